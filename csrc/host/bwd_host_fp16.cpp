// CPU backend instance of the backward pass for cutlass::half_t.
#include "bwd_host.h"

namespace flash_ext {
template void run_bwd_cpu_dtype<cutlass::half_t>(BwdParams const&);
}  // namespace flash_ext
