// Host traits: the degenerate, single-thread instance of the same kernel body.  One "thread" owns the
// whole tile; copies are plain loads/stores; cp.async fences and barriers have nothing to order; a row
// reduction needs no partner.  The only piece with real work is the MMA atom below, a register-blocked
// 4x16x16 tile the compiler vectorises along N, standing in for mma.sync.
#pragma once

#include <cmath>
#include <cstring>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_types.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "philox.h"

namespace flash_ext {

// Widening load of one input element to fp32.  bf16 is the top half of an fp32; fp16 goes through the
// compiler's _Float16 (vcvtph2ps with F16C), so neither costs a library call in the inner loop.
template <class T>
inline float host_to_float(T x) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    uint32_t bits = uint32_t(x.raw()) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else if constexpr (std::is_same_v<T, cutlass::half_t>) {
    uint16_t raw = x.raw();
    _Float16 h;
    std::memcpy(&h, &raw, sizeof(h));
    return float(h);
  } else {
    return float(x);
  }
}

// exp2 for the softmax, written so the compiler vectorises the loop that calls it (libm's exp2f is an
// opaque call).  Range reduction x = n + f, f in [-0.5, 0.5], then a degree-6 polynomial for 2^f:
// relative error ~2e-7, below bf16/fp16 output rounding and the fp32 accumulation error of P.V.
// Inputs below -126 (including -inf from masking) give exactly 0, as masked probabilities must.
inline float host_exp2(float x) {
  float const xc = x > 127.f ? 127.f : (x < -126.f ? -126.f : x);
  float const n = __builtin_roundevenf(xc);
  float const f = xc - n;
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6184665e-3f;
  p = p * f + 5.5503385e-2f;
  p = p * f + 2.4022650e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += int32_t(n) << 23;
  float r;
  std::memcpy(&r, &bits, sizeof(r));
  return x < -126.f ? 0.f : r;
}

// 16 fp32 lanes: one zmm with AVX-512, two ymm with AVX2; the compiler lowers it to what -march allows.
typedef float v16f __attribute__((vector_size(64)));

template <class T>
inline v16f load16_as_float(T const* p) {
  v16f out;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&out, p, sizeof(out));
  } else if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    typedef uint16_t v16u16 __attribute__((vector_size(32)));
    typedef uint32_t v16u32 __attribute__((vector_size(64)));
    v16u16 raw;
    std::memcpy(&raw, p, sizeof(raw));
    v16u32 const bits = __builtin_convertvector(raw, v16u32) << 16;
    std::memcpy(&out, &bits, sizeof(out));
  } else {
    static_assert(std::is_same_v<T, cutlass::half_t>);
    typedef _Float16 v16h __attribute__((vector_size(32)));
    v16h raw;
    std::memcpy(&raw, p, sizeof(raw));
    out = __builtin_convertvector(raw, v16f);
  }
  return out;
}

// D(8x16) = A(8x16) . B(16x16)^T + C, fp32 accumulation.  Value orders are chosen so that the accumulator
// keeps the (columns, rows) value-mode convention of the SM80 atom, and so that P (the accumulator of
// Q.K^T) *is* an A fragment of P.V with no shuffling: the atom's K equals its N.
template <class T>
struct HostMma8x16x16 {
  static constexpr int kM = 8, kN = 16, kK = 16;
  using DRegisters = float[kM * kN];
  using ARegisters = T[kM * kK];
  using BRegisters = T[kN * kK];
  using CRegisters = float[kM * kN];
};

}  // namespace flash_ext

