"""The backward as part of the PyTorch stack: opcheck of the backward ops and of the forward ops' autograd,
torch.compile(fullgraph=True) of a training step, and a real use: a tiny transformer trained on the CPU with
flash_ext attention follows the same loss curve as the same model with torch SDPA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flash_ext
from flash_ext import flash_attn_func, flash_attn_varlen_func

from attn_check import make_alibi, make_qkv
from conftest import DEVICES, require_device


def _skip_missing_head_dim(device: torch.device, d: int) -> None:
    """These tests train (forward and backward): on CUDA the backward's head dims (FLASH_EXT_BWD_HEADDIMS)."""
    dims = flash_ext.build_info()["gpu_bwd_head_dims" if device.type == "cuda" else "host_head_dims"]
    if not dims or max(dims) < d:
        pytest.skip(f"head_dim {d} has no {device.type} kernel in this build ({dims})")


def _bwd_args(device, sample: int):
    """flash_ext::bwd arguments: (shapes, flags) from a forward call of the same problem, fresh buffers."""
    specs = [
        dict(shape=(2, 33, 45, 4, 4, 64), dtype=torch.float16, kw=dict(causal=False)),
        dict(shape=(2, 70, 50, 4, 2, 32), dtype=torch.bfloat16, kw=dict(causal=True, alibi=True)),
        dict(shape=(1, 65, 130, 6, 2, 96), dtype=torch.float16, kw=dict(window=(16, 4), softcap=5.0)),
    ]
    spec = specs[sample]
    b, sq, sk, h, hk, d = spec["shape"]
    q, k, v = make_qkv(b, sq, sk, h, hk, d, spec["dtype"], device)
    kw = spec["kw"]
    slopes = make_alibi(b, h, device=device) if kw.get("alibi") else None
    window = kw.get("window", (-1, -1))
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=0.125, causal=kw["causal"] if "causal" in kw else False,
                                  window_size=window, softcap=kw.get("softcap", 0.0), alibi_slopes=slopes,
                                  return_attn_probs=True)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return (dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.125, kw.get("causal", False), window[0], window[1],
            kw.get("softcap", 0.0), slopes, False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sample", range(3))
def test_opcheck_bwd(device, sample):
    device = require_device(device)
    _skip_missing_head_dim(device, 96 if sample == 2 else 64)
    torch.library.opcheck(torch.ops.flash_ext.bwd.default, _bwd_args(device, sample))


def _varlen(device, requires_grad: bool):
    lens_q, lens_k = [5, 0, 33], [9, 4, 40]
    cu_q = torch.tensor([0, 5, 5, 38], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 13, 53], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), 4, 64, dtype=torch.bfloat16, device=device, requires_grad=requires_grad)
    k = torch.randn(sum(lens_k), 2, 64, dtype=torch.bfloat16, device=device, requires_grad=requires_grad)
    v = torch.randn(sum(lens_k), 2, 64, dtype=torch.bfloat16, device=device, requires_grad=requires_grad)
    used = torch.tensor([7, 0, 40], dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k, used


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_varlen_bwd(device):
    device = require_device(device)
    _skip_missing_head_dim(device, 64)
    q, k, v, cu_q, cu_k, used = _varlen(device, False)
    out, lse, _ = torch.ops.flash_ext.varlen_fwd(q, k, v, cu_q, cu_k, used, 33, 40, 0.125, True, -1, -1, 8.0, None)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.library.opcheck(torch.ops.flash_ext.varlen_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 33, 40, 0.0, 0.125, True,
                           -1, -1, 8.0, None, False, None, used))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_varlen_fwd_requires_grad(device):
    """The varlen forward's autograd, through AOTAutograd (test_aot_dispatch_dynamic runs the backward)."""
    device = require_device(device)
    _skip_missing_head_dim(device, 64)
    q, k, v, cu_q, cu_k, used = _varlen(device, True)
    torch.library.opcheck(torch.ops.flash_ext.varlen_fwd.default,
                          (q, k, v, cu_q, cu_k, used, 33, 40, 0.125, True, -1, -1, 8.0, None))


class _Attention(torch.nn.Module):
    """Causal self-attention with GQA: projections to q and to a packed kv, flash_ext or SDPA in between."""

    def __init__(self, dim: int, nheads: int, nheads_k: int, use_flash: bool, deterministic: bool = False):
        super().__init__()
        self.nheads, self.nheads_k, self.head_dim, self.use_flash = nheads, nheads_k, dim // nheads, use_flash
        self.deterministic = deterministic
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * nheads_k * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.nheads, self.head_dim)
        kv = self.wkv(x).view(b, s, 2, self.nheads_k, self.head_dim)
        if self.use_flash:
            o = flash_ext.flash_attn_kvpacked_func(q, kv, causal=True, deterministic=self.deterministic)
        else:
            k, v = (t.repeat_interleave(self.nheads // self.nheads_k, 2).transpose(1, 2) for t in kv.unbind(2))
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True).transpose(1, 2)
        return self.wo(o.reshape(b, s, -1))


class _TinyTransformer(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, nheads: int, nheads_k: int, layers: int, use_flash: bool,
                 max_len: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(0.1 * torch.randn(max_len, dim))
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict({
                "ln1": torch.nn.LayerNorm(dim), "attn": _Attention(dim, nheads, nheads_k, use_flash),
                "ln2": torch.nn.LayerNorm(dim),
                "mlp": torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)),
            }))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        for blk in self.blocks:
            x = x + blk["attn"](blk["ln1"](x))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.head(x)


