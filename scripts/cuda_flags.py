#!/usr/bin/env python3
"""Which CUDA archs a build compiles, and their nvcc -gencode flags; shared by setup.py and the tests.

SASS (code=sm_XY) runs only on GPUs of its own major arch whose minor is at least its own: sm_80 SASS serves
sm_80/86/87/89, sm_90 SASS serves sm_90.  The PTX of the newest listed arch (code=compute_XY, what "+PTX" means
in TORCH_CUDA_ARCH_LIST) lets the driver JIT-compile the kernels for newer GPUs (e.g. Blackwell, sm_100/sm_120)
on first use.  An arch-specific target ("90a") has no forward-compatible PTX, so its base arch's PTX is
embedded instead.

Every arch costs one more compile of every CUDA unit (nvcc compiles the device code once per target), so the
list is the largest lever on build time: the build asks, in this order, FLASH_EXT_CUDA_ARCHS, then
TORCH_CUDA_ARCH_LIST (torch's own knob, as extension builds read it), then the GPUs visible to the build, and
only then takes the default "80;90" (`choose_archs`).

    python scripts/cuda_flags.py 80 90   ->   -gencode arch=compute_80,code=sm_80 ... code=compute_90
"""
from __future__ import annotations

import re
import sys
from typing import Mapping, Sequence

DEFAULT_ARCHS = ["80", "90"]

# torch's named entries of TORCH_CUDA_ARCH_LIST (torch.utils.cpp_extension), those of sm_80 and newer.
_NAMED = {"ampere": ["8.0", "8.6"], "ada": ["8.9"], "hopper": ["9.0"]}
_OLDER_NAMED = {"kepler", "kepler+tesla", "maxwell", "maxwell+tegra", "pascal", "volta", "volta+tegra", "turing"}


class ArchError(ValueError):
    """An arch list that names nothing this build can compile."""


def gencode_flags(archs: list[str]) -> list[str]:
    """SASS for every arch in `archs` (e.g. ["80", "90"]) plus PTX of the newest one."""
    flags: list[str] = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    ptx = max((a.rstrip("a") for a in archs), key=int)
    flags += ["-gencode", f"arch=compute_{ptx},code=compute_{ptx}"]
    return flags


def one_sass_per_major(targets: Sequence[tuple[int, int, str]]) -> list[str]:
    """(major, minor, suffix) targets -> the archs to compile: per major the lowest minor asked for, whose
    SASS runs on every later minor of that major (8.0 serves 8.6 and 8.9), so "8.0 8.6 8.9" is one compile,
    not three; an arch-specific target ("9.0a", its own SASS only) is kept beside its major's plain one."""
    lowest: dict[tuple[int, str], int] = {}
    for major, minor, suffix in targets:
        key = (major, suffix)
        lowest[key] = min(minor, lowest.get(key, minor))
    return [f"{major}{minor}{suffix}" for (major, suffix), minor in sorted(lowest.items())]


def archs_from_torch_list(value: str) -> tuple[list[str], list[str]]:
    """TORCH_CUDA_ARCH_LIST (e.g. "7.5 8.0 8.6 9.0+PTX", "8.0;9.0a", "Ampere;Hopper") -> (archs to compile,
    entries dropped because flash_ext's kernels need sm_80 or newer).  Raises ArchError naming the value when
    an entry is malformed or nothing of sm_80 or newer is left."""
    targets: list[tuple[int, int, str]] = []
    dropped: list[str] = []
    bad: list[str] = []
    for entry in [e for e in re.split(r"[;,\s]+", value.strip()) if e]:
        # "+PTX" asks for the PTX too, which the build embeds for its newest arch anyway (gencode_flags).
        base = entry[:-4] if entry.upper().endswith("+PTX") else entry
        name = base.lower()
        if name in _OLDER_NAMED:
            dropped.append(entry)
            continue
        for arch in _NAMED.get(name, [base]):
            m = re.fullmatch(r"(\d+)\.(\d)(a?)", arch, flags=re.IGNORECASE)
            if m is None:
                bad.append(entry)
                break
            major, minor, suffix = int(m.group(1)), int(m.group(2)), m.group(3).lower()
            if major < 8:
                dropped.append(entry)
            else:
                targets.append((major, minor, suffix))
    if bad:
        raise ArchError(f"TORCH_CUDA_ARCH_LIST={value!r}: {bad} are not compute capabilities like 8.0, 9.0a "
                        "or 8.6+PTX (or the names Ampere, Ada, Hopper)")
    if not targets:
        raise ArchError(f"TORCH_CUDA_ARCH_LIST={value!r} names no arch of compute capability 8.0 or newer, and "
                        "flash_ext's CUDA kernels need sm_80+; set FLASH_EXT_CUDA_ARCHS (e.g. \"80;90\") or "
                        "FLASH_EXT_FORCE_CPU_ONLY=1")
    return one_sass_per_major(targets), dropped


def archs_from_capabilities(capabilities: Sequence[tuple[int, int]]) -> list[str] | None:
    """The visible GPUs' (major, minor) -> the archs that run on all of them: sm_80 SASS for any 8.x (the
    SASS this project gates), sm_90 for 9.0.  None (take the default) when there is no GPU or one this rule
    does not cover (older than 8.0: refused at run time anyway; 10.0 and newer: run through the PTX)."""
    if not capabilities or any(major not in (8, 9) for major, _ in capabilities):
        return None
    return one_sass_per_major([(major, 0, "") for major, _ in capabilities])


def choose_archs(env: Mapping[str, str], capabilities: Sequence[tuple[int, int]]) -> tuple[list[str], str]:
    """(archs, where they came from), in the order the module docstring gives.  FLASH_EXT_CUDA_ARCHS is taken
    as written (";"- or ","-separated, e.g. "80;90a"); raises ArchError for a value naming no arch >= 80."""
    raw = env.get("FLASH_EXT_CUDA_ARCHS", "").strip()
    if raw:
        archs = [a.strip() for a in raw.replace(",", ";").split(";") if a.strip()]
        bad = [a for a in archs if not a.rstrip("a").isdigit() or int(a.rstrip("a")) < 80]
        if bad or not archs:
            raise ArchError(f"FLASH_EXT_CUDA_ARCHS={raw!r}: {bad or raw!r} is not an arch >= 80 (e.g. 80;90)")
        return archs, "FLASH_EXT_CUDA_ARCHS"
    torch_list = env.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if torch_list:
        archs, dropped = archs_from_torch_list(torch_list)
        note = f", without {dropped} (flash_ext needs sm_80+)" if dropped else ""
        return archs, f"TORCH_CUDA_ARCH_LIST={torch_list!r}{note}"
    archs = archs_from_capabilities(capabilities)
    if archs is not None:
        shown = ", ".join(f"{major}.{minor}" for major, minor in capabilities)
        return archs, f"the GPUs visible to this build (compute capability {shown})"
    return list(DEFAULT_ARCHS), "the default (no FLASH_EXT_CUDA_ARCHS, TORCH_CUDA_ARCH_LIST or sm_80/sm_90 GPU seen)"


if __name__ == "__main__":
    print(" ".join(gencode_flags(sys.argv[1:] or DEFAULT_ARCHS)))
