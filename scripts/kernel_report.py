#!/usr/bin/env python3
"""Resource usage of every compiled forward kernel, and the no-spill gate.

Reads the CUDA binaries embedded in the built extension with ``cuobjdump --dump-resource-usage`` (from the
CUDA toolkit, or the ``nvidia-cuda-cuobjdump`` pip package), and writes a markdown table (kernel,
registers, shared memory, stack/local bytes, estimated CTAs per SM).  With ``--gate`` it exits non-zero if
any forward kernel has a stack frame or local memory: register spills land there.

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

# Per-SM limits used for the occupancy estimate: registers, max dynamic shared memory per SM (bytes).
SM_LIMITS = {80: (65536, 164 * 1024), 86: (65536, 100 * 1024), 89: (65536, 100 * 1024), 90: (65536, 228 * 1024)}


def find_cuobjdump() -> str:
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if os.path.exists(os.path.join(home, "bin", "cuobjdump")):
        return os.path.join(home, "bin", "cuobjdump")
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for p in glob.glob(os.path.join(root, "**", "bin", "cuobjdump"), recursive=True):
            return p
    sys.exit("kernel_report: cuobjdump not found (install nvidia-cuda-cuobjdump or a CUDA toolkit)")


def demangle(names: list[str]) -> list[str]:
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        return out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return names


NOTES_MARKER = "<!-- notes: kept by scripts/kernel_report.py when it regenerates the table above -->"

FLAG_NAMES = ("even_mn", "even_k", "causal", "local", "alibi", "softcap", "split", "dropout")


def describe(demangled: str) -> dict | None:
    # Sm80Traits<head dim, M, N, warps, element[, architecture policy]>
    m = re.search(r"Sm80Traits<(\d+), (\d+), (\d+), (\d+), cutlass::(\w+)(?:, [\w:]+)?>", demangled)
    f = re.search(r"KernelFlags<(.*)>\s*>\s*\(", demangled)
    if not m:
        return None
    hd, bm, bn, warps, dtype = int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5].replace("_t", "")
    flags = []
    if f:
        for name, val in zip(FLAG_NAMES, [x.strip() for x in re.split(r",\s*(?![^<]*>)", f[1])]):
            flags.append(f"{name}={'T' if 'true' in val else 'F' if 'false' in val else 'rt'}")
    return {"hd": hd, "bm": bm, "bn": bn, "warps": warps, "dtype": dtype, "flags": " ".join(flags),
            "smem": (bm + 2 * bn) * hd * 2}


def parse(so: str, cuobjdump: str) -> list[dict]:
    text = subprocess.run([cuobjdump, "--dump-resource-usage", so], capture_output=True, text=True, check=True).stdout
    rows, arch = [], None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        a = re.match(r"arch = sm_(\d+)", line.strip())
        if a:
            arch = int(a[1])
        fn = re.match(r"\s*Function (\S+):", line)
        if fn and "flash_fwd_kernel" in fn[1] and i + 1 < len(lines):
            usage = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", lines[i + 1]))
            rows.append({"arch": arch, "mangled": fn[1], "reg": int(usage.get("REG", 0)),
                         "stack": int(usage.get("STACK", 0)), "local": int(usage.get("LOCAL", 0))})
    for row, name in zip(rows, demangle([r["mangled"] for r in rows])):
        row.update(describe(name) or {"hd": 0, "bm": 0, "bn": 0, "warps": 0, "dtype": "?", "flags": name, "smem": 0})
        regs_per_sm, smem_per_sm = SM_LIMITS.get(row["arch"], SM_LIMITS[80])
        threads = 32 * row["warps"] if row["warps"] else 128
        by_regs = regs_per_sm // max(1, row["reg"] * threads)
        by_smem = smem_per_sm // max(1, row["smem"])
        row["ctas"] = min(by_regs, by_smem)
    return sorted(rows, key=lambda r: (r["arch"], r["hd"], r["dtype"], r["flags"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("so", nargs="+", help="built extension(s), e.g. flash_ext/_C*.so")
    ap.add_argument("--out", help="markdown file to write")
    ap.add_argument("--gate", action="store_true", help="fail if any forward kernel uses stack or local memory")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump()
    rows = [r for so in args.so for r in parse(so, cuobjdump)]
    if not rows:
        print("kernel_report: no flash_fwd_kernel found (was the extension built with CUDA?)", file=sys.stderr)
        return 1
    commit = os.environ.get("FLASH_EXT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    head = ("| arch | head dim | dtype | tile (M x N, warps) | flags | registers | smem (bytes) | "
            "stack+local (bytes) | est. CTAs/SM |\n|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| sm_{r['arch']} | {r['hd']} | {r['dtype']} | {r['bm']} x {r['bn']}, {r['warps']} | {r['flags']} | "
        f"{r['reg']} | {r['smem']} | {r['stack'] + r['local']} | {r['ctas']} |\n" for r in rows)
    bad = [r for r in rows if r["stack"] or r["local"]]
    text = (f"# Compiled forward kernels\n\nGenerated by `scripts/kernel_report.py` from the built extension "
            f"(cuobjdump resource usage) on {datetime.date.today()} at commit {commit or 'unknown'}.  "
            f"Register spills would show as stack or local bytes; the CI gate requires 0 for every kernel.  "
            f"Shared memory is the dynamic amount the launcher requests, (M + 2N) x head dim x 2 bytes.  "
            f"CTAs/SM is min(65536 / (registers x threads), smem per SM / smem per CTA).\n\n"
            f"{len(rows)} kernels, {len(bad)} with stack or local memory.\n\n" + head + body)
    if args.out:
        # Hand-written notes below the marker (measurements such as compile times) survive a regeneration.
        out = pathlib.Path(args.out)
        old = out.read_text() if out.exists() else ""
        if NOTES_MARKER in old:
            text += "\n" + old[old.index(NOTES_MARKER):]
        out.write_text(text)
    print(head + body, end="")
    print(f"{len(rows)} kernels, {len(bad)} with stack/local memory")
    if args.gate and bad:
        for r in bad:
            print(f"SPILL: sm_{r['arch']} hd{r['hd']} {r['dtype']} {r['flags']}: stack {r['stack']} local {r['local']}",
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
