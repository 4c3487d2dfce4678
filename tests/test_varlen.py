"""Variable-length batches (flash_attn_varlen_func and packed variants) against a per-sequence float64
reference, with the same pass rule as the fixed-length tests (tests/attn_check.py)."""
from __future__ import annotations

import itertools

import pytest
import torch

import flash_ext
from attn_check import check_close
from conftest import DEVICES, require_device


def _skip(device: str) -> None:
    require_device(device)  # skips without a usable GPU; fails a CUDA item without the cuda mark


def _cu(lengths: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=device)


def _run_and_check(lens_q, lens_k, h, hk, d, dtype, device, seqused=None, **kw):
    q = torch.randn(sum(lens_q), h, d, dtype=dtype, device=device)
    k = torch.randn(sum(lens_k), hk, d, dtype=dtype, device=device)
    v = torch.randn(sum(lens_k), hk, d, dtype=dtype, device=device)
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    used_t = torch.tensor(seqused, dtype=torch.int32, device=device) if seqused is not None else None
    out, lse, _ = flash_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q, default=0),
                                                   max(lens_k, default=0), return_attn_probs=True,
                                                   seqused_k=used_t, **kw)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq == 0:
            continue
        kk = seqused[i] if seqused is not None else lk
        qs = q[cu_q[i]:cu_q[i + 1]][None]
        ks = k[cu_k[i]:cu_k[i] + kk][None]
        vs = v[cu_k[i]:cu_k[i] + kk][None]
        alibi = kw.get("alibi_slopes")
        kw_i = dict(kw, alibi_slopes=alibi[i:i + 1] if alibi is not None and alibi.dim() == 2 else alibi)
        check_close(out[cu_q[i]:cu_q[i + 1]][None], lse[:, cu_q[i]:cu_q[i + 1]][None], qs, ks, vs,
                    context=f"sequence {i} (sq {lq}, sk {kk})", **kw_i)


CASES = [
    # lens_q, lens_k, h, hk, d, kwargs
    ([5, 0, 130, 1, 77], [9, 3, 130, 200, 1], 4, 2, 40, {"causal": True}),          # zero-length q, sq > sk
    ([1] * 7, [1] * 7, 2, 1, 64, {}),                                              # all length 1
    ([1, 1, 1], [300, 17, 1], 6, 2, 128, {"causal": True}),                        # max_seqlen_q 1 (decode)
    ([200, 129], [100, 0], 2, 2, 59, {"causal": True}),                            # sk 0: empty rows
    ([128, 256], [128, 256], 3, 3, 96, {"window_size": (32, 8)}),
    ([70, 300, 5], [300, 70, 5], 4, 4, 32, {"softcap": 20.0}),
    ([33, 150], [150, 33], 4, 1, 80, {"alibi_slopes": "per-batch", "causal": True}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_varlen_matches_per_sequence_reference(device: str, case: int) -> None:
    _skip(device)
    lens_q, lens_k, h, hk, d, kw = CASES[case]
    dtype = torch.bfloat16 if case % 2 == 0 else torch.float16
    if kw.get("alibi_slopes") == "per-batch":
        kw = dict(kw, alibi_slopes=torch.rand(len(lens_q), h, device=device) * 0.5)
    _run_and_check(lens_q, lens_k, h, hk, d, dtype, device, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_seqused_k(device: str) -> None:
    _skip(device)
    _run_and_check([40, 90, 3], [100, 90, 50], 2, 2, 64, torch.bfloat16, device, seqused=[60, 0, 50], causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_packed_variants_match_unpacked(device: str) -> None:
    _skip(device)
    lens = [17, 64, 129]
    cu = _cu(lens, device)
    qkv = torch.randn(sum(lens), 3, 4, 64, dtype=torch.bfloat16, device=device)
    ref = flash_ext.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 129, 129, causal=True)
    packed = flash_ext.flash_attn_varlen_qkvpacked_func(qkv, cu, 129, causal=True)
    kvpacked = flash_ext.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, 129, 129, causal=True)
    assert torch.equal(ref, packed) and torch.equal(ref, kvpacked)


def test_varlen_equals_fixed_length_batch() -> None:
    """A varlen batch of equal lengths is the fixed-length batch: results must be bit-identical."""
    b, s, h, d = 3, 100, 4, 64
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16) for _ in range(3))
    cu = _cu([s] * b, "cpu")
    out_fixed, lse_fixed, _ = flash_ext.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out_var, lse_var, _ = flash_ext.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu,
                                                           s, s, causal=True, return_attn_probs=True)
    assert torch.equal(out_var.view(b, s, h, d), out_fixed)
    assert torch.equal(lse_var.view(h, b, s).transpose(0, 1), lse_fixed)


