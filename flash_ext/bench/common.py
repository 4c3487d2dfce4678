"""Shared pieces of the benchmark modes: problem sizes and FLOP counts, the correctness guard, timing,
machine metadata (commit, CPU model, threads, load) and table formatting."""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext

#: SDPA backends, in the order they are reported.
SDPA_BACKENDS: Dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


DTYPES: Dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


DTYPE_NAMES: Dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


#: Loose (absolute, relative) tolerance of the correctness guard, against an fp32 reference.
GUARD_TOL: Dict[torch.dtype, Tuple[float, float]] = {
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
    torch.float32: (1e-3, 1e-3),
}


HEADLINE = dict(batch=1, seqlen=2048, nheads=8, head_dim=64, causal=False, dtype=torch.bfloat16)


MiB = float(1 << 20)


def attention_flops(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, head_dim: int, causal: bool) -> float:
    """FLOPs of a forward pass: ``4 * b * sq * sk * h * d`` (Q.K^T and P.V), halved for causal."""
    flops = 4.0 * batch * seqlen_q * seqlen_k * nheads * head_dim
    return flops / 2 if causal else flops


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Textbook attention that materialises S and P, in the input dtype.

    q ``(b, sq, h, d)``, k/v ``(b, sk, hk, d)``; returns ``(b, sq, h, d)`` (a transposed view).  S is
    scaled in place and freed before ``P @ V``, so the peak is about two ``(b, h, sq, sk)`` matrices (S and
    P) plus the output; causal adds a ``(sq, sk)`` boolean mask (bottom-right aligned).
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = (d ** -0.5) if softmax_scale is None else softmax_scale
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=2)
        v = v.repeat_interleave(h // hk, dim=2)
    s = torch.matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2))
    s.mul_(scale)
    if causal:
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu_(sk - sq + 1)
        s.masked_fill_(hidden, float("-inf"))
        del hidden
    p = torch.softmax(s, dim=-1)
    del s
    return torch.matmul(p, v.transpose(1, 2)).transpose(1, 2)


def check_against_sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            causal: bool, max_rows: int = 256) -> Tuple[bool, float, float]:
    """Compares ``out`` (flash_ext, ``(b, sq, h, d)``) with SDPA's MATH backend in fp32.

    Only up to ``max_rows`` evenly spaced query rows (always the first and the last) are checked, each
    against all keys, which keeps the reference small at long sequence lengths.  The causal mask is built
    explicitly, bottom-right aligned as in flash_ext.  Returns ``(ok, max_abs_err, atol)``; ``ok`` needs
    finite output and ``|out - ref| <= atol + rtol * |ref|`` everywhere.
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    rows = torch.linspace(0, sq - 1, steps=min(sq, max_rows), device=q.device).round().long().unique()
    qs = q[:, rows].float().transpose(1, 2)
    kf = k.float().repeat_interleave(h // hk, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(h // hk, dim=2).transpose(1, 2)
    mask = None
    if causal:
        cols = torch.arange(sk, device=q.device)
        mask = cols.view(1, -1) <= (rows.view(-1, 1) + (sk - sq))
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(qs, kf, vf, attn_mask=mask, scale=d ** -0.5)
    got = out[:, rows].float().transpose(1, 2)
    atol, rtol = GUARD_TOL[q.dtype]
    err = (got - ref).abs()
    max_err = float(err.max()) if err.numel() else 0.0
    ok = bool(torch.isfinite(got).all()) and bool((err <= atol + rtol * ref.abs()).all())
    return ok, max_err, atol


def time_fn(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int,
            cpu_times: Optional[List[float]] = None) -> List[float]:
    """Seconds per call of ``fn`` for ``repeats`` calls after ``warmup`` calls.

    CUDA: a pair of CUDA events around each call.  CPU: ``time.perf_counter`` around each call; when
    ``cpu_times`` is given, the process CPU time (``time.process_time``, all threads) of each call is
    appended to it.  On a loaded machine the CPU time is the steadier measure of the work a call does.
    """
    for _ in range(warmup):
        fn()
    times: List[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            c0 = time.process_time()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if cpu_times is not None:
                cpu_times.append(time.process_time() - c0)
    return times


def matmul_peak_tflops(device: torch.device, dtypes: Sequence[torch.dtype], warmup: int, repeats: int,
                       n: int = 2048, budget_s: float = 0.5) -> Dict[str, float]:
    """TFLOP/s of ``torch.matmul`` on square operands in each dtype, measured in this run: the machine's own
    dense-GEMM rate, the ceiling an attention kernel (two GEMMs plus a softmax) can approach.  The largest
    is the reference peak (on CPUs without a native bf16 path the fp32 matmul is the faster).

    The size is ``n`` unless one call of that size would take longer than ``budget_s`` (a dtype without a
    native path on this CPU: bf16 on AVX2 took 134 s at 2048^3): then the largest multiple of 256 that fits,
    estimated from a 256^3 probe.  The key names the size used when it is not ``n`` ("bf16@512")."""
    out: Dict[str, float] = {}
    for dtype in dtypes:
        size = n
        if device.type == "cpu":
            p = torch.randn(256, 256, device=device).to(dtype)
            probe = min(time_fn(lambda: torch.matmul(p, p), device, 1, 3))
            fits = int(256 * (budget_s / max(probe, 1e-9)) ** (1.0 / 3.0)) // 256 * 256
            size = max(256, min(n, fits))
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        times = time_fn(lambda: torch.matmul(a, b), device, warmup, repeats)
        key = DTYPE_NAMES[dtype] + ("" if size == n else f"@{size}")
        out[key] = 2.0 * size ** 3 / statistics.median(times) / 1e12
    return out


def repeats_for(fn: Callable[[], Any], device: torch.device, requested: Optional[int], default: int,
                min_seconds: float, cap: int = 5000) -> int:
    """Timed calls for ``fn``: ``requested`` when the user gave one; else enough calls to fill ``min_seconds``
    (estimated from the faster of two calls, timed after the caller's warm-up), at least ``default`` and at
    most ``cap``.
    A short call (a decode step: tens to hundreds of microseconds) timed only ``default`` times is a median of
    a few milliseconds, which one of a VM's slow moments decides."""
    if requested is not None:
        return requested
    one = min(time_fn(fn, device, 0, 2))
    return int(min(cap, max(default, math.ceil(min_seconds / max(one, 1e-7)))))


def read_bandwidth_gbs(src: torch.Tensor, warmup: int, repeats: int) -> float:
    """Memory read bandwidth measured in this run: bytes of ``src`` (a large tensor, kept by the caller so
    that each measurement reads the same memory) read by ``src.sum()`` per second (the write is one scalar).
    A memory-bound decode step reads K and V once; this is its ceiling."""
    times = time_fn(lambda: src.sum(), src.device, warmup, repeats)
    return src.numel() * src.element_size() / statistics.median(times) / 1e9


def short_error(exc: BaseException) -> str:
    """One line for a table note: the exception's type and message, its lines joined (an op's refusal is a
    header line, "flash_ext.fwd: 1 invalid argument:", then one line per reason; the reasons are the point)."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    text = text or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def free_device_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def mem_available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_commit() -> str:
    """Short commit of the checkout (``+dirty`` if it has changes), or ``uncommitted`` / ``unknown``."""
    root = _repo_root()
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            inside = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=root, capture_output=True,
                                    text=True, timeout=10)
            return "uncommitted" if inside.returncode == 0 else "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (falls back to ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({os.cpu_count()} logical CPUs)"


def loadavg() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_isa_flags() -> List[str]:
    """The vector-ISA flags /proc/cpuinfo reports (avx*, fma, f16c, amx*), for the record of a CPU figure."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(x for x in line.split(":", 1)[1].split()
                                  if x.startswith(("avx", "amx")) or x in ("fma", "f16c"))
    except OSError:
        pass
    return []


