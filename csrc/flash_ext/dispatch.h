// Which specialisations exist and which one a problem runs.  Everything here is constexpr data and
// constexpr functions, so the rules can be read, unit-tested on the host, and reported by explain().
#pragma once

#include <type_traits>

#include <cute/config.hpp>
#include <cute/numeric/integral_constant.hpp>

#include "flags.h"
#include "params.h"

namespace flash_ext {

// ---------------------------------------------------------------------------------------------------
// Tile configuration of the GPU kernel, one constexpr function of (head dim, causal, arch).
struct TileConfig {
  int block_m, block_n, num_warps;
};

// Shared memory per CTA is (block_m + 2 * block_n) * head_dim * 2 bytes.  Reasoning per choice:
//  - 4 warps own 16-row slabs each, so block_m = 64 or 128 gives each warp 1 or 2 MMA rows; with 128 rows a
//    CTA does twice the work per K/V byte loaded from L2, which is what the sm_80/sm_90 memory system needs.
//  - The accumulators per thread are block_m * (block_n + head_dim) / (32 * num_warps) floats.  Keeping that
//    at or under ~192 leaves room for operand fragments inside 255 registers without spilling; where it would
//    exceed that (large head dims), 8 warps split the rows instead of shrinking the tiles.
//  - At 1 CTA/SM (these kernels use up to 255 registers x 128 threads), occupancy comes from 4-8 resident
//    warps whose MMA and cp.async overlap inside the CTA; smaller CTAs would not raise it under the register cap.
constexpr TileConfig sm80_tile_config(int head_dim, bool /*causal*/) {
  if (head_dim <= 32) { return {128, 128, 4}; }   // 24 KB + 16 KB smem; 128 + 32 accumulators
  if (head_dim <= 64) { return {128, 64, 4}; }    // 16 KB + 16 KB; 64 + 64 accumulators
  if (head_dim <= 96) { return {128, 64, 4}; }    // 24 KB + 24 KB; 64 + 96 accumulators
  if (head_dim <= 128) { return {128, 32, 4}; }   // 32 KB + 16 KB; 32 + 128 accumulators
  if (head_dim <= 192) { return {128, 64, 8}; }   // 48 KB + 48 KB; 32 + 96 accumulators
  return {128, 64, 8};                            // 64 KB + 64 KB; 32 + 128 accumulators
}

// Head dims with a GPU instantiation, ascending; a problem with head dim d runs the smallest one >= d.
inline constexpr int kGpuHeadDims[] = {32, 64, 96, 128, 192, 256};

constexpr int gpu_head_dim_for(int d) {
  for (int hd : kGpuHeadDims) {
    if (d <= hd) { return hd; }
  }
  return -1;
}

// ---------------------------------------------------------------------------------------------------
// Static flag combinations compiled into each (head dim, dtype, causal) file.  Each costs compile time for
// every user, so the list is short: a fully static kernel for the common case, and general kernels that
// keep the rare features as runtime branches.
enum class FlagMode : unsigned char { kFalse, kTrue, kRuntime };

struct Variant {
  const char* name;
  FlagMode even_mn, even_k, local, alibi, softcap;
};

inline constexpr Variant kVariants[] = {
    // Tile-multiple sequence lengths, head dim equal to the tile's, no extras: no predicate anywhere.
    {"even", FlagMode::kTrue, FlagMode::kTrue, FlagMode::kFalse, FlagMode::kFalse, FlagMode::kFalse},
    // Any sequence length and head dim, plain or causal attention: the usual inference/ragged case.
    {"uneven", FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kFalse, FlagMode::kFalse, FlagMode::kFalse},
    // Local windows, ALiBi and softcap as runtime branches.
    {"general", FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime},
};
inline constexpr int kNumVariants = int(sizeof(kVariants) / sizeof(kVariants[0]));

// Pruning rule: a causal file never compiles the local-window branch (the op layer turns "causal plus a
// finite left window" into a local problem, which runs the non-causal file).
constexpr FlagMode local_mode(Variant v, bool causal) { return causal ? FlagMode::kFalse : v.local; }

struct ProblemFlags {
  bool even_mn, even_k, local, alibi, softcap;
};

// The runtime facts the flags stand for, for a tile of block_m x block_n and a head-dim tile.  Varlen
// batches are never "even": each sequence has its own length.
CUTE_HOST_DEVICE constexpr ProblemFlags problem_flags(FwdParams const& p, int block_m, int block_n, int head_dim) {
  bool const varlen = p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.seqused_k != nullptr;
  return {!varlen && p.seqlen_q % block_m == 0 && p.seqlen_k % block_n == 0, p.d == head_dim, p.is_local,
          p.alibi_slopes_ptr != nullptr, p.softcap > 0.f};
}

constexpr bool admits(FlagMode mode, bool value) {
  return mode == FlagMode::kRuntime || (mode == FlagMode::kTrue) == value;
}

constexpr bool variant_admits(Variant v, bool causal, ProblemFlags p) {
  return admits(v.even_mn, p.even_mn) && admits(v.even_k, p.even_k) && admits(local_mode(v, causal), p.local) &&
         admits(v.alibi, p.alibi) && admits(v.softcap, p.softcap);
}

// The first (most specialised) variant that admits the problem; -1 if none does.
constexpr int select_variant(bool causal, ProblemFlags p) {
  for (int i = 0; i < kNumVariants; ++i) {
    if (variant_admits(kVariants[i], causal, p)) { return i; }
  }
  return -1;
}

static_assert(select_variant(false, {true, true, false, false, false}) == 0);
static_assert(select_variant(true, {false, true, false, false, false}) == 1);
static_assert(select_variant(false, {true, true, true, true, true}) == 2);
static_assert(select_variant(true, {true, true, true, false, false}) == -1, "causal files have no local branch");

template <FlagMode M>
using FlagType = std::conditional_t<M == FlagMode::kRuntime, bool, cute::C<M == FlagMode::kTrue>>;

template <int kVariant, bool kCausal>
using VariantFlags = KernelFlags<FlagType<kVariants[kVariant].even_mn>, FlagType<kVariants[kVariant].even_k>,
                                 cute::C<kCausal>, FlagType<local_mode(kVariants[kVariant], kCausal)>,
                                 FlagType<kVariants[kVariant].alibi>, FlagType<kVariants[kVariant].softcap>>;

}  // namespace flash_ext
