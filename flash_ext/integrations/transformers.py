"""flash_ext as an attention implementation of Hugging Face transformers (5.4 <= version < 6; tested on 5.24).

    import flash_ext.integrations.transformers as fx_transformers
    fx_transformers.register()                       # once per process; returns "fx_attention"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fx_attention")
    # or, on a model already built:  model.set_attn_implementation("fx_attention")

**Importing this module has no side effect**: it does not import transformers and registers nothing.
``register()`` does both, explicitly, so that which attention a model runs is decided where the model is
built, never by an import elsewhere in the program.

The name has no "flash" in it on purpose: transformers treats every name containing "flash" as a request for
the ``flash_attn`` package or a hub kernel and tries to load one.

What the model hands over and what flash_ext makes of it
=========================================================
``register()`` installs two functions under the name, one in each of transformers' interfaces:

* ``mask_interface`` in ``AttentionMaskInterface``: transformers' mask builders (``create_causal_mask`` and
  friends) call it once per forward with the mask *pattern* (a composition of index predicates such as
  causal, sliding window, packed sequences) and the user's 2-D padding mask.  It returns what
  ``attention_forward`` needs and nothing larger than ``(batch, kv_length)``:
    - ``None``: no key is padding (the dense kernel runs);
    - a bool ``(batch, <= kv_length)`` key mask, True = a real token, over the keys the layer will see; for
      causal attention it ends with the last query token, so a static cache's empty slots after it fall
      outside it (the keys past a mask's end are dropped, transformers' flash-attention convention);
    - a ``PackedSequences`` (several sequences concatenated in a row, from ``position_ids``: the varlen
      kernel runs with one sequence per segment);
    - a ``BidirectionalWindow`` (one of the above with the window the pattern states)
      where the pattern is a bidirectional sliding window: models pass their layers' ``sliding_window`` in two
      conventions there (ModernBERT the pattern's window + 1, T5Gemma's encoder the window itself), so the
      pattern's own window is taken, not the layer's argument.
  The pattern itself is read from the mask function and checked: causal or bidirectional, a sliding window,
  a chunked window that spans the whole input, packed sequences, and the unions of Gemma-3's bidirectional
  mode (``_read_union``).  Anything else (a union of patterns such as bidirectional image-token blocks, a
  custom ``and_mask_function``) is refused with a ``ValueError``, never approximated; so is a key mask with a
  gap inside a row under a sliding window (below).
* ``attention_forward`` in ``AttentionInterface``: each attention layer calls it with q ``(b, h, sq, d)``,
  k/v ``(b, hk, sk, d)`` (after the KV-cache update, so ``sk >= sq``) and that mask.  Causality comes from
  the ``is_causal`` argument or ``module.is_causal``; flash_ext's causal mask is aligned bottom-right, which
  is exactly "query i is token sk - sq + i" of a KV-cache step.  GQA/MQA need no copies (``h % hk == 0``).
    - no mask: ``flash_attn_func``;
    - a key mask, causal or with a sliding window: queries and keys are packed with the mask (``unpad_input``'s
      gather; queries with its last ``sq`` columns), ``flash_attn_varlen_func`` runs, ``pad_input`` scatters
      the output back (padding rows are 0);
    - a key mask, bidirectional without a window: only the keys are packed; every query row attends to the
      real keys of its batch entry.  This is also right for cross-attention, where the mask describes the encoder's tokens and
      says nothing about the queries;
    - ``PackedSequences``, the ``cu_seq_lens_q/k`` + ``max_length_q/k`` keyword arguments of a padding-free
      batch, or (no mask, no such arguments) a single row whose ``position_ids`` restart, as flash_attention_2
      reads them (``_packed_from_position_ids``): ``flash_attn_varlen_func`` on the flattened tokens.
  ``scaling``, ``sliding_window`` (the model's convention: a window of ``w`` keys ends at the query, so
  flash_ext's ``window_size=(w - 1, 0)``, or ``(w - 1, w - 1)`` bidirectional without a
  ``BidirectionalWindow``; with one, its ``(w, w)``: keys at distance ``<= w``), ``softcap`` (Gemma-2) and
  ``dropout`` (training) are passed through; the backward is flash_ext's (training works).  With padding, a
  sliding window counts real tokens, not positions (queries and keys are both packed): the same as eager
  attention whenever each row's real tokens are contiguous (left or right padding); a mask with a gap inside
  a row is refused when the pattern has a window.

A dense ``(batch, 1, s, s)`` mask a model builds itself (Pixtral's vision tower: one block per image) runs as
packed sequences when it is block-diagonal (``_block_diagonal``, checked exactly).  Refused with a
``ValueError`` naming the argument: any other 4-D or float mask (arbitrary additive masks cannot be
expressed), a model that folds ALiBi into its mask (Falcon's ``config.alibi``, refused when the mask is
asked for), attention sinks (``s_aux``), position biases, paged (continuous-batching) caches, an fp32 model
on CUDA (flash_ext's CUDA kernels take fp16/bf16; load the model in bf16 or run under ``torch.autocast``).
Under ``torch.autocast`` (CPU or CUDA) q, k and v run in the autocast dtype; fp32 or mixed activations in a
half-precision model (fp32 layer norms, fp32 rotary) run in the weights' dtype, as in transformers' own
flash-attention path; on the CPU an fp32 model runs in fp32.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange

from .. import bert_padding
from ..interface import flash_attn_func, flash_attn_varlen_func, size_arg

__all__ = ["DEFAULT_NAME", "SUPPORTED_VERSIONS", "BidirectionalWindow", "PackedSequences", "attention_forward",
           "mask_interface", "register"]

DEFAULT_NAME = "fx_attention"
SUPPORTED_VERSIONS = ">=5.4,<6"
"""The transformers releases whose mask-interface contract (``q_length``/``q_offset`` arguments) this
module implements; ``register()`` checks the contract itself, not the version number."""

_ERR = "flash_ext.integrations.transformers"


@dataclasses.dataclass(frozen=True)
class PackedSequences:
    """Several sequences concatenated along each row of a ``(batch, seqlen)`` input, as transformers' mask
    builders detect them from ``position_ids`` (a new sequence wherever the position does not increase by 1),
    or as flash_attention_2 reads the layers' ``position_ids`` (a new sequence wherever the position returns
    to the row's minimum; ``_packed_from_position_ids``).

    ``cu_seqlens`` (int32, ``(num_sequences + 1,)``): sequence boundaries in the flattened ``batch * seqlen``
    tokens.  ``max_seqlen``: an upper bound of the longest sequence (``seqlen``, so no device read-back)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    batch: int
    seqlen: int

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> "PackedSequences":
        """From a bool ``(batch, seqlen)`` map of the tokens that open a sequence (each row's first one among
        them): ``cu_seqlens`` over the flattened tokens, ``seqlen`` as the length bound (no read-back)."""
        begin = torch.nonzero(starts.flatten(), as_tuple=False).flatten()
        total = torch.tensor([starts.numel()], device=begin.device, dtype=begin.dtype)
        batch, seqlen = size_arg(starts.shape[0]), size_arg(starts.shape[1])
        return cls(torch.cat([begin, total]).to(torch.int32), seqlen, batch, seqlen)


