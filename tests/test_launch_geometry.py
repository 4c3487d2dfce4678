"""Launch geometry (csrc/flash_ext/grid.h) around CUDA's 65,535 limit on grid.y and grid.z.

Before, the forward grid was (m_blocks, batch, heads x splits): more than 65,535 varlen sequences, or heads x
num_splits above 65,535, failed at launch with "invalid configuration argument" while explain() said ok.  Now
(batch, head, split) is folded over (y, z).  Checked as pure functions through ``flash_ext._C.launch_geometry``
(the code the CUDA launchers and the emulator use), and end to end on the warp emulator, which walks the grid
block by block like the GPU.  tests/cpp/test_grid.cpp checks the decode exhaustively.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import flash_ext
from attn_check import check_close

LIMIT = 65535


def geometry(m_blocks: int, b: int, h: int, splits: int, seqlen_q: int = 1, d: int = 64, blocks=()) -> dict:
    return flash_ext._C.launch_geometry(m_blocks, b, h, splits, seqlen_q, d, [list(b_) for b_ in blocks])


@pytest.mark.parametrize("b,h,splits,expect", [
    (LIMIT, 1, 1, [LIMIT, 1]),          # one full y row
    (LIMIT + 1, 1, 1, [LIMIT, 2]),      # one more sequence opens a second z row
    (1, LIMIT + 1, 1, [LIMIT, 2]),      # heads
    (1, 600, 128, [LIMIT, 2]),          # heads x splits = 76,800
    (3, 5, 2, [30, 1]),                 # small problems keep a single row: y = the item count
    (LIMIT, LIMIT, 1, [LIMIT, LIMIT]),  # the largest grid that launches
])
def test_forward_grid_stays_within_limits(b: int, h: int, splits: int, expect: list) -> None:
    g = geometry(4, b, h, splits)
    assert g["fwd_grid"] == [4] + expect and g["fwd_error"] == ""
    assert all(x <= LIMIT for x in g["fwd_grid"][1:])


def test_too_many_ctas_are_refused_not_launched() -> None:
    g = geometry(1, LIMIT, LIMIT, 2)
    assert "65,535^2" in g["fwd_error"]


def test_block_decode_at_the_boundary() -> None:
    b = LIMIT + 5
    g = geometry(2, b, 1, 1, blocks=[(1, LIMIT - 1, 0), (0, 0, 1), (1, 4, 1), (0, 5, 1)])
    dec = [blk["fwd"] for blk in g["blocks"]]
    assert dec[0] == [1, LIMIT - 1, 0, 0, 1]   # last block of z row 0: sequence 65,534
    assert dec[1] == [0, LIMIT, 0, 0, 1]       # first of z row 1: sequence 65,535
    assert dec[2] == [1, LIMIT + 4, 0, 0, 1]   # the last sequence
    assert dec[3][-1] == 0                     # padding block past the end: exits at once
    # heads x splits: item r = bidb + b * (bidh + h * split)
    g = geometry(1, 2, 600, 128, blocks=[(0, 1, 1)])
    r = 1 + LIMIT
    assert g["blocks"][0]["fwd"] == [0, r % 2, (r // 2) % 600, r // 1200, 1]


def test_combine_grid_folds_batch_and_heads() -> None:
    pairs = 70000 * 3
    last = pairs - 3 * LIMIT  # y of the first padding block in z row 3
    g = geometry(1, 70000, 3, 4, seqlen_q=5, d=40, blocks=[(0, 0, 3), (0, last - 1, 3), (0, last, 3)])
    assert g["combine_grid"] == [1, LIMIT, 4] and g["combine_error"] == ""  # 210,000 (batch, head) pairs
    r = 3 * LIMIT
    assert g["blocks"][0]["combine"] == [r % 70000, r // 70000, 1]
    assert g["blocks"][1]["combine"] == [69999, 2, 1]  # the last pair
    assert g["blocks"][2]["combine"][-1] == 0          # padding


def test_explain_reports_the_folded_grid() -> None:
    if not flash_ext.build_info()["emulator"]:
        pytest.skip("the Sm80 plan on a CPU-only machine needs the warp emulator (FLASH_EXT_EMULATOR=1)")
    d = flash_ext.build_info()["emulator_head_dims"][0]
    q = torch.randn(LIMIT + 1, 1, 1, d, dtype=torch.float16)
    with flash_ext.emulate():
        e = flash_ext.explain(q, q, q, num_splits=1, verbose=False)
    assert e.ok and e.plan["grid"] == [1, LIMIT, 2], e.plan


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)


def test_more_than_65535_sequences_run_on_the_emulated_gpu() -> None:
    """70,000 varlen sequences: those past 65,535 live in the second z row of the grid and must be computed.
    Most sequences are empty (their CTAs exit at once) so the emulated run stays short."""
    if not flash_ext.build_info()["emulator"]:
        pytest.skip("needs the warp emulator (FLASH_EXT_EMULATOR=1)")
    d = flash_ext.build_info()["emulator_head_dims"][0]
    n = 70000
    busy = {0: (3, 50), LIMIT: (5, 70), n - 1: (2, 9)}  # sequence -> (query rows, keys)
    lens_q = [busy.get(i, (0, 0))[0] for i in range(n)]
    lens_k = [busy.get(i, (0, 0))[1] for i in range(n)]
    h = 2
    q = torch.randn(sum(lens_q), h, d, dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), h, d, dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), h, d, dtype=torch.bfloat16)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    with flash_ext.emulate():
        out, lse, _ = flash_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), num_splits=1,
                                                       return_attn_probs=True)
    r = flash_ext.emulator_report()
    # 140,000 (sequence, head) items: grid (1, 65535, 3), the padding blocks of the last z row included
    assert r["findings"] == 0 and r["stats"]["ctas"] == 3 * LIMIT
    for i in busy:
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        ka, ke = int(cu_k[i]), int(cu_k[i + 1])
        check_close(out[a:e][None], lse[:, a:e][None], q[a:e][None], k[ka:ke][None], v[ka:ke][None],
                    context=f"sequence {i}")


def test_heads_times_splits_past_65535_on_the_emulated_gpu() -> None:
    if not flash_ext.build_info()["emulator"]:
        pytest.skip("needs the warp emulator (FLASH_EXT_EMULATOR=1)")
    d = flash_ext.build_info()["emulator_head_dims"][0]
    h, splits = 520, 128  # 66,560 CTAs per query-row block
    q = torch.randn(1, 1, h, d, dtype=torch.float16)
    k = torch.randn(1, 40, h, d, dtype=torch.float16)
    v = torch.randn(1, 40, h, d, dtype=torch.float16)
    with flash_ext.emulate():
        assert flash_ext.explain(q, k, v, num_splits=splits, verbose=False).plan["grid"] == [1, LIMIT, 2]
        out, lse, _ = flash_ext.flash_attn_func(q, k, v, num_splits=splits, return_attn_probs=True)
    assert flash_ext.emulator_report()["findings"] == 0
    check_close(out, lse, q, k, v, context="520 heads x 128 splits")
