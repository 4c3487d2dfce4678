"""Backward pass: gradients of flash_attn_func (and every packed / varlen variant) against the float64 autograd
of flash_ext.reference.attention_ref, with flash-attention's backward rule (tests/grad_check.py).

Like tests/test_fwd.py, the default run takes a deterministic sample of the shape x head dim x heads x flags x
dtype grid (every (shape, flag set) pair once and every (shape, head dim) pair once, the other factors
rotating); ``-m full`` runs the whole grid.  Outputs, gradients, D and the dQ accumulators are poisoned with
NaN before every kernel (conftest.py), so an element a kernel forgets to write fails.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

import flash_ext
from flash_ext import (flash_attn_backward, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_backward, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func)
from flash_ext.reference import attention_grad_ref

from attn_check import DTYPE_NAMES, make_alibi, make_qkv
from conftest import DEVICES, require_device
from grad_check import check_grads

SHAPES = [(1, 239), (3, 799), (113, 203), (127, 512), (128, 217), (256, 512), (512, 256), (1023, 1024)]
HEAD_DIMS = [8, 32, 40, 59, 64, 96, 111, 128, 160, 192, 256]
HEADS = [(6, 6), (6, 2), (6, 1)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
FLAG_SETS = ["plain", "causal", "local", "causal_local", "alibi", "alibi_causal", "softcap_causal", "all"]


def require_head_dim(device: torch.device, d: int, dtype: torch.dtype) -> None:
    """Skips when this build has no kernel for head dim d on the device (dev builds compile a subset)."""
    info = flash_ext.build_info()
    if device.type == "cuda" and dtype == torch.float32:
        pytest.skip("fp32 is a CPU-only dtype")
    dims = info["gpu_bwd_head_dims"] if device.type == "cuda" else info["host_head_dims"]
    if not dims or max(dims) < (d + 7) // 8 * 8:
        pytest.skip(f"head_dim {d} has no {device.type} kernel in this build ({dims})")


def _flag_kwargs(flags: str, batch: int, nheads: int, sq: int, sk: int) -> tuple[dict, float]:
    """flash_attn_func keyword arguments of a flag set, and the factor applied to q (softcap needs scores in
    tanh's non-linear range).  Windows are narrower than a tile for long sequences, so whole tiles are skipped."""
    window = (max(sk // 9, 3), max(sk // 17, 1))
    kw: dict = {}
    if flags in ("causal", "causal_local", "alibi_causal", "softcap_causal"):
        kw["causal"] = True
    if flags in ("local", "all"):
        kw["window_size"] = window
    if flags == "causal_local":
        kw["window_size"] = (window[0], -1)
    if flags in ("alibi", "alibi_causal", "all"):
        kw["alibi_slopes"] = make_alibi(batch, nheads, per_batch=(flags != "alibi"))
    if flags in ("softcap_causal", "all"):
        kw["softcap"] = 5.0
    return kw, (4.0 if "softcap" in kw else 1.0)


def _problem_size(sq: int, sk: int, heads: tuple[int, int]) -> tuple[int, int, int]:
    """(batch, nheads, nheads_k) keeping the float64 reference cheap for the largest shapes."""
    fewer = {(6, 6): (2, 2), (6, 2): (4, 2), (6, 1): (3, 1)}
    if sq * sk >= 200_000:
        return (1, *fewer[heads])
    return (1 if sq * sk >= 60_000 else 2, *heads)


def run_case(device, sq, sk, d, heads, flags, dtype):
    device = require_device(device)
    require_head_dim(device, d, dtype)
    b, h, hk = _problem_size(sq, sk, heads)
    kw, q_scale = _flag_kwargs(flags, b, h, sq, sk)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = kw["alibi_slopes"].to(device)
    q, k, v = (t.requires_grad_() for t in make_qkv(b, sq, sk, h, hk, d, dtype, device, q_scale=q_scale))
    dout = torch.randn(b, sq, h, d, device=device).to(dtype)
    out = flash_attn_func(q, k, v, **kw)
    out.backward(dout)
    context = f"b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} {flags} {DTYPE_NAMES[dtype]} {device} {kw}"
    return check_grads((q.grad, k.grad, v.grad), q, k, v, dout, context=context, **kw)


def _default_cases():
    cases = []
    for si, (sq, sk) in enumerate(SHAPES):
        for fi, flags in enumerate(FLAG_SETS):
            n = si * len(FLAG_SETS) + fi
            cases.append((sq, sk, HEAD_DIMS[n % len(HEAD_DIMS)], HEADS[(si + fi) % len(HEADS)], flags,
                          DTYPES[(si + 2 * fi) % len(DTYPES)]))
    for si, (sq, sk) in enumerate(SHAPES):
        for di, d in enumerate(HEAD_DIMS):
            case = (sq, sk, d, HEADS[(si + 2 * di + 1) % len(HEADS)], FLAG_SETS[(3 * si + di + 1) % len(FLAG_SETS)],
                    DTYPES[(2 * si + di + 1) % len(DTYPES)])
            if case not in cases:
                cases.append(case)
    return cases


DEFAULT_CASES = _default_cases()


def _case_id(c):
    sq, sk, d, (h, hk), flags, dtype = c
    return f"{sq}x{sk}-d{d}-h{h}k{hk}-{flags}-{DTYPE_NAMES[dtype]}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", DEFAULT_CASES, ids=[_case_id(c) for c in DEFAULT_CASES])
def test_grad_sample(device, case):
    run_case(device, *case)


def test_default_sample_coverage():
    """The sample meets every head dim, shape, and, per flag set, every dtype and head layout."""
    assert {c[2] for c in DEFAULT_CASES} == set(HEAD_DIMS)
    assert {(c[0], c[1]) for c in DEFAULT_CASES} == set(SHAPES)
    for flags in FLAG_SETS:
        sub = [c for c in DEFAULT_CASES if c[4] == flags]
        assert {c[5] for c in sub} == set(DTYPES), flags
        assert {c[3] for c in sub} == set(HEADS), flags


@pytest.mark.full
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: DTYPE_NAMES[t])
@pytest.mark.parametrize("flags", FLAG_SETS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda x: f"h{x[0]}k{x[1]}")
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_grad_full(device, shape, d, heads, flags, dtype):
    run_case(device, shape[0], shape[1], d, heads, flags, dtype)


# ---------------------------------------------------------------------------------------------------------
# Rows that see no key and keys that no row sees: exact zeros, never NaN (asserted by check_grads).

MASK_CASES = [
    # (sq, sk, causal, window_size)
    (200, 50, True, (-1, -1)),    # sq > sk causal: rows 0..149 see nothing
    (130, 1, True, (-1, -1)),     # only the last row sees the single key
    (300, 100, False, (0, 0)),    # diagonal only
    (100, 300, False, (0, 0)),    # keys 0..199 seen by nobody: whole K/V tiles with zero dK/dV
    (97, 300, False, (2, 0)),
    (64, 512, False, (0, 0)),
    (333, 97, True, (4, -1)),     # causal + left window, sq > sk
    (77, 300, True, (10, -1)),
    (1, 300, True, (5, -1)),      # one query row sees 6 keys
    (5, 5, False, (0, 0)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: DTYPE_NAMES[t])
@pytest.mark.parametrize("sq,sk,causal,window", MASK_CASES,
                         ids=[f"{c[0]}x{c[1]}-{'causal-' if c[2] else ''}w{c[3][0]}_{c[3][1]}" for c in MASK_CASES])
def test_grad_masking(device, sq, sk, causal, window, dtype):
    device = require_device(device)
    require_head_dim(device, 64, dtype)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, sq, sk, 4, 2, 64, dtype, device))
    dout = torch.randn(1, sq, 4, 64, device=device).to(dtype)
    flash_attn_func(q, k, v, causal=causal, window_size=window).backward(dout)
    check_grads((q.grad, k.grad, v.grad), q, k, v, dout, causal=causal, window_size=window,
                context=f"{sq}x{sk} causal={causal} {window}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("extra", ["alibi", "softcap"])
def test_grad_empty_rows_with_alibi_softcap(device, extra):
    """ALiBi gives rows past a sequence or outside a window finite biases: their P must still be 0."""
    device = require_device(device)
    require_head_dim(device, 96, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 190, 60, 4, 4, 96, torch.bfloat16, device, q_scale=3.0))
    kw = {"alibi_slopes": make_alibi(2, 4, device=device)} if extra == "alibi" else {"softcap": 3.0}
    dout = torch.randn(2, 190, 4, 96, device=device).to(torch.bfloat16)
    for causal, window in [(True, (-1, -1)), (False, (1, 1)), (True, (7, -1))]:
        q.grad = k.grad = v.grad = None
        flash_attn_func(q, k, v, causal=causal, window_size=window, **kw).backward(dout)
        check_grads((q.grad, k.grad, v.grad), q, k, v, dout, causal=causal, window_size=window,
                    context=f"{extra} {causal} {window}", **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [0.5, 50.0])
