"""Random flash_attn-style calls against the float64 reference, for a while: a search for the cases the
test grids do not name.

    python scripts/fuzz_reference.py [--seed N] [--seconds S] [--device cpu|cuda] [--max-head-dim D]

Each case draws a batch, lengths (1-511, across tile edges), heads with a GQA ratio, a head dim (odd ones
included; at most --max-head-dim, by default the largest this build compiles for the device), fp16 or bf16,
causal, a local window, softcap, ALiBi and a softmax scale, then runs one of: the forward
(``flash_attn_func``, out and LSE), the forward and backward (dq, dk, dv), the varlen forward (packed
sequences, one check per sequence), or ``flash_attn_with_kvcache`` (a cache with per-sequence lengths, new
keys appended in place, the cache checked too).  Every result must pass the suite's own rules
(``tests/attn_check.py``, ``tests/grad_check.py``: at most 2-3x the same-dtype reference's error, exact
zeros and +inf LSE on rows that see no key).  Failures are printed with the case's parameters; the exit
status is the number of failures (capped at 100).

Explicit softmax scales are at most 0.3 (the default, 1/sqrt(d), is larger below head dim 12): at larger
scales a row's softmax is nearly one-hot and the backward's D = rowsum(dO * O), taken from O in its dtype as
FA2 takes it, dominates dq/dk's error; see docs/design.md, "Numerical stability".  Not part of the test suite: it has no fixed outcome to assert beyond "no failure",
and its run time is whatever --seconds says.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
import torch

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(_ROOT, "tests"))
sys.path.append(_ROOT)  # an in-place build, where the package is not installed
import flash_ext  # noqa: E402
from attn_check import check_close  # noqa: E402
from grad_check import check_grads  # noqa: E402

HEAD_DIMS = [1, 3, 8, 16, 24, 32, 40, 48, 56, 59, 64, 72, 80, 96, 100, 111, 127, 128, 160, 192, 200, 224, 256]


def built_max_head_dim(device: str) -> int:
    """The largest head dim this build runs on `device` (build_info's head-dim lists)."""
    info = flash_ext.build_info()
    dims = info.get("host_head_dims" if device == "cpu" else "gpu_head_dims") or [256]
    return max(dims)


def draw(rng: random.Random, max_d: int) -> dict:
    """One case's parameters."""
    hk = rng.choice([1, 2, 3])
    ws = (-1, -1)
    if rng.random() < 0.3:
        ws = (rng.choice([-1, 0, 1, 5, 40, 300]), rng.choice([-1, 0, 2, 17, 500]))
    return dict(mode=rng.choice(["fwd", "fwd", "bwd", "varlen", "kvcache"]), b=rng.choice([1, 1, 2, 3]),
                sq=rng.choice([1, 2, 3, 7, 16, 17, 31, 64, 65, 113, 128, 129, 200, 257]),
                sk=rng.choice([1, 2, 5, 16, 33, 64, 100, 128, 129, 255, 256, 300, 511]),
                h=hk * rng.choice([1, 2, 3, 4]), hk=hk, d=rng.choice([x for x in HEAD_DIMS if x <= max_d]),
                dtype=rng.choice([torch.float16, torch.bfloat16]), causal=rng.random() < 0.4, window_size=ws,
                softcap=rng.choice([0.0, 0.0, 0.0, 5.0, 30.0]), alibi=rng.random() < 0.25,
                softmax_scale=rng.choice([None, None, 0.05, 0.3]), seed=rng.randrange(1 << 30),
                lens_seed=rng.randrange(1 << 30))


def run(case: dict, device: str) -> None:
    """Runs one case; raises on a failed check."""
    torch.manual_seed(case["seed"])
    lrng = random.Random(case["lens_seed"])
    mode, b, sq, sk, h, hk, d = (case[k] for k in ("mode", "b", "sq", "sk", "h", "hk", "d"))
    ctx = str(case)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(dtype=case["dtype"], device=device)

    al = torch.rand(b, h, device=device) * 0.3 if case["alibi"] else None
    kw = dict(softmax_scale=case["softmax_scale"], causal=case["causal"], window_size=case["window_size"],
              softcap=case["softcap"], alibi_slopes=al)
    if mode in ("fwd", "bwd"):
        q, k, v = randn(b, sq, h, d), randn(b, sk, hk, d), randn(b, sk, hk, d)
        if mode == "fwd":
            out, lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
            check_close(out, lse, q, k, v, context=ctx, **kw)
        else:
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            out = flash_ext.flash_attn_func(qq, kk, vv, **kw)
            dout = torch.randn_like(out)
            out.backward(dout)
            check_close(out, None, q, k, v, context=ctx, **kw)
            check_grads((qq.grad, kk.grad, vv.grad), q, k, v, dout, context=ctx, **kw)
    elif mode == "varlen":
        lq = [lrng.randint(1, sq) for _ in range(b)]
        lk = [lrng.randint(1, sk) for _ in range(b)]
        qs, ks, vs = [randn(n, h, d) for n in lq], [randn(n, hk, d) for n in lk], [randn(n, hk, d) for n in lk]
        cq = torch.tensor([0] + lq, device=device).cumsum(0).to(torch.int32)
        ck = torch.tensor([0] + lk, device=device).cumsum(0).to(torch.int32)
        out, lse, _ = flash_ext.flash_attn_varlen_func(torch.cat(qs), torch.cat(ks), torch.cat(vs), cq, ck, max(lq),
                                                       max(lk), return_attn_probs=True, **kw)
        for j in range(b):
            kwj = dict(kw, alibi_slopes=None if al is None else al[j:j + 1])
            rows = slice(int(cq[j]), int(cq[j + 1]))
            check_close(out[rows].unsqueeze(0), lse[:, rows].unsqueeze(0), qs[j].unsqueeze(0), ks[j].unsqueeze(0),
                        vs[j].unsqueeze(0), context=f"{ctx}, sequence {j}", **kwj)
    else:  # kvcache: at most 8 new query rows, a cache 8 longer than sk, new keys appended in place
        sq = min(sq, 8)
        kc, vc = randn(b, sk + 8, hk, d), randn(b, sk + 8, hk, d)
        q = randn(b, sq, h, d)
        lens = [lrng.randint(0, sk) for _ in range(b)]
        nk = lrng.choice([0, 0, 1, sq])
        knew, vnew = (randn(b, nk, hk, d), randn(b, nk, hk, d)) if nk else (None, None)
        kc0, vc0 = kc.clone(), vc.clone()
        out, lse = flash_ext.flash_attn_with_kvcache(
            q, kc, vc, k=knew, v=vnew, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
            return_softmax_lse=True, **kw)
        for j in range(b):
            n = lens[j] + nk
            kj, vj = kc0[j, :lens[j]], vc0[j, :lens[j]]
            if nk:
                kj, vj = torch.cat([kj, knew[j]]), torch.cat([vj, vnew[j]])
            assert torch.equal(kc[j, :n], kj) and torch.equal(vc[j, :n], vj), f"{ctx}: cache {j} after the append"
            if n == 0:
                assert (out[j] == 0).all(), f"{ctx}: an empty cache's output must be 0"
                continue
            kwj = dict(kw, alibi_slopes=None if al is None else al[j:j + 1])
            check_close(out[j:j + 1], lse[j:j + 1], q[j:j + 1], kj.unsqueeze(0), vj.unsqueeze(0),
                        context=f"{ctx}, sequence {j}", **kwj)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--max-head-dim", type=int, default=None)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    max_d = args.max_head_dim or built_max_head_dim(args.device)
    t0, passed, failed = time.time(), 0, 0
    while time.time() - t0 < args.seconds:
        case = draw(rng, max_d)
        try:
            run(case, args.device)
            passed += 1
        except Exception as e:  # a failed check, or an error the call should not have raised
            failed += 1
            print(f"FAIL {case}: {type(e).__name__}: {' / '.join(str(e).splitlines())[:500]}", flush=True)
    print(f"seed {args.seed}: {passed} passed, {failed} failed in {time.time() - t0:.0f} s (max head dim {max_d})")
    return min(failed, 100)


if __name__ == "__main__":
    sys.exit(main())
