// Host micro-kernels for AMX-BF16 (Sapphire Rapids and later): the AVX-512-BF16 kernels, with the bf16 GEMMs of
// whole 16 x 16 tiles on the tile registers (tdpbf16ps: 16 x 16 x 32 products per instruction, against
// 16 x 2 for a vdpbf16ps).  Everything else (softmax, fp32 and fp16 GEMMs, partial tiles) is the
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

// out[j] lane i = in[i] lane j: 32-bit interleaves, then 64-bit ones, then two rounds of 128-bit lane shuffles.
inline __attribute__((always_inline)) void transpose16_u32(vu const* in, vu* out) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) { r[i] = (__m512i)in[i]; }
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // r[4 i + e], 128-bit lane L: element 4 L + e of rows 4 i .. 4 i + 3.
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Output row 4 L + e: lane L of r[e], r[4 + e], r[8 + e], r[12 + e] (a 4 x 4 transpose of 128-bit lanes).
  for (int e = 0; e < 4; ++e) {
    __m512i const u0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44);
    __m512i const u1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xee);
    __m512i const u2 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
    __m512i const u3 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xee);
    out[e] = (vu)_mm512_shuffle_i32x4(u0, u2, 0x88);
    out[4 + e] = (vu)_mm512_shuffle_i32x4(u0, u2, 0xdd);
    out[8 + e] = (vu)_mm512_shuffle_i32x4(u1, u3, 0x88);
    out[12 + e] = (vu)_mm512_shuffle_i32x4(u1, u3, 0xdd);
  }
}

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
