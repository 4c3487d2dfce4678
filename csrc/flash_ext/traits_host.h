// Host traits: the single-thread instance of the same kernel body.  One "thread" owns the whole tile;
// copies are plain loads/stores; cp.async fences and barriers have nothing to order; a row reduction needs
// no partner.
//
// The MMA atom is one scalar multiply-add (1x1x1): it only gives the fragments their layouts, in which a
// tile is a plain column-major matrix — query rows contiguous — so that the per-element work can run as
// vector code down the columns.  That work does not go through the atom: the body's GEMM steps, the
// online-softmax step and the output conversion reach, through hooks (TileGemm in gemm.h,
// softmax_rescale_o and convert below), the micro-kernels of the CPU's instruction-set level (host_isa.h),
// one call per tile.  The body is compiled once, for the baseline target; only those micro-kernels are
// compiled per level.
#pragma once

#include <cmath>
#include <cstring>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_types.h>

#include "gemm.h"
#include "global_memory.h"
#include "mask.h"
#include "host_isa.h"

namespace flash_ext {

// Widening of one input element to fp32 (the scalar path of the atom; the micro-kernels widen a vector at
// a time).
template <class T>
inline float host_to_float(T x) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    uint32_t bits = uint32_t(x.raw()) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return float(x);
  }
}

// exp2 for scalar uses (the vector micro-kernels have the same function, kLanes at a time): range reduction
// x = n + f, f in [-0.5, 0.5], then a degree-6 polynomial for 2^f, relative error ~2e-7, below bf16/fp16
// output rounding and the fp32 accumulation error of P.V.  Inputs below -126 (including -inf from masking)
// give exactly 0, as masked probabilities must.
inline float host_exp2(float x) {
  float const xc = x > 127.f ? 127.f : (x < -126.f ? -126.f : x);
  float const n = (xc + 12582912.f) - 12582912.f;  // round to nearest even
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

template <class T>
constexpr HostDType host_dtype() {
  if constexpr (std::is_same_v<T, float>) {
    return HostDType::kF32;
  } else if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    return HostDType::kBF16;
  } else {
    static_assert(std::is_same_v<T, cutlass::half_t>, "host operands are fp32, bf16 or fp16");
    return HostDType::kF16;
  }
}

// The micro-kernels of the running call (the launcher sets them per CTA), else those of the selected level.
inline HostKernels const& host_kernels() {
  HostKernels const* k = host_cta_context().kernels;
  return *(k != nullptr ? k : host_kernels_for(host_isa_selected()));
}

// D = A * B + C on one element: the atom.  The body's GEMMs do not use it (TileGemm below takes whole
// tiles); it keeps cute::gemm on host fragments correct for any other caller.
template <class T>
struct HostFma {
  using DRegisters = float[1];
  using ARegisters = T[1];
  using BRegisters = T[1];
  using CRegisters = float[1];
};

}  // namespace flash_ext

namespace cute {

template <class T>
struct MMA_Traits<flash_ext::HostFma<T>> {
  using ValTypeD = float;
  using ValTypeA = T;
  using ValTypeB = T;
  using ValTypeC = float;
  // A register fragment (Q, loaded once per CTA) holds fp32: widened once, not in every tile's GEMM.
  using FrgTypeA = float;
  using Shape_MNK = Shape<_1, _1, _1>;
  using ThrID = Layout<_1>;
  using ALayout = Layout<Shape<_1, _1>>;  // (thr, val) -> (m, k)
  using BLayout = Layout<Shape<_1, _1>>;  // (thr, val) -> (n, k)
  using CLayout = Layout<Shape<_1, _1>>;  // (thr, val) -> (m, n)
};

// Found by argument-dependent lookup from MMA_Atom::call.  A may hold fp32 (P in the P.V step) as well as T.
template <class T, class TD, class DLayout, class TA, class ALayout, class TB, class BLayout, class TC,
          class CLayout>
inline void mma_unpack(MMA_Traits<flash_ext::HostFma<T>> const&, Tensor<TD, DLayout>& D,
                       Tensor<TA, ALayout> const& A, Tensor<TB, BLayout> const& B, Tensor<TC, CLayout> const& C) {
  D(0) = flash_ext::host_to_float(A(0)) * flash_ext::host_to_float(B(0)) + C(0);
}

}  // namespace cute

