// Problem description shared by every backend. Plain data: no torch, no CUDA types, so the same struct
// is filled by the op layer (csrc/ops/) and read by the host and the device instances of the kernel body.
#pragma once

#include <cstdint>

namespace flash_ext {

using index_t = int64_t;

struct FwdParams {
  // Q (b, seqlen_q, h, d), K/V (b, seqlen_k, h_k, d), O like Q.  Last dim contiguous; other strides in
  // elements.  Pointers and row/head/batch strides are 16-byte aligned (the op layer guarantees it) so the
  // GPU traits may move 128-bit vectors.
  void const* __restrict__ q_ptr = nullptr;
  void const* __restrict__ k_ptr = nullptr;
  void const* __restrict__ v_ptr = nullptr;
  void* __restrict__ o_ptr = nullptr;
  index_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  index_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  index_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  index_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  // Log-sum-exp of each query row's scores, (b, h, seqlen_q) fp32, contiguous.  +inf for a row that sees
  // no key (its O row is 0).
  float* __restrict__ softmax_lse_ptr = nullptr;

  // Variable-length batches: sequence i of the batch occupies rows [cu_seqlens_q[i], cu_seqlens_q[i+1]) of
  // q/o (total_q, h, d) and [cu_seqlens_k[i], cu_seqlens_k[i+1]) of k/v (total_k, h_k, d).  seqused_k, if
  // set, limits sequence i to its first seqused_k[i] keys.  seqlen_q/seqlen_k then hold the maxima (they
  // size the grid), and the LSE is (h, total_q).  nullptr: fixed-length batch.
  int const* __restrict__ cu_seqlens_q = nullptr;
  int const* __restrict__ cu_seqlens_k = nullptr;
  int const* __restrict__ seqused_k = nullptr;
  int total_q = 0;

  // KV cache (flash_attn_with_kvcache): batch entry b reads K/V batch kv_batch_idx[b] of the cache, starting
  // at row leftpad_k[b]; seqused_k[b] is then its number of keys.  Paged caches: k/v are (num_pages,
  // page_size, h_k, d), and row j of batch b lives in page block_table[b * block_table_batch_stride +
  // j / page_size] (page_size is a multiple of every kBlockN, so a K/V tile never straddles pages).
  int const* __restrict__ kv_batch_idx = nullptr;
  int const* __restrict__ leftpad_k = nullptr;
  int const* __restrict__ block_table = nullptr;
  index_t block_table_batch_stride = 0;
  int page_size = 0;

  int b = 0, h = 0, h_k = 0;
  int h_h_k_ratio = 1;  // h / h_k: query heads sharing one K/V head (MQA/GQA)
  int seqlen_q = 0, seqlen_k = 0;
  int d = 0;  // actual head dim (a multiple of 8); the kernel's kHeadDim is >= d

  // Score domain.  The kernel keeps x = S (or tanh(S * scale / softcap) with softcap) and the true score is
  // x * score_scale.  exp2 of (x - max) * score_scale_log2 is then exp(score - max_score).
  float softmax_scale = 1.f;     // the user's scale applied to q.k
  float softcap = 0.f;           // 0: off
  float softcap_prescale = 0.f;  // softmax_scale / softcap
  float score_scale = 1.f;       // softmax_scale, or softcap when softcap is on
  float score_scale_log2 = 1.f;  // score_scale * log2(e)

  // Visible keys of query row i: i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q +
  // window_right (bottom-right aligned).  -1 means unbounded on that side.  causal == (left -1, right 0).
  int window_left = -1, window_right = -1;
  bool is_causal = false;
  bool is_local = false;  // a finite window other than plain causal

