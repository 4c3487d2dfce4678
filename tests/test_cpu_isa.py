"""The CPU backend at every instruction-set level this build contains and this CPU runs.

The kernel body is compiled once; its per-element work runs in micro-kernels compiled per level and chosen
at run time (csrc/flash_ext/host_isa.h).  The rest of the suite runs the level chosen automatically (the
best one, or FLASH_EXT_CPU_ISA); here each level in turn runs a sample of the forward reference grid
(tests/test_fwd.py's default sample, every dtype, head dim and flag set) and the decode, varlen, KV-cache
and split-KV cases, against the same float64 reference and pass rule.  A level this CPU lacks is skipped
with the missing CPU feature named (an AVX2-only machine compiles the AVX-512 and AMX levels but cannot run
them; tests/cpp/test_host_isa.cpp still runs their 16-lane kernel source, and the AMX level's tile GEMM,
emulated on AVX2).  Also: the selection
itself — explain() and build_info() report the level in use, and a level or FLASH_EXT_CPU_ISA value that
cannot run is refused with a ValueError, never run as another level or left to crash.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import flash_ext
from flash_ext import _C

import test_fwd
from attn_check import check_close, check_large_scores, make_large_score_qkv, make_qkv
import test_kvcache as kvcache_tests  # not `test_kvcache`: the test functions below have that name
import test_varlen as varlen_tests

LEVELS = ["generic", "avx2", "avx512", "avx512_bf16", "amx_bf16"]


@pytest.fixture(params=LEVELS)
def cpu_isa(request) -> str:
    """Runs the test with the CPU micro-kernels of one level, skipping levels this build or CPU lacks."""
    why = flash_ext.build_info()["cpu_isas"][request.param]["unavailable"]
    if why:
        pytest.skip(why)
    previous = _C.set_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        _C.set_cpu_isa(previous)


# Every 6th case of the default sample: all three dtypes, every flag set, most head dims and shapes.
FWD_SAMPLE = test_fwd.DEFAULT_CASES[::6]


def test_fwd_sample_coverage() -> None:
    assert {c[5] for c in FWD_SAMPLE} == set(test_fwd.DTYPES)
    assert {c[4] for c in FWD_SAMPLE} == set(test_fwd.FLAG_SETS)
    assert len({c[2] for c in FWD_SAMPLE}) >= 8


@pytest.mark.parametrize("case", FWD_SAMPLE, ids=[test_fwd._case_id(c) for c in FWD_SAMPLE])
def test_fwd_sample(cpu_isa: str, case) -> None:
    test_fwd.run_case("cpu", *case)


@pytest.mark.parametrize("sq", [1, 16, 17])
def test_short_queries_and_decode(cpu_isa: str, sq: int) -> None:
    # sq = 1 with GQA runs the query heads of a K/V group as rows of a 16-row tile.
    test_fwd.test_short_queries("cpu", sq, causal=True)


@pytest.mark.parametrize("group", [1, 3, 6, 7, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d", [80, 128])
def test_decode_group_rows(cpu_isa: str, group: int, dtype: torch.dtype, d: int) -> None:
    # One query token, `group` query heads per K/V head: that many live rows of the 16-row tile, on both
    # sides of the bf16 dot products' 6-row bound (csrc/host/isa/kernels.h, gemm_bf16_few_rows); d = 80
    # leaves a depth tail short of a vector; 300 keys, a partial last K/V tile.
    q, k, v = make_qkv(2, 1, 300, 2 * group, 2, d, dtype, "cpu")
    out, lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True)
    check_close(out, lse, q, k, v, context=f"{cpu_isa} group {group} d {d}")


@pytest.mark.parametrize("case", [0, 2, 6])
def test_varlen(cpu_isa: str, case: int) -> None:
    varlen_tests.test_varlen_matches_per_sequence_reference("cpu", case)


@pytest.mark.parametrize("case", [0, 1, 4])
def test_kvcache(cpu_isa: str, case: int) -> None:
    kvcache_tests.test_kvcache_matches_reference("cpu", case)


def test_paged_split_kv(cpu_isa: str) -> None:
    kvcache_tests.test_paged_equals_contiguous("cpu", num_splits=4)


# Prefill keeps each whole K/V tile for the head's later row blocks on the same thread: a level that reads K/V
# tiles in place (amx_bf16) packed (fp16 and fp32: split into 2 or 3 bf16 pieces; launch_host.h,
# HostKvTileCache), the others as a dense copy that replaces the staged one (HostKvMirror).  Cases where a wrong
# entry would be found: query heads of one K/V group and two batch entries in a row (both are emptied when the
# K/V head changes), K and V the same tensor (one address, two packed forms; one copy), more keys than the cache
# holds at d = 256 (2 x 64 KiB per 128-key bf16 tile, 2 x 64 KiB per 64-key fp16 tile, 2 x 96 KiB per 64-key fp32
# tile, against one L2, two for fp32: past 4 MiB of L2 (8 for fp32), the later tiles are packed per GEMM as
# without a cache), and more keys than the mirror holds (four of this CPU's L2s: the later tiles are staged).
@pytest.mark.parametrize("case", ["gqa", "k_is_v", "past_the_cache", "past_the_mirror"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_prefill_kv_tiles_reused(cpu_isa: str, case: str, causal: bool, dtype: torch.dtype) -> None:
    if case == "past_the_cache":
        q, k, v = make_qkv(1, 260, 4500, 2, 1, 256, dtype, "cpu")
    elif case == "past_the_mirror":
        mirror_keys = 4 * flash_ext.build_info()["cpu_l2_bytes"] // (64 * dtype.itemsize * 2)
        # At most 64Ki keys (the float64 reference's scores, 260 x keys, stay ~140 MB): past the mirror of a
        # CPU with up to 4 MiB of L2 per core at bf16/fp16, 8 MiB at fp32.
        q, k, v = make_qkv(1, 260, min(mirror_keys + 300, 1 << 16), 1, 1, 64, dtype, "cpu")
    else:
        q, k, v = make_qkv(2, 300, 700, 6, 2, 128, dtype, "cpu")
        if case == "k_is_v":
            v = k
    out, lse, _ = flash_ext.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    check_close(out, lse, q, k, v, causal=causal, context=f"{cpu_isa} {case}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_huge_scores_exact(cpu_isa: str, dtype: torch.dtype, causal: bool) -> None:
    """test_fwd.test_huge_scores_exact on each level's softmax step: the prefill tiles, and decode's few rows
    (one query row, a head group of 4 run as 4 rows of one K/V head)."""
    for sq, hk in ((3, 4), (1, 1)):
        q, k, v, out_expected, lse_expected = make_large_score_qkv(dtype, causal, sq=sq, hk=hk)
        out, lse, _ = flash_ext.flash_attn_func(q, k, v, causal=causal, num_splits=1, return_attn_probs=True)
        check_large_scores(out, lse, out_expected, lse_expected, context=f"{cpu_isa} sq {sq}")


def test_level_in_use_is_reported(cpu_isa: str) -> None:
    assert flash_ext.build_info()["cpu_isa"] == cpu_isa
    q = torch.randn(1, 10, 2, 64)
    assert flash_ext.explain(q, q, q, verbose=False).plan["cpu_isa"] == cpu_isa


def test_levels_listed() -> None:
    info = flash_ext.build_info()
    assert list(info["cpu_isas"]) == LEVELS
    generic = info["cpu_isas"]["generic"]
    assert generic["compiled"] and generic["supported"] and not generic["unavailable"]
    assert info["cpu_isa_best"] in LEVELS and not info["cpu_isas"][info["cpu_isa_best"]]["unavailable"]
    for name, level in info["cpu_isas"].items():
        # Runnable exactly when compiled and supported; otherwise the reason says which.
        assert (level["unavailable"] == "") == (level["compiled"] and level["supported"]), name


def test_unavailable_level_refused() -> None:
    levels = flash_ext.build_info()["cpu_isas"]
    missing = [name for name in LEVELS if levels[name]["unavailable"]]
    if not missing:
        pytest.skip("this CPU runs every compiled level")
    name = missing[-1]
    before = flash_ext.build_info()["cpu_isa"]
    with pytest.raises(ValueError, match=levels[name]["unavailable"].split(" (")[0]):
        _C.set_cpu_isa(name)
    assert flash_ext.build_info()["cpu_isa"] == before  # nothing changed
    with pytest.raises(ValueError, match="unknown CPU instruction-set level"):
        _C.set_cpu_isa("sse9")


def _run_with_env(value: str, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FLASH_EXT_CPU_ISA=value)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


CALL = ("import torch, flash_ext; q = torch.randn(1, 20, 2, 64); "
        "print(flash_ext.build_info()['cpu_isa']); flash_ext.flash_attn_func(q, q, q); print('ran')")


def test_env_selects_level() -> None:
    r = _run_with_env("generic", CALL)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["generic", "ran"]


@pytest.mark.parametrize("value", ["avx512_bf16", "amx_bf16", "sse9"])
def test_env_unusable_level_refused(value: str) -> None:
    why = flash_ext.build_info()["cpu_isas"].get(value, {}).get("unavailable", "unknown")
    if not why:
        pytest.skip(f"this CPU runs {value}")
    r = _run_with_env(value, CALL)
    assert r.returncode != 0 and "ran" not in r.stdout
    # flash_attn_func's refusal: flash_ext.ArgumentError, a ValueError (and a RuntimeError, as flash_attn's)
    assert "flash_ext.errors.ArgumentError" in r.stderr and "FLASH_EXT_CPU_ISA" in r.stderr, r.stderr[-2000:]
    expected = "unknown CPU instruction-set level" if value == "sse9" else why.split(" (")[0]
    assert expected in r.stderr, r.stderr[-2000:]