namespace flash_ext {

// Shared memory -> fp32 register fragment, one element: the widening load of Q into its A fragment.
template <class T>
struct HostWidenCopy {
  using SRegisters = T[1];
  using DRegisters = float[1];
};

// Global <-> shared copies of N consecutive elements: one unaligned N-element move (memcpy) when both
// sides are contiguous, else element by element (a partial tile's rows into a column-major tile; whole
// tiles go through the level's transposing micro-kernel, cute::copy below).
// No alignment is assumed of the caller's tensors on the CPU.
template <class T, int N>
struct HostVectorCopy {
  using SRegisters = T[N];
  using DRegisters = T[N];
};

// The whole-tile copies from global memory (cute::copy below, host_mirror_tile) prefetch each row's counterpart
// in the tile walked next and the rows this far ahead in their own tile.
inline constexpr int kHostCopyRowsAhead = 8;

// Every 64-byte line of `bytes` bytes from `addr`, an integer: a neighbouring tile's rows may lie outside the
// tensor, which a prefetch may name (it never faults) but pointer arithmetic may not.
inline void host_prefetch_lines(uintptr_t addr, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) { __builtin_prefetch(reinterpret_cast<void const*>(addr + uintptr_t(b))); }
}

}  // namespace flash_ext

namespace cute {

template <class T, int N>
struct Copy_Traits<flash_ext::HostVectorCopy<T, N>> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, Int<N * sizeof_bits_v<T>>>>;  // (thr, bits)
  using DstLayout = SrcLayout;
  using RefLayout = SrcLayout;
};

// Both layouts count elements of T: the tiled copies partition T tiles, the destination just holds fp32.
template <class T>
struct Copy_Traits<flash_ext::HostWidenCopy<T>> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, Int<sizeof_bits_v<T>>>>;
  using DstLayout = SrcLayout;
  using RefLayout = SrcLayout;
};

template <class T, class SEngine, class SLayout, class DEngine, class DLayout>
inline void copy_unpack(Copy_Traits<flash_ext::HostWidenCopy<T>> const&, Tensor<SEngine, SLayout> const& src,
                        Tensor<DEngine, DLayout>& dst) {
  static_assert(std::is_same_v<typename DEngine::value_type, float>);
  dst(0) = flash_ext::host_to_float(src(0));
}

template <class T, int N, class SEngine, class SLayout, class DEngine, class DLayout>
inline void copy_unpack(Copy_Traits<flash_ext::HostVectorCopy<T, N>> const&, Tensor<SEngine, SLayout> const& src,
                        Tensor<DEngine, DLayout>& dst) {
  using Contiguous = Layout<Int<N>, _1>;
  if constexpr (std::is_same_v<decltype(coalesce(SLayout{})), Contiguous> &&
                std::is_same_v<decltype(coalesce(DLayout{})), Contiguous>) {
    std::memcpy(raw_pointer_cast(&dst(0)), raw_pointer_cast(&src(0)), N * sizeof(T));
  } else {
    for (int i = 0; i < N; ++i) { dst(i) = src(i); }
  }
}

// A whole shared -> register operand, (CPY, CPY_M, CPY_K), widened to fp32 (Q's fragment, once per CTA; the
// backward's operands): column by column, so that the innermost loop runs down contiguous rows on both sides,
// whatever the destination's column padding (make_a_fragment), rather than through the atom one element at a
// time in cute's order.
template <class T, class TV, class Tiler, class SEngine, class SLayout, class DEngine, class DLayout>
inline void copy(TiledCopy<Copy_Atom<flash_ext::HostWidenCopy<T>, T>, TV, Tiler> const& tiled_copy,
                 Tensor<SEngine, SLayout> const& src, Tensor<DEngine, DLayout>& dst) {
  if constexpr (SLayout::rank == 3 && DLayout::rank == 3) {
    static_assert(decltype(size(src))::value == decltype(size(dst))::value);
    for (int k = 0; k < int(size<2>(src)); ++k) {
      for (int m = 0; m < int(size<1>(src)); ++m) {
        for (int v = 0; v < int(size<0>(src)); ++v) { dst(v, m, k) = flash_ext::host_to_float(src(v, m, k)); }
      }
    }
  } else {
    copy(static_cast<Copy_Atom<flash_ext::HostWidenCopy<T>, T> const&>(tiled_copy), src, dst);
  }
}