def test_grad_softcap(device, softcap):
    """softcap's derivative 1 - tanh^2 is far from 1 at a small cap and close to it at a large one."""
    device = require_device(device)
    require_head_dim(device, 128, torch.float16)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 140, 140, 4, 2, 128, torch.float16, device, q_scale=4.0))
    dout = torch.randn(2, 140, 4, 128, device=device).to(torch.float16)
    flash_attn_func(q, k, v, causal=True, softcap=softcap).backward(dout)
    check_grads((q.grad, k.grad, v.grad), q, k, v, dout, causal=True, softcap=softcap, context=f"softcap={softcap}")


# fp32 runs on the CPU only; bf16 is what the GPU's GQA reduction and the merged-LSE backward get tested with.
GRAD_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(8, 1), (8, 2), (8, 4)])
def test_grad_gqa_equals_repeated_heads(device, dtype, heads):
    """GQA dk/dv are the sums over each K/V head's query heads: equal (up to the sum's rounding) to MHA with
    repeated K/V heads followed by that sum, and within the reference rule."""
    device = require_device(device)
    require_head_dim(device, 64, dtype)
    h, hk = heads
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 70, 190, h, hk, 64, dtype, device))
    dout = torch.randn(2, 70, h, 64, device=device).to(dtype)
    flash_attn_func(q, k, v, causal=True).backward(dout)
    check_grads((q.grad, k.grad, v.grad), q, k, v, dout, causal=True, context=f"gqa {heads}")
    kr, vr = (t.detach().repeat_interleave(h // hk, 2).requires_grad_() for t in (k, v))
    qr = q.detach().requires_grad_()
    flash_attn_func(qr, kr, vr, causal=True).backward(dout)
    # Not bit-equal: the CPU splits the dQ sums by K/V head count (launch_host_bwd.h), and in bf16 GQA rounds
    # each dK/dV sum once where the repeated heads round every term: a few bf16 ulps of the largest term.
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    for got, want in [(q.grad, qr.grad), (k.grad, kr.grad.float().unflatten(2, (hk, h // hk)).sum(3)),
                      (v.grad, vr.grad.float().unflatten(2, (hk, h // hk)).sum(3))]:
        err = (got.float() - want.float()).abs().max().item()
        assert err <= tol * max(want.float().abs().max().item(), 1e-6), (err, want.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [59, 8, 224])
def test_grad_padded_head_dim_and_default_scale(device, d):
    """Head dims that are not multiples of 8 are zero-padded by the Python layer; their gradients come back
    unpadded, with the default scale of the original head dim."""
    device = require_device(device)
    require_head_dim(device, d, torch.float16)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 65, 80, 2, 2, d, torch.float16, device, q_scale=3.0))
    dout = torch.randn(1, 65, 2, d, device=device).to(torch.float16)
    flash_attn_func(q, k, v).backward(dout)
    check_grads((q.grad, k.grad, v.grad), q, k, v, dout, softmax_scale=1 / math.sqrt(d), context=f"d={d}")


@pytest.mark.parametrize("device", DEVICES)
def test_grad_non_contiguous_and_misaligned(device):
    """Transposed, strided, broadcast and misaligned views: the gradients of the views themselves."""
    device = require_device(device)
    require_head_dim(device, 64, torch.float16)
    b, sq, sk, h, hk, d = 2, 150, 170, 4, 2, 64
    qb = torch.randn(b, h, sq, d, dtype=torch.float16, device=device).requires_grad_()
    kb = torch.randn(b, sk, hk, d + 3, dtype=torch.float16, device=device).requires_grad_()
    vb = torch.randn(1, sk, hk, d, dtype=torch.float16, device=device).requires_grad_()
    q, k, v = qb.transpose(1, 2), kb[..., 3:], vb.expand(b, sk, hk, d)
    dout = torch.randn(b, sq, h, d, device=device).to(torch.float16)
    flash_attn_func(q, k, v, causal=True).backward(dout)
    ref = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*ref, causal=True).backward(dout)
    assert torch.equal(qb.grad, ref[0].grad.transpose(1, 2))
    assert torch.equal(kb.grad[..., 3:], ref[1].grad) and (kb.grad[..., :3] == 0).all()
    assert torch.equal(vb.grad, ref[2].grad.sum(0, keepdim=True))
    check_grads([t.grad for t in ref], *ref, dout, causal=True, context="views")


# ---------------------------------------------------------------------------------------------------------
# Packed inputs get packed gradients; varlen.

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 40])
def test_grad_qkvpacked_and_kvpacked(device, d):
    device = require_device(device)
    require_head_dim(device, d, torch.bfloat16)
    qkv = torch.randn(2, 137, 3, 4, d, dtype=torch.bfloat16, device=device).requires_grad_()
    dout = torch.randn(2, 137, 4, d, device=device).to(torch.bfloat16)
    flash_attn_qkvpacked_func(qkv, causal=True).backward(dout)
    assert qkv.grad.shape == qkv.shape
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    flash_attn_func(q, k, v, causal=True).backward(dout)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 2))
    check_grads((q.grad, k.grad, v.grad), q, k, v, dout, causal=True, context="qkvpacked")

    q = torch.randn(2, 77, 6, d, dtype=torch.bfloat16, device=device).requires_grad_()
    kv = torch.randn(2, 203, 2, 2, d, dtype=torch.bfloat16, device=device).requires_grad_()
    slopes = make_alibi(2, 6, device=device)
    dout = torch.randn(2, 77, 6, d, device=device).to(torch.bfloat16)
    flash_attn_kvpacked_func(q, kv, causal=True, alibi_slopes=slopes).backward(dout)
    k, v = (t.detach() for t in kv.unbind(2))
    dk, dv = kv.grad.unbind(2)
    check_grads((q.grad, dk, dv), q, k, v, dout, causal=True, alibi_slopes=slopes, context="kvpacked")


def _cu(lengths, device):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=device)


def _check_varlen_grads(lens_q, lens_k, q, k, v, dout, grads, seqused=None, **kw):
    """Per-sequence reference gradients; keys past seqused_k and rows of empty sequences get exact zeros."""
    dq, dk, dv = (g.detach().cpu() for g in grads)
    cu_q, cu_k = _cu(lens_q, "cpu"), _cu(lens_k, "cpu")
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        used = seqused[i] if seqused is not None else lk
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i] + used)
        assert (dk[cu_k[i] + used:cu_k[i + 1]] == 0).all() and (dv[cu_k[i] + used:cu_k[i + 1]] == 0).all()
        if lq == 0 or used == 0:
            assert (dq[qs] == 0).all() and (dk[ks] == 0).all() and (dv[ks] == 0).all()
            continue
        alibi = kw.get("alibi_slopes")
        kw_i = dict(kw, alibi_slopes=alibi[i:i + 1] if alibi is not None and alibi.dim() == 2 else alibi)
        check_grads((dq[qs][None], dk[ks][None], dv[ks][None]), q[qs][None], k[ks][None], v[ks][None],
                    dout[qs][None], context=f"sequence {i} (sq {lq}, sk {used})", **kw_i)


