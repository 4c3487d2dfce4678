"""Context parallelism: ring attention over ``torch.distributed``, forward and backward.

When one sequence does not fit one device, every rank of a process group holds a *shard* of it, the query
shard stays, and the key/value shards travel around the ring; partial results are merged through their
log-sum-exp (flash_ext's split-KV combine rule, across processes).  The API is ring-flash-attention's
(``ring_flash_attn_func``, ``zigzag_ring_flash_attn_func`` and their packed variants, argument names and
shard conventions included) with flash_attn 2.8's arguments::

    out = ring_flash_attn_func(q, k, v, causal=True, group=group)   # q/k/v: this rank's shard (b, s_local, h, d)

Shards (``W`` ranks of ``group``, ranks as ``dist.get_rank(group)``):

* ``ring_flash_attn_func``: rank ``r`` holds rows ``[r * s_local, (r + 1) * s_local)`` of q, k and v, i.e.
  ``x.chunk(W, dim=1)[r]``.
* ``zigzag_ring_flash_attn_func``: the sequence is cut into ``2W`` chunks and rank ``r`` holds chunks ``r`` and
  ``2W - 1 - r`` one after the other, i.e. ``torch.cat([c[r], c[2 * W - 1 - r]], dim=1)`` with
  ``c = x.chunk(2 * W, dim=1)``; under a causal mask this gives every rank the same work.
  ``shard_sequence`` / ``unshard_sequence`` produce and invert both layouts.

The result on every rank is ``flash_attn_func`` on the full sequences, restricted to its query rows (and the
LSE ``(b, h, s_local)`` of those rows), with flash_ext's semantics: masks aligned to the bottom-right corner
of the *global* problem, ``seqlen_q = W * s_q`` and ``seqlen_k = W * s_k`` (``s_q`` may differ from ``s_k``),
softcap, local windows, MQA/GQA (``h % h_k == 0``), any head dim the build has.  Gradients flow to q, k, v.

Not supported (refused with ``NotImplementedError`` before anything is sent): ``dropout_p > 0`` (the kernels'
dropout mask is a function of each call's own row and column indices, and a ring step's block would need the mask at
its global coordinates, the same in the forward and the backward) and
``alibi_slopes`` (the kernels measure the ALiBi distance from each call's own corner, not the global diagonal).

Requirements of a call (all ranks of ``group`` call it together, like any collective, forward and backward):
every rank passes the same shapes, dtypes and options.  Before anything is sent, the ranks compare them with
one small ``all_gather`` (a CPU tensor on a gloo group, no device synchronisation; with NCCL alone a device
tensor and one host read): a rank whose arguments are invalid raises its ``ValueError`` (``NotImplementedError``
for dropout or ALiBi) and every other rank a ``ValueError`` naming it, instead of waiting for a transfer that
never comes.  Whether the call records a graph (grad mode and an input requiring grad) is compared too: the
backward is a collective as well.  Set ``FLASH_EXT_RING_TRUST_ARGS=1`` on every rank to skip that check
(invalid or mismatched arguments are then undefined behaviour: a rank may wait until the process group's
timeout, gloo may deliver a shorter message silently or abort the process, and mismatched options give wrong
results silently).  A rank that records a graph but never calls ``.backward()`` leaves the others waiting in
theirs until the timeout.  Transfers that fail later (a peer dies or stops calling) end with an error naming the step
and the peer, bounded by the process group's ``timeout``.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _C
from ..interface import _window_size_error, maybe_contiguous
from .ring import RingFlashAttnFunction, RingSpec

__all__ = [
    "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
    "shard_sequence", "unshard_sequence",
]

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


def _layout_name(zigzag: bool) -> str:
    return "zigzag_ring_flash_attn_func" if zigzag else "ring_flash_attn_func"


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, zigzag: bool = False, dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor in the layout of ``ring_flash_attn_func`` (``zigzag=False``)
    or ``zigzag_ring_flash_attn_func`` (``zigzag=True``).  The length along ``dim`` must be divisible by
    ``world_size`` (by ``2 * world_size`` for zigzag).  Returns a contiguous copy."""
    n = x.shape[dim]
    parts = 2 * world_size if zigzag else world_size
    if world_size < 1 or not 0 <= rank < world_size or n % parts != 0:
        raise ValueError(
            f"flash_ext.distributed.shard_sequence: sequence length {n} (dim {dim}), rank {rank}, world_size "
            f"{world_size}: the length must be divisible by {'2 * world_size' if zigzag else 'world_size'} = {parts} "
            f"and 0 <= rank < world_size")
    c = x.chunk(parts, dim=dim)
    if not zigzag:
        return c[rank].contiguous()
    return torch.cat([c[rank], c[2 * world_size - 1 - rank]], dim=dim)


