// Backward postprocess, one query row at a time: dQ = softmax_scale * (sum of the dQ accumulator slices, in
// slice order), converted to the element type.  Shared by the host loop (launch_host_bwd.h) and the CUDA
// kernel (launch_sm80_bwd.cuh).  A row that saw no key has all-zero accumulators and gets dQ = 0.
#pragma once

#include <cute/config.hpp>

#include "block_info.h"
#include "params.h"

namespace flash_ext {

// The dQ accumulator row of query `row` (slice 0; slice s lies s * dq_slice_stride(p) floats further) and the
// dQ row it becomes.
CUTE_HOST_DEVICE index_t dq_slice_stride(BwdParams const& p) { return index_t(p.h) * p.accum_rows * p.d; }
CUTE_HOST_DEVICE float const* dq_accum_row(BwdParams const& p, BlockInfo const& binfo, int bidb, int bidh, int row) {
  return p.dq_accum_ptr + (index_t(bidh) * p.accum_rows + binfo.accum_row(p, bidb, row)) * p.d;
}
template <class Element>
CUTE_HOST_DEVICE Element* dq_row(BwdParams const& p, BlockInfo const& binfo, int bidb, int bidh, int row) {
  return static_cast<Element*>(p.dq_ptr) + binfo.q_offset(p.dq_batch_stride, p.dq_row_stride, bidb) +
         index_t(row) * p.dq_row_stride + index_t(bidh) * p.dq_head_stride;
}
// Column c of an accumulator row: its slices summed in slice order, times softmax_scale.
CUTE_HOST_DEVICE float dq_scaled_sum(BwdParams const& p, float const* acc, int c) {
  float sum = acc[c];
  for (int s = 1; s < p.dq_accum_splits; ++s) { sum += acc[s * dq_slice_stride(p) + c]; }
  return sum * p.softmax_scale;
}

// Columns [col_begin, col_end) of query `row` of sequence bidb, head bidh.
template <class Element>
CUTE_HOST_DEVICE void postprocess_dq_row(BwdParams const& p, BlockInfo const& binfo, int bidb, int bidh, int row,
                                         int col_begin, int col_end) {
  float const* const acc = dq_accum_row(p, binfo, bidb, bidh, row);
  Element* const dq = dq_row<Element>(p, binfo, bidb, bidh, row);
  for (int c = col_begin; c < col_end; ++c) { dq[c] = Element(dq_scaled_sum(p, acc, c)); }
}

}  // namespace flash_ext
