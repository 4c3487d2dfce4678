"""The ring itself: K/V shards travel around the process group while every rank attends its query shard to
each of them; the backward sends K/V around again, with the dK/dV accumulators following their shard.

Transport: ``torch.distributed`` point-to-point ops (``batch_isend_irecv``) on the caller's group, with any
backend it offers (gloo on CPU tensors, NCCL on CUDA tensors).  The exchange for step ``s + 1`` is issued
before the local attention of step ``s`` starts and waited after it, so the transfer overlaps the compute
(the double buffering below makes that safe: a buffer is received into only after the step that read it has
been waited).  Waits are bounded by the process group's timeout; a failed or timed-out transfer is re-raised
with the step, the direction and the peer.

Direction (as in ring-flash-attention): rank ``r`` sends to ``r + 1`` and receives from ``r - 1``, so at step
``s`` it holds the K/V shard of rank ``(r - s) mod W``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._ops import first_order_only
from .layout import Block, band_of, plan_step, shard_pieces
from .merge import finalize, merge_partial_

__all__ = ["RingSpec", "Ring", "ring_forward", "ring_backward", "RingFlashAttnFunction", "tracing"]

# Message tags (honoured by gloo; NCCL matches by order, which every rank keeps identical).
_KV_TAG = 0x6B76
_GRAD_TAG = 0x646B

# Optional per-step event hook for the benchmark (python -m flash_ext.bench ring): called as
# hook(event, step) with event "posted" (the step's exchange issued), "computed" (its local calls done),
# "wait" / "waited" (around each wait for a transfer; the backward's final wait for this rank's own dK/dV,
# after the last step, is traced as step W).
# None in normal use (no cost).
_trace_hook: Optional[Callable[[str, int], None]] = None


@contextlib.contextmanager
def tracing(hook: Callable[[str, int], None]) -> Iterator[None]:
    """Calls ``hook(event, step)`` at each ring step's milestones while the context is active (benchmark
    instrumentation; on CUDA the hook must synchronise itself to measure anything)."""
    global _trace_hook
    previous, _trace_hook = _trace_hook, hook
    try:
        yield
    finally:
        _trace_hook = previous


def _trace(event: str, step: int) -> None:
    if _trace_hook is not None:
        _trace_hook(event, step)


@dataclass(frozen=True)
class RingSpec:
    """What one ring call computes (everything but the tensors and the group)."""
    softmax_scale: float
    causal: bool
    window_size: Tuple[int, int]
    softcap: float
    deterministic: bool
    zigzag: bool


class _Pending:
    """The requests of one batched exchange; ``wait`` re-raises a transport failure with its context."""

    def __init__(self, works: Sequence[dist.Work], what: str, ring: "Ring"):
        self.works, self.what, self.ring = works, what, ring

    def wait(self, step: int) -> None:
        _trace("wait", step)
        try:
            for w in self.works:
                w.wait()
        except Exception as exc:  # gloo/NCCL errors are RuntimeError subclasses or DistBackendError
            r = self.ring
            raise RuntimeError(
                f"flash_ext.distributed: {self.what} failed on rank {r.rank} of {r.world_size} in the ring group "
                f"(sending to rank {r.next}, receiving from rank {r.prev}): {exc}. A peer rank probably failed or "
                f"stopped taking part in the ring; the wait is bounded by the process group's timeout.") from exc
        _trace("waited", step)


class Ring:
    """A process group seen as a ring: this rank, its neighbours, and batched exchanges with them."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.next = (self.rank + 1) % self.world_size
        self.prev = (self.rank - 1) % self.world_size

    def exchange(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], tag: int, what: str) -> _Pending:
        """Sends ``send`` to the next rank and receives ``recv`` (same shapes, in order) from the previous one."""
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=self.next, tag=tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=self.prev, tag=tag) for t in recv]
        return _Pending(dist.batch_isend_irecv(ops), what, self)


