"""The pass rule of the gradient tests (flash-attention's own backward rule).

With ``g64`` the float64 autograd gradient and ``g_pt`` the gradient of the same-dtype PyTorch reference
(``attention_grad_ref(..., upcast=False)``, see flash_ext/reference.py), for each of dq, dk, dv:

    max|g - g64| <= 3 * max|g_pt - g64| + GRAD_FLOOR[dtype] * G,   G = max(max|dq64|, max|dk64|, max|dv64|)

The floor only matters where the same-dtype reference is (nearly) exact: fp32 (whose reference error is ~1e-7
relative while the kernel's fp32 P comes from a polynomial exp2 with ~2e-7), or gradients that vanish
exactly (one key per row: P = 1 and dS = P (dP - D) = 0, which the kernel reaches up to the rounding of
terms of the size of dv).  It is relative to the largest of the three gradients, the scale of those terms.  About half an ulp of the dtype at the gradient's scale for fp16/bf16; wrong
masking, scaling or a missing term shows up as errors of 1e-2 .. 1 relative.

Exact properties are asserted too: no NaN; query rows that see no key get dq == 0 exactly, and keys no query
row sees get dk == dv == 0 exactly (never NaN).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from flash_ext.reference import attention_grad_ref, visibility_mask

GRAD_FLOOR = {torch.float16: 5e-4, torch.bfloat16: 4e-3, torch.float32: 2e-5}


def _cpu(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().cpu()


def check_grads(grads: Sequence[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                dout: torch.Tensor, *, softmax_scale: Optional[float] = None, causal: bool = False,
                window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                alibi_slopes: Optional[torch.Tensor] = None, dlse: Optional[torch.Tensor] = None,
                dropout_p: float = 0.0, dropout_mask: Optional[torch.Tensor] = None, context: str = "") -> dict:
    """Asserts the rule above for kernel gradients ``grads = (dq, dk, dv)`` of fixed-length inputs
    ``q (b, sq, h, d)``, ``k``/``v (b, sk, hk, d)`` and upstream gradient ``dout`` (and ``dlse`` of the LSE,
    when the loss also depends on it; ``dropout_mask`` (b, h, sq, sk) with ``dropout_p``, the forward's keep
    mask).  Returns the errors."""
    dtype = q.dtype
    q, k, v, dout = _cpu(q), _cpu(k), _cpu(v), _cpu(dout)
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
              alibi_slopes=_cpu(alibi_slopes), dlse=_cpu(dlse), dropout_p=dropout_p, dropout_mask=_cpu(dropout_mask))
    ref64 = attention_grad_ref(q, k, v, dout, upcast=True, **kw)
    ref_pt = attention_grad_ref(q, k, v, dout, upcast=False, **kw)
    sq, sk = q.shape[1], k.shape[1]
    visible = visibility_mask(sq, sk, causal, window_size)
    empty_rows, unseen_keys = ~visible.any(1), ~visible.any(0)
    res = {}
    grad_scale = max((g.abs().max().item() for g in ref64 if g.numel()), default=0.0)
    for name, g, like, g64, gpt in zip(("dq", "dk", "dv"), grads, (q, k, v), ref64, ref_pt):
        assert g.shape == like.shape, f"{context}: {name}.shape {tuple(g.shape)} != {tuple(like.shape)}"
        assert g.dtype == dtype, f"{context}: {name}.dtype {g.dtype}"
        g = g.detach().cpu()
        assert not torch.isnan(g).any(), f"{context}: NaN in {name} at {torch.isnan(g).nonzero()[:5].tolist()}"
        if g.numel() == 0:
            continue
        zero = g[:, empty_rows] if name == "dq" else g[:, unseen_keys]
        assert (zero == 0).all(), f"{context}: {name} must be exactly 0 where no key/query is visible"
        err = (g.double() - g64).abs().max().item()
        err_pt = (gpt.double() - g64).abs().max().item()
        scale = g64.abs().max().item()
        bound = 3 * err_pt + GRAD_FLOOR[dtype] * grad_scale
        res[name] = (err, err_pt, scale)
        assert err <= bound, (f"{context}: max|{name} - ref64| = {err:.3e} > bound {bound:.3e} (same-dtype "
                              f"reference error {err_pt:.3e}, max|{name}| {scale:.3e})")
    return res
