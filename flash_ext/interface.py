"""FA2 2.8-compatible Python API.  Every attention function ends in one call of ``torch.ops.flash_ext.fwd`` (or
``varlen_fwd``), whose registered autograd runs ``torch.ops.flash_ext.bwd`` (``varlen_bwd``) (a call that can record
no graph goes below the autograd layer: ``_call_forward_op``); the explicit backward functions
(``flash_attn_backward``, ``flash_attn_varlen_backward``) call those ops directly."""
from __future__ import annotations

import numbers
import re
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from . import _C, _ops  # noqa: F401  (_ops registers fake kernels and autograd)
from .dropout import s_dmask, s_dmask_varlen
from .errors import raises_argument_error

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
]


def _is_scalar_tensor(x, integral: bool) -> bool:
    """A one-element tensor of an integer (or, unless `integral`, floating) dtype: flash_attn 2.8's ops are
    torch.library custom ops declared ``int`` / ``float``, which take such a tensor for the number (its own
    tests pass ``window_size=torch.randint(0, seqlen_k, (2,))``), so flash_ext takes it too."""
    if not isinstance(x, torch.Tensor) or x.numel() != 1 or x.dtype == torch.bool or x.is_complex():
        return False
    return not x.is_floating_point() or not integral


def _is_int(x) -> bool:
    """An integer other than a bool (NumPy's too, and a one-element integer tensor).  Python's own int first:
    the ABC check costs about a microsecond, and these checks run on every call."""
    return (type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))
            or _is_scalar_tensor(x, integral=True))


def _is_real(x) -> bool:
    """A real number other than a bool (NumPy's, a traced SymFloat, a one-element real tensor too), Python's
    own types first."""
    return (type(x) in (float, int) or (isinstance(x, (numbers.Real, torch.SymFloat)) and not isinstance(x, bool))
            or _is_scalar_tensor(x, integral=False))


def _window_size_error(window_size) -> Optional[str]:
    """The rule window_size breaks, or None: the ops take two ints, so the shape is checked here.  Any integer
    type (NumPy's, one-element integer tensors, a two-element integer tensor as a whole) is taken, and a
    negative side is unbounded, as in flash_attn."""
    pair = isinstance(window_size, (tuple, list)) or (
        isinstance(window_size, torch.Tensor) and window_size.dim() == 1)
    if not (pair and len(window_size) == 2 and _is_int(window_size[0]) and _is_int(window_size[1])):
        return (f"window_size: got {window_size!r}; must be a pair of ints (left, right) (Python, NumPy or "
                "one-element integer tensors), negative = unbounded")
    return None


def _python_arg_errors(dropout_p: float, window_size, softmax_scale=None) -> List[str]:
    """Python-side argument types (the value rules, dropout_p's range and the rest, are the op's)."""
    errors = []
    if not _is_real(dropout_p):
        errors.append(f"dropout_p: got {dropout_p!r}; must be a float in [0, 1 - 2^-17] (or a one-element tensor)")
    if softmax_scale is not None and not _is_real(softmax_scale):
        errors.append(f"softmax_scale: got {softmax_scale!r}; must be None (1 / sqrt(headdim)) or a float > 0")
    window_error = _window_size_error(window_size)
    if window_error:
        errors.append(window_error)
    return errors


def _refusal(op_name: str, errors: List[str]) -> ValueError:
    """One error listing every unmet requirement, in the ops' format."""
    return ValueError(f"{op_name}: {len(errors)} invalid argument{'s' if len(errors) > 1 else ''}:" +
                      "".join(f"\n  - {e}" for e in errors))


_OP_REFUSAL = re.compile(r"^\S+: \d+ invalid arguments?:")


def refusal_reasons(error: BaseException) -> List[str]:
    """The reasons an error lists when it is a refusal in the ops' format (``_refusal``), else its whole text."""
    text = str(error)
    if isinstance(error, ValueError) and _OP_REFUSAL.match(text):
        return [line[4:] for line in text.splitlines() if line.startswith("  - ")]
    return [text]


def _op_reasons(op, *args) -> List[str]:
    """The unmet requirements ``op(*args)`` would report, found in the op's check-only mode (it checks and runs
    nothing; ``_C.check_only``).  An error other than the op's list (arguments too malformed to check) is
    returned whole."""
    try:
        _C.check_only(op, *args)  # one host call: the mode cannot outlive it, compiled caller or not
    except (TypeError, ValueError) as e:  # a RuntimeError (a device fault, out of memory) is no argument's fault
        return refusal_reasons(e)
    return []


