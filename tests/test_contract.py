"""The op layer's contract (issue #9): no crash, no partial write, no silent truncation, NaN independent of
the split path, no autograd history in a KV cache, one host read of index tensors per call, one cached
device query, the pybind module, the build's arch flags.  Each test failed before its fix."""
from __future__ import annotations

import contextlib
import math

import importlib.util
import pathlib
import re

import pytest
import torch

import flash_ext
from flash_ext import reference
from conftest import ALL_HEAD_DIMS, head_dim_skip_reason, skip_unless_head_dim_built

ROOT = pathlib.Path(__file__).resolve().parent.parent


# -- KV cache: batch sizes, and every check before the first write ------------------------------------

def test_kvcache_cache_smaller_than_q_batch_is_refused() -> None:
    """Without cache_batch_idx or block_table entry i uses cache entry i: a cache with fewer entries than q's
    batch was an out-of-bounds read (garbage, or SIGSEGV for q batch 512 against a cache of batch 1)."""
    q = torch.randn(4, 1, 2, 64)
    k_cache = torch.randn(1, 16, 2, 64)
    with pytest.raises(ValueError, match=r"k_cache\.shape\[0\]: got 1 cache entries; must be >= q's batch 4"):
        flash_ext.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=4)
    new, kc = torch.randn(4, 1, 2, 64), k_cache.clone()
    with pytest.raises(ValueError, match="must be >= q's batch 4"):
        flash_ext.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), new, new, cache_seqlens=3)
    assert torch.equal(k_cache, kc)
    q = torch.randn(512, 1, 2, 64)
    k_cache = torch.randn(1, 4096, 2, 64)
    with pytest.raises(ValueError, match="must be >= q's batch 512"):
        flash_ext.flash_attn_with_kvcache(q, k_cache, k_cache.clone())


def _bad_kvcache_calls():
    """Ten calls that must each be refused before the append writes anything (issue #9, item 2)."""
    b, h, hk, d = 2, 4, 2, 64
    q = torch.randn(b, 1, h, d, dtype=torch.bfloat16)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    return [
        ("softcap NaN", dict(q=q, softcap=float("nan")), "softcap"),
        ("num_splits too large", dict(q=q, num_splits=129), "num_splits"),
        ("window (0.5, 0)", dict(q=q, window_size=(0.5, 0)), "window_size"),
        ("scale 0", dict(q=q, softmax_scale=0.0), "softmax_scale"),
        ("wrong ALiBi shape", dict(q=q, alibi_slopes=torch.rand(5)), "alibi_slopes.shape"),
        ("q fp16 with a bf16 cache", dict(q=q.half()), "dtype"),
        ("3 q heads against 2 cache heads", dict(q=torch.randn(b, 1, 3, d, dtype=torch.bfloat16)), "heads"),
        ("int64 cache_leftpad", dict(q=q, cache_leftpad=torch.tensor([0, 1])), "cache_leftpad"),
        ("leftpad > cache_seqlens", dict(q=q, cache_leftpad=torch.tensor([0, 6], dtype=torch.int32)), "cache_leftpad"),
        ("leftpad of the wrong length", dict(q=q, cache_leftpad=torch.tensor([0, 1, 2], dtype=torch.int32)),
         "cache_leftpad"),
    ], seqlens, (b, 40, hk, d)


@pytest.mark.parametrize("case", range(10), ids=[c[0] for c in _bad_kvcache_calls()[0]])
def test_refused_kvcache_call_leaves_cache_bit_identical(case: int) -> None:
    calls, seqlens, cache_shape = _bad_kvcache_calls()
    name, kwargs, needle = calls[case]
    k_cache = torch.randn(cache_shape, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    kc, vc = k_cache.clone(), v_cache.clone()
    new_k = torch.randn(cache_shape[0], 2, *cache_shape[2:], dtype=torch.bfloat16)
    new_v = torch.randn_like(new_k)
    kwargs = dict(kwargs)
    q = kwargs.pop("q")
    with pytest.raises(ValueError, match=needle):
        flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=seqlens, **kwargs)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc), f"{name}: the refused call wrote into the cache"


def test_kvcache_append_records_no_autograd_history() -> None:
    """k/v that require grad used to leave k_cache holding IndexPutBackward0 across decode steps."""
    k_cache = torch.zeros(2, 16, 2, 64)
    v_cache = torch.zeros(2, 16, 2, 64)
    q = torch.randn(2, 1, 4, 64, requires_grad=True)
    k = torch.randn(2, 1, 2, 64, requires_grad=True)
    v = torch.randn(2, 1, 2, 64, requires_grad=True)
    for step in range(3):
        flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k * 1.0, v * 1.0, cache_seqlens=step)
    assert not k_cache.requires_grad and k_cache.grad_fn is None
    assert not v_cache.requires_grad and v_cache.grad_fn is None
    assert torch.equal(k_cache[:, :3], k.detach().expand(2, 3, 2, 64))


# -- sizes that do not fit the kernels' 32-bit indices ---------------------------------------------------

def _varlen_inputs():
    q = torch.randn(10, 2, 64)
    k = torch.randn(12, 2, 64)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    return q, k, cu_q, cu_k


@pytest.mark.parametrize("max_seqlen_q,max_seqlen_k,window", [
    (2 ** 32 + 3, 7, (-1, -1)),     # was truncated to 3: rows 3.. never computed, garbage returned
    (2 ** 31, 7, (-1, -1)),          # was INT_MIN: an empty grid, the poisoned output returned as is
    (6, 2 ** 32 + 2, (4, 0)),        # was truncated to 2: the window silently dropped
    (2 ** 30, 2 ** 30, (-1, -1)),    # each fits an int, their sum (the causal diagonal's range) does not
])
def test_lengths_beyond_32_bits_are_refused(max_seqlen_q: int, max_seqlen_k: int, window) -> None:
    q, k, cu_q, cu_k = _varlen_inputs()
    with pytest.raises(ValueError, match="32-bit"):
        flash_ext.flash_attn_varlen_func(q, k, k, cu_q, cu_k, max_seqlen_q, max_seqlen_k, window_size=window)


