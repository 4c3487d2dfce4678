"""Merging partial attention results through their log-sum-exp, the rule of flash_ext's split-KV combine
(csrc/flash_ext/combine.h) applied one partial at a time.

A partial over a subset of the keys is ``(O_s, LSE_s)``: ``O_s`` normalised by its own softmax sum,
``LSE_s = log`` of that sum.  Over all partials ``LSE = log sum_s exp(LSE_s)`` and
``O = sum_s exp(LSE_s - LSE) O_s``.  Folding them in one at a time into a running ``(O, LSE)`` in fp32 gives
the same result up to fp32 rounding.  Edge rows, as the combine treats them:

* a partial whose row saw no key weighs exactly 0.  flash_ext's ops report such a row as ``O = 0``,
  ``LSE = +inf``; the merge reads that ``+inf`` as ``-inf`` (an empty sum), as the combine's split
  accumulators do;
* a row that no partial saw ends with ``O = 0`` and ``LSE = +inf`` (``finalize``);
* a NaN partial LSE (a NaN score) makes the row's O and LSE NaN for good (it reaches both weights through
  the exponents; the combine needs an explicit flag for that only because its ``fmaxf`` drops NaN);
* a NaN in ``O_s`` with a finite weight (a NaN value row) makes those O columns NaN.

Stability: both exponents are taken relative to the larger LSE, so each weight is in ``[0, 1]`` and their sum
in ``[1, 2]`` (or 0 when neither side has seen a key; the running maximum is then replaced by 0 so that no
``-inf - (-inf)`` appears).
"""
from __future__ import annotations

import torch

__all__ = ["merge_partial_", "finalize"]


def merge_partial_(out: torch.Tensor, lse: torch.Tensor, out_s: torch.Tensor, lse_s: torch.Tensor) -> None:
    """Folds the partial ``(out_s, lse_s)`` into the running ``(out, lse)`` in place.

    ``out`` fp32 ``(b, s, h, d)`` and ``lse`` fp32 ``(b, h, s)`` (views into the running accumulators are fine);
    ``out_s`` of the same shape in any float dtype and ``lse_s`` fp32 ``(b, h, s)`` as flash_ext's ops return
    them (``+inf`` on rows that saw no key).  The running ``lse`` uses ``-inf`` for "no key yet"; start from
    ``out = 0``, ``lse = -inf``.
    """
    lse_s = lse_s.masked_fill(lse_s == float("inf"), float("-inf"))
    top = torch.maximum(lse, lse_s)
    top = top.masked_fill(top == float("-inf"), 0.0)
    w_run = torch.exp(lse - top)
    w_new = torch.exp(lse_s - top)
    total = w_run + w_new
    lse.copy_(top + torch.log(total))
    inv = torch.where(total == 0, torch.zeros_like(total), total.reciprocal())
    # (b, h, s) -> (b, s, h, 1) to scale rows of (b, s, h, d)
    a = (w_run * inv).transpose(1, 2).unsqueeze(-1)
    c = (w_new * inv).transpose(1, 2).unsqueeze(-1)
    out.mul_(a).add_(out_s.to(torch.float32) * c)


def finalize(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> tuple:
    """The merged result in flash_ext's convention: ``out`` in ``dtype``, rows no partial saw (``lse == -inf``)
    get ``lse = +inf`` (their ``out`` is already exactly 0)."""
    return out.to(dtype), lse.masked_fill(lse == float("-inf"), float("inf"))
