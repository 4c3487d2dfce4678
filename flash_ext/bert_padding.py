"""Padding helpers with the API of flash_attn 2.8's ``flash_attn.bert_padding``.

A padded batch ``(batch, seqlen, ...)`` with a 2-D mask becomes the packed layout of the varlen functions
(``(total_nnz, ...)`` plus ``cu_seqlens``) and back:

    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out_unpad = flash_ext.flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens,
                                                 max_seqlen, max_seqlen, causal=True)
    out = pad_input(out_unpad, indices, batch, seqlen)      # padding rows are 0

``indices`` are positions in the flattened ``(batch * seqlen)`` axis, in row-major order, so the tokens of
batch entry ``i`` stay contiguous and in order: that is what makes ``cu_seqlens`` (the running sum of the
per-row counts) describe the packed tensor.  The gathers and scatters are autograd functions whose
backward is the matching scatter or gather, so gradients flow through unpad/pad as through flash_attn's.

Differences from flash_attn 2.8, all on inputs flash_attn does not define: bad shapes raise ``ValueError``
(flash_attn asserts or fails inside torch); repeated indices accumulate their gradients (flash_attn's
scatter keeps one of them); ``unpad_input`` combines ``attention_mask`` and ``unused_mask`` with a logical
or (flash_attn adds them, which double-counts a token marked in both).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange

from .errors import ArgumentError
from .interface import size_arg

__all__ = [
    "IndexFirstAxis", "IndexPutFirstAxis", "IndexFirstAxisResidual", "index_first_axis", "index_put_first_axis",
    "index_first_axis_residual", "unpad_input", "unpad_input_for_concatenated_sequences", "pad_input",
]


def _check_indices(indices: torch.Tensor) -> list:
    """The rule ``indices`` breaks, as a one-element list, or []."""
    errors = []
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        got = f"{indices.dtype} {tuple(indices.shape)}" if isinstance(indices, torch.Tensor) else type(indices).__name__
        errors.append(f"indices: got {got}; must be a 1-D int64 (or int32) tensor")
    return errors


def _raise(fn: str, errors: list) -> None:
    if errors:
        raise ArgumentError(f"flash_ext.bert_padding.{fn}: " + "; ".join(errors))


class IndexFirstAxis(torch.autograd.Function):
    """``input[indices]`` along the first axis; the backward scatters the gradient into zeros."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        # One row gather on the trailing dims flattened: a single index_select instead of the generic
        # advanced-indexing path (which would also accept a bool mask and expand it).
        rows = rearrange(input, "n ... -> n (...)")
        return rows.index_select(0, indices).reshape(-1, *input.shape[1:])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        grad = rearrange(grad_output, "z ... -> z (...)")
        grad_input = grad.new_zeros(ctx.first_axis_dim, grad.shape[1]).index_add_(0, indices, grad)
        return grad_input.reshape(ctx.first_axis_dim, *grad_output.shape[1:]), None


