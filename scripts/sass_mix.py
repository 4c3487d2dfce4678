#!/usr/bin/env python3
"""The instruction mix of each kernel's main-loop iteration, read from the SASS: what a warp issues per K/V
tile besides its MMAs.

kernel_report.py counts what feeds the tensor cores (HMMA, ldmatrix, cp.async: the shared-memory bar); this
counts everything the warp issues on the same steady path (sass_loop.py, method and limits there), by class,
so that two kernels' loops can be compared instruction by instruction -- ours against each other, or against
another library's cubin compiled the same way (docs/perf.md, "the main loop against FA2's").  A
sub-partition issues one instruction per clock and an HMMA.16816 occupies its tensor pipe for about 8 clocks
(A100) or 6 (H100/H200 with mma.sync), so instructions per HMMA near or above that are issue-bound.

    python scripts/sass_mix.py flash_ext/_C*.so --arch 90 --match 'Sm80Traits<64,'
    python scripts/sass_mix.py fa2_fwd_hdim128_bf16_sm80.cubin --arch 90

Classes (by the opcode's first part): hmma, ldsm, ldgsts; ex2 (MUFU.EX2) and other MUFU; ffma, fmul, fadd,
fmnmx (fp32 arithmetic and max); f2fp (fp32 -> 16-bit packs); shfl, vote; cmpsel (FSETP, FSEL, SEL, PLOP3:
comparisons and selects); int (integer and address arithmetic, uniform datapath included); mov; bar (BAR,
DEPBAR, LDGDEPBAR); bra; spill (LDL/STL); other.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sass_loop  # noqa: E402
from kernel_report import demangle, find_cuobjdump, sass_env  # noqa: E402

CLASSES = ("hmma", "ldsm", "ldgsts", "ex2", "mufu", "ffma", "fmul", "fadd", "fmnmx", "f2fp", "shfl", "vote",
           "cmpsel", "int", "mov", "bar", "bra", "spill", "other")
_BY_OPCODE = {
    "HMMA": "hmma", "LDSM": "ldsm", "LDGSTS": "ldgsts", "FFMA": "ffma", "FMUL": "fmul", "FADD": "fadd",
    "FMNMX": "fmnmx", "F2FP": "f2fp", "SHFL": "shfl", "VOTE": "vote", "VOTEU": "vote", "MOV": "mov",
    "UMOV": "mov", "BRA": "bra", "BAR": "bar", "DEPBAR": "bar", "LDGDEPBAR": "bar", "LDL": "spill", "STL": "spill",
    "FSETP": "cmpsel", "FSEL": "cmpsel", "SEL": "cmpsel", "USEL": "cmpsel", "PLOP3": "cmpsel", "ISETP": "cmpsel",
    "UISETP": "cmpsel",
}
_INT = re.compile(r"^U?(IMAD|IADD3?|VIADD|LEA|SHF|LOP3|IMNMX|IABS|PRMT|SHL|SHR|FLO|POPC|I2F|F2I|S2R|S2UR|R2UR|"
                  r"CS2R|LDC|ULDC|IMUL|BMSK|SGXT|VIADDMNMX)$")


def opcode_class(opcode: str) -> str:
    base = opcode.split(".")[0]
    if base == "MUFU":
        return "ex2" if ".EX2" in opcode else "mufu"
    if base in _BY_OPCODE:
        return _BY_OPCODE[base]
    return "int" if _INT.match(base) else "other"


def mix_metrics(ins: sass_loop.Instr) -> dict[str, int]:
    out = sass_loop.instr_metrics(ins)
    if out:  # an @!PT instruction is never issued
        out["c_" + opcode_class(ins.opcode)] = 1
    return out


KEYS = tuple(sass_loop.METRICS) + tuple("c_" + c for c in CLASSES)


def loop_mix(fn: sass_loop.Function) -> dict[str, int] | None:
    """Class counts (and sass_loop's METRICS) of the steady path of fn's main loop, or None."""
    m = sass_loop.main_loop(fn, metrics=mix_metrics, keys=KEYS)
    return None if m is None else m.steady


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="built extension(s), object files or cubins")
    ap.add_argument("--arch", type=int, help="only this sm_ arch (e.g. 90)")
    ap.add_argument("--match", default="", help="regular expression the demangled kernel name must match")
    args = ap.parse_args()
    pattern = re.compile(args.match)
    exe = find_cuobjdump()
    print("| kernel | arch | instructions | HMMA | per HMMA | " + " | ".join(CLASSES[1:]) + " |")
    print("|---|---|---|---|---|" + "---|" * (len(CLASSES) - 1))
    for f in args.files:
        done = subprocess.run([exe, "-sass", f], capture_output=True, text=True, env=sass_env())
        if done.returncode != 0:
            sys.exit(f"sass_mix: `{exe} -sass {f}` failed (exit {done.returncode}): {done.stderr.strip()}")
        functions = sass_loop.parse_sass(done.stdout)
        for fn, name in zip(functions, demangle([fn.name for fn in functions])):
            if (args.arch and fn.arch != args.arch) or not pattern.search(name):
                continue
            s = loop_mix(fn)
            if s is None or not s["hmma"]:
                continue
            cells = " | ".join(str(s["c_" + c]) for c in CLASSES[1:])
            print(f"| `{name[:110]}` | {fn.arch} | {s['instructions']} | {s['hmma']} | "
                  f"{s['instructions'] / s['hmma']:.2f} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
