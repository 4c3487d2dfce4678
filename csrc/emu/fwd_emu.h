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

// The small global arrays a kernel reads or writes beside its tiles -- cu_seqlens, seqused_k, leftpad_k,
// kv_batch_idx, block_table, ALiBi slopes, the RNG state, LSE (and, for the backward, D and the LSE
// gradient) -- with the extents params.h gives them, appended to launch.globals unless the caller already
// registered a tensor at that address (the op layer and the tests register q/k/v/out and the partials from
// the tensors themselves).  LSE is writable in the forward and read-only in the backward.
inline void add_param_ranges(EmuLaunch& launch, FwdParams const& p, bool backward,
                             float const* softmax_d = nullptr, float const* dsoftmax_lse = nullptr) {
  auto add = [&](void const* ptr, int64_t elems, size_t elem_bytes, bool writable, char const* name) {
    if (ptr == nullptr || elems <= 0) { return; }
    auto const begin = reinterpret_cast<uintptr_t>(ptr);
    for (GlobalRange const& r : launch.globals) {
      if (begin == r.begin || (begin > r.begin && begin < r.end)) { return; }  // (a narrowed range may be empty)
    }
    launch.globals.push_back({begin, begin + uintptr_t(elems) * elem_bytes, writable, name});
  };
  int64_t const b = p.b, stats = p.cu_seqlens_q ? int64_t(p.h) * p.total_q : b * p.h * p.seqlen_q;
  add(p.cu_seqlens_q, b + 1, sizeof(int), false, "cu_seqlens_q");
  add(p.cu_seqlens_k, b + 1, sizeof(int), false, "cu_seqlens_k");
  add(p.seqused_k, b, sizeof(int), false, "seqused_k");
  add(p.kv_batch_idx, b, sizeof(int), false, "cache_batch_idx");
  add(p.leftpad_k, b, sizeof(int), false, "cache_leftpad");
  add(p.block_table, b * p.block_table_batch_stride, sizeof(int), false, "block_table");
  add(p.alibi_slopes_ptr, (b - 1) * p.alibi_slopes_batch_stride + p.h, sizeof(float), false, "alibi_slopes");
  add(p.rng_seed_ptr, 1, sizeof(int64_t), false, "rng seed");
  add(p.rng_offset_ptr, 1, sizeof(int64_t), false, "rng offset");
  add(p.rng_state_out, 2, sizeof(int64_t), !backward, "rng_state");
  add(p.softmax_lse_ptr, stats, sizeof(float), !backward, "softmax_lse");
  add(softmax_d, stats, sizeof(float), false, "softmax_d");
  add(dsoftmax_lse, stats, sizeof(float), false, "dsoftmax_lse");
}

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
