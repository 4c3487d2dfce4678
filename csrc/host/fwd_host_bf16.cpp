// CPU backend instance for cutlass::bfloat16_t.
#include "fwd_host.h"

namespace flash_ext {
template void run_fwd_cpu_dtype<cutlass::bfloat16_t>(FwdParams const&);
}  // namespace flash_ext
