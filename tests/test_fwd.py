"""Forward-pass correctness of flash_ext.flash_attn_func against flash_ext.reference.attention_ref.

The full shape x head-dim x heads x flags x dtype grid (``-m full``) takes hours on a small CPU; the default
run uses a deterministic sample of it (``DEFAULT_CASES``): every (shape, flag set) pair once, with the head
dim, head layout and dtype rotating so that every head dim, every head layout and every dtype meets every
flag set and several shapes (``test_default_sample_coverage`` checks this).  The pass rule is in
tests/attn_check.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import flash_ext
from flash_ext import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flash_ext.reference import attention_ref

from attn_check import (DTYPE_NAMES, check_close, check_large_scores, make_alibi, make_large_score_qkv, make_qkv,
                        make_rising_maxima_qkv)
from conftest import DEVICES, require_device

SHAPES = [(1, 1), (1, 239), (3, 799), (113, 203), (127, 512), (128, 217), (256, 512), (512, 256), (1023, 1024),
          (1024, 1023)]
HEAD_DIMS = [8, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
HEADS = [(6, 6), (6, 2), (6, 1)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Flag sets.  "local" windows depend on the shape (see _flag_kwargs); softcap runs with q scaled by 4 so the
# scores reach the non-linear part of tanh.
FLAG_SETS = ["plain", "causal", "local", "causal_local", "alibi", "alibi_causal", "softcap_causal", "all"]


def _window(sq: int, sk: int):
    """A window narrower than the host/GPU tiles (64..128) for long sequences, so whole tiles are skipped."""
    return (max(sk // 9, 3), max(sk // 17, 1))


def _flag_kwargs(flags: str, batch: int, nheads: int, sq: int, sk: int) -> tuple[dict, float]:
    """Keyword arguments of flash_attn_func for a flag set, and the factor applied to q."""
    kw: dict = {}
    q_scale = 1.0
    if flags in ("causal", "causal_local", "alibi_causal", "softcap_causal"):
        kw["causal"] = True
    if flags in ("local", "all"):
        kw["window_size"] = _window(sq, sk)
    if flags == "causal_local":
        kw["window_size"] = (_window(sq, sk)[0], -1)
    if flags in ("alibi", "alibi_causal", "all"):
        kw["alibi_slopes"] = make_alibi(batch, nheads, per_batch=(flags != "alibi"))
    if flags in ("softcap_causal", "all"):
        kw["softcap"] = 5.0
        q_scale = 4.0
    return kw, q_scale


# Heads used for the largest shapes (fewer heads, same kind of layout: MHA, GQA, MQA).
_FEWER_HEADS = {(6, 6): (2, 2), (6, 2): (4, 2), (6, 1): (3, 1)}


def _problem_size(sq: int, sk: int, nheads: int, nheads_k: int) -> tuple[int, int, int]:
    """(batch, nheads, nheads_k) for a shape, keeping each case's float64 reference cheap on a small CPU."""
    if sq * sk >= 200_000:
        return (1, *_FEWER_HEADS[(nheads, nheads_k)])
    if sq * sk >= 60_000:
        return 1, nheads, nheads_k
    return 2, nheads, nheads_k


def run_case(device, sq, sk, d, heads, flags, dtype, batch=None):
    device = require_device(device)
    if device.type == "cuda":
        if dtype == torch.float32:
            pytest.skip("fp32 is a CPU-only dtype")
        gpu_dims = flash_ext.build_info()["gpu_head_dims"]
        if not gpu_dims or max(gpu_dims) < d:
            pytest.skip(f"head_dim {d} not compiled for the GPU in this build ({gpu_dims})")
    b, h, hk = _problem_size(sq, sk, *heads)
    b = batch or b
    kw, q_scale = _flag_kwargs(flags, b, h, sq, sk)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"].to(device)
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device, q_scale=q_scale)
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert probs.shape == (0,) and probs.dtype == q.dtype  # flash_attn's empty S_dmask without dropout
    context = f"b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} {flags} {DTYPE_NAMES[dtype]} {device} {kw}"
    check_close(out, lse, q, k, v, context=context, **kw)