def _task(steps: int, batch: int, seqlen: int, vocab: int, period: int = 4) -> list[torch.Tensor]:
    """Sequences that repeat a random block of `period` tokens: after the first block every token is the one
    `period` positions back, which only attention can fetch."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, period), generator=gen).repeat(1, seqlen // period) for _ in range(steps)]


def _train(use_flash: bool, data: list[torch.Tensor], vocab: int, compiled: bool = False) -> list[float]:
    torch.manual_seed(1)
    model = _TinyTransformer(vocab, 64, 4, 2, 2, use_flash)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def step(tokens):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step_fn = torch.compile(step, fullgraph=False) if compiled else step
    return [float(step_fn(tokens)) for tokens in data]


def test_tiny_transformer_matches_sdpa_training():
    """Two-layer GQA transformer (head dim 16), fp32 on the CPU, 60 AdamW steps on a repeated-block task: the
    loss curve with flash_ext attention tracks the one with SDPA (same init, same data) and the model learns."""
    _skip_missing_head_dim(torch.device("cpu"), 16)
    vocab = 16
    data = _task(60, 8, 32, vocab)
    flash = _train(True, data, vocab)
    sdpa = _train(False, data, vocab)
    start, end = sum(flash[:3]) / 3, sum(flash[-3:]) / 3
    assert end < 0.75 * start, f"no learning: {start:.3f} -> {end:.3f}"
    diffs = [abs(a - b) / b for a, b in zip(flash, sdpa)]
    assert max(diffs[:10]) < 1e-4, f"first steps differ: {diffs[:10]}"
    assert max(diffs) < 1e-2, f"loss curves diverge: flash {flash[-5:]} sdpa {sdpa[-5:]}"


@pytest.mark.parametrize("device", DEVICES)
def test_compile_training_step_fullgraph(device):
    """A whole training step (attention inside a module, loss, backward, parameter update) as ONE graph under
    torch.compile(fullgraph=True) matches eager: same losses, same updated parameters.  Dynamo traces the
    backward with trace_autograd_ops.  The backward is torch.autograd.grad and the update a hand-written SGD
    step: torch.optim's step() deliberately breaks the graph (its _use_grad wrapper), and in this torch a
    traced loss.backward() / p.grad = None leaves .grad set between calls (gradients then accumulate across
    steps; the same happens without flash_ext).  The GPU's dQ is accumulated in the deterministic order (with
    atomics the sums' order changes between calls), and its bf16 steps are compared at bf16's resolution:
    inductor evaluates the graph's elementwise ops in fp32 where eager rounds each to bf16 (measured on an
    H200: 11 of 65536 weights apart, by at most 4.6e-5)."""
    device = require_device(device)
    _skip_missing_head_dim(device, 64)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-4)

    def make():
        torch.manual_seed(2)
        return _Attention(256, 4, 2, use_flash=True, deterministic=True).to(device=device, dtype=dtype)

    def step(m, x, target):
        loss = F.mse_loss(m(x), target)
        params = list(m.parameters())
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= 0.1 * g
        return loss.detach()

    x = torch.randn(2, 77, 256, device=device, dtype=dtype)
    target = torch.randn(2, 77, 256, device=device, dtype=dtype)
    m_e, m_c = make(), make()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(step, fullgraph=True)
        for _ in range(3):
            loss_e = step(m_e, x, target)
            loss_c = compiled(m_c, x, target)
            torch.testing.assert_close(loss_c, loss_e, **tol)
    for (name, pe), pc in zip(m_e.named_parameters(), m_c.parameters()):
        torch.testing.assert_close(pc, pe, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_compile_backward_graph_has_the_bwd_op(device):
    """The backward is traced as the registered op (not a decomposition): its node is in the AOT graph."""
    device = require_device(device)
    _skip_missing_head_dim(device, 64)
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    seen = []

    def compiler(gm, _):  # ops and the ops that functionalization wraps (the bwd op mutates its buffers)
        for n in gm.graph.nodes:
            if n.op == "call_function":
                seen.append(str(n.target) + " " + " ".join(str(a) for a in n.args[:1]))
        return make_boxed_func(gm)  # AOT autograd's calling convention (an unboxed one only warns)

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True).sum()

    q, k, v = (t.requires_grad_() for t in make_qkv(1, 40, 40, 2, 2, 64, torch.float16, device))
    out = aot_function(f, fw_compiler=compiler, bw_compiler=compiler)(q, k, v)
    out.backward()
    assert any("flash_ext.fwd" in t for t in seen) and any("flash_ext.bwd" in t for t in seen), seen


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_double_backward_raises_instead_of_dropping_the_term(varlen):
    """A gradient penalty (create_graph=True, then a gradient of the first-order gradient) lost the attention's
    second-order term silently (the backward op has no autograd); it must raise.  The first-order gradients
    taken with create_graph=True are unchanged."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    w = torch.randn(1, 8, 2, 16)
    if varlen:
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        attn = lambda q, k, v: flash_ext.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5)[None]
    else:
        attn = flash_ext.flash_attn_func
    out = attn(q, k, v)
    gq, = torch.autograd.grad((out * w).sum(), q, create_graph=True)
    gq_plain, = torch.autograd.grad((attn(q, k, v) * w).sum(), q)
    assert torch.equal(gq.detach(), gq_plain)
    with pytest.raises(RuntimeError, match="attention backward is not differentiable"):
        torch.autograd.grad((gq ** 2).sum(), k)
