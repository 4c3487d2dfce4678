// Backward preprocess, one query row at a time: D = rowsum(dO * O) in fp32 (the softmax-Jacobian term every
// dS = P * (dP - D) of that row needs), minus the row's LSE gradient when one is given (params.h), and the
// row's dQ accumulators zeroed in every slice, so that the main kernel can add into them.  Shared by the host loop (launch_host_bwd.h) and the CUDA kernel
// (launch_sm80_bwd.cuh); each row is summed by one thread in column order, so D is the same on every run.
#pragma once

#include <cute/config.hpp>

#include "block_info.h"
#include "params.h"

namespace flash_ext {

template <class Element>
CUTE_HOST_DEVICE void preprocess_row(BwdParams const& p, BlockInfo const& binfo, int bidb, int bidh, int row) {
  Element const* const o = static_cast<Element const*>(p.o_ptr) + binfo.q_offset(p.o_batch_stride, p.o_row_stride, bidb) +
                           index_t(row) * p.o_row_stride + index_t(bidh) * p.o_head_stride;
  Element const* const dout = static_cast<Element const*>(p.do_ptr) +
                              binfo.q_offset(p.do_batch_stride, p.do_row_stride, bidb) + index_t(row) * p.do_row_stride +
                              index_t(bidh) * p.do_head_stride;
  float d = 0.f;
  for (int c = 0; c < p.d; ++c) { d += float(dout[c]) * float(o[c]); }
  index_t const stat = binfo.lse_offset(p, bidb, bidh) + row;
  if (p.dsoftmax_lse_ptr != nullptr) { d -= p.dsoftmax_lse_ptr[stat]; }
  p.softmax_d_ptr[stat] = d;
  index_t const slice_stride = index_t(p.h) * p.accum_rows * p.d;
  float* const acc = p.dq_accum_ptr + (index_t(bidh) * p.accum_rows + binfo.accum_row(p, bidb, row)) * p.d;
  for (int s = 0; s < p.dq_accum_splits; ++s) {
    for (int c = 0; c < p.d; ++c) { acc[s * slice_stride + c] = 0.f; }
  }
}

}  // namespace flash_ext