def _default_cases():
    """Two deterministic passes over the grid (see the module docstring).

    Pass 1: every (shape, flag set) pair; head dim, heads and dtype rotate.
    Pass 2: every (shape, head dim) pair; flag set, heads and dtype rotate with other phases than in pass 1.
    """
    cases = []
    for si, (sq, sk) in enumerate(SHAPES):
        for fi, flags in enumerate(FLAG_SETS):
            n = si * len(FLAG_SETS) + fi
            d = HEAD_DIMS[n % len(HEAD_DIMS)]
            heads = HEADS[(si + fi) % len(HEADS)]
            dtype = DTYPES[(si + 2 * fi) % len(DTYPES)]
            cases.append((sq, sk, d, heads, flags, dtype))
    for si, (sq, sk) in enumerate(SHAPES):
        for di, d in enumerate(HEAD_DIMS):
            flags = FLAG_SETS[(3 * si + di + 1) % len(FLAG_SETS)]
            heads = HEADS[(si + 2 * di + 1) % len(HEADS)]
            dtype = DTYPES[(2 * si + di + 1) % len(DTYPES)]
            case = (sq, sk, d, heads, flags, dtype)
            if case not in cases:
                cases.append(case)
    return cases


DEFAULT_CASES = _default_cases()


def _case_id(c):
    sq, sk, d, (h, hk), flags, dtype = c
    return f"{sq}x{sk}-d{d}-h{h}k{hk}-{flags}-{DTYPE_NAMES[dtype]}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", DEFAULT_CASES, ids=[_case_id(c) for c in DEFAULT_CASES])
def test_output_sample(device, case):
    run_case(device, *case)


def test_default_sample_coverage():
    """The default sample touches every head dim, head layout, dtype and flag set, with uneven shapes."""
    assert {c[2] for c in DEFAULT_CASES} == set(HEAD_DIMS)
    assert {(c[0], c[1]) for c in DEFAULT_CASES} == set(SHAPES)
    for flags in FLAG_SETS:
        sub = [c for c in DEFAULT_CASES if c[4] == flags]
        assert {c[5] for c in sub} == set(DTYPES), flags
        assert {c[3] for c in sub} == set(HEADS), flags
        assert any(c[0] % 64 and c[1] % 64 for c in sub), flags  # seqlens that are not tile multiples


@pytest.mark.full
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: DTYPE_NAMES[t])
@pytest.mark.parametrize("flags", FLAG_SETS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda x: f"h{x[0]}k{x[1]}")
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_output_full(device, shape, d, heads, flags, dtype):
    run_case(device, shape[0], shape[1], d, heads, flags, dtype)


# ---------------------------------------------------------------------------------------------------------
# Masking edge cases: rows that see no key, narrow windows, windows that hide whole tiles.

MASK_CASES = [
    # (sq, sk, causal, window_size)
    (200, 50, True, (-1, -1)),     # sq > sk causal: rows 0..149 see nothing (two whole 64-row tiles)
    (130, 1, True, (-1, -1)),      # only the last row sees the single key
    (300, 100, False, (0, 0)),     # diagonal only, rows 0..199 empty
    (128, 128, False, (0, 0)),
    (128, 128, False, (2, 0)),
    (100, 157, False, (0, 3)),
    (97, 300, False, (2, 0)),
    (64, 512, False, (0, 0)),      # every row sees one key in the last tile; key tiles 0..6 are skipped
    (256, 256, False, (3, 3)),
    (333, 97, True, (4, -1)),      # causal + left window, sq > sk
    (77, 300, True, (10, -1)),
    (256, 256, False, (-1, 0)),    # window (-1, 0) == causal
    (200, 200, False, (70, -1)),   # left bound only
    (200, 200, False, (-1, 70)),   # right bound only
    (150, 400, False, (500, 20)),  # left >= seqlen_k: unbounded left
    (1, 300, True, (-1, -1)),      # one query row, causal: sees every key
    (1, 300, True, (5, -1)),
    (5, 5, False, (0, 0)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=lambda t: DTYPE_NAMES[t])
@pytest.mark.parametrize("sq,sk,causal,window", MASK_CASES,
                         ids=[f"{c[0]}x{c[1]}-{'causal-' if c[2] else ''}w{c[3][0]}_{c[3][1]}" for c in MASK_CASES])
def test_masking(device, sq, sk, causal, window, dtype):
    device = require_device(device)
    if device.type == "cuda" and dtype == torch.float32:
        pytest.skip("fp32 is a CPU-only dtype")
    q, k, v = make_qkv(1, sq, sk, 4, 2, 64, dtype, device)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    check_close(out, lse, q, k, v, causal=causal, window_size=window, context=f"{sq}x{sk} causal={causal} {window}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq", [1, 3, 15, 16, 17])
@pytest.mark.parametrize("causal", [False, True])
def test_short_queries(device, sq, causal):
    """Around the CPU's switch from a 16-row to a 128-row tile (launch_host.h); sq = 1 with GQA also runs a
    K/V group's query heads as rows.  ALiBi and a window keep every mask path live."""
    device = require_device(device)
    q, k, v = make_qkv(2, sq, 203, 8, 2, 128, torch.bfloat16, device)
    kw = {"alibi_slopes": make_alibi(2, 8, device=device), "window_size": (150, -1) if causal else (-1, -1)}
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **kw)
    check_close(out, lse, q, k, v, causal=causal, context=f"sq={sq}", **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("extra", ["alibi", "softcap"])
def test_masking_empty_rows_with_alibi_softcap(device, extra):
    """Empty rows stay exactly (0, +inf) when ALiBi/softcap paths are active."""
    device = require_device(device)
    q, k, v = make_qkv(2, 190, 60, 4, 4, 96, torch.bfloat16, device)
    kw = {"alibi_slopes": make_alibi(2, 4, device=device)} if extra == "alibi" else {"softcap": 3.0}
    for causal, window in [(True, (-1, -1)), (False, (1, 1)), (True, (7, -1))]:
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True, **kw)
        check_close(out, lse, q, k, v, causal=causal, window_size=window, context=f"{extra} {causal} {window}", **kw)


