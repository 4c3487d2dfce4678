// The Sm80 backward at the head dims test_emu_bwd.cpp leaves out, on the warp emulator (emu_bwd_head_dim.cpp,
// one object per head dim, each registering its cases).  Built only when CMake is given
// -DFLASH_EXT_EMU_BWD_HEADDIMS="32;96;..." (CMakeLists.txt): each head dim costs minutes of compilation, more
// than CI's budget holds; `python -m pytest -m full tests/test_cpp_host.py` builds and runs 32, 96, 128, 192, 256.
#include <algorithm>
#include <cstdio>

#include "emu_bwd_case.h"

int main() {
  auto& registry = emu_bwd_test::head_dim_registry();
  if (registry.empty()) {
    std::printf("FAIL: no head dim linked in (FLASH_EXT_EMU_BWD_HEADDIMS)\n");
    return 1;
  }
  std::sort(registry.begin(), registry.end());
  int failures = 0;
  for (auto const& [head_dim, cases] : registry) { failures += cases(); }
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
