"""flash_ext.explain: the plan of a call without running it, or every reason it cannot run."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

import flash_ext


def test_explain_cpu_plan_fields() -> None:
    q, k, v = (torch.randn(2, 300, 8, 59, dtype=torch.bfloat16) for _ in range(3))
    e = flash_ext.explain(q, k, v, causal=True, verbose=False)
    assert e.ok and not e.reasons
    p = e.plan
    assert p["backend"].startswith("host traits")
    assert p["head_dim"] == 64 and p["head_dim_tile"] == 64  # 59 padded to 64 by the Python layer
    assert p["grid"] == [3, 2, 8]  # ceil(300 / 128) m-blocks
    assert p["flags"]["causal"] and not p["flags"]["even_mn"] and p["num_splits"] == 1
    assert 0 < e.hbm_bytes < e.naive_hbm_bytes
    text = str(e)
    assert "tile" in text and "HBM" in text


def test_explain_cpu_short_query_tile() -> None:
    """Up to 16 query rows run on a 16-row host tile; GQA decode counts a K/V group's heads as rows."""
    def block_m(sq: int, h: int = 4, hk: int = 4) -> int:
        q = torch.randn(1, sq, h, 64)
        k = torch.randn(1, 100, hk, 64)
        return flash_ext.explain(q, k, k, verbose=False).plan["block_m"]

    assert block_m(16) == 16 and block_m(17) == 128
    assert block_m(1, h=32, hk=2) == 16   # 16 query heads per K/V head -> 16 rows
    assert block_m(1, h=64, hk=2) == 128  # 32 rows


def test_explain_window_normalisation_is_reported() -> None:
    q = torch.randn(1, 40, 2, 32)
    k = torch.randn(1, 8, 2, 32)
    # left >= sk - 1 bounds nothing; right = 10 < sq - 1 still hides keys from the first rows.
    e = flash_ext.explain(q, k, k, window_size=(7, 10), verbose=False)
    assert e.plan["window"] == [-1, 10] and e.plan["flags"]["local"]


