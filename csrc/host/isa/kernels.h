// The CPU backend's micro-kernels (host_isa.h: HostKernels), written once over a vector type and compiled
// once per instruction-set level.  csrc/host/isa_<level>.cpp enables the level's instructions, then defines
// in flash_ext::(anonymous) before including this file:
//   kIsa, kName          the level
//   kLanes               fp32 lanes of one vector (4, 8 or 16)
//   kAccRegs             vector registers a GEMM block keeps its accumulators in (12 of 16, 24 of 32)
//   kMaxRowVectors       row vectors per GEMM block, at most (the block is kMaxRowVectors x kAccRegs / it)
//   kPackColumnMajorA    whether a GEMM copies an fp32 column-major A (Q's fragment, P) into contiguous
//                        scratch before its column blocks instead of reading it in place (gemm_rows says why)
//   vf, vi, vu, vh       GCC vector types: kLanes x float / int32 / uint32 / uint16
//   vsplat(x)            x in every lane (a broadcast; 0 + x would be an addition, turning -0 into +0)
//   vfma(a, b, c)        a * b + c (one rounding where the level has FMA)
//   any_greater(a, b)    some lane of a > b (ordered: NaN is not greater)
//   any_outside(x, lo, hi)  some lane of x is not in [lo, hi]: x < lo, x > hi or NaN
//   load_bf16            kLanes bf16 values -> fp32 vector (a zero-extension and a shift)
//   load_f16, store_f16  kLanes fp16 values <-> fp32 vector (F16C where the level has it)
//   kBf16Dot             true where the level has vdpbf16ps; then also
//   vdot_bf16(acc, a, b) acc + a.lo * b.lo + a.hi * b.hi per lane, a and b holding bf16 pairs in uint32 lanes
//   FLASH_EXT_ISA_HAS_BF16_PAIRS  optional, 1 where the level rounds fp32 to bf16 by instruction; then also
//   vbf16_pairs(e, o)    lane l: e[l] and o[l] rounded to nearest even bf16, o's in the high half; subnormal
//                        inputs may count as zero, as in vdpbf16ps (else kernels.h's own, by bit arithmetic)
//   vmul_even_u32(a, b)  the 64-bit products of the even uint32 lanes, as (low, high) lane pairs (pmuludq)
//   vmovemask(m)         bit l set iff lane l of the comparison result m is true
//   FLASH_EXT_ISA_HAS_SCALEF  1 where the level has round-to-integer and scale-by-2^n instructions; then also
//   vround_even(x)       x rounded to the nearest integer, ties to even
//   vscalef(p, n)        p * 2^n for integral n (NaN in, NaN out)
//   FLASH_EXT_ISA_HAS_PAIR_ROWS  optional (bf16-dot levels), 1 where the level interleaves bf16 rows by
//                        instruction; then also
//   bf16_row_pairs2(e, o, p0, p1)  the (e, o) bf16 pairs of 2 * kLanes columns (o null: 0) in the level's column
//                        order; unpermute_pairs2(a, b) turns sums over p0's and p1's columns into columns 0..kLanes-1
//                        (a) and kLanes..2 kLanes-1 (b) in order (else kernels.h's own: two bf16_row_pairs, in order)
//   FLASH_EXT_ISA_HAS_SUM_EACH  optional, 1 where the level sums vectors' lanes by shuffles; then also
//   vsum_each(v)         lane i = the sum of v[i]'s lanes for kLanes vectors v[0..kLanes), in sum_lanes's order
//                        (else kernels.h's own, through memory)
//   FLASH_EXT_ISA_HAS_VMAX  optional, 1 where the level has maxps; then also
//   vmax(a, b)           a > b ? a : b lane by lane, as one instruction (GCC compiles the selection as a compare
//                        and a blend: two operations in vexp2, once per score)
//   FLASH_EXT_ISA_HAS_TILES  1 where the level has AMX-BF16 tiles (kLanes 16, bf16 dot products); then also
//   tiles_begin(), tiles_end()   configure tiles 0-7 as 16 rows x 64 bytes / release them
//   FLASH_EXT_TILE_LOAD(t, p, stride), FLASH_EXT_TILE_STORE(t, p, stride)   tile t (a literal) <-> 16 rows
//                        of 64 bytes, stride bytes apart
//   FLASH_EXT_TILE_ZERO(t)       tile t = 0
//   FLASH_EXT_TILE_DOT(c, a, b)  tdpbf16ps: tile c(i, j) += sum over pairs q of a(i, q) . b(q, j), each a
//                        bf16 pair (fp32 accumulation; subnormal inputs and outputs count as zero)
//   FLASH_EXT_ISA_HAS_TRANSPOSE  optional, 1 where the level transposes kLanes x kLanes 32-bit lanes by
//                        shuffles; then also
//   vtranspose(in, out)  out[j] lane i = in[i] lane j, for kLanes vectors (else kernels.h's own, through memory)
// Everything here has internal linkage (anonymous namespace): each level keeps its own copy, and the one
// shared template used (philox.h's rounds) is instantiated only for a type of this namespace (host_isa.h
// says why).  No standard-library function is called either.
//
// Layouts (why the vectors run down the columns): the host tiles are column-major — query rows are the
// contiguous dimension of S, P and O (traits_host.h).  A GEMM block then holds kAccRegs vectors of C, each
// a run of rows of one column; every step over k loads the block's A column vectors once and broadcasts
// one B value per column straight from memory (a broadcast load costs no shuffle), so B needs no packing
// beyond widening to fp32, whatever its strides.  The softmax reduces over columns, i.e. across vectors:
// element-wise max and add, with no horizontal reduction.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "flash_ext/host_isa.h"
#include "flash_ext/philox.h"

namespace flash_ext {
namespace {

#ifndef FLASH_EXT_ISA_HAS_BF16_PAIRS
#define FLASH_EXT_ISA_HAS_BF16_PAIRS 0
#endif
#ifndef FLASH_EXT_ISA_HAS_SCALEF
#define FLASH_EXT_ISA_HAS_SCALEF 0
#endif
#ifndef FLASH_EXT_ISA_HAS_TILES
#define FLASH_EXT_ISA_HAS_TILES 0
#endif
#ifndef FLASH_EXT_ISA_HAS_PAIR_ROWS
#define FLASH_EXT_ISA_HAS_PAIR_ROWS 0
#endif
#ifndef FLASH_EXT_ISA_HAS_SUM_EACH
#define FLASH_EXT_ISA_HAS_SUM_EACH 0
#endif
#ifndef FLASH_EXT_ISA_HAS_TRANSPOSE
#define FLASH_EXT_ISA_HAS_TRANSPOSE 0
#endif
#ifndef FLASH_EXT_ISA_HAS_VMAX
#define FLASH_EXT_ISA_HAS_VMAX 0
#endif

static_assert(kLanes == 4 || kLanes == 8 || kLanes == 16);
static_assert(sizeof(vf) == 4 * kLanes && sizeof(vi) == 4 * kLanes && sizeof(vh) == 2 * kLanes);

#define FLASH_EXT_INLINE inline __attribute__((always_inline))

FLASH_EXT_INLINE vf vload(float const* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
FLASH_EXT_INLINE void vstore(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(v)); }
// maxps's rule, lane by lane: a NaN in b comes out (MaxOp's fmaxf would skip it); either way a NaN never
// moves a softmax reference (the comparison with the slack is false) and exp2 carries it into the sum.
#if !FLASH_EXT_ISA_HAS_VMAX
FLASH_EXT_INLINE vf vmax(vf a, vf b) { return a > b ? a : b; }
#endif


// Round to nearest even; NaN becomes 0x7fff (cutlass::bfloat16_t's rule), infinities stay.  The bf16 bits
// in the low half of each 32-bit lane (the high half 0): the bf16 pairs below are assembled in 32-bit lanes,
// with no narrowing to 16 bits and widening back.
FLASH_EXT_INLINE vu to_bf16_lanes(vf x) {
  vu const bits = (vu)x;
  vu const rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  vi const is_nan = (vi)((bits & 0x7fffffffu) > 0x7f800000u);
  return is_nan ? vu{} + 0x7fffu : rounded;
}
FLASH_EXT_INLINE vh to_bf16_bits(vf x) { return __builtin_convertvector(to_bf16_lanes(x), vh); }

#if !FLASH_EXT_ISA_HAS_TRANSPOSE
FLASH_EXT_INLINE void vtranspose(vu const* in, vu* out) {
  for (int j = 0; j < kLanes; ++j) {
    vu column{};  // built whole, then stored: lane stores into out[j] read it first (GCC: maybe-uninitialized)
    for (int i = 0; i < kLanes; ++i) { column[i] = in[i][j]; }
    out[j] = column;
  }
}
#endif

// kLanes elements of type kB from p + i, as fp32; load_as_f32 is the same with the type known at run time.
template <HostDType kB>
FLASH_EXT_INLINE vf load_b(void const* p, int64_t i) {
  if constexpr (kB == HostDType::kF32) {
    return vload(static_cast<float const*>(p) + i);
  } else if constexpr (kB == HostDType::kBF16) {
    return load_bf16(static_cast<uint16_t const*>(p) + i);
  } else {
    return load_f16(static_cast<uint16_t const*>(p) + i);
  }
}

FLASH_EXT_INLINE vf load_as_f32(void const* p, HostDType t) {
  if (t == HostDType::kF32) { return load_b<HostDType::kF32>(p, 0); }
  if (t == HostDType::kBF16) { return load_b<HostDType::kBF16>(p, 0); }
  return load_b<HostDType::kF16>(p, 0);
}

FLASH_EXT_INLINE float scalar_as_f32(void const* p, int64_t i, HostDType t) {
  if (t == HostDType::kF32) { return static_cast<float const*>(p)[i]; }
  uint16_t const h = static_cast<uint16_t const*>(p)[i];
  alignas(64) uint16_t in[kLanes] = {h};
  alignas(64) float out[kLanes];
  vstore(out, load_as_f32(in, t));
  return out[0];
}

FLASH_EXT_INLINE int64_t elem_bytes(HostDType t) { return t == HostDType::kF32 ? 4 : 2; }
FLASH_EXT_INLINE void const* offset(void const* p, int64_t i, HostDType t) {
  return static_cast<char const*>(p) + i * elem_bytes(t);
}

// ---------------------------------------------------------------------------------------------------------
// exp2, kLanes at a time, for x <= 127 (the softmax only exponentiates differences to a running maximum,
// x <= 0 up to rounding): the scalar host_exp2 of traits_host.h — range reduction x = n + f, n = x rounded to
// nearest even, f in [-0.5, 0.5], and the same degree-6 polynomial for 2^f (relative error ~2e-7).  Below
// -126 (and -inf) gives exactly 0; a NaN x gives a NaN.
FLASH_EXT_INLINE vf exp2_poly(vf f) {
  vf p = vsplat(1.5353362e-4f);
  p = vfma(p, f, vsplat(1.3398874e-3f));
  p = vfma(p, f, vsplat(9.6184665e-3f));
  p = vfma(p, f, vsplat(5.5503385e-2f));
  p = vfma(p, f, vsplat(2.4022650e-1f));
  p = vfma(p, f, vsplat(6.9314718e-1f));
  return vfma(p, f, vsplat(1.0f));
}

// vexp2_in_range is exp2 for x in [-126, 127], not NaN (the softmax step's scores in the steady state: a lane
// outside goes through vexp2); vexp2 adds the lanes below the range (0) and NaN (NaN), and equals it inside.
#if FLASH_EXT_ISA_HAS_SCALEF
// The level rounds and scales by instruction (AVX-512: vrndscaleps, vscalefps): 5 operations fewer than the
// bit arithmetic below, per element of every score tile.  scalef propagates NaN and is exact for n >= -126
// (p * 2^n is then a normal number or, for x in [-126, -125.5), the exact subnormal, where the bit
// arithmetic's exponent field underflows: values below 2^-126 either way).
FLASH_EXT_INLINE vf vexp2_in_range(vf x) {
  vf const n = vround_even(x);
  return vscalef(exp2_poly(x - n), n);
}
FLASH_EXT_INLINE vf vexp2(vf x) {
  vf const r = vexp2_in_range(x);
  return x < -126.f ? vf{} : r;
}
#else
// The rounding is done by adding 1.5 * 2^23, whose sum also holds n in its low mantissa bits, ready to
// shift into the exponent.  The lanes out of range are fixed with masks rather than selects: AVX2's
// vblendvps is 2-3 micro-ops a lane group on current cores, and this runs once per score.
FLASH_EXT_INLINE vf vexp2_in_range(vf x) {
  vf const t = x + 12582912.f;     // 1.5 * 2^23 + round(x): the sum's mantissa ends in n
  vf const f = x - (t - 12582912.f);
  vf const p = exp2_poly(f);
  return (vf)((vi)p + ((vi)t << 23));  // (0x4b400000 + n) << 23 == n << 23 (mod 2^32)
}
FLASH_EXT_INLINE vf vexp2(vf x) {
  vi const in_range = x >= -126.f;  // false below the range, at -inf and for NaN
  vi const nan = x != x;
  // A NaN x gives -126 to vexp2_in_range: the result's NaN comes from `nan`.
  vf const r = vexp2_in_range(vmax(x, vsplat(-126.f)));
  return (vf)(((vi)r & in_range) | nan);  // 0 below the range; all ones (a NaN) for a NaN x
}
#endif

// ---------------------------------------------------------------------------------------------------------
// GEMM (HostGemmArgs).  Scratch is on the stack and bounded: the operands are processed in chunks of
// columns and depth that fit it (the forward's tiles always fit whole).
constexpr int kRowsPerBlock = kMaxRowVectors * kLanes;
constexpr int64_t kBScratch = 144 * 128;  // fp32 elements of widened B (72 KiB: V of 128 keys at d = 128, padded)
constexpr int64_t kAScratch = int64_t(kRowsPerBlock) * 256;  // fp32 elements of one packed A block
// The fp32 GEMM of register blocks (defined last), also the fallback of the tile and few-row paths.
void gemm_blocks(HostGemmArgs const& g);

// How B's elements are laid out, for the broadcasts of a block: along the columns (B(n, k) = V(k, n) of
// P.V: one k step reads NR neighbours), along k (K of Q.K^T: each column a contiguous run), or neither.
enum class BWalk { kColsContiguous, kDepthContiguous, kStrided };

// One register block: C(rows r < RV * kLanes, cols j < NR) += sum_k A(r, k) * B(j, k) with A packed as
// a[k * lda + r] and B fp32 at b[j * b_ns + k * b_ks]; with zero_start, = instead of += (C is not read: the
// accumulators start from zero, not from a cleared C loaded back).  Columns >= ncols are computed on column
// 0's data (kept in bounds) and not stored.
template <int RV, int NR, BWalk kWalk>
FLASH_EXT_INLINE void gemm_block(float* c, int64_t ldc, float const* a, int64_t lda, float const* b, int64_t b_ns,
                                 int64_t b_ks, int depth, int ncols, bool zero_start) {
  vf acc[RV][NR];
  float const* bcol[NR];
#pragma GCC unroll 32
  for (int j = 0; j < NR; ++j) {
    bool const live = j < ncols;
    bcol[j] = b + (live ? j * b_ns : 0);
#pragma GCC unroll 4
    for (int i = 0; i < RV; ++i) { acc[i][j] = live && !zero_start ? vload(c + j * ldc + i * kLanes) : vf{}; }
  }
  for (int k = 0; k < depth; ++k) {
    vf av[RV];
#pragma GCC unroll 4
    for (int i = 0; i < RV; ++i) { av[i] = vload(a + i * kLanes); }
    a += lda;
#pragma GCC unroll 32
    for (int j = 0; j < NR; ++j) {
      float x;
      if constexpr (kWalk == BWalk::kColsContiguous) {
        x = b[k * b_ks + (j < ncols ? j : 0)];
      } else if constexpr (kWalk == BWalk::kDepthContiguous) {
        x = bcol[j][k];
      } else {
        x = bcol[j][k * b_ks];
      }
      vf const bv = vsplat(x);
#pragma GCC unroll 4
      for (int i = 0; i < RV; ++i) { acc[i][j] = vfma(av[i], bv, acc[i][j]); }
    }
  }
#pragma GCC unroll 32
  for (int j = 0; j < NR; ++j) {
    if (j < ncols) {
#pragma GCC unroll 4
      for (int i = 0; i < RV; ++i) { vstore(c + j * ldc + i * kLanes, acc[i][j]); }
    }
  }
}

// The blocks of a run of ncols columns: full NR-column blocks, then one block of exactly the remainder
// (a narrower block, not a full one with idle columns).
template <int RV, int NR, BWalk kWalk>
FLASH_EXT_INLINE void gemm_cols(float* c, int64_t ldc, float const* a, int64_t lda, float const* b, int64_t b_ns,
                                int64_t b_ks, int depth, int ncols, bool zero_start) {
  if constexpr (NR > 0) {
    int j = 0;
    for (; j + NR <= ncols; j += NR) {
      gemm_block<RV, NR, kWalk>(c + j * ldc, ldc, a, lda, b + j * b_ns, b_ns, b_ks, depth, NR, zero_start);
    }
    if (j < ncols) {
      gemm_cols<RV, NR - 1, kWalk>(c + j * ldc, ldc, a, lda, b + j * b_ns, b_ns, b_ks, depth, ncols - j, zero_start);
    }
  }
}

// A(m0 + r, k) for r < RV * kLanes, k < depth, as fp32 at out[k * RV * kLanes + r].
template <int RV>
void pack_a_block(HostGemmArgs const& g, int m0, int k0, int depth, float* out) {
  constexpr int kRows = RV * kLanes;
  for (int k = 0; k < depth; ++k) {
    int64_t const base = int64_t(m0) * g.a_ms + int64_t(k0 + k) * g.a_ks;
    if (g.a_ms == 1) {
#pragma GCC unroll 4
      for (int i = 0; i < RV; ++i) {
        vstore(out + k * kRows + i * kLanes, load_as_f32(offset(g.a, base + i * kLanes, g.a_type), g.a_type));
      }
    } else {
      for (int r = 0; r < kRows; ++r) { out[k * kRows + r] = scalar_as_f32(g.a, base + r * g.a_ms, g.a_type); }
    }
  }
}

// The stride of B's major mode once widened (bf16/fp16) into the scratch: the minor mode's length rounded up
// to 16 floats, plus 16 more where that is an even number of 64-byte lines.  A power-of-two stride puts the
// rows of V that one register block of P.V walks (a k step each, 512 bytes apart at d = 128) into 8 of L1's
// 64 sets, fewer lines than the block reads: they evicted each other on every block.  An odd number of lines
// spreads them over all the sets (the same reason as the host accumulators' padding, gemm.h).
constexpr int64_t widened_stride(int minor) {
  int64_t const ld = (int64_t(minor) + 15) / 16 * 16;
  return ld / 16 % 2 == 0 ? ld + 16 : ld;
}
static_assert(widened_stride(128) == 144 && widened_stride(64) == 80 && widened_stride(6) == 16 &&
              widened_stride(48) == 48);

// B's chunk as the register blocks read it: B(n0 + j, k0 + k) for j < ncols, k < depth as fp32 at
// out[j * ns + k * ks].  Where one of B's modes is contiguous the widened chunk is dense along it, its other
// mode padded (widened_stride); else B's own strides are kept, over the span they cover.
struct WidenedB {
  int64_t ns, ks;
};
FLASH_EXT_INLINE WidenedB widened_strides(HostGemmArgs const& g, int ncols, int depth) {
  if (g.b_ns == 1) { return {1, widened_stride(ncols)}; }
  if (g.b_ks == 1) { return {widened_stride(depth), 1}; }
  return {g.b_ns, g.b_ks};
}
constexpr int64_t widened_span(WidenedB w, int ncols, int depth) {
  return int64_t(ncols - 1) * w.ns + int64_t(depth - 1) * w.ks + 1;
}

// len elements of type t from src, widened, at out.
FLASH_EXT_INLINE void widen_run(void const* src, HostDType t, int64_t len, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) { vstore(out + i, load_as_f32(offset(src, i, t), t)); }
  for (; i < len; ++i) { out[i] = scalar_as_f32(src, i, t); }
}

void widen_b(HostGemmArgs const& g, int n0, int k0, int ncols, int depth, WidenedB w, float* out) {
  void const* src = offset(g.b, int64_t(n0) * g.b_ns + int64_t(k0) * g.b_ks, g.b_type);
  if (w.ns == g.b_ns && w.ks == g.b_ks) {  // B's own strides: one pass over the span
    widen_run(src, g.b_type, widened_span(w, ncols, depth), out);
    return;
  }
  // One contiguous run per major index: n's of a k (b_ns == 1) or k's of an n (b_ks == 1).
  bool const cols_run = g.b_ns == 1;
  int const runs = cols_run ? depth : ncols, len = cols_run ? ncols : depth;
  int64_t const src_ld = cols_run ? g.b_ks : g.b_ns, dst_ld = cols_run ? w.ks : w.ns;
  for (int r = 0; r < runs; ++r) { widen_run(offset(src, r * src_ld, g.b_type), g.b_type, len, out + r * dst_ld); }
}

// Whether an fp32 column-major A read in place would crowd the L1: a row block's A is `rows` floats of
// each of depth columns lda floats apart, and with a column stride that is a multiple of the 64-byte line
// every column's lines fall into the same few sets (the host tiles' 128-row stride, 512 bytes: 16 of the 64
// sets at AVX-512's two lines per column, depth / 8 lines in each).  Counted for the 64 sets that L1s of
// 32 KiB / 8 ways and 48 KiB / 12 ways both have, against the smaller number of ways.
constexpr int kL1Sets = 64;
constexpr int kL1Ways = 8;
constexpr bool a_crowds_l1(int64_t lda, int rows, int depth) {
  int64_t const stride = lda * int64_t(sizeof(float));
  if (stride % 64 != 0) { return false; }  // the columns drift across the sets
  int64_t g = kL1Sets, r = (stride / 64) % kL1Sets;  // gcd(stride in lines, sets): 0 -> every column one set
  while (r != 0) {
    int64_t const t = g % r;
    g = r, r = t;
  }
  int64_t const lines = (int64_t(rows) * int64_t(sizeof(float)) + 63) / 64;  // per column
  int64_t const sets = kL1Sets / g * lines < kL1Sets ? kL1Sets / g * lines : kL1Sets;
  return int64_t(depth) * lines > int64_t(kL1Ways) * sets;
}
static_assert(a_crowds_l1(128, 32, 128) && !a_crowds_l1(128, 32, 64) && !a_crowds_l1(64, 32, 128) &&
              !a_crowds_l1(131, 32, 256) && a_crowds_l1(128, 16, 128));

// One row block of C against ncols columns.  A is read once per column block, so it is packed first
// (a[k * RV * kLanes + r], contiguous) unless it is fp32 and column-major already (Q's fragment, P) and
// reading it in place is the cheaper of the two.  Crowded into a few L1 sets (a_crowds_l1), in place A
// was fetched again from L2 by every column block; where the level packs (kPackColumnMajorA) such an A is
// copied once per row block when more than one column block reads it.  Measurements: docs/perf.md.
template <int RV>
void gemm_rows(HostGemmArgs const& g, int m0, int n0, int k0, int ncols, int depth, float const* b, int64_t b_ns,
               int64_t b_ks, float* abuf, bool zero_start) {
  constexpr int NR = kAccRegs / RV;
  float const* a;
  int64_t lda;
  // In place unless packing pays (an fp32 column-major A whose lines crowd the L1, read by several blocks).
  if (g.a_type == HostDType::kF32 && g.a_ms == 1 &&
      !(kPackColumnMajorA && ncols > NR && a_crowds_l1(g.a_ks, RV * kLanes, depth))) {
    a = static_cast<float const*>(g.a) + m0 + int64_t(k0) * g.a_ks;
    lda = g.a_ks;
  } else {
    pack_a_block<RV>(g, m0, k0, depth, abuf);
    a = abuf;
    lda = RV * kLanes;
  }
  float* c = g.c + m0 + int64_t(n0) * g.ldc;
  if (b_ns == 1) {
    gemm_cols<RV, NR, BWalk::kColsContiguous>(c, g.ldc, a, lda, b, 1, b_ks, depth, ncols, zero_start);
  } else if (b_ks == 1) {
    gemm_cols<RV, NR, BWalk::kDepthContiguous>(c, g.ldc, a, lda, b, b_ns, 1, depth, ncols, zero_start);
  } else {
    gemm_cols<RV, NR, BWalk::kStrided>(c, g.ldc, a, lda, b, b_ns, b_ks, depth, ncols, zero_start);
  }
}

// C(m, n) = 0 for m < rows rounded up to a vector, n < cols: an overwriting GEMM (HostGemmArgs::overwrite)
// on the paths that accumulate.
void zero_c(HostGemmArgs const& g) {
  int const rows = (g.rows + kLanes - 1) / kLanes * kLanes;
  for (int n = 0; n < g.cols; ++n) {
    for (int m = 0; m < rows; m += kLanes) { vstore(g.c + m + int64_t(n) * g.ldc, vf{}); }
  }
}

// The arguments for a path that only accumulates: C cleared first when overwriting.
HostGemmArgs accumulating(HostGemmArgs g) {
  if (g.overwrite) {
    zero_c(g);
    g.overwrite = false;
  }
  return g;
}

// ---------------------------------------------------------------------------------------------------------
// The bf16 GEMM of levels with vdpbf16ps: A and B as bf16 pairs along k, one instruction per pair of k.
#if FLASH_EXT_ISA_BF16_DOT
constexpr int64_t kPairScratch = 8192;  // uint32 pairs of B (32 KiB)

FLASH_EXT_INLINE uint32_t bf16_bits_of(float x) {
  alignas(64) float in[kLanes] = {x};
  alignas(64) uint16_t out[kLanes];
  vh const h = to_bf16_bits(vload(in));
  __builtin_memcpy(out, &h, sizeof(h));
  return out[0];
}
FLASH_EXT_INLINE uint32_t bf16_bits_at(void const* p, int64_t i, HostDType t) {
  if (t == HostDType::kBF16) { return static_cast<uint16_t const*>(p)[i]; }
  return bf16_bits_of(scalar_as_f32(p, i, t));
}

#if !FLASH_EXT_ISA_HAS_BF16_PAIRS
// Lane l: even[l] and odd[l] rounded to bf16 (to_bf16_lanes), odd's in the high half.
FLASH_EXT_INLINE vu vbf16_pairs(vf even, vf odd) { return to_bf16_lanes(even) | (to_bf16_lanes(odd) << 16); }
#endif

// kLanes bf16 values from p, zero-extended into 32-bit lanes.
FLASH_EXT_INLINE vu bf16_lanes(uint16_t const* p) {
  vh h;
  __builtin_memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, vu);
}
// Lane l: even[l] in the low half, odd[l] in the high half (0 without an odd row: depth odd).
FLASH_EXT_INLINE vu bf16_row_pairs(uint16_t const* even, uint16_t const* odd) {
  return odd ? bf16_lanes(even) | (bf16_lanes(odd) << 16) : bf16_lanes(even);
}
#if !FLASH_EXT_ISA_HAS_PAIR_ROWS
FLASH_EXT_INLINE void bf16_row_pairs2(uint16_t const* even, uint16_t const* odd, vu& p0, vu& p1) {
  p0 = bf16_row_pairs(even, odd);
  p1 = bf16_row_pairs(even + kLanes, odd ? odd + kLanes : nullptr);
}
FLASH_EXT_INLINE void unpermute_pairs2(vf&, vf&) {}
#endif

