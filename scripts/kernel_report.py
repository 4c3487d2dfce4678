#!/usr/bin/env python3
"""Resource usage of every compiled forward and backward kernel, and the no-spill gate.

Reads the CUDA binaries embedded in the built extension with ``cuobjdump --dump-resource-usage`` (from the
CUDA toolkit, or the ``nvidia-cuda-cuobjdump`` pip package), and writes a markdown table (kernel,
registers, shared memory, stack/local bytes, estimated CTAs per SM).  With ``--gate`` it exits non-zero if
any forward or backward kernel (the attention kernels and the backward's pre/postprocess) has a stack frame
or local memory: register spills land there.

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
    order = {"fwd": 0, "bwd": 1, "bwd pre": 2, "bwd post": 3, "?": 4}
    return sorted(rows, key=lambda r: (order[r["kernel"]], r["arch"], r["hd"], r["dtype"], r["flags"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("so", nargs="+", help="built extension(s), e.g. flash_ext/_C*.so")
    ap.add_argument("--out", help="markdown file to write")
    ap.add_argument("--gate", action="store_true", help="fail if any kernel uses stack or local memory")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump()
    rows = [r for so in args.so for r in parse(so, cuobjdump)]
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
            print(f"SPILL: {r['kernel']} sm_{r['arch']} hd{r['hd']} {r['dtype']} {r['flags']}: stack {r['stack']} "
                  f"local {r['local']}",
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