namespace cute {

template <class T>
struct MMA_Traits<flash_ext::HostMma8x16x16<T>> {
  using ValTypeD = float;
  using ValTypeA = T;
  using ValTypeB = T;
  using ValTypeC = float;
  using Shape_MNK = Shape<_8, _16, _16>;
  using ThrID = Layout<_1>;
  using ALayout = Layout<Shape<_1, Shape<_16, _8>>, Stride<_0, Stride<_8, _1>>>;    // (thr,(k,m)) -> m + 8k
  using BLayout = Layout<Shape<_1, Shape<_16, _16>>, Stride<_0, Stride<_1, _16>>>;  // (thr,(n,k)) -> n + 16k
  using CLayout = Layout<Shape<_1, Shape<_16, _8>>, Stride<_0, Stride<_8, _1>>>;    // (thr,(n,m)) -> m + 8n
};

// Found by argument-dependent lookup from MMA_Atom::call; more specialised than cute's generic unpack,
// which would pass 640 scalars one by one.  A may hold fp32 (P in the P.V step) as well as T.
template <class T, class TD, class DLayout, class TA, class ALayout, class TB, class BLayout, class TC,
          class CLayout>
inline void mma_unpack(MMA_Traits<flash_ext::HostMma8x16x16<T>> const&, Tensor<TD, DLayout>& D,
                       Tensor<TA, ALayout> const& A, Tensor<TB, BLayout> const& B,
                       Tensor<TC, CLayout> const& C) {
  using Op = flash_ext::HostMma8x16x16<T>;
  using flash_ext::v16f;
  // Each operand slice is one contiguous register array in the value order declared in MMA_Traits.
  static_assert(std::is_same_v<decltype(coalesce(D.layout())), Layout<Int<Op::kM * Op::kN>, _1>>);
  static_assert(std::is_same_v<decltype(coalesce(C.layout())), Layout<Int<Op::kM * Op::kN>, _1>>);
  static_assert(std::is_same_v<decltype(coalesce(A.layout())), Layout<Int<Op::kM * Op::kK>, _1>>);
  static_assert(std::is_same_v<decltype(coalesce(B.layout())), Layout<Int<Op::kN * Op::kK>, _1>>);
  auto const* a = &A(0);
  auto const* b = &B(0);
  float const* c = &C(0);
  float* d = &D(0);

  v16f bk[Op::kK];  // row k of B^T: 16 columns n
  for (int k = 0; k < Op::kK; ++k) { bk[k] = flash_ext::load16_as_float(b + Op::kN * k); }
  alignas(64) float af[Op::kM * Op::kK];  // widened once, then broadcast from L1 into the FMAs
  for (int i = 0; i < Op::kM * Op::kK; i += 16) {
    v16f const x = flash_ext::load16_as_float(a + i);
    std::memcpy(af + i, &x, sizeof(x));
  }
  v16f acc[Op::kM];  // row m of D: 16 columns n
  for (int m = 0; m < Op::kM; ++m) { std::memcpy(&acc[m], c + Op::kN * m, sizeof(v16f)); }
  for (int k = 0; k < Op::kK; ++k) {
    for (int m = 0; m < Op::kM; ++m) { acc[m] += af[k + Op::kK * m] * bk[k]; }
  }
  for (int m = 0; m < Op::kM; ++m) { std::memcpy(d + Op::kN * m, &acc[m], sizeof(v16f)); }
}

}  // namespace cute

namespace flash_ext {

// Philox words for dropout on the host (philox.h, dropout.h): four groups per evaluation, each counter word
// in the low half of a 64-bit lane (upper halves are don't-care), so that every 32x32->64 product of a round
// is one even-lane multiply (pmuludq) with no lane shuffles.  (A compiler that sees a 64-bit vector multiply
// emits three multiplies; on uint32 lanes it shuffles to widen: both measured ~2x slower than scalar code.)
struct HostPhiloxWord {
  typedef uint64_t v4u64 __attribute__((vector_size(32)));
  v4u64 v;
};
inline HostPhiloxWord operator^(HostPhiloxWord a, HostPhiloxWord b) { return {a.v ^ b.v}; }
inline HostPhiloxWord operator+(HostPhiloxWord a, uint32_t b) { return {a.v + uint64_t(b)}; }
inline HostPhiloxWord philox_mul_hi_lo(uint32_t m, HostPhiloxWord x, HostPhiloxWord& hi) {
  HostPhiloxWord p;
#if defined(__AVX2__)
  p.v = (HostPhiloxWord::v4u64)_mm256_mul_epu32((__m256i)x.v, _mm256_set1_epi64x(m));
#elif defined(__SSE2__)
  typedef uint64_t v2u64 __attribute__((vector_size(16)));
  __m128i const mm = _mm_set1_epi64x(m);
  v2u64 const lo = (v2u64)_mm_mul_epu32((__m128i)v2u64{x.v[0], x.v[1]}, mm);
  v2u64 const hi2 = (v2u64)_mm_mul_epu32((__m128i)v2u64{x.v[2], x.v[3]}, mm);
  p.v = HostPhiloxWord::v4u64{lo[0], lo[1], hi2[0], hi2[1]};
#else
  p.v = (x.v & 0xffffffffu) * uint64_t(m);
#endif
  hi.v = p.v >> 32;
  return p;
}

template <>
struct PhiloxLanes<HostPhiloxWord> {
  static constexpr int kLanes = 4;
  static HostPhiloxWord broadcast(uint32_t x) { return {HostPhiloxWord::v4u64{x, x, x, x}}; }
  static void set(HostPhiloxWord& w, int lane, uint32_t x) { w.v[lane] = x; }
  static uint32_t get(HostPhiloxWord w, int lane) { return uint32_t(w.v[lane]); }
};

template <int kHeadDim_, int kBlockM_, int kBlockN_, class Element_>
struct HostTraits {
  using Element = Element_;
  using ElementAccum = float;
  // P stays fp32: the host MMA widens its operands anyway, so rounding P to 16 bits would only cost time
  // (and a little accuracy).
  using ElementP = float;
  static constexpr bool kIsHost = true;
  // A single thread has room for the whole Q tile: load it once, not once per K tile.
  static constexpr bool kQInRegs = true;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = 1;
  static constexpr int kNThreads = 1;
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0 && kBlockM % 8 == 0);

