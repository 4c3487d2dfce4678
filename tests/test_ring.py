"""Ring attention (flash_ext.distributed) on CPU process groups (gloo, spawned ranks, world sizes 2 and 4).

Every rank's shard of ``out``/``lse`` and of the gradients is put back at its global positions and the result
must pass the FA2 rules on the full sequences (tests/attn_check.py for the forward: at most twice the
same-dtype reference's error from the float64 reference plus a floor; tests/grad_check.py for the gradients:
three times, plus a floor), with the exact properties those rules assert (rows that see no key: out 0,
lse +inf, zero dq).  It must also stay within the same bound of the single-process flash_ext result on the full
sequence.  One spawn per world size runs all cases (process start-up dominates on 2 cores).

Failures: one rank with bad or mismatched arguments makes every rank raise a ValueError at once; a rank that
dies mid-ring or stops calling ends every other rank's call with an error naming the step, within the
process group's timeout; the parent kills any rank still running at its deadline.
"""
from __future__ import annotations

import functools
import os
import time
import zlib
from typing import Any, Dict, List

import pytest
import torch

import flash_ext
import ring_harness
from attn_check import LSE_FLOOR, OUT_FLOOR, check_close
from conftest import head_dim_skip_reason
from flash_ext.reference import attention_ref

_HAS_BWD = hasattr(torch.ops.flash_ext, "bwd")
_NO_BWD = "flash_ext::bwd is not in this build (the backward issue #12 has not landed)"
# whether the backward op takes the gradient of the LSE (then the ring passes it through, else refuses it)
_HAS_DLSE = _HAS_BWD and "dsoftmax_lse" in str(torch.ops.flash_ext.bwd.default._schema)


