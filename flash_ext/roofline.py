"""A static performance model of the CUDA forward kernel: which resource bounds a call, and how long it
should take, on a named GPU — computed from the plan, without a GPU.

The model (docs/perf.md, "Static model", has the arithmetic and the sources of every number):

* Work per CTA.  A CTA owns ``block_m`` query rows of one (batch, head[, split]) and visits the K/V tiles
  its rows can see (the same ranges as ``block_info.h``: causal diagonal, local window, split share).
  Per visited tile it executes ``4 * block_m * block_n * head_dim`` MMA FLOPs (both GEMMs, the whole
  tile, masked or not) and moves ``tile_smem_bytes`` through shared memory: each warp re-reads its Q slab,
  all of K and all of V with ldmatrix, and cp.async writes K and V once.  Per CTA once: Q written, O
  staged (written and read back).  These per-tile counts are the ones ``scripts/kernel_report.py`` reads
  from the SASS (docs/kernels.md).
* Special functions: per visited tile every score takes one ``ex2`` (MUFU) and every two probabilities one
  fp32 -> 16-bit pack conversion, both on the SM's 16-per-clock units (CUDA C++ Programming Guide,
  arithmetic instruction throughput, compute capability 8.x/9.0): 1.5 ops per score.  At head dim 64 that is
  as much time as the tensor cores' (one score = 128 FMA at 1365 FMA/clk on Hopper's mma.sync = 1.5 ops at
  16/clk).
* Time per CTA, two ways: the **overlap bound** max(tensor, shared memory, special functions), everything
  else (address arithmetic, barriers, latency) hidden under them, a lower bound; and the **serial estimate**
  tensor + shared memory + special functions, no overlap at all.  On the H200 (docs/perf.md, "GPU") the
  measured forward lay at 0.73-1.07 of the serial estimate from 2048 keys up (0.87-1.47 at 512-1024 keys,
  where launch and wave tails count) and at 1.4-3.3x the overlap bound, over 72 rows of two builds (the
  sum was chosen after seeing those rows: an estimate, not a validated predictor).  The overlap bound is the
  ceiling a better schedule (FA3's ping-pong of softmax against the GEMMs) could approach.
* CTAs are list-scheduled in launch order onto ``sms x k`` slots, each with ``1/k`` of an SM, where k is
  the tile's resident CTAs per SM, or fewer when the grid does not fill them (``ceil(ctas / sms)``: the
  hardware spreads a grid over the SMs first); the makespan captures wave quantisation and causal imbalance.
* HBM: compulsory bytes (Q, the K/V tiles some CTA reads, O, LSE, split partials written and read back
  by the combine) at the datasheet bandwidth, scaled by the share of SMs that have a CTA (one SM cannot
  pull the whole bandwidth; fair share assumed).  K/V re-reads by the m-blocks of a head are assumed to
  hit L2.
* Predicted time = max(makespan, HBM time) with the overlap bound per CTA; ``serial`` the same with the
  serial estimate.  The bound: HBM if it is the larger; "waves/occupancy" if the makespan exceeds the
  perfectly balanced compute time by more than 25% (SMs idle for >= 20% of it); otherwise whichever of tensor
  cores / shared memory / special functions has the most work.

Not modelled: launch latency (~ a few microseconds), the combine kernel's own time beyond its bytes, dropout's RNG,
L2 capacity misses, clocks below boost, register-bound latency hiding.  ``python -m flash_ext.bench`` prints
both times next to each measurement on a GPU the model knows; measured on an H200 only (A100: unverified).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, Dict, List, Optional

__all__ = ["GpuSpec", "GPUS", "Roofline", "gpu_spec", "predict", "tile_smem_bytes", "tile_mma_flops",
           "tile_sfu_ops", "kv_tile_ranges"]


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """Published figures of one GPU (sources: docs/perf.md, "GPU figures")."""

    name: str
    sms: int
    clock_ghz: float  # the boost clock the datasheet's tensor-core peak is quoted at
    mma_fma_per_clk_sm: float  # dense fp16/bf16 multiply-adds per clock per SM reachable with mma.sync
    hbm_gb_s: float
    smem_bytes_per_clk_sm: int = 128  # 32 banks x 4 bytes
    smem_per_sm: int = 164 * 1024  # shared memory per SM usable by CTAs
    max_smem_per_block_optin: int = 163 * 1024
    sfu_ops_per_clk_sm: int = 16  # ex2 and fp32 -> 16-bit conversions per clock per SM (cc 8.x and 9.0)

    @property
    def mma_flops(self) -> float:
        """Peak dense MMA FLOP/s of the whole GPU on the mma.sync path."""
        return 2.0 * self.mma_fma_per_clk_sm * self.sms * self.clock_ghz * 1e9

    @property
    def smem_bytes_s(self) -> float:
        """Shared-memory bytes per second of the whole GPU."""
        return float(self.smem_bytes_per_clk_sm) * self.sms * self.clock_ghz * 1e9

    @property
    def sfu_ops_s(self) -> float:
        """Special-function (ex2, conversion) results per second of the whole GPU."""
        return float(self.sfu_ops_per_clk_sm) * self.sms * self.clock_ghz * 1e9

    @property
    def fma_per_smem_byte_bar(self) -> float:
        """FMA per shared byte a kernel needs so that shared memory keeps the tensor cores fed."""
        return self.mma_fma_per_clk_sm / self.smem_bytes_per_clk_sm


GPUS: Dict[str, GpuSpec] = {
    # 312 TFLOP/s dense fp16 = 108 SMs x 1.41 GHz x 2 x 1024 FMA/clk; 2039 GB/s HBM2e (80 GB SXM4).
    "A100": GpuSpec("A100-SXM4-80GB", sms=108, clock_ghz=1.41, mma_fma_per_clk_sm=1024, hbm_gb_s=2039),
    # 989 TFLOP/s dense fp16 (wgmma) = 132 SMs x 1.83 GHz x 2 x 2048 FMA/clk; mma.sync reaches about 2/3
    # of it.  3350 GB/s HBM3.
    "H100": GpuSpec("H100-SXM5-80GB", sms=132, clock_ghz=1.83, mma_fma_per_clk_sm=2048 * 2 / 3, hbm_gb_s=3350,
                    smem_per_sm=228 * 1024, max_smem_per_block_optin=227 * 1024),
    # The H100's SMs and clocks with 141 GB of HBM3e at 4800 GB/s.
    "H200": GpuSpec("H200-SXM-141GB", sms=132, clock_ghz=1.83, mma_fma_per_clk_sm=2048 * 2 / 3, hbm_gb_s=4800,
                    smem_per_sm=228 * 1024, max_smem_per_block_optin=227 * 1024),
}


def gpu_spec(name: str) -> GpuSpec:
    """The spec of a GPU by name ("A100", "H100", "H200"; a device name such as "NVIDIA H100 80GB HBM3"
    works too)."""
    key = name.upper()
    for k, spec in GPUS.items():
        if k in key:
            return spec
    raise ValueError(f"gpu: got {name!r}; the roofline model knows {sorted(GPUS)}")


def tile_mma_flops(block_m: int, block_n: int, head_dim: int) -> int:
    """MMA FLOPs of one K/V tile: S = Q K^T and O += P V over the whole tile."""
    return 4 * block_m * block_n * head_dim


def tile_sfu_ops(block_m: int, block_n: int) -> float:
    """Special-function ops of one K/V tile: an ex2 per score, a pack conversion per two probabilities."""
    return 1.5 * block_m * block_n


def tile_smem_bytes(block_m: int, block_n: int, head_dim: int, num_warps: int, elem: int = 2,
                    q_in_regs: bool = False) -> int:
    """Shared-memory bytes one K/V tile moves: every warp ldmatrix-reads its Q slab (unless Q stays in
    registers), all of K and all of V (warps are stacked along M, each needs the whole K and V tile);
    cp.async writes K and V once.  Per CTA and tile, FMA / byte = block_m * block_n / (block_m + 2 * block_n
    * (num_warps + 1)) with Q re-read: independent of the head dim."""
    q_reads = 0 if q_in_regs else (block_m // num_warps) * head_dim * elem
    per_warp_reads = q_reads + 2 * block_n * head_dim * elem
    return num_warps * per_warp_reads + 2 * block_n * head_dim * elem


def _tile_range(m_block: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, window_left: int,
                window_right: int) -> tuple:
    """[n_min, n_max) of K/V tiles visible to m_block: block_info.h's n_block_min / n_block_max."""
    n_max = math.ceil(seqlen_k / block_n)
    if window_right >= 0:
        last_row = min((m_block + 1) * block_m, seqlen_q) - 1
        end_col = last_row + seqlen_k - seqlen_q + window_right + 1  # one past the last visible key
        n_max = min(n_max, 0 if end_col <= 0 else math.ceil(end_col / block_n))
    n_min = 0
    if window_left >= 0:
        first_col = m_block * block_m + seqlen_k - seqlen_q - window_left
        n_min = 0 if first_col <= 0 else first_col // block_n
    return n_min, n_max