def unshard_sequence(shards: List[torch.Tensor], zigzag: bool = False, dim: int = 1) -> torch.Tensor:
    """The full-sequence tensor from every rank's shard (``shards[r]`` from rank ``r``), inverting
    ``shard_sequence``; e.g. after ``dist.all_gather``.  Zigzag shards must all have one even length."""
    if not zigzag:
        return torch.cat(shards, dim=dim)
    w = len(shards)
    lengths = [s.shape[dim] for s in shards]
    if w < 1 or lengths[0] % 2 or any(n != lengths[0] for n in lengths):
        # chunk(2) of an odd or unequal shard splits it elsewhere than shard_sequence did: a silent reordering
        raise ValueError(
            f"flash_ext.distributed.unshard_sequence: zigzag shards of lengths {lengths} (dim {dim}): every rank's "
            f"shard must have the same, even length (two chunks of the sequence, as shard_sequence makes them)")
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([halves[r][0] for r in range(w)] + [halves[w - 1 - i][1] for i in range(w)], dim=dim)


def _local_errors(q, k, v, dropout_p, window_size, alibi_slopes, zigzag: bool) -> Tuple[List[str], List[str]]:
    """(ValueError reasons, NotImplementedError reasons) that this rank's arguments alone give."""
    errors: List[str] = []
    unsupported: List[str] = []
    if dropout_p != 0.0:
        unsupported.append(
            f"dropout_p={dropout_p}: ring attention with dropout is not implemented (the kernels' dropout mask is "
            f"drawn at each call's own row/column indices, a ring step would need it at the global ones); only "
            f"dropout_p=0.0 works")
    if alibi_slopes is not None:
        unsupported.append(
            "alibi_slopes: not supported by ring attention (the kernels measure the ALiBi distance from each "
            "call's own bottom-right corner, not from the global diagonal)")
    window_error = _window_size_error(window_size)
    if window_error:
        errors.append(window_error)
    tensors_ok = all(isinstance(t, torch.Tensor) for t in (q, k, v))
    if not tensors_ok:
        errors.append(f"q, k, v: got {type(q).__name__}, {type(k).__name__}, {type(v).__name__}; must be tensors")
    elif q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and zigzag:
        for name, t in (("q", q), ("k", k)):
            if t.shape[1] % 2:
                errors.append(
                    f"{name}.shape[1]: got {t.shape[1]}; the zigzag layout needs an even local length (each rank holds "
                    f"two chunks of it): the global sequence length must be divisible by 2 * world_size")
    return errors, unsupported


def _signature(ok: bool, q, k, v, head_dim: int, softmax_scale: float, causal: bool, window_size, softcap: float,
               deterministic: bool, zigzag: bool) -> List[float]:
    """What every rank must agree on (the caller's head dim, not the padded one: two head dims that pad to the
    same size would exchange K/V of the same shape but mean different things), and whether the call records a
    graph: the backward is collective too, so a rank without one would leave the others waiting in it."""
    if not ok:
        return [0.0] + [-1.0] * (len(_SIG_FIELDS) - 1)
    records_graph = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return [1.0, *map(float, q.shape[:3]), float(head_dim), *map(float, k.shape[1:3]),
            float(_DTYPE_CODES.get(q.dtype, 0)),
            float(softmax_scale), float(causal), float(window_size[0]), float(window_size[1]), float(softcap),
            float(deterministic), float(zigzag), float(records_graph)]


_SIG_FIELDS = ("ok", "batch", "s_q", "heads", "head_dim", "s_k", "heads_k", "dtype", "softmax_scale", "causal",
               "window_left", "window_right", "softcap", "deterministic", "zigzag", "requires_grad")