// A whole global -> shared tile, (CPY, CPY_M, CPY_K): row by row, each row's next-tile counterpart
// prefetched.  The body walks K/V tiles right to left, so the tile copied next lies kBlockN rows below this
// one (a paged or varlen layout may put it elsewhere: a prefetch of the wrong lines costs a little
// bandwidth, never a fault).  Without it the copies stalled on memory (about 8% of a prefill call at d=64).
template <class T, int N, class TV, class Tiler, class SEngine, class SLayout, class DEngine, class DLayout>
inline void copy(TiledCopy<Copy_Atom<flash_ext::HostVectorCopy<T, N>, T>, TV, Tiler> const& tiled_copy,
                 Tensor<SEngine, SLayout> const& src, Tensor<DEngine, DLayout>& dst) {
  using Atom = Copy_Atom<flash_ext::HostVectorCopy<T, N>, T>;
  if constexpr (SLayout::rank == 3 && is_gmem<SEngine>::value) {
    int64_t const tile_step = int64_t(size<1>(src)) * int64_t(stride<1>(src));
    int const row_bytes = int(size<0>(src) * size<2>(src)) * int(sizeof(T));
    int const rows = int(size<1>(src));
    // Rows a few ahead in this tile too: the next-tile prefetch does not cover a tile nobody walked to
    // (a CTA's Q, its first K/V tile), whose rows otherwise miss one by one.
    constexpr int kRowsAhead = flash_ext::kHostCopyRowsAhead;
    auto prefetch_row = [&](char const* row) {
      flash_ext::host_prefetch_lines(reinterpret_cast<uintptr_t>(row), row_bytes);
    };
    for (int m = 0; m < kRowsAhead && m < rows; ++m) {
      prefetch_row(reinterpret_cast<char const*>(raw_pointer_cast(&src(0, m, 0))));
    }
    if constexpr (decltype(rank(coalesce(layout<1>(DLayout{}))))::value == 1 &&
                  decltype(stride(coalesce(layout<1>(DLayout{}))))::value == 1) {
      // A column-major tile (Q; the backward's Q and dO, once per query tile): rows become columns through
      // the level's transposing micro-kernel rather than element by element, kStep rows per call (a whole
      // block of the micro-kernel at 16-bit elements; two of 16 rows at fp32 with 16 lanes).  The tile
      // walked next is the one above (the backward's query tiles ascend).
      using S0 = decltype(coalesce(layout<0>(SLayout{})));
      using S2 = decltype(coalesce(layout<2>(SLayout{})));
      using D0 = decltype(coalesce(layout<0>(DLayout{})));
      using D2 = decltype(coalesce(layout<2>(DLayout{})));
      static_assert(S0::rank == 1 && S2::rank == 1 && D0::rank == 1 && D2::rank == 1 &&
                        decltype(stride(S0{}))::value == 1 && decltype(stride(S2{}))::value == N &&
                        decltype(stride(D2{}))::value == N * decltype(stride(D0{}))::value,
                    "whole rows of the source, whole columns of the destination");
      constexpr int64_t kColumnStride = decltype(stride(D0{}))::value;
      constexpr int kStep = 32;
      flash_ext::HostKernels const& k = flash_ext::host_kernels();
      for (int m = kRowsAhead; m < kStep && m < rows; ++m) {
        prefetch_row(reinterpret_cast<char const*>(raw_pointer_cast(&src(0, m, 0))));
      }
      for (int m0 = 0; m0 < rows; m0 += kStep) {
        for (int m = m0; m < m0 + kStep && m < rows; ++m) {  // the next block's rows, and this one's next tile
          if (m + kStep < rows) { prefetch_row(reinterpret_cast<char const*>(raw_pointer_cast(&src(0, m + kStep, 0)))); }
          prefetch_row(reinterpret_cast<char const*>(raw_pointer_cast(&src(0, m, 0)) + tile_step));
        }
        k.rows_to_columns(raw_pointer_cast(&src(0, m0, 0)), int64_t(stride<1>(src)), raw_pointer_cast(&dst(0, m0, 0)),
                          kColumnStride, int(sizeof(T)), rows - m0 < kStep ? rows - m0 : kStep,
                          row_bytes / int(sizeof(T)));
      }
      return;
    }
    for (int m = 0; m < rows; ++m) {
      prefetch_row(reinterpret_cast<char const*>(raw_pointer_cast(&src(0, m, 0)) - tile_step));
      if (m + kRowsAhead < rows) {
        prefetch_row(reinterpret_cast<char const*>(raw_pointer_cast(&src(0, m + kRowsAhead, 0))));
      }
      copy(static_cast<Atom const&>(tiled_copy), src(_, m, _), dst(_, m, _));
    }
  } else {
    copy(static_cast<Atom const&>(tiled_copy), src, dst);
  }
}

}  // namespace cute

