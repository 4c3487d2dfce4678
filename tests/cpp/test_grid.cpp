// Launch geometry (csrc/flash_ext/grid.h) as pure functions, around CUDA's 65,535 limit on grid.y / grid.z:
// every grid stays inside the limits, and the block decode is a bijection from the valid blocks onto the
// work items (m_block, batch, head, split) -- checked exhaustively where the grid is small enough, and at the
// boundaries (first and last blocks of each z row) where it is not.  Also the forward's walk over K/V tiles
// (block_info.h): stepping tile by tile from the right-most one lands on each tile's own address; and its
// visible range and masked tiles against the visibility rule row by row.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "flash_ext/block_info.h"
#include "flash_ext/grid.h"
#include "check.h"
#include "test_window.h"

using namespace flash_ext;


bool within_limits(GridDims g) { return g.x <= kMaxGridX && g.y <= kMaxGridYZ && g.z <= kMaxGridYZ && g.y >= 1 && g.z >= 1; }

// Every block of the grid of (m_blocks, b, h, splits); each work item exactly once, padding blocks only at
// the end of the last z row.
void exhaustive(int m_blocks, int b, int h, int splits) {
  GridDims const g = fwd_grid(m_blocks, b, h, splits);
  CHECK(within_limits(g) && grid_error(g) == nullptr, "grid (%lld, %lld, %lld) for b %d h %d s %d", (long long)g.x,
        (long long)g.y, (long long)g.z, b, h, splits);
  int64_t const items = int64_t(b) * h * splits;
  std::vector<uint8_t> seen(size_t(items) * m_blocks, 0);
  int64_t valid = 0, invalid = 0, order_breaks = 0, last = -1;
  for (unsigned z = 0; z < g.z; ++z)
    for (unsigned y = 0; y < g.y; ++y)
      for (unsigned x = 0; x < g.x; ++x) {
        FwdBlock const f = fwd_block(x, y, z, unsigned(g.y), b, h, splits);
        if (!f.valid) {
          ++invalid;
          continue;
        }
        ++valid;
        bool const in_range = f.m_block >= 0 && f.m_block < m_blocks && f.bidb >= 0 && f.bidb < b && f.bidh >= 0 &&
                              f.bidh < h && f.n_split >= 0 && f.n_split < splits;
        if (!in_range) {
          CHECK(false, "block (%u, %u, %u) decodes out of range", x, y, z);
          continue;
        }
        int64_t const id = ((int64_t(f.n_split) * h + f.bidh) * b + f.bidb) * m_blocks + f.m_block;
        ++seen[size_t(id)];
        order_breaks += id != last + 1;  // linear block order: m_block, batch, head, split
        last = id;
      }
  bool once = true;
  for (uint8_t s : seen) { once = once && s == 1; }
  CHECK(valid == items * m_blocks && once && order_breaks == 0, "b %d h %d s %d: %lld valid blocks, each once: %d, order breaks %lld",
        b, h, splits, (long long)valid, int(once), (long long)order_breaks);
  CHECK(invalid == g.x * g.y * g.z - items * m_blocks && invalid < g.x * g.y, "padding blocks %lld", (long long)invalid);
}

// Grids too big to enumerate: the first and last block of every z row, and the item count.
void boundaries(int64_t b, int64_t h, int64_t splits) {
  GridDims const g = fwd_grid(1, b, h, splits);
  int64_t const items = b * h * splits;
  CHECK(within_limits(g) && g.y * g.z >= items && g.y * (g.z - 1) < items, "b %lld h %lld s %lld: grid (%lld, %lld, %lld)",
        (long long)b, (long long)h, (long long)splits, (long long)g.x, (long long)g.y, (long long)g.z);
  for (int64_t z = 0; z < g.z; z += (g.z > 64 ? g.z / 64 : 1)) {
    for (int64_t y : {int64_t(0), g.y - 1}) {
      int64_t const r = y + z * g.y;
      FwdBlock const f = fwd_block(0, unsigned(y), unsigned(z), unsigned(g.y), int(b), int(h), int(splits));
      bool const expect_valid = r < items;
      CHECK(f.valid == expect_valid, "block (0, %lld, %lld): valid %d", (long long)y, (long long)z, int(f.valid));
      if (expect_valid) {
        CHECK(f.bidb == r % b && f.bidh == (r / b) % h && f.n_split == r / (b * h), "block (0, %lld, %lld) -> (%d, %d, %d)",
              (long long)y, (long long)z, f.bidb, f.bidh, f.n_split);
      }
    }
  }
  // The last item is addressable.
  int64_t const r = items - 1;
  FwdBlock const f = fwd_block(0, unsigned(r % g.y), unsigned(r / g.y), unsigned(g.y), int(b), int(h), int(splits));
  CHECK(f.valid && f.bidb == b - 1 && f.bidh == h - 1 && f.n_split == splits - 1, "last item of b %lld h %lld s %lld",
        (long long)b, (long long)h, (long long)splits);
}

