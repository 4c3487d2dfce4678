// Which backward specialisations exist and which one a problem runs (the backward's dispatch.h): the GPU tile
// configuration per head dim, the static flag variants per (head dim, dtype, causal) file, and the grid.
// Everything is constexpr so the rules can be read, unit-tested on the host, and reported.
#pragma once

#include <cute/config.hpp>

#include "block_info.h"
#include "dispatch.h"
#include "flags.h"

namespace flash_ext {

// ---------------------------------------------------------------------------------------------------
// GPU tile configuration of the backward, one constexpr function of the head dim.
struct BwdTileConfig {
  int block_m, block_n, num_warps;
  int atom_m_sdp, atom_n_dkv, atom_m_dq;  // warps along the rows of S/dP, dK/dV and dQ (the rest: columns)
  bool double_buffer_q;
  constexpr bool operator==(BwdTileConfig const&) const = default;
};

constexpr int bwd_tile_smem_bytes(BwdTileConfig t, int head_dim) {
  return ((t.double_buffer_q ? 3 : 2) * t.block_m * head_dim + 2 * t.block_n * head_dim + 2 * t.block_m * t.block_n) * 2;
}

// Shared memory per CTA: Q (x2 when double-buffered) and dO tiles of block_m rows, K and V tiles of block_n
// rows, and the P and dS tiles (block_m x block_n), 2 bytes per element.  Reasoning:
//  - One config per head dim that fits the smallest budget (99 KB, sm_86/sm_89) and so every sm_8x/sm_90
//    part: the backward's kernels are the largest of the library and a second config per head dim would double
//    their compile time.  (A 163/227 KB part could take 128-key tiles at head dims 96-256.)
//  - The CTA holds dK and dV for block_n keys in registers for its whole walk: 2 x block_n x head_dim / threads
//    fp32 per thread, the dominant register cost.  block_n and the warp count keep this <= 64, leaving room
//    for S and dP (block_m x block_n / threads each) or the dQ accumulator (block_m x head_dim / threads),
//    which are live at different times.  At head dim 256 that takes 8 warps on a 32 x 32 tile (with 4 warps,
//    dK + dV were 128 fp32 per thread and all 24 kernels spilled 56-320 bytes); S and dP then have 8 columns
//    per warp (2 x 4 warps), loaded with ldmatrix.x2 (traits_sm80_bwd.h).  The alternative, 64 x 32 on 8
//    warps, needs 104 KB: more than sm_86's 99 KB.
//  - block_m = 64 (32 at head dim 256): each K/V tile is reused by every query tile it sees, and each query
//    tile's Q/dO loads serve block_n keys; 64 keeps the S/dP accumulators small.
//  - Warps split both dimensions of each output (no cross-warp reduction exists in the backward), as
//    balanced as the 16-row x 16-column warp steps allow, to cut each warp's operand reads from shared memory.
constexpr BwdTileConfig sm80_bwd_tile_config(int head_dim) {
  if (head_dim <= 32) { return {64, 128, 8, 2, 4, 4, true}; }   // 61 KB; dK+dV 32, S+dP 64 regs
  if (head_dim <= 64) { return {64, 128, 8, 2, 4, 4, true}; }   // 90 KB; dK+dV 64, S+dP 64
  if (head_dim <= 96) { return {64, 64, 8, 2, 4, 4, true}; }    // 78 KB; dK+dV 48, S+dP 32
  if (head_dim <= 128) { return {64, 64, 8, 2, 4, 2, true}; }   // 98 KB; dK+dV 64, S+dP 32
  if (head_dim <= 192) { return {64, 32, 8, 4, 2, 2, false}; }  // 82 KB; dK+dV 48, S+dP 16
  return {32, 32, 8, 2, 2, 2, false};                           // 70 KB; dK+dV 64, S+dP 8
}

constexpr bool bwd_tile_configs_fit() {
  for (int hd : {32, 64, 96, 128, 192, 256}) {
    if (bwd_tile_smem_bytes(sm80_bwd_tile_config(hd), hd) > int(SmemBudget::kSm86)) { return false; }
  }
  return true;
}
static_assert(bwd_tile_configs_fit(), "every backward tile config fits sm_86/sm_89's 99 KB of shared memory");

// ---------------------------------------------------------------------------------------------------
// Static flag combinations compiled into each backward (head dim, dtype, causal) file.  The backward kernels
// are the library's largest, so the list is the shortest that keeps the common training case free of runtime
// branches: a fully static kernel for tile-multiple lengths without extras, one general kernel, and (as in the
// forward) one dropout kernel with every other feature at runtime, so that the kernels without dropout carry
// no random-number code.  (Varlen training runs the general or the dropout kernel: every sequence has its own
// length.)
inline constexpr Variant kBwdVariants[] = {
    {"even", FlagMode::kTrue, FlagMode::kTrue, FlagMode::kFalse, FlagMode::kFalse, FlagMode::kFalse, FlagMode::kFalse,
     FlagMode::kFalse},
    {"general", FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime,
     FlagMode::kFalse, FlagMode::kFalse},
    {"dropout", FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime,
     FlagMode::kFalse, FlagMode::kTrue},
};
inline constexpr int kNumBwdVariants = int(sizeof(kBwdVariants) / sizeof(kBwdVariants[0]));

// The forward's pruning rule applies (a causal file has no local-window branch).  Split-KV does not exist in
// the backward: problem flags are taken with split = false.
constexpr int select_bwd_variant(bool causal, ProblemFlags p) {
  p.split = false;
  for (int i = 0; i < kNumBwdVariants; ++i) {
    if (variant_admits(kBwdVariants[i], causal, p)) { return i; }
  }
  return -1;
}

//                                        even_mn even_k local  alibi  softcap split  dropout
static_assert(select_bwd_variant(false, {true, true, false, false, false, false, false}) == 0);
static_assert(select_bwd_variant(true, {true, true, false, false, false, true, false}) == 0, "split never matters");
static_assert(select_bwd_variant(true, {false, true, false, false, false, false, false}) == 1);
static_assert(select_bwd_variant(false, {true, true, true, true, true, false, false}) == 1);
static_assert(select_bwd_variant(false, {true, true, false, false, false, false, true}) == 2, "dropout has its own kernel");
static_assert(select_bwd_variant(false, {false, false, true, true, true, false, true}) == 2 &&
                  select_bwd_variant(true, {false, false, false, true, true, false, true}) == 2,
              "every feature combination has a dropout kernel");
static_assert(select_bwd_variant(true, {true, true, true, false, false, false, false}) == -1,
              "causal files have no local branch");

template <int kVariant, bool kCausal>
using BwdVariantFlags = KernelFlags<FlagType<kBwdVariants[kVariant].even_mn>, FlagType<kBwdVariants[kVariant].even_k>,
                                    cute::C<kCausal>, FlagType<local_mode(kBwdVariants[kVariant], kCausal)>,
                                    FlagType<kBwdVariants[kVariant].alibi>, FlagType<kBwdVariants[kVariant].softcap>,
                                    FlagType<kBwdVariants[kVariant].split>, FlagType<kBwdVariants[kVariant].dropout>>;

// ---------------------------------------------------------------------------------------------------
// Grid.  One CTA per (K/V tile, batch, K/V head), walking the query heads of its group, adds into one shared dQ
// slice with atomics.  Deterministic mode fixes the order of every dQ sum instead: gridDim.x = dq_splits
// columns of CTAs, column s owning K/V tiles s, s + dq_splits, ... in increasing order and its own dQ slice
// s (a single writer per slice); the postprocess adds the slices in slice order.  dq_splits is chosen to fill
// about one wave of processors; each slice costs h x rows x d x 4 bytes.
constexpr int bwd_deterministic_splits(int batch, int heads_k, int n_blocks, int processors) {
  int const groups = batch * heads_k;
  if (groups <= 0 || n_blocks <= 0) { return 1; }
  int const want = ceil_div(processors > 0 ? processors : 1, groups);
  return want < 1 ? 1 : (want > n_blocks ? n_blocks : want);
}

static_assert(bwd_deterministic_splits(4, 32, 16, 132) == 2);
static_assert(bwd_deterministic_splits(1, 1, 8, 132) == 8, "never more splits than K/V tiles");

// The dQ slices of a deterministic backward (GPU) or of any CPU backward together take at most this many
// bytes, or one slice if one is larger.  Without a cap the slice count grows as SMs / (batch x K/V heads): MQA at
// 32K keys, 32 query heads, d 128 on an H100 asked for 132 slices of 512 MiB (66 GiB) where dQ itself is 256 MiB.
// Fewer slices only lengthen each column's walk over the K/V tiles; the count stays a function of the shape
// (and the GPU's SM count), so the sum order, and with it the result, is still fixed for a given shape.
inline constexpr int64_t kDqAccumBudgetBytes = int64_t(2) << 30;

constexpr int cap_dq_slices(int slices, int64_t slice_bytes) {
  if (slice_bytes <= 0 || int64_t(slices) * slice_bytes <= kDqAccumBudgetBytes) { return slices; }
  int64_t const fit = kDqAccumBudgetBytes / slice_bytes;
  return fit < 1 ? 1 : int(fit);
}

static_assert(cap_dq_slices(132, int64_t(512) << 20) == 4 && cap_dq_slices(8, int64_t(1) << 20) == 8 &&
              cap_dq_slices(3, int64_t(4) << 30) == 1);

}  // namespace flash_ext
