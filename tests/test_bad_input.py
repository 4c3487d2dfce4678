"""Invalid arguments give one ValueError that names every offending argument (and never crash)."""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

import flash_ext
from flash_ext import bert_padding
from flash_ext import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flash_ext import flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func

from conftest import require_device


def _qkv(b=2, sq=16, sk=24, h=4, hk=2, d=64, dtype=torch.float16, device="cpu"):
    return (torch.randn(b, sq, h, d, dtype=dtype, device=device),
            torch.randn(b, sk, hk, d, dtype=dtype, device=device),
            torch.randn(b, sk, hk, d, dtype=dtype, device=device))


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def _noncontig_last(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, last-dimension stride 2."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def _fwd_op(q, k, v):
    return torch.ops.flash_ext.fwd(q, k, v, 0.125, False, -1, -1, 0.0, None)


q0, k0, v0 = _qkv()

# (id, call, words the message must contain)
CASES = [
    ("fp64", lambda: flash_attn_func(q0.double(), k0.double(), v0.double()), ["q.dtype", "Double"]),
    ("int32", lambda: flash_attn_func(q0.int(), k0.int(), v0.int()), ["q.dtype"]),
    ("k_dtype_mismatch", lambda: flash_attn_func(q0, k0.bfloat16(), v0), ["k.dtype/v.dtype", "BFloat16"]),
    ("v_dtype_mismatch", lambda: flash_attn_func(q0, k0, v0.float()), ["k.dtype/v.dtype", "Float"]),
    # The op takes a contiguous last dimension; the Python functions make one, as flash_attn does (test_contract).
    ("q_last_dim_strided", lambda: _fwd_op(_noncontig_last(q0), k0, v0), ["q.stride(-1)", "contiguous"]),
    ("k_last_dim_strided", lambda: _fwd_op(q0, _noncontig_last(k0), v0), ["k.stride(-1)"]),
    ("v_last_dim_strided", lambda: _fwd_op(q0, k0, _noncontig_last(v0)), ["v.stride(-1)"]),
    ("q_3d", lambda: flash_attn_func(q0[0], k0, v0), ["q", "3 dims"]),
    ("k_5d", lambda: flash_attn_func(q0, k0[None], v0), ["k", "5 dims"]),
    ("v_3d", lambda: flash_attn_func(q0, k0, v0[0]), ["v", "3 dims"]),
    ("head_dim_264", lambda: flash_attn_func(*_qkv(d=264)), ["head_dim", "264", "256"]),
    ("head_dim_300", lambda: flash_attn_func(*_qkv(d=300)), ["head_dim", "300", "256"]),
    ("heads_not_multiple", lambda: flash_attn_func(*_qkv(h=6, hk=4)), ["heads", "6", "4", "multiple"]),
    ("heads_k_gt_q", lambda: flash_attn_func(*_qkv(h=2, hk=4)), ["heads"]),
    ("kv_shape_mismatch", lambda: flash_attn_func(q0, k0, v0[:, :20]), ["v.shape", "k.shape"]),
    ("kv_head_dim_mismatch", lambda: flash_attn_func(q0, k0, v0[..., :32]), ["v.shape"]),
    ("q_k_head_dim_mismatch", lambda: flash_attn_func(q0[..., :32].contiguous(), k0, v0), ["k.shape[-1]"]),
    ("batch_mismatch", lambda: flash_attn_func(q0, k0[:1], v0[:1]), ["k.shape[0]"]),
    ("alibi_wrong_len", lambda: flash_attn_func(q0, k0, v0, alibi_slopes=torch.rand(5)), ["alibi_slopes.shape", "[5]"]),
    ("alibi_wrong_batch", lambda: flash_attn_func(q0, k0, v0, alibi_slopes=torch.rand(3, 4)), ["alibi_slopes.shape"]),
    ("alibi_3d", lambda: flash_attn_func(q0, k0, v0, alibi_slopes=torch.rand(2, 4, 1)), ["alibi_slopes.shape"]),
    ("alibi_fp16", lambda: flash_attn_func(q0, k0, v0, alibi_slopes=torch.rand(4).half()), ["alibi_slopes.dtype"]),
    ("alibi_fp64", lambda: flash_attn_func(q0, k0, v0, alibi_slopes=torch.rand(4).double()), ["alibi_slopes.dtype"]),
    ("window_float", lambda: flash_attn_func(q0, k0, v0, window_size=(1.5, 0)), ["window_size", "1.5"]),
    ("window_not_pair", lambda: flash_attn_func(q0, k0, v0, window_size=(1, 2, 3)), ["window_size"]),
    ("window_int", lambda: flash_attn_func(q0, k0, v0, window_size=4), ["window_size"]),
    ("softcap_nan", lambda: flash_attn_func(q0, k0, v0, softcap=float("nan")), ["softcap"]),
    ("softcap_inf", lambda: flash_attn_func(q0, k0, v0, softcap=float("inf")), ["softcap"]),
    ("scale_nan", lambda: flash_attn_func(q0, k0, v0, softmax_scale=float("nan")), ["softmax_scale"]),
    ("scale_inf", lambda: flash_attn_func(q0, k0, v0, softmax_scale=float("inf")), ["softmax_scale"]),
    # Finite in double, not in the kernels' float32 (0, or inf once times log2(e)): all-NaN outputs before.
    ("scale_below_float", lambda: flash_attn_func(q0, k0, v0, softmax_scale=1e-50), ["softmax_scale", "1e-50"]),
    ("scale_subnormal_float", lambda: flash_attn_func(q0, k0, v0, softmax_scale=1e-40), ["softmax_scale", "1e-40"]),
    ("scale_log2e_overflow", lambda: flash_attn_func(q0, k0, v0, softmax_scale=3e38), ["softmax_scale", "3e+38"]),
    ("softcap_above_float", lambda: flash_attn_func(q0, k0, v0, softcap=1e39), ["softcap", "1e+39"]),
    ("softcap_below_float", lambda: flash_attn_func(q0, k0, v0, softcap=1e-50), ["softcap", "1e-50"]),
    ("scale_over_softcap", lambda: flash_attn_func(q0, k0, v0, softmax_scale=1e20, softcap=1e-20),
     ["softmax_scale / softcap", "1e+40"]),
    ("qkvpacked_shape", lambda: flash_attn_qkvpacked_func(torch.randn(2, 8, 2, 4, 64).half()), ["qkv"]),
    ("kvpacked_shape", lambda: flash_attn_kvpacked_func(q0, torch.randn(2, 8, 3, 2, 64).half()), ["kv"]),
    ("op_head_dim_not_multiple_of_8", lambda: torch.ops.flash_ext.fwd(
        q0[..., :59], k0[..., :59], v0[..., :59], 0.1, False, -1, -1, 0.0, None), ["head_dim", "59", "multiple of 8"]),
]


@pytest.mark.parametrize("call,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, words):
    msg = _error(call)
    for w in words:
        assert w in msg, f"{w!r} not in error message:\n{msg}"


PUBLIC_CALLS = [
    ("flash_attn_func", lambda: flash_attn_func(*_qkv(h=6, hk=4))),
    ("flash_attn_func_python_rule", lambda: flash_attn_func(q0, k0, v0, window_size=4)),
    ("qkvpacked", lambda: flash_attn_qkvpacked_func(torch.randn(2, 8, 2, 4, 64).half())),
    ("kvpacked", lambda: flash_attn_kvpacked_func(q0, torch.randn(2, 24, 2, 2, 64).half(), dropout_p=1.0)),
    ("varlen", lambda: flash_ext.flash_attn_varlen_func(
        q0[0], k0[0], v0[0], torch.tensor([0, 16]), torch.tensor([0, 24]), 16, 24)),  # int64 cu_seqlens
    ("kvcache", lambda: flash_ext.flash_attn_with_kvcache(q0, k0, v0, cache_seqlens=99)),
    ("backward", lambda: flash_ext.flash_attn_backward(q0, q0, k0, v0, q0, torch.zeros(2, 4, 3))),  # LSE shape
    ("bert_padding", lambda: bert_padding.index_first_axis(q0, torch.zeros(2, 2))),
]


@pytest.mark.parametrize("call", [c[1] for c in PUBLIC_CALLS], ids=[c[0] for c in PUBLIC_CALLS])
def test_public_refusals_are_argument_errors(call):
    """flash_attn 2.8's C++ checks raise RuntimeError, so code written for it may fall back on `except
    RuntimeError`; the public functions' refusals are flash_ext.ArgumentError, a ValueError and a RuntimeError.
    The registered ops keep raising ValueError (the dispatcher's mapping of the C++ checks' error)."""
    with pytest.raises(RuntimeError) as info:
        call()
    assert isinstance(info.value, flash_ext.ArgumentError) and isinstance(info.value, ValueError), info.value
    assert "flash_ext" in str(info.value)


NON_STRIDED = [
    ("q_sparse", lambda: flash_attn_func(q0.to_sparse(), k0, v0), "q: got a sparse_coo tensor"),
    ("v_mkldnn", lambda: flash_attn_func(q0.float(), k0.float(), v0.float().to_mkldnn()), "v: got a mkldnn tensor"),
    ("q_nested", lambda: flash_attn_func(torch.nested.nested_tensor([q0[0], q0[0, :8]], layout=torch.jagged), k0, v0),
     "q: got a nested tensor"),
    ("cu_seqlens_sparse", lambda: flash_ext.flash_attn_varlen_func(
        q0[0], k0[0], v0[0], torch.tensor([0, 16], dtype=torch.int32).to_sparse(),
        torch.tensor([0, 24], dtype=torch.int32), 16, 24), "cu_seqlens_q: got a sparse_coo tensor"),
    ("k_cache_sparse", lambda: flash_ext.flash_attn_with_kvcache(q0[:, :1], k0.to_sparse(), v0, cache_seqlens=4),
     "k_cache: got a sparse_coo tensor"),
    ("dq_sparse", lambda: flash_ext.flash_attn_backward(q0, q0, k0, v0, q0, torch.zeros(2, 4, 16),
                                                        dq=torch.zeros_like(q0).to_sparse()), "dq: got a sparse"),
]


@pytest.mark.parametrize("call,words", [c[1:] for c in NON_STRIDED], ids=[c[0] for c in NON_STRIDED])
def test_tensors_without_strides_are_named(call, words):
    """Sparse, mkldnn and nested tensors failed inside torch ("unsupported memory format option", "Could not
    run ... with arguments from the 'SparseCPU' backend", NotImplementedError), naming no argument."""
    with pytest.raises(flash_ext.ArgumentError) as info:
        call()
    assert words in str(info.value) and "must be a dense (strided) tensor" in str(info.value), info.value


def test_op_refusals_stay_value_errors():
    with pytest.raises(ValueError) as info:
        _fwd_op(*_qkv(h=6, hk=4))
    assert type(info.value) is ValueError and "heads" in str(info.value)


def test_op_errors_list_argument_and_rule():
    """The op's message format: '<op>: N invalid argument(s):' followed by one '  - name: got X; rule' line each."""
    msg = _error(flash_attn_func, q0, k0, v0, softcap=float("nan"))
    assert msg.startswith("flash_ext.fwd: 1 invalid argument:")
    assert re.search(r"\n  - softcap: got nan; must be", msg), msg


def test_several_problems_in_one_error():
    q = torch.randn(2, 16, 6, 64, dtype=torch.float64)  # unsupported dtype
    k = torch.randn(2, 24, 4, 64, dtype=torch.float16)  # 6 % 4 != 0, dtype differs from q
    v = torch.randn(2, 20, 4, 64, dtype=torch.float16)  # shape differs from k
    msg = _error(flash_attn_func, q, k, v, num_splits=1000, softcap=float("inf"),
                 alibi_slopes=torch.rand(7, dtype=torch.float16))
    expected = ["q.dtype", "k.dtype/v.dtype", "heads", "v.shape", "alibi_slopes.shape", "alibi_slopes.dtype",
                "num_splits", "softcap"]
    for w in expected:
        assert f"  - {w}: got" in msg, f"{w!r} missing from:\n{msg}"
    assert f"flash_ext.fwd: {len(expected)} invalid arguments:" in msg, msg
    assert msg.count("\n  - ") == len(expected), msg


def test_one_line_per_wrong_value():
    """A head dim above 256 is not also "not a multiple of 8", a negative max_seqlen_q not also "shorter than the
    longest sequence": each wrong value gets the one rule it breaks first."""
    msg = _error(flash_attn_func, *_qkv(d=257))
    assert msg.count("\n  - ") == 1 and "must be in [1, 256]" in msg, msg
    q = torch.randn(8, 2, 64)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    msg = _error(flash_ext.flash_attn_varlen_func, q, q, q, cu, cu, -1, 4)
    assert msg.count("\n  - ") == 1 and "max_seqlen_q: got -1; must be >= 0" in msg, msg


def test_several_problems_rank_and_dtype():
    msg = _error(flash_attn_func, q0[0].double(), k0, v0[..., None], softcap=float("nan"))
    for w in ["q: got 3 dims", "v: got 5 dims", "q.dtype", "k.dtype/v.dtype", "softcap"]:
        assert w in msg, f"{w!r} missing from:\n{msg}"


def test_dropout_p_rules():
    """dropout_p must be a number in [0, 1 - 2^-17]: the mask holds 1 - p to 16 bits, so any larger p (1 too,
    which flash_attn 2.8 refuses) would drop everything; listed with the rest, the value as passed."""
    for bad, shown in ((1.0, "1"), (-0.1, "-0.1"), (float("nan"), "nan"), (1.5, "1.5"), (-1e-9, "-1e-09"),
                       (1 - 2.0 ** -18, "0.9999961853027344"), (1 - 1e-9, "0.999999999")):
        msg = _error(flash_attn_func, q0, k0, v0, dropout_p=bad)
        assert f"dropout_p: got {shown};" in msg and "[0, 1 - 2^-17]" in msg, msg
        assert "flash_attn 2.8 refuses it too" not in msg, msg  # it does not refuse negative values
    # the largest p whose keep probability is representable runs, and keeps about 1 in 2^16 probabilities
    out = flash_attn_func(q0, k0, v0, dropout_p=1 - 2.0 ** -17)
    assert torch.isfinite(out).all()
    msg = _error(flash_attn_func, q0.double(), k0, v0, dropout_p=1.0)
    assert "dropout_p" in msg and "q.dtype" in msg, msg
    msg = _error(flash_attn_func, q0, k0, v0, dropout_p="0.1")
    assert "dropout_p: got '0.1'" in msg, msg


@pytest.mark.parametrize("fn", ["varlen", "varlen_qkvpacked", "varlen_kvpacked"])
def test_varlen_python_type_errors_listed_with_the_op_rules(fn):
    """A dropout_p or window_size of the wrong type (caught in Python) is listed together with what the op
    itself refuses (here q's dtype and a cu_seqlens value), as flash_attn_func does, in one error."""
    q = torch.randn(10, 2, 64, dtype=torch.float64)
    kv = torch.randn(10, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)  # 12 > 10 rows
    bad = dict(dropout_p=torch.tensor([0.1, 0.2]), window_size=(1,))  # one-element tensors are numbers
    if fn == "varlen":
        msg = _error(flash_attn_varlen_func, q, kv, kv, cu, cu, 8, 8, **bad)
    elif fn == "varlen_qkvpacked":
        msg = _error(flash_attn_varlen_qkvpacked_func, torch.stack([q, q, q], 1), cu, 8, **bad)
    else:
        msg = _error(flash_attn_varlen_kvpacked_func, q, torch.stack([kv, kv], 1), cu, cu, 8, 8, **bad)
    for w in ["dropout_p: got tensor([0.1000, 0.2000])", "window_size: got (1,)", "q.dtype", "cu_seqlens_q[-1]"]:
        assert w in msg, f"{w!r} missing from:\n{msg}"
    assert re.match(r"flash_ext.varlen_fwd: \d+ invalid arguments:", msg), msg


def test_kvcache_python_type_errors_listed_with_the_op_rules():
    """flash_attn_with_kvcache: a Python-side refusal (cache_seqlens' type, window_size's shape) comes with
    the op's own (q's dtype, a cache_batch_idx value) in one error, and the cache is not written."""
    q = torch.randn(1, 4, 2, 64, dtype=torch.float64)
    k_cache, v_cache = (torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    new = torch.ones(1, 2, 2, 64, dtype=torch.bfloat16)
    msg = _error(flash_ext.flash_attn_with_kvcache, q, k_cache, v_cache, new, new, cache_seqlens="x",
                 window_size=(1,), cache_batch_idx=torch.tensor([5], dtype=torch.int32))
    for w in ["cache_seqlens: got 'x'", "window_size: got (1,)", "q.dtype: got Double", "cache_batch_idx: got value 5"]:
        assert w in msg, f"{w!r} missing from:\n{msg}"
    assert (k_cache == 0).all() and (v_cache == 0).all()


def test_kvcache_refusal_of_inference_caches_lists_no_false_reason():
    """Caches made under torch.inference_mode() are appended to in inference mode by the function; the listing
    of the op's reasons beside a Python-side one runs the same way (it named the caches as inference tensors
    outside inference mode, telling the caller to do what it did)."""
    with torch.inference_mode():
        k_cache, v_cache = torch.zeros(1, 16, 2, 64), torch.zeros(1, 16, 2, 64)
    new = torch.ones(1, 1, 2, 64)
    msg = _error(flash_ext.flash_attn_with_kvcache, torch.randn(1, 1, 2, 64), k_cache, v_cache, new, new,
                 cache_seqlens=3, window_size=(1,))
    assert "window_size: got (1,)" in msg and "inference" not in msg, msg
    assert (k_cache == 0).all()


def test_check_only_mode_runs_nothing_and_ends_with_the_call():
    """The ops' check-only mode (used for the lists above) raises even for valid arguments and writes nothing;
    it is on for the one call through _C.check_only only, also when that call raises."""
    from flash_ext import _C

    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    new = torch.ones(1, 2, 2, 64, dtype=torch.bfloat16)
    seqlens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"flash_ext.kvcache_fwd: 0 invalid argument"):
        _C.check_only(flash_ext.flash_attn_with_kvcache, q, cache, cache.clone(), new, new, cache_seqlens=seqlens)
    assert (cache == 0).all(), "check-only must append nothing"
    out = flash_ext.flash_attn_with_kvcache(q, cache, cache.clone(), new, new, cache_seqlens=seqlens)
    assert torch.isfinite(out).all() and (cache[0, 3:5] == 1).all()


def test_refusal_in_compiled_code_leaves_later_calls_alone():
    """A Python-side refusal inside torch.compile (a graph break between switching the check-only mode on and
    off) left the mode on: every later call on the thread was refused with an empty list."""
    q = torch.randn(1, 1, 2, 64)
    kc, vc = torch.randn(1, 16, 2, 64), torch.randn(1, 16, 2, 64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    bad = [lambda: flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, window_size=(1, 2, 3)),
           lambda: flash_ext.flash_attn_varlen_func(q[0].repeat(4, 1, 1), kc[0, :4], vc[0, :4], cu, cu, 4, 4,
                                                    window_size=(1,))]
    for fn in bad:
        torch._dynamo.reset()
        with pytest.raises(Exception):
            torch.compile(fn)()
        out = flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3)
        assert torch.isfinite(out).all()


def test_valid_after_error():
    """A rejected call leaves nothing behind: the next valid call works."""
    with pytest.raises(ValueError):
        flash_attn_func(q0.double(), k0, v0)
    out = flash_attn_func(q0, k0, v0)
    assert not torch.isnan(out).any()


def test_alibi_scalar_tensor():
    """A 0-dim slopes tensor is a shape error (it once reached a.stride(-1) and raised IndexError)."""
    msg = _error(flash_attn_func, q0, k0, v0, alibi_slopes=torch.tensor(0.1))
    assert "alibi_slopes.shape" in msg


# One tensor on the meta device and the others on the CPU dispatches to the fake kernel, which must refuse
# the mix like the real op instead of returning uninitialised memory.
@pytest.mark.parametrize("which", ["k", "alibi"])
def test_meta_and_cpu_mixed(which):
    k = k0.to("meta") if which == "k" else k0
    slopes = torch.rand(4, device="meta") if which == "alibi" else None
    with pytest.raises(ValueError, match="different devices"):
        flash_attn_func(q0, k, v0, alibi_slopes=slopes)


# --- CUDA-only rules -------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_fp32_on_cuda():
    require_device("cuda")
    q, k, v = _qkv(dtype=torch.float32, device="cuda")
    msg = _error(flash_attn_func, q, k, v)
    assert "q.dtype" in msg and "CUDA" in msg


@pytest.mark.cuda
def test_devices_differ():
    require_device("cuda")
    q, k, v = _qkv(device="cuda")
    msg = _error(flash_attn_func, q, k.cpu(), v)
    assert "k.device/v.device" in msg
    msg = _error(flash_attn_func, q, k, v, alibi_slopes=torch.rand(4))
    assert "alibi_slopes.device" in msg


@pytest.mark.parametrize("where", [pytest.param("cuda", marks=pytest.mark.cuda), "emulated"])
def test_op_copies_rows_not_16_byte_aligned(where):
    """The Sm80 kernels move 16-byte vectors; the op copies inputs whose rows are not 16-byte aligned (this
    test expected a refusal the op stopped giving on 2026-11-30, unseen: it runs only with a GPU)."""
    if where == "cuda":
        require_device("cuda")
    elif not flash_ext.build_info()["emulator"] or 64 not in flash_ext.build_info()["emulator_head_dims"]:
        pytest.skip("no emulated head dim 64 in this build")
    device = "cuda" if where == "cuda" else "cpu"
    q = torch.randn(2, 16, 4, 65, dtype=torch.float16, device=device)[..., 1:]
    k = torch.randn(2, 24, 2, 64, dtype=torch.float16, device=device)
    with flash_ext.emulate() if where == "emulated" else contextlib.nullcontext():
        got = torch.ops.flash_ext.fwd(q, k, k, 0.1, False, -1, -1, 0.0, None)[0]
        want = torch.ops.flash_ext.fwd(q.contiguous(), k, k, 0.1, False, -1, -1, 0.0, None)[0]
    assert q.data_ptr() % 16 != 0 and torch.equal(got, want)
