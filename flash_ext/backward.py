"""The backward pass as explicit functions, for callers that run the forward and the backward themselves
(context-parallel / ring attention, custom autograd Functions, activation recomputation schemes).

Training through ``flash_attn_func`` and its variants needs none of this: their autograd runs the same ops.
These functions are thin conveniences over the registered ops ``torch.ops.flash_ext.bwd`` and
``torch.ops.flash_ext.varlen_bwd``, whose arguments follow flash_attn 2.8's ``_flash_attn_backward`` and
``_flash_attn_varlen_backward`` (same positions, dq/dk/dv buffers written in place, ``softmax_d`` returned):
here the buffers are optional, the head dim may be any size up to 256, and the gradients are returned.

``out`` and ``softmax_lse`` are the attention output and log-sum-exp over ALL the keys the loss saw.  With
context parallelism a rank holds only a block of k/v: pass the merged global ``out``/``softmax_lse`` and that
block's k/v, and the results are that block's dk/dv and its share of dq (the shares add up to the full dq).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from . import _ops  # noqa: F401  (registers the ops' fake kernels)
from .errors import raises_argument_error
from .interface import _window_size_error, maybe_contiguous

__all__ = ["flash_attn_backward", "flash_attn_varlen_backward"]

Grads = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _prepare(dout, q, k, v, out, softmax_scale, window_size, rank: int):
    """Default scale, window check, a contiguous last dimension (as flash_attn's backward makes them), and
    zero-padding of the head dim to a multiple of 8 (zeros change no dot product, and their gradients are
    dropped).  Inputs the op will reject pass through otherwise untouched so that its error names what the
    caller gave.  Returns ``(dout, q, k, v, out, scale, head_dim, padded)``."""
    error = _window_size_error(window_size)
    if error:
        raise ValueError(f"flash_ext: {error}")
    head_dim = q.shape[-1] if q.dim() >= 1 else 0
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5 if head_dim > 0 else 1.0
    padded = head_dim if head_dim % 8 == 0 or head_dim > 256 else head_dim + 8 - head_dim % 8
    tensors = tuple(maybe_contiguous(t) for t in (dout, q, k, v, out))
    if padded != head_dim and all(t.dim() == rank and t.shape[-1] == head_dim for t in tensors):
        tensors = tuple(F.pad(t, [0, padded - head_dim]) for t in tensors)
    return (*tensors, float(softmax_scale), head_dim, padded)


def _given_buffer_errors(q, k, v, dq, dk, dv, head_dim: int) -> List[str]:
    """What the op would say of the caller's buffers, for when it writes padded stand-ins instead (the head dim
    not a multiple of 8): each must match its input before padding, and none may overlap itself or another."""
    errors = []
    given = [(name, g, like) for name, g, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)) if g is not None]
    for name, g, like in given:
        shape = (*like.shape[:-1], head_dim)
        if tuple(g.shape) != shape or g.dtype != like.dtype or g.device != like.device:
            errors.append(f"{name}: got {g.dtype} {tuple(g.shape)} on {g.device}; must match {shape} {like.dtype} on "
                          f"{like.device}")
        if torch._debug_has_internal_overlap(g) == 1:
            errors.append(f"{name}: strides {g.stride()} with elements that share memory; is written: must not "
                          "overlap itself (e.g. not an expand()ed tensor)")
    for i, (name, g, _) in enumerate(given):
        for other, h, _ in given[i + 1:]:
            if g.numel() and g.data_ptr() == h.data_ptr() and g.stride() == h.stride():
                errors.append(f"{name}/{other}: the same memory; are both written: must not overlap each other")
    return errors


def _buffers(q, k, v, dq, dk, dv, head_dim: int, padded: int):
    """Buffers the op writes: the caller's, or fresh ones; padded stand-ins when the head dim was padded (the
    caller's are then checked here, before anything runs, and written by _results)."""
    if padded != head_dim:
        errors = _given_buffer_errors(q, k, v, dq, dk, dv, head_dim)
        if errors:
            raise ValueError("flash_ext: " + "; ".join(errors))

    def one(given, like):
        if given is not None and padded == head_dim:
            return given
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    return one(dq, q), one(dk, k), one(dv, v)


