#!/usr/bin/env python3
"""Resource usage of every compiled forward and backward kernel, main-loop metrics of both; the no-spill
gate and the forward's feed-rate gate.

Reads the CUDA binaries embedded in the built extension (or object files, or fatbins; several are merged into
one table) with ``cuobjdump`` (from the CUDA toolkit, or the ``nvidia-cuda-cuobjdump`` pip package) and writes
markdown tables:

* resources (``--dump-resource-usage``) of the forward and backward kernels (the attention kernels and the
  backward's pre/postprocess): registers, shared memory, stack/local bytes, estimated CTAs/SM;
* the main loop of the forward and of the backward, read from the SASS (``-sass``, parsed by ``sass_loop.py``,
  whose docstring gives the method and its limits): per iteration and warp the HMMA, ldmatrix, shared stores,
  cp.async and global loads, and FMA per shared-memory byte, next to the arch's bar (``FEED_BAR``) for the
  forward (the backward's table is informational).

With ``--gate`` it exits non-zero if any kernel has a stack frame or local memory (register spills land
there), or if a forward kernel's FMA per shared-memory byte is below its arch's bar and not covered by a
waiver (``FEED_WAIVERS``), or is below its waiver's floor, or a waiver has become unnecessary.

    python scripts/kernel_report.py flash_ext/_C*.so --out docs/kernels.md --gate
"""
from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sass_loop  # noqa: E402

# FMA per shared-memory byte a main loop must reach so that shared memory can feed the tensor cores at the
# mma.sync rate: (dense fp16/bf16 FMA per clock per SM) / (shared-memory bytes per clock per SM).  Shared
# memory delivers 32 banks x 4 bytes = 128 B/clk/SM on sm_80 and sm_90.  sm_80 (A100): 1024 FMA/clk/SM
# (312 TFLOP/s = 108 SMs x 1.41 GHz x 2 x 1024) -> 1024 / 128 = 8.0.  sm_90 (H100/H200): 2048 FMA/clk/SM
# for wgmma (989 TFLOP/s = 132 x 1.83 GHz x 2 x 2048), of which mma.sync reaches about 2/3 -> 1365 / 128
# = 10.7.  Sources and the roofline built on the same numbers: docs/perf.md, flash_ext/roofline.py.
FEED_BAR = {80: 8.0, 90: 2048 * 2 / 3 / 128}
FEED_EPS = 1e-9  # 4 warps x 32 rows gives exactly 32/3 = sm_90's bar

# Kernels allowed below the bar for now, with the floor they must not fall below (a regression gate).  Per
# K/V tile a warp reads its Q rows, all of K and V (ldmatrix) and writes its share of the cp.async copy:
# rows x N / (rows + 2 N + 2 N / warps) FMA per byte for a 128-row tile, whatever the head dim (the SASS
# agrees, docs/kernels.md):
#   8 warps x 16 rows, N = 64: 6.4 (N = 32: 5.8)   -- below both bars; the variants that spill with 4 warps
#   4 warps x 32 rows, N = 32: 9.1                  -- meets sm_80's 8.0, below sm_90's 10.7
#   4 warps x 32 rows, N = 64: 10.7                 -- meets both; no waiver
# dispatch.h (sm80_four_warp_block_n) takes the highest of these that compiles without spills per head dim
# and variant; the rest wait for a body with fewer live registers (issue #14 item 3).  Key: (arch, head dim,
# warps, keys per tile), so a waiver covers one tile; the floors sit below those values, they do not copy
# them.  The 8-warp entries at head dims 32/64 serve the baseline build (FLASH_EXT_GPU_FWD_WARPS=8).
#
# The decode tile (dispatch.h, variant "decode": at most 16 query rows) is below the bar by design: its one
# warp writes K and V with cp.async and reads them back, 16 x 64 / (16 + 2 x 64 x 2) = 3.8 FMA per byte
# (head dim 256: 2 warps x 16 rows x 16 keys, 32 x 16 / (32 + 2 x 16 x 3) = 4.0).  It does not aim at the
# tensor cores: a decode step does ~4 FLOPs per K/V byte read from HBM, and what the tile minimises is
# shared-memory traffic per HBM byte (1-2 reads of each K/V tile instead of the 8-warp tile's 8;
# docs/perf.md, "Decode").
# Head dim 192's `dropout` kernel has 32-key tiles (5.8, as at 256), where 64 keys spilled (dispatch.h).
FEED_WAIVERS = {(arch, hd, 8, 64): 6.0 for arch in (80, 90) for hd in (32, 64, 96, 128, 192)}
FEED_WAIVERS.update({(arch, hd, 8, 32): 5.5 for arch in (80, 90) for hd in (192, 256)})
FEED_WAIVERS.update({(90, hd, 4, 32): 9.0 for hd in (32, 64, 96, 128)})
FEED_WAIVERS.update({(arch, hd, 1, 64): 3.3 for arch in (80, 90) for hd in (32, 64, 96, 128, 192)})
FEED_WAIVERS.update({(arch, 256, 2, 16): 3.5 for arch in (80, 90)})

