// The dropout keep mask as a tensor (the mask op: return_attn_probs, tests, the backward's checks), from the
// element-wise form of dropout.h's contract: one Philox evaluation per element, independent of the forward
// kernels' grouped evaluation that it is compared against.
#include <cuda_runtime.h>

#include <string>

#include "flash_ext/dropout.h"
#include "flash_ext/fwd_api.h"

namespace flash_ext {
namespace {

// One thread per key column of one (batch, head, row); blockIdx.y = row, blockIdx.z = batch * heads + head.
__global__ void dropout_mask_kernel(__grid_constant__ const FwdParams params, bool* mask, int heads, int seqlen_q,
                                    int seqlen_k) {
  int const j = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
  int const i = int(blockIdx.y), bh = int(blockIdx.z);
  if (j >= seqlen_k) { return; }
  DropoutRng const rng = DropoutRng::make(dropout_seed_offset(params), bh / heads, bh % heads, heads,
                                          params.dropout_threshold);
  mask[(int64_t(bh) * seqlen_q + i) * seqlen_k + j] = dropout_keep(rng, i, j);
}

}  // namespace

std::string run_dropout_mask_cuda(FwdParams const& params, bool* mask, int batch, int heads, int seqlen_q,
                                  int seqlen_k, void* stream) {
  if (int64_t(batch) * heads > 65535 || seqlen_q > 65535) {
    return "dropout_mask: batch * heads and seqlen_q must be at most 65535 on CUDA (grid limits)";
  }
  dim3 const grid(unsigned((seqlen_k + 127) / 128), unsigned(seqlen_q), unsigned(batch * heads));
  dropout_mask_kernel<<<grid, 128, 0, static_cast<cudaStream_t>(stream)>>>(params, mask, heads, seqlen_q, seqlen_k);
  cudaError_t const err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string("kernel launch: ") + cudaGetErrorString(err);
}

}  // namespace flash_ext
