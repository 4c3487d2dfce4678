// Host micro-kernels for AMX-BF16 (Sapphire Rapids and later): the AVX-512-BF16 kernels, with the bf16 GEMMs of
// whole 16 x 16 tiles on the tile registers (tdpbf16ps: 16 x 16 x 32 products per instruction, against
// 16 x 2 for a vdpbf16ps), and the fp16 and fp32 GEMMs of more than a few rows there too, their operands split
// into 2 or 3 bf16 pieces (kernels.h).  Everything else (softmax, decode's few-row GEMMs, partial tiles) is the
// AVX-512-BF16 level's code.
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define FLASH_EXT_ISA_TARGET "amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#include "isa/target_begin.h"

#include <immintrin.h>

#include <cstdint>

#include "flash_ext/host_isa.h"

namespace flash_ext {
namespace {
constexpr HostIsa kIsa = HostIsa::kAmxBf16;
constexpr char const* kName = "amx_bf16";
}  // namespace
}  // namespace flash_ext

#include "isa/avx512.h"
#include "isa/avx512_bf16.h"

namespace flash_ext {
namespace {

#define FLASH_EXT_ISA_HAS_TILES 1

// ldtilecfg's 64-byte operand (palette 1): every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64);

// The compiler barriers: GCC's tile intrinsics are asm statements that do not declare the memory a tile load
// or ldtilecfg reads, so without them the stores that fill a packed operand could be moved past its load.
inline __attribute__((always_inline)) void tiles_begin() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64, cfg.rows[t] = 16; }
  __asm__ volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}
// Released after every GEMM: configured tiles make every context switch save and restore their 8 KiB.
inline __attribute__((always_inline)) void tiles_end() { _tile_release(); }
// The tile number is a literal: the instructions encode it, and the intrinsics paste it into their asm.
#define FLASH_EXT_TILE_LOAD(t, p, stride) \
  do {                                    \
    __asm__ volatile("" ::: "memory");    \
    _tile_loadd(t, p, stride);            \
  } while (0)
#define FLASH_EXT_TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define FLASH_EXT_TILE_ZERO(t) _tile_zero(t)
#define FLASH_EXT_TILE_DOT(c, a, b) _tile_dpbf16ps(c, a, b)

}  // namespace
}  // namespace flash_ext

#include "isa/kernels.h"

namespace flash_ext {
HostKernels const* host_kernels_amx_bf16() { return &kKernels; }
}  // namespace flash_ext
#else
#include "flash_ext/host_isa.h"
namespace flash_ext {
HostKernels const* host_kernels_amx_bf16() { return nullptr; }  // no AMX intrinsics in this compiler
}  // namespace flash_ext
#endif