def test_forced_splits_with_too_many_rows_are_refused() -> None:
    """Split-KV partials are addressed with 32-bit rows; the op refuses rather than wrap (no allocation:
    the check runs on shapes alone, an expanded view stands in for 2^31 query rows)."""
    q = torch.zeros(1, 1, 1, 8).expand(2 ** 16, 2 ** 15 + 1, 1, 8)
    k = torch.zeros(2 ** 16, 4, 1, 8)
    with pytest.raises(ValueError, match="split-KV partials"):
        torch.ops.flash_ext.fwd(q, k, k, 0.5, False, -1, -1, 0.0, None, 4)


# -- NaN: the same answer for every split count ----------------------------------------------------------

@pytest.mark.parametrize("emulated", [False, True], ids=["host", "sm80_emulated"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_nan_propagates_whatever_the_split_count(num_splits: int, emulated: bool) -> None:
    """Causal, sq 600 > sk 512: rows 0..87 see no key.  NaN in q at row 300 of head 1 and in k at key 400
    of K/V head 0: exactly the rows that see a NaN are NaN in O and LSE (rows >= 488 of head 0, row 300 of
    head 1); rows that see no key stay O = 0, LSE = +inf (row 50 of head 1 has NaN in q but sees nothing);
    every other row is finite.  Before the fix, NaN in q gave NaN unsplit but 0 split, and NaN in k gave
    LSE +inf unsplit but a finite LSE split.  Also on the GPU body (warp emulator), whose row maxima skip a
    NaN (fmaxf) and whose references lag (softmax.h): the NaN must still reach the row through exp2."""
    if emulated:
        info = flash_ext.build_info()
        if not info["emulator"] or 64 not in info["emulator_head_dims"]:
            pytest.skip("the warp emulator with head dim 64 is not built (FLASH_EXT_EMULATOR=1)")
    else:
        skip_unless_head_dim_built("cpu", 64)
    q = torch.randn(1, 600, 2, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 512, 2, 64, dtype=torch.bfloat16)
    v = torch.randn(1, 512, 2, 64, dtype=torch.bfloat16)
    q[0, 300, 1] = float("nan")
    q[0, 50, 1] = float("nan")
    k[0, 400, 0] = float("nan")
    with flash_ext.emulate("sm80") if emulated else contextlib.nullcontext():
        out, lse, _ = flash_ext.flash_attn_func(q, k, v, causal=True, num_splits=num_splits,
                                                return_attn_probs=True)
    if emulated:
        assert flash_ext.emulator_report()["findings"] == 0, flash_ext.emulator_report()
    rows = torch.arange(600)
    empty = rows < 88
    nan_rows = torch.stack([rows >= 488, rows == 300])                      # (h, sq)
    assert torch.equal(lse[0].isnan(), nan_rows)
    assert torch.equal(out[0].isnan().all(-1).T, nan_rows) and torch.equal(out[0].isnan().any(-1).T, nan_rows)
    for h in range(2):
        assert (lse[0, h, empty] == float("inf")).all() and (out[0, empty, h] == 0).all()
        finite = ~empty & ~nan_rows[h]
        assert torch.isfinite(lse[0, h, finite]).all() and torch.isfinite(out[0, finite, h]).all()


def test_reference_keeps_nan_where_exact_attention_has_it() -> None:
    """The float64 oracle: a NaN score row was taken for an empty row (O = 0, LSE = +inf, as `row_max > -inf`
    is False for NaN), and NaN or inf in v reached every row through P @ V's 0 * NaN, masked keys included.
    Causal, sq = sk = 6, one head; the expected patterns follow from which keys each row sees (row i: keys <= i)."""
    q, k, v = (torch.randn(1, 6, 1, 8, dtype=torch.float64) for _ in range(3))
    q[0, 1, 0, 0] = float("nan")         # row 1's scores
    v[0, 3, 0, 2] = float("nan")         # key 3: rows 3, 4, 5, channel 2
    v[0, 4, 0, 5] = float("inf")         # key 4: rows 4, 5, channel 5, +inf
    v[0, 5, 0, 5] = float("-inf")        # key 5: row 5, channel 5: +inf and -inf meet -> NaN
    v[0, 2, 0, 7] = float("inf")         # key 2, dropped for row 4 only (dropout below)
    keep = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    keep[0, 0, 4, 2] = False
    out, lse = reference.attention_ref(q, k, v, causal=True, dropout_p=0.5, dropout_mask=keep)
    o = out[0, :, 0]                                                        # (sq, d)
    nan = {(1, c) for c in range(8)} | {(3, 2), (4, 2), (5, 2), (5, 5)}
    pos_inf = {(2, 7), (3, 7), (4, 5), (5, 7)}                              # (4, 7): key 2 dropped there
    for r in range(6):
        for c in range(8):
            x = o[r, c].item()
            want = "nan" if (r, c) in nan else "+inf" if (r, c) in pos_inf else "finite"
            got = "nan" if math.isnan(x) else "+inf" if x == math.inf else "finite" if math.isfinite(x) else "-inf"
            assert got == want, (r, c, x)
    assert lse[0, 0].isnan().tolist() == [False, True, False, False, False, False]
    assert torch.isfinite(lse[0, 0, [0, 2, 3, 4, 5]]).all()


# -- tests that must skip, not fail, on builds without a head dim ----------------------------------------

def test_head_dim_skip_rule() -> None:
    """A problem runs the smallest compiled head dim >= its own (padded to a multiple of 8): CI's CUDA
    build (64, 128) has no kernel for head dim 224, so a GPU test of it must skip with that reason."""
    info = {"host_head_dims": list(ALL_HEAD_DIMS), "gpu_head_dims": [64, 128], "cuda": True}
    assert head_dim_skip_reason("cuda", 224, info) is not None and "224" in head_dim_skip_reason("cuda", 224, info)
    assert head_dim_skip_reason("cuda", 100, info) is None        # runs the 128 kernel
    assert head_dim_skip_reason("cuda", 125, info) is None        # 128 after padding
    assert head_dim_skip_reason("cuda", 129, info) is not None
    assert head_dim_skip_reason("cpu", 224, info) is None
    assert head_dim_skip_reason("cpu", 8, {"host_head_dims": [], "gpu_head_dims": []}) is not None


# -- GPU host overhead -------------------------------------------------------------------------------------

def test_one_device_property_query_site() -> None:
    """cudaGetDeviceProperties costs about a millisecond per call; it ran two or three times per op call.
    Device facts now come from one helper (ops::device_info, ATen's cached properties)."""
    pattern = re.compile(r"cudaGetDeviceProperties|getDeviceProperties|cudaDeviceGetAttribute")
    sites = [f"{p.relative_to(ROOT)}:{i + 1}" for p in sorted((ROOT / "csrc").rglob("*"))
             if p.suffix in {".cpp", ".cu", ".cuh", ".h"}
             for i, line in enumerate(p.read_text().splitlines())
             if pattern.search(line) and not line.strip().startswith("//")]
    assert sites == [s for s in sites if s.startswith("csrc/ops/common.cpp")] and len(sites) == 1, sites


def test_every_op_guards_its_device_before_any_device_work() -> None:
    """The only device guards were at launch time, after the index read, the capture test and dropout's RNG
    state had run on the *current* device: tensors on cuda:1 with cuda:0 current queried (and created a
    context on) GPU 0, and a capture on q's device was not seen.  Each op entry now sets q's device (the
    dropout-mask op: rng_state's) as its first statement, before its ArgChecker.  Unverified on a GPU (no
    multi-GPU machine has run it); this checks the code's shape."""
    ops = {"fwd.cpp": ["flash_ext.fwd", "flash_ext.fwd"], "varlen.cpp": ["flash_ext.varlen_fwd"],
           "kvcache.cpp": ["flash_ext.kvcache_fwd"], "bwd.cpp": ["flash_ext.bwd", "flash_ext.varlen_bwd"],
           "dropout.cpp": ["flash_ext.dropout_mask"]}
    for name, checkers in ops.items():
        lines = (ROOT / "csrc" / "ops" / name).read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if re.match(r'\s*ArgChecker c\("', line)]
        assert [re.search(r'"(.*)"', lines[i]).group(1) for i in starts] == checkers, (name, starts)
        for i in starts:
            guard = lines[i - 1].strip()
            assert re.fullmatch(r"c10::OptionalDeviceGuard const device_guard\(cuda_device_of\((q|rng_state)\)\);",
                                guard), (name, i + 1, guard)


def _count_reads(fn) -> int:
    before = flash_ext._C.index_reads()
    fn()
    return flash_ext._C.index_reads() - before


def test_one_index_read_per_op_call() -> None:
    """Index validation did up to 6 blocking device-to-host copies per varlen call (4 for kvcache_fwd, 3
    for the append); now every index tensor of a call is gathered and read once."""
    skip_unless_head_dim_built("cpu", 64)
    q = torch.randn(9, 2, 64)
    pages = torch.randn(3, 128, 2, 64)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 150], dtype=torch.int32)
    used = torch.tensor([60, 50], dtype=torch.int32)
    table = torch.tensor([[2], [0]], dtype=torch.int32)
    assert _count_reads(lambda: flash_ext.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 5, 100,
                                                                 block_table=table, seqused_k=used)) == 1
    q4 = torch.randn(2, 1, 4, 64)
    k_cache = torch.randn(3, 32, 2, 64)
    new = torch.randn(2, 1, 2, 64)
    assert _count_reads(lambda: flash_ext.flash_attn_with_kvcache(
        q4, k_cache, k_cache.clone(), new, new, cache_seqlens=torch.tensor([3, 9], dtype=torch.int32),
        cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
        cache_leftpad=torch.tensor([1, 0], dtype=torch.int32))) == 1
    assert _count_reads(lambda: flash_ext.flash_attn_func(q4, q4, q4)) == 0


