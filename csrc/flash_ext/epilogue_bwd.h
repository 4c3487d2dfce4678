// The backward's writes to HBM: each K/V tile's share of dQ added into the fp32 accumulators (every
// iteration), and dK, dV stored once per K/V tile at the end.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "block_info.h"
#include "copy.h"
#include "flags.h"
#include "gemm.h"
#include "params.h"

namespace flash_ext {

// acc_dq: (MMA, MMA_M, MMA_K) accumulator of dS.K for query tile m_block of head bidh, added element by
// element into slice dq_slice of the accumulators (Traits::atomic_add: red.global.add.f32 on the GPU, where
// other CTAs add into the same rows; a plain add on the host, where the slice has one writer).  Rows past the
// sequence and head-dim padding are skipped: their values are 0, but their addresses belong to other rows.
template <class Traits, class Flags, class AccDQ>
CUTE_HOST_DEVICE void accumulate_dq(BwdParams const& params, BlockInfo const& binfo, Flags const& flags,
                                    AccDQ const& acc_dq, int tidx, int bidb, int bidh, int m_block, int dq_slice) {
  using namespace cute;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(tidx);
  Tensor tdQcdQ = thr_mma_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // (MMA,MMA_M,MMA_K) -> (m,k)
  CUTE_STATIC_ASSERT_V(size(tdQcdQ) == size(acc_dq));
  int const row0 = m_block * kBlockM;
  int const rows_left = binfo.seqlen_q - row0;
  float* const dq_tile = params.dq_accum_ptr +
                         (index_t(dq_slice) * params.h + bidh) * params.accum_rows * params.d +
                         binfo.accum_row(params, bidb, row0) * params.d;
  if constexpr (Traits::kIsHost) {  // one thread holds the whole tile: row by row (the slice has one writer)
    int const rows = flags.even_mn ? kBlockM : cute::min(rows_left, kBlockM);
    Traits::add_acc_rows(acc_dq, dq_tile, params.d, rows, flags.even_k ? kHeadDim : params.d);
    return;
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) {
    int const r = get<0>(tdQcdQ(i));
    int const c = get<1>(tdQcdQ(i));
    if ((flags.even_mn || r < rows_left) && (flags.even_k || c < params.d)) {
      Traits::atomic_add(dq_tile + index_t(r) * params.d + c, acc_dq(i));
    }
  }
}

// acc_dk, acc_dv: (MMA, MMA_N, MMA_K) accumulators of K/V tile n_block of K/V head bidh_kv (summed over the
// query heads of its group).  dK is scaled by softmax_scale here (dS was kept unscaled), both are converted to
// the element type, staged through shared memory (sdK, sdV: the K and V tiles' bytes) so that global stores
// are row-contiguous 16-byte vectors, and stored with row and column predicates.  The host's one thread holds
// both whole column-major tiles and stores them row by row into global memory (HostTraits::store_acc_rows).
// Precondition: none; the function waits until no thread still reads sK/sV.
template <class Traits, class Flags, class AccDK, class AccDV>
CUTE_HOST_DEVICE void write_dk_dv(BwdParams const& params, BlockInfo const& binfo, Flags const& flags, AccDK& acc_dk,
                                  AccDV const& acc_dv,
                                  typename Traits::Element* smem_dk, typename Traits::Element* smem_dv, int tidx,
                                  int bidb, int bidh_kv, int n_block) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) { acc_dk(i) *= params.softmax_scale; }
  auto tile = [&](void* base, index_t batch_stride, index_t row_stride, index_t head_stride) {
    Element* const ptr = static_cast<Element*>(base) + head_stride * bidh_kv +
                         binfo.kv_tile_offset<Traits>(params, bidb, n_block, kBlockN, batch_stride, row_stride);
    return make_tensor(make_gmem_ptr(ptr), make_layout(Shape<Int<kBlockN>, Int<kHeadDim>>{},
                                                       make_stride(row_stride, _1{})));    // (BLK_N,HEAD_DIM)
  };
  int const rows_left = binfo.seqlen_k - n_block * kBlockN;
  if constexpr (Traits::kIsHost) {  // one thread holds both whole tiles: rows straight to global dK and dV
    int const rows = cute::min(rows_left, kBlockN);
    Traits::store_acc_rows(acc_dk, raw_pointer_cast(tile(params.dk_ptr, params.dk_batch_stride, params.dk_row_stride,
                                                         params.dk_head_stride).data()),
                           params.dk_row_stride, rows, params.d);
    Traits::store_acc_rows(acc_dv, raw_pointer_cast(tile(params.dv_ptr, params.dv_batch_stride, params.dv_row_stride,
                                                         params.dv_head_stride).data()),
                           params.dv_row_stride, rows, params.d);
    return;
  }
  Tensor rdK = convert_fragment<Traits, Element>(acc_dk);                                  // (MMA,MMA_N,MMA_K)
  Tensor rdV = convert_fragment<Traits, Element>(acc_dv);                                  // (MMA,MMA_N,MMA_K)

  typename Traits::TiledMmadKV tiled_mma_dkv;
  Tensor sdK = make_tensor(make_smem_ptr(smem_dk), typename Traits::SmemLayoutKV{});       // (BLK_N,HEAD_DIM)
  Tensor sdV = make_tensor(make_smem_ptr(smem_dv), typename Traits::SmemLayoutKV{});       // (BLK_N,HEAD_DIM)
  auto smem_tiled_copy_dKV = make_tiled_copy_C(typename Traits::SmemCopyAtomdKV{}, tiled_mma_dkv);
  auto smem_thr_copy_dKV = smem_tiled_copy_dKV.get_thread_slice(tidx);
  // The last reads of sK (dQ = dS.K) and sV (dP = dO.V^T) by other threads precede this barrier.
  Traits::barrier();
  copy(smem_tiled_copy_dKV, smem_thr_copy_dKV.retile_S(rdK), smem_thr_copy_dKV.partition_D(sdK));
  copy(smem_tiled_copy_dKV, smem_thr_copy_dKV.retile_S(rdV), smem_thr_copy_dKV.partition_D(sdV));
  // sdK/sdV were written in the MMA's thread layout and are read back in the copy's layout.
  Traits::barrier();

  Tensor gdK = tile(params.dk_ptr, params.dk_batch_stride, params.dk_row_stride, params.dk_head_stride);
  Tensor gdV = tile(params.dv_ptr, params.dv_batch_stride, params.dv_row_stride, params.dv_head_stride);
  typename Traits::GmemTiledCopydKV gmem_tiled_copy_dKV;
  auto gmem_thr_copy_dKV = gmem_tiled_copy_dKV.get_thread_slice(tidx);
  Tensor tdKVcdKV = gmem_thr_copy_dKV.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // (CPY,CPY_N,CPY_K) -> (n,k)
  // As in the forward epilogue, runtime even-ness is derived here rather than kept live across the main loop;
  // a static flag stays static.
  auto const full_rows = make_flag<std::remove_cv_t<decltype(flags.even_mn)>>(rows_left >= kBlockN);
  auto const full_cols = make_flag<std::remove_cv_t<decltype(flags.even_k)>>(params.d == kHeadDim);
  auto store = [&](auto const& sX, auto& gX) {
    Tensor tXsX = gmem_thr_copy_dKV.partition_S(sX);                                       // (CPY,CPY_N,CPY_K)
    Tensor tXgX = gmem_thr_copy_dKV.partition_D(gX);                                       // (CPY,CPY_N,CPY_K)
    Tensor tXrX = make_tensor<Element>(shape(tXgX));                                       // (CPY,CPY_N,CPY_K)
    copy(gmem_tiled_copy_dKV, tXsX, tXrX);
    copy_tile<Traits>(gmem_tiled_copy_dKV, tXrX, tXgX, tdKVcdKV, rows_left, params.d, full_rows, full_cols,
                      /*clear_oob=*/false);
  };
  store(sdK, gdK);
  store(sdV, gdV);
}

}  // namespace flash_ext
