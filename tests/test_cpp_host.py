"""Runs the C++ host tests (CMakeLists.txt, ctest) from pytest: the GPU traits' tile partitions checked
without a GPU, the host micro-kernels of every instruction-set level this CPU runs against scalar
references, the forward (every level) and backward kernel bodies with host traits against double-precision
loops, dropout's Philox known answers and mask contract, the launch geometry, and the warp emulator
(instruction semantics, each check on a small kernel, the forward kernel with injected GPU bugs, each of
which must be caught, and the Sm80 backward kernel against a double-precision gradient with zero findings).
Under ``-m full`` also the Sm80 backward at head dims 32, 96, 128, 192 and 256 (every variant) on the emulator
(a separate build: each head dim costs minutes of compilation)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "cpp-tests"
BUILD_FULL = ROOT / "build" / "cpp-tests-full"
FULL_BWD_HEAD_DIMS = "32;96;128;192;256"  # test_emu_bwd.cpp has 64 (every variant) and 256 (general)


def cmake_build(build_dir: pathlib.Path, *options: str, target: str | None = None) -> pathlib.Path:
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    configure = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build_dir), f"-DPython3_EXECUTABLE={sys.executable}", *options],
        capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    build = subprocess.run(["cmake", "--build", str(build_dir), "-j2"] + (["--target", target] if target else []),
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-5000:] + build.stderr[-5000:]
    return build_dir


@pytest.fixture(scope="module")
def cpp_build() -> pathlib.Path:
    return cmake_build(BUILD)


@pytest.mark.parametrize("name", ["test_traits", "test_traits_bwd", "test_host_isa", "test_host_kernel", "test_dropout",
                                  "test_grid", "test_emu", "test_emu_ucontext", "test_emu_faults", "test_host_bwd", "test_emu_bwd"])
def test_ctest(cpp_build: pathlib.Path, name: str) -> None:
    result = subprocess.run(["ctest", "--test-dir", str(cpp_build), "--output-on-failure", "-R", f"^{name}$"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert "100% tests passed" in result.stdout, result.stdout


@pytest.mark.full
def test_emu_bwd_every_head_dim() -> None:
    """The Sm80 backward at head dims 32, 96, 128, 192, 256 on the emulator: every variant, both dtypes,
    multi-slice deterministic dQ, each clean and within tolerance (tests/cpp/emu_bwd_head_dim.cpp)."""
    build = cmake_build(BUILD_FULL, f"-DFLASH_EXT_EMU_BWD_HEADDIMS={FULL_BWD_HEAD_DIMS}", target="test_emu_bwd_heads")
    result = subprocess.run([str(build / "test_emu_bwd_heads")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert result.stdout.count("ok  ") == 5 * len(FULL_BWD_HEAD_DIMS.split(";")), result.stdout
