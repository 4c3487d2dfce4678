"""``flash_ext.emulate``: run CPU fp16/bf16 calls on the warp emulator's Sm80 backend.

The warp emulator (``csrc/emu/``, built with ``FLASH_EXT_EMULATOR=1``) executes the real Sm80 CUDA kernels --
the same tile shapes, swizzled shared memory, tiled copies and MMAs, and the static-flag variant the GPU
dispatcher picks -- on emulated warps on the CPU, with instruction semantics taken from the PTX ISA and
checks for shared-memory races, reads of unlanded copies, bad addresses, warp divergence at collectives,
threads leaving a barrier, copies in flight at exit and shared-memory bank conflicts.  Any finding makes the
call raise, naming where it happened.  ``explain()`` reports the emulated plan.
"""
from __future__ import annotations

import contextlib
import json
from typing import Iterator

from . import _C

__all__ = ["emulate", "emulator_report"]


@contextlib.contextmanager
def emulate(arch: str = "sm80") -> Iterator[None]:
    """Inside the block, every CPU fp16/bf16 forward call of every op (fwd, varlen, kvcache incl. paged,
    split-KV) made by this thread runs on the emulated ``arch`` (only ``"sm80"``; the backward keeps running
    on the host backend, its Sm80 kernels are emulated by the C++ tests); other threads keep their
    own mode.  The environment variable ``FLASH_EXT_EMULATE=sm80`` is every thread's starting mode (set it
    before importing flash_ext).  Raises ``ValueError`` if the build has no emulator.  fp32 calls keep
    running on the host backend (the GPU kernels take fp16/bf16 only)."""
    previous = _C.set_emulate(arch)
    try:
        yield
    finally:
        _C.set_emulate(previous)


def emulator_report() -> dict:
    """The report of this thread's latest emulated launch: ``findings`` (total), ``counts`` per check, ``stats``
    (CTAs, threads, barriers, ldmatrix/mma/shfl/cp.async executed, shared-memory wavefronts, ...) and the
    first ``messages``.  ``{}`` before the first emulated call."""
    return json.loads(_C.emulator_report())