def _case(name: str, world: int, fn: str, *, s_q: int, s_k: int = None, b: int = 1, h: int = 2, hk: int = None,
          d: int = 64, dtype=torch.bfloat16, packing=None, backward: bool = True, **kwargs) -> Dict[str, Any]:
    s_k = s_q if s_k is None else s_k
    hk = h if hk is None else hk
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{world}".encode()))
    data = {"q": torch.randn(b, world * s_q, h, d, generator=g).to(dtype),
            "k": torch.randn(b, world * s_k, hk, d, generator=g).to(dtype),
            "v": torch.randn(b, world * s_k, hk, d, generator=g).to(dtype),
            "dout": torch.randn(b, world * s_q, h, d, generator=g).to(dtype),
            "dlse": torch.randn(b, h, world * s_q, generator=g)}
    if name.endswith("nan bf16"):
        data["q"][0, world * s_q // 2 + 1, 1] = float("nan")  # one query row
        data["k"][0, 3, 0] = float("nan")                      # one key, seen by every row from position 3 on
    return dict(name=name, fn=fn, zigzag=fn.startswith("zigzag"), packing=packing, kwargs=kwargs,
                backward=backward and _HAS_BWD, **data)


def _cases(world: int) -> List[Dict[str, Any]]:
    ring, zz = "ring_flash_attn_func", "zigzag_ring_flash_attn_func"
    cases = [
        _case("ring causal gqa bf16", world, ring, b=2, s_q=37, h=4, hk=2, causal=True),
        _case("zigzag causal fp16", world, zz, s_q=38, dtype=torch.float16, causal=True, deterministic=True),
        _case("ring non-causal mqa fp32 d40", world, ring, s_q=25, h=4, hk=1, d=40, dtype=torch.float32),
        _case("zigzag non-causal qkvpacked bf16", world, "zigzag_ring_flash_attn_qkvpacked_func", s_q=30,
              packing="qkv"),
        # one rank with mismatched or invalid arguments: every rank raises, the group stays usable
        dict(_case("mismatched s_q", world, ring, s_q=12, causal=True, backward=False), perturb={1: "shorter_q"},
             expect_error=True),
        dict(_case("invalid head dim", world, ring, s_q=12, backward=False), perturb={0: "head_dim_300"},
             expect_error=True),
        dict(_case("mismatched head dim", world, zz, s_q=12, d=40, backward=False), perturb={1: "head_dim_plus_2"},
             expect_error=True),
        dict(_case("dropout", world, zz, s_q=12, dropout_p=0.1, backward=False), expect_error=True),
        dict(_case("grad on some ranks only", world, ring, s_q=12, causal=True), perturb={1: "no_grad"},
             expect_error=True),
        dict(_case("ring causal strided last dim bf16", world, ring, s_q=19, h=4, hk=2, causal=True), strided=True),
        _case("zigzag causal qkvpacked bf16", world, "zigzag_ring_flash_attn_qkvpacked_func", s_q=30, packing="qkv",
              causal=True),
        _case("ring kvpacked sliding window softcap gqa bf16", world, "ring_flash_attn_kvpacked_func", s_q=33, h=4,
              hk=2, packing="kv", causal=True, window_size=(19, -1), softcap=3.0),
        _case("zigzag window fp16", world, zz, s_q=26, dtype=torch.float16, window_size=(7, 11)),
        # sq > sk (bottom-right causal): the first W * (s_q - s_k) query rows see no key at all
        _case("ring causal sq>sk empty rows bf16", world, ring, s_q=40, s_k=16, causal=True),
        _case("zigzag causal sq<sk fp16", world, zz, s_q=12, s_k=30, dtype=torch.float16, causal=True),
        _case("ring window fp32 b3", world, ring, b=3, s_q=21, dtype=torch.float32, window_size=(5, 3)),
        # NaN in one query row and in one key: the same rows as single-process flash_ext become NaN
        dict(_case("ring causal nan bf16", world, ring, s_q=20, causal=True, backward=False), nan=True),
        # a loss that uses the returned LSE: passed to the backward op when it takes it, refused otherwise
        dict(_case("zigzag causal lse-grad gqa bf16", world, zz, s_q=24, h=4, hk=2, causal=True),
             lse_grad=True, expect_error=_HAS_BWD and not _HAS_DLSE),
    ]
    if world == 4:
        sub = _case("subgroups ring causal bf16", 2, ring, s_q=29, causal=True)
        other = _case("subgroups ring causal bf16 (second pair)", 2, ring, s_q=29, causal=True)
        cases.append(dict(sub, subgroups=[[0, 2], [1, 3]], world=2, data=[
            {n: sub[n] for n in ("q", "k", "v", "dout")}, {n: other[n] for n in ("q", "k", "v", "dout")}]))
    return cases


FAILURE_WORLD = 4  # the failure scenarios run after the cases of this world size, in the same processes


@functools.lru_cache(maxsize=None)
def _run(world: int):
    """All cases of one world size in one spawn (process start-up dominates on 2 cores); with FAILURE_WORLD the
    failure scenarios follow, rank 1 dying in the last one."""
    for d in (40, 64):
        reason = head_dim_skip_reason("cpu", d)
        if reason:
            pytest.skip(reason)
    cases = _cases(world)
    stages = [("ring_harness.run_cases", cases)]
    if world == FAILURE_WORLD:
        stages.append(("test_ring.failure_scenarios", None))
    start = time.monotonic()
    results = ring_harness.run(world, stages, deadline_s=300,
                               expected_exit={1: 17} if world == FAILURE_WORLD else None)
    print(f"\nworld {world}: {len(cases)} cases in {time.monotonic() - start:.1f} s (spawn included)")
    return world, cases, results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ring_run(request):
    world, cases, results = _run(request.param)
    return world, cases, results[0]


def _full(case, results, i, key, dim=1):
    return ring_harness.unshard([r[i][key] for r in results], case["zigzag"], dim=dim)


def _mask_kwargs(case):
    kw = case["kwargs"]
    return dict(causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1)),
                softcap=kw.get("softcap", 0.0))


def _valid_cases(world):
    return [c["name"] for c in _cases(world)
            if not c.get("expect_error") and not c.get("subgroups") and not c.get("lse_grad") and not c.get("nan")]


CASE_NAMES = sorted(set(_valid_cases(2)))


def _lookup(ring_run, name):
    world, cases, results = ring_run
    i = next(i for i, c in enumerate(cases) if c["name"] == name)
    return world, cases[i], [r[i] for r in results], i, results