// A(m0 + r, k0 + 2q + {0, 1}) as one uint32 (low half: the even k) at out[q * RV * kLanes + r]; a missing
// odd k (depth odd) is 0.
template <int RV>
void pack_a_pairs(HostGemmArgs const& g, int m0, int k0, int depth, uint32_t* out) {
  constexpr int kRows = RV * kLanes;
  int const pairs = (depth + 1) / 2;
  int64_t const base = int64_t(m0) * g.a_ms + int64_t(k0) * g.a_ks;
  // One loop per operand kind (the type tests hoisted out of it): contiguous columns of fp32 (Q widened, P:
  // rounded in pairs) or bf16, else element by element.
  if (g.a_ms == 1 && g.a_type == HostDType::kF32) {
    float const* a = static_cast<float const*>(g.a) + base;
    for (int q = 0; q < pairs; ++q) {
      float const* even = a + int64_t(2 * q) * g.a_ks;
      bool const has_odd = 2 * q + 1 < depth;
#pragma GCC unroll 4
      for (int i = 0; i < RV; ++i) {
        vu const pair = vbf16_pairs(vload(even + i * kLanes), has_odd ? vload(even + g.a_ks + i * kLanes) : vf{});
        __builtin_memcpy(out + q * kRows + i * kLanes, &pair, sizeof(pair));
      }
    }
  } else if (g.a_ms == 1 && g.a_type == HostDType::kBF16) {
    uint16_t const* a = static_cast<uint16_t const*>(g.a) + base;
    for (int q = 0; q < pairs; ++q) {
      uint16_t const* even = a + int64_t(2 * q) * g.a_ks;
      bool const has_odd = 2 * q + 1 < depth;
#pragma GCC unroll 4
      for (int i = 0; i < RV; ++i) {
        vu const pair = bf16_row_pairs(even + i * kLanes, has_odd ? even + g.a_ks + i * kLanes : nullptr);
        __builtin_memcpy(out + q * kRows + i * kLanes, &pair, sizeof(pair));
      }
    }
  } else {
    for (int q = 0; q < pairs; ++q) {
      int64_t const at = base + int64_t(2 * q) * g.a_ks;
      bool const has_odd = 2 * q + 1 < depth;
      for (int r = 0; r < kRows; ++r) {
        uint32_t const lo = bf16_bits_at(g.a, at + r * g.a_ms, g.a_type);
        uint32_t const hi = has_odd ? bf16_bits_at(g.a, at + r * g.a_ms + g.a_ks, g.a_type) : 0u;
        out[q * kRows + r] = lo | (hi << 16);
      }
    }
  }
}

// B(n0 + j, k0 + 2q + {0, 1}) as one uint32 at out[q * ncols + j].  B contiguous along the columns (V of
// P.V) interleaves two rows of kLanes columns a vector at a time; the rest goes element by element.
void pack_b_pairs(HostGemmArgs const& g, int n0, int k0, int ncols, int depth, uint32_t* out) {
  uint16_t const* b = static_cast<uint16_t const*>(g.b);
  int const vec_cols = g.b_ns == 1 ? ncols / kLanes * kLanes : 0;
  for (int q = 0; q < (depth + 1) / 2; ++q) {
    int const k = k0 + 2 * q;
    bool const has_odd = 2 * q + 1 < depth;
    uint16_t const* row = b + n0 + int64_t(k) * g.b_ks;  // used only when g.b_ns == 1
    for (int j = 0; j < vec_cols; j += kLanes) {
      vu const pair = bf16_row_pairs(row + j, has_odd ? row + g.b_ks + j : nullptr);
      __builtin_memcpy(out + q * ncols + j, &pair, sizeof(pair));
    }
    for (int j = vec_cols; j < ncols; ++j) {
      int64_t const at = int64_t(n0 + j) * g.b_ns + int64_t(k) * g.b_ks;
      uint32_t const lo = b[at];
      uint32_t const hi = has_odd ? b[at + g.b_ks] : 0u;
      out[q * ncols + j] = lo | (hi << 16);
    }
  }
}

template <int RV, int NR>
FLASH_EXT_INLINE void dot_block(float* c, int64_t ldc, uint32_t const* a, uint32_t const* b, int64_t b_js,
                                int64_t b_qs, int pairs, int ncols) {
  constexpr int kRows = RV * kLanes;
  vf acc[RV][NR];
#pragma GCC unroll 32
  for (int j = 0; j < NR; ++j) {
#pragma GCC unroll 4
    for (int i = 0; i < RV; ++i) { acc[i][j] = j < ncols ? vload(c + j * ldc + i * kLanes) : vf{}; }
  }
  for (int q = 0; q < pairs; ++q) {
    vu av[RV];
#pragma GCC unroll 4
    for (int i = 0; i < RV; ++i) { __builtin_memcpy(&av[i], a + q * kRows + i * kLanes, sizeof(vu)); }
#pragma GCC unroll 32
    for (int j = 0; j < NR; ++j) {
      uint32_t bw;
      __builtin_memcpy(&bw, b + (j < ncols ? j : 0) * b_js + q * b_qs, sizeof(bw));
      vu const bv = vu{} + bw;
#pragma GCC unroll 4
      for (int i = 0; i < RV; ++i) { acc[i][j] = vdot_bf16(acc[i][j], av[i], bv); }
    }
  }
#pragma GCC unroll 32
  for (int j = 0; j < NR; ++j) {
    if (j < ncols) {
#pragma GCC unroll 4
      for (int i = 0; i < RV; ++i) { vstore(c + j * ldc + i * kLanes, acc[i][j]); }
    }
  }
}

// B's pairs: straight from B when its k-pairs are adjacent 32-bit words (K row-major: b_ks == 1 and even
// offsets), else packed.
template <int RV>
void dot_rows(HostGemmArgs const& g, int m0, int n0, int k0, int ncols, int depth, uint32_t const* bpairs,
              int64_t b_js, int64_t b_qs, uint32_t* abuf) {
  constexpr int NR = kAccRegs / RV;
  pack_a_pairs<RV>(g, m0, k0, depth, abuf);
  float* c = g.c + m0 + int64_t(n0) * g.ldc;
  for (int j = 0; j < ncols; j += NR) {
    dot_block<RV, NR>(c + j * g.ldc, g.ldc, abuf, bpairs + j * b_js, b_js, b_qs, (depth + 1) / 2,
                      ncols - j < NR ? ncols - j : NR);
  }
}