@dataclasses.dataclass(frozen=True)
class BidirectionalWindow:
    """A bidirectional sliding window as the mask pattern states it (``sliding_window_bidirectional_overlay``):
    query i attends to keys j with ``|i - j| <= window``, over ``keys``: what ``mask_interface`` returns
    without a window (None: no padding; a bool ``(batch, <= kv_length)`` key mask; ``PackedSequences``).
    ``window=None``: every key, stated for models whose layers cannot say it (``_bidirectional_by_config``)."""

    keys: Optional[Any]
    window: Optional[int]


def _bidirectional_by_config(config: Any) -> bool:
    """Gemma-family configs with ``use_bidirectional_attention`` (PaliGemma's default) make every layer call
    itself non-causal (``is_causal=False``) whatever its mask: PaliGemma's text masks are causal (bidirectional
    blocks come only with ``token_type_ids``, a union, refused), and eager applies the mask.  For such models
    the mask decides: ``mask_interface`` states every non-causal pattern (a ``BidirectionalWindow``), and
    ``attention_forward`` runs the others causal."""
    return bool(getattr(config, "use_bidirectional_attention", False))


# ---------------------------------------------------------------------------------------------------------
# transformers, imported on first use
# ---------------------------------------------------------------------------------------------------------

_transformers_parts: Optional[Dict[str, Any]] = None


def _transformers() -> Dict[str, Any]:
    """The pieces of transformers this module uses, imported once; ImportError naming the requirement when
    transformers is absent or its mask-interface contract is not the one implemented here."""
    global _transformers_parts
    if _transformers_parts is not None:
        return _transformers_parts
    try:
        transformers = importlib.import_module("transformers")
        masking_utils = importlib.import_module("transformers.masking_utils")
    except ImportError as exc:
        raise ImportError(f"{_ERR}: needs Hugging Face transformers {SUPPORTED_VERSIONS} (pip install "
                          f"'flash_ext[transformers]'); importing it failed: {exc}") from exc
    version = getattr(transformers, "__version__", "?")
    contract = getattr(masking_utils, "sdpa_mask", None)
    params = inspect.signature(contract).parameters if contract is not None else {}
    if not (hasattr(transformers, "AttentionInterface") and hasattr(masking_utils, "AttentionMaskInterface")
            and "q_length" in params and "q_offset" in params):
        raise ImportError(f"{_ERR}: transformers {version} does not have the attention/mask interfaces this "
                          f"integration implements (AttentionInterface, AttentionMaskInterface with "
                          f"q_length/q_offset arguments); supported: transformers {SUPPORTED_VERSIONS}")
    _transformers_parts = {
        "version": version,
        "AttentionInterface": transformers.AttentionInterface,
        "AttentionMaskInterface": masking_utils.AttentionMaskInterface,
        "is_tracing": getattr(importlib.import_module("transformers.utils.import_utils"), "is_tracing",
                              lambda t: torch.compiler.is_compiling()),
        "patterns": _pattern_catalogue(masking_utils),
        "causal_mask_function": masking_utils.causal_mask_function,
    }
    return _transformers_parts