@pytest.mark.cuda
def test_no_index_copy_while_capturing() -> None:
    """Under CUDA graph capture the index values are trusted: no device-to-host copy (it would break the
    capture), and the captured graph replays correctly."""
    if not torch.cuda.is_available() or not flash_ext.build_info()["cuda"]:
        pytest.skip("needs a CUDA device and a CUDA build")
    skip_unless_head_dim_built("cuda", 64)
    q = torch.randn(9, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device="cuda")
    eager = flash_ext.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        before = flash_ext._C.index_reads()
        with torch.cuda.graph(graph):
            out = flash_ext.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5)
        assert flash_ext._C.index_reads() == before
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


# -- build flags and the module ---------------------------------------------------------------------------

def _cuda_flags_module():
    spec = importlib.util.spec_from_file_location("cuda_flags", ROOT / "scripts" / "cuda_flags.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_build_embeds_ptx_of_the_newest_arch() -> None:
    """SASS for sm_80/sm_90 alone gave "no kernel image" on Blackwell; PTX of the newest arch is JIT-able."""
    flags = _cuda_flags_module().gencode_flags(["80", "90"])
    pairs = [flags[i + 1] for i in range(0, len(flags), 2)]
    assert pairs == ["arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90", "arch=compute_90,code=compute_90"]
    assert _cuda_flags_module().gencode_flags(["80", "90a"])[-1] == "arch=compute_90,code=compute_90"
    setup_py = (ROOT / "setup.py").read_text()
    assert 'load_script("cuda_flags").gencode_flags(archs)' in setup_py


def test_build_archs_follow_the_users_knobs_then_the_visible_gpus() -> None:
    """Every arch is one more compile of every CUDA unit.  The build used "80;90" whatever the machine, even
    with TORCH_CUDA_ARCH_LIST set or one sm_90 GPU present (half its CUDA compile wasted there)."""
    mod = _cuda_flags_module()
    choose = mod.choose_archs
    # NGC containers' list: the pre-Ampere entries dropped, 8.0/8.6/8.7 served by one sm_80 SASS.
    archs, source = choose({"TORCH_CUDA_ARCH_LIST": "5.2 6.0 6.1 7.0 7.2 7.5 8.0 8.6 8.7 9.0+PTX"}, [])
    assert archs == ["80", "90"] and "7.5" in source
    assert choose({"TORCH_CUDA_ARCH_LIST": "8.6"}, [])[0] == ["86"]
    assert choose({"TORCH_CUDA_ARCH_LIST": "8.9;8.6"}, [])[0] == ["86"]
    assert choose({"TORCH_CUDA_ARCH_LIST": "9.0a"}, [])[0] == ["90a"]
    assert choose({"TORCH_CUDA_ARCH_LIST": "8.0,9.0,9.0a"}, [])[0] == ["80", "90", "90a"]
    assert choose({"TORCH_CUDA_ARCH_LIST": "Ampere;Hopper"}, [])[0] == ["80", "90"]
    assert choose({"TORCH_CUDA_ARCH_LIST": "Turing Ampere+PTX"}, [])[0] == ["80"]
    # FLASH_EXT_CUDA_ARCHS first, as written; then TORCH_CUDA_ARCH_LIST; then the GPUs; then the default.
    env = {"FLASH_EXT_CUDA_ARCHS": "90a", "TORCH_CUDA_ARCH_LIST": "8.0"}
    assert choose(env, [(8, 0)]) == (["90a"], "FLASH_EXT_CUDA_ARCHS")
    assert choose({"TORCH_CUDA_ARCH_LIST": "8.0"}, [(9, 0)])[0] == ["80"]
    assert choose({}, [(9, 0)])[0] == ["90"]
    assert choose({}, [(8, 6), (8, 9)])[0] == ["80"]
    assert choose({}, [(9, 0), (8, 0)])[0] == ["80", "90"]
    assert choose({}, [])[0] == ["80", "90"]
    assert choose({}, [(10, 0)])[0] == ["80", "90"]  # not a family the rule covers: the default and its PTX
    for env in ({"TORCH_CUDA_ARCH_LIST": "7.5"}, {"TORCH_CUDA_ARCH_LIST": "sm_80"},
                {"FLASH_EXT_CUDA_ARCHS": "75;80"}, {"FLASH_EXT_CUDA_ARCHS": "ampere"}):
        with pytest.raises(mod.ArchError) as e:
            choose(env, [])
        assert repr(next(iter(env.values()))) in str(e.value)
    setup_py = (ROOT / "setup.py").read_text()
    assert "mod.choose_archs(os.environ, capabilities)" in setup_py


def test_sdist_carries_what_setup_py_compiles() -> None:
    """An sdist held csrc/'s .cpp files only (setuptools' default): no header, no CUDA or emulator source, none
    of the scripts setup.py loads, so `pip install` of it and `python -m build` (wheel from the sdist) failed.
    MANIFEST.in must graft csrc/ and include every script setup.py loads."""
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    assert "graft csrc" in manifest
    included = {word for line in manifest if line.startswith("include ") for word in line.split()[1:]}
    loaded = set(re.findall(r'load_script\("(\w+)"\)', (ROOT / "setup.py").read_text()))
    assert loaded and {f"scripts/{name}.py" for name in loaded} <= included, (loaded, included)


def test_C_is_a_pybind_module_and_registers_nothing_twice() -> None:
    """flash_ext._C was an empty CPython module and Python re-derived the plan; now the non-op C++ functions
    are pybind11 functions, the ops stay TORCH_LIBRARY ops, and no name is both."""
    functions = {"build_info", "compiled_kernels", "plan_fwd", "num_splits_heuristic", "set_poison_outputs",
                 "index_reads"}
    for name in functions:
        fn = getattr(flash_ext._C, name)
        assert type(fn).__name__ == "builtin_function_or_method" and fn.__doc__, name
    ops = set(torch.ops.flash_ext.__dir__()) if hasattr(torch.ops.flash_ext, "__dir__") else set()
    registered = {name for name in ("fwd", "varlen_fwd", "kvcache_fwd", "_plan_fwd", "_build_info",
                                    "_num_splits_heuristic", "_set_poison_outputs", "kvcache_append_")
                  if hasattr(torch.ops.flash_ext, name)}
    assert registered == {"fwd", "varlen_fwd", "kvcache_fwd"}, registered
    assert not {n.lstrip("_") for n in ops} & functions
    kernels = flash_ext.compiled_kernels()
    info = flash_ext.build_info()
    assert {k["backend"] for k in kernels} == ({"cpu"} | ({"cuda"} if info["cuda"] else set())
                                               | ({"emulator"} if info["emulator"] else set()))
    assert {k["head_dim"] for k in kernels if k["backend"] == "emulator"} == set(info["emulator_head_dims"])
    assert {k["head_dim"] for k in kernels if k["backend"] == "cpu"} == set(flash_ext.build_info()["host_head_dims"])


def test_einops_is_a_declared_dependency() -> None:
    """The reference (and the padding helpers) use einops: it must be installed with the package."""
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"einops\b", d) for d in deps), deps


