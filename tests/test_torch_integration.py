"""flash_ext as a citizen of the PyTorch stack: op registration (opcheck), torch.compile, torch.export, autograd."""
from __future__ import annotations

import pytest
import torch

import flash_ext
from flash_ext import flash_attn_func

from attn_check import check_close, make_alibi, make_qkv
from conftest import DEVICES, require_device


def _sample_inputs(device):
    """(args) tuples for torch.ops.flash_ext.fwd: plain, causal+ALiBi (b,h), GQA+local+softcap, MQA+ALiBi (h,)."""
    samples = []
    q, k, v = make_qkv(2, 33, 45, 4, 4, 64, torch.float16, device)
    samples.append((q, k, v, 0.125, False, -1, -1, 0.0, None))
    q, k, v = make_qkv(2, 70, 50, 4, 2, 32, torch.bfloat16, device)
    samples.append((q, k, v, 0.2, True, -1, -1, 0.0, make_alibi(2, 4, device=device)))
    q, k, v = make_qkv(1, 65, 130, 6, 2, 96, torch.float16, device)
    samples.append((q, k, v, 0.1, False, 16, 4, 5.0, None))
    q, k, v = make_qkv(2, 20, 20, 3, 1, 128, torch.bfloat16, device)
    samples.append((q, k, v, 0.09, True, 3, -1, 0.0, make_alibi(2, 3, per_batch=False, device=device)))
    return samples


# opcheck's default utilities are test_schema, test_autograd_registration, test_faketensor and
# test_aot_dispatch_dynamic; with inputs that require grad the last one also runs the backward (the bwd op)
# through AOTAutograd and compares it with eager.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sample", range(4))
def test_opcheck(device, sample):
    device = require_device(device)
    args = _sample_inputs(device)[sample]
    torch.library.opcheck(torch.ops.flash_ext.fwd.default, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sample", range(4))
def test_opcheck_requires_grad(device, sample):
    device = require_device(device)
    q, k, v, *rest = _sample_inputs(device)[sample]
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *rest)
    torch.library.opcheck(torch.ops.flash_ext.fwd.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_lse_output_needs_no_gradient(device):
    """The LSE output is differentiable (its gradient is tested in tests/test_bwd.py); an out-only loss
    backpropagates without one."""
    device = require_device(device)
    q, k, v = make_qkv(1, 10, 12, 2, 2, 32, torch.float16, device)
    q.requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.requires_grad and out.grad_fn is not None
    out.float().sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_inference_mode_and_no_grad():
    q, k, v = make_qkv(1, 10, 12, 2, 2, 32, torch.float16)
    q.requires_grad_()
    ref = flash_attn_func(q.detach(), k, v)
    with torch.no_grad():
        assert torch.equal(flash_attn_func(q, k, v), ref)
    with torch.inference_mode():
        assert torch.equal(flash_attn_func(q, k, v), ref)


# flash_attn_func and flash_attn_varlen_func call their op below the autograd layer when no graph can be
# recorded (interface._call_forward_op): a graph must still be recorded exactly when grad mode is on and one of
# q, k, v or alibi_slopes requires grad, and the result must not depend on the path.
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("grad_input", [None, "q", "k", "v", "alibi_slopes"])
@pytest.mark.parametrize("grad_mode", [True, False])
def test_graph_recorded_exactly_when_needed(varlen, grad_input, grad_mode):
    q, k, v = make_qkv(2, 9, 13, 4, 2, 32, torch.bfloat16)
    alibi = make_alibi(2, 4)
    if varlen:
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        alibi = alibi[0]
        cu_q = torch.tensor([0, 9, 18], dtype=torch.int32)
        cu_k = torch.tensor([0, 13, 26], dtype=torch.int32)
        call = lambda q, k, v, alibi: flash_ext.flash_attn_varlen_func(  # noqa: E731
            q, k, v, cu_q, cu_k, 9, 13, causal=True, alibi_slopes=alibi)
    else:
        call = lambda q, k, v, alibi: flash_attn_func(q, k, v, causal=True, alibi_slopes=alibi)  # noqa: E731
    with torch.no_grad():
        ref = call(q, k, v, alibi)
    inputs = {"q": q, "k": k, "v": v, "alibi_slopes": alibi}
    if grad_input is not None:
        inputs[grad_input] = inputs[grad_input].clone().requires_grad_()
    with torch.set_grad_enabled(grad_mode):
        out = call(inputs["q"], inputs["k"], inputs["v"], inputs["alibi_slopes"])
    recorded = grad_mode and grad_input is not None
    assert out.requires_grad == recorded and (out.grad_fn is not None) == recorded
    assert torch.equal(out.detach(), ref)
    if not recorded:
        return
    if grad_input == "alibi_slopes":  # no gradient for the slopes: refused at backward, as before
        with pytest.raises(NotImplementedError, match="alibi_slopes"):
            out.float().sum().backward()
        return
    out.float().sum().backward()
    grad = inputs[grad_input].grad
    assert grad is not None and grad.shape == inputs[grad_input].shape and grad.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    """Odd head dim (padding path), GQA, causal, softcap; compiled == eager bit for bit."""
    device = require_device(device)

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True, softcap=4.0) * 2

    compiled = torch.compile(f, fullgraph=True)
    q, k, v = make_qkv(2, 33, 45, 4, 2, 59, torch.float16, device)
    out = compiled(q, k, v)
    assert torch.equal(out, f(q, k, v))
    check_close(out / 2, None, q, k, v, causal=True, softcap=4.0, context="compiled")


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_explicit_backward_padded(device):
    """flash_attn_backward at a padded head dim (60) into given buffers, compiled with fullgraph: the eager
    pre-check of the caller's buffers runs the op in a host-side check-only mode a graph cannot hold, so the
    compiled path checks what the final copy would pass silently instead; gradients equal eager's."""
    device = require_device(device)
    q, k, v = make_qkv(1, 20, 24, 2, 1, 60, torch.bfloat16, device)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)

    def f(dq, dk, dv):
        return flash_ext.flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, causal=True)

    bufs = [torch.zeros_like(t) for t in (q, k, v)]
    grads = torch.compile(f, fullgraph=True)(*bufs)
    expected = flash_ext.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    assert all(g is b for g, b in zip(grads, bufs)) and all(torch.equal(g, e) for g, e in zip(grads, expected))
    with pytest.raises(Exception, match="dq: got torch.float16"):
        torch.compile(f, fullgraph=True)(bufs[0].half(), bufs[1], bufs[2])
    if k.shape == v.shape:  # one buffer as dk and dv: the copies would overwrite dk with dv
        with pytest.raises(Exception, match="dk/dv: got one tensor twice"):
            torch.compile(f, fullgraph=True)(bufs[0], bufs[1], bufs[1])


