// Test-only level: the micro-kernel source as the AVX-512 levels compile it — 16 lanes, 24 accumulators,
// bf16 pairs multiplied as vdpbf16ps does — but built for AVX2, each 16-lane operation done as two 8-lane
// ones and vdpbf16ps emulated (odd pair element first, then even, each product exact in fp32, as the
// instruction's definition orders them).  It lets an AVX2-only CPU run the 16-lane blocking, the pair
// packing and the chunking of the AVX-512 kernels, and the level's instruction hooks (exp2 by round and
// scale, pairs by a rounding conversion) as the instructions define them; what it cannot check is the
// AVX-512 instructions themselves.  Compiled a second time with FLASH_EXT_EMULATE_TILES
// (host_isa_emulated_amx.cpp) as the AMX-BF16 level, tiles emulated too, and a third time with
// FLASH_EXT_EMULATE_NO_BF16_DOT (host_isa_emulated_avx512.cpp) as the plain AVX-512 level, whose bf16 operands
// are widened to fp32 instead (its few-rows pair paths).  Not part of the extension.
#if defined(__x86_64__)
#define FLASH_EXT_ISA_TARGET "avx2,fma,f16c"
#include "isa/target_begin.h"
// 16-lane vectors without AVX-512: GCC notes that passing them by value would change the ABI; every such
// function here is inlined, and nothing of this unit is called with them across units.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flash_ext/host_isa.h"

namespace flash_ext {
namespace {

#if FLASH_EXT_EMULATE_TILES
constexpr HostIsa kIsa = HostIsa::kAmxBf16;
constexpr char const* kName = "amx_bf16 (emulated on avx2)";
#elif FLASH_EXT_EMULATE_NO_BF16_DOT
constexpr HostIsa kIsa = HostIsa::kAvx512;
constexpr char const* kName = "avx512 (emulated on avx2)";
#else
constexpr HostIsa kIsa = HostIsa::kAvx512Bf16;
constexpr char const* kName = "avx512_bf16 (emulated on avx2)";
#endif
constexpr int kLanes = 16;
constexpr int kAccRegs = 24;
constexpr int kMaxRowVectors = 2;
constexpr bool kPackColumnMajorA = true;  // as the AVX-512 levels it stands for
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

struct Halves {
  __m256 lo, hi;
};
inline Halves split(vf v) {
  Halves h;
  std::memcpy(&h, &v, sizeof(v));
  return h;
}
inline vf join(__m256 lo, __m256 hi) {
  Halves const h{lo, hi};
  vf v;
  std::memcpy(&v, &h, sizeof(v));
  return v;
}

inline vf vsplat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline bool any_greater(vf a, vf b) {
  Halves const x = split(a), y = split(b);
  return (_mm256_movemask_ps(_mm256_cmp_ps(x.lo, y.lo, _CMP_GT_OQ)) |
          _mm256_movemask_ps(_mm256_cmp_ps(x.hi, y.hi, _CMP_GT_OQ))) != 0;
}
inline bool any_outside(vf x, vf lo, vf hi) {
  Halves const v = split(x), l = split(lo), h = split(hi);
  auto const out = [](__m256 v, __m256 l, __m256 h) {
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v, h, _CMP_GT_OQ), _mm256_cmp_ps(v, l, _CMP_NGE_UQ)));
  };
  return (out(v.lo, l.lo, h.lo) | out(v.hi, l.hi, h.hi)) != 0;
}
inline vf vfma(vf a, vf b, vf c) {
  Halves const x = split(a), y = split(b), z = split(c);
  return join(_mm256_fmadd_ps(x.lo, y.lo, z.lo), _mm256_fmadd_ps(x.hi, y.hi, z.hi));
}
inline vf load_bf16(uint16_t const* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vu) << 16);
}
inline vf load_f16(uint16_t const* p) {
  return join(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p))),
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p + 8))));
}
inline void store_f16(uint16_t* p, vf x) {
  Halves const h = split(x);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(h.lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(h.hi, _MM_FROUND_TO_NEAREST_INT));
}
inline vu vmul_even_u32(vu a, vu b) {
  __m256i x[2], y[2], z[2];
  std::memcpy(x, &a, sizeof(a));
  std::memcpy(y, &b, sizeof(b));
  z[0] = _mm256_mul_epu32(x[0], y[0]);
  z[1] = _mm256_mul_epu32(x[1], y[1]);
  vu r;
  std::memcpy(&r, z, sizeof(r));
  return r;
}
inline uint32_t vmovemask(vi m) {
  Halves const h = split((vf)m);
  return uint32_t(_mm256_movemask_ps(h.lo)) | uint32_t(_mm256_movemask_ps(h.hi)) << 8;
}
inline vf vdot_bf16(vf acc, vu a, vu b) {
  vf const a_even = (vf)(a << 16), a_odd = (vf)(a & 0xffff0000u);
  vf const b_even = (vf)(b << 16), b_odd = (vf)(b & 0xffff0000u);
  return vfma(a_even, b_even, vfma(a_odd, b_odd, acc));
}