def _pattern_catalogue(mu) -> Dict[Any, str]:
    """Maps each mask-pattern building block of ``transformers.masking_utils`` to what it means here.

    Module-level predicates are keyed by the function; the factories (``sliding_window_overlay(w)`` and the
    like) return closures that all share one code object, so those are keyed by ``__code__``.  A block this
    release lacks is simply absent: a pattern using it is then refused, not guessed."""
    catalogue: Dict[Any, str] = {}
    for name, kind in (("causal_mask_function", "causal"), ("bidirectional_mask_function", "bidirectional")):
        if hasattr(mu, name):
            catalogue[getattr(mu, name)] = kind
    probe = torch.zeros(1, 1, dtype=torch.long)
    factories = (
        ("and_masks", lambda f: f(mu.causal_mask_function), "and"),
        ("or_masks", lambda f: f(mu.causal_mask_function), "or"),
        ("sliding_window_overlay", lambda f: f(1), "window"),
        ("sliding_window_bidirectional_overlay", lambda f: f(1), "bidirectional_window"),
        ("chunked_overlay", lambda f: f(1, probe[0]), "chunked"),
        ("packed_sequence_mask_function", lambda f: f(probe), "packed"),
        ("remap_positions_for_packed_sequence", lambda f: f(mu.causal_mask_function, probe), "remap"),
    )
    for name, build, kind in factories:
        factory = getattr(mu, name, None)
        if factory is not None:
            try:
                catalogue[build(factory).__code__] = kind
            except Exception:  # noqa: BLE001 - a changed factory signature: its patterns are refused
                pass
    return catalogue


def _closure_vars(fn: Callable) -> Dict[str, Any]:
    code, cells = fn.__code__, fn.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells, strict=True)}


def _unsupported_pattern(fn: Callable, why: str) -> ValueError:
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    return ValueError(
        f"{_ERR}: the model asks for an attention pattern flash_ext cannot express ({why}: mask function "
        f"{name}). fx_attention serves causal or bidirectional attention with padding, a sliding window, a "
        f"chunk spanning the whole input, or packed sequences; load this model with attn_implementation='sdpa' "
        f"or 'eager' instead.")


def _read_pattern(mask_function: Callable, catalogue: Dict[Any, str]) -> Dict[str, Any]:
    """Walks the composition of index predicates transformers built; returns ``{"chunk_size": int|None,
    "packed": tensor|None}``; raises for any block that is not a causal/bidirectional base, an intersection,
    a sliding window, a chunk or a packed-sequence split (all of which the flash_ext call reproduces)."""
    found: Dict[str, Any] = {"causal": False, "chunk_size": None, "packed": None, "remap": False,
                             "bidirectional_window": None, "window": False}
    stack = [mask_function]
    while stack:
        fn = stack.pop()
        kind = catalogue.get(fn) or catalogue.get(getattr(fn, "__code__", None))
        if kind == "causal":
            found["causal"] = True
        elif kind == "bidirectional":
            pass
        elif kind == "window":
            # the call's width is the layer's sliding_window argument, whose convention models share
            found["window"] = int(_closure_vars(fn)["sliding_window"])
        elif kind == "bidirectional_window":
            found["bidirectional_window"] = int(_closure_vars(fn)["sliding_window"])
        elif kind == "and":
            stack.extend(_closure_vars(fn)["mask_functions"])
        elif kind == "remap":
            found["remap"] = True
            stack.append(_closure_vars(fn)["mask_function"])
        elif kind == "chunked":
            found["chunk_size"] = int(_closure_vars(fn)["chunk_size"])
        elif kind == "packed":
            found["packed"] = _closure_vars(fn)["packed_sequence_mask"]
        elif kind == "or":
            union = _read_union(fn, catalogue)
            if union is not None:
                found["bidirectional_window"] = union  # None: every key (plain bidirectional attention)
        else:
            raise _unsupported_pattern(fn, "an unrecognised mask predicate")
    if found["remap"] and found["packed"] is None:
        raise _unsupported_pattern(mask_function, "positions remapped without a packed-sequence split")
    return found


def _probe(fn: Callable, n: int) -> Optional[torch.Tensor]:
    """``fn`` evaluated on query and key indices ``0 ... n-1`` (batch 0, head 0): a bool tensor broadcast to
    ``(n, n)``, or None when it fails or returns something else."""
    idx = torch.arange(n)
    try:
        out = fn(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :])
    except Exception:  # noqa: BLE001 - a predicate that needs other inputs: not recognised
        return None
    if isinstance(out, bool):
        out = torch.tensor(out)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        return None
    return out if out.dim() == 0 else (out.expand(n, n) if out.shape[-2:] in ((n, n), (1, n), (n, 1)) else None)


def _everything(fn: Callable) -> bool:
    """A predicate that ignores the indices and is True (``lambda *args: torch.tensor(True)``, Gemma-3's
    bidirectional mode): on index tensors of shape (n, 1) and (1, n) it returns one 0-d True."""
    out = _probe(fn, 8)
    return out is not None and out.dim() == 0 and bool(out)