def test_window_right_at_least_seqlen_k_with_long_q():
    """The documented window rule holds even where flash-attn 2.8 would treat right >= seqlen_k as unbounded:
    with seqlen_q > seqlen_k + 1 the first rows still see fewer keys (csrc/ops/common.cpp, set_semantics)."""
    q, k, v = make_qkv(1, 40, 8, 2, 2, 32, torch.float32)
    out, lse, _ = flash_attn_func(q, k, v, window_size=(-1, 10), return_attn_probs=True)
    check_close(out, lse, q, k, v, window_size=(-1, 10), context="window (-1, 10), sq=40, sk=8")


# ---------------------------------------------------------------------------------------------------------
# Layouts and packed entry points.

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 59])
def test_qkvpacked(device, d):
    device = require_device(device)
    qkv = torch.randn(2, 137, 3, 4, d, dtype=torch.float16, device=device)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    for causal in (False, True):
        out, lse, _ = flash_attn_qkvpacked_func(qkv, causal=causal, return_attn_probs=True)
        check_close(out, lse, q, k, v, causal=causal, context=f"qkvpacked causal={causal}")
        # same result as passing the three views separately
        assert torch.equal(out, flash_attn_func(q, k, v, causal=causal))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [128, 40])
def test_kvpacked(device, d):
    device = require_device(device)
    q = torch.randn(2, 77, 6, d, dtype=torch.bfloat16, device=device)
    kv = torch.randn(2, 203, 2, 2, d, dtype=torch.bfloat16, device=device)
    k, v = kv.unbind(2)
    slopes = make_alibi(2, 6, device=device)
    out, lse, _ = flash_attn_kvpacked_func(q, kv, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    check_close(out, lse, q, k, v, causal=True, alibi_slopes=slopes, context="kvpacked")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=lambda t: DTYPE_NAMES[t])
def test_non_contiguous_inputs(device, dtype):
    device = require_device(device)
    if device.type == "cuda" and dtype == torch.float32:
        pytest.skip("fp32 is a CPU-only dtype")
    b, sq, sk, h, hk, d = 2, 150, 170, 4, 2, 64
    # (b, h, s, d) storage seen through a transpose: head stride < row stride.
    q = torch.randn(b, h, sq, d, dtype=dtype, device=device).transpose(1, 2)
    # the first d channels of a wider tensor: row stride 96, last dim still contiguous
    k = torch.randn(b, sk, hk, 96, dtype=dtype, device=device)[..., :d]
    # one batch entry broadcast over the batch (batch stride 0) and a reversed-head view via index
    v = torch.randn(1, sk, hk, d, dtype=dtype, device=device).expand(b, sk, hk, d)
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(0) == 0
    for causal in (False, True):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        check_close(out, lse, q, k, v, causal=causal, context=f"non-contiguous causal={causal}")
        assert torch.equal(out, flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal))


