"""Plain PyTorch reference for ``flash_ext.flash_attn_func``: the forward, and its gradients by autograd.

This module materialises the full ``(seqlen_q, seqlen_k)`` score matrix and applies every feature of the
fused kernel in the most direct way, so that it can serve as the ground truth in tests.  It is not meant
to be fast.

Semantics (flash_attn 2.8), with ``i`` the query row, ``j`` the key column and
``shift = seqlen_k - seqlen_q`` (masks are aligned to the bottom-right corner):

1. ``s_ij = softmax_scale * (q_i . k_j)``; ``softmax_scale`` defaults to ``1 / sqrt(head_dim)``.
2. ``softcap > 0``: ``s_ij = softcap * tanh(s_ij / softcap)``.
3. ALiBi: ``s_ij -= slope_h * |i + shift - j|`` (slopes of shape ``(nheads,)`` or ``(batch, nheads)``).
4. Visibility: with ``window_size = (left, right)`` (``causal`` forces ``right = 0``), key ``j`` is visible
   to row ``i`` iff ``i + shift - left <= j <= i + shift + right``; a side set to ``-1`` is unbounded.
   Invisible scores become ``-inf``.
5. ``out_i = softmax(s_i) @ v`` and ``lse_i = logsumexp(s_i)``.  A row that sees no key at all gets
   ``out_i = 0`` and ``lse_i = +inf`` (never NaN).
6. Dropout (given a keep mask and ``dropout_p``): ``out_i = (softmax(s_i) * keep_i) @ v / (1 - dropout_p)``;
   ``lse_i`` is unchanged (that of the undropped scores).

Grouped-query attention (``nheads_k < nheads``) is handled by repeating every K/V head
``nheads // nheads_k`` times, so query head ``h`` uses K/V head ``h // (nheads // nheads_k)``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from einops import rearrange, repeat

__all__ = ["attention_ref", "attention_grad_ref", "visibility_mask", "rotary_ref"]


def visibility_mask(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Boolean ``(seqlen_q, seqlen_k)`` tensor, True where query row ``i`` may attend to key ``j``.

    Implements step 4 of the module docstring literally (bottom-right aligned; ``causal`` sets the right
    bound to 0 and keeps the left bound of ``window_size``; ``-1`` leaves a side unbounded).
    """
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    row = torch.arange(seqlen_q, device=device).view(-1, 1)
    col = torch.arange(seqlen_k, device=device).view(1, -1)
    diag = row + (seqlen_k - seqlen_q)  # the key column aligned with query row i
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= col <= diag + right
    if left >= 0:
        visible &= col >= diag - left
    return visible


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention_ref: q, k, v must be 4-D, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"attention_ref: k.shape {tuple(k.shape)} != v.shape {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention_ref: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    h, hk = q.shape[2], k.shape[2]
    if hk == 0 or h % hk != 0:
        raise ValueError(f"attention_ref: nheads {h} is not a multiple of nheads_k {hk}")


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    upcast: bool = True,
    dropout_p: float = 0.0,
    dropout_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference attention forward pass; returns ``(out, lse)``.

    Args:
        q: ``(batch, seqlen_q, nheads, head_dim)``.
        k, v: ``(batch, seqlen_k, nheads_k, head_dim)`` with ``nheads % nheads_k == 0``.
        softmax_scale: multiplier of ``q . k``; ``None`` means ``1 / sqrt(head_dim)`` of the given
            (unpadded) head dim.
        causal, window_size, softcap, alibi_slopes: as in ``flash_ext.flash_attn_func`` (see the module
            docstring for the exact formulas).
        dropout_p, dropout_mask: bool ``(batch, nheads, seqlen_q, seqlen_k)``, True where a probability is
            kept (step 6); ``None``: no dropout.  The kept probabilities are scaled by ``1 / (1 - dropout_p)``
            in the softmax's dtype before ``P @ v``.
        upcast: selects the arithmetic.

            * ``True``: q, k, v (and the slopes) are converted to float64 and every step runs in float64.
              Returns ``out`` and ``lse`` as float64.  This is the "exact" answer used as ground truth.
            * ``False``: emulates what a framework does when it computes attention in the input dtype
              ("same-dtype" reference, used to size the tolerance):

              - ``q @ k^T`` is one matmul in the input dtype (PyTorch accumulates internally in fp32 for
                fp16/bf16 and rounds the result to the input dtype);
              - the rounded scores are converted to float32; scale, softcap, ALiBi, masking, the softmax
                and the log-sum-exp are computed in float32;
              - the probabilities are rounded to the input dtype and ``P @ v`` is one matmul in the input
                dtype.

              Returns ``out`` in the input dtype and ``lse`` in float32.

    A query row with no visible key yields ``out = 0`` and ``lse = +inf``; the result never contains NaN
    unless the inputs do, and then only where exact attention has it: a NaN score makes its row's ``out``
    and ``lse`` NaN, a NaN or infinite value in ``v`` reaches the rows that weigh its key (not rows that
    mask or drop it, as ``P @ V`` would with ``0 * NaN``).
    """
    _check_shapes(q, k, v)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0

    in_dtype = q.dtype
    io_dtype = torch.float64 if upcast else in_dtype  # dtype of the two matmuls and of `out`
    acc_dtype = torch.float64 if upcast else torch.float32  # dtype of the softmax and of `lse`

    # (batch, nheads, seqlen, head_dim); for GQA/MQA query head hk * group + g reads K/V head hk.
    group = nheads // nheads_k
    qh = rearrange(q.to(io_dtype), "b s h d -> b h s d")
    kh = repeat(k.to(io_dtype), "b s hk d -> b (hk g) s d", g=group)
    vh = repeat(v.to(io_dtype), "b s hk d -> b (hk g) s d", g=group)

    scores = torch.matmul(qh, kh.transpose(-1, -2)).to(acc_dtype) * softmax_scale  # (b, h, sq, sk)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)

    row = torch.arange(seqlen_q, device=q.device).view(-1, 1)
    col = torch.arange(seqlen_k, device=q.device).view(1, -1)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=acc_dtype)
        slopes = slopes.expand(batch, nheads) if slopes.dim() == 1 else slopes
        distance = (row + (seqlen_k - seqlen_q) - col).abs().to(acc_dtype)  # (sq, sk)
        scores = scores - slopes.view(batch, nheads, 1, 1) * distance

    visible = visibility_mask(seqlen_q, seqlen_k, causal, window_size, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))

    # Softmax by hand so that empty rows give 0 instead of NaN.  A row is empty by the mask (or when every
    # score it sees is -inf); a NaN score makes its row NaN, never empty (`row_max > -inf` was False for it).
    row_max = scores.amax(dim=-1, keepdim=True) if seqlen_k > 0 else scores.new_full(
        (batch, nheads, seqlen_q, 1), float("-inf"))
    any_visible = visible.any(dim=-1, keepdim=True) & (row_max != float("-inf"))
    safe_max = torch.where(any_visible, row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - safe_max)  # exp(-inf) = 0 for masked entries
    denom = probs.sum(dim=-1, keepdim=True)
    probs = torch.where(any_visible, probs / torch.where(any_visible, denom, torch.ones_like(denom)),
                        torch.zeros_like(probs))
    lse = torch.where(any_visible, safe_max + torch.log(torch.where(any_visible, denom, torch.ones_like(denom))),
                      torch.full_like(denom, float("inf"))).squeeze(-1)  # (b, h, sq)

    contributes = visible & any_visible  # (b, h, sq, sk): the keys each row's output sums over
    if dropout_mask is not None:
        mask = dropout_mask.to(q.device)
        probs = torch.where(mask, probs / (1.0 - dropout_p), torch.zeros_like(probs))
        contributes = contributes & mask
    out = torch.matmul(probs.to(io_dtype), torch.where(vh.isfinite(), vh, 0))
    if not bool(vh.isfinite().all()):
        # Non-finite values only where a row's output sums them: P @ V would spread them through 0 * inf = NaN
        # to every row, masked or dropped keys included.  Counted exactly, as 0/1 matmuls.
        weight = contributes.to(io_dtype)
        count = lambda which: torch.matmul(weight, which.to(io_dtype)) > 0  # noqa: E731
        pos, neg, nan = count(vh == float("inf")), count(vh == float("-inf")), count(vh.isnan())
        out = torch.where(nan | (pos & neg), float("nan"),
                          torch.where(pos, float("inf"), torch.where(neg, float("-inf"), out)))
    out = rearrange(out, "b h s d -> b s h d").contiguous()
    return out, lse.contiguous()


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """Rotary embedding, written independently of ``flash_ext.kvcache.apply_rotary`` for the tests.

    ``x`` (b, s, h, d); ``cos``/``sin`` (seqlen_ro, rotary_dim / 2) hold cos/sin of the angle of pair ``i`` at
    each position; ``positions`` (b, s) selects the row.  The first ``rotary_dim`` channels are rotated pair by
    pair, the rest pass through:

    * ``interleaved`` (GPT-J): pair ``i`` is channels ``(2i, 2i+1)``, read as the complex number
      ``x[2i] + 1j * x[2i+1]`` and multiplied by ``cos + 1j * sin``;
    * otherwise (GPT-NeoX): pair ``i`` is channels ``(i, i + rotary_dim / 2)``, multiplied by the rotation
      matrix ``[[cos, -sin], [sin, cos]]``.

    Computed in float64, returned rounded to ``x``'s dtype.
    """
    half = cos.shape[1]
    rd = 2 * half
    c = cos.double()[positions][:, :, None, :]  # (b, s, 1, rd / 2)
    s = sin.double()[positions][:, :, None, :]
    xr = x[..., :rd].double()
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], half, 2).contiguous())
        rotated = torch.view_as_real(z * torch.complex(c, s)).reshape(xr.shape)
    else:
        pair = torch.stack((xr[..., :half], xr[..., half:]), dim=-1)           # (..., rd / 2, 2)
        rot = torch.stack((torch.stack((c, -s), dim=-1), torch.stack((s, c), dim=-1)), dim=-2)  # (..., rd/2, 2, 2)
        out = (rot @ pair[..., None])[..., 0]                                  # (..., rd / 2, 2)
        rotated = torch.cat((out[..., 0], out[..., 1]), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rd:]), dim=-1)


def attention_grad_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    upcast: bool = True,
    dlse: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    dropout_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of ``attention_ref``'s ``out`` for the upstream gradient ``dout`` (and of its
    ``lse`` for ``dlse``, ``(batch, nheads, seqlen_q)``, when given), by autograd through ``attention_ref``
    (every step of it is differentiable PyTorch; no formula is restated here).

    ``upcast=True``: everything in float64, the exact gradient (returned as float64).  ``upcast=False``: the
    autograd of the same-dtype reference, i.e. what a framework gets when it trains attention in the input
    dtype: the backward matmuls of ``q @ k^T`` and ``P @ v`` run in the input dtype (so dS and P are rounded to
    it), the softmax backward in float32.  Returned in the input dtype.  Masked scores and rows that see no key
    contribute exactly zero.  ``dout`` has ``out``'s shape; GQA/MQA gradients of k/v are summed over the query
    heads of each group (autograd of the head repetition).  ``dropout_p``/``dropout_mask``: as in
    ``attention_ref`` (the mask is a given constant, e.g. from the ``dropout_mask`` op).
    """
    dtype = torch.float64 if upcast else q.dtype
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    slopes = None if alibi_slopes is None else alibi_slopes.detach()
    out, lse = attention_ref(*leaves, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                             softcap=softcap, alibi_slopes=slopes, upcast=upcast, dropout_p=dropout_p,
                             dropout_mask=dropout_mask)
    outputs, grads = [out], [dout.detach().to(out.dtype)]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse.detach().to(lse.dtype))
    dq, dk, dv = torch.autograd.grad(outputs, leaves, grads)
    return dq, dk, dv