def _distance_below(fn: Callable) -> Optional[int]:
    """The radius ``r`` of a model's own bidirectional-window overlay ``|q - kv| < sliding_window`` (Gemma-3's
    ``_bidirectional_window_overlay``, copied by other models), keys at distance ``<= r``; None for any other
    predicate.  Recognised by its name and integer parameter, and its values checked on a grid."""
    if getattr(fn, "__qualname__", "") != "_bidirectional_window_overlay.<locals>.inner_mask":
        return None
    width = _closure_vars(fn).get("sliding_window")
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        return None
    n = 3 * width + 3
    out, idx = _probe(fn, n), torch.arange(n)
    expected = (idx[:, None] - idx[None, :]).abs() < width
    return width - 1 if out is not None and out.dim() == 2 and torch.equal(out, expected) else None


def _read_union(fn: Callable, catalogue: Dict[Any, str]) -> Optional[int]:
    """The union (``or_masks``) that bidirectional modes build on top of a causal mask, read exactly:

    * with an operand that is always True (Gemma-3's full layers): every key; returns None;
    * a causal sliding window of ``w`` keys (``|q - kv| <= w - 1`` on the left) with a bidirectional window of
      radius ``r >= w - 1`` (Gemma-3's sliding layers): the bidirectional window; returns ``r``.

    Any other union (bidirectional image-token blocks inside a causal mask, custom overlays) is refused."""
    operands = list(_closure_vars(fn).get("mask_functions", ()))
    if any(_everything(op) for op in operands):
        return None
    radius = []
    for op in operands:
        r = _distance_below(op)
        if r is None and catalogue.get(getattr(op, "__code__", None)) == "bidirectional_window":
            r = int(_closure_vars(op)["sliding_window"])
        radius.append(r)
    if len(operands) == 2 and sum(r is not None for r in radius) == 1:
        r = next(x for x in radius if x is not None)
        base = _read_pattern(operands[radius.index(None)], catalogue)
        if (base["causal"] and base["window"] and base["window"] - 1 <= r and base["packed"] is None
                and base["chunk_size"] is None and base["bidirectional_window"] is None):
            return r
    raise _unsupported_pattern(fn, "a union of patterns, e.g. bidirectional blocks inside a causal mask")


# ---------------------------------------------------------------------------------------------------------
# the mask interface
# ---------------------------------------------------------------------------------------------------------

def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Optional[Callable] = None,
    attention_mask: Optional[torch.Tensor] = None,
    device: Any = "cpu",
    **kwargs: Any,
):
    """transformers' ``AttentionMaskInterface`` entry for flash_ext (see the module docstring).

    ``q_length``/``q_offset``: the queries are tokens ``q_offset ... q_offset + q_length - 1`` (``q_offset``
    may be a 0-d tensor under a static cache); ``kv_length``/``kv_offset``: the keys the layer will see are
    tokens ``kv_offset ... kv_offset + kv_length - 1``; ``attention_mask``: the user's 2-D padding mask over
    tokens ``0 ...`` (bool, True = real), or None.  Returns None, a bool key mask over the first ``<=
    kv_length`` keys, a ``PackedSequences``, or for a bidirectional sliding window a ``BidirectionalWindow``
    holding what it returns without one.
    """
    parts = _transformers()
    config = kwargs.get("config")
    if getattr(config, "alibi", False) is True:
        # Falcon adds ALiBi to the mask it gets here (a float tensor it needs, even without padding): refused
        # before the model's own code fails on a mask it cannot add to.
        raise ValueError(f"{_ERR}: config.alibi: got True; the model folds ALiBi, an additive position bias, into "
                         f"the attention mask, which flash_ext's transformers path cannot apply (it takes a 2-D "
                         f"padding mask); load this model with attn_implementation='sdpa' or 'eager'")
    if mask_function is None:
        mask_function = parts["causal_mask_function"]       # transformers' own default
    pattern = _read_pattern(mask_function, parts["patterns"])
    mask = _key_mask(parts, pattern, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, device)
    window = pattern["bidirectional_window"]
    stated = window is not None or (not pattern["causal"] and _bidirectional_by_config(config))
    if stated and (mask is None or isinstance(mask, PackedSequences)
                   or (isinstance(mask, torch.Tensor) and mask.dim() == 2)):
        return BidirectionalWindow(mask, window)
    return mask


