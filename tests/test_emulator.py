"""The Sm80 CUDA kernels, run on the warp emulator (csrc/emu/, build knob FLASH_EXT_EMULATOR=1).

Every call runs inside ``flash_ext.emulate("sm80")``: the real Sm80 instantiation (tile shapes, swizzled
shared memory, ldmatrix/mma fragments, cp.async and barriers, the static variant the GPU dispatcher picks)
executes on emulated warps.  Each case asserts

* the FA2 pass rule against the float64 reference (tests/attn_check.py), and
* a clean emulator report: zero findings of every check (races, unlanded reads, bad addresses, divergence,
  exits at a barrier, copies in flight at exit, bank conflicts), with evidence that the emulated kernel ran
  (CTAs, ldmatrix and mma executed) and which static variant it was.

Every head dim (32..256) x both dtypes x every variant (even, uneven, general; causal or not; split-KV;
varlen; paged K/V; KV cache).  A head dim the build did not compile into the emulator is skipped with the
reason; CI compiles a subset (``.ci/run``); ``-m full`` adds more shapes per case.
"""
from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable

import pytest
import torch

import flash_ext
from attn_check import (RISING_PATTERNS, check_close, check_large_scores, make_alibi, make_large_score_qkv,
                        make_rising_maxima_qkv)

pytestmark = pytest.mark.skipif(not flash_ext.build_info()["emulator"],
                                reason="flash_ext was built without the warp emulator (FLASH_EXT_EMULATOR=1)")

HEAD_DIMS = [32, 64, 96, 128, 192, 256]
DTYPES = [torch.float16, torch.bfloat16]
DT = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def make_qkv(b: int, sq: int, sk: int, h: int, hk: int, d: int, dtype: torch.dtype, q_scale: float = 1.0):
    """Standard-normal q, k, v (attn_check.make_qkv, without its skip for head dims the CPU backend lacks: the
    emulator has its own head dims, require_head_dim)."""
    q = (torch.randn(b, sq, h, d) * q_scale).to(dtype)
    return q, torch.randn(b, sk, hk, d).to(dtype), torch.randn(b, sk, hk, d).to(dtype)


def require_head_dim(hd: int) -> None:
    built = flash_ext.build_info()["emulator_head_dims"]
    if hd not in built:
        pytest.skip(f"head dim {hd} is not compiled into the emulator (emulated head dims {built}; "
                    f"FLASH_EXT_EMU_HEADDIMS)")


def assert_clean(context: str, variant: str | None = None, ran: bool = True) -> dict:
    """The latest emulated launch: no finding of any check, the emulated kernel really ran, the variant."""
    r = flash_ext.emulator_report()
    assert r, f"{context}: no emulated launch recorded"
    assert r["findings"] == 0 and not any(r["counts"].values()), f"{context}: {json.dumps(r, indent=1)}"
    s = r["stats"]
    # Sm80 CTAs have 32 x warps threads (the 4th argument of the traits in the kernel's name: 1, 2, 4 or 8 by
    # variant); a split-KV launch adds the combine kernel's CTAs of 128.
    warps = {int(k.split("<")[1].split(",")[3]) for k in r["kernels"] if k.startswith("Sm80Traits<")}
    assert len(warps) == 1 and warps <= {1, 2, 4, 8}, f"{context}: ran {r['kernels']}"
    cta_threads = 32 * warps.pop()
    combine = any(k.startswith("combine_kernel") for k in r["kernels"])
    if combine and cta_threads == 128:  # both kernels' CTAs have 128 threads
        assert s["ctas"] > 1 and s["threads"] == 128 * s["ctas"], f"{context}: {s}"
    else:
        sm80_ctas = (s["threads"] - 128 * s["ctas"]) // (cta_threads - 128) if combine else s["ctas"]
        assert 0 < sm80_ctas <= s["ctas"] and \
            s["threads"] == cta_threads * sm80_ctas + 128 * (s["ctas"] - sm80_ctas), f"{context}: {s}"
    if ran:
        assert s["ldmatrix"] > 0 and s["mma"] > 0 and s["cp_async"] > 0 and s["barriers"] > 0, f"{context}: {s}"
    if variant is not None:
        assert any(k.endswith(f"variant {variant}") for k in r["kernels"]), f"{context}: ran {r['kernels']}"
    return r