VARLEN_CASES = [
    # lens_q, lens_k, h, hk, d, kwargs
    ([5, 0, 130, 1, 77], [9, 3, 130, 200, 1], 4, 2, 40, {"causal": True}),  # empty q sequence, sq > sk
    ([1] * 7, [1] * 7, 2, 1, 64, {}),
    ([200, 129], [100, 0], 2, 2, 59, {"causal": True}),                    # a sequence without keys
    ([128, 256], [128, 256], 3, 3, 96, {"window_size": (32, 8)}),
    ([70, 300, 5], [300, 70, 5], 4, 4, 32, {"softcap": 20.0}),
    ([33, 150], [150, 33], 4, 1, 80, {"alibi_slopes": "per-batch", "causal": True}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_grad_varlen(device, case):
    device = require_device(device)
    lens_q, lens_k, h, hk, d, kw = VARLEN_CASES[case]
    dtype = torch.bfloat16 if case % 2 == 0 else torch.float16
    require_head_dim(device, d, dtype)
    if kw.get("alibi_slopes") == "per-batch":
        kw = dict(kw, alibi_slopes=torch.rand(len(lens_q), h, device=device) * 0.5)
    q = torch.randn(sum(lens_q), h, d, dtype=dtype, device=device).requires_grad_()
    k = torch.randn(sum(lens_k), hk, d, dtype=dtype, device=device).requires_grad_()
    v = torch.randn(sum(lens_k), hk, d, dtype=dtype, device=device).requires_grad_()
    dout = torch.randn(sum(lens_q), h, d, device=device).to(dtype)
    out = flash_attn_varlen_func(q, k, v, _cu(lens_q, device), _cu(lens_k, device), max(lens_q), max(lens_k), **kw)
    out.backward(dout)
    _check_varlen_grads(lens_q, lens_k, q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), dout.cpu(),
                        (q.grad, k.grad, v.grad), **{n: (t.cpu() if torch.is_tensor(t) else t) for n, t in kw.items()})


@pytest.mark.parametrize("device", DEVICES)
def test_grad_varlen_seqused_k_and_unused_rows(device):
    """Keys past seqused_k and k/v rows after the last sequence get dk = dv = 0."""
    device = require_device(device)
    require_head_dim(device, 64, torch.bfloat16)
    lens_q, lens_k, used = [40, 90, 3], [100, 90, 50], [60, 0, 50]
    q = torch.randn(sum(lens_q), 2, 64, dtype=torch.bfloat16, device=device).requires_grad_()
    k = torch.randn(sum(lens_k) + 7, 2, 64, dtype=torch.bfloat16, device=device).requires_grad_()  # 7 spare rows
    v = torch.randn(sum(lens_k) + 7, 2, 64, dtype=torch.bfloat16, device=device).requires_grad_()
    dout = torch.randn(sum(lens_q), 2, 64, device=device).to(torch.bfloat16)
    used_t = torch.tensor(used, dtype=torch.int32, device=device)
    flash_attn_varlen_func(q, k, v, _cu(lens_q, device), _cu(lens_k, device), 90, 100, causal=True,
                           seqused_k=used_t).backward(dout)
    assert (k.grad[sum(lens_k):] == 0).all() and (v.grad[sum(lens_k):] == 0).all()
    _check_varlen_grads(lens_q, lens_k, q.detach().cpu(), k.detach().cpu()[:sum(lens_k)],
                        v.detach().cpu()[:sum(lens_k)], dout.cpu(),
                        (q.grad, k.grad[:sum(lens_k)], v.grad[:sum(lens_k)]), seqused=used, causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_grad_varlen_packed_variants(device):
    device = require_device(device)
    require_head_dim(device, 64, torch.float16)
    lens = [17, 64, 129]
    cu = _cu(lens, device)
    qkv = torch.randn(sum(lens), 3, 4, 64, dtype=torch.float16, device=device).requires_grad_()
    dout = torch.randn(sum(lens), 4, 64, device=device).to(torch.float16)
    flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True).backward(dout)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(1))
    flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True).backward(dout)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 1))
    kv = torch.stack([k.detach(), v.detach()], 1).requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    flash_attn_varlen_kvpacked_func(q2, kv, cu, cu, max(lens), max(lens), causal=True).backward(dout)
    assert torch.equal(q2.grad, q.grad) and torch.equal(kv.grad, torch.stack([k.grad, v.grad], 1))