@pytest.mark.parametrize("name", CASE_NAMES)
def test_forward_matches_full_sequence(ring_run, name):
    world, case, per_rank, i, results = _lookup(ring_run, name)
    out = _full(case, results, i, "out")
    lse = _full(case, results, i, "lse", dim=2)
    q, k, v = case["q"], case["k"], case["v"]
    ctx = f"world {world}, {name}"
    res = check_close(out, lse, q, k, v, context=ctx, **_mask_kwargs(case))
    # ... and within the same bound of single-process flash_ext on the full sequence
    fx_out, fx_lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True, **_mask_kwargs(case))
    if out.numel():
        diff = (out.double() - fx_out.double()).abs().max().item()
        assert diff <= res["out_bound"], f"{ctx}: max|ring - flash_ext| = {diff:.3e} > {res['out_bound']:.3e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(fx_lse)), ctx
    finite = torch.isfinite(fx_lse)
    if finite.any():
        diff = (lse - fx_lse)[finite].abs().max().item()
        assert diff <= res["lse_bound"], f"{ctx}: max|lse ring - flash_ext| = {diff:.3e} > {res['lse_bound']:.3e}"


def test_rows_without_keys(ring_run):
    """sq > sk under bottom-right causal: with W = 2 rank 0 sees no key at all in any step and rank 1's first
    rows none either; their out is exactly 0 and lse +inf (check_close asserts it; here: that such rows exist
    on a whole rank, and that steps were really empty, not NaN)."""
    world, case, per_rank, i, results = _lookup(ring_run, "ring causal sq>sk empty rows bf16")
    lse0 = per_rank[0]["lse"]
    assert torch.isinf(lse0).all() and (lse0 > 0).all() and (per_rank[0]["out"] == 0).all()
    s_q, s_k = 40, 16
    for r in range(1, world):  # global row i sees keys iff i >= W * (s_q - s_k)
        empty = max(0, min(s_q, world * (s_q - s_k) - r * s_q))
        lse = per_rank[r]["lse"]
        assert torch.isinf(lse[..., :empty]).all() and torch.isfinite(lse[..., empty:]).all(), (r, empty)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_gradients_match_full_sequence(ring_run, name):
    if not _HAS_BWD:
        pytest.skip(_NO_BWD)
    from grad_check import GRAD_FLOOR, check_grads

    world, case, per_rank, i, results = _lookup(ring_run, name)
    grads = [_full(case, results, i, n) for n in ("dq", "dk", "dv")]
    q, k, v, dout = case["q"], case["k"], case["v"], case["dout"]
    ctx = f"world {world}, {name}"
    res = check_grads(grads, q, k, v, dout, context=ctx, **_mask_kwargs(case))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fx = torch.autograd.grad(flash_ext.flash_attn_func(*leaves, **_mask_kwargs(case)), leaves, dout)
    scale = max(s for _, _, s in res.values())
    for n, g, g_fx in zip(("dq", "dk", "dv"), grads, fx):
        bound = 3 * res[n][1] + GRAD_FLOOR[q.dtype] * scale
        diff = (g.double() - g_fx.double()).abs().max().item()
        assert diff <= bound, f"{ctx}: max|{n} ring - flash_ext| = {diff:.3e} > {bound:.3e}"


