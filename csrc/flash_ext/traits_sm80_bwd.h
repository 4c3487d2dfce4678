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
#include "traits_sm80_common.h"

namespace flash_ext {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kAtomMSdP_, int kAtomNdKV_, int kAtomMdQ_,
          bool kDoubleBufferQ_, class Element_, class Arch_ = Sm80Arch>
struct Sm80BwdTraits : Sm80TraitsCommon<Arch_, Element_, kHeadDim_, kNWarps_ * 32> {
  using Common = Sm80TraitsCommon<Arch_, Element_, kHeadDim_, kNWarps_ * 32>;
  using Common::kBlockKSmem;
  using typename Common::SmemLayoutAtom;
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
  // column permutation gives each warp kColStep contiguous columns per step: 16 (two n8 atoms side by side,
  // what one ldmatrix.x4 of a B operand loads) instead of two 8-column pieces kNWarps / kAtomM * 8 apart;
  // or 8 (one n8 atom, B loaded by ldmatrix.x2) where the output has fewer than 16 columns per warp.
  template <int kAtomM, int kColStep>
  using WarpTiledMma = cute::TiledMMA<
      cute::MMA_Atom<MmaOp>, cute::Layout<cute::Shape<cute::Int<kAtomM>, cute::Int<kNWarps / kAtomM>, cute::_1>>,
      cute::Tile<cute::Int<16 * kAtomM>,
                 cute::Layout<cute::Shape<cute::_8, cute::Int<kNWarps / kAtomM>, cute::Int<kColStep / 8>>,
                              cute::Stride<cute::_1, cute::Int<kColStep>, cute::_8>>,
                 cute::_16>>;
  // S and dP at head dim 256 (32 x 32 on 8 warps, 2 x 4) are the one output narrower than 16 columns per warp.
  static constexpr int kColStepSdP = kBlockN % (16 * (kNWarps / kAtomMSdP)) == 0 ? 16 : 8;
  using TiledMmaSdP = WarpTiledMma<kAtomMSdP, kColStepSdP>;
  using TiledMmadKV = WarpTiledMma<kAtomNdKV, 16>;
  using TiledMmadQ = WarpTiledMma<kAtomMdQ, 16>;
  static_assert(kNWarps % kAtomMSdP == 0 && kNWarps % kAtomNdKV == 0 && kNWarps % kAtomMdQ == 0);
  static_assert(kBlockM % (16 * kAtomMSdP) == 0 && kBlockN % (kColStepSdP * (kNWarps / kAtomMSdP)) == 0, "S/dP tile");
  static_assert(kBlockN % (16 * kAtomNdKV) == 0 && kHeadDim % (16 * (kNWarps / kAtomNdKV)) == 0, "dK/dV tile");
  static_assert(kBlockM % (16 * kAtomMdQ) == 0 && kHeadDim % (16 * (kNWarps / kAtomMdQ)) == 0, "dQ tile");
  static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0, "P/dS are k16 operands along both dimensions");

  // Q, dO, K, V: whole tiles of the forward's swizzled row atom (traits_sm80_common.h).
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
  // B of S and dP (K, V): one ldmatrix loads the 16 x kColStepSdP slab of a warp's step.
  using SmemCopyAtomSdPB =
      cute::Copy_Atom<std::conditional_t<kColStepSdP == 16, typename Arch::LdsmN, typename Arch::LdsmNx2>, Element>;
  using SmemCopyAtomPdS = SmemCopyAtom;
  using SmemCopyAtomPdSTransposed = SmemCopyAtomTransposed;
  using SmemCopyAtomStorePdS = cute::Copy_Atom<typename Arch::VecCopy, Element>;
  using SmemCopyAtomdKV = cute::Copy_Atom<typename Arch::VecCopy, Element>;

  using GmemTiledCopyQKV = typename Common::GmemTiledCopyAsync;
  using GmemTiledCopydKV = typename Common::GmemTiledCopyVec;

  // Q (1 or 2 buffers), dO, K, V, P, dS.  dK and dV are staged through the K and V tiles in the epilogue.
  static constexpr int kSmemQdOBytes = int(cute::cosize_v<SmemLayoutQdO>) * int(sizeof(Element));
  static constexpr int kSmemKVBytes = int(cute::cosize_v<SmemLayoutKV>) * int(sizeof(Element));
  static constexpr int kSmemPdSBytes = int(cute::cosize_v<SmemLayoutPdS>) * int(sizeof(ElementPdS));
  static constexpr int kSmemBytes = (kDoubleBufferQ ? 3 : 2) * kSmemQdOBytes + 2 * kSmemKVBytes + 2 * kSmemPdSBytes;
};

}  // namespace flash_ext
