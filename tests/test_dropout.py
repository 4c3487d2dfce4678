"""Dropout: the kernel's mask against an independent numpy Philox reference (tests/dropout_ref.py), outputs
against the float64 reference with that mask (FA2 pass rule), S_dmask, drop statistics, RNG state handling
(same seed -> same mask, consecutive calls differ, explicit rng_state, torch.compile, CUDA graphs).

The mask is a pure function of (seed, offset, batch, head, row, column): these tests take the (seed, offset)
from the op's returned rng_state (or pass one in) and recompute the mask in numpy from the specification.
"""
from __future__ import annotations

import pytest
import torch

import flash_ext
from flash_ext import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from flash_ext.reference import visibility_mask

from attn_check import check_close, make_alibi, make_qkv
from conftest import DEVICES, require_device
from dropout_ref import dropout_keep_mask

INT64 = (1 << 63) - 1


def _op(q, k, v, p, rng_state=None, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
        num_splits=0):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.flash_ext.fwd(q, k, v, scale, causal, window[0], window[1], softcap, alibi, num_splits, p,
                                   rng_state)


def _rng_state(seed: int, offset: int, device) -> torch.Tensor:
    return torch.tensor([seed, offset], dtype=torch.int64, device=device)


def _ref_mask(rng_state: torch.Tensor, p: float, b: int, h: int, sq: int, sk: int) -> torch.Tensor:
    seed, offset = rng_state.cpu().tolist()
    return torch.from_numpy(dropout_keep_mask(seed, offset, p, b, h, sq, sk))


# ---------------------------------------------------------------------------------------------------------
# The mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,offset", [(0, 0), (123456789, 4), (-1, INT64), (-(1 << 63), (1 << 40) + 12),
                                         (0x0123456789ABCDEF, 0xFEDCBA98)])
def test_mask_op_matches_numpy(device, seed, offset):
    """The element-wise mask op (CPU loop / CUDA kernel) == the numpy reference, bit for bit, including
    seeds and offsets with their high 32 bits set (the key mixes them)."""
    device = require_device(device)
    rs = _rng_state(seed, offset, device)
    for p in (0.1, 0.5, 0.93):
        got = torch.ops.flash_ext.dropout_mask(rs, p, 3, 5, 37, 53).cpu()
        assert torch.equal(got, _ref_mask(rs, p, 3, 5, 37, 53)), (seed, offset, p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1, 70000, 3), (1, 70001, 2, 2), (2, 1, 3, 70003)])
def test_mask_op_past_grid_limits(device, shape):
    """seqlen_q or batch * heads past CUDA's 65,535 grid.y/z (and a long key row): the mask op covers every
    element, equal to the numpy reference (on CUDA a grid-stride loop; it once refused these shapes)."""
    device = require_device(device)
    rs = _rng_state(2024, 77, device)
    got = torch.ops.flash_ext.dropout_mask(rs, 0.4, *shape).cpu()
    assert torch.equal(got, _ref_mask(rs, 0.4, *shape)), shape


def test_mask_depends_on_every_coordinate_and_state():
    """Changing the seed, the offset (low or high half), batch, head, row or column changes the bits: the
    reference is not degenerate (so agreeing with it means something)."""
    base = dropout_keep_mask(7, 8, 0.5, 2, 3, 32, 32)
    for other in (dropout_keep_mask(8, 8, 0.5, 2, 3, 32, 32), dropout_keep_mask(7, 12, 0.5, 2, 3, 32, 32),
                  dropout_keep_mask(7, 8 + (1 << 32), 0.5, 2, 3, 32, 32),
                  dropout_keep_mask(7 + (1 << 32), 8, 0.5, 2, 3, 32, 32)):
        assert (base != other).mean() > 0.4
    assert (base[0] != base[1]).mean() > 0.4 and (base[:, 0] != base[:, 1]).mean() > 0.4
    assert (base[..., :16, :] != base[..., 16:, :]).mean() > 0.4
    assert (base[..., :16] != base[..., 16:]).mean() > 0.4


