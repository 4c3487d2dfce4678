"""A short tour of flash_ext: ``python -m flash_ext.demo``.

1. Runs ``flash_ext.flash_attn_func`` on a few shapes (causal with a ragged seqlen, grouped-query
   attention, an odd head dim with ``seqlen_q < seqlen_k``, fp16 multi-query) and compares each output
   with a reference, printing the max error and the tolerance.

   Reference: ``flash_ext.reference.attention_ref``, with the rule of the test suite: the error
   of flash_ext against the float64 reference may be at most twice the error of the same computation
   done naively in the input dtype, plus a floor of about one output ulp (bf16 2e-3, fp16 2.5e-4,
   fp32 1e-5); the output must also be free of NaN.

2. Prints the peak extra memory (beyond the inputs, output included) of one naive forward call and of
   one flash_ext call at a few sequence lengths (see ``flash_ext.bench`` for how it is measured).  The
   naive implementation's peak grows with ``seqlen**2`` (it stores the score matrix), flash_ext's with
   ``seqlen`` (just the output and the log-sum-exp).

Runs on CUDA when a GPU is visible and the build has CUDA kernels, otherwise on the CPU, where it takes
well under a minute on two cores.  ``--device`` overrides.  Exit status 1 if a correctness check fails.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

import flash_ext
from flash_ext.bench.common import DTYPE_NAMES, MiB, default_device, device_name, naive_attention, short_error
from flash_ext.bench.memory import memory_point, memory_table
from flash_ext.reference import attention_ref

OUT_FLOOR = {torch.float16: 2.5e-4, torch.bfloat16: 2e-3, torch.float32: 1e-5}


@dataclass(frozen=True)
class Case:
    """One correctness case: q ``(batch, seqlen_q, nheads, head_dim)``, k/v ``(batch, seqlen_k, nheads_k, head_dim)``."""

    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    causal: bool
    dtype: torch.dtype


CASES: Tuple[Case, ...] = (
    Case("causal, seqlen 257 (not a tile multiple)", 2, 257, 257, 4, 4, 64, True, torch.bfloat16),
    Case("GQA: 8 query heads share 2 K/V heads", 1, 300, 300, 8, 2, 128, False, torch.bfloat16),
    Case("odd head dim 59, causal, seqlen_q < seqlen_k", 1, 100, 333, 3, 3, 59, True, torch.bfloat16),
    Case("fp16 MQA (1 K/V head), head dim 96, causal", 2, 190, 190, 6, 1, 96, True, torch.float16),
)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(ref_float64, ref_same_dtype)``: flash_ext.reference.attention_ref upcast and in the inputs' dtype."""
    ref64 = attention_ref(q, k, v, causal=causal, upcast=True)[0]
    ref_same = attention_ref(q, k, v, causal=causal, upcast=False)[0]
    return ref64, ref_same


def missing_kernel(device: torch.device, head_dim: int) -> Optional[str]:
    """Why this build cannot run ``head_dim`` on ``device`` (a build made with a restricted
    ``FLASH_EXT_HOST_HEADDIMS`` / ``FLASH_EXT_HEADDIMS``), or None when it can: a case it cannot run
    is a property of the build, not a wrong result, so the demo skips it instead of failing."""
    info = flash_ext.build_info()
    compiled, var = ((info["gpu_head_dims"], "FLASH_EXT_HEADDIMS") if device.type == "cuda"
                     else (info["host_head_dims"], "FLASH_EXT_HOST_HEADDIMS"))
    if any(h >= head_dim for h in compiled):
        return None
    return (f"this build has no {device.type} kernel for head dim {head_dim} (compiled: {list(compiled)}; "
            f"build with {var} including a head dim >= {head_dim})")


