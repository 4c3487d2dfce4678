"""The ring's step plans (flash_ext/distributed/layout.py) against a brute-force mask: for every rank and step,
the calls' own masks (each call's causal/window read with the kernel's bottom-right alignment, by
flash_ext.reference.visibility_mask) placed at their rows and columns must cover exactly the global mask of
``flash_attn_func`` on the full sequences, each visible (query, key) pair once.  Pure integer work, no process
group; the shard positions are derived here independently (ring-flash-attention's chunking)."""
from __future__ import annotations

import itertools

import pytest
import torch

from flash_ext.distributed.layout import band_of, plan_step, shard_pieces
from flash_ext.reference import visibility_mask


def positions(rank: int, world: int, s_local: int, zigzag: bool) -> torch.Tensor:
    """Global positions of a rank's local rows, as ring-flash-attention's tests shard a sequence."""
    seq = torch.arange(world * s_local)
    if not zigzag:
        return seq.chunk(world)[rank]
    c = seq.chunk(2 * world)
    return torch.cat([c[rank], c[2 * world - 1 - rank]])


def covered(world, sq, sk, zigzag, causal, window):
    """Checks every (rank, step); returns the number of calls per step for each rank."""
    glob = visibility_mask(world * sq, world * sk, causal, window)
    band = band_of(world * sq, world * sk, causal, window)
    calls = {}
    for rank in range(world):
        qpos = positions(rank, world, sq, zigzag)
        for step in range(world):
            src = (rank - step) % world
            kpos = positions(src, world, sk, zigzag)
            want = glob[qpos][:, kpos]
            got = torch.zeros(sq, sk, dtype=torch.int32)
            blocks = plan_step(shard_pieces(rank, world, sq, zigzag), shard_pieces(src, world, sk, zigzag), band)
            for blk in blocks:
                (r0, r1), (c0, c1) = blk.q_rows, blk.k_rows
                assert 0 <= r0 < r1 <= sq and 0 <= c0 < c1 <= sk, blk
                wl, wr = blk.window
                assert wl >= -1 and wr >= -1, blk
                assert not (blk.causal and blk.window != (-1, -1)), blk
                local = visibility_mask(r1 - r0, c1 - c0, blk.causal, blk.window)
                assert local.any(), f"a call that computes nothing: {blk}"
                got[r0:r1, c0:c1] += local.int()
            ctx = (f"world {world} sq {sq} sk {sk} zigzag {zigzag} causal {causal} window {window} rank {rank} "
                   f"step {step}: {blocks}")
            assert got.max() <= 1, f"{ctx}: a pair is computed twice"
            assert torch.equal(got.bool(), want), f"{ctx}: mask differs at {(got.bool() != want).nonzero()[:5].tolist()}"
            calls[(rank, step)] = len(blocks)
    return calls


WINDOWS = [(-1, -1), (0, 0), (1, -1), (-1, 2), (3, 0), (5, 2), (13, 4), (2, 30)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("zigzag", [False, True])
def test_plans_cover_the_global_mask_exactly(world, zigzag):
    lengths = [(2, 2), (6, 6), (4, 10), (10, 4), (8, 2)] if zigzag else [(1, 1), (5, 5), (3, 7), (7, 3), (6, 1)]
    for (sq, sk), causal, window in itertools.product(lengths, [False, True], WINDOWS):
        covered(world, sq, sk, zigzag, causal, window)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_causal_skip_rule_and_call_counts(world):
    """Contiguous causal: rank r computes steps 0..r, one call each (causal at step 0 only) and skips the rest;
    zigzag causal: one call in every step of every rank (ring-flash-attention's structure)."""
    s = 6
    band = band_of(world * s, world * s, True, (-1, -1))
    for rank in range(world):
        for step in range(world):
            src = (rank - step) % world
            blocks = plan_step(shard_pieces(rank, world, s, False), shard_pieces(src, world, s, False), band)
            if step > rank:
                assert blocks == [], (rank, step, blocks)
            else:
                assert len(blocks) == 1 and blocks[0].causal == (step == 0) and blocks[0].q_rows == (0, s)
                assert blocks[0].k_rows == (0, s) and (step == 0 or blocks[0].full)
    calls = covered(world, s, s, True, True, (-1, -1))
    assert set(calls.values()) == {1}, calls
    for rank in range(world):
        for step in range(1, world):
            src = (rank - step) % world
            blk, = plan_step(shard_pieces(rank, world, s, True), shard_pieces(src, world, s, True), band)
            assert blk.full
            # earlier source rank: all queries against its first chunk; later: second query chunk against all
            expect = ((0, s), (0, s // 2)) if src < rank else ((s // 2, s), (0, s))
            assert (blk.q_rows, blk.k_rows) == expect, (rank, step, blk)


def test_non_causal_is_one_full_call_per_step():
    for zigzag in (False, True):
        calls = covered(3, 4, 6, zigzag, False, (-1, -1))
        assert set(calls.values()) == {1}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("zigzag", [False, True])
def test_shard_and_unshard_sequence_against_positions(world, zigzag):
    """shard_sequence gives each rank the rows `positions` names (derived above, independently), and
    unshard_sequence puts every row back; shards it cannot have made are refused, not silently reordered."""
    from flash_ext.distributed import shard_sequence, unshard_sequence

    s_local = 6
    x = torch.arange(world * s_local).view(1, -1, 1, 1).expand(2, -1, 3, 1) * 10 + torch.arange(3).view(1, 1, 3, 1)
    shards = [shard_sequence(x, r, world, zigzag=zigzag) for r in range(world)]
    for r, sh in enumerate(shards):
        assert torch.equal(sh[0, :, 0, 0], positions(r, world, s_local, zigzag) * 10), (r, sh[0, :, 0, 0])
    assert torch.equal(unshard_sequence(shards, zigzag=zigzag), x)
    if world > 1 or zigzag:  # a length one row short is divisible by 1 only
        with pytest.raises(ValueError, match="divisible"):
            shard_sequence(x[:, :-1], 0, world, zigzag=zigzag)
    if zigzag:  # odd or unequal shards: chunk(2) would split them elsewhere than shard_sequence does
        with pytest.raises(ValueError, match="same, even length"):
            unshard_sequence([torch.arange(3).view(1, 3), torch.arange(3, 6).view(1, 3)], zigzag=True)
        with pytest.raises(ValueError, match="same, even length"):
            unshard_sequence([torch.arange(4).view(1, 4), torch.arange(4, 6).view(1, 2)], zigzag=True)