void combine(int64_t sq, int64_t d, int64_t b, int64_t h) {
  GridDims const g = combine_grid(sq, d, b, h);
  CHECK(within_limits(g) && g.x * kCombineThreads >= sq * combine_col_groups(d), "combine grid for sq %lld d %lld",
        (long long)sq, (long long)d);
  int64_t valid = 0;
  std::vector<uint8_t> seen(size_t(b * h), 0);
  for (unsigned z = 0; z < g.z; ++z)
    for (unsigned y = 0; y < g.y; ++y) {
      CombineBlock const c = combine_block(y, z, unsigned(g.y), int(b), int(h));
      if (c.valid) {
        ++valid;
        ++seen[size_t(c.bidh) * b + c.bidb];
      }
    }
  bool once = true;
  for (uint8_t s : seen) { once = once && s == 1; }
  CHECK(valid == b * h && once, "combine blocks of b %lld h %lld", (long long)b, (long long)h);
}

// The forward starts at tile n_max - 1 (kv_tile_offset) and moves left by kv_tile_step.  Expected offsets are
// written from the cache layouts themselves: a contiguous cache (batch index, left padding, varlen start)
// places key r of entry b at base(b) + r * row_stride; a paged one at table[b][r / page] * page_stride +
// (r % page) * row_stride.
void kv_tile_walk(int block_n, bool paged, bool varlen) {
  constexpr int kBatch = 3, kPage = 128, kPagesPer = 6;
  index_t const row_stride = 5 * 64, batch_stride = 1000 * row_stride, page_stride = kPage * row_stride;
  int const lens[kBatch] = {700, 129, kPage * kPagesPer};
  int const cu[kBatch + 1] = {0, 700, 829, 829 + kPage * kPagesPer};
  int const batch_idx[kBatch] = {2, 0, 1}, leftpad[kBatch] = {0, 37, 5};
  // Pages scattered over a pool of 3 x 6: entry b's page j is pool page (7 * (b * 6 + j) + 3) mod 18.
  int table[kBatch][kPagesPer];
  for (int b = 0; b < kBatch; ++b)
    for (int j = 0; j < kPagesPer; ++j) { table[b][j] = (7 * (b * kPagesPer + j) + 3) % (kBatch * kPagesPer); }
  FwdParams p;
  p.b = kBatch;
  p.seqlen_k = kPage * kPagesPer;
  if (paged) {
    p.block_table = &table[0][0];
    p.block_table_batch_stride = kPagesPer;
    p.page_size = kPage;
  } else if (varlen) {
    p.cu_seqlens_k = cu;
  } else {
    p.kv_batch_idx = batch_idx;
    p.leftpad_k = leftpad;
  }
  for (int b = 0; b < kBatch; ++b) {
    BlockInfo const binfo(p, b);
    int const row0 = p.leftpad_k ? leftpad[b] : 0;
    int const keys = varlen ? lens[b] : p.seqlen_k - row0;
    auto expected = [&](int n) -> index_t {
      int const r = row0 + n * block_n;
      if (paged) { return index_t(table[b][r / kPage]) * page_stride + index_t(r % kPage) * row_stride; }
      return (varlen ? index_t(cu[b]) * row_stride : index_t(batch_idx[b]) * batch_stride) + index_t(r) * row_stride;
    };
    int const n_max = ceil_div(keys, block_n);
    index_t at = binfo.kv_tile_offset(p, b, n_max - 1, block_n, paged ? page_stride : batch_stride, row_stride);
    int wrong = at != expected(n_max - 1);
    for (int n = n_max - 2; n >= 0; --n) {
      at += binfo.kv_tile_step(p, b, n, block_n, paged ? page_stride : batch_stride, row_stride);
      wrong += at != expected(n);
    }
    CHECK(wrong == 0, "K/V walk, block_n %d, %s, entry %d: %d of %d tiles misplaced", block_n,
          paged ? "paged" : varlen ? "varlen" : "batch index + left padding", b, wrong, n_max);
  }
}