@pytest.mark.parametrize("device", DEVICES)
def test_compile_return_attn_probs_dynamic(device):
    """return_attn_probs=True under torch.compile (lse is a graph output), with dynamic sequence lengths."""
    device = require_device(device)

    def f(q, k, v, slopes):
        out, lse, probs = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
        assert probs.shape == (0,)
        return out, lse

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for sq, sk in [(33, 45), (70, 20), (5, 129)]:
        q, k, v = make_qkv(2, sq, sk, 4, 2, 40, torch.bfloat16, device)
        slopes = make_alibi(2, 4, per_batch=False, device=device)
        out, lse = compiled(q, k, v, slopes)
        out_e, lse_e = f(q, k, v, slopes)
        assert out.shape == out_e.shape and lse.shape == lse_e.shape == (2, 4, sq)
        assert lse.dtype == torch.float32
        assert torch.equal(out, out_e) and torch.equal(lse, lse_e)


class _Block(torch.nn.Module):
    """A toy attention block: a projection of x to q, attention over given k/v, output projection."""

    def __init__(self, nheads: int, head_dim: int):
        super().__init__()
        self.nheads, self.head_dim = nheads, head_dim
        self.wq = torch.nn.Linear(nheads * head_dim, nheads * head_dim)
        self.wo = torch.nn.Linear(nheads * head_dim, nheads * head_dim)
        self.register_buffer("slopes", torch.linspace(0.05, 0.3, nheads))

    def forward(self, x, k, v):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.nheads, self.head_dim)
        o = flash_attn_func(q, k, v, causal=True, window_size=(24, -1), alibi_slopes=self.slopes)
        return self.wo(o.reshape(b, s, -1))