def _key_mask(parts: Dict[str, Any], pattern: Dict[str, Any], batch_size: int, q_length: int, kv_length: int,
              q_offset: Any, kv_offset: int, attention_mask: Optional[torch.Tensor], device: Any):
    """mask_interface's None, key mask or PackedSequences for the pattern read (``parts``: _transformers())."""

    chunk = pattern["chunk_size"]
    if chunk is not None and kv_offset + kv_length > chunk:
        raise ValueError(f"{_ERR}: chunked attention (attention_chunk_size={chunk}) over {kv_offset + kv_length} "
                         f"tokens: flash_ext has no chunk-local mask, it serves chunked models only while the whole "
                         f"input fits in one chunk; use attn_implementation='sdpa' or 'eager' for longer inputs")

    packed = pattern["packed"]
    if packed is not None:
        # Sequence ids per token, constant inside a sequence; a new sequence starts at each row start and
        # wherever the id changes.
        ids = packed.expand(batch_size, -1)
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        return PackedSequences.from_starts(starts)

    end = kv_offset + kv_length
    if pattern["causal"]:
        # Causal self-attention: the keys end with the last query token.  A static cache hands over all its
        # slots, the empty ones after that token too; the mask then ends earlier than the keys, and
        # attention_forward drops the keys past its end (transformers' convention for flash-attention masks).
        # Under a static cache q_offset is a 0-d tensor: reading it is one device read-back per forward.
        query_end = int(q_offset) + q_length if isinstance(q_offset, torch.Tensor) else q_offset + q_length
        end = min(end, query_end)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            return attention_mask  # a prepared mask the model passes through: attention_forward refuses it
        keys = attention_mask.to(device=device, dtype=torch.bool)
        if keys.shape[-1] < end:
            keys = F.pad(keys, (0, end - keys.shape[-1]), value=False)   # tokens past the mask are not real
        keys = keys[:, kv_offset:end]
    elif end == kv_offset + kv_length:
        return None
    else:
        keys = torch.ones(batch_size, end - kv_offset, dtype=torch.bool, device=device)
    # A window that spans every key pair (w keys ending at the query; a radius r) hides nothing, gap or not.
    span = keys.shape[-1]
    causal_hides = bool(pattern["window"]) and span > pattern["window"]
    bidirectional_hides = pattern["bidirectional_window"] is not None and span - 1 > pattern["bidirectional_window"]
    if causal_hides or bidirectional_hides:
        _refuse_gaps_under_a_window(parts, keys)
    if keys.shape[-1] == kv_length and not parts["is_tracing"](keys) and bool(keys.all()):
        return None  # no padding: one read-back per forward buys the dense kernel for every layer
    return keys


_GAP_MESSAGE = (f"{_ERR}: attention_mask: a row's real tokens are not contiguous (a padding token between two real "
                f"ones) in a model with a sliding window: transformers counts the window in positions, padding "
                f"included, while flash_ext packs the real tokens and would count it in real tokens (a different "
                f"result where the gap falls inside a window; transformers' flash_attention_2 does the same silently); "
                f"pad on one side only (left or right), or use attn_implementation='sdpa' or 'eager'")


def _refuse_gaps_under_a_window(parts: Dict[str, Any], keys: torch.Tensor) -> None:
    """A sliding window over a key mask with a gap inside a row: refused (attention_forward packs the real
    tokens, which is exact for left or right padding only).  One read-back per forward; in a traced graph an
    asynchronous assertion (a RuntimeError when the graph runs) instead."""
    starts = keys[:, :1].sum(-1) + (keys[:, 1:] & ~keys[:, :-1]).sum(-1)   # runs of real tokens per row
    contiguous = (starts <= 1).all()
    if parts["is_tracing"](keys):
        torch._assert_async(contiguous, _GAP_MESSAGE)
    elif not bool(contiguous):
        raise ValueError(_GAP_MESSAGE)


# ---------------------------------------------------------------------------------------------------------
# the attention interface
# ---------------------------------------------------------------------------------------------------------

_warned_output_attentions = False


def _compute_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   module: torch.nn.Module) -> Optional[torch.dtype]:
    """The dtype to run in when q, k and v are not already one dtype the kernels take, as transformers' own
    flash-attention path decides it on every device: fp32 among them under ``torch.autocast`` (of their
    device type) becomes the autocast dtype (rotary embeddings in fp32 bring q and k back to fp32 while v stays
    in the autocast dtype); otherwise mixed dtypes, or fp32 on CUDA, become the dtype of the model's
    half-precision weights (fp32 activations in a bf16 model come from fp32 layer norms).  Mixed dtypes with
    fp32 weights run in fp32 on the CPU; on CUDA, fp32 without either is a ValueError."""
    dtypes = {query.dtype, key.dtype, value.dtype}
    device = query.device.type
    if torch.float32 in dtypes and device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    if len(dtypes) == 1 and not (device == "cuda" and query.dtype == torch.float32):
        return None
    linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    if linear is not None and linear.weight.dtype in (torch.float16, torch.bfloat16):
        return linear.weight.dtype
    if device != "cuda":
        return torch.float32
    raise ValueError(f"{_ERR}: query/key/value: got {query.dtype}/{key.dtype}/{value.dtype} on CUDA; flash_ext's "
                     f"CUDA kernels take float16/bfloat16: load the model with dtype=torch.bfloat16 (or float16), or "
                     f"run it under torch.autocast")


def _window(sliding_window: Optional[int], causal: bool, seqlen_k: int) -> Tuple[int, int]:
    if sliding_window is None or seqlen_k <= sliding_window:
        return (-1, -1)  # every key is inside the window: the unwindowed kernel gives the same result
    left = int(sliding_window) - 1
    return (left, 0) if causal else (left, left)


