#include "flash_ext/fwd_api.h"
#include "fwd_host.h"

namespace flash_ext {

extern template void run_fwd_cpu_dtype<float>(FwdParams const&);
extern template void run_fwd_cpu_dtype<cutlass::half_t>(FwdParams const&);
extern template void run_fwd_cpu_dtype<cutlass::bfloat16_t>(FwdParams const&);

void run_fwd_cpu(FwdParams const& params, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return run_fwd_cpu_dtype<float>(params);
    case DType::kFloat16: return run_fwd_cpu_dtype<cutlass::half_t>(params);
    case DType::kBFloat16: return run_fwd_cpu_dtype<cutlass::bfloat16_t>(params);
  }
}

}  // namespace flash_ext
