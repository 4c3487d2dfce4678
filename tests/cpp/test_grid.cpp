// Launch geometry (csrc/flash_ext/grid.h) as pure functions, around CUDA's 65,535 limit on grid.y / grid.z:
// every grid stays inside the limits, and the block decode is a bijection from the valid blocks onto the
// work items (m_block, batch, head, split) -- checked exhaustively where the grid is small enough, and at the
// boundaries (first and last blocks of each z row) where it is not.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "flash_ext/grid.h"
#include "check.h"

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

int main() {
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