def metadata(device: torch.device, mode: str, args: argparse.Namespace) -> Dict[str, Any]:
    meta: Dict[str, Any] = {
        "mode": mode,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "device": str(device),
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "flash_ext_version": getattr(flash_ext, "__version__", "unknown"),
        "flash_ext_build": flash_ext.build_info(),
        "python": platform.python_version(),
        "num_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # The instruction-set level of flash_ext's CPU micro-kernels (chosen at run time, or FLASH_EXT_CPU_ISA).
        "flash_ext_cpu_isa": flash_ext.build_info().get("cpu_isa"),
        "cpu_flags": cpu_isa_flags(),
        "loadavg_start": loadavg(),
        "argv": sys.argv[1:],
    }
    return meta


def default_device() -> torch.device:
    """CUDA if a GPU is visible and this build has CUDA kernels, else the CPU."""
    if torch.cuda.is_available() and flash_ext.build_info().get("cuda", False):
        return torch.device("cuda")
    return torch.device("cpu")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([line, sep, *body])


def fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}"


@dataclass
class ImplResult:
    """Timing of one implementation on one configuration."""

    status: str = "ok"  # ok | skip | OOM | ERR | FAIL
    note: str = ""
    median_s: Optional[float] = None
    min_s: Optional[float] = None
    times_s: List[float] = field(default_factory=list)
    tflops: Optional[float] = None
    cpu_median_s: Optional[float] = None  # CPU device only: median process CPU time per call


def time_impl(fn: Callable[[], Any], device: torch.device, flops: float, warmup: int,
               repeats: int) -> ImplResult:
    cpu_times: List[float] = []
    try:
        times = time_fn(fn, device, warmup, repeats, cpu_times)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        free_device_memory(device)
        return ImplResult(status="OOM" if is_oom(exc) else "ERR", note=short_error(exc))
    med = statistics.median(times)
    return ImplResult(median_s=med, min_s=min(times), times_s=times, tflops=flops / med / 1e12,
                      cpu_median_s=statistics.median(cpu_times) if cpu_times else None)


def cpu_would_exhaust_ram(nbytes: float) -> bool:
    avail = mem_available_bytes()
    return avail is not None and nbytes > 0.7 * avail
