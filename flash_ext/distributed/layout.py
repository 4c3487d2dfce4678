"""Where each rank's shard sits in the global sequence, and which local attention calls one ring step makes.

Everything here is integer arithmetic on positions; no tensor is touched, so the rules can be checked
exhaustively against a brute-force mask (tests/test_ring_layout.py).

Global problem.  The ring computes ``flash_attn_func`` on the full sequences: ``seqlen_q = W * s_q`` query rows
and ``seqlen_k = W * s_k`` keys (``W`` ranks, local shards of ``s_q`` / ``s_k`` rows).  flash_ext's masks are
aligned to the bottom-right corner, so with ``shift = seqlen_k - seqlen_q`` query ``i`` sees key ``j`` iff

    shift - left <= j - i <= shift + right        (``causal`` makes right = 0; -1 leaves a side unbounded)

i.e. ``j - i`` lies in a *band* ``[lo, hi]`` (``-inf`` / ``+inf`` for an unbounded side).

Shards.  A rank's shard is a list of *pieces*: contiguous runs of global positions stored one after the other
in the local tensor.  The contiguous layout (ring-flash-attention's ``ring_flash_attn_func``) gives rank ``r``
one piece, positions ``[r * s, (r + 1) * s)``.  The zigzag layout (``zigzag_ring_flash_attn_func``) cuts the
sequence into ``2W`` chunks of ``s / 2`` and gives rank ``r`` chunks ``r`` and ``2W - 1 - r``, so that under a
causal mask every rank has the same amount of work.

One step.  The query shard of rank ``r`` meets the K/V shard of rank ``src``.  For every (query piece, key
piece) pair the band decides between three cases:

* skip: no query of the piece sees any key of the piece (not computed at all);
* full: every query sees every key (a call without a mask);
* partial: the rows and columns that see something form a sub-rectangle; trimmed to it, the band becomes a
  mask the kernel expresses *with its own bottom-right alignment*: a causal or local-window call whose
  ``window_size`` is re-based on the trimmed rectangle's corner (see ``_pair_block``).

Pairs are then coalesced into as few calls as the layout allows (``plan_step``): one call per step for the
contiguous layout, and for the zigzag layout under a causal mask one causal call on the rank's own shard and
one unmasked call per other step, as ring-flash-attention does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = ["Piece", "Block", "Band", "band_of", "shard_pieces", "plan_step"]

INF = math.inf


@dataclass(frozen=True)
class Piece:
    """``length`` consecutive global positions starting at ``start``, stored at local row ``local`` onwards."""
    start: int
    length: int
    local: int


@dataclass(frozen=True)
class Band:
    """Key ``j`` is visible to query ``i`` iff ``lo <= j - i <= hi`` (``lo`` may be -inf, ``hi`` +inf)."""
    lo: float
    hi: float


@dataclass(frozen=True)
class Block:
    """One local attention call: rows ``q_rows`` of the local query shard against rows ``k_rows`` of the
    visiting K/V shard, with the kernel's own (bottom-right aligned) ``causal`` and ``window`` arguments.
    Query rows outside ``q_rows`` see no key of this call's K/V rows."""
    q_rows: Tuple[int, int]  # [begin, end) of the local query rows
    k_rows: Tuple[int, int]  # [begin, end) of the visiting shard's rows
    causal: bool
    window: Tuple[int, int]  # (left, right), -1 = unbounded, relative to this call's bottom-right corner

    @property
    def full(self) -> bool:
        return not self.causal and self.window == (-1, -1)


def band_of(seqlen_q: int, seqlen_k: int, causal: bool, window_size: Tuple[int, int]) -> Band:
    """The band of ``flash_attn_func``'s mask on the global problem (see the module docstring)."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    shift = seqlen_k - seqlen_q
    return Band(lo=shift - left if left >= 0 else -INF, hi=shift + right if right >= 0 else INF)


def shard_pieces(group_rank: int, world_size: int, seqlen_local: int, zigzag: bool) -> List[Piece]:
    """The pieces of ``group_rank``'s shard of ``seqlen_local`` rows (zigzag needs ``seqlen_local`` even)."""
    if not zigzag:
        return [Piece(group_rank * seqlen_local, seqlen_local, 0)]
    c = seqlen_local // 2
    return [Piece(group_rank * c, c, 0), Piece((2 * world_size - 1 - group_rank) * c, c, c)]


