"""The op layer's contract (issue #9): no crash, no partial write, no silent truncation, NaN independent of
the split path, no autograd history in a KV cache, one host read of index tensors per call, one cached
device query, the pybind module, the build's arch flags.  Each test failed before its fix."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
import torch

import flash_ext
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
        ("softcap < 0", dict(q=q, softcap=-1.0), "softcap"),
        ("num_splits too large", dict(q=q, num_splits=129), "num_splits"),
        ("window (-3, 0)", dict(q=q, window_size=(-3, 0)), r"window_size\[0\]"),
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

@pytest.mark.parametrize("num_splits", [1, 4])
def test_nan_propagates_whatever_the_split_count(num_splits: int) -> None:
    """Causal, sq 600 > sk 512: rows 0..87 see no key.  NaN in q at row 300 of head 1 and in k at key 400
    of K/V head 0: exactly the rows that see a NaN are NaN in O and LSE (rows >= 488 of head 0, row 300 of
    head 1); rows that see no key stay O = 0, LSE = +inf (row 50 of head 1 has NaN in q but sees nothing);
    every other row is finite.  Before the fix, NaN in q gave NaN unsplit but 0 split, and NaN in k gave
    LSE +inf unsplit but a finite LSE split."""
    skip_unless_head_dim_built("cpu", 64)
    q = torch.randn(1, 600, 2, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 512, 2, 64, dtype=torch.bfloat16)
    v = torch.randn(1, 512, 2, 64, dtype=torch.bfloat16)
    q[0, 300, 1] = float("nan")
    q[0, 50, 1] = float("nan")
    k[0, 400, 0] = float("nan")
    out, lse, _ = flash_ext.flash_attn_func(q, k, v, causal=True, num_splits=num_splits, return_attn_probs=True)
    rows = torch.arange(600)
    empty = rows < 88
    nan_rows = torch.stack([rows >= 488, rows == 300])                      # (h, sq)
    assert torch.equal(lse[0].isnan(), nan_rows)
    assert torch.equal(out[0].isnan().all(-1).T, nan_rows) and torch.equal(out[0].isnan().any(-1).T, nan_rows)
    for h in range(2):
        assert (lse[0, h, empty] == float("inf")).all() and (out[0, empty, h] == 0).all()
        finite = ~empty & ~nan_rows[h]
        assert torch.isfinite(lse[0, h, finite]).all() and torch.isfinite(out[0, finite, h]).all()


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