# Per-SM limits used for the occupancy estimate: registers, max dynamic shared memory per SM (bytes).
SM_LIMITS = {80: (65536, 164 * 1024), 86: (65536, 100 * 1024), 89: (65536, 100 * 1024), 90: (65536, 228 * 1024)}


def find_tool(name: str) -> str | None:
    """`name` from PATH, else CUDA_HOME/bin, else an nvidia-* pip package (they install into nvidia/cu*/bin)."""
    exe = shutil.which(name)
    if exe:
        return exe
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if os.path.exists(os.path.join(home, "bin", name)):
        return os.path.join(home, "bin", name)
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for p in sorted(glob.glob(os.path.join(root, "**", "bin", name), recursive=True)):
            return p
    return None


def find_cuobjdump() -> str:
    exe = find_tool("cuobjdump")
    if exe is None:
        sys.exit("kernel_report: cuobjdump not found (install nvidia-cuda-cuobjdump or a CUDA toolkit)")
    return exe


def sass_env() -> dict[str, str]:
    """An environment in which `cuobjdump -sass` works: it runs `nvdisasm` from PATH and fails (exit 1, no
    SASS) without it; the pip packages do not put either on PATH."""
    nvdisasm = find_tool("nvdisasm")
    if nvdisasm is None:
        sys.exit("kernel_report: nvdisasm not found; `cuobjdump -sass` needs it on PATH (install "
                 "nvidia-cuda-nvdisasm or a CUDA toolkit, or pass --no-loops to skip the SASS main-loop metrics)")
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")
    return env


def demangle(names: list[str]) -> list[str]:
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        return out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return names


NOTES_MARKER = "<!-- notes: kept by scripts/kernel_report.py when it regenerates the table above -->"

FLAG_NAMES = ("even_mn", "even_k", "causal", "local", "alibi", "softcap", "split", "dropout")


# Kernels the report covers (mangled-name substrings) and what each is called in the table.
KERNELS = {"flash_fwd_kernel": "fwd", "flash_bwd_kernel": "bwd", "bwd_preprocess_kernel": "bwd pre",
           "bwd_postprocess_kernel": "bwd post"}


def _flags(demangled: str) -> str:
    f = re.search(r"KernelFlags<(.*)>\s*>\s*\(", demangled)
    if not f:
        return ""
    vals = [x.strip() for x in re.split(r",\s*(?![^<]*>)", f[1])]
    return " ".join(f"{n}={'T' if 'true' in v else 'F' if 'false' in v else 'rt'}"
                    for n, v in zip(FLAG_NAMES, vals) if n != "split" or "Sm80BwdTraits" not in demangled)


