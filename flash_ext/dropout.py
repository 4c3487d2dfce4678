"""Dropout helpers of the Python API: the keep mask as a tensor, and ``S_dmask`` for ``return_attn_probs``.

The mask itself is defined once, in ``csrc/flash_ext/dropout.h`` (see docs/design.md, "Dropout"): a pure
function of the op's ``rng_state = (seed, offset)``, ``dropout_p`` and the element's (batch, query head,
query row, key column).  ``dropout_mask`` evaluates that function element by element
(``torch.ops.flash_ext.dropout_mask``: a CPU loop or a small CUDA kernel).

``S_dmask`` is a debugging/testing aid, computed by a separate O(seqlen_q x seqlen_k) path after the
forward kernel, scaled as flash_attn's CUDA kernel leaves it ("the output of softmax, possibly with different
scaling"): in key blocks of ``_get_block_size_n`` columns, ``exp(s - m_j)`` with ``m_j`` the row's maximum
over block j and every block right of it (that kernel walks the key blocks right to left and writes each
with the running maximum it has then), negated where the mask drops it (a dropped 0 becomes -0.0, so
``torch.signbit`` recovers the mask everywhere and ``S_dmask >= 0`` wherever the value is positive).
flash_attn's own tests turn it back into probabilities with the same block width (``normalize_flash_attn_S``
multiplies block j by ``exp(m_j - lse)``); before 2026-12-07 flash_ext returned the probabilities themselves,
which that step shrank.  It needs about
``3 * 4 * batch * nheads * seqlen_q * seqlen_k`` bytes of temporary memory, freed on return: it is computed
without autograd and requires no grad (flash_attn's S_dmask gets no gradient either: its backward ignores it).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["dropout_mask"]


def dropout_mask(rng_state: torch.Tensor, dropout_p: float, batch: int, nheads: int, seqlen_q: int,
                 seqlen_k: int) -> torch.Tensor:
    """The dropout keep mask, bool ``(batch, nheads, seqlen_q, seqlen_k)`` on ``rng_state``'s device.

    ``rng_state`` is the int64 ``(seed, offset)`` pair a forward op returned.  Element ``[b, h, i, j]`` is
    True when query row ``i`` of head ``h`` keeps key ``j`` in batch entry ``b``; for varlen batches ``b``
    is the sequence index and ``i``, ``j`` count from the start of the sequence.
    """
    from .interface import size_arg  # interface imports this module

    return torch.ops.flash_ext.dropout_mask(rng_state, float(dropout_p), size_arg(batch), size_arg(nheads),
                                            size_arg(seqlen_q), size_arg(seqlen_k))


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-block width of ``S_dmask``'s scaling (module docstring): flash_attn 2.8's rule of the same name,
    the column tile of its CUDA forward kernels by head dim and compute capability; devices other than CUDA
    use the sm_80 row.  Exported by ``flash_ext.flash_attn_interface`` as flash_attn's tests import it."""
    if head_dim > 256:
        raise ValueError(f"head_dim: got {head_dim}; must be <= 256")
    device = torch.device(device)
    sm8x = False  # sm_86 / sm_89, not sm_80
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        sm8x = major == 8 and minor > 0
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        if sm8x:
            return 64 if not is_dropout and is_causal else 32
        return 32 if is_dropout else 64
    return 64