# ---------------------------------------------------------------------------------------------------------
# Outputs with the reference mask

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, window, softcap, alibi, dropout_p)
CASES = [
    (2, 77, 131, 4, 2, 40, True, (-1, -1), 0.0, False, 0.17),    # odd shapes, GQA, causal
    (1, 128, 128, 2, 2, 64, False, (-1, -1), 0.0, False, 0.5),   # tile multiples
    (2, 33, 45, 6, 1, 96, False, (7, 3), 0.0, True, 0.3),        # MQA, local window, ALiBi
    (1, 150, 90, 2, 2, 128, True, (-1, -1), 4.0, False, 0.1),    # sq > sk causal (empty rows), softcap
    (1, 5, 300, 4, 2, 64, False, (-1, -1), 0.0, False, 0.4),     # short queries: 16-row host tile
    (2, 1, 200, 8, 2, 32, False, (-1, -1), 0.0, False, 0.25),    # GQA decode (no head/row swap with dropout)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_matches_reference(device, case, dtype):
    device = require_device(device)
    b, sq, sk, h, hk, d, causal, window, softcap, alibi, p = CASES[case]
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device)
    slopes = make_alibi(b, h, device=device) if alibi else None
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    rs_in = _rng_state(0x5DEECE66D + case, 1000 + 4 * case + (case << 34), device)
    out, lse, rs = _op(q, k, v, p, rs_in, causal=causal, window=window, softcap=softcap, alibi=slopes)
    assert torch.equal(rs.cpu(), rs_in.cpu()), "the rng_state output must be the (seed, offset) used"
    mask = _ref_mask(rs, p, b, h, sq, sk)
    check_close(out, lse, q, k, v, dropout_p=p, dropout_mask=mask, context=f"case {case}", **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_generator_rng_state_reproduces_the_output(device):
    """Without an rng_state input the op draws from the default generator and returns the (seed, offset)
    it used (written by the kernel: the test mode poisons that output first)."""
    device = require_device(device)
    q, k, v = make_qkv(2, 70, 100, 4, 2, 64, torch.float16, device)
    out, lse, rs = _op(q, k, v, 0.3, causal=True)
    assert rs.shape == (2,) and rs.dtype == torch.int64 and rs.device == q.device
    assert rs[0].item() != -(1 << 63), "rng_state still holds the poison value"
    check_close(out, lse, q, k, v, causal=True, dropout_p=0.3, dropout_mask=_ref_mask(rs, 0.3, 2, 4, 70, 100))


def test_check_close_fails_with_a_wrong_mask():
    """The output comparison can tell masks apart: the mask of the next offset fails the pass rule."""
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, torch.float16)
    out, lse, rs = _op(q, k, v, 0.2, _rng_state(42, 8, "cpu"))
    check_close(out, lse, q, k, v, dropout_p=0.2, dropout_mask=_ref_mask(rs, 0.2, 1, 2, 64, 64))
    with pytest.raises(AssertionError):
        check_close(out, lse, q, k, v, dropout_p=0.2, dropout_mask=_ref_mask(_rng_state(42, 12, "cpu"), 0.2, 1, 2, 64, 64))


