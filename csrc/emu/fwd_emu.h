// Raw-pointer entry points of the emulated Sm80 backend, between the op layer (or the C++ tests) and the
// emulated launcher (launch_emu.h).  No torch types, no kernel templates.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "emu/runtime.h"
#include "flash_ext/dispatch.h"
#include "flash_ext/fwd_api.h"
#include "flash_ext/grid.h"
#include "flash_ext/params.h"

namespace flash_ext::emu {

// for_each_chunk(begin, end, body): runs body(b, e) over chunks covering [begin, end), possibly on several
// CPU threads at once (at::parallel_for in the extension).
using ParallelFor = std::function<void(int64_t, int64_t, std::function<void(int64_t, int64_t)> const&)>;

// One emulated launch: the global tensors it may touch, how to spread CTAs, and the accumulated report.
struct EmuLaunch {
  std::vector<GlobalRange> globals;
  ParallelFor parallel_for;
  Report report;
  std::mutex mutex;
};

// The emulated device: an sm_80 A100 (108 SMs, 163 KB of shared memory per CTA).  The processor count feeds
// the split-KV heuristic the way the GPU's does.
inline constexpr int kEmuProcessors = 108;
inline constexpr int kEmuSmemOptin = 163 * 1024;

// What the emulated launcher would run (the CUDA dispatcher's plan on the emulated device); ok false with
// `why` when nothing can run (head dim not compiled into the emulator, no variant, grid too large).
CudaPlan plan_fwd_emu(FwdParams const& params, DType dtype);

// Runs the forward kernel (and, with splits, the combine kernel) on the emulator.  Returns an empty string,
// or why it could not launch; findings and statistics accumulate in launch.report.
std::string run_fwd_emu(FwdParams const& params, DType dtype, EmuLaunch& launch);

// Head dims compiled into the emulator, ascending, comma-separated.
std::string emu_head_dims();
// Why a problem of head dim d has no emulated kernel in this build, or "".
std::string head_dim_unavailable(int d);

}  // namespace flash_ext::emu
