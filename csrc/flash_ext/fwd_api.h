// Raw-pointer entry points between the torch op layer (csrc/ops/) and the kernels.  No torch types cross
// this boundary, so kernel translation units never include torch headers.
#pragma once

#include <string>

#include "grid.h"
#include "params.h"

namespace flash_ext {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// CPU backend: the kernel body with HostTraits, run over at::parallel_for.
void run_fwd_cpu(FwdParams const& params, DType dtype);

// What the CUDA dispatcher (or the warp emulator, which mirrors it) would launch for a problem; `ok` false
// with `why` set when nothing can run.
struct CudaPlan {
  bool ok = false;
  std::string why;
  int head_dim = 0, block_m = 0, block_n = 0, num_warps = 0, smem_bytes = 0;
  int ctas_per_sm = 1;  // resident CTAs per SM (dispatch.h, sm80_ctas_per_sm): the split heuristic's slots
  int variant = -1;
  const char* variant_name = "";
  GridDims grid;  // the launch grid (grid.h)
};

#if defined(FLASH_EXT_WITH_CUDA)
CudaPlan plan_fwd_cuda(FwdParams const& params, DType dtype, int device_cc_major, int device_cc_minor,
                       int max_smem_per_block_optin);
// Launches on `stream` (a cudaStream_t) of the current device, whose compute capability and opt-in shared
// memory per block the caller passes (the op layer's cached device properties).  Returns an empty string on
// success, else the reason.
std::string run_fwd_cuda(FwdParams const& params, DType dtype, int device_cc_major, int device_cc_minor,
                         int max_smem_per_block_optin, void* stream);
// The dropout keep mask (batch, heads, seqlen_q, seqlen_k) of dropout.h into `mask` (device memory), with the
// seed/offset and threshold of `params` (csrc/cuda/dropout_mask.cu).
std::string run_dropout_mask_cuda(FwdParams const& params, bool* mask, int batch, int heads, int seqlen_q,
                                  int seqlen_k, void* stream);
#endif

}  // namespace flash_ext