def test_nan_rows_match_single_process(ring_run):
    """NaN in one query row and one key: exactly the rows with a NaN score get NaN out and LSE (the merge keeps
    a NaN partial, as the split-KV combine does), as single-process flash_ext documents and gives; the other
    rows pass the forward rule against the reference on the same inputs with the NaNs zeroed (no NaN score
    reaches those rows)."""
    from flash_ext.reference import visibility_mask

    world, case, per_rank, i, results = _lookup(ring_run, "ring causal nan bf16")
    out = _full(case, results, i, "out")
    lse = _full(case, results, i, "lse", dim=2)
    q, k, v = case["q"], case["k"], case["v"]
    b, s, h, _ = q.shape
    group = h // k.shape[2]
    visible = visibility_mask(s, k.shape[1], causal=True)                          # (s, s_k)
    q_nan = torch.isnan(q).any(-1).transpose(1, 2)                                 # (b, h, s)
    k_nan = torch.isnan(k).any(-1).repeat_interleave(group, dim=2).transpose(1, 2)  # (b, h, s_k)
    nan_rows = (q_nan & visible.any(1)) | (visible & k_nan[:, :, None, :]).any(-1)
    assert nan_rows.any() and not nan_rows.all()
    fx_out, fx_lse, _ = flash_ext.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    nan_out = nan_rows.transpose(1, 2).unsqueeze(-1).expand_as(out)
    for name, o, l in (("ring", out, lse), ("single-process flash_ext", fx_out, fx_lse)):
        assert torch.equal(torch.isnan(l), nan_rows), f"world {world}: {name} lse NaN rows"
        assert torch.equal(torch.isnan(o), nan_out), f"world {world}: {name} out NaN rows"
    clean = [torch.nan_to_num(t, nan=0.0) for t in (q, k, v)]
    ref, ref_lse = attention_ref(*clean, causal=True)
    same, same_lse = attention_ref(*clean, causal=True, upcast=False)
    ok = ~nan_out
    err = (out.double() - ref)[ok].abs().max().item()
    bound = 2 * (same.double() - ref)[ok].abs().max().item() + OUT_FLOOR[q.dtype]
    assert err <= bound, f"world {world}: out error {err:.3e} > {bound:.3e} on the rows without NaN"
    err = (lse.double() - ref_lse)[~nan_rows].abs().max().item()
    bound = 2 * (same_lse.double() - ref_lse)[~nan_rows].abs().max().item() + LSE_FLOOR[q.dtype]
    assert err <= bound, f"world {world}: lse error {err:.3e} > {bound:.3e} on the rows without NaN"


def _loss_grads(q, k, v, dout, dlse, upcast: bool, **kw):
    """Gradients of sum(out * dout) + sum(lse * dlse) through the plain PyTorch reference (float64 when
    ``upcast``, else the same-dtype framework arithmetic)."""
    dtype = torch.float64 if upcast else q.dtype
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, upcast=upcast, **kw)
    return torch.autograd.grad([out, lse], leaves, [dout.to(out.dtype), dlse.to(lse.dtype)])


def test_lse_gradient(ring_run):
    """A loss that uses the returned LSE: the ring hands dLSE to every call (d LSE_i / d s_ij = P_ij with the
    global P), so the gradients must pass the backward rule; a backward op without dsoftmax_lse refuses it."""
    if not _HAS_BWD:
        pytest.skip(_NO_BWD)
    world, case, per_rank, i, results = _lookup(ring_run, "zigzag causal lse-grad gqa bf16")
    if not _HAS_DLSE:
        for r, res in enumerate(per_rank):
            kind, msg = res["error"]
            assert kind == "NotImplementedError" and "softmax_lse" in msg, (r, msg)
        return
    from grad_check import GRAD_FLOOR

    grads = [_full(case, results, i, n) for n in ("dq", "dk", "dv")]
    q, k, v, dout, dlse = case["q"], case["k"], case["v"], case["dout"], case["dlse"]
    kw = _mask_kwargs(case)
    ref64 = _loss_grads(q, k, v, dout, dlse, True, **kw)
    ref_pt = _loss_grads(q, k, v, dout, dlse, False, **kw)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fx_out, fx_lse, _ = flash_ext.flash_attn_func(*leaves, return_attn_probs=True, **kw)
    fx = torch.autograd.grad([fx_out, fx_lse], leaves, [dout, dlse])
    scale = max(g.abs().max().item() for g in ref64)
    for n, g, g64, gpt, gfx in zip(("dq", "dk", "dv"), grads, ref64, ref_pt, fx):
        assert not torch.isnan(g).any(), n
        bound = 3 * (gpt.double() - g64).abs().max().item() + GRAD_FLOOR[q.dtype] * scale
        err = (g.double() - g64).abs().max().item()
        assert err <= bound, f"world {world}: max|{n} - ref64| = {err:.3e} > {bound:.3e}"
        diff = (g.double() - gfx.double()).abs().max().item()
        assert diff <= bound, f"world {world}: max|{n} ring - flash_ext| = {diff:.3e} > {bound:.3e}"


