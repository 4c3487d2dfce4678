"""``memory`` mode: peak extra memory of one forward call (or, with ``--backward``, of forward + backward, the
attention of a training step) against seqlen: naive attention vs flash_ext, and SDPA's default backend with
``--backward``."""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

import flash_ext
from .common import (
    DTYPES, DTYPE_NAMES, MiB, cpu_would_exhaust_ram, format_table, free_device_memory, is_oom,
    naive_attention, short_error,
)

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
            self.why_not = short_error(exc)

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
        free_device_memory(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        free_device_memory(device)
        return {"cuda_alloc": int(peak)}
    if _RSS is None:
        _RSS = _RssPeak()
    result: Dict[str, Optional[int]] = {"rss": _RSS.measure(fn) if _RSS.available else None}
    if cross_check:
        result["alloc"] = _profiler_peak(fn)
    return result


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
    backward: bool = False  # forward + backward (gradients of q, k, v included in the peak)
    sdpa: Dict[str, Optional[int]] = field(default_factory=dict)  # with backward only
    sdpa_status: str = "not run"


def memory_point(batch: int, seqlen: int, nheads: int, head_dim: int, causal: bool, dtype: torch.dtype,
                 device: torch.device, cross_check: bool = True, with_naive: bool = True,
                 backward: bool = False) -> MemRow:
    """Peak extra memory of one naive and one flash_ext call at one shape: the forward, or with ``backward``
    ``torch.autograd.grad(attn(q, k, v), (q, k, v), dout)`` (then SDPA's default backend as well)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    score_bytes = batch * nheads * seqlen * seqlen * elem
    row = MemRow(DTYPE_NAMES[dtype], batch, seqlen, nheads, head_dim, causal, score_bytes,
                 batch * seqlen * nheads * head_dim * elem, backward=backward)
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (batch, seqlen, nheads, head_dim)
    q, k, v, dout = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
    if backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))

    def call(attn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], Any]:
        if not backward:
            return lambda: attn(*inputs)
        grad_out = dout if inputs[0] is q else dout.transpose(1, 2).contiguous()
        return lambda: torch.autograd.grad(attn(*inputs), inputs, grad_out)

    # The naive forward keeps two score matrices alive at its peak, its autograd about four.
    naive_factor = 4.4 if backward else 2.2
    if not with_naive:
        row.naive_status = "not run"
    elif device.type == "cpu" and cpu_would_exhaust_ram(naive_factor * score_bytes):
        row.naive_status = f"skip (needs ~{naive_factor * score_bytes / 2**30:.1f} GiB)"
    else:
        try:
            row.naive = measure_peak_extra_memory(call(lambda a, b, c: naive_attention(a, b, c, causal=causal), q, k, v),
                                                  device, cross_check)
        except Exception as exc:  # noqa: BLE001
            free_device_memory(device)
            row.naive_status = "OOM" if is_oom(exc) else f"ERR {short_error(exc)}"
    try:
        row.flash_ext = measure_peak_extra_memory(
            call(lambda a, b, c: flash_ext.flash_attn_func(a, b, c, causal=causal), q, k, v), device, cross_check)
    except Exception as exc:  # noqa: BLE001
        free_device_memory(device)
        row.flash_status = "OOM" if is_oom(exc) else f"ERR {short_error(exc)}"
    if backward:  # SDPA (its default backend choice) on (b, h, s, d) leaves, like the fwd mode's bhsd layout
        qs, ks, vs = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        try:
            row.sdpa = measure_peak_extra_memory(
                call(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal),
                     qs, ks, vs), device, cross_check)
            row.sdpa_status = "ok"
        except Exception as exc:  # noqa: BLE001
            free_device_memory(device)
            row.sdpa_status = "OOM" if is_oom(exc) else f"ERR {short_error(exc)}"
    return row


def memory_table(rows: Sequence[MemRow], device: torch.device) -> str:
    methods = ["cuda_alloc"] if device.type == "cuda" else ["rss", "alloc"]
    methods = [m for m in methods if any(r.naive.get(m) is not None or r.flash_ext.get(m) is not None
                                         for r in rows)] or methods[:1]
    with_sdpa = any(r.backward for r in rows)
    headers = ["dtype", "b", "s", "h", "d", "causal", "pass", "S MiB", "out MiB"]
    for m in methods:
        headers += [f"naive {m} MiB"] + ([f"sdpa {m} MiB"] if with_sdpa else []) + [f"flash {m} MiB",
                                                                                      f"naive/flash ({m})"]
    out = []

    def cell(values: Dict[str, Optional[int]], m: str, status: str, digits: int) -> str:
        x = values.get(m)
        return f"{x / MiB:.{digits}f}" if x is not None else (status if status != "ok" else "-")

    for r in rows:
        cells = [r.dtype, str(r.batch), str(r.seqlen), str(r.nheads), str(r.head_dim), "Y" if r.causal else "N",
                 "fwd+bwd" if r.backward else "fwd", f"{r.score_matrix_bytes / MiB:.1f}", f"{r.output_bytes / MiB:.2f}"]
        for m in methods:
            n = r.naive.get(m)
            f_ = r.flash_ext.get(m)
            cells.append(cell(r.naive, m, r.naive_status, 1))
            if with_sdpa:
                cells.append(cell(r.sdpa, m, r.sdpa_status, 2))
            cells.append(cell(r.flash_ext, m, r.flash_status, 2))
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
    qw = torch.randn(1, 64, 2, 64, device=device, dtype=dtype, requires_grad=args.backward)
    for out in (naive_attention(qw, qw, qw), flash_ext.flash_attn_func(qw, qw, qw),
                torch.nn.functional.scaled_dot_product_attention(qw, qw, qw)):
        if args.backward:
            torch.autograd.grad(out, qw, torch.ones_like(out))
    del qw, out
    rows = []
    print(f"memory ({'forward + backward' if args.backward else 'forward'}): peak extra memory per call ({'torch.cuda.max_memory_allocated' if cuda else 'peak RSS (VmHWM reset) and torch profiler allocation events'})",
          flush=True)
    for d in head_dims:
        for causal in causals:
            for s in seqlens:
                row = memory_point(batch, s, nheads, d, causal, dtype, device, cross_check=not args.no_cross_check,
                                   backward=args.backward)
                rows.append(row)
                sdpa = f", sdpa {row.sdpa} {row.sdpa_status}" if args.backward else ""
                print(f"  s={s} d={d} causal={causal}: naive {row.naive} {row.naive_status}{sdpa}, "
                      f"flash_ext {row.flash_ext} {row.flash_status}", flush=True)
    method = ("torch.cuda.max_memory_allocated() - memory_allocated() before the call" if cuda else
              "rss: VmHWM after the call - VmRSS before (peak reset through /proc/self/clear_refs, "
              "glibc mmap threshold fixed at 128 KiB, malloc_trim before each point)" +
              ("" if args.no_cross_check else "; alloc: peak running sum of torch.profiler memory events "
               "(torch CPU allocator only)"))
    return {"results": [asdict(r) for r in rows], "notes": [], "method": method,
            "_table": memory_table(rows, device), "_rows": rows}
