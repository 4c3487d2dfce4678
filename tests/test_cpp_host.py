"""Runs the C++ host tests (CMakeLists.txt, ctest) from pytest: the GPU traits' tile partitions checked
without a GPU, the host micro-kernels of every instruction-set level this CPU runs against scalar
references, the forward (every level) and backward kernel bodies with host traits against double-precision
loops, dropout's Philox known answers and mask contract, the launch geometry, and the warp emulator
(instruction semantics, each check on a small kernel, the forward kernel with injected GPU bugs, each of
which must be caught, and the Sm80 backward kernel against a double-precision gradient with zero findings)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "cpp-tests"


@pytest.fixture(scope="module")
def cpp_build() -> pathlib.Path:
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    configure = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(BUILD), f"-DPython3_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    build = subprocess.run(["cmake", "--build", str(BUILD), "-j2"], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-5000:] + build.stderr[-5000:]
    return BUILD


@pytest.mark.parametrize("name", ["test_traits", "test_traits_bwd", "test_host_isa", "test_host_kernel", "test_dropout",
                                  "test_grid", "test_emu", "test_emu_ucontext", "test_emu_faults", "test_host_bwd", "test_emu_bwd"])
def test_ctest(cpp_build: pathlib.Path, name: str) -> None:
    result = subprocess.run(["ctest", "--test-dir", str(cpp_build), "--output-on-failure", "-R", f"^{name}$"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert "100% tests passed" in result.stdout, result.stdout
