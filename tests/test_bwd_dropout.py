"""The backward pass with dropout: the kernels regenerate the forward's mask from its rng_state, and the
gradients match the float64 autograd of the reference run with that mask (tests/grad_check.py's rule).

The mask of the reference comes from outside the kernels: tests/dropout_ref.py (numpy, written from the mask's
specification) for an explicit rng_state, or S_dmask (the negated entries of ``return_attn_probs``) for a
generator-drawn one.  A wrong mask must fail the same check (test_wrong_mask_fails).
"""
from __future__ import annotations

import pytest
import torch

from flash_ext import flash_attn_backward, flash_attn_func

from attn_check import DTYPE_NAMES, make_alibi, make_qkv
from conftest import DEVICES, require_device
from dropout_ref import dropout_keep_mask
from grad_check import check_grads
from test_bwd import _cu, require_head_dim


def _rng_state(seed: int, offset: int, device) -> torch.Tensor:
    return torch.tensor([seed, offset], dtype=torch.int64, device=device)


def _mask(rng_state: torch.Tensor, p: float, b: int, h: int, sq: int, sk: int) -> torch.Tensor:
    seed, offset = rng_state.cpu().tolist()
    return torch.from_numpy(dropout_keep_mask(seed, offset, p, b, h, sq, sk))


def _fwd(q, k, v, p, rng_state, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, deterministic=False):
    """The forward op with an explicit rng_state (its autograd runs flash_ext::bwd with the same state)."""
    out, lse, rs = torch.ops.flash_ext.fwd(q, k, v, q.shape[-1] ** -0.5, causal, window[0], window[1], softcap, alibi,
                                           0, p, rng_state, deterministic)
    return out, lse, rs


# (b, sq, sk, h, hk, d, dtype, p, kwargs): odd lengths (not tile multiples, sq != sk both ways), GQA/MQA,
# causal, local windows, ALiBi, softcap, a head dim that is not a multiple of 8 at the op (40 pads to 40; 59
# through the Python functions below), and a high drop rate.
CASES = [
    (2, 77, 131, 4, 2, 64, torch.bfloat16, 0.17, {}),
    (1, 200, 63, 6, 1, 32, torch.float16, 0.5, {"causal": True}),
    (2, 65, 190, 4, 4, 128, torch.float16, 0.1, {"window": (17, 5), "softcap": 5.0}),
    (1, 129, 129, 2, 2, 96, torch.bfloat16, 0.3, {"alibi": "per-batch", "causal": True}),
    (1, 33, 300, 3, 1, 256, torch.float16, 0.9, {}),
    (2, 150, 150, 4, 2, 40, torch.float32, 0.25, {"causal": True, "window": (40, -1)}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_grad_with_dropout(device, case):
    device = require_device(device)
    b, sq, sk, h, hk, d, dtype, p, kw = CASES[case]
    require_head_dim(device, d, dtype)
    if device.type == "cuda" and dtype == torch.float32:
        pytest.skip("fp32 is a CPU-only dtype")
    alibi = make_alibi(b, h).to(device) if kw.get("alibi") == "per-batch" else None
    q, k, v = (t.requires_grad_() for t in make_qkv(b, sq, sk, h, hk, d, dtype, device,
                                                     q_scale=4.0 if "softcap" in kw else 1.0))
    rs = _rng_state(1234 + case, 8 * case, device)
    dout = torch.randn(b, sq, h, d, device=device).to(dtype)
    out, _, rs_out = _fwd(q, k, v, p, rs, causal=kw.get("causal", False), window=kw.get("window", (-1, -1)),
                          softcap=kw.get("softcap", 0.0), alibi=alibi)
    assert torch.equal(rs_out.cpu(), rs.cpu())
    out.backward(dout)
    check_grads((q.grad, k.grad, v.grad), q, k, v, dout, causal=kw.get("causal", False),
                window_size=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0), alibi_slopes=alibi,
                dropout_p=p, dropout_mask=_mask(rs, p, b, h, sq, sk),
                context=f"case {case} {DTYPE_NAMES[dtype]} {device} p={p} {kw}")


def test_wrong_mask_fails():
    """The check can fail: the same gradients against a reference with another seed's mask are rejected."""
    require_head_dim(torch.device("cpu"), 64, torch.float16)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 64, 80, 2, 2, 64, torch.float16))
    rs = _rng_state(5, 0, "cpu")
    dout = torch.randn(1, 64, 2, 64).to(torch.float16)
    _fwd(q, k, v, 0.3, rs)[0].backward(dout)
    grads = (q.grad, k.grad, v.grad)
    check_grads(grads, q, k, v, dout, dropout_p=0.3, dropout_mask=_mask(rs, 0.3, 1, 2, 64, 80))
    with pytest.raises(AssertionError):
        check_grads(grads, q, k, v, dout, dropout_p=0.3, dropout_mask=_mask(_rng_state(6, 0, "cpu"), 0.3, 1, 2, 64, 80))


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_func_generator_drawn_mask(device):
    """The public function (seed from torch's generator, head dim 59 padded by the Python layer): autograd saves
    the forward's rng_state; the mask recovered from S_dmask (dropped probabilities negated) is the one the
    backward used.  The same seed repeats the gradients bit for bit."""
    device = require_device(device)
    require_head_dim(device, 64, torch.bfloat16)
    b, sq, sk, h, hk, d, p = 2, 90, 70, 4, 2, 59, 0.2
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, device)
    dout = torch.randn(b, sq, h, d, device=device).to(torch.bfloat16)

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(11)
        out, _, s_dmask = flash_attn_func(*leaves, dropout_p=p, causal=True, return_attn_probs=True)
        out.backward(dout)
        return [t.grad for t in leaves], s_dmask.detach()

    grads, s_dmask = run()
    mask = (s_dmask >= 0).cpu()  # dropped: negated (P = 0 entries contribute nothing either way)
    check_grads(grads, q, k, v, dout, causal=True, dropout_p=p, dropout_mask=mask, context=f"{device}")
    again, _ = run()
    assert all(torch.equal(a, b_) for a, b_ in zip(grads, again))


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_with_dropout(device):
    """Varlen: the mask of sequence i is that of batch entry i over its own positions."""
    device = require_device(device)
    lens_q, lens_k, h, hk, d, p = [5, 0, 130, 77], [9, 3, 100, 200], 4, 2, 64, 0.25
    require_head_dim(device, d, torch.float16)
    q = torch.randn(sum(lens_q), h, d).to(device=device, dtype=torch.float16).requires_grad_()
    k = torch.randn(sum(lens_k), hk, d).to(device=device, dtype=torch.float16).requires_grad_()
    v = torch.randn(sum(lens_k), hk, d).to(device=device, dtype=torch.float16).requires_grad_()
    dout = torch.randn(sum(lens_q), h, d).to(device=device, dtype=torch.float16)
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    rs = _rng_state(77, 12, device)
    out, _, _ = torch.ops.flash_ext.varlen_fwd(q, k, v, cu_q, cu_k, None, max(lens_q), max(lens_k), d ** -0.5, True,
                                               -1, -1, 0.0, None, 0, None, p, rs)
    out.backward(dout)
    mask = _mask(rs, p, len(lens_q), h, max(lens_q), max(lens_k))
    dq, dk, dv = (g.detach().cpu() for g in (q.grad, k.grad, v.grad))
    cq, ck = _cu(lens_q, "cpu"), _cu(lens_k, "cpu")
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if lq == 0:
            assert (dk[ks] == 0).all() and (dv[ks] == 0).all()
            continue
        check_grads((dq[qs][None], dk[ks][None], dv[ks][None]), q.detach().cpu()[qs][None],
                    k.detach().cpu()[ks][None], v.detach().cpu()[ks][None], dout.cpu()[qs][None], causal=True,
                    dropout_p=p, dropout_mask=mask[i:i + 1, :, :lq, :lk], context=f"sequence {i}")


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_backward_needs_rng_state(device):
    """flash_attn_backward with dropout: rng_state given -> the forward's gradients; missing -> ValueError
    naming it, nothing written."""
    device = require_device(device)
    require_head_dim(device, 64, torch.float16)
    q, k, v = make_qkv(1, 40, 50, 2, 2, 64, torch.float16, device)
    rs = _rng_state(3, 4, device)
    out, lse, _ = _fwd(q, k, v, 0.4, rs)
    dout = torch.randn_like(out)
    dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, dropout_p=0.4, rng_state=rs)
    check_grads((dq, dk, dv), q, k, v, dout, dropout_p=0.4, dropout_mask=_mask(rs, 0.4, 1, 2, 40, 50))
    bufs = [torch.full_like(t, 7.0) for t in (q, k, v)]
    with pytest.raises(ValueError, match="rng_state"):
        flash_attn_backward(dout, q, k, v, out, lse, *bufs, dropout_p=0.4)
    assert all((t == 7).all() for t in bufs)


