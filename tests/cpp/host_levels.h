// The CPU micro-kernel levels a C++ host test runs: every level compiled into the build that this CPU can
// execute (the others are reported as skipped, with the missing feature), plus on x86-64 with AVX2 the
// AVX-512-BF16 kernel source emulated on AVX2 (tests/cpp/host_isa_emulated.cpp).
#pragma once

#include <cstdio>
#include <vector>

#include "flash_ext/host_isa.h"

namespace flash_ext {
HostKernels const* host_kernels_avx512_emulated();  // tests/cpp/host_isa_emulated.cpp (x86-64 only)

inline std::vector<HostKernels const*> host_levels_to_test() {
  std::vector<HostKernels const*> levels;
  for (int i = 0; i < kNumHostIsas; ++i) {
    char const* why = host_isa_unavailable_reason(HostIsa(i));
    if (*why == '\0') {
      levels.push_back(host_kernels_for(HostIsa(i)));
    } else {
      std::printf("skip %s: %s\n", host_isa_name(HostIsa(i)), why);
    }
  }
#if defined(__x86_64__)
  if (host_isa_supported(HostIsa::kAvx2)) { levels.push_back(host_kernels_avx512_emulated()); }
#endif
  return levels;
}
}  // namespace flash_ext