def describe(demangled: str) -> dict | None:
    # Sm80Traits<head dim, M, N, warps, element[, architecture policy]> (likewise Sm80BwdTraits below)
    m = re.search(r"Sm80Traits<(\d+), (\d+), (\d+), (\d+), cutlass::(\w+)", demangled)
    if m:
        hd, bm, bn, warps = int(m[1]), int(m[2]), int(m[3]), int(m[4])
        return {"kernel": "fwd", "hd": hd, "bm": bm, "bn": bn, "warps": warps, "dtype": m[5].replace("_t", ""),
                "flags": _flags(demangled), "smem": (bm + 2 * bn) * hd * 2}
    m = re.search(r"Sm80BwdTraits<(\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (true|false), cutlass::(\w+)",
                  demangled)
    if m:
        hd, bm, bn, warps, dbl = int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[8] == "true"
        return {"kernel": "bwd", "hd": hd, "bm": bm, "bn": bn, "warps": warps, "dtype": m[9].replace("_t", ""),
                "flags": _flags(demangled), "smem": ((3 if dbl else 2) * bm * hd + 2 * bn * hd + 2 * bm * bn) * 2}
    m = re.search(r"(bwd_preprocess_kernel|bwd_postprocess_kernel)<cutlass::(\w+)>", demangled)
    if m:
        return {"kernel": KERNELS[m[1]], "hd": 0, "bm": 0, "bn": 0, "warps": 4, "dtype": m[2].replace("_t", ""),
                "flags": "", "smem": 0}
    return None


def parse(so: str, cuobjdump: str) -> list[dict]:
    text = subprocess.run([cuobjdump, "--dump-resource-usage", so], capture_output=True, text=True, check=True).stdout
    rows, arch = [], None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        a = re.match(r"arch = sm_(\d+)", line.strip())
        if a:
            arch = int(a[1])
        fn = re.match(r"\s*Function (\S+):", line)
        if fn and any(k in fn[1] for k in KERNELS) and i + 1 < len(lines):
            usage = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", lines[i + 1]))
            rows.append({"arch": arch, "mangled": fn[1], "reg": int(usage.get("REG", 0)),
                         "stack": int(usage.get("STACK", 0)), "local": int(usage.get("LOCAL", 0))})
    for row, name in zip(rows, demangle([r["mangled"] for r in rows])):
        row.update(describe(name) or {"kernel": "?", "hd": 0, "bm": 0, "bn": 0, "warps": 0, "dtype": "?",
                                      "flags": name, "smem": 0})
        regs_per_sm, smem_per_sm = SM_LIMITS.get(row["arch"], SM_LIMITS[80])
        threads = 32 * row["warps"] if row["warps"] else 128
        by_regs = regs_per_sm // max(1, row["reg"] * threads)
        by_smem = smem_per_sm // max(1, row["smem"]) if row["smem"] else 32
        row["ctas"] = min(by_regs, by_smem)
    return rows


def merge_rows(rows: list[dict]) -> list[dict]:
    """The rows of several binaries (CI's build and scratch compiles of other units) as one table: a kernel that
    more than one of them holds (same arch and mangled name, e.g. a shared template) once, from the first; in
    the order kernel kind, arch, head dim, dtype, flags, whichever binary each row came from."""
    order = {"fwd": 0, "bwd": 1, "bwd pre": 2, "bwd post": 3, "?": 4}
    first: dict[tuple, dict] = {}
    for r in rows:
        first.setdefault((r["arch"], r["mangled"]), r)
    return sorted(first.values(), key=lambda r: (order[r["kernel"]], r["arch"], r["hd"], r["dtype"], r["flags"]))


def loop_metrics(so: str, cuobjdump: str) -> dict[tuple[int, str], sass_loop.LoopMetrics | None]:
    """Main-loop metrics of every forward and backward kernel in `so`, keyed by (arch, mangled name)."""
    done = subprocess.run([cuobjdump, "-sass", so], capture_output=True, text=True, env=sass_env())
    if done.returncode != 0:
        sys.exit(f"kernel_report: `{cuobjdump} -sass {so}` failed (exit {done.returncode}): {done.stderr.strip()}")
    text = done.stdout
    return {(fn.arch, fn.name): sass_loop.main_loop(fn) for fn in sass_loop.parse_sass(text)
            if "flash_fwd_kernel" in fn.name or "flash_bwd_kernel" in fn.name}


def feed_check(row: dict) -> str | None:
    """Why `row` fails the feed-rate gate, or None."""
    lm = row.get("loop")
    if lm is None:
        return "no main loop with HMMA found in the SASS"
    ratio, bar = lm.fma_per_smem_byte, FEED_BAR.get(row["arch"])
    if bar is None:
        return None
    floor = FEED_WAIVERS.get((row["arch"], row["hd"], row["warps"], row["bn"]))
    if ratio >= bar - FEED_EPS:
        return None if floor is None else f"meets the bar {bar:.1f}: remove its FEED_WAIVERS entry"
    if floor is None:
        return f"{ratio:.2f} FMA/B below the bar {bar:.1f}"
    return None if ratio >= floor else f"{ratio:.2f} FMA/B below its waiver floor {floor:.1f}"