def _flatten(x: torch.Tensor) -> torch.Tensor:
    return rearrange(x, "b s h d -> (b s) h d")


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[Any],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """transformers' ``AttentionInterface`` entry for flash_ext (see the module docstring).

    q ``(batch, heads, seqlen_q, d)``, k/v ``(batch, heads_k, seqlen_k, d_v)``; ``attention_mask`` what
    ``mask_interface()`` returned (None, a bool ``(batch, seqlen_k)`` key mask, ``PackedSequences``).
    Returns ``(out (batch, seqlen_q, heads, d_v), None)``: attention weights are never formed.
    """
    global _warned_output_attentions
    errors = []
    if not (query.dim() == 4 and key.dim() == 4 and value.dim() == 4):
        errors.append(f"query/key/value: got {tuple(query.shape)}/{tuple(key.shape)}/{tuple(value.shape)}; must be "
                      "(batch, heads, seqlen, head_dim)")
    for name in ("s_aux", "position_bias", "block_table", "head_mask"):
        if kwargs.get(name) is not None:
            errors.append(f"{name}: given; flash_ext has no "
                          + {"s_aux": "attention sinks", "position_bias": "additive position bias",
                             "block_table": "paged (continuous-batching) KV cache",
                             "head_mask": "per-head output mask"}[name])
    mask = attention_mask
    stated_window = None  # a bidirectional window the mask pattern states (BidirectionalWindow)
    stated_bidirectional = isinstance(mask, BidirectionalWindow)
    if stated_bidirectional:
        mask, stated_window = mask.keys, mask.window
    mask_causal = None  # the causality a dense block mask states (it, not the layer's flag, is eager's truth)
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and query.dim() == 4:
        blocks = _block_diagonal(mask, query.shape[0], query.shape[2], key.shape[2])
        if blocks is not None:
            mask, mask_causal = blocks
    if isinstance(mask, torch.Tensor) and (mask.dim() != 2 or mask.is_floating_point()):
        errors.append(f"attention_mask: got a {mask.dim()}-D {mask.dtype} tensor {tuple(mask.shape)}; flash_ext takes "
                      "a 2-D padding mask (batch, seqlen) only, it cannot apply an arbitrary (e.g. 4-D) mask: one the "
                      "caller or the model builds itself (a model that passes cu_seq_lens only to implementations "
                      "named 'flash...', such as Pixtral's vision tower, builds a block mask for every other name) or "
                      "an additive bias folded into it; pass the 2-D mask, or use attn_implementation='sdpa' or "
                      "'eager' for such models")
    elif mask is not None and not isinstance(mask, (torch.Tensor, PackedSequences)):
        errors.append(f"attention_mask: got {type(mask).__name__}; must be None, a 2-D padding mask or "
                      f"PackedSequences (what {DEFAULT_NAME}'s mask function returns)")
    if errors:
        raise ValueError(f"{_ERR}.attention_forward: " + "; ".join(errors)
                         + ("" if "'eager'" in errors[-1] else
                            "; load this model with attn_implementation='sdpa' or 'eager' instead"))
    if kwargs.get("output_attentions") and not _warned_output_attentions:
        _warned_output_attentions = True
        warnings.warn(f"{_ERR}: output_attentions=True: flash_ext never forms the attention weights; they are "
                      "returned as None (use attn_implementation='eager' to get them)", stacklevel=2)

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if not stated_bidirectional and _bidirectional_by_config(getattr(module, "config", None)):
        causal = True  # the mask pattern was causal: eager attends causally whatever the layer's flag
    if mask_causal is not None:
        causal, sliding_window, stated_window = mask_causal, None, None  # the mask states the whole pattern
    batch, heads, seqlen_q, head_dim = query.shape
    seqlen_k, v_dim = key.shape[2], value.shape[-1]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))        # (b, s, h, d): flash_attn's layout
    target = _compute_dtype(query, key, value, module)
    if target is not None:
        q, k, v = q.to(target), k.to(target), v.to(target)
    # One head dim for q, k and v: zero columns change neither q.k nor the output columns that are kept.
    width = max(head_dim, v_dim)
    if head_dim < width:
        q, k = F.pad(q, [0, width - head_dim]), F.pad(k, [0, width - head_dim])
    if v_dim < width:
        v = F.pad(v, [0, width - v_dim])
    common = dict(
        dropout_p=float(dropout),
        softmax_scale=float(scaling) if scaling is not None else head_dim ** -0.5,
        causal=causal,
        window_size=((-1, -1) if stated_bidirectional and stated_window is None
                     else _window(sliding_window, causal, seqlen_k) if stated_window is None
                     else (stated_window, 0 if causal else stated_window)),
        softcap=float(softcap) if softcap else 0.0,
        deterministic=bool(kwargs.get("deterministic") or False),
    )

    varlen_kwargs = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if mask is None and not all(x is not None for x in varlen_kwargs):
        mask = _packed_from_position_ids(kwargs.get("position_ids"), batch, seqlen_q, seqlen_k)
    if isinstance(mask, PackedSequences):
        if not (seqlen_q == seqlen_k == mask.seqlen and batch == mask.batch):
            raise ValueError(f"{_ERR}.attention_forward: attention_mask: packed sequences of shape ({mask.batch}, "
                             f"{mask.seqlen}) for queries ({batch}, {seqlen_q}) and keys ({batch}, {seqlen_k}); "
                             "they must all agree (packed sequences are a forward without a cache)")
        out = _varlen_flat(q, k, v, mask.cu_seqlens, mask.cu_seqlens, mask.max_seqlen, mask.max_seqlen, common)
    elif mask is not None:
        out = _padded(q, k, v, mask, common)
    elif all(x is not None for x in varlen_kwargs):
        cu_q, cu_k, max_q, max_k = varlen_kwargs
        out = _varlen_flat(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), size_arg(max_q), size_arg(max_k), common)
    else:
        out = flash_attn_func(q, k, v, **common)
    if out.shape[-1] != v_dim:
        out = out[..., :v_dim]
    return out, None


