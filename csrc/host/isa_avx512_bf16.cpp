// Host micro-kernels for AVX-512 with AVX512_BF16: the AVX-512 kernels, with bf16 GEMMs on vdpbf16ps (two
// products of bf16 pairs per fp32 lane and instruction).
#if defined(__x86_64__)
#define FLASH_EXT_ISA_TARGET "avx512bf16,avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#include "isa/target_begin.h"

#include "flash_ext/host_isa.h"

namespace flash_ext {
namespace {
constexpr HostIsa kIsa = HostIsa::kAvx512Bf16;
constexpr char const* kName = "avx512_bf16";
}  // namespace
}  // namespace flash_ext

#include "isa/avx512.h"
#include "isa/avx512_bf16.h"
#include "isa/kernels.h"

namespace flash_ext {
HostKernels const* host_kernels_avx512_bf16() { return &kKernels; }
}  // namespace flash_ext
#endif  // __x86_64__