def loop_table(rows: list[dict], gated: bool = True) -> str:
    head = ("| arch | head dim | dtype | tile (M x N, warps) | flags | HMMA (FMA) | LDSM (bytes) | cp.async (bytes) "
            "| STS / LDS bytes | LDG | BAR | instructions | FMA / smem byte | bar |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")

    def rng(lm: sass_loop.LoopMetrics, key: str) -> str:
        lo, st, hi = lm.min[key], lm.steady[key], lm.max[key]
        return f"{st}" if lo == hi else f"{st} ({lo}-{hi})"

    body = ""
    for r in rows:
        lm = r.get("loop")
        tile = f"{r['bm']} x {r['bn']}, {r['warps']}"
        if lm is None:
            body += f"| sm_{r['arch']} | {r['hd']} | {r['dtype']} | {tile} | {r['flags']} | no loop found |||||||||\n"
            continue
        s = lm.steady
        bar = FEED_BAR.get(r["arch"]) if gated else None
        verdict = "-" if bar is None else (f"{bar:.1f} met" if lm.fma_per_smem_byte >= bar - FEED_EPS else f"{bar:.1f} **below**")
        body += (f"| sm_{r['arch']} | {r['hd']} | {r['dtype']} | {tile} | {r['flags']} | {s['hmma']} ({s['fma']}) | "
                 f"{s['ldsm']} ({s['ldsm_bytes']}) | {rng(lm, 'ldgsts')} ({s['ldgsts_bytes']}) | "
                 f"{rng(lm, 'sts_bytes')} / {rng(lm, 'lds_bytes')} | {rng(lm, 'ldg')} | {s['bar']} | "
                 f"{rng(lm, 'instructions')} | {lm.fma_per_smem_byte:.2f} | {verdict} |\n")
    return head + body


LOOP_TEXT = """## Main loop, per iteration and warp (from the SASS)

One iteration is one K/V tile.  Counts per warp along the steady-state path (an interior tile: both
next copies issued, no zero-fill, no mask); where other paths differ, their range follows in
parentheses.  Bytes are per warp: LDSM.x4 512, cp.async.16 512 (written to shared memory), STS.128 512.
FMA / smem byte = HMMA x 2048 / (LDSM + LDS + STS + cp.async bytes); the bar is the ratio at which
shared memory (128 B/clk/SM) feeds the tensor cores at the mma.sync rate (sm_80: 1024 FMA/clk/SM ->
8.0; sm_90: about 2/3 of 2048 -> 10.7; arithmetic and sources in `docs/perf.md`).  Kernels below the bar
with 8 warps x 16 rows are waived to a floor (6.0; 5.5 with 32-key tiles); 4 warps x 32 rows meet sm_80's bar
with 32-key tiles (9.1; waived to 9.0 on sm_90) and both bars with 64-key tiles, and dispatch.h uses them where
they do not spill (`FEED_WAIVERS` in `scripts/kernel_report.py`, `sm80_four_warp_block_n`).
The one-warp decode tile (16 rows, variant `decode`) is waived to 3.3: it is meant to be bound by HBM, not by
the tensor cores (its arithmetic is in `kernel_report.py` and `docs/perf.md`, "Decode").
Method and limits: `scripts/sass_loop.py` (loop = the back edge whose region holds the most HMMA;
per-path sums over the region's forward-edge DAG; static counts, predicated instructions count as
executed).

"""