# ---------------------------------------------------------------------------------------------------------
# Determinism.

def test_cpu_backward_bitwise_reproducible():
    """50 backward runs give the same bits, and so does a different thread count (the split of the work is a
    function of the shape, not of the threads)."""
    require_head_dim(torch.device("cpu"), 64, torch.bfloat16)
    q, k, v = make_qkv(1, 300, 517, 4, 2, 64, torch.bfloat16)
    dout = torch.randn(1, 300, 4, 64).to(torch.bfloat16)
    slopes = make_alibi(1, 4)

    def grads():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        flash_attn_func(*leaves, causal=True, alibi_slopes=slopes, softcap=8.0).backward(dout)
        return [t.grad for t in leaves]

    first = grads()
    for _ in range(49):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    threads = torch.get_num_threads()
    try:
        for n in {1, 3, max(2, threads)}:
            torch.set_num_threads(n)
            assert all(torch.equal(a, b) for a, b in zip(first, grads())), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.cuda
def test_gpu_deterministic_backward():
    device = require_device("cuda")
    require_head_dim(device, 64, torch.bfloat16)  # 64: the backward head dim of CI's and gpu_check.sh's builds
    q, k, v = make_qkv(2, 1000, 1000, 8, 2, 64, torch.bfloat16, device)
    dout = torch.randn_like(q)

    def grads(deterministic):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        flash_attn_func(*leaves, causal=True, deterministic=deterministic).backward(dout)
        return [t.grad for t in leaves]

    first = grads(True)
    check_grads(first, q, k, v, dout, causal=True, context="deterministic")
    for _ in range(49):
        assert all(torch.equal(a, b) for a, b in zip(first, grads(True)))
    check_grads(grads(False), q, k, v, dout, causal=True, context="atomic dQ")


