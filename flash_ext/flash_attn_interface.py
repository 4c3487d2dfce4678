"""``flash_attn.flash_attn_interface`` under flash_ext: code that imports the functions from that module
(``from flash_attn.flash_attn_interface import flash_attn_func``) reads ``flash_ext.flash_attn_interface``.

Besides the public functions, the module has flash_attn 2.8's lower-level functions that context-parallel
libraries call to run the forward and the backward themselves (ring-flash-attention, and the Ulysses/USP
code built on it): ``_flash_attn_forward``, ``_flash_attn_varlen_forward``, ``_flash_attn_backward``,
``_flash_attn_varlen_backward`` with flash_attn's parameter names and positions (such code reads them with
``inspect`` and calls with keywords) and return values, and the ``_wrapped_*`` names flash_attn gives them.
``_get_block_size_n`` is there too, as flash_attn's tests import it to undo ``S_dmask``'s per-block scaling.

Differences from flash_attn (all more permissive, none changes a result):

* any head dim up to 256 (flash_attn's low-level functions take multiples of 8; here other sizes are padded
  with zeros, as ``flash_attn_func`` does);
* ``return_softmax=True`` without dropout gives an empty ``S_dmask`` (flash_attn raises), and ``S_dmask`` is
  ``(b, h, seqlen_q, seqlen_k)``, not padded to multiples of 128;
* ``rng_state`` is the forward op's: empty without dropout (flash_attn's holds two unused values), and the
  backward takes either back;
* ``softmax_d`` (the backward's D = rowsum(dout * out), which the callers ignore) is ``(b, h, seqlen_q)`` /
  ``(h, total_q)``, without flash_attn's padding of the rows;
* the backward with ``dropout_p > 0`` requires the forward's ``rng_state`` (flash_attn draws a new mask when
  it is None, which cannot be the forward's);
* ``zero_tensors`` is accepted and has no effect: rows of a varlen ``q`` past ``cu_seqlens_q[-1]`` always
  get O = 0 and LSE = +inf.  ``leftpad_k`` (varlen forward) is refused when given: use
  ``flash_attn_with_kvcache``'s ``cache_leftpad``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .backward import fixed_backward_with_d, varlen_backward_with_d
from .dropout import _get_block_size_n
from .errors import raises_argument_error
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                        forward_with_rng_state, varlen_forward_with_rng_state, _refusal)
from .kvcache import flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
           "_get_block_size_n", "_flash_attn_forward", "_flash_attn_varlen_forward", "_flash_attn_backward",
           "_flash_attn_varlen_backward"]

FwdOutputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _s_dmask_or_empty(probs: Optional[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """S_dmask only when return_softmax asked for it (an O(seqlen_q x seqlen_k) tensor); flash_attn's empty
    tensor otherwise."""
    return probs if probs is not None else torch.empty((0,), dtype=q.dtype, device=q.device)


@raises_argument_error
def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> FwdOutputs:
    """flash_attn 2.8's ``_flash_attn_forward``: ``(out, softmax_lse, S_dmask, rng_state)`` of one attention
    forward, q ``(b, sq, h, d)``, k/v ``(b, sk, hk, d)``, LSE fp32 ``(b, h, sq)``; ``rng_state`` is what
    ``_flash_attn_backward`` needs to regenerate the dropout mask.  Semantics as ``flash_attn_func``."""
    out, lse, probs, rng_state = forward_with_rng_state(
        q, k, v, dropout_p, softmax_scale, causal, (window_size_left, window_size_right), softcap, alibi_slopes,
        False, bool(return_softmax), 0)
    return out, lse, _s_dmask_or_empty(probs, q), rng_state


@raises_argument_error
def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> FwdOutputs:
    """flash_attn 2.8's ``_flash_attn_varlen_forward``: ``(out, softmax_lse, S_dmask, rng_state)``, q
    ``(total_q, h, d)``, k/v ``(total_k, hk, d)`` (or pages with ``block_table``), LSE fp32 ``(h, total_q)``.
    Semantics as ``flash_attn_varlen_func``."""
    if leftpad_k is not None:
        raise _refusal("flash_ext._flash_attn_varlen_forward", [
            "leftpad_k: got a tensor; flash_ext's varlen forward has no left padding of the keys (must be None); "
            "flash_attn_with_kvcache takes it as cache_leftpad"])
    out, lse, probs, rng_state = varlen_forward_with_rng_state(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        (window_size_left, window_size_right), softcap, alibi_slopes, False, bool(return_softmax), block_table,
        seqused_k, 0)
    return out, lse, _s_dmask_or_empty(probs, q), rng_state


@raises_argument_error
def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """flash_attn 2.8's ``_flash_attn_backward``: writes the gradients into ``dq``/``dk``/``dv`` (allocated
    when None, then lost to the caller, as in flash_attn) and returns ``softmax_d`` = rowsum(dout * out),
    fp32 ``(b, h, sq)``.  ``out``/``softmax_lse`` are the forward's over every key the loss saw (merged ones
    under context parallelism: this block's dk/dv and its share of dq)."""
    _, softmax_d = fixed_backward_with_d(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_size_left, window_size_right), softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic, dropout_p=dropout_p, rng_state=rng_state)
    return softmax_d


@raises_argument_error
def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    """flash_attn 2.8's ``_flash_attn_varlen_backward``: as ``_flash_attn_backward`` for packed sequences;
    ``softmax_d`` fp32 ``(h, total_q)``."""
    _, softmax_d = varlen_backward_with_d(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dq, dk, dv,
        softmax_scale=softmax_scale, causal=causal, window_size=(window_size_left, window_size_right),
        softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic, dropout_p=dropout_p,
        rng_state=rng_state)
    return softmax_d


# flash_attn routes its public functions through these names (its torch.library custom ops); code written
# against it sometimes calls them directly.
_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_varlen_forward = _flash_attn_varlen_forward
_wrapped_flash_attn_backward = _flash_attn_backward
_wrapped_flash_attn_varlen_backward = _flash_attn_varlen_backward
