// The parameters every C++ host test sets the same way for a dense problem: q, o (b, sq, h, d) and k, v
// (b, sk, hk, d), contiguous, with the semantics of a test case (causal, window, softcap, ALiBi).  Case: any
// struct with fields b, h, hk, sq, sk, d, causal, wl, wr, softcap and alibi.  The backward's BwdParams
// derives from FwdParams, so both tests use this.
#pragma once

#include <cmath>

#include "flash_ext/params.h"

namespace flash_ext {

template <class Case>
void set_dense_problem(FwdParams& p, Case const& c, void* q, void* k, void* v, void* o, float* lse,
                       float const* alibi_slopes) {
  p.q_ptr = q, p.k_ptr = k, p.v_ptr = v, p.o_ptr = o, p.softmax_lse_ptr = lse;
  p.q_batch_stride = index_t(c.sq) * c.h * c.d, p.q_row_stride = c.h * c.d, p.q_head_stride = c.d;
  p.k_batch_stride = index_t(c.sk) * c.hk * c.d, p.k_row_stride = c.hk * c.d, p.k_head_stride = c.d;
  p.v_batch_stride = p.k_batch_stride, p.v_row_stride = p.k_row_stride, p.v_head_stride = c.d;
  p.o_batch_stride = p.q_batch_stride, p.o_row_stride = p.q_row_stride, p.o_head_stride = c.d;
  p.b = c.b, p.h = c.h, p.h_k = c.hk, p.h_h_k_ratio = c.h / c.hk, p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.d = c.d;
  p.softmax_scale = 1.f / std::sqrt(float(c.d));
  p.softcap = c.softcap;
  p.softcap_prescale = c.softcap > 0 ? p.softmax_scale / c.softcap : 0.f;
  p.score_scale = c.softcap > 0 ? c.softcap : p.softmax_scale;
  p.score_scale_log2 = p.score_scale * float(M_LOG2E);
  p.window_left = c.causal ? -1 : c.wl;
  p.window_right = c.causal ? 0 : c.wr;
  p.is_causal = c.causal;
  p.is_local = !c.causal && (c.wl >= 0 || c.wr >= 0);
  p.alibi_slopes_ptr = c.alibi ? alibi_slopes : nullptr;
}

}  // namespace flash_ext