  // Split-KV (FlashDecoding): the visible K/V tiles of each (m_block, batch, head) are divided among
  // num_splits CTAs.  Each writes its rows' partial output, normalised by its own sum, in fp32 to
  // oaccum (num_splits, h, accum_rows, d) and the partial log-sum-exp (-inf for a split that saw no key) to
  // lseaccum (num_splits, h, accum_rows); combine.h merges them into o / softmax_lse.  accum_rows is
  // b * seqlen_q, or total_q for varlen.
  int num_splits = 1;
  int accum_rows = 0;
  float* __restrict__ oaccum_ptr = nullptr;
  float* __restrict__ lseaccum_ptr = nullptr;

  // ALiBi: score += -slope * |i + seqlen_k - seqlen_q - j|, slopes fp32 (h) or (b, h).
  float const* __restrict__ alibi_slopes_ptr = nullptr;
  index_t alibi_slopes_batch_stride = 0;

  // Dropout on P (dropout.h defines the mask): element (b, h, i, j) is kept iff its 16 random bits are
  // below dropout_threshold = round((1 - p) * 65536); O is scaled by dropout_scale = 1 / (1 - p).  The
  // Philox seed and offset are rng_seed and rng_offset, except that a pointer, when set, is read by the
  // kernel instead: seed = *rng_seed_ptr, offset = *rng_offset_ptr + rng_offset.  That serves CUDA graph
  // capture (the generator's device-side seed and offset base, read at replay, not baked in at capture)
  // and an rng_state tensor passed in by the caller (seed and offset read from its two int64 entries).
  // The kernel writes the (seed, offset) it used to rng_state_out[0..1] (one thread), if set.
  // Declared last so that the fields above keep their offsets: kernels without dropout are unchanged.
  bool is_dropout = false;
  uint32_t dropout_threshold = 65536;
  float dropout_scale = 1.f;
  uint64_t rng_seed = 0, rng_offset = 0;
  int64_t const* rng_seed_ptr = nullptr;
  int64_t const* rng_offset_ptr = nullptr;
  int64_t* rng_state_out = nullptr;
};

// The backward pass reads the forward's problem (q, k, v, o, softmax_lse and every masking/score field of
// FwdParams, unchanged in meaning) plus dO, and writes dQ, dK, dV.  The KV-cache fields (kv_batch_idx,
// leftpad_k, block_table) and split-KV (num_splits) are not used by the backward: they stay null / 1.
struct BwdParams : FwdParams {
  // dO like O; dQ like Q; dK and dV like K and V ((b, seqlen_k, h_k, d), or (total_k, h_k, d) for varlen).
  // Same alignment guarantees as FwdParams.
  void const* __restrict__ do_ptr = nullptr;
  void* __restrict__ dq_ptr = nullptr;
  void* __restrict__ dk_ptr = nullptr;
  void* __restrict__ dv_ptr = nullptr;
  index_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  index_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  index_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  index_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  // D = rowsum(dO * O) per query row, fp32, laid out like softmax_lse ((b, h, seqlen_q), varlen (h, total_q)).
  // Written by the preprocess, read by the main kernel.
  float* __restrict__ softmax_d_ptr = nullptr;
  // Optional upstream gradient of softmax_lse (laid out like it).  d LSE_i / d score_ij = P_ij, so it enters
  // only through D: dS = P * (dP - (D - dLSE)).  nullptr: none.
  float const* __restrict__ dsoftmax_lse_ptr = nullptr;

  // dQ accumulators, fp32 (dq_accum_splits, h, accum_rows, d) with accum_rows as in FwdParams (b * seqlen_q,
  // or total_q).  The main kernel adds the unscaled dS.K of every K/V tile into slice `dq_slice` of its CTA;
  // the postprocess sums the slices in slice order, scales by softmax_scale and converts to dQ.  One slice
  // fed by unordered atomic adds (GPU, deterministic = false), or one slice per fixed group of K/V tiles
  // with a single writer each (GPU deterministic mode, and always on the CPU): the sum then has one order.
  float* __restrict__ dq_accum_ptr = nullptr;
  int dq_accum_splits = 1;
  bool deterministic = false;
};

}  // namespace flash_ext
