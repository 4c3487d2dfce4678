"""scripts/sass_loop.py: the SASS main-loop parser behind kernel_report's per-iteration metrics.

`tests/data/sass_loop_excerpt.sass` is a small function in `cuobjdump -sass` layout (real sm_80
mnemonics and syntax; the encoding words are zero filler).  Every expected number below was counted by
hand from that file, block by block, not produced by the parser.

The function (addresses in hex):
  000-030  prologue, one HMMA outside any loop
  040-060  a loop without HMMA (`@!P1 BRA 0x40`): must not be chosen
  070-210  the main loop (`@P0 BRA 0x70` at 210), blocks:
     B0 070-0e0: DEPBAR, BAR, 2 x LDSM.16.M88.4, 2 x HMMA.16816, ISETP, @P2 BRA 0x120      8 instructions
     B1 0f0-110: 2 x STS.128 (zero fill), BRA 0x140                                        3 instructions
     B2 120-130: LDGSTS.128, @!PT LDS (never executes)                                     1 instruction
     B3 140-1b0: LDGDEPBAR, BAR, LDSM.16.MT88.4, LDSM.16.M88.2, HMMA.16816, HMMA.1688,
                 ISETP, @!P3 BRA 0x1e0                                                     8 instructions
     B4 1c0-1d0: LDGSTS.128, LDG.E                                                         2 instructions
     B5 1e0-210: LDS.U16, IADD3, ISETP, @P0 BRA 0x70 (latch)                               4 instructions
     paths: B0 -> (B1 | B2) -> B3 -> (B4 ->) B5: 4 paths
  220-230  epilogue (STG, EXIT)
  240-250  a divergence slow path branching back into the loop (`BRA 0x160`, region 160-250: 2 HMMA,
           fewer than the main loop's 4): must not be chosen
  260      the function's closing self-branch (`BRA 0x260`)
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sass_loop():
    spec = importlib.util.spec_from_file_location("sass_loop", ROOT / "scripts" / "sass_loop.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sass_loop"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def excerpt(sass_loop):
    return sass_loop.parse_sass((ROOT / "tests" / "data" / "sass_loop_excerpt.sass").read_text())


def test_parse_reads_every_instruction(excerpt) -> None:
    assert len(excerpt) == 1
    fn = excerpt[0]
    assert fn.name == "_Z4demoPv" and fn.arch == 80
    assert len(fn.instrs) == 39  # 0x000 .. 0x260 in steps of 0x10
    bra = [i for i in fn.instrs if i.opcode == "BRA"]
    assert [(i.addr, i.guard, i.branch_target) for i in bra] == [
        (0x060, "@!P1", 0x40), (0x0e0, "@P2", 0x120), (0x110, "", 0x140), (0x1b0, "@!P3", 0x1e0),
        (0x210, "@P0", 0x70), (0x250, "", 0x160), (0x260, "", 0x260)]


def test_instruction_bytes(sass_loop, excerpt) -> None:
    by_addr = {i.addr: sass_loop.instr_metrics(i) for i in excerpt[0].instrs}
    assert by_addr[0x090]["ldsm_bytes"] == 512       # four 8x8 matrices of 16-bit
    assert by_addr[0x170]["ldsm_bytes"] == 256       # .2
    assert by_addr[0x190]["fma"] == 1024             # m16n8k8
    assert by_addr[0x0b0]["fma"] == 2048             # m16n8k16
    assert by_addr[0x0f0]["sts_bytes"] == 512        # 32 lanes x 16 B
    assert by_addr[0x1e0]["lds_bytes"] == 64         # 32 lanes x 2 B
    assert by_addr[0x1d0]["ldg_bytes"] == 128        # 32 lanes x 4 B
    assert by_addr[0x130] == {}                      # @!PT: never issued


def test_main_loop_is_found_and_counted_per_path(sass_loop, excerpt) -> None:
    m = sass_loop.main_loop(excerpt[0])
    assert (m.header, m.latch) == (0x070, 0x210)
    assert m.static_instructions == 27 and m.paths == 4 and m.inner_loops == 0
    # Steady path B0 B2 B3 B4 B5: every HMMA, both LDGSTS, fewest instructions.
    steady = {"instructions": 8 + 1 + 8 + 2 + 4, "hmma": 4, "fma": 2 * 2048 + 2048 + 1024, "ldsm": 4,
              "ldsm_bytes": 512 + 512 + 512 + 256, "lds_bytes": 64, "sts_bytes": 0, "ldgsts": 2,
              "ldgsts_bytes": 1024, "ldg": 1, "ldg_bytes": 128, "bar": 2, "vote": 0,
              "smem_bytes": 1792 + 64 + 1024}
    assert m.steady == steady
    assert m.fma_per_smem_byte == pytest.approx(7168 / 2880)
    # Per-metric ranges over the 4 paths.
    assert m.min["instructions"] == 8 + 1 + 8 + 4 and m.max["instructions"] == 8 + 3 + 8 + 2 + 4
    assert (m.min["ldgsts"], m.max["ldgsts"]) == (0, 2)
    assert (m.min["sts_bytes"], m.max["sts_bytes"]) == (0, 1024)
    assert (m.min["ldg"], m.max["ldg"]) == (0, 1)
    assert (m.min["smem_bytes"], m.max["smem_bytes"]) == (1792 + 64 + 512, 1792 + 64 + 1024 + 512)
    assert m.min["hmma"] == m.max["hmma"] == 4


def test_function_without_hmma_loop(sass_loop) -> None:
    text = ("\tcode for sm_90\n\t\tFunction : f\n"
            "        /*0000*/                   IADD3 R0, R0, 0x1, RZ ;\n"
            "        /*0010*/               @P0 BRA 0x0 ;\n"
            "        /*0020*/                   EXIT ;\n")
    (fn,) = sass_loop.parse_sass(text)
    assert fn.arch == 90 and len(fn.instrs) == 3
    assert sass_loop.main_loop(fn) is None


def test_feed_rate_gate_rules(sass_loop) -> None:
    """kernel_report's gate: below the arch's bar fails unless waived; a waived kernel must stay above its
    floor; a waiver whose kernel meets the bar must go."""
    spec = importlib.util.spec_from_file_location("kernel_report", ROOT / "scripts" / "kernel_report.py")
    kr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kr)

    def row(arch: int, hd: int, hmma: int, smem_bytes: int, warps: int = 8, bn: int = 64) -> dict:
        counts = dict.fromkeys(sass_loop.METRICS, 0)
        counts.update(hmma=hmma, fma=2048 * hmma, smem_bytes=smem_bytes)
        lm = sass_loop.LoopMetrics(0, 0, 0, 1, 0, counts, counts, counts)
        return {"arch": arch, "hd": hd, "warps": warps, "bn": bn, "loop": lm}

    kr.FEED_WAIVERS = {(80, 128, 8, 64): 6.0}
    # 128 HMMA = 262144 FMA: 40960 B -> 6.4 (waived, above the floor), 45000 B -> 5.8 (below the floor).
    assert kr.feed_check(row(80, 128, 128, 40960)) is None
    assert "floor" in kr.feed_check(row(80, 128, 128, 45000))
    # The same 6.4 without a waiver fails the sm_80 bar of 8.0; 32768 B -> 8.0 passes.
    assert "bar" in kr.feed_check(row(80, 64, 128, 40960))
    assert kr.feed_check(row(80, 64, 128, 32768)) is None
    # A waived kernel that meets the bar: the waiver must be removed.
    assert "remove" in kr.feed_check(row(80, 128, 128, 32768))
    # A waiver covers one tile: the same head dim's 4-warp kernel, or 8 warps with other tiles, is held to the bar.
    assert "bar" in kr.feed_check(row(80, 128, 128, 40960, warps=4))
    assert "bar" in kr.feed_check(row(80, 128, 128, 40960, bn=32))
    # sm_90's bar is 32/3: 24576 B -> exactly 32/3 passes, 24577 B fails.
    assert kr.feed_check(row(90, 64, 128, 24576)) is None
    assert "bar" in kr.feed_check(row(90, 64, 128, 24577))
    assert "no main loop" in kr.feed_check({"arch": 80, "hd": 64, "warps": 8, "bn": 64, "loop": None})


def test_instruction_mix_of_the_steady_path(sass_loop, excerpt) -> None:
    """scripts/sass_mix.py: the steady path B0 B2 B3 B4 B5 (23 instructions) by class, counted by hand:
    DEPBAR, BAR, LDGDEPBAR, BAR -> bar 4; 4 LDSM; 4 HMMA; 2 LDGSTS; 3 ISETP -> cmpsel; 3 BRA; LDG and LDS ->
    other 2; IADD3 -> int 1.  The @!PT LDS of B2 is never issued and counts nowhere."""
    spec = importlib.util.spec_from_file_location("sass_mix", ROOT / "scripts" / "sass_mix.py")
    mix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mix)
    s = mix.loop_mix(excerpt[0])
    counts = {c: s["c_" + c] for c in mix.CLASSES if s["c_" + c]}
    assert counts == {"hmma": 4, "ldsm": 4, "ldgsts": 2, "bar": 4, "cmpsel": 3, "bra": 3, "other": 2, "int": 1}
    assert sum(counts.values()) == s["instructions"] == 23
    assert mix.opcode_class("MUFU.EX2") == "ex2" and mix.opcode_class("MUFU.RCP") == "mufu"
    assert mix.opcode_class("FMNMX.FTZ") == "fmnmx" and mix.opcode_class("FSEL") == "cmpsel"
    assert mix.opcode_class("VOTE.ANY") == "vote" and mix.opcode_class("STL") == "spill"
    assert mix.opcode_class("IMAD.WIDE.U32") == "int" and mix.opcode_class("ULDC.64") == "int"


def test_report_merges_binaries() -> None:
    """kernel_report's table from several binaries (CI's build and scratch compiles): one row per (arch, mangled
    name), the first binary's, ordered by kind, arch, head dim, dtype, flags across binaries."""
    spec = importlib.util.spec_from_file_location("kernel_report", ROOT / "scripts" / "kernel_report.py")
    kr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kr)

    def row(kernel: str, arch: int, hd: int, name: str, reg: int) -> dict:
        return {"kernel": kernel, "arch": arch, "hd": hd, "dtype": "bfloat16", "flags": "f", "mangled": name, "reg": reg}

    ci = [row("fwd", 90, 64, "a", 1), row("bwd", 80, 64, "b", 2)]
    scratch = [row("fwd", 80, 128, "c", 3), row("fwd", 90, 64, "a", 9), row("fwd", 80, 64, "a", 4),
               row("bwd post", 80, 0, "p", 5)]
    merged = kr.merge_rows(ci + scratch)
    assert [(r["kernel"], r["arch"], r["hd"], r["reg"]) for r in merged] == [
        ("fwd", 80, 64, 4), ("fwd", 80, 128, 3), ("fwd", 90, 64, 1), ("bwd", 80, 64, 2), ("bwd post", 80, 0, 5)]