def _steps(ring: Ring, spec: RingSpec, seqlen_q: int, seqlen_k: int) -> List[List[Block]]:
    """The calls of every step for this rank (step ``s`` meets the K/V shard of rank ``(rank - s) mod W``)."""
    w = ring.world_size
    band = band_of(w * seqlen_q, w * seqlen_k, spec.causal, spec.window_size)
    q_pieces = shard_pieces(ring.rank, w, seqlen_q, spec.zigzag)
    return [plan_step(q_pieces, shard_pieces((ring.rank - s) % w, w, seqlen_k, spec.zigzag), band) for s in range(w)]


def _nothing_to_attend(q: torch.Tensor, k: torch.Tensor) -> bool:
    """No query row or no key on this rank, hence (the ranks agree on shapes) on any: nothing is sent."""
    return q.shape[0] == 0 or q.shape[1] == 0 or k.shape[1] == 0


def _rows(t: torch.Tensor, rows: Tuple[int, int]) -> torch.Tensor:
    return t[:, rows[0]:rows[1]]


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec,
                 ring: Ring) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the local query shard against the whole sequence.  q ``(b, s_q, h, d)``, k/v
    ``(b, s_k, h_k, d)`` contiguous, already checked (``d % 8 == 0``)."""
    b, sq, h, d = q.shape
    out = torch.zeros((b, sq, h, d), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    if _nothing_to_attend(q, k):
        return finalize(out, lse, q.dtype)
    steps = _steps(ring, spec, sq, k.shape[1])
    cur: Tuple[torch.Tensor, torch.Tensor] = (k, v)
    spare: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    for step, blocks in enumerate(steps):
        pending = None
        if step + 1 < ring.world_size:
            if spare is None:
                spare = (torch.empty_like(k), torch.empty_like(v))
            pending = ring.exchange(cur, spare, _KV_TAG, f"forward step {step}: the K/V exchange")
        _trace("posted", step)
        for blk in blocks:
            o_s, lse_s, _ = torch.ops.flash_ext.fwd(  # (out, lse, rng_state)
                _rows(q, blk.q_rows), _rows(cur[0], blk.k_rows), _rows(cur[1], blk.k_rows), spec.softmax_scale,
                blk.causal, blk.window[0], blk.window[1], spec.softcap, None, 0)
            merge_partial_(_rows(out, blk.q_rows), lse[:, :, blk.q_rows[0]:blk.q_rows[1]], o_s, lse_s)
        _trace("computed", step)
        if pending is not None:
            pending.wait(step)
            # The shard just computed on becomes the next receive buffer, unless it is the caller's k/v.
            cur, spare = spare, (cur if step > 0 else None)
    return finalize(out, lse, q.dtype)


def _bwd_op():
    """flash_ext's backward op, or None in a build without it."""
    try:
        return torch.ops.flash_ext.bwd
    except (AttributeError, RuntimeError):
        return None


