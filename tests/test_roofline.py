"""flash_ext.roofline: the static performance model's arithmetic against hand-computed cases.

The expected values are worked out by hand in the comments (from the formulas in docs/perf.md, "Static
model"), on a made-up GPU with round numbers so that the arithmetic is checkable on paper.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import flash_ext
from flash_ext import roofline as rl

# 2 SMs at 1 GHz, 1024 FMA/clk/SM (2.048 TFLOP/s per SM), 128 B/clk/SM of shared memory, 1000 GB/s of HBM.
TOY2 = rl.GpuSpec("toy-2", sms=2, clock_ghz=1.0, mma_fma_per_clk_sm=1024, hbm_gb_s=1000)
# The same SM, 100 of them; and with 100x the HBM bandwidth, so that HBM cannot be the bound.
TOY100 = rl.GpuSpec("toy-100", sms=100, clock_ghz=1.0, mma_fma_per_clk_sm=1024, hbm_gb_s=1000)
TOY100_FAST_HBM = rl.GpuSpec("toy-100-hbm", sms=100, clock_ghz=1.0, mma_fma_per_clk_sm=1024, hbm_gb_s=100000)


def test_per_tile_counts_match_the_issue_arithmetic() -> None:
    # hd 128, 128 x 64 tile, 8 warps x 16 rows: per warp Q 16x128x2 = 4096 B, K and V 64x128x2 = 16384 B
    # each -> 36864 B x 8 warps = 294912 B, plus cp.async K and V 2 x 16384 = 32768 B -> 327680 B for
    # 2 x 128 x 64 x 128 = 2097152 FMA: 0.156 B/FMA.  FA2's 4 warps x 32 rows: (8192 + 32768) x 4 + 32768
    # = 196608 B: 0.094 B/FMA.
    assert rl.tile_smem_bytes(128, 64, 128, 8) == 327680
    assert rl.tile_smem_bytes(128, 64, 128, 4) == 196608
    assert rl.tile_mma_flops(128, 64, 128) == 2 * 2097152
    assert 327680 / 2097152 == pytest.approx(0.15625)


def test_published_figures_and_bars() -> None:
    a100, h100, h200 = rl.GPUS["A100"], rl.GPUS["H100"], rl.GPUS["H200"]
    assert a100.mma_flops == pytest.approx(312e12, rel=0.01)  # datasheet: 312 TFLOP/s dense fp16
    assert h100.mma_flops == pytest.approx(989e12 * 2 / 3, rel=0.01)  # 2/3 of 989 TFLOP/s (mma.sync)
    assert a100.fma_per_smem_byte_bar == 8.0  # 1024 FMA/clk / 128 B/clk
    assert h100.fma_per_smem_byte_bar == pytest.approx(10.67, abs=0.01)
    assert h200.hbm_gb_s == 4800 and h200.sms == h100.sms == 132
    assert rl.gpu_spec("NVIDIA H100 80GB HBM3") is h100
    with pytest.raises(ValueError, match="V100"):
        rl.gpu_spec("V100")


def test_tile_ranges_mirror_block_info() -> None:
    # Causal, sq = sk = 256, 128 x 64: m 0 sees keys <= 127 -> tiles [0, 2); m 1 keys <= 255 -> [0, 4).
    assert rl.kv_tile_ranges(256, 256, 128, 64, -1, 0) == [[2, 4]]
    # 8 tiles in 3 splits of ceil(8 / 3) = 3: [0, 3), [3, 6), [6, 8).
    assert rl.kv_tile_ranges(128, 512, 128, 64, -1, -1, 3) == [[3], [3], [2]]
    # Window (64, 0), sq = sk = 512: m 0 [0, 2); m 1 first key 128 - 64 = 64 -> tile 1, to 4: 3 tiles;
    # m 2 keys 192.. -> tile 3 to 6; m 3 keys 320.. -> tile 5 to 8.
    assert rl.kv_tile_ranges(512, 512, 128, 64, 64, 0) == [[2, 3, 3, 3]]
    # Causal with sq > sk: the first m_block's rows see no key.
    assert rl.kv_tile_ranges(256, 64, 128, 64, -1, 0) == [[0, 1]]


def test_one_cta_on_two_sms_is_occupancy_bound() -> None:
    r = rl.predict(1, 1, 1, 128, 128, 64, TOY2, block_m=128, block_n=64, num_warps=8, head_dim_tile=64)
    # One CTA, 2 tiles.  Per tile: 4 x 128 x 64 x 64 = 2097152 FLOP at 2.048e12 /s = 1.024 us; shared bytes
    # 8 x (16 x 64 x 2 + 2 x 64 x 64 x 2) + 2 x 64 x 64 x 2 = 163840.  Per CTA 3 x 128 x 64 x 2 = 49152.
    # CTA time = max(2.048 us, (327680 + 49152) B / 128e9 B/s = 2.944 us) = 2.944 us.
    assert r.ctas == 1 and r.t_schedule == pytest.approx(2.944e-6)
    assert r.t_tensor == pytest.approx(4194304 / 4.096e12)  # 1.024 us over both SMs
    assert r.t_smem == pytest.approx(376832 / 256e9)  # 1.472 us
    # HBM: K, V 2 x 128 x 64 x 2 = 32768; Q, O the same; LSE 128 x 4 = 512 -> 66048 B, one SM of two busy
    # -> 500 GB/s -> 0.132 us.
    assert r.hbm_bytes == 66048 and r.t_hbm == pytest.approx(66048 / 500e9)
    assert r.time == pytest.approx(2.944e-6)
    assert r.bound == "waves/occupancy"  # 2.944 > 1.25 x 1.472
    assert r.useful_flops == 4 * 128 * 128 * 64


def test_special_functions_and_the_serial_estimate() -> None:
    # Per tile 1.5 x 128 x 64 = 12288 ex2 + pack conversions; at 16 per clock and 1 GHz 0.768 us, so the one
    # CTA of the occupancy case spends 1.536 us on them: under its shared-memory 2.944 us (overlap bound
    # unchanged), and the serial estimate adds all three: 2.048 + 2.944 + 1.536 = 6.528 us.
    assert rl.tile_sfu_ops(128, 64) == 12288
    r = rl.predict(1, 1, 1, 128, 128, 64, TOY2, block_m=128, block_n=64, num_warps=8, head_dim_tile=64)
    assert r.t_sfu == pytest.approx(2 * 12288 / 32e9)
    assert r.time == pytest.approx(2.944e-6) and r.serial == pytest.approx(6.528e-6)
    # Special functions at a quarter of the rate (4 per clock): 6.144 us per CTA bound the full grid.
    slow_sfu = dataclasses.replace(TOY100_FAST_HBM, sfu_ops_per_clk_sm=4)
    r = rl.predict(2, 100, 100, 128, 128, 64, slow_sfu, block_m=128, block_n=64, num_warps=4, head_dim_tile=64)
    assert r.t_schedule == pytest.approx(2 * 6.144e-6) and r.bound == "special functions"
    # The H200's rate: 16 x 132 SMs x 1.83 GHz.
    assert rl.gpu_spec("H200").sfu_ops_s == pytest.approx(16 * 132 * 1.83e9)


def test_full_grid_is_shared_memory_bound() -> None:
    # 200 equal CTAs (b = 2, h = 100, one m_block, 2 tiles each) on 100 SMs: 2 waves of 2.944 us; balanced
    # shared-memory time 200 x 376832 B / 12.8e12 B/s = 5.888 us = the makespan -> shared memory bound.
    r = rl.predict(2, 100, 100, 128, 128, 64, TOY100_FAST_HBM, block_m=128, block_n=64, num_warps=8,
                   head_dim_tile=64)
    assert r.ctas == 200 and r.t_schedule == pytest.approx(2 * 2.944e-6)
    assert r.t_smem == pytest.approx(200 * 376832 / 12.8e12)
    assert r.bound == "shared memory"
    # With 1000 GB/s the same grid is HBM bound: Q, K, V, O 4 x 2 x 128 x 100 x 64 x 2 = 13107200 B plus
    # LSE 2 x 100 x 128 x 4 = 102400 B -> 13.2096 us > 5.888 us.
    slow = rl.predict(2, 100, 100, 128, 128, 64, TOY100, block_m=128, block_n=64, num_warps=8, head_dim_tile=64)
    assert slow.bound == "HBM" and slow.time == pytest.approx(13209600 / 1e12)
    # 4 warps x 32 rows (the FA2 tile): per tile 4 x (32 x 64 x 2 + 16384) + 16384 = 90112 B, CTA
    # (2 x 90112 + 49152) / 128e9 = 1.792 us vs MMA 2.048 us -> tensor cores bound.
    r4 = rl.predict(2, 100, 100, 128, 128, 64, TOY100_FAST_HBM, block_m=128, block_n=64, num_warps=4,
                    head_dim_tile=64)
    assert r4.t_schedule == pytest.approx(2 * 2.048e-6) and r4.bound == "tensor cores"


def test_decode_tile_with_splits_is_hbm_bound() -> None:
    # One query row, sk = 6400 (100 tiles of 64), a 16-row 1-warp tile, 100 splits of one tile each.
    # CTA: MMA 4 x 16 x 64 x 64 / 2.048e12 = 0.128 us; shared bytes 16 x 64 x 2 + 2 x 64 x 64 x 2 +
    # 2 x 64 x 64 x 2 = 34816, plus 3 x 16 x 64 x 2 = 6144 -> 0.32 us.  HBM: K, V 2 x 6400 x 64 x 2 =
    # 1638400; Q, O 256; LSE 4; partials 2 x 100 x 65 x 4 = 52000 -> 1690660 B / 1000 GB/s = 1.69066 us.
    r = rl.predict(1, 1, 1, 1, 6400, 64, TOY100, block_m=16, block_n=64, num_warps=1, head_dim_tile=64,
                   num_splits=100)
    assert r.ctas == 100 and r.t_schedule == pytest.approx(0.32e-6)
    assert r.hbm_bytes == 1690660 and r.t_hbm == pytest.approx(1.69066e-6)
    assert r.bound == "HBM" and r.time == pytest.approx(1.69066e-6)


def test_makespan_list_schedule() -> None:
    assert rl._makespan([3.0, 1.0, 1.0, 1.0], 2) == 3.0  # slot A: 3; slot B: 1 + 1 + 1
    assert rl._makespan([1.0] * 5, 2) == 3.0  # ceil(5 / 2) waves
    # A 2, B 2; the two 1s end at 3 on A and B; the last 2 starts at 3 and ends at 5.
    assert rl._makespan([2.0, 2.0, 1.0, 1.0, 2.0], 2) == 5.0


def test_explain_reports_the_gpu_roofline_from_a_cpu_tensor() -> None:
    q = torch.randn(1, 1, 32, 64, dtype=torch.bfloat16)  # head dim 64: compiled in every dev build
    k = torch.randn(1, 8192, 8, 64, dtype=torch.bfloat16)
    e = flash_ext.explain(q, k, k, gpu="H100", verbose=False)
    assert e.ok and e.roofline is not None
    r = e.roofline
    # The GPU's tile, not the CPU plan's 16-row host tile; the 4 query heads of a group are 4 rows, which run
    # the "decode" variant: 16 rows x 64 keys on one warp, 18 KB of shared memory at head dim 64, so 8 CTAs per
    # SM by registers (dispatch.h); a baseline build (FLASH_EXT_GPU_FWD_WARPS=8) runs 128 x 64 on 8 warps.
    baseline = flash_ext.build_info()["gpu_fwd_warps"].startswith("8")
    tile = (128, 64, 8, 1) if baseline else (16, 64, 1, 8)
    assert e.plan["block_m"] == 16 and (r.block_m, r.block_n, r.num_warps, r.ctas_per_sm) == tile
    assert e.plan["kernel_problem"]["seqlen_q"] == 4 and e.plan["kernel_problem"]["h"] == 8
    assert r.num_splits > 1  # 8 CTAs on 132 SMs are split
    # What the decode tile is for (issue #14): the step is bound by reading K and V from HBM, with the
    # shared-memory and tensor-core work well below it.
    if not baseline:
        assert r.bound == "HBM" and r.t_smem < 0.5 * r.t_hbm and r.t_tensor < 0.5 * r.t_hbm, str(r)
    assert "roofline" in str(e) and "H100" in str(e)
    with pytest.raises(ValueError, match="A100"):
        flash_ext.explain(q, k, k, gpu="V100", verbose=False)
    # fp32 runs on the CPU only: no GPU prediction, and the explanation says why.
    e32 = flash_ext.explain(q.float(), k.float(), k.float(), gpu="A100", verbose=False)
    assert e32.ok and e32.roofline is None and "float16/bfloat16" in str(e32)


@pytest.mark.parametrize("gpu", ["A100", "H100", "H200"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_gqa_decode_steps_are_hbm_bound_on_the_decode_tile(head_dim: int, gpu: str) -> None:
    """Issue #14's "done when": a decode step's plan is bound by HBM in the model.  32 query heads over 8 K/V
    heads (4 rows per K/V head after the group swap), small and large batches and caches."""
    if head_dim not in flash_ext.build_info()["host_head_dims"]:
        pytest.skip(f"head dim {head_dim} has no CPU kernel in this build (the plan comes from a CPU call)")
    baseline = flash_ext.build_info()["gpu_fwd_warps"].startswith("8")
    for b, sk in ((1, 4096), (8, 8192), (8, 65536)):
        q = torch.randn(b, 1, 32, head_dim, dtype=torch.bfloat16)
        k = torch.empty(b, sk, 8, head_dim, dtype=torch.bfloat16)
        r = flash_ext.explain(q, k, k, gpu=gpu, verbose=False).roofline
        assert r is not None and r.block_m == (128 if baseline else 16 if head_dim < 256 else 32), str(r)
        if not baseline:
            assert r.bound == "HBM", f"b={b} sk={sk}: {r}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_dim_128_prefill_tiles_per_gpu_class(dtype: torch.dtype) -> None:
    """dispatch.h's head-dim-128 tiles, as FA2 2.8 chooses them: a tile-multiple problem, causal or not,
    runs 128 x 64 on 4 warps where a CTA may take 163 KB or more of shared memory (A100, H100, H200: 64 KB
    each, 10.7 FMA per shared byte, sm_90's bar); on sm_86/sm_89's 99 KB that tile would leave one CTA of 4
    warps per SM, so they keep 128 x 32 (48 KB, two CTAs).  Odd lengths keep 128 x 32 everywhere (64 keys
    spilled there, nvcc 13.0).  Expected values are the rule's, written by hand."""
    from flash_ext import _C

    if flash_ext.build_info()["gpu_fwd_warps"].startswith("8"):
        pytest.skip("the baseline build runs 128 x 64 on 8 warps everywhere")

    def tile(causal: bool, smem_kb: int, seqlen: int, local: bool = False, alibi: bool = False) -> tuple:
        t = _C.gpu_tile_config(128, causal, smem_kb * 1024, seqlen, seqlen, False, local, alibi, False, 1, False)
        return t["variant"], t["block_m"], t["block_n"], t["num_warps"], t["smem_bytes"], t["ctas_per_sm"]

    for smem_kb in (163, 227):  # A100; H100 / H200
        assert tile(False, smem_kb, 2048) == ("even", 128, 64, 4, 65536, 2)
        assert tile(True, smem_kb, 2048) == ("even", 128, 64, 4, 65536, 2)
        assert tile(False, smem_kb, 2000) == ("uneven", 128, 32, 4, 49152, 2)
        assert tile(True, smem_kb, 2000) == ("uneven", 128, 32, 4, 49152, 2)
    assert tile(False, 99, 2048) == ("even", 128, 32, 4, 49152, 2)  # sm_86 / sm_89
    assert tile(True, 99, 2048) == ("even", 128, 32, 4, 49152, 2)
    # `general` (windows, ALiBi, softcap): 4 warps x 32 keys without causal (a causal sliding window runs
    # the non-causal file as a local problem), 8 warps x 64 keys with causal, where 4 warps spilled.
    for smem_kb in (163, 227, 99):
        assert tile(False, smem_kb, 2048, local=True) == ("general", 128, 32, 4, 49152, 2)
        assert tile(True, smem_kb, 2048, alibi=True) == ("general", 128, 64, 8, 65536, 1)
    # The model on those tiles: the 64-key tile meets sm_90's feed bar (2 x 32 x 64 x 128 FMA per warp and
    # tile over (32 + 2 x 64) x 128 x 2 B of ldmatrix plus its quarter of 2 x 64 x 128 x 2 B of cp.async).
    if 128 in flash_ext.build_info()["host_head_dims"]:  # explain() plans a CPU call first
        q = torch.randn(1, 2048, 16, 128, dtype=dtype)
        r = flash_ext.explain(q, q, q, gpu="H100", verbose=False).roofline
        assert (r.block_n, r.num_warps) == (64, 4)
    assert rl.tile_mma_flops(128, 64, 128) / 2 / rl.tile_smem_bytes(128, 64, 128, 4) == pytest.approx(32 / 3)
