// The backward kernel body: one CTA computes dK and dV for one K/V tile (n_block) of one (batch, K/V head),
// and adds that tile's share of dQ into fp32 accumulators.  Written once over `Traits` (Sm80BwdTraits on the
// GPU, HostBwdTraits on the CPU) and `Flags` (static or runtime specialisation), like the forward.
//
// The math, per query tile i that sees K/V tile j (scores in the kernel's domain x, see params.h):
//   S  = Q K^T,  x = softcap ? tanh(S * softmax_scale / softcap) : S,  then ALiBi and the mask (mask.h)
//   P  = exp(x * score_scale - LSE)              the forward's probabilities, recomputed from its LSE
//   dV += (P o keep)^T dO / (1 - p)              keep: the forward's dropout mask (dropout.h), else all ones
//   dP = (dO V^T) o keep / (1 - p)
//   dS = P * (dP - D) * (softcap ? 1 - tanh^2 : 1)   D = rowsum(dO * O) (bwd_preprocess.h); unscaled
//   dK += dS^T Q                                 scaled by softmax_scale once, in the epilogue
//   dQ += dS K                                   fp32 accumulators, scaled in the postprocess
// Everything S x S-shaped lives in registers (S, P, dP, dS) or in one tile of shared memory (P, dS, as the
// transposed operands of dV and dK and the A operand of dQ): no S x S buffer exists anywhere.
//
// Data journey: the K and V tiles  HBM -> smem once;  acc_dk, acc_dv in registers across the whole walk;
// for each query head of the K/V head's group and each query tile that sees this K/V tile: Q, dO tiles
// HBM -> smem (Q double-buffered where shared memory allows), LSE and D rows HBM -> registers;  P, dS
// registers -> smem -> registers;  dQ registers -> HBM accumulators (atomic adds);  dK, dV -> HBM once.
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>

#include "block_info.h"
#include "copy.h"
#include "dispatch.h"
#include "dropout.h"
#include "epilogue_bwd.h"
#include "flags.h"
#include "gemm.h"
#include "mask.h"
#include "params.h"

