// The forward kernel body: one CTA computes O and LSE for one (m_block, batch, head).  Written once over
// `Traits` (Sm80Traits on the GPU, HostTraits on the CPU) and `Flags` (static or runtime specialisation).
//
// Data journey: Q tile  HBM -> smem (once) -> registers (per k-slice);  K/V tiles HBM -> smem, streamed
// right to left over the visible range;  S = Q.K^T and P = softmax pieces live only in registers;  acc_o,
// row_max and row_sum live in registers across tiles;  O (and LSE) go back to HBM once, in the epilogue.
#pragma once

#include <cute/tensor.hpp>

#include "block_info.h"
#include "copy.h"
#include "dispatch.h"
#include "dropout.h"
#include "epilogue.h"
#include "flags.h"
#include "gemm.h"
#include "grid.h"
#include "mask.h"
#include "params.h"
#include "softmax.h"

namespace flash_ext {

// The flags of the forward body for this traits' tile (problem_flags is shared with the dispatcher).
template <class Traits, class Flags>
CUTE_HOST_DEVICE Flags flags_from_params(FwdParams const& p) {
  return flags_from_problem<Flags>(problem_flags(p, Traits::kBlockM, Traits::kBlockN, Traits::kHeadDim), p.is_causal);
}

template <class Traits, class Flags>
CUTE_HOST_DEVICE void compute_attn_1rowblock(FwdParams const& params, Flags const& flags, int bidb, int bidh,
                                             int m_block, int tidx, char* smem, int n_split = 0) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  // The (seed, offset) this launch used, for the backward: written once, before any CTA can exit early.
  if (flags.dropout && params.rng_state_out != nullptr && tidx == 0 && bidb == 0 && bidh == 0 && m_block == 0 &&
      n_split == 0) {
    PhiloxSeedOffset const so = dropout_seed_offset<Traits>(params);
    Traits::store_global(params.rng_state_out, int64_t(so.seed));
    Traits::store_global(params.rng_state_out + 1, int64_t(so.offset));
  }