@pytest.mark.parametrize("device", DEVICES)
def test_odd_head_dim_non_contiguous(device):
    """An odd head dim goes through the padding path; a strided view must give the same answer."""
    device = require_device(device)
    base = torch.randn(1, 90, 3, 4, 59, dtype=torch.bfloat16, device=device)
    q, k, v = base.unbind(2)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_close(out, lse, q, k, v, causal=True, context="d=59 view")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 40])
def test_misaligned_views(device, d):
    """Start address one element past a 16-byte boundary and row strides that are not multiples of 8.

    The CPU kernel takes such views as they are; for the Sm80 kernels (CUDA, the emulator) the op copies
    them to aligned storage."""
    device = require_device(device)
    q = torch.randn(2, 97, 4, d + 1, dtype=torch.float16, device=device)[..., 1:]
    k = torch.randn(2, 130, 2, d + 3, dtype=torch.float16, device=device)[..., 3:]
    v = torch.randn(2, 130, 2, d + 1, dtype=torch.float16, device=device)[..., 1:]
    assert q.data_ptr() % 16 and k.stride(-2) % 8
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_close(out, lse, q, k, v, causal=True, context=f"misaligned d={d}")
    assert torch.equal(out, flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True))


def test_inputs_not_modified():
    q, k, v = make_qkv(1, 70, 90, 2, 1, 59, torch.float16)
    copies = [t.clone() for t in (q, k, v)]
    flash_attn_func(q, k, v, causal=True)
    for a, b in zip((q, k, v), copies):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------
# Scale, ALiBi, softcap, GQA.

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [59, 111, 8, 224])
def test_default_scale_uses_original_head_dim(device, d):
    device = require_device(device)
    q, k, v = make_qkv(1, 65, 80, 2, 2, d, torch.float16, device, q_scale=3.0)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    check_close(out, lse, q, k, v, softmax_scale=1 / math.sqrt(d), context=f"default scale d={d}")
    if d % 8:  # and it is not the scale of the padded head dim
        padded = d + 8 - d % 8
        _, lse_padded = attention_ref(q.cpu(), k.cpu(), v.cpu(), softmax_scale=1 / math.sqrt(padded))
        assert (lse.cpu().double() - lse_padded).abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [0.3, 1.7, 1e-3])
def test_explicit_scale(device, scale):
    device = require_device(device)
    q, k, v = make_qkv(2, 100, 129, 4, 1, 80, torch.bfloat16, device)
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, return_attn_probs=True)
    check_close(out, lse, q, k, v, softmax_scale=scale, causal=True, context=f"scale={scale}")


def test_numbers_given_as_one_element_tensors():
    """flash_attn 2.8's ops are custom ops declared int/float, which take one-element tensors for numbers, and
    its own tests pass window_size=torch.randint(0, seqlen_k, (2,)): flash_ext refused every such call."""
    q, k, v = make_qkv(2, 40, 57, 4, 2, 64, torch.bfloat16)
    want = flash_attn_func(q, k, v, softmax_scale=0.2, window_size=(5, 3))
    for window in (torch.tensor([5, 3]), (torch.tensor(5), torch.tensor([3], dtype=torch.int32)), [np.int64(5), 3]):
        assert torch.equal(flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.2), window_size=window), want)
    cache = torch.zeros(2, 64, 2, 64, dtype=torch.bfloat16)
    decode = lambda window: flash_ext.flash_attn_with_kvcache(  # noqa: E731
        q[:, :1], cache.clone(), cache.clone(), k[:, :9], v[:, :9], cache_seqlens=4, window_size=window)
    assert torch.equal(decode(torch.tensor([2, 0])), decode((2, 0)))
    torch.manual_seed(7)
    want = flash_attn_func(q, k, v, dropout_p=0.25)
    torch.manual_seed(7)
    assert torch.equal(flash_attn_func(q, k, v, dropout_p=torch.tensor(0.25, dtype=torch.float64)), want)
    for bad in (torch.tensor([5.0, 3.0]), torch.tensor([True, False]), torch.tensor([1, 2, 3])):
        with pytest.raises(ValueError, match="window_size"):
            flash_attn_func(q, k, v, window_size=bad)


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_nonpositive_scale(scale):
    """softmax_scale <= 0 is rejected (masked scores are -inf before scaling), never a NaN result."""
    q, k, v = make_qkv(1, 4, 5, 1, 1, 32, torch.float32)
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True)