class _LastRead:
    """What a reader of a model-wide tensor (``position_ids``, a dense mask) found for the tensor it last read,
    so the layers of one forward, which share the tensor, pay for one read (a device read-back) instead of
    one each.  Keyed by identity and version counter; inference tensors (``torch.inference_mode``, as
    transformers' pipelines run) keep no version counter and are read every time."""

    def __init__(self) -> None:
        self._entry: Tuple[Any, int, Any] = (None, -1, None)

    def get(self, tensor: torch.Tensor, read: Callable[[], Any]) -> Any:
        version = -1 if tensor.is_inference() else tensor._version
        seen, seen_version, value = self._entry
        if version >= 0 and seen is not None and seen() is tensor and seen_version == version:
            return value
        value = read()
        if version >= 0:
            self._entry = (weakref.ref(tensor), version, value)
        return value


_position_ids_read = _LastRead()
_dense_mask_read = _LastRead()


def _block_diagonal(mask: torch.Tensor, batch: int, seqlen_q: int,
                    seqlen_k: int) -> Optional[Tuple[PackedSequences, bool]]:
    """A dense ``(batch or 1, heads or 1, s, s)`` mask that models build themselves for names without "flash"
    (Pixtral's vision tower: one block per image), read exactly when it is block-diagonal: every row sees one
    contiguous block of its row's tokens, the blocks tile the row, optionally causal inside each block, the
    same for every head.  The mask is boolean (True = attend) or additive with only 0 and masked values (-inf
    or the dtype's minimum: no bias).  Returns ``(PackedSequences, causal)``, or None for any other mask
    (refused by the caller), a row that sees no key, or in a traced graph (the check reads the mask back)."""
    if not (mask.dim() == 4 and mask.shape[0] in (1, batch) and seqlen_q == seqlen_k
            and tuple(mask.shape[-2:]) == (seqlen_q, seqlen_k)) or _transformers()["is_tracing"](mask):
        return None
    return _dense_mask_read.get(mask, lambda: _read_blocks(mask, batch, seqlen_q))


def _read_blocks(mask: torch.Tensor, batch: int, s: int) -> Optional[Tuple[PackedSequences, bool]]:
    m = mask[:, 0]
    if mask.shape[1] > 1 and not torch.equal(mask, m[:, None].expand_as(mask)):
        return None  # heads with different masks
    m = m.expand(batch, s, s)  # one mask broadcast over the batch
    if m.dtype == torch.bool:
        allowed = m
    elif m.is_floating_point():
        allowed = m == 0
        if not bool((allowed | (m <= torch.finfo(m.dtype).min)).all()):
            return None  # values other than 0 and masked: an additive bias
    else:
        return None
    idx = torch.arange(s, device=m.device)
    if not bool(allowed.any(-1).all()):
        return None
    first = torch.where(allowed, idx, s).amin(-1)                           # (b, s): each row's first key
    starts = first == idx                                                   # rows that open a block
    if not torch.equal(first, torch.cummax(torch.where(starts, idx, 0), -1).values):
        return None  # a row's first key is not the start of its block
    following = torch.cat([torch.where(starts, idx, s)[:, 1:], torch.full_like(first[:, :1], s)], -1)
    last = following.flip(-1).cummin(-1).values.flip(-1) - 1                # (b, s): the end of each row's block
    block = (idx >= first[..., None]) & (idx <= last[..., None])            # (b, s, s)
    if torch.equal(allowed, block):
        causal = False
    elif torch.equal(allowed, block & (idx[None, :] <= idx[:, None])):
        causal = True
    else:
        return None
    return PackedSequences.from_starts(starts), causal


def _packed_from_position_ids(position_ids: Any, batch: int, seqlen_q: int,
                              seqlen_k: int) -> Optional[PackedSequences]:
    """Packed sequences told apart only by ``position_ids`` (``DataCollatorWithFlattening``'s default output),
    found as transformers' flash_attention_2 finds them: one row of more than one token, a new sequence wherever
    the position returns to the row's minimum.  transformers' mask builders look for packing only without a
    cache, so with ``use_cache`` (the default, also in training) eager attention lets such sequences attend to
    each other; flash_attention_2 does not, nor does this.  The check reads the positions back once per forward (the decoder layers share the
    tensor); in a traced graph it is skipped (eager attention's semantics: pass ``cu_seq_lens_*``, e.g.
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, or ``use_cache=False``)."""
    if not (isinstance(position_ids, torch.Tensor) and batch == 1 and 1 < seqlen_q == seqlen_k
            and position_ids.dim() == 2 and tuple(position_ids.shape) == (1, seqlen_q)
            and not position_ids.is_floating_point()):
        return None
    if _transformers()["is_tracing"](position_ids):
        return None
    return _position_ids_read.get(position_ids, lambda: _read_restarts(position_ids[0]))


def _read_restarts(positions: torch.Tensor) -> Optional[PackedSequences]:
    # flash_attention_2's rule: a sequence starts where the position is the row's minimum (0, or RoBERTa-style
    # padding_idx + 1); a gap in the positions without a restart stays one sequence, as eager keeps it.
    starts = positions == positions.min()
    starts[0] = True
    if not bool(starts[1:].any()):
        return None
    return PackedSequences.from_starts(starts[None])


