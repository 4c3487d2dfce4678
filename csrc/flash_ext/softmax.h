// Online softmax: the state that survives from one K/V tile to the next is, per query row, the running
// maximum of the scores seen so far (row_max), the running sum of exp(score - row_max) (row_sum), and the
// un-normalised output acc_o.  When a new tile raises a row's maximum, the old sum and acc_o rows are
// rescaled by exp(old_max - new_max) so that every term is relative to the same maximum.  Scores are kept
// in the kernel's domain x; exp2(x * scale_log2 - max * scale_log2) == exp(score - max_score).  The CPU
// backend's vector step (traits_host.h) keeps a lagging maximum instead: a score the row has seen, moved only
// when a tile exceeds it by more than 2^8 in probability (host_isa.h, kHostSoftmaxSlack), so that most tiles
// need no maxima pass and no rescale; every term stays relative to the same value, which is what finalize()
// relies on.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace flash_ext {

struct MaxOp {
  CUTE_HOST_DEVICE float operator()(float a, float b) const { return a > b ? a : b; }
};
struct SumOp {
  CUTE_HOST_DEVICE float operator()(float a, float b) const { return a + b; }
};

template <class Traits, int kNRows>
struct OnlineSoftmax {
  using TensorT = decltype(cute::make_tensor<float>(cute::Shape<cute::Int<kNRows>>{}));
  TensorT row_max;
  TensorT row_sum;  // this thread's partial sums; combined across the row's owners in finalize()

  // A row whose maximum is still -inf has seen only masked keys; subtracting 0 instead keeps its
  // probabilities at exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN.
  CUTE_HOST_DEVICE static float safe_max_scaled(float m, float scale_log2) {
    return m == -INFINITY ? 0.f : m * scale_log2;
  }

  // scores (rows, cols) in the kernel domain, overwritten with exp(score - row_max); acc_o (rows, cols)
  // rescaled to the new maximum.  `first` is the first tile this CTA processes.
  template <class Scores, class AccO>
  CUTE_HOST_DEVICE void rescale_o(Scores& scores, AccO& acc_o, float scale_log2, bool first) {
    using namespace cute;
    static_assert(decltype(size<0>(scores))::value == kNRows);
    if constexpr (requires { Traits::softmax_rescale_o(row_max, row_sum, scores, acc_o, scale_log2, first); }) {
      // The host runs this step over the whole tile as vector code for the CPU's instruction set
      // (traits_host.h, csrc/host/isa/kernels.h): the same per-row arithmetic, rows side by side in lanes.
      Traits::softmax_rescale_o(row_max, row_sum, scores, acc_o, scale_log2, first);
      return;
    }
    CUTE_UNROLL
    for (int i = 0; i < kNRows; ++i) {
      float m = first ? -INFINITY : row_max(i);
      CUTE_UNROLL
      for (int j = 0; j < size<1>(scores); ++j) { m = MaxOp{}(m, scores(i, j)); }
      m = Traits::row_allreduce(m, MaxOp{});
      float const m_scaled = safe_max_scaled(m, scale_log2);
      if (!first) {
        // A row with no visible key so far has row_max -inf and a zero history: the correction is
        // exp2(-inf) = 0, never inf * 0.  (m >= row_max, so m is finite whenever row_max is.)
        float const correction = Traits::exp2(row_max(i) * scale_log2 - m_scaled);
        row_sum(i) *= correction;
        CUTE_UNROLL
        for (int j = 0; j < size<1>(acc_o); ++j) { acc_o(i, j) *= correction; }
      }
      row_max(i) = m;
      float sum = first ? 0.f : row_sum(i);
      CUTE_UNROLL
      for (int j = 0; j < size<1>(scores); ++j) {
        // One FFMA + EX2 per score on the GPU: the subtraction is folded into the multiply-add.
        scores(i, j) = Traits::exp2(scores(i, j) * scale_log2 - m_scaled);
        sum += scores(i, j);
      }
      row_sum(i) = sum;
    }
  }

  // Normalises acc_o (rows, cols) in place and returns the rows' log-sum-exp in the true score domain.
  // A row with no visible key gets O = 0 and LSE = empty_lse: +inf for a final result (FA2's convention),
  // -inf for a split-KV partial (it then weighs nothing in the combine).  Its sum is exactly 0, and only
  // its: a row that saw a key has sum >= 1 (its maximum contributes exp2(0)).  A NaN score (NaN in q or k)
  // makes the sum NaN, which is NOT an empty row: 1 / NaN and log(NaN) carry it into O and LSE, and the
  // combine carries a NaN partial through, so the answer does not depend on the split count.  With scale_o
  // (a flag: dropout), O is also multiplied by o_scale (dropout's 1 / (1 - p)), folded into the normalisation
  // rather than an extra pass over acc_o; a static false leaves the code exactly as without the parameter.
  template <class AccO, class ScaleO = cute::C<false>>
  CUTE_HOST_DEVICE TensorT finalize(AccO& acc_o, float score_scale, float empty_lse = INFINITY, ScaleO scale_o = {},
                                    float o_scale = 1.f) {
    using namespace cute;
    TensorT lse = make_tensor<float>(Shape<Int<kNRows>>{});
    TensorT inv = make_tensor<float>(Shape<Int<kNRows>>{});
    CUTE_UNROLL
    for (int i = 0; i < kNRows; ++i) {
      float const sum = Traits::row_allreduce(row_sum(i), SumOp{});
      bool const empty = sum == 0.f;
      inv(i) = empty ? 0.f : 1.f / sum;
      if (scale_o) { inv(i) *= o_scale; }
      lse(i) = empty ? empty_lse : row_max(i) * score_scale + logf(sum);
    }
    // Columns outer: the host's acc_o is column-major (a whole 128 x d tile), so the rows of one column are
    // contiguous; rows outer strode a cache line per element (a fifth of the host body's time at d = 128).
    // The GPU's few registers per thread are unrolled either way.
    CUTE_UNROLL
    for (int j = 0; j < size<1>(acc_o); ++j) {
      CUTE_UNROLL
      for (int i = 0; i < kNRows; ++i) { acc_o(i, j) *= inv(i); }
    }
    return lse;
  }
};

}  // namespace flash_ext
