"""The bench CLI (`python -m flash_ext.bench`) runs each mode end to end on tiny CPU sizes and exits 0, and
refuses bad options through argparse; README's demo (`python -m flash_ext.demo`) runs and passes.  Smoke tests
of the tools, not timings: nothing here measures speed."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from flash_ext import build_info as flash_ext_build_info

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--device", "cpu", "--seqlens", "64", "--headdims", "32", "--threads", "1", "--warmup", "0", "--repeats", "1",
        "--batch", "1", "--nheads", "2"]


def _module(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)


def _bench(*args: str) -> subprocess.CompletedProcess:
    return _module("flash_ext.bench", *args)


def test_demo_runs_and_passes() -> None:
    """README's first command ends in the demo; it was broken for days by a refactor of the bench package."""
    r = _module("flash_ext.demo", "--device", "cpu", "--seqlens", "256", "512", "--nheads", "2")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-4000:]
    assert "all checks passed" in r.stdout and r.stdout.count("  ok  ") == 4, r.stdout[-3000:]
    assert "(measured: peak RSS" in r.stdout and "seqlen    512: naive" in r.stdout, r.stdout[-3000:]


def test_demo_skips_head_dims_the_build_lacks(monkeypatch, capsys) -> None:
    """A build with restricted FLASH_EXT_HOST_HEADDIMS (64 here) ran the demo's head-dim-96/128 cases into the
    op's refusal and printed SOME CHECKS FAILED, as if a result were wrong: those cases are skipped with the
    reason, the rest still run and decide; a build that can run none of them still fails."""
    from flash_ext import demo
    info = dict(flash_ext_build_info())
    monkeypatch.setattr(demo.flash_ext, "build_info", lambda: dict(info, host_head_dims=[64]))
    assert demo.run_checks(torch.device("cpu"))
    out = capsys.readouterr().out
    assert out.count("  ok  ") == 2 and out.count("  skip  ") == 2 and "FAIL" not in out, out
    assert "no cpu kernel for head dim 128 (compiled: [64]; build with FLASH_EXT_HOST_HEADDIMS" in out, out
    monkeypatch.setattr(demo.flash_ext, "build_info", lambda: dict(info, host_head_dims=[32]))
    assert not demo.run_checks(torch.device("cpu"))
    assert "FAIL  no case ran" in capsys.readouterr().out


@pytest.mark.parametrize("mode, extra", [
    ("fwd", ["--no-naive", "--backends", "math"]),
    ("bwd", ["--no-naive", "--backends", "math", "--causal", "yes"]),
    ("memory", ["--no-cross-check"]),
    ("decode", []),
    ("decode", ["--kv-heads", "2"]),  # multi-head attention: one query row per K/V head
    ("dropout", ["--dtype", "fp32"]),
    # the ring's rows have no correctness column: reading one ended every run in an AttributeError
    ("ring", ["--dtype", "fp32", "--world", "2"]),
])
def test_mode_runs(mode: str, extra: list) -> None:
    r = _bench(mode, *TINY, *extra)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-4000:]


def test_bad_dropout_p_is_an_argparse_error() -> None:
    r = _bench("dropout", "--dropout-p", "1.0", *TINY)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--dropout-p: got 1.0; must be in [0, 1)" in r.stderr, r.stderr


@pytest.mark.parametrize("mode, option, value, rule", [
    ("fwd", "--seqlens", "-5", "must be >= 1"),
    ("fwd", "--seqlens", "0", "must be >= 1"),
    ("fwd", "--batch", "0", "must be >= 1"),
    ("bwd", "--headdims", "0", "must be >= 1"),
    ("memory", "--nheads", "-1", "must be >= 1"),
    ("fwd", "--repeats", "0", "must be >= 1"),
    ("decode", "--threads", "0", "must be >= 1"),
    ("decode", "--kv-layers", "-1", "must be >= 0"),
    ("fwd", "--warmup", "-1", "must be >= 0"),
    ("ring", "--world", "0", "must be >= 1"),
    ("ring", "--world", "1", "the ring mode needs >= 2 ranks"),
])
def test_bad_counts_are_argparse_errors(mode: str, option: str, value: str, rule: str) -> None:
    """A count out of range is refused before anything runs (these ended in tracebacks, or ran empty problems
    that reported PASS)."""
    args = list(TINY)
    if option in args:  # TINY's own value of the option is replaced
        i = args.index(option)
        del args[i:i + 2]
    r = _bench(mode, *args, option, value)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"argument {option}: got {value}" in r.stderr and rule in r.stderr, r.stderr[-3000:]


def test_refused_problem_names_the_reason() -> None:
    """A flash_ext refusal is an ERR row whose reason is printed, not just the op's header line."""
    r = _bench("fwd", *TINY, "--headdims", "300", "--no-naive", "--backends", "math", "--causal", "no")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "flash_ext ERR" in r.stdout and "head_dim: got 300; must be in [1, 256]" in r.stdout, r.stdout[-3000:]


def test_bad_kv_heads_is_an_error_naming_the_rule() -> None:
    r = _bench("decode", *TINY, "--kv-heads", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--kv-heads: got 0; must be >= 1" in r.stderr, r.stderr
    r = _bench("decode", *TINY, "--kv-heads", "3")  # TINY has 2 query heads
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--kv-heads: got 3; must divide the 2 query heads" in r.stderr, r.stderr


def test_repeats_for_fills_the_time_unless_given() -> None:
    """Decode's timed calls: the user's --repeats as given; else as many calls as fill the time (one call timed
    to estimate), never fewer than the default nor more than the cap."""
    import time

    import torch

    from flash_ext.bench.common import repeats_for

    cpu = torch.device("cpu")
    nap = lambda: time.sleep(0.002)  # noqa: E731
    assert repeats_for(nap, cpu, 3, 5, 10.0) == 3
    assert repeats_for(nap, cpu, None, 5, 0.0) == 5
    assert repeats_for(nap, cpu, None, 5, 10.0, cap=40) == 40
    # 0.05 s of 2 ms naps: at most 25 calls (a nap lasts at least 2 ms), at least the default
    assert 5 <= repeats_for(nap, cpu, None, 5, 0.05) <= 25
