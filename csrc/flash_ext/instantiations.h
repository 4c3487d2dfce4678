// From run-time values to the compiled GPU instantiations: which head dims a build holds (setup.py passes
// one mask per kernel family, since FLASH_EXT_HEADDIMS, FLASH_EXT_BWD_HEADDIMS and FLASH_EXT_EMU_HEADDIMS
// are independent), and the visit that turns (head dim, dtype, causal) into template arguments.  Shared by
// the CUDA dispatchers (csrc/cuda/fwd_dispatch.cu, bwd_dispatch.cu) and the emulator's
// (csrc/emu/fwd_emu_dispatch.cpp), so the three pick instantiations by the same rule.
#pragma once

#include <string>

#include <cutlass/numeric_types.h>

#include "block_info.h"
#include "dispatch.h"
#include "fwd_api.h"

namespace flash_ext {

// kMask: bit i set when kGpuHeadDims[i] is compiled.
template <unsigned kMask>
struct CompiledHeadDims {
  static constexpr int kCount = int(sizeof(kGpuHeadDims) / sizeof(kGpuHeadDims[0]));

  static constexpr bool contains(int hd) {
    for (int i = 0; i < kCount; ++i) {
      if (kGpuHeadDims[i] == hd) { return (kMask >> i) & 1u; }
    }
    return false;
  }
  // The smallest compiled head dim >= d (the problem runs zero-padded to it), or -1.
  static constexpr int at_least(int d) {
    for (int hd : kGpuHeadDims) {
      if (contains(hd) && d <= hd) { return hd; }
    }
    return -1;
  }
  // "64, 128", or if_none when the set is empty.
  static std::string list(char const* if_none = "none") {
    std::string s;
    for (int hd : kGpuHeadDims) {
      if (contains(hd)) { s += (s.empty() ? "" : ", ") + std::to_string(hd); }
    }
    return s.empty() ? if_none : s;
  }
};

// Calls fn.template operator()<HD, Element, Causal>() for (hd, dtype, causal); false when hd is not one of
// kGpuHeadDims.  fn is instantiated for every combination, so a caller that may name an instantiation the
// build lacks guards it with CompiledHeadDims<...>::contains(HD) (a partial build must still link).
template <class Fn>
bool visit_gpu_instantiation(int hd, DType dtype, bool causal, Fn&& fn) {
  return visit_head_dim(hd, [&]<int HD>() {
    if (dtype == DType::kFloat16) {
      causal ? fn.template operator()<HD, cutlass::half_t, true>() : fn.template operator()<HD, cutlass::half_t, false>();
    } else {
      causal ? fn.template operator()<HD, cutlass::bfloat16_t, true>()
             : fn.template operator()<HD, cutlass::bfloat16_t, false>();
    }
  });
}

// Why no CUDA kernel of this library can run a (device, dtype) pair, or "" when one may.
inline std::string cuda_refusal(int cc_major, int cc_minor, DType dtype) {
  if (cc_major < 8) {
    return "the GPU has compute capability " + std::to_string(cc_major) + "." + std::to_string(cc_minor) +
           "; flash_ext's CUDA kernels need sm_80 or newer (use CPU tensors instead)";
  }
  if (dtype == DType::kFloat32) { return "CUDA kernels take fp16 or bf16 (fp32 runs on the CPU backend)"; }
  return {};
}

// The forward plan of the (head dim tile, causal) file for a problem (the CUDA dispatcher's and the
// emulator's): the static variant that runs it and that variant's tile (dispatch.h).
inline void fill_fwd_plan(CudaPlan& plan, FwdParams const& params, int head_dim, bool causal, SmemBudget budget) {
  plan.head_dim = head_dim;
  plan.variant = select_fwd_variant(params, head_dim, causal, budget);
  plan.variant_name = plan.variant >= 0 ? kVariants[plan.variant].name : "";
  BlockShape const shape = sm80_block_shape(head_dim, budget);
  TileConfig const tile = plan.variant >= 0 ? sm80_tile_config(head_dim, plan.variant, causal, budget)
                                            : TileConfig{shape.block_m, shape.block_n, 0};
  plan.block_m = tile.block_m;
  plan.block_n = tile.block_n;
  plan.num_warps = tile.num_warps;
  plan.smem_bytes = tile_smem_bytes(tile, head_dim);
  plan.ctas_per_sm = sm80_ctas_per_sm(tile, head_dim, budget);
  plan.grid = fwd_grid(ceil_div(params.seqlen_q, tile.block_m), params.b, params.h, params.num_splits);
  plan.ok = plan.variant >= 0 && grid_error(plan.grid) == nullptr;
  if (plan.variant < 0) { plan.why = "no compiled flag variant admits this problem"; }
  if (char const* why = grid_error(plan.grid)) { plan.why = std::string("cannot launch: ") + why; }
}

}  // namespace flash_ext
