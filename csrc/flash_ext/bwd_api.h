// Raw-pointer entry points of the backward pass between the torch op layer (csrc/ops/bwd.cpp) and the
// kernels, as fwd_api.h is for the forward.  No torch types cross this boundary.
#pragma once

#include <string>

#include "fwd_api.h"
#include "params.h"

namespace flash_ext {

// CPU backend: preprocess, the backward body with HostBwdTraits, postprocess, over at::parallel_for.
// params.dq_accum_splits must be bwd_cpu_dq_splits(params) (slices allocated by the caller).
void run_bwd_cpu(BwdParams const& params, DType dtype);
// The number of dQ accumulator slices the CPU backend uses for this problem (a function of its shape only).
int bwd_cpu_dq_splits(BwdParams const& params);

#if defined(FLASH_EXT_WITH_CUDA)
// What the CUDA backward would launch; `ok` false with `why` set when nothing can run.
struct CudaBwdPlan {
  bool ok = false;
  std::string why;
  int head_dim = 0, block_m = 0, block_n = 0, num_warps = 0, smem_bytes = 0;
  int variant = -1;
  const char* variant_name = "";
  int n_blocks = 0;    // K/V tiles per (batch, K/V head)
  int dq_splits = 1;   // dQ accumulator slices the launch needs (deterministic: one per CTA column)
};
CudaBwdPlan plan_bwd_cuda(BwdParams const& params, DType dtype, int device_cc_major, int device_cc_minor,
                          int max_smem_per_block_optin, int processors);
// Launches preprocess, main kernel and postprocess on `stream` (a cudaStream_t); params.dq_accum_splits must
// be the plan's dq_splits.  Returns an empty string on success, else the reason.
std::string run_bwd_cuda(BwdParams const& params, DType dtype, int device_cc_major, int device_cc_minor,
                         int max_smem_per_block_optin, void* stream);
#endif

}  // namespace flash_ext
