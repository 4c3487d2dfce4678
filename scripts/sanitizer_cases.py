#!/usr/bin/env python3
"""Small CUDA calls covering every kernel variant and boundary path, for compute-sanitizer.

Each case runs once and is checked against the float64 reference so that a sanitizer run also proves the
results.  ``--quick`` runs a smaller subset (racecheck is slow).
"""
from __future__ import annotations

import argparse
import sys

import torch

import flash_ext
from flash_ext.reference import attention_ref


def cases(quick: bool):
    # (b, sq, sk, h, hk, d, kwargs)
    yield 1, 128, 128, 2, 2, 64, {}                                   # even variant
    yield 1, 77, 131, 4, 2, 40, {"causal": True}                      # uneven variant, GQA, padded d
    yield 1, 200, 333, 2, 1, 128, {"window_size": (17, 5)}            # general: local
    if quick:
        return
    yield 2, 65, 190, 2, 2, 128, {"softcap": 30.0, "alibi_slopes": torch.tensor([0.5, 0.25])}
    yield 1, 300, 100, 2, 2, 64, {"causal": True}                     # sq > sk: empty rows, early exit
    yield 1, 1, 1000, 8, 1, 128, {}                                    # decode-like
    yield 1, 513, 1025, 2, 2, 96, {"causal": True}                    # next-larger head dim tile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.ops.flash_ext._set_poison_outputs(True)
    torch.manual_seed(0)
    failures = 0
    for b, sq, sk, h, hk, d, kw in cases(args.quick):
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        if "alibi_slopes" in kw:
            kw = dict(kw, alibi_slopes=kw["alibi_slopes"].cuda())
        out, lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        torch.cuda.synchronize()
        ref, _ = attention_ref(q, k, v, **kw)
        err = (out.double() - ref).abs().max().item()
        ok = err < 3e-2 and not out.isnan().any().item() and not lse.isnan().any().item()
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} b{b} sq{sq} sk{sk} h{h}/{hk} d{d} {kw}: max err {err:.2e}")
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
