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
              dropout_p=0.0, rng_state=None):
    _check_same_device("fwd", {"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes, "rng_state": rng_state})
    b, sq, h, d = q.shape
    out = q.new_empty((b, sq, h, d))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse, _rng_state_fake(q, dropout_p)


@torch.library.register_fake("flash_ext::varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, window_left, window_right, softcap, alibi_slopes, num_splits=0, block_table=None,
                     dropout_p=0.0, rng_state=None):
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


def _fwd_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])


def _fwd_backward(ctx, grad_out, grad_lse, *grad_rng_state):
    raise NotImplementedError(
        "flash_ext: the backward pass is not implemented yet; flash_ext currently provides the forward "
        "(inference) kernels only. Use torch.nn.functional.scaled_dot_product_attention for training.")


torch.library.register_autograd("flash_ext::fwd", _fwd_backward, setup_context=_fwd_setup_context)
torch.library.register_autograd("flash_ext::varlen_fwd", _fwd_backward, setup_context=_fwd_setup_context)
