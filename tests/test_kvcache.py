"""flash_attn_with_kvcache against a reference that appends and rotates first, then calls attention_ref on
the visible keys of each batch entry; paged vs contiguous caches; bad indices."""
from __future__ import annotations

import pytest
import torch

import flash_ext
from flash_ext.kvcache import apply_rotary
from flash_ext.reference import rotary_ref
from attn_check import check_close
from conftest import DEVICES, require_device


def _rotary_tables(seqlen: int, rotary_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(seqlen, rotary_dim // 2, device=device) * 6.28
    return angles.cos(), angles.sin()


def _reference(q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad, causal, window, interleaved):
    """Appends and rotates with plain indexing (rotary from flash_ext.reference.rotary_ref, written
    independently of the implementation), then checks per batch entry against attention_ref."""
    b, sq = q.shape[:2]
    kc, vc = k_cache.clone(), v_cache.clone()
    qs, ks, vs, outs = [], [], [], []
    for i in range(b):
        bi = int(batch_idx[i]) if batch_idx is not None else i
        start = int(seqlens[i])
        lp = int(leftpad[i]) if leftpad is not None else 0
        qi = q[i:i + 1]
        if k is not None:
            pos = torch.arange(start, start + k.shape[1], device=q.device)[None]
            ki = rotary_ref(k[i:i + 1], cos, sin, pos, interleaved) if cos is not None else k[i:i + 1]
            kc[bi, start:start + k.shape[1]] = ki[0]
            vc[bi, start:start + k.shape[1]] = v[i]
            if cos is not None:
                local = causal or window != (-1, -1)
                qpos = (torch.arange(sq, device=q.device) + start if local else torch.full((sq,), start, device=q.device))
                qi = rotary_ref(qi, cos, sin, qpos[None], interleaved)
        end = start + (k.shape[1] if k is not None else 0)
        qs.append(qi)
        ks.append(kc[bi:bi + 1, lp:end])
        vs.append(vc[bi:bi + 1, lp:end])
    return qs, ks, vs, kc, vc


CASES = [
    # b, sq, cache_len, hk, h, d, seqlen_new, kwargs
    (2, 1, 300, 2, 8, 64, 1, {"causal": True}),                                    # decode step, GQA
    (3, 4, 500, 1, 4, 128, 4, {"causal": True, "rotary": "neox"}),                 # speculative, rotary
    (2, 7, 256, 2, 2, 64, 7, {"window_size": (50, 0), "rotary": "gptj"}),
    (2, 5, 400, 2, 2, 96, 0, {}),                                                  # no append
    (2, 3, 333, 2, 4, 64, 3, {"causal": True, "batch_idx": True, "leftpad": True}),
    # Non-causal rotary: every query row is rotated at the first new position; rotary_dim < d.
    (2, 3, 200, 2, 4, 64, 2, {"rotary": "neox", "rotary_dim": 16}),
    (2, 2, 150, 1, 2, 64, 2, {"rotary": "gptj", "rotary_dim": 64}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kvcache_matches_reference(device: str, case: int) -> None:
    device = require_device(device)
    b, sq, cache_len, hk, h, d, new, kw = CASES[case]
    dtype = torch.bfloat16
    b_cache = b + 2 if kw.get("batch_idx") else b
    k_cache = torch.randn(b_cache, cache_len, hk, d, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, sq, h, d, dtype=dtype, device=device)
    k = torch.randn(b, new, hk, d, dtype=dtype, device=device) if new else None
    v = torch.randn(b, new, hk, d, dtype=dtype, device=device) if new else None
    seqlens = torch.randint(10, cache_len - new, (b,), dtype=torch.int32, device=device)
    batch_idx = torch.randperm(b_cache, device=device)[:b].to(torch.int32) if kw.get("batch_idx") else None
    leftpad = torch.randint(0, 8, (b,), dtype=torch.int32, device=device) if kw.get("leftpad") else None
    cos = sin = None
    if "rotary" in kw:
        cos, sin = _rotary_tables(cache_len, kw.get("rotary_dim", d // 2), device)
    interleaved = kw.get("rotary") == "gptj"
    causal, window = kw.get("causal", False), kw.get("window_size", (-1, -1))
    qs, ks, vs, kc_ref, vc_ref = _reference(q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad,
                                             causal, window, interleaved)
    out, lse = flash_ext.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, cache_batch_idx=batch_idx,
        cache_leftpad=leftpad, causal=causal, window_size=window, rotary_interleaved=interleaved,
        return_softmax_lse=True)
    assert torch.equal(v_cache, vc_ref), "append must write exactly the new rows"
    if cos is None:
        assert torch.equal(k_cache, kc_ref), "append must write exactly the new rows"
    else:  # rotated keys: fp32 rotation vs the reference's float64 one, each rounded once to bf16
        assert ((k_cache.double() - kc_ref.double()).abs() <= 2 ** -7 * kc_ref.double().abs()).all()
    for i in range(b):
        check_close(out[i:i + 1], lse[i:i + 1], qs[i], ks[i], vs[i], causal=causal, window_size=window,
                    context=f"case {case} batch entry {i}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 4, 0])
def test_paged_equals_contiguous(device: str, num_splits: int) -> None:
    device = require_device(device)
    b, h, hk, d, page, pages_per_seq = 3, 8, 2, 128, 128, 4
    cache_len = page * pages_per_seq
    k_cache = torch.randn(b, cache_len, hk, d, dtype=torch.float16, device=device)
    v_cache = torch.randn_like(k_cache)
    # Scatter the contiguous caches into pages in a shuffled order.
    perm = torch.randperm(b * pages_per_seq, device=device)
    table = perm.view(b, pages_per_seq).to(torch.int32)
    k_pages = torch.empty(b * pages_per_seq, page, hk, d, dtype=torch.float16, device=device)
    v_pages = torch.empty_like(k_pages)
    k_pages[perm] = k_cache.reshape(b * pages_per_seq, page, hk, d)
    v_pages[perm] = v_cache.reshape(b * pages_per_seq, page, hk, d)
    q = torch.randn(b, 2, h, d, dtype=torch.float16, device=device)
    k_new = torch.randn(b, 2, hk, d, dtype=torch.float16, device=device)
    v_new = torch.randn_like(k_new)
    seqlens = torch.tensor([5, 200, 300], dtype=torch.int32, device=device)
    out_c = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                              num_splits=num_splits)
    out_p = flash_ext.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=seqlens,
                                              block_table=table, causal=True, num_splits=num_splits)
    assert torch.equal(out_c, out_p)
    assert torch.equal(k_pages[perm].reshape_as(k_cache), k_cache)  # appended rows landed in the right pages


def test_kvcache_whole_cache_by_default() -> None:
    """Without new keys and cache_seqlens, every row of the cache is attended to."""
    q = torch.randn(2, 3, 4, 64, dtype=torch.bfloat16)
    k_cache = torch.randn(2, 50, 2, 64, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    out, lse = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, return_softmax_lse=True)
    check_close(out, lse, q, k_cache, v_cache, causal=True, context="whole cache")


def test_kvcache_bad_indices() -> None:
    q = torch.randn(2, 1, 2, 64)
    k_cache = torch.randn(2, 16, 2, 64)
    new = torch.randn(2, 1, 2, 64)
    with pytest.raises(ValueError, match="capacity"):
        flash_ext.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), new, new, cache_seqlens=16)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_ext.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), new, new)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flash_ext.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=4,
                                          cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32))
    pages = torch.randn(4, 128, 2, 64)
    with pytest.raises(ValueError, match="block_table"):
        flash_ext.flash_attn_with_kvcache(q, pages, pages.clone(), cache_seqlens=100,
                                          block_table=torch.tensor([[0], [9]], dtype=torch.int32))
    with pytest.raises(ValueError, match="page size"):
        small = torch.randn(4, 16, 2, 64)
        flash_ext.flash_attn_with_kvcache(q, small, small.clone(), cache_seqlens=4,
                                          block_table=torch.tensor([[0], [1]], dtype=torch.int32))