def kv_tile_ranges(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, window_left: int, window_right: int,
                   num_splits: int = 1) -> List[List[int]]:
    """K/V tiles each CTA of one (batch, head) visits: one list per split, one entry per m_block.  Mirrors
    block_info.h (n_block_min, n_block_max, restrict_to_split); the window is after FA2 normalisation
    (causal is (-1, 0); -1 = unbounded)."""
    per_split = math.ceil(math.ceil(seqlen_k / block_n) / num_splits)
    out = []
    for split in range(num_splits):
        counts = []
        for m in range(math.ceil(seqlen_q / block_m)):
            n_min, n_max = _tile_range(m, seqlen_q, seqlen_k, block_m, block_n, window_left, window_right)
            if num_splits > 1:
                n_min, n_max = max(n_min, split * per_split), min(n_max, (split + 1) * per_split)
            counts.append(max(0, n_max - n_min))
        out.append(counts)
    return out


@dataclasses.dataclass
class Roofline:
    """The model's verdict for one call on one GPU (times in seconds)."""

    gpu: GpuSpec
    block_m: int
    block_n: int
    num_warps: int
    head_dim_tile: int
    num_splits: int
    ctas: int
    ctas_per_sm: int
    mma_flops: float  # executed, whole tiles
    useful_flops: float  # 4 b h sq sk d, halved for causal (the bench's convention)
    smem_bytes: float
    hbm_bytes: float
    t_tensor: float  # all MMA work spread evenly over every SM
    t_smem: float  # all shared-memory traffic spread evenly over every SM
    t_hbm: float
    t_schedule: float  # makespan of the CTA list schedule, overlap bound per CTA
    time: float  # the overlap bound: max(t_schedule, t_hbm)
    bound: str
    t_sfu: float = 0.0  # all special-function work spread evenly over every SM
    serial: float = 0.0  # the serial estimate: the same schedule with tensor + smem + sfu per CTA, or HBM

    @property
    def fma_per_smem_byte(self) -> float:
        return self.mma_flops / 2 / self.smem_bytes if self.smem_bytes else math.inf

    @property
    def useful_tflops(self) -> float:
        return self.useful_flops / self.time / 1e12 if self.time > 0 else 0.0

    def __str__(self) -> str:
        return (f"{self.gpu.name}: {self.time * 1e6:.1f} us predicted (overlap bound; serial estimate "
                f"{self.serial * 1e6:.1f} us), {self.bound}-bound "
                f"({self.useful_tflops:.0f} TFLOP/s useful); tensor {self.t_tensor * 1e6:.1f} us, "
                f"smem {self.t_smem * 1e6:.1f} us ({self.fma_per_smem_byte:.1f} FMA/B, bar "
                f"{self.gpu.fma_per_smem_byte_bar:.1f}), special functions {self.t_sfu * 1e6:.1f} us, "
                f"HBM {self.t_hbm * 1e6:.1f} us, schedule "
                f"{self.t_schedule * 1e6:.1f} us over {self.ctas} CTAs in {self.gpu.sms}x{self.ctas_per_sm} slots")


