// Picks the (head dim, dtype, causal) instantiation for a problem and reports the plan: the emulated
// counterpart of csrc/cuda/fwd_dispatch.cu (same head-dim rule, tile config and variant selection).
#undef NDEBUG  // the emulator keeps assertions on (CUTE_INVALID_CONTROL_PATH is only a printf under NDEBUG)

#include <string>

#include "emu/fwd_emu.h"
#include "emu/launch_emu.h"

#ifndef FLASH_EXT_EMU_HEADDIMS_MASK
#error "the build defines FLASH_EXT_EMU_HEADDIMS_MASK: bit i set when kGpuHeadDims[i] is compiled into the emulator"
#endif

namespace flash_ext::emu {

#define FLASH_EXT_EMU_DECLARE(HD)                                                                            \
  extern template std::string run_fwd_emu_sm80<HD, cutlass::half_t, false>(FwdParams const&, EmuLaunch&);     \
  extern template std::string run_fwd_emu_sm80<HD, cutlass::half_t, true>(FwdParams const&, EmuLaunch&);      \
  extern template std::string run_fwd_emu_sm80<HD, cutlass::bfloat16_t, false>(FwdParams const&, EmuLaunch&); \
  extern template std::string run_fwd_emu_sm80<HD, cutlass::bfloat16_t, true>(FwdParams const&, EmuLaunch&);
FLASH_EXT_EMU_DECLARE(32)
FLASH_EXT_EMU_DECLARE(64)
FLASH_EXT_EMU_DECLARE(96)
FLASH_EXT_EMU_DECLARE(128)
FLASH_EXT_EMU_DECLARE(192)
FLASH_EXT_EMU_DECLARE(256)
#undef FLASH_EXT_EMU_DECLARE

namespace {

constexpr int kNumGpuHeadDims = int(sizeof(kGpuHeadDims) / sizeof(kGpuHeadDims[0]));

constexpr bool head_dim_compiled(int hd) {
  for (int i = 0; i < kNumGpuHeadDims; ++i) {
    if (kGpuHeadDims[i] == hd) { return ((FLASH_EXT_EMU_HEADDIMS_MASK) >> i) & 1; }
  }
  return false;
}

int built_head_dim_for(int d) {
  for (int hd : kGpuHeadDims) {
    if (head_dim_compiled(hd) && d <= hd) { return hd; }
  }
  return -1;
}

// Calls fn.template operator()<HD, Element, Causal>() for the problem's instantiation.
template <class Fn>
void visit_instantiation(int hd, DType dtype, bool causal, Fn&& fn) {
  auto with_hd = [&]<int HD>() {
    if (dtype == DType::kFloat16) {
      causal ? fn.template operator()<HD, cutlass::half_t, true>() : fn.template operator()<HD, cutlass::half_t, false>();
    } else {
      causal ? fn.template operator()<HD, cutlass::bfloat16_t, true>()
             : fn.template operator()<HD, cutlass::bfloat16_t, false>();
    }
  };
  switch (hd) {
    case 32: return with_hd.template operator()<32>();
    case 64: return with_hd.template operator()<64>();
    case 96: return with_hd.template operator()<96>();
    case 128: return with_hd.template operator()<128>();
    case 192: return with_hd.template operator()<192>();
    case 256: return with_hd.template operator()<256>();
    default: return;
  }
}

}  // namespace

std::string emu_head_dims() {
  std::string s;
  for (int hd : kGpuHeadDims) {
    if (head_dim_compiled(hd)) { s += (s.empty() ? "" : ", ") + std::to_string(hd); }
  }
  return s;
}

std::string head_dim_unavailable(int d) {
  if (built_head_dim_for(d) >= 0) { return {}; }
  std::string const built = emu_head_dims();
  return "no emulated Sm80 kernel for head dim " + std::to_string(d) + " in this build (emulated head dims: " +
         (built.empty() ? "none" : built) + "); rebuild with FLASH_EXT_EMU_HEADDIMS including a head dim >= " +
         std::to_string(d);
}

CudaPlan plan_fwd_emu(FwdParams const& params, DType dtype) {
  CudaPlan plan;
  if (dtype == DType::kFloat32) {
    plan.why = "the Sm80 kernels take fp16 or bf16 (fp32 runs on the host backend)";
    return plan;
  }
  int const hd = built_head_dim_for(params.d);
  if (hd < 0) {
    plan.why = head_dim_unavailable(params.d);
    return plan;
  }
  visit_instantiation(hd, dtype, params.is_causal, [&]<int HD, class Element, bool Causal>() {
    using Traits = typename EmuFwd<HD, Element, Causal>::Traits;
    plan.head_dim = HD;
    plan.block_m = Traits::kBlockM;
    plan.block_n = Traits::kBlockN;
    plan.num_warps = Traits::kNWarps;
    plan.smem_bytes = Traits::kSmemBytes;
    plan.variant = select_variant(Causal, problem_flags(params, Traits::kBlockM, Traits::kBlockN, Traits::kHeadDim));
    plan.variant_name = plan.variant >= 0 ? kVariants[plan.variant].name : "";
    plan.grid = fwd_grid(ceil_div(params.seqlen_q, Traits::kBlockM), params.b, params.h, params.num_splits);
    plan.ok = plan.variant >= 0 && grid_error(plan.grid) == nullptr;
    if (plan.variant < 0) { plan.why = "no compiled flag variant admits this problem"; }
    if (char const* why = grid_error(plan.grid)) { plan.why = std::string("cannot launch: ") + why; }
  });
  return plan;
}

std::string run_fwd_emu(FwdParams const& params, DType dtype, EmuLaunch& launch) {
  CudaPlan const plan = plan_fwd_emu(params, dtype);
  if (!plan.ok) { return plan.why; }
  std::string result;
  visit_instantiation(plan.head_dim, dtype, params.is_causal, [&]<int HD, class Element, bool Causal>() {
    if constexpr (head_dim_compiled(HD)) { result = run_fwd_emu_sm80<HD, Element, Causal>(params, launch); }
  });
  return result;
}

}  // namespace flash_ext::emu
