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

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import _ops  # noqa: F401  (registers the ops' fake kernels)
from .errors import raises_argument_error
from .interface import _op_reasons, _refusal, _window_size_error, maybe_contiguous, size_arg

__all__ = ["flash_attn_backward", "flash_attn_varlen_backward"]

Grads = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _prepare(dout, q, k, v, out, softmax_scale, window_size, rank: int):
    """Default scale, window check, a contiguous last dimension (as flash_attn's backward makes them), and
    zero-padding of the head dim to a multiple of 8 (zeros change no dot product, and their gradients are
    dropped).  Inputs the op will reject pass through otherwise untouched so that its error names what the
    caller gave.  Returns ``(dout, q, k, v, out)`` as the op takes them, the same before padding, the scale,
    the head dim and the padded head dim."""
    error = _window_size_error(window_size)
    if error:
        raise ValueError(f"flash_ext: {error}")
    head_dim = q.shape[-1] if q.dim() >= 1 else 0
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5 if head_dim > 0 else 1.0
    padded = head_dim if head_dim % 8 == 0 or head_dim > 256 else head_dim + 8 - head_dim % 8
    unpadded = tuple(maybe_contiguous(t) for t in (dout, q, k, v, out))
    tensors = unpadded
    if padded != head_dim and all(t.dim() == rank and t.shape[-1] == head_dim for t in tensors):
        tensors = tuple(F.pad(t, [0, padded - head_dim]) for t in tensors)
    else:
        padded = head_dim
    return tensors, unpadded, float(softmax_scale), head_dim, padded


def _check_unpadded(op, op_name: str, unpadded, softmax_lse, given, *rest) -> None:
    """With a padded head dim the op writes padded stand-ins, not the caller's buffers: when the caller gives
    buffers, they and the caller's tensors (fresh stand-ins for buffers not given) go through the op's own
    checks first, in check-only mode (which takes any head dim), so the rules and the messages are those of an
    unpadded call.  Without buffers the op's checks of the padded call are the checks (no second pass)."""
    dout, q, k, v, out = unpadded
    if torch.compiler.is_compiling():
        # check-only mode is a host-side switch a traced graph cannot hold: the op checks the padded call in
        # the graph, and here only what the final copies would pass silently (a cast, a broadcast, another
        # device, one buffer given twice)
        named = [(name, g, like) for name, g, like in zip(("dq", "dk", "dv"), given, (q, k, v)) if g is not None]
        errors = [f"{name}: got {g.dtype} {tuple(g.shape)} on {g.device}; must match {like.dtype} "
                  f"{tuple(like.shape)} on {like.device}" for name, g, like in named
                  if g.shape != like.shape or g.dtype != like.dtype or g.device != like.device]
        errors += [f"{a}/{b}: got one tensor twice; are both written: must not overlap each other"
                   for i, (a, ga, _) in enumerate(named) for b, gb, _ in named[i + 1:] if ga is gb]
        if errors:
            raise _refusal(op_name, errors)
        return
    bufs = [g if g is not None else torch.empty(like.shape, dtype=like.dtype, device=like.device)
            for g, like in zip(given, (q, k, v))]
    errors = _op_reasons(op, dout, q, k, v, out, softmax_lse, *bufs, *rest)
    if errors:
        raise _refusal(op_name, errors)


def _buffers(q, k, v, given, head_dim: int, padded: int):
    """Buffers the op writes: the caller's, or fresh ones; padded stand-ins when the head dim was padded (the
    caller's then checked by _check_unpadded and written by _results)."""
    def one(g, like):
        if g is not None and padded == head_dim:
            return g
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    return tuple(one(g, like) for g, like in zip(given, (q, k, v)))


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
    return fixed_backward_with_d(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale=softmax_scale,
                                 causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 deterministic=deterministic, dropout_p=dropout_p, rng_state=rng_state)[0]


def fixed_backward_with_d(dout, q, k, v, out, softmax_lse, dq, dk, dv, *, softmax_scale, causal, window_size,
                          softcap, alibi_slopes, deterministic, dropout_p, rng_state) -> Tuple[Grads, torch.Tensor]:
    """``flash_attn_backward``'s work, returning ``((dq, dk, dv), softmax_d)``: also for flash_attn's
    ``_flash_attn_backward`` (flash_attn_interface.py), which returns D = rowsum(dout * out)."""
    given = (dq, dk, dv)
    (dout, q, k, v, out), unpadded, scale, head_dim, padded = _prepare(dout, q, k, v, out, softmax_scale,
                                                                      window_size, rank=4)
    options = (float(dropout_p), scale, bool(causal), int(window_size[0]), int(window_size[1]), float(softcap),
               alibi_slopes, bool(deterministic), rng_state)
    if padded != head_dim and any(g is not None for g in given):
        _check_unpadded(torch.ops.flash_ext.bwd, "flash_ext.bwd", unpadded, softmax_lse, given, *options)
    written = _buffers(q, k, v, given, head_dim, padded)
    softmax_d = torch.ops.flash_ext.bwd(dout, q, k, v, out, softmax_lse, *written, *options)
    return _results(written, given, head_dim, padded), softmax_d


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
    return varlen_backward_with_d(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  deterministic=deterministic, seqused_k=seqused_k, dropout_p=dropout_p,
                                  rng_state=rng_state)[0]


def varlen_backward_with_d(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dq, dk, dv, *, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           dropout_p, rng_state, seqused_k=None) -> Tuple[Grads, torch.Tensor]:
    """``flash_attn_varlen_backward``'s work, returning ``((dq, dk, dv), softmax_d)``: also for flash_attn's
    ``_flash_attn_varlen_backward``."""
    given = (dq, dk, dv)
    (dout, q, k, v, out), unpadded, scale, head_dim, padded = _prepare(dout, q, k, v, out, softmax_scale,
                                                                      window_size, rank=3)
    options = (cu_seqlens_q, cu_seqlens_k, size_arg(max_seqlen_q), size_arg(max_seqlen_k), float(dropout_p), scale,
               bool(causal), int(window_size[0]), int(window_size[1]), float(softcap), alibi_slopes,
               bool(deterministic), rng_state, seqused_k)
    if padded != head_dim and any(g is not None for g in given):
        _check_unpadded(torch.ops.flash_ext.varlen_bwd, "flash_ext.varlen_bwd", unpadded, softmax_lse, given,
                        *options)
    written = _buffers(q, k, v, given, head_dim, padded)
    softmax_d = torch.ops.flash_ext.varlen_bwd(dout, q, k, v, out, softmax_lse, *written, *options)
    return _results(written, given, head_dim, padded), softmax_d