// The AVX-512-BF16 level's instruction hooks (kernels.h), so that its code paths run here too.
// vrndscaleps: round to nearest even, per 8-lane half.
#define FLASH_EXT_ISA_HAS_SCALEF 1
inline vf vround_even(vf x) {
  Halves const h = split(x);
  return join(_mm256_round_ps(h.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
              _mm256_round_ps(h.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// vscalefps for what vexp2 asks of it: integral n in [-126, 127] (2^n is then a normal float, and the product
// is rounded once, as scalef's); outside that range vexp2 discards the result, and a NaN n comes with a NaN p.
inline vf vscalef(vf p, vf n) { return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23); }
// vcvtne2ps2bf16 + vpermw: each value rounded to nearest even bf16, subnormal inputs as signed zeros (the
// instruction's DAZ), a NaN quieted; the even element in the low half.
inline vu bf16_rne_daz(vf x) {
  vu const bits = (vu)x;
  vu const mag = bits & 0x7fffffffu;
  vu const flushed = (mag < 0x00800000u) ? bits & 0x80000000u : bits;
  vu const rounded = (flushed + 0x7fffu + ((flushed >> 16) & 1u)) >> 16;
  return (mag > 0x7f800000u) ? (bits >> 16) | 0x40u : rounded;
}
#define FLASH_EXT_ISA_HAS_BF16_PAIRS 1
inline vu vbf16_pairs(vf even, vf odd) { return bf16_rne_daz(even) | (bf16_rne_daz(odd) << 16); }
// vpunpcklwd / vpunpckhwd per 128-bit lane, and the vpermt2ps pair that puts the columns back in order
// (isa/avx512_bf16.h): the same column order, so that the permuted path runs here too.
#define FLASH_EXT_ISA_HAS_PAIR_ROWS 1
inline void bf16_row_pairs2(uint16_t const* even, uint16_t const* odd, vu& p0, vu& p1) {
  uint32_t w0[16], w1[16];
  for (int lane = 0; lane < 4; ++lane) {
    for (int i = 0; i < 4; ++i) {
      int const c0 = 8 * lane + i, c1 = c0 + 4;
      w0[4 * lane + i] = uint32_t(even[c0]) | uint32_t(odd ? odd[c0] : 0) << 16;
      w1[4 * lane + i] = uint32_t(even[c1]) | uint32_t(odd ? odd[c1] : 0) << 16;
    }
  }
  std::memcpy(&p0, w0, sizeof(p0));
  std::memcpy(&p1, w1, sizeof(p1));
}
inline void unpermute_pairs2(vf& a, vf& b) {
  float x[16], y[16], lo[16], hi[16];
  std::memcpy(x, &a, sizeof(x));
  std::memcpy(y, &b, sizeof(y));
  for (int c = 0; c < 32; ++c) {  // column c: 128-bit lane c / 8 of p0 (c % 8 < 4) or of p1
    int const lane = c / 8, i = c % 8;
    float const v = i < 4 ? x[4 * lane + i] : y[4 * lane + i - 4];
    (c < 16 ? lo : hi)[c % 16] = v;
  }
  std::memcpy(&a, lo, sizeof(a));
  std::memcpy(&b, hi, sizeof(b));
}

#if FLASH_EXT_EMULATE_TILES
// The AMX level's tile hooks, as the instructions define them: eight 16 x 64-byte tiles per thread;
// tdpbf16ps per element in the SDM's order (each pair's even product, then its odd one, added to the fp32
// accumulator and rounded to nearest even), bf16 inputs that are subnormal count as zero, and so do
// subnormal results.  A load or store before tiles_begin (an unconfigured tile) aborts, as the instruction
// faults.
#define FLASH_EXT_ISA_HAS_TILES 1
struct EmulatedTiles {
  alignas(64) unsigned char t[8][16][64];
  bool configured = false;
};
thread_local EmulatedTiles t_tiles;
inline void tiles_begin() {
  std::memset(t_tiles.t, 0, sizeof(t_tiles.t));  // ldtilecfg zeroes the tiles
  t_tiles.configured = true;
}
inline void tiles_end() { t_tiles.configured = false; }
inline void tile_load(int t, void const* p, int64_t stride) {
  if (!t_tiles.configured) { __builtin_trap(); }
  for (int r = 0; r < 16; ++r) { std::memcpy(t_tiles.t[t][r], static_cast<char const*>(p) + r * stride, 64); }
}
inline void tile_store(int t, void* p, int64_t stride) {
  if (!t_tiles.configured) { __builtin_trap(); }
  for (int r = 0; r < 16; ++r) { std::memcpy(static_cast<char*>(p) + r * stride, t_tiles.t[t][r], 64); }
}
inline float bf16_daz(uint16_t h) {
  uint32_t const bits = (h & 0x7f80u) == 0 ? uint32_t(h & 0x8000u) << 16 : uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float ftz(float x) { return std::fabs(x) < 1.17549435e-38f ? std::copysign(0.f, x) : x; }
inline void tile_dot(int c, int a, int b) {
  if (!t_tiles.configured) { __builtin_trap(); }
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) {
      float acc;
      std::memcpy(&acc, &t_tiles.t[c][i][4 * j], sizeof(acc));
      for (int q = 0; q < 16; ++q) {
        uint16_t x[2], y[2];
        std::memcpy(x, &t_tiles.t[a][i][4 * q], sizeof(x));
        std::memcpy(y, &t_tiles.t[b][q][4 * j], sizeof(y));
        acc = ftz(acc + bf16_daz(x[0]) * bf16_daz(y[0]));
        acc = ftz(acc + bf16_daz(x[1]) * bf16_daz(y[1]));
      }
      std::memcpy(&t_tiles.t[c][i][4 * j], &acc, sizeof(acc));
    }
  }
}
#define FLASH_EXT_TILE_LOAD(t, p, stride) tile_load(t, p, stride)
#define FLASH_EXT_TILE_STORE(t, p, stride) tile_store(t, p, stride)
inline void tile_zero(int t) {
  if (!t_tiles.configured) { __builtin_trap(); }
  std::memset(t_tiles.t[t], 0, sizeof(t_tiles.t[t]));
}
#define FLASH_EXT_TILE_ZERO(t) tile_zero(t)
#define FLASH_EXT_TILE_DOT(c, a, b) tile_dot(c, a, b)
#endif

}  // namespace
}  // namespace flash_ext

#if FLASH_EXT_EMULATE_NO_BF16_DOT
#define FLASH_EXT_ISA_BF16_DOT 0
#else
#define FLASH_EXT_ISA_BF16_DOT 1
#endif
#include "isa/kernels.h"

namespace flash_ext {
#if FLASH_EXT_EMULATE_TILES
HostKernels const* host_kernels_amx_emulated() { return &kKernels; }
#elif FLASH_EXT_EMULATE_NO_BF16_DOT
HostKernels const* host_kernels_avx512_plain_emulated() { return &kKernels; }
#else
HostKernels const* host_kernels_avx512_emulated() { return &kKernels; }
#endif
}  // namespace flash_ext
#endif  // __x86_64__
