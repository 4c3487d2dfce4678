// Which part of the problem one CTA sees: its sequence lengths, where its batch starts in memory, and the
// range of K/V tiles [n_block_min, n_block_max) that hold at least one key visible to one of its rows.
// Tiles outside that range are never loaded; tiles inside it that every row sees in full skip the mask.
#pragma once

#include <cute/config.hpp>
#include <cute/algorithm/functional.hpp>

#include "global_memory.h"
#include "params.h"

namespace flash_ext {

CUTE_HOST_DEVICE constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

struct BlockInfo {
  int seqlen_q;
  int seqlen_k;
  int q_start;  // first row of this sequence in q/o (varlen), else -1
  int k_start;  // first row of this sequence in k/v (varlen), else -1
  int k_row0;   // first key row within the batch entry (KV cache left padding), else 0

  // Reads this batch entry's index arrays through the memory policy Mem (global_memory.h; kernels pass their
  // traits, so that the emulator checks the reads).
  template <class Mem = PlainGlobalMemory>
  CUTE_HOST_DEVICE BlockInfo(FwdParams const& params, int bidb, Via<Mem> = {})
      : q_start(params.cu_seqlens_q ? Mem::load_global(params.cu_seqlens_q + bidb) : -1),
        k_start(params.cu_seqlens_k ? Mem::load_global(params.cu_seqlens_k + bidb) : -1),
        k_row0(params.leftpad_k ? Mem::load_global(params.leftpad_k + bidb) : 0) {
    seqlen_q = params.cu_seqlens_q ? Mem::load_global(params.cu_seqlens_q + bidb + 1) - q_start : params.seqlen_q;
    seqlen_k = params.cu_seqlens_k ? Mem::load_global(params.cu_seqlens_k + bidb + 1) - k_start : params.seqlen_k;
    if (params.seqused_k) { seqlen_k = Mem::load_global(params.seqused_k + bidb); }
  }

  // Element offsets of this batch entry's first row.
  CUTE_HOST_DEVICE index_t q_offset(index_t batch_stride, index_t row_stride, int bidb) const {
    return q_start >= 0 ? index_t(q_start) * row_stride : index_t(bidb) * batch_stride;
  }
  // Element offset of K/V tile n_block of this batch entry (its first key), without the head offset: the one
  // place that knows about varlen offsets, cache batch indices, left padding and pages.
  template <class Mem = PlainGlobalMemory>
  CUTE_HOST_DEVICE index_t kv_tile_offset(FwdParams const& params, int bidb, int n_block, int block_n,
                                          index_t batch_stride, index_t row_stride) const {
    int const row = k_row0 + n_block * block_n;
    if (params.block_table != nullptr) { return kv_page_offset<Mem>(params, bidb, row, batch_stride, row_stride); }
    index_t const seq = k_start >= 0 ? index_t(k_start) * row_stride
                                     : index_t(params.kv_batch_idx ? Mem::load_global(params.kv_batch_idx + bidb) : bidb) *
                                           batch_stride;
    return seq + index_t(row) * row_stride;
  }
  // Element offset from K/V tile n_block + 1 to tile n_block: the forward walks its tiles right to left by
  // moving each thread's copy source, instead of rebuilding it (tile base, 64-bit row products, the thread's
  // own offset) for every tile.  One tile of rows back in a contiguous cache; in a paged one the difference of
  // the two tiles' page addresses (a tile never straddles two pages: pages hold a multiple of 128 keys and
  // the op layer refuses left padding with a block table, so every tile starts at a multiple of block_n).
  template <class Mem = PlainGlobalMemory>
  CUTE_HOST_DEVICE index_t kv_tile_step(FwdParams const& params, int bidb, int n_block, int block_n,
                                        index_t batch_stride, index_t row_stride) const {
    if (params.block_table != nullptr) {
      int const row = k_row0 + n_block * block_n;
      return kv_page_offset<Mem>(params, bidb, row, batch_stride, row_stride) -
             kv_page_offset<Mem>(params, bidb, row + block_n, batch_stride, row_stride);
    }
    return -index_t(block_n) * row_stride;
  }
  // Element offset of key `row` of this batch entry in a paged cache: its page (looked up in the block table)
  // times the page stride, plus its row within the page.
  template <class Mem = PlainGlobalMemory>
  CUTE_HOST_DEVICE index_t kv_page_offset(FwdParams const& params, int bidb, int row, index_t page_stride,
                                          index_t row_stride) const {
    int const page =
        Mem::load_global(params.block_table + index_t(bidb) * params.block_table_batch_stride + row / params.page_size);
    return index_t(page) * page_stride + index_t(row % params.page_size) * row_stride;
  }
  // LSE is (b, h, seqlen_q) for fixed-length batches and (h, total_q) for varlen.
  CUTE_HOST_DEVICE index_t lse_offset(FwdParams const& params, int bidb, int bidh) const {
    return q_start >= 0 ? index_t(bidh) * params.total_q + q_start
                        : (index_t(bidb) * params.h + bidh) * params.seqlen_q;
  }

