"""Benchmarks for flash_ext: forward throughput and peak memory.

Run ``python -m flash_ext.bench --help`` for every option.  Two modes:

``fwd`` (default)
    Forward throughput in TFLOP/s of ``flash_ext.flash_attn_func`` against
    ``torch.nn.functional.scaled_dot_product_attention`` with each backend forced in turn
    (``sdpa_kernel(SDPBackend.X)`` for FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION, MATH; a
    backend that raises for the device/dtype/shape is skipped with a note) and a naive implementation
    that materialises the score matrix (``matmul``, ``softmax``, ``matmul``).

    FLOPs per call: ``4 * batch * seqlen_q * seqlen_k * nheads * head_dim`` (two matmuls), halved for
    causal.  The score matrix is square (``seqlen_q == seqlen_k``) in every configuration.

    Before a configuration is timed, flash_ext's output is compared with SDPA's MATH backend run in fp32
    on the same (rounded) inputs, over up to 256 evenly spaced query rows against all keys; a row that
    does not match within a loose tolerance (bf16 3e-2, fp16 5e-3, fp32 1e-3; absolute plus relative) is
    marked FAIL and no flash_ext speed is reported for it.

    Timing: CUDA events around each call after ``--warmup`` calls, median of ``--repeats``; on the CPU
    ``time.perf_counter`` around each call, median of ``--repeats``; the process CPU time of each call
    is recorded too (column ``x best (cpu time)``: the ratio from CPU time, steadier than wall time when
    other processes share the cores).  The number of CPU threads is torch's default (printed and
    recorded; ``--threads`` changes it).  Every implementation gets the same inputs; SDPA gets them in
    its native ``(batch, nheads, seqlen, head_dim)`` contiguous layout (``--sdpa-layout bhsd``, the
    layout most favourable to SDPA) and flash_ext in its native ``(batch, seqlen, nheads, head_dim)``.

    Default grid on CUDA (after the FlashAttention-2 paper): bf16, head_dim 64 and 128, hidden size
    ``nheads * head_dim = 2048`` (so 32 heads at d=64, 16 heads at d=128; override with ``--nheads``),
    seqlen 512 .. 16k with ``batch * seqlen = 16384`` tokens, causal and not.
    Default grid on the CPU: bf16, batch 1, 8 heads, seqlen 512, 1024, 2048, head_dim 64 and 128, causal
    and not; it contains the headline case (batch 1, 8 heads, seqlen 2048, head_dim 64, non-causal).

``memory``
    Peak *extra* memory of one forward call (beyond its inputs; the output is included) against seqlen,
    for the naive implementation and for flash_ext.

    * CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus
      ``memory_allocated()`` before the call.
    * CPU, method ``rss`` (primary): the kernel's peak resident set size.  The peak (``VmHWM``) is reset
      to the current RSS by writing ``5`` to ``/proc/self/clear_refs``, the call runs, and
      ``VmHWM - VmRSS(before)`` is the peak extra memory.  This sees every allocation, torch's or not.
      So that freed memory really leaves the RSS, glibc is told to serve every block >= 128 KiB by
      ``mmap`` (``mallopt(M_MMAP_THRESHOLD)``) and ``malloc_trim(0)`` runs before each point; the mode
      therefore changes this process's allocator behaviour and does no timing.
    * CPU, method ``alloc`` (cross-check): the running sum of the allocation/free events that
      ``torch.profiler.profile(profile_memory=True)`` records for the call; it sees torch's CPU allocator
      only.

    Default: bf16, batch 1, head_dim 64, non-causal; CUDA 16 heads, seqlen 1k .. 32k; CPU 8 heads,
    seqlen 1k .. 8k.  A naive point that would need more than 70 % of the available RAM (CPU) is
    skipped, and an out-of-memory error (CUDA) is reported as OOM.

Output: the results table is printed last; ``--json PATH`` writes every result together with the date,
the git commit, the device name, the torch version, the thread count and the load average;
``--plot PATH.png`` draws the results if matplotlib is installed.

Timings on a shared machine are noisy: the load average at the start and end of the run is printed and
recorded so that a reader can judge.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext

__all__ = [
    "FwdConfig",
    "attention_flops",
    "naive_attention",
    "check_against_sdpa_math",
    "time_fn",
    "measure_peak_extra_memory",
    "run_fwd",
    "run_memory",
    "main",
]

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


# ----------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FwdConfig:
    """One attention problem: q, k, v of shape ``(batch, seqlen, nheads, head_dim)``."""

    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    causal: bool
    dtype: torch.dtype

    def describe(self) -> str:
        return (f"{DTYPE_NAMES[self.dtype]} b={self.batch} s={self.seqlen} h={self.nheads} d={self.head_dim} "
                f"{'causal' if self.causal else 'non-causal'}")


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


def _short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return f"{type(exc).__name__}: {first[:160]}"


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _free_device_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _mem_available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------------------------------
# Peak memory
# ----------------------------------------------------------------------------------------------------

class _RssPeak:
    """Peak-RSS measurement through ``/proc/self/clear_refs`` (Linux); see the module docstring."""

    def __init__(self) -> None:
        self.libc: Optional[ctypes.CDLL] = None
        self.available = False
        self.why_not = ""
        try:
            self.libc = ctypes.CDLL("libc.so.6")
            # M_MMAP_THRESHOLD = -3: a fixed threshold also stops glibc from raising it dynamically.
            self.libc.mallopt(ctypes.c_int(-3), ctypes.c_int(128 * 1024))
        except OSError:
            self.libc = None
        try:
            self._reset()
            self._read()
            self.available = True
        except OSError as exc:
            self.why_not = _short_error(exc)

    @staticmethod
    def _read() -> Tuple[int, int]:
        rss = hwm = -1
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
        if rss < 0 or hwm < 0:
            raise OSError("VmRSS/VmHWM not found in /proc/self/status")
        return rss, hwm

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def measure(self, fn: Callable[[], Any]) -> int:
        if self.libc is not None:
            self.libc.malloc_trim(ctypes.c_size_t(0))
        self._reset()
        rss_before, _ = self._read()
        out = fn()
        _, hwm = self._read()
        del out
        return max(0, hwm - rss_before)


_RSS: Optional[_RssPeak] = None


@contextlib.contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    """Silences file descriptor 2 (the profiler's C++ side prints start/stop lines there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _profiler_peak(fn: Callable[[], Any]) -> Optional[int]:
    """Peak of the running sum of torch's CPU allocation events during ``fn`` (None if unavailable)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with _quiet_stderr_fd():
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = fn()
                del out
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except Exception:  # private API: degrade to "not measured"
        return None
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def measure_peak_extra_memory(fn: Callable[[], Any], device: torch.device,
                              cross_check: bool = True) -> Dict[str, Optional[int]]:
    """Peak extra bytes of one call of ``fn`` (its return value is dropped after the measurement).

    CUDA: ``{"cuda_alloc": bytes}``.  CPU: ``{"rss": bytes or None, "alloc": bytes or None}`` (``alloc``
    only with ``cross_check``).  Raises what ``fn`` raises (e.g. out of memory).
    """
    global _RSS
    if device.type == "cuda":
        _free_device_memory(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        _free_device_memory(device)
        return {"cuda_alloc": int(peak)}
    if _RSS is None:
        _RSS = _RssPeak()
    result: Dict[str, Optional[int]] = {"rss": _RSS.measure(fn) if _RSS.available else None}
    if cross_check:
        result["alloc"] = _profiler_peak(fn)
    return result


# ----------------------------------------------------------------------------------------------------
# Environment / metadata
# ----------------------------------------------------------------------------------------------------

def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def _loadavg() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


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
        "loadavg_start": _loadavg(),
        "argv": sys.argv[1:],
    }
    return meta


def default_device() -> torch.device:
    """CUDA if a GPU is visible and this build has CUDA kernels, else the CPU."""
    if torch.cuda.is_available() and flash_ext.build_info().get("cuda", False):
        return torch.device("cuda")
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------

def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([line, sep, *body])


def _fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}"


# ----------------------------------------------------------------------------------------------------
# fwd mode
# ----------------------------------------------------------------------------------------------------

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


@dataclass
class FwdRow:
    dtype: str
    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    causal: bool
    flops: float
    check: str = "-"  # PASS | FAIL | ERR | -
    max_err: Optional[float] = None
    atol: Optional[float] = None
    impls: Dict[str, ImplResult] = field(default_factory=dict)
    best_sdpa: Optional[str] = None
    ratio_best_sdpa: Optional[float] = None
    ratio_sdpa_flash: Optional[float] = None
    ratio_best_sdpa_cpu_time: Optional[float] = None  # CPU device: same ratio from process CPU time


def _time_impl(fn: Callable[[], Any], device: torch.device, flops: float, warmup: int,
               repeats: int) -> ImplResult:
    cpu_times: List[float] = []
    try:
        times = time_fn(fn, device, warmup, repeats, cpu_times)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        _free_device_memory(device)
        return ImplResult(status="OOM" if _is_oom(exc) else "ERR", note=_short_error(exc))
    med = statistics.median(times)
    return ImplResult(median_s=med, min_s=min(times), times_s=times, tflops=flops / med / 1e12,
                      cpu_median_s=statistics.median(cpu_times) if cpu_times else None)


def _cpu_would_exhaust_ram(nbytes: float) -> bool:
    avail = _mem_available_bytes()
    return avail is not None and nbytes > 0.7 * avail


def bench_fwd_config(cfg: FwdConfig, device: torch.device, backends: Sequence[str], with_naive: bool,
                     warmup: int, repeats: int, sdpa_layout: str, notes: List[str]) -> FwdRow:
    """Checks and times flash_ext, each SDPA backend and the naive implementation on one problem."""
    flops = attention_flops(cfg.batch, cfg.seqlen, cfg.seqlen, cfg.nheads, cfg.head_dim, cfg.causal)
    row = FwdRow(DTYPE_NAMES[cfg.dtype], cfg.batch, cfg.seqlen, cfg.nheads, cfg.head_dim, cfg.causal, flops)
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (cfg.batch, cfg.seqlen, cfg.nheads, cfg.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(device=device, dtype=cfg.dtype) for _ in range(3))
    score_elems = float(cfg.batch) * cfg.nheads * cfg.seqlen * cfg.seqlen

    # flash_ext: correctness guard first; a wrong result gets no speed.
    try:
        out = flash_ext.flash_attn_func(q, k, v, causal=cfg.causal)
        ok, row.max_err, row.atol = check_against_sdpa_math(q, k, v, out, cfg.causal)
        del out
    except Exception as exc:  # noqa: BLE001
        _free_device_memory(device)
        row.check = "ERR"
        row.impls["flash_ext"] = ImplResult(status="OOM" if _is_oom(exc) else "ERR", note=_short_error(exc))
    else:
        row.check = "PASS" if ok else "FAIL"
        if ok:
            row.impls["flash_ext"] = _time_impl(lambda: flash_ext.flash_attn_func(q, k, v, causal=cfg.causal),
                                                device, flops, warmup, repeats)
        else:
            row.impls["flash_ext"] = ImplResult(status="FAIL", note=f"max err {row.max_err:.3g} > tol")
    _free_device_memory(device)

    if sdpa_layout == "bhsd":
        qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    else:
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    for name in backends:
        key = f"sdpa:{name}"
        backend = SDPA_BACKENDS[name]
        if device.type == "cpu" and name == "math" and _cpu_would_exhaust_ram(3 * 4 * score_elems):
            row.impls[key] = ImplResult(status="skip", note="would exhaust RAM")
            continue

        def call(backend: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=cfg.causal)

        try:  # probe: a backend that cannot run this device/dtype/shape raises here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call()
        except Exception as exc:  # noqa: BLE001
            _free_device_memory(device)
            status = "OOM" if _is_oom(exc) else "skip"
            row.impls[key] = ImplResult(status=status, note=_short_error(exc))
            msg = f"{key} {status} on {device.type} {DTYPE_NAMES[cfg.dtype]} d={cfg.head_dim}: {_short_error(exc)}"
            if status == "skip" and not any(n.startswith(f"{key} skip on {device.type}") for n in notes):
                notes.append(msg)
            elif status != "skip":
                notes.append(f"{cfg.describe()}: {msg}")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row.impls[key] = _time_impl(call, device, flops, warmup, repeats)
        _free_device_memory(device)
    del qs, ks, vs

    if with_naive:
        elem = torch.tensor([], dtype=cfg.dtype).element_size()
        if device.type == "cpu" and _cpu_would_exhaust_ram(2 * elem * score_elems):
            row.impls["naive"] = ImplResult(status="skip", note="would exhaust RAM")
        else:
            row.impls["naive"] = _time_impl(lambda: naive_attention(q, k, v, causal=cfg.causal), device, flops,
                                            warmup, repeats)
        _free_device_memory(device)

    sdpa_ok = {k_: r for k_, r in row.impls.items() if k_.startswith("sdpa:") and r.tflops is not None}
    if sdpa_ok:
        row.best_sdpa = max(sdpa_ok, key=lambda k_: sdpa_ok[k_].tflops or 0.0)
    fl = row.impls.get("flash_ext")
    if fl is not None and fl.tflops is not None:
        if row.best_sdpa is not None:
            row.ratio_best_sdpa = fl.tflops / sdpa_ok[row.best_sdpa].tflops
        if "sdpa:flash" in sdpa_ok:
            row.ratio_sdpa_flash = fl.tflops / sdpa_ok["sdpa:flash"].tflops
        best = sdpa_ok.get(row.best_sdpa) if row.best_sdpa else None
        if fl.cpu_median_s and best is not None and best.cpu_median_s:
            row.ratio_best_sdpa_cpu_time = best.cpu_median_s / fl.cpu_median_s
    return row


def fwd_configs(args: argparse.Namespace, device: torch.device) -> List[FwdConfig]:
    dtype = DTYPES[args.dtype]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if args.quick:
        return [FwdConfig(HEADLINE["batch"], HEADLINE["seqlen"], HEADLINE["nheads"], HEADLINE["head_dim"],
                          HEADLINE["causal"], dtype)]
    cuda = device.type == "cuda"
    head_dims = args.headdims or [64, 128]
    seqlens = args.seqlens or ([512, 1024, 2048, 4096, 8192, 16384] if cuda else [512, 1024, 2048])
    configs = []
    for d in head_dims:
        for causal in causals:
            for s in seqlens:
                if args.batch is not None:
                    b = args.batch
                elif cuda:
                    b = max(1, args.tokens // s)
                else:
                    b = 1
                h = args.nheads if args.nheads is not None else (max(1, args.hidden // d) if cuda else 8)
                configs.append(FwdConfig(b, s, h, d, causal, dtype))
    return configs


def _fwd_table(rows: Sequence[FwdRow], device: torch.device) -> str:
    impl_cols = ["flash_ext"] + [f"sdpa:{n}" for n in SDPA_BACKENDS] + ["naive"]
    # Only columns in which something was measured (or which failed in an interesting way).
    shown = [c for c in impl_cols if any(c in r.impls and r.impls[c].status not in ("skip",) for r in rows)]
    cpu = device.type == "cpu"
    headers = ["dtype", "b", "s", "h", "d", "causal", "flash ms"] + [f"{c} TF/s" for c in shown] + [
        "best sdpa", "x best", "x sdpa:flash"] + (["x best (cpu time)"] if cpu else []) + ["max err", "check"]
    table_rows = []
    for r in rows:
        cells = [r.dtype, str(r.batch), str(r.seqlen), str(r.nheads), str(r.head_dim), "Y" if r.causal else "N"]
        fl = r.impls.get("flash_ext")
        cells.append(_fmt(fl.median_s * 1e3, 4) if fl is not None and fl.median_s is not None else "-")
        for c in shown:
            ir = r.impls.get(c)
            if ir is None:
                cells.append("-")
            elif ir.tflops is not None:
                cells.append(_fmt(ir.tflops))
            else:
                cells.append(ir.status)
        cells += [r.best_sdpa.replace("sdpa:", "") if r.best_sdpa else "-", _fmt(r.ratio_best_sdpa),
                  _fmt(r.ratio_sdpa_flash)] + ([_fmt(r.ratio_best_sdpa_cpu_time)] if cpu else []) + [
                  _fmt(r.max_err, 2), r.check]
        table_rows.append(cells)
    return format_table(headers, table_rows)


def run_fwd(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    backends = args.backends or list(SDPA_BACKENDS)
    warmup = args.warmup if args.warmup is not None else (10 if device.type == "cuda" else 1)
    repeats = args.repeats if args.repeats is not None else (30 if device.type == "cuda" else 5)
    configs = fwd_configs(args, device)
    notes: List[str] = []
    rows: List[FwdRow] = []
    print(f"fwd: {len(configs)} configurations, warmup {warmup}, median of {repeats}; "
          f"TF/s = TFLOP/s with FLOPs = 4*b*s^2*h*d (/2 causal)", flush=True)
    for i, cfg in enumerate(configs):
        t0 = time.perf_counter()
        row = bench_fwd_config(cfg, device, backends, not args.no_naive, warmup, repeats, args.sdpa_layout, notes)
        rows.append(row)
        fl = row.impls.get("flash_ext")
        print(f"  [{i + 1}/{len(configs)}] {cfg.describe()}: check {row.check}, flash_ext "
              f"{_fmt(fl.tflops) if fl and fl.tflops else (fl.status if fl else '-')} TF/s, x best sdpa "
              f"{_fmt(row.ratio_best_sdpa)} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return {
        "results": [asdict(r) for r in rows],
        "notes": notes,
        "timing": {"warmup": warmup, "repeats": repeats, "statistic": "median",
                   "clock": "cuda events" if device.type == "cuda" else "time.perf_counter",
                   "sdpa_layout": args.sdpa_layout},
        "_table": _fwd_table(rows, device),
        "_rows": rows,
    }


# ----------------------------------------------------------------------------------------------------
# decode mode
# ----------------------------------------------------------------------------------------------------

@dataclass
class DecodeRow:
    """One decode step (one query token per sequence) against a KV cache of seqlen_k keys."""

    seqlen_k: int
    kv_bytes: int
    num_splits: int = 1
    flash_s: Optional[float] = None
    sdpa_s: Optional[float] = None
    check: str = "-"
    max_err: Optional[float] = None

    @property
    def flash_gbs(self) -> Optional[float]:
        return self.kv_bytes / self.flash_s / 1e9 if self.flash_s else None

    @property
    def sdpa_gbs(self) -> Optional[float]:
        return self.kv_bytes / self.sdpa_s / 1e9 if self.sdpa_s else None


def copy_bandwidth_gbs(device: torch.device, nbytes: int, warmup: int, repeats: int) -> float:
    """Device copy bandwidth, counting bytes read plus bytes written, measured in this run: the ceiling a
    memory-bound decode step can approach."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    times = time_fn(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9


def run_decode(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """GB/s of K/V read per decode step for flash_ext.flash_attn_with_kvcache (split-KV by the heuristic)
    and torch SDPA (default backend choice, GQA), against the device copy bandwidth."""
    cuda = device.type == "cuda"
    b = args.batch or (8 if cuda else 1)
    h = args.nheads or (32 if cuda else 8)
    hk = max(1, h // 4)
    d = (args.headdims or [128])[0]
    seqlens = args.seqlens or ([4096, 8192, 16384, 32768, 65536, 131072] if cuda else [4096, 16384])
    dtype = DTYPES[args.dtype]
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    repeats = args.repeats if args.repeats is not None else (30 if cuda else 5)
    copy_gbs = copy_bandwidth_gbs(device, (1 << 31) if cuda else (1 << 28), warmup, repeats)
    rows: List[DecodeRow] = []
    for sk in seqlens:
        row = DecodeRow(seqlen_k=sk, kv_bytes=2 * b * sk * hk * d * torch.tensor([], dtype=dtype).element_size())
        q = torch.randn(b, 1, h, d, dtype=dtype, device=device)
        k_cache = torch.randn(b, sk, hk, d, dtype=dtype, device=device)
        v_cache = torch.randn(b, sk, hk, d, dtype=dtype, device=device)
        plan = flash_ext.explain(q, k_cache, v_cache, verbose=False).plan
        row.num_splits = plan.get("num_splits", 1)

        def flash() -> torch.Tensor:
            return flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=sk)

        qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        out = flash()
        ok, err, _ = check_against_sdpa_math(q, k_cache, v_cache, out, causal=False)
        row.check, row.max_err = ("PASS" if ok else "FAIL"), err
        if ok:
            row.flash_s = statistics.median(time_fn(flash, device, warmup, repeats))
        try:
            row.sdpa_s = statistics.median(time_fn(sdpa, device, warmup, repeats))
        except RuntimeError:
            row.sdpa_s = None
        rows.append(row)
        print(f"  decode b={b} h={h} hk={hk} d={d} sk={sk}: splits {row.num_splits}, check {row.check}, "
              f"flash_ext {_fmt(row.flash_gbs)} GB/s, sdpa {_fmt(row.sdpa_gbs)} GB/s", flush=True)
        del q, k_cache, v_cache
        _free_device_memory(device)
    headers = ["b", "h", "hk", "d", "seqlen_k", "splits", "flash GB/s", "sdpa GB/s", "copy GB/s", "flash/copy",
               "flash/sdpa", "check"]
    table_rows = [[str(b), str(h), str(hk), str(d), str(r.seqlen_k), str(r.num_splits), _fmt(r.flash_gbs),
                   _fmt(r.sdpa_gbs), _fmt(copy_gbs), _fmt(r.flash_gbs / copy_gbs if r.flash_gbs else None),
                   _fmt(r.flash_gbs / r.sdpa_gbs if r.flash_gbs and r.sdpa_gbs else None), r.check] for r in rows]
    return {"_table": format_table(headers, table_rows), "_rows": rows, "copy_gbs": copy_gbs,
            "rows": [dict(seqlen_k=r.seqlen_k, num_splits=r.num_splits, flash_gbs=r.flash_gbs, sdpa_gbs=r.sdpa_gbs,
                          check=r.check, max_err=r.max_err) for r in rows],
            "method": "GB/s = bytes of K and V read / median step time; copy GB/s counts read + write"}


# ----------------------------------------------------------------------------------------------------
# memory mode
# ----------------------------------------------------------------------------------------------------

@dataclass
class MemRow:
    dtype: str
    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    causal: bool
    score_matrix_bytes: int  # one (b, h, s, s) matrix in the input dtype, for orientation
    output_bytes: int
    naive: Dict[str, Optional[int]] = field(default_factory=dict)
    flash_ext: Dict[str, Optional[int]] = field(default_factory=dict)
    naive_status: str = "ok"
    flash_status: str = "ok"


def memory_point(batch: int, seqlen: int, nheads: int, head_dim: int, causal: bool, dtype: torch.dtype,
                 device: torch.device, cross_check: bool = True, with_naive: bool = True) -> MemRow:
    """Peak extra memory of one naive and one flash_ext forward call at one shape."""
    elem = torch.tensor([], dtype=dtype).element_size()
    score_bytes = batch * nheads * seqlen * seqlen * elem
    row = MemRow(DTYPE_NAMES[dtype], batch, seqlen, nheads, head_dim, causal, score_bytes,
                 batch * seqlen * nheads * head_dim * elem)
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (batch, seqlen, nheads, head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    if not with_naive:
        row.naive_status = "not run"
    elif device.type == "cpu" and _cpu_would_exhaust_ram(2.2 * score_bytes):
        row.naive_status = f"skip (needs ~{2 * score_bytes / 2**30:.1f} GiB)"
    else:
        try:
            row.naive = measure_peak_extra_memory(lambda: naive_attention(q, k, v, causal=causal), device,
                                                  cross_check)
        except Exception as exc:  # noqa: BLE001
            _free_device_memory(device)
            row.naive_status = "OOM" if _is_oom(exc) else f"ERR {_short_error(exc)}"
    try:
        row.flash_ext = measure_peak_extra_memory(lambda: flash_ext.flash_attn_func(q, k, v, causal=causal), device,
                                                  cross_check)
    except Exception as exc:  # noqa: BLE001
        _free_device_memory(device)
        row.flash_status = "OOM" if _is_oom(exc) else f"ERR {_short_error(exc)}"
    return row


def memory_table(rows: Sequence[MemRow], device: torch.device) -> str:
    methods = ["cuda_alloc"] if device.type == "cuda" else ["rss", "alloc"]
    methods = [m for m in methods if any(r.naive.get(m) is not None or r.flash_ext.get(m) is not None
                                         for r in rows)] or methods[:1]
    headers = ["dtype", "b", "s", "h", "d", "causal", "S MiB", "out MiB"]
    for m in methods:
        headers += [f"naive {m} MiB", f"flash {m} MiB", f"naive/flash ({m})"]
    out = []
    for r in rows:
        cells = [r.dtype, str(r.batch), str(r.seqlen), str(r.nheads), str(r.head_dim), "Y" if r.causal else "N",
                 f"{r.score_matrix_bytes / MiB:.1f}", f"{r.output_bytes / MiB:.2f}"]
        for m in methods:
            n = r.naive.get(m)
            f_ = r.flash_ext.get(m)
            cells.append(f"{n / MiB:.1f}" if n is not None else (r.naive_status if r.naive_status != "ok" else "-"))
            cells.append(f"{f_ / MiB:.2f}" if f_ is not None else (r.flash_status if r.flash_status != "ok" else "-"))
            cells.append(f"{n / f_:.1f}" if n is not None and f_ else "-")
        out.append(cells)
    return format_table(headers, out)


def run_memory(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype]
    seqlens = args.seqlens or ([1024, 2048, 4096, 8192, 16384, 32768] if cuda else [1024, 2048, 4096, 8192])
    head_dims = args.headdims or [64]
    batch = args.batch if args.batch is not None else 1
    nheads = args.nheads if args.nheads is not None else (16 if cuda else 8)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    # Warm both paths up on a tiny problem so that one-time costs (thread pools, lazy init) are excluded.
    qw = torch.randn(1, 64, 2, 64, device=device, dtype=dtype)
    naive_attention(qw, qw, qw)
    flash_ext.flash_attn_func(qw, qw, qw)
    del qw
    rows = []
    print(f"memory: peak extra memory per call ({'torch.cuda.max_memory_allocated' if cuda else 'peak RSS (VmHWM reset) and torch profiler allocation events'})",
          flush=True)
    for d in head_dims:
        for causal in causals:
            for s in seqlens:
                row = memory_point(batch, s, nheads, d, causal, dtype, device, cross_check=not args.no_cross_check)
                rows.append(row)
                print(f"  s={s} d={d} causal={causal}: naive {row.naive} {row.naive_status}, "
                      f"flash_ext {row.flash_ext} {row.flash_status}", flush=True)
    method = ("torch.cuda.max_memory_allocated() - memory_allocated() before the call" if cuda else
              "rss: VmHWM after the call - VmRSS before (peak reset through /proc/self/clear_refs, "
              "glibc mmap threshold fixed at 128 KiB, malloc_trim before each point)" +
              ("" if args.no_cross_check else "; alloc: peak running sum of torch.profiler memory events "
               "(torch CPU allocator only)"))
    return {"results": [asdict(r) for r in rows], "notes": [], "method": method,
            "_table": memory_table(rows, device), "_rows": rows}


# ----------------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------------

def plot(mode: str, result: Dict[str, Any], meta: Dict[str, Any], path: str) -> Optional[str]:
    """Draws the results to ``path``; returns a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: --plot skipped"
    title = f"{meta['device_name']}, torch {meta['torch_version']}, {meta['git_commit']}"
    if mode == "fwd":
        rows: List[FwdRow] = result["_rows"]
        groups = sorted({(r.dtype, r.head_dim, r.causal) for r in rows})
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
        for ax, (dt, d, causal) in zip(axes[0], groups):
            sub = [r for r in rows if (r.dtype, r.head_dim, r.causal) == (dt, d, causal)]
            names = sorted({n for r in sub for n in r.impls})
            for name in names:
                pts = [(r.seqlen, r.impls[name].tflops) for r in sub
                       if name in r.impls and r.impls[name].tflops is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                            linewidth=2.5 if name == "flash_ext" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{dt} d={d} {'causal' if causal else 'non-causal'}")
            ax.legend(fontsize=7)
    else:
        rows_m: List[MemRow] = result["_rows"]
        fig, ax = plt.subplots(figsize=(6, 4))
        method = "cuda_alloc" if meta["device"].startswith("cuda") else "rss"
        for label, attr in (("naive", "naive"), ("flash_ext", "flash_ext")):
            pts = [(r.seqlen, getattr(r, attr).get(method)) for r in rows_m]
            pts = [(s, b / MiB) for s, b in pts if b is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("seqlen")
        ax.set_ylabel(f"peak extra memory, MiB ({method})")
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flash_ext.bench",
        description="flash_ext benchmarks: forward TFLOP/s against torch SDPA backends and naive attention "
                    "(fwd), or peak extra memory against seqlen (memory).  See the module docstring.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("mode", nargs="?", default="fwd", choices=["fwd", "memory", "decode"],
                   help="what to measure (decode: GB/s of K/V read per decode step vs device copy and SDPA)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda if a GPU is visible and the build has CUDA kernels, else cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--seqlens", type=int, nargs="+", default=None, help="override the seqlen grid")
    p.add_argument("--headdims", type=int, nargs="+", default=None, help="override the head dims (64 128)")
    p.add_argument("--batch", type=int, default=None,
                   help="fixed batch (default: tokens // seqlen on CUDA, 1 on CPU)")
    p.add_argument("--nheads", type=int, default=None,
                   help="fixed head count (default: hidden // head_dim on CUDA, 8 on CPU; memory: 16 CUDA, 8 CPU)")
    p.add_argument("--tokens", type=int, default=16384, help="CUDA fwd: batch * seqlen when --batch is not given")
    p.add_argument("--hidden", type=int, default=2048, help="CUDA fwd: nheads * head_dim when --nheads is not given")
    p.add_argument("--causal", choices=["both", "yes", "no"], default=None,
                   help="default: both for fwd, no for memory")
    p.add_argument("--backends", nargs="+", choices=list(SDPA_BACKENDS), default=None,
                   help="SDPA backends to time (default: all)")
    p.add_argument("--no-naive", action="store_true", help="fwd: do not time the naive implementation")
    p.add_argument("--sdpa-layout", choices=["bhsd", "bshd-view"], default="bhsd",
                   help="inputs given to SDPA: contiguous (b,h,s,d) copies, or transposed views of flash_ext's")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default: CUDA 10, CPU 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls, median reported (default: CUDA 30, CPU 5)")
    p.add_argument("--quick", action="store_true",
                   help="fwd: only the headline case (b=1, h=8, s=2048, d=64, non-causal)")
    p.add_argument("--no-cross-check", action="store_true",
                   help="memory on CPU: skip the torch.profiler allocation cross-check")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads(N) first (default: leave torch's default, which is printed)")
    p.add_argument("--json", metavar="PATH", default=None, help="write all results and metadata as JSON")
    p.add_argument("--plot", metavar="PATH.png", default=None, help="plot the results (needs matplotlib)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.causal is None:
        args.causal = "both" if args.mode == "fwd" else "no"
    if args.device is None:
        device = default_device()
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("error: --device cuda but no CUDA device is visible", file=sys.stderr)
            return 2
    build = flash_ext.build_info()
    meta = metadata(device, args.mode, args)
    print(f"flash_ext {meta['flash_ext_version']} ({meta['git_commit']}), torch {meta['torch_version']}, "
          f"device {meta['device_name']}, threads {meta['num_threads']}, cpu capability {meta['cpu_capability']}, "
          f"load average {meta['loadavg_start']}", flush=True)
    if device.type == "cuda" and not build.get("cuda", False):
        print("warning: this flash_ext build has no CUDA kernels; flash_ext rows will show ERR", flush=True)

    runners = {"fwd": run_fwd, "memory": run_memory, "decode": run_decode}
    result = runners[args.mode](args, device)
    meta["loadavg_end"] = _loadavg()
    table = result.pop("_table")
    rows = result.pop("_rows")

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, **result}, f, indent=2, default=str)
        print(f"wrote {args.json}")
    if args.plot and args.mode != "decode":
        note = plot(args.mode, {"_rows": rows}, meta, args.plot)
        print(note if note else f"wrote {args.plot}")

    print()
    for n in result.get("notes", []):
        print(f"note: {n}")
    if "method" in result:
        print(f"method: {result['method']}")
    print(f"load average start {meta['loadavg_start']} end {meta['loadavg_end']} "
          f"({os.cpu_count()} logical CPUs; a load above that count means the timings were shared)")
    print(table)
    failed = any(r.check in ("FAIL", "ERR") for r in rows) if args.mode in ("fwd", "decode") else False
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