def _makespan(durations: List[float], slots: int) -> float:
    """Greedy list schedule in launch order: each CTA starts on the slot that frees first."""
    if not durations:
        return 0.0
    if len(durations) <= slots:
        return max(durations)
    if min(durations) == max(durations):
        return math.ceil(len(durations) / slots) * durations[0]
    free = [0.0] * slots
    for d in durations:
        t = heapq.heappop(free)
        heapq.heappush(free, t + d)
    return max(free)


def predict(batch: int, heads: int, heads_k: int, seqlen_q: int, seqlen_k: int, head_dim: int, gpu: GpuSpec,
            block_m: int, block_n: int, num_warps: int, head_dim_tile: int, window_left: int = -1,
            window_right: int = -1, num_splits: int = 1, element_size: int = 2, ctas_per_sm: int = 1,
            causal: Optional[bool] = None, q_in_regs: bool = False) -> Roofline:
    """The roofline of one forward call with the given tile on `gpu` (see the module docstring).

    `window_left/right` are after FA2 normalisation (causal = (-1, 0)); `causal` only chooses the useful-FLOP
    convention (defaults to window == (-1, 0)).  `ctas_per_sm` is 1 for every kernel whose registers x
    threads exceed half an SM's 64K registers (the 8-warp tiles), 2 for the 4-warp ones and up to 8 for the
    1-warp decode tile where shared memory allows (dispatch.h, sm80_ctas_per_sm; the plan's "ctas_per_sm").
    `q_in_regs` models a kernel that keeps Q in registers (Sm80Traits::kQInRegs; false today)."""
    if causal is None:
        causal = window_left < 0 and window_right == 0
    tiles = kv_tile_ranges(seqlen_q, seqlen_k, block_m, block_n, window_left, window_right, num_splits)
    per_tile_flops = tile_mma_flops(block_m, block_n, head_dim_tile)
    per_tile_smem = tile_smem_bytes(block_m, block_n, head_dim_tile, num_warps, q_in_regs=q_in_regs)
    per_tile_sfu = tile_sfu_ops(block_m, block_n)
    per_cta_smem = 3 * block_m * head_dim_tile * 2  # Q written once; O staged: written, read back
    sm_flops = gpu.mma_flops / gpu.sms
    sm_smem = gpu.smem_bytes_s / gpu.sms
    sm_sfu = gpu.sfu_ops_s / gpu.sms
    groups = batch * heads
    # The CTAs an SM actually holds: the hardware spreads a grid over the SMs first, so a grid smaller than
    # sms x ctas_per_sm leaves each SM ceil(ctas / sms) of them, each with that share of the SM.
    ctas = groups * len(tiles) * len(tiles[0]) if tiles else 0
    per_sm = max(1, min(ctas_per_sm, math.ceil(ctas / gpu.sms)))
    # Launch order: blockIdx.x = m_block fastest, then batch, then split * heads + head.
    durations: List[float] = []
    serial_durations: List[float] = []
    for split_tiles in tiles:
        parts = [(n * per_tile_flops / sm_flops, (n * per_tile_smem + per_cta_smem) / sm_smem, n * per_tile_sfu / sm_sfu)
                 for n in split_tiles]
        durations += [max(p) * per_sm for p in parts] * groups
        serial_durations += [sum(p) * per_sm for p in parts] * groups
    total_tiles = groups * sum(sum(t) for t in tiles)
    mma_flops = float(total_tiles) * per_tile_flops
    smem_bytes = float(total_tiles) * per_tile_smem + float(ctas) * per_cta_smem
    t_tensor = mma_flops / gpu.mma_flops
    t_smem = smem_bytes / gpu.smem_bytes_s
    t_sfu = float(total_tiles) * per_tile_sfu / gpu.sfu_ops_s
    t_schedule = _makespan(durations, gpu.sms * per_sm)
    t_serial = _makespan(serial_durations, gpu.sms * per_sm)

    # Compulsory HBM bytes: the K/V tiles some m_block reads (once per K/V head), Q, O, LSE, split partials.
    spans = sorted(_tile_range(m, seqlen_q, seqlen_k, block_m, block_n, window_left, window_right)
                   for m in range(math.ceil(seqlen_q / block_m)))
    read_tiles, reach = 0, 0  # size of the union of the [n_min, n_max) spans
    for lo, hi in spans:
        lo = max(lo, reach)
        if hi > lo:
            read_tiles += hi - lo
            reach = hi
    kv_rows = min(seqlen_k, read_tiles * block_n)
    e = element_size
    hbm = (2.0 * batch * kv_rows * heads_k * head_dim * e + 2.0 * batch * seqlen_q * heads * head_dim * e
           + 4.0 * batch * heads * seqlen_q)
    if num_splits > 1:
        hbm += 2.0 * num_splits * batch * heads * seqlen_q * (head_dim + 1) * 4
    busy_sms = min(gpu.sms, ctas)
    t_hbm = hbm / (gpu.hbm_gb_s * 1e9 * busy_sms / gpu.sms) if busy_sms else 0.0

    useful = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim * (0.5 if causal else 1.0)
    time = max(t_schedule, t_hbm)
    balanced = max(t_tensor, t_smem, t_sfu)
    if t_hbm >= t_schedule:
        bound = "HBM"
    elif t_schedule > 1.25 * balanced:
        bound = "waves/occupancy"
    elif t_sfu >= max(t_tensor, t_smem):
        bound = "special functions"
    elif t_smem > t_tensor:
        bound = "shared memory"
    else:
        bound = "tensor cores"
    return Roofline(gpu, block_m, block_n, num_warps, head_dim_tile, num_splits, ctas, ctas_per_sm, mma_flops,
                    useful, smem_bytes, hbm, t_tensor, t_smem, t_hbm, t_schedule, time, bound, t_sfu,
                    max(t_serial, t_hbm))