def _refuse_with_op_reasons(op_name: str, errors: List[str], op_reasons: Callable[[], List[str]]):
    """Raises the Python-side ``errors`` together with what the op itself refuses (``op_reasons()``, run with
    neutral stand-ins for the arguments that failed here): one error that lists everything."""
    try:
        errors = errors + op_reasons()
    except (TypeError, ValueError, RuntimeError) as e:  # arguments too malformed to check: theirs is the error
        errors = errors + [str(e)]
    raise _refusal(op_name, errors)


def _stand_ins(errors: List[str], dropout_p, window_size, softmax_scale):
    """Neutral values for the arguments _python_arg_errors refused, so that the op's plan can still list the
    rest: ``(dropout_p, window_size, softmax_scale)``."""
    refused = lambda name: any(e.startswith(name + ":") for e in errors)  # noqa: E731
    return (0.0 if refused("dropout_p") else dropout_p, (-1, -1) if refused("window_size") else window_size,
            None if refused("softmax_scale") else softmax_scale)


def _check_fwd_args(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    num_splits) -> None:
    """flash_attn_func's Python-side type rules, and when one fails, the op's own rules too (its check-only
    mode, with neutral stand-ins for the arguments that failed here, as varlen and kvcache do): one error
    lists everything, in the op's format."""
    errors = _python_arg_errors(dropout_p, window_size, softmax_scale)
    if not errors:
        return
    p, window, softmax_scale = _stand_ins(errors, dropout_p, window_size, softmax_scale)

    def op_reasons() -> List[str]:
        q_, k_, v_, scale, _ = _prepare_qkv(q, k, v, softmax_scale, rank=4)
        return _op_reasons(torch.ops.flash_ext.fwd, q_, k_, v_, scale, bool(causal), int(window[0]),
                           int(window[1]), float(softcap), alibi_slopes, int(num_splits), float(p))
    _refuse_with_op_reasons("flash_ext.fwd", errors, op_reasons)


# Where a call can record no graph, the forward ops are called below the autograd layer.  The autograd kernel
# that torch.library.register_autograd installs (_ops.py) is Python: every call through it converts its arguments
# from the dispatcher to Python objects and back (~9 us per call on a Zen 3, docs/perf.md), only to find that
# nothing requires grad and redispatch below autograd itself.  Not while compiling: the traced graph keeps the op
# as registered.
_below_autograd = getattr(torch._C, "_AutoDispatchBelowAutograd", None)