  BlockInfo const binfo(params, bidb, via<Traits>);
  if (m_block * kBlockM >= binfo.seqlen_q) { return; }
  Window<Flags> const window(params, flags);
  int n_min = n_block_min<kBlockM, kBlockN>(binfo, window, m_block);
  int n_max = n_block_max<kBlockM, kBlockN>(binfo, window, m_block);
  if (flags.split) { restrict_to_split<kBlockN>(binfo, params.num_splits, n_split, n_min, n_max); }
  // LSE of a row that sees no key: +inf for a final result, -inf for a split partial.  Evaluated where it is
  // used, not held across the main loop (the head-dim-256 kernels have no register to spare for it).
  auto empty_lse = [&flags] { return flags.split ? -INFINITY : INFINITY; };

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor acc_o = make_acc_fragment<Traits>(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});   // (MMA,MMA_M,MMA_K)
  Tensor acc_o_rc = acc_rowcol<Traits::kAccValCols>(acc_o);                                 // (ROWS,COLS)
  constexpr int kNRows = decltype(size<0>(acc_o_rc))::value;
  // S = Q.K^T and O = P.V start from zero: cleared registers on the GPU.  Whole-tile GEMMs (the host, whose
  // accumulators are tiles in memory: 64 KiB each at 128 x 128) start their own tiles from zero instead of
  // writing a cleared tile and reading it straight back: every S, and O at its first P.V.
  constexpr auto kZeroS = cute::bool_constant<TileGemm<typename Traits::TiledMma>::value>{};
  if constexpr (!kZeroS) { clear(acc_o); }

  // No key is visible to any row of this tile (causal with seqlen_q > seqlen_k, narrow windows, a split
  // past the diagonal): O = 0 and LSE = +inf (a split partial: -inf), without touching K or V.
  if (n_max <= n_min) {
    if constexpr (kZeroS) { clear(acc_o); }
    Tensor lse = make_tensor<float>(Shape<Int<kNRows>>{});
    fill(lse, empty_lse());
    write_output<Traits>(params, binfo, flags, acc_o, lse, smem, tidx, bidb, bidh, m_block, n_split);
    return;
  }

  int const bidh_kv = bidh / params.h_h_k_ratio;  // GQA/MQA: consecutive query heads share a K/V head
  Tensor mQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(params.q_ptr) + binfo.q_offset(params.q_batch_stride, params.q_row_stride, bidb)),
                          make_shape(binfo.seqlen_q, params.h, params.d),
                          make_stride(params.q_row_stride, params.q_head_stride, _1{}));   // (SEQ_Q,H,D)
  Tensor gQ = local_tile(mQ(_, bidh, _), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));   // (BLK_M,HEAD_DIM)

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});  // (BLK_M,HEAD_DIM)
  Tensor sK = make_tensor(sQ.data() + cosize(typename Traits::SmemLayoutQ{}), typename Traits::SmemLayoutKV{});  // (BLK_N,HEAD_DIM)
  Tensor sV = make_tensor(sK.data() + cosize(typename Traits::SmemLayoutKV{}), typename Traits::SmemLayoutKV{});  // (BLK_N,HEAD_DIM)
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});                     // (HEAD_DIM,BLK_N)
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});  // (HEAD_DIM,BLK_N)

  // Global -> shared copies, with identity tensors for their predicates.
  typename Traits::GmemTiledCopyQKV gmem_tiled_copy_QKV;
  auto gmem_thr_copy_QKV = gmem_tiled_copy_QKV.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy_QKV.partition_S(gQ);                                          // (CPY,CPY_M,CPY_K)
  Tensor tQsQ = gmem_thr_copy_QKV.partition_D(sQ);                                          // (CPY,CPY_M,CPY_K)
  Tensor tKsK = gmem_thr_copy_QKV.partition_D(sK);                                          // (CPY,CPY_N,CPY_K)
  Tensor tVsV = gmem_thr_copy_QKV.partition_D(sV);                                          // (CPY,CPY_N,CPY_K)
  // K/V tile n_max - 1 as this thread's copy partition.  The loop then moves the partitions one tile left at a
  // time (kv_tile_step: one 64-bit add in a contiguous cache) rather than rebuilding them from the tile index:
  // the rebuild cost ~22 integer instructions per K or V tile (sm_90, head dim 64) and, at head dim 256, the
  // last register (four kernels spilled 8 bytes with it, none without).
  // block_info.h alone knows varlen offsets, cache batch indices, left padding and pages.
  int n_block = n_max - 1;
  auto kv_partition = [&](void const* base, index_t head_stride, index_t batch_stride, index_t row_stride) {
    Element const* ptr = static_cast<Element const*>(base) + head_stride * bidh_kv +
                         binfo.kv_tile_offset<Traits>(params, bidb, n_block, kBlockN, batch_stride, row_stride);
    Tensor gKV = make_tensor(make_gmem_ptr(ptr), make_layout(Shape<Int<kBlockN>, Int<kHeadDim>>{},
                                                             make_stride(row_stride, _1{})));  // (BLK_N,HEAD_DIM)
    return gmem_thr_copy_QKV.partition_S(gKV);                                                // (CPY,CPY_N,CPY_K)
  };
  Tensor tKgK = kv_partition(params.k_ptr, params.k_head_stride, params.k_batch_stride, params.k_row_stride);  // (CPY,CPY_N,CPY_K)
  Tensor tVgV = kv_partition(params.v_ptr, params.v_head_stride, params.v_batch_stride, params.v_row_stride);  // (CPY,CPY_N,CPY_K)
  // Moves a partition from tile n + 1 to tile n.
  auto step_left = [&](auto& tXgX, index_t batch_stride, index_t row_stride, int n) {
    tXgX.data() = tXgX.data() + binfo.kv_tile_step<Traits>(params, bidb, n, kBlockN, batch_stride, row_stride);
  };
  Tensor tQcQ = gmem_thr_copy_QKV.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));          // (CPY,CPY_M,CPY_K) -> (m,k)
  Tensor tKVcKV = gmem_thr_copy_QKV.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));        // (CPY,CPY_N,CPY_K) -> (n,k)

  // Shared -> register operands of the two GEMMs.
  Tensor tSrQ = make_a_fragment<Traits>(thr_mma, sQ);                                       // (MMA,MMA_M,MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);                                           // (MMA,MMA_N,MMA_K)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);                                // (MMA,MMA_K,MMA_N)
  auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ);                                            // (CPY,CPY_M,CPY_K)
  auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_K.partition_S(sK);                                            // (CPY,CPY_N,CPY_K)
  auto smem_tiled_copy_V = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_copy_V.partition_S(sVt);                                          // (CPY,CPY_K,CPY_N)

  // (row, col) of every score this thread holds, for masks, ALiBi and dropout.
  Tensor tScS_acc = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));  // (MMA,MMA_M,MMA_N) -> (m,n)
  Tensor tScS = acc_rowcol<Traits::kAccValCols>(tScS_acc);                                // (ROWS,COLS) -> (m,n)

  int const row0 = m_block * kBlockM;
  int const rows_left = binfo.seqlen_q - row0;

  // Prologue: Q and the right-most K tile in one cp.async group.
  copy_tile<Traits>(gmem_tiled_copy_QKV, tQgQ, tQsQ, tQcQ, rows_left, params.d, flags.even_mn, flags.even_k);
  copy_tile<Traits>(gmem_tiled_copy_QKV, tKgK, tKsK, tKVcKV, binfo.seqlen_k - n_block * kBlockN,
            params.d, flags.even_mn, flags.even_k);
  Traits::cp_async_fence();

  using AccSLayout = decltype(partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{}).layout());
  OnlineSoftmax<Traits, kNRows> softmax;
  bool const any_mask = !flags.even_mn || flags.causal || flags.local;
  // The mask in two forms (mask.h).  In the plain variants (kThreadScoreMask: `even`, `uneven`):
  // ThreadScoreMask and the masked tiles' bounds (block_info.h), both built here.  Elsewhere ScoreMask and
  // tile_fully_visible per tile, as written in the loop (placed there, they keep the runtime-window kernels'
  // loop as it was; docs/perf.md, "the causal mask relative to a thread's first score").
  constexpr bool kThreadMask = kThreadScoreMask<Flags>;
  auto const thread_mask = [&] {
    if constexpr (kThreadMask) { return ThreadScoreMask<Window<Flags>>(binfo, window, tScS); } else { return 0; }
  }();
  auto const masked = [&] {
    if constexpr (kThreadMask) {
      return masked_tiles<kBlockM, kBlockN>(binfo, window, m_block, n_min, n_max);
    } else {
      return 0;
    }
  }();
  // Right to left over [n_min, n_max): first the tiles some row sees only in part (sequence end, causal
  // diagonal), then the fully visible ones, which skip the mask, then the left edge of a local window.  One
  // loop with a CTA-uniform branch rather than three copies of the body: the copies cost registers (hd 256
  // spilled) and compile time, and the static "even" variant has no mask code at all (any_mask is false).
  bool first_tile = true;  // carried, not n_block == n_max - 1: n_max need not stay live across the loop
  for (; n_block >= n_min; --n_block) {
    Tensor acc_s = make_acc_fragment<Traits>(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA,MMA_M,MMA_N)
    if constexpr (!kZeroS) { clear(acc_s); }

    // K(n_block) has landed and is visible to all threads; and every thread has finished the previous
    // P.V, so sV may be overwritten.
    Traits::template cp_async_wait<0>();
    Traits::barrier();

    // V(n_block) streams in while S = Q.K^T runs.  Rows past seqlen_k are zero-filled (see copy_tile).
    copy_tile<Traits>(gmem_tiled_copy_QKV, tVgV, tVsV, tKVcKV, binfo.seqlen_k - n_block * kBlockN,
              params.d, flags.even_mn, flags.even_k);
    Traits::cp_async_fence();

    if constexpr (Traits::kQInRegs) {
      if (first_tile) {  // Q landed with the first K tile (same cp.async group)
        copy(smem_tiled_copy_Q, tSsQ, smem_thr_copy_Q.retile_D(tSrQ));
      }
      gemm_rs(acc_s, tSrQ, tSrK, tSsK, tiled_mma, smem_tiled_copy_K, smem_thr_copy_K, kZeroS);
    } else {
      gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_tiled_copy_Q, smem_tiled_copy_K, smem_thr_copy_Q,
              smem_thr_copy_K, kZeroS);
    }
    if (flags.softcap) { apply_softcap<Traits>(acc_s, params.softcap_prescale); }
    Tensor scores = acc_rowcol<Traits::kAccValCols>(acc_s);                                  // (ROWS,COLS)
    if constexpr (kThreadMask) {
      bool const need_mask = any_mask && masked(n_block);
      // A static true even_mn: every key of every tile is < seqlen_k.
      apply_score_mask<Traits>(thread_mask, scores, tScS, row0, n_block * kBlockN, flags.alibi,
                               alibi_slope_in_score_domain<Traits>(params, flags.alibi, bidb, bidh), need_mask,
                               flags.even_mn);
    } else {
      bool const need_mask = any_mask && !tile_fully_visible<kBlockM, kBlockN>(binfo, window, m_block, n_block);
      ScoreMask<Window<Flags>> const mask{binfo, window,
                                          alibi_slope_in_score_domain<Traits>(params, flags.alibi, bidb, bidh)};
      apply_score_mask<Traits>(mask, scores, tScS, row0, n_block * kBlockN, flags.alibi, need_mask);
    }

    // V(n_block) has landed; every thread is done reading sK, so K(n_block - 1) may overwrite it and
    // stream in during the softmax and P.V of this tile.
    Traits::template cp_async_wait<0>();
    Traits::barrier();
    if (n_block > n_min) {
      step_left(tKgK, params.k_batch_stride, params.k_row_stride, n_block - 1);
      copy_tile<Traits>(gmem_tiled_copy_QKV, tKgK, tKsK, tKVcKV, binfo.seqlen_k - (n_block - 1) * kBlockN,
                        params.d, flags.even_mn, flags.even_k);
      Traits::cp_async_fence();
      // The next tile's V source.  This tile's V copy took its addresses when it was issued.
      step_left(tVgV, params.v_batch_stride, params.v_row_stride, n_block - 1);
    }

    // On the host, O is not cleared (kZeroS): what rescale_o does to it at the first tile, the first P.V
    // overwrites.
    softmax.rescale_o(scores, acc_o_rc, params.score_scale_log2, first_tile);
    [[maybe_unused]] bool const first_pv = first_tile;
    first_tile = false;
    // Dropout zeroes probabilities after the row sums took them in: the LSE is that of the undropped softmax.
    // The mask's Philox rounds are issued here, after Q.K^T, not beside it: interleaved with the GEMM their
    // state was live next to the K fragments and the hd 128 kernel spilled on sm_90.
    if (flags.dropout) {
      // The mask's per-(batch, head) constants are rebuilt here from the kernel parameters (constant bank)
      // rather than kept live across the loop: five registers the hd 128 kernel does not have.
      DropoutRng const rng = DropoutRng::make(dropout_seed_offset<Traits>(params), bidb, bidh, params.h,
                                              params.dropout_threshold);
      apply_dropout_bits<Traits>(
          acc_s, dropout_keep_bits<Traits, AccSLayout>(tScS_acc, rng, row0, n_block * kBlockN));
    }

    // P goes straight from the accumulator registers into the A operand of P.V.
    Tensor tOrP = make_p_operand<Traits>(acc_s);                                              // (MMA,MMA_M,MMA_K)
    if constexpr (kZeroS) {
      TileGemm<typename Traits::TiledMma>::rs(acc_o, tOrP, tOsVt, first_pv);
    } else {
      gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_tiled_copy_V, smem_thr_copy_V);
    }
  }

  Tensor lse = softmax.finalize(acc_o_rc, params.score_scale, empty_lse(), flags.dropout, params.dropout_scale);
  // The last read of sQ (the final Q.K^T) happened before the loop's second barrier: sO may reuse it.
  write_output<Traits>(params, binfo, flags, acc_o, lse, smem, tidx, bidb, bidh, m_block, n_split);
}

// One CTA of the forward grid (grid.h): block (bx, by, bz) of a grid with gridDim.y == grid_y.  The body of
// the CUDA kernel and of the warp emulator's launch, so both decode the grid the same way.
template <class Traits, class Flags>
CUTE_HOST_DEVICE void fwd_cta(FwdParams const& params, unsigned bx, unsigned by, unsigned bz, unsigned grid_y,
                              int tidx, char* smem) {
  FwdBlock const blk = fwd_block(bx, by, bz, grid_y, params.b, params.h, params.num_splits);
  if (!blk.valid) { return; }
  compute_attn_1rowblock<Traits>(params, flags_from_params<Traits, Flags>(params), blk.bidb, blk.bidh, blk.m_block,
                                 tidx, smem, blk.n_split);
}

}  // namespace flash_ext
