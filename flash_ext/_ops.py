"""Registration glue for the C++ ops: fake (meta) kernels for torch.compile/export, and autograd."""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the shared library, which registers torch.ops.flash_ext.*)


def _check_same_device(op: str, tensors: dict) -> None:
    """The fake kernels also run when a meta tensor is mixed with real ones; refuse that like the real op."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"flash_ext.{op}: tensors are on different devices ({listed}); all must share q's device")


def _rng_state_fake(q, dropout_p):
    """The rng_state output: (seed, offset) int64 with dropout, an empty tensor without."""
    return q.new_empty((2,) if dropout_p > 0 else (0,), dtype=torch.int64)


@torch.library.register_fake("flash_ext::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, num_splits=0,
              dropout_p=0.0, rng_state=None, deterministic=False):
    _check_same_device("fwd", {"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes, "rng_state": rng_state})
    b, sq, h, d = q.shape
    out = q.new_empty((b, sq, h, d))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse, _rng_state_fake(q, dropout_p)


@torch.library.register_fake("flash_ext::varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, window_left, window_right, softcap, alibi_slopes, num_splits=0, block_table=None,
                     dropout_p=0.0, rng_state=None, deterministic=False):
    _check_same_device("varlen_fwd", {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                                      "cu_seqlens_k": cu_seqlens_k, "seqused_k": seqused_k,
                                      "alibi_slopes": alibi_slopes, "block_table": block_table,
                                      "rng_state": rng_state})
    total_q, h, d = q.shape
    return (q.new_empty((total_q, h, d)), q.new_empty((h, total_q), dtype=torch.float32),
            _rng_state_fake(q, dropout_p))


@torch.library.register_fake("flash_ext::dropout_mask")
def _dropout_mask_fake(rng_state, dropout_p, batch, heads, seqlen_q, seqlen_k):
    return rng_state.new_empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.bool)


@torch.library.register_fake("flash_ext::kvcache_fwd")
def _kvcache_fwd_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                      softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, num_splits=0,
                      rotary_len=-1, rotary_rows=0):
    _check_same_device("kvcache_fwd", {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v,
                                       "cache_seqlens": cache_seqlens, "cache_batch_idx": cache_batch_idx,
                                       "cache_leftpad": cache_leftpad, "block_table": block_table,
                                       "alibi_slopes": alibi_slopes})
    b, sq, h, d = q.shape
    return q.new_empty((b, sq, h, d)), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.register_fake("flash_ext::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_left,
              window_right, softcap, alibi_slopes, deterministic, rng_state=None, dsoftmax_lse=None):
    _check_same_device("bwd", {"dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": softmax_lse,
                               "dq": dq, "dk": dk, "dv": dv, "alibi_slopes": alibi_slopes,
                               "dsoftmax_lse": dsoftmax_lse})
    b, sq, h, _ = q.shape
    return q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.register_fake("flash_ext::varlen_bwd")
def _varlen_bwd_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                     deterministic, rng_state=None, seqused_k=None, dsoftmax_lse=None):
    _check_same_device("varlen_bwd", {"dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": softmax_lse,
                                      "dq": dq, "dk": dk, "dv": dv, "cu_seqlens_q": cu_seqlens_q,
                                      "cu_seqlens_k": cu_seqlens_k, "seqused_k": seqused_k,
                                      "alibi_slopes": alibi_slopes, "dsoftmax_lse": dsoftmax_lse})
    total_q, h, _ = q.shape
    return q.new_empty((h, total_q), dtype=torch.float32)


# Autograd of the forward ops: the backward ops with fresh gradient buffers.  Both outputs are differentiable:
# the gradient of softmax_lse enters the backward as D - dLSE (d LSE_i / d score_ij = P_ij), which flash_attn
# drops silently.  ALiBi slopes get no gradient: a graph that needs one is refused rather than given zero.

_ALIBI_GRAD_ERROR = ("flash_ext: alibi_slopes requires grad, but the backward pass computes no gradient for the "
                     "slopes (as in flash_attn); pass alibi_slopes.detach() or a tensor that does not require grad.")


def _setup_context_common(ctx, q, k, v, output, alibi_slopes, dropout_p) -> None:
    out, lse, rng_state = output
    # rng_state: the (seed, offset) the forward's dropout mask used; the backward regenerates the same mask.
    ctx.mark_non_differentiable(rng_state)
    ctx.save_for_backward(q, k, v, out, lse, rng_state)
    ctx.dropout_p = dropout_p
    # Unused outputs then arrive as None in the backward (no zero-filled dLSE when the loss ignores the LSE).
    ctx.set_materialize_grads(False)
    ctx.alibi_slopes = alibi_slopes


def _grad_buffers(q, k, v):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _dout(grad_out, out):
    """The upstream gradient of out as the op takes it (zeros when only the LSE reaches the loss)."""
    if grad_out is None:
        return torch.zeros_like(out)
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    return grad_out.to(out.dtype)


def _rng(rng_state, dropout_p):
    """The forward's (seed, offset) for the backward op: only with dropout (an empty tensor without)."""
    return rng_state if dropout_p > 0 else None