namespace flash_ext {

template <class T>
using HostTiledMma = cute::TiledMMA<cute::MMA_Atom<HostFma<T>>, cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>>;

// A host operand as the micro-kernels take it: a (1, ROWS, COLS) partition of the 1x1x1 atom is the
// matrix itself, so its two strides are all there is to know.
struct HostOperand {
  void const* ptr;
  HostDType type;
  int64_t row_stride, col_stride;
  int rows, cols;
};

// The one stride of a mode that steps through memory evenly (a size-1 mode: any, 0).
template <class Layout>
constexpr int64_t host_mode_stride(Layout const& mode) {
  auto const flat = cute::coalesce(mode);
  static_assert(decltype(cute::rank(flat))::value == 1, "host tile modes step through memory evenly");
  return int64_t(cute::stride(flat));
}

// The copy of a whole K/V tile (`rows` rows of row_elems elements, row_stride apart) in `mirror`: found, or
// made now where there is room; nullptr where there is none.  Lookups start after the last hit: row blocks walk
// a head's tiles in the order the first one copied them.  Made like the staged copy (cute::copy above): each
// row's counterpart in the tile walked next (the one below) and the rows a few ahead prefetched.
template <class T>
void const* host_mirror_tile(HostKvMirror& mirror, T const* tile, int64_t row_stride, int rows, int row_elems) {
  for (int j = 0; j < mirror.count; ++j) {
    int const i = (mirror.hint + j) % mirror.count;
    if (mirror.entries[i].key == tile && mirror.entries[i].key_row_stride == row_stride) {
      mirror.hint = i + 1;
      return mirror.entries[i].copy;
    }
  }
  int64_t const row_bytes = int64_t(row_elems) * int64_t(sizeof(T));
  int64_t const copy_stride = host_mirror_row_elems(row_elems, int(sizeof(T))) * int64_t(sizeof(T));
  if (mirror.count == mirror.capacity || mirror.used + rows * copy_stride > mirror.bytes) { return nullptr; }
  char* const copy = mirror.data + mirror.used;
  auto prefetch_row = [&](int m) {
    host_prefetch_lines(reinterpret_cast<uintptr_t>(tile) + uintptr_t(int64_t(m) * row_stride * int64_t(sizeof(T))),
                        row_bytes);
  };
  constexpr int kRowsAhead = kHostCopyRowsAhead;
  for (int m = 0; m < kRowsAhead && m < rows; ++m) { prefetch_row(m); }
  for (int m = 0; m < rows; ++m) {
    prefetch_row(m - rows);
    if (m + kRowsAhead < rows) { prefetch_row(m + kRowsAhead); }
    std::memcpy(copy + m * copy_stride, tile + m * row_stride, size_t(row_bytes));
  }
  mirror.entries[mirror.count++] = {tile, row_stride, copy};
  mirror.used += rows * copy_stride;
  mirror.hint = mirror.count;
  return copy;
}

template <class Tensor>
HostOperand host_operand(Tensor const& t) {
  using namespace cute;
  static_assert(decltype(rank(t))::value == 3 && decltype(size<0>(t))::value == 1,
                "host operands are (1, ROWS, COLS) partitions of the 1x1x1 atom");
  using T = std::remove_cv_t<typename std::remove_reference_t<Tensor>::value_type>;
  return {raw_pointer_cast(&t(0, 0, 0)), host_dtype<T>(), host_mode_stride(layout<1>(t)),
          host_mode_stride(layout<2>(t)), int(size<1>(t)), int(size<2>(t))};
}

// acc(m, n) += sum_k A(m, k) * B(n, k) over a whole tile (= with zero_acc), by the level's GEMM micro-kernel.
// Rows past the CTA's live rows (host_cta_context) are skipped.
template <class Acc, class A, class B>
void host_tile_gemm(Acc& acc, A const& tA, B const& tB, bool zero_acc = false) {
  HostOperand const c = host_operand(acc), a = host_operand(tA);
  HostOperand b = host_operand(tB);
  static_assert(std::is_same_v<typename Acc::value_type, float>);
  HostCtaContext const& ctx = host_cta_context();
  bool b_global = false;
  if (ctx.kv_in_place || ctx.kv_mirror != nullptr) {
    // B a K/V tile not staged (HostTraits::read_in_place): its global rows or their mirrored copy instead
    for (HostTileInPlace const& t : ctx.in_place) {
      if (t.smem != nullptr && t.smem == b.ptr) {
        b.ptr = t.gmem;
        (b.row_stride == t.smem_row_stride ? b.row_stride : b.col_stride) = t.gmem_row_stride;
        b_global = t.global;
      }
    }
  }
  // Column-major fp32 accumulators: partition_fragment_C's layout for the 1x1x1 atom, columns padded
  // (make_acc_fragment, gemm.h).
  static_assert(host_mode_stride(cute::layout<1>(typename Acc::layout_type{})) == 1);
  int const live = ctx.live_rows;
  // A's packed form, where one is kept.  P, left packed by the softmax step (HostSoftmaxArgs::p_pairs; valid
  // until this GEMM consumes it, since the next S reuses its storage).  Else Q: the forward's Q.K^T overwrites
  // S (kernel_fwd.h, kZeroS), and its A is the Q fragment, loaded once per CTA (kQInRegs), the same for every
  // K tile: the CTA's first overwriting GEMM packs it into the invalid cache, the later Q.K^T find it there
  // (the first P.V also overwrites, O, but its A is P, not the cache's key).  The backward's overwriting GEMMs
  // (kernel_bwd.h, kZeroAcc) run under a scope whose caches are null.
  HostPackCache* a_cache = nullptr;
  if (HostPackCache* const p = ctx.p_cache; p != nullptr && p->valid && p->key == a.ptr) {
    a_cache = p;
  } else if (HostPackCache* const q = ctx.q_cache; zero_acc && q != nullptr && (!q->valid || q->key == a.ptr)) {
    a_cache = q;
  }
  HostGemmArgs const g{static_cast<float*>(const_cast<void*>(c.ptr)), c.col_stride, a.ptr, a.type, a.row_stride,
                       a.col_stride, b.ptr, b.type, b.row_stride, b.col_stride,
                       c.rows < live ? c.rows : live, c.cols, a.cols, zero_acc, a_cache,
                       // Only a global tile may be kept: a staged one's address is the shared tile, refilled
                       // with every K/V tile.
                       b_global ? ctx.kv_cache : nullptr};
  host_kernels().gemm(g);
  if (a_cache != nullptr && a_cache == ctx.p_cache) { a_cache->valid = false; }
  // Rows past the live ones (rounded up to a vector) are not computed; with zero_acc they are zeroed, as a
  // cleared accumulator would hold them, rather than left as whatever the stack held.
  int const computed = (g.rows + 15) / 16 * 16;
  if (zero_acc && computed < c.rows) {
    for (int n = 0; n < c.cols; ++n) {
      std::memset(g.c + computed + int64_t(n) * g.ldc, 0, sizeof(float) * size_t(c.rows - computed));
    }
  }
}

// Whole-tile GEMMs of the host (gemm.h): A from registers (Q, P) or shared memory, B from shared memory,
// read in place — the micro-kernel widens what it needs.
template <class T>
struct TileGemm<HostTiledMma<T>> : std::true_type {
  template <class Acc, class FragA, class SmemB>
  static void rs(Acc& acc, FragA const& tCrA, SmemB const& tCsB, bool zero_acc = false) {
    host_tile_gemm(acc, tCrA, tCsB, zero_acc);
  }
  template <class Acc, class SmemA, class SmemB>
  static void ss(Acc& acc, SmemA const& tCsA, SmemB const& tCsB, bool zero_acc = false) {
    host_tile_gemm(acc, tCsA, tCsB, zero_acc);
  }
};

template <int kHeadDim_, int kBlockM_, int kBlockN_, class Element_>
struct HostTraits : PlainGlobalMemory {
  using Element = Element_;
  using ElementAccum = float;
  // P stays fp32: the micro-kernels take fp32 operands anyway (bf16 dot-product levels round it themselves).
  using ElementP = float;
  static constexpr bool kIsHost = true;