@pytest.mark.parametrize("device", DEVICES)
def test_large_scores(device):
    """Scores of several hundred: the online softmax must rescale without overflow."""
    device = require_device(device)
    q, k, v = make_qkv(1, 130, 260, 2, 2, 64, torch.float16, device, q_scale=30.0)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert lse.abs().max() > 100
    check_close(out, lse, q, k, v, context="large scores")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=lambda t: DTYPE_NAMES[t])
def test_huge_scores_exact(device, dtype, causal):
    """Finite inputs whose scores reach ~2^33 (fp16) to ~2^85 log2 units (attn_check.make_large_score_qkv): the
    softmax is one-hot (or an exact tie) and the kernels must say so.  Exponentiating x * scale - round(max *
    scale) gave inf, NaN or LSE = +inf here (the rounding of max * scale is itself hundreds of log2 units or
    more).  Unsplit: split-KV partials carry log(sum) inside an fp32 LSE that large, where it rounds away, so
    keys tied across splits are weighed by split rather than by count (README, "Numerics")."""
    device = require_device(device)
    if dtype == torch.float32 and device.type == "cuda":
        pytest.skip("float32 is a CPU dtype")
    q, k, v, out_expected, lse_expected = make_large_score_qkv(dtype, causal, device)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, num_splits=1, return_attn_probs=True)
    check_large_scores(out, lse, out_expected, lse_expected, context=f"{dtype} causal={causal}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda t: DTYPE_NAMES[t])
@pytest.mark.parametrize("pattern", ["rising_far", "rising_near", "spikes"])
def test_maxima_rising_along_the_walk(device, dtype, pattern):
    """Row maxima that keep rising as the kernel walks the K/V tiles (right to left): every tile far above
    the last, a few units per tile (the references move only past a slack, softmax.h), or one key per
    tile well above the rest, at a different column of each.  A rescale that is skipped or misapplied to O,
    the sums or the probabilities already written weighs the tiles wrongly against each other."""
    device = require_device(device)
    if device.type == "cuda" and dtype == torch.float32:
        pytest.skip("fp32 is a CPU-only dtype")
    q, k, v = make_rising_maxima_qkv(pattern, dtype, device)
    for causal in (False, True):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        check_close(out, lse, q, k, v, causal=causal, context=f"{pattern}, causal={causal}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes_h", "slopes_bh"])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi(device, per_batch, causal):
    device = require_device(device)
    b, h = 2, 6
    q, k, v = make_qkv(b, 111, 230, h, 3, 96, torch.float16, device)
    slopes = make_alibi(b, h, per_batch=per_batch, device=device)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, return_attn_probs=True)
    check_close(out, lse, q, k, v, causal=causal, alibi_slopes=slopes, context=f"alibi {tuple(slopes.shape)}")
    if per_batch:  # the batch entries really use their own slopes
        out2 = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes[0].contiguous())
        assert torch.equal(out[0], out2[0]) and not torch.equal(out[1], out2[1])


@pytest.mark.parametrize("device", DEVICES)
def test_alibi_large_slopes(device):
    """Steep slopes (8 and 0.5): far keys get scores of -1e3 and below."""
    device = require_device(device)
    q, k, v = make_qkv(1, 200, 180, 2, 2, 32, torch.bfloat16, device)
    slopes = torch.tensor([8.0, 0.5], device=device)
    out, lse, _ = flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True)
    check_close(out, lse, q, k, v, alibi_slopes=slopes, context="steep alibi")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(device, softcap, causal):
    device = require_device(device)
    q, k, v = make_qkv(2, 140, 140, 4, 2, 128, torch.bfloat16, device, q_scale=4.0)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, softcap=softcap, return_attn_probs=True)
    check_close(out, lse, q, k, v, causal=causal, softcap=softcap, context=f"softcap={softcap}")


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_with_alibi_and_scale(device):
    """softcap is applied to the scaled scores, ALiBi afterwards (the order matters)."""
    device = require_device(device)
    q, k, v = make_qkv(2, 99, 150, 4, 4, 64, torch.float32, device, q_scale=3.0)
    if device.type == "cuda":
        q, k, v = q.half(), k.half(), v.half()
    slopes = make_alibi(2, 4, device=device)
    kw = dict(softmax_scale=0.2, softcap=2.0, alibi_slopes=slopes, causal=True)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    check_close(out, lse, q, k, v, context="softcap+alibi+scale", **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [(8, 1), (8, 2), (8, 4), (3, 1)])