def predict_plan(plan: Dict[str, Any], gpu: GpuSpec, requested_splits: int = 0) -> Roofline:
    """The roofline of an ``explain()`` plan on `gpu`.  On a CUDA device the plan's own tile and split count
    are used; otherwise (a CPU plan) the GPU tile of dispatch.h for this head dim and the split heuristic
    with the GPU's SM count, as the op would choose them on that GPU."""
    from . import _C

    prob = plan["kernel_problem"]
    causal = bool(plan["flags"]["causal"])
    window_left, window_right = plan["window"]
    if str(plan.get("backend", "")).startswith("Sm80"):
        block_m, block_n = plan["block_m"], plan["block_n"]
        num_warps, hd_tile, splits = plan["threads_per_cta"] // 32, plan["head_dim_tile"], plan["num_splits"]
        ctas_per_sm = plan.get("ctas_per_sm", 1)
    else:
        flags = plan["flags"]

        def tile(num_splits: int) -> Dict[str, Any]:
            # The variant (and with it the warps) depends on the split count; the M x N tile does not.
            return _C.gpu_tile_config(prob["d"], causal, gpu.max_smem_per_block_optin, prob["seqlen_q"],
                                      prob["seqlen_k"], bool(plan.get("varlen", False)),
                                      bool(flags.get("local", False)), bool(flags.get("alibi", False)),
                                      bool(flags.get("softcap", False)), num_splits,
                                      bool(flags.get("dropout", False)))

        t = tile(1)
        if requested_splits > 0:
            splits = requested_splits
        else:  # set_splits (csrc/ops/common.cpp): the slots are SMs x resident CTAs of the tile
            ctas = prob["b"] * prob["h"] * math.ceil(prob["seqlen_q"] / t["block_m"])
            splits = _C.num_splits_heuristic(ctas, gpu.sms * t["ctas_per_sm"], math.ceil(prob["seqlen_k"] / t["block_n"]))
        if splits > 1:
            t = tile(splits)
        block_m, block_n, num_warps, hd_tile = t["block_m"], t["block_n"], t["num_warps"], t["head_dim_tile"]
        ctas_per_sm = t["ctas_per_sm"]
    return predict(prob["b"], prob["h"], prob["h_k"], prob["seqlen_q"], prob["seqlen_k"], prob["d"], gpu,
                   block_m, block_n, num_warps, hd_tile, window_left, window_right, splits,
                   min(prob["element_size"], 2), ctas_per_sm=ctas_per_sm, causal=causal)


