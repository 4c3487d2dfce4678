"""``flash_ext.install_as_flash_attn()``: code that imports flash_attn (its functions, its low-level
``flash_attn_interface`` functions, its padding helpers) runs on flash_ext unchanged.  Each case runs in a fresh
interpreter, since the alias changes what a module name means for the whole process."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def test_flash_attn_imports_resolve_to_flash_ext() -> None:
    """The import forms flash_attn's users write, after install: the same function objects as flash_ext's, and
    a call through them equal to the float64 reference's rule (the reference, not flash_ext, is the oracle)."""
    r = _run("""
        import sys, torch, flash_ext
        assert "flash_attn" not in sys.modules
        alias = flash_ext.install_as_flash_attn()
        assert flash_ext.install_as_flash_attn() is alias          # idempotent
        import flash_attn
        from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
        from flash_attn.flash_attn_interface import _flash_attn_forward, _flash_attn_backward, _get_block_size_n
        from flash_attn.bert_padding import unpad_input, pad_input
        import flash_ext.flash_attn_interface as fi, flash_ext.bert_padding as bp
        assert flash_attn is alias and flash_attn.__version__ == "2.8.3" and flash_attn.__flash_ext__
        assert flash_attn_func is flash_ext.flash_attn_func and flash_attn_with_kvcache is flash_ext.flash_attn_with_kvcache
        assert _flash_attn_forward is fi._flash_attn_forward and unpad_input is bp.unpad_input
        from flash_ext.reference import attention_ref
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 33, 4, 64, dtype=torch.bfloat16) for _ in range(3))
        out = flash_attn_func(q, k, v, causal=True)
        ref64 = attention_ref(q, k, v, causal=True, upcast=True)[0]
        ref16 = attention_ref(q, k, v, causal=True, upcast=False)[0]
        err, tol = (out.double() - ref64).abs().max().item(), 2 * (ref16.double() - ref64).abs().max().item() + 2e-3
        assert err <= tol, (err, tol)
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_an_imported_flash_attn_is_not_replaced() -> None:
    """A real flash_attn already imported (a stand-in module here) keeps its name: the alias is refused, naming
    sys.modules['flash_attn'] and the rule, and nothing is registered."""
    r = _run("""
        import sys, types, flash_ext
        sys.modules["flash_attn"] = types.ModuleType("flash_attn")
        try:
            flash_ext.install_as_flash_attn()
        except flash_ext.ArgumentError as e:
            assert "sys.modules['flash_attn']" in str(e) and "must not be imported yet" in str(e), e
            assert "flash_attn.flash_attn_interface" not in sys.modules
            print("refused")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "refused", r.stdout[-2000:] + r.stderr[-3000:]


def test_import_flash_ext_installs_nothing() -> None:
    r = _run("""
        import sys, flash_ext
        assert not any(m == "flash_attn" or m.startswith("flash_attn.") for m in sys.modules), sorted(sys.modules)[:5]
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout[-2000:] + r.stderr[-3000:]


def test_transformers_imports_after_the_alias() -> None:
    """Libraries probe for flash_attn with importlib.util.find_spec when they load (transformers on every model
    or config import): the alias had no module spec, so find_spec raised ValueError and, with the alias
    installed first, `from transformers import LlamaConfig` failed.  The alias has a spec; transformers still
    finds no flash_attn distribution (package metadata), so it does not offer flash_attention_2."""
    r = _run("""
        import importlib.util, flash_ext
        flash_ext.install_as_flash_attn()
        assert importlib.util.find_spec("flash_attn") is not None
        assert importlib.util.find_spec("flash_attn.flash_attn_interface") is not None
        import inspect, flash_attn
        assert inspect.getfile(flash_attn).endswith("flash_attn_alias.py")
        try:
            import transformers
        except ImportError:
            print("ok")
            raise SystemExit
        from transformers import LlamaConfig  # noqa: F401
        from transformers.utils import is_flash_attn_2_available
        assert not is_flash_attn_2_available()
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_a_loaded_flash_attn_submodule_is_not_replaced() -> None:
    """A real flash_attn submodule already imported (without its package in sys.modules, contrived) is refused
    too: replacing it would leave its importers with the other implementation."""
    r = _run("""
        import sys, types, flash_ext
        sys.modules["flash_attn.flash_attn_interface"] = types.ModuleType("flash_attn.flash_attn_interface")
        try:
            flash_ext.install_as_flash_attn()
        except flash_ext.ArgumentError as e:
            assert "sys.modules['flash_attn.flash_attn_interface']" in str(e), e
            assert "flash_attn" not in sys.modules
            print("refused")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "refused", r.stdout[-2000:] + r.stderr[-3000:]
