// The CUDA side of the forward kernel: the __global__ wrapper around the kernel body with Sm80Traits, and
// the launcher that picks the static variant and sets dynamic shared memory.  Included only by .cu files.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "dispatch.h"
#include "grid.h"
#include "kernel_fwd.h"
#include "params.h"
#include "traits_sm80.h"

namespace flash_ext {

template <int kHeadDim, class Element, bool kCausal, SmemBudget kBudget = SmemBudget::kSm80>
using Sm80Fwd = Sm80FwdTiles<kHeadDim, Element, kCausal, kBudget, Sm80Arch>;

// One CTA per (m_block, batch, head, split), laid out and decoded by grid.h.
template <class Traits, class Flags>
__global__ void __launch_bounds__(Traits::kNThreads, 1) flash_fwd_kernel(__grid_constant__ const FwdParams params) {
  extern __shared__ __align__(128) char smem[];
  fwd_cta<Traits, Flags>(params, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y, int(threadIdx.x), smem);
}

template <class Traits, class Flags>
std::string launch_fwd(FwdParams const& params, cudaStream_t stream) {
  auto kernel = &flash_fwd_kernel<Traits, Flags>;
  constexpr int kSmem = Traits::kSmemBytes;
  cudaError_t err = cudaSuccess;
  if (kSmem > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) { return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(err); }
  }
  GridDims const g = fwd_grid(ceil_div(params.seqlen_q, Traits::kBlockM), params.b, params.h, params.num_splits);
  if (char const* why = grid_error(g)) { return std::string("grid: ") + why; }
  kernel<<<dim3(unsigned(g.x), unsigned(g.y), unsigned(g.z)), Traits::kNThreads, kSmem, stream>>>(params);
  err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string("kernel launch: ") + cudaGetErrorString(err);
}

template <class Fwd, bool kCausal, int kVariant = 0>
std::string launch_variant(FwdParams const& params, cudaStream_t stream, int variant) {
  if constexpr (kVariant < kNumVariants) {
    if (variant == kVariant) {
      return launch_fwd<typename Fwd::template Traits<kVariant>, VariantFlags<kVariant, kCausal>>(params, stream);
    }
    return launch_variant<Fwd, kCausal, kVariant + 1>(params, stream, variant);
  } else {
    return "no compiled variant admits this problem";
  }
}

template <class Fwd>
std::string run_tiles(FwdParams const& params, cudaStream_t stream) {
  return launch_variant<Fwd, Fwd::kCausal>(params, stream,
                                           select_fwd_variant(params, Fwd::kHeadDim, Fwd::kCausal, Fwd::kBudget));
}

// Explicitly instantiated once per (head dim, dtype, causal) in the generated files.
template <int kHeadDim, class Element, bool kCausal>
std::string run_fwd_sm80(FwdParams const& params, cudaStream_t stream, SmemBudget budget) {
  using Fwd = Sm80Fwd<kHeadDim, Element, kCausal>;
  if constexpr (Fwd::kBudgetMatters) {
    if (budget == SmemBudget::kSm86) {
      return run_tiles<Sm80Fwd<kHeadDim, Element, kCausal, SmemBudget::kSm86>>(params, stream);
    }
  }
  return run_tiles<Fwd>(params, stream);
}

}  // namespace flash_ext