def _bad_call(**over):
    q = torch.randn(10, 2, 64, dtype=torch.bfloat16)
    k = torch.randn(12, 2, 64, dtype=torch.bfloat16)
    args = dict(q=q, k=k, v=k.clone(), cu_seqlens_q=_cu([4, 6], "cpu"), cu_seqlens_k=_cu([5, 7], "cpu"),
                max_seqlen_q=6, max_seqlen_k=7)
    args.update(over)
    return flash_ext.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("over, needle", [
    (dict(cu_seqlens_q=torch.tensor([0, 6, 4], dtype=torch.int32)), "non-decreasing"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 6, 10], dtype=torch.int32)), "cu_seqlens_k"),   # lengths differ
    # beyond q's rows (fewer is a padded batch, accepted as in flash_attn: test_contract.py)
    (dict(cu_seqlens_q=torch.tensor([0, 4, 11], dtype=torch.int32), max_seqlen_q=7), "cu_seqlens_q[-1]"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 13], dtype=torch.int32)), "cu_seqlens_k[-1]"),  # beyond k rows
    (dict(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=torch.int32)), "cu_seqlens_q[0]"),
    (dict(max_seqlen_q=5), "max_seqlen_q"),
    (dict(max_seqlen_k=3), "max_seqlen_k"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int64)), "int32"),
    (dict(seqused_k=torch.tensor([9, 1], dtype=torch.int32)), "seqused_k"),
])
def test_varlen_bad_input(over: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        _bad_call(**over)
    assert needle in str(err.value), str(err.value)


def test_varlen_bad_input_lists_everything_at_once() -> None:
    with pytest.raises(ValueError) as err:
        _bad_call(cu_seqlens_q=torch.tensor([0, 6, 4], dtype=torch.int32), max_seqlen_k=3,
                  softcap=float("nan"))
    msg = str(err.value)
    assert "non-decreasing" in msg and "max_seqlen_k" in msg and "softcap" in msg, msg


def _paged_copy(k: torch.Tensor, cu_k: torch.Tensor, page_size: int, max_pages: int, seed: int = 0):
    """k (total_k, hk, d) -> (pages (num_pages, page_size, hk, d), block_table (b, max_pages)): each sequence's
    rows scattered over randomly chosen pages, the unused page rows filled with NaN (never read)."""
    b = cu_k.numel() - 1
    gen = torch.Generator().manual_seed(seed)
    num_pages = b * max_pages + 3
    perm = torch.randperm(num_pages, generator=gen)
    table = perm[: b * max_pages].reshape(b, max_pages).to(torch.int32)
    pages = torch.full((num_pages, page_size) + tuple(k.shape[1:]), float("nan"), dtype=k.dtype)
    for i in range(b):
        seq = k[cu_k[i]:cu_k[i + 1]].cpu()
        for j in range(0, seq.shape[0], page_size):
            part = seq[j:j + page_size]
            pages[table[i, j // page_size], :part.shape[0]] = part
    return pages.to(k.device), table.to(k.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 40])
def test_varlen_paged_kv_equals_contiguous(device: str, d: int) -> None:
    """flash_attn_varlen_func with block_table: the same keys in scattered pages give the same bits as the
    packed layout (and that one matches the reference); NaN page padding proves unused rows are not read."""
    _skip(device)
    lens_q, lens_k = [3, 0, 129, 1], [300, 7, 200, 0]
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    q = torch.randn(sum(lens_q), 6, d, dtype=torch.bfloat16, device=device)
    k = torch.randn(sum(lens_k), 2, d, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    k_pages, table = _paged_copy(k, cu_k, 128, 3)
    v_pages, _ = _paged_copy(v, cu_k, 128, 3)
    kw = dict(causal=True, window_size=(100, -1), return_attn_probs=True)
    out_c, lse_c, _ = flash_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 129, 300, **kw)
    out_p, lse_p, _ = flash_ext.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 129, 300,
                                                       block_table=table, **kw)
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)
    for i in (0, 2):
        check_close(out_p[cu_q[i]:cu_q[i + 1]][None], lse_p[:, cu_q[i]:cu_q[i + 1]][None],
                    q[cu_q[i]:cu_q[i + 1]][None], k[cu_k[i]:cu_k[i + 1]][None], v[cu_k[i]:cu_k[i + 1]][None],
                    causal=True, window_size=(100, -1), context=f"paged sequence {i}")


def test_varlen_paged_bad_input() -> None:
    cu_q, cu_k = _cu([2, 3], "cpu"), _cu([130, 40], "cpu")
    q = torch.randn(5, 2, 64)
    pages = torch.randn(4, 128, 2, 64)
    good = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)

    def call(k=pages, table=good, cu=cu_k, max_k=130):
        return flash_ext.flash_attn_varlen_func(q, k, k, cu_q, cu, 3, max_k, block_table=table)

    call()  # valid
    with pytest.raises(ValueError, match="page size"):
        call(k=torch.randn(8, 64, 2, 64))
    with pytest.raises(ValueError, match="block_table"):
        call(table=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32))   # page 9 of 4, in use (130 keys)
    with pytest.raises(ValueError, match="block_table"):
        call(table=good.long())
    with pytest.raises(ValueError, match="longer than its pages"):
        call(cu=_cu([300, 40], "cpu"), max_k=300)                        # 300 keys > 2 pages x 128
    with pytest.raises(ValueError, match=r"k: got 3 dims"):
        call(k=torch.randn(170, 2, 64))
    # A page past the ones in use may hold anything (here an invalid index): it is never read.
    call(table=torch.tensor([[0, 1], [2, -5]], dtype=torch.int32))