@pytest.mark.parametrize("device", DEVICES)
def test_export(device):
    device = require_device(device)
    m = _Block(4, 40).to(device=device, dtype=torch.bfloat16)
    m.slopes = m.slopes.float()
    x = torch.randn(2, 37, 160, dtype=torch.bfloat16, device=device)
    _, k, v = make_qkv(2, 37, 50, 4, 2, 40, torch.bfloat16, device)
    sq = torch.export.Dim("sq", min=2, max=4096)
    sk = torch.export.Dim("sk", min=2, max=4096)
    ep = torch.export.export(m, (x, k, v), dynamic_shapes=({1: sq}, {1: sk}, {1: sk}))
    assert any(n.target is torch.ops.flash_ext.fwd.default for n in ep.graph.nodes)
    with torch.no_grad():
        assert torch.equal(ep.module()(x, k, v), m(x, k, v))
        # another sequence length through the same exported program
        x2 = torch.randn(2, 90, 160, dtype=torch.bfloat16, device=device)
        _, k2, v2 = make_qkv(2, 90, 31, 4, 2, 40, torch.bfloat16, device)
        assert torch.equal(ep.module()(x2, k2, v2), m(x2, k2, v2))


def _varlen_args(device, seqused: bool):
    """varlen_fwd args: three sequences (one empty), GQA, causal + softcap; optionally seqused_k."""
    lens_q, lens_k = [5, 0, 33], [9, 4, 40]
    cu_q = torch.tensor([0, 5, 5, 38], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 13, 53], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), 4, 64, dtype=torch.bfloat16, device=device)
    k = torch.randn(sum(lens_k), 2, 64, dtype=torch.bfloat16, device=device)
    v = torch.randn(sum(lens_k), 2, 64, dtype=torch.bfloat16, device=device)
    used = torch.tensor([7, 0, 40], dtype=torch.int32, device=device) if seqused else None
    return (q, k, v, cu_q, cu_k, used, max(lens_q), max(lens_k), 0.125, True, -1, -1, 8.0, None)