# ---------------------------------------------------------------------------------------------------------
# The explicit backward (the registered ops), as context-parallel attention uses it.

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_backward_with_merged_out_and_lse(device, dtype, heads):
    """Ring-attention use: out/LSE merged from two forward calls over the two halves of the keys; the backward
    of each half with the merged out/LSE gives that half's dk/dv and a share of dq; the shares add up to the
    gradient of attention over all keys."""
    device = require_device(device)
    require_head_dim(device, 64, dtype)
    h, hk = heads
    q, k, v = make_qkv(2, 150, 260, h, hk, 64, dtype, device)
    dout = torch.randn(2, 150, h, 64, device=device).to(dtype)
    halves = [(k[:, :130], v[:, :130]), (k[:, 130:], v[:, 130:])]
    parts = [flash_attn_func(q, kh, vh, return_attn_probs=True)[:2] for kh, vh in halves]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    # Merged in fp32 and rounded once, as a ring step's merge does.
    out = sum(o.float() * torch.exp(l - lse).transpose(1, 2).unsqueeze(-1) for o, l in parts).to(dtype)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for kh, vh in halves:
        dq_h, dk_h, dv_h = flash_attn_backward(dout, q, kh, vh, out, lse)
        dq += dq_h
        dks.append(dk_h)
        dvs.append(dv_h)
    check_grads((dq, torch.cat(dks, 1), torch.cat(dvs, 1)), q, k, v, dout, context=f"merged halves {heads}")