def test_kvcache_bad_append_writes_nothing() -> None:
    """Every refused append leaves both caches untouched (the op checks all indices before it writes)."""
    q = torch.randn(2, 1, 2, 64)
    k_cache = torch.randn(3, 16, 2, 64)
    v_cache = torch.randn_like(k_cache)
    new = torch.randn(2, 2, 2, 64)
    cos, sin = torch.randn(10, 16).cos(), torch.randn(10, 16).sin()
    kc, vc = k_cache.clone(), v_cache.clone()
    bad_calls = [
        ({"cache_seqlens": torch.tensor([3, -1], dtype=torch.int32)}, "cache_seqlens"),   # negative: no wrap-around
        ({"cache_seqlens": torch.tensor([3, 15], dtype=torch.int32)}, "capacity"),        # 15 + 2 > 16
        ({"cache_seqlens": 9, "rotary_cos": cos, "rotary_sin": sin}, "rotary"),           # positions 9, 10 of 10
        ({"cache_seqlens": 2, "cache_batch_idx": torch.tensor([0, 3], dtype=torch.int32)}, "cache_batch_idx"),
        ({"cache_seqlens": 2, "cache_batch_idx": torch.tensor([0, 1])}, "cache_batch_idx"),  # int64
        ({"cache_seqlens": 2, "rotary_cos": torch.ones(10, 40), "rotary_sin": torch.zeros(10, 40)}, "rotary_dim"),
    ]
    for kwargs, needle in bad_calls:
        with pytest.raises(ValueError, match=needle):
            flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, **kwargs)
        assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc), kwargs
    pages = torch.randn(4, 128, 2, 64)
    before = pages.clone()
    with pytest.raises(ValueError, match="block_table"):
        flash_ext.flash_attn_with_kvcache(q, pages, pages.clone(), new, new, cache_seqlens=127,
                                          block_table=torch.tensor([[0, 1], [2, 7]], dtype=torch.int32))
    assert torch.equal(pages, before)