def run_fixed(hd: int, dtype: torch.dtype, sq: int, sk: int, h: int, hk: int, d: int, variant: str, b: int = 1,
              q_scale: float = 1.0, **kw) -> None:
    require_head_dim(hd)
    if kw.get("alibi_slopes") == "alibi":
        kw["alibi_slopes"] = make_alibi(b, h)
    kw.setdefault("num_splits", 1)  # small problems would otherwise be split (and run the split variant)
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, q_scale=q_scale)
    context = f"hd{hd} {DT[dtype]} b{b} sq{sq} sk{sk} h{h}/{hk} d{d} {kw}"
    with flash_ext.emulate("sm80"):
        plan = flash_ext.explain(q, k, v, verbose=False, **kw).plan
        out, lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert plan["emulated"] and plan["backend"].startswith("Sm80 traits on the warp emulator"), plan
    assert plan["head_dim_tile"] == hd and plan["variant"] == variant, (context, plan)
    r = assert_clean(context, variant=variant)
    splits = kw.get("num_splits", 1)
    if splits and splits > 1:
        assert plan["num_splits"] == splits and r["stats"]["smem_vector"] == 0, (context, plan, r["stats"])
    kw.pop("num_splits", None)
    check_close(out, lse, q, k, v, context=context, **kw)


