"""The ``python -m flash_ext.bench`` command line: one parser for every mode, and the run/record/print loop."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import torch

import flash_ext
from .common import DTYPES, SDPA_BACKENDS, default_device, loadavg, metadata
from .bwd import run_bwd
from .decode import run_decode
from .dropout import run_dropout
from .fwd import run_fwd
from .memory import run_memory
from .plot import plot
from .ring import run_ring



class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where there is a fixed default: options defaulting to None say in their
    help what they default to (it depends on the device or the mode)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "%(default)" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flash_ext.bench",
        description="flash_ext benchmarks: forward, backward or forward+backward TFLOP/s against torch SDPA "
                    "backends and naive attention (fwd, bwd, fwd+bwd), peak extra memory against seqlen (memory, "
                    "--backward for a training step), decode-step K/V bandwidth (decode), or the cost of dropout "
                    "(dropout), ring attention over gloo (ring).  See the module docstring.",
        formatter_class=_DefaultsHelpFormatter)
    p.add_argument("mode", nargs="?", default="fwd",
                   choices=["fwd", "bwd", "fwd+bwd", "memory", "decode", "dropout", "ring"],
                   help="what to measure (bwd / fwd+bwd: the backward alone / forward + backward; decode: GB/s of "
                        "K/V read per decode step vs device copy and SDPA; dropout: forward time with dropout / "
                        "without, same run; ring: ring attention over gloo on this machine, per-step compute / "
                        "communication / overlap)")
    p.add_argument("--world", type=_positive_int, default=2, help="ring: number of processes (ranks)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda if a GPU is visible and the build has CUDA kernels, else cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="element type of q, k, v")
    p.add_argument("--seqlens", type=_positive_int, nargs="+", default=None, help="override the seqlen grid")
    p.add_argument("--headdims", type=_positive_int, nargs="+", default=None, help="override the head dims (64 128)")
    p.add_argument("--batch", type=_positive_int, default=None,
                   help="fixed batch (default: tokens // seqlen on CUDA, 1 on CPU)")
    p.add_argument("--nheads", type=_positive_int, default=None,
                   help="fixed head count (default: hidden // head_dim on CUDA, 8 on CPU; memory: 16 CUDA, 8 CPU)")
    p.add_argument("--tokens", type=_positive_int, default=16384, help="CUDA fwd: batch * seqlen when --batch is not given")
    p.add_argument("--hidden", type=_positive_int, default=2048, help="CUDA fwd: nheads * head_dim when --nheads is not given")
    p.add_argument("--causal", choices=["both", "yes", "no"], default=None,
                   help="default: both for fwd, no for memory")
    p.add_argument("--backends", nargs="+", choices=list(SDPA_BACKENDS), default=None,
                   help="SDPA backends to time (default: all)")
    p.add_argument("--no-naive", action="store_true", help="fwd: do not time the naive implementation")
    p.add_argument("--dropout-p", type=_dropout_p, default=0.1, help="dropout: the dropout probability timed, in [0, 1)")
    p.add_argument("--no-sdpa", action="store_true", help="dropout: do not time SDPA alongside")
    p.add_argument("--sdpa-layout", choices=["bhsd", "bshd-view"], default="bhsd",
                   help="inputs given to SDPA: contiguous (b,h,s,d) copies, or transposed views of flash_ext's")
    p.add_argument("--kv-layers", type=_nonnegative_int, default=0,
                   help="decode: K/V caches the steps cycle through, as a model's layers do (0: enough for "
                        "%d MiB in all, so each step reads its cache from memory, not from a warm cache; "
                        "1: the same cache every step)" % 512)
    p.add_argument("--kv-heads", type=_positive_int, default=None,
                   help="decode: K/V heads, dividing the query heads (default: nheads // 4, a GQA group of 4 "
                        "query rows per K/V head; nheads for multi-head attention, one row each)")
    p.add_argument("--warmup", type=_nonnegative_int, default=None, help="untimed calls first (default: CUDA 10, CPU 1)")
    p.add_argument("--repeats", type=_positive_int, default=None,
                   help="timed calls, median reported (default: CUDA 30, CPU 5; decode: as many as fill 0.25 s "
                        "per side, at least those)")
    p.add_argument("--quick", action="store_true",
                   help="fwd/bwd/fwd+bwd: only the headline case (b=1, h=8, s=2048, d=64, non-causal); dropout: "
                        "d=64, one seqlen")
    p.add_argument("--backward", action="store_true",
                   help="memory: measure forward + backward (autograd of the attention) instead of the forward, "
                        "with SDPA's default backend as a third column")
    p.add_argument("--no-cross-check", action="store_true",
                   help="memory on CPU: skip the torch.profiler allocation cross-check")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch.set_num_threads(N) first (default: leave torch's default, which is printed)")
    p.add_argument("--json", metavar="PATH", default=None, help="write all results and metadata as JSON")
    p.add_argument("--plot", metavar="PATH.png", default=None, help="plot the results (needs matplotlib)")
    return p


def _int_at_least(low: int):
    """argparse type of a count: an integer >= low."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; must be an integer >= {low}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"got {n}; must be >= {low}")
        return n
    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)


def _dropout_p(text: str) -> float:
    """argparse type of --dropout-p: a probability in [0, 1), as the attention functions require."""
    try:
        p = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; must be a number in [0, 1)") from None
    if not 0.0 <= p < 1.0:
        raise argparse.ArgumentTypeError(f"got {p}; must be in [0, 1)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.mode == "ring" and args.world < 2:  # one rank has no ring: nothing to exchange or overlap
        parser.error(f"argument --world: got {args.world}; the ring mode needs >= 2 ranks")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.causal is None:
        args.causal = "both" if args.mode in ("fwd", "bwd", "fwd+bwd", "dropout") else "no"
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
    if device.type == "cpu":
        print(f"flash_ext CPU micro-kernels: {meta['flash_ext_cpu_isa']} (CPU vector flags: "
              f"{' '.join(meta['cpu_flags']) or 'unknown'})", flush=True)
    if device.type == "cuda" and not build.get("cuda", False):
        print("warning: this flash_ext build has no CUDA kernels; flash_ext rows will show ERR", flush=True)

    runners = {"fwd": run_fwd, "bwd": run_bwd, "fwd+bwd": run_bwd, "memory": run_memory, "decode": run_decode,
               "dropout": run_dropout, "ring": run_ring}
    result = runners[args.mode](args, device)
    meta["loadavg_end"] = loadavg()
    table = result.pop("_table")
    rows = result.pop("_rows")

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, **result}, f, indent=2, default=str)
        print(f"wrote {args.json}")
    if args.plot and args.mode in ("fwd", "memory"):
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
    # memory and ring rows are measurements without a correctness column (the ring's results are checked by
    # tests/test_ring.py); the other modes fail on a FAIL or ERR row.
    checked = args.mode not in ("memory", "ring")
    failed = checked and any(r.check in ("FAIL", "ERR") for r in rows)
    return 1 if failed else 0
