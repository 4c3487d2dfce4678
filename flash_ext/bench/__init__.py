"""Benchmarks for flash_ext: forward throughput and peak memory.

Run ``python -m flash_ext.bench --help`` for every option.  Modes (``decode`` and ``ring``: see their modules):

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

``bwd`` and ``fwd+bwd``
    The training side, same grid, guard and timing as ``fwd``: the backward alone, or forward + backward, of
    flash_ext, each SDPA backend and naive attention, FLOPs 2.5x / 3.5x the forward's (``bench/bwd.py``).

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

``decode``
    GB/s of K/V read per decode step (one query token against a KV cache), see ``decode.py``.

``dropout``
    The cost of dropout: forward time with ``--dropout-p`` (default 0.1) / without, alternating calls in
    one run, with a correctness guard against the element-wise mask; SDPA's dropout alongside.  See
    ``dropout.py``.
``ring``
    Ring attention (``flash_ext.distributed``) on this machine: ``--world`` CPU processes (default 2) joined by
    gloo over localhost; per ring step the local attention time, the communication still exposed after it, the
    same exchange timed alone and the overlap achieved, forward and (when the build has it) backward; layouts
    contiguous causal, zigzag causal and contiguous non-causal.  Default: bf16, batch 1, 8 heads, head_dim 64,
    seqlen 2048 and 4096 in total, ``cores // world`` threads per rank.  CPU gloo is not a GPU link.

Output: the results table is printed last; ``--json PATH`` writes every result together with the date,
the git commit, the device name, the torch version, the thread count and the load average;
``--plot PATH.png`` draws the results if matplotlib is installed.

Timings on a shared machine are noisy: the load average at the start and end of the run is printed and
recorded so that a reader can judge.
"""
from __future__ import annotations

from .common import attention_flops, check_against_sdpa_math, naive_attention, time_fn
from .bwd import run_bwd
from .fwd import FwdConfig, run_fwd
from .memory import measure_peak_extra_memory, run_memory
from .decode import run_decode
from .dropout import run_dropout
from .ring import run_ring
from .cli import main

__all__ = [
    "FwdConfig",
    "attention_flops",
    "naive_attention",
    "check_against_sdpa_math",
    "time_fn",
    "measure_peak_extra_memory",
    "run_fwd",
    "run_bwd",
    "run_memory",
    "run_decode",
    "run_dropout",
    "run_ring",
    "main",
]