  // A CTA with kv_in_place (set by the launcher) does not stage a whole K/V tile: the tile GEMM reads the
  // global rows instead (host_tile_gemm), and this returns true in place of the copy.  Two kinds of CTA do so.
  // A decode CTA, whose split's rows the launcher has just warmed into L2: "shared memory" is ordinary memory
  // here, so the copy would read L2 and write K and V tiles (68 KiB with Q at bf16, d = 128: twice the L1) that
  // the GEMMs then read back from L2 as well (decode steps measured 9-17% more K/V bandwidth without it; bf16,
  // fp16, fp32; AVX-512 and AVX2 levels).  And a prefill CTA on a level whose GEMMs load K by tile rows from any
  // stride and pack V themselves (HostKernels::bf16_kv_in_place, AMX: 4-11% less time; f16_ and f32_kv_in_place,
  // AMX, whose split GEMMs pack both).  On the other levels in-place prefill reads were measured slower (the
  // GEMMs' broadcast loads took the memory stalls that the staged copy overlaps); there a prefill CTA with a
  // kv_mirror copies each whole tile once per call, into the thread's HostKvMirror, and the tile GEMM reads
  // that copy for the first row block and every later one (AVX2 and AVX-512 levels, bf16/fp16/fp32: 1-14% less
  // time).  Measurements: docs/perf.md.  A tile with rows past seqlen_k or head-dim padding (whole = false), or
  // one the mirror has no room for, is staged, zero-filled, as always, and its shared tile stops standing for
  // another.  Only row-major tiles of kBlockN rows qualify, i.e. sK and sV: the column-major Q tile (kBlockM
  // rows, possibly as many) is read from shared memory by a register copy, not by the tile GEMM.
  template <class S, class D>
  static bool read_in_place(S const& src, D const& dst, bool whole) {
    using namespace cute;
    if constexpr (decltype(rank(src))::value == 3 && decltype(size<1>(src))::value == kBlockN_ &&
                  is_gmem<typename S::engine_type>::value) {
      if constexpr (int64_t(decltype(stride<1>(dst)){}) == kHeadDim_) {  // (CPY, CPY_N, CPY_K): rows along mode 1
        HostCtaContext& ctx = host_cta_context();
        if (!ctx.kv_in_place && ctx.kv_mirror == nullptr) { return false; }
        void const* const smem = raw_pointer_cast(&dst(0, 0, 0));
        HostTileInPlace* slot = nullptr;
        for (HostTileInPlace& t : ctx.in_place) {
          if (t.smem == smem || (slot == nullptr && t.smem == nullptr)) { slot = &t; }
        }
        if (slot == nullptr) { return false; }  // not reached: two tiles, sK and sV
        if (!whole) {
          slot->smem = nullptr;
          return false;
        }
        auto const* const tile = raw_pointer_cast(&src(0, 0, 0));
        int64_t const row_stride = stride<1>(src);
        if (ctx.kv_in_place) {
          *slot = {smem, tile, row_stride, kHeadDim_, true};
          return true;
        }
        void const* const copy = host_mirror_tile(*ctx.kv_mirror, tile, row_stride, kBlockN_, kHeadDim_);
        if (copy == nullptr) {  // no room: staged
          slot->smem = nullptr;
          return false;
        }
        *slot = {smem, copy, host_mirror_row_elems(kHeadDim_, int(sizeof(Element))), kHeadDim_, false};
        return true;
      } else {
        return false;
      }
    } else {
      return false;
    }
  }
  // A single thread has room for the whole Q tile: load it once, not once per K tile.
  static constexpr bool kQInRegs = true;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = 1;
  static constexpr int kNThreads = 1;
  // Rows are processed in vectors of up to 16 (host_isa.h).
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0 && kBlockM % 16 == 0);