def _agree(group, device: torch.device, sig: List[float]) -> List[List[float]]:
    """Every rank's signature (one all_gather of a few float64 on the group)."""
    backend = str(dist.get_backend(group))
    on_cpu = "gloo" in backend or "cpu" in backend
    mine = torch.tensor(sig, dtype=torch.float64, device="cpu" if on_cpu else device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [t.tolist() for t in gathered]


def _ring_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs, group, zigzag: bool):
    name = f"flash_ext.distributed.{_layout_name(zigzag)}"
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name}: torch.distributed is not initialised (call dist.init_process_group first)")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{name}: group: this process (global rank {dist.get_rank()}) is not a member of the group")
    # As flash_attn_func: a strided last dimension is made contiguous (a differentiable copy), not refused.
    q, k, v = (maybe_contiguous(t) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    errors, unsupported = _local_errors(q, k, v, dropout_p, window_size, alibi_slopes, zigzag)
    head_dim = 0
    if not errors and not unsupported:
        q, k, v, softmax_scale, head_dim = _prepare_qkv_padded(q, k, v, softmax_scale)
        plan = _C.plan_fwd(q, k, v, softmax_scale, bool(causal), int(window_size[0]), int(window_size[1]),
                           float(softcap), None, 0)
        errors += list(plan.get("reasons", [])) if not plan.get("ok", False) else []
    ok = not errors and not unsupported
    if os.environ.get("FLASH_EXT_RING_TRUST_ARGS", "0") != "1":
        sig = _signature(ok, q, k, v, head_dim, softmax_scale, causal, window_size, softcap, deterministic, zigzag)
        device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
        try:
            everyone = _agree(group, device, sig)
        except Exception as exc:  # a peer that died or does not call: bounded by the group's timeout
            raise RuntimeError(
                f"{name}: comparing the arguments of the ranks (one all_gather on the group) failed on rank "
                f"{dist.get_rank(group)}: {exc}. A peer rank probably failed or is not calling ring attention; the "
                f"wait is bounded by the process group's timeout.") from exc
        me = dist.get_rank(group)
        if ok:
            failed = [r for r, s in enumerate(everyone) if s[0] != 1.0]
            if failed:
                raise ValueError(f"{name}: rank(s) {failed} of the group refused their arguments (see the error on "
                                 f"those ranks); no rank started the ring")
            differ = [r for r, s in enumerate(everyone) if s != sig]
            if differ:
                fields = [f for i, f in enumerate(_SIG_FIELDS) if any(s[i] != sig[i] for s in everyone)]
                listed = "; ".join(f"rank {r}: " + ", ".join(f"{f}={everyone[r][_SIG_FIELDS.index(f)]:g}" for f in fields)
                                   for r in range(len(everyone)))
                raise ValueError(f"{name}: the ranks of the group passed different arguments (rank {me} here); every "
                                 f"rank must pass the same shapes, dtype and options: {listed}")
    if unsupported:
        raise NotImplementedError(f"{name}: " + "; ".join(unsupported))
    if errors:
        raise ValueError(f"{name}: invalid arguments on rank {dist.get_rank(group)} of the group:\n" +
                         "\n".join(f"  - {e}" for e in errors))

    spec = RingSpec(softmax_scale=float(softmax_scale), causal=bool(causal),
                    window_size=(int(window_size[0]), int(window_size[1])), softcap=float(softcap),
                    deterministic=bool(deterministic), zigzag=zigzag)
    out, lse = RingFlashAttnFunction.apply(q, k.contiguous(), v.contiguous(), spec, group)
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim]
    return (out, lse, None) if return_attn_probs else out


def _prepare_qkv_padded(q, k, v, softmax_scale):
    """Default scale from the caller's head dim, then zero padding of the head dim to a multiple of 8 (the
    kernels' vector width), through differentiable ``F.pad`` so gradients come back unpadded."""
    head_dim = q.shape[-1] if q.dim() >= 1 else 0
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5 if head_dim > 0 else 1.0
    padded = head_dim if head_dim % 8 == 0 or head_dim > 256 else head_dim + 8 - head_dim % 8
    if padded != head_dim and k.shape[-1] == head_dim and v.shape[-1] == head_dim:
        q, k, v = (F.pad(t, [0, padded - head_dim]) for t in (q, k, v))
    return q, k, v, float(softmax_scale), head_dim