def test_gqa(device, heads):
    device = require_device(device)
    h, hk = heads
    q, k, v = make_qkv(2, 70, 190, h, hk, 64, torch.float16, device)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_close(out, lse, q, k, v, causal=True, context=f"gqa {heads}")
    # equal to MHA with K/V heads repeated explicitly
    rep = h // hk
    out_mha = flash_attn_func(q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2), causal=True)
    assert torch.equal(out, out_mha)


# ---------------------------------------------------------------------------------------------------------
# API behaviour.

@pytest.mark.parametrize("device", DEVICES)
def test_bit_identical_repeated_calls(device):
    device = require_device(device)
    q, k, v = make_qkv(2, 300, 333, 4, 2, 80, torch.bfloat16, device)
    slopes = make_alibi(2, 4, device=device)
    r1 = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    r2 = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True, deterministic=True)
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])
    if device.type == "cpu":  # the split of work over CPU threads must not change a bit
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            r3 = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(r1[0], r3[0]) and torch.equal(r1[1], r3[1])


@pytest.mark.parametrize("device", DEVICES)
def test_return_structure(device):
    device = require_device(device)
    q, k, v = make_qkv(2, 33, 45, 4, 2, 40, torch.float16, device)
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
    assert out.device == q.device
    res = flash_attn_func(q, k, v, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3
    o, lse, p = res
    assert torch.equal(o, out)
    assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32 and lse.device == q.device
    assert p.shape == (0,) and p.dtype == q.dtype and p.device == q.device
    for fn, args in [(flash_attn_qkvpacked_func, (torch.stack([q, q, q], 2),)),
                     (flash_attn_kvpacked_func, (q, torch.stack([k, v], 2)))]:
        r = fn(*args, return_attn_probs=True)
        assert isinstance(r, tuple) and len(r) == 3 and r[2].shape == (0,)
        assert isinstance(fn(*args), torch.Tensor)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,sq,sk", [(0, 10, 10), (2, 0, 10), (2, 10, 0), (0, 0, 0), (2, 0, 0)])
@pytest.mark.parametrize("d", [64, 59])
def test_empty(device, b, sq, sk, d):
    device = require_device(device)
    q, k, v = make_qkv(b, sq, sk, 4, 2, d, torch.float16, device)
    for kw in ({}, {"causal": True}, {"window_size": (3, 3)}, {"alibi_slopes": make_alibi(b, 4, device=device)}):
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        assert out.shape == (b, sq, 4, d) and out.dtype == q.dtype
        assert lse.shape == (b, 4, sq) and lse.dtype == torch.float32
        if out.numel():
            assert (out == 0).all() and torch.isposinf(lse).all()  # only sk == 0 has elements here


# ---------------------------------------------------------------------------------------------------------
# The poisoning switch the whole suite relies on.

def test_poison_switch_returns_previous_state():
    # conftest switched poisoning on for the session
    assert flash_ext._C.set_poison_outputs(True) is True
    try:
        assert flash_ext._C.set_poison_outputs(False) is True
        assert flash_ext._C.set_poison_outputs(False) is False
        assert flash_ext._C.set_poison_outputs(True) is False
    finally:
        flash_ext._C.set_poison_outputs(True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 0)), (True, (2, -1))])
def test_kernel_writes_every_output_element(device, causal, window):
    """With poisoning on, out/lse start as NaN: the kernel must overwrite every element, including
    padding-free tails (sq, sk not tile multiples) and rows that see no key; poisoning off gives the same bits."""
    device = require_device(device)
    q, k, v = make_qkv(2, 131, 67, 4, 2, 40, torch.float16, device)  # d=40: op sees d=40 (multiple of 8)
    args = (q, k, v, 0.125, causal, window[0], window[1], 0.0, None)
    assert flash_ext._C.set_poison_outputs(True) is True
    out, lse, _ = torch.ops.flash_ext.fwd(*args)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    previous = flash_ext._C.set_poison_outputs(False)
    try:
        out2, lse2, _ = torch.ops.flash_ext.fwd(*args)
    finally:
        flash_ext._C.set_poison_outputs(previous)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    check_close(out, lse, q, k, v, softmax_scale=0.125, causal=causal, window_size=window, context="op direct")
