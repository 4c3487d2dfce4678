// The emulated Sm80 backward: launch_sm80_bwd.cuh and csrc/cuda/bwd_dispatch.cu on the warp emulator.  Same
// tile config (sm80_bwd_tile_config), same traits apart from the Arch policy, same grid (K/V tiles or dQ
// columns, batch, K/V head), the same CTA body (bwd_cta, which flash_bwd_kernel's loop also is) and the same
// atomic or deterministic dQ accumulation (EmuSm80Arch::atomic_add: red.global.add.f32, range- and
// alignment-checked against the launch's writable tensors).
//
// The per-row preprocess (D, zeroed dQ slices) and postprocess (dQ) kernels use no shared memory and no
// collectives: their CUDA threads run one after another here, each doing the CUDA thread's work
// (bwd_preprocess.h, bwd_postprocess.h), outside the emulated checks.
#pragma once

#include <algorithm>
#include <string>
#include <type_traits>

#include "emu/arch_emu.h"
#include "emu/fwd_emu.h"
#include "emu/launch_grid.h"
#include "emu/runtime.h"
#include "flash_ext/block_info.h"
#include "flash_ext/bwd_postprocess.h"
#include "flash_ext/bwd_preprocess.h"
#include "flash_ext/dispatch_bwd.h"
#include "flash_ext/grid.h"
#include "flash_ext/kernel_bwd.h"
#include "flash_ext/traits_sm80_bwd.h"

namespace flash_ext::emu {

// Sm80Bwd of launch_sm80_bwd.cuh with the emulated policy.
template <int kHeadDim, class Element>
struct EmuBwd {
  static constexpr BwdTileConfig kTile = sm80_bwd_tile_config(kHeadDim);
  using Traits = Sm80BwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.num_warps, kTile.atom_m_sdp,
                               kTile.atom_n_dkv, kTile.atom_m_dq, kTile.double_buffer_q, Element, EmuSm80Arch>;
};

// flash_bwd_kernel's body for blockIdx (x, y, z), gridDim.x = grid_x and threadIdx.x = tid.
template <class Traits, class Flags>
void bwd_cta(BwdParams const& params, unsigned x, unsigned y, unsigned z, unsigned grid_x, int tid, char* smem) {
  Flags const flags = bwd_flags_from_params<Traits, Flags>(params);
  int const n_blocks = ceil_div(params.seqlen_k, Traits::kBlockN);
  int const dq_slice = params.deterministic ? int(x) : 0;
  for (int n_block = int(x); n_block < n_blocks; n_block += int(grid_x)) {
    compute_dq_dk_dv_1colblock<Traits>(params, flags, int(y), int(z), n_block, dq_slice, tid, smem);
  }
}

// The launch description of the backward kernel: threads, dynamic shared memory and its regions in
// compute_dq_dk_dv_1colblock's order (Q buffers, dO, K, V, P, dS).  Global tensors come from the launch.
template <class Traits>
KernelDesc bwd_kernel_desc(std::string name) {
  KernelDesc kernel;
  kernel.name = std::move(name);
  kernel.threads = Traits::kNThreads;
  kernel.smem_bytes = Traits::kSmemBytes;
  uint32_t const q_bytes = uint32_t((Traits::kDoubleBufferQ ? 2 : 1) * Traits::kSmemQdOBytes);
  uint32_t const k_at = q_bytes + uint32_t(Traits::kSmemQdOBytes);
  uint32_t const p_at = k_at + 2u * uint32_t(Traits::kSmemKVBytes);
  kernel.regions = {{0u, "sQ"},
                    {q_bytes, "sdO"},
                    {k_at, "sK"},
                    {k_at + uint32_t(Traits::kSmemKVBytes), "sV"},
                    {p_at, "sP"},
                    {p_at + uint32_t(Traits::kSmemPdSBytes), "sdS"}};
  return kernel;
}

// flash_bwd_kernel<Traits, Flags><<<grid, kNThreads, kSmemBytes>>> (launch_bwd): every block, emulated.
template <class Traits, class Flags>
std::string launch_bwd_emu(BwdParams const& params, EmuLaunch& launch, KernelDesc const& kernel) {
  int const n_blocks = ceil_div(params.seqlen_k, Traits::kBlockN);
  GridDims const g{params.deterministic ? params.dq_accum_splits : n_blocks, params.b, params.h_k};
  return launch_grid_emu(
      kernel, g, launch,
      [&](unsigned x, unsigned y, unsigned z, int tid, char* smem) {
        bwd_cta<Traits, Flags>(params, x, y, z, unsigned(g.x), tid, smem);
      },
      [&](unsigned x, unsigned y, unsigned z) {
        return (params.deterministic ? "dQ column " : "n_block ") + std::to_string(x) + ", batch " +
               std::to_string(y) + ", K/V head " + std::to_string(z);
      });
}

// bwd_preprocess_kernel / bwd_postprocess_kernel of bwd_dispatch.cu, thread by thread (same work split).
template <class Element>
void bwd_pre_post_emu(BwdParams const& params, EmuLaunch& launch, bool pre) {
  int const groups = (params.d + 7) / 8;
  int64_t const per_batch = int64_t(params.seqlen_q) * params.h * (pre ? 1 : groups);
  launch.parallel_for(0, int64_t(params.b) * per_batch, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int const bidb = int(i / per_batch);
      int64_t const t = i % per_batch;
      BlockInfo const binfo(params, bidb);
      if (pre) {
        int const row = int(t / params.h), bidh = int(t % params.h);
        if (row < binfo.seqlen_q) { preprocess_row<Element>(params, binfo, bidb, bidh, row); }
      } else {
        int const row = int(t / (int64_t(groups) * params.h)), bidh = int((t / groups) % params.h);
        int const group = int(t % groups);
        if (row < binfo.seqlen_q) {
          postprocess_dq_row<Element>(params, binfo, bidb, bidh, row, group * 8, std::min((group + 1) * 8, params.d));
        }
      }
    }
  });
}