@pytest.mark.parametrize("device", DEVICES)
def test_backward_op_writes_given_buffers(device):
    """The op writes into the caller's buffers (strided views too) and returns D = rowsum(dout * out)."""
    device = require_device(device)
    require_head_dim(device, 64, torch.float16)
    q, k, v = make_qkv(2, 90, 77, 4, 2, 64, torch.float16, device)
    dout = torch.randn_like(q)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dqkv = torch.empty(2, 90, 3, 4, 64, dtype=torch.float16, device=device)  # dq is a strided view of it
    dq, dk, dv = dqkv[:, :, 0], torch.empty_like(k), torch.empty_like(v)
    softmax_d = torch.ops.flash_ext.bwd(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.125, True, -1, -1, 0.0, None,
                                        False)
    expected_d = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d, expected_d, rtol=1e-5, atol=1e-5)
    check_grads((dqkv[:, :, 0], dk, dv), q, k, v, dout, softmax_scale=0.125, causal=True, context="op buffers")
    dq2, dk2, dv2 = flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=0.125, causal=True)
    assert torch.equal(dq2, dqkv[:, :, 0]) and torch.equal(dk2, dk) and torch.equal(dv2, dv)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_backward_function(device):
    device = require_device(device)
    require_head_dim(device, 64, torch.bfloat16)
    lens_q, lens_k = [33, 0, 70], [50, 9, 70]
    q = torch.randn(sum(lens_q), 4, 59, dtype=torch.bfloat16, device=device)  # padded head dim
    k = torch.randn(sum(lens_k), 2, 59, dtype=torch.bfloat16, device=device)
    v = torch.randn(sum(lens_k), 2, 59, dtype=torch.bfloat16, device=device)
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 70, causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    dk_buffer = torch.full_like(k, float("nan"))
    dq, dk, dv = flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 70, 70, dk=dk_buffer, causal=True)
    assert dk is dk_buffer
    _check_varlen_grads(lens_q, lens_k, q.cpu(), k.cpu(), v.cpu(), dout.cpu(), (dq, dk, dv), causal=True)