# -- flash_attn 2.8 compatibility found by an audit against its source (2026-12-03) ---------------------

def _strided_last(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, last-dimension stride 2."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def test_strided_last_dimension_is_made_contiguous_as_in_flash_attn() -> None:
    """flash_attn's Python layer makes q/k/v (and dout) contiguous when stride(-1) != 1; these calls were
    refused with a ValueError.  The strided call must equal the float64 reference and the contiguous call."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 17, 4, 64), torch.randn(2, 23, 2, 64), torch.randn(2, 23, 2, 64)
    qs, ks, vs = (_strided_last(t) for t in (q, k, v))
    assert qs.stride(-1) == 2
    out = flash_ext.flash_attn_func(qs, ks, vs, causal=True)
    ref, _ = reference.attention_ref(q, k, v, causal=True)
    assert (out.double() - ref).abs().max() < 1e-5
    assert torch.equal(out, flash_ext.flash_attn_func(q, k, v, causal=True))
    cu = torch.tensor([0, 7, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 23], dtype=torch.int32)
    out_v = flash_ext.flash_attn_varlen_func(qs[0], ks[0], vs[0], cu, cu_k, 10, 14)
    assert torch.equal(out_v, flash_ext.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 10, 14))
    # kvcache: q and the new k/v (the caches are written in place and must stay as given)
    kc, vc = torch.zeros(2, 32, 2, 64), torch.zeros(2, 32, 2, 64)
    kc2, vc2 = kc.clone(), vc.clone()
    o1 = flash_ext.flash_attn_with_kvcache(qs[:, :1], kc, vc, ks[:, :3], vs[:, :3], cache_seqlens=5)
    o2 = flash_ext.flash_attn_with_kvcache(q[:, :1], kc2, vc2, k[:, :3], v[:, :3], cache_seqlens=5)
    assert torch.equal(o1, o2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    # the explicit backward with a strided dout
    out, lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True)
    dout = torch.randn_like(out)
    g1 = flash_ext.flash_attn_backward(_strided_last(dout), q, k, v, out, lse)
    g2 = flash_ext.flash_attn_backward(dout, q, k, v, out, lse)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_varlen_q_rows_past_the_last_sequence() -> None:
    """flash_attn takes total_q = q.shape[0] and accepts q with rows past cu_seqlens_q[-1] (batches padded to a
    fixed token count, e.g. for CUDA graphs); this was refused.  The real rows equal the unpadded call and the
    float64 reference; the padding rows get O = 0, LSE = +inf and zero gradients (flash_attn leaves them
    unwritten)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(16, 2, 64, requires_grad=True), torch.randn(12, 2, 64), torch.randn(12, 2, 64)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    out, lse, _ = flash_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 7, causal=True, return_attn_probs=True)
    assert out.shape == (16, 2, 64) and lse.shape == (2, 16)
    for i in range(2):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        ref, ref_lse = reference.attention_ref(q[None, qs].detach(), k[None, ks], v[None, ks], causal=True)
        assert (out[qs].detach().double() - ref[0]).abs().max() < 1e-5
        assert (lse[:, qs].double() - ref_lse[0]).abs().max() < 1e-5
    assert torch.equal(out[10:], torch.zeros(6, 2, 64)) and bool(torch.isposinf(lse[:, 10:]).all())
    dout = torch.randn_like(out)
    out.backward(dout)
    q_real = q[:10].detach().clone().requires_grad_()
    out_real = flash_ext.flash_attn_varlen_func(q_real, k, v, cu_q, cu_k, 6, 7, causal=True)
    out_real.backward(dout[:10])
    assert torch.equal(q.grad[:10], q_real.grad) and torch.equal(q.grad[10:], torch.zeros(6, 2, 64))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]: got 17; must be <= the number of rows 16"):
        flash_ext.flash_attn_varlen_func(q.detach(), k, v, torch.tensor([0, 4, 17], dtype=torch.int32), cu_k, 13, 7)


