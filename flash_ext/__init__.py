"""flash_ext: FlashAttention-2-class fused attention for PyTorch.

One CuTe kernel body runs on CUDA (sm_80+) and, through host traits, on the CPU.  The public functions
follow flash_attn 2.8; the op is also available as ``torch.ops.flash_ext.fwd``.
"""
from __future__ import annotations

import torch

from . import _C, _ops, flash_attn_interface  # noqa: F401  (flash_attn.flash_attn_interface's names)
from .backward import flash_attn_backward, flash_attn_varlen_backward
from .emulate import emulate, emulator_report
from .errors import ArgumentError
from .explain import Explanation, explain, explain_call
from .flash_attn_alias import install_as_flash_attn
from .kvcache import flash_attn_with_kvcache
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "build_info",
    "compiled_kernels", "explain", "explain_call", "Explanation", "emulate", "emulator_report", "flash_attn_backward",
    "flash_attn_varlen_backward", "ArgumentError", "install_as_flash_attn",
]


def build_info() -> dict:
    """What this build contains and which CPU path it takes here, one entry per key:

    * ``cuda``: bool; ``cuda_archs``: str; ``gpu_head_dims``: the CUDA forward's head dims (FLASH_EXT_HEADDIMS);
      ``gpu_bwd_head_dims``: the CUDA backward's (FLASH_EXT_BWD_HEADDIMS); ``gpu_fwd_warps``: "per variant", or
      "8 (baseline build)" with FLASH_EXT_GPU_FWD_WARPS=8;
    * ``host_head_dims``: the CPU backend's head dims; ``emulator``: bool, and ``emulator_head_dims``: the warp
      emulator's (``flash_ext.emulate``);
    * ``cpu_isas``: per CPU micro-kernel level, whether it is compiled, supported by this CPU, and why not
      (unavailable); ``cpu_isa_best``: the level taken by default; ``cpu_isa``: the level in use
      (FLASH_EXT_CPU_ISA forces a lower one); ``cpu_l2_bytes``: the L2 size the CPU tiles are sized for."""
    return _C.build_info()


def compiled_kernels() -> list:
    """Every compiled kernel instance, one dict each: ``backend`` ("cuda"/"emulator"/"cpu"), ``arch``, ``kernel``,
    ``head_dim``, ``dtype``, ``causal``, ``variant`` (the static flag combination) and the tile
    (``block_m``, ``block_n``, ``threads``); CUDA entries also carry ``smem_budget_kb`` (163, or 99 for a kernel
    compiled for sm_86/sm_89's shared memory where a tile differs there).  A problem runs the smallest compiled
    head dim >= its own."""
    return _C.compiled_kernels()
