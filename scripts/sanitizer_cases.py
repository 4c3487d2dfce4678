#!/usr/bin/env python3
"""Small CUDA calls covering every kernel variant and boundary path, forward and backward, for
compute-sanitizer.

Each case runs once and is checked against the float64 reference so that a sanitizer run also proves the
results.  ``--quick`` runs a smaller subset (racecheck is slow).
"""
from __future__ import annotations

import argparse
import sys

import torch

import flash_ext
from flash_ext.reference import attention_grad_ref, attention_ref


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


def kvcache_case(device: str) -> float:
    """Paged decode with an append and forced split-KV (paged addressing, the combine kernel, the append op);
    returns the max error against the reference on each entry's gathered keys."""
    b, h, hk, d, page = 2, 8, 2, 128, 256
    k_pages = torch.randn(6, page, hk, d, device=device, dtype=torch.bfloat16)
    v_pages = torch.randn_like(k_pages)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([300, 513], dtype=torch.int32, device=device)
    q = torch.randn(b, 1, h, d, device=device, dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(b, 1, hk, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    out = flash_ext.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=seqlens,
                                            block_table=table, causal=True, num_splits=4)
    if device == "cuda":
        torch.cuda.synchronize()
    err = 0.0
    for i in range(b):
        n = int(seqlens[i]) + 1
        keys = k_pages[table[i].long()].reshape(-1, hk, d)[:n][None]
        vals = v_pages[table[i].long()].reshape(-1, hk, d)[:n][None]
        ref, _ = attention_ref(q[i:i + 1], keys, vals, causal=True)
        err = max(err, (out[i:i + 1].double() - ref).abs().max().item())
    return err


def varlen_case(device: str) -> float:
    """Three sequences (one empty), causal, GQA: per-sequence offsets and the empty-sequence early exit;
    then the same keys as pages (block_table), which must reproduce the packed result exactly."""
    lens_q, lens_k = [70, 0, 129], [33, 5, 300]
    cu_q = torch.tensor([0, 70, 70, 199], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 33, 38, 338], dtype=torch.int32, device=device)
    q = torch.randn(199, 4, 64, device=device, dtype=torch.bfloat16)
    k = torch.randn(338, 2, 64, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = flash_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    # The same keys in pages of 128 rows (sequence i in pages 3i, 3i + 1, 3i + 2): must give the same bits.
    table = torch.arange(9, dtype=torch.int32, device=device).reshape(3, 3)
    k_pages = torch.zeros(9, 128, 2, 64, device=device, dtype=torch.bfloat16)
    v_pages = torch.zeros_like(k_pages)
    for i in range(3):
        n = lens_k[i]
        k_pages.view(3, 384, 2, 64)[i, :n] = k[cu_k[i]:cu_k[i + 1]]
        v_pages.view(3, 384, 2, 64)[i, :n] = v[cu_k[i]:cu_k[i + 1]]
    out_paged = flash_ext.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lens_q), max(lens_k),
                                                 causal=True, block_table=table)
    if device == "cuda":
        torch.cuda.synchronize()
    if not torch.equal(out_paged, out):
        return float("inf")
    err = 0.0
    for i in range(3):
        if lens_q[i] == 0:
            continue
        qs, ks, vs = (t[c[i]:c[i + 1]][None] for t, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        ref, _ = attention_ref(qs, ks, vs, causal=True)
        err = max(err, (out[cu_q[i]:cu_q[i + 1]][None].double() - ref).abs().max().item())
    return err


def dropout_case(device: str) -> float:
    """The dropout kernel (uneven shapes, GQA, causal, forced split-KV) and the mask kernel: the output with an
    explicit rng_state against the reference with the mask op's mask."""
    b, sq, sk, h, hk, d, p = 2, 77, 131, 4, 2, 64, 0.3
    q = torch.randn(b, sq, h, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    rs = torch.tensor([1234, 8], dtype=torch.int64, device=device)
    err = 0.0
    for splits in (1, 3):
        out, _, rs_out = torch.ops.flash_ext.fwd(q, k, v, d ** -0.5, True, -1, -1, 0.0, None, splits, p, rs)
        mask = torch.ops.flash_ext.dropout_mask(rs, p, b, h, sq, sk)
        if device == "cuda":
            torch.cuda.synchronize()
        if not torch.equal(rs_out, rs):
            return float("inf")
        ref, _ = attention_ref(q, k, v, causal=True, dropout_p=p, dropout_mask=mask)
        err = max(err, (out.double() - ref).abs().max().item())
    return err


def backward_case(device: str, b, sq, sk, h, hk, d, kw, deterministic: bool = False) -> float:
    """Forward + backward (preprocess, the main kernel with its atomic or deterministic dQ accumulation,
    postprocess); returns the largest gradient error relative to the float64 gradient's magnitude."""
    q, k, v = (torch.randn(b, s, n, d, device=device, dtype=torch.bfloat16).requires_grad_()
               for s, n in ((sq, h), (sk, hk), (sk, hk)))
    dout = torch.randn(b, sq, h, d, device=device, dtype=torch.bfloat16)
    ref_kw = {n: (t.cpu() if torch.is_tensor(t) else t) for n, t in kw.items()}
    if kw.get("dropout_p", 0) > 0:  # the dropout backward: the reference gets the mask recovered from S_dmask
        out, _, s_dmask = flash_ext.flash_attn_func(q, k, v, deterministic=deterministic, return_attn_probs=True,
                                                    **kw)
        ref_kw["dropout_mask"] = (s_dmask.detach() >= 0).cpu()
    else:
        out = flash_ext.flash_attn_func(q, k, v, deterministic=deterministic, **kw)
    out.backward(dout)
    if device == "cuda":
        torch.cuda.synchronize()
    ref = attention_grad_ref(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), dout.cpu(), **ref_kw)
    err = 0.0
    for g, r in zip((q.grad, k.grad, v.grad), ref):
        if g.isnan().any().item():
            return float("inf")
        err = max(err, (g.cpu().double() - r).abs().max().item() / max(r.abs().max().item(), 1e-30))
    return err


def built(device: str, head_dim: int, backward: bool = False) -> bool:
    """Whether this build has a kernel for head_dim (the smallest compiled head dim >= it runs the problem)."""
    info = flash_ext.build_info()
    key = "host_head_dims" if device == "cpu" else ("gpu_bwd_head_dims" if backward else "gpu_head_dims")
    return any((head_dim + 7) // 8 * 8 <= hd for hd in info[key])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script's own logic")
    args = ap.parse_args()
    device = args.device
    flash_ext._C.set_poison_outputs(True)
    torch.manual_seed(0)
    failures = 0
    skipped = 0
    for b, sq, sk, h, hk, d, kw in cases(args.quick):
        if not built(device, d):
            skipped += 1
            print(f"skip b{b} sq{sq} sk{sk} h{h}/{hk} d{d} {kw}: head dim not compiled in this build")
            continue
        q = torch.randn(b, sq, h, d, device=device, dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device=device, dtype=torch.bfloat16)
        v = torch.randn(b, sk, hk, d, device=device, dtype=torch.bfloat16)
        if "alibi_slopes" in kw:
            kw = dict(kw, alibi_slopes=kw["alibi_slopes"].to(device))
        out, lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        ref, _ = attention_ref(q, k, v, **kw)
        err = (out.double() - ref).abs().max().item()
        ok = err < 3e-2 and not out.isnan().any().item() and not lse.isnan().any().item()
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} b{b} sq{sq} sk{sk} h{h}/{hk} d{d} {kw}: max err {err:.2e}")
    # The dropout kernel is a variant of its own (the others contain no RNG code): racecheck sees it too.
    extra = [("dropout, split-KV, mask kernel", dropout_case)]
    # The backward: even, general and dropout variants, GQA group loop, causal, empty query rows and key tiles,
    # atomic and deterministic dQ.
    bwd_cases = [(1, 128, 128, 2, 2, 64, {}, False), (1, 77, 131, 4, 2, 40, {"causal": True}, True),
                 (1, 90, 110, 4, 2, 64, {"causal": True, "dropout_p": 0.3}, False)]
    if not args.quick:
        bwd_cases += [(1, 300, 100, 2, 1, 128, {"causal": True}, False),
                      (1, 100, 300, 2, 2, 96, {"window_size": (17, 5), "softcap": 5.0}, False),
                      (2, 65, 190, 2, 2, 128, {"alibi_slopes": torch.tensor([0.5, 0.25])}, True)]
    for b, sq, sk, h, hk, d, kw, det in bwd_cases:
        if not built(device, d, backward=True):
            skipped += 1
            print(f"skip backward b{b} sq{sq} sk{sk} h{h}/{hk} d{d} {kw}: head dim not compiled in this build")
            continue
        if "alibi_slopes" in kw:
            kw = dict(kw, alibi_slopes=kw["alibi_slopes"].to(device))
        err = backward_case(device, b, sq, sk, h, hk, d, kw, det)
        ok = err < 3e-2
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} backward b{b} sq{sq} sk{sk} h{h}/{hk} d{d} {kw} deterministic={det}: "
              f"max rel err {err:.2e}")
    if not args.quick:
        extra = [("paged KV-cache decode, split-KV", kvcache_case), ("varlen", varlen_case)] + extra
    for name, case in extra:
        err = case(device)
        ok = err < 3e-2
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: max err {err:.2e}")
    print(f"{failures} failures, {skipped} cases skipped (head dims this build lacks)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