def _results(written: Grads, given, head_dim: int, padded: int) -> Grads:
    if padded == head_dim:
        return written
    results = []
    for w, g in zip(written, given):
        w = w[..., :head_dim]
        results.append(g.copy_(w) if g is not None else w)
    return tuple(results)


@raises_argument_error
def flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor] = None,
    dk: Optional[torch.Tensor] = None,
    dv: Optional[torch.Tensor] = None,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
) -> Grads:
    """Gradients ``(dq, dk, dv)`` of ``flash_attn_func(q, k, v, ...)`` for the upstream gradient ``dout``.

    Shapes and options as in ``flash_attn_func``: q, dout, out ``(batch, seqlen_q, nheads, headdim)``, k/v
    ``(batch, seqlen_k, nheads_k, headdim)``, ``softmax_lse`` fp32 ``(batch, nheads, seqlen_q)`` (what
    ``flash_attn_func(..., return_attn_probs=True)`` returns).  ``dq``/``dk``/``dv``, when given, are written in
    place (shapes and dtypes of q/k/v, last dimension contiguous) and returned; missing ones are allocated.
    With grouped heads dk/dv are summed over the query heads of each K/V head.  Rows that see no key get zero
    gradients.  ``deterministic=True``: bitwise reproducible dq on the GPU (fixed accumulation order); the CPU
    is always deterministic.  With ``dropout_p > 0``, ``rng_state`` is required: the forward's ``(seed, offset)``
    (the third output of ``torch.ops.flash_ext.fwd``, or the ``rng_state`` that forward was given), from which
    the backward regenerates the forward's dropout mask (same ``dropout_p`` as the forward).
    """
    given = (dq, dk, dv)
    dout, q, k, v, out, scale, head_dim, padded = _prepare(dout, q, k, v, out, softmax_scale, window_size, rank=4)
    written = _buffers(q, k, v, dq, dk, dv, head_dim, padded)
    torch.ops.flash_ext.bwd(dout, q, k, v, out, softmax_lse, *written, float(dropout_p), scale, bool(causal),
                            int(window_size[0]), int(window_size[1]), float(softcap), alibi_slopes,
                            bool(deterministic), rng_state)
    return _results(written, given, head_dim, padded)


@raises_argument_error
def flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dq: Optional[torch.Tensor] = None,
    dk: Optional[torch.Tensor] = None,
    dv: Optional[torch.Tensor] = None,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    seqused_k: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
) -> Grads:
    """Gradients ``(dq, dk, dv)`` of ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)``.

    q, dout, out ``(total_q, nheads, headdim)``, k/v ``(total_k, nheads_k, headdim)``, ``softmax_lse`` fp32
    ``(nheads, total_q)``; sequences, ``seqused_k`` and options as in ``flash_attn_varlen_func`` (paged K/V
    has no backward).  Keys a sequence does not use (past ``seqused_k``, or rows no sequence covers) get zero
    dk/dv.  Buffers and determinism as in ``flash_attn_backward``.
    """
    given = (dq, dk, dv)
    dout, q, k, v, out, scale, head_dim, padded = _prepare(dout, q, k, v, out, softmax_scale, window_size, rank=3)
    written = _buffers(q, k, v, dq, dk, dv, head_dim, padded)
    torch.ops.flash_ext.varlen_bwd(dout, q, k, v, out, softmax_lse, *written, cu_seqlens_q, cu_seqlens_k,
                                   int(max_seqlen_q), int(max_seqlen_k), float(dropout_p), scale, bool(causal),
                                   int(window_size[0]), int(window_size[1]), float(softcap), alibi_slopes,
                                   bool(deterministic), rng_state, seqused_k)
    return _results(written, given, head_dim, padded)
