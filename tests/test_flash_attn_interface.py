"""flash_attn 2.8's lower-level functions under ``flash_ext.flash_attn_interface`` (``_flash_attn_forward``,
``_flash_attn_varlen_forward``, ``_flash_attn_backward``, ``_flash_attn_varlen_backward``), as context-parallel
libraries call them: ring-flash-attention reads their parameters with ``inspect.getfullargspec``, calls them with
keywords, runs the forward per key block, merges the blocks' (out, lse) itself, and runs the backward per block
with the merged out/lse into buffers it gives.

Expected values: the float64 reference (flash_ext.reference, through attn_check/grad_check's rule) over the whole
key range; the parameter lists are flash_attn v2.8.3's (flash_attn/flash_attn_interface.py)."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from flash_ext import ArgumentError
from flash_ext.dropout import dropout_mask
from flash_ext.flash_attn_interface import (_flash_attn_backward, _flash_attn_forward, _flash_attn_varlen_backward,
                                            _flash_attn_varlen_forward, _wrapped_flash_attn_backward,
                                            _wrapped_flash_attn_forward)

from attn_check import check_close, make_qkv
from conftest import DEVICES, require_device
from grad_check import check_grads

# flash_attn v2.8.3's parameter lists, in order (a caller builds a dict from them and calls with keywords).
FLASH_ATTN_PARAMS = {
    _flash_attn_forward: ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left",
                          "window_size_right", "softcap", "alibi_slopes", "return_softmax"],
    _flash_attn_varlen_forward: ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                 "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
                                 "softcap", "alibi_slopes", "return_softmax", "block_table", "leftpad_k",
                                 "seqused_k", "zero_tensors"],
    _flash_attn_backward: ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p",
                           "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
                           "alibi_slopes", "deterministic", "rng_state"],
    _flash_attn_varlen_backward: ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q",
                                  "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale",
                                  "causal", "window_size_left", "window_size_right", "softcap", "alibi_slopes",
                                  "deterministic", "rng_state", "zero_tensors"],
}


def default_args(fn) -> dict:
    """ring-flash-attention's way of reading a function's parameters: every name, None where no default."""
    spec = inspect.getfullargspec(fn)
    defaults = spec.defaults or ()
    args = dict(zip(spec.args, (None,) * (len(spec.args) - len(defaults)) + tuple(defaults)))
    args["softcap"] = 0.0
    return args


def test_parameters_are_flash_attns() -> None:
    """Names and order as flash_attn's, readable by inspect.getfullargspec (which does not follow a decorator's
    __wrapped__: the first version's error-converting wrapper showed (*args, **kwargs), so such a caller built an
    empty dict and called without q); the _wrapped_ names flash_attn routes through are the same functions."""
    for fn, names in FLASH_ATTN_PARAMS.items():
        spec = inspect.getfullargspec(fn)
        assert spec.args == names and spec.varargs is None and spec.varkw is None, (fn.__name__, spec)
    varlen_defaults = default_args(_flash_attn_varlen_forward)
    assert [varlen_defaults[n] for n in ("window_size_left", "window_size_right", "return_softmax", "zero_tensors")] \
        == [-1, -1, False, False]
    assert default_args(_flash_attn_backward)["rng_state"] is None
    assert _wrapped_flash_attn_forward is _flash_attn_forward and _wrapped_flash_attn_backward is _flash_attn_backward


def _merge(out, lse, block_out, block_lse):
    """Two partials over disjoint key sets, merged as ring-flash-attention does (sigmoid form, fp32)."""
    block_out = block_out.float()
    block_lse = block_lse.transpose(-2, -1).unsqueeze(-1)  # (b, sq, h, 1)
    if out is None:
        return block_out, block_lse
    return out - torch.sigmoid(block_lse - lse) * (out - block_out), lse - F.logsigmoid(lse - block_lse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal, head_dim", [(True, 64), (False, 59)])
def test_ring_attention_through_the_low_level_functions(device, dtype, causal, head_dim) -> None:
    """q is the last of three equal blocks of a sequence; k/v arrive block by block (a ring's steps): the blocks
    before q's fully visible, q's own block causal on its diagonal.  Merged out/lse must equal one causal call
    over all keys, and the per-block backward with the merged out/lse must add up to its gradients
    (dq summed over blocks, dk/dv per block).  Grouped heads; head dim 59 goes through the zero padding."""
    dev = require_device(device)
    torch.manual_seed(0)
    block, nblocks = 45, 3
    q, k, v = make_qkv(2, block, block * nblocks, 4, 2, head_dim, dtype, dev)
    scale = head_dim ** -0.5
    out = lse = None
    for j in range(nblocks):
        params = default_args(_flash_attn_forward)
        params.update(q=q, k=k[:, j * block:(j + 1) * block], v=v[:, j * block:(j + 1) * block], dropout_p=0.0,
                      softmax_scale=scale, causal=causal and j == nblocks - 1, window_size_left=-1,
                      window_size_right=-1, alibi_slopes=None, return_softmax=False)
        block_out, block_lse, _, _ = _flash_attn_forward(**params)
        out, lse = _merge(out, lse, block_out, block_lse)
    out = out.to(dtype)
    lse = lse.squeeze(-1).transpose(1, 2).contiguous()  # (b, h, sq)
    check_close(out, lse, q, k, v, softmax_scale=scale, causal=causal, context="merged ring forward")

    dout = torch.randn_like(out)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=dev)
    dks, dvs = [], []
    bufs = [torch.full_like(t, float("nan")) for t in (q, k[:, :block], v[:, :block])]
    for j in range(nblocks):
        params = default_args(_flash_attn_backward)
        params.update(dout=dout, q=q, k=k[:, j * block:(j + 1) * block], v=v[:, j * block:(j + 1) * block],
                      out=out, softmax_lse=lse, dq=bufs[0], dk=bufs[1], dv=bufs[2], dropout_p=0.0,
                      softmax_scale=scale, causal=causal and j == nblocks - 1, window_size_left=-1,
                      window_size_right=-1, alibi_slopes=None, deterministic=False, rng_state=None)
        softmax_d = _flash_attn_backward(**params)
        assert softmax_d.shape == (2, 4, block) and softmax_d.dtype == torch.float32
        dq += bufs[0].float()
        dks.append(bufs[1].clone())
        dvs.append(bufs[2].clone())
    check_grads((dq.to(dtype), torch.cat(dks, 1), torch.cat(dvs, 1)), q, k, v, dout, softmax_scale=scale,
                causal=causal, context="ring backward")


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_low_level_functions(device) -> None:
    """Two packed sequences of different lengths, causal with a window: each sequence's rows against the
    reference of that sequence alone, forward and backward (positional arguments, as flash_attn's own callers
    pass them)."""
    dev = require_device(device)
    torch.manual_seed(1)
    dtype, d, window = torch.bfloat16, 64, (20, 0)
    lens_q, lens_k = [37, 50], [45, 61]
    cu_q = torch.tensor([0, 37, 87], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 45, 106], dtype=torch.int32, device=dev)
    q, k, v = (t[0] for t in make_qkv(1, 87, 106, 4, 4, d, dtype, dev))
    k, v = k[:106], v[:106]
    out, lse, s_dmask, rng_state = _flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, 50, 61, 0.0, d ** -0.5, True, window[0], window[1])
    assert lse.shape == (4, 87) and s_dmask.numel() == 0
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    softmax_d = _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 50, 61, 0.0, d ** -0.5,
                                            True, window[0], window[1], 0.0, None, False, rng_state)
    assert softmax_d.shape == (4, 87)
    for i in range(2):
        rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        one = lambda t, r: t[r].unsqueeze(0)  # noqa: E731
        check_close(one(out, rq), lse[:, rq].unsqueeze(0), one(q, rq), one(k, rk), one(v, rk), causal=True,
                    window_size=window, context=f"sequence {i}")
        check_grads((one(dq, rq), one(dk, rk), one(dv, rk)), one(q, rq), one(k, rk), one(v, rk), one(dout, rq),
                    causal=True, window_size=window, context=f"sequence {i}")


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_round_trip(device) -> None:
    """The forward's rng_state handed to the backward regenerates the forward's mask: output and gradients as
    the reference with that mask (the dropout_mask op's); S_dmask comes with return_softmax.  Without the
    rng_state the backward refuses before writing (flash_attn would draw a fresh mask, not the forward's)."""
    dev = require_device(device)
    torch.manual_seed(2)
    p = 0.25
    q, k, v = make_qkv(1, 70, 90, 2, 1, 64, torch.float16, dev)
    out, lse, s_dmask, rng_state = _flash_attn_forward(q, k, v, p, 0.125, False, -1, -1, 0.0, None, True)
    assert rng_state.shape == (2,) and s_dmask.shape == (1, 2, 70, 90)
    mask = dropout_mask(rng_state, p, 1, 2, 70, 90)
    assert torch.equal(mask, ~torch.signbit(s_dmask))  # S_dmask's sign is the mask (dropped entries negated)
    check_close(out, lse, q, k, v, softmax_scale=0.125, dropout_p=p, dropout_mask=mask, context="dropout fwd")
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, p, 0.125, False, -1, -1, 0.0, None, False, rng_state)
    check_grads((dq, dk, dv), q, k, v, dout, softmax_scale=0.125, dropout_p=p, dropout_mask=mask,
                context="dropout bwd")
    # return_softmax=False: no S_dmask (an O(sq x sk) tensor flash_ext built anyway; flash_attn returns an
    # empty one), the same output and rng_state semantics
    out2, lse2, none, rng2 = _flash_attn_forward(q, k, v, p, 0.125, False, -1, -1, 0.0, None, False)
    assert none.shape == (0,) and none.dtype == q.dtype and rng2.shape == (2,)
    none = _flash_attn_varlen_forward(q[0], k[0], v[0], torch.tensor([0, 70], dtype=torch.int32, device=dev),
                                      torch.tensor([0, 90], dtype=torch.int32, device=dev), 70, 90, p, 0.125, False)[2]
    assert none.shape == (0,)
    sentinel = torch.full_like(q, 7.0)
    with pytest.raises(ArgumentError, match=r"rng_state: got None; is required with dropout_p > 0"):
        _flash_attn_backward(dout, q, k, v, out, lse, sentinel, dk, dv, p, 0.125, False, -1, -1, 0.0, None, False)
    assert torch.equal(sentinel, torch.full_like(q, 7.0))


def test_leftpad_k_is_refused_by_name() -> None:
    """flash_ext's varlen forward has no left padding of the keys: refused, naming it and the alternative."""
    q, k, v = (t[0] for t in make_qkv(1, 10, 10, 2, 2, 64, torch.float16))
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ArgumentError, match=r"leftpad_k: got a tensor; .* cache_leftpad"):
        _flash_attn_varlen_forward(q, k, v, cu, cu, 10, 10, 0.0, 0.125, False,
                                   leftpad_k=torch.zeros(1, dtype=torch.int32))


def test_empty_rng_state_of_a_call_without_dropout_is_taken_back() -> None:
    """The forward op returns an empty rng_state without dropout; the ops refused it back ("must be (2,)") even
    where nothing reads it, so a backward fed what its forward returned failed.  Taken with dropout_p == 0;
    still refused where it would be read (dropout_p > 0, and the dropout_mask op, which reads it always)."""
    q, k, v = make_qkv(1, 16, 16, 2, 2, 64, torch.float16)
    out, lse, rng_state = torch.ops.flash_ext.fwd(q, k, v, 0.125, False, -1, -1, 0.0, None)
    assert rng_state.shape == (0,)
    again = torch.ops.flash_ext.fwd(q, k, v, 0.125, False, -1, -1, 0.0, None, 0, 0.0, rng_state)
    assert torch.equal(again[0], out)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    torch.ops.flash_ext.bwd(torch.ones_like(out), q, k, v, out, lse, *grads, 0.0, 0.125, False, -1, -1, 0.0, None,
                            False, rng_state)
    assert all(torch.isfinite(g).all() for g in grads)
    with pytest.raises(ValueError, match=r"rng_state: got Long \[0\] on cpu; must be an int64 tensor of shape \(2,\)"):
        torch.ops.flash_ext.bwd(torch.ones_like(out), q, k, v, out, lse, *grads, 0.1, 0.125, False, -1, -1, 0.0,
                                None, False, rng_state)
    with pytest.raises(ValueError, match=r"rng_state: got Long \[0\]"):
        torch.ops.flash_ext.dropout_mask(rng_state, 0.0, 1, 2, 16, 16)