# ---------------------------------------------------------------------------------------------------------
# What is not differentiable says so.

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient(device, causal):
    """The returned LSE is differentiable (dS = P (dP - (D - dLSE))); flash_attn would drop this term.  Rows
    that see no key (causal, sq > sk) have LSE +inf and get no gradient from it."""
    device = require_device(device)
    require_head_dim(device, 64, torch.float16)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 150, 90, 4, 2, 64, torch.float16, device))
    dout = torch.randn(2, 150, 4, 64, device=device).to(torch.float16)
    dlse = torch.randn(2, 4, 150, device=device)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    torch.autograd.backward([out, lse], [dout, dlse])
    check_grads((q.grad, k.grad, v.grad), q, k, v, dout, causal=causal, dlse=dlse, context="out and lse")
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    lse.backward(dlse)  # the LSE alone
    check_grads((q.grad, k.grad, v.grad), q, k, v, torch.zeros_like(dout), causal=causal, dlse=dlse, context="lse")
    assert not all(torch.equal(a, b) for a, b in zip(grads, (q.grad, k.grad, v.grad)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=["fp32", "bf16"])
def test_ring_attention_through_autograd(device, dtype):
    """Attention over two key blocks merged with their LSEs, differentiated by plain autograd (the merge reads
    the LSEs): the gradients equal those of attention over all keys."""
    device = require_device(device)
    require_head_dim(device, 64, dtype)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 120, 200, 4, 2, 64, dtype, device))
    dout = torch.randn(1, 120, 4, 64, device=device).to(dtype)
    o1, l1, _ = flash_attn_func(q, k[:, :77], v[:, :77], return_attn_probs=True)
    o2, l2, _ = flash_attn_func(q, k[:, 77:], v[:, 77:], return_attn_probs=True)
    lse = torch.logaddexp(l1, l2)
    out = (o1.float() * torch.exp(l1 - lse).transpose(1, 2).unsqueeze(-1) +
           o2.float() * torch.exp(l2 - lse).transpose(1, 2).unsqueeze(-1)).to(dtype)
    out.backward(dout)
    check_grads((q.grad, k.grad, v.grad), q, k, v, dout, context="two blocks merged by LSE")


def test_alibi_slopes_requiring_grad_are_refused():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 10, 12, 2, 2, 32, torch.float16))
    slopes = torch.rand(2).requires_grad_()
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=slopes).float().sum().backward()