_ARGS_DOC = """
    Arguments as ``flash_ext.flash_attn_func`` (flash_attn 2.8), on this rank's shards, plus ``group`` (the
    process group of the ring, default the world).  q ``(b, s_q, h, d)``, k/v ``(b, s_k, h_k, d)``; every rank
    passes the same shapes, dtype and options.  Returns this rank's ``out (b, s_q, h, d)``, or with
    ``return_attn_probs=True`` ``(out, softmax_lse (b, h, s_q) fp32, None)``.  Differentiable w.r.t. q, k, v,
    through ``out`` and the returned LSE (as ``flash_ext.flash_attn_func``).  ``dropout_p`` must be 0 and ``alibi_slopes`` None (``NotImplementedError``).
"""


def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: Optional[dist.ProcessGroup] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, None]]:
    """Ring attention, contiguous shards: rank ``r`` of ``W`` holds rows ``[r * s, (r + 1) * s)`` of the
    sequence (``x.chunk(W, dim=1)[r]``).  Under ``causal`` rank ``r`` computes ``r + 1`` of the ``W`` steps (the
    others are skipped), so the last rank does the most work; ``zigzag_ring_flash_attn_func`` balances it.
    """
    return _ring_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, group, zigzag=False)


def zigzag_ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: Optional[dist.ProcessGroup] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, None]]:
    """Ring attention, zigzag shards: the sequence is cut into ``2W`` chunks and rank ``r`` holds chunks ``r``
    and ``2W - 1 - r`` (its local length must be even).  Under ``causal`` every rank computes one causal call on
    its own shard and one half-size unmasked call per other step: the same work on every rank.
    """
    return _ring_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, group, zigzag=True)


def _unpack_qkv(qkv: torch.Tensor, name: str):
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        shape = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ValueError(f"flash_ext.distributed.{name}: qkv: got shape {shape}; must be (batch, s_local, 3, nheads, headdim)")
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def _unpack_kv(kv: torch.Tensor, name: str):
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"flash_ext.distributed.{name}: kv: got shape {shape}; must be (batch, s_local, 2, nheads_k, headdim)")
    return kv[:, :, 0], kv[:, :, 1]


def ring_flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                                   causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                   alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                                   return_attn_probs: bool = False, group: Optional[dist.ProcessGroup] = None):
    """``ring_flash_attn_func`` on packed ``qkv (b, s_local, 3, h, d)`` (the gradient comes back packed)."""
    q, k, v = _unpack_qkv(qkv, "ring_flash_attn_qkvpacked_func")
    return ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                deterministic, return_attn_probs, group)


def ring_flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                                  softmax_scale: Optional[float] = None, causal: bool = False,
                                  window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                  alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                                  return_attn_probs: bool = False, group: Optional[dist.ProcessGroup] = None):
    """``ring_flash_attn_func`` with packed ``kv (b, s_local, 2, h_k, d)``."""
    k, v = _unpack_kv(kv, "ring_flash_attn_kvpacked_func")
    return ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0,
                                          softmax_scale: Optional[float] = None, causal: bool = False,
                                          window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                          alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                                          return_attn_probs: bool = False, group: Optional[dist.ProcessGroup] = None):
    """``zigzag_ring_flash_attn_func`` on packed ``qkv (b, s_local, 3, h, d)``."""
    q, k, v = _unpack_qkv(qkv, "zigzag_ring_flash_attn_qkvpacked_func")
    return zigzag_ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                       deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                                         softmax_scale: Optional[float] = None, causal: bool = False,
                                         window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                         alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                                         return_attn_probs: bool = False, group: Optional[dist.ProcessGroup] = None):
    """``zigzag_ring_flash_attn_func`` with packed ``kv (b, s_local, 2, h_k, d)``."""
    k, v = _unpack_kv(kv, "zigzag_ring_flash_attn_kvpacked_func")
    return zigzag_ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                       deterministic, return_attn_probs, group)


for _f in (ring_flash_attn_func, zigzag_ring_flash_attn_func):
    _f.__doc__ = (_f.__doc__ or "") + _ARGS_DOC
del _f
