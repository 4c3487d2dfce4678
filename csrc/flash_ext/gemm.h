// Tiled GEMM steps of the kernel body and the accumulator views they produce.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/array.h>

namespace flash_ext {

// acc += A . B^T with both operands in shared memory.  Register fragments are filled one k-slice ahead of
// the MMA that consumes them, so shared-memory loads (ldmatrix on the GPU) overlap tensor-core work.
// zero_acc (a static bool): acc = A . B^T instead, acc's contents unread.  Only whole-tile GEMMs take it (see
// TileGemm below); register-fragment MMAs accumulate into cleared registers, which cost nothing to clear.
template <class Acc, class FragA, class FragB, class SmemA, class SmemB, class TiledMma, class CopyA,
          class CopyB, class ThrCopyA, class ThrCopyB, class ZeroAcc = cute::false_type>
CUTE_HOST_DEVICE void gemm_ss(Acc& acc, FragA& tCrA, FragB& tCrB, SmemA const& tCsA, SmemB const& tCsB,
                              TiledMma const& tiled_mma, CopyA const& smem_tiled_copy_A,
                              CopyB const& smem_tiled_copy_B, ThrCopyA const& smem_thr_copy_A,
                              ThrCopyB const& smem_thr_copy_B, ZeroAcc = {}) {
  using namespace cute;
  static_assert(!ZeroAcc::value, "register-fragment MMAs accumulate: clear acc first");
  Tensor tCrA_view = smem_thr_copy_A.retile_D(tCrA);  // (CPY,CPY_M,CPY_K)
  Tensor tCrB_view = smem_thr_copy_B.retile_D(tCrB);  // (CPY,CPY_N,CPY_K)
  CUTE_STATIC_ASSERT_V(size<1>(tCsA) == size<1>(tCrA_view));
  CUTE_STATIC_ASSERT_V(size<1>(tCsB) == size<1>(tCrB_view));
  copy(smem_tiled_copy_A, tCsA(_, _, _0{}), tCrA_view(_, _, _0{}));
  copy(smem_tiled_copy_B, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k < size<2>(tCrA) - 1) {
      copy(smem_tiled_copy_A, tCsA(_, _, k + 1), tCrA_view(_, _, k + 1));
      copy(smem_tiled_copy_B, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1));
    }
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// acc += A . B^T with A already in registers (P in the P.V step) and B in shared memory.  The next k-slice
// of B is prefetched into registers while the current one multiplies, unless one slice is large (head dim
// >= 192: 48-64 registers per slice), where double-buffering it would push the kernel past 255 registers.
template <class Acc, class FragA, class FragB, class SmemB, class TiledMma, class CopyB, class ThrCopyB,
          class ZeroAcc = cute::false_type>
CUTE_HOST_DEVICE void gemm_rs(Acc& acc, FragA const& tCrA, FragB& tCrB, SmemB const& tCsB,
                              TiledMma const& tiled_mma, CopyB const& smem_tiled_copy_B,
                              ThrCopyB const& smem_thr_copy_B, ZeroAcc = {}) {
  using namespace cute;
  static_assert(!ZeroAcc::value, "register-fragment MMAs accumulate: clear acc first");
  Tensor tCrB_view = smem_thr_copy_B.retile_D(tCrB);  // (CPY,CPY_N,CPY_K)
  CUTE_STATIC_ASSERT_V(size<1>(tCsB) == size<1>(tCrB_view));
  constexpr int kSliceBytes = decltype(size(tCrB(_, _, 0)))::value * int(sizeof(typename FragB::value_type));
  constexpr bool kPrefetch = kSliceBytes <= 128;
  if constexpr (kPrefetch) { copy(smem_tiled_copy_B, tCsB(_, _, _0{}), tCrB_view(_, _, _0{})); }
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if constexpr (kPrefetch) {
      if (k < size<2>(tCrA) - 1) { copy(smem_tiled_copy_B, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1)); }
    } else {
      copy(smem_tiled_copy_B, tCsB(_, _, k), tCrB_view(_, _, k));
    }
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// acc += A . B^T with A in shared memory and B already in registers (the host backward's K and V, loaded
// once per K/V tile).  A's k-slices are copied one ahead of the MMA that consumes them.
template <class Acc, class FragA, class FragB, class SmemA, class TiledMma, class CopyA, class ThrCopyA>
CUTE_HOST_DEVICE void gemm_sr(Acc& acc, FragA& tCrA, FragB const& tCrB, SmemA const& tCsA, TiledMma const& tiled_mma,
                              CopyA const& smem_tiled_copy_A, ThrCopyA const& smem_thr_copy_A) {
  using namespace cute;
  Tensor tCrA_view = smem_thr_copy_A.retile_D(tCrA);  // (CPY,CPY_M,CPY_K)
  CUTE_STATIC_ASSERT_V(size<1>(tCsA) == size<1>(tCrA_view));
  copy(smem_tiled_copy_A, tCsA(_, _, _0{}), tCrA_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k < size<2>(tCrA) - 1) { copy(smem_tiled_copy_A, tCsA(_, _, k + 1), tCrA_view(_, _, k + 1)); }
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// Whole-tile GEMMs.  A backend whose MMA is a routine over whole tiles rather than an instruction on
// register fragments (the host: one micro-kernel call per GEMM, traits_host.h) specialises TileGemm for its
// TiledMma, with rs(acc, A, sB, zero_acc) and ss(acc, sA, sB, zero_acc); the overloads below, more
// constrained than gemm_ss, gemm_rs and gemm_sr, then take the complete acc += A . B^T (acc = A . B^T with
// zero_acc) in one call, reading the operands where they are (an operand in shared memory is read there:
// the k-slice register fragments are not used).  A backend
// with TileGemm has no fragment in registers that gemm_sr's B could be, so gemm_sr is refused for it.
template <class TiledMma>
struct TileGemm : std::false_type {};

template <class Acc, class FragA, class FragB, class SmemA, class SmemB, class TiledMma, class CopyA,
          class CopyB, class ThrCopyA, class ThrCopyB, class ZeroAcc = cute::false_type>
  requires TileGemm<TiledMma>::value
void gemm_ss(Acc& acc, FragA&, FragB&, SmemA const& tCsA, SmemB const& tCsB, TiledMma const&, CopyA const&,
             CopyB const&, ThrCopyA const&, ThrCopyB const&, ZeroAcc = {}) {
  TileGemm<TiledMma>::ss(acc, tCsA, tCsB, ZeroAcc::value);
}

template <class Acc, class FragA, class FragB, class SmemB, class TiledMma, class CopyB, class ThrCopyB,
          class ZeroAcc = cute::false_type>
  requires TileGemm<TiledMma>::value
void gemm_rs(Acc& acc, FragA const& tCrA, FragB&, SmemB const& tCsB, TiledMma const&, CopyB const&,
             ThrCopyB const&, ZeroAcc = {}) {
  TileGemm<TiledMma>::rs(acc, tCrA, tCsB, ZeroAcc::value);
}

template <class Acc, class FragA, class FragB, class SmemA, class TiledMma, class CopyA, class ThrCopyA>
  requires TileGemm<TiledMma>::value
void gemm_sr(Acc&, FragA&, FragB const&, SmemA const&, TiledMma const&, CopyA const&, ThrCopyA const&) {
  static_assert(!TileGemm<TiledMma>::value, "whole-tile GEMMs read B where it lives: use gemm_ss (kKVInRegs = false)");
}

// An accumulator tile of TiledMma over `shape`: partition_fragment_C's, except on the host, where its array is
// left uninitialised and its columns padded (host_acc_column_stride).  cute's owning tensor value-initialises
// its array when constructed: free in registers, but on the host a memset of the whole tile in memory (64 KiB
// for a 128 x 128 S, once per K/V tile; 6% of a bf16 prefill's time on AMX, docs/perf.md).  The body writes
// every accumulator before reading it: a clear, or on the host an overwriting first GEMM (kZeroS, kZeroAcc).
// Aligned to a cache line: cute's array is 16-byte aligned, and the stack placed S and O at 48 bytes past a line,
// so every 64-byte row of an AMX tile and every AVX-512 vector of a column straddled two lines (bf16 prefill
// on AMX 10-20% less time aligned; docs/perf.md, "host accumulators on cache lines").  Every host tile's rows
// are a multiple of 16, so its column stride is whole lines (host_acc_column_stride) and each column starts on one.
template <class T, size_t N>
struct alignas(64) UninitializedArrayEngine : cute::ArrayEngine<T, N> {
  UninitializedArrayEngine() {}  // user-provided: value-initialisation calls it, and it leaves the array as is
};

// The column stride of a host accumulator tile of `rows` rows (column-major).  A plain stride of 64 or 128
// floats is a power-of-two number of 64-byte lines, so one row vector's columns (the softmax's pass over a row
// block of S, a register block's C columns) fall into 64 / 4 or 64 / 8 of L1's 64 sets and evict each other
// before the tile is done with them.  One more line per column (an odd number of lines) spreads them over
// every set and keeps each column 64-byte aligned.  Measured on the AVX2 level: docs/perf.md.
constexpr int host_acc_column_stride(int rows) { return rows % 16 == 0 && rows >= 64 ? rows + 16 : rows; }
static_assert(host_acc_column_stride(128) * 4 / 64 % 2 == 1 && host_acc_column_stride(64) * 4 / 64 % 2 == 1);

// Elements from one row of a mirrored K/V tile (traits_host.h: host_mirror_tile) to the next.  fp32 rows are
// read in place by the GEMMs' broadcasts, and P.V walks one line of each of V's rows per step over k: rows of
// an even number of 64-byte lines (d = 64, 128) put those lines into half of L1's sets or fewer, where they
// evicted each other before the next column block came back to them.  An odd number spreads them over every
// set (as the accumulators' columns); fp32 P.V at d = 128 measured ~6% faster on AVX2 (docs/perf.md).  16-bit
// rows are widened by the GEMMs into their own padded scratch (kernels.h: widened_stride), so they stay dense.
constexpr int64_t host_mirror_row_elems(int row_elems, int elem_bytes) {
  int64_t const bytes = int64_t(row_elems) * elem_bytes;
  return elem_bytes == 4 && bytes % 128 == 0 ? (bytes + 64) / elem_bytes : row_elems;
}
static_assert(host_mirror_row_elems(128, 4) == 144 && host_mirror_row_elems(64, 4) == 80 &&
              host_mirror_row_elems(96, 4) == 112 && host_mirror_row_elems(48, 4) == 48 &&
              host_mirror_row_elems(128, 2) == 128);

// A host tile of the shape of Frag, a (1, ROWS, COLS) fragment: uninitialised, its columns padded
// (host_acc_column_stride).  Shared by the accumulators and the Q fragment below.
template <class Frag>
CUTE_HOST_DEVICE auto make_host_padded_fragment() {
  using L = typename Frag::layout_type;
  constexpr int kRows = decltype(cute::size<1>(L{}))::value;
  constexpr int kCols = decltype(cute::size<2>(L{}))::value;
  constexpr int kLd = host_acc_column_stride(kRows);
  using Layout = decltype(cute::make_layout(cute::layout<0>(L{}), cute::make_layout(cute::Int<kRows>{}, cute::_1{}),
                                            cute::make_layout(cute::Int<kCols>{}, cute::Int<kLd>{})));
  return cute::Tensor<UninitializedArrayEngine<typename Frag::value_type, cute::cosize_v<Layout>>, Layout>{};
}

// The A operand fragment of a GEMM whose A is loaded from shared memory once and kept (Q, kQInRegs):
// partition_fragment_A's, except on the host, where its columns are padded like the accumulators'.  Dense,
// a 128-row Q fragment's columns are 512 bytes apart and one register block's 16 or 32 rows of every column
// fall into 8 or 16 of L1's 64 sets, fewer lines than the block walks over the head dim; the Q.K^T's A then
// came from L2 for every column block.  Every element is written by the shared -> register copy before use.
template <class Traits, class ThrMma, class SmemTensor>
CUTE_HOST_DEVICE auto make_a_fragment(ThrMma const& thr_mma, SmemTensor const& sA) {
  if constexpr (Traits::kIsHost) {
    return make_host_padded_fragment<decltype(thr_mma.partition_fragment_A(sA))>();
  } else {
    return thr_mma.partition_fragment_A(sA);
  }
}

// An accumulator tile of TiledMma over `shape` (UninitializedArrayEngine above says what the host's form is and why).
template <class Traits, class TiledMma, class Shape>
CUTE_HOST_DEVICE auto make_acc_fragment(TiledMma const& tiled_mma, Shape const& shape) {
  if constexpr (Traits::kIsHost) {
    return make_host_padded_fragment<decltype(cute::partition_fragment_C(tiled_mma, shape))>();
  } else {
    return cute::partition_fragment_C(tiled_mma, shape);
  }
}

// ((cols, rows), MMA_M, MMA_N) accumulator -> ((rows, MMA_M), (cols, MMA_N)): the (row, column) view that
// softmax and masking index.  kAccValCols is how many adjacent columns of one row an atom gives a thread.
template <int kAccValCols, class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol_layout(Layout acc) {
  using namespace cute;
  static_assert(decltype(rank(acc))::value == 3);
  auto l = logical_divide(acc, Shape<Int<kAccValCols>>{});  // ((cols, rows), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

template <int kAccValCols, class Tensor>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Tensor&& t) {
  return cute::make_tensor(t.data(), acc_rowcol_layout<kAccValCols>(t.layout()));
}

// Conversion of an fp32 register fragment (accumulators -> fp16/bf16 operands or outputs), as one array so
// the GPU uses packed cvt instructions (two values per instruction).  The conversion itself is the traits'
// (Traits::convert: cvt.rn on the GPU, its emulation under the warp emulator, a plain cast on the host).
// On the host, fragments that are both one contiguous run (a whole output tile) are converted in place by the
// level's micro-kernel: the element-wise copies in and out of the Arrays (the bf16 Array's sub-word
// references) cost more than the conversion.
template <class Traits, class Src, class Dst>
CUTE_HOST_DEVICE void convert_into(Src const& src, Dst& dst) {
  using To = typename Dst::value_type;
  constexpr int N = decltype(cute::size(src))::value;
  static_assert(decltype(cute::size(dst))::value == N);
  static_assert(std::is_same_v<typename Src::value_type, float>);
  if constexpr (Traits::kIsHost) {
    using Contiguous = cute::Layout<cute::Int<N>, cute::_1>;
    if constexpr (std::is_same_v<decltype(cute::coalesce(typename Src::layout_type{})), Contiguous> &&
                  std::is_same_v<decltype(cute::coalesce(typename Dst::layout_type{})), Contiguous>) {
      Traits::convert_contiguous(cute::raw_pointer_cast(&src(0)), cute::raw_pointer_cast(&dst(0)), N);
      return;
    }
  }
  cutlass::Array<float, N> in;
  CUTE_UNROLL
  for (int i = 0; i < N; ++i) { in[i] = src(i); }
  cutlass::Array<To, N> const out = Traits::template convert<To, N>(in);
  CUTE_UNROLL
  for (int i = 0; i < N; ++i) { dst(i) = out[i]; }
}

template <class Traits, class To, class Tensor>
CUTE_HOST_DEVICE auto convert_fragment(Tensor const& t) {
  auto out = cute::make_tensor<To>(t.layout());
  convert_into<Traits>(t, out);
  return out;
}

// P as the A operand of P.V: the S accumulator converted to ElementP and re-viewed with the A-operand
// layout (same registers, different (mode) grouping).  When ElementP is the accumulator type (host
// traits) the result aliases the accumulator instead of copying it.
template <class Traits, class AccS>
CUTE_HOST_DEVICE auto make_p_operand(AccS& acc_s) {
  using ElementP = typename Traits::ElementP;
  auto const a_layout = Traits::acc_to_a_layout(acc_s.layout());
  if constexpr (std::is_same_v<ElementP, typename AccS::value_type>) {
    return cute::make_tensor(acc_s.data(), a_layout);
  } else {
    auto rP = cute::make_tensor<ElementP>(a_layout);  // owns cosize(a_layout) == cosize(acc) registers
    auto rP_as_acc = cute::make_tensor(rP.data(), acc_s.layout());
    convert_into<Traits>(acc_s, rP_as_acc);
    return rP;
  }
}

}  // namespace flash_ext
