// Everything that edits scores between Q.K^T and the softmax: softcap, ALiBi bias, and the visibility mask
// (sequence bound, causal, local window).  Coordinates come from an identity tensor partitioned exactly like
// the accumulator, so the same code is right for any thread layout the traits choose.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "block_info.h"
#include "flags.h"
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

// The rule score by score, in absolute rows and keys, built per tile: the backward's form, and the forward's
// where kThreadScoreMask (below) is false: the variants with runtime features (`general`, `decode`,
// `dropout`).  In the backward ThreadScoreMask below spilled 4-32 bytes (head dim 64, in its files); in the
// forward's runtime-feature kernels it was not kept (docs/perf.md, "the causal mask relative to a thread's
// first score").
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

// The same rule relative to the thread's first score (coordinate (0, 0) of its fragment): the forward's form
// where the window has no left side by type (`even`, `uneven`), built once per CTA.  Score (i, j) of the tile
// whose first row and key are row0 and col0 is row0 + r0 + dr, col0 + c0 + dc, with (r0, c0) the thread's first
// score within a tile; on the GPU dr and dc are compile-time offsets (the partitioned identity tensor), so per
// score the rule compares them with two per-thread integers built here (the distances from c0 to the sequence
// end and to row r0's diagonal), shifted by the tile's row0 and col0.  With ScoreMask's absolute rows and keys
// the forward's loop kept a bound per register row and the sequence lengths live, and the head-dim-128 64-key
// causal kernels spilled 84-104 bytes (docs/perf.md, "the causal mask relative to a thread's first score").
template <class W>  // Window or WindowCopy (block_info.h)
struct ThreadScoreMask {
  W const& window;
  int to_end;   // seqlen_k - c0: in the tile at col0, keys dc >= to_end - col0 are past the sequence
  int to_diag;  // diagonal(r0) - c0: in the tile at (row0, col0), key dc of row dr lies dc - dr - (to_diag +
                // row0 - col0) right of its row's diagonal

  // coord: the (row, col) view of the thread's identity fragment (coord(i, j) is its place within a tile).
  template <class Coord>
  CUTE_HOST_DEVICE ThreadScoreMask(BlockInfo const& binfo, W const& window, Coord const& coord) : window(window) {
    auto const c00 = coord(0, 0);
    to_end = binfo.seqlen_k - cute::get<1>(c00);
    to_diag = binfo.diagonal(cute::get<0>(c00)) - cute::get<1>(c00);
  }

  // As ScoreMask::apply, the slope passed per call.  keys_in_range: the caller knows that every key of the tile
  // is < seqlen_k (a static true drops that test from the code).
  template <class Acc, class Coord, class KeysInRange = bool>
  CUTE_HOST_DEVICE void apply(Acc& acc, Coord const& coord, int row0, int col0, bool apply_bias, float alibi_slope,
                              bool need_mask, KeysInRange keys_in_range = false) const {
    using namespace cute;
    if (!apply_bias && !need_mask) { return; }
    auto const c00 = coord(0, 0);
    int const end = to_end - col0, diag = to_diag + row0 - col0;
    CUTE_UNROLL
    for (int i = 0; i < size<0>(acc); ++i) {
      CUTE_UNROLL
      for (int j = 0; j < size<1>(acc); ++j) {
        int const dr = get<0>(coord(i, j)) - get<0>(c00);
        int const dc = get<1>(coord(i, j)) - get<1>(c00);
        int const past_diag = dc - dr - diag;  // the key's column minus its row's diagonal
        if (apply_bias) { acc(i, j) -= alibi_slope * float(past_diag < 0 ? -past_diag : past_diag); }
        if (need_mask) {
          bool const hidden = (!keys_in_range && dc >= end) || (window.has_right() && past_diag > window.right()) ||
                              (window.has_left() && past_diag < -window.left());
          if (hidden) { acc(i, j) = -INFINITY; }
        }
      }
    }
  }
};

// The tile's score edits: the mask's apply over the thread's fragment, element by element (each GPU thread holds
// a few scores of a row); or, on traits whose one thread holds the whole tile as a column-major fragment (the
// host), their whole-tile mask_scores, which applies the same rule a column at a time (HostMaskArgs) from the
// tile's first row's diagonal.  row0 and col0 place the tile; coord maps the fragment's (row, col) into it.
template <class Traits, class W, class Scores, class Coord>
CUTE_HOST_DEVICE void apply_score_mask(ScoreMask<W> const& mask, Scores& scores, Coord const& coord, int row0, int col0,
                                       bool apply_bias, bool need_mask) {
  if constexpr (Traits::kIsHost) {
    if (apply_bias || need_mask) {
      Traits::mask_scores(scores, mask.window, mask.binfo.diagonal(row0), mask.binfo.seqlen_k, col0, apply_bias,
                          mask.alibi_slope, need_mask);
    }
  } else {
    mask.apply(scores, coord, row0, col0, apply_bias, need_mask);
  }
}

// The same for ThreadScoreMask, the slope passed per call.  GPU traits only: the host runs its forward with
// runtime flags (DynamicFlags, launch_host.h), whose window is a runtime flag, so it masks with ScoreMask.
template <class Traits, class W, class Scores, class Coord, class KeysInRange = bool>
CUTE_HOST_DEVICE void apply_score_mask(ThreadScoreMask<W> const& mask, Scores& scores, Coord const& coord, int row0,
                                       int col0, bool apply_bias, float alibi_slope, bool need_mask,
                                       KeysInRange keys_in_range = false) {
  static_assert(!Traits::kIsHost, "the host's forward masks with ScoreMask (its flags are runtime)");
  mask.apply(scores, coord, row0, col0, apply_bias, alibi_slope, need_mask, keys_in_range);
}

// Whether the forward masks with ThreadScoreMask (and tells its masked tiles by walked bounds, block_info.h):
// the plain variants, `even` and `uneven`, whose window has no left side and which have no ALiBi, softcap or
// dropout, by type.  The causal files' `general`, `decode` and `dropout` have a static no-left-side window too,
// but keep ScoreMask: with ThreadScoreMask their sm_90 kernels spilled (head dim 192 `decode` 20 B, head dim
// 256 `dropout` 12 B; docs/perf.md, "the causal mask relative to a thread's first score").
template <class Flags>
inline constexpr bool kThreadScoreMask =
    kStaticFalse<decltype(Flags::local)> && kStaticFalse<decltype(Flags::alibi)> &&
    kStaticFalse<decltype(Flags::softcap)> && kStaticFalse<decltype(Flags::dropout)>;

}  // namespace flash_ext
