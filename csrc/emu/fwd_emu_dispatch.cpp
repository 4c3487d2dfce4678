// Picks the (head dim, dtype, causal) instantiation for a problem and reports the plan: the emulated
// counterpart of csrc/cuda/fwd_dispatch.cu (same head-dim rule, tile config and variant selection).
#undef NDEBUG  // the emulator keeps assertions on (CUTE_INVALID_CONTROL_PATH is only a printf under NDEBUG)

#include <string>

#include "emu/fwd_emu.h"
#include "emu/launch_emu.h"
#include "flash_ext/instantiations.h"

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

using Built = CompiledHeadDims<FLASH_EXT_EMU_HEADDIMS_MASK>;

}  // namespace

std::string emu_head_dims() { return Built::list(""); }

std::string head_dim_unavailable(int d) {
  if (Built::at_least(d) >= 0) { return {}; }
  return "no emulated Sm80 kernel for head dim " + std::to_string(d) + " in this build (emulated head dims: " +
         Built::list() + "); rebuild with FLASH_EXT_EMU_HEADDIMS including a head dim >= " +
         std::to_string(d);
}

CudaPlan plan_fwd_emu(FwdParams const& params, DType dtype) {
  CudaPlan plan;
  if (dtype == DType::kFloat32) {
    plan.why = "the Sm80 kernels take fp16 or bf16 (fp32 runs on the host backend)";
    return plan;
  }
  int const hd = Built::at_least(params.d);
  if (hd < 0) {
    plan.why = head_dim_unavailable(params.d);
    return plan;
  }
  fill_fwd_plan(plan, params, hd, params.is_causal, kEmuBudget);
  return plan;
}

std::string run_fwd_emu(FwdParams const& params, DType dtype, EmuLaunch& launch) {
  CudaPlan const plan = plan_fwd_emu(params, dtype);
  if (!plan.ok) { return plan.why; }
  add_param_ranges(launch, params, /*backward=*/false);
  std::string result;
  visit_gpu_instantiation(plan.head_dim, dtype, params.is_causal, [&]<int HD, class Element, bool Causal>() {
    if constexpr (Built::contains(HD)) { result = run_fwd_emu_sm80<HD, Element, Causal>(params, launch); }
  });
  return result;
}

}  // namespace flash_ext::emu