@pytest.mark.parametrize("device", DEVICES)
def test_varlen(device):
    """Varlen: the batch coordinate is the sequence index, rows/columns count from the sequence start;
    empty and odd-length sequences, GQA, causal, seqused_k."""
    device = require_device(device)
    lens_q, lens_k = [37, 0, 130, 5], [50, 9, 131, 64]
    h, hk, d, p = 4, 2, 64, 0.35
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=device)
    used = torch.tensor([50, 9, 100, 1], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), h, d).half().to(device)
    k = torch.randn(sum(lens_k), hk, d).half().to(device)
    v = torch.randn(sum(lens_k), hk, d).half().to(device)
    for causal, seqused in ((True, None), (False, used)):
        rs_in = _rng_state(99, 1 << 33, device)
        out, lse, rs = torch.ops.flash_ext.varlen_fwd(q, k, v, cu_q, cu_k, seqused, max(lens_q), max(lens_k),
                                                      d ** -0.5, causal, -1, -1, 0.0, None, 0, None, p, rs_in)
        mask = _ref_mask(rs, p, len(lens_q), h, max(lens_q), max(lens_k))
        for i in range(len(lens_q)):
            if lens_q[i] == 0:
                continue
            sk = lens_k[i] if seqused is None else int(used[i])
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i]) + sk)
            check_close(out[qs][None], lse[:, qs][None], q[qs][None], k[ks][None], v[ks][None], causal=causal,
                        dropout_p=p, dropout_mask=mask[i:i + 1, :, :lens_q[i], :sk], context=f"sequence {i}")


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_function_and_s_dmask(device):
    """flash_attn_varlen_func with dropout: S_dmask's sign pattern is the reference mask per sequence."""
    device = require_device(device)
    lens = [20, 3, 45]
    h, d, p = 2, 32, 0.5
    cu = torch.tensor([0, 20, 23, 68], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(68, h, d).half().to(device) for _ in range(3))
    torch.manual_seed(5)
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu, cu, 45, 45, dropout_p=p, causal=True,
                                               return_attn_probs=True)
    torch.manual_seed(5)
    _, _, rs = torch.ops.flash_ext.varlen_fwd(q, k, v, cu, cu, None, 45, 45, d ** -0.5, True, -1, -1, 0.0, None, 0,
                                              None, p, None)
    mask = _ref_mask(rs, p, 3, h, 45, 45)
    assert s_dmask.shape == (3, h, 45, 45)
    for i, n in enumerate(lens):
        got = ~torch.signbit(s_dmask[i, :, :n, :n].cpu())
        assert torch.equal(got, mask[i, :, :n, :n]), f"sequence {i}"
        assert (s_dmask[i, :, n:, :] == 0).all() and (s_dmask[i, :, :, n:] == 0).all()
        s = slice(int(cu[i]), int(cu[i + 1]))
        check_close(out[s][None], lse[:, s][None], q[s][None], k[s][None], v[s][None], causal=True, dropout_p=p,
                    dropout_mask=mask[i:i + 1, :, :n, :n], context=f"varlen function, sequence {i}")


