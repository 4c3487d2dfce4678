"""Static per-iteration metrics of a kernel's main loop, read from `cuobjdump -sass` text.

What is counted, per warp, for one iteration of the main loop (one K/V tile of the attention forward):

* ``hmma``: tensor-core MMA instructions; ``fma`` their multiply-adds (HMMA.16816: 16 x 8 x 16 = 2048).
* ``ldsm`` / ``ldsm_bytes``: ldmatrix loads; ``.4`` moves four 8x8 16-bit matrices = 512 bytes per warp.
* ``lds_bytes`` / ``sts_bytes``: plain shared loads / stores (32 lanes x width).
* ``ldgsts`` / ``ldgsts_bytes``: cp.async global->shared copies (bytes written to shared memory).
* ``ldg`` / ``ldg_bytes``: plain global loads.  ``bar``: CTA barriers.  ``vote``: warp votes (the online
  softmax's per-tile decision whether to rescale, softmax.h; not on a CTA's first tile).
* ``instructions``: instructions issued (``@!PT`` padding excluded).
* ``smem_bytes`` = ldsm + lds + sts + ldgsts bytes: everything the loop moves through shared memory, and
  ``fma_per_smem_byte`` = fma / smem_bytes.  Every warp runs the same code, so the per-warp ratio is
  the CTA's.

How the loop is found (and the limits of the method):

1. Instructions are read with their addresses; a ``BRA`` whose target is at or before its own address
   is a back edge, and [target, branch] its loop region (nvcc lays a loop out contiguously, header
   first, latch branch last).  The main loop is the region holding the most HMMA instructions; ties go to
   the smallest such region (the innermost loop that holds them all).
2. The region is cut into basic blocks (leaders: the header, branch targets inside the region, the
   instruction after a branch or EXIT).  Forward edges inside the region form a DAG in address order;
   edges leaving the region (loop exits, divergence slow paths placed after the function body) are
   dropped, and so are the back edges of any inner loop (an inner loop's body is counted once:
   ``inner_loops`` says when that happened).
3. Each metric is summed along the paths from the header to the latch branch.  ``steady`` is one path,
   the steady-state iteration of an interior tile: the most HMMA, then the most cp.async copies (the
   next tiles' loads issued), then the most votes (not a CTA's first tile), then the fewest instructions
   (no zero-fill of rows past the sequence end, no mask code, no rescale).  ``min`` / ``max`` give each metric's range over all paths (they differ where an
   iteration has a conditional part: the next K tile's copy skipped on the last iteration, predicated
   zero-fill copies of a partial tile, masking of a diagonal tile).  ``fma_per_smem_byte`` is the
   steady path's.

Static counts, not a trace: a predicated-off instruction (``@P0 LDGSTS`` past the sequence end) counts
as executed, every lane is assumed active, bytes are per warp, and a loop body the compiler duplicated
into two regions (e.g. a peeled first iteration before the loop) is seen only as the region that
branches back.  Indirect branches (BRX, JMX) are not followed.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

# `/*0760*/   @!P1 BRA 0x760 ;` (cuobjdump) - the encoding comment after the `;` is ignored.
_INSTR = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(@!?U?P(?:T|\d+)\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_ARCH = re.compile(r"(?:code for|arch =)\s*sm_(\d+)")
_TARGET = re.compile(r"0x([0-9a-fA-F]+)\s*$")

# Multiply-adds per warp of one HMMA, by shape (m n k).
_HMMA_FMA = {"16816": 16 * 8 * 16, "1688": 16 * 8 * 8, "884": 8 * 8 * 4}

METRICS = ("instructions", "hmma", "fma", "ldsm", "ldsm_bytes", "lds_bytes", "sts_bytes", "ldgsts",
           "ldgsts_bytes", "ldg", "ldg_bytes", "bar", "vote", "smem_bytes")


@dataclasses.dataclass
class Instr:
    addr: int
    guard: str  # "" (always), "@P0", "@!P1", "@PT", ...
    opcode: str
    operands: str

    @property
    def conditional(self) -> bool:
        return bool(self.guard) and self.guard not in ("@PT", "@!PT")

    @property
    def never(self) -> bool:
        """`@!PT`: never executes (nvcc pads with such instructions)."""
        return self.guard == "@!PT"

    @property
    def branch_target(self) -> int | None:
        if self.opcode.split(".")[0] != "BRA":
            return None
        m = _TARGET.search(self.operands)
        return int(m[1], 16) if m else None


@dataclasses.dataclass
class Function:
    name: str
    arch: int | None
    instrs: list[Instr]


def parse_sass(text: str) -> list[Function]:
    """The functions of `cuobjdump -sass` output, with their instructions (addresses kept)."""
    functions: list[Function] = []
    arch = None
    for line in text.splitlines():
        a = _ARCH.search(line)
        if a:
            arch = int(a[1])
            continue
        f = _FUNCTION.match(line)
        if f:
            functions.append(Function(f[1], arch, []))
            continue
        m = _INSTR.match(line)
        if m and functions:
            functions[-1].instrs.append(Instr(int(m[1], 16), (m[2] or "").strip(), m[3], m[4].strip()))
    return functions


def _width_bytes(opcode: str, default: int = 4) -> int:
    """Bytes per lane of a memory opcode from its width suffix (.128, .64, .U8, .S16, ...)."""
    for part in opcode.split(".")[1:]:
        if part in ("128", "64", "32"):
            return int(part) // 8
        if part in ("U8", "S8"):
            return 1
        if part in ("U16", "S16"):
            return 2
    return default


def instr_metrics(ins: Instr) -> dict[str, int]:
    """This instruction's contribution to the METRICS (per warp, all lanes active)."""
    op = ins.opcode
    base = op.split(".")[0]
    out: dict[str, int] = {}
    if ins.never:
        return out
    out["instructions"] = 1
    if base == "HMMA":
        shape = op.split(".")[1] if "." in op else ""
        out["hmma"] = 1
        out["fma"] = _HMMA_FMA.get(shape, 0)
    elif base == "LDSM":
        parts = op.split(".")
        n = int(parts[-1]) if parts[-1] in ("2", "4") else 1
        out["ldsm"] = 1
        out["ldsm_bytes"] = 128 * n  # n 8x8 matrices of 16-bit elements
    elif base == "LDS":
        out["lds_bytes"] = 32 * _width_bytes(op)
    elif base == "STS":
        out["sts_bytes"] = 32 * _width_bytes(op)
    elif base == "LDGSTS":
        out["ldgsts"] = 1
        out["ldgsts_bytes"] = 32 * _width_bytes(op)
    elif base == "LDG":
        out["ldg"] = 1
        out["ldg_bytes"] = 32 * _width_bytes(op)
    elif base == "BAR" and ".SYNC" in op:
        out["bar"] = 1
    elif base == "VOTE":
        out["vote"] = 1
    out["smem_bytes"] = sum(out.get(k, 0) for k in ("ldsm_bytes", "lds_bytes", "sts_bytes", "ldgsts_bytes"))
    return out


