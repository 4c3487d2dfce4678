// The dropout keep mask as a tensor (the mask op: return_attn_probs, tests, the backward's checks), from the
// element-wise form of dropout.h's contract: one Philox evaluation per element, independent of the forward
// kernels' grouped evaluation that it is compared against.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "flash_ext/dropout.h"
#include "flash_ext/fwd_api.h"

namespace flash_ext {
namespace {

// A grid-stride loop over the (batch * heads, seqlen_q, seqlen_k) elements in memory order, so that no
// extent meets a grid limit (grid.y/z hold 65,535: a long sequence or many heads would not launch) and
// consecutive threads write consecutive bytes.
__global__ void dropout_mask_kernel(__grid_constant__ const FwdParams params, bool* mask, int heads, int seqlen_q,
                                    int seqlen_k, int64_t total) {
  PhiloxSeedOffset const so = dropout_seed_offset(params);
  int64_t const stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    int const j = int(e % seqlen_k);
    int64_t const row = e / seqlen_k;
    int const i = int(row % seqlen_q), bh = int(row / seqlen_q);
    DropoutRng const rng = DropoutRng::make(so, bh / heads, bh % heads, heads, params.dropout_threshold);
    mask[e] = dropout_keep(rng, i, j);
  }
}

}  // namespace

std::string run_dropout_mask_cuda(FwdParams const& params, bool* mask, int batch, int heads, int seqlen_q,
                                  int seqlen_k, void* stream) {
  constexpr int kThreads = 256;
  constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // enough to fill any GPU; the loop covers the rest
  int64_t const total = int64_t(batch) * heads * seqlen_q * seqlen_k;
  int64_t const blocks = std::min((total + kThreads - 1) / kThreads, kMaxBlocks);
  dropout_mask_kernel<<<unsigned(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(params, mask, heads,
                                                                                           seqlen_q, seqlen_k, total);
  cudaError_t const err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string("kernel launch: ") + cudaGetErrorString(err);
}

}  // namespace flash_ext