def _pair_block(qp: Piece, kp: Piece, band: Band) -> Optional[Block]:
    """The call for one (query piece, key piece) pair, or None when no query of ``qp`` sees a key of ``kp``.

    In the pair's local coordinates (``i'`` from 0 to ``m``, ``j'`` from 0 to ``n``) the band reads
    ``lo <= j' - i' <= hi`` with ``lo = band.lo - D``, ``hi = band.hi - D``, ``D = kp.start - qp.start``.
    Row ``i'`` sees something iff ``-hi <= i' <= n - 1 - lo``; column ``j'`` iff ``lo <= j' <= m - 1 + hi``.
    Trimming to those rows ``[r0, r1)`` and columns ``[c0, c1)`` moves the origin by ``c0 - r0`` along the
    diagonal.  The kernel's window on an ``m2 x n2`` call keeps ``n2 - m2 - left <= j'' - i'' <= n2 - m2 +
    right``, so ``left = n2 - m2 - lo2`` and ``right = hi2 - (n2 - m2)``; both are >= 0 because the last
    trimmed row and the last trimmed column see something.  A side whose bound no element of the rectangle
    reaches becomes -1 (unbounded)."""
    m, n = qp.length, kp.length
    if m == 0 or n == 0:
        return None
    d = kp.start - qp.start
    lo, hi = band.lo - d, band.hi - d
    r0 = 0 if hi == INF else max(0, -int(hi))
    r1 = m if lo == -INF else min(m, n - int(lo))
    if r0 >= r1:
        return None
    c0 = 0 if lo == -INF else max(0, int(lo))
    c1 = n if hi == INF else min(n, m + int(hi))
    m2, n2, shift = r1 - r0, c1 - c0, c0 - r0
    lo2, hi2 = lo - shift, hi - shift
    left = -1 if lo2 <= -(m2 - 1) else int(n2 - m2 - lo2)
    right = -1 if hi2 >= n2 - 1 else int(hi2 - (n2 - m2))
    assert left >= -1 and right >= -1 and c0 < c1, (qp, kp, band)
    causal = left == -1 and right == 0
    window = (-1, -1) if causal else (left, right)
    return Block((qp.local + r0, qp.local + r1), (kp.local + c0, kp.local + c1), causal, window)


def _span(pieces: Sequence[Piece]) -> Tuple[int, int]:
    """Local rows covered by consecutive pieces (callers pass pieces that are adjacent in the local tensor)."""
    return pieces[0].local, pieces[-1].local + pieces[-1].length


def plan_step(q_pieces: Sequence[Piece], k_pieces: Sequence[Piece], band: Band) -> List[Block]:
    """The calls of one ring step: the query shard ``q_pieces`` against the visiting K/V shard ``k_pieces``.

    The calls cover every visible (query, key) pair exactly once.  Coalescing rules (both exact):

    1. Same pieces on both sides (a rank's own shard; equal shard lengths, so ``shift = 0``) under a plain
       causal band (``lo = -inf``, ``hi = 0``): the pieces are stored in increasing position order, so local
       order is global order and one causal call on the whole shard is the global mask.  (Zigzag step 0.)
    2. A query piece whose every non-skipped pair is full attends to all those key pieces in one unmasked call
       when they are adjacent in the local tensor; query pieces with the same such call share it.
    """
    if list(q_pieces) == list(k_pieces) and band.lo == -INF and band.hi == 0 and q_pieces:
        rows = _span(q_pieces)
        return [Block(rows, rows, True, (-1, -1))]
    per_q: List[Tuple[Piece, List[Tuple[Piece, Block]]]] = []
    for qp in q_pieces:
        pairs = [(kp, b) for kp in k_pieces for b in [_pair_block(qp, kp, band)] if b is not None]
        per_q.append((qp, pairs))
    blocks: List[Block] = []
    for qp, pairs in per_q:
        kps = [kp for kp, _ in pairs]
        adjacent = all(a.local + a.length == b.local for a, b in zip(kps, kps[1:]))
        whole = all(b.full and b.q_rows == (qp.local, qp.local + qp.length) and b.k_rows == (kp.local, kp.local + kp.length)
                    for kp, b in pairs)
        if pairs and whole and adjacent:
            blk = Block((qp.local, qp.local + qp.length), _span(kps), False, (-1, -1))
            prev = blocks[-1] if blocks else None
            if prev is not None and prev.full and prev.k_rows == blk.k_rows and prev.q_rows[1] == blk.q_rows[0]:
                blocks[-1] = Block((prev.q_rows[0], blk.q_rows[1]), blk.k_rows, False, (-1, -1))
            else:
                blocks.append(blk)
        else:
            blocks.extend(b for _, b in pairs)
    return blocks