def _kvcache_args(device, paged: bool, append: bool = False):
    """kvcache_fwd args: decode-like (2 query rows) against a contiguous or a paged cache, optionally
    appending 3 new rows per entry (cache_seqlens are then the lengths before the append)."""
    b, h, hk, d = 2, 4, 2, 64
    q = torch.randn(b, 2, h, d, dtype=torch.float16, device=device)
    if paged:
        k_cache = torch.randn(5, 128, hk, d, dtype=torch.float16, device=device)
        block_table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32, device=device)
    else:
        k_cache = torch.randn(b, 200, hk, d, dtype=torch.float16, device=device)
        block_table = None
    v_cache = torch.randn_like(k_cache)
    seqlens_k = torch.tensor([130, 17], dtype=torch.int32, device=device)
    k, v = ((torch.randn(b, 3, hk, d, dtype=torch.float16, device=device) for _ in range(2)) if append
            else (None, None))
    return (q, k_cache, v_cache, k, v, seqlens_k, None, None, block_table, 0.125, True, -1, -1, 0.0, None, 0, -1, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seqused", [False, True])
def test_opcheck_varlen(device, seqused):
    device = require_device(device)
    torch.library.opcheck(torch.ops.flash_ext.varlen_fwd.default, _varlen_args(device, seqused))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("append", [False, True])
def test_opcheck_kvcache(device, paged, append):
    """With new k/v the op appends in place: its schema declares exactly the mutations it does (opcheck's
    test_schema checks that), and the fake kernel agrees with the real one."""
    device = require_device(device)
    args = list(_kvcache_args(device, paged, append))
    if append and not paged:
        args[6] = torch.tensor([1, 0], dtype=torch.int32, device=device)  # cache_batch_idx
    torch.library.opcheck(torch.ops.flash_ext.kvcache_fwd.default, tuple(args))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_kvcache_decode_step(device):
    """A decode step (rotary, in-place append, attention) compiles into one graph; compiled == eager,
    caches included (the append is an op that declares its mutation of k_cache and v_cache)."""
    device = require_device(device)
    b, h, hk, d, cap = 2, 4, 2, 64, 96
    cos, sin = torch.randn(cap, d // 4, device=device).cos(), torch.randn(cap, d // 4, device=device).sin()

    def step(q, k_cache, v_cache, k, v, seqlens):
        return flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                                 cache_seqlens=seqlens, causal=True, return_softmax_lse=True)

    compiled = torch.compile(step, fullgraph=True)
    q = torch.randn(b, 1, h, d, dtype=torch.bfloat16, device=device)
    k, v = (torch.randn(b, 1, hk, d, dtype=torch.bfloat16, device=device) for _ in range(2))
    k_cache = torch.randn(b, cap, hk, d, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.tensor([10, 57], dtype=torch.int32, device=device)
    kc_e, vc_e = k_cache.clone(), v_cache.clone()
    out, lse = compiled(q, k_cache, v_cache, k, v, seqlens)
    out_e, lse_e = step(q, kc_e, vc_e, k, v, seqlens)
    assert torch.equal(k_cache, kc_e) and torch.equal(v_cache, vc_e)
    assert torch.equal(out, out_e) and torch.equal(lse, lse_e)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_kvcache_read_only(device):
    """Attention against an existing (paged) cache, no append: no host-side checks, one graph."""
    device = require_device(device)
    q, k_cache, v_cache, _, _, seqlens_k, _, _, block_table, *_ = _kvcache_args(device, paged=True)

    def f(q, k_cache, v_cache, seqlens, block_table):
        return flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                 block_table=block_table, causal=True)

    out = torch.compile(f, fullgraph=True)(q, k_cache, v_cache, seqlens_k, block_table)
    assert torch.equal(out, f(q, k_cache, v_cache, seqlens_k, block_table))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_varlen_paged(device):
    device = require_device(device)
    q, k, v, cu_q, cu_k, used, max_q, max_k, *rest = _varlen_args(device, seqused=False)
    pages = torch.randn(5, 128, 2, 64, dtype=torch.bfloat16, device=device)
    table = torch.tensor([[4], [0], [2]], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.flash_ext.varlen_fwd.default,
                          (q, pages, pages.clone(), cu_q, cu_k, used, max_q, max_k, *rest, 0, table))


def test_forward_mode_ad_is_refused_not_dropped():
    """The ops' autograd has no forward-mode formula and dropped a tangent silently (jacfwd all zeros, a None
    tangent): refused by name where an input carries a tangent; inputs without one still run in a dual level."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import jacfwd, jvp

    q, k, v = (torch.randn(1, 3, 1, 64) for _ in range(3))
    f = lambda q_: flash_attn_func(q_, k, v)  # noqa: E731
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        jvp(f, (q,), (torch.randn_like(q),))
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        jacfwd(f)(q)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="flash_ext.fwd: forward-mode AD"):
            flash_attn_func(dual, k, v)
        with pytest.raises(NotImplementedError, match="flash_ext.varlen_fwd: forward-mode AD"):
            flash_ext.flash_attn_varlen_func(dual[0], k[0], v[0], cu, cu, 3, 3)
        with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache: forward-mode AD"):
            flash_ext.flash_attn_with_kvcache(dual, k, v, cache_seqlens=3)
        assert torch.equal(flash_attn_func(q, k, v), flash_attn_func(q.clone(), k, v))  # no tangent: runs


def test_compile_varlen_max_seqlen_stays_symbolic():
    """max_seqlen_q/k are SymInts in the ops' schemas: with dynamic=True a new batch maximum reuses the graph
    (as int, every value recompiled, and fullgraph hit the recompile limit at the 9th); and the padding workflow
    unpad_input -> flash_attn_varlen_func -> pad_input compiles with fullgraph=True, unpad_input's max_seqlen
    (a .item()) included."""
    from torch._dynamo.testing import CompileCounter

    from flash_ext.bert_padding import pad_input, unpad_input

    def f(q, cu, max_seqlen):
        return flash_ext.flash_attn_varlen_func(q, q, q, cu, cu, max_seqlen, max_seqlen, causal=True)

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    for n in range(3, 13):  # two sequences, the second one growing: a new max_seqlen every step
        q = torch.randn(3 + n, 2, 64)
        cu = torch.tensor([0, 3, 3 + n], dtype=torch.int32)
        assert torch.equal(compiled(q, cu, n), f(q, cu, n))
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for 10 maxima"

    b, s = 2, 12
    x = torch.randn(b, s, 2, 64)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 7:] = False

    def padded(x, mask):
        xu, idx, cu, mx, _ = unpad_input(x, mask)
        return pad_input(flash_ext.flash_attn_varlen_func(xu, xu, xu, cu, cu, mx, mx, causal=True), idx, b, s)

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(padded, backend="aot_eager", fullgraph=True)(x, mask)
    assert torch.equal(got, padded(x, mask))