class IndexPutFirstAxis(torch.autograd.Function):
    """A zero tensor of ``first_axis_dim`` rows with ``values`` written at rows ``indices``; the backward gathers."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        output = values.new_zeros(first_axis_dim, *values.shape[1:])
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return grad_output.index_select(0, indices), None, None


class IndexFirstAxisResidual(torch.autograd.Function):
    """``(input[indices], input)``: the gather plus the input itself as a second output (a residual branch);
    the backward adds the gathered rows' gradient into the residual's."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor):
        ctx.save_for_backward(indices)
        # The second output is a detached alias: returning `input` itself would make autograd treat the
        # output as a view of an input, which in-place use downstream would then trip over.
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor, grad_residual: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return grad_residual.index_add(0, indices, grad_output), None


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` of ``input`` ``(n, ...)`` (``input.dim() >= 2``): ``(len(indices), ...)``, differentiable."""
    errors = _check_indices(indices)
    if not isinstance(input, torch.Tensor) or input.dim() < 2:
        errors.insert(0, f"input: got {tuple(input.shape) if isinstance(input, torch.Tensor) else input!r}; "
                         "must be a tensor of at least 2 dims (first axis indexed)")
    _raise("index_first_axis", errors)
    return IndexFirstAxis.apply(input, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A zero tensor ``(first_axis_dim, ...)`` with ``values`` ``(len(indices), ...)`` at rows ``indices``;
    differentiable in ``values``."""
    errors = _check_indices(indices)
    if not isinstance(values, torch.Tensor) or values.dim() < 2:
        errors.insert(0, f"values: got {tuple(values.shape) if isinstance(values, torch.Tensor) else values!r}; "
                         "must be a tensor of at least 2 dims")
    elif not errors and values.shape[0] != indices.shape[0]:
        errors.append(f"values/indices: got {values.shape[0]} rows for {indices.shape[0]} indices; must match")
    _raise("index_put_first_axis", errors)
    return IndexPutFirstAxis.apply(values, indices, int(first_axis_dim))


def index_first_axis_residual(input: torch.Tensor, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(input[indices], input)`` with both outputs differentiable (see ``IndexFirstAxisResidual``)."""
    errors = _check_indices(indices)
    if not isinstance(input, torch.Tensor) or input.dim() < 2:
        errors.insert(0, f"input: got {tuple(input.shape) if isinstance(input, torch.Tensor) else input!r}; "
                         "must be a tensor of at least 2 dims")
    _raise("index_first_axis_residual", errors)
    return IndexFirstAxisResidual.apply(input, indices)


def _mask_to_varlen(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices, cu_seqlens, seqlens)`` of a 2-D bool mask: the flattened positions of its True entries
    (int64, row-major), the int32 running count per row starting at 0, and the int32 count per row.  No
    device-to-host copy beyond the one ``nonzero`` needs for its output size (callers that know a bound on
    the longest row pass that as ``max_seqlen`` instead of reading it back)."""
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, seqlens


def _check_batch_mask(fn: str, hidden_states: torch.Tensor, masks: dict) -> None:
    errors = []
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        errors.append(f"hidden_states: got {tuple(getattr(hidden_states, 'shape', ()))}; must be (batch, seqlen, ...)")
    for name, mask in masks.items():
        if mask is None:
            continue
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.is_floating_point() or mask.is_complex():
            got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            errors.append(f"{name}: got {got}; must be a 2-D bool or integer tensor (batch, seqlen)")
        elif not errors and tuple(mask.shape) != tuple(hidden_states.shape[:2]):
            errors.append(f"{name}: got shape {tuple(mask.shape)}; must equal hidden_states' (batch, seqlen) = "
                          f"{tuple(hidden_states.shape[:2])}")
    _raise(fn, errors)


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Packs the tokens a 2-D mask selects (flash_attn 2.8 ``unpad_input``).

    * ``hidden_states`` ``(batch, seqlen, ...)``; ``attention_mask`` ``(batch, seqlen)`` bool or integer,
      nonzero = a real token.  ``unused_mask`` (same shape, optional): tokens that are allocated but unused
      (e.g. reserved slots after a row's real tokens); they are packed too, but not counted in ``seqused``.

    Returns ``(hidden_states_unpad (total_nnz, ...), indices (total_nnz,) int64, cu_seqlens (batch + 1,)
    int32, max_seqlen_in_batch: int, seqused (batch,) int32)``: ``indices`` are the selected positions of
    the flattened ``(batch * seqlen)`` axis, ``cu_seqlens`` the running count of selected tokens per row
    starting at 0, ``seqused`` the count of ``attention_mask`` tokens per row.  A row without tokens gets a
    zero-length sequence.  ``max_seqlen_in_batch`` is a Python int (one device-to-host copy on CUDA).
    """
    _check_batch_mask("unpad_input", hidden_states, {"attention_mask": attention_mask, "unused_mask": unused_mask})
    used = attention_mask.bool()
    selected = used | unused_mask.bool() if unused_mask is not None else used
    indices, cu_seqlens, seqlens = _mask_to_varlen(selected)
    max_seqlen = seqlens.max().item() if seqlens.numel() > 0 else 0  # an int (a SymInt when compiled)
    tokens = rearrange(hidden_states, "b s ... -> (b s) ...")
    return (IndexFirstAxis.apply(tokens, indices), indices, cu_seqlens, max_seqlen,
            used.sum(dim=-1, dtype=torch.int32))


def unpad_input_for_concatenated_sequences(
    hidden_states: torch.Tensor,
    attention_mask_in_length: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Packs rows that each hold several sequences back to back (flash_attn 2.8).

    ``attention_mask_in_length`` ``(batch, seqlen)`` integer: row ``i`` lists the lengths of the sequences
    concatenated at the start of ``hidden_states[i]``, followed by zeros, e.g. ``[2, 3, 0, 0, 0, 0]`` is a
    2-token sequence then a 3-token one, and position 5 is padding.  Every sequence becomes its own varlen
    sequence, so attention never crosses from one into the next.

    Returns ``(hidden_states_unpad (total_nnz, ...), indices (total_nnz,), cu_seqlens (num_sequences + 1,)
    int32, max_seqlen_in_batch: int)``.
    """
    _check_batch_mask("unpad_input_for_concatenated_sequences", hidden_states,
                      {"attention_mask_in_length": attention_mask_in_length})
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    # Each row's sequences fill its first sum(lengths) positions; the rest is padding.
    positions = torch.arange(seqlen, device=lengths.device)
    selected = positions[None, :] < lengths.sum(dim=-1, keepdim=True)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    flat_lengths = lengths.flatten()
    seqlens = flat_lengths[flat_lengths != 0]
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = seqlens.max().item() if seqlens.numel() > 0 else 0  # an int (a SymInt when compiled)
    tokens = rearrange(hidden_states, "b s ... -> (b s) ...")
    return IndexFirstAxis.apply(tokens, indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of ``unpad_input``: ``hidden_states`` ``(total_nnz, ...)`` written at ``indices`` of a zero
    ``(batch, seqlen, ...)`` tensor (flash_attn 2.8 ``pad_input``); differentiable."""
    errors = _check_indices(indices)
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        errors.insert(0, f"hidden_states: got {tuple(getattr(hidden_states, 'shape', ()))}; must be (total_nnz, ...)")
    elif not errors and hidden_states.shape[0] != indices.shape[0]:
        errors.append(f"hidden_states/indices: got {hidden_states.shape[0]} rows for {indices.shape[0]} indices; "
                      "must match")
    _raise("pad_input", errors)
    batch, seqlen = size_arg(batch), size_arg(seqlen)
    output = IndexPutFirstAxis.apply(hidden_states, indices, batch * seqlen)
    return rearrange(output, "(b s) ... -> b s ...", b=batch)
