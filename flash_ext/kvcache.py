"""``flash_attn_with_kvcache`` (flash_attn 2.8 semantics): append new keys/values to a KV cache in place,
rotary embeddings at absolute positions, batch-indexed, left-padded or paged caches, and attention of q
against the cache through ``torch.ops.flash_ext.kvcache_fwd`` (split-KV for decode shapes)."""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from .interface import _op_reasons, _python_arg_errors, _refusal, maybe_contiguous, refuse_forward_ad
from .errors import raises_argument_error

__all__ = ["flash_attn_with_kvcache", "apply_rotary"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotates the first ``2 * cos.shape[1]`` channels of ``x`` (b, s, h, d) by the angles at ``positions``
    (b, s).  ``interleaved``: GPT-J pairs (0, 1), (2, 3), ...; else GPT-NeoX halves (i, i + rotary_dim / 2).
    Computed in fp32, returned in x's dtype."""
    rd = 2 * cos.shape[1]
    c = cos[positions].unsqueeze(2).float()   # (b, s, 1, rd / 2)
    s = sin[positions].unsqueeze(2).float()
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def _argument_errors(q: torch.Tensor, k_cache: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                     rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor],
                     cache_seqlens: Optional[Union[int, torch.Tensor]], window_size, softmax_scale) -> List[str]:
    """Every unmet requirement the Python layer can see from shapes and types alone (values are the ops'
    business, before they write or read anything), as 'argument: got ...; rule' lines."""
    errors = _python_arg_errors(0.0, window_size, softmax_scale)
    if q.dim() != 4 or k_cache.dim() != 4:
        errors.append(f"q/k_cache: got {tuple(q.shape)}/{tuple(k_cache.shape)}; must both be 4-D")
    if (k is None) != (v is None):
        errors.append(f"k/v: got {'k' if k is not None else 'v'} alone; must be given together (or neither)")
    elif k is not None and q.dim() == 4 and k_cache.dim() == 4:
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != k_cache.shape[2:]:
            errors.append(f"k/v: got {tuple(k.shape)}/{tuple(v.shape)}; must be (batch={q.shape[0]}, seqlen_new, "
                          f"nheads_k={k_cache.shape[2]}, d={k_cache.shape[3]})")
    if (rotary_cos is None) != (rotary_sin is None):
        errors.append("rotary_cos/rotary_sin: got one of them; must be given together (or neither)")
    elif rotary_cos is not None:
        if k is None:
            errors.append("rotary_cos/rotary_sin: given without new k/v; rotary embeddings apply to appended keys "
                          "(and q) only, so k and v must be given (as in flash_attn)")
        head_dim = q.shape[-1] if q.dim() >= 1 else 0
        if rotary_cos.device != q.device or rotary_sin.device != q.device:
            errors.append(f"rotary_cos/rotary_sin: got devices {rotary_cos.device}/{rotary_sin.device}; must be q's "
                          f"({q.device})")
        if not (rotary_cos.is_floating_point() and rotary_sin.is_floating_point()):
            errors.append(f"rotary_cos/rotary_sin: got dtypes {rotary_cos.dtype}/{rotary_sin.dtype}; must be floating "
                          "point")
        if not (rotary_cos.dim() == 2 and rotary_sin.shape == rotary_cos.shape and rotary_cos.shape[0] >= 1
                and 0 < 2 * rotary_cos.shape[1] <= head_dim):
            errors.append(f"rotary_cos/rotary_sin: got {tuple(rotary_cos.shape)}/{tuple(rotary_sin.shape)}; must "
                          f"both be (seqlen_ro >= 1, rotary_dim / 2) with 0 < rotary_dim <= head dim {head_dim}")
    if cache_seqlens is None:
        if k is not None:
            errors.append("cache_seqlens: got None with new k/v; appending needs the current cache lengths (an int "
                          "or an int32 tensor of shape (batch,))")
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not -2 ** 31 <= cache_seqlens < 2 ** 31:
            errors.append(f"cache_seqlens: got {cache_seqlens}; an int must fit int32 (and be within the cache)")
    else:
        b = q.shape[0] if q.dim() >= 1 else -1
        if not (isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32
                and cache_seqlens.dim() == 1 and cache_seqlens.shape[0] == b):
            got = (f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}" if isinstance(cache_seqlens, torch.Tensor)
                   else repr(cache_seqlens))
            errors.append(f"cache_seqlens: got {got}; must be an int or an int32 tensor of shape ({b},)")
    return errors


