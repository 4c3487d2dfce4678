// Host micro-kernels for the compiler's baseline target (x86-64: SSE2; aarch64: NEON; any other: what GCC's
// vector extensions lower to): 4 fp32 lanes.  The fallback of every CPU, and the only level off x86-64.
#include <cstdint>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "flash_ext/host_isa.h"

namespace flash_ext {
namespace {

constexpr HostIsa kIsa = HostIsa::kGeneric;
constexpr char const* kName = "generic";
constexpr int kLanes = 4;
constexpr int kAccRegs = 12;       // of 16 xmm (x86-64); aarch64 has 32 registers but the same blocks do
constexpr int kMaxRowVectors = 2;  // 2 x 6 blocks
constexpr bool kPackColumnMajorA = false;  // A read in place (packing not measured at this level)
typedef float vf __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(8)));

inline __attribute__((always_inline)) vf vsplat(float x) { return vf{x, x, x, x}; }
inline __attribute__((always_inline)) bool any_greater(vf a, vf b) { return a[0] > b[0] || a[1] > b[1] || a[2] > b[2] || a[3] > b[3]; }
inline __attribute__((always_inline)) bool any_outside(vf x, vf lo, vf hi) {
  bool out = false;
  for (int i = 0; i < 4; ++i) { out |= !(x[i] >= lo[i] && x[i] <= hi[i]); }  // NaN fails both comparisons
  return out;
}
inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) { return a * b + c; }

// fp16 <-> fp32 without F16C: exact widening; narrowing rounds to nearest even (subnormals through an
// fp32 addition that rounds the way the hardware does), NaN -> 0x7fff as cutlass's software conversion.
inline float f16_to_f32(uint16_t h) {
  uint32_t const sign = uint32_t(h & 0x8000u) << 16;
  uint32_t const exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    float const mag = float(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    std::memcpy(&bits, &mag, sizeof(bits));
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t f32_to_f16(float x) {
  uint32_t f;
  std::memcpy(&f, &x, sizeof(f));
  uint32_t const sign = f & 0x80000000u;
  f ^= sign;
  uint32_t o;
  if (f >= (143u << 23)) {  // >= 65536 (rounds to inf), inf, NaN
    o = f > 0x7f800000u ? 0x7fffu : 0x7c00u;
  } else if (f < (113u << 23)) {  // fp16 subnormal or zero: let an fp32 addition do the rounding
    uint32_t const magic_bits = 126u << 23;  // 0.5: its ulp is 2^-24, the fp16 subnormal step
    float magic, v;
    std::memcpy(&magic, &magic_bits, sizeof(magic));
    std::memcpy(&v, &f, sizeof(v));
    float const sum = v + magic;
    uint32_t sum_bits;
    std::memcpy(&sum_bits, &sum, sizeof(sum_bits));
    o = sum_bits - magic_bits;
  } else {
    uint32_t const mant_odd = (f >> 13) & 1u;
    f += (uint32_t(15 - 127) << 23) + 0xfffu + mant_odd;
    o = f >> 13;
  }
  return uint16_t(o | (sign >> 16));
}

inline vf load_bf16(uint16_t const* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vu) << 16);
}
inline vf load_f16(uint16_t const* p) {
  alignas(16) float out[kLanes];
  for (int i = 0; i < kLanes; ++i) { out[i] = f16_to_f32(p[i]); }
  vf v;
  std::memcpy(&v, out, sizeof(v));
  return v;
}
inline void store_f16(uint16_t* p, vf x) {
  alignas(16) float in[kLanes];
  std::memcpy(in, &x, sizeof(x));
  for (int i = 0; i < kLanes; ++i) { p[i] = f32_to_f16(in[i]); }
}

// Philox's widening multiply and the keep bits' lane mask: SSE2's pmuludq and movmskps where the baseline
// has them (every x86-64), else lane by lane.
inline vu vmul_even_u32(vu a, vu b) {
#if defined(__SSE2__)
  return (vu)_mm_mul_epu32((__m128i)a, (__m128i)b);
#else
  typedef uint64_t v64 __attribute__((vector_size(16)));
  return (vu)(((v64)a & 0xffffffffu) * ((v64)b & 0xffffffffu));
#endif
}
inline uint32_t vmovemask(vi m) {
#if defined(__SSE2__)
  return uint32_t(_mm_movemask_ps((__m128)m));
#else
  return uint32_t(m[0] & 1) | uint32_t(m[1] & 1) << 1 | uint32_t(m[2] & 1) << 2 | uint32_t(m[3] & 1) << 3;
#endif
}

}  // namespace
}  // namespace flash_ext

#define FLASH_EXT_ISA_BF16_DOT 0
#include "isa/kernels.h"

namespace flash_ext {
HostKernels const* host_kernels_generic() { return &kKernels; }
}  // namespace flash_ext
