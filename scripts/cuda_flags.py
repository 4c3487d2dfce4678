#!/usr/bin/env python3
"""The nvcc -gencode flags for a list of archs, shared by setup.py and the tests.

SASS (code=sm_XY) runs only on GPUs of its own major arch: sm_80 SASS serves sm_80/86/87/89, sm_90 SASS
serves sm_90.  The PTX of the newest listed arch (code=compute_XY, what "+PTX" means in TORCH_CUDA_ARCH_LIST)
lets the driver JIT-compile the kernels for newer GPUs (e.g. Blackwell, sm_100/sm_120) on first use.  An
arch-specific target ("90a") has no forward-compatible PTX, so its base arch's PTX is embedded instead.

    python scripts/cuda_flags.py 80 90   ->   -gencode arch=compute_80,code=sm_80 ... code=compute_90
"""
from __future__ import annotations

import sys


def gencode_flags(archs: list[str]) -> list[str]:
    """SASS for every arch in `archs` (e.g. ["80", "90"]) plus PTX of the newest one."""
    flags: list[str] = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    ptx = max((a.rstrip("a") for a in archs), key=int)
    flags += ["-gencode", f"arch=compute_{ptx},code=compute_{ptx}"]
    return flags


if __name__ == "__main__":
    print(" ".join(gencode_flags(sys.argv[1:] or ["80", "90"])))
