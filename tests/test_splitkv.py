"""Split-KV (FlashDecoding): partial results per K/V share, merged by the combine step.  Every split count
must give the reference answer (tests/attn_check.py rule); empty splits and rows that no split sees must
come through the combine as -inf partials / +inf LSE, never NaN (outputs and partials are poisoned)."""
from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

import flash_ext
from attn_check import check_close, make_alibi, make_qkv
from conftest import DEVICES, require_device, skip_unless_head_dim_built

heuristic = flash_ext._C.num_splits_heuristic

DECODE = [
    # b, sq, sk, h, hk, d, kwargs
    (1, 1, 20000, 8, 1, 128, {}),                                  # long-context decode, MQA
    (2, 4, 3000, 8, 2, 64, {"causal": True}),                      # speculative decode, GQA
    (1, 16, 1500, 4, 4, 96, {"window_size": (300, 0)}),            # local: most splits see nothing
    (1, 300, 100, 2, 2, 64, {"causal": True}),                     # sq > sk: rows with no key
    (1, 7, 777, 6, 2, 59, {"alibi_slopes": "h", "softcap": 10.0}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(DECODE)))
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8, 0])
def test_split_counts_match_reference(device: str, case: int, num_splits: int) -> None:
    device = require_device(device)
    b, sq, sk, h, hk, d, kw = DECODE[case]
    if kw.get("alibi_slopes") == "h":
        kw = dict(kw, alibi_slopes=make_alibi(b, h, per_batch=False, device=device))
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, device)
    out, lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True, num_splits=num_splits, **kw)
    check_close(out, lse, q, k, v, context=f"num_splits={num_splits} case {case}", **kw)
    unsplit, lse1, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True, num_splits=1, **kw)
    # Same algorithm up to the combine's fp32 re-weighting: far tighter than the reference rule.
    assert (out.float() - unsplit.float()).abs().max().item() <= 2 * 2 ** -7
    assert torch.equal(lse.isinf(), lse1.isinf())


@pytest.mark.parametrize("device", DEVICES)
def test_more_splits_than_tiles(device: str) -> None:
    """Forced splits beyond the number of K/V tiles leave some splits empty; the result is unchanged."""
    device = require_device(device)
    q, k, v = make_qkv(1, 2, 70, 2, 2, 64, torch.float16, device)
    out, lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True, num_splits=64)
    check_close(out, lse, q, k, v, context="64 splits over 2 tiles")


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_with_splits(device: str) -> None:
    device = require_device(device)
    lens_q, lens_k = [1, 3, 0, 2], [900, 5, 40, 2000]
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), 4, 64, dtype=torch.bfloat16, device=device)
    k = torch.randn(sum(lens_k), 2, 64, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    ref = flash_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 2000, causal=True, num_splits=1)
    for splits in (4, 0):
        out = flash_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 2000, causal=True, num_splits=splits)
        assert (out.float() - ref.float()).abs().max().item() <= 2 * 2 ** -7


def test_heuristic_rules() -> None:
    # A grid that fills the processors is never split.
    assert heuristic(132 * 2, 132, 10000) == 1
    assert heuristic(120, 132, 10000) == 1          # >= 80% of a wave already
    # Too few K/V tiles: nothing to gain.
    assert heuristic(1, 132, 1) == 1
    # Decode with a long K/V: split, and use most of the machine.
    s = heuristic(8, 132, 2000)
    assert s > 1 and 8 * s <= 132 * 2
    # Never more splits than half the tiles (each split reads at least two tiles).
    assert heuristic(1, 132, 10) <= 5
    # Pure function of its inputs.
    assert heuristic(8, 132, 2000) == s


def cpu_l2_bytes() -> int:
    """L2 bytes per core as the OS reports them (glibc's sysconf _SC_LEVEL2_CACHE_SIZE, 191), else 1 MiB."""
    try:
        l2 = os.sysconf(191) if sys.platform.startswith("linux") else 0
    except (OSError, ValueError):
        l2 = 0
    return l2 if l2 > 0 else 1 << 20


def test_cpu_l2_reported() -> None:
    assert flash_ext.build_info()["cpu_l2_bytes"] == cpu_l2_bytes()