def test_kvcache_is_forward_only():
    """A backward through flash_attn_with_kvcache is an error, not a silently missing gradient; without grad
    the function is unaffected."""
    require_head_dim(torch.device("cpu"), 32, torch.float16)
    q = torch.randn(1, 1, 2, 32, dtype=torch.float16, requires_grad=True)
    k_cache, v_cache = (torch.randn(1, 16, 2, 32, dtype=torch.float16) for _ in range(2))
    seqlens = torch.tensor([5], dtype=torch.int32)
    out = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="forward-only"):
        (out.float().sum() + q.float().sum()).backward()
    with torch.no_grad():
        assert torch.equal(flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens), out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,sq,sk", [(0, 10, 10), (2, 0, 10), (2, 10, 0)])
def test_grad_empty(device, b, sq, sk):
    device = require_device(device)
    require_head_dim(device, 64, torch.float16)
    q, k, v = (t.requires_grad_() for t in make_qkv(b, sq, sk, 4, 2, 64, torch.float16, device))
    flash_attn_func(q, k, v, causal=True).float().sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


# ---------------------------------------------------------------------------------------------------------
# Bad input: one ValueError naming every problem, raised before anything is written.

def test_bwd_op_reports_every_bad_argument_and_writes_nothing():
    require_head_dim(torch.device("cpu"), 32, torch.float16)
    q, k, v = make_qkv(2, 10, 12, 4, 2, 32, torch.float16)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    dq, dk, dv = (torch.full_like(t, 7.0) for t in (q, k, v))
    bad_dout = torch.randn(2, 10, 4, 16)          # wrong head dim and dtype
    bad_lse = lse[:, :, :5]                        # wrong shape
    bad_dk = torch.full((2, 12, 2, 32), 7.0, dtype=torch.bfloat16)  # wrong dtype
    with pytest.raises(ValueError) as err:
        torch.ops.flash_ext.bwd(bad_dout, q, k, v, out, bad_lse, dq, bad_dk, dv, 0.0, -1.0, True, -1, -1,
                                float("nan"), None, False)
    msg = str(err.value)
    for name in ("dout", "softmax_lse", "dk", "softmax_scale", "softcap"):
        assert name in msg, (name, msg)
    assert (dq == 7).all() and (bad_dk == 7).all() and (dv == 7).all()
    with pytest.raises(ValueError, match="dropout_p"):
        torch.ops.flash_ext.bwd(torch.randn_like(out), q, k, v, out, lse, dq, dk, dv, 1.5, 0.1, True, -1, -1, 0.0,
                                None, False)
    with pytest.raises(ValueError, match="dsoftmax_lse"):
        torch.ops.flash_ext.bwd(torch.randn_like(out), q, k, v, out, lse, dq, dk, dv, 0.0, 0.1, True, -1, -1, 0.0,
                                None, False, None, lse.double())
    assert (dq == 7).all() and (dk == 7).all() and (dv == 7).all()


def test_varlen_bwd_op_checks_index_values_before_writing():
    require_head_dim(torch.device("cpu"), 32, torch.float16)
    q = torch.randn(30, 2, 32, dtype=torch.float16)
    k = torch.randn(40, 2, 32, dtype=torch.float16)
    v = torch.randn(40, 2, 32, dtype=torch.float16)
    cu_q, cu_k = _cu([10, 20], "cpu"), _cu([15, 25], "cpu")
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 25, return_attn_probs=True)
    dq, dk, dv = (torch.full_like(t, 7.0) for t in (q, k, v))
    bad_cu_k = torch.tensor([0, 30, 20], dtype=torch.int32)  # decreasing
    used = torch.tensor([16, 3], dtype=torch.int32)          # 16 > the first sequence's 15 keys
    with pytest.raises(ValueError) as err:
        torch.ops.flash_ext.varlen_bwd(torch.randn_like(out), q, k, v, out, lse, dq, dk, dv, cu_q, bad_cu_k, 20, 25,
                                       0.0, 0.1, False, -1, -1, 0.0, None, False, None, used)
    assert "cu_seqlens_k" in str(err.value)
    with pytest.raises(ValueError, match="seqused_k"):
        torch.ops.flash_ext.varlen_bwd(torch.randn_like(out), q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 20, 25,
                                       0.0, 0.1, False, -1, -1, 0.0, None, False, None, used)
    assert (dq == 7).all() and (dk == 7).all() and (dv == 7).all()
