// Split-KV combine: merges the num_splits partial results of one query row.  Each split s holds O_s, normalised by
// its own softmax sum, and LSE_s = log of that sum (in the true score domain, max included). The exact result is
// LSE = log sum_s exp(LSE_s) and O = sum_s exp(LSE_s - LSE) O_s; the maximum LSE_s is subtracted before
// exponentiating so nothing overflows, and the weights are exp(LSE_s - max) / sum rather than exp(LSE_s - LSE):
// LSE = max + log(sum) is rounded at LSE's magnitude, so with huge scores (|LSE| ~ 2^30, an ulp of 128) two tied splits
// each weighed exp(0) = 1 instead of 1/2.  (LSE_s itself rounds its own log(sum) away at that size: README,
// "Numerics".)  Splits that saw no key have LSE_s = -inf and weigh exactly 0; a row no split saw gets O = 0 and
// LSE = +inf.  A NaN partial LSE (a NaN score in that split) makes the row NaN, as the unsplit kernel's would be:
// fmaxf alone would drop it.
#pragma once

#include <cmath>

#include <cute/config.hpp>
#include <cutlass/array.h>

#include "block_info.h"
#include "global_memory.h"
#include "grid.h"
#include "params.h"

namespace flash_ext {

// Columns [col_begin, col_end) of query `row` of sequence bidb, head bidh; the caller with col_begin == 0
// also writes the row's LSE.  Partials are read, and O and LSE written, through the memory policy Mem
// (global_memory.h), so that the emulator checks every access.
template <class Element, class Mem = PlainGlobalMemory>
CUTE_HOST_DEVICE void combine_row(FwdParams const& p, BlockInfo const& binfo, int bidb, int bidh, int row,
                                  int col_begin, int col_end) {
  index_t const r = binfo.accum_row(p, bidb, row);
  index_t const split_stride = index_t(p.h) * p.accum_rows;
  float const* lse_s = p.lseaccum_ptr + index_t(bidh) * p.accum_rows + r;
  float max_lse = -INFINITY;
  bool nan = false;
  for (int s = 0; s < p.num_splits; ++s) {
    float const l = Mem::load_global(lse_s + s * split_stride);
    nan = nan || l != l;
    max_lse = fmaxf(max_lse, l);
  }
  Element* o = static_cast<Element*>(p.o_ptr) + binfo.q_offset(p.o_batch_stride, p.o_row_stride, bidb) +
               index_t(row) * p.o_row_stride + index_t(bidh) * p.o_head_stride;
  float* const lse_out = p.softmax_lse_ptr + binfo.lse_offset(p, bidb, bidh) + row;
  if (nan) {
    for (int c = col_begin; c < col_end; ++c) { Mem::store_global(o + c, Element(NAN)); }
    if (col_begin == 0) { Mem::store_global(lse_out, NAN); }
    return;
  }
  if (max_lse == -INFINITY) {
    for (int c = col_begin; c < col_end; ++c) { Mem::store_global(o + c, Element(0.f)); }
    if (col_begin == 0) { Mem::store_global(lse_out, INFINITY); }
    return;
  }
  float sum = 0.f;
  for (int s = 0; s < p.num_splits; ++s) { sum += expf(Mem::load_global(lse_s + s * split_stride) - max_lse); }
  float const lse = max_lse + logf(sum), inv_sum = 1.f / sum;
  if (col_begin == 0) { Mem::store_global(lse_out, lse); }
  float const* o_s = p.oaccum_ptr + (index_t(bidh) * p.accum_rows + r) * p.d;
  // A GPU/emulator thread's group of kCombineCols columns (always whole: the op requires d % 8 == 0): one
  // weight per split and 16-byte moves (partial rows are d floats from a 256-byte aligned base, O rows
  // 16-byte aligned as for the forward's epilogue).  The host backend's call takes a whole row
  // (launch_host.h) and goes by chunks of the row below.
  if (col_end - col_begin == kCombineCols && col_begin % 4 == 0 && p.d % 4 == 0) {
    using In = cutlass::AlignedArray<float, 4>;
    float acc[kCombineCols] = {};
    for (int s = 0; s < p.num_splits; ++s) {
      float const w = expf(Mem::load_global(lse_s + s * split_stride) - max_lse) * inv_sum;
      float const* src = o_s + s * split_stride * p.d + col_begin;
      CUTE_UNROLL
      for (int v = 0; v < kCombineCols / 4; ++v) {
        In const x = Mem::load_global(reinterpret_cast<In const*>(src) + v);
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) { acc[4 * v + e] += w * x[e]; }
      }
    }
    cutlass::AlignedArray<Element, kCombineCols> out;
    CUTE_UNROLL
    for (int e = 0; e < kCombineCols; ++e) { out[e] = Element(acc[e]); }
    Mem::store_global(reinterpret_cast<cutlass::AlignedArray<Element, kCombineCols>*>(o + col_begin), out);
    return;
  }
  // The host's whole row: chunks of kRowChunk columns, split-outer, so that each split's weight costs one expf
  // per chunk (not one per column: at 64 splits that was a tenth of a 16k-key decode step) and its partial row
  // is added as one contiguous run the compiler vectorises.  Per column the same products summed in the same
  // split order as the group path above.
#ifdef __CUDA_ARCH__
  // A GPU thread never gets here (its column groups are whole, the op requiring d % 8 == 0); a chunk's array
  // would still be allocated registers for it (the combine kernel went from 48 to 162 on sm_80).
  constexpr int kRowChunk = 1;
#else
  constexpr int kRowChunk = 128;
#endif
  for (int c0 = col_begin; c0 < col_end; c0 += kRowChunk) {
    int const n = col_end - c0 < kRowChunk ? col_end - c0 : kRowChunk;
    float acc[kRowChunk];
    for (int c = 0; c < n; ++c) { acc[c] = 0.f; }
    for (int s = 0; s < p.num_splits; ++s) {
      float const w = expf(Mem::load_global(lse_s + s * split_stride) - max_lse) * inv_sum;
      float const* src = o_s + s * split_stride * p.d + c0;
      for (int c = 0; c < n; ++c) { acc[c] += w * Mem::load_global(src + c); }
    }
    for (int c = 0; c < n; ++c) { Mem::store_global(o + c0 + c, Element(acc[c])); }
  }
}

// Combine thread t of (batch bidb, head bidh) merges column group t % groups of query row t / groups
// (grid.h): the per-thread body of the CUDA combine kernel, also run by the warp emulator.
template <class Element, class Mem = PlainGlobalMemory>
CUTE_HOST_DEVICE void combine_thread(FwdParams const& p, int bidb, int bidh, int64_t t) {
  int const groups = int(combine_col_groups(p.d));
  int const row = int(t / groups);
  int const col = int(t % groups) * kCombineCols;
  BlockInfo const binfo(p, bidb, via<Mem>);
  if (row >= binfo.seqlen_q) { return; }
  combine_row<Element, Mem>(p, binfo, bidb, bidh, row, col, col + kCombineCols < p.d ? col + kCombineCols : p.d);
}

}  // namespace flash_ext