  using TiledMma = HostTiledMma<Element>;

  // Q is column-major so that its register copy, a fragment ordered like it, holds columns of query rows:
  // the A operand of Q.K^T as the micro-kernel reads it (the gather happens once per CTA).  K, V and O are
  // row-major: K's rows are the broadcast operand, V's rows feed P.V, O's rows are stored contiguously.
  using SmemLayoutQ = cute::Layout<cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>,
                                   cute::Stride<cute::_1, cute::Int<kBlockM>>>;
  using SmemLayoutKV = cute::Layout<cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>,
                                    cute::Stride<cute::Int<kHeadDim>, cute::_1>>;
  static_assert(decltype(cute::stride<0>(SmemLayoutKV{}))::value == kHeadDim, "read_in_place: dense rows");
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = SmemLayoutVt;
  using SmemLayoutO = cute::Layout<cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>,
                                   cute::Stride<cute::Int<kHeadDim>, cute::_1>>;

  // Q's shared -> register copy widens to the fp32 A fragment (FrgTypeA).  K and V are read by the tile GEMM
  // straight from shared memory; their copy atoms only shape partitions.
  using SmemCopyAtom = cute::Copy_Atom<HostWidenCopy<Element>, Element>;
  using SmemCopyAtomTransposed = SmemCopyAtom;
  using SmemCopyAtomO = cute::Copy_Atom<cute::UniversalCopy<Element>, Element>;

  // Rows move 8 elements at a time (the op requires head dims that are multiples of 8).
  using GmemLayoutAtom = cute::Layout<cute::Shape<cute::_1, cute::_1>>;
  using GmemValLayout = cute::Layout<cute::Shape<cute::_1, cute::_8>>;
  using GmemTiledCopyQKV = decltype(cute::make_tiled_copy(cute::Copy_Atom<HostVectorCopy<Element, 8>, Element>{},
                                                          GmemLayoutAtom{}, GmemValLayout{}));
  using GmemTiledCopyO = GmemTiledCopyQKV;

  static constexpr int kSmemQBytes = int(cute::cosize_v<SmemLayoutQ>) * int(sizeof(Element));
  static constexpr int kSmemKVBytes = int(cute::cosize_v<SmemLayoutKV>) * int(sizeof(Element));
  static constexpr int kSmemBytes = kSmemQBytes + 2 * kSmemKVBytes;

  // One column per atom value: the (row, col) view is the fragment's (m, n) itself.
  static constexpr int kAccValCols = 1;

  // The accumulator of S, (1, M, N), already is the A operand (1, M, K = N) of P.V.
  template <class Layout>
  static constexpr auto acc_to_a_layout(Layout acc) { return acc; }