# (name, sq, sk, h, hk, d_offset, variant, kwargs): d = hd - d_offset.  Shapes are tile multiples for "even"
# (block_m 128; block_n 64, or 32 at head dim 256).  No split unless num_splits says so.
FIXED_CASES = [
    ("even", 128, 256, 2, 2, 0, "even", {}),
    ("even_causal", 128, 256, 2, 1, 0, "even", {"causal": True}),
    ("uneven_gqa_d", 77, 200, 4, 2, 8, "uneven", {}),
    ("uneven_causal_empty_rows", 150, 70, 2, 2, 0, "uneven", {"causal": True}),
    ("uneven_17_rows", 17, 200, 2, 2, 0, "uneven", {"num_splits": 2}),
    # At most 16 query rows (after the group swap) run the decode tile (one warp; two at head dim 256), with
    # every feature but dropout.
    ("split_forced", 3, 700, 2, 2, 0, "decode", {"num_splits": 3}),
    ("split_heuristic_decode", 1, 900, 8, 1, 0, "decode", {"num_splits": 0, "causal": True}),
    ("decode_16_rows_causal", 16, 333, 2, 2, 8, "decode", {"causal": True, "num_splits": 2}),
    ("decode_gqa_swap_split", 1, 500, 8, 2, 0, "decode", {"num_splits": 4}),
    ("decode_local_alibi_softcap", 5, 230, 2, 2, 8, "decode",
     {"window_size": (100, 0), "alibi_slopes": "alibi", "softcap": 5.0, "num_splits": 2}),
    ("general_local_alibi_softcap", 100, 230, 2, 2, 8, "general",
     {"window_size": (40, 7), "alibi_slopes": "alibi", "softcap": 5.0}),
    ("general_causal_alibi_split", 64, 333, 2, 2, 0, "general", {"causal": True, "alibi_slopes": "alibi",
                                                                   "num_splits": 2}),
]
FULL_SHAPES = [(1, 1), (129, 63), (256, 512), (300, 97)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
@pytest.mark.parametrize("case", FIXED_CASES, ids=[c[0] for c in FIXED_CASES])
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_fixed_length(hd: int, case: tuple, dtype: torch.dtype) -> None:
    name, sq, sk, h, hk, d_off, variant, kw = case
    q_scale = 4.0 if kw.get("softcap") else 1.0
    run_fixed(hd, dtype, sq, sk, h, hk, hd - d_off, variant, q_scale=q_scale, **dict(kw))


@pytest.mark.full
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
@pytest.mark.parametrize("shape", FULL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("flags", ["plain", "causal", "window", "alibi_softcap_causal"])
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_fixed_length_full(hd: int, flags: str, shape: tuple, dtype: torch.dtype) -> None:
    sq, sk = shape
    kw: dict = {"plain": {}, "causal": {"causal": True}, "window": {"window_size": (20, 3)},
                "alibi_softcap_causal": {"causal": True, "alibi_slopes": "alibi", "softcap": 8.0}}[flags]
    even = sq % 128 == 0 and sk % (32 if hd == 256 else 64) == 0 and flags in ("plain", "causal")
    # flash_attn drops a window side that reaches past the sequence (left >= sk - 1, right >= sq - 1): a
    # window covering everything is no window, and the plain "uneven" kernel runs.
    no_window = flags == "window" and 20 >= sk - 1 and 3 >= sq - 1
    variant = "even" if even else ("uneven" if flags in ("plain", "causal") or no_window else "general")
    variant = "decode" if sq <= 16 else variant
    run_fixed(hd, dtype, sq, sk, 3, 1, hd, variant, b=2, q_scale=4.0 if "softcap" in kw else 1.0, **kw)


# ---------------------------------------------------------------------------------------------------------
# The online softmax's lagging references (softmax.h): after a CTA's first K/V tile, each warp votes once per
# tile on whether any of its rows rose past the slack, and rescales O only then.

@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
@pytest.mark.parametrize("pattern", RISING_PATTERNS)
@pytest.mark.parametrize("tile,hd", [("even", 64), ("uneven", 64), ("decode", 64), ("even", 128)])
def test_maxima_rising_along_the_walk(tile: str, hd: int, pattern: str, dtype: torch.dtype) -> None:
    """Row maxima rising as the kernel walks right to left (attn_check.make_rising_maxima_qkv) on the GPU
    tiles: the result against the float64 reference, one vote per warp and tile after the first (counted by
    the emulator), and on the slow ramp both outcomes (the references lag on most tiles and move on some).
    Head dim 128's `even` runs the same 4 warps x 128 x 64 walk at 255 registers."""
    require_head_dim(hd)
    sq, sk = {"even": (128, 640), "uneven": (100, 600), "decode": (1, 600)}[tile]
    q, k, v = make_rising_maxima_qkv(pattern, dtype, sq=sq, sk=sk, d=hd)
    context = f"{tile} {pattern} {DT[dtype]}"
    with flash_ext.emulate("sm80"):
        out, lse, _ = flash_ext.flash_attn_func(q, k, v, num_splits=1, return_attn_probs=True)
    r = assert_clean(context, variant=tile)
    check_close(out, lse, q, k, v, context=context)
    # Sm80Traits<head dim, block_m, block_n, warps, ...> of the kernel that ran.
    kernel = next(name for name in r["kernels"] if name.startswith("Sm80Traits<"))
    _, _, block_n, warps = (int(x) for x in kernel.split("<")[1].split(",")[:4])
    s = r["stats"]
    tiles = -(-sk // block_n)
    assert s["vote"] == s["ctas"] * warps * (tiles - 1), (context, block_n, warps, s)
    if pattern == "rising_far":  # 11.5 log2 units per 64-key tile: a move nearly every time
        assert s["vote_true"] >= 0.8 * s["vote"], (context, s)
    elif pattern == "rising_near":  # 1.15 per tile, 10.4 in all: a move or two per warp
        assert 0 < s["vote_true"] <= 0.3 * s["vote"], (context, s)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
def test_huge_scores_exact(dtype: torch.dtype, causal: bool) -> None:
    """test_fwd.test_huge_scores_exact on the GPU tiles: exp2((x - ref) * scale), exact for the maximum at any
    magnitude, where FA2's single FFMA rounds ref * scale by hundreds of log2 units here."""
    require_head_dim(64)
    q, k, v, out_expected, lse_expected = make_large_score_qkv(dtype, causal)
    context = f"huge scores {DT[dtype]} causal={causal}"
    with flash_ext.emulate("sm80"):
        out, lse, _ = flash_ext.flash_attn_func(q, k, v, causal=causal, num_splits=1, return_attn_probs=True)
    assert_clean(context)
    check_large_scores(out, lse, out_expected, lse_expected, context)


# ---------------------------------------------------------------------------------------------------------
# Varlen (with and without paged K/V) and the KV cache.

def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)


def _check_sequences(out, lse, q, k_seqs, v_seqs, cu_q, context, **kw) -> None:
    for i, (ks, vs) in enumerate(zip(k_seqs, v_seqs)):
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        if a == e:
            continue
        check_close(out[a:e][None], lse[:, a:e][None], q[a:e][None], ks[None], vs[None],
                    context=f"{context} sequence {i}", **kw)


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_varlen(hd: int, paged: bool) -> None:
    require_head_dim(hd)
    dtype = torch.bfloat16 if paged else torch.float16
    lens_q, lens_k = [5, 0, 130, 77], [9, 3, 130, 300]
    h, hk, d = 4, 2, hd - 8
    q = torch.randn(sum(lens_q), h, d, dtype=dtype)
    k_seqs = [torch.randn(n, hk, d, dtype=dtype) for n in lens_k]
    v_seqs = [torch.randn(n, hk, d, dtype=dtype) for n in lens_k]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    kw = {"causal": True}
    if paged:
        page = 128
        pages_per = [max(1, -(-n // page)) for n in lens_k]
        order = torch.randperm(sum(pages_per))  # pages of a sequence scattered over the pool
        k = torch.full((sum(pages_per), page, hk, d), float("nan"), dtype=dtype)
        v = torch.full_like(k, float("nan"))
        table = torch.zeros(len(lens_k), max(pages_per), dtype=torch.int32)
        nxt = 0
        for i, n in enumerate(lens_k):
            for j in range(pages_per[i]):
                pg = int(order[nxt])
                nxt += 1
                table[i, j] = pg
                rows = slice(j * page, min(n, (j + 1) * page))
                k[pg, : rows.stop - rows.start] = k_seqs[i][rows]
                v[pg, : rows.stop - rows.start] = v_seqs[i][rows]
        extra = {"block_table": table}
    else:
        k, v = torch.cat(k_seqs), torch.cat(v_seqs)
        extra = {}
    # Three rows past the last sequence (a padded batch): no kernel touches them; O = 0 and LSE = +inf.
    q_padded = torch.cat([q, torch.randn(3, h, d, dtype=dtype)])
    with flash_ext.emulate():
        out, lse, _ = flash_ext.flash_attn_varlen_func(q_padded, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                       return_attn_probs=True, **kw, **extra)
    context = f"varlen hd{hd} {'paged' if paged else 'packed'}"
    assert_clean(context, variant="uneven")
    _check_sequences(out, lse, q, k_seqs, v_seqs, cu_q, context, **kw)
    assert torch.equal(out[-3:], torch.zeros(3, h, d, dtype=dtype)) and bool(torch.isposinf(lse[:, -3:]).all())


@pytest.mark.parametrize("mode", ["paged_split", "batch_idx_leftpad"])
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_kvcache(hd: int, mode: str) -> None:
    """Decode steps with an append: paged cache with the split heuristic, and a contiguous cache read through
    cache_batch_idx with left padding (explicit splits)."""
    require_head_dim(hd)
    dtype = torch.float16 if mode == "paged_split" else torch.bfloat16
    b, sq, hk, h, d, new = 2, 2, 2, 4, hd, 2
    seqlens = torch.tensor([300, 45], dtype=torch.int32)
    k_new = torch.randn(b, new, hk, d, dtype=dtype)
    v_new = torch.randn(b, new, hk, d, dtype=dtype)
    q = torch.randn(b, sq, h, d, dtype=dtype)
    kw: dict = {"causal": True}
    if mode == "paged_split":
        page, npages = 128, 8
        k_cache = torch.randn(npages, page, hk, d, dtype=dtype)
        v_cache = torch.randn(npages, page, hk, d, dtype=dtype)
        table = torch.tensor([[5, 1, 6], [2, 7, 0]], dtype=torch.int32)
        kw.update(block_table=table, num_splits=0)
        rows_of = lambda kc, i, end: kc[table[i]].reshape(-1, hk, d)[:end]  # noqa: E731
        leftpad = torch.zeros(b, dtype=torch.int32)
    else:
        cache_len = 400
        k_cache = torch.randn(3, cache_len, hk, d, dtype=dtype)
        v_cache = torch.randn(3, cache_len, hk, d, dtype=dtype)
        batch_idx = torch.tensor([2, 0], dtype=torch.int32)
        leftpad = torch.tensor([7, 0], dtype=torch.int32)
        kw.update(cache_batch_idx=batch_idx, cache_leftpad=leftpad, num_splits=3)
        rows_of = lambda kc, i, end: kc[int(batch_idx[i])][:end]  # noqa: E731
    with flash_ext.emulate():
        out, lse = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                     return_softmax_lse=True, **kw)
    assert_clean(f"kvcache hd{hd} {mode}", variant="decode")
    for i in range(b):
        end = int(seqlens[i]) + new
        lp = int(leftpad[i])
        ks, vs = rows_of(k_cache, i, end)[lp:], rows_of(v_cache, i, end)[lp:]
        assert torch.equal(ks[-new:], k_new[i]), "the append landed where the kernel reads"
        check_close(out[i:i + 1], lse[i:i + 1], q[i:i + 1], ks[None], vs[None], causal=True,
                    context=f"kvcache hd{hd} {mode} batch {i}")


# ---------------------------------------------------------------------------------------------------------
# The switch itself.

def test_emulate_switch_and_explain() -> None:
    info = flash_ext.build_info()
    d = min(info["emulator_head_dims"][0], max(info["host_head_dims"]))  # served by both backends
    q, k, v = make_qkv(1, 40, 50, 2, 2, d, torch.float16)
    assert not flash_ext.explain(q, k, v, verbose=False).plan["emulated"]
    with flash_ext.emulate():
        plan = flash_ext.explain(q, k, v, verbose=False).plan
        # 40 x 50 runs the "uneven" variant: 4 warps x 32 rows up to head dim 128 (64 keys per tile up to 64,
        # then 32), else 8 warps x 16 rows (dispatch.h's sm80_four_warp_block_n, chosen by what fits in
        # registers without spills); a baseline build (FLASH_EXT_GPU_FWD_WARPS=8) has 8 warps everywhere.
        assert plan["emulated"] and plan["variant"] == "uneven" and "emulated sm_80" in plan["device"]
        baseline = info["gpu_fwd_warps"].startswith("8")
        four = plan["head_dim_tile"] <= 128 and not baseline
        assert plan["threads_per_cta"] == (128 if four else 256)
        assert plan["block_n"] == (32 if four and plan["head_dim_tile"] > 64 else 64)
        fp32 = flash_ext.explain(q.float(), k.float(), v.float(), verbose=False).plan
        assert not fp32["emulated"] and fp32["backend"].startswith("host traits"), "fp32 stays on the host"
    assert not flash_ext.explain(q, k, v, verbose=False).plan["emulated"], "the context manager restores"
    with pytest.raises(ValueError, match="sm80"):
        with flash_ext.emulate("sm90"):
            pass


def test_emulate_is_per_thread() -> None:
    """One process-wide mode moved other threads' calls onto the emulator while a block was open, and two
    threads' overlapping blocks (A enters, B enters, A leaves, B leaves) left it on for good."""
    import threading
    d = min(flash_ext.build_info()["emulator_head_dims"][0], max(flash_ext.build_info()["host_head_dims"]))
    q, k, v = make_qkv(1, 20, 20, 1, 1, d, torch.bfloat16)
    emulated = lambda: flash_ext.explain(q, k, v, verbose=False).plan["emulated"]  # noqa: E731
    report_before = flash_ext.emulator_report()
    seen: dict[str, bool] = {}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        with flash_ext.emulate():
            a_in.set()
            seen["a inside"] = emulated()
            b_in.wait()
        a_out.set()

    def b() -> None:
        a_in.wait()
        with flash_ext.emulate():
            b_in.set()
            a_out.wait()
            seen["b inside after a left"] = emulated()
            out = flash_ext.flash_attn_func(q, k, v)
            seen["b's report is its own"] = flash_ext.emulator_report()["stats"]["ctas"] >= 1
        seen["b after"] = emulated()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    a_in.wait()
    seen["main meanwhile"] = emulated()
    for t in threads:
        t.join(timeout=300)
    assert seen == {"a inside": True, "main meanwhile": False, "b inside after a left": True,
                    "b's report is its own": True, "b after": False}
    assert not emulated()
    assert flash_ext.emulator_report() == report_before, "b's launch is not this thread's report"


def _at_odd_byte(t: torch.Tensor) -> torch.Tensor:
    """t's values at an address that is not a multiple of its element size (as torch.frombuffer or a DLPack
    import can give): .contiguous() keeps such an address."""
    x = torch.frombuffer(bytearray(t.numel() * t.element_size() + 16), dtype=t.dtype, offset=1,
                         count=t.numel()).view(t.shape)
    x.copy_(t)
    assert x.data_ptr() % x.element_size() != 0
    return x


def test_small_tensors_at_odd_byte_addresses() -> None:
    """Index tensors, ALiBi slopes and rng_state reached the Sm80 kernels at the caller's address: misaligned
    4- and 8-byte global loads (a fault on a GPU), and a kvcache append done before the failing launch.  Now
    copied when misaligned: every call equals the aligned one, with no finding."""
    d = flash_ext.build_info()["emulator_head_dims"][0]
    torch.manual_seed(0)
    with flash_ext.emulate():
        q, k, v = torch.randn(22, 2, d).half(), torch.randn(37, 1, d).half(), torch.randn(37, 1, d).half()
        cu_q, cu_k = torch.tensor([0, 5, 22], dtype=torch.int32), torch.tensor([0, 7, 37], dtype=torch.int32)
        slopes = torch.tensor([0.5, 0.25])
        want = flash_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 30, alibi_slopes=slopes, causal=True)
        got = flash_ext.flash_attn_varlen_func(q, k, v, _at_odd_byte(cu_q), _at_odd_byte(cu_k), 17, 30,
                                               alibi_slopes=_at_odd_byte(slopes), causal=True)
        assert torch.equal(got, want) and flash_ext.emulator_report()["findings"] == 0

        caches = [torch.randn(3, 64, 1, d).half() for _ in range(2)]
        q1, k1, v1 = torch.randn(2, 1, 2, d).half(), torch.randn(2, 1, 1, d).half(), torch.randn(2, 1, 1, d).half()
        seqlens, batch_idx = torch.tensor([3, 5], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
        leftpad = torch.tensor([1, 0], dtype=torch.int32)
        results = []
        for wrap in (lambda t: t, _at_odd_byte):
            kc, vc = (c.clone() for c in caches)
            out = flash_ext.flash_attn_with_kvcache(q1, kc, vc, k1, v1, cache_seqlens=wrap(seqlens),
                                                    cache_batch_idx=wrap(batch_idx), cache_leftpad=wrap(leftpad))
            assert flash_ext.emulator_report()["findings"] == 0
            results.append((out, kc, vc))
        assert all(torch.equal(a, b) for a, b in zip(*results))

        qd, kd, vd = make_qkv(1, 20, 30, 1, 1, d, torch.float16)
        state = torch.tensor([1234, 8], dtype=torch.int64)
        args = (qd, kd, vd, d ** -0.5, False, -1, -1, 0.0, None, 1, 0.25)
        want = torch.ops.flash_ext.fwd(*args, state)[0]
        got = torch.ops.flash_ext.fwd(*args, _at_odd_byte(state))[0]
        assert torch.equal(got, want) and flash_ext.emulator_report()["findings"] == 0


def test_unbuilt_head_dim_is_refused_by_name() -> None:
    built = flash_ext.build_info()["emulator_head_dims"]
    if 256 in built:
        pytest.skip("every head dim up to 256 is compiled into the emulator")
    d = max(built) + 8
    q, k, v = make_qkv(1, 8, 8, 1, 1, d, torch.bfloat16)
    with flash_ext.emulate():
        assert "no emulated Sm80 kernel" in flash_ext.explain(q, k, v, verbose=False).reasons[0]
        with pytest.raises(ValueError, match="no emulated Sm80 kernel for head dim"):
            flash_ext.flash_attn_func(q, k, v)


def test_environment_variable_turns_it_on(tmp_path) -> None:
    import os
    import subprocess
    import sys
    d = flash_ext.build_info()["emulator_head_dims"][0]
    code = ("import threading, torch, flash_ext; q = torch.randn(1, 5, 1, %d, dtype=torch.float16); "
            "flash_ext.flash_attn_func(q, q, q); print(flash_ext.emulator_report()['stats']['ctas']); "
            "t = threading.Thread(target=lambda: print(flash_ext.explain(q, q, q, verbose=False).plan['emulated'])); "
            "t.start(); t.join()" % d)
    env = dict(os.environ, FLASH_EXT_EMULATE="sm80")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "True"], "every thread starts from FLASH_EXT_EMULATE"


# ---------------------------------------------------------------------------------------------------------
# A finding fails the call.  The kernel-bug fault injection (dropped barriers and cp.async waits, unswizzled
# shared memory, wrong shuffle masks, wrong P pairing, each caught) is tests/cpp/test_emu_faults.cpp, run by
# tests/test_cpp_host.py; here the op-layer plumbing: the test-only hook narrows one tensor by 16 bytes in
# the emulator's address check, so the correct kernel's reads (or writes) of those bytes become findings.

def _call_touching(tensor: str, d: int) -> Callable[[], object]:
    """A call whose kernel (or combine) touches `tensor`: the tiles through cp.async and vector moves, the
    rest through the plain scalar loads and stores of csrc/flash_ext/global_memory.h."""
    b, sq, sk, h = 3, 70, 90, 4
    q, k, v = make_qkv(b, sq, sk, h, 2, d, torch.float16)
    if tensor in ("k", "v", "out", "softmax_lse"):
        return lambda: flash_ext.flash_attn_func(q, k, v, num_splits=1)
    if tensor in ("split partials", "split partial LSE"):
        return lambda: flash_ext.flash_attn_func(q[:, :1], k, v, num_splits=2)
    if tensor == "alibi_slopes":
        slopes = make_alibi(b, h)
        return lambda: flash_ext.flash_attn_func(q, k, v, alibi_slopes=slopes, num_splits=1)
    if tensor == "rng_state":
        return lambda: flash_ext.flash_attn_func(q, k, v, dropout_p=0.2, num_splits=1)
    if tensor in ("cu_seqlens_q", "cu_seqlens_k"):
        cu_q = torch.tensor([0, 30, 31, 70], dtype=torch.int32)
        cu_k = torch.tensor([0, 50, 51, 90], dtype=torch.int32)
        return lambda: flash_ext.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 40, 50, num_splits=1)
    if tensor in ("block_table", "seqused_k"):
        page = 256
        kc = torch.zeros(2 * b, page, 2, d, dtype=torch.float16)
        vc = torch.zeros_like(kc)
        table = torch.arange(2 * b, dtype=torch.int32).reshape(b, 2).flip(0).contiguous()
        lens = torch.tensor([300, 17, 400], dtype=torch.int32)
        return lambda: flash_ext.flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=lens, block_table=table,
                                                         num_splits=1)
    raise AssertionError(tensor)


# Each tensor the kernels touch, and how (a pattern of the finding's wording): the tiles (cp.async, vector
# stores) and the plain scalar accesses (index arrays, ALiBi slopes, RNG state, LSE, split partials written by
# the kernel and read by the combine, whichever CTA's finding is listed first).
NARROWED = [("k", "reads"), ("v", "reads"), ("out", "writes"), ("softmax_lse", "st.global"),
            ("split partial LSE", "[ls][dt].global"), ("split partials", "st.global"), ("alibi_slopes", "ld.global"),
            ("rng_state", "st.global"), ("cu_seqlens_q", "ld.global"), ("cu_seqlens_k", "ld.global"),
            ("block_table", "ld.global"), ("seqused_k", "ld.global")]


@pytest.mark.parametrize("tensor,access", NARROWED, ids=[t for t, _ in NARROWED])
def test_a_finding_fails_the_call_with_its_location(tensor: str, access: str) -> None:
    d = flash_ext.build_info()["emulator_head_dims"][0]
    call = _call_touching(tensor, d)
    previous = flash_ext._C._set_emulator_test_fault(f"narrow:{tensor}")
    try:
        with flash_ext.emulate(), pytest.raises(RuntimeError) as info:
            call()
    finally:
        flash_ext._C._set_emulator_test_fault(previous)
    msg = str(info.value)
    assert "warp emulator" in msg and "bad_address" in msg and f"({tensor} spans" in msg, msg
    # who (thread, warp, lane), what, the kernel source line of its last instruction, and which CTA
    assert re.search(access, msg) and re.search(r"after \w+\.h:\d+", msg) and "CTA block (" in msg, msg
    r = flash_ext.emulator_report()
    # (a refused cp.async leaves its shared bytes unlanded, so unlanded reads may follow)
    assert r["counts"]["bad_address"] > 0 and r["findings"] >= r["counts"]["bad_address"], r["counts"]
    # Without the hook the same call is clean: the finding came from the narrowed range alone.
    with flash_ext.emulate():
        call()
    r = assert_clean(f"narrow:{tensor} off")
    if access.endswith(".global"):
        assert r["stats"]["global_plain"] > 0, r["stats"]


# ---------------------------------------------------------------------------------------------------------
# Dropout (the static "dropout" variant): the emulated kernel's mask is the contract's (csrc/flash_ext/
# dropout.h), bit for bit the CPU backend's and the numpy reference's (tests/dropout_ref.py).

def _rng_state(seed: int, offset: int) -> torch.Tensor:
    return torch.tensor([seed, offset], dtype=torch.int64)


def _keep_pattern(hd: int, p: float, rs: torch.Tensor, b: int, h: int, sq: int, varlen: bool = False) -> torch.Tensor:
    """The kernel's keep mask, read off its output: q = 0 makes every probability 1/sk, and V = the identity
    (sk = hd keys, one per column) puts P[i, j] into O[i, j], so O[i, j] != 0 exactly where (i, j) is kept."""
    sk = hd
    q = torch.zeros(b, sq, h, hd, dtype=torch.float16)
    k = torch.randn(b, sk, h, hd, dtype=torch.float16)
    v = torch.eye(hd, dtype=torch.float16).expand(b, h, hd, hd).permute(0, 2, 1, 3).contiguous()
    if varlen:
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32)
        cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32)
        out = torch.ops.flash_ext.varlen_fwd(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, None,
                                             sq, sk, hd ** -0.5, False, -1, -1, 0.0, None, num_splits=1,
                                             dropout_p=p, rng_state=rs)[0]
        out = out.unflatten(0, (b, sq))
    else:
        out = torch.ops.flash_ext.fwd(q, k, v, hd ** -0.5, False, -1, -1, 0.0, None, 1, p, rs)[0]
    return (out != 0).permute(0, 2, 1, 3)  # (b, h, sq, sk)


