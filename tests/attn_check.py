"""Input generation and the FA2-style pass rule shared by the forward tests.

Pass rule (as in flash-attention's own tests): with ``ref64`` the float64 reference and ``ref_same`` the
same-dtype reference (``attention_ref(..., upcast=False)``, see flash_ext/reference.py):

    max|out - ref64| <= 2 * max|ref_same - ref64| + OUT_FLOOR[dtype]
    max|lse - lse64| <= 2 * max|lse_same - lse64| + LSE_FLOOR[dtype]      (over rows with finite lse64)

i.e. the kernel may be at most twice as far from the exact answer as a straightforward framework
implementation in the same dtype.  The floors only matter when the same-dtype reference happens to be
(nearly) exact, e.g. one key per row, where ``out`` is a copy of a ``v`` row:

* OUT_FLOOR is about one unit in the last place of the dtype at 0.5 (the typical size of an output
  element): fp16 2.5e-4 (ulp(0.5) = 4.9e-4, so a kernel off by a full ulp at |out|~1 still fails),
  bf16 2e-3 (ulp(0.5) = 3.9e-3), fp32 1e-5 (a few hundred fp32 ulps; wrong masking, scaling or
  normalisation shows up as errors of 1e-2 .. 1).
* LSE_FLOOR: lse is always computed and stored in fp32 from fp32 scores; values are O(1..10) so fp32
  rounding is ~1e-6.  1e-4 for every dtype.

In addition, exact properties are asserted: no NaN anywhere, ``lse == +inf`` exactly on the rows where the
reference has ``+inf`` (rows that see no key) and nowhere else, and ``out == 0`` exactly on those rows.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from flash_ext.reference import attention_ref
from conftest import skip_unless_head_dim_built

OUT_FLOOR = {torch.float16: 2.5e-4, torch.bfloat16: 2e-3, torch.float32: 1e-5}
LSE_FLOOR = {torch.float16: 1e-4, torch.bfloat16: 1e-4, torch.float32: 1e-4}
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def make_qkv(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_k: int, head_dim: int,
             dtype: torch.dtype, device="cpu", q_scale: float = 1.0):
    """Standard-normal q, k, v (q optionally multiplied by q_scale) in the requested dtype/device.  Skips the
    calling test when this build has no kernel for `head_dim` on `device` (partial builds)."""
    skip_unless_head_dim_built(device, head_dim)
    q = (torch.randn(batch, seqlen_q, nheads, head_dim) * q_scale).to(dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim).to(dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim).to(dtype=dtype, device=device)
    return q, k, v


def make_alibi(batch: int, nheads: int, per_batch: bool = True, device="cpu") -> torch.Tensor:
    """fp32 slopes in [0, 0.3) (FA2's test distribution), shape (batch, nheads) or (nheads,)."""
    shape = (batch, nheads) if per_batch else (nheads,)
    return (torch.rand(*shape) * 0.3).to(device)


RISING_PATTERNS = ["rising_far", "rising_near", "spikes"]


def make_rising_maxima_qkv(pattern: str, dtype: torch.dtype, device="cpu", sq: int = 100, sk: int = 600,
                           d: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (1, s, h=2 / h_k=1, d) whose row maxima keep rising as the kernels walk the K/V tiles right to
    left (softmax.h: the references lag a row's maximum by up to a slack of 8 log2 units).  With the default
    scale 1/sqrt(64), score(j) * scale ~ k[j, 0] + noise of ~1:

    * ``rising_far``: +0.125 per key to the left, 23 log2 units per 128-key tile (a move on every tile);
    * ``rising_near``: +0.0125 per key, 2.3 log2 units per 128 keys (the slack is crossed every few tiles,
      the probabilities in between reach up to 2^8);
    * ``spikes``: one key every 97 well above the rest, higher to the left.
    """
    assert pattern in RISING_PATTERNS, pattern
    q, k, v = (torch.randn(1, s, h, d) for s, h in ((sq, 2), (sk, 1), (sk, 1)))
    keys_from_right = torch.arange(sk - 1, -1, -1, dtype=torch.float32)  # 0 at the right-most key
    q[..., 0] = 8.0
    if pattern == "rising_far":
        k[0, :, 0, 0] = keys_from_right * 0.125
    elif pattern == "rising_near":
        k[0, :, 0, 0] = keys_from_right * 0.0125
    else:
        k[0, :, 0, 0] = 0.0
        spikes = torch.arange(50, sk, 97)
        k[0, spikes, 0, 0] = 4.0 + keys_from_right[spikes] * 0.05
    return tuple(t.to(dtype=dtype, device=device) for t in (q, k, v))


def make_large_score_qkv(dtype: torch.dtype, causal: bool, device="cpu", b: int = 1, sq: int = 16, sk: int = 300,
                         h: int = 4, hk: int = 4, d: int = 64):
    """q, k, v with huge scores that every dtype and fp32 accumulation hold exactly, and the expected result
    computed from integers (not from a softmax).  q = magnitude * u and k = magnitude * w with u, w in
    {-1, 0, 1}^d, so score(i, j) = magnitude^2 * (u_i . w_j), magnitude 2^15 in fp16 (its largest power of
    two) and 2^40 otherwise: at the default scale 1/8, at least 2^27 apart per unit of the integer dot
    product, so every key below a row's largest dot weighs exp(-2^27) = 0, and the row's output is the mean of
    v over the keys that reach it (ties included); its LSE is that dot * magnitude^2 / 8 + log(count).
    K/V have hk heads (query head i reads K/V head i // (h / hk)).  Returns (q, k, v, out_expected,
    lse_expected), the expected values in float64 on the CPU, out as (b, sq, h, d) and lse as (b, h, sq)."""
    assert d == 64, "the scale 1/8 is exact at head dim 64"
    magnitude = 2.0 ** 15 if dtype == torch.float16 else 2.0 ** 40
    u = torch.randint(-1, 2, (b, sq, h, d))
    w = torch.randint(-1, 2, (b, sk, hk, d))
    w[:, sk // 2] = w[:, sk // 3]  # a tie for some rows at least (the same key twice)
    v = torch.randn(b, sk, hk, d).to(dtype)
    dots = torch.einsum("bihd,bjhd->bhij", u, w.repeat_interleave(h // hk, dim=2))  # int64, exact
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    dots = dots.masked_fill(~visible, -10 ** 9)
    best = dots.max(dim=-1, keepdim=True).values
    winners = (dots == best).double()  # (b, h, sq, sk)
    count = winners.sum(-1)
    out = torch.einsum("bhij,bjhd->bihd", winners / count[..., None], v.double().repeat_interleave(h // hk, dim=2))
    lse = best[..., 0].double() * magnitude ** 2 / 8 + count.log()
    q, k = ((magnitude * t).to(dtype=dtype, device=device) for t in (u, w))
    return q, k, v.to(device), out, lse


def check_large_scores(out: torch.Tensor, lse: torch.Tensor, out_expected: torch.Tensor, lse_expected: torch.Tensor,
                       context: str) -> None:
    """make_large_score_qkv's pass rule: out within the dtype's rounding of the mean of the winning values, LSE
    within fp32 rounding of its exact value (relative: it is ~2^33)."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[out.dtype]
    out, lse = out.detach().cpu().double(), lse.detach().cpu().double()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{context}: non-finite out or lse"
    err = (out - out_expected).abs().max().item()
    assert err <= tol, f"{context}: max|out - expected| = {err:.3e} > {tol:.0e}"
    rel = ((lse - lse_expected).abs() / lse_expected.abs().clamp_min(1.0)).max().item()
    assert rel <= 1e-6, f"{context}: lse relative error {rel:.3e}"


def _cpu(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().cpu()


def check_close(out: torch.Tensor, lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, *, softmax_scale: Optional[float] = None, causal: bool = False,
                window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                dropout_mask: Optional[torch.Tensor] = None, context: str = "") -> dict:
    """Asserts the pass rule above for a kernel result (``out``, ``lse``) of the given inputs.

    With ``dropout_mask`` (bool ``(b, h, sq, sk)``, True = kept), both references apply that mask and the
    ``1 / (1 - dropout_p)`` scale (flash_ext/reference.py, step 6).

    Returns the measured errors (useful when printing a failing case).
    """
    dtype = q.dtype
    b, sq, h, d = q.shape
    assert out.shape == (b, sq, h, d), f"{context}: out.shape {tuple(out.shape)}"
    assert out.dtype == dtype, f"{context}: out.dtype {out.dtype}"
    out = out.detach().cpu()
    q, k, v = _cpu(q), _cpu(k), _cpu(v)
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
              alibi_slopes=_cpu(alibi_slopes), dropout_p=dropout_p, dropout_mask=_cpu(dropout_mask))
    out_ref, lse_ref = attention_ref(q, k, v, upcast=True, **kw)
    out_same, lse_same = attention_ref(q, k, v, upcast=False, **kw)

    assert not torch.isnan(out).any(), f"{context}: NaN in out at {torch.isnan(out).nonzero()[:5].tolist()}"
    empty_rows = torch.isinf(lse_ref)  # (b, h, sq): rows that see no key
    res = {}
    if out.numel():
        err = (out.double() - out_ref).abs().max().item()
        err_same = (out_same.double() - out_ref).abs().max().item()
        bound = 2 * err_same + OUT_FLOOR[dtype]
        res.update(out_err=err, out_err_same_dtype=err_same, out_bound=bound)
        assert err <= bound, (f"{context}: max|out - ref64| = {err:.3e} > bound {bound:.3e} "
                              f"(same-dtype ref error {err_same:.3e}, floor {OUT_FLOOR[dtype]:.1e})")
        empty_out = out.permute(0, 2, 1, 3)[empty_rows]  # (n_empty, d)
        assert (empty_out == 0).all(), f"{context}: rows without visible keys must be exactly 0"
    if lse is not None:
        assert lse.shape == (b, h, sq), f"{context}: lse.shape {tuple(lse.shape)}"
        assert lse.dtype == torch.float32, f"{context}: lse.dtype {lse.dtype}"
        lse = lse.detach().cpu()
        assert not torch.isnan(lse).any(), f"{context}: NaN in lse at {torch.isnan(lse).nonzero()[:5].tolist()}"
        lse_inf = torch.isinf(lse)
        assert torch.equal(lse_inf, empty_rows), (
            f"{context}: lse is inf at {(lse_inf & ~empty_rows).nonzero()[:5].tolist()} (should be finite) / "
            f"finite at {(~lse_inf & empty_rows).nonzero()[:5].tolist()} (should be +inf)")
        assert (lse[lse_inf] > 0).all(), f"{context}: empty rows must have lse = +inf, not -inf"
        finite = ~empty_rows
        if finite.any():
            err = (lse.double() - lse_ref)[finite].abs().max().item()
            err_same = (lse_same.double() - lse_ref)[finite].abs().max().item()
            bound = 2 * err_same + LSE_FLOOR[dtype]
            res.update(lse_err=err, lse_err_same_dtype=err_same, lse_bound=bound)
            assert err <= bound, (f"{context}: max|lse - lse64| = {err:.3e} > bound {bound:.3e} "
                                  f"(same-dtype ref error {err_same:.3e}, floor {LSE_FLOOR[dtype]:.1e})")
    return res