  // Dropout (dropout.h): the keep bits of a tile and their application, by the level's micro-kernels, with
  // the bits in the (1, M, N) accumulator's column-major element order.  Rows past the live ones are skipped
  // (their bits are 0 and their P is never stored).
  template <class AccLayout, class Rng>
  static void dropout_keep_tile(uint32_t* words, Rng const& rng, int row0, int col0) {
    using namespace cute;
    static_assert(decltype(size<0>(AccLayout{}))::value == 1);
    HostDropoutArgs const a{words, int(size<1>(AccLayout{})), int(size<2>(AccLayout{})), host_cta_context().live_rows,
                            row0, col0, rng.key0, rng.key1, rng.bh, rng.offset_lo, rng.threshold};
    host_kernels().dropout_keep(a);
  }
  template <class Acc>
  static void dropout_apply_tile(Acc& acc, uint32_t const* words) {
    using namespace cute;
    using L = typename Acc::layout_type;
    static_assert(decltype(size<0>(L{}))::value == 1 && host_mode_stride(layout<1>(L{})) == 1,
                  "column-major tiles: rows contiguous");
    host_kernels().dropout_apply(&acc(0), host_mode_stride(layout<2>(L{})), int(size<1>(L{})), int(size<2>(L{})),
                                 host_cta_context().live_rows, words);
  }

  static void cp_async_fence() {}
  template <int N>
  static void cp_async_wait() {}
  static void barrier() {}
  static float exp2(float x) { return host_exp2(x); }
  static float tanh(float x) { return std::tanh(x); }
  // Round to nearest even, by the level's conversion micro-kernel.
  template <class To, int N>
  static cutlass::Array<To, N> convert(cutlass::Array<float, N> const& in) {
    cutlass::Array<To, N> out;
    host_kernels().convert(in.data(), out.data(), host_dtype<To>(), N);
    return out;
  }
  template <class To>
  static void convert_contiguous(float const* in, To* out, int n) {
    host_kernels().convert(in, out, host_dtype<To>(), n);
  }
  // The backward's P = exp2(S * scale_log2 - LSE_log2) over S and dS = P * (dP - D) over dP (subtract_d false:
  // P * dP, D already folded in by the softcap step) for a whole (ROWS, COLS) tile, in one pass of the level's
  // exp2_rows: element by element, compiled for the baseline target (one scalar exp2 at a time), the P loop
  // alone was about 40% of the backward body's time (docs/perf.md).  lse_log2 and dsum: one value per row,
  // contiguous.
  template <class Scores, class DP, class Lse, class DSum>
  static void probs_and_ds(Scores& scores, DP& dp, Lse const& lse_log2, DSum const& dsum, bool subtract_d,
                           float scale_log2) {
    using namespace cute;
    static_assert(host_mode_stride(layout<0>(typename Scores::layout_type{})) == 1 &&
                      host_mode_stride(layout<0>(typename DP::layout_type{})) == 1 &&
                      host_mode_stride(typename Lse::layout_type{}) == 1 &&
                      host_mode_stride(typename DSum::layout_type{}) == 1,
                  "column-major tiles: rows contiguous");
    host_kernels().exp2_rows(&scores(0, 0), host_mode_stride(layout<1>(scores)), int(size<0>(scores)),
                             int(size<1>(scores)), &lse_log2(0), scale_log2, &dp(0, 0), host_mode_stride(layout<1>(dp)),
                             subtract_d ? &dsum(0) : nullptr);
  }
  // A (1, M, N) accumulator stored row by row, rounded to Out, by the level's store_rows: the output tile
  // (write_output) into global O, instead of the conversion, shared-memory staging and copy that the GPU's
  // scattered fragments need (these went element by element here: 7-8.5% of a bf16 prefill call's samples on
  // the AMX level, against 3% for store_rows; docs/perf.md); and the backward's P and dS into their
  // row-major shared tiles (store_pds).
  template <class Acc, class Out>
  static void store_acc_rows(Acc const& acc, Out* out, int64_t row_stride, int rows, int cols) {
    using namespace cute;
    using L = typename Acc::layout_type;
    static_assert(decltype(size<0>(L{}))::value == 1 && host_mode_stride(layout<1>(L{})) == 1,
                  "column-major tiles: rows contiguous");
    host_kernels().store_rows(&acc(0), host_mode_stride(layout<2>(L{})), out, row_stride, host_dtype<Out>(), rows,
                              cols);
  }
  // The backward's share of dQ (accumulate_dq): out(m, j) += acc(m, j), row by row, by the level's add_rows.
  template <class Acc>
  static void add_acc_rows(Acc const& acc, float* out, int64_t row_stride, int rows, int cols) {
    using namespace cute;
    using L = typename Acc::layout_type;
    static_assert(decltype(size<0>(L{}))::value == 1 && host_mode_stride(layout<1>(L{})) == 1,
                  "column-major tiles: rows contiguous");
    host_kernels().add_rows(&acc(0), host_mode_stride(layout<2>(L{})), out, row_stride, rows, cols);
  }
  template <class Tensor>
  static void clear_smem(Tensor&& t) { cute::clear(t); }
  // copy_tile's clear of a tile with missing rows, when the tile's rows are not contiguous (Q's column-major
  // tile, (CPY, CPY_M, CPY_K) with rows along mode 1 at stride 1): one thread holds the whole tile, so it is
  // zeroed as one run and the live rows are copied over it.  Row by row, each missing row was kHeadDim strided
  // 2-byte stores, half of a decode CTA's own time on AVX2 (12 of its 16 query rows missing).  Returns false
  // for row-major tiles (K, V), whose missing rows are contiguous runs that copy_tile clears one by one.
  template <class Tensor>
  static bool clear_tile_if_rows_strided(Tensor& t) {
    using namespace cute;
    using T = std::decay_t<Tensor>;
    using L = typename T::layout_type;
    if constexpr (!is_gmem<typename T::engine_type>::value && decltype(rank(L{}))::value == 3) {
      if constexpr (host_mode_stride(layout<1>(L{})) == 1) {
        static_assert(decltype(cosize(L{}))::value == decltype(size(L{}))::value, "a dense tile");
        std::memset(raw_pointer_cast(&t(0, 0, 0)), 0, size(L{}) * sizeof(typename T::value_type));
        return true;
      }
    }
    return false;
  }
  template <class Op>
  static float row_allreduce(float x, Op) { return x; }
  static bool warp_any(bool p) { return p; }  // a CTA of one thread is its own warp