def test_s_dmask_is_an_empty_tensor_without_dropout() -> None:
    """flash_attn returns torch.empty(0) (q's dtype) as S_dmask without dropout; callers use .numel() on it."""
    q = torch.randn(1, 5, 2, 32, dtype=torch.bfloat16)
    for fn, args in [(flash_ext.flash_attn_func, (q, q, q)),
                     (flash_ext.flash_attn_varlen_func, (q[0], q[0], q[0], torch.tensor([0, 5], dtype=torch.int32),
                                                         torch.tensor([0, 5], dtype=torch.int32), 5, 5))]:
        s_dmask = fn(*args, return_attn_probs=True)[2]
        assert isinstance(s_dmask, torch.Tensor) and s_dmask.shape == (0,) and s_dmask.dtype == torch.bfloat16


def test_kvcache_append_to_an_inference_tensor_outside_inference_mode() -> None:
    """A cache made under torch.inference_mode() and a step run outside it (under no_grad): torch refuses the
    op's in-place update only after the op ran, so the cache was appended to by a call that raised (and a
    retry appended twice).  flash_attn appends; so must this, once, returning normal tensors."""
    torch.manual_seed(2)
    with torch.inference_mode():
        kc, vc = torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64)
    kc_plain, vc_plain = kc.clone(), vc.clone()  # outside inference mode: normal tensors
    q, kn, vn = torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64)
    with torch.no_grad():
        out, lse = flash_ext.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=3, return_softmax_lse=True)
    expected = flash_ext.flash_attn_with_kvcache(q, kc_plain, vc_plain, kn, vn, cache_seqlens=3)
    assert torch.equal(out, expected) and torch.equal(kc, kc_plain) and torch.equal(vc, vc_plain)
    assert torch.equal(kc[:, 3:4], kn) and not out.is_inference() and not lse.is_inference()


def test_kvcache_append_into_overlapping_caches_is_refused() -> None:
    """An expand()ed cache (entries sharing memory) or one tensor as both caches: one append overwrote another,
    a silently wrong result.  Refused before any write."""
    q, kn = torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64)
    base = torch.randn(1, 16, 2, 64)
    shared = base.expand(2, 16, 2, 64)
    vc = torch.randn(2, 16, 2, 64)
    before = base.clone()
    with pytest.raises(ValueError, match=r"k_cache: got strides \[0, .*must not overlap itself"):
        flash_ext.flash_attn_with_kvcache(q, shared, vc, kn, kn, cache_seqlens=3)
    assert torch.equal(base, before)
    kc = torch.randn(2, 16, 2, 64)
    with pytest.raises(ValueError, match="k_cache/v_cache: got tensors sharing memory"):
        flash_ext.flash_attn_with_kvcache(q, kc, kc, kn, kn, cache_seqlens=3)
    # one packed KV-cache slice passed as both caches: not dense, so torch cannot tell; refused all the same
    kv = torch.zeros(2, 16, 2, 2, 64)
    with pytest.raises(ValueError, match="k_cache/v_cache: got tensors sharing memory"):
        flash_ext.flash_attn_with_kvcache(q, kv[:, :, 0], kv[:, :, 0], kn, kn, cache_seqlens=3)
    assert (kv == 0).all()
    # the two slices of a packed KV cache do not share an element: appended to like separate caches
    out = flash_ext.flash_attn_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], kn, 2 * kn, cache_seqlens=3)
    assert torch.equal(kv[:, 3:4, 0], kn) and torch.equal(kv[:, 3:4, 1], 2 * kn) and torch.isfinite(out).all()
    # without an append, shared or repeated entries are only read: allowed
    out = flash_ext.flash_attn_with_kvcache(q, shared, shared, cache_seqlens=3,
                                            cache_batch_idx=torch.tensor([0, 0], dtype=torch.int32))
    assert out.shape == q.shape