# ---------------------------------------------------------------------------------------------------------
# return_attn_probs: S_dmask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (10, 4))])
def test_s_dmask(device, causal, window):
    """S_dmask: |S_dmask| is scaled as flash_attn's CUDA kernel leaves it (exp(s - m_j), m_j the row's maximum
    over key block j and the blocks right of it; 64-key blocks at head dim 64 with dropout, flash_attn's
    _get_block_size_n), so flash_attn's tests' normalize_flash_attn_S step (block j times exp(m_j - lse))
    gives the softmax probabilities; its sign pattern is the reference mask, and the output is the reference
    output with that mask.  The (seed, offset) are recovered by re-seeding the generator and calling the op,
    which returns them: the same generator state gives the same mask."""
    device = require_device(device)
    b, sq, sk, h, hk, d, p = 2, 50, 70, 4, 2, 64, 0.3
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, device)
    torch.manual_seed(11)
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=p, causal=causal, window_size=window,
                                        return_attn_probs=True)
    torch.manual_seed(11)
    out2, _, rs = _op(q, k, v, p, causal=causal, window=window)
    assert torch.equal(out, out2), "same generator state, same output"
    mask = _ref_mask(rs, p, b, h, sq, sk)
    assert s_dmask.shape == (b, h, sq, sk) and s_dmask.dtype == q.dtype
    assert torch.equal(~torch.signbit(s_dmask.cpu()), mask)
    visible = visibility_mask(sq, sk, causal, window, device=q.device)
    scores = (q.double().transpose(1, 2) @ k.double().repeat_interleave(h // hk, 2).transpose(1, 2).transpose(-1, -2)
              * d ** -0.5).masked_fill(~visible, float("-inf"))                # (b, h, sq, sk)
    probs_ref = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    lse_ref = torch.logsumexp(scores, dim=-1, keepdim=True)
    m_first = scores.amax(-1, keepdim=True)             # keys 0..63: the maximum over both blocks (0..69)
    m_last = scores[..., 64:].amax(-1, keepdim=True)    # keys 64..69
    m = torch.cat([m_first.expand(-1, -1, -1, 64), m_last.expand(-1, -1, -1, sk - 64)], dim=-1)
    scaled_ref = torch.exp(scores - m).nan_to_num(0.0)  # rows or blocks with no visible key: 0
    got = s_dmask.abs().double().cpu()
    assert (got - scaled_ref.cpu()).abs().max() <= 1e-2
    normalized = (got * torch.exp(m - lse_ref).cpu()).nan_to_num(0.0)  # flash_attn's tests' normalisation
    assert (normalized - probs_ref.cpu()).abs().max() <= 1e-2
    assert flash_ext.flash_attn_interface._get_block_size_n(q.device, d, True, causal) == 64
    check_close(out, lse, q, k, v, causal=causal, window_size=window, dropout_p=p, dropout_mask=mask)


def test_s_dmask_carries_no_gradient():
    """S_dmask is a diagnostic: no graph (it would keep O(sq x sk) fp32 temporaries alive and send a gradient
    into q and k that flash_attn's backward drops); out and the LSE stay differentiable."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 20, 30, 2, 1, 64, torch.bfloat16))
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=0.2, return_attn_probs=True)
    assert not s_dmask.requires_grad and s_dmask.grad_fn is None
    assert out.requires_grad and lse.requires_grad
    (out.float().sum() + lse.sum()).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_s_dmask_empty_without_dropout():
    """flash_attn returns an empty tensor (q's dtype) as S_dmask when there is no dropout, not None."""
    q, k, v = make_qkv(1, 9, 9, 2, 2, 32, torch.float16)
    p = flash_attn_func(q, k, v, return_attn_probs=True)[2]
    assert isinstance(p, torch.Tensor) and p.shape == (0,) and p.dtype == torch.float16 and p.device == q.device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p,window,tol", [(0.17, (-1, -1), 0.01), (0.5, (-1, -1), 0.01), (0.1, (64, 0), 0.025)])
def test_drop_fraction(device, p, window, tol):
    """|p_hat - p| <= 0.01 over the visible elements of a large problem (FA2's rule; 0.025 with a local
    window), measured on S_dmask."""
    device = require_device(device)
    b, s, h, d = 2, 512, 4, 64
    q, k, v = make_qkv(b, s, s, h, h, d, torch.float16, device, q_scale=0.2)
    _, _, s_dmask = flash_attn_func(q, k, v, dropout_p=p, window_size=window, return_attn_probs=True)
    visible = visibility_mask(s, s, False, window, device=device).expand_as(s_dmask)
    dropped = torch.signbit(s_dmask)[visible].float().mean().item()
    assert abs(dropped - p) <= tol, f"p_hat {dropped:.4f} vs p {p}"


# ---------------------------------------------------------------------------------------------------------
# RNG state


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_output_and_consecutive_calls_differ(device):
    device = require_device(device)
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, torch.float16, device)
    torch.manual_seed(3)
    a, _, rs_a = _op(q, k, v, 0.2)
    b, _, rs_b = _op(q, k, v, 0.2)
    torch.manual_seed(3)
    a2, _, rs_a2 = _op(q, k, v, 0.2)
    assert torch.equal(a, a2) and torch.equal(rs_a, rs_a2)
    assert not torch.equal(rs_a, rs_b) and not torch.equal(a, b)
    assert not torch.equal(_ref_mask(rs_a, 0.2, 1, 2, 64, 64), _ref_mask(rs_b, 0.2, 1, 2, 64, 64))
    if device.type == "cuda":  # CUDA: one seed, offsets advance; CPU: a fresh seed per call, offset 0
        assert rs_a[0] == rs_b[0] and rs_b[1] > rs_a[1]
    else:
        assert rs_a[1] == 0 and rs_b[1] == 0 and rs_a[0] != rs_b[0]


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_rng_state_is_pure(device):
    """With an rng_state input no generator is touched and the result repeats exactly."""
    device = require_device(device)
    q, k, v = make_qkv(1, 40, 40, 2, 2, 32, torch.float16, device)
    rs = _rng_state(77, 16, device)
    gen_state = torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)
    a, _, _ = _op(q, k, v, 0.4, rs)
    b, _, _ = _op(q, k, v, 0.4, rs)
    after = torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)
    assert torch.equal(a, b) and torch.equal(gen_state, after)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_zero_is_bit_identical(device):
    device = require_device(device)
    q, k, v = make_qkv(2, 77, 99, 4, 2, 64, torch.bfloat16, device)
    scale = 64 ** -0.5
    base_out, base_lse, base_rs = torch.ops.flash_ext.fwd(q, k, v, scale, True, -1, -1, 0.0, None)
    out, lse, rs = _op(q, k, v, 0.0, causal=True)
    assert torch.equal(out, base_out) and torch.equal(lse, base_lse)
    assert rs.numel() == 0 and base_rs.numel() == 0
    assert torch.equal(flash_attn_func(q, k, v, dropout_p=0.0, causal=True), flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("device", DEVICES)
def test_mask_independent_of_num_splits(device):
    """Split-KV only regroups the K/V tiles: every split count gives the reference output of the same mask."""
    device = require_device(device)
    q, k, v = make_qkv(2, 5, 1000, 4, 1, 128, torch.float16, device)
    rs = _rng_state(2024, 44, device)
    mask = _ref_mask(rs, 0.25, 2, 4, 5, 1000)
    outs = []
    for splits in (1, 3, 7):
        out, lse, _ = _op(q, k, v, 0.25, rs, num_splits=splits)
        check_close(out, lse, q, k, v, dropout_p=0.25, dropout_mask=mask, context=f"num_splits={splits}")
        outs.append(out.float())
    assert (outs[0] - outs[1]).abs().max() < 2e-3 and (outs[0] - outs[2]).abs().max() < 2e-3


def test_mask_independent_of_host_tile_height():
    """The CPU runs problems of <= 16 query rows with a 16-row tile and longer ones with 128-row tiles; the
    first 16 rows of a longer problem get the same mask, hence the same output."""
    q, k, v = make_qkv(1, 40, 100, 2, 2, 64, torch.float32)
    rs = _rng_state(5, 12, "cpu")
    assert flash_ext.explain(q[:, :16], k, v, dropout_p=0.5, verbose=False).plan["block_m"] == 16
    assert flash_ext.explain(q, k, v, dropout_p=0.5, verbose=False).plan["block_m"] == 128
    short, _, _ = _op(q[:, :16].contiguous(), k, v, 0.5, rs)
    long, _, _ = _op(q, k, v, 0.5, rs)
    assert torch.allclose(short, long[:, :16], atol=1e-6, rtol=1e-5)
    check_close(short, None, q[:, :16], k, v, dropout_p=0.5, dropout_mask=_ref_mask(rs, 0.5, 1, 2, 16, 100))


@pytest.mark.parametrize("device", DEVICES)
def test_packed_functions(device):
    device = require_device(device)
    q, k, v = make_qkv(1, 30, 30, 2, 2, 32, torch.float16, device)
    torch.manual_seed(8)
    ref = flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    torch.manual_seed(8)
    assert torch.equal(flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), dropout_p=0.3, causal=True), ref)
    torch.manual_seed(8)
    assert torch.equal(flash_attn_kvpacked_func(q, torch.stack([k, v], 2), dropout_p=0.3, causal=True), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_rng_state(device):
    device = require_device(device)
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32, torch.float16, device)
    for bad in (torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int64)):
        with pytest.raises(ValueError, match="rng_state: got"):
            _op(q, k, v, 0.1, bad.to(device))
    if device.type == "cuda":
        with pytest.raises(ValueError, match="rng_state: got"):
            _op(q, k, v, 0.1, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="dropout_p: got"):
        torch.ops.flash_ext.dropout_mask(torch.zeros(2, dtype=torch.int64, device=device), 1.0, 1, 1, 1, 1)


