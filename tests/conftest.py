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

#: Head dims a full build compiles, on either backend (FLASH_EXT_HEADDIMS / FLASH_EXT_HOST_HEADDIMS select
#: subsets; CI's CUDA build has 64 and 128 only).
ALL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def head_dim_skip_reason(device_type: str, head_dim: int, info: dict | None = None) -> str | None:
    """Why a problem of this head dim cannot run on this build's `device_type` backend, or None.

    A problem runs the smallest compiled head dim >= its own (padded to a multiple of 8); a build that
    compiled a subset has no kernel for larger head dims.  `info` defaults to ``flash_ext.build_info()``."""
    info = flash_ext.build_info() if info is None else info
    key = "host_head_dims" if device_type == "cpu" else "gpu_head_dims"
    built = list(info[key])
    padded = (head_dim + 7) // 8 * 8
    if any(padded <= hd for hd in built):
        return None
    knob = "FLASH_EXT_HOST_HEADDIMS" if device_type == "cpu" else "FLASH_EXT_HEADDIMS"
    return f"this build has no {device_type} kernel for head dim {head_dim} (compiled: {built}; see {knob})"


def skip_unless_head_dim_built(device, head_dim: int) -> None:
    """Skips the calling test when this build has no kernel for `head_dim` on `device`."""
    reason = head_dim_skip_reason(torch.device(device).type, head_dim)
    if reason is not None:
        pytest.skip(reason)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test that builds its inputs by hand and hits a head dim this (partial) build did not compile is
    skipped with the op's own reason instead of failing (also when opcheck wraps the op's error).  Only for partial builds: with every head dim
    compiled, that error is a real failure."""
    try:
        return (yield)
    except Exception as exc:  # the op's ValueError, or torch.library.opcheck's wrapper of it
        msg = str(exc)
        partial = flash_ext is not None and (
            tuple(flash_ext.build_info()["host_head_dims"]) != ALL_HEAD_DIMS
            or (flash_ext.build_info()["cuda"] and tuple(flash_ext.build_info()["gpu_head_dims"]) != ALL_HEAD_DIMS))
        if partial and "kernel for it in this build" in msg:
            pytest.skip(f"head dim not compiled in this build: {msg.splitlines()[-1].strip()}")
        raise


def cuda_skip_reason() -> str | None:
    """None when the CUDA backend can be exercised, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if flash_ext is None:
        return f"flash_ext cannot be imported: {_IMPORT_ERROR}"
    if not flash_ext.build_info()["cuda"]:
        return "flash_ext was built without the CUDA backend"
    return None


_running: pytest.Item | None = None  # the test being run (pytest_runtest_setup), for require_device's mark check


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _running
    _running = item


def require_device(device: str) -> torch.device:
    """Returns ``torch.device(device)`` or skips the calling test when that device cannot be tested.  A test
    that asks for CUDA must carry the ``cuda`` mark, which is how scripts/gpu_check.sh selects the GPU tests
    (``-m cuda``): three unmarked CUDA tests were never run on a GPU, one of them stale for a week.  Checked
    here, on any machine, before the skip."""
    if device == "cuda":
        if _running is not None and _running.get_closest_marker("cuda") is None:
            pytest.fail(f"{_running.nodeid} asks for CUDA but has no 'cuda' mark: `-m cuda` (scripts/gpu_check.sh) "
                        "would never select it", pytrace=False)
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