  // apply_score_mask's host form: the whole tile at once (HostKernels::mask_scores).  scores (M, N) is the (row,
  // col) view of the column-major S fragment, whose (i, j) is the tile's (i, j) (test_traits checks it); diag0
  // is the diagonal of the tile's first row.
  template <class W, class Scores>
  static void mask_scores(Scores& scores, W const& window, int diag0, int seqlen_k, int col0, bool bias,
                          float alibi_slope, bool need_mask) {
    using namespace cute;
    static_assert(host_mode_stride(layout<0>(typename Scores::layout_type{})) == 1, "column-major S: rows contiguous");
    HostMaskArgs const a{&scores(0, 0),   host_mode_stride(layout<1>(scores)),
                         int(size<0>(scores)), int(size<1>(scores)),
                         diag0,           col0,
                         seqlen_k,        bias,
                         alibi_slope,     need_mask,
                         window.has_left(), window.has_right(),
                         window.left(),   window.right()};
    host_kernels().mask_scores(a);
  }

  // OnlineSoftmax::rescale_o (softmax.h) for a whole tile, by the level's softmax micro-kernel, which
  // performs its per-row steps on vectors of rows (host_isa.h, HostSoftmaxArgs): the same lagging reference,
  // moved per vector of rows rather than per warp, and found in the same pass that exponentiates, so most
  // tiles read S once and leave O alone; finalize() derives the same O and LSE from it, up to rounding.
  // scores (M, N) and acc_o (M, D) are the (row, col) views of column-major fragments.
  template <class RowState, class Scores, class AccO>
  static void softmax_rescale_o(RowState& row_max, RowState& row_sum, Scores& scores, AccO& acc_o,
                                float scale_log2, bool first) {
    using namespace cute;
    static_assert(host_mode_stride(layout<0>(typename Scores::layout_type{})) == 1 && host_mode_stride(layout<0>(typename AccO::layout_type{})) == 1,
                  "column-major tiles: rows contiguous");
    int const rows = int(size<0>(scores));
    int const live = host_cta_context().live_rows;
    if (first) {  // rows the micro-kernel skips (past the live rows) reach finalize() as rows without keys
      for (int i = live; i < rows; ++i) { row_max(i) = -INFINITY, row_sum(i) = 0.f; }
    }
    HostPackCache* const p_cache = host_cta_context().p_cache;
    if (p_cache != nullptr) { p_cache->valid = false; }
    HostSoftmaxArgs const a{&scores(0, 0), host_mode_stride(layout<1>(scores)), int(size<1>(scores)),
                            &acc_o(0, 0), host_mode_stride(layout<1>(acc_o)), int(size<1>(acc_o)),
                            &row_max(0), &row_sum(0), rows < live ? rows : live, scale_log2, first, p_cache};
    host_kernels().softmax_rescale(a);
  }
};

}  // namespace flash_ext