void gemm_bf16_dot(HostGemmArgs const& g) {
  alignas(64) uint32_t abuf[kAScratch / 2 + kRowsPerBlock];
  alignas(64) uint32_t bbuf[kPairScratch];
  int const rows = (g.rows + kLanes - 1) / kLanes * kLanes;
  // Chunks of depth (an even number) and columns whose packed pairs fit the scratch.
  int kc = g.depth < 256 ? g.depth : 256;
  int nc = g.cols;
  while (int64_t(nc) * ((kc + 1) / 2) > kPairScratch) { nc = (nc + 1) / 2; }
  for (int k0 = 0; k0 < g.depth; k0 += kc) {
    int const depth = g.depth - k0 < kc ? g.depth - k0 : kc;
    for (int n0 = 0; n0 < g.cols; n0 += nc) {
      int const ncols = g.cols - n0 < nc ? g.cols - n0 : nc;
      uint16_t const* b = static_cast<uint16_t const*>(g.b);
      int64_t const first = int64_t(n0) * g.b_ns + int64_t(k0) * g.b_ks;
      uint32_t const* bpairs;
      int64_t b_js, b_qs;
      if (g.b_ks == 1 && g.b_ns % 2 == 0 && first % 2 == 0 && depth % 2 == 0) {
        bpairs = reinterpret_cast<uint32_t const*>(b + first);  // read through memcpy only
        b_js = g.b_ns / 2;
        b_qs = 1;
      } else {
        pack_b_pairs(g, n0, k0, ncols, depth, bbuf);
        bpairs = bbuf;
        b_js = 1;
        b_qs = ncols;
      }
      int m0 = 0;
      for (; m0 + kRowsPerBlock <= rows; m0 += kRowsPerBlock) {
        dot_rows<kMaxRowVectors>(g, m0, n0, k0, ncols, depth, bpairs, b_js, b_qs, abuf);
      }
      for (; m0 < rows; m0 += kLanes) { dot_rows<1>(g, m0, n0, k0, ncols, depth, bpairs, b_js, b_qs, abuf); }
    }
  }
}

#if FLASH_EXT_ISA_HAS_TILES
// ---------------------------------------------------------------------------------------------------------
// The bf16 GEMM on AMX tiles.  tdpbf16ps adds to a 16 x 16 fp32 tile the product of a tile of 16 rows x 16
// bf16 pairs along k (its first operand) and a tile of 16 k-pairs x 16 columns of pairs (its second).  The
// host's C is column-major, so the tiles compute C^T: a C tile's 16 rows are 16 columns n of C, each 64
// contiguous bytes of 16 rows m, loaded and stored in place with C's column stride.  Its first operand is
// then B's rows (k contiguous: K of Q.K^T as it lies in memory; V of P.V transposed), its second A's k-pairs
// of 16 rows m, packed as for vdpbf16ps.  Register blocking: C tiles 0-3 (2 x 2: 32 columns x 32 rows), B
// tiles 4-5, A tiles 6-7; every tile loaded is used twice.  Columns past the last whole 16 go to
// gemm_bf16_dot, as do products of fewer than 16 columns.
constexpr int kTileK = 32;                       // bf16 of k per tile row (64 bytes)
constexpr int kTileBScratch = 32768;             // bf16 of B's packed rows (64 KiB: V^T of 128 keys x d 256)
constexpr int kTileAScratch = 32 * 256 / 2;      // uint32 pairs of 32 rows x 256 k (16 KiB)
constexpr int kTileDepthChunk = 256;             // k packed and multiplied per chunk (A's scratch holds 256)

// The k-pairs of one packed row over depth: whole 32-deep tile steps, the pairs past depth zero.  One
// definition for every packed form of A (pack_a_tiles, pack_a_all, the softmax step's P) and its size.
constexpr int tile_pairs(int depth) { return (depth + kTileK - 1) / kTileK * (kTileK / 2); }
// Bytes of A's packed pairs for all its rows (a multiple of 16) over depth k, split into kPieces (pack_a_all).
constexpr int64_t packed_a_bytes(int rows, int depth, int pieces) {
  return int64_t(rows) * tile_pairs(depth) * pieces * int64_t(sizeof(uint32_t));
}
// Whether gemm_tiles multiplies A from a HostPackCache of cache_bytes: its depth in one chunk, its pairs within
// the cache.  The softmax step leaves P only there when this holds for the P.V (and no column of the P.V is
// left to gemm_bf16_dot, which reads A itself).
constexpr bool tiles_use_packed_a(int rows, int depth, int pieces, int64_t cache_bytes) {
  return depth <= kTileDepthChunk && packed_a_bytes(rows, depth, pieces) <= cache_bytes;
}
static_assert(packed_a_bytes(128, 128, 1) == 128 * 64 * 4 && packed_a_bytes(16, 40, 3) == 16 * 32 * 3 * 4);

// B(n0 + j, k0 + k) for j < ncols (a multiple of 16), k < depth as bf16 at out[j * ldo + k], and 0 for
// depth <= k < ldo.  B contiguous along n (V of P.V): pairs of rows interleaved a vector at a time, then
// 16 x 16 blocks of pairs transposed; otherwise element by element.
void pack_b_rows(HostGemmArgs const& g, int n0, int k0, int ncols, int depth, uint16_t* out, int ldo) {
  uint16_t const* b = static_cast<uint16_t const*>(g.b);
  if (g.b_ns == 1 && kLanes == 16) {
    int const pairs = ldo / 2;
    for (int q0 = 0; q0 < pairs; q0 += 16) {  // 32 rows of B at a time, each read once, whole
      for (int j = 0; j < ncols; j += 16) {
        vu rows[16], cols[16];
        for (int i = 0; i < 16; ++i) {
          int const k = 2 * (q0 + i);
          if (k >= depth) {
            rows[i] = vu{};
            continue;
          }
          uint16_t const* row = b + n0 + j + int64_t(k0 + k) * g.b_ks;
          rows[i] = bf16_row_pairs(row, k + 1 < depth ? row + g.b_ks : nullptr);
        }
        vtranspose(rows, cols);
        for (int i = 0; i < 16; ++i) { __builtin_memcpy(out + int64_t(j + i) * ldo + 2 * q0, &cols[i], sizeof(vu)); }
      }
    }
    return;
  }
  for (int j = 0; j < ncols; ++j) {
    uint16_t const* src = b + int64_t(n0 + j) * g.b_ns + int64_t(k0) * g.b_ks;
    uint16_t* dst = out + int64_t(j) * ldo;
    if (g.b_ks == 1) {
      __builtin_memcpy(dst, src, sizeof(uint16_t) * depth);
    } else {
      for (int k = 0; k < depth; ++k) { dst[k] = src[int64_t(k) * g.b_ks]; }
    }
    for (int k = depth; k < ldo; ++k) { dst[k] = 0; }
  }
}

// The tile products of operands split into kPieces bf16 pieces each (below): pairs (A's piece, B's piece),
// largest first; the products of two pieces whose orders sum past kPieces - 1 are left out.
constexpr int split_parts(int pieces) { return pieces == 1 ? 1 : pieces == 2 ? 3 : 6; }
constexpr int kSplitA[6] = {0, 0, 1, 0, 1, 2};
constexpr int kSplitB[6] = {0, 1, 0, 2, 1, 0};

// C tiles of NT x 16 columns and MT x 16 rows at c += B rows (b, b_row bytes apart) . A pairs (a, a_row
// bytes apart), over ksteps x 32 k.  kPieces > 1: operands split into pieces (below), each B row and each A
// block holding ksteps of its first piece, then ksteps of the next: c += the split_parts products of pieces
// while C stays in its tiles.
template <int NT, int MT, int kPieces = 1>
FLASH_EXT_INLINE void tile_block(float* c, int64_t ldc, uint16_t const* b, int64_t b_row, uint32_t const* a,
                                 int64_t a_row, int ksteps, bool zero_c) {
  static_assert(kPieces >= 1 && kPieces <= 3);
  int64_t const c_row = ldc * int64_t(sizeof(float));
  int64_t const b_tile = 16 * (b_row / int64_t(sizeof(uint16_t)));  // elements from B's row n to n + 16
  int64_t const a_step = 16 * (a_row / int64_t(sizeof(uint32_t)));  // elements from pair q to q + 16
  if (zero_c) {
    FLASH_EXT_TILE_ZERO(0);
    if constexpr (MT == 2) { FLASH_EXT_TILE_ZERO(1); }
    if constexpr (NT == 2) { FLASH_EXT_TILE_ZERO(2); }
    if constexpr (NT == 2 && MT == 2) { FLASH_EXT_TILE_ZERO(3); }
  } else {
    FLASH_EXT_TILE_LOAD(0, c, c_row);
    if constexpr (MT == 2) { FLASH_EXT_TILE_LOAD(1, c + 16, c_row); }
    if constexpr (NT == 2) { FLASH_EXT_TILE_LOAD(2, c + 16 * ldc, c_row); }
    if constexpr (NT == 2 && MT == 2) { FLASH_EXT_TILE_LOAD(3, c + 16 * ldc + 16, c_row); }
  }
#pragma GCC unroll 6
  for (int part = 0; part < split_parts(kPieces); ++part) {
    uint16_t const* const bp = b + kSplitB[part] * ksteps * kTileK;
    uint32_t const* const ap = a + kSplitA[part] * ksteps * a_step;
    for (int s = 0; s < ksteps; ++s) {
      FLASH_EXT_TILE_LOAD(4, bp + s * kTileK, b_row);
      FLASH_EXT_TILE_LOAD(6, ap + s * a_step, a_row);
      FLASH_EXT_TILE_DOT(0, 4, 6);
      if constexpr (MT == 2) {
        FLASH_EXT_TILE_LOAD(7, ap + s * a_step + 16, a_row);
        FLASH_EXT_TILE_DOT(1, 4, 7);
      }
      if constexpr (NT == 2) {
        FLASH_EXT_TILE_LOAD(5, bp + b_tile + s * kTileK, b_row);
        FLASH_EXT_TILE_DOT(2, 5, 6);
        if constexpr (MT == 2) { FLASH_EXT_TILE_DOT(3, 5, 7); }
      }
    }
  }
  FLASH_EXT_TILE_STORE(0, c, c_row);
  if constexpr (MT == 2) { FLASH_EXT_TILE_STORE(1, c + 16, c_row); }
  if constexpr (NT == 2) { FLASH_EXT_TILE_STORE(2, c + 16 * ldc, c_row); }
  if constexpr (NT == 2 && MT == 2) { FLASH_EXT_TILE_STORE(3, c + 16 * ldc + 16, c_row); }
}

// ---------------------------------------------------------------------------------------------------------
// fp16 and fp32 products on the bf16 tiles ("split").  x becomes a sum of bf16 pieces, each the rest of x
// after the pieces before it, rounded to nearest even (the rests are exact in fp32: Sterbenz).
//   fp16 B, 2 pieces: an fp16 x is exactly hi + lo (11 significant bits; hi keeps 8, and x - hi, a multiple of
//     x's last bit and at most 4 of them, needs at most 3); an fp32 A (P) to within 2^-16 |x|.  A.B^T is then
//     Ah.Bh + Ah.Bl + Al.Bh + Al.Bl; the tiles compute the first three, each bf16 x bf16 product exact and
//     summed in fp32, and leave out the fourth (<= 2^-16 |A(m, k) B(n, k)|): ~2^-15 relative per product at
//     most, against the 2^-11 of the fp16 P that the GPU's P.V multiplies.
//   fp32 B, 3 pieces: an fp32 x is exactly hi + mid + lo (24 bits, 8 per piece; 16 at most left after hi, 8
//     after mid).  Six products (those of piece orders summing to <= 2) leave out mid.lo, lo.mid, lo.lo:
//     <= ~2^-23 |A(m, k) B(n, k)| per product, the order of fp32's own rounding of each sum (2^-24).
// Subnormal pieces count as zero (tdpbf16ps), i.e. what is lost is below 2^-126.  The fp16 prefill measured about
// half the time of the fp32 FMAs it ran on before, fp32 0.73-0.97 of it (docs/perf.md).
// The packed forms hold the first piece of the whole (padded) depth, then the next: A's pairs of a row block
// as pack_a_tiles lays them, q < ksteps * 16 of hi, then as many of the next piece; B's rows as pack_b_rows
// writes them, each row its hi over the padded depth, then the next piece.

// Lane l: the pieces of even[l] and odd[l] as bf16 pairs (odd's in the high half), hi first.  A NaN or
// infinity stays whole in hi (the later pieces 0: x - hi would be NaN for an infinity).
template <int kPieces>
FLASH_EXT_INLINE void split_pairs(vf even, vf odd, vu* pieces) {
#pragma GCC unroll 3
  for (int i = 0; i < kPieces; ++i) {
    vu const p = vbf16_pairs(even, odd);
    pieces[i] = p;
    vf const re = even - (vf)(p << 16), ro = odd - (vf)(p & 0xffff0000u);
    even = re == re ? re : vf{}, odd = ro == ro ? ro : vf{};
  }
}
// The same for kLanes consecutive values, as bf16 bits in the low halves of the lanes.
template <int kPieces>
FLASH_EXT_INLINE void split_lanes(vf x, vu* pieces) {
#pragma GCC unroll 3
  for (int i = 0; i < kPieces; ++i) {
    vu const p = to_bf16_lanes(x);
    pieces[i] = p;
    vf const r = x - (vf)(p << 16);
    x = r == r ? r : vf{};
  }
}

// A(m .. m + kLanes, k) as fp32, `at` the index of A(m, k).
FLASH_EXT_INLINE vf a_rows_at(HostGemmArgs const& g, int64_t at) {
  if (g.a_ms == 1) { return load_as_f32(offset(g.a, at, g.a_type), g.a_type); }
  alignas(64) float v[kLanes];
  for (int r = 0; r < kLanes; ++r) { v[r] = scalar_as_f32(g.a, at + r * g.a_ms, g.a_type); }
  return vload(v);
}

// A(m0 + r, k0 + 2q + {0, 1}) split: the hi pair at out[q * RV * kLanes + r], each next piece's piece_pairs
// pairs further; a missing odd k (depth odd) is 0.  A contiguous along k (the backward's P^T and dS^T): each
// row's 32 k of a step split in two vectors, their pairs gathered into one, and 16 rows of pairs transposed.
template <int RV, int kPieces>
void pack_a_split(HostGemmArgs const& g, int m0, int k0, int depth, int piece_pairs, uint32_t* out) {
  constexpr int kRows = RV * kLanes;
  int64_t const base = int64_t(m0) * g.a_ms + int64_t(k0) * g.a_ks;
  if (g.a_ks == 1 && kLanes == 16) {
    for (int q0 = 0; q0 < (depth + 1) / 2; q0 += 16) {
      int const k = 2 * q0;
      for (int i = 0; i < RV; ++i) {
        vu rows[kPieces][16], cols[16];
        for (int r = 0; r < 16; ++r) {
          int64_t const at = base + int64_t(i * 16 + r) * g.a_ms + k;
          vf x0, x1;
          if (k + 32 <= depth) {
            x0 = load_as_f32(offset(g.a, at, g.a_type), g.a_type);
            x1 = load_as_f32(offset(g.a, at + 16, g.a_type), g.a_type);
          } else {  // the last step: zero past depth
            alignas(64) float x[32];
            for (int j = 0; j < 32; ++j) { x[j] = k + j < depth ? scalar_as_f32(g.a, at + j, g.a_type) : 0.f; }
            x0 = vload(x), x1 = vload(x + 16);
          }
          vu p0[kPieces], p1[kPieces];
          split_lanes<kPieces>(x0, p0);
          split_lanes<kPieces>(x1, p1);
          auto const pairs_of = [](vu a, vu b) {  // bf16 of k = 2p in lane p's low half, of k = 2p + 1 in its high
            vu const even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            vu const odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            return even | (odd << 16);
          };
          for (int h = 0; h < kPieces; ++h) { rows[h][r] = pairs_of(p0[h], p1[h]); }
        }
        int const n = (depth + 1) / 2 - q0 < 16 ? (depth + 1) / 2 - q0 : 16;
        for (int h = 0; h < kPieces; ++h) {
          vtranspose(rows[h], cols);
          for (int p = 0; p < n; ++p) {
            __builtin_memcpy(out + (h * piece_pairs + q0 + p) * kRows + i * 16, &cols[p], sizeof(vu));
          }
        }
      }
    }
    return;
  }
  for (int q = 0; q < (depth + 1) / 2; ++q) {
    int64_t const even = base + int64_t(2 * q) * g.a_ks;
    bool const has_odd = 2 * q + 1 < depth;
#pragma GCC unroll 4
    for (int i = 0; i < RV; ++i) {
      int64_t const at = even + int64_t(i) * kLanes * g.a_ms;
      vu pieces[kPieces];
      split_pairs<kPieces>(a_rows_at(g, at), has_odd ? a_rows_at(g, at + g.a_ks) : vf{}, pieces);
      for (int h = 0; h < kPieces; ++h) {
        __builtin_memcpy(out + (h * piece_pairs + q) * kRows + i * kLanes, &pieces[h], sizeof(vu));
      }
    }
  }
}