def _grid_table(gpus: List[str]) -> str:
    """Predictions for the GPU benchmark's default grid (bf16, batch x seqlen = 16k tokens, hidden 2048,
    head dims 64 and 128, causal and not) and GQA decode steps, as a markdown table.  The problems are given
    as the kernel sees them (a decode step's 4 query heads per K/V head are 4 rows, as swap_query_groups
    makes them), so the table needs no CPU kernel of those head dims in this build."""
    rows = ["| GPU | problem (kernel's view) | tile, splits | overlap / serial us | useful TFLOP/s (overlap) | bound | "
            "tensor / smem / sfu / HBM / schedule us |", "|---|---|---|---|---|---|---|"]
    # (b, h, h_k, seqlen_q, seqlen_k, d, causal)
    problems = [(16384 // s, 2048 // d, 2048 // d, s, s, d, c) for d in (64, 128) for c in (False, True)
                for s in (512, 2048, 8192, 16384)]
    problems += [(b, 8, 8, 4, sk, 128, False) for b, sk in ((1, 8192), (8, 8192), (8, 65536))]
    for name in gpus:
        for b, h, hk, sq, sk, d, causal in problems:
            plan = {"backend": "model", "kernel_problem": {"b": b, "h": h, "h_k": hk, "seqlen_q": sq,
                                                           "seqlen_k": sk, "d": d, "element_size": 2},
                    "flags": {"causal": causal}, "window": [-1, 0 if causal else -1]}
            r = predict_plan(plan, gpu_spec(name))
            shape = f"b={b} h={h}/{hk} sq={sq} sk={sk} d={d}{' causal' if causal else ''}"
            rows.append(f"| {name} | {shape} | {r.block_m}x{r.block_n}/{r.num_warps}w, {r.num_splits} | "
                        f"{r.time * 1e6:.1f} / {r.serial * 1e6:.1f} | {r.useful_tflops:.0f} | {r.bound} | "
                        f"{r.t_tensor * 1e6:.1f} / {r.t_smem * 1e6:.1f} / {r.t_sfu * 1e6:.1f} / "
                        f"{r.t_hbm * 1e6:.1f} / {r.t_schedule * 1e6:.1f} |")
    return "\n".join(rows)


def _decode_tiles_table(gpus: List[str]) -> str:
    """What-if: a GQA decode step (32 query / 8 K/V heads = 4 rows per K/V head, d = 128, bf16) with the
    decode tile dispatch.h picks and two larger ones, each with its resident CTAs per SM and the splits
    dispatch.h's heuristic gives it over that many slots."""
    from . import _C

    rows = ["| GPU | b, sk | tile (M x N / warps) | splits | overlap / serial us | bound | "
            "tensor / smem / sfu / HBM / schedule us |", "|---|---|---|---|---|---|---|"]
    for name in gpus:
        spec = gpu_spec(name)
        for b, sk in ((1, 8192), (8, 8192), (8, 65536)):
            # dispatch.h's tile for the step (4 rows: the "decode" variant's), to mark the row it runs.
            cur = _C.gpu_tile_config(128, False, spec.max_smem_per_block_optin, 4, sk, False, False, False, False,
                                     2, False)
            for bm, bn, warps in ((128, 64, 8), (64, 64, 4), (16, 64, 1)):
                per_sm = _C.gpu_ctas_per_sm(bm, bn, warps, 128, spec.max_smem_per_block_optin)
                splits = _C.num_splits_heuristic(b * 8 * math.ceil(4 / bm), spec.sms * per_sm, math.ceil(sk / bn))
                r = predict(b, 8, 8, 4, sk, 128, spec, bm, bn, warps, 128, num_splits=splits, ctas_per_sm=per_sm)
                today = " (today)" if (bm, bn, warps) == (cur["block_m"], cur["block_n"], cur["num_warps"]) else ""
                rows.append(f"| {name} | {b}, {sk} | {bm} x {bn} / {warps}{today} | {splits} | "
                            f"{r.time * 1e6:.1f} / {r.serial * 1e6:.1f} | {r.bound} | {r.t_tensor * 1e6:.1f} / "
                            f"{r.t_smem * 1e6:.1f} / {r.t_sfu * 1e6:.1f} / {r.t_hbm * 1e6:.1f} / "
                            f"{r.t_schedule * 1e6:.1f} |")
    return "\n".join(rows)
