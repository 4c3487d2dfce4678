#include "bwd_host.h"
#include "flash_ext/bwd_api.h"
#include "flash_ext/dispatch_bwd.h"

namespace flash_ext {

extern template void run_bwd_cpu_dtype<float>(BwdParams const&);
extern template void run_bwd_cpu_dtype<cutlass::half_t>(BwdParams const&);
extern template void run_bwd_cpu_dtype<cutlass::bfloat16_t>(BwdParams const&);

void run_bwd_cpu(BwdParams const& params, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return run_bwd_cpu_dtype<float>(params);
    case DType::kFloat16: return run_bwd_cpu_dtype<cutlass::half_t>(params);
    case DType::kBFloat16: return run_bwd_cpu_dtype<cutlass::bfloat16_t>(params);
  }
}

int bwd_cpu_dq_splits(BwdParams const& params) {
  int64_t const slice_bytes = int64_t(params.h) * params.accum_rows * params.d * int64_t(sizeof(float));
  return cap_dq_slices(host_bwd_splits(params.b, params.h_k, ceil_div(params.seqlen_k, kHostBwdBlockN)), slice_bytes);
}

}  // namespace flash_ext