BWD_LOOP_TEXT = """## Backward main loop, per iteration and warp (from the SASS)

One iteration is one query tile of a CTA's walk over its K/V tile: the five GEMMs (S = Q K^T, dP = dO V^T,
dV += P^T dO, dK += dS^T Q, dQ = dS K), the P and dS stores to shared memory, the next Q/dO copies.  Counted
as above (LDSM.x2 256 bytes per warp, STS: P and dS); `red.global.add` of dQ counts as instructions only.
Not gated: no feed bar is set for the backward (its tiles are chosen by registers and sm_86's 99 KB of
shared memory, `dispatch_bwd.h`), so the bar column is empty; the forward's bars above say what the ratios
would need to be for the tensor cores to be fed.

"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("so", nargs="+", help="built extension(s), e.g. flash_ext/_C*.so")
    ap.add_argument("--out", help="markdown file to write")
    ap.add_argument("--gate", action="store_true",
                    help="fail if any kernel uses stack or local memory, or a forward kernel misses the FMA/smem-byte bar")
    ap.add_argument("--no-loops", action="store_true", help="skip the SASS main-loop metrics")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump()
    rows = []
    for so in args.so:
        found = parse(so, cuobjdump)
        if not args.no_loops:
            loops = loop_metrics(so, cuobjdump)
            for r in found:
                r["loop"] = loops.get((r["arch"], r["mangled"]))
        rows += found
    rows = merge_rows(rows)
    if not rows:
        print("kernel_report: no flash_ext kernel found (was the extension built with CUDA?)", file=sys.stderr)
        return 1
    commit = os.environ.get("FLASH_EXT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    head = ("| kernel | arch | head dim | dtype | tile (M x N, warps) | flags | registers | smem (bytes) | "
            "stack+local (bytes) | est. CTAs/SM |\n|---|---|---|---|---|---|---|---|---|---|\n")
    def tile(r: dict) -> str:
        return f"{r['bm']} x {r['bn']}, {r['warps']}" if r["bm"] else "-"

    body = "".join(
        f"| {r['kernel']} | sm_{r['arch']} | {r['hd'] or '-'} | {r['dtype']} | {tile(r)} | {r['flags']} | "
        f"{r['reg']} | {r['smem']} | {r['stack'] + r['local']} | {r['ctas']} |\n" for r in rows)
    bad = [r for r in rows if r["stack"] or r["local"]]
    text = (f"# Compiled kernels\n\nGenerated by `scripts/kernel_report.py` from the built extension "
            f"(cuobjdump resource usage) on {datetime.date.today()} at commit {commit or 'unknown'}.  "
            f"Register spills would show as stack or local bytes; the CI gate requires 0 for every kernel.  "
            f"Shared memory is the dynamic amount the launcher requests: forward (M + 2N) x head dim x 2 bytes, "
            f"backward (2 or 3 M + 2N) x head dim x 2 + 2 M x N x 2 bytes (dispatch_bwd.h).  "
            f"CTAs/SM is min(65536 / (registers x threads), smem per SM / smem per CTA).\n\n"
            f"{len(rows)} kernels, {len(bad)} with stack or local memory.\n\n" + head + body)
    fwd_rows = [r for r in rows if r["kernel"] == "fwd"]  # the feed-rate gate covers the forward kernels
    bwd_rows = [r for r in rows if r["kernel"] == "bwd"]
    starved = [] if args.no_loops else [(r, why) for r in fwd_rows for why in [feed_check(r)] if why]
    if not args.no_loops:
        text += "\n" + LOOP_TEXT + loop_table(fwd_rows)
        print(loop_table(fwd_rows), end="")
        if bwd_rows:
            text += "\n" + BWD_LOOP_TEXT + loop_table(bwd_rows, gated=False)
            print(loop_table(bwd_rows, gated=False), end="")
    if args.out:
        # Hand-written notes below the marker (measurements such as compile times) survive a regeneration.
        out = pathlib.Path(args.out)
        old = out.read_text() if out.exists() else ""
        if NOTES_MARKER in old:
            text += "\n" + old[old.index(NOTES_MARKER):]
        out.write_text(text)
    print(head + body, end="")
    print(f"{len(rows)} kernels, {len(bad)} with stack/local memory, {len(starved)} failing the feed-rate gate")
    if args.gate and (bad or starved):
        for r in bad:
            print(f"SPILL: {r['kernel']} sm_{r['arch']} hd{r['hd']} {r['dtype']} {r['flags']}: stack {r['stack']} "
                  f"local {r['local']}",
                  file=sys.stderr)
        for r, why in starved:
            print(f"FEED: sm_{r['arch']} hd{r['hd']} {r['dtype']} {r['flags']}: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
