// The AVX512_BF16 instructions that kernels.h's bf16 GEMM uses (its list of what a level defines), shared by
// the levels that have them (csrc/host/isa_avx512_bf16.cpp, isa_amx_bf16.cpp).  Included after isa/avx512.h.
#pragma once

#include <immintrin.h>

namespace flash_ext {
namespace {
inline __attribute__((always_inline)) vf vdot_bf16(vf acc, vu a, vu b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
// fp32 -> bf16 pairs by vcvtne2ps2bf16 (round to nearest even) and one word permutation: a third of the
// instructions of the bit arithmetic, for the A operand of every bf16 tile GEMM (P, and Q widened).  As in
// vdpbf16ps, which consumes the pairs, subnormal inputs count as zero; a NaN stays a NaN.
#define FLASH_EXT_ISA_HAS_BF16_PAIRS 1
inline __attribute__((always_inline)) vu vbf16_pairs(vf even, vf odd) {
  // cvtne2ps2bf16(b, a): words 0-15 are a's lanes, 16-31 b's; the permutation interleaves them.
  __m512i const halves = (__m512i)_mm512_cvtne2ps_pbh((__m512)odd, (__m512)even);
  __m512i const interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return (vu)_mm512_permutexvar_epi16(interleave, halves);
}
// Two bf16 rows of 32 columns -> their (even, odd) pairs in two vectors by vpunpcklwd / vpunpckhwd: half the
// instructions of zero-extending, shifting and or-ing each 16 columns, in the unpacks' column order (p0's
// lane 4L + i holds column 8L + i, p1's column 8L + 4 + i, for 128-bit lane L and i < 4).
#define FLASH_EXT_ISA_HAS_PAIR_ROWS 1
inline __attribute__((always_inline)) void bf16_row_pairs2(uint16_t const* even, uint16_t const* odd, vu& p0, vu& p1) {
  __m512i const e = _mm512_loadu_si512(even);
  __m512i const o = odd ? _mm512_loadu_si512(odd) : _mm512_setzero_si512();
  p0 = (vu)_mm512_unpacklo_epi16(e, o);
  p1 = (vu)_mm512_unpackhi_epi16(e, o);
}
// Sums over p0's and p1's columns (a, b) -> columns 0-15 (a) and 16-31 (b) in order.
inline __attribute__((always_inline)) void unpermute_pairs2(vf& a, vf& b) {
  __m512i const lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  __m512i const hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  __m512 const x = (__m512)a, y = (__m512)b;
  a = (vf)_mm512_permutex2var_ps(x, lo, y);
  b = (vf)_mm512_permutex2var_ps(x, hi, y);
}
}  // namespace
}  // namespace flash_ext

#define FLASH_EXT_ISA_BF16_DOT 1