# ---------------------------------------------------------------------------------------------------------
# torch.compile, opcheck, CUDA graphs


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    """opcheck with dropout: the explicit rng_state makes the op deterministic, as opcheck needs."""
    device = require_device(device)
    q, k, v = make_qkv(2, 33, 45, 4, 2, 64, torch.float16, device)
    rs = _rng_state(1, 4, device)
    torch.library.opcheck(torch.ops.flash_ext.fwd.default, (q, k, v, 0.125, True, -1, -1, 0.0, None, 0, 0.3, rs))
    cu = torch.tensor([0, 10, 33], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.flash_ext.varlen_fwd.default,
                          (q[0], k[0, :33], v[0, :33], cu, cu, None, 23, 23, 0.125, False, -1, -1, 0.0, None, 0, None,
                           0.3, rs))
    torch.library.opcheck(torch.ops.flash_ext.dropout_mask.default, (rs, 0.3, 2, 3, 17, 19))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_draws_fresh_masks(device):
    """Compiled with fullgraph, the RNG state is read at run time (not baked into the graph): two runs
    differ, and a re-seeded run equals eager with the same seed, bit for bit."""
    device = require_device(device)

    def f(q, k, v):
        return flash_attn_func(q, k, v, dropout_p=0.25, causal=True) * 2

    compiled = torch.compile(f, fullgraph=True)
    q, k, v = make_qkv(2, 33, 45, 4, 2, 40, torch.float16, device)
    torch.manual_seed(21)
    eager = f(q, k, v)
    torch.manual_seed(21)
    first = compiled(q, k, v)
    second = compiled(q, k, v)
    assert torch.equal(first, eager)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_two_calls_are_not_merged(device):
    """Two identical dropout calls in one compiled graph stay two draws (the op is nondeterministic_seeded)."""
    device = require_device(device)

    def f(q, k, v):
        return flash_attn_func(q, k, v, dropout_p=0.5), flash_attn_func(q, k, v, dropout_p=0.5)

    q, k, v = make_qkv(1, 32, 32, 2, 2, 32, torch.float16, device)
    a, b = torch.compile(f, fullgraph=True)(q, k, v)
    assert not torch.equal(a, b)


