// kernel<<<grid, threads, smem>>> on the warp emulator, for any kernel: the emulated counterpart of a CUDA
// launch, independent of what the kernel computes.  The forward (launch_emu.h) and any later kernel (the
// backward) launch through it; docs/design.md, "Emulating a new kernel", says how.
//
// Every block of the grid is one emulated CTA (runtime.h: run_cta), blocks are visited in CUDA's linear order
// (x fastest, then y, then z), spread over CPU threads by the launch's parallel-for; each CPU thread keeps
// its own report, merged at the end, so findings are ordered by block index whatever the thread count.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "emu/fwd_emu.h"
#include "emu/runtime.h"
#include "flash_ext/grid.h"

namespace flash_ext::emu {

namespace detail {
template <class Body>
struct BlockCtx {
  Body const* body;
  unsigned x, y, z;
};
template <class Body>
void block_trampoline(void const* ctx, int tid, char* smem) {
  auto const& c = *static_cast<BlockCtx<Body> const*>(ctx);
  (*c.body)(c.x, c.y, c.z, tid, smem);
}
}  // namespace detail

// Runs cta_body(x, y, z, tid, smem) -- one block's work for threadIdx.x = tid, with the CTA's dynamic shared
// memory -- for every block (blockIdx = (x, y, z)) of `grid` and every tid < desc.threads, each thread on
// its own fiber; describe(x, y, z) names a block's work in findings (e.g. "m_block 0, batch 1, head 3").
// desc.globals bounds the kernel's global accesses (launch.globals when desc.globals is empty).  Returns ""
// or why the grid cannot launch; findings and statistics accumulate in launch.report.
template <class CtaBody_, class Describe>
std::string launch_grid_emu(KernelDesc desc, GridDims const& grid, EmuLaunch& launch, CtaBody_ const& cta_body,
                            Describe const& describe) {
  if (char const* why = grid_error(grid)) { return std::string("grid: ") + why; }
  if (desc.globals.empty()) { desc.globals = launch.globals; }
  int64_t const blocks = grid.x * grid.y * grid.z;
  launch.parallel_for(0, blocks, [&](int64_t begin, int64_t end) {
    Report local;
    for (int64_t i = begin; i < end; ++i) {
      auto const x = unsigned(i % grid.x), y = unsigned((i / grid.x) % grid.y), z = unsigned(i / (grid.x * grid.y));
      CtaCoord coord;
      coord.x = x, coord.y = y, coord.z = z, coord.order = uint64_t(i);
      coord.work = describe(x, y, z);
      detail::BlockCtx<CtaBody_> const ctx{&cta_body, x, y, z};
      run_cta(desc, coord, &detail::block_trampoline<CtaBody_>, &ctx, local);
    }
    std::lock_guard<std::mutex> lock(launch.mutex);
    launch.report.merge(local);
  });
  return {};
}

}  // namespace flash_ext::emu