def test_explain_lists_every_reason() -> None:
    q, k, v = (torch.randn(1, 10, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    e = flash_ext.explain(q.double(), k, v[..., :3], softcap=float("nan"), dropout_p=1.0, verbose=False)
    assert not e.ok
    joined = "\n".join(e.reasons)
    for needle in ("dropout_p", "q.dtype", "softcap", "v.shape"):
        assert needle in joined, joined
    assert "cannot run" in str(e)


def test_explain_matches_the_call() -> None:
    """explain() runs no kernel, and the call it describes then succeeds."""
    q, k, v = (torch.randn(1, 128, 2, 64, dtype=torch.float16) for _ in range(3))
    assert flash_ext.explain(q, k, v, verbose=False).ok
    assert flash_ext.flash_attn_func(q, k, v).shape == q.shape


def test_flash_ext_log_env_logs_each_call() -> None:
    code = "import torch, flash_ext; q = torch.randn(1, 10, 2, 64); flash_ext.flash_attn_func(q, q, q)"
    env = dict(os.environ, FLASH_EXT_LOG="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[flash_ext] flash_ext.fwd" in r.stderr and '"backend": "host traits (CPU)"' in r.stderr


def test_explain_refuses_what_the_python_layer_refuses() -> None:
    """flash_attn_func checks window_size's shape and dropout_p's type in Python before the op; explain()
    skipped those checks and reported ok=True (or raised TypeError for window_size=None)."""
    q = torch.randn(1, 10, 2, 64, dtype=torch.bfloat16)
    for kwargs, needle in [(dict(window_size=(1, 2, 3)), "window_size"), (dict(window_size=(1.5, 2)), "window_size"),
                           (dict(window_size=None), "window_size"), (dict(dropout_p="0.1"), "dropout_p")]:
        e = flash_ext.explain(q, q, q, verbose=False, **kwargs)
        assert not e.ok and any(r.startswith(needle) for r in e.reasons), (kwargs, e.reasons)
    e = flash_ext.explain(q.double(), q, q, window_size=None, verbose=False)  # the op's reasons are listed too
    assert not e.ok and any("window_size" in r for r in e.reasons) and any("q.dtype" in r for r in e.reasons)


def test_explain_call_is_the_plan_the_launch_would_run() -> None:
    """explain_call runs the call's real path with the ops in plan-only mode: for flash_attn_func its plan is
    the one explain() derives from plan_fwd (two paths to one make_plan), and the call afterwards runs."""
    q, k, v = (torch.randn(2, 77, 4, 40, dtype=torch.bfloat16) for _ in range(3))
    for kw in (dict(causal=True), dict(window_size=(9, 3), softcap=5.0), dict(num_splits=3)):
        via_call = flash_ext.explain_call(flash_ext.flash_attn_func, q, k, v, verbose=False, **kw)
        via_plan = flash_ext.explain(q, k, v, verbose=False, **kw)
        assert via_call.ok and via_call.plan == via_plan.plan, kw
    assert flash_ext.flash_attn_func(q, k, v).isfinite().all()  # the mode ended with explain_call


def test_explain_call_kvcache_decode_writes_nothing() -> None:
    """A decode step with new keys: the plan of the attention (a group of 4 query heads as 4 rows of its K/V
    head, the cache split over KV), with the cache left as it was (the append is skipped in plan-only mode)."""
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    k_cache, v_cache = torch.zeros(2, 4096, 2, 128, dtype=torch.bfloat16), torch.zeros(2, 4096, 2, 128,
                                                                                         dtype=torch.bfloat16)
    new = torch.ones(2, 1, 2, 128, dtype=torch.bfloat16)
    seqlens = torch.tensor([100, 4000], dtype=torch.int32)
    e = flash_ext.explain_call(flash_ext.flash_attn_with_kvcache, q, k_cache, v_cache, new, new,
                               cache_seqlens=seqlens, verbose=False)
    assert e.ok, e.reasons
    kp = e.plan["kernel_problem"]
    assert (kp["b"], kp["h"], kp["h_k"], kp["seqlen_q"], kp["seqlen_k"]) == (2, 2, 2, 4, 4096), kp
    assert (k_cache == 0).all() and (v_cache == 0).all() and seqlens.tolist() == [100, 4000]
    assert "problem     batch 2, 2 query heads on 2 K/V heads, seqlen_q 4" in str(e)


def test_explain_call_varlen_dropout_draws_nothing_and_refusals_list_everything() -> None:
    cu = torch.tensor([0, 100, 350], dtype=torch.int32)
    x = torch.randn(350, 4, 64, dtype=torch.float16)
    state = torch.random.get_rng_state()
    e = flash_ext.explain_call(flash_ext.flash_attn_varlen_func, x, x, x, cu, cu, 250, 250, dropout_p=0.1,
                               causal=True, verbose=False)
    assert e.ok and e.plan["varlen"] and e.plan["flags"]["dropout"] and e.plan["flags"]["causal"]
    assert torch.equal(torch.random.get_rng_state(), state), "plan-only mode must not draw from the generator"
    bad = flash_ext.explain_call(flash_ext.flash_attn_varlen_func, x.double(), x, x, cu, cu, 200, 250,
                                 verbose=False)
    assert not bad.ok and any("q.dtype" in r for r in bad.reasons) and any("max_seqlen_q" in r for r in bad.reasons)
    # return_attn_probs' S_dmask is built after the kernel from its outputs: skipped, nothing was written
    import flash_ext.interface as interface

    def no_s_dmask(*args, **kwargs):
        raise AssertionError("S_dmask computed in plan-only mode")

    real, interface.s_dmask_varlen = interface.s_dmask_varlen, no_s_dmask
    try:
        e = flash_ext.explain_call(flash_ext.flash_attn_varlen_func, x, x, x, cu, cu, 250, 250, dropout_p=0.1,
                                   return_attn_probs=True, verbose=False)
    finally:
        interface.s_dmask_varlen = real
    assert e.ok, e.reasons
    empty = flash_ext.explain_call(flash_ext.flash_attn_func, x[:0][None], x[None], x[None], verbose=False)
    assert empty.ok and empty.plan == {} and "nothing to compute" in str(empty)


def test_backward_refuses_plan_only_mode() -> None:
    """The backward has no plan-only path: in that mode it refuses rather than write its buffers."""
    q, k, v = (torch.randn(1, 16, 2, 64) for _ in range(3))
    out, lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True)
    dq = torch.zeros_like(q)
    e = flash_ext.explain_call(flash_ext.flash_attn_backward, torch.ones_like(out), q, k, v, out, lse, dq,
                               verbose=False)
    assert not e.ok and "explain_call covers the forward functions" in e.reasons[0] and (dq == 0).all()
