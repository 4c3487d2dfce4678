// Picks the (head dim, dtype, causal) instantiation for a problem and reports the plan for explain().
#include <cuda_runtime.h>

#include <string>

#include "flash_ext/combine.h"
#include "flash_ext/dispatch.h"
#include "flash_ext/fwd_api.h"
#include "flash_ext/grid.h"
#include "flash_ext/instantiations.h"
#include "flash_ext/launch_sm80.cuh"

#ifndef FLASH_EXT_GPU_HEADDIMS_MASK
#error "the build defines FLASH_EXT_GPU_HEADDIMS_MASK: bit i set when kGpuHeadDims[i] was compiled"
#endif

namespace flash_ext {

#define FLASH_EXT_DECLARE(HD)                                                                           \
  extern template std::string run_fwd_sm80<HD, cutlass::half_t, false>(FwdParams const&, cudaStream_t, SmemBudget);  \
  extern template std::string run_fwd_sm80<HD, cutlass::half_t, true>(FwdParams const&, cudaStream_t, SmemBudget);   \
  extern template std::string run_fwd_sm80<HD, cutlass::bfloat16_t, false>(FwdParams const&, cudaStream_t, SmemBudget); \
  extern template std::string run_fwd_sm80<HD, cutlass::bfloat16_t, true>(FwdParams const&, cudaStream_t, SmemBudget);
FLASH_EXT_DECLARE(32)
FLASH_EXT_DECLARE(64)
FLASH_EXT_DECLARE(96)
FLASH_EXT_DECLARE(128)
FLASH_EXT_DECLARE(192)
FLASH_EXT_DECLARE(256)
#undef FLASH_EXT_DECLARE

namespace {

using Built = CompiledHeadDims<FLASH_EXT_GPU_HEADDIMS_MASK>;

// Split-KV combine: one thread per (query row, kCombineCols output columns), geometry and per-thread work in
// grid.h and combine.h (shared with the warp emulator).
template <class Element>
__global__ void combine_kernel(__grid_constant__ const FwdParams params) {
  CombineBlock const blk = combine_block(blockIdx.y, blockIdx.z, gridDim.y, params.b, params.h);
  if (!blk.valid) { return; }
  combine_thread<Element>(params, blk.bidb, blk.bidh, int64_t(blockIdx.x) * blockDim.x + threadIdx.x);
}

template <class Element>
std::string launch_combine(FwdParams const& params, cudaStream_t stream) {
  GridDims const g = combine_grid(params.seqlen_q, params.d, params.b, params.h);
  if (char const* why = grid_error(g)) { return std::string("combine grid: ") + why; }
  combine_kernel<Element><<<dim3(unsigned(g.x), unsigned(g.y), unsigned(g.z)), kCombineThreads, 0, stream>>>(params);
  cudaError_t const err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string("combine launch: ") + cudaGetErrorString(err);
}

}  // namespace

CudaPlan plan_fwd_cuda(FwdParams const& params, DType dtype, int cc_major, int cc_minor, int max_smem_optin) {
  CudaPlan plan;
  plan.why = cuda_refusal(cc_major, cc_minor, dtype);
  if (!plan.why.empty()) { return plan; }
  int const hd = Built::at_least(params.d);
  if (hd < 0) {
    plan.why = "no GPU kernel for head dim " + std::to_string(params.d) + " in this build (compiled head dims: " +
               Built::list() + "); rebuild with FLASH_EXT_HEADDIMS including a head dim >= " + std::to_string(params.d);
    return plan;
  }
  fill_fwd_plan(plan, params, hd, params.is_causal, smem_budget_for(max_smem_optin));
  return plan;
}

std::string run_fwd_cuda(FwdParams const& params, DType dtype, int cc_major, int cc_minor, int max_smem_optin,
                         void* stream) {
  CudaPlan const plan = plan_fwd_cuda(params, dtype, cc_major, cc_minor, max_smem_optin);
  if (!plan.ok) { return plan.why; }
  std::string result;
  visit_gpu_instantiation(plan.head_dim, dtype, params.is_causal, [&]<int HD, class Element, bool Causal>() {
    // Only compiled instantiations are referenced, so a partial build links.
    if constexpr (Built::contains(HD)) {
      result = run_fwd_sm80<HD, Element, Causal>(params, static_cast<cudaStream_t>(stream),
                                                 smem_budget_for(max_smem_optin));
    }
  });
  if (result.empty() && params.num_splits > 1) {
    result = dtype == DType::kFloat16 ? launch_combine<cutlass::half_t>(params, static_cast<cudaStream_t>(stream))
                                      : launch_combine<cutlass::bfloat16_t>(params, static_cast<cudaStream_t>(stream));
  }
  if (result.find("no kernel image") != std::string::npos || result.find("invalid device function") != std::string::npos) {
    result += " (this build has no kernel for sm_" + std::to_string(cc_major * 10 + cc_minor) +
              "; rebuild with FLASH_EXT_CUDA_ARCHS including it)";
  }
  return result;
}

}  // namespace flash_ext