  using TiledMma = cute::TiledMMA<cute::MMA_Atom<HostMma8x16x16<Element>>, cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>>;

  // Row-major tiles: a single reader needs no swizzle.
  using SmemLayoutQ = cute::Layout<cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>,
                                   cute::Stride<cute::Int<kHeadDim>, cute::_1>>;
  using SmemLayoutKV = cute::Layout<cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>,
                                    cute::Stride<cute::Int<kHeadDim>, cute::_1>>;
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = SmemLayoutVt;
  using SmemLayoutO = SmemLayoutQ;

  using SmemCopyAtom = cute::Copy_Atom<cute::UniversalCopy<Element>, Element>;
  using SmemCopyAtomTransposed = SmemCopyAtom;
  using SmemCopyAtomO = SmemCopyAtom;

  // Element-wise copies: no alignment is assumed of the caller's tensors on the CPU.
  using GmemLayoutAtom = cute::Layout<cute::Shape<cute::_1, cute::_1>>;
  using GmemValLayout = cute::Layout<cute::Shape<cute::_1, cute::_8>>;
  using GmemTiledCopyQKV = decltype(cute::make_tiled_copy(cute::Copy_Atom<cute::UniversalCopy<Element>, Element>{},
                                                          GmemLayoutAtom{}, GmemValLayout{}));
  using GmemTiledCopyO = GmemTiledCopyQKV;

  static constexpr int kSmemQBytes = int(cute::cosize_v<SmemLayoutQ>) * int(sizeof(Element));
  static constexpr int kSmemKVBytes = int(cute::cosize_v<SmemLayoutKV>) * int(sizeof(Element));
  static constexpr int kSmemBytes = kSmemQBytes + 2 * kSmemKVBytes;

  static constexpr int kAccValCols = 16;

  // The atom's K equals its N, so the accumulator of S already is the A fragment of P.V.
  template <class Layout>
  static constexpr auto acc_to_a_layout(Layout acc) { return acc; }

  // Dropout groups (dropout.h) of the ((16 cols, 8 rows), MMA_M, MMA_N) accumulator: rows {R, R + 8} lie in
  // neighbouring MMA_M atoms (2a, 2a + 1), columns {c, c + 1, c + 8, c + 9} in one atom's 16 columns.  As
  // (SLOT = (col bit, row half, col half), GROUP = ((cols % 8) / 2, row within the atom, atom pair, MMA_N)).
  using DropoutWord = HostPhiloxWord;
  template <class AccLayout>
  static constexpr auto dropout_groups(AccLayout acc) {
    using namespace cute;
    constexpr int kMmaM = decltype(size<1>(acc))::value;
    constexpr int kMmaN = decltype(size<2>(acc))::value;
    static_assert(decltype(size<0>(acc))::value == 128 && kMmaM % 2 == 0);
    // (slot, group) -> index of the fragment's (compact, column-major) domain: n + 16 m + 128 mma_m + ...
    auto const g = cute::Layout<Shape<Shape<_2, _2, _2>, Shape<_4, _8, Int<kMmaM / 2>, Int<kMmaN>>>,
                          Stride<Stride<_1, _128, _8>, Stride<_2, _16, _256, Int<128 * kMmaM>>>>{};
    return composition(acc, g);
  }

  static void cp_async_fence() {}
  template <int N>
  static void cp_async_wait() {}
  static void barrier() {}
  static float exp2(float x) { return host_exp2(x); }
  static float tanh(float x) { return std::tanh(x); }
  // The host compiler vectorises this loop itself (bf16: the round-to-nearest-even of cutlass's cast).
  template <class To, int N>
  static cutlass::Array<To, N> convert(cutlass::Array<float, N> const& in) {
    cutlass::Array<To, N> out;
    for (int i = 0; i < N; ++i) { out[i] = static_cast<To>(in[i]); }
    return out;
  }
  template <class Tensor>
  static void clear_smem(Tensor&& t) { cute::clear(t); }
  template <class Op>
  static float row_allreduce(float x, Op) { return x; }
};

}  // namespace flash_ext
