// Everything that edits scores between Q.K^T and the softmax: softcap, ALiBi bias, and the visibility mask
// (sequence bound, causal, local window).  Coordinates come from an identity tensor partitioned exactly like
// the accumulator, so the same code is right for any thread layout the traits choose.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "block_info.h"
#include "params.h"

namespace flash_ext {

// x = tanh(S * softmax_scale / softcap); the true score is x * softcap (params.score_scale).
template <class Traits, class Tensor>
CUTE_HOST_DEVICE void apply_softcap(Tensor& acc, float prescale) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); ++i) { acc(i) = Traits::tanh(acc(i) * prescale); }
}

// The ALiBi slope of (batch, head) in the kernel's score domain (the bias is added to Q.K^T before the scale, so
// the slope is divided by it), or 0 without ALiBi.  Both kernels call it per tile instead of holding the value
// across their main loop: it is an L1 hit, and the head-dim-256 forward had no register left for it.
template <class Traits>
CUTE_HOST_DEVICE float alibi_slope_in_score_domain(FwdParams const& params, bool alibi, int bidb, int bidh) {
  return alibi ? Traits::load_global(params.alibi_slopes_ptr + bidb * params.alibi_slopes_batch_stride + bidh) /
                     params.score_scale
               : 0.f;
}

template <class W>  // Window or WindowCopy (block_info.h)
struct ScoreMask {
  BlockInfo const& binfo;
  W const& window;
  float alibi_slope;  // already divided by score_scale: it is added in the kernel's score domain

  // acc and coord are (row, col) views of the same fragment: coord(i, j) is the (row, col) of acc(i, j)
  // within its tile; row0/col0 place the tile in the problem.
  template <class Acc, class Coord>
  CUTE_HOST_DEVICE void apply(Acc& acc, Coord const& coord, int row0, int col0, bool apply_bias,
                              bool need_mask) const {
    using namespace cute;
    if (!apply_bias && !need_mask) { return; }
    CUTE_UNROLL
    for (int i = 0; i < size<0>(acc); ++i) {
      CUTE_UNROLL
      for (int j = 0; j < size<1>(acc); ++j) {
        int const row = row0 + get<0>(coord(i, j));
        int const col = col0 + get<1>(coord(i, j));
        int const diag = binfo.diagonal(row);
        if (apply_bias) { acc(i, j) -= alibi_slope * float(diag > col ? diag - col : col - diag); }
        if (need_mask) {
          bool const hidden = col >= binfo.seqlen_k || (window.has_right() && col > diag + window.right()) ||
                              (window.has_left() && col < diag - window.left());
          if (hidden) { acc(i, j) = -INFINITY; }
        }
      }
    }
  }
};

// The tile's score edits: ScoreMask::apply over the thread's fragment, element by element (each GPU thread holds
// a few scores of a row); or, on traits whose one thread holds the whole tile as a column-major fragment (the
// host), their whole-tile mask_scores, which applies the same rule a column at a time (HostMaskArgs).  row0 and
// col0 place the tile; coord maps the fragment's (row, col) into it.
template <class Traits, class W, class Scores, class Coord>
CUTE_HOST_DEVICE void apply_score_mask(ScoreMask<W> const& mask, Scores& scores, Coord const& coord, int row0, int col0,
                                       bool apply_bias, bool need_mask) {
  if constexpr (Traits::kIsHost) {
    if (apply_bias || need_mask) { Traits::mask_scores(mask, scores, row0, col0, apply_bias, need_mask); }
  } else {
    mask.apply(scores, coord, row0, col0, apply_bias, need_mask);
  }
}

}  // namespace flash_ext
