// GPU traits of the backward pass for sm_80 and newer (kernel_bwd.h).  Like Sm80Traits, the tile shapes,
// shared-memory layouts and tiled copy/MMA layouts come from the real sm_80 atoms, and every instruction from
// the architecture policy `Arch` (arch_sm80.h; the backward adds Arch::atomic_add for the dQ accumulators).
//
// Three tiled MMAs, one per output shape:
//   S = Q.K^T, dP = dO.V^T       (BLK_M, BLK_N)     TiledMmaSdP   A: Q / dO          B: K / V
//   dV += P^T.dO, dK += dS^T.Q   (BLK_N, HEAD_DIM)  TiledMmadKV   A: P^T / dS^T      B: dO^T / Q^T
//   dQ  = dS.K                   (BLK_M, HEAD_DIM)  TiledMmadQ    A: dS              B: K^T
// The transposed operands are read from the same swizzled tiles with ldmatrix.trans.  Unlike the forward, no
// row reduction crosses lanes (LSE and D are given), so warps may split the columns of an output as well as
// its rows: kAtomM* warps along the rows, the rest along the columns.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/numeric_types.h>

#include "arch_sm80.h"

namespace flash_ext {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kAtomMSdP_, int kAtomNdKV_, int kAtomMdQ_,
          bool kDoubleBufferQ_, class Element_, class Arch_ = Sm80Arch>
struct Sm80BwdTraits : Arch_ {
  using Arch = Arch_;
  using Element = Element_;
  using ElementAccum = float;
  using ElementPdS = Element;  // P and dS feed 16-bit tensor-core MMAs
  static constexpr bool kIsHost = false;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kAtomMSdP = kAtomMSdP_;
  static constexpr int kAtomNdKV = kAtomNdKV_;
  static constexpr int kAtomMdQ = kAtomMdQ_;
  // Q double-buffered: the next Q tile streams in during the whole current iteration instead of only during
  // dQ = dS.K (dispatch_bwd.h decides per head dim, from shared memory).
  static constexpr bool kDoubleBufferQ = kDoubleBufferQ_;
  // K, V, K^T fragments are re-read from shared memory for every GEMM (holding them would cost the registers
  // the dK/dV accumulators need), and dS reaches dQ's A operand through shared memory (with warps split
  // along N, the S accumulator's thread layout is not dQ's A layout).
  static constexpr bool kKVInRegs = false;
  static constexpr bool kDSFromAcc = false;
  static_assert(kHeadDim % 32 == 0, "head dim tiles are multiples of 32");
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>,
                "tensor-core path takes fp16 or bf16");