@pytest.mark.parametrize("varlen", [False, True], ids=["fwd", "varlen"])
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_dropout_mask_is_the_cpu_backends(hd: int, varlen: bool) -> None:
    require_head_dim(hd)
    from dropout_ref import dropout_keep_mask
    p, b, h, sq = 0.3, 2, 3, 150
    rs = _rng_state(0x1234567890AB, (5 << 33) + 12)
    with flash_ext.emulate():
        emulated = _keep_pattern(hd, p, rs, b, h, sq, varlen)
    r = assert_clean(f"dropout mask hd{hd}", variant="dropout")
    host = _keep_pattern(hd, p, rs, b, h, sq, varlen)
    reference = torch.from_numpy(dropout_keep_mask(int(rs[0]), int(rs[1]), p, b, h, sq, hd))
    assert torch.equal(host, reference), "the CPU backend's mask is the contract's"
    assert torch.equal(emulated, host), f"{int((emulated != host).sum())} mask bits differ from the CPU backend"
    assert 0.6 < emulated.float().mean() < 0.8


@pytest.mark.parametrize("dtype", DTYPES, ids=DT.get)
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_dropout_output(hd: int, dtype: torch.dtype) -> None:
    """Odd shapes, GQA, causal, ALiBi, the split heuristic: O and LSE against the
    float64 reference with the contract's mask."""
    require_head_dim(hd)
    from dropout_ref import dropout_keep_mask
    b, sq, sk, h, hk, p = 2, 77, 140, 4, 2, 0.17
    q, k, v = make_qkv(b, sq, sk, h, hk, hd - 8, dtype)
    slopes = make_alibi(b, h)
    rs = _rng_state(99 + hd, 4 * hd)
    with flash_ext.emulate():
        out, lse, rs_out = torch.ops.flash_ext.fwd(q, k, v, (hd - 8) ** -0.5, True, -1, -1, 0.0, slopes, 0, p, rs)
    assert_clean(f"dropout hd{hd}", variant="dropout")
    assert torch.equal(rs_out, rs)
    mask = torch.from_numpy(dropout_keep_mask(int(rs[0]), int(rs[1]), p, b, h, sq, sk))
    check_close(out, lse, q, k, v, causal=True, alibi_slopes=slopes, dropout_p=p, dropout_mask=mask,
                context=f"dropout hd{hd} {DT[dtype]}")
