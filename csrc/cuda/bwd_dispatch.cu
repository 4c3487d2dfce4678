// The CUDA backward: picks the (head dim, dtype, causal) instantiation of the main kernel, and runs it between
// the per-row preprocess (D, zeroed dQ slices) and postprocess (dQ) kernels, which depend on the dtype only.
#include <cuda_runtime.h>

#include <string>

#include "flash_ext/bwd_api.h"
#include "flash_ext/bwd_postprocess.h"
#include "flash_ext/bwd_preprocess.h"
#include "flash_ext/dispatch_bwd.h"
#include "flash_ext/instantiations.h"
#include "flash_ext/launch_sm80_bwd.cuh"

#ifndef FLASH_EXT_GPU_BWD_HEADDIMS_MASK
#error "the build defines FLASH_EXT_GPU_BWD_HEADDIMS_MASK: bit i set when the backward of kGpuHeadDims[i] was compiled"
#endif

namespace flash_ext {

#define FLASH_EXT_DECLARE(HD)                                                                          \
  extern template std::string run_bwd_sm80<HD, cutlass::half_t, false>(BwdParams const&, cudaStream_t);     \
  extern template std::string run_bwd_sm80<HD, cutlass::half_t, true>(BwdParams const&, cudaStream_t);      \
  extern template std::string run_bwd_sm80<HD, cutlass::bfloat16_t, false>(BwdParams const&, cudaStream_t); \
  extern template std::string run_bwd_sm80<HD, cutlass::bfloat16_t, true>(BwdParams const&, cudaStream_t);
FLASH_EXT_DECLARE(32)
FLASH_EXT_DECLARE(64)
FLASH_EXT_DECLARE(96)
FLASH_EXT_DECLARE(128)
FLASH_EXT_DECLARE(192)
FLASH_EXT_DECLARE(256)
#undef FLASH_EXT_DECLARE

namespace {

// The backward's own subset (FLASH_EXT_BWD_HEADDIMS, setup.py), independent of the forward's.
using Built = CompiledHeadDims<FLASH_EXT_GPU_BWD_HEADDIMS_MASK>;

// One thread per (query row, head): D for the row and its zeroed dQ slices.  Consecutive threads take
// consecutive heads of a row, so a warp reads one contiguous stretch of dO and O.
template <class Element>
__global__ void bwd_preprocess_kernel(__grid_constant__ const BwdParams params) {
  int64_t const t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int const row = int(t / params.h), bidh = int(t % params.h), bidb = int(blockIdx.y);
  BlockInfo const binfo(params, bidb);
  if (row >= binfo.seqlen_q) { return; }
  preprocess_row<Element>(params, binfo, bidb, bidh, row);
}

// One thread per (query row, head, 8 columns): consecutive threads take consecutive column groups, so the
// accumulator reads and dQ writes are coalesced.
template <class Element>
__global__ void bwd_postprocess_kernel(__grid_constant__ const BwdParams params) {
  constexpr int kCols = 8;
  int const groups = (params.d + kCols - 1) / kCols;
  int64_t const t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int const row = int(t / (int64_t(groups) * params.h));
  int const bidh = int((t / groups) % params.h);
  int const group = int(t % groups);
  int const bidb = int(blockIdx.y);
  BlockInfo const binfo(params, bidb);
  if (row >= binfo.seqlen_q) { return; }
  postprocess_dq_row<Element>(params, binfo, bidb, bidh, row, group * kCols, min((group + 1) * kCols, params.d));
}

template <class Element>
std::string launch_pre_post(BwdParams const& params, cudaStream_t stream, bool pre) {
  constexpr int kThreads = 128;
  int64_t const threads = pre ? int64_t(params.seqlen_q) * params.h
                              : int64_t(params.seqlen_q) * params.h * ((params.d + 7) / 8);
  dim3 const grid(unsigned((threads + kThreads - 1) / kThreads), params.b);
  if (pre) {
    bwd_preprocess_kernel<Element><<<grid, kThreads, 0, stream>>>(params);
  } else {
    bwd_postprocess_kernel<Element><<<grid, kThreads, 0, stream>>>(params);
  }
  cudaError_t const err = cudaGetLastError();
  return err == cudaSuccess ? std::string()
                            : std::string(pre ? "backward preprocess" : "backward postprocess") + " launch: " +
                                  cudaGetErrorString(err);
}

}  // namespace

CudaBwdPlan plan_bwd_cuda(BwdParams const& params, DType dtype, int cc_major, int cc_minor, int max_smem_optin,
                          int processors) {
  CudaBwdPlan plan;
  plan.why = cuda_refusal(cc_major, cc_minor, dtype);
  if (!plan.why.empty()) { return plan; }
  int const hd = Built::at_least(params.d);
  if (hd < 0) {
    plan.why = "no GPU backward kernel for head dim " + std::to_string(params.d) + " in this build (compiled "
               "backward head dims: " + Built::list() + "); rebuild with FLASH_EXT_BWD_HEADDIMS including a head dim >= " +
               std::to_string(params.d);
    return plan;
  }
  // The grid is (K/V tiles or dQ columns, batch, K/V heads): gridDim.y and gridDim.z hold at most 65,535.
  if (params.b > 65535 || params.h_k > 65535) {
    plan.why = "the CUDA backward launches one grid row per sequence and per K/V head (at most 65,535 each); got " +
               std::to_string(params.b) + " sequences and " + std::to_string(params.h_k) +
               " K/V heads: split the batch into calls of at most 65,535 sequences";
    return plan;
  }
  BwdTileConfig const tile = sm80_bwd_tile_config(hd);
  plan.head_dim = hd;
  plan.block_m = tile.block_m;
  plan.block_n = tile.block_n;
  plan.num_warps = tile.num_warps;
  plan.smem_bytes = bwd_tile_smem_bytes(tile, hd);
  if (plan.smem_bytes > max_smem_optin) {
    plan.why = "the backward kernel needs " + std::to_string(plan.smem_bytes) + " bytes of shared memory per block; "
               "this GPU allows " + std::to_string(max_smem_optin);
    return plan;
  }
  plan.variant = select_bwd_variant(params.is_causal, problem_flags(params, tile.block_m, tile.block_n, hd));
  plan.variant_name = plan.variant >= 0 ? kBwdVariants[plan.variant].name : "";
  plan.n_blocks = ceil_div(params.seqlen_k, tile.block_n);
  int64_t const slice_bytes = int64_t(params.h) * params.accum_rows * params.d * int64_t(sizeof(float));
  plan.dq_splits =
      params.deterministic ? cap_dq_slices(bwd_deterministic_splits(params.b, params.h_k, plan.n_blocks, processors), slice_bytes)
                           : 1;
  plan.ok = plan.variant >= 0;
  if (!plan.ok) { plan.why = "no compiled backward variant admits this problem"; }
  return plan;
}

std::string run_bwd_cuda(BwdParams const& params, DType dtype, int cc_major, int cc_minor, int max_smem_optin,
                         void* stream_ptr) {
  auto const stream = static_cast<cudaStream_t>(stream_ptr);
  // The processor count only sizes the deterministic grid, which params.dq_accum_splits already fixes.
  CudaBwdPlan const plan = plan_bwd_cuda(params, dtype, cc_major, cc_minor, max_smem_optin, /*processors=*/1);
  if (!plan.ok) { return plan.why; }
  bool const fp16 = dtype == DType::kFloat16;
  std::string result = fp16 ? launch_pre_post<cutlass::half_t>(params, stream, true)
                            : launch_pre_post<cutlass::bfloat16_t>(params, stream, true);
  if (!result.empty()) { return result; }
  visit_gpu_instantiation(plan.head_dim, dtype, params.is_causal, [&]<int HD, class Element, bool Causal>() {
    // Only compiled instantiations are referenced, so a partial build links.
    if constexpr (Built::contains(HD)) { result = run_bwd_sm80<HD, Element, Causal>(params, stream); }
  });
  if (!result.empty()) { return result; }
  return fp16 ? launch_pre_post<cutlass::half_t>(params, stream, false)
              : launch_pre_post<cutlass::bfloat16_t>(params, stream, false);
}

}  // namespace flash_ext