namespace flash_ext {

// The flags as the backward body sees them (the forward's problem_flags for the backward's tile; split-KV
// does not exist in the backward).
template <class Traits, class Flags>
CUTE_HOST_DEVICE Flags bwd_flags_from_params(BwdParams const& p) {
  ProblemFlags pf = problem_flags(p, Traits::kBlockM, Traits::kBlockN, Traits::kHeadDim);
  pf.split = false;
  return flags_from_problem<Flags>(pf, p.is_causal);
}

// Registers -> shared memory for P and dS: converted to ElementPdS (fp16/bf16 on the GPU, where they feed
// tensor cores; the accumulator itself on the host, where ElementPdS is fp32, stored row by row into the
// row-major tile: a transposing copy, by the CPU level's micro-kernel).
template <class Traits, class Acc, class TiledCopy, class ThrCopy, class Dst>
CUTE_HOST_DEVICE void store_pds(Acc const& acc, TiledCopy const& tiled_copy, ThrCopy const& thr_copy, Dst&& dst) {
  using ElementPdS = typename Traits::ElementPdS;
  if constexpr (Traits::kIsHost) {
    Traits::store_pds_rows(acc, dst);
  } else if constexpr (std::is_same_v<ElementPdS, typename Acc::value_type>) {
    cute::copy(tiled_copy, thr_copy.retile_S(acc), dst);
  } else {
    auto r = convert_fragment<Traits, ElementPdS>(acc);
    cute::copy(tiled_copy, thr_copy.retile_S(r), dst);
  }
}

// dq_slice: the dQ accumulator slice this CTA adds into (BwdParams::dq_accum_splits).  Every thread of the
// CTA calls this with the same arguments; a CTA may call it for several K/V tiles in turn.
template <class Traits, class Flags>
CUTE_HOST_DEVICE void compute_dq_dk_dv_1colblock(BwdParams const& params, Flags const& flags, int bidb, int bidh_kv,
                                                 int n_block, int dq_slice, int tidx, char* smem) {
  using namespace cute;
  using Element = typename Traits::Element;
  using ElementPdS = typename Traits::ElementPdS;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kQBuffers = Traits::kDoubleBufferQ ? 2 : 1;

  BlockInfo const binfo(params, bidb, via<Traits>);
  if (n_block * kBlockN >= binfo.seqlen_k) { return; }  // no key of this sequence here: no dK/dV row to write
  WindowCopy<Flags> const window(params, flags);
  int const m_min = m_block_min<kBlockM, kBlockN>(binfo, window, n_block);
  int const m_max = m_block_max<kBlockM, kBlockN>(binfo, window, n_block);

  // Shared memory: Q (1 or 2 buffers), dO, K, V tiles, then P and dS.
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQdO{});  // (BLK_M,HEAD_DIM)
  Tensor sdO = make_tensor(sQ.data() + kQBuffers * cosize(typename Traits::SmemLayoutQdO{}),
                           typename Traits::SmemLayoutQdO{});                              // (BLK_M,HEAD_DIM)
  Tensor sK = make_tensor(sdO.data() + cosize(typename Traits::SmemLayoutQdO{}), typename Traits::SmemLayoutKV{});  // (BLK_N,HEAD_DIM)
  Tensor sV = make_tensor(sK.data() + cosize(typename Traits::SmemLayoutKV{}), typename Traits::SmemLayoutKV{});    // (BLK_N,HEAD_DIM)
  Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<ElementPdS*>((sV.data() + cosize(typename Traits::SmemLayoutKV{})).get())),
                          typename Traits::SmemLayoutPdS{});                               // (BLK_M,BLK_N)
  Tensor sdS = make_tensor(sP.data() + cosize(typename Traits::SmemLayoutPdS{}), typename Traits::SmemLayoutPdS{});  // (BLK_M,BLK_N)
  Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQdOt{});                 // (HEAD_DIM,BLK_M)
  Tensor sQtNoSwizzle = make_tensor(sQ.data().get(), typename Traits::SmemLayoutQdOtNoSwizzle{});  // (HEAD_DIM,BLK_M)
  Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQdOt{});               // (HEAD_DIM,BLK_M)
  Tensor sdOtNoSwizzle = make_tensor(sdO.data().get(), typename Traits::SmemLayoutQdOtNoSwizzle{});  // (HEAD_DIM,BLK_M)
  Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});                   // (HEAD_DIM,BLK_N)
  Tensor sKtNoSwizzle = make_tensor(sK.data().get(), typename Traits::SmemLayoutKtNoSwizzle{});  // (HEAD_DIM,BLK_N)
  Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPdSt{});                 // (BLK_N,BLK_M)
  Tensor sPtNoSwizzle = make_tensor(sP.data().get(), typename Traits::SmemLayoutPdStNoSwizzle{});  // (BLK_N,BLK_M)
  Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPdSt{});               // (BLK_N,BLK_M)

  // A CTA that runs several K/V tiles in turn (deterministic mode) may still have threads storing the previous
  // tile's dK/dV out of sK/sV: the loads below would overwrite them.
  Traits::barrier();

  typename Traits::TiledMmadKV tiled_mma_dkv;
  auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(tidx);
  Tensor acc_dk = make_acc_fragment<Traits>(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA,MMA_N,MMA_K)
  Tensor acc_dv = make_acc_fragment<Traits>(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (MMA,MMA_N,MMA_K)
  clear(acc_dk);
  clear(acc_dv);

  // No query row sees a key of this tile (keys left of every row's local window, a sequence without
  // queries): dK = dV = 0, without reading anything.
  if (m_max <= m_min) {
    write_dk_dv<Traits>(params, binfo, flags, acc_dk, acc_dv, sK.data().get(), sV.data().get(), tidx, bidb, bidh_kv, n_block);
    return;
  }

  typename Traits::TiledMmaSdP tiled_mma_sdp;
  auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(tidx);
  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(tidx);

  // Global memory: this CTA's K and V tiles, and (per iteration) a Q and a dO tile of some query head.
  Element const* const k_head = static_cast<Element const*>(params.k_ptr) + params.k_head_stride * bidh_kv;
  Element const* const v_head = static_cast<Element const*>(params.v_ptr) + params.v_head_stride * bidh_kv;
  Tensor gK = make_tensor(make_gmem_ptr(k_head + binfo.kv_tile_offset<Traits>(params, bidb, n_block, kBlockN, params.k_batch_stride, params.k_row_stride)),
                          make_layout(Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(params.k_row_stride, _1{})));  // (BLK_N,HEAD_DIM)
  Tensor gV = make_tensor(make_gmem_ptr(v_head + binfo.kv_tile_offset<Traits>(params, bidb, n_block, kBlockN, params.v_batch_stride, params.v_row_stride)),
                          make_layout(Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(params.v_row_stride, _1{})));  // (BLK_N,HEAD_DIM)
  Element const* const q_seq = static_cast<Element const*>(params.q_ptr) + binfo.q_offset(params.q_batch_stride, params.q_row_stride, bidb);
  Element const* const do_seq = static_cast<Element const*>(params.do_ptr) + binfo.q_offset(params.do_batch_stride, params.do_row_stride, bidb);
  auto row_tile = [&](Element const* seq, index_t row_stride, index_t head_stride, int bidh, int m_block) {
    return make_tensor(make_gmem_ptr(seq + head_stride * bidh + index_t(m_block) * kBlockM * row_stride),
                       make_layout(Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(row_stride, _1{})));  // (BLK_M,HEAD_DIM)
  };

  typename Traits::GmemTiledCopyQKV gmem_tiled_copy_QKV;
  auto gmem_thr_copy_QKV = gmem_tiled_copy_QKV.get_thread_slice(tidx);
  Tensor tQsQ = gmem_thr_copy_QKV.partition_D(sQ);                                          // (CPY,CPY_M,CPY_K)
  Tensor tdOsdO = gmem_thr_copy_QKV.partition_D(sdO);                                       // (CPY,CPY_M,CPY_K)
  Tensor tKsK = gmem_thr_copy_QKV.partition_D(sK);                                          // (CPY,CPY_N,CPY_K)
  Tensor tVsV = gmem_thr_copy_QKV.partition_D(sV);                                          // (CPY,CPY_N,CPY_K)
  Tensor tQcQ = gmem_thr_copy_QKV.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));    // (CPY,CPY_M,CPY_K) -> (m,k)
  Tensor tKVcKV = gmem_thr_copy_QKV.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // (CPY,CPY_N,CPY_K) -> (n,k)

  // Register operands of the five GEMMs.  P^T and dS^T (A of dV, dK) and dS (A of dQ) are ElementPdS.
  Tensor tSrQ = thr_mma_sdp.partition_fragment_A(sQ);                                       // (MMA,MMA_M,MMA_K)
  Tensor tSrK = thr_mma_sdp.partition_fragment_B(sK);                                       // (MMA,MMA_N,MMA_K)
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO);                                    // (MMA,MMA_M,MMA_K)
  Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);                                      // (MMA,MMA_N,MMA_K)
  Tensor tdKVrPdSt = make_tensor<ElementPdS>(thr_mma_dkv.partition_fragment_A(sPtNoSwizzle).layout());  // (MMA,MMA_N,MMA_M)
  Tensor tdVrdOt = thr_mma_dkv.partition_fragment_B(sdOtNoSwizzle);                         // (MMA,MMA_K,MMA_M)
  Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(sQtNoSwizzle);                           // (MMA,MMA_K,MMA_M)
  Tensor tdQrdS = make_tensor<ElementPdS>(thr_mma_dq.partition_fragment_A(sdS).layout());  // (MMA,MMA_M,MMA_N)
  Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKtNoSwizzle);                            // (MMA,MMA_K,MMA_N)

  // Shared -> register copies (ldmatrix on the GPU; .trans for the transposed operands).
  auto smem_tiled_copy_QdO = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma_sdp);
  auto smem_thr_copy_QdO = smem_tiled_copy_QdO.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_QdO.partition_S(sQ);                                          // (CPY,CPY_M,CPY_K)
  Tensor tdPsdO = smem_thr_copy_QdO.partition_S(sdO);                                       // (CPY,CPY_M,CPY_K)
  auto smem_tiled_copy_KV = make_tiled_copy_B(typename Traits::SmemCopyAtomSdPB{}, tiled_mma_sdp);
  auto smem_thr_copy_KV = smem_tiled_copy_KV.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_KV.partition_S(sK);                                           // (CPY,CPY_N,CPY_K)
  Tensor tdPsV = smem_thr_copy_KV.partition_S(sV);                                          // (CPY,CPY_N,CPY_K)
  auto smem_tiled_copy_PdSt = make_tiled_copy_A(typename Traits::SmemCopyAtomPdSTransposed{}, tiled_mma_dkv);
  auto smem_thr_copy_PdSt = smem_tiled_copy_PdSt.get_thread_slice(tidx);
  Tensor tdVsPt = smem_thr_copy_PdSt.partition_S(sPt);                                      // (CPY,CPY_N,CPY_M)
  Tensor tdKsdSt = smem_thr_copy_PdSt.partition_S(sdSt);                                    // (CPY,CPY_N,CPY_M)
  auto smem_tiled_copy_QdOt = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dkv);
  auto smem_thr_copy_QdOt = smem_tiled_copy_QdOt.get_thread_slice(tidx);
  Tensor tdVsdOt = smem_thr_copy_QdOt.partition_S(sdOt);                                    // (CPY,CPY_K,CPY_M)
  Tensor tdKsQt = smem_thr_copy_QdOt.partition_S(sQt);                                      // (CPY,CPY_K,CPY_M)
  auto smem_tiled_copy_dS = make_tiled_copy_A(typename Traits::SmemCopyAtomPdS{}, tiled_mma_dq);
  auto smem_thr_copy_dS = smem_tiled_copy_dS.get_thread_slice(tidx);
  Tensor tdQsdS = smem_thr_copy_dS.partition_S(sdS);                                        // (CPY,CPY_M,CPY_N)
  auto smem_tiled_copy_Kt = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dq);
  auto smem_thr_copy_Kt = smem_tiled_copy_Kt.get_thread_slice(tidx);
  Tensor tdQsKt = smem_thr_copy_Kt.partition_S(sKt);                                        // (CPY,CPY_K,CPY_N)
  // Registers -> shared memory for P and dS, in the S accumulator's thread layout.
  auto smem_tiled_copy_PdS = make_tiled_copy_C(typename Traits::SmemCopyAtomStorePdS{}, tiled_mma_sdp);
  auto smem_thr_copy_PdS = smem_tiled_copy_PdS.get_thread_slice(tidx);
  Tensor tPsP = smem_thr_copy_PdS.partition_D(sP);                                          // (CPY,CPY_M,CPY_N)
  Tensor tdSsdS = smem_thr_copy_PdS.partition_D(sdS);                                       // (CPY,CPY_M,CPY_N)

  // Q buffer b of a partition of sQ (double buffering moves only the data pointer; the swizzle pattern
  // repeats every buffer, whose size is a multiple of it).
  auto q_buffer = [](auto const& t, int b) {
    return make_tensor(t.data() + b * int(cosize(typename Traits::SmemLayoutQdO{})), t.layout());
  };

  // (row, col) of every score this thread holds, and one LSE and one D per row it holds.
  Tensor tScS_acc = thr_mma_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));  // (MMA,MMA_M,MMA_N) -> (m,n)
  Tensor tScS = acc_rowcol<Traits::kAccValCols>(tScS_acc);                                // (ROWS,COLS) -> (m,n)
  constexpr int kNRows = decltype(size<0>(tScS))::value;
  // Dropout: the forward's mask, regenerated from the same (seed, offset) and coordinates (dropout.h).
  using AccSLayout = decltype(partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{}).layout());

  // The walk: for each query head of the group, the query tiles [m_min, m_max) in order.  One flat loop, so
  // that the prefetch of the next Q/dO tile crosses head boundaries like any other step.
  int const num_m = m_max - m_min;
  int const n_iters = num_m * params.h_h_k_ratio;
  auto head_of = [&](int it) { return bidh_kv * params.h_h_k_ratio + it / num_m; };
  auto m_block_of = [&](int it) { return m_min + it % num_m; };
  auto load_q = [&](int it, int buffer) {
    int const m_block = m_block_of(it);
    Tensor tQgQ = gmem_thr_copy_QKV.partition_S(row_tile(q_seq, params.q_row_stride, params.q_head_stride, head_of(it), m_block));
    Tensor tQsQ_buf = q_buffer(tQsQ, buffer);
    copy_tile<Traits>(gmem_tiled_copy_QKV, tQgQ, tQsQ_buf, tQcQ, binfo.seqlen_q - m_block * kBlockM, params.d,
                      flags.even_mn, flags.even_k);
  };
  // dO rows past seqlen_q are zero-filled: P is 0 there, but 0 * NaN in dV += P^T dO would be NaN.
  auto load_do = [&](int it) {
    int const m_block = m_block_of(it);
    Tensor tdOgdO = gmem_thr_copy_QKV.partition_S(row_tile(do_seq, params.do_row_stride, params.do_head_stride, head_of(it), m_block));
    copy_tile<Traits>(gmem_tiled_copy_QKV, tdOgdO, tdOsdO, tQcQ, binfo.seqlen_q - m_block * kBlockM, params.d,
                      flags.even_mn, flags.even_k);
  };

  // Prologue: K, V and the first Q, dO tiles in one cp.async group.  K/V rows past seqlen_k are zero-filled
  // (scores there are masked, and dQ = dS K must not meet NaN).
  int const keys_left = binfo.seqlen_k - n_block * kBlockN;
  copy_tile<Traits>(gmem_tiled_copy_QKV, gmem_thr_copy_QKV.partition_S(gK), tKsK, tKVcKV, keys_left, params.d,
                    flags.even_mn, flags.even_k);
  copy_tile<Traits>(gmem_tiled_copy_QKV, gmem_thr_copy_QKV.partition_S(gV), tVsV, tKVcKV, keys_left, params.d,
                    flags.even_mn, flags.even_k);
  load_q(0, 0);
  load_do(0);
  Traits::cp_async_fence();

  bool const any_mask = !flags.even_mn || flags.causal || flags.local;
  // Whole-tile GEMMs (the host) write S, dP and dQ outright instead of adding to cleared tiles: on the host
  // a clear is a memset of 64 KiB per iteration at d = 128 (2.5% of a training step's samples; docs/perf.md).
  constexpr auto kZeroAcc = cute::bool_constant<TileGemm<typename Traits::TiledMmaSdP>::value &&
                                                TileGemm<typename Traits::TiledMmadQ>::value>{};
  static_assert(!kZeroAcc || !Traits::kKVInRegs, "register-fragment MMAs accumulate into cleared tiles");
  for (int it = 0; it < n_iters; ++it) {
    int const bidh = head_of(it);
    int const m_block = m_block_of(it);
    int const row0 = m_block * kBlockM;
    int const q_buf = Traits::kDoubleBufferQ ? it % 2 : 0;
    bool const has_next = it + 1 < n_iters;

    // Q(it) and dO(it) have landed and are visible to all threads; every thread has finished iteration
    // it - 1, so sP, sdS and the other Q buffer (last read by its dK = dS^T Q) may be overwritten.
    Traits::template cp_async_wait<0>();
    Traits::barrier();
    if constexpr (Traits::kKVInRegs) {
      if (it == 0) {  // K and V landed with the first Q/dO tiles; their operand fragments serve the whole walk
        copy(smem_tiled_copy_KV, tSsK, smem_thr_copy_KV.retile_D(tSrK));
        copy(smem_tiled_copy_KV, tdPsV, smem_thr_copy_KV.retile_D(tdPrV));
        copy(smem_tiled_copy_Kt, tdQsKt, smem_thr_copy_Kt.retile_D(tdQrKt));
      }
    }
    if constexpr (Traits::kDoubleBufferQ) {
      if (has_next) {  // Q(it + 1) streams in during this whole iteration
        load_q(it + 1, 1 - q_buf);
        Traits::cp_async_fence();
      }
    }

    // LSE and D of this thread's rows.  Rows past seqlen_q get LSE = +inf, so that their P is exactly 0 (their
    // Q rows are zero, but ALiBi could still give them finite scores).  A row whose LSE says it saw no key (+inf
    // from the forward; -inf from a caller's merged LSE) likewise gets P = 0.
    index_t const row_stats = binfo.lse_offset(params, bidb, bidh) + row0;
    Tensor lse_log2 = make_tensor<float>(Shape<Int<kNRows>>{});
    Tensor dsum = make_tensor<float>(Shape<Int<kNRows>>{});
    CUTE_UNROLL
    for (int i = 0; i < kNRows; ++i) {
      int const r = get<0>(tScS(i, 0));
      bool const in = flags.even_mn || r < binfo.seqlen_q - row0;
      float const lse = in ? Traits::load_global(params.softmax_lse_ptr + row_stats + r) : INFINITY;
      lse_log2(i) = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
      dsum(i) = in ? Traits::load_global(params.softmax_d_ptr + row_stats + r) : 0.f;
    }

    // dP = dO V^T, then S = Q K^T (dP first: the softcap derivative is folded into it while S is at hand).
    Tensor acc_dp = make_acc_fragment<Traits>(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA,MMA_M,MMA_N)
    Tensor acc_s = make_acc_fragment<Traits>(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});   // (MMA,MMA_M,MMA_N)
    if constexpr (!kZeroAcc) {
      clear(acc_dp);
      clear(acc_s);
    }
    if constexpr (Traits::kKVInRegs) {
      gemm_sr(acc_dp, tdPrdO, tdPrV, tdPsdO, tiled_mma_sdp, smem_tiled_copy_QdO, smem_thr_copy_QdO);
      gemm_sr(acc_s, tSrQ, tSrK, q_buffer(tSsQ, q_buf), tiled_mma_sdp, smem_tiled_copy_QdO, smem_thr_copy_QdO);
    } else {
      gemm_ss(acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, tiled_mma_sdp, smem_tiled_copy_QdO, smem_tiled_copy_KV,
              smem_thr_copy_QdO, smem_thr_copy_KV, kZeroAcc);
      gemm_ss(acc_s, tSrQ, tSrK, q_buffer(tSsQ, q_buf), tSsK, tiled_mma_sdp, smem_tiled_copy_QdO,
              smem_tiled_copy_KV, smem_thr_copy_QdO, smem_thr_copy_KV, kZeroAcc);
    }
    Tensor scores = acc_rowcol<Traits::kAccValCols>(acc_s);                                  // (ROWS,COLS)
    Tensor dp = acc_rowcol<Traits::kAccValCols>(acc_dp);                                     // (ROWS,COLS)

    // This tile's keep bits (the forward's mask of query head bidh).  Generated after the GEMMs, not beside
    // them: interleaved with the GEMMs, the Philox state was live next to the operand fragments and the sm_90
    // dropout kernel spilled.  Only the packed bits stay live until dV's operand below.
    DropoutBits<Traits, AccSLayout> keep;
    if (flags.dropout) {
      // Rebuilt per tile from the parameters (constant bank) rather than kept live across the walk.
      DropoutRng const rng = DropoutRng::make(dropout_seed_offset<Traits>(params), bidb, bidh, params.h,
                                              params.dropout_threshold);
      // One group at a time where a thread's bits fit one word (the GPU tiles): see dropout_keep_bits.
      constexpr bool kRolled = DropoutBits<Traits, AccSLayout>::kWords == 1;
      keep = dropout_keep_bits<Traits, AccSLayout, kRolled>(tScS_acc, rng, row0, n_block * kBlockN);
    }

    // Dropout: out = (P o keep) V / (1 - p), so the gradient reaching P is dO V^T o keep / (1 - p).
    if (flags.dropout) {
      apply_dropout_bits<Traits>(acc_dp, keep);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dp); ++i) { acc_dp(i) *= params.dropout_scale; }
    }

    // dp <- (dP - D) * d(score)/d(x): with softcap the score is softcap * tanh(S * scale / softcap), whose
    // derivative w.r.t. S * scale is 1 - tanh^2.  ALiBi is additive (derivative 1) and applied afterwards.
    if (flags.softcap) {
      apply_softcap<Traits>(acc_s, params.softcap_prescale);
      CUTE_UNROLL
      for (int i = 0; i < kNRows; ++i) {
        CUTE_UNROLL
        for (int j = 0; j < size<1>(dp); ++j) { dp(i, j) = (dp(i, j) - dsum(i)) * (1.f - scores(i, j) * scores(i, j)); }
      }
    } else if constexpr (!Traits::kIsHost) {  // the host subtracts D in its pass that forms P and dS, below
      CUTE_UNROLL
      for (int i = 0; i < kNRows; ++i) {
        CUTE_UNROLL
        for (int j = 0; j < size<1>(dp); ++j) { dp(i, j) -= dsum(i); }
      }
    }

    // The forward's ALiBi and mask, then P = exp(score - LSE) (one FFMA + EX2 per score on the GPU).  Masked
    // scores are -inf and give P = 0 exactly.
    ScoreMask<WindowCopy<Flags>> const mask{binfo, window,
                                            alibi_slope_in_score_domain<Traits>(params, flags.alibi, bidb, bidh)};
    bool const need_mask = any_mask && !tile_fully_visible<kBlockM, kBlockN>(binfo, window, m_block, n_block);
    apply_score_mask<Traits>(mask, scores, tScS, row0, n_block * kBlockN, flags.alibi, need_mask);
    // Then dS = P * dp, in place in the dP accumulator (P undropped: the softmax saw every score).
    if constexpr (Traits::kIsHost) {  // both over the whole tile in one pass, by the CPU level's vector exp2
      Traits::probs_and_ds(scores, dp, lse_log2, dsum, /*subtract_d=*/!flags.softcap, params.score_scale_log2);
    } else {
      CUTE_UNROLL
      for (int i = 0; i < kNRows; ++i) {
        CUTE_UNROLL
        for (int j = 0; j < size<1>(scores); ++j) {
          scores(i, j) = Traits::exp2(scores(i, j) * params.score_scale_log2 - lse_log2(i));
        }
      }
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dp); ++i) { acc_dp(i) *= acc_s(i); }
    }
    // dV's operand is the dropped P (the 1 / (1 - p) is applied to dV once, in the epilogue).
    if (flags.dropout) { apply_dropout_bits<Traits>(acc_s, keep); }
    store_pds<Traits>(acc_s, smem_tiled_copy_PdS, smem_thr_copy_PdS, tPsP);
    store_pds<Traits>(acc_dp, smem_tiled_copy_PdS, smem_thr_copy_PdS, tdSsdS);

    // sP and sdS were written in the S accumulator's thread layout and are read in the dK/dV and dQ MMAs'.
    Traits::barrier();

    gemm_ss(acc_dv, tdKVrPdSt, tdVrdOt, tdVsPt, tdVsdOt, tiled_mma_dkv, smem_tiled_copy_PdSt, smem_tiled_copy_QdOt,
            smem_thr_copy_PdSt, smem_thr_copy_QdOt);
    gemm_ss(acc_dk, tdKVrPdSt, tdKrQt, tdKsdSt, q_buffer(tdKsQt, q_buf), tiled_mma_dkv, smem_tiled_copy_PdSt,
            smem_tiled_copy_QdOt, smem_thr_copy_PdSt, smem_thr_copy_QdOt);

    // Every thread is done with sdO (and with a single-buffered sQ): the next tile streams in during dQ.
    if (has_next) {
      Traits::barrier();
      if constexpr (!Traits::kDoubleBufferQ) { load_q(it + 1, 0); }
      load_do(it + 1);
      Traits::cp_async_fence();
    }

    Tensor acc_dq = make_acc_fragment<Traits>(tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA,MMA_M,MMA_K)
    if constexpr (!kZeroAcc) { clear(acc_dq); }
    if constexpr (Traits::kDSFromAcc) {
      // The dS accumulator's registers already are the A operand of dS.K (one thread, the atom's K equals
      // its N, as for P in the forward's P.V).  K^T comes from registers loaded once (kKVInRegs) or from sKt.
      Tensor tdQrdS_acc = make_tensor(acc_dp.data(), Traits::acc_to_a_layout(acc_dp.layout()));  // (MMA,MMA_M,MMA_N)
      if constexpr (Traits::kKVInRegs) {
        cute::gemm(tiled_mma_dq, tdQrdS_acc, tdQrKt, acc_dq);
      } else {
        gemm_rs(acc_dq, tdQrdS_acc, tdQrKt, tdQsKt, tiled_mma_dq, smem_tiled_copy_Kt, smem_thr_copy_Kt, kZeroAcc);
      }
    } else {
      gemm_ss(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, tiled_mma_dq, smem_tiled_copy_dS, smem_tiled_copy_Kt,
              smem_thr_copy_dS, smem_thr_copy_Kt, kZeroAcc);
    }
    accumulate_dq<Traits>(params, binfo, flags, acc_dq, tidx, bidb, bidh, m_block, dq_slice);
  }

  if (flags.dropout) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dv); ++i) { acc_dv(i) *= params.dropout_scale; }
  }
  write_dk_dv<Traits>(params, binfo, flags, acc_dk, acc_dv, sK.data().get(), sV.data().get(), tidx, bidb, bidh_kv, n_block);
}

}  // namespace flash_ext