def test_subgroups(ring_run):
    """World 4 as two rings of two ({0, 2} and {1, 3}), each on its own data: the group argument is respected."""
    world, cases, results = ring_run
    if world != 4:
        pytest.skip("subgroups are exercised with world size 4")
    i = next(i for i, c in enumerate(cases) if c.get("subgroups"))
    case = cases[i]
    for members, data in zip(case["subgroups"], case["data"]):
        out = ring_harness.unshard([results[r][i]["out"] for r in members], False)
        lse = ring_harness.unshard([results[r][i]["lse"] for r in members], False, dim=2)
        check_close(out, lse, data["q"], data["k"], data["v"], causal=True, context=f"subgroup {members}")
        if _HAS_BWD:
            from grad_check import check_grads
            grads = [ring_harness.unshard([results[r][i][n] for r in members], False) for n in ("dq", "dk", "dv")]
            check_grads(grads, data["q"], data["k"], data["v"], data["dout"], causal=True, context=f"subgroup {members}")


def test_bad_arguments_on_one_rank_fail_every_rank(ring_run):
    world, cases, results = ring_run
    by_name = {c["name"]: i for i, c in enumerate(cases)}
    for r in range(world):
        kind, msg = results[r][by_name["mismatched s_q"]]["error"]
        assert kind == "ValueError" and "different arguments" in msg and "s_q=" in msg, (r, msg)
        kind, msg = results[r][by_name["invalid head dim"]]["error"]
        assert kind == "ValueError", (r, msg)
        if r == 0:
            assert "head_dim" in msg and "300" in msg, msg
        else:
            assert "rank(s) [0]" in msg, msg
        kind, msg = results[r][by_name["mismatched head dim"]]["error"]
        assert kind == "ValueError" and "different arguments" in msg and "head_dim=42" in msg, (r, msg)
        kind, msg = results[r][by_name["dropout"]]["error"]
        assert kind == "NotImplementedError" and "dropout_p=0.1" in msg and "global" in msg, (r, msg)
        # one rank recording no graph would leave the others waiting in the backward's first exchange
        kind, msg = results[r][by_name["grad on some ranks only"]]["error"]
        assert kind == "ValueError" and "different arguments" in msg and "requires_grad=0" in msg, (r, msg)
    # the cases after the refused ones ran on the same group (checked by the forward tests)


# ---------------------------------------------------------------------------------------------------------------
# A rank that stops calling or dies: every other rank gets an error naming where, within the group's timeout.

SHORT_TIMEOUT_S = 3.0


def failure_scenarios(rank: int, world: int, _payload) -> Dict[str, Any]:
    import datetime

    import torch.distributed as dist

    import flash_ext.distributed as fxd
    from flash_ext.distributed.ring import tracing

    q = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    out: Dict[str, Any] = {}

    def attempt(key, group, trust=False):
        os.environ["FLASH_EXT_RING_TRUST_ARGS"] = "1" if trust else "0"
        t0 = time.monotonic()
        try:
            fxd.ring_flash_attn_func(q, q, q, causal=True, group=group)
            out[key] = ("no error", "", time.monotonic() - t0)
        except Exception as exc:
            out[key] = (type(exc).__name__, str(exc), time.monotonic() - t0)

    # 1. rank 1 never calls (rings over a short-timeout group): the argument check times out on the others
    for key, trust in (("absent", False), ("absent_trusted", True)):
        g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=SHORT_TIMEOUT_S))
        if rank != 1:
            attempt(key, g, trust)
        dist.barrier()
    # 2. rank 1 dies after computing its first step, before it has received anything
    def die(event, step):
        if event == "computed":
            os._exit(17)
    if rank == 1:
        with tracing(die):
            attempt("dies", None)
    else:
        attempt("dies", None)
    return out


def test_failures_end_every_rank_in_bounded_time():
    world, _, results = _run(FAILURE_WORLD)
    for r in range(world):
        if r == 1:
            continue
        res = results[1][r]
        for key in ("absent", "absent_trusted"):
            kind, msg, elapsed = res[key]
            assert kind == "RuntimeError" and "flash_ext.distributed" in msg, (r, key, kind, msg)
            assert elapsed < SHORT_TIMEOUT_S + 10, (r, key, elapsed)
        assert "comparing the arguments" in res["absent"][1], res["absent"]
        assert "forward step" in res["absent_trusted"][1] and "K/V exchange" in res["absent_trusted"][1], res["absent_trusted"]
        kind, msg, elapsed = res["dies"]
        assert kind == "RuntimeError" and "forward step" in msg and "flash_ext.distributed" in msg, (r, kind, msg)
        assert elapsed < ring_harness.PG_TIMEOUT_S + 10, (r, elapsed)