// The forward's K/V tile range and masked tiles (block_info.h) against the visibility rule taken row by row:
// row r sees keys [diag(r) - left, diag(r) + right] (a side without a bound: unbounded) within [0, seqlen_k),
// diag(r) = r + seqlen_k - seqlen_q.  For each row block: no tile outside [n_block_min, n_block_max) holds a key
// that one of its rows (< seqlen_q) sees; tile_fully_visible is true exactly where every row of the block
// (kBlockM of them, as the kernel's mask treats them) sees every key of the tile; and the walked bounds
// (masked_tiles) mark exactly the other tiles of the range.
template <int kBlockM, int kBlockN>
int masked_tiles_against_rule(int seqlen_q, int seqlen_k, TestWindow w) {
  FwdParams p{};
  p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  BlockInfo const binfo(p, 0);
  auto lo = [&](int64_t r) { return w.l ? std::max<int64_t>(0, binfo.diagonal(int(r)) - int64_t(w.left_)) : 0; };
  auto hi = [&](int64_t r) {  // one past the last key row r sees
    return std::min<int64_t>(seqlen_k, w.r ? binfo.diagonal(int(r)) + int64_t(w.right_) + 1 : seqlen_k);
  };
  int wrong = 0;
  for (int m_block = 0; m_block * kBlockM < seqlen_q; ++m_block) {
    int const row0 = m_block * kBlockM;
    int const n_min = n_block_min<kBlockM, kBlockN>(binfo, w, m_block);
    int const n_max = n_block_max<kBlockM, kBlockN>(binfo, w, m_block);
    MaskedTiles const walked = masked_tiles<kBlockM, kBlockN>(binfo, w, m_block, n_min, n_max);
    for (int n = 0; n * kBlockN < seqlen_k; ++n) {
      int64_t const c0 = int64_t(n) * kBlockN, c1 = c0 + kBlockN;  // the tile's keys [c0, c1)
      bool any_seen = false, all_seen = true;
      for (int64_t r = row0; r < row0 + kBlockM; ++r) {
        if (r < seqlen_q) { any_seen = any_seen || std::max(lo(r), c0) < std::min(hi(r), c1); }
        all_seen = all_seen && lo(r) <= c0 && c1 <= hi(r);
      }
      if (n < n_min || n >= n_max) {
        wrong += any_seen;
        continue;
      }
      wrong += tile_fully_visible<kBlockM, kBlockN>(binfo, w, m_block, n) != all_seen;
      wrong += walked(n) == all_seen;
    }
  }
  return wrong;
}

void masked_tile_cases() {
  int const lens[][2] = {{1, 1}, {1, 300}, {100, 300}, {300, 100}, {256, 256}, {257, 255}, {200, 1000}, {1000, 200}};
  TestWindow const windows[] = {
      {false, false, 0, 0}, {false, true, 0, 0}, {false, true, 0, 5},    {true, false, 17, 0}, {true, true, 17, 5},
      {true, true, 0, 0},   {true, true, 3, 3},  {true, true, 150, 70}, {false, true, 0, 2000},
  };
  int cases = 0;
  for (auto const& len : lens) {
    for (TestWindow const& w : windows) {
      int const wrong = masked_tiles_against_rule<128, 64>(len[0], len[1], w) +
                        masked_tiles_against_rule<128, 32>(len[0], len[1], w) +
                        masked_tiles_against_rule<64, 64>(len[0], len[1], w) +
                        masked_tiles_against_rule<16, 64>(len[0], len[1], w) +
                        masked_tiles_against_rule<64, 128>(len[0], len[1], w);
      CHECK(wrong == 0, "masked tiles, seqlen_q %d, seqlen_k %d, window (%d: %d, %d: %d): %d tiles wrong", len[0],
            len[1], w.l, w.left_, w.r, w.right_, wrong);
      cases += 5;
    }
  }
  std::printf("masked tiles: %d (lengths, window, tile) cases against the rule row by row\n", cases);
}

int main() {
  masked_tile_cases();
  for (int block_n : {16, 32, 64, 128}) {
    kv_tile_walk(block_n, /*paged=*/false, /*varlen=*/false);
    kv_tile_walk(block_n, /*paged=*/false, /*varlen=*/true);
    kv_tile_walk(block_n, /*paged=*/true, /*varlen=*/false);
  }
  // Small grids, exhaustively.
  exhaustive(3, 2, 5, 1);
  exhaustive(2, 7, 3, 4);
  exhaustive(1, 1, 1, 1);
  // Around 65,535 items: one y row exactly, one item more, varlen batches past the limit.
  exhaustive(1, 65535, 1, 1);
  exhaustive(1, 65536, 1, 1);
  exhaustive(2, 70000, 1, 1);
  exhaustive(1, 1, 65536, 1);
  exhaustive(1, 3, 40000, 1);   // heads x batch past the limit
  exhaustive(1, 1, 600, 128);   // heads x splits = 76,800
  exhaustive(1, 131071, 1, 1);  // 65,535 x 2 + 1: a third z row with one block
  // Huge grids at their boundaries, up to the largest that launches.
  boundaries(100000, 64, 1);
  boundaries(1, 65535, 65535);
  boundaries(65535, 65535, 1);
  boundaries(255, 257, 65535);
  CHECK(grid_error(fwd_grid(1, 65535, 65535, 1)) == nullptr, "65,535^2 items launch");
  CHECK(grid_error(fwd_grid(1, 65535, 65535, 2)) != nullptr, "65,535^2 x 2 items are refused");
  CHECK(grid_error(fwd_grid(int64_t(1) << 31, 1, 1, 1)) != nullptr, "2^31 m-blocks are refused");
  combine(1000, 64, 3, 5);
  combine(7, 256, 70000, 1);
  combine(1, 8, 1, 66000);
  return check_summary();
}