// B(n0 + j, k0 + k) split for j < ncols (a multiple of 16), k < depth: piece h at out[j * ldo + h * width + k]
// (width = ldo / kPieces), 0 for depth <= k < width.  B contiguous along n (V of P.V): 16 x 16 blocks of pairs
// transposed, as pack_b_rows; along k (K of Q.K^T): a vector at a time; otherwise element by element.
template <int kPieces>
void pack_b_split(HostGemmArgs const& g, int n0, int k0, int ncols, int depth, uint16_t* out, int ldo) {
  int const width = ldo / kPieces;
  if (g.b_ns == 1 && kLanes == 16) {
    for (int q0 = 0; q0 < width / 2; q0 += 16) {
      for (int j = 0; j < ncols; j += 16) {
        vu rows[kPieces][16], cols[16];
        for (int i = 0; i < 16; ++i) {
          int const k = 2 * (q0 + i);
          vu pieces[kPieces] = {};
          if (k < depth) {
            int64_t const at = n0 + j + int64_t(k0 + k) * g.b_ks;
            vf const odd = k + 1 < depth ? load_as_f32(offset(g.b, at + g.b_ks, g.b_type), g.b_type) : vf{};
            split_pairs<kPieces>(load_as_f32(offset(g.b, at, g.b_type), g.b_type), odd, pieces);
          }
          for (int h = 0; h < kPieces; ++h) { rows[h][i] = pieces[h]; }
        }
        for (int h = 0; h < kPieces; ++h) {
          vtranspose(rows[h], cols);
          for (int i = 0; i < 16; ++i) {
            __builtin_memcpy(out + int64_t(j + i) * ldo + h * width + 2 * q0, &cols[i], sizeof(vu));
          }
        }
      }
    }
    return;
  }
  for (int j = 0; j < ncols; ++j) {
    int64_t const at = int64_t(n0 + j) * g.b_ns + int64_t(k0) * g.b_ks;
    uint16_t* const row = out + int64_t(j) * ldo;
    int k = 0;
    if (g.b_ks == 1) {
      for (; k + kLanes <= depth; k += kLanes) {
        vu pieces[kPieces];
        split_lanes<kPieces>(load_as_f32(offset(g.b, at + k, g.b_type), g.b_type), pieces);
        for (int h = 0; h < kPieces; ++h) {
          vh const bits = __builtin_convertvector(pieces[h], vh);
          __builtin_memcpy(row + h * width + k, &bits, sizeof(bits));
        }
      }
    }
    for (; k < depth; ++k) {
      alignas(64) float x[kLanes] = {scalar_as_f32(g.b, at + int64_t(k) * g.b_ks, g.b_type)};
      vu pieces[kPieces];
      split_lanes<kPieces>(vload(x), pieces);
      for (int h = 0; h < kPieces; ++h) { row[h * width + k] = uint16_t(pieces[h][0]); }
    }
    for (int h = 0; h < kPieces; ++h) {
      for (k = depth; k < width; ++k) { row[h * width + k] = 0; }
    }
  }
}

// A(m0 + r, k0 + 2q + {0, 1}) for r < MT * 16 as bf16 pairs at out[q * MT * 16 + r], q < the pairs of whole
// tile steps over depth (zero past depth: B's padding is zero too, but stale pairs here could hold an inf,
// and 0 * inf is NaN); split into kPieces: the hi pairs so, then each next piece's as many pairs further.
template <int MT, int kPieces = 1>
void pack_a_tiles(HostGemmArgs const& g, int m0, int k0, int depth, uint32_t* out) {
  constexpr int kRows = MT * 16;
  int const pairs = tile_pairs(depth);
  if constexpr (kPieces > 1) {
    pack_a_split<MT * 16 / kLanes, kPieces>(g, m0, k0, depth, pairs, out);
  } else {
    pack_a_pairs<MT * 16 / kLanes>(g, m0, k0, depth, out);
  }
  for (int h = 0; h < kPieces; ++h) {
    for (int q = (depth + 1) / 2; q < pairs; ++q) {
      for (int r = 0; r < kRows; ++r) { out[(h * pairs + q) * kRows + r] = 0; }
    }
  }
}

// Rows m0 .. m0 + MT * 16 against columns n0 .. n0 + ncols (a multiple of 16) over depth from k0, A's pairs
// packed by pack_a_tiles<MT, kPieces>.
template <int MT, int kPieces>
void tile_rows(HostGemmArgs const& g, int m0, int n0, int k0, int ncols, int depth, uint16_t const* b, int64_t b_row,
               uint32_t const* apairs) {
  bool const zero_c = g.overwrite && k0 == 0;
  constexpr int kRows = MT * 16;
  int const ksteps = (depth + kTileK - 1) / kTileK;
  float* c = g.c + m0 + int64_t(n0) * g.ldc;
  int j = 0;
  for (; j + 32 <= ncols; j += 32) {
    tile_block<2, MT, kPieces>(c + j * g.ldc, g.ldc, b + (b_row / 2) * j, b_row, apairs, kRows * 4, ksteps, zero_c);
  }
  if (j < ncols) {
    tile_block<1, MT, kPieces>(c + j * g.ldc, g.ldc, b + (b_row / 2) * j, b_row, apairs, kRows * 4, ksteps, zero_c);
  }
}

// All of A's rows (rows, a multiple of 16) packed block by block as tile_rows reads them: the block of rows
// m0 at out + m0 * pairs, pairs = those of depth's whole tile steps (kPieces times that split).  With the
// 32-row blocks first, every block starts there whatever its height.
template <int kPieces>
void pack_a_all(HostGemmArgs const& g, int rows, int depth, uint32_t* out) {
  int const pairs = tile_pairs(depth) * kPieces;
  int m0 = 0;
  for (; m0 + 32 <= rows; m0 += 32) { pack_a_tiles<2, kPieces>(g, m0, 0, depth, out + int64_t(m0) * pairs); }
  if (m0 < rows) { pack_a_tiles<1, kPieces>(g, m0, 0, depth, out + int64_t(m0) * pairs); }
}

// B's cols x depth as pack_b_rows (pack_b_split) writes it (rows of ld bf16), kept in g.b_cache
// (HostTileCache): packed on the first GEMM that multiplies this tile, found by the later ones.  Null without
// a cache or room in it.
template <int kPieces>
uint16_t const* cached_b_rows(HostGemmArgs const& g, int cols, int ld) {
  HostTileCache* const tc = g.b_cache;
  if (tc == nullptr) { return nullptr; }
  for (int i = 0; i < tc->count; ++i) {
    HostTileCache::Entry const& e = tc->entries[i];
    if (e.key == g.b && e.b_ns == g.b_ns && e.b_ks == g.b_ks && e.cols == cols && e.depth == g.depth) {
      return reinterpret_cast<uint16_t const*>(static_cast<char const*>(tc->data) + e.offset);
    }
  }
  int64_t const bytes = (int64_t(cols) * ld * int64_t(sizeof(uint16_t)) + 63) / 64 * 64;
  if (tc->count == tc->capacity || tc->used + bytes > tc->bytes) { return nullptr; }
  uint16_t* const out = reinterpret_cast<uint16_t*>(static_cast<char*>(tc->data) + tc->used);
  if constexpr (kPieces > 1) {
    pack_b_split<kPieces>(g, 0, 0, cols, g.depth, out, ld);
  } else {
    pack_b_rows(g, 0, 0, cols, g.depth, out, ld);
  }
  tc->entries[tc->count++] = {g.b, g.b_ns, g.b_ks, cols, g.depth, tc->used};
  tc->used += bytes;
  return out;
}

// Few rows against B contiguous along the columns (a decode step's P.V: 1-16 rows of P against a V tile that is
// read once).  gemm_tiles computes C^T, whose first operand is B's rows along k: V transposed, 16 x 16 blocks
// of pairs at a time, for every tile (2.7 us of a 3.5 us decode tile at d = 128, 4 live rows, bench_host_gemm).
// Here the tiles compute C itself: first operand A's rows (P's rows of k-pairs: A's pairs of 16 rows, the
// pack_a_pairs form, transposed once per 32 k), second operand B's k-pairs along the columns, two rows of V
// interleaved a vector at a time (bf16_row_pairs2, in the level's column order), 32 k x 64 columns packed just
// before their products so that the tiles read them back from L1 (packing all of B first, 32 KiB at d = 128,
// measured 1.7-2.0 us per tile against 1.1-1.2: its pairs came back from L2).  C's tiles (16 rows x 16
// columns, row-major) go through scratch and are transposed into column-major C.  The products and their
// fp32 sums are those of gemm_tiles (the same bf16 roundings of A, by vbf16_pairs).
// Depth up to 512 (A's pairs in kTileAScratch); columns a multiple of 32.
bool tiles_few_rows_pv(HostGemmArgs const& g) {
  int const ksteps = (g.depth + kTileK - 1) / kTileK;
  if (g.rows > 16 || g.b_ns != 1 || g.a_ms != 1 || g.a_type != HostDType::kF32 || g.b_cache != nullptr ||
      g.a_cache != nullptr || g.cols % 32 != 0 || g.ldc < 16 || ksteps * 256 > kTileAScratch) {
    return false;
  }
  alignas(64) uint32_t apairs[kTileAScratch];  // A(m, k-pair q) at (q / 16) * 256 + m * 16 + q % 16
  alignas(64) uint32_t packed[16 * 16];        // one tile step of pack_a_pairs' form: q * 16 + m
  for (int s = 0; s < ksteps; ++s) {
    HostGemmArgs step = g;
    step.a = static_cast<float const*>(g.a) + int64_t(s) * kTileK * g.a_ks;
    int const depth = g.depth - s * kTileK < kTileK ? g.depth - s * kTileK : kTileK;
    pack_a_pairs<1>(step, 0, 0, depth, packed);
    vu rows[16], cols[16];
    for (int i = 0; i < 16; ++i) {
      if (2 * i < depth) {
        __builtin_memcpy(&rows[i], packed + i * 16, sizeof(vu));
      } else {
        rows[i] = vu{};
      }
    }
    vtranspose(rows, cols);
    for (int m = 0; m < 16; ++m) { __builtin_memcpy(apairs + s * 256 + m * 16, &cols[m], sizeof(vu)); }
  }
  // B's 16 k-pairs of tile step s, columns j .. j + width (width 32 or 64), as tile rows of width pairs at
  // bpairs: packed just before its products, so that they are read back from L1 (V itself is read once).
  alignas(64) uint32_t bpairs[16 * 64];
  uint16_t const* const b = static_cast<uint16_t const*>(g.b);
  auto pack_b = [&](int s, int j, int width) {
    for (int r = 0; r < 16; ++r) {
      int const k = s * kTileK + 2 * r;
      uint32_t* out = bpairs + r * width;
      if (k >= g.depth) {
        __builtin_memset(out, 0, sizeof(uint32_t) * width);
        continue;
      }
      uint16_t const* even = b + int64_t(k) * g.b_ks + j;
      uint16_t const* odd = k + 1 < g.depth ? even + g.b_ks : nullptr;
      for (int c = 0; c < width; c += 2 * kLanes) {
        vu p0, p1;
        bf16_row_pairs2(even + c, odd != nullptr ? odd + c : nullptr, p0, p1);
        __builtin_memcpy(out + c, &p0, sizeof(vu));
        __builtin_memcpy(out + c + kLanes, &p1, sizeof(vu));
      }
    }
  };
  // Column i of a tile (i < 16) of B's columns j .. j + 31, half h: C's column j + col_of(h, i).
  auto col_of = [](int h, int i) {
#if FLASH_EXT_ISA_HAS_PAIR_ROWS
    return 8 * (i / 4) + 4 * h + i % 4;  // vpunpcklwd / vpunpckhwd order (avx512_bf16.h)
#else
    return 16 * h + i;
#endif
  };
  alignas(64) float ct[4][16 * 16];
  // C tile t (16 columns: half t % 2 of B's columns j + 32 (t / 2) ..) into C's columns, all 16 rows (as
  // gemm_tiles, which stores whole 16-row tiles too).
  auto add_tile = [&](int j, int t) {
    vu in[16], out[16];
    for (int m = 0; m < 16; ++m) { __builtin_memcpy(&in[m], ct[t] + m * 16, sizeof(vu)); }
    vtranspose(in, out);  // out[i]: column i of the tile, its 16 rows
    for (int i = 0; i < 16; ++i) {
      float* c = g.c + int64_t(j + 32 * (t / 2) + col_of(t % 2, i)) * g.ldc;
      vf const v = (vf)out[i];
      vstore(c, g.overwrite ? v : vload(c) + v);
    }
  };
  // NT = 4: 64 columns at a time, four C tiles accumulating at once (tdpbf16ps's latency is several of its issue
  // intervals) from one load of A's tile per step; NT = 2 for a last 32.
  auto group = [&]<int NT>(int j) {
    int64_t const ld = NT * 16 * int64_t(sizeof(uint32_t));  // bytes of a packed row
    FLASH_EXT_TILE_ZERO(0);
    FLASH_EXT_TILE_ZERO(1);
    if constexpr (NT == 4) {
      FLASH_EXT_TILE_ZERO(2);
      FLASH_EXT_TILE_ZERO(3);
    }
    for (int s = 0; s < ksteps; ++s) {
      pack_b(s, j, NT * 16);
      FLASH_EXT_TILE_LOAD(4, apairs + s * 256, 64);
      FLASH_EXT_TILE_LOAD(5, bpairs, ld);
      FLASH_EXT_TILE_LOAD(6, bpairs + 16, ld);
      if constexpr (NT == 4) { FLASH_EXT_TILE_LOAD(7, bpairs + 32, ld); }
      FLASH_EXT_TILE_DOT(0, 4, 5);
      FLASH_EXT_TILE_DOT(1, 4, 6);
      if constexpr (NT == 4) {
        FLASH_EXT_TILE_DOT(2, 4, 7);
        FLASH_EXT_TILE_LOAD(5, bpairs + 48, ld);
        FLASH_EXT_TILE_DOT(3, 4, 5);
      }
    }
    FLASH_EXT_TILE_STORE(0, ct[0], 64);
    FLASH_EXT_TILE_STORE(1, ct[1], 64);
    if constexpr (NT == 4) {
      FLASH_EXT_TILE_STORE(2, ct[2], 64);
      FLASH_EXT_TILE_STORE(3, ct[3], 64);
    }
    for (int t = 0; t < NT; ++t) { add_tile(j, t); }
  };
  tiles_begin();
  int j = 0;
  for (; j + 64 <= g.cols; j += 64) { group.template operator()<4>(j); }
  if (j < g.cols) { group.template operator()<2>(j); }  // g.cols % 64 == 32
  tiles_end();
  return true;
}