def _varlen_flat(q, k, v, cu_q, cu_k, max_q, max_k, common) -> torch.Tensor:
    """Padding-free rows: the tokens of each row are already sequences back to back."""
    batch = q.shape[0]
    out = flash_attn_varlen_func(_flatten(q), _flatten(k), _flatten(v), cu_q, cu_k, max_q, max_k, **common)
    return rearrange(out, "(b s) h d -> b s h d", b=batch)


def _padded(q, k, v, mask: torch.Tensor, common) -> torch.Tensor:
    """A 2-D key mask: pack the real keys (and for causal or windowed attention the real queries), run varlen,
    unpack."""
    batch, seqlen_q = q.shape[0], q.shape[1]
    keys = mask.bool()
    if keys.shape[0] != batch:
        raise ValueError(f"{_ERR}.attention_forward: attention_mask: got batch {keys.shape[0]}; the keys have batch "
                         f"{batch}")
    # transformers' convention for flash-attention masks: a longer mask ends with the last key; a shorter one
    # ends with the last real key, and the keys after it are a static cache's empty slots.
    if keys.shape[1] > k.shape[1]:
        keys = keys[:, -k.shape[1]:]
    elif keys.shape[1] < k.shape[1]:
        k, v = k[:, :keys.shape[1]], v[:, :keys.shape[1]]
    seqlen_k = k.shape[1]
    idx_k, cu_k, _ = bert_padding._mask_to_varlen(keys)
    k_unpad = bert_padding.index_first_axis(_flatten(k), idx_k)
    v_unpad = bert_padding.index_first_axis(_flatten(v), idx_k)
    # max_seqlen: the padded lengths bound every sequence and need no device read-back.
    windowed = tuple(common["window_size"]) != (-1, -1)
    if not common["causal"] and not windowed:
        # Each query row attends to its row's real keys, whatever the row is (a padding query's output is as
        # unused as eager's); queries stay in place, so cross-attention (mask over the encoder) is right too.
        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, device=q.device, dtype=torch.int32)
        out = flash_attn_varlen_func(_flatten(q), k_unpad, v_unpad, cu_q, cu_k, seqlen_q, seqlen_k, **common)
        return rearrange(out, "(b s) h d -> b s h d", b=batch)
    if seqlen_q > seqlen_k:
        kind = "causal" if common["causal"] else "windowed"
        raise ValueError(f"{_ERR}.attention_forward: {kind} attention with {seqlen_q} queries but {seqlen_k} keys: "
                         "the queries must be the last keys (self-attention)")
    # Causal or windowed self-attention: the queries are the last seqlen_q tokens, so the mask's last columns
    # say which are real.  Packing both sides keeps every real token's order, and bottom-right alignment then
    # puts each real query right after the real keys before it (its real successors are all among the
    # queries), so a window counts real tokens on both sides.  With the queries left in place, a right-padded
    # row's window was shifted by its padding (the kernel aligns the last query with the last real key).
    if seqlen_q == seqlen_k:
        idx_q, cu_q = idx_k, cu_k
    else:
        idx_q, cu_q, _ = bert_padding._mask_to_varlen(keys[:, -seqlen_q:])
    q_unpad = bert_padding.index_first_axis(_flatten(q), idx_q)
    out = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_q, cu_k, seqlen_q, seqlen_k, **common)
    return bert_padding.pad_input(out, idx_q, batch, seqlen_q)


# ---------------------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------------------

_RESERVED = ("eager", "sdpa", "flex_attention")


def register(name: str = DEFAULT_NAME) -> str:
    """Registers flash_ext under ``name`` with transformers' ``AttentionInterface`` (``attention_forward``) and
    ``AttentionMaskInterface`` (``mask_interface``), for every model of the process; returns ``name``.

    Then ``from_pretrained(..., attn_implementation=name)`` or ``model.set_attn_implementation(name)``.
    Calling it again is harmless.  ``name`` must not contain "flash" (transformers would try to load
    flash_attn or a hub kernel for it), "/" or ":" (hub kernel syntax), nor a "paged|" prefix, nor be one of
    transformers' own implementations.  ImportError when transformers is missing or unsupported.
    """
    errors = []
    if not isinstance(name, str) or not name:
        errors.append(f"name: got {name!r}; must be a non-empty string")
    else:
        if "flash" in name.lower():
            errors.append(f"name: got {name!r}; must not contain 'flash' (transformers reserves such names for "
                          "flash_attn and hub kernels and would try to load one)")
        if "/" in name or ":" in name or name.startswith("paged|"):
            errors.append(f"name: got {name!r}; '/', ':' and a 'paged|' prefix have meanings to transformers "
                          "(hub kernels, paged caches)")
        if name in _RESERVED:
            errors.append(f"name: got {name!r}; that is one of transformers' own implementations")
    if errors:
        raise ValueError(f"{_ERR}.register: " + "; ".join(errors))
    parts = _transformers()
    parts["AttentionInterface"].register(name, attention_forward)
    parts["AttentionMaskInterface"].register(name, mask_interface)
    return name