// The kernel name the report lists, e.g. "Sm80BwdTraits<64, 64, 128, 8, fp16, EmuSm80Arch> causal, variant general".
template <class Traits, bool kCausal>
std::string bwd_kernel_name(int variant) {
  using Element = typename Traits::Element;
  return "Sm80BwdTraits<" + std::to_string(Traits::kHeadDim) + ", " + std::to_string(Traits::kBlockM) + ", " +
         std::to_string(Traits::kBlockN) + ", " + std::to_string(Traits::kNWarps) + ", " +
         (std::is_same_v<Element, cutlass::half_t> ? "fp16" : "bf16") + ", EmuSm80Arch>" + (kCausal ? " causal" : "") +
         ", variant " + kBwdVariants[variant].name;
}

// run_bwd_cuda for one static variant: preprocess, the main kernel, postprocess.  The caller picks kVariant
// with select_bwd_variant (as run_bwd_sm80 does); instantiating one variant at a time keeps a test's compile
// time to what it runs.  `kernel` defaults to bwd_kernel_desc (a test may pass a wrong one on purpose).
template <class Traits, bool kCausal, int kVariant>
std::string run_bwd_variant_emu(BwdParams const& params, EmuLaunch& launch, KernelDesc const* kernel = nullptr) {
  static_assert(kVariant >= 0 && kVariant < kNumBwdVariants);
  int const variant =
      select_bwd_variant(kCausal, problem_flags(params, Traits::kBlockM, Traits::kBlockN, Traits::kHeadDim));
  if (variant != kVariant) {
    return "the GPU dispatcher picks variant " + std::string(variant >= 0 ? kBwdVariants[variant].name : "(none)") +
           " for this problem, not " + kBwdVariants[kVariant].name;
  }
  add_param_ranges(launch, params, /*backward=*/true, params.softmax_d_ptr, params.dsoftmax_lse_ptr);
  KernelDesc const desc = kernel ? *kernel : bwd_kernel_desc<Traits>(bwd_kernel_name<Traits, kCausal>(kVariant));
  using Element = typename Traits::Element;
  bwd_pre_post_emu<Element>(params, launch, true);
  std::string err = launch_bwd_emu<Traits, BwdVariantFlags<kVariant, kCausal>>(params, launch, desc);
  if (err.empty()) { bwd_pre_post_emu<Element>(params, launch, false); }
  return err;
}

}  // namespace flash_ext::emu
