// CPU backend instance of the backward pass for float.
#include "bwd_host.h"

namespace flash_ext {
template void run_bwd_cpu_dtype<float>(BwdParams const&);
}  // namespace flash_ext
