// Host micro-kernels for AVX2 + FMA + F16C: 8 fp32 lanes, 16 ymm registers (12 accumulators per block).
#if defined(__x86_64__)
#define FLASH_EXT_ISA_TARGET "avx2,fma,f16c"
#include "isa/target_begin.h"

#include <immintrin.h>

#include <cstdint>

#include "flash_ext/host_isa.h"

namespace flash_ext {
namespace {

constexpr HostIsa kIsa = HostIsa::kAvx2;
constexpr char const* kName = "avx2";
constexpr int kLanes = 8;
constexpr int kAccRegs = 12;
constexpr int kMaxRowVectors = 2;  // 2 x 6 blocks: 12 accumulators, 2 A vectors, 1 broadcast
// In place: packing A measured 3-5% slower at this level (the same Xeon, FLASH_EXT_CPU_ISA=avx2; docs/perf.md).
constexpr bool kPackColumnMajorA = false;
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));

inline __attribute__((always_inline)) vf vsplat(float x) { return _mm256_set1_ps(x); }
inline __attribute__((always_inline)) bool any_greater(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
inline __attribute__((always_inline)) bool any_outside(vf x, vf lo, vf hi) {
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x, hi, _CMP_GT_OQ), _mm256_cmp_ps(x, lo, _CMP_NGE_UQ))) != 0;
}
inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline __attribute__((always_inline)) vu vmul_even_u32(vu a, vu b) { return (vu)_mm256_mul_epu32((__m256i)a, (__m256i)b); }
inline __attribute__((always_inline)) uint32_t vmovemask(vi m) { return uint32_t(_mm256_movemask_ps((__m256)m)); }
inline __attribute__((always_inline)) vf load_bf16(uint16_t const* p) {
  __m256i const x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  return (vf)_mm256_slli_epi32(x, 16);
}
inline __attribute__((always_inline)) vf load_f16(uint16_t const* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
}
// maxps: kernels.h's vmax rule (a NaN in b comes out) in one instruction.
#define FLASH_EXT_ISA_HAS_VMAX 1
inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
// Lane i: the sum of v[i]'s 8 lanes, in sum_lanes's order (lane e + lane e + 4, then + 2, + 1: the same
// bits); the last step leaves lane 4L + t holding input slot L + 2t, read so that it is v[4L + t].
#define FLASH_EXT_ISA_HAS_SUM_EACH 1
inline __attribute__((always_inline)) vf vsum_each(vf const* v) {
  auto slot = [v](int s) { return (__m256)v[4 * (s % 2) + s / 2]; };
  __m256 h[4], t[2];
  for (int i = 0; i < 4; ++i) {  // 128-bit lane 0: slot 2i's 4 partial sums, lane 1: slot 2i + 1's
    __m256 const x = slot(2 * i), y = slot(2 * i + 1);
    h[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lane L: slot 4i + L's 2 partial sums in elements 0 and 2, 4i + 2 + L's in 1, 3
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(h[2 * i], h[2 * i + 1]), _mm256_unpackhi_ps(h[2 * i], h[2 * i + 1]));
  }
  return (vf)_mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
}
#define FLASH_EXT_ISA_HAS_TRANSPOSE 1
// out[j] lane i = in[i] lane j: 32-bit interleaves, then 64-bit shuffles (columns j and j + 4 of four rows),
// then the 128-bit halves of rows 0-3 and 4-7 exchanged.
inline __attribute__((always_inline)) void vtranspose(vu const* in, vu* out) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps((__m256)in[2 * i], (__m256)in[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps((__m256)in[2 * i], (__m256)in[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // u[4 h + c], 128-bit half H: column c + 4 H of rows 4 h .. 4 h + 3
    u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h + 0], t[4 * h + 2], 0x44);
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h + 0], t[4 * h + 2], 0xee);
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xee);
  }
  for (int c = 0; c < 4; ++c) {
    out[c] = (vu)_mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    out[4 + c] = (vu)_mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}
inline __attribute__((always_inline)) void store_f16(uint16_t* p, vf x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

}  // namespace
}  // namespace flash_ext

#define FLASH_EXT_ISA_BF16_DOT 0
#include "isa/kernels.h"

namespace flash_ext {
HostKernels const* host_kernels_avx2() { return &kKernels; }
}  // namespace flash_ext
#endif  // __x86_64__
