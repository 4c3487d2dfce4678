// Which specialisations exist and which one a problem runs.  Everything here is constexpr data and
// constexpr functions, so the rules can be read, unit-tested on the host, and reported by explain().
#pragma once

#include <type_traits>

#include <cute/config.hpp>
#include <cute/numeric/integral_constant.hpp>

#include "block_info.h"
#include "flags.h"
#include "params.h"

namespace flash_ext {

// ---------------------------------------------------------------------------------------------------
// Tile configuration of the GPU kernel, one constexpr function of (head dim, static variant, arch).
struct TileConfig {
  int block_m, block_n, num_warps;
  constexpr bool operator==(TileConfig const&) const = default;
};

// The arch enters only through its shared memory per CTA: sm_80/sm_87 allow 163 KB and sm_90 227 KB,
// sm_86/sm_89 99 KB.  (Everything else these kernels use is common to sm_80..sm_90.)
enum class SmemBudget : int { kSm80 = 163 * 1024, kSm86 = 99 * 1024 };

constexpr SmemBudget smem_budget_for(int max_smem_per_block_optin) {
  return max_smem_per_block_optin >= int(SmemBudget::kSm80) ? SmemBudget::kSm80 : SmemBudget::kSm86;
}

constexpr int tile_smem_bytes(TileConfig t, int head_dim) { return (t.block_m + 2 * t.block_n) * head_dim * 2; }

// ---------------------------------------------------------------------------------------------------
// Static flag combinations compiled into each (head dim, dtype, causal) file.  Each costs compile time for
// every user, so the list is short: a fully static kernel for the common case, and general kernels that
// keep the rare features as runtime branches.
enum class FlagMode : unsigned char { kFalse, kTrue, kRuntime };

struct Variant {
  const char* name;
  FlagMode even_mn, even_k, local, alibi, softcap, split, dropout;
};

inline constexpr Variant kVariants[] = {
    // Tile-multiple sequence lengths, head dim equal to the tile's, no extras: no predicate anywhere.
    {"even", FlagMode::kTrue, FlagMode::kTrue, FlagMode::kFalse, FlagMode::kFalse, FlagMode::kFalse, FlagMode::kFalse,
     FlagMode::kFalse},
    // Any sequence length and head dim, plain or causal attention, split-KV or not: the usual inference
    // and decode case.  Splitting only changes the tile range and the epilogue, so it costs no kernel.
    {"uneven", FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kFalse, FlagMode::kFalse, FlagMode::kFalse,
     FlagMode::kRuntime, FlagMode::kFalse},
    // Local windows, ALiBi and softcap as runtime branches.
    {"general", FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime,
     FlagMode::kRuntime, FlagMode::kFalse},
    // Training: dropout with every other feature as a runtime branch, so one kernel per file admits every
    // flash_attn feature combination with dropout.  The kernels without dropout contain no RNG code.
    {"dropout", FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime,
     FlagMode::kRuntime, FlagMode::kTrue},
};
inline constexpr int kNumVariants = int(sizeof(kVariants) / sizeof(kVariants[0]));

// ---------------------------------------------------------------------------------------------------
// The M x N tile of a head dim, the same for every static variant: the variant is picked from flags that
// depend on the tile (even_mn), and the split heuristic counts K/V tiles before any variant is chosen.
// Shared memory per CTA is (block_m + 2 * block_n) * head_dim * 2 bytes.  Reasoning:
//  - 128 query rows per CTA: each K/V tile loaded into shared memory serves 128 rows, which halves the
//    K/V bytes per query row (L2 -> SM traffic) compared with 64.
//  - block_n trades the S accumulators (and smem) against barriers per K/V byte.
//  - 128 x 128 reached 255 registers and spilled 4 bytes on sm_90 in its runtime-flag variant.
//  - Head dim 256: 128 x 64 spilled 30 bytes in its runtime-flag variant; 32-key tiles halve S and fit 99 KB,
//    so one config serves every sm_8x/sm_90 part.
struct BlockShape {
  int block_m, block_n;
};
constexpr BlockShape sm80_block_shape(int head_dim, SmemBudget /*budget*/ = SmemBudget::kSm80) {
  if (head_dim <= 192) { return {128, 64}; }  // hd 32..192: 8-48 KB of Q + 8-48 KB of K and V
  return {128, 32};                           // hd 256: 64 KB + 32 KB
}

// Warps per CTA, per static variant.  A warp owns kBlockM / num_warps rows, in 16-row MMA slabs.
//  - Shared-memory feed: every warp reads all of K and V from shared memory for each tile (ldmatrix), so
//    per K/V tile a warp moves (its Q rows + 2 N) x d x 2 bytes for its rows x N x d FMA.  4 warps x 32 rows
//    reuse each K/V fragment for two slabs: 10.7 FMA per shared byte at 128 x 64 against 6.4 with 8 warps
//    x 16 rows, which is below what the tensor cores consume (8.0 on sm_80, 10.7 on sm_90;
//    scripts/kernel_report.py's FEED_BAR, docs/kernels.md).
//  - Registers: the accumulators per thread are block_m * (block_n + head_dim) / (32 * num_warps) floats,
//    twice as many with 4 warps.  Measured with nvcc 13.0 (sm_80 and sm_90, bf16, 2026-12-02): 4 warps
//    fit in 255 registers without spills for the "even" and "uneven" variants at hd 32 and 64 (208-255
//    registers) and for "even" at hd 96 (254-255); the others spill with 4 warps (stack bytes: hd 64
//    "general" 32-40, "dropout" 80; hd 96 "uneven" 8 on sm_90; hd 128 every variant, 32-440, and at
//    128 x 32 "general"/"dropout" 8/72), so they keep 8 warps x 16 rows (docs/kernels.md has the table;
//    the 8-warp kernels use up to 255 registers at hd 192/256 -- no headroom there, so a change to the
//    body is re-checked with scripts/compile_all.sh).
//  - At <= 255 registers one CTA of 8 warps fills an SM's 64K registers; a 4-warp CTA leaves room for a
//    second one where shared memory allows (hd <= 96 at 163 KB), so 8 warps per SM overlap MMA, exp2 and
//    cp.async in both cases.
// Build knob FLASH_EXT_GPU_FWD_WARPS=8 (setup.py): every variant on 8 warps x 16 rows, the tiles before the
// rule below, so that a second build can be benchmarked side by side with a default one (gpu_check.sh).
#if defined(FLASH_EXT_GPU_FWD_WARPS)
inline constexpr int kBaselineFwdWarps = FLASH_EXT_GPU_FWD_WARPS;
static_assert(kBaselineFwdWarps == 8, "FLASH_EXT_GPU_FWD_WARPS only selects the 8-warp baseline");
#else
inline constexpr int kBaselineFwdWarps = 0;
#endif

constexpr int sm80_num_warps(int head_dim, Variant v) {
  if (kBaselineFwdWarps != 0) { return kBaselineFwdWarps; }
  bool const lean = v.local == FlagMode::kFalse && v.alibi == FlagMode::kFalse && v.softcap == FlagMode::kFalse &&
                    v.dropout == FlagMode::kFalse;
  bool const fully_static = lean && v.even_mn == FlagMode::kTrue && v.even_k == FlagMode::kTrue &&
                            v.split == FlagMode::kFalse;
  if (head_dim <= 64 && lean) { return 4; }
  if (head_dim <= 96 && fully_static) { return 4; }
  return 8;
}

constexpr TileConfig sm80_tile_config(int head_dim, int variant, SmemBudget budget = SmemBudget::kSm80) {
  BlockShape const b = sm80_block_shape(head_dim, budget);
  return {b.block_m, b.block_n, sm80_num_warps(head_dim, kVariants[variant])};
}

constexpr bool tile_configs_fit() {
  for (int hd : {32, 64, 96, 128, 192, 256}) {
    for (int v = 0; v < kNumVariants; ++v) {
      for (SmemBudget b : {SmemBudget::kSm80, SmemBudget::kSm86}) {
        TileConfig const t = sm80_tile_config(hd, v, b);
        if (tile_smem_bytes(t, hd) > int(b)) { return false; }
        // Each warp owns whole 16-row MMA slabs (Sm80Traits).
        if (t.block_m % (16 * t.num_warps) != 0) { return false; }
      }
    }
  }
  return true;
}
static_assert(tile_configs_fit(), "every tile config fits the shared memory of the archs it is chosen for");

// Head dims with a GPU instantiation, ascending; a problem with head dim d runs the smallest one >= d.
inline constexpr int kGpuHeadDims[] = {32, 64, 96, 128, 192, 256};

constexpr int gpu_head_dim_for(int d) {
  for (int hd : kGpuHeadDims) {
    if (d <= hd) { return hd; }
  }
  return -1;
}

// Calls fn.template operator()<HD>() with HD == hd, one of kGpuHeadDims (the host backend instantiates the
// same head dims); false for any other hd.  From a run-time head dim to a template argument, in one place.
template <class Fn>
bool visit_head_dim(int hd, Fn&& fn) {
  switch (hd) {
    case 32: fn.template operator()<32>(); return true;
    case 64: fn.template operator()<64>(); return true;
    case 96: fn.template operator()<96>(); return true;
    case 128: fn.template operator()<128>(); return true;
    case 192: fn.template operator()<192>(); return true;
    case 256: fn.template operator()<256>(); return true;
    default: return false;
  }
}
static_assert(sizeof(kGpuHeadDims) / sizeof(kGpuHeadDims[0]) == 6, "visit_head_dim names every head dim");

// Pruning rule: a causal file never compiles the local-window branch (the op layer turns "causal plus a
// finite left window" into a local problem, which runs the non-causal file).
constexpr FlagMode local_mode(Variant v, bool causal) { return causal ? FlagMode::kFalse : v.local; }

struct ProblemFlags {
  bool even_mn, even_k, local, alibi, softcap, split, dropout;
};

// The runtime facts the flags stand for, for a tile of block_m x block_n and a head-dim tile.  Varlen
// batches are never "even": each sequence has its own length.
CUTE_HOST_DEVICE constexpr ProblemFlags problem_flags(FwdParams const& p, int block_m, int block_n, int head_dim) {
  bool const varlen = p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.seqused_k != nullptr;
  return {!varlen && p.seqlen_q % block_m == 0 && p.seqlen_k % block_n == 0, p.d == head_dim, p.is_local,
          p.alibi_slopes_ptr != nullptr, p.softcap > 0.f, p.num_splits > 1, p.is_dropout};
}

// The flags as a kernel body sees them: static members keep their constant, runtime members take the
// problem's values (the dispatcher only picks a static combination that agrees with them).
template <class Flags>
CUTE_HOST_DEVICE Flags flags_from_problem(ProblemFlags const& pf, bool causal) {
  Flags f;
  f.even_mn = make_flag<decltype(f.even_mn)>(pf.even_mn);
  f.even_k = make_flag<decltype(f.even_k)>(pf.even_k);
  f.causal = make_flag<decltype(f.causal)>(causal);
  f.local = make_flag<decltype(f.local)>(pf.local);
  f.alibi = make_flag<decltype(f.alibi)>(pf.alibi);
  f.softcap = make_flag<decltype(f.softcap)>(pf.softcap);
  f.split = make_flag<decltype(f.split)>(pf.split);
  f.dropout = make_flag<decltype(f.dropout)>(pf.dropout);
  return f;
}

constexpr bool admits(FlagMode mode, bool value) {
  return mode == FlagMode::kRuntime || (mode == FlagMode::kTrue) == value;
}

constexpr bool variant_admits(Variant v, bool causal, ProblemFlags p) {
  return admits(v.even_mn, p.even_mn) && admits(v.even_k, p.even_k) && admits(local_mode(v, causal), p.local) &&
         admits(v.alibi, p.alibi) && admits(v.softcap, p.softcap) && admits(v.split, p.split) &&
         admits(v.dropout, p.dropout);
}

// The first (most specialised) variant that admits the problem; -1 if none does.
constexpr int select_variant(bool causal, ProblemFlags p) {
  for (int i = 0; i < kNumVariants; ++i) {
    if (variant_admits(kVariants[i], causal, p)) { return i; }
  }
  return -1;
}

static_assert(select_variant(false, {true, true, false, false, false, false, false}) == 0);
static_assert(select_variant(true, {false, true, false, false, false, false, false}) == 1);
static_assert(select_variant(true, {true, true, false, false, false, true, false}) == 1, "split-KV runs the uneven kernel");
static_assert(select_variant(false, {true, true, true, true, true, true, false}) == 2);
static_assert(select_variant(true, {true, true, true, false, false, false, false}) == -1, "causal files have no local branch");
static_assert(select_variant(false, {true, true, false, false, false, false, true}) == 3, "dropout has its own kernel");
static_assert(select_variant(false, {false, false, true, true, true, true, true}) == 3 &&
                  select_variant(true, {false, false, false, true, true, true, true}) == 3,
              "every feature combination has a dropout kernel");

// The static variant a problem runs in the file of head dim tile head_dim (all its variants share one
// M x N tile, so even_mn is known before the variant is).
CUTE_HOST_DEVICE constexpr int select_fwd_variant(FwdParams const& p, int head_dim, bool causal,
                                                  SmemBudget budget = SmemBudget::kSm80) {
  BlockShape const b = sm80_block_shape(head_dim, budget);
  return select_variant(causal, problem_flags(p, b.block_m, b.block_n, head_dim));
}

template <FlagMode M>
using FlagType = std::conditional_t<M == FlagMode::kRuntime, bool, cute::C<M == FlagMode::kTrue>>;

template <int kVariant, bool kCausal>
using VariantFlags = KernelFlags<FlagType<kVariants[kVariant].even_mn>, FlagType<kVariants[kVariant].even_k>,
                                 cute::C<kCausal>, FlagType<local_mode(kVariants[kVariant], kCausal)>,
                                 FlagType<kVariants[kVariant].alibi>, FlagType<kVariants[kVariant].softcap>,
                                 FlagType<kVariants[kVariant].split>, FlagType<kVariants[kVariant].dropout>>;

// ---------------------------------------------------------------------------------------------------
// Split-KV heuristic.  One CTA per (m_block, batch, head) leaves processors idle when there are fewer such
// CTAs than processors (decode: one m_block, few heads).  Splitting the K/V tiles of each among s CTAs
// multiplies the parallelism by s, at the cost of writing and re-reading s fp32 partial outputs and a
// combine pass.  Wave efficiency of s splits is w / ceil(w) with w = ctas * s / processors (the last wave's
// idle share).  The rule: no split when the grid already fills 80% of a wave; otherwise the smallest s
// whose efficiency is within 85% of the best one, among s that leave every split at least
// min_blocks_per_split K/V tiles (so the partials' traffic stays small next to the K/V bytes each reads)
// and that give distinct tile counts per split (ceil(n_blocks / s) must drop when s grows).
constexpr int num_splits_heuristic(int ctas, int processors, int n_blocks, int max_splits = 128,
                                   int min_blocks_per_split = 2) {
  if (ctas <= 0 || processors <= 0 || n_blocks <= 0) { return 1; }
  if (ctas * 10 >= processors * 8) { return 1; }
  int const limit = cute::min(cute::min(max_splits, processors), n_blocks / min_blocks_per_split);
  if (limit < 2) { return 1; }
  auto efficiency = [&](int s) {
    float const waves = float(ctas * s) / float(processors);
    float const full = float(int(waves) + (waves > float(int(waves)) ? 1 : 0));
    return waves / full;
  };
  auto eligible = [&](int s) { return s == 1 || ceil_div(n_blocks, s) != ceil_div(n_blocks, s - 1); };
  float best = 0.f;
  for (int s = 1; s <= limit; ++s) {
    if (eligible(s)) { best = cute::max(best, efficiency(s)); }
  }
  for (int s = 1; s <= limit; ++s) {
    if (eligible(s) && efficiency(s) >= 0.85f * best) { return s; }
  }
  return 1;
}

static_assert(num_splits_heuristic(132 * 4, 132, 1000) == 1, "a full grid is not split");
static_assert(num_splits_heuristic(8, 132, 2) == 1, "too few K/V tiles to split");
static_assert(num_splits_heuristic(1, 132, 1000) > 1, "a lone CTA with a long K/V is split");

}  // namespace flash_ext