@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_repeated_cache_batch_idx_appends_deterministically(causal: bool) -> None:
    """flash_attn 2.8 takes a repeated cache_batch_idx with new k/v ("the values updated in the cache might come
    from any of the duplicate indices"; e.g. padding entries pointed at one spare slot); it was refused.  Now
    taken, with the rule written out: where two entries write one cache row the later batch entry's row is
    stored, and every entry attends to its cache entry as it is after all appends.  Expected cache built
    row by row here, outputs from the float64 reference on it."""
    torch.manual_seed(11)
    b, h, hk, d, cap, new = 4, 4, 2, 64, 16, 2
    q = torch.randn(b, new, h, d)
    kc, vc = torch.randn(3, cap, hk, d), torch.randn(3, cap, hk, d)
    kn, vn = torch.randn(b, new, hk, d), torch.randn(b, new, hk, d)
    idx = [1, 0, 1, 1]     # entries 0, 2 and 3 share cache entry 1
    lens = [3, 5, 4, 9]    # entry 0 writes rows 3-4, entry 2 rows 4-5 (row 4 overlaps), entry 3 rows 9-10
    kc_ref, vc_ref = kc.clone(), vc.clone()
    for i in range(b):     # batch order: a later entry overwrites an earlier one's row
        for t in range(new):
            kc_ref[idx[i], lens[i] + t], vc_ref[idx[i], lens[i] + t] = kn[i, t], vn[i, t]
    out, lse = flash_ext.flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
        cache_batch_idx=torch.tensor(idx, dtype=torch.int32), causal=causal, return_softmax_lse=True)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    for i in range(b):
        keys = lens[i] + new
        ref_out, ref_lse = reference.attention_ref(q[i:i + 1], kc_ref[idx[i]:idx[i] + 1, :keys],
                                                   vc_ref[idx[i]:idx[i] + 1, :keys], causal=causal)
        torch.testing.assert_close(out[i:i + 1].double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[i:i + 1].double(), ref_lse, atol=1e-5, rtol=1e-5)
    # Entry 0's row 4 lost to entry 2's: the cache holds entry 2's key there, not entry 0's.
    assert torch.equal(kc[1, 4], kn[2, 0]) and not torch.equal(kc[1, 4], kn[0, 1])


def test_kvcache_new_rows_that_view_a_cache_append_their_values_before_the_call() -> None:
    """New k/v that are views of the caches (a step re-appending cached rows) were read while the append wrote
    over them: a partial write then an error (one entry), or a silently wrong cache (two)."""
    torch.manual_seed(3)
    for b in (1, 2):
        kc, vc = torch.randn(b, 16, 2, 64), torch.randn(b, 16, 2, 64)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q = torch.randn(b, 2, 2, 64)
        new_k, new_v = kc[:, 1:3], vc[:, 2:4]  # views of the caches, overlapping the rows written ([3, 5))
        expected = flash_ext.flash_attn_with_kvcache(q, kc_ref, vc_ref, new_k.clone(), new_v.clone(), cache_seqlens=3)
        out = flash_ext.flash_attn_with_kvcache(q, kc, vc, new_k, new_v, cache_seqlens=3)
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref) and torch.equal(out, expected), b


def test_kvcache_op_refuses_inference_caches_outside_inference_mode_before_writing() -> None:
    """The op called directly (the Python function switches inference mode on itself): torch refused the update
    only after the op had appended."""
    with torch.inference_mode():
        kc, vc = torch.randn(1, 16, 2, 64), torch.randn(1, 16, 2, 64)
    before = kc.clone(), vc.clone()
    q, kn = torch.randn(1, 1, 2, 64), torch.randn(1, 1, 2, 64)
    with pytest.raises(ValueError, match=r"(?s)k_cache: got an inference tensor .*v_cache: got an inference tensor"):
        torch.ops.flash_ext.kvcache_fwd(q, kc, vc, kn, kn, torch.tensor([3], dtype=torch.int32), None, None, None,
                                        0.125, False, -1, -1, 0.0, None)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_paged_append_into_a_page_row_another_entry_uses_is_refused() -> None:
    """Two entries whose appends land on the same page rows (or one entry's append on rows another reads) lost
    one entry's key silently; the non-paged path already refused repeated cache entries.  A prefix page that
    entries only read is shared legitimately."""
    torch.manual_seed(4)
    kc, vc = torch.randn(4, 128, 2, 64), torch.randn(4, 128, 2, 64)
    before = kc.clone(), vc.clone()
    q, kn = torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64)
    seqlens = torch.tensor([3, 3], dtype=torch.int32)
    cases = [([[0, 1], [0, 2]], r"page 0 row 3 appended to by batch entry 0 \(its row 3\) and (read|appended to) "
                                r"by entry 1"),
             ([[0, 1], [2, 3]], None)]
    for table, needle in cases:
        table = torch.tensor(table, dtype=torch.int32)
        if needle is None:
            flash_ext.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, kn, cache_seqlens=seqlens,
                                              block_table=table)
            continue
        with pytest.raises(ValueError, match=needle):
            flash_ext.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=seqlens, block_table=table)
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    # Entry 1 reads page 0 (rows 0-127) as its prefix while entry 0 appends to it at row 3.
    with pytest.raises(ValueError, match="read by entry 1"):
        flash_ext.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=torch.tensor([3, 130], dtype=torch.int32),
                                          block_table=torch.tensor([[0, 1], [0, 2]], dtype=torch.int32))
    assert torch.equal(kc, before[0])
    # A shared prefix page only read, each entry appending to a page of its own: fine.
    out = flash_ext.flash_attn_with_kvcache(q, kc, vc, kn, kn,
                                            cache_seqlens=torch.tensor([130, 130], dtype=torch.int32),
                                            block_table=torch.tensor([[0, 1], [0, 2]], dtype=torch.int32))
    assert out.shape == q.shape and torch.equal(kc[1, 2], kn[0, 0]) and torch.equal(kc[2, 2], kn[1, 0])