def _probs(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, softmax_scale: float, causal: bool,
           window_size: Tuple[int, int], softcap: float, slopes: Optional[torch.Tensor]) -> torch.Tensor:
    """``S_dmask``'s values (h, sq, sk) fp32 of one sequence before the mask's signs (module docstring):
    q (sq, h, d), k (sk, hk, d), lse (h, sq) (rows without keys: +inf); slopes (h,) or None."""
    sq, h, _ = q.shape
    sk, hk = k.shape[0], k.shape[1]
    qf = q.float().transpose(0, 1)                                            # (h, sq, d)
    kf = k.float().repeat_interleave(h // hk, dim=1).transpose(0, 1)           # (h, sk, d)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * softmax_scale                 # (h, sq, sk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    row = torch.arange(sq, device=q.device).view(-1, 1)
    col = torch.arange(sk, device=q.device).view(1, -1)
    diag = row + (sk - sq)
    if slopes is not None:
        s = s - slopes.float().view(h, 1, 1) * (diag - col).abs()
    left, right = window_size
    if causal:
        right = 0
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= col <= diag + right
    if left >= 0:
        visible &= col >= diag - left
    s = s.masked_fill(~visible, float("-inf"))
    if sk == 0 or sq == 0:
        return torch.zeros_like(s)
    # m_j: the maximum over block j and the blocks right of it (a reversed running maximum of block maxima).
    block = _get_block_size_n(q.device, q.shape[-1], True, causal)
    blocks = (sk + block - 1) // block
    padded = torch.nn.functional.pad(s, (0, blocks * block - sk), value=float("-inf"))
    block_max = padded.view(h, sq, blocks, block).amax(-1)
    m = torch.cummax(block_max.flip(-1), dim=-1).values.flip(-1).repeat_interleave(block, dim=-1)[..., :sk]
    p = torch.exp(s - m)
    empty = (m == float("-inf")) | (lse.float().unsqueeze(-1) == float("inf"))  # no key here or in the row
    return torch.where(visible & ~empty, p, torch.zeros_like(p))


@torch.no_grad()  # a diagnostic, not a differentiable output: flash_attn's backward drops its gradient too
def s_dmask(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, rng_state: torch.Tensor, dropout_p: float,
            softmax_scale: float, causal: bool, window_size: Tuple[int, int], softcap: float,
            alibi_slopes: Optional[torch.Tensor]) -> torch.Tensor:
    """``S_dmask`` (batch, nheads, seqlen_q, seqlen_k) in q's dtype for fixed-length q (b, sq, h, d)."""
    b, sq, h, _ = q.shape
    keep = dropout_mask(rng_state, dropout_p, b, h, sq, k.shape[1])
    out = []
    for i in range(b):
        slopes = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i])
        out.append(_probs(q[i], k[i], lse[i], softmax_scale, causal, window_size, softcap, slopes))
    p = torch.stack(out)
    return torch.where(keep, p, -p).to(q.dtype)


@torch.no_grad()
def s_dmask_varlen(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, rng_state: torch.Tensor, dropout_p: float,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                   softmax_scale: float, causal: bool, window_size: Tuple[int, int], softcap: float,
                   alibi_slopes: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor] = None,
                   block_table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``S_dmask`` (batch, nheads, max_seqlen_q, max_seqlen_k) for varlen q (total_q, h, d), lse (h, total_q);
    zero outside each sequence's (seqlen_q, seqlen_k) block."""
    b = cu_seqlens_q.numel() - 1
    h = q.shape[1]
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    keep = dropout_mask(rng_state, dropout_p, b, h, max_seqlen_q, max_seqlen_k)
    p = torch.zeros(b, h, max_seqlen_q, max_seqlen_k, dtype=torch.float32, device=q.device)
    for i in range(b):
        sq = cu_q[i + 1] - cu_q[i]
        sk = cu_k[i + 1] - cu_k[i] if used is None else used[i]
        if block_table is None:
            ki = k[cu_k[i]:cu_k[i] + sk]
        else:  # paged K/V: the sequence's keys are the first sk rows of its pages
            page = k.shape[1]
            ki = k[block_table[i, :(sk + page - 1) // page].long()].reshape(-1, *k.shape[2:])[:sk]
        slopes = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i])
        p[i, :, :sq, :sk] = _probs(q[cu_q[i]:cu_q[i + 1]], ki, lse[:, cu_q[i]:cu_q[i + 1]], softmax_scale, causal,
                                   window_size, softcap, slopes)
    return torch.where(keep, p, -p).to(q.dtype)