  // Row of query `row` of this sequence in the split-KV accumulators (num_splits, h, accum_rows, ...).
  CUTE_HOST_DEVICE index_t accum_row(FwdParams const& params, int bidb, int row) const {
    return q_start >= 0 ? index_t(q_start) + row : index_t(bidb) * params.seqlen_q + row;
  }

  // Bottom-right alignment: query row i sits on the diagonal at key column i + seqlen_k - seqlen_q.
  CUTE_HOST_DEVICE int diagonal(int row) const { return row + seqlen_k - seqlen_q; }
};

// Window bounds as the kernels use them; `has_right()`/`has_left()` say whether the side is bounded.  Two
// forms with one interface, chosen by what each kernel's registers allow (measured, docs/kernels.md): Window
// reads the kernel parameters where used (the constant bank on the GPU), so the bounds do not stay live across
// the forward's main loop (its head-dim-256 kernels spilled with copies); WindowCopy copies them once, as the
// backward does (its head-dim-64 sm_80 kernel spilled 32 bytes reading them in place).
template <class Flags>
struct Window {
  FwdParams const& params;
  Flags const& flags;
  CUTE_HOST_DEVICE Window(FwdParams const& params, Flags const& flags) : params(params), flags(flags) {}
  CUTE_HOST_DEVICE bool has_left() const { return flags.local && params.window_left >= 0; }
  CUTE_HOST_DEVICE bool has_right() const { return flags.causal || (flags.local && params.window_right >= 0); }
  CUTE_HOST_DEVICE int left() const { return params.window_left; }
  CUTE_HOST_DEVICE int right() const { return flags.causal ? 0 : params.window_right; }
};

template <class Flags>
struct WindowCopy {
  bool has_left_, has_right_;
  int left_, right_;
  CUTE_HOST_DEVICE WindowCopy(FwdParams const& params, Flags const& flags) {
    Window<Flags> const w(params, flags);
    has_left_ = w.has_left(), has_right_ = w.has_right(), left_ = w.left(), right_ = w.right();
  }
  CUTE_HOST_DEVICE bool has_left() const { return has_left_; }
  CUTE_HOST_DEVICE bool has_right() const { return has_right_; }
  CUTE_HOST_DEVICE int left() const { return left_; }
  CUTE_HOST_DEVICE int right() const { return right_; }
};

template <int kBlockM, int kBlockN, class W>
CUTE_HOST_DEVICE int n_block_max(BlockInfo const& binfo, W const& w, int m_block) {
  int n_max = ceil_div(binfo.seqlen_k, kBlockN);
  if (w.has_right()) {
    int const last_row = cute::min((m_block + 1) * kBlockM, binfo.seqlen_q) - 1;
    int const end_col = binfo.diagonal(last_row) + w.right() + 1;  // one past the last visible key
    n_max = cute::min(n_max, end_col <= 0 ? 0 : ceil_div(end_col, kBlockN));
  }
  return n_max;
}

// The share of the K/V tiles that split n_split of num_splits handles: tiles [n_split * per, (n_split + 1) *
// per) of the sequence, with per = ceil(tiles / num_splits).  Intersected with the visible range, it may be
// empty (a split entirely past the causal diagonal): that split then reports LSE = -inf.
template <int kBlockN>
CUTE_HOST_DEVICE void restrict_to_split(BlockInfo const& binfo, int num_splits, int n_split, int& n_min, int& n_max) {
  int const per_split = ceil_div(ceil_div(binfo.seqlen_k, kBlockN), num_splits);
  n_min = cute::max(n_min, n_split * per_split);
  n_max = cute::min(n_max, (n_split + 1) * per_split);
}

template <int kBlockM, int kBlockN, class W>
CUTE_HOST_DEVICE int n_block_min(BlockInfo const& binfo, W const& w, int m_block) {
  if (!w.has_left()) { return 0; }
  int const first_col = binfo.diagonal(m_block * kBlockM) - w.left();
  return first_col <= 0 ? 0 : first_col / kBlockN;
}

// The backward's view of the same visibility rule, per K/V tile: the query blocks [m_block_min, m_block_max)
// that hold at least one row seeing at least one key of tile n_block.  Row i sees key j when j <= diagonal(i) +
// right and j >= diagonal(i) - left, so the first row that sees the tile's first key is col0 - (seqlen_k -
// seqlen_q) - right, and the last row that sees its last key is col1 - (seqlen_k - seqlen_q) + left.  The range
// may be empty (keys left of a local window's reach, or a sequence without queries): dK = dV = 0 there.
template <int kBlockM, int kBlockN, class W>
CUTE_HOST_DEVICE int m_block_min(BlockInfo const& binfo, W const& w, int n_block) {
  if (!w.has_right()) { return 0; }
  int const first_row = n_block * kBlockN - (binfo.seqlen_k - binfo.seqlen_q) - w.right();
  return first_row <= 0 ? 0 : first_row / kBlockM;
}

template <int kBlockM, int kBlockN, class W>
CUTE_HOST_DEVICE int m_block_max(BlockInfo const& binfo, W const& w, int n_block) {
  int m_max = ceil_div(binfo.seqlen_q, kBlockM);
  if (w.has_left()) {
    int const last_col = cute::min((n_block + 1) * kBlockN, binfo.seqlen_k) - 1;
    int const last_row = last_col - (binfo.seqlen_k - binfo.seqlen_q) + w.left();
    m_max = cute::min(m_max, last_row < 0 ? 0 : last_row / kBlockM + 1);
  }
  return m_max;
}

// True when every (row, key) of the tile pair is visible, so the mask may be skipped.  Rows past
// seqlen_q are counted too (conservative: they are never stored).
template <int kBlockM, int kBlockN, class W>
CUTE_HOST_DEVICE bool tile_fully_visible(BlockInfo const& binfo, W const& w, int m_block,
                                         int n_block) {
  int const row0 = m_block * kBlockM, col0 = n_block * kBlockN;
  bool visible = col0 + kBlockN <= binfo.seqlen_k;
  if (w.has_right()) { visible = visible && col0 + kBlockN - 1 <= binfo.diagonal(row0) + w.right(); }
  if (w.has_left()) { visible = visible && col0 >= binfo.diagonal(row0 + kBlockM - 1) - w.left(); }
  return visible;
}

// The K/V tiles of [n_min, n_max) whose scores need the mask (tile_fully_visible fails), as two bounds: tiles
// n >= right_from and n < left_below.  The rule fails at the ends of the range only (keys past seqlen_k or right
// of a row's window at the right end, keys left of a window at the left end), so the bounds are found by walking
// in from either end, one step per masked tile (a causal CTA: at most ceil(kBlockM / kBlockN) + 1).  Without a
// left window side by type, left_below is n_min, a constant.  The forward's static-window variants test their
// tile against these (kernel_fwd.h): evaluating the rule per tile kept its inputs (the sequence lengths, the row
// block) live across the loop, and the head-dim-128 64-key causal kernel spilled 84-100 bytes; 0 with these
// (bounds in closed form, by a division, spilled as much; docs/perf.md, "the causal mask relative to a
// thread's first score").
struct MaskedTiles {
  int right_from, left_below;
  CUTE_HOST_DEVICE bool operator()(int n_block) const { return n_block >= right_from || n_block < left_below; }
};

template <int kBlockM, int kBlockN, class W>
CUTE_HOST_DEVICE MaskedTiles masked_tiles(BlockInfo const& binfo, W const& w, int m_block, int n_min, int n_max) {
  MaskedTiles t{n_max, n_min};
  while (t.right_from > n_min && !tile_fully_visible<kBlockM, kBlockN>(binfo, w, m_block, t.right_from - 1)) {
    --t.right_from;
  }
  if (w.has_left()) {
    while (t.left_below < t.right_from && !tile_fully_visible<kBlockM, kBlockN>(binfo, w, m_block, t.left_below)) {
      ++t.left_below;
    }
  }
  return t;
}

}  // namespace flash_ext
