// Host traits of the backward pass: the single-thread instance of the backward kernel body (kernel_bwd.h).
// Everything the forward's HostTraits provide (the 1x1x1 atom whose fragments are plain column-major
// matrices, the whole-tile GEMM hook TileGemm that runs the CPU level's micro-kernel, element copies, no-op
// fences, the polynomial exp2) is inherited; this adds the backward's extra operands and views:
//
//   S = Q.K^T, dP = dO.V^T       (BLK_M, BLK_N)     TiledMmaSdP
//   dV += P^T.dO, dK += dS^T.Q   (BLK_N, HEAD_DIM)  TiledMmadKV   (A: P^T / dS^T, B: dO^T / Q^T)
//   dQ  = dS.K                   (BLK_M, HEAD_DIM)  TiledMmadQ    (A: dS,         B: K^T)
//
// Each is one micro-kernel call over the whole tile (host_isa.h), reading its operands where they lie: the
// transposed operands are compositions of the shared tiles, i.e. strides the micro-kernel walks, and dS is
// read from its accumulator.  P and dS stay fp32 (ElementPdS), like P in the forward's host instance: the
// micro-kernels multiply in fp32 anyway (or round to bf16 themselves), so 16-bit P/dS would only add rounding.
#pragma once

#include <cute/tensor.hpp>

#include "traits_host.h"

namespace flash_ext {

template <int kHeadDim_, int kBlockM_, int kBlockN_, class Element_>
struct HostBwdTraits : HostTraits<kHeadDim_, kBlockM_, kBlockN_, Element_> {
  using Base = HostTraits<kHeadDim_, kBlockM_, kBlockN_, Element_>;
  using Element = Element_;
  using ElementPdS = float;
  using Base::kBlockM;
  using Base::kBlockN;
  using Base::kHeadDim;
  static_assert(kBlockM % 16 == 0, "the query tile is the K extent of dK/dV = dS^T.Q / P^T.dO");

  // One Q buffer: nothing runs asynchronously on the host, so there is nothing to overlap.
  static constexpr bool kDoubleBufferQ = false;
  // No operand fragments: the whole-tile GEMMs read K, V and K^T in shared memory, which is cache-resident
  // like a register copy would be.  The dS accumulator is already dQ's A operand (the atom's K equals its N),
  // so dQ skips shared memory for dS.
  static constexpr bool kKVInRegs = false;
  static constexpr bool kDSFromAcc = true;

  using TiledMmaSdP = typename Base::TiledMma;
  using TiledMmadKV = typename Base::TiledMma;
  using TiledMmadQ = typename Base::TiledMma;

  using SmemLayoutQdO = typename Base::SmemLayoutQ;                                       // (BLK_M,HEAD_DIM)
  using SmemLayoutKV = typename Base::SmemLayoutKV;                                       // (BLK_N,HEAD_DIM)
  using SmemLayoutPdS = cute::Layout<cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>,
                                     cute::Stride<cute::Int<kBlockN>, cute::_1>>;          // (BLK_M,BLK_N)
  using SmemLayoutQdOt = decltype(cute::composition(
      SmemLayoutQdO{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{},
                                         cute::GenRowMajor{})));                          // (HEAD_DIM,BLK_M)
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                        cute::GenRowMajor{})));                           // (HEAD_DIM,BLK_N)
  using SmemLayoutPdSt = decltype(cute::composition(
      SmemLayoutPdS{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{},
                                         cute::GenRowMajor{})));                          // (BLK_N,BLK_M)
  using SmemLayoutQdOtNoSwizzle = SmemLayoutQdOt;
  using SmemLayoutKtNoSwizzle = SmemLayoutKt;
  using SmemLayoutPdStNoSwizzle = SmemLayoutPdSt;

  using SmemCopyAtom = cute::Copy_Atom<cute::UniversalCopy<Element>, Element>;
  using SmemCopyAtomTransposed = SmemCopyAtom;
  using SmemCopyAtomSdPB = SmemCopyAtom;
  using SmemCopyAtomPdS = cute::Copy_Atom<cute::UniversalCopy<ElementPdS>, ElementPdS>;
  using SmemCopyAtomPdSTransposed = SmemCopyAtomPdS;
  using SmemCopyAtomStorePdS = SmemCopyAtomPdS;
  using SmemCopyAtomdKV = SmemCopyAtom;
  using GmemTiledCopydKV = typename Base::GmemTiledCopyO;

  // Q, dO, K, V tiles, then P and dS.  dK and dV are staged through the K and V tiles in the epilogue.
  static constexpr int kSmemQdOBytes = int(cute::cosize_v<SmemLayoutQdO>) * int(sizeof(Element));
  static constexpr int kSmemKVBytes = int(cute::cosize_v<SmemLayoutKV>) * int(sizeof(Element));
  static constexpr int kSmemPdSBytes = int(cute::cosize_v<SmemLayoutPdS>) * int(sizeof(ElementPdS));
  static constexpr int kSmemBytes = 2 * kSmemQdOBytes + 2 * kSmemKVBytes + 2 * kSmemPdSBytes;

  // P or dS into its row-major shared tile (kernel_bwd.h, store_pds): dst is its (1, BLK_M, BLK_N) partition.
  template <class Acc, class Dst>
  static void store_pds_rows(Acc const& acc, Dst const& dst) {
    using namespace cute;
    static_assert(decltype(size<0>(dst))::value == 1 && host_mode_stride(layout<2>(typename Dst::layout_type{})) == 1,
                  "row-major P/dS tiles");
    Base::store_acc_rows(acc, raw_pointer_cast(&dst(0)), host_mode_stride(layout<1>(typename Dst::layout_type{})),
                         int(size<1>(dst)), int(size<2>(dst)));
  }

  // A dQ slice has one writer on the host (launch_host_bwd.h): a plain add is the accumulation.
  static void atomic_add(float* p, float x) { *p += x; }
};

}  // namespace flash_ext
