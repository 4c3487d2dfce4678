// Backward postprocess, one query row at a time: dQ = softmax_scale * (sum of the dQ accumulator slices, in
// slice order), converted to the element type.  Shared by the host loop (launch_host_bwd.h) and the CUDA
// kernel (launch_sm80_bwd.cuh).  A row that saw no key has all-zero accumulators and gets dQ = 0.
#pragma once

#include <cute/config.hpp>

#include "block_info.h"
#include "params.h"

namespace flash_ext {

// Columns [col_begin, col_end) of query `row` of sequence bidb, head bidh.
template <class Element>
CUTE_HOST_DEVICE void postprocess_dq_row(BwdParams const& p, BlockInfo const& binfo, int bidb, int bidh, int row,
                                         int col_begin, int col_end) {
  index_t const slice_stride = index_t(p.h) * p.accum_rows * p.d;
  float const* const acc = p.dq_accum_ptr + (index_t(bidh) * p.accum_rows + binfo.accum_row(p, bidb, row)) * p.d;
  Element* const dq = static_cast<Element*>(p.dq_ptr) + binfo.q_offset(p.dq_batch_stride, p.dq_row_stride, bidb) +
                      index_t(row) * p.dq_row_stride + index_t(bidh) * p.dq_head_stride;
  for (int c = col_begin; c < col_end; ++c) {
    float sum = acc[c];
    for (int s = 1; s < p.dq_accum_splits; ++s) { sum += acc[s * slice_stride + c]; }
    dq[c] = Element(sum * p.softmax_scale);
  }
}

}  // namespace flash_ext
