"""Shared pytest configuration for the flash_ext Python tests.

* Output poisoning: for the whole session ``flash_ext._C.set_poison_outputs(True)`` makes the op
  fill ``out`` and ``lse`` with NaN before the kernel runs, so any element the kernel forgets to write
  shows up as NaN and fails the comparison.  The previous setting is restored at the end.
* Devices: tests parametrised with ``DEVICES`` run on "cpu" always and on "cuda" only when a GPU is visible
  *and* the extension was built with CUDA; otherwise the CUDA case is skipped with the reason.
* Seeds: every test starts from a seed derived from its node id, so a test's inputs do not depend on
  which other tests ran before it (``-k``/``-x``/reordering reproduce the same data).  ``--flash-seed N``
  mixes ``N`` into every seed to try other data.
"""
from __future__ import annotations

import zlib

import pytest
import torch

try:  # the C++ host tests of this directory must still run when the extension is not built
    import flash_ext
except ImportError as exc:  # pragma: no cover - reported by the test modules that need it
    flash_ext = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def cuda_skip_reason() -> str | None:
    """None when the CUDA backend can be exercised, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if flash_ext is None:
        return f"flash_ext cannot be imported: {_IMPORT_ERROR}"
    if not flash_ext.build_info()["cuda"]:
        return "flash_ext was built without the CUDA backend"
    return None


def require_device(device: str) -> torch.device:
    """Returns ``torch.device(device)`` or skips the calling test when that device cannot be tested."""
    if device == "cuda":
        reason = cuda_skip_reason()
        if reason is not None:
            pytest.skip(reason)
    return torch.device(device)


def cuda_devices() -> list[str]:
    """The devices a test can actually run on in this environment."""
    return ["cpu"] + (["cuda"] if cuda_skip_reason() is None else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Parametrises a test over cpu/cuda, skipping cuda when it is not available."""
    return require_device(request.param)


def pytest_addoption(parser):
    parser.addoption("--flash-seed", type=int, default=0, help="extra seed mixed into every test's RNG seed")


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    seed = zlib.crc32(request.node.nodeid.encode()) ^ request.config.getoption("--flash-seed")
    torch.manual_seed(seed)
    yield


@pytest.fixture(scope="session", autouse=True)
def _poison_outputs():
    if flash_ext is None:
        yield
        return
    previous = flash_ext._C.set_poison_outputs(True)
    try:
        yield
    finally:
        flash_ext._C.set_poison_outputs(previous)
