// Which specialisations exist and which one a problem runs.  Everything here is constexpr data and
// constexpr functions, so the rules can be read, unit-tested on the host, and reported by explain().
#pragma once

#include <string_view>
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
  // Only for problems of at most kDecodeRows query rows per sequence: the variant runs the decode tile.
  bool few_rows = false;
};

// Query rows per sequence (after the decode group swap, csrc/ops/common.h) up to which a problem runs the
// decode tile: one warp's 16-row MMA slab.
inline constexpr int kDecodeRows = 16;

inline constexpr Variant kVariants[] = {
    // Tile-multiple sequence lengths, head dim equal to the tile's, no extras: no predicate anywhere.
    {"even", FlagMode::kTrue, FlagMode::kTrue, FlagMode::kFalse, FlagMode::kFalse, FlagMode::kFalse, FlagMode::kFalse,
     FlagMode::kFalse},
    // Decode and short query chunks (<= kDecodeRows rows, e.g. one token with its query heads as rows):
    // every feature but dropout as a runtime branch, on the decode tile (sm80_tile_config).  Its loop is
    // bound by HBM reads of K and V, so the branches are free and one kernel per file covers sliding
    // windows, ALiBi and softcap decode too.
    {"decode", FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime, FlagMode::kRuntime,
     FlagMode::kRuntime, FlagMode::kFalse, /*few_rows=*/true},
    // Any sequence length and head dim, plain or causal attention, split-KV or not: the usual inference
    // case.  Splitting only changes the tile range and the epilogue, so it costs no kernel.
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
// The M x N tile of a head dim, shared by every static variant that fixes even_mn (the variant is picked
// from flags that depend on the tile: even_mn) and used by the split heuristic to count K/V tiles before
// any variant is chosen.  Variants with a runtime even_mn may run their own tile (sm80_tile_config: the
// decode tile, head dim 192's dropout kernel), since their kernels derive the flag from their own tile.
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

// Warps per CTA and keys per tile, per static variant.  A warp owns kBlockM / num_warps rows, in 16-row MMA
// slabs.
//  - Shared-memory feed: every warp reads all of K and V from shared memory for each tile (ldmatrix), and
//    its Q rows too, so per K/V tile a warp moves (its rows + 2 N) x d x 2 bytes for its rows x N x d x 2
//    FMA, plus its share of the cp.async writes; the ratio does not depend on d.  With 128 rows:
//        8 warps x 16 rows, N = 64:  6.4 FMA per shared byte
//        4 warps x 32 rows, N = 32:  9.1
//        4 warps x 32 rows, N = 64: 10.7
//    against what the tensor cores consume at the mma.sync rate: 8.0 on sm_80, 10.7 on sm_90
//    (scripts/kernel_report.py's FEED_BAR, docs/kernels.md).  Two slabs per warp reuse each K/V fragment
//    twice; halving N halves the S accumulators (the register cost of the second slab) at a smaller loss.
//  - Registers: the accumulators per thread are rows_per_warp x (N + d) / 32 floats.  What fits in 255
//    registers without spills, measured with nvcc 13.0 (sm_80 and sm_90, fp16 and bf16, causal or not;
//    stack bytes of the first config that spilled in brackets):
//        hd <= 64: even, uneven 4 x 32 rows, N 64;  general, dropout 4 x 32, N 32 (N 64: 8-120 B)
//        hd 96:    even 4 x 32, N 64 (uneven at N 64: 8 B on sm_90);  uneven, general 4 x 32, N 32;
//                  dropout 8 x 16, N 64 (4 x 32, N 32: 32-88 B)
//        hd 128:   even 4 x 32, N 64 where the budget is sm_80's (255 registers, 0 B; non-causal
//                  re-measured at 27635bb, after the walked K/V partitions and the lagging reference of
//                  #14 had freed registers: N 64 had spilled 32-440 B on 2026-12-03; causal with the mask
//                  relative to a thread's first score and the walked masked-tile bounds of mask.h and
//                  block_info.h, 84-104 B before them);  uneven 4 x 32, N 32 (N 64: 12-82 B);  general
//                  without causal 4 x 32, N 32 (0 B on both archs, re-measured at dc826a3; 8 B on
//                  2026-12-03);  general with causal and dropout 8 x 16, N 64 (4 x 32, N 32: causal
//                  general 28 B on sm_80 at dc826a3, 0 B on sm_80 and 24 B on sm_90 at 023c62d; dropout
//                  40-136 B)
//        hd 192, 256: 8 x 16 (8 warps already use 235-255 registers)
//    The 4-warp kernels run at 220-255 registers, so a change to the body is re-checked with
//    scripts/compile_all.sh.  FA2 runs hd 128 on 4 warps too: 128 x 64 on sm_80/sm_90, 128 x 32 without
//    causal on sm_86/sm_89.
//  - hd 128's 128 x 64 even tile takes 64 KB of shared memory: one CTA of 4 warps per SM on sm_86/sm_89
//    (99 KB), where 128 x 32 (48 KB) keeps two.  So that tile depends on the budget, and an hd-128 file
//    compiles its even kernel twice (kBudgetMatters, traits_sm80.h); its other variants are the same
//    kernels under either budget.
//  - At <= 255 registers one CTA of 8 warps fills an SM's 64K registers; a 4-warp CTA leaves room for a
//    second one (shared memory allows it at every head dim <= 128), so 8 warps per SM overlap MMA, exp2
//    and cp.async in both cases.
//  - A static-even variant may take fewer keys than the shared shape when they divide it: "even at 128 x 64"
//    (select_fwd_variant) implies "even at 128 x 32".
// Build knob FLASH_EXT_GPU_FWD_WARPS=8 (setup.py): every variant on 8 warps x 16 rows of the 128 x 64 tile,
// decode included (the tiles before the rules below), so that a second build can be benchmarked side by side
// with a default one (gpu_check.sh).
#if defined(FLASH_EXT_GPU_FWD_WARPS)
inline constexpr int kBaselineFwdWarps = FLASH_EXT_GPU_FWD_WARPS;
static_assert(kBaselineFwdWarps == 8, "FLASH_EXT_GPU_FWD_WARPS only selects the 8-warp baseline");
#else
inline constexpr int kBaselineFwdWarps = 0;
#endif

// Keys per tile of the 4-warp x 32-row config of a variant (the table above), or 0 where it keeps 8 warps.
constexpr int sm80_four_warp_block_n(int head_dim, Variant v, bool causal, SmemBudget budget) {
  bool const lean = v.local == FlagMode::kFalse && v.alibi == FlagMode::kFalse && v.softcap == FlagMode::kFalse &&
                    v.dropout == FlagMode::kFalse;
  bool const fully_static = lean && v.even_mn == FlagMode::kTrue && v.even_k == FlagMode::kTrue &&
                            v.split == FlagMode::kFalse;
  bool const dropout = v.dropout != FlagMode::kFalse;
  if (head_dim <= 64) { return lean ? 64 : 32; }
  if (head_dim <= 96) { return fully_static ? 64 : dropout ? 0 : 32; }
  if (head_dim <= 128) {
    if (!lean) { return !dropout && !causal ? 32 : 0; }
    return fully_static && budget == SmemBudget::kSm80 ? 64 : 32;
  }
  return 0;
}

// The decode tile (variants with few_rows): one warp, kDecodeRows x block_n.  A decode step reads every K/V
// byte once and does ~rows x 4 FLOPs per byte with it, so HBM bounds it; what the 128-row tile adds is
// ldmatrix and MMA work for rows that do not exist: its 8 warps each re-read all of K and V from shared
// memory, 8x the shared-memory traffic of one warp, which the roofline puts above the HBM time
// (docs/perf.md, "Decode").  One warp per CTA hides HBM latency with several CTAs per SM (36 KB of shared
// memory each at hd 128: 4 on sm_80) and with the split heuristic counting those slots (sm80_ctas_per_sm).
// Head dim 256 takes 2 warps x 16 rows x 16 keys instead: with one warp the K/V copy gives each thread 4-8
// rows of a tile to address, and the kernel spilled (nvcc 13.0, sm_80: 20 B at 16 x 32, 4 B at 16 x 16,
// 4 B at 2 warps x 32 keys; 219-223 registers and 0 B at 2 warps x 16 keys on sm_80 and sm_90).
//
// The head-dim-192 `dropout` kernel takes 32-key tiles: at 64 it spilled (24 B on sm_80, 40-48 B on sm_90,
// nvcc 13.0: six loop-invariant words reloaded per tile) with 255 registers; 32 keys halve the S
// accumulator and compile without spills on both archs.  A runtime-even variant may have its own N: its
// kernel derives even_mn and its split share from its own tile (kernel_fwd.h), and the split heuristic's
// count of 64-key tiles only sizes the split.
constexpr TileConfig sm80_tile_config(int head_dim, int variant, bool causal, SmemBudget budget = SmemBudget::kSm80) {
  BlockShape const b = sm80_block_shape(head_dim, budget);
  Variant const v = kVariants[variant];
  if (kBaselineFwdWarps != 0) { return {b.block_m, b.block_n, kBaselineFwdWarps}; }
  if (v.few_rows) { return head_dim == 256 ? TileConfig{2 * kDecodeRows, 16, 2} : TileConfig{kDecodeRows, b.block_n, 1}; }
  if (int const n4 = sm80_four_warp_block_n(head_dim, v, causal, budget); n4 != 0) { return {b.block_m, n4, 4}; }
  if (head_dim == 192 && v.dropout == FlagMode::kTrue) { return {b.block_m, 32, 8}; }
  return {b.block_m, b.block_n, 8};
}

// Resident CTAs per SM for a tile, for the split heuristic's count of processors: shared memory (the budget
// stands for the SM's), registers (the kernels are compiled for one CTA per SM, up to 255 registers per
// thread: 256 x threads allocated) and the 16 CTAs per SM of sm_86/sm_89 (sm_80 and sm_90 allow 32).
constexpr int sm80_ctas_per_sm(TileConfig t, int head_dim, SmemBudget budget = SmemBudget::kSm80) {
  int const by_smem = int(budget) / tile_smem_bytes(t, head_dim);
  int const by_regs = 65536 / (256 * 32 * t.num_warps);
  return cute::max(1, cute::min(cute::min(by_smem, by_regs), 16));
}
static_assert(sm80_ctas_per_sm({128, 64, 8}, 128) == 1 && sm80_ctas_per_sm({128, 64, 4}, 64) == 2 &&
              sm80_ctas_per_sm({16, 64, 1}, 128) == 4 && sm80_ctas_per_sm({16, 64, 1}, 128, SmemBudget::kSm86) == 2);

constexpr bool tile_configs_fit() {
  for (int hd : {32, 64, 96, 128, 192, 256}) {
    for (int v = 0; v < kNumVariants; ++v) {
      for (SmemBudget b : {SmemBudget::kSm80, SmemBudget::kSm86}) {
        for (bool causal : {false, true}) {
          TileConfig const t = sm80_tile_config(hd, v, causal, b);
          if (tile_smem_bytes(t, hd) > int(b)) { return false; }
          // Each warp owns whole 16-row MMA slabs (Sm80Traits).
          if (t.block_m % (16 * t.num_warps) != 0) { return false; }
          // Variants that test even_mn statically use the shared shape's rows and a divisor of its keys
          // (select_fwd_variant computes the flag on the shared shape).
          BlockShape const shape = sm80_block_shape(hd, b);
          if (kVariants[v].even_mn != FlagMode::kRuntime &&
              (t.block_m != shape.block_m || shape.block_n % t.block_n != 0)) {
            return false;
          }
        }
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
  bool few_rows = false;  // at most kDecodeRows query rows per sequence (not a kernel flag: picks the tile)
};

// The runtime facts the flags stand for, for a tile of block_m x block_n and a head-dim tile.  Varlen
// batches are never "even": each sequence has its own length (seqlen_q is then the longest one's).
CUTE_HOST_DEVICE constexpr ProblemFlags problem_flags(FwdParams const& p, int block_m, int block_n, int head_dim) {
  bool const varlen = p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.seqused_k != nullptr;
  return {!varlen && p.seqlen_q % block_m == 0 && p.seqlen_k % block_n == 0, p.d == head_dim, p.is_local,
          p.alibi_slopes_ptr != nullptr, p.softcap > 0.f, p.num_splits > 1, p.is_dropout,
          p.seqlen_q <= kDecodeRows};
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
         admits(v.dropout, p.dropout) && (!v.few_rows || p.few_rows);
}

// The first (most specialised) variant that admits the problem; -1 if none does.
constexpr int select_variant(bool causal, ProblemFlags p) {
  for (int i = 0; i < kNumVariants; ++i) {
    if (variant_admits(kVariants[i], causal, p)) { return i; }
  }
  return -1;
}

// The index of the variant called `name` (for the rules below and tests), -1 if none.
constexpr int variant_named(std::string_view name) {
  for (int i = 0; i < kNumVariants; ++i) {
    if (name == kVariants[i].name) { return i; }
  }
  return -1;
}

// ProblemFlags: {even_mn, even_k, local, alibi, softcap, split, dropout, few_rows}.
static_assert(select_variant(false, {true, true, false, false, false, false, false}) == variant_named("even"));
static_assert(select_variant(true, {false, true, false, false, false, false, false}) == variant_named("uneven"));
static_assert(select_variant(true, {true, true, false, false, false, true, false}) == variant_named("uneven"),
              "split-KV runs the uneven kernel");
static_assert(select_variant(false, {true, true, true, true, true, true, false}) == variant_named("general"));
static_assert(select_variant(true, {true, true, true, false, false, false, false}) == -1, "causal files have no local branch");
static_assert(select_variant(false, {true, true, false, false, false, false, true}) == variant_named("dropout"),
              "dropout has its own kernel");
static_assert(select_variant(false, {false, false, true, true, true, true, true}) == variant_named("dropout") &&
                  select_variant(true, {false, false, false, true, true, true, true}) == variant_named("dropout"),
              "every feature combination has a dropout kernel");
static_assert(select_variant(false, {false, true, false, false, false, true, false, true}) == variant_named("decode") &&
                  select_variant(true, {false, false, false, true, true, false, false, true}) == variant_named("decode") &&
                  select_variant(false, {false, true, true, true, true, true, false, true}) == variant_named("decode"),
              "every few-rows problem without dropout runs the decode tile");
static_assert(select_variant(false, {false, true, false, false, false, false, true, true}) == variant_named("dropout"),
              "dropout with few rows keeps the dropout kernel");

// The static variant a problem runs in the file of head dim tile head_dim (even_mn is computed on the M x N
// tile the variants that test it share, so it is known before the variant is).
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
