#!/usr/bin/env python3
"""Header search paths for compiling CuTe on the host and device, shared by setup.py and CMakeLists.txt.

Prints the directories, one per line (``--cmake``: ';'-separated), or exits non-zero with the reason.
Order for CUTLASS/CuTe: $CUTLASS_INCLUDE_DIR, the third_party/cutlass submodule, the headers shipped in the
pinned pip package nvidia-cutlass==4.2.0.0 (found without importing it).  The host compiler also needs
CCCL (cuda/std/...) and cuda_runtime_api.h: from $CUDA_HOME (default /usr/local/cuda) or the nvidia-* pip
packages (nvidia-cuda-runtime, nvidia-cuda-cccl).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


class HeaderError(RuntimeError):
    pass


def cutlass_include() -> pathlib.Path:
    candidates = []
    if os.environ.get("CUTLASS_INCLUDE_DIR"):
        candidates.append(pathlib.Path(os.environ["CUTLASS_INCLUDE_DIR"]))
    candidates.append(ROOT / "third_party" / "cutlass" / "include")
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.origin is not None:
        candidates.append(pathlib.Path(spec.origin).parent / "source" / "include")
    for c in candidates:
        if (c / "cute" / "tensor.hpp").exists():
            return c
    raise HeaderError(
        "CUTLASS headers not found. Set CUTLASS_INCLUDE_DIR, run `git submodule update --init third_party/cutlass`, "
        "or `pip install --no-deps nvidia-cutlass==4.2.0.0`. Looked in: " + ", ".join(map(str, candidates)))


def cuda_home() -> pathlib.Path | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return pathlib.Path(home)
    default = pathlib.Path("/usr/local/cuda")
    return default if default.exists() else None


def _pip_nvidia_includes(header: str) -> list[pathlib.Path]:
    spec = importlib.util.find_spec("nvidia")
    roots = [pathlib.Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return [inc for root in roots for inc in sorted(root.glob("**/include")) if (inc / header).exists()]


def host_cuda_includes() -> list[pathlib.Path]:
    dirs: list[pathlib.Path] = []
    home = cuda_home()
    if home is not None:
        dirs += [home / "include", home / "include" / "cccl"]
    have = lambda h: any((d / h).exists() for d in dirs)  # noqa: E731
    # pip headers only fill what the toolkit lacks: mixing two CUDA versions' headers is asking for trouble.
    if not have("cuda_runtime_api.h"):
        dirs += _pip_nvidia_includes("cuda_runtime_api.h")
    if not have("cuda/std/cstdint"):
        dirs += _pip_nvidia_includes("cuda/std/cstdint")
        dirs += [d / "cccl" for d in _pip_nvidia_includes("cccl/cuda/std/cstdint")]
    dirs = [d for d in dict.fromkeys(dirs) if d.exists()]
    missing = [h for h in ("cuda_runtime_api.h", "cuda/std/cstdint") if not have(h)]
    if missing:
        raise HeaderError(f"host compiles of CuTe need {missing}: install a CUDA toolkit (set CUDA_HOME) or "
                          "`pip install --no-deps nvidia-cuda-runtime nvidia-cuda-cccl`.")
    return dirs


def all_includes() -> list[pathlib.Path]:
    return [ROOT / "csrc", cutlass_include()] + host_cuda_includes()


if __name__ == "__main__":
    try:
        dirs = all_includes()
    except HeaderError as e:
        print(f"flash_ext: {e}", file=sys.stderr)
        sys.exit(1)
    sep = ";" if "--cmake" in sys.argv else "\n"
    print(sep.join(str(d) for d in dirs))