def _op_errors_beside(errors: List[str], q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                      block_table, causal, softcap, alibi_slopes, num_splits) -> List[str]:
    """What the op itself would also refuse (dtypes, devices, index values, ...) when the Python checks above
    already failed: the op in check-only mode, with neutral stand-ins for what failed here (no window, the
    default scale, no new k/v, no rotary) so that one error lists everything.  Nothing when q or the cache
    is not even 4-D (the op's rank errors would repeat the Python one)."""
    refused = lambda name: any(e.startswith(name + ":") for e in errors)  # noqa: E731
    if refused("q/k_cache") or not all(isinstance(t, torch.Tensor) for t in (q, k_cache, v_cache)):
        return []
    new_kv = None if refused("k/v") or k is None else (maybe_contiguous(k), maybe_contiguous(v))
    b, capacity = q.shape[0], k_cache.shape[1]
    if isinstance(cache_seqlens, torch.Tensor) and not refused("cache_seqlens"):
        seqlens = cache_seqlens
    else:  # an int (or a refused value: 0) as the tensor the op takes
        n = cache_seqlens if isinstance(cache_seqlens, int) and not refused("cache_seqlens") else (
            0 if new_kv is not None else capacity)
        seqlens = torch.full((b,), n, dtype=torch.int32, device=q.device)
    scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0
    args = (maybe_contiguous(q), k_cache, v_cache, *(new_kv if new_kv is not None else (None, None)), seqlens,
            cache_batch_idx, cache_leftpad, block_table, scale, bool(causal), -1, -1, float(softcap), alibi_slopes,
            int(num_splits), -1, 0)
    if new_kv is not None and _inference_cache_outside_inference_mode(k_cache, v_cache):
        with torch.inference_mode():  # as the call itself would run (below): no false inference-tensor reason
            return _op_reasons(torch.ops.flash_ext.kvcache_fwd, *args)
    return _op_reasons(torch.ops.flash_ext.kvcache_fwd, *args)


