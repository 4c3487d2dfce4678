// The 16-lane AVX-512 definitions that kernels.h needs (its list of what a level defines), shared by the
// two AVX-512 levels (csrc/host/isa_avx512.cpp, isa_avx512_bf16.cpp).  Included by those units only, after
// isa/target_begin.h has enabled AVX-512 and after they define kIsa and kName; everything here has internal
// linkage, so each level keeps its own copy (host_isa.h says why that matters).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace flash_ext {
namespace {

constexpr int kLanes = 16;
constexpr int kAccRegs = 24;
constexpr int kMaxRowVectors = 2;  // 2 x 12 blocks: 24 accumulators, 2 A vectors, 1 broadcast
// Measured on an Intel Xeon (48 KiB L1, 12 ways): a bf16 prefill at head dim 128 5% faster (docs/perf.md).
constexpr bool kPackColumnMajorA = true;
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

inline __attribute__((always_inline)) vf vsplat(float x) { return _mm512_set1_ps(x); }
inline __attribute__((always_inline)) bool any_greater(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }
inline __attribute__((always_inline)) bool any_outside(vf x, vf lo, vf hi) {
  return (_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ) | _mm512_cmp_ps_mask(x, lo, _CMP_NGE_UQ)) != 0;
}
inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
// The maskz forms here and below: GCC 12's unmasked ones warn (-Wmaybe-uninitialized) inside their own headers.
inline __attribute__((always_inline)) vu vmul_even_u32(vu a, vu b) {
  return (vu)_mm512_maskz_mul_epu32(__mmask8(0xff), (__m512i)a, (__m512i)b);
}
inline __attribute__((always_inline)) uint32_t vmovemask(vi m) { return uint32_t(_mm512_movepi32_mask((__m512i)m)); }
inline __attribute__((always_inline)) vf load_bf16(uint16_t const* p) {
  __m512i const x = _mm512_maskz_cvtepu16_epi32(__mmask16(0xffff), _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
  return (vf)((vu)x << 16);
}
inline __attribute__((always_inline)) vf load_f16(uint16_t const* p) {
  return _mm512_maskz_cvtph_ps(__mmask16(0xffff), _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
}
// maxps: kernels.h's vmax rule (a NaN in b comes out) in one instruction.
#define FLASH_EXT_ISA_HAS_VMAX 1
inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return _mm512_maskz_max_ps(__mmask16(0xffff), a, b); }
// Lane i: the sum of v[i]'s 16 lanes, in sum_lanes's order (lane e + lane e + 8, then + 4, + 2, + 1, so the
// result is the same bits): 45 shuffles and adds for 16 sums instead of 16 trips through memory.  The last
// step leaves lane 4j + t holding input slot j + 4t; the slots are read in the order that makes it v[4j + t].
#define FLASH_EXT_ISA_HAS_SUM_EACH 1
inline __attribute__((always_inline)) vf vsum_each(vf const* v) {
  auto slot = [v](int s) { return (__m512)v[4 * (s % 4) + s / 4]; };
  __mmask16 const all = 0xffff;
  __m512 h[8], q[4], t[2];
  for (int i = 0; i < 8; ++i) {  // 128-bit lanes 0-1: slot 2i's 8 partial sums, lanes 2-3: slot 2i + 1's
    __m512 const x = slot(2 * i), y = slot(2 * i + 1);
    h[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(all, x, y, 0x44), _mm512_maskz_shuffle_f32x4(all, x, y, 0xee));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane j: slot 4i + j's 4 partial sums
    q[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(all, h[2 * i], h[2 * i + 1], 0x88),
                         _mm512_maskz_shuffle_f32x4(all, h[2 * i], h[2 * i + 1], 0xdd));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lane j: slot 8i + j's 2 partial sums in elements 0 and 2, 8i + 4 + j's in 1, 3
    t[i] = _mm512_add_ps(_mm512_maskz_unpacklo_ps(all, q[2 * i], q[2 * i + 1]),
                         _mm512_maskz_unpackhi_ps(all, q[2 * i], q[2 * i + 1]));
  }
  return (vf)_mm512_add_ps(_mm512_maskz_shuffle_ps(all, t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_maskz_shuffle_ps(all, t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
}
#define FLASH_EXT_ISA_HAS_SCALEF 1
inline __attribute__((always_inline)) vf vround_even(vf x) {
  return _mm512_maskz_roundscale_ps(__mmask16(0xffff), x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline __attribute__((always_inline)) vf vscalef(vf p, vf n) { return _mm512_maskz_scalef_ps(__mmask16(0xffff), p, n); }
#define FLASH_EXT_ISA_HAS_TRANSPOSE 1
// out[j] lane i = in[i] lane j: 32-bit interleaves, then 64-bit ones, then two rounds of 128-bit lane shuffles
// (the maskz forms, as throughout this file).
inline __attribute__((always_inline)) void vtranspose(vu const* in, vu* out) {
  __mmask16 const all = 0xffff;
  __mmask8 const all8 = 0xff;
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) { r[i] = (__m512i)in[i]; }
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_maskz_unpacklo_epi32(all, r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_maskz_unpackhi_epi32(all, r[2 * i], r[2 * i + 1]);
  }
  // r[4 i + e], 128-bit lane L: element 4 L + e of rows 4 i .. 4 i + 3.
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_maskz_unpacklo_epi64(all8, t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_maskz_unpackhi_epi64(all8, t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_maskz_unpacklo_epi64(all8, t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_maskz_unpackhi_epi64(all8, t[4 * i + 1], t[4 * i + 3]);
  }
  // Output row 4 L + e: lane L of r[e], r[4 + e], r[8 + e], r[12 + e] (a 4 x 4 transpose of 128-bit lanes).
  for (int e = 0; e < 4; ++e) {
    __m512i const u0 = _mm512_maskz_shuffle_i32x4(all, r[e], r[4 + e], 0x44);
    __m512i const u1 = _mm512_maskz_shuffle_i32x4(all, r[e], r[4 + e], 0xee);
    __m512i const u2 = _mm512_maskz_shuffle_i32x4(all, r[8 + e], r[12 + e], 0x44);
    __m512i const u3 = _mm512_maskz_shuffle_i32x4(all, r[8 + e], r[12 + e], 0xee);
    out[e] = (vu)_mm512_maskz_shuffle_i32x4(all, u0, u2, 0x88);
    out[4 + e] = (vu)_mm512_maskz_shuffle_i32x4(all, u0, u2, 0xdd);
    out[8 + e] = (vu)_mm512_maskz_shuffle_i32x4(all, u1, u3, 0x88);
    out[12 + e] = (vu)_mm512_maskz_shuffle_i32x4(all, u1, u3, 0xdd);
  }
}
inline __attribute__((always_inline)) void store_f16(uint16_t* p, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtps_ph(__mmask16(0xffff), x, _MM_FROUND_TO_NEAREST_INT));
}

}  // namespace
}  // namespace flash_ext
