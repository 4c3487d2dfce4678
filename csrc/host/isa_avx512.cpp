// Host micro-kernels for AVX-512 F/BW/DQ/VL: 16 fp32 lanes, 32 zmm registers (24 accumulators per block).
#if defined(__x86_64__)
#define FLASH_EXT_ISA_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#include "isa/target_begin.h"

#include "flash_ext/host_isa.h"

namespace flash_ext {
namespace {
constexpr HostIsa kIsa = HostIsa::kAvx512;
constexpr char const* kName = "avx512";
}  // namespace
}  // namespace flash_ext

#include "isa/avx512.h"

#define FLASH_EXT_ISA_BF16_DOT 0
#include "isa/kernels.h"

namespace flash_ext {
HostKernels const* host_kernels_avx512() { return &kKernels; }
}  // namespace flash_ext
#endif  // __x86_64__