def _inference_cache_outside_inference_mode(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether an append would update an inference tensor (created under ``torch.inference_mode()``) outside
    inference mode.  Never under ``torch.compile``: its graphs trace normal tensors."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return False
    return k_cache.is_inference() or v_cache.is_inference()


class _ForwardOnly(torch.autograd.Function):
    """Identity on the outputs whose backward is an error: flash_attn_with_kvcache has no backward (as in
    flash_attn), and without this autograd's fallback for the op would warn and drop the gradient."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, lse: torch.Tensor, *inputs: torch.Tensor):
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("flash_ext.flash_attn_with_kvcache is forward-only (as in flash_attn): no gradient flows "
                           "through it; train with flash_attn_func / flash_attn_varlen_func")


@raises_argument_error
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Attention of ``q`` (b, seqlen_q, nheads, d) against a KV cache, flash_attn 2.8 semantics.

    * ``k_cache``/``v_cache``: (batch_cache, seqlen_cache, nheads_k, d), or with ``block_table`` (int32,
      (b, max_pages)) a paged cache (num_pages, page_size, nheads_k, d) with page_size a multiple of 128.
    * ``cache_seqlens`` (int or int32 (b,)): current cache lengths (absolute row index of the first free
      slot); default (only without new k/v): the whole cache.  ``cache_batch_idx`` (int32 (b,)): cache batch of each q batch entry.
      Repeated values with new k/v are allowed, as in flash_attn (whose rows then "might come from any of the
      duplicate indices"): where two entries write one cache row the later batch entry's row is stored, and
      every entry attends to its cache entry after all appends (unspecified order with trusted values).
      ``cache_leftpad`` (int32 (b,)): the cache of entry i starts at row ``cache_leftpad[i]``.
    * ``k``/``v`` (b, seqlen_new, nheads_k, d): appended **in place** at rows ``cache_seqlens[i] ...`` before
      attention.  With ``rotary_cos``/``rotary_sin`` ((seqlen_ro, rotary_dim / 2)), k is rotated at those
      absolute positions, and q at ``cache_seqlens[i] + j`` when causal or local (a window side below the
      cache capacity), else at ``cache_seqlens[i]`` for every query row (``rotary_interleaved``: GPT-J
      style, else GPT-NeoX).  Rotary tables without new k/v are an error, as in flash_attn.
    * Keys visible to entry i: rows ``[cache_leftpad[i], cache_seqlens[i] + seqlen_new)``; causal/local
      masks are bottom-right aligned to them.  Other arguments as in ``flash_attn_func``.

    Every argument, index values included (cache lengths, batch indices, left padding, pages, rotary
    coverage), is validated before anything is written: a refused call leaves the cache bit-identical, and a
    bad index is a ``flash_ext.ArgumentError`` (a ValueError and a RuntimeError), never an out-of-bounds
    access.  On CUDA the index values cost one device-to-host copy per call; they are trusted (not copied)
    while the current stream is capturing a CUDA graph, or with ``FLASH_EXT_TRUST_CU_SEQLENS=1`` (then
    invalid values are undefined behaviour, as in flash_attn).  The cache is plain storage: appending k/v that require grad records no autograd history
    into it, and the function is forward-only (as in flash_attn).  The whole function is one op
    (``torch.ops.flash_ext.kvcache_fwd``, mutation declared), so a decode step compiles into one graph under
    ``torch.compile``.  Returns ``out``, or ``(out, softmax_lse (b, nheads, seqlen_q))``.
    """
    refuse_forward_ad("flash_ext.flash_attn_with_kvcache", (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                                           alibi_slopes))
    errors = _argument_errors(q, k_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, window_size, softmax_scale)
    if errors:
        errors += _op_errors_beside(errors, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                                    block_table, causal, softcap, alibi_slopes, num_splits)
        raise _refusal("flash_ext.flash_attn_with_kvcache", errors)
    # As flash_attn: q and the new k/v may have a strided last dimension (the caches may not: they are written).
    q, k, v = maybe_contiguous(q), maybe_contiguous(k), maybe_contiguous(v)
    b, sq = q.shape[0], q.shape[1]
    dev = q.device
    paged = block_table is not None
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged and block_table.dim() == 2 else k_cache.shape[1]
    if cache_seqlens is None:
        seqlens = torch.full((b,), capacity, dtype=torch.int32, device=dev)
    elif isinstance(cache_seqlens, int):
        seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=dev)
    else:
        seqlens = cache_seqlens
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0

    rotary_len, rotary_rows = -1, 0
    if k is not None:
        # The rotary gathers run on clamped positions before the op validates them: if a position was out of
        # range the op raises (writing nothing) and these rotated values are never used.
        seqlen_new = k.shape[1]
        # flash_attn rotates every q row at its own position when the kernel is causal or local, deciding that
        # after a window side of at least the cache capacity became unbounded (as any negative side is).
        bounded = [0 <= w < capacity for w in window_size]
        local = causal or bounded[0] or bounded[1]
        if rotary_cos is not None:
            rotary_len = rotary_cos.shape[0]
            rotary_rows = max(seqlen_new, sq if local else 1)
            pos = seqlens.long()[:, None] + torch.arange(seqlen_new, device=dev)[None, :]   # (b, seqlen_new)
            k = apply_rotary(k, rotary_cos, rotary_sin, pos.clamp(0, rotary_len - 1), rotary_interleaved)
            qpos = seqlens.long()[:, None] + (torch.arange(sq, device=dev)[None, :] if local else 0)
            q = apply_rotary(q, rotary_cos, rotary_sin, qpos.expand(b, sq).clamp(0, rotary_len - 1),
                             rotary_interleaved)
        # The cache is plain storage (no autograd history); a dtype other than the cache's is the op's error.
        k, v = k.detach(), v.detach()

    args = (q, k_cache, v_cache, k, v, seqlens, cache_batch_idx, cache_leftpad, block_table, float(softmax_scale),
            bool(causal), int(window_size[0]), int(window_size[1]), float(softcap), alibi_slopes, int(num_splits),
            rotary_len, rotary_rows)
    if k is not None and _inference_cache_outside_inference_mode(k_cache, v_cache):
        # torch refuses an in-place update of an inference tensor outside inference mode, and it does so after
        # the op has run (the version-counter bump): the cache would be appended to by a call that raises.
        # flash_attn (a plain extension call) appends; so does this, in inference mode, with outputs returned
        # as normal tensors as flash_attn's are.
        with torch.inference_mode():
            out, lse = torch.ops.flash_ext.kvcache_fwd(*args)
        out, lse = out.clone(), lse.clone()
    else:
        out, lse = torch.ops.flash_ext.kvcache_fwd(*args)
    differentiable = [t for t in (q, k_cache, v_cache, alibi_slopes) if t is not None and t.requires_grad]
    if differentiable and torch.is_grad_enabled():
        out, lse = _ForwardOnly.apply(out.detach(), lse.detach(), *differentiable)
    return (out, lse) if return_softmax_lse else out
