"""``ring`` mode: ring attention (flash_ext.distributed) on one machine, CPU processes joined by gloo over
localhost (world size ``--world``, default 2).  Per ring step: the time of the local attention (compute), the
time a rank still waits for the next K/V shard after it (exposed communication), the time the same K/V exchange
takes alone (no compute running), and the overlap achieved, ``1 - exposed / alone`` (the fraction of the
transfer hidden behind the compute).  Forward, and the backward when the build has flash_ext's backward op.

Method: every rank runs ``--warmup`` untimed calls, then ``--repeats`` timed ones; a hook inside the ring
(``flash_ext.distributed.ring.tracing``) timestamps each step when its exchange is posted, when its local
attention is done, and when the exchange has been received; per step and rank the median over repeats.  The
row reports the rank with the most compute in that step (it sets the ring's pace; a faster rank's wait also
contains the imbalance), and the spread of compute over ranks.  "Alone": the same ``batch_isend_irecv`` of the
same K/V shards (forward) or K/V plus the fp32 dK/dV accumulators (backward), timed with nothing else
running, median.  The argument check (one small all_gather per call) is timed alone too.

Caveat: CPU gloo over localhost is not a GPU link.  Its transfers are memory copies through the kernel's TCP
stack, and its progress threads share the cores with the attention, so the numbers show that the transfer is
overlapped and what the ring costs on a CPU box, not what NVLink or InfiniBand would do.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time
import traceback
from typing import Any, Dict, List

import torch

from .common import DTYPES, fmt, format_table

LAYOUTS = {
    "ring-causal": ("ring_flash_attn_func", True),
    "zigzag-causal": ("zigzag_ring_flash_attn_func", True),
    "ring": ("ring_flash_attn_func", False),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_steps(runs: List[List[Dict[str, float]]]) -> List[Dict[str, float]]:
    """Per step, the median over runs of each duration."""
    return [{key: statistics.median(run[s][key] for run in runs) for key in runs[0][s]} for s in range(len(runs[0]))]


def _timed_call(fn) -> tuple:
    """Runs fn() under the ring's tracing hook; returns (fn's result, per-step durations in seconds: "compute"
    from the step's exchange being issued to its local calls being done, "compute_cpu" the CPU time of this
    thread over the same span (the attention runs on it with one torch thread), "wait" the time spent in waits
    for transfers, and the call's total)."""
    from flash_ext.distributed.ring import tracing

    marks: List[tuple] = []

    def hook(event: str, step: int) -> None:
        marks.append((event, step, time.perf_counter(), time.thread_time()))

    with tracing(hook):
        t0 = time.perf_counter()
        result = fn()
        total = time.perf_counter() - t0
    steps = sorted({m[1] for m in marks})
    at = {(e, s): (t, c) for e, s, t, c in marks if e in ("posted", "computed")}
    per_step = []
    for s in steps:
        begins = [t for e, st, t, _ in marks if st == s and e == "wait"]
        ends = [t for e, st, t, _ in marks if st == s and e == "waited"]
        done, start = at.get(("computed", s)), at.get(("posted", s))
        per_step.append({"compute": done[0] - start[0] if done else 0.0,
                         "compute_cpu": done[1] - start[1] if done else 0.0,
                         "wait": sum(b - a for a, b in zip(begins, ends))})
    return result, per_step, total


