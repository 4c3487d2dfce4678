// The CUDA side of the backward pass: the __global__ wrappers around the backward body (Sm80BwdTraits) and
// around the per-row preprocess/postprocess, and the launcher that picks the static variant.  Included only
// by .cu files.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "bwd_postprocess.h"
#include "bwd_preprocess.h"
#include "dispatch_bwd.h"
#include "kernel_bwd.h"
#include "params.h"
#include "traits_sm80_bwd.h"

namespace flash_ext {

template <int kHeadDim, class Element>
struct Sm80Bwd {
  static constexpr BwdTileConfig kTile = sm80_bwd_tile_config(kHeadDim);
  using Traits = Sm80BwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.num_warps, kTile.atom_m_sdp,
                               kTile.atom_n_dkv, kTile.atom_m_dq, kTile.double_buffer_q, Element>;
};

// One CTA per (K/V tile, batch, K/V head): blockIdx.x = n_block, so CTAs of one head, which read the same Q/dO
// tiles, run together and share them in L2.  Deterministic mode: gridDim.x columns, column s running the K/V
// tiles s, s + gridDim.x, ... in order and adding into dQ slice s only (dispatch_bwd.h).
template <class Traits, class Flags>
__global__ void __launch_bounds__(Traits::kNThreads, 1) flash_bwd_kernel(__grid_constant__ const BwdParams params) {
  extern __shared__ __align__(128) char smem[];
  Flags const flags = bwd_flags_from_params<Traits, Flags>(params);
  int const n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  int const dq_slice = params.deterministic ? int(blockIdx.x) : 0;
  for (int n_block = int(blockIdx.x); n_block < n_blocks; n_block += int(gridDim.x)) {
    compute_dq_dk_dv_1colblock<Traits>(params, flags, int(blockIdx.y), int(blockIdx.z), n_block, dq_slice,
                                       int(threadIdx.x), smem);
  }
}

template <class Traits, class Flags>
std::string launch_bwd(BwdParams const& params, cudaStream_t stream) {
  auto kernel = &flash_bwd_kernel<Traits, Flags>;
  constexpr int kSmem = Traits::kSmemBytes;
  cudaError_t err = cudaSuccess;
  if (kSmem > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) { return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(err); }
  }
  int const n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  dim3 const grid(params.deterministic ? params.dq_accum_splits : n_blocks, params.b, params.h_k);
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(params);
  err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string("backward kernel launch: ") + cudaGetErrorString(err);
}

template <class Traits, bool kCausal, int kVariant = 0>
std::string launch_bwd_variant(BwdParams const& params, cudaStream_t stream, int variant) {
  if constexpr (kVariant < kNumBwdVariants) {
    if (variant == kVariant) { return launch_bwd<Traits, BwdVariantFlags<kVariant, kCausal>>(params, stream); }
    return launch_bwd_variant<Traits, kCausal, kVariant + 1>(params, stream, variant);
  } else {
    return "no compiled backward variant admits this problem";
  }
}

// The main backward kernel of one (head dim, dtype, causal); explicitly instantiated in the generated files.
template <int kHeadDim, class Element, bool kCausal>
std::string run_bwd_sm80(BwdParams const& params, cudaStream_t stream) {
  using Traits = typename Sm80Bwd<kHeadDim, Element>::Traits;
  int const variant =
      select_bwd_variant(kCausal, problem_flags(params, Traits::kBlockM, Traits::kBlockN, Traits::kHeadDim));
  return launch_bwd_variant<Traits, kCausal>(params, stream, variant);
}

}  // namespace flash_ext