def test_heuristic_used_by_default_and_reported() -> None:
    q = torch.randn(1, 1, 1, 64)
    k = torch.randn(1, 8192, 1, 64)
    threads = torch.get_num_threads()
    e = flash_ext.explain(q, k, k, verbose=False)
    block_n = e.plan["block_n"]
    tiles = 8192 // block_n
    # CPU decode rule (launch_host.h): a split's K and V rows of every K/V head fit in half of L2.
    row_bytes = 2 * 64 * 4
    tiles_per_split = max(1, (cpu_l2_bytes() // 2) // (row_bytes * block_n))
    l2_rule = min(128, -(-tiles // tiles_per_split))
    assert e.plan["num_splits"] == max(heuristic(1, threads, tiles), l2_rule)
    assert flash_ext.explain(q, k, k, num_splits=1, verbose=False).plan["num_splits"] == 1
    assert flash_ext.explain(q, k, k, num_splits=6, verbose=False).plan["num_splits"] == 6


def test_cpu_decode_splits_follow_l2_and_layout() -> None:
    """The L2 rule counts the bytes of one key over all K/V heads; heads that do not lie side by side (a
    (b, h_k, s, d) cache seen through a transpose) are not warmed, so only the occupancy heuristic applies."""
    skip_unless_head_dim_built("cpu", 128)
    threads = torch.get_num_threads()
    q = torch.randn(1, 1, 16, 128, dtype=torch.bfloat16)

    def expected(plan: dict, warmed: bool) -> int:
        kp, block_n = plan["kernel_problem"], plan["block_n"]
        tiles = -(-kp["seqlen_k"] // block_n)
        ctas = kp["b"] * kp["h"] * -(-kp["seqlen_q"] // plan["block_m"])
        splits = heuristic(ctas, threads, tiles)
        if warmed:
            row_bytes = 2 * kp["h_k"] * kp["d"] * kp["element_size"]
            tiles_per_split = max(1, (cpu_l2_bytes() // 2) // (row_bytes * block_n))
            splits = max(splits, min(128, -(-tiles // tiles_per_split)))
        return splits

    k = torch.randn(1, 32768, 4, 128, dtype=torch.bfloat16)
    e = flash_ext.explain(q, k, k, verbose=False)
    assert e.plan["num_splits"] == expected(e.plan, warmed=True) > 1
    kt = torch.randn(1, 4, 32768, 128, dtype=torch.bfloat16).transpose(1, 2)
    et = flash_ext.explain(q, kt, kt, verbose=False)
    assert et.plan["num_splits"] == expected(et.plan, warmed=False)


@pytest.mark.parametrize("layout", ["bshd", "packed_kv", "bhsd_view", "paged"])
@pytest.mark.parametrize("num_splits", [3, 0])
def test_cpu_decode_warm_layouts(layout: str, num_splits: int) -> None:
    """CPU decode runs the heads of one (batch, split) back to back and warms their K/V rows first: every
    cache layout, GQA groups split across worker threads, and forced or automatic splits give the reference."""
    b, sk, h, hk, d = 2, 3001, 6, 3, 64
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v = make_qkv(b, 1, sk, h, hk, d, torch.bfloat16)
        if layout == "packed_kv":
            kv = torch.stack([k, v], dim=2)  # (b, s, 2, hk, d)
            kk, vv = kv[:, :, 0], kv[:, :, 1]
        elif layout == "bhsd_view":
            kk, vv = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
        else:
            kk, vv = k, v
        if layout == "paged":
            page = 256
            pages = -(-sk // page)
            perm = torch.randperm(b * pages)
            k_pages = torch.zeros(b * pages, page, hk, d, dtype=k.dtype)
            v_pages = torch.zeros_like(k_pages)
            kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pages * page - sk)).reshape(b * pages, page, hk, d)
            vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pages * page - sk)).reshape(b * pages, page, hk, d)
            k_pages[perm], v_pages[perm] = kp, vp
            table = perm.reshape(b, pages).to(torch.int32)
            out, lse = flash_ext.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=sk, block_table=table,
                                                         num_splits=num_splits, return_softmax_lse=True)
        else:
            out, lse = flash_ext.flash_attn_with_kvcache(q, kk, vv, cache_seqlens=sk, num_splits=num_splits,
                                                         return_softmax_lse=True)
        check_close(out, lse, q, k, v, context=f"layout {layout}, num_splits={num_splits}")
    finally:
        torch.set_num_threads(previous)


def test_num_splits_out_of_range() -> None:
    """Above 128 is refused; below 1 picks the heuristic, as flash_attn's C++ API does (test_contract.py)."""
    q = torch.randn(1, 4, 2, 64)
    for bad in (129, 1000):
        with pytest.raises(ValueError, match="num_splits"):
            flash_ext.flash_attn_func(q, q, q, num_splits=bad)
