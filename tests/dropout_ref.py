"""An independent numpy implementation of flash_ext's dropout mask, written from its specification in
docs/design.md ("Dropout: the mask") and csrc/flash_ext/dropout.h, not from the C++ code.

Philox4x32-10 (Salmon et al., SC 2011) with the published constants; the counter and key of element
(b, h, i, j) and the 16-bit threshold as specified.  Everything is evaluated per element (one Philox
evaluation per element, vectorised over numpy arrays), so the kernels' grouping (one evaluation per 8
elements) is checked rather than reused.
"""
from __future__ import annotations

import math

import numpy as np

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on broadcastable arrays of 32-bit values (held in uint64); returns four uint64 arrays."""
    c = [np.asarray(x, dtype=np.uint64) & _MASK32 for x in (c0, c1, c2, c3)]
    k = [np.asarray(x, dtype=np.uint64) & _MASK32 for x in (k0, k1)]
    for rnd in range(10):
        if rnd:
            k = [(k[0] + np.uint64(_W0)) & _MASK32, (k[1] + np.uint64(_W1)) & _MASK32]
        p0 = np.uint64(_M0) * c[0]  # < 2^64: exact in uint64
        p1 = np.uint64(_M1) * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
    return c


def keep_threshold(p: float) -> int:
    """t = floor((1 - p) * 65536 + 0.5) in double precision: an element is kept iff its 16 bits are < t."""
    return int(math.floor((1.0 - p) * 65536.0 + 0.5))


def dropout_keep_mask(seed: int, offset: int, p: float, batch: int, nheads: int, seqlen_q: int,
                      seqlen_k: int) -> np.ndarray:
    """Boolean (batch, nheads, seqlen_q, seqlen_k): True where element (b, h, i, j) is kept.

    ``seed`` and ``offset`` are the op's ``rng_state`` (int64 values, used as their 64-bit two's complement
    patterns).  For varlen batches, b is the sequence index and (i, j) are positions within the sequence,
    so the mask of sequence b is ``dropout_keep_mask(...)[b, :, :seqlen_q_b, :seqlen_k_b]``.
    """
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    b = np.arange(batch, dtype=np.uint64).reshape(-1, 1, 1, 1)
    h = np.arange(nheads, dtype=np.uint64).reshape(1, -1, 1, 1)
    i = np.arange(seqlen_q, dtype=np.uint64).reshape(1, 1, -1, 1)
    j = np.arange(seqlen_k, dtype=np.uint64).reshape(1, 1, 1, -1)
    grow = np.uint64(8) * (i // np.uint64(16)) + i % np.uint64(8)
    gcol = np.uint64(4) * (j // np.uint64(16)) + (j % np.uint64(8)) // np.uint64(2)
    slot = j % np.uint64(2) + np.uint64(2) * ((i % np.uint64(16)) // np.uint64(8)) + \
        np.uint64(4) * ((j % np.uint64(16)) // np.uint64(8))
    bh = (b * np.uint64(nheads) + h) & _MASK32
    x = philox4x32_10(gcol, grow, bh, np.uint64(offset & 0xFFFFFFFF), np.uint64(seed & 0xFFFFFFFF),
                      np.uint64((seed >> 32) ^ (offset >> 32)))
    shape = np.broadcast_shapes(gcol.shape, grow.shape, bh.shape)
    word = np.select([slot // np.uint64(2) == np.uint64(w) for w in range(4)],
                     [np.broadcast_to(x[w], shape) for w in range(4)])
    bits = (word >> (np.uint64(16) * (slot % np.uint64(2)))) & np.uint64(0xFFFF)
    return bits < np.uint64(keep_threshold(p))


def _self_test() -> None:
    """Random123 known-answer vectors (tests/kat_vectors of Random123, "philox4x32 10" lines)."""
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, out in kat:
        got = tuple(int(w) for w in philox4x32_10(*ctr, *key))
        assert got == out, (ctr, key, [hex(w) for w in got])


_self_test()