// The GEMM on tiles: bf16 operands (kPieces 1), or both operands split into kPieces bf16 pieces as above.
template <int kPieces>
void gemm_tiles(HostGemmArgs const& g) {
  constexpr bool kSplit = kPieces > 1;
  int const tile_cols = g.cols / 16 * 16;
  if (tile_cols < g.cols) {  // the last few columns
    HostGemmArgs rest = g;
    rest.c += int64_t(tile_cols) * g.ldc;
    rest.b = offset(g.b, int64_t(tile_cols) * g.b_ns, g.b_type);
    rest.cols = g.cols - tile_cols;
    if constexpr (kSplit) {
      gemm_blocks(rest);  // in fp32; clears C itself when overwriting
    } else {
      if (rest.overwrite) { zero_c(rest); }
      gemm_bf16_dot(rest);
    }
    if (tile_cols == 0) { return; }
  }
  alignas(64) uint32_t abuf[kPieces * kTileAScratch];
  alignas(64) uint16_t bbuf[kTileBScratch];
  int const rows = (g.rows + 15) / 16 * 16;
  int const kc = g.depth < kTileDepthChunk ? g.depth : kTileDepthChunk;
  int const kc_padded = (kc + kTileK - 1) / kTileK * kTileK;
  int const nc_packed = kTileBScratch / (kPieces * kc_padded) / 16 * 16;  // >= 32
  // A packed once for all its rows where a cache holds it (HostGemmArgs::a_cache: the forward's Q, packed
  // once per CTA instead of once per K tile; measured, docs/perf.md), else block by block below.
  uint32_t const* cached = nullptr;
  if (HostPackCache* const pc = g.a_cache; pc != nullptr && tiles_use_packed_a(rows, g.depth, kPieces, pc->bytes)) {
    if (!(pc->valid && pc->key == g.a && pc->rows == rows && pc->depth == g.depth)) {
      pack_a_all<kPieces>(g, rows, kc, static_cast<uint32_t*>(pc->data));
      *pc = {pc->data, pc->bytes, g.a, rows, g.depth, true};
    }
    cached = static_cast<uint32_t const*>(pc->data);
  }
  // B packed once for every GEMM of the call that multiplies it, where a cache holds it (HostGemmArgs::b_cache:
  // the prefill's global K/V tiles).
  uint16_t const* const b_packed = kc == g.depth ? cached_b_rows<kPieces>(g, tile_cols, kPieces * kc_padded) : nullptr;
  tiles_begin();
  if (cached != nullptr && (b_packed != nullptr || (!kSplit && g.b_ks == 1 && kc % kTileK == 0))) {
    // A packed whole and B's rows in place (the forward's Q.K^T): blocks of 32 columns outer, so that each
    // block of B's rows is fetched once and used by every row block while it is in L1.  Row blocks outer
    // fetched all of B (K: 32 KiB at d = 128) again for every 32 rows, and K's rows, a head's stride apart
    // in a (b, s, h, d) tensor, fall into a few L1 sets and do not stay (bf16 prefill 10% less time at d = 64,
    // 2% at d = 128; docs/perf.md).
    int const ksteps = kc_padded / kTileK;
    int64_t const b_ld = b_packed != nullptr ? kPieces * kc_padded : g.b_ns;  // elements from B's row n to n + 1
    int64_t const b_row = b_ld * int64_t(sizeof(uint16_t));
    for (int j = 0; j < tile_cols; j += 32) {
      uint16_t const* b = (b_packed != nullptr ? b_packed : static_cast<uint16_t const*>(g.b)) + int64_t(j) * b_ld;
      float* c = g.c + int64_t(j) * g.ldc;
      auto block = [&]<int MT>(int m0) {  // rows m0 .. m0 + MT * 16 against this block's 32 (or last 16) columns
        uint32_t const* a = cached + int64_t(m0) * (kPieces * kc_padded / 2);
        if (j + 32 <= tile_cols) {
          tile_block<2, MT, kPieces>(c + m0, g.ldc, b, b_row, a, MT * 16 * 4, ksteps, g.overwrite);
        } else {
          tile_block<1, MT, kPieces>(c + m0, g.ldc, b, b_row, a, MT * 16 * 4, ksteps, g.overwrite);
        }
      };
      int m0 = 0;
      for (; m0 + 32 <= rows; m0 += 32) { block.template operator()<2>(m0); }
      if (m0 < rows) { block.template operator()<1>(m0); }
    }
    tiles_end();
    return;
  }
  for (int k0 = 0; k0 < g.depth; k0 += kc) {
    int const depth = g.depth - k0 < kc ? g.depth - k0 : kc;
    int const ld = (depth + kTileK - 1) / kTileK * kTileK * kPieces;  // bf16 of a packed B row
    bool const in_place = !kSplit && g.b_ks == 1 && depth % kTileK == 0;
    // Columns in chunks only as far as packed B must fit its scratch: A, unless cached, is packed again for
    // every chunk.
    int const nc = in_place || b_packed != nullptr ? tile_cols : nc_packed;
    for (int n0 = 0; n0 < tile_cols; n0 += nc) {
      int const ncols = tile_cols - n0 < nc ? tile_cols - n0 : nc;
      uint16_t const* b;
      int64_t b_row;  // bytes
      if (b_packed != nullptr) {  // one chunk: kc == depth, and packed B is used in place
        b = b_packed + int64_t(n0) * ld;
        b_row = ld * int64_t(sizeof(uint16_t));
      } else if (in_place) {  // B's rows used in place
        b = static_cast<uint16_t const*>(g.b) + int64_t(n0) * g.b_ns + k0;
        b_row = g.b_ns * int64_t(sizeof(uint16_t));
      } else {
        if constexpr (kSplit) {
          pack_b_split<kPieces>(g, n0, k0, ncols, depth, bbuf, ld);
        } else {
          pack_b_rows(g, n0, k0, ncols, depth, bbuf, ld);
        }
        b = bbuf;
        b_row = ld * int64_t(sizeof(uint16_t));
      }
      int m0 = 0;
      for (; m0 + 32 <= rows; m0 += 32) {
        if (cached == nullptr) { pack_a_tiles<2, kPieces>(g, m0, k0, depth, abuf); }
        tile_rows<2, kPieces>(g, m0, n0, k0, ncols, depth, b, b_row, cached ? cached + int64_t(m0) * (ld / 2) : abuf);
      }
      if (m0 < rows) {
        if (cached == nullptr) { pack_a_tiles<1, kPieces>(g, m0, k0, depth, abuf); }
        tile_rows<1, kPieces>(g, m0, n0, k0, ncols, depth, b, b_row, cached ? cached + int64_t(m0) * (ld / 2) : abuf);
      }
    }
  }
  tiles_end();
}
#endif  // FLASH_EXT_ISA_HAS_TILES
#endif  // FLASH_EXT_ISA_BF16_DOT

// ---------------------------------------------------------------------------------------------------------
// Few rows: a decode step fills 1-8 rows of its 16-row tile (one query, or a GQA group).  The blocks above
// spend a vector on kLanes rows, so with rows <= kLanes / 2 at least half their lanes are idle, and every
// element of B costs a broadcast load plus a widening pass beforehand.  Here vectors run along B's
// contiguous dimension instead, and B is widened as it is loaded:
//   B contiguous along the columns (b_ns == 1: V of P.V): a row of C, kLanes columns per vector, each
//     A(m, k) broadcast.  Per output the same fused multiply-adds in the same order as the blocks above.
//   B contiguous along depth (b_ks == 1: K of Q.K^T): dot products of A's rows with B's columns, kLanes
//     steps of depth per vector, the lanes summed at the end (the same products, summed in another order).
// Used for fp32 A only (the host's Q and P).  A bf16-dot level's bf16 products, whose rounding to bf16 is
// part of that level's contract, take their own few-rows path below (gemm_bf16_few_rows).
constexpr int kSmallRows = kLanes / 2;
constexpr int kSmallDepth = 512;  // depth per chunk of the dot products' transposed A

template <int R>
constexpr int small_col_vectors() {  // accumulators R x CV, plus R broadcasts and one B vector
  constexpr int cv = (kAccRegs - R) / R;
  return cv < 1 ? 1 : cv > 8 ? 8 : cv;
}
// Keys per block of the dot products: R x NK accumulators whose lane sums fill one vector (vsum_each), plus
// R A vectors and one B vector (at most 16 + 8 + 1 of AVX-512's 32 registers, 8 + 4 + 1 of AVX2's 16).
template <int R>
constexpr int small_keys() {
  static_assert(R >= 1 && R <= kSmallRows);
  return kLanes / R;
}

// bf16 B on a level without bf16 products (avx2, avx512, generic), few rows: B taken as 32-bit words, each the
// bf16 pair of elements 2i and 2i + 1.  Masking off a word's low half leaves element 2i + 1 in fp32, shifting
// it up by 16 gives element 2i: one load and two integer operations per 2 kLanes values, where load_bf16
// spends a widening shuffle and a shift per kLanes.  The vectors then hold the even- and the odd-indexed
// elements, which both orientations below take into account.
FLASH_EXT_INLINE void load_bf16_pairs(uint16_t const* p, vf& even, vf& odd) {
  vu w;
  __builtin_memcpy(&w, p, sizeof(w));
  even = (vf)(w << 16);
  odd = (vf)(w & 0xffff0000u);
}

// Keys per block of small_pair_dots_block.  Two or more rows: R x NK accumulators filling kAccRegs (12 on
// AVX2 at R = 4, against small_keys' 8): 4 rows' Q.K^T 0.90x the time on Zen 3 (bench/host_gemm.cpp, bf16,
// d = 128).  One row keeps small_keys' kLanes keys: 12 measured 1.10x the time there.
template <int R>
constexpr int small_pair_keys() {
  static_assert(R >= 1 && R <= kSmallRows);
  return R == 1 || kAccRegs / R < small_keys<R>() ? small_keys<R>() : kAccRegs / R;
}

// The lanes' sum, halving the vector each step (lane i + lane i + n/2, ...).  Through an array rather
// than __builtin_shufflevector, which GCC has only from version 12; the code generated is as fast here.
template <class V>
FLASH_EXT_INLINE float sum_lanes(V v) {
  constexpr int n = sizeof(V) / sizeof(float);
  float x[n];
  __builtin_memcpy(x, &v, sizeof(v));
#pragma GCC unroll 4
  for (int w = n / 2; w > 0; w /= 2) {
#pragma GCC unroll 8
    for (int i = 0; i < w; ++i) { x[i] += x[i + w]; }
  }
  return x[0];
}

#if !FLASH_EXT_ISA_HAS_SUM_EACH
FLASH_EXT_INLINE vf vsum_each(vf const* v) {
  alignas(64) float sums[kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) { sums[i] = sum_lanes(v[i]); }
  return vload(sums);
}
#endif

template <int R, int NK>
FLASH_EXT_INLINE void zero_accumulators(vf (&acc)[R][NK]) {
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
#pragma GCC unroll 16
    for (int j = 0; j < NK; ++j) { acc[m][j] = vf{}; }
  }
}

// Lane l of the result: lane I_l of a's lanes followed by b's (0 .. 2 kLanes), the indices constants.  GCC
// before 12 has no __builtin_shufflevector; its __builtin_shuffle folds a constant index vector the same way.
template <int... I>
FLASH_EXT_INLINE vf vpermute2(vf a, vf b) {
  static_assert(sizeof...(I) == kLanes);
#if defined(__clang__) || __GNUC__ >= 12
  return __builtin_shufflevector(a, b, I...);
#else
  return __builtin_shuffle(a, b, vu{uint32_t(I)...});
#endif
}

// Key J's column of S from the vectors of lane sums (slots J * R .. + R, key-major) as one vector: its R sums,
// then zeros to the vector boundary.  Constant permutations: one where the key's sums lie in one vector, two
// where they straddle two.  (Compile-time packs through functions, not lambdas: GCC left lambdas uninlined.)
template <int R, int J, int kVectors, int... L>
FLASH_EXT_INLINE vf key_column(vf const (&sums)[kVectors], std::integer_sequence<int, L...>) {
  constexpr int kVector = J * R / kLanes, kOffset = J * R % kLanes;
  if constexpr (kOffset + R <= kLanes) {
    return vpermute2<(L < R ? kOffset + L : kLanes + L)...>(sums[kVector], vf{});
  } else {
    vf const both = vpermute2<(L < R ? kOffset + L : L)...>(sums[kVector], sums[kVector + 1]);
    return vpermute2<(L < R ? L : kLanes + L)...>(both, vf{});
  }
}

template <int R, int kVectors, int... J>
FLASH_EXT_INLINE void store_key_columns(float* c, int64_t ldc, vf const (&sums)[kVectors],
                                        std::integer_sequence<int, J...>) {
  (vstore(c + J * ldc, key_column<R, J>(sums, std::make_integer_sequence<int, kLanes>{})), ...);
}

// C(m, n0 + j) += the lane sums of acc[m][j] for m < R, j < NK (store: C(m, n0 + j) = them): kLanes of them per
// vsum_each, key-major (slot j * R + m), so that each key's R rows come out as one run of C's column.  Storing
// is adding to a zeroed C bit for bit (a lane sum is never -0: its accumulator starts at +0), without the
// zeroing pass over C and the read of it back.  It writes each key's column as one vector, rows R to the vector
// boundary zero as that pass left them (dead query rows of S stay 0): with the zeros written apart (a memcpy per
// key), a 1-row decode tile's Q.K^T took 2.0-2.4x the time (bench_host_gemm, Zen 4, each level; docs/perf.md).
template <int R, int NK>
FLASH_EXT_INLINE void add_lane_sums(float* c, int64_t ldc, vf const (&acc)[R][NK], bool store = false) {
  static_assert(R < kLanes);
  constexpr int kSlots = R * NK;
  constexpr int kVectors = (kSlots + kLanes - 1) / kLanes;
  vf sums[kVectors];
#pragma GCC unroll 4
  for (int v = 0; v < kVectors; ++v) {
    vf slots[kLanes];
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) {
      int const slot = v * kLanes + i;
      slots[i] = slot < kSlots ? acc[slot % R][slot / R] : vf{};
    }
    sums[v] = vsum_each(slots);
  }
  if (store) {
    store_key_columns<R>(c, ldc, sums, std::make_integer_sequence<int, NK>{});
  } else {  // a run of R floats per key (a vector add where R is 4 or 8)
    alignas(64) float lanes[kVectors * kLanes];
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) { vstore(lanes + v * kLanes, sums[v]); }
#pragma GCC unroll 16
    for (int j = 0; j < NK; ++j) {
      float run[R];
      __builtin_memcpy(run, c + j * ldc, sizeof(run));
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) { run[m] += lanes[j * R + m]; }
      __builtin_memcpy(c + j * ldc, run, sizeof(run));
    }
  }
}

// C(m, n0 + c) for m < R and c < CV * kLanes, with B(n, k) = b[n + k * b_ks].  C's rows are strided, so
// they pass through a small row buffer on the way in and out (R * CV * kLanes values per depth-long run).
template <int R, int CV, HostDType kB>
FLASH_EXT_INLINE void small_rows_block(HostGemmArgs const& g, int n0) {
  constexpr int kCols = CV * kLanes;
  float const* a = static_cast<float const*>(g.a);
  float* c = g.c + int64_t(n0) * g.ldc;
  alignas(64) float row[kCols];
  vf acc[R][CV];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
    for (int j = 0; j < kCols; ++j) { row[j] = c[m + j * g.ldc]; }
#pragma GCC unroll 8
    for (int v = 0; v < CV; ++v) { acc[m][v] = vload(row + v * kLanes); }
  }
  void const* b = offset(g.b, n0, kB);
  for (int k = 0; k < g.depth; ++k) {
    vf av[R];
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) { av[m] = vsplat(a[m * g.a_ms + k * g.a_ks]); }
#pragma GCC unroll 8
    for (int v = 0; v < CV; ++v) {
      vf const bv = load_b<kB>(b, int64_t(k) * g.b_ks + v * kLanes);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) { acc[m][v] = vfma(av[m], bv, acc[m][v]); }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
#pragma GCC unroll 8
    for (int v = 0; v < CV; ++v) { vstore(row + v * kLanes, acc[m][v]); }
    for (int j = 0; j < kCols; ++j) { c[m + j * g.ldc] = row[j]; }
  }
}

// Columns [n0, n_end) of C, n_end - n0 a multiple of kLanes: blocks of CV vectors, then single vectors
// (not every narrower width: each is another instantiation per row count and type, i.e. compile time).
template <int R, int CV, HostDType kB>
void small_rows_cols(HostGemmArgs const& g, int n0, int n_end) {
  int n = n0;
  for (; n + CV * kLanes <= n_end; n += CV * kLanes) { small_rows_block<R, CV, kB>(g, n); }
  if constexpr (CV > 1) {
    if (n < n_end) { small_rows_cols<R, 1, kB>(g, n, n_end); }
  }
}

// C(m, n0 + j) += sum_k A(m, k0 + k) * B(n0 + j, k0 + k) for m < R, j < NK, k < depth (a multiple of
// kLanes), with A's rows transposed into at (at[m * depth + k]) and B(n, k) = b[n * b_ns + k].
template <int R, int NK, HostDType kB>
FLASH_EXT_INLINE void small_dots_block(HostGemmArgs const& g, float const* at, int n0, int k0, int depth) {
  vf acc[R][NK];
  zero_accumulators(acc);
  void const* b = offset(g.b, int64_t(n0) * g.b_ns + k0, kB);
  for (int k = 0; k < depth; k += kLanes) {
    vf av[R];
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) { av[m] = vload(at + m * depth + k); }
#pragma GCC unroll 16
    for (int j = 0; j < NK; ++j) {
      vf const bv = load_b<kB>(b, int64_t(j) * g.b_ns + k);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) { acc[m][j] = vfma(av[m], bv, acc[m][j]); }
    }
  }
  add_lane_sums<R, NK>(g.c + int64_t(n0) * g.ldc, g.ldc, acc, g.overwrite);
}

template <int R, int NK, HostDType kB>
void small_dots_cols(HostGemmArgs const& g, float const* at, int n0, int k0, int depth) {
  int n = n0;
  for (; n + NK <= g.cols; n += NK) { small_dots_block<R, NK, kB>(g, at, n, k0, depth); }
  if constexpr (NK > 1) {  // then key by key, as in small_rows_cols
    if (n < g.cols) { small_dots_cols<R, 1, kB>(g, at, n, k0, depth); }
  }
}