def _dlse(grad_lse):
    return None if grad_lse is None else grad_lse.float()


def first_order_only(ctx, grads: tuple) -> tuple:
    """The gradients, made to raise if differentiated again.  The backward ops have no autograd of their own,
    so under ``create_graph=True`` the gradients would come back without a graph and a second-order loss (a
    gradient penalty) would silently lose the attention's term; flash_attn does the same silently.  As
    ``torch.autograd.function.once_differentiable`` does, but keyed on the saved inputs requiring grad (the
    second-order term comes from q, k, v, not only from the incoming gradient).  The error node takes q, k and
    v as inputs too, so that any gradient requested through these gradients reaches it (autograd prunes a
    node that lies on no path to the requested inputs)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return grads
    inputs = [t for t in ctx.saved_tensors[:3] if t.requires_grad]
    if not inputs:
        return grads
    live = [i for i, g in enumerate(grads) if g is not None]
    err = torch._C._functions.DelayedError(
        b"flash_ext: the attention backward is not differentiable (no double backward, as in flash_attn, which "
        b"silently drops the second-order term): use torch.nn.functional.scaled_dot_product_attention's math path "
        b"for higher-order gradients", len(live) + len(inputs))
    wrapped = err(*[grads[i].detach() for i in live], *inputs)
    out = list(grads)
    for i, w in zip(live, wrapped):
        out[i] = w
    return tuple(out)


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, _num_splits, dropout_p,
     _rng_state, deterministic) = inputs
    _setup_context_common(ctx, q, k, v, output, alibi_slopes, dropout_p)
    ctx.args = (softmax_scale, causal, window_left, window_right, softcap, deterministic)


def _fwd_backward(ctx, grad_out, grad_lse, _grad_rng_state):
    if ctx.needs_input_grad[8]:
        raise NotImplementedError(_ALIBI_GRAD_ERROR)
    if grad_out is None and grad_lse is None:
        return (None,) * 13
    q, k, v, out, lse, rng_state = ctx.saved_tensors
    softmax_scale, causal, window_left, window_right, softcap, deterministic = ctx.args
    dq, dk, dv = _grad_buffers(q, k, v)
    torch.ops.flash_ext.bwd(_dout(grad_out, out), q, k, v, out, lse, dq, dk, dv, ctx.dropout_p, softmax_scale,
                            causal, window_left, window_right, softcap, ctx.alibi_slopes, deterministic,
                            _rng(rng_state, ctx.dropout_p), _dlse(grad_lse))
    return first_order_only(ctx, (dq, dk, dv) + (None,) * 10)


def _varlen_fwd_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
     window_right, softcap, alibi_slopes, _num_splits, block_table, dropout_p, _rng_state, deterministic) = inputs
    _setup_context_common(ctx, q, k, v, output, alibi_slopes, dropout_p)
    ctx.paged = block_table is not None
    ctx.index = (cu_seqlens_q, cu_seqlens_k, seqused_k)
    ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic)


def _varlen_fwd_backward(ctx, grad_out, grad_lse, _grad_rng_state):
    if ctx.needs_input_grad[13]:
        raise NotImplementedError(_ALIBI_GRAD_ERROR)
    if grad_out is None and grad_lse is None:
        return (None,) * 19
    if ctx.paged:
        raise NotImplementedError("flash_ext: the backward pass through paged K/V (block_table) is not supported "
                                  "(as in flash_attn); pass k/v as (total_k, nheads_k, headdim) to train")
    q, k, v, out, lse, rng_state = ctx.saved_tensors
    cu_seqlens_q, cu_seqlens_k, seqused_k = ctx.index
    max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic = ctx.args
    dq, dk, dv = _grad_buffers(q, k, v)
    torch.ops.flash_ext.varlen_bwd(_dout(grad_out, out), q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                   max_seqlen_q, max_seqlen_k, ctx.dropout_p, softmax_scale, causal, window_left,
                                   window_right, softcap, ctx.alibi_slopes, deterministic,
                                   _rng(rng_state, ctx.dropout_p), seqused_k, _dlse(grad_lse))
    return first_order_only(ctx, (dq, dk, dv) + (None,) * 16)


torch.library.register_autograd("flash_ext::fwd", _fwd_backward, setup_context=_fwd_setup_context)
torch.library.register_autograd("flash_ext::varlen_fwd", _varlen_fwd_backward, setup_context=_varlen_fwd_setup_context)
