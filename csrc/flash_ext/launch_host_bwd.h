// The CPU backend of the backward pass: preprocess (D, zeroed dQ accumulators), the backward kernel body with
// HostBwdTraits, and the dQ postprocess, each spread over CPU threads by a caller-supplied parallel-for
// (at::parallel_for in the extension, a plain loop in the C++ tests).
//
// Determinism: the gradients are bitwise identical for every run and every thread count.  Each work item is
// one (split, batch, K/V head): it owns the K/V tiles n = split, split + splits, ... of that head in
// increasing order, dK/dV of those tiles, and dQ accumulator slice `split`, which nobody else writes; the
// postprocess sums the slices in slice order.  The split count depends only on the problem's shape
// (host_bwd_splits), never on the thread count, so the order of every floating-point sum is fixed.
#pragma once

#include <cstdint>

#include "block_info.h"
#include "bwd_postprocess.h"
#include "bwd_preprocess.h"
#include "kernel_bwd.h"
#include "launch_host.h"
#include "params.h"
#include "traits_host_bwd.h"

namespace flash_ext {

// Host backward tiles: 64 query rows x 128 keys.  Per (query tile, K/V tile) step the body runs five
// whole-tile GEMMs (micro-kernel calls) and stores P and dS to their tiles; acc_dk + acc_dv (2 x 128 x d fp32)
// and the tiles stay in L2.  The key extent sets the traffic: each CTA walks every query tile of its head,
// reading Q and dO and adding into the fp32 dQ rows (12 bytes x d per query row), once per K/V tile, so 128
// keys halve what 64 moved; on the AMX Xeon that traffic was what the copies' prefetches stalled on (a bf16
// training step 12-15% faster than with 64 keys; 256 keys, or 128 query rows, no faster: docs/perf.md).
inline constexpr int kHostBwdBlockM = 64;
inline constexpr int kHostBwdBlockN = 128;

// Work items per problem the split count aims for: enough to keep a many-core CPU busy (and to balance causal
// problems, where K/V tiles near the end see fewer query tiles; splits take strided tiles for that reason),
// at the price of one fp32 dQ slice (h x rows x d x 4 bytes) per split.  A shape-only rule: see above.
inline constexpr int kHostBwdTargetItems = 32;

constexpr int host_bwd_splits(int batch, int heads_k, int n_blocks) {
  int const groups = batch * heads_k;
  if (groups <= 0 || n_blocks <= 0) { return 1; }
  int const want = ceil_div(kHostBwdTargetItems, groups);
  return want < 1 ? 1 : (want > n_blocks ? n_blocks : want);
}

static_assert(host_bwd_splits(4, 8, 16) == 1, "32 heads keep 32 items busy without splitting");
static_assert(host_bwd_splits(1, 8, 32) == 4);
static_assert(host_bwd_splits(1, 1, 3) == 3, "never more splits than K/V tiles");

template <class Traits, class ParallelFor>
void run_bwd_host_traits(BwdParams const& params, HostKernels const& kernels, ParallelFor&& parallel_for) {
  using Element = typename Traits::Element;
  DynamicFlags const flags = bwd_flags_from_params<Traits, DynamicFlags>(params);
  int64_t const rows = int64_t(params.b) * params.h * params.seqlen_q;
  auto for_each_row = [&](auto&& fn) {
    parallel_for(int64_t(0), rows, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        int const row = int(i % params.seqlen_q);
        int const bidh = int((i / params.seqlen_q) % params.h);
        int const bidb = int(i / (int64_t(params.seqlen_q) * params.h));
        BlockInfo const binfo(params, bidb);
        if (row < binfo.seqlen_q) { fn(binfo, bidb, bidh, row); }
      }
    });
  };

  for_each_row([&](BlockInfo const& binfo, int bidb, int bidh, int row) {
    preprocess_row<Element>(params, binfo, bidb, bidh, row);
  });

  int const n_blocks = ceil_div(params.seqlen_k, Traits::kBlockN);
  int const splits = params.dq_accum_splits;
  int64_t const items = int64_t(splits) * params.b * params.h_k;
  parallel_for(int64_t(0), items, [&](int64_t begin, int64_t end) {
    HostCtaScope scope(kernels);
    // Every row of every tile is computed: the tiles' rows are query rows (S, dP, dQ) as well as key rows
    // (dK, dV), and rows past either sequence end are zero-filled inputs whose results are never stored.
    scope.set_live_rows(1 << 30);
    alignas(128) char smem[Traits::kSmemBytes];  // the "shared memory" of one CTA
    for (int64_t i = begin; i < end; ++i) {
      int const split = int(i % splits);
      int const bidh_kv = int((i / splits) % params.h_k);
      int const bidb = int(i / (int64_t(splits) * params.h_k));
      for (int n_block = split; n_block < n_blocks; n_block += splits) {
        compute_dq_dk_dv_1colblock<Traits>(params, flags, bidb, bidh_kv, n_block, /*dq_slice=*/split, /*tidx=*/0, smem);
      }
    }
  });

  // postprocess_dq_row's sums, rounded to Element a row at a time by the level's conversion (element by
  // element, the conversion was ~4% of a bf16 training step's samples; docs/perf.md).
  for_each_row([&](BlockInfo const& binfo, int bidb, int bidh, int row) {
    float const* const acc = dq_accum_row(params, binfo, bidb, bidh, row);
    float sums[Traits::kHeadDim];
    for (int c = 0; c < params.d; ++c) { sums[c] = dq_scaled_sum(params, acc, c); }
    kernels.convert(sums, dq_row<Element>(params, binfo, bidb, bidh, row), host_dtype<Element>(), params.d);
  });
}

template <int kHeadDim, class Element, class ParallelFor>
void run_bwd_host_head_dim(BwdParams const& params, HostKernels const& kernels, ParallelFor&& parallel_for) {
  if constexpr (host_head_dim_compiled(kHeadDim)) {
    run_bwd_host_traits<HostBwdTraits<kHeadDim, kHostBwdBlockM, kHostBwdBlockN, Element>>(params, kernels, parallel_for);
  }
}

// Precondition (the op layer's): params.dq_accum_splits slices allocated (bwd_cpu_dq_splits: host_bwd_splits
// capped by the accumulator budget, cap_dq_slices); any count >= 1 is correct.  `kernels`: the micro-kernels to
// use; nullptr: those of the selected level.
template <class Element, class ParallelFor>
void run_bwd_host(BwdParams const& params, ParallelFor&& parallel_for, HostKernels const* kernels = nullptr) {
  HostKernels const& k = kernels != nullptr ? *kernels : *host_kernels_for(host_isa_selected());
  // The op layer rejects head dims without a compiled host kernel before this point.
  visit_head_dim(host_head_dim_for(params.d),
                 [&]<int HD>() { run_bwd_host_head_dim<HD, Element>(params, k, parallel_for); });
}

}  // namespace flash_ext