def _worker(rank: int, world: int, port: int, cfg: Dict[str, Any], outdir: str) -> None:
    try:
        torch.set_num_threads(cfg["threads"])
        import torch.distributed as dist

        import flash_ext.distributed as fxd
        from flash_ext.distributed.ring import Ring, _bwd_op

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        dtype = DTYPES[cfg["dtype"]]
        b, h, d = cfg["batch"], cfg["nheads"], cfg["head_dim"]
        results = []
        has_bwd = _bwd_op() is not None
        ring = Ring(None)
        for seqlen in cfg["seqlens"]:
            s_local = seqlen // world
            g = torch.Generator().manual_seed(1234 + rank)
            q, k, v, dout = (torch.randn(b, s_local, h, d, generator=g).to(dtype) for _ in range(4))

            def exchange_alone(tensors):
                bufs = [torch.empty_like(t) for t in tensors]
                times = []
                for _ in range(cfg["warmup"] + cfg["repeats"]):
                    dist.barrier()
                    t0 = time.perf_counter()
                    ring.exchange(tensors, bufs, 1, "benchmark exchange").wait(-1)
                    times.append(time.perf_counter() - t0)
                return statistics.median(times[cfg["warmup"]:])

            kv_alone = exchange_alone([k, v])
            grad_alone = exchange_alone([k.float(), v.float()]) if has_bwd else None
            check_times = []
            for _ in range(cfg["warmup"] + cfg["repeats"]):
                t0 = time.perf_counter()
                fxd._agree(None, q.device, [1.0] * 15)
                check_times.append(time.perf_counter() - t0)
            for layout in cfg["layouts"]:
                fn_name, causal = LAYOUTS[layout]
                fn = getattr(fxd, fn_name)
                fwd_runs, bwd_runs, fwd_totals, bwd_totals = [], [], [], []
                for it in range(cfg["warmup"] + cfg["repeats"]):
                    leaves = [t.clone().requires_grad_(has_bwd) for t in (q, k, v)]
                    dist.barrier()
                    out, steps, total = _timed_call(lambda: fn(*leaves, causal=causal))
                    if it >= cfg["warmup"]:
                        fwd_runs.append(steps)
                        fwd_totals.append(total)
                    if has_bwd:
                        dist.barrier()
                        _, steps, total = _timed_call(lambda: torch.autograd.grad(out, leaves, dout))
                        if it >= cfg["warmup"]:
                            bwd_runs.append(steps)
                            bwd_totals.append(total)
                results.append(dict(
                    seqlen=seqlen, s_local=s_local, layout=layout, kv_bytes=2 * k.numel() * k.element_size(),
                    grad_bytes=2 * k.numel() * 4, kv_alone=kv_alone, grad_alone=grad_alone,
                    check=statistics.median(check_times[cfg["warmup"]:]),
                    fwd_steps=_median_steps(fwd_runs), fwd_total=statistics.median(fwd_totals),
                    bwd_steps=_median_steps(bwd_runs) if bwd_runs else None,
                    bwd_total=statistics.median(bwd_totals) if bwd_totals else None))
                print(f"  rank {rank}: seqlen {seqlen} {layout}: fwd {1e3 * results[-1]['fwd_total']:.1f} ms"
                      + (f", bwd {1e3 * results[-1]['bwd_total']:.1f} ms" if bwd_totals else ""), flush=True)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump({"results": results, "has_bwd": has_bwd}, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def run_ring(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """Per-step compute / exposed-communication / communication-alone times of the ring on CPU gloo."""
    import torch.multiprocessing as mp

    world = args.world
    threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 2) // world)
    cfg = dict(dtype=args.dtype, batch=args.batch or 1, nheads=args.nheads or 8,
               head_dim=(args.headdims or [64])[0], seqlens=args.seqlens or [2048, 4096],
               warmup=args.warmup if args.warmup is not None else 1,
               repeats=args.repeats if args.repeats is not None else 3, threads=threads,
               layouts=list(LAYOUTS))
    notes = [f"CPU processes joined by gloo over localhost, world size {world}, {threads} torch thread(s) per "
             f"rank; this is not a GPU link (see the mode's docstring)"]
    if device.type != "cpu":
        notes.append(f"--device {device.type} ignored: the ring mode runs on the CPU with gloo")
    for s in cfg["seqlens"]:
        if s % (2 * world):
            raise SystemExit(f"--seqlens: {s} is not divisible by 2 * world = {2 * world} (zigzag layout)")
    with tempfile.TemporaryDirectory(prefix="flash_ext_bench_ring_") as outdir:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, outdir)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        errs = [open(os.path.join(outdir, f"rank{r}.err")).read() for r in range(world)
                if os.path.exists(os.path.join(outdir, f"rank{r}.err"))]
        if errs:
            raise RuntimeError("ring benchmark worker failed:\n" + "\n".join(errs))
        per_rank = [json.load(open(os.path.join(outdir, f"rank{r}.json"))) for r in range(world)]
    has_bwd = per_rank[0]["has_bwd"]
    if not has_bwd:
        notes.append("backward not measured: this build has no flash_ext::bwd op")
    headers = ["seqlen", "s_local", "layout", "pass", "step", "compute ms", "compute cpu ms", "exposed comm ms",
               "comm alone ms", "overlap", "MB sent/rank", "min..max compute ms"]
    table_rows, rows = [], []
    for i, base in enumerate(per_rank[0]["results"]):
        for phase in ("fwd", "bwd") if has_bwd else ("fwd",):
            nsteps = world  # the backward has one more entry: the return hop of the dK/dV accumulators
            for s in range(len(base[f"{phase}_steps"])):
                # the rank with the most compute in this step sets the ring's pace: its wait is the exposed
                # communication (a faster rank's wait also contains the imbalance)
                slowest = max(per_rank, key=lambda pr: pr["results"][i][f"{phase}_steps"][s]["compute"])
                compute = slowest["results"][i][f"{phase}_steps"][s]["compute"]
                compute_cpu = slowest["results"][i][f"{phase}_steps"][s]["compute_cpu"]
                wait = slowest["results"][i][f"{phase}_steps"][s]["wait"]
                if s == nsteps:  # the return hop: the rank that finished last waits the least, the transfer alone
                    wait = min(pr["results"][i][f"{phase}_steps"][s]["wait"] for pr in per_rank)
                # what this step waits for: the next K/V shard (not after the last step) and, in the backward,
                # the dK/dV accumulator sent by the previous rank after its step s - 1 (none at step 0; step W
                # is the return hop of this rank's own accumulator)
                kv = s + 1 < nsteps
                grad_in = phase == "bwd" and s > 0
                alone = (base["kv_alone"] if kv else 0.0) + (base["grad_alone"] if grad_in else 0.0)
                sent = (base["kv_bytes"] if kv else 0) + (base["grad_bytes"] if phase == "bwd" and s < nsteps else 0)
                overlap = max(0.0, min(1.0, 1 - wait / alone)) if alone > 0 and s < nsteps else None
                rows.append(dict(seqlen=base["seqlen"], layout=base["layout"], phase=phase, step=s, compute=compute,
                                 compute_cpu=compute_cpu, exposed=wait, comm_alone=alone or None, overlap=overlap, bytes_sent=sent))
                spread = [pr["results"][i][f"{phase}_steps"][s]["compute"] for pr in per_rank]
                table_rows.append([str(base["seqlen"]), str(base["s_local"]), base["layout"], phase,
                                   str(s) if s < nsteps else "return",
                                   fmt(1e3 * compute) if s < nsteps else "-",
                                   fmt(1e3 * compute_cpu) if s < nsteps else "-", fmt(1e3 * wait),
                                   fmt(1e3 * alone) if alone else "-",
                                   fmt(overlap) if overlap is not None else "-", fmt(sent / 1e6),
                                   f"{fmt(1e3 * min(spread))}..{fmt(1e3 * max(spread))}" if s < nsteps else ""])
            total = max(pr["results"][i][f"{phase}_total"] for pr in per_rank)
            table_rows.append([str(base["seqlen"]), str(base["s_local"]), base["layout"], phase, "call",
                               fmt(1e3 * total), "", "", "", "", "", ""])
        if base["layout"] == cfg["layouts"][0]:
            notes.append(f"seqlen {base['seqlen']}: argument check (one all_gather per call) "
                         f"{1e3 * base['check']:.3f} ms; K/V exchange alone {1e3 * base['kv_alone']:.2f} ms")
    if has_bwd:
        notes.append("backward 'return': the wait for a rank's own dK/dV accumulator, sent by the previous rank after "
                     "its last step; nothing is left to overlap it (shown: the smallest wait over ranks, i.e. the "
                     "rank that finished last; the others also wait out the imbalance)")
    return {"_table": format_table(headers, table_rows), "_rows": rows, "rows": rows, "per_rank": per_rank,
            "config": cfg, "notes": notes,
            "method": "per step: median over repeats; compute and exposed communication of the rank with the most "
                      "compute in that step; overlap = 1 - exposed / alone"}
