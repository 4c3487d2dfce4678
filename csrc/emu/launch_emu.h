// The emulated Sm80 launcher: launch_sm80.cuh and csrc/cuda/fwd_dispatch.cu on the warp emulator.  Same tile
// config (sm80_tile_config), same traits apart from the Arch policy, same static variant (select_variant),
// same grid and block decode (grid.h, fwd_cta), and the split-KV combine run thread by thread the way the
// CUDA combine kernel splits it (combine_thread).  CTAs are spread over CPU threads by the caller's
// parallel-for (at::parallel_for in the extension); each CTA is one deterministic emulated run.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "emu/arch_emu.h"
#include "emu/fwd_emu.h"
#include "emu/launch_grid.h"
#include "emu/runtime.h"
#include "flash_ext/combine.h"
#include "flash_ext/dispatch.h"
#include "flash_ext/grid.h"
#include "flash_ext/kernel_fwd.h"
#include "flash_ext/traits_sm80.h"

namespace flash_ext::emu {

// The emulated device is an sm_80 part (A100): its shared-memory budget picks the tile, as on the GPU.
inline constexpr SmemBudget kEmuBudget = SmemBudget::kSm80;

// Sm80Fwd of launch_sm80.cuh with the emulated policy.
template <int kHeadDim, class Element, bool kCausal>
using EmuFwd = Sm80FwdTiles<kHeadDim, Element, kCausal, kEmuBudget, EmuSm80Arch>;

// flash_fwd_kernel<Traits, Flags><<<grid, kNThreads, kSmemBytes>>>: every block of the grid, on the emulator.
template <class Traits, class Flags>
std::string launch_fwd_emu(FwdParams const& params, EmuLaunch& launch, std::string const& name) {
  GridDims const g = fwd_grid(ceil_div(params.seqlen_q, Traits::kBlockM), params.b, params.h, params.num_splits);
  KernelDesc kernel;
  kernel.name = name;
  kernel.threads = Traits::kNThreads;
  kernel.smem_bytes = Traits::kSmemBytes;
  kernel.regions = {{0u, "sQ/sO"},
                    {uint32_t(Traits::kSmemQBytes), "sK"},
                    {uint32_t(Traits::kSmemQBytes + Traits::kSmemKVBytes), "sV"}};
  return launch_grid_emu(
      kernel, g, launch,
      [&](unsigned x, unsigned y, unsigned z, int tid, char* smem) {
        fwd_cta<Traits, Flags>(params, x, y, z, unsigned(g.y), tid, smem);
      },
      [&](unsigned x, unsigned y, unsigned z) {
        FwdBlock const b = fwd_block(x, y, z, unsigned(g.y), params.b, params.h, params.num_splits);
        return b.valid ? "m_block " + std::to_string(b.m_block) + ", batch " + std::to_string(b.bidb) + ", head " +
                             std::to_string(b.bidh) + ", split " + std::to_string(b.n_split)
                       : std::string("padding block");
      });
}

// combine_kernel<Element><<<combine_grid, kCombineThreads>>>: no shared memory and no collectives; each
// emulated thread does the CUDA thread's work (combine_thread), its global reads and writes checked.
template <class Element>
std::string launch_combine_emu(FwdParams const& params, EmuLaunch& launch) {
  GridDims const g = combine_grid(params.seqlen_q, params.d, params.b, params.h);
  if (char const* why = grid_error(g)) { return std::string("combine grid: ") + why; }
  KernelDesc kernel;
  kernel.name = std::string("combine_kernel<") + (std::is_same_v<Element, cutlass::half_t> ? "fp16" : "bf16") + ">";
  kernel.threads = kCombineThreads;
  return launch_grid_emu(
      kernel, g, launch,
      [&](unsigned x, unsigned y, unsigned z, int tid, char*) {
        CombineBlock const blk = combine_block(y, z, unsigned(g.y), params.b, params.h);
        if (blk.valid) {
          combine_thread<Element, EmuSm80Arch>(params, blk.bidb, blk.bidh, int64_t(x) * kCombineThreads + tid);
        }
      },
      [&](unsigned x, unsigned y, unsigned z) {
        CombineBlock const blk = combine_block(y, z, unsigned(g.y), params.b, params.h);
        return blk.valid ? "combine rows of batch " + std::to_string(blk.bidb) + ", head " + std::to_string(blk.bidh) +
                               ", block " + std::to_string(x)
                         : std::string("padding block");
      });
}

template <class Fwd, bool kCausal, int kVariant = 0>
std::string launch_variant_emu(FwdParams const& params, EmuLaunch& launch, int variant) {
  if constexpr (kVariant < kNumVariants) {
    if (variant == kVariant) {
      using Traits = typename Fwd::template Traits<kVariant>;
      using Element = typename Traits::Element;
      std::string const name = "Sm80Traits<" + std::to_string(Traits::kHeadDim) + ", " + std::to_string(Traits::kBlockM) +
                               ", " + std::to_string(Traits::kBlockN) + ", " + std::to_string(Traits::kNWarps) + ", " +
                               (std::is_same_v<Element, cutlass::half_t> ? "fp16" : "bf16") + ", EmuSm80Arch>" +
                               (kCausal ? " causal" : "") + ", variant " + kVariants[kVariant].name;
      return launch_fwd_emu<Traits, VariantFlags<kVariant, kCausal>>(params, launch, name);
    }
    return launch_variant_emu<Fwd, kCausal, kVariant + 1>(params, launch, variant);
  } else {
    return "no compiled variant admits this problem";
  }
}

// run_fwd_sm80 (launch_sm80.cuh) + the combine launch of run_fwd_cuda (fwd_dispatch.cu), emulated.
// Explicitly instantiated once per (head dim, dtype, causal) in csrc/emu/generated/.
template <int kHeadDim, class Element, bool kCausal>
std::string run_fwd_emu_sm80(FwdParams const& params, EmuLaunch& launch) {
  using Fwd = EmuFwd<kHeadDim, Element, kCausal>;
  std::string err = launch_variant_emu<Fwd, kCausal>(params, launch,
                                                     select_fwd_variant(params, kHeadDim, kCausal, Fwd::kBudget));
  if (err.empty() && params.num_splits > 1) { err = launch_combine_emu<Element>(params, launch); }
  return err;
}

}  // namespace flash_ext::emu