@pytest.mark.cuda
def test_cuda_graph_replays_draw_fresh_masks():
    """Captured in a CUDA graph, each replay reads the generator's state at replay time: replays differ,
    and a replay after torch.cuda.manual_seed(s) equals an eager call after the same re-seed."""
    device = require_device("cuda")
    q, k, v = make_qkv(2, 64, 64, 4, 2, 64, torch.float16, device)
    static = {}

    def step():
        static["out"], _, static["rs"] = _op(q, k, v, 0.3, causal=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.manual_seed(1234)
    graph.replay()
    first, first_rs = static["out"].clone(), static["rs"].clone()
    graph.replay()
    second = static["out"].clone()
    assert not torch.equal(first, second)
    torch.cuda.manual_seed(1234)
    eager, _, eager_rs = _op(q, k, v, 0.3, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(first, eager) and torch.equal(first_rs, eager_rs)
    check_close(first, None, q, k, v, causal=True, dropout_p=0.3, dropout_mask=_ref_mask(first_rs, 0.3, 2, 4, 64, 64))


def test_s_dmask_block_width_is_flash_attns():
    """flash_attn's tests import _get_block_size_n from flash_attn.flash_attn_interface to undo S_dmask's
    per-block scaling: the same table (flash_attn 2.8, its sm_80 row off CUDA), importable from the same
    module name under flash_ext."""
    from flash_ext.flash_attn_interface import _get_block_size_n, flash_attn_func as f
    assert f is flash_attn_func
    cpu = torch.device("cpu")
    table = {(32, True, False): 128, (64, True, False): 64, (64, False, False): 128, (96, True, True): 64,
             (128, True, False): 32, (128, False, True): 64, (160, True, False): 64, (256, True, True): 64}
    for (d, dropout, causal), width in table.items():
        assert _get_block_size_n(cpu, d, dropout, causal) == width, (d, dropout, causal)