// small_rows_block for bf16 B, CP pairs of vectors (2 kLanes columns each) along C's row: per B row, one
// load_bf16_pairs per 2 kLanes columns, the even columns accumulated in acc_e and the odd ones in acc_o.  Per
// output the same fused multiply-adds in the same order as small_rows_block (and as the blocks above).
template <int R, int CP>
FLASH_EXT_INLINE void small_pair_rows_block(HostGemmArgs const& g, int n0) {
  float const* a = static_cast<float const*>(g.a);
  uint16_t const* b = static_cast<uint16_t const*>(g.b) + n0;
  float* c = g.c + int64_t(n0) * g.ldc;
  vf acc_e[R][CP], acc_o[R][CP];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
#pragma GCC unroll 8
    for (int v = 0; v < CP; ++v) {
      alignas(64) float e[kLanes], o[kLanes];
      float const* cv = c + m + int64_t(v) * 2 * kLanes * g.ldc;
      for (int i = 0; i < kLanes; ++i) { e[i] = cv[2 * i * g.ldc], o[i] = cv[(2 * i + 1) * g.ldc]; }
      acc_e[m][v] = vload(e), acc_o[m][v] = vload(o);
    }
  }
  for (int k = 0; k < g.depth; ++k) {
    vf av[R];
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) { av[m] = vsplat(a[m * g.a_ms + k * g.a_ks]); }
#pragma GCC unroll 8
    for (int v = 0; v < CP; ++v) {
      vf be, bo;
      load_bf16_pairs(b + int64_t(k) * g.b_ks + v * 2 * kLanes, be, bo);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) {
        acc_e[m][v] = vfma(av[m], be, acc_e[m][v]);
        acc_o[m][v] = vfma(av[m], bo, acc_o[m][v]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
#pragma GCC unroll 8
    for (int v = 0; v < CP; ++v) {
      alignas(64) float e[kLanes], o[kLanes];
      vstore(e, acc_e[m][v]), vstore(o, acc_o[m][v]);
      float* cv = c + m + int64_t(v) * 2 * kLanes * g.ldc;
      for (int i = 0; i < kLanes; ++i) { cv[2 * i * g.ldc] = e[i], cv[(2 * i + 1) * g.ldc] = o[i]; }
    }
  }
}

template <int R, int CP>
void small_pair_rows_cols(HostGemmArgs const& g, int n0, int n_end) {
  int n = n0;
  for (; n + CP * 2 * kLanes <= n_end; n += CP * 2 * kLanes) { small_pair_rows_block<R, CP>(g, n); }
  if constexpr (CP > 1) {
    if (n < n_end) { small_pair_rows_cols<R, 1>(g, n, n_end); }
  }
}

// small_dots_block for bf16 B (K rows, contiguous along depth), depth a multiple of 2 kLanes: A's rows
// transposed into `at` with each 2 kLanes of depth as its kLanes even-indexed values, then its kLanes odd ones
// (pair_order), so that they meet B's even and odd vectors from load_bf16_pairs.  Each key's 2 kLanes words
// are loaded once and used by the R rows twice.  Lane i of an accumulator sums the products of depth 2i and
// 2i + 1 of every 2 kLanes (small_dots_block's: depth i of every kLanes): the same products, another order.
FLASH_EXT_INLINE int pair_order(int k) {  // where depth k of a transposed A row goes
  int const group = k / (2 * kLanes), r = k % (2 * kLanes);
  return group * 2 * kLanes + (r % 2) * kLanes + r / 2;
}
// A's R rows, depth values from a, into at[m * depth + k] (pairs: at pair_order(k)).  A column-major A whose
// columns are at least a vector apart (the body's Q fragment: 16 rows or more, rows contiguous) goes kLanes
// columns at a time through vtranspose: the columns k0 + step * i (step 2 for pairs: a group's even or odd
// ones) as its input vectors, row m's kLanes values as its output m.  A vector read from a column runs past
// row R into the rest of the column's stride, never past the last column: the last group's columns are read R
// values each, into zeroed vectors (element by element through pair_order, that group was ~40% of a 4-row
// decode Q.K^T's fixed cost per call on AVX2; docs/perf.md).
template <int R>
FLASH_EXT_INLINE void transpose_small_a(HostGemmArgs const& g, float const* a, int depth, bool pairs, float* at) {
  if (!(g.a_ms == 1 && g.a_ks >= kLanes && depth % (2 * kLanes) == 0)) {
    for (int m = 0; m < R; ++m) {
      for (int k = 0; k < depth; ++k) { at[m * depth + (pairs ? pair_order(k) : k)] = a[m * g.a_ms + int64_t(k) * g.a_ks]; }
    }
    return;
  }
  int const step = pairs ? 2 : 1;
  auto group = [&](int k, auto whole_columns) {
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {  // pairs: the even columns, then the odd ones; else k, then k + kLanes
      int const first = k + (pairs ? half : half * kLanes);
      vu in[kLanes], out[kLanes];
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) {
        float const* column = a + int64_t(first + step * i) * g.a_ks;
        if constexpr (decltype(whole_columns)::value) {
          __builtin_memcpy(&in[i], column, sizeof(vu));
        } else {
          in[i] = vu{};
          __builtin_memcpy(&in[i], column, R * sizeof(float));
        }
      }
      vtranspose(in, out);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) { __builtin_memcpy(at + m * depth + k + half * kLanes, &out[m], sizeof(vu)); }
    }
  };
  int const last = depth - 2 * kLanes;
  for (int k = 0; k < last; k += 2 * kLanes) { group(k, std::true_type{}); }
  group(last, std::false_type{});
}

template <int R, int NK>
FLASH_EXT_INLINE void small_pair_dots_block(HostGemmArgs const& g, float const* at, int n0, int k0, int depth) {
  vf acc[R][NK];
  zero_accumulators(acc);
  uint16_t const* b = static_cast<uint16_t const*>(g.b) + int64_t(n0) * g.b_ns + k0;
  for (int k = 0; k < depth; k += 2 * kLanes) {
#pragma GCC unroll 16
    for (int j = 0; j < NK; ++j) {  // key by key: two B vectors live beside the accumulators, A read from `at` (L1)
      vf be, bo;
      load_bf16_pairs(b + int64_t(j) * g.b_ns + k, be, bo);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) {
        acc[m][j] = vfma(vload(at + m * depth + k + kLanes), bo, vfma(vload(at + m * depth + k), be, acc[m][j]));
      }
    }
  }
  add_lane_sums<R, NK>(g.c + int64_t(n0) * g.ldc, g.ldc, acc, g.overwrite);
}

template <int R, int NK>
void small_pair_dots_cols(HostGemmArgs const& g, float const* at, int n0, int k0, int depth) {
  int n = n0;
  for (; n + NK <= g.cols; n += NK) { small_pair_dots_block<R, NK>(g, at, n, k0, depth); }
  if constexpr (NK > 1) {
    if (n < g.cols) { small_pair_dots_cols<R, 1>(g, at, n, k0, depth); }
  }
}

// An overwriting product: the orientation along C's columns accumulates into C zeroed first; the dot products
// store their first depth chunk's sums and add the later ones (add_lane_sums).  The former is a function of its
// own (noinline): compiled into one with the dot products, its P.V loop ran short of integer registers, the loop
// counter and strides reloaded from the stack (bench_host_gemm's decode tile, 4 rows, Zen 3: P.V 2287-2311 ns
// against 1842-1888 apart).
template <int R, HostDType kB>
__attribute__((noinline)) void small_gemm_along_cols(HostGemmArgs const& in) {
  HostGemmArgs const g = accumulating(in);
  int const n_vec = g.cols / kLanes * kLanes;
  if constexpr (kB == HostDType::kBF16) {  // pairs of vectors first, then a single vector's columns
    constexpr int CP = small_col_vectors<R>() / 2 < 1 ? 1 : small_col_vectors<R>() / 2;
    int const n_pair = g.cols / (2 * kLanes) * (2 * kLanes);
    small_pair_rows_cols<R, CP>(g, 0, n_pair);
    small_rows_cols<R, 1, kB>(g, n_pair, n_vec);
  } else {
    small_rows_cols<R, small_col_vectors<R>(), kB>(g, 0, n_vec);
  }
  if (n_vec < g.cols) {  // the last few columns, by the blocks
    HostGemmArgs rest = g;
    rest.c += int64_t(n_vec) * g.ldc;
    rest.b = offset(g.b, n_vec, kB);
    rest.cols = g.cols - n_vec;
    gemm_blocks(rest);
  }
}

template <int R, HostDType kB>
FLASH_EXT_INLINE void small_gemm_dots(HostGemmArgs const& in) {
  float const* a = static_cast<float const*>(in.a);
  alignas(64) float at[R * kSmallDepth];
  HostGemmArgs g = in;
  for (int k0 = 0; k0 < g.depth; k0 += kSmallDepth, g.overwrite = false) {
    int const depth = g.depth - k0 < kSmallDepth ? g.depth - k0 : kSmallDepth;
    // bf16 K by pairs where the chunk is whole groups of 2 kLanes (every head dim the op compiles; kSmallDepth is one)
    bool const pairs = kB == HostDType::kBF16 && depth % (2 * kLanes) == 0;
    transpose_small_a<R>(g, a + int64_t(k0) * g.a_ks, depth, pairs, at);
    if constexpr (kB == HostDType::kBF16) {
      if (pairs) {
        small_pair_dots_cols<R, small_pair_keys<R>()>(g, at, 0, k0, depth);
        continue;
      }
    }
    small_dots_cols<R, small_keys<R>(), kB>(g, at, 0, k0, depth);
  }
}

template <int R, HostDType kB>
void small_gemm(HostGemmArgs const& g, bool cols_contiguous) {
  if (cols_contiguous) { return small_gemm_along_cols<R, kB>(g); }
  small_gemm_dots<R, kB>(g);
}

template <int R>
void small_gemm_rows(HostGemmArgs const& g, bool cols_contiguous) {
  if constexpr (R < kSmallRows) {
    if (g.rows > R) { return small_gemm_rows<R + 1>(g, cols_contiguous); }
  }
  switch (g.b_type) {
    case HostDType::kF32: return small_gemm<R, HostDType::kF32>(g, cols_contiguous);
    case HostDType::kBF16:
      // A bf16-dot level never gets here (gemm_few_rows declines bf16 B there): not instantiated, for
      // compile time.
      if constexpr (FLASH_EXT_ISA_BF16_DOT) { return gemm_blocks(g); }
      return small_gemm<R, HostDType::kBF16>(g, cols_contiguous);
    case HostDType::kF16: return small_gemm<R, HostDType::kF16>(g, cols_contiguous);
  }
}

// Not on the AMX level, whose tiles take every bf16 product (gemm): not instantiated there, for compile time.
#if FLASH_EXT_ISA_BF16_DOT && !FLASH_EXT_ISA_HAS_TILES
// Few rows on a bf16-dot level, for bf16 B: the same two orientations, with vdpbf16ps's products (A rounded
// to bf16 pairs, the level's contract, as in gemm_bf16_dot).  A's R rows are first packed as pairs along
// depth, row by row (ap[m * pairs + q] = A(m, k0 + 2q) | A(m, k0 + 2q + 1) << 16; a missing odd k is 0).
//   B contiguous along depth (K): B's pairs are its own 32-bit words, kLanes of them per vector; the lanes
//     summed by vsum_each.  kLanes pairs of A and B per instruction, no broadcast.
//   B contiguous along the columns (V): two rows of B interleaved into pairs two vectors at a time
//     (bf16_row_pairs2), each used by the R rows; A's pair broadcast.  Per output the same vdpbf16ps as
//     gemm_bf16_dot's blocks in the same order, summed from zero and then added to C (the blocks start
//     from C): the same products, one addition placed differently.
template <int R>
void pack_small_pairs(HostGemmArgs const& g, int k0, int depth, int pairs, uint32_t* ap) {
  float const* a = static_cast<float const*>(g.a);
  alignas(64) float even[kLanes], odd[kLanes];
  for (int m = 0; m < R; ++m) {
    for (int q0 = 0; q0 < pairs; q0 += kLanes) {
#pragma GCC unroll 16
      for (int l = 0; l < kLanes; ++l) {
        int const k = 2 * (q0 + l);
        even[l] = k < depth ? a[m * g.a_ms + int64_t(k0 + k) * g.a_ks] : 0.f;
        odd[l] = k + 1 < depth ? a[m * g.a_ms + int64_t(k0 + k + 1) * g.a_ks] : 0.f;
      }
      vu const p = vbf16_pairs(vload(even), vload(odd));
      __builtin_memcpy(ap + m * pairs + q0, &p, sizeof(p));
    }
  }
}

// Q.K^T-shaped: C(m, n0 + j) += A(m, k0 + .) . B(n0 + j, k0 + .) for m < R, j < NK over depth (= when
// g.overwrite: the first depth chunk of an overwriting product), A's pairs in ap (pairs per row, a multiple
// of kLanes, zero past depth).  A tail of depth short of a whole vector is read through a zeroed copy: B's
// row may end there.
template <int R, int NK>
FLASH_EXT_INLINE void small_bf16_dots_block(HostGemmArgs const& g, uint32_t const* ap, int pairs, int n0, int k0,
                                            int depth) {
  vf acc[R][NK];
  zero_accumulators(acc);
  uint16_t const* b = static_cast<uint16_t const*>(g.b) + int64_t(n0) * g.b_ns + k0;
  int const whole = depth / (2 * kLanes) * kLanes;  // pairs in whole vectors of B
  auto step = [&](int q, auto&& b_pairs) {
    vu av[R];
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) { __builtin_memcpy(&av[m], ap + m * pairs + q, sizeof(vu)); }
#pragma GCC unroll 16
    for (int j = 0; j < NK; ++j) {
      vu const bv = b_pairs(j);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) { acc[m][j] = vdot_bf16(acc[m][j], av[m], bv); }
    }
  };
  for (int q = 0; q < whole; q += kLanes) {
    step(q, [&](int j) {
      vu v;
      __builtin_memcpy(&v, b + int64_t(j) * g.b_ns + 2 * q, sizeof(v));
      return v;
    });
  }
  if (2 * whole < depth) {
    int const tail = depth - 2 * whole;  // bf16 elements, < 2 * kLanes
    step(whole, [&](int j) {
      alignas(64) uint16_t part[2 * kLanes] = {};
      __builtin_memcpy(part, b + int64_t(j) * g.b_ns + 2 * whole, sizeof(uint16_t) * tail);
      vu v;
      __builtin_memcpy(&v, part, sizeof(v));
      return v;
    });
  }
  add_lane_sums<R, NK>(g.c + int64_t(n0) * g.ldc, g.ldc, acc, g.overwrite);
}

// P.V-shaped: C(m, n0 + c) += A(m, k0 + .) . B(k0 + ., n0 + c) for m < R, c < CV * kLanes, B(n, k) =
// b[n + k * b_ks].  CV even: B's rows interleaved two vectors at a time (bf16_row_pairs2, in the level's
// column order), else one.  The accumulators start from zero (the order of the columns inside them is the
// level's) and are added to C's rows at the end, through a row buffer.
template <int R, int CV>
FLASH_EXT_INLINE void small_bf16_rows_block(HostGemmArgs const& g, uint32_t const* ap, int pairs, int n0, int k0,
                                            int depth) {
  static_assert(CV == 1 || CV % 2 == 0);
  constexpr int kCols = CV * kLanes;
  vf acc[R][CV];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
#pragma GCC unroll 8
    for (int v = 0; v < CV; ++v) { acc[m][v] = vf{}; }
  }
  uint16_t const* b = static_cast<uint16_t const*>(g.b) + n0 + int64_t(k0) * g.b_ks;
  for (int q = 0; q < (depth + 1) / 2; ++q) {
    uint16_t const* even = b + int64_t(2 * q) * g.b_ks;
    uint16_t const* odd = 2 * q + 1 < depth ? even + g.b_ks : nullptr;
    vu bv[CV];
    if constexpr (CV == 1) {
      bv[0] = bf16_row_pairs(even, odd);
    } else {
#pragma GCC unroll 8
      for (int v = 0; v < CV; v += 2) {
        bf16_row_pairs2(even + v * kLanes, odd ? odd + v * kLanes : nullptr, bv[v], bv[v + 1]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      vu const av = vu{} + ap[m * pairs + q];
#pragma GCC unroll 8
      for (int v = 0; v < CV; ++v) { acc[m][v] = vdot_bf16(acc[m][v], av, bv[v]); }
    }
  }
  float* c = g.c + int64_t(n0) * g.ldc;
  alignas(64) float row[kCols];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
    if constexpr (CV > 1) {
#pragma GCC unroll 8
      for (int v = 0; v < CV; v += 2) { unpermute_pairs2(acc[m][v], acc[m][v + 1]); }
    }
    // Stored as vectors, read as scalars (a vector load of scalar stores would stall on store forwarding).
#pragma GCC unroll 8
    for (int v = 0; v < CV; ++v) { vstore(row + v * kLanes, acc[m][v]); }
    for (int j = 0; j < kCols; ++j) { c[m + j * g.ldc] += row[j]; }
  }
}