def test_paged_append_conflicts_against_a_slot_by_slot_model() -> None:
    """check_paged_append against the rule written out slot by slot: refused iff a page row that an append
    writes as (entry i, row r) is also read or written as any other (entry, row).  Random small block tables
    with shared pages, pages listed twice and appends that cross page boundaries."""
    gen = torch.Generator().manual_seed(9)
    page, num_pages, b = 128, 8, 3
    kc, vc = torch.zeros(num_pages, page, 1, 8), torch.zeros(num_pages, page, 1, 8)
    q = torch.randn(b, 1, 1, 8)
    verdicts = set()
    for case in range(60):
        if case % 2:  # pages drawn with repeats: shared, and listed twice
            table = torch.randint(0, num_pages, (b, 2), generator=gen, dtype=torch.int32)
        else:  # distinct pages, then one entry's first page given to another as its prefix
            table = torch.randperm(num_pages, generator=gen)[:2 * b].view(b, 2).to(torch.int32)
            table[case // 2 % b, 0] = table[(case // 2 + 1) % b, 0]
        new = int(torch.randint(1, 140, (1,), generator=gen))
        lens = torch.randint(0, 2 * page - new + 1, (b,), generator=gen, dtype=torch.int32)
        owner = {}  # (page, row) -> the (entry, logical row) pairs that touch it
        for i in range(b):
            for r in range(int(lens[i]) + new):
                owner.setdefault((int(table[i, r // page]), r % page), set()).add((i, r))
        conflict = any(len(owner[(int(table[i, r // page]), r % page)]) > 1
                       for i in range(b) for r in range(int(lens[i]), int(lens[i]) + new))
        kn = torch.randn(b, new, 1, 8)
        k0, v0 = kc.clone(), vc.clone()
        if conflict:
            with pytest.raises(ValueError, match="block_table: got page"):
                flash_ext.flash_attn_with_kvcache(q, k0, v0, kn, kn, cache_seqlens=lens, block_table=table)
            assert torch.equal(k0, kc) and torch.equal(v0, vc)
        else:
            flash_ext.flash_attn_with_kvcache(q, k0, v0, kn, kn, cache_seqlens=lens, block_table=table)
        verdicts.add(conflict)
    assert verdicts == {True, False}


def test_kvcache_new_rows_of_another_dtype_are_refused() -> None:
    """New k/v were cast into the cache's dtype before the op's check: a float64 k of 1e6 landed in an fp16
    cache as inf, an int64 v was accepted.  flash_attn refuses both; rotary tables must be floating point."""
    q = torch.randn(1, 1, 2, 64, dtype=torch.float16)
    kc, vc = torch.randn(1, 16, 2, 64, dtype=torch.float16), torch.randn(1, 16, 2, 64, dtype=torch.float16)
    before = kc.clone(), vc.clone()
    kn = torch.full((1, 1, 2, 64), 1e6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"k/v\.dtype: got Double/Long"):
        flash_ext.flash_attn_with_kvcache(q, kc, vc, kn, kn.long(), cache_seqlens=3)
    table = torch.ones(8, 16, dtype=torch.int64)
    with pytest.raises(ValueError, match="rotary_cos/rotary_sin: got dtypes torch.int64"):
        flash_ext.flash_attn_with_kvcache(q, kc, vc, kn.half(), kn.half(), table, table, cache_seqlens=3)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_flash_attn_lenient_values_mean_what_they_mean_there() -> None:
    """Values flash_attn 2.8 takes that flash_ext refused: softcap <= 0 is off (its docstring), a negative window
    side is unbounded and num_splits < 1 picks the heuristic (its C++ API), NumPy integers as window sides.
    Each must give the result of its canonical spelling, in every entry point."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 40, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    pairs = [(dict(softcap=-3.0), dict(softcap=0.0)),
             (dict(window_size=(-5, -2)), dict()),
             (dict(window_size=(-2, 0)), dict(causal=True)),
             (dict(window_size=(np.int64(7), np.int32(0))), dict(window_size=(7, 0))),
             (dict(num_splits=-1), dict(num_splits=0))]
    cu = torch.tensor([0, 40, 80], dtype=torch.int32)
    kc, vc = torch.zeros(2, 64, 2, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 2, 64, dtype=torch.bfloat16)
    calls = {
        "func": lambda kw: flash_ext.flash_attn_func(q, k, v, **kw),
        "varlen": lambda kw: flash_ext.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu,
                                                              cu, 40, 40, **kw),
        "kvcache": lambda kw: flash_ext.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=0, **kw),
    }
    for name, call in calls.items():
        for lenient, canonical in pairs:
            assert torch.equal(call(lenient), call(canonical)), (name, lenient)


def test_kvcache_rotary_positions_follow_flash_attn_window_clamp() -> None:
    """flash_attn makes a window side of at least the cache capacity unbounded before deciding whether q's rows
    are rotated at their own positions (causal or local) or all at cache_seqlens: (capacity, -1) is not local."""
    torch.manual_seed(6)
    q = torch.randn(1, 4, 2, 64)
    kc, vc = torch.randn(1, 32, 2, 64), torch.randn(1, 32, 2, 64)
    kn, vn = torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64)
    cos, sin = torch.rand(64, 16), torch.rand(64, 16)
    outs = [flash_ext.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cos, sin, cache_seqlens=5,
                                              window_size=w) for w in [(-1, -1), (32, -1), (-1, 40)]]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    local = flash_ext.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cos, sin, cache_seqlens=5,
                                             window_size=(31, -1))
    assert not torch.equal(outs[0], local)  # a bounded side: q row j rotated at cache_seqlens + j


def test_empty_inputs_with_a_strided_last_dimension() -> None:
    """Empty q or k/v whose last dimension has a stride (maybe_contiguous leaves empty tensors as they are) were
    refused for the stride; there is nothing to read."""
    base = torch.randn(2, 8, 2, 128)
    q, k = base[:, :, :, ::2], base[:, :, :, ::2]
    for qq, kk in [(q[:0], k[:0]), (q[:, :0], k), (q, k[:, :0])]:
        out = flash_ext.flash_attn_func(qq, kk, kk)
        assert out.shape == qq.shape and (out == 0).all()


@pytest.mark.parametrize("d", [64, 60])  # 60: the padded path, which must apply the same rules
def test_bwd_refuses_gradient_buffers_that_overlap(d: int) -> None:
    """dk and dv as one tensor, an expand()ed dk, dq aliasing q: a wrong gradient with no error; also through
    views that are not dense (torch's overlap test answers "too hard" for them, which was taken as "no"): one
    packed slice passed twice, two views 8 elements apart, dq a fresh view of the packed q it reads.  Slices of
    one packed buffer (flash_attn's qkv-packed backward passes dqkv[:, :, i]) do not overlap and stay
    accepted.  Nothing is written by a refused call."""
    torch.manual_seed(7)
    qkv = torch.randn(1, 16, 3, 2, d)
    q, k, v = qkv.unbind(2)
    out, lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True)
    dout = torch.randn_like(out)
    g = lambda: torch.empty_like(q)  # noqa: E731
    one = g()
    packed = torch.zeros(1, 16, 2, 2, d)
    shifted = torch.zeros(1, 16, 2, d + 8)
    bad = [((g(), one, one), "dk/dv: got tensors sharing memory"),
           ((g(), torch.empty(1, 1, 2, d).expand(1, 16, 2, d), g()), "dk: got strides"),
           ((q, g(), g()), "dq/q: got tensors sharing memory"),
           ((g(), packed[:, :, 0], packed[:, :, 0]), "dk/dv: got tensors sharing memory"),
           ((g(), shifted[..., :d], shifted[..., 8:]), "dk/dv: got tensors sharing memory"),
           ((qkv[:, :, 0], g(), g()), "dq/q: got tensors sharing memory")]
    before = qkv.clone()
    for (dq, dk, dv), needle in bad:
        with pytest.raises(ValueError, match=needle):
            flash_ext.flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv)
    assert torch.equal(qkv, before) and (packed == 0).all() and (shifted == 0).all()
    dqkv = torch.empty(1, 16, 3, 2, d)
    grads = flash_ext.flash_attn_backward(dout, q, k, v, out, lse, dqkv[:, :, 0], dqkv[:, :, 1], dqkv[:, :, 2])
    ref = flash_ext.flash_attn_backward(dout, q, k, v, out, lse)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref))
    assert torch.equal(dqkv[:, :, 1], ref[1])
    # a fused GQA/MQA projection's gradient split into h, h_k, h_k heads: views of other sizes, disjoint
    for hk in (2, 1):
        fused = torch.randn(1, 16, 4 + 2 * hk, d)
        qg, kg, vg = fused.split([4, hk, hk], dim=2)
        out_g, lse_g, _ = flash_ext.flash_attn_func(qg, kg, vg, return_attn_probs=True)
        dout_g = torch.randn_like(out_g)
        dfused = torch.empty_like(fused)
        grads = flash_ext.flash_attn_backward(dout_g, qg, kg, vg, out_g, lse_g, *dfused.split([4, hk, hk], dim=2))
        ref = flash_ext.flash_attn_backward(dout_g, qg, kg, vg, out_g, lse_g)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref)), hk


def test_backward_checks_caller_buffers_before_writing_when_the_head_dim_is_padded() -> None:
    """At a head dim that is not a multiple of 8 the op writes padded stand-ins, so the caller's tensors and
    buffers go through the op's own checks first: the same rules and messages as an unpadded head dim (dq
    written then an error not naming dk, a dq of another dtype cast, a strided dq or dq aliasing q taken, the
    other errors left out, padded shapes in messages: all seen before), nothing written on a refusal."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(1, 16, 2, 60) for _ in range(3))
    out, lse, _ = flash_ext.flash_attn_func(q, k, v, return_attn_probs=True)
    dout = torch.randn_like(out)
    dq = torch.zeros_like(q)
    with pytest.raises(ValueError) as refused:
        flash_ext.flash_attn_backward(dout, q, k, v, out.half(), lse.double(), dq, torch.empty(1, 15, 2, 60),
                                      softmax_scale=-1.0)
    msg = str(refused.value)
    for w in ["dk: got Float [1, 15, 2, 60]", "out: got Half [1, 16, 2, 60]", "softmax_lse: got Double",
              "softmax_scale: got -1"]:
        assert w in msg, f"{w!r} missing from:\n{msg}"
    assert (dq == 0).all()
    with pytest.raises(ValueError, match="dq: got Half"):
        flash_ext.flash_attn_backward(dout, q, k, v, out, lse, dq.half())
    with pytest.raises(ValueError, match=r"dq.stride\(-1\): got 2"):
        flash_ext.flash_attn_backward(dout, q, k, v, out, lse, torch.zeros(1, 16, 2, 120)[..., ::2])
    with pytest.raises(ValueError, match="dq/q: got tensors sharing memory"):
        flash_ext.flash_attn_backward(dout, q, k, v, out, lse, q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    with pytest.raises(ValueError, match="dq: got None"):  # the op itself, as flash_attn's callers may call it
        torch.ops.flash_ext.bwd(dout, q, k, v, out, lse, None, dk, dv, 0.0, 0.125, False, -1, -1, 0.0, None, False)
    assert (dk == 0).all() and (dv == 0).all()


def test_index_value_errors_name_the_value() -> None:
    """The rule: an error names the argument, the value and the rule.  Three index errors named only where."""
    qv, kv = torch.randn(10, 2, 64), torch.randn(12, 2, 64)
    cq, ck = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seqused_k: got value 6 at index 0; must be within \[0, that sequence's key count 5\]"):
        flash_ext.flash_attn_varlen_func(qv, kv, kv, cq, ck, 6, 7, seqused_k=torch.tensor([6, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q: got a decrease at index 2 \(6 then 4\)"):
        flash_ext.flash_attn_varlen_func(qv, kv, kv, torch.tensor([0, 6, 4, 10], dtype=torch.int32),
                                         torch.tensor([0, 5, 6, 12], dtype=torch.int32), 6, 7)
    with pytest.raises(ValueError, match=r"block_table: got value 9 at \[1, 0\]"):
        flash_ext.flash_attn_with_kvcache(torch.randn(2, 1, 2, 64), torch.randn(4, 128, 2, 64), torch.randn(4, 128, 2, 64),
                                          cache_seqlens=100, block_table=torch.tensor([[0], [9]], dtype=torch.int32))


def test_build_info_has_every_documented_key() -> None:
    """build_info()'s docstring is its contract: the keys it names are the keys there (a GPU run once found
    ``gpu_bwd_head_dims`` documented and used by the tests but never set by the extension)."""
    documented = set(re.findall(r"``(\w+)``:", flash_ext.build_info.__doc__))
    assert {"cuda", "gpu_head_dims", "gpu_bwd_head_dims", "host_head_dims", "cpu_isa"} <= documented
    info = flash_ext.build_info()
    assert documented == set(info), (documented - set(info), set(info) - documented)  # no key undocumented
    assert set(info["gpu_bwd_head_dims"]) <= set(info["gpu_head_dims"])
    if not info["cuda"]:
        assert info["gpu_bwd_head_dims"] == [] and info["gpu_head_dims"] == []
