// What the forward and backward sm_80 traits (traits_sm80.h, traits_sm80_bwd.h) share, as their common base:
// the swizzled shared-memory row atom of the Q/K/V-shaped tiles, the 16-byte global <-> shared tiled copies,
// and the views of the m16n8 accumulator (P as an A operand, dropout's groups).  It derives from the
// architecture policy `Arch` (arch_sm80.h), so the traits inherit the primitives through it.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>

#include "arch_sm80.h"

namespace flash_ext {

template <class Arch_, class Element_, int kHeadDim_, int kNThreads_>
struct Sm80TraitsCommon : Arch_ {
  // Rows of kBlockKSmem elements (64 = 128 bytes when possible), XOR-swizzled so that the 8 rows an ldmatrix
  // phase reads, plain or transposed, fall in distinct banks, and cp.async writes stay conflict-free.
  static constexpr int kBlockKSmem = kHeadDim_ % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kBlockKSmem == 32 ? 2 : 3;
  using SmemLayoutAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzle, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockKSmem>>, cute::Stride<cute::Int<kBlockKSmem>, cute::_1>>{}));

  // Global <-> shared: each thread moves 16 bytes per instruction; a row of kBlockKSmem elements is covered
  // by kGmemThreadsPerRow consecutive threads, so a warp reads whole 128-byte lines.  Async (cp.async) for
  // the inputs, plain vector stores for outputs staged through shared memory.
  static constexpr int kGmemElemsPerLoad = 16 / int(sizeof(Element_));
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
  static_assert(kNThreads_ % kGmemThreadsPerRow == 0);
  using GmemLayoutAtom = cute::Layout<
      cute::Shape<cute::Int<kNThreads_ / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
      cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
  using GmemValLayout = cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerLoad>>>;
  using GmemTiledCopyAsync = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<typename Arch_::CpAsync, Element_>{}, GmemLayoutAtom{}, GmemValLayout{}));
  using GmemTiledCopyVec = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<typename Arch_::VecCopy, Element_>{}, GmemLayoutAtom{}, GmemValLayout{}));

  // One accumulator fragment of the m16n8 atom holds 2 columns x 2 rows per thread.
  static constexpr int kAccValCols = 2;

  // ((2 cols, 2 rows), MMA_M, MMA_N) accumulator  ->  ((2, 2, 2), MMA_M, MMA_N / 2): two neighbouring n8
  // accumulator tiles form one k16 A fragment (P of P.V in the forward; P^T, dS as operands in the backward,
  // where the warp tiles' column permutation makes them columns c and c + 8 of one 16-column step), so an
  // accumulator feeds the next MMA without leaving registers.
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
  // ((2, 2, 2), (MMA_M, MMA_N / 2)): one Philox call per group, none wasted.  Where a warp's step is one n8
  // atom (MMA_N odd: the backward's S/dP at head dim 256), a thread holds half of each group, slots 0-3 or 4-7
  // by its column: ((2, 2), (MMA_M, MMA_N)), and each call serves 4 of its 8 slots.  tests/cpp/test_dropout.cpp
  // checks the view for every thread of every forward and backward tile config.
  template <class Layout>
  CUTE_HOST_DEVICE static constexpr auto dropout_groups(Layout acc) {
    if constexpr (decltype(cute::size<2>(acc))::value % 2 == 0) {
      auto a = acc_to_a_layout(acc);  // ((2, 2, 2), MMA_M, MMA_N / 2)
      return cute::make_layout(cute::get<0>(a), cute::make_layout(cute::get<1>(a), cute::get<2>(a)));
    } else {
      return cute::make_layout(cute::get<0>(acc), cute::make_layout(cute::get<1>(acc), cute::get<2>(acc)));
    }
  }
};

}  // namespace flash_ext