@dataclasses.dataclass
class LoopMetrics:
    header: int  # address of the loop header (the back edge's target)
    latch: int  # address of the back-edge branch
    static_instructions: int  # instructions in the region, all paths
    paths: int  # header-to-latch paths through the region's DAG
    inner_loops: int  # back edges inside the region other than the latch (their bodies counted once)
    steady: dict[str, int]  # the steady-state path (see steady_key)
    min: dict[str, int]  # per metric, over all paths
    max: dict[str, int]

    @property
    def fma_per_smem_byte(self) -> float:
        b = self.steady["smem_bytes"]
        return self.steady["fma"] / b if b else float("inf")


def steady_key(c: dict[str, int]) -> tuple[int, int, int, int]:
    """Order of paths; the largest is the steady-state iteration: the most MMAs, then the most cp.async
    copies (the next tiles' loads issued), then the most votes (a CTA's first tile skips the softmax's
    vote, and would otherwise pass for the cheapest path), then the fewest instructions (no zero-fill, no
    mask code, no rescale: the path of an interior, fully visible tile)."""
    return (c["hmma"], c["ldgsts"], c["vote"], -c["instructions"])


def _back_edges(instrs: list[Instr]) -> list[tuple[int, int]]:
    """(index of header, index of latch branch) for every backward branch."""
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    out = []
    for i, ins in enumerate(instrs):
        t = ins.branch_target
        if t is not None and t <= ins.addr and t in index:
            out.append((index[t], i))
    return out


def _static_count(instrs: Iterable[Instr], key: str) -> int:
    return sum(instr_metrics(ins).get(key, 0) for ins in instrs)