template <int R>
constexpr int small_pair_col_vectors() {  // accumulators R x CV, plus CV B vectors and one broadcast; CV even
  constexpr int cv = (kAccRegs - 1) / (R + 1) / 2 * 2;
  return cv < 2 ? 2 : cv > 8 ? 8 : cv;
}

// Rows up to which Q.K^T takes the dot products (gemm_bf16_few_rows says why).
constexpr int kSmallDotRows = kSmallRows < 6 ? kSmallRows : 6;

// An overwriting product arrives here only Q.K^T-shaped (gemm_bf16_few_rows clears C for P.V): its first
// depth chunk stores its sums, the later ones add theirs.
template <int R>
void small_bf16_gemm(HostGemmArgs const& in, bool cols_contiguous) {
  alignas(64) uint32_t ap[R * kSmallDepth / 2];
  int const n_vec = in.cols / kLanes * kLanes;
  HostGemmArgs g = in;
  for (int k0 = 0; k0 < g.depth; k0 += kSmallDepth, g.overwrite = false) {
    int const depth = g.depth - k0 < kSmallDepth ? g.depth - k0 : kSmallDepth;
    int const pairs = ((depth + 1) / 2 + kLanes - 1) / kLanes * kLanes;
    pack_small_pairs<R>(g, k0, depth, pairs, ap);
    if (cols_contiguous) {
      constexpr int CV = small_pair_col_vectors<R>();
      int n = 0;
      for (; n + CV * kLanes <= n_vec; n += CV * kLanes) { small_bf16_rows_block<R, CV>(g, ap, pairs, n, k0, depth); }
      for (; n + 2 * kLanes <= n_vec; n += 2 * kLanes) { small_bf16_rows_block<R, 2>(g, ap, pairs, n, k0, depth); }
      for (; n < n_vec; n += kLanes) { small_bf16_rows_block<R, 1>(g, ap, pairs, n, k0, depth); }
    } else if constexpr (R <= kSmallDotRows) {  // (gemm_bf16_few_rows sends no more rows here)
      constexpr int NK = small_keys<R>();
      int n = 0;
      for (; n + NK <= g.cols; n += NK) { small_bf16_dots_block<R, NK>(g, ap, pairs, n, k0, depth); }
      for (; n < g.cols; ++n) { small_bf16_dots_block<R, 1>(g, ap, pairs, n, k0, depth); }
    }
  }
  if (cols_contiguous && n_vec < g.cols) {  // the last few columns, by the blocks
    HostGemmArgs rest = g;
    rest.c += int64_t(n_vec) * g.ldc;
    rest.b = offset(g.b, n_vec, HostDType::kBF16);
    rest.cols = g.cols - n_vec;
    gemm_bf16_dot(rest);
  }
}

template <int R>
void small_bf16_gemm_rows(HostGemmArgs const& g, bool cols_contiguous) {
  if constexpr (R < kSmallRows) {
    if (g.rows > R) { return small_bf16_gemm_rows<R + 1>(g, cols_contiguous); }
  }
  small_bf16_gemm<R>(g, cols_contiguous);
}

// Whether the bf16 few-rows path takes the product (and then computes it): fp32 A (Q, P), bf16 B with one
// of its dimensions contiguous.  The dot products only up to 6 rows: per 16 outputs they cost R x depth / 32
// vdpbf16ps plus one 45-instruction vsum_each, against depth / 2 vdpbf16ps (and as many broadcast loads)
// for gemm_bf16_dot's 16-row vectors, which break even at 7-8 rows (measured on a Zen 4, 128 keys, d = 128:
// 0.24-0.75x the time at 1-6 rows, 1.07x at 7, 1.01x at 8; the interleaved P.V 0.18-0.80x at 1-8).
bool gemm_bf16_few_rows(HostGemmArgs const& g) {
  if (g.rows > kSmallRows || g.a_type != HostDType::kF32 || g.b_type != HostDType::kBF16) { return false; }
  bool const cols_contiguous = g.b_ns == 1 && g.cols >= kLanes;
  if (!cols_contiguous && (g.b_ks != 1 || g.rows > kSmallDotRows)) { return false; }
  small_bf16_gemm_rows<1>(cols_contiguous ? accumulating(g) : g, cols_contiguous);
  return true;
}
#endif  // FLASH_EXT_ISA_BF16_DOT && !FLASH_EXT_ISA_HAS_TILES

// Whether the few-rows path takes the product (and then computes it).
bool gemm_few_rows(HostGemmArgs const& g) {
  if (g.rows > kSmallRows || g.a_type != HostDType::kF32) { return false; }
  if (FLASH_EXT_ISA_BF16_DOT && g.b_type == HostDType::kBF16) { return false; }  // vdpbf16ps's rounding
  bool const cols_contiguous = g.b_ns == 1 && g.cols >= kLanes;
  bool const depth_contiguous = g.b_ks == 1 && g.depth % kLanes == 0;
  if (!cols_contiguous && !depth_contiguous) { return false; }
  small_gemm_rows<1>(g, cols_contiguous);  // overwriting as small_gemm does it
  return true;
}

void gemm(HostGemmArgs const& in) {
  if (in.rows <= 0 || in.cols <= 0) { return; }
#if FLASH_EXT_ISA_HAS_TILES
  // The tiles start from zero themselves.
  if (in.depth > 0 && in.b_type == HostDType::kBF16 && in.a_type != HostDType::kF16) {
    if (tiles_few_rows_pv(in)) { return; }
    return gemm_tiles<1>(in);
  }
#endif
  if (in.depth <= 0) {
    if (in.overwrite) { zero_c(in); }
    return;
  }
#if FLASH_EXT_ISA_BF16_DOT
  if (in.b_type == HostDType::kBF16 && in.a_type != HostDType::kF16) {
#if !FLASH_EXT_ISA_HAS_TILES
    if (gemm_bf16_few_rows(in)) { return; }
#endif
    return gemm_bf16_dot(accumulating(in));
  }
#endif
  if (gemm_few_rows(in)) { return; }
#if FLASH_EXT_ISA_HAS_TILES
  // fp16 and fp32 B split into bf16 tile products (gemm_tiles<2>, <3>), except for up to 16 rows (decode
  // steps, one token or a GQA group as rows: bound by reading K and V, which the split would pack, in 2-3
  // pieces, before its first product; a 16-row group measured ~1.15x the time split).  fp32 only where B is a
  // K/V tile that a cache keeps packed for later GEMMs (the forward's prefill): packed per GEMM, its 3 pieces
  // and A's cost more than the products save (the backward's GEMMs measured 1.2x the time).
  constexpr int kSplitMinRows = 17;
  if (in.rows >= kSplitMinRows && in.b_type == HostDType::kF16) { return gemm_tiles<2>(in); }
  if (in.rows >= kSplitMinRows && in.b_type == HostDType::kF32 && in.b_cache != nullptr) { return gemm_tiles<3>(in); }
#endif
  gemm_blocks(in);  // starts its accumulators from zero itself when overwriting
}

