// Online softmax: the state that survives from one K/V tile to the next is, per query row, a reference
// maximum (row_max), the running sum of exp(score - row_max) (row_sum), and the un-normalised output acc_o,
// all relative to that reference.  When a tile's scores rise far enough above a row's reference, the old sum
// and acc_o rows are rescaled by exp(old_ref - new_ref) so that every term is relative to the same value.
// Scores are kept in the kernel's domain x; exp2((x - ref) * scale_log2) == exp(score - ref).  The difference
// comes first: exact for the maximum (exp2(0) = 1) and for scores near it at any magnitude.  FA2's single
// FFMA, x * scale_log2 - ref * scale_log2, rounds ref * scale_log2: half an ulp, which reaches 1 at 2^24 and
// overflows exp2 past 2^32, so finite inputs with large scores gave wrong weights, inf or NaN.  The cost is an
// FADD per score beside its MUFU.EX2 (8x less throughput): 28 instructions more per K/V tile and warp in the
// sm_80 head-dim-128 `even` loop (455 against 427, docs/kernels.md), none in the tensor-core or memory work.
//
// The reference lags: it moves only when a tile's maximum exceeds it by more than kSoftmaxSlack in the exp2
// domain, to that maximum (then the running one); rows that move along with another row of their warp go to
// the larger of their reference and the tile's maximum.  Either way it stays a score the row has seen, within
// the slack of its running maximum, so the probabilities are at most 2^8 = 256; and once the first tiles have
// set it, most tiles leave acc_o alone.  The rescale is d / 4 multiplies per row and thread at head dim
// d, as many as the tile's exponentials at d = 128 with 32-key tiles.  O / row_sum and the LSE
// ref * scale + log(row_sum) do not depend on which reference was used, up to rounding: 256 fits any fp16 /
// bf16 probability and fp32 sum.  The GPU decides per warp (one vote: the rescale is a uniform branch); the
// CPU backend's vector step (traits_host.h) decides per vector of rows with the same slack
// (host_isa.h, kHostSoftmaxSlack).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace flash_ext {

// How far (log2 units) a tile's maximum may exceed a row's reference before the reference moves.
inline constexpr float kSoftmaxSlack = 8.f;

// fmaxf, not `a > b ? a : b`: the GPU does it in one FMNMX where the comparison takes an FSETP and an FSEL,
// once per score.  fmaxf skips a NaN operand; a NaN score still reaches the output through its own exp2
// (NaN) in the row sum and in P.V, so a row that sees a NaN key ends NaN either way (finalize).
struct MaxOp {
  CUTE_HOST_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
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
  CUTE_HOST_DEVICE static float safe_ref(float m) { return m == -INFINITY ? 0.f : m; }

  // scores (rows, cols) in the kernel domain, overwritten with exp(score - reference); acc_o (rows, cols)
  // and row_sum rescaled when a reference moves.  `first` is the first tile this CTA processes.
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
    // The first tile sets each row's reference to the row's maximum.  Later tiles measure how far they rise
    // above it; past the slack on any row of the warp, every row moves.  IEEE arithmetic gives the edge
    // cases: a reference of -inf (only masked keys so far) gives +inf (moves) on any visible key and NaN
    // (skipped by fmaxf: no move) on none; a fully masked tile gives -inf.
    auto tile_row_max = [&](int i) {
      float m = -INFINITY;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(scores); ++j) { m = MaxOp{}(m, scores(i, j)); }
      return Traits::row_allreduce(m, MaxOp{});
    };
    auto move_row = [&](int i, float tile_m) {
      float const m = MaxOp{}(row_max(i), tile_m);
      // A row with no visible key so far has row_max -inf and a zero history: the correction is
      // exp2(-inf) = 0, never inf * 0.  (m >= row_max, so m is finite whenever row_max is.)
      float const correction = Traits::exp2((row_max(i) - safe_ref(m)) * scale_log2);
      row_sum(i) *= correction;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(acc_o); ++j) { acc_o(i, j) *= correction; }
      row_max(i) = m;
    };
    float rise = -INFINITY;
    CUTE_UNROLL
    for (int i = 0; i < kNRows; ++i) {
      float const m = tile_row_max(i);
      if (first) {
        row_max(i) = m;
      } else {
        rise = MaxOp{}(rise, m - row_max(i));
      }
    }
    // Warp-uniform, so the rescale is a branch, not predicated lane by lane.  Its rows' maxima are taken
    // again rather than kept from above: a rare path, where the kept copies would be live registers on the
    // common one.
    if (!first && Traits::warp_any(rise * scale_log2 > kSoftmaxSlack)) {
      CUTE_UNROLL
      for (int i = 0; i < kNRows; ++i) { move_row(i, tile_row_max(i)); }
    }
    CUTE_UNROLL
    for (int i = 0; i < kNRows; ++i) {
      float const ref = safe_ref(row_max(i));
      float sum = first ? 0.f : row_sum(i);
      CUTE_UNROLL
      for (int j = 0; j < size<1>(scores); ++j) {
        scores(i, j) = Traits::exp2((scores(i, j) - ref) * scale_log2);
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
