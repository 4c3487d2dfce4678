// Picks the (head dim, dtype, causal) instantiation for a problem and reports the plan for explain().
#include <cuda_runtime.h>

#include <string>

#include "flash_ext/combine.h"
#include "flash_ext/dispatch.h"
#include "flash_ext/fwd_api.h"
#include "flash_ext/grid.h"
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

constexpr int kNumGpuHeadDims = int(sizeof(kGpuHeadDims) / sizeof(kGpuHeadDims[0]));

constexpr bool head_dim_built(int i) { return ((FLASH_EXT_GPU_HEADDIMS_MASK) >> i) & 1; }

constexpr bool head_dim_compiled(int hd) {
  for (int i = 0; i < kNumGpuHeadDims; ++i) {
    if (kGpuHeadDims[i] == hd) { return head_dim_built(i); }
  }
  return false;
}

// Smallest compiled head dim >= d, or -1.
int built_head_dim_for(int d) {
  for (int i = 0; i < kNumGpuHeadDims; ++i) {
    if (head_dim_built(i) && d <= kGpuHeadDims[i]) { return kGpuHeadDims[i]; }
  }
  return -1;
}

std::string built_list() {
  std::string s;
  for (int i = 0; i < kNumGpuHeadDims; ++i) {
    if (head_dim_built(i)) { s += (s.empty() ? "" : ", ") + std::to_string(kGpuHeadDims[i]); }
  }
  return s.empty() ? "none" : s;
}

template <int kHeadDim, class Element, bool kCausal, SmemBudget kBudget>
void fill_plan_traits(CudaPlan& plan, FwdParams const& params) {
  using Traits = typename Sm80Fwd<kHeadDim, Element, kCausal, kBudget>::Traits;
  plan.head_dim = kHeadDim;
  plan.block_m = Traits::kBlockM;
  plan.block_n = Traits::kBlockN;
  plan.num_warps = Traits::kNWarps;
  plan.smem_bytes = Traits::kSmemBytes;
  plan.variant = select_variant(kCausal, problem_flags(params, Traits::kBlockM, Traits::kBlockN, Traits::kHeadDim));
  plan.variant_name = plan.variant >= 0 ? kVariants[plan.variant].name : "";
  plan.grid = fwd_grid(ceil_div(params.seqlen_q, Traits::kBlockM), params.b, params.h, params.num_splits);
  plan.ok = plan.variant >= 0 && grid_error(plan.grid) == nullptr;
  if (plan.variant < 0) { plan.why = "no compiled flag variant admits this problem"; }
  if (char const* why = grid_error(plan.grid)) { plan.why = std::string("cannot launch: ") + why; }
}

template <int kHeadDim, class Element, bool kCausal>
void fill_plan(CudaPlan& plan, FwdParams const& params, SmemBudget budget) {
  if (Sm80Fwd<kHeadDim, Element, kCausal>::kBudgetMatters && budget == SmemBudget::kSm86) {
    fill_plan_traits<kHeadDim, Element, kCausal, SmemBudget::kSm86>(plan, params);
  } else {
    fill_plan_traits<kHeadDim, Element, kCausal, SmemBudget::kSm80>(plan, params);
  }
}

// Calls fn.template operator()<HD, Element, Causal>() for the problem's instantiation.
template <class Fn>
bool visit_instantiation(int hd, DType dtype, bool causal, Fn&& fn) {
  auto with_hd = [&]<int HD>() {
    if (dtype == DType::kFloat16) {
      causal ? fn.template operator()<HD, cutlass::half_t, true>() : fn.template operator()<HD, cutlass::half_t, false>();
    } else {
      causal ? fn.template operator()<HD, cutlass::bfloat16_t, true>()
             : fn.template operator()<HD, cutlass::bfloat16_t, false>();
    }
  };
  switch (hd) {
    case 32: with_hd.template operator()<32>(); return true;
    case 64: with_hd.template operator()<64>(); return true;
    case 96: with_hd.template operator()<96>(); return true;
    case 128: with_hd.template operator()<128>(); return true;
    case 192: with_hd.template operator()<192>(); return true;
    case 256: with_hd.template operator()<256>(); return true;
    default: return false;
  }
}

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
  if (cc_major < 8) {
    plan.why = "the GPU has compute capability " + std::to_string(cc_major) + "." + std::to_string(cc_minor) +
               "; flash_ext's CUDA kernels need sm_80 or newer (use CPU tensors instead)";
    return plan;
  }
  if (dtype == DType::kFloat32) {
    plan.why = "CUDA kernels take fp16 or bf16 (fp32 runs on the CPU backend)";
    return plan;
  }
  int const hd = built_head_dim_for(params.d);
  if (hd < 0) {
    plan.why = "no GPU kernel for head dim " + std::to_string(params.d) + " in this build (compiled head dims: " +
               built_list() + "); rebuild with FLASH_EXT_HEADDIMS including a head dim >= " + std::to_string(params.d);
    return plan;
  }
  visit_instantiation(hd, dtype, params.is_causal, [&]<int HD, class Element, bool Causal>() {
    fill_plan<HD, Element, Causal>(plan, params, smem_budget_for(max_smem_optin));
  });
  return plan;
}

std::string run_fwd_cuda(FwdParams const& params, DType dtype, int cc_major, int cc_minor, int max_smem_optin,
                         void* stream) {
  CudaPlan const plan = plan_fwd_cuda(params, dtype, cc_major, cc_minor, max_smem_optin);
  if (!plan.ok) { return plan.why; }
  std::string result;
  visit_instantiation(plan.head_dim, dtype, params.is_causal, [&]<int HD, class Element, bool Causal>() {
    // Only compiled instantiations are referenced, so a partial build links.
    if constexpr (head_dim_compiled(HD)) {
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