def main_loop(fn: Function, metrics: Callable[[Instr], dict[str, int]] = instr_metrics,
              keys: tuple[str, ...] = METRICS) -> LoopMetrics | None:
    """Per-iteration metrics of the loop with the most HMMA instructions; None if no loop has any.  `metrics`
    and `keys` add counts of one's own (sass_mix.py: instruction classes); they must include METRICS."""
    instrs = fn.instrs
    edges = _back_edges(instrs)
    scored = [(_static_count(instrs[h:l + 1], "hmma"), -(l - h), h, l) for h, l in edges]
    scored = [s for s in scored if s[0] > 0]
    if not scored:
        return None
    _, _, head, latch = max(scored)
    region = instrs[head:latch + 1]
    addr_to_pos = {ins.addr: p for p, ins in enumerate(region)}
    header_addr, latch_addr = region[0].addr, region[-1].addr

    # Basic blocks of the region.
    leaders = {0}
    for p, ins in enumerate(region):
        t = ins.branch_target
        if t is not None and t in addr_to_pos:
            leaders.add(addr_to_pos[t])
        if (t is not None or ins.opcode.startswith("EXIT")) and p + 1 < len(region):
            leaders.add(p + 1)
    starts = sorted(leaders)
    blocks = [(s, (starts[j + 1] if j + 1 < len(starts) else len(region))) for j, s in enumerate(starts)]
    block_of = {s: j for j, (s, _) in enumerate(blocks)}

    inner = 0
    succ: list[list[int]] = [[] for _ in blocks]
    reaches_latch = [False] * len(blocks)
    for j, (s, e) in enumerate(blocks):
        last = region[e - 1]
        t = last.branch_target
        falls_through = True
        if t is not None:
            falls_through = last.conditional
            if e - 1 == len(region) - 1:
                reaches_latch[j] = True  # the latch itself: taking it ends the iteration
            elif t in addr_to_pos and t > last.addr:
                succ[j].append(block_of[addr_to_pos[t]])
            elif t in addr_to_pos:
                inner += 1  # an inner loop's back edge: its body is counted once
        elif last.opcode.startswith("EXIT"):
            falls_through = last.conditional
        if falls_through and j + 1 < len(blocks) and e - 1 != len(region) - 1:
            succ[j].append(j + 1)

    counts = []
    for s, e in blocks:
        c = dict.fromkeys(keys, 0)
        for ins in region[s:e]:
            for k, v in metrics(ins).items():
                c[k] += v
        counts.append(c)

    # Sums along header-to-latch paths.  Address order is a topological order of the forward edges, and
    # the lexicographic steady_key is compatible with addition, so one pass keeps each block's best prefix.
    def add(a: dict, b: dict) -> dict:
        return {k: a[k] + b[k] for k in keys}

    n = len(blocks)
    lo: list[dict | None] = [None] * n
    hi: list[dict | None] = [None] * n
    best: list[dict | None] = [None] * n
    npaths = [0] * n
    lo[0] = hi[0] = best[0] = counts[0]
    npaths[0] = 1
    out_lo = out_hi = out_best = None
    total_paths = 0
    for j in range(n):
        if best[j] is None:
            continue
        if reaches_latch[j]:
            total_paths += npaths[j]
            out_lo = lo[j] if out_lo is None else {k: min(out_lo[k], lo[j][k]) for k in keys}
            out_hi = hi[j] if out_hi is None else {k: max(out_hi[k], hi[j][k]) for k in keys}
            out_best = best[j] if out_best is None or steady_key(best[j]) > steady_key(out_best) else out_best
        for s in succ[j]:
            c_lo, c_hi, c_best = add(lo[j], counts[s]), add(hi[j], counts[s]), add(best[j], counts[s])
            lo[s] = c_lo if lo[s] is None else {k: min(lo[s][k], c_lo[k]) for k in keys}
            hi[s] = c_hi if hi[s] is None else {k: max(hi[s][k], c_hi[k]) for k in keys}
            best[s] = c_best if best[s] is None or steady_key(c_best) > steady_key(best[s]) else best[s]
            npaths[s] += npaths[j]
    if out_best is None:
        return None
    return LoopMetrics(header_addr, latch_addr, len(region), total_paths, inner, out_best, out_lo, out_hi)