def test_kvcache_python_errors_listed_at_once() -> None:
    """Shape/type problems the Python layer sees are reported together, each naming its argument."""
    q = torch.randn(2, 1, 2, 64)
    k_cache = torch.randn(2, 16, 2, 64)
    cos = torch.randn(16, 16)
    with pytest.raises(ValueError) as info:
        flash_ext.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), k=torch.randn(2, 1, 2, 64),
                                          rotary_cos=cos, cache_seqlens=torch.tensor([1, 2]), window_size=(3,))
    msg = str(info.value)
    assert "4 invalid arguments" in msg
    for needle in ("window_size", "k/v", "rotary_cos/rotary_sin", "cache_seqlens"):
        assert needle in msg, (needle, msg)
    # Rotary tables without new keys: flash_attn refuses them; so do we (rather than ignore them).
    with pytest.raises(ValueError, match="without new k/v"):
        flash_ext.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), rotary_cos=cos, rotary_sin=cos,
                                          cache_seqlens=3)


def test_kvcache_op_reports_every_malformed_index_tensor() -> None:
    q = torch.randn(2, 1, 2, 64)
    k_cache = torch.randn(2, 16, 2, 64)
    with pytest.raises(ValueError) as info:
        torch.ops.flash_ext.kvcache_fwd(q, k_cache, k_cache, None, None, torch.tensor([1, 2]), torch.tensor([0, 1]),
                                        None, None, 0.1, False, -1, -1, 0.0, None, 0)
    msg = str(info.value)
    assert "2 invalid arguments" in msg and "cache_seqlens" in msg and "cache_batch_idx" in msg, msg


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("rotary_dim", [64, 32, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_apply_rotary_matches_independent_reference(interleaved, rotary_dim, dtype) -> None:
    """The implementation's rotary (fp32 math) against the reference's (float64 complex / rotation-matrix
    formulation): equal up to one rounding of the output dtype; channels past rotary_dim untouched."""
    x = torch.randn(2, 5, 3, 64).to(dtype)
    cos, sin = _rotary_tables(40, rotary_dim, "cpu")
    pos = torch.randint(0, 40, (2, 5))
    got, want = apply_rotary(x, cos, sin, pos, interleaved), rotary_ref(x, cos, sin, pos, interleaved)
    ulp = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7}[dtype]
    assert ((got.double() - want.double()).abs() <= ulp * (want.double().abs() + 1)).all()
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])
    # A rotation is not the identity: the test can tell a missing or mis-paired rotation apart.
    assert not torch.allclose(got[..., :rotary_dim].double(), x[..., :rotary_dim].double(), atol=1e-2)


@pytest.mark.parametrize("emulated", [False, True], ids=["host", "emulated"])
def test_q_viewing_the_appended_rows_is_read_as_passed(emulated: bool) -> None:
    """q a view of the very cache rows the call appends to: the op appended first and then read q, so the
    attention ran with the new k as its query (error 2.8, no warning).  Now q is copied before the append:
    the result is the clone's bit for bit and matches the float64 reference of the q as passed."""
    if emulated and 64 not in flash_ext.build_info()["emulator_head_dims"]:
        pytest.skip("no emulated head dim 64 in this build")
    from flash_ext.reference import attention_ref
    import contextlib
    torch.manual_seed(0)
    k_cache = torch.randn(1, 64, 2, 64, dtype=torch.float16)
    v_cache = torch.randn(1, 64, 2, 64, dtype=torch.float16)
    k_new, v_new = torch.randn(1, 1, 2, 64, dtype=torch.float16), torch.randn(1, 1, 2, 64, dtype=torch.float16)
    q_as_passed = k_cache[:, 10:11].clone()
    kc, vc = k_cache.clone(), v_cache.clone()
    with flash_ext.emulate() if emulated else contextlib.nullcontext():
        from_clone = flash_ext.flash_attn_with_kvcache(q_as_passed, kc, vc, k_new, v_new, cache_seqlens=10)
        out = flash_ext.flash_attn_with_kvcache(k_cache[:, 10:11], k_cache, v_cache, k_new, v_new, cache_seqlens=10)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
    assert torch.equal(out, from_clone)
    expected, _ = attention_ref(q_as_passed, kc[:, :11], vc[:, :11])
    assert (out.double() - expected).abs().max() < 2e-3