def refuse_forward_ad(name: str, tensors: Tuple) -> None:
    """Forward-mode AD (``torch.func.jvp``/``jacfwd``, ``torch.autograd.forward_ad``) has no formula here, and
    the ops' autograd drops a tangent without a word (zeros for jacfwd): refused by name where an input
    carries one.  One global read when no dual level is open."""
    if fwAD._current_level < 0:
        return
    if any(isinstance(t, torch.Tensor) and fwAD.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError(
            f"{name}: forward-mode AD (torch.func.jvp / jacfwd, torch.autograd.forward_ad) is not implemented: an "
            f"input carries a tangent, and it would be dropped; differentiate in reverse mode (.backward(), "
            f"torch.autograd.grad)")


def _call_forward_op(op, grad_inputs: Tuple, *args):
    """``op(*args)`` for a forward op with an autograd formula (``fwd``, ``varlen_fwd``): through autograd when
    grad mode is on and one of ``grad_inputs`` (the differentiable tensors, as passed to the op) requires grad,
    else directly below it, with the same result (outputs that do not require grad).  Forward-mode AD is
    refused (refuse_forward_ad)."""
    refuse_forward_ad(f"flash_ext.{op.__name__}", grad_inputs)
    if (_below_autograd is None or torch.compiler.is_compiling()
            or (torch.is_grad_enabled()
                and any(isinstance(t, torch.Tensor) and t.requires_grad for t in grad_inputs))):
        return op(*args)
    with _below_autograd():
        return op(*args)


def size_arg(x) -> Union[int, torch.SymInt]:
    """A size the ops take as SymInt (max_seqlen_q/k, the mask's dims): kept symbolic under torch.compile, where
    int() would specialise the graph on its value (a recompile per batch maximum), else a Python int."""
    return x if isinstance(x, (int, torch.SymInt)) else int(x)


def maybe_contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` with a contiguous last dimension (a copy only when it is strided), as flash_attn makes its inputs
    before the kernel call; None and 0-d tensors pass through for the op's checks to name."""
    if t is None or t.dim() == 0 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def _prepare_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float], rank: int,
                 kv_rank: Optional[int] = None):
    """Default scale from the caller's head dim, a contiguous last dimension (as flash_attn does), then
    zero-padding of the head dim to a multiple of 8 (the kernels' vector width; zeros change no dot product).
    Inputs the op will reject pass through otherwise untouched so its error names what the caller gave.
    ``kv_rank``: k/v's rank when it differs from q's (paged K/V under a varlen q).  Returns ``(q, k, v,
    softmax_scale, head_dim)``."""
    q, k, v = maybe_contiguous(q), maybe_contiguous(k), maybe_contiguous(v)
    kv_rank = rank if kv_rank is None else kv_rank
    head_dim = q.shape[-1] if q.dim() >= 1 else 0
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5 if head_dim > 0 else 1.0
    padded = head_dim if head_dim % 8 == 0 or head_dim > 256 else head_dim + 8 - head_dim % 8
    if (padded != head_dim and q.dim() == rank and k.dim() == kv_rank and v.dim() == kv_rank
            and k.shape[-1] == head_dim and v.shape[-1] == head_dim):
        q, k, v = (F.pad(t, [0, padded - head_dim]) for t in (q, k, v))
    return q, k, v, float(softmax_scale), head_dim


@raises_argument_error
def flash_attn_func(
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
    num_splits: int = 0,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Exact softmax attention without materialising the (seqlen_q, seqlen_k) score matrix.

    Semantics follow flash_attn 2.8's ``flash_attn_func``:

    * q ``(batch, seqlen_q, nheads, headdim)``, k and v ``(batch, seqlen_k, nheads_k, headdim)`` with
      ``nheads % nheads_k == 0`` (MQA/GQA: query head ``i`` uses K/V head ``i // (nheads // nheads_k)``).
      fp16 or bf16 on CUDA (sm_80+); fp16, bf16 or fp32 on the CPU.  Any ``headdim <= 256``.
    * ``softmax_scale`` defaults to ``1 / sqrt(headdim)``.
    * ``causal``: the mask is aligned to the bottom-right corner: query ``i`` sees keys
      ``j <= i + seqlen_k - seqlen_q``.
    * ``window_size=(left, right)``: query ``i`` sees keys in
      ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``; a negative side is unbounded.
    * ``softcap > 0``: scores become ``softcap * tanh(scores / softcap)`` before masking (``<= 0``: off).
    * ``alibi_slopes`` fp32 ``(nheads,)`` or ``(batch, nheads)``: adds ``-slope * |i + seqlen_k - seqlen_q - j|``.
    * A query row that sees no key gets output 0 and log-sum-exp ``+inf``.
    * ``dropout_p`` in ``[0, 1 - 2^-17]`` (the mask holds ``1 - p`` to 16 bits; flash_attn 2.8 refuses
      p >= 1): each softmax probability is dropped with probability ``dropout_p`` and the output is
      ``(P * mask) @ v / (1 - dropout_p)``; the log-sum-exp is that of the undropped scores.  The mask is a pure function of a seed/offset drawn
      from torch's default generator of q's device (``torch.manual_seed`` repeats it bit for bit,
      consecutive calls differ, CUDA graph replays draw anew) and of the element's (batch, head, row,
      column): the same on the CPU and the GPU, whatever the tiling or ``num_splits`` (docs/design.md,
      "Dropout").  ``dropout_p=0`` gives exactly the result without dropout.
    * Differentiable w.r.t. ``q``, ``k`` and ``v`` (the backward kernels, ``torch.ops.flash_ext.bwd``), through
      ``out`` and through the returned ``softmax_lse`` as well (flash_attn silently drops the latter); not
      w.r.t. ``alibi_slopes`` (with slopes that require grad the backward raises ``NotImplementedError``).
      With dropout the backward regenerates the forward's mask from its ``rng_state``.
      ``deterministic=True`` makes the GPU backward
      accumulate dQ in a fixed order (bitwise identical gradients run to run, a little slower); on the CPU
      the backward is always deterministic, for any thread count.  The forward is always deterministic.
    * ``num_splits`` (an addition to flash_attn's signature): split-KV parallelism.  0 (or less) picks it with
      the heuristic (splits only when the grid would leave processors idle: few batch x heads x query blocks,
      long seqlen_k), 1 turns it off, n > 1 forces n splits (at most 128).  Results equal the unsplit ones
      up to fp32 rounding of the combine.

    Returns ``out`` ``(batch, seqlen_q, nheads, headdim)``; with ``return_attn_probs=True`` returns
    ``(out, softmax_lse, S_dmask)`` where ``softmax_lse`` is fp32 ``(batch, nheads, seqlen_q)`` and
    ``S_dmask`` is an empty tensor without dropout (as flash_attn's), else (testing only)
    ``(batch, nheads, seqlen_q, seqlen_k)`` in q's dtype, the dropped entries negated (``-0.0`` for a dropped
    0), scaled as flash_attn's CUDA kernel leaves it: per key block of ``_get_block_size_n`` columns,
    ``exp(s - m_j)`` with ``m_j`` the row's maximum over that block and the blocks right of it (flash_attn's
    tests' ``normalize_flash_attn_S`` turns it into the probabilities).  Recomputed after the kernel by an
    O(seqlen_q x seqlen_k) path (flash_ext/dropout.py); unlike flash_attn's, not padded to multiples of 128.
    """
    out, lse, probs, _ = forward_with_rng_state(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                                alibi_slopes, deterministic, return_attn_probs, num_splits)
    return (out, lse, probs) if return_attn_probs else out


def forward_with_rng_state(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, num_splits):
    """``flash_attn_func``'s work, returning ``(out, softmax_lse, S_dmask, rng_state)`` (S_dmask None unless
    ``return_attn_probs``): also for flash_attn's ``_flash_attn_forward`` (flash_attn_interface.py)."""
    _check_fwd_args(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits)
    q, k, v, softmax_scale, head_dim = _prepare_qkv(q, k, v, softmax_scale, rank=4)
    out, lse, rng_state = _call_forward_op(
        torch.ops.flash_ext.fwd, (q, k, v, alibi_slopes), q, k, v, softmax_scale, bool(causal), int(window_size[0]),
        int(window_size[1]), float(softcap), alibi_slopes, int(num_splits), float(dropout_p), None, bool(deterministic))
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim]
    if not return_attn_probs:
        return out, lse, None, rng_state
    probs = torch.empty((0,), dtype=q.dtype, device=q.device)  # flash_attn: an empty S_dmask without dropout
    if dropout_p > 0 and not _C.in_plan_only():  # explain_call: no kernel wrote lse/rng_state
        probs = s_dmask(q, k, lse, rng_state, float(dropout_p), softmax_scale, bool(causal),
                        (int(window_size[0]), int(window_size[1])), float(softcap), alibi_slopes)
    return out, lse, probs, rng_state


@raises_argument_error
def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    num_splits: int = 0,
):
    """``flash_attn_func`` on packed ``qkv`` of shape ``(batch, seqlen, 3, nheads, headdim)`` (no copy)."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"flash_ext: qkv: got shape {tuple(qkv.shape)}; must be (batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs, num_splits)


@raises_argument_error
def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    num_splits: int = 0,
):
    """``flash_attn_func`` with packed ``kv`` of shape ``(batch, seqlen_k, 2, nheads_k, headdim)`` (no copy)."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"flash_ext: kv: got shape {tuple(kv.shape)}; must be (batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, num_splits)


@raises_argument_error
def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    num_splits: int = 0,
):
    """Attention over a batch of sequences of different lengths, packed without padding (flash_attn 2.8).

    q ``(total_q, nheads, headdim)``, k/v ``(total_k, nheads_k, headdim)``; sequence ``i`` is rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of q and ``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` of k/v (int32, length
    batch + 1, starting at 0).  ``max_seqlen_q``/``max_seqlen_k`` must be at least the longest sequence.  Rows
    of q past ``cu_seqlens_q[-1]`` (a batch padded to a fixed size) belong to no sequence: O = 0, LSE = +inf
    and zero gradients there (not written when the index values are trusted, see below).
    ``seqused_k`` (int32, (batch,)), if given, uses only the first ``seqused_k[i]`` keys of sequence ``i``.
    Causal and window masks are aligned per sequence (bottom-right); all other arguments as in
    ``flash_attn_func``.  Returns ``out (total_q, nheads, headdim)``, or with ``return_attn_probs``
    ``(out, softmax_lse (nheads, total_q) fp32, S_dmask)`` (``S_dmask`` as in ``flash_attn_func``).

    The cu_seqlens values are validated (on CUDA this costs one device-to-host copy of them); set
    ``FLASH_EXT_TRUST_CU_SEQLENS=1`` to skip that when they are known to be valid.  ``num_splits`` as in
    ``flash_attn_func``.  ``block_table`` (int32, (batch, max_pages)): paged K/V, k/v then being
    ``(num_pages, page_size, nheads_k, headdim)`` with page_size a multiple of 128; sequence ``i``'s keys
    are its first ``cu_seqlens_k[i+1] - cu_seqlens_k[i]`` rows across pages ``block_table[i, :]``.
    Dropout: the mask of sequence ``i`` uses ``i`` as the batch coordinate and rows/columns counted within
    the sequence; ``S_dmask`` is ``(batch, nheads, max_seqlen_q, max_seqlen_k)``, zero outside each
    sequence's block.
    """
    out, lse, probs, _ = varlen_forward_with_rng_state(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, seqused_k, num_splits)
    return (out, lse, probs) if return_attn_probs else out


def varlen_forward_with_rng_state(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, block_table, seqused_k, num_splits):
    """``flash_attn_varlen_func``'s work, returning ``(out, softmax_lse, S_dmask, rng_state)`` (S_dmask None
    unless ``return_attn_probs``): also for flash_attn's ``_flash_attn_varlen_forward``."""
    errors = _python_arg_errors(dropout_p, window_size, softmax_scale)
    if errors:  # the op's own rules too, checked with neutral stand-ins for what failed here
        p, window, scale = _stand_ins(errors, dropout_p, window_size, softmax_scale)

        def op_reasons() -> List[str]:
            q_, k_, v_, scale_, _ = _prepare_qkv(q, k, v, scale, rank=3, kv_rank=4 if block_table is not None else 3)
            return _op_reasons(torch.ops.flash_ext.varlen_fwd, q_, k_, v_, cu_seqlens_q, cu_seqlens_k, seqused_k,
                               size_arg(max_seqlen_q), size_arg(max_seqlen_k), scale_, bool(causal), int(window[0]),
                               int(window[1]), float(softcap), alibi_slopes, int(num_splits), block_table, float(p),
                               None, bool(deterministic))
        _refuse_with_op_reasons("flash_ext.varlen_fwd", errors, op_reasons)
    q, k, v, softmax_scale, head_dim = _prepare_qkv(q, k, v, softmax_scale, rank=3,
                                                    kv_rank=4 if block_table is not None else 3)
    out, lse, rng_state = _call_forward_op(
        torch.ops.flash_ext.varlen_fwd, (q, k, v, alibi_slopes), q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
        size_arg(max_seqlen_q), size_arg(max_seqlen_k), softmax_scale, bool(causal), int(window_size[0]),
        int(window_size[1]), float(softcap), alibi_slopes, int(num_splits), block_table, float(dropout_p), None,
        bool(deterministic))
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim]
    if not return_attn_probs:
        return out, lse, None, rng_state
    probs = torch.empty((0,), dtype=q.dtype, device=q.device)  # flash_attn: an empty S_dmask without dropout
    if dropout_p > 0 and not _C.in_plan_only():  # explain_call: no kernel wrote lse/rng_state
        probs = s_dmask_varlen(q, k, lse, rng_state, float(dropout_p), cu_seqlens_q, cu_seqlens_k,
                               size_arg(max_seqlen_q), size_arg(max_seqlen_k), softmax_scale, bool(causal),
                               (int(window_size[0]), int(window_size[1])), float(softcap), alibi_slopes, seqused_k,
                               block_table)
    return out, lse, probs, rng_state


@raises_argument_error
def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    num_splits: int = 0,
):
    """``flash_attn_varlen_func`` on packed ``qkv`` of shape ``(total, 3, nheads, headdim)`` (no copy)."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"flash_ext: qkv: got shape {tuple(qkv.shape)}; must be (total, 3, nheads, headdim)")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, num_splits=num_splits)


@raises_argument_error
def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    num_splits: int = 0,
):
    """``flash_attn_varlen_func`` with packed ``kv`` of shape ``(total_k, 2, nheads_k, headdim)`` (no copy)."""
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"flash_ext: kv: got shape {tuple(kv.shape)}; must be (total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, num_splits=num_splits)