def _bwd_takes_dlse(op) -> bool:
    """Whether the backward op accepts the gradient of the LSE (``dsoftmax_lse``)."""
    return any(a.name == "dsoftmax_lse" for a in op.default._schema.arguments)


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, spec: RingSpec, ring: Ring,
                  dlse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the local shards.  Every call of a step runs flash_ext's backward op with the
    *merged* ``out`` and ``lse`` (P = exp(score - global LSE), D = rowsum(dout * global out)), so its dk/dv are
    that call's keys' share of the gradient and its dq the share of these query rows.  dq accumulates locally
    in fp32; the fp32 dK/dV accumulator of each K/V shard travels with it around the ring and reaches its
    owner after the last step (one more hop than K/V).  ``dlse`` (the gradient of the returned LSE, when the
    loss uses it) goes to every call with its rows: d LSE_i / d s_ij = P_ij with the global P, so each call's
    share is exact too."""
    if _nothing_to_attend(q, k):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    bwd = _bwd_op()
    if bwd is None:
        raise NotImplementedError(
            "flash_ext.distributed: the backward pass needs flash_ext's backward op (torch.ops.flash_ext.bwd), "
            "which this build does not have")
    if dlse is not None and not _bwd_takes_dlse(bwd):
        raise NotImplementedError(_LSE_GRAD_ERROR)
    w = ring.world_size
    sk = k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc = [tuple(torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2))]
    steps = _steps(ring, spec, q.shape[1], sk)
    cur: Tuple[torch.Tensor, torch.Tensor] = (k, v)
    spare: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    grad_pending: Optional[_Pending] = None
    held = 0  # index in `acc` of the accumulator of the shard held at this step
    for step, blocks in enumerate(steps):
        kv_pending = None
        if step + 1 < w:
            if spare is None:
                spare = (torch.empty_like(k), torch.empty_like(v))
            kv_pending = ring.exchange(cur, spare, _KV_TAG, f"backward step {step}: the K/V exchange")
        _trace("posted", step)
        parts = []
        for blk in blocks:
            qs = slice(blk.q_rows[0], blk.q_rows[1])
            dq_b = torch.empty_like(q[:, qs])
            dk_b = torch.empty_like(k[:, blk.k_rows[0]:blk.k_rows[1]])
            dv_b = torch.empty_like(dk_b)
            extra = {} if dlse is None else {"dsoftmax_lse": dlse[:, :, qs]}
            bwd(dout[:, qs], q[:, qs], _rows(cur[0], blk.k_rows), _rows(cur[1], blk.k_rows), out[:, qs],
                lse[:, :, qs], dq_b, dk_b, dv_b, 0.0, spec.softmax_scale, blk.causal, blk.window[0], blk.window[1],
                spec.softcap, None, spec.deterministic, rng_state=None, **extra)
            dq[:, qs] += dq_b
            parts.append((blk.k_rows, dk_b, dv_b))
        _trace("computed", step)
        if grad_pending is not None:
            grad_pending.wait(step)
        dk_acc, dv_acc = acc[held]
        for rows, dk_b, dv_b in parts:
            _rows(dk_acc, rows).add_(dk_b)
            _rows(dv_acc, rows).add_(dv_b)
        if w > 1:
            if len(acc) == 1:
                acc.append(tuple(torch.empty_like(t) for t in acc[0]))
            what = (f"backward step {step}: the dK/dV exchange" if step + 1 < w
                    else "backward: returning the dK/dV accumulators to their owners")
            grad_pending = ring.exchange(acc[held], acc[1 - held], _GRAD_TAG, what)
            held = 1 - held
        if kv_pending is not None:
            kv_pending.wait(step)
            cur, spare = spare, (cur if step > 0 else None)
    if grad_pending is not None:
        grad_pending.wait(w)  # traced as a step of its own: the return hop of this rank's accumulators
    dk, dv = acc[held]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_LSE_GRAD_ERROR = (
    "flash_ext.distributed: the gradient w.r.t. softmax_lse (returned with return_attn_probs=True) needs a "
    "backward op that takes dsoftmax_lse, which this build does not have; the loss depends on the LSE here. "
    "Use lse.detach() where only its value is needed.")


class RingFlashAttnFunction(torch.autograd.Function):
    """Autograd of the ring: the forward saves the local shards and the merged (out, lse); the backward runs
    ``ring_backward``.  Every rank of the group must run the backward (it is a collective)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec,
                group: Optional[dist.ProcessGroup]):
        ring = Ring(group)
        out, lse = ring_forward(q, k, v, spec, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.group = spec, group
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor]):
        q, k, v, out, lse = ctx.saved_tensors
        # The peers wait for this rank's K/V and accumulators even when its own loss ignores `out`.
        dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        if dlse is not None:
            dlse = dlse.to(torch.float32).contiguous()
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.spec, Ring(ctx.group), dlse)
        return first_order_only(ctx, (dq, dk, dv, None, None))  # no double backward: raise, never drop the term