def test_cpu_dropout_backward_bitwise_reproducible():
    """50 runs with the same rng_state give the same bits, for any thread count."""
    require_head_dim(torch.device("cpu"), 64, torch.bfloat16)
    q, k, v = make_qkv(1, 150, 211, 4, 2, 64, torch.bfloat16)
    dout = torch.randn(1, 150, 4, 64).to(torch.bfloat16)
    rs = _rng_state(99, 4, "cpu")

    def grads():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        _fwd(*leaves, 0.3, rs, causal=True)[0].backward(dout)
        return [t.grad for t in leaves]

    first = grads()
    for _ in range(49):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_bwd_with_dropout(device):
    device = require_device(device)
    require_head_dim(device, 64, torch.float16)
    q, k, v = make_qkv(2, 33, 45, 4, 2, 64, torch.float16, device)
    rs = _rng_state(1, 4, device)
    out, lse, _ = _fwd(q, k, v, 0.3, rs, causal=True)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.library.opcheck(torch.ops.flash_ext.bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, dq, dk, dv, 0.3, 0.125, True, -1, -1, 0.0, None,
                           False, rs))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flash_ext.fwd.default,
                          (qg, kg, vg, 0.125, True, -1, -1, 0.0, None, 0, 0.3, rs, False))


@pytest.mark.cuda
def test_gpu_deterministic_backward_with_dropout():
    device = require_device("cuda")
    require_head_dim(device, 64, torch.float16)
    q, k, v = make_qkv(2, 500, 700, 8, 2, 64, torch.float16, device)
    dout = torch.randn_like(q)
    rs = _rng_state(2024, 16, device)

    def grads():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        _fwd(*leaves, 0.2, rs, causal=True, deterministic=True)[0].backward(dout)
        return [t.grad for t in leaves]

    first = grads()
    check_grads(first, q, k, v, dout, causal=True, dropout_p=0.2, dropout_mask=_mask(rs, 0.2, 2, 8, 500, 700))
    for _ in range(49):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))
