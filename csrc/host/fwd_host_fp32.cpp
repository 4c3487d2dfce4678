// CPU backend instance for float.
#include "fwd_host.h"

namespace flash_ext {
template void run_fwd_cpu_dtype<float>(FwdParams const&);
}  // namespace flash_ext
