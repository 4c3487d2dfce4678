// GPU traits for sm_80 and newer (Ampere instructions, also the path used on Hopper by this library):
// 16-byte cp.async global->shared copies, swizzled shared layouts, ldmatrix shared->register copies,
// mma.sync m16n8k16 with fp32 accumulation, and quad shuffles for row reductions.  The instructions come
// from the architecture policy `Arch` (arch_sm80.h): the real ones on the GPU, emulated ones under the warp
// emulator; everything else here (tiles, layouts, partitions) is the same for both.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/numeric_types.h>

#include "arch_sm80.h"

namespace flash_ext {

// The primitives (cp_async_fence/wait, barrier, exp2, tanh, convert, clear_smem, shfl_xor) are Arch's own
// static members, inherited so that the kernel body calls them as Traits::barrier() on every backend.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, class Element_, class Arch_ = Sm80Arch>
struct Sm80Traits : Arch_ {
  using Arch = Arch_;
  using Element = Element_;
  using ElementAccum = float;
  using ElementP = Element;  // P feeds a 16-bit tensor-core MMA
  static constexpr bool kIsHost = false;
  // Q is re-read from shared memory for every K tile: holding it in registers would cost 32-64
  // registers per thread that the accumulators need (and cause spills at head dim 128+).
  static constexpr bool kQInRegs = false;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0, "head dim tiles are multiples of 32");
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns 16-row slabs of the M tile");
  static_assert(kBlockN % 16 == 0 && kBlockN % 8 == 0, "P = S tile must split into k16 A fragments");
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>,
                "tensor-core path takes fp16 or bf16");

  // Warps are stacked along M: a warp owns whole rows of S and O, so row statistics never cross warps.
  using MmaOp = typename Arch::template Mma<Element>;
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<MmaOp>,
                                  cute::Layout<cute::Shape<cute::Int<kNWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kNWarps>, cute::_16, cute::_16>>;

  // Shared memory: rows of kBlockKSmem elements (64 = 128 bytes when possible), XOR-swizzled so that
  // the 8 rows an ldmatrix phase reads fall in distinct banks, and cp.async writes stay conflict-free.
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kBlockKSmem == 32 ? 2 : 3;
  using SmemLayoutAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzle, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockKSmem>>, cute::Stride<cute::Int<kBlockKSmem>, cute::_1>>{}));
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemLayoutAtom{},
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemLayoutAtom{},
                                                    cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V read as the B operand of P.V: (head dim, key) view of the same bytes.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = SmemLayoutQ;

  using SmemCopyAtom = cute::Copy_Atom<typename Arch::LdsmN, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<typename Arch::LdsmT, Element>;
  using SmemCopyAtomO = cute::Copy_Atom<typename Arch::VecCopy, Element>;

  // Global<->shared: each thread moves 16 bytes per instruction; a row of kBlockKSmem elements is covered
  // by kGmemThreadsPerRow consecutive threads so a warp reads whole 128-byte lines.
  static constexpr int kGmemElemsPerLoad = 16 / int(sizeof(Element));
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
  static_assert(kNThreads % kGmemThreadsPerRow == 0);
  using GmemLayoutAtom = cute::Layout<
      cute::Shape<cute::Int<kNThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
      cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
  using GmemValLayout = cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerLoad>>>;
  using GmemTiledCopyQKV = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<typename Arch::CpAsync, Element>{}, GmemLayoutAtom{}, GmemValLayout{}));
  using GmemTiledCopyO = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<typename Arch::VecCopy, Element>{}, GmemLayoutAtom{}, GmemValLayout{}));

  // Q tile, then K and V tiles; O reuses the Q bytes in the epilogue.
  static constexpr int kSmemQBytes = int(cute::cosize_v<SmemLayoutQ>) * int(sizeof(Element));
  static constexpr int kSmemKVBytes = int(cute::cosize_v<SmemLayoutKV>) * int(sizeof(Element));
  static constexpr int kSmemBytes = kSmemQBytes + 2 * kSmemKVBytes;
  static_assert(int(cute::cosize_v<SmemLayoutO>) * int(sizeof(Element)) <= kSmemQBytes);

  // One accumulator fragment of the m16n8 atom holds 2 columns x 2 rows per thread.
  static constexpr int kAccValCols = 2;

  // ((2 cols, 2 rows), MMA_M, MMA_N) accumulator of S = Q.K^T  ->  ((2, 2, 2), MMA_M, MMA_N / 2): two
  // neighbouring n8 accumulator tiles form one k16 A fragment of P.V, so P never leaves registers.
  template <class Layout>
  CUTE_HOST_DEVICE static constexpr auto acc_to_a_layout(Layout acc) {
    static_assert(decltype(cute::rank(acc))::value == 3);
    static_assert(decltype(cute::size<0>(acc))::value == 4);
    static_assert(decltype(cute::size<2>(acc))::value % 2 == 0);
    auto l = cute::logical_divide(acc, cute::Shape<cute::Underscore, cute::Underscore, cute::_2>{});
    return cute::make_layout(cute::make_layout(cute::get<0>(l), cute::get<2, 0>(l)), cute::get<1>(l),
                             cute::get<2, 1>(l));
  }

  // Dropout groups (dropout.h): in the m16n8 accumulator a thread holds rows {R, R + 8} x columns {c, c + 1}
  // of each atom (value index: column bit + 2 x row half), and the atom pair (n, n + 1), n even, adds columns
  // {c + 8, c + 9}: exactly one group of the contract, in slot order.  ((2, 2), MMA_M, MMA_N) ->
  // ((2, 2, 2), (MMA_M, MMA_N / 2)): one Philox call per group, none wasted.
  template <class Layout>
  CUTE_HOST_DEVICE static constexpr auto dropout_groups(Layout acc) {
    auto a = acc_to_a_layout(acc);  // ((2, 2, 2), MMA_M, MMA_N / 2)
    return cute::make_layout(cute::get<0>(a), cute::make_layout(cute::get<1>(a), cute::get<2>(a)));
  }

  // A row of the S accumulator is spread over the 4 lanes of a quad (lanes 4r..4r+3, see the
  // partition tests); xor-shuffles over lane bits 0 and 1 combine exactly that group.
  template <class Op>
  CUTE_HOST_DEVICE static float row_allreduce(float x, Op op) {
    x = op(x, Arch::shfl_xor(x, 2));
    x = op(x, Arch::shfl_xor(x, 1));
    return x;
  }
};

}  // namespace flash_ext