void gemm_blocks(HostGemmArgs const& g) {
  alignas(64) float abuf[kAScratch];
  alignas(64) float bbuf[kBScratch];
  int const rows = (g.rows + kLanes - 1) / kLanes * kLanes;
  // Chunks of depth and columns whose widened B fits the scratch (fp32 B is used in place).
  int kc = g.depth < 256 ? g.depth : 256;
  int nc = g.cols;
  if (g.b_type != HostDType::kF32) {
    while (widened_span(widened_strides(g, nc, kc), nc, kc) > kBScratch) {
      if (nc > 1 && (g.b_ns >= g.b_ks || kc == 1)) {
        nc = (nc + 1) / 2;
      } else {
        kc = (kc + 1) / 2;
      }
    }
  }
  for (int k0 = 0; k0 < g.depth; k0 += kc) {
    int const depth = g.depth - k0 < kc ? g.depth - k0 : kc;
    for (int n0 = 0; n0 < g.cols; n0 += nc) {
      int const ncols = g.cols - n0 < nc ? g.cols - n0 : nc;
      float const* b;
      WidenedB w{g.b_ns, g.b_ks};
      if (g.b_type == HostDType::kF32) {
        b = static_cast<float const*>(g.b) + int64_t(n0) * g.b_ns + int64_t(k0) * g.b_ks;
      } else {
        w = widened_strides(g, ncols, depth);
        widen_b(g, n0, k0, ncols, depth, w, bbuf);
        b = bbuf;
      }
      // Overwriting: the first depth chunk's accumulators start from zero, so C is never cleared in memory
      // and loaded back (the S = Q.K^T of every prefill tile, 64 KiB at 128 x 128).
      bool const zero_start = g.overwrite && k0 == 0;
      int m0 = 0;
      for (; m0 + kRowsPerBlock <= rows; m0 += kRowsPerBlock) {
        gemm_rows<kMaxRowVectors>(g, m0, n0, k0, ncols, depth, b, w.ns, w.ks, abuf, zero_start);
      }
      for (; m0 < rows; m0 += kLanes) { gemm_rows<1>(g, m0, n0, k0, ncols, depth, b, w.ns, w.ks, abuf, zero_start); }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Online-softmax step (HostSoftmaxArgs), in one pass over the scores where no row's maximum moves far.
// softmax.h's rescale_o reads a tile twice (the row maxima, then the exponentials) and rescales O whenever a
// maximum moves.  Here a row's reference (row_max) moves only when a score exceeds it by more than
// kHostSoftmaxSlack in the exp2 domain (host_isa.h), so the probabilities are at most 256 (fp32 has room for
// that many times any tile's sum) and in the steady state, most tiles after the first few, S is read once and
// O not at all (a prefill call measured 4-7% faster than with the maxima pass: docs/perf.md).  The result
// differs from rescale_o by rounding only: O / row_sum and row_max + log2(row_sum) / scale do not depend on
// the reference, which stays a score the row has seen (so a row with a visible key still has sum >= 1).
// When some row of a vector does move (always at a tile's first column where the reference is -inf: the
// first tile, rows that saw only masked keys so far), the maxima of the columns not yet exponentiated are
// taken for every row of the vector and each row that would move anywhere in the tile moves once, to its
// maximum over those columns; the probabilities already written for the vector, its sums and (after the
// first tile) its O are scaled by the correction.  So a tile costs at most one extra pass per vector of
// rows, what rescale_o always pays, however the scores are ordered.

FLASH_EXT_INLINE vf safe_ref(vf ref, vf neg_inf) {
  // A reference of -inf (only masked keys so far) subtracts 0: exp2(-inf - 0) = 0, not exp2(-inf + inf).
  return ref == neg_inf ? vf{} : ref;
}

void softmax_rescale(HostSoftmaxArgs const& a) {
  // The arguments as locals: the stores through float pointers below could otherwise alias them (the
  // build has no strict aliasing), and every column would reload them.
  int const rows = (a.rows + kLanes - 1) / kLanes * kLanes, cols = a.cols, o_cols = a.o_cols;
  int64_t const lds = a.lds, ldo = a.ldo;
  bool const first = a.first;
  vf const scale = vsplat(a.scale_log2);
  vf const neg_inf = vsplat(-__builtin_inff());
  vf const slack = vsplat(kHostSoftmaxSlack);
  constexpr bool kRangeTest = !FLASH_EXT_ISA_HAS_SCALEF;
  vf const lowest = vsplat(-126.f);  // vexp2_in_range's lower end
#if FLASH_EXT_ISA_HAS_TILES
  // P left as pack_a_all lays out A for the tile GEMM: blocks of 32 rows, then one of 16, each [pair][row].
  // Only where gemm_tiles takes it whole from the cache (tiles_use_packed_a, and O's columns whole tiles, none
  // left to gemm_bf16_dot): S keeps the scores, so the pairs are P's only copy.
  int const pairs = tile_pairs(cols);
  uint32_t* const p_pairs =
      a.p_pairs != nullptr && tiles_use_packed_a(rows, cols, 1, a.p_pairs->bytes) && o_cols % 16 == 0
          ? static_cast<uint32_t*>(a.p_pairs->data)
          : nullptr;
#endif
  for (int m0 = 0; m0 < rows; m0 += kLanes) {
    float* const s = a.s + m0;
#if FLASH_EXT_ISA_HAS_TILES
    // Pairs from the registers as the columns are computed: S's columns are 512 bytes apart at 128 rows, so a
    // row vector's 128 columns fall into 8 of L1's 64 sets and are gone by the time a second pass reads them.
    bool const pack = p_pairs != nullptr;
    int const block = m0 / 32 * 32, height = block + 32 <= rows ? 32 : 16;
    uint32_t* const pair_out = pack ? p_pairs + int64_t(block) * pairs + (m0 - block) : nullptr;
    auto const put_pair = [&](int q, vf even, vf odd) {
      vu const pair = vbf16_pairs(even, odd);
      __builtin_memcpy(pair_out + q * height, &pair, sizeof(pair));
    };
    vf p_even{};  // the last even column's probabilities, until its odd neighbour comes
#endif
    vf ref = first ? neg_inf : vload(a.row_max + m0);
    vf base = safe_ref(ref, neg_inf);
    // A row moves when (x - base) * scale exceeds its limit: the slack, or -inf while the reference is
    // -inf (any score above -inf moves it).  NaN compares false: it never moves a reference, and exp2(NaN)
    // carries it into the sum.
    auto const limit_of = [&](vf r) { return r == neg_inf ? neg_inf : slack; };
    vf limit = limit_of(ref);
    vf sum = first ? vf{} : vload(a.row_sum + m0);
    float* sn = s;
    for (int n = 0; n < cols; ++n, sn += lds) {
      vf const x = vload(sn);
      // The difference first, then the scale: exact for the maximum (exp2(0) = 1, so a row that saw a key
      // has sum >= 1) and for scores near it.  x * scale - base * scale as one FMA rounds base * scale by up
      // to half an ulp, which reaches 1 at 2^24 and overflows exp2 past 2^32 (or the maximum weighs nothing):
      // large but finite inputs gave inf or NaN.
      vf y = (x - base) * scale;
      vf p;
      // The common case in one test.  Bit-arithmetic levels: every lane from -126 to the limit, so no row moves
      // and exp2 needs none of its range masks (a compare and an or more in the test, five operations fewer in
      // exp2 on AVX2: the softmax step 0.40-0.43 -> 0.35 ns per score on Zen 3, docs/perf.md); masked keys
      // (-inf), scores far below the reference and NaN take vexp2.  Scalef levels: their exp2 saves one
      // operation that way and the test costs two, so they test for a move only.
      if (kRangeTest ? !any_outside(y, lowest, limit) : !any_greater(y, limit)) [[likely]] {
        p = kRangeTest ? vexp2_in_range(y) : vexp2(y);
      } else {
        if (any_greater(y, limit)) {
          vf rest_max = x;
          for (int j = n + 1; j < cols; ++j) { rest_max = vmax(rest_max, vload(s + j * lds)); }
          auto const moves = (rest_max - base) * scale > limit;
          vf const new_ref = moves ? rest_max : ref;
          vf const new_base = safe_ref(new_ref, neg_inf);
          // exp2(old - new) <= 2^-slack where a row moves from a finite reference; 0 from -inf (its history is
          // zero: nothing to keep, and never inf * 0); 1 elsewhere (exact: those lanes are unchanged).
          vf const correction = moves ? (ref == neg_inf ? vf{} : vexp2((ref - new_base) * scale)) : vsplat(1.f);
#if FLASH_EXT_ISA_HAS_TILES
          if (pack) {  // S still holds the scores: the pairs written so far again, exponentiated anew
            auto const p_at = [&](int j) { return vexp2((vload(s + j * lds) - new_base) * scale); };
            for (int q = 0; q < n / 2; ++q) { put_pair(q, p_at(2 * q), p_at(2 * q + 1)); }
            if (n & 1) { p_even = p_at(n - 1); }
          } else
#endif
          {
            for (int j = 0; j < n; ++j) { vstore(s + j * lds, vload(s + j * lds) * correction); }
          }
          sum *= correction;
          if (!first) {  // the first tile's O is not there yet: the first P.V writes it (kernel_fwd.h)
            float* const o = a.o + m0;
            for (int j = 0; j < o_cols; ++j) { vstore(o + j * ldo, vload(o + j * ldo) * correction); }
          }
          ref = new_ref;
          base = new_base;
          limit = limit_of(ref);
          y = (x - base) * scale;
        }
        p = vexp2(y);
      }
      sum += p;
#if FLASH_EXT_ISA_HAS_TILES
      if (pack) {  // P.V reads the pairs only (host_tile_gemm); S keeps the scores
        if (n & 1) {
          put_pair(n / 2, p_even, p);
        } else {
          p_even = p;
        }
      } else {
        vstore(sn, p);
      }
#else
      vstore(sn, p);
#endif
    }
    vstore(a.row_max + m0, ref);
    vstore(a.row_sum + m0, sum);
#if FLASH_EXT_ISA_HAS_TILES
    if (pack) {  // an odd last column pairs with zero, and whole 32-deep steps are zero past the columns
      for (int q = cols / 2; q < pairs; ++q) { put_pair(q, 2 * q < cols ? p_even : vf{}, vf{}); }
    }
#endif
  }
#if FLASH_EXT_ISA_HAS_TILES
  if (p_pairs != nullptr) { *a.p_pairs = {a.p_pairs->data, a.p_pairs->bytes, a.s, rows, cols, true}; }
#endif
}

// ---------------------------------------------------------------------------------------------------------
// ScoreMask::apply's edits on a whole column-major tile (HostMaskArgs).  Its rule solved for the row: row m's
// diagonal is diag0 + m, so a key col is hidden right of the diagonal where col > diag0 + m + right, i.e. m < col -
// diag0 - right, and left of it where col < diag0 + m - left, i.e. m > col - diag0 + left.  So in each column (rows
// contiguous) the hidden scores are a prefix and a suffix of the rows, or all of them past seqlen_k: filled, not
// tested score by score (the element-wise rule on the host was a quarter of a causal prefill's time, its
// coordinates and window flags worked out per score; docs/perf.md).  The bias is |diag - key| per score, as
// exact integers converted to fp32 as ScoreMask converts them.
void mask_scores(HostMaskArgs const& a) {
  int const rows = a.rows;
  vi lane;
  for (int l = 0; l < kLanes; ++l) { lane[l] = l; }
  vf const slope = vsplat(a.alibi_slope);
  float const neg_inf = -__builtin_inff();
  for (int n = 0; n < a.cols; ++n) {
    float* const s = a.s + int64_t(n) * a.lds;
    int64_t const col = int64_t(a.col0) + n;
    if (a.bias) {  // the first row's diagonal minus the key, in int as ScoreMask::apply computes it
      int const first = int(int64_t(a.diag0) - col);
      for (int m0 = 0; m0 < rows; m0 += kLanes) {
        vi const d = lane + (first + m0);
        vf const distance = __builtin_convertvector(d < 0 ? -d : d, vf);
        vstore(s + m0, vload(s + m0) - slope * distance);
      }
    }
    if (!a.mask) { continue; }
    // Visible rows [lo, hi) of this column, in 64 bits: a window side may be any int.
    int64_t lo = 0, hi = rows;
    if (col >= a.seqlen_k) {
      hi = 0;
    } else {
      if (a.has_right) { lo = col - a.diag0 - a.right; }
      if (a.has_left) { hi = col - a.diag0 + a.left + 1; }
    }
    lo = lo < 0 ? 0 : lo > rows ? rows : lo;
    hi = hi < 0 ? 0 : hi > rows ? rows : hi;
    for (int64_t m = 0; m < lo; ++m) { s[m] = neg_inf; }  // hi <= lo: these two cover every row
    for (int64_t m = hi; m < rows; ++m) { s[m] = neg_inf; }
  }
}

// ---------------------------------------------------------------------------------------------------------
void convert(float const* src, void* dst, HostDType to, int64_t n) {
  int64_t i = 0;
  if (to == HostDType::kF32) {
    float* d = static_cast<float*>(dst);
    for (; i < n; ++i) { d[i] = src[i]; }
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst);
  alignas(64) float tail_in[kLanes];
  alignas(64) uint16_t tail_out[kLanes];
  for (; i < n; i += kLanes) {
    bool const full = i + kLanes <= n;
    float const* in = src + i;
    if (!full) {
      for (int l = 0; l < kLanes; ++l) { tail_in[l] = i + l < n ? src[i + l] : 0.f; }
      in = tail_in;
    }
    uint16_t* out = full ? d + i : tail_out;
    if (to == HostDType::kBF16) {
      vh const h = to_bf16_bits(vload(in));
      __builtin_memcpy(out, &h, sizeof(h));
    } else {
      store_f16(out, vload(in));
    }
    if (!full) {
      for (int l = 0; i + l < n; ++l) { d[i + l] = tail_out[l]; }
    }
  }
}

void exp2_rows(float* s, int64_t lds, int rows, int cols, float const* row_bias, float scale_log2, float* dp,
               int64_t ldp, float const* row_d) {
  int const vrows = (rows + kLanes - 1) / kLanes * kLanes;
  vf const scale = vsplat(scale_log2);
  for (int m0 = 0; m0 < vrows; m0 += kLanes) {
    vf const bias = vload(row_bias + m0);
    float* col = s + m0;
    if (dp == nullptr) {
      for (int n = 0; n < cols; ++n, col += lds) { vstore(col, vexp2(vload(col) * scale - bias)); }
      continue;
    }
    vf const d = row_d != nullptr ? vload(row_d + m0) : vf{};
    float* dcol = dp + m0;
    for (int n = 0; n < cols; ++n, col += lds, dcol += ldp) {
      vf const p = vexp2(vload(col) * scale - bias);
      vstore(col, p);
      vstore(dcol, p * (vload(dcol) - d));
    }
  }
}

// The row-wise moves of column-major tiles (store_rows, add_rows, rows_to_columns): blocks of kLanes rows x
// kLanes columns, transposed in registers (vtranspose), so that every load and store is a vector along the
// side that is contiguous in memory.  Element by element, these moves were a third of the backward body's
// time (docs/perf.md).

// Rows m0 .. m0 + kLanes - 1 of columns j0 .. j0 + jc - 1 of a column-major fp32 tile (column j at src + j * lds,
// src pointing at element (m0, j0)), as row vectors: rows[l] lane j = element (m0 + l, j0 + j); lanes past jc are 0.
FLASH_EXT_INLINE void load_row_block(float const* src, int64_t lds, int jc, vu* rows) {
  vu cols[kLanes];
  for (int j = 0; j < kLanes; ++j) { cols[j] = j < jc ? (vu)vload(src + int64_t(j) * lds) : vu{}; }
  vtranspose(cols, rows);
}

// row(m, j0, jc, v) for every row m < rows and block of kLanes columns j0 .. j0 + jc - 1 of a column-major fp32
// tile, v holding the row's elements of the block (lanes past jc 0): what store_rows and add_rows do per row.
template <class Row>
FLASH_EXT_INLINE void for_each_row_vector(float const* src, int64_t lds, int rows, int cols, Row&& row) {
  for (int m0 = 0; m0 < rows; m0 += kLanes) {
    int const mr = rows - m0 < kLanes ? rows - m0 : kLanes;
    for (int j0 = 0; j0 < cols; j0 += kLanes) {
      int const jc = cols - j0 < kLanes ? cols - j0 : kLanes;
      vu r[kLanes];
      load_row_block(src + m0 + int64_t(j0) * lds, lds, jc, r);
      for (int l = 0; l < mr; ++l) { row(m0 + l, j0, jc, (vf)r[l]); }
    }
  }
}

template <class Out>
FLASH_EXT_INLINE void store_rows_as(float const* src, int64_t lds, Out* dst, int64_t ldd, HostDType to, int rows,
                                    int cols) {
  for_each_row_vector(src, lds, rows, cols, [&](int m, int j0, int jc, vf v) {
    Out* const out = dst + int64_t(m) * ldd + j0;
    alignas(64) Out row[kLanes];
    if constexpr (sizeof(Out) == 4) {
      vstore(reinterpret_cast<float*>(row), v);
    } else if (to == HostDType::kBF16) {
      vh const h = to_bf16_bits(v);
      __builtin_memcpy(row, &h, sizeof(h));
    } else {
      store_f16(reinterpret_cast<uint16_t*>(row), v);
    }
    if (jc == kLanes) {
      __builtin_memcpy(out, row, sizeof(row));
    } else {
      for (int j = 0; j < jc; ++j) { out[j] = row[j]; }
    }
  });
}

void store_rows(float const* src, int64_t lds, void* dst, int64_t ldd, HostDType to, int rows, int cols) {
  if (to == HostDType::kF32) {
    store_rows_as(src, lds, static_cast<float*>(dst), ldd, to, rows, cols);
  } else {
    store_rows_as(src, lds, static_cast<uint16_t*>(dst), ldd, to, rows, cols);
  }
}

void add_rows(float const* src, int64_t lds, float* dst, int64_t ldd, int rows, int cols) {
  for_each_row_vector(src, lds, rows, cols, [&](int m, int j0, int jc, vf v) {
    float* const out = dst + int64_t(m) * ldd + j0;
    if (jc == kLanes) {
      vstore(out, vload(out) + v);
    } else {
      for (int j = 0; j < jc; ++j) { out[j] += v[j]; }
    }
  });
}

// Row m0 + l's elements j0 .. j0 + jc - 1 (0 past jc, or when l >= mr), widened to 32-bit lanes.
template <class Elem>
FLASH_EXT_INLINE vu row_lanes(Elem const* src, int64_t lds, int l, int mr, int jc) {
  typedef Elem ve __attribute__((vector_size(kLanes * sizeof(Elem))));
  ve e = {};
  Elem const* const in = src + int64_t(l) * lds;
  if (l >= mr) {
  } else if (jc == kLanes) {
    __builtin_memcpy(&e, in, sizeof(e));
  } else {
    for (int j = 0; j < jc; ++j) { e[j] = in[j]; }
  }
  return __builtin_convertvector(e, vu);
}

// Elem: uint16_t or uint32_t, moved as bits.  32-bit elements: kLanes rows x kLanes columns per transpose.
// 16-bit elements: rows m0 + 2p and m0 + 2p + 1 interleaved into the halves of one 32-bit lane per column,
// so that one transpose of kLanes such vectors yields, per column, 2 kLanes consecutive rows as they lie in
// the column-major tile: half the shuffles per element of widening each row on its own.
template <class Elem>
FLASH_EXT_INLINE void rows_to_columns_as(Elem const* src, int64_t lds, Elem* dst, int64_t ldd, int rows, int cols) {
  constexpr int kPack = 4 / int(sizeof(Elem));  // rows per 32-bit lane
  constexpr int kRows = kPack * kLanes;         // rows per block
  for (int m0 = 0; m0 < rows; m0 += kRows) {
    int const mr = rows - m0 < kRows ? rows - m0 : kRows;
    for (int j0 = 0; j0 < cols; j0 += kLanes) {
      int const jc = cols - j0 < kLanes ? cols - j0 : kLanes;
      Elem const* const block = src + int64_t(m0) * lds + j0;
      vu r[kLanes], c[kLanes];
      for (int p = 0; p < kLanes; ++p) {
        if constexpr (kPack == 1) {
          r[p] = row_lanes(block, lds, p, mr, jc);
        } else {
          r[p] = row_lanes(block, lds, 2 * p, mr, jc) | (row_lanes(block, lds, 2 * p + 1, mr, jc) << 16);
        }
      }
      vtranspose(r, c);
      for (int j = 0; j < jc; ++j) {
        Elem* const out = dst + int64_t(j0 + j) * ldd + m0;
        if (mr == kRows) {
          __builtin_memcpy(out, &c[j], sizeof(vu));
        } else {
          Elem col[kRows];
          __builtin_memcpy(col, &c[j], sizeof(vu));
          for (int l = 0; l < mr; ++l) { out[l] = col[l]; }
        }
      }
    }
  }
}

void rows_to_columns(void const* src, int64_t lds, void* dst, int64_t ldd, int elem_bytes, int rows, int cols) {
  if (elem_bytes == 4) {
    rows_to_columns_as(static_cast<uint32_t const*>(src), lds, static_cast<uint32_t*>(dst), ldd, rows, cols);
  } else {
    rows_to_columns_as(static_cast<uint16_t const*>(src), lds, static_cast<uint16_t*>(dst), ldd, rows, cols);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Dropout (HostDropoutArgs).  The contract of dropout.h, vectorised over group rows: one Philox call covers
// kLanes consecutive group rows of one group column.  Group row 8 a + r holds query rows 16 a + r and
// 16 a + 8 + r; group column 4 b + q holds key columns 16 b + 2 q + {0, 1, 8, 9}.  Of a lane's 128 bits,
// word w = rowhalf + 2 colhalf serves row 16 a + r + 8 rowhalf, and its low / high 16 bits the even / odd
// column of the column half: so each (word, half) compared with the threshold gives one column's bits for
// kLanes rows at once, already in the accumulator's row order.

// A Philox word of kLanes counters (philox.h's Word): internal linkage, so philox4x32_10's instantiation
// for it stays this level's own (host_isa.h says why that matters).
struct PhiloxVec {
  vu v;
};
FLASH_EXT_INLINE PhiloxVec operator^(PhiloxVec a, PhiloxVec b) { return {a.v ^ b.v}; }
FLASH_EXT_INLINE PhiloxVec operator+(PhiloxVec a, uint32_t b) { return {a.v + b}; }
// The 32 x 32 -> 64-bit products of every lane: the level's even-lane widening multiply (pmuludq) on the
// even lanes and, shifted down, on the odd ones; the low halves by a plain 32-bit multiply.
FLASH_EXT_INLINE PhiloxVec philox_mul_hi_lo(uint32_t m, PhiloxVec x, PhiloxVec& hi) {
  typedef uint64_t v64 __attribute__((vector_size(sizeof(vu))));
  vu const mv = vu{} + m;
  v64 const even = (v64)vmul_even_u32(x.v, mv);
  v64 const odd = (v64)vmul_even_u32((vu)((v64)x.v >> 32), mv);
  hi.v = (vu)((even >> 32) | (odd & 0xffffffff00000000ull));
  return {x.v * m};
}

void dropout_keep(HostDropoutArgs const& d) {
  constexpr int kRun = kLanes < 8 ? kLanes : 8;  // lanes of one 16-row block: a run of adjacent bits
  int const live_rows = d.live_rows < d.rows ? d.live_rows : d.rows;
  int const group_rows = 8 * ((live_rows + 15) / 16);
  for (int w = 0; w < d.rows * d.cols / 32; ++w) { d.words[w] = 0; }
  vu lane = {};
  for (int l = 0; l < kLanes; ++l) { lane[l] = uint32_t(l); }
  PhiloxVec const bh{vu{} + d.bh}, offset_lo{vu{} + d.offset_lo}, key0{vu{} + d.key0}, key1{vu{} + d.key1};
  vi const threshold = vi{} + int32_t(d.threshold);  // <= 65536: signed compares are exact
  uint32_t const grow0 = uint32_t(8 * (d.row0 / 16)), gcol0 = uint32_t(4 * (d.col0 / 16));
  for (int gc = 0; gc < d.cols / 4; ++gc) {
    int const col = 16 * (gc / 4) + 2 * (gc % 4);  // the group's first column within the tile
    PhiloxVec const gcol{vu{} + (gcol0 + uint32_t(gc))};
    for (int gr = 0; gr < group_rows; gr += kLanes) {
      PhiloxVec const grow{lane + (grow0 + uint32_t(gr))};
      Philox4<PhiloxVec> const x = philox4x32_10<PhiloxVec>(gcol, grow, bh, offset_lo, key0, key1);
#pragma GCC unroll 4
      for (int w = 0; w < 4; ++w) {
        int const row_half = w % 2, col_half = w / 2;
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          vi const r = (vi)((x.x[w].v >> (16 * half)) & 0xffffu);
          uint32_t const keep = vmovemask(r < threshold);  // bit l: group row gr + l
          int const n = col + half + 8 * col_half;
          for (int l0 = 0; l0 < kLanes && gr + l0 < group_rows; l0 += kRun) {
            int const g = gr + l0;
            int const bit = 16 * (g / 8) + g % 8 + 8 * row_half + d.rows * n;  // a run never crosses a word
            d.words[bit / 32] |= ((keep >> l0) & ((1u << kRun) - 1u)) << (bit % 32);
          }
        }
      }
    }
  }
}

void dropout_apply(float* p, int64_t ldp, int rows, int cols, int live_rows, uint32_t const* words) {
  int const live = live_rows < rows ? live_rows : rows;
  vu lane_bit = {};
  for (int l = 0; l < kLanes; ++l) { lane_bit[l] = 1u << l; }
  for (int n = 0; n < cols; ++n) {
    for (int m0 = 0; m0 < live; m0 += kLanes) {
      int const bit = m0 + rows * n;  // kLanes divides 16 and rows: a vector's bits share a word
      uint32_t const keep = words[bit / 32] >> (bit % 32);
      vi const kept = (vi)(((vu{} + keep) & lane_bit) != 0);
      float* x = p + m0 + n * ldp;
      vstore(x, kept ? vload(x) : vf{});  // a select: a dropped NaN or inf score becomes 0 too
    }
  }
}

constexpr HostKernels kKernels{kIsa,          kName,          kLanes,          &gemm,
                               &softmax_rescale, &mask_scores, &convert,     &dropout_keep,   &dropout_apply,
                               &store_rows,   &add_rows,      &rows_to_columns, &exp2_rows,
                               FLASH_EXT_ISA_HAS_TILES != 0, FLASH_EXT_ISA_HAS_TILES != 0,
                               FLASH_EXT_ISA_HAS_TILES != 0};

#undef FLASH_EXT_INLINE

}  // namespace
}  // namespace flash_ext