def run_checks(device: torch.device) -> bool:
    """Runs every case the build has kernels for; prints one line each; returns True when all of them
    pass and at least one ran."""
    print("Correctness against flash_ext.reference.attention_ref")
    print("  rule: max|out - ref64| <= 2 * max|ref_same_dtype - ref64| + floor, and no NaN")
    gen = torch.Generator(device="cpu").manual_seed(0)
    all_ok, ran = True, 0
    for c in CASES:
        q = torch.randn(c.batch, c.seqlen_q, c.nheads, c.head_dim, generator=gen).to(device, c.dtype)
        k = torch.randn(c.batch, c.seqlen_k, c.nheads_k, c.head_dim, generator=gen).to(device, c.dtype)
        v = torch.randn(c.batch, c.seqlen_k, c.nheads_k, c.head_dim, generator=gen).to(device, c.dtype)
        shape = (f"q {tuple(q.shape)} k/v {tuple(k.shape)} {DTYPE_NAMES[c.dtype]}"
                 f"{' causal' if c.causal else ''}")
        reason = missing_kernel(device, c.head_dim)
        if reason is not None:
            print(f"  skip  {c.name}: {shape}: {reason}")
            continue
        ran += 1
        try:
            out = flash_ext.flash_attn_func(q, k, v, causal=c.causal)
            ref64, ref_same = _reference(q, k, v, c.causal)
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            print(f"  FAIL  {c.name}: {shape}: raised {short_error(exc)}")
            all_ok = False
            continue
        err = (out.double() - ref64.double()).abs().max().item()
        tol = 2 * (ref_same.double() - ref64.double()).abs().max().item() + OUT_FLOOR[c.dtype]
        ok = bool(torch.isfinite(out).all()) and err <= tol
        all_ok &= ok
        print(f"  {'ok  ' if ok else 'FAIL'}  {c.name}: {shape}: max err {err:.2e} (tolerance {tol:.2e})")
    if not ran:
        print("  FAIL  no case ran: this build has no kernel for any of the demo's head dims")
    return all_ok and ran > 0


def run_memory(device: torch.device, seqlens: Sequence[int], nheads: int, head_dim: int) -> None:
    """Prints the peak extra memory of naive attention and flash_ext at each seqlen."""
    dtype = torch.bfloat16
    how = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
           else "peak RSS during the call (VmHWM reset through /proc/self/clear_refs)")
    print(f"\nPeak extra memory of one forward call, batch 1, {nheads} heads, head dim {head_dim}, bf16 "
          f"(measured: {how})")
    w = torch.randn(1, 64, 2, 64, device=device, dtype=dtype)  # warm both paths up (thread pools etc.)
    naive_attention(w, w, w)
    flash_ext.flash_attn_func(w, w, w)
    rows = []
    for s in seqlens:
        rows.append(memory_point(1, s, nheads, head_dim, False, dtype, device, cross_check=False))
    print(memory_table(rows, device))
    key = "cuda_alloc" if device.type == "cuda" else "rss"
    for r in rows:
        n, f = r.naive.get(key), r.flash_ext.get(key)
        if n is not None and f:
            print(f"  seqlen {r.seqlen:>6}: naive {n / MiB:9.1f} MiB   flash_ext {f / MiB:7.2f} MiB   "
                  f"({n / f:.0f}x less)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flash_ext.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda if a GPU is visible and the build has CUDA kernels, else cpu")
    p.add_argument("--seqlens", type=int, nargs="+", default=None,
                   help="memory section seqlens (default: CPU 1024 2048 4096 8192; CUDA up to 16384)")
    p.add_argument("--nheads", type=int, default=None, help="memory section heads (default: CPU 4, CUDA 16)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory section")
    args = p.parse_args(argv)
    device = torch.device(args.device) if args.device else default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(f"flash_ext {flash_ext.__version__} on {device_name(device)}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; build: {flash_ext.build_info()}\n")
    ok = run_checks(device)
    memory_skip = missing_kernel(device, 64)
    if not args.no_memory and memory_skip is not None:
        print(f"\nPeak extra memory section skipped: {memory_skip}")
    elif not args.no_memory:
        cuda = device.type == "cuda"
        seqlens = args.seqlens or ([1024, 2048, 4096, 8192, 16384] if cuda else [1024, 2048, 4096, 8192])
        run_memory(device, seqlens, args.nheads or (16 if cuda else 4), 64)
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'} ({time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
