// Launch geometry of the forward and split-KV combine kernels: the grid a launcher requests and the decode
// of a block index back into the work it stands for.  Pure functions, shared by the CUDA kernels, the warp
// emulator (which walks the same grid) and explain(), so a grid that cannot launch is reported, not hit.
//
// CUDA allows grid.x up to 2^31 - 1 but grid.y and grid.z only up to 65,535.  The forward kernel has one CTA
// per (m_block, batch, head, split): m_block stays in x (CTAs of one head, which share K/V, are scheduled
// together), and the other three are numbered r = bidb + b * (bidh + h * n_split) and laid out row-major
// over (y, z): y = r mod Y, z = r / Y with Y = min(count, 65,535).  The linear block order (x fastest, then
// y, then z) is therefore m_block, batch, head, split whatever the sizes, and a problem with more than
// 65,535 sequences, or heads x splits beyond 65,535, still launches.  When count is not a multiple of Y the
// last z row has blocks past the end: they decode as invalid and exit at once.
#pragma once

#include <cstdint>

#include <cute/config.hpp>

namespace flash_ext {

inline constexpr int64_t kMaxGridX = 2147483647;  // 2^31 - 1
inline constexpr int64_t kMaxGridYZ = 65535;
// The most (batch, head, split) or (batch, head) items a folded (y, z) pair can address; also < 2^32, so
// the decode runs in 32-bit unsigned arithmetic.
inline constexpr int64_t kMaxFoldedItems = kMaxGridYZ * kMaxGridYZ;

struct GridDims {
  int64_t x = 0, y = 0, z = 0;
  constexpr bool operator==(GridDims const&) const = default;
};

// Items [0, count) over (y, z), y fastest.  count == 0 gives an empty grid.
constexpr GridDims fold_items(int64_t x, int64_t count) {
  int64_t const y = count < kMaxGridYZ ? count : kMaxGridYZ;
  return {x, y, y == 0 ? 0 : (count + y - 1) / y};
}

// Why a grid of these sizes cannot launch, or nullptr.  The op layer refuses such calls and explain()
// reports the reason; in practice the limit (about 4.3e9 CTAs per m_block) is far beyond any tensor.
constexpr char const* grid_error(GridDims g) {
  if (g.x > kMaxGridX) { return "more than 2^31 - 1 query-row blocks (grid.x)"; }
  if (g.z > kMaxGridYZ) { return "batch x heads x splits exceeds 65,535^2 CTAs per query-row block"; }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------------
// Forward kernel.

struct FwdBlock {
  int m_block, bidb, bidh, n_split;
  bool valid;  // false for the padding blocks of a partial last z row
};

constexpr GridDims fwd_grid(int64_t m_blocks, int64_t b, int64_t h, int64_t num_splits) {
  return fold_items(m_blocks, b * h * num_splits);
}

// block (x, y, z) of a grid whose y extent is grid_y (gridDim.y), for a problem of b x h x num_splits.
CUTE_HOST_DEVICE constexpr FwdBlock fwd_block(unsigned x, unsigned y, unsigned z, unsigned grid_y, int b, int h,
                                              int num_splits) {
  unsigned const r = y + z * grid_y;
  unsigned const bh = r / unsigned(b);
  unsigned const split = bh / unsigned(h);
  return {int(x), int(r % unsigned(b)), int(bh % unsigned(h)), int(split), split < unsigned(num_splits)};
}

// ---------------------------------------------------------------------------------------------------
// Split-KV combine kernel: each thread merges kCombineCols output columns of one query row; consecutive
// threads take consecutive column groups of a row (coalesced partial reads and output writes); blocks of
// kCombineThreads threads cover the rows of one (batch, head) along x, and (batch, head) is folded over (y, z)
// as r = bidb + b * bidh.

inline constexpr int kCombineCols = 8;
inline constexpr int kCombineThreads = 128;

struct CombineBlock {
  int bidb, bidh;
  bool valid;
};

constexpr int64_t combine_col_groups(int64_t d) { return (d + kCombineCols - 1) / kCombineCols; }

constexpr GridDims combine_grid(int64_t seqlen_q, int64_t d, int64_t b, int64_t h) {
  int64_t const threads = seqlen_q * combine_col_groups(d);
  return fold_items((threads + kCombineThreads - 1) / kCombineThreads, b * h);
}

CUTE_HOST_DEVICE constexpr CombineBlock combine_block(unsigned y, unsigned z, unsigned grid_y, int b, int h) {
  unsigned const r = y + z * grid_y;
  unsigned const bidh = r / unsigned(b);
  return {int(r % unsigned(b)), int(bidh), bidh < unsigned(h)};
}

static_assert(fold_items(7, 65535) == GridDims{7, 65535, 1}, "up to 65,535 items stay in y");
static_assert(fold_items(7, 65536) == GridDims{7, 65535, 2}, "one more item opens a second z row");
static_assert(grid_error(fwd_grid(1, 65535, 65535, 1)) == nullptr);
static_assert(grid_error(fwd_grid(1, 65536, 65535, 1)) != nullptr);
static_assert(fwd_block(3, 0, 1, 65535, 65536, 1, 1).bidb == 65535 && fwd_block(3, 0, 1, 65535, 65536, 1, 1).valid,
              "sequence 65,535 is the first block of the second z row");
static_assert(!fwd_block(3, 1, 1, 65535, 65536, 1, 1).valid, "the rest of that row is padding");

}  // namespace flash_ext