  using MmaOp = typename Arch::template Mma<Element>;
  // kAtomM warps along the output's rows (16 rows each per step), kNWarps / kAtomM along its columns.  The
  // column permutation gives each warp 16 contiguous columns per step (two n8 atoms side by side) instead of
  // two 8-column pieces kNWarps / kAtomM * 8 apart: 16 columns are what one ldmatrix.x4 of a B operand loads.
  template <int kAtomM>
  using WarpTiledMma = cute::TiledMMA<
      cute::MMA_Atom<MmaOp>, cute::Layout<cute::Shape<cute::Int<kAtomM>, cute::Int<kNWarps / kAtomM>, cute::_1>>,
      cute::Tile<cute::Int<16 * kAtomM>,
                 cute::Layout<cute::Shape<cute::_8, cute::Int<kNWarps / kAtomM>, cute::_2>,
                              cute::Stride<cute::_1, cute::_16, cute::_8>>,
                 cute::_16>>;
  using TiledMmaSdP = WarpTiledMma<kAtomMSdP>;
  using TiledMmadKV = WarpTiledMma<kAtomNdKV>;
  using TiledMmadQ = WarpTiledMma<kAtomMdQ>;
  static_assert(kNWarps % kAtomMSdP == 0 && kNWarps % kAtomNdKV == 0 && kNWarps % kAtomMdQ == 0);
  static_assert(kBlockM % (16 * kAtomMSdP) == 0 && kBlockN % (16 * (kNWarps / kAtomMSdP)) == 0, "S/dP tile");
  static_assert(kBlockN % (16 * kAtomNdKV) == 0 && kHeadDim % (16 * (kNWarps / kAtomNdKV)) == 0, "dK/dV tile");
  static_assert(kBlockM % (16 * kAtomMdQ) == 0 && kHeadDim % (16 * (kNWarps / kAtomMdQ)) == 0, "dQ tile");
  static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0, "P/dS are k16 operands along both dimensions");

  // Q, dO, K, V: rows of kBlockKSmem elements (64 = 128 bytes when possible), XOR-swizzled as in the forward so
  // that the 8 rows an ldmatrix phase reads, plain or transposed, fall in distinct banks.
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kBlockKSmem == 32 ? 2 : 3;
  using SmemLayoutAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzle, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockKSmem>>, cute::Stride<cute::Int<kBlockKSmem>, cute::_1>>{}));
  using SmemLayoutQdO = decltype(cute::tile_to_shape(SmemLayoutAtom{},
                                                     cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemLayoutAtom{},
                                                    cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutQdOt = decltype(cute::composition(
      SmemLayoutQdO{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutQdOtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutQdOt{}));
  using SmemLayoutKtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutKt{}));

  // P and dS: (BLK_M, BLK_N) tiles in rows of 64 (or 32) elements, swizzled the same way; read back plain (dS
  // as the A operand of dQ) and transposed (P^T, dS^T as the A operands of dV and dK).
  static constexpr int kBlockNSmemPdS = kBlockN % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzlePdS = kBlockNSmemPdS == 32 ? 2 : 3;
  using SmemLayoutPdS = decltype(cute::tile_to_shape(
      cute::composition(cute::Swizzle<kSwizzlePdS, 3, 3>{},
                        cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockNSmemPdS>>,
                                     cute::Stride<cute::Int<kBlockNSmemPdS>, cute::_1>>{}),
      cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(cute::composition(
      SmemLayoutPdS{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  using SmemLayoutPdStNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutPdSt{}));

  using SmemCopyAtom = cute::Copy_Atom<typename Arch::LdsmN, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<typename Arch::LdsmT, Element>;
  using SmemCopyAtomPdS = SmemCopyAtom;
  using SmemCopyAtomPdSTransposed = SmemCopyAtomTransposed;
  using SmemCopyAtomStorePdS = cute::Copy_Atom<typename Arch::VecCopy, Element>;
  using SmemCopyAtomdKV = cute::Copy_Atom<typename Arch::VecCopy, Element>;

  // Global<->shared: 16 bytes per thread and instruction, whole 128-byte lines per warp (as in the forward).
  static constexpr int kGmemElemsPerLoad = 16 / int(sizeof(Element));
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
  static_assert(kNThreads % kGmemThreadsPerRow == 0);
  using GmemLayoutAtom = cute::Layout<
      cute::Shape<cute::Int<kNThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
      cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
  using GmemValLayout = cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerLoad>>>;
  using GmemTiledCopyQKV = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<typename Arch::CpAsync, Element>{}, GmemLayoutAtom{}, GmemValLayout{}));
  using GmemTiledCopydKV = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<typename Arch::VecCopy, Element>{}, GmemLayoutAtom{}, GmemValLayout{}));

  // Q (1 or 2 buffers), dO, K, V, P, dS.  dK and dV are staged through the K and V tiles in the epilogue.
  static constexpr int kSmemQdOBytes = int(cute::cosize_v<SmemLayoutQdO>) * int(sizeof(Element));
  static constexpr int kSmemKVBytes = int(cute::cosize_v<SmemLayoutKV>) * int(sizeof(Element));
  static constexpr int kSmemPdSBytes = int(cute::cosize_v<SmemLayoutPdS>) * int(sizeof(ElementPdS));
  static constexpr int kSmemBytes = (kDoubleBufferQ ? 3 : 2) * kSmemQdOBytes + 2 * kSmemKVBytes + 2 * kSmemPdSBytes;

  // One accumulator fragment of the m16n8 atom holds 2 columns x 2 rows per thread.
  static constexpr int kAccValCols = 2;

  // ((2 cols, 2 rows), MMA_M, MMA_N) accumulator -> ((2, 2, 2), MMA_M, MMA_N / 2): neighbouring n8 tiles
  // (2a, 2a + 1) side by side.  With the column permutation of WarpTiledMma they are columns c and c + 8 of
  // one warp's 16-column step, as in the forward's S accumulator.
  template <class Layout>
  CUTE_HOST_DEVICE static constexpr auto acc_to_a_layout(Layout acc) {
    static_assert(decltype(cute::rank(acc))::value == 3);
    static_assert(decltype(cute::size<0>(acc))::value == 4);
    static_assert(decltype(cute::size<2>(acc))::value % 2 == 0);
    auto l = cute::logical_divide(acc, cute::Shape<cute::Underscore, cute::Underscore, cute::_2>{});
    return cute::make_layout(cute::make_layout(cute::get<0>(l), cute::get<2, 0>(l)), cute::get<1>(l),
                             cute::get<2, 1>(l));
  }

  // Dropout groups (dropout.h) of the S accumulator, as in Sm80Traits: rows {R, R + 8} x columns {c, c + 1} of
  // an atom plus columns {c + 8, c + 9} of its neighbour are one group of the contract, in slot order.
  // tests/cpp/test_dropout.cpp checks this view for every thread of every backward tile config.
  template <class Layout>
  CUTE_HOST_DEVICE static constexpr auto dropout_groups(Layout acc) {
    auto a = acc_to_a_layout(acc);  // ((2, 2, 2), MMA_M, MMA_N / 2)
    return cute::make_layout(cute::get<0>(a), cute::make_layout(cute::get<1>(a), cute::get<2>(a)));
  }
};

}  // namespace flash_ext
