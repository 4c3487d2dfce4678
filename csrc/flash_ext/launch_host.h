// The CPU backend: the kernel body instantiated with HostTraits, one call per (m_block, batch, head),
// spread over CPU threads by a caller-supplied parallel-for (at::parallel_for in the extension, a plain
// loop in the C++ tests).  Every flag is a runtime bool here: two tile heights per (dtype, head dim).  The
// micro-kernels of one instruction-set level (host_isa.h) serve the whole call.
#pragma once

#include <cstdint>

#include "block_info.h"
#include "combine.h"
#include "host_isa.h"
#include "kernel_fwd.h"
#include "params.h"
#include "traits_host.h"

namespace flash_ext {

// Host tiles: 128 query rows amortise each K/V tile's copy into operand fragments (measured 37 -> 46 GF/s
// per core at d=64 vs 64 rows).  Everything a "CTA" touches (~100-400 KB) stays in L2.  A problem of at
// most 16 query rows (decode: one token, or the query heads of one K/V group run as rows) gets a 16-row
// tile instead: in a 128-row tile it would pay for 112 empty rows in every Q.K^T and P.V.
inline constexpr int kHostBlockM = 128;
inline constexpr int kHostBlockMShort = 16;
// Key columns per tile, by element type.  O lives in memory on the host and P.V reads and writes it once
// per K/V tile, so a deeper P.V pays where the GEMM itself is fast: bf16 (vdpbf16ps, AMX tiles) measured
// 5-10% faster with 128 than with 64; fp32 measured 3-7% slower (its S tile doubles to 64 KiB) and fp16
// even (Intel Xeon with AMX, 2026-12-02, docs/perf.md).  Per element type, so no extra instantiation.
constexpr int host_block_n(bool bf16) { return bf16 ? 128 : 64; }
template <class Element>
inline constexpr int kHostBlockN = host_block_n(std::is_same_v<Element, cutlass::bfloat16_t>);

constexpr int host_block_m(int seqlen_q) { return seqlen_q <= kHostBlockMShort ? kHostBlockMShort : kHostBlockM; }

// Head dims the host backend knows, ascending.  A build compiles the subset in FLASH_EXT_HOST_HEADDIMS_MASK
// (bit i: kHostHeadDims[i]; setup.py's FLASH_EXT_HOST_HEADDIMS, default all): each head dim is two kernel
// bodies per dtype, and the host translation units dominate a CPU-only build.  A problem with head dim d
// runs the smallest compiled kHeadDim >= d; -1 when none is compiled (the op layer refuses the call).
inline constexpr int kHostHeadDims[] = {32, 64, 96, 128, 192, 256};
inline constexpr int kNumHostHeadDims = int(sizeof(kHostHeadDims) / sizeof(kHostHeadDims[0]));
#ifndef FLASH_EXT_HOST_HEADDIMS_MASK
#define FLASH_EXT_HOST_HEADDIMS_MASK 0x3f
#endif

constexpr bool host_head_dim_compiled(int hd) {
  for (int i = 0; i < kNumHostHeadDims; ++i) {
    if (kHostHeadDims[i] == hd) { return ((FLASH_EXT_HOST_HEADDIMS_MASK) >> i) & 1; }
  }
  return false;
}

constexpr int host_head_dim_for(int d) {
  for (int hd : kHostHeadDims) {
    if (d <= hd && host_head_dim_compiled(hd)) { return hd; }
  }
  return -1;
}

// Installs a call's micro-kernels as this worker thread's context (host_isa.h) for the scope of one
// parallel-for chunk, and restores what was there (a nested or earlier call's).
class HostCtaScope {
 public:
  explicit HostCtaScope(HostKernels const& kernels) : ctx_(host_cta_context()), saved_(ctx_) {
    ctx_.kernels = &kernels;
  }
  ~HostCtaScope() { ctx_ = saved_; }
  HostCtaScope(HostCtaScope const&) = delete;
  HostCtaScope& operator=(HostCtaScope const&) = delete;
  void set_live_rows(int rows) { ctx_.live_rows = rows; }

 private:
  HostCtaContext& ctx_;
  HostCtaContext const saved_;
};

template <class Traits, class ParallelFor>
void run_fwd_host_traits(FwdParams const& params, HostKernels const& kernels, ParallelFor&& parallel_for) {
  int const num_m_blocks = ceil_div(params.seqlen_q, Traits::kBlockM);
  int const num_splits = params.num_splits;
  int64_t const total = int64_t(num_m_blocks) * num_splits * params.b * params.h;
  DynamicFlags const flags = flags_from_params<Traits, DynamicFlags>(params);
  parallel_for(int64_t(0), total, [&](int64_t begin, int64_t end) {
    HostCtaScope scope(kernels);
    // The "shared memory" of one CTA; m_block varies fastest so neighbouring work items reuse K/V in cache.
    alignas(128) char smem[Traits::kSmemBytes];
    for (int64_t i = begin; i < end; ++i) {
      int const m_block = int(i % num_m_blocks);
      int64_t rest = i / num_m_blocks;
      int const n_split = int(rest % num_splits);
      rest /= num_splits;
      int const bidh = int(rest % params.h);
      int const bidb = int(rest / params.h);
      // Query rows of this tile that exist (the last tile of a sequence, a decode step's 1-16 rows).
      scope.set_live_rows(BlockInfo(params, bidb).seqlen_q - m_block * Traits::kBlockM);
      compute_attn_1rowblock<Traits>(params, flags, bidb, bidh, m_block, /*tidx=*/0, smem, n_split);
    }
  });
  if (num_splits > 1) {  // the "combine kernel": one work item per (batch, head, query row)
    int64_t const rows = int64_t(params.b) * params.h * params.seqlen_q;
    parallel_for(int64_t(0), rows, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        int const row = int(i % params.seqlen_q);
        int const bidh = int((i / params.seqlen_q) % params.h);
        int const bidb = int(i / (int64_t(params.seqlen_q) * params.h));
        BlockInfo const binfo(params, bidb);
        if (row < binfo.seqlen_q) {
          combine_row<typename Traits::Element>(params, binfo, bidb, bidh, row, 0, params.d);
        }
      }
    });
  }
}

template <int kHeadDim, class Element, class ParallelFor>
void run_fwd_host_head_dim(FwdParams const& params, HostKernels const& kernels, ParallelFor&& parallel_for) {
  if constexpr (!host_head_dim_compiled(kHeadDim)) {
    return;  // not in this build: host_head_dim_for never selects it
  } else if (host_block_m(params.seqlen_q) == kHostBlockMShort) {
    using Traits = HostTraits<kHeadDim, kHostBlockMShort, kHostBlockN<Element>, Element>;
    run_fwd_host_traits<Traits>(params, kernels, parallel_for);
  } else {
    using Traits = HostTraits<kHeadDim, kHostBlockM, kHostBlockN<Element>, Element>;
    run_fwd_host_traits<Traits>(params, kernels, parallel_for);
  }
}

// `kernels`: the micro-kernels to use; nullptr: those of the selected level (host_isa_selected()).
template <class Element, class ParallelFor>
void run_fwd_host(FwdParams const& params, ParallelFor&& parallel_for, HostKernels const* kernels = nullptr) {
  HostKernels const& k = kernels != nullptr ? *kernels : *host_kernels_for(host_isa_selected());
  // The op layer rejects head dims without a compiled host kernel before this point.
  visit_head_dim(host_head_dim_for(params.d),
                 [&]<int HD>() { run_fwd_host_head_dim<HD, Element>(params, k, parallel_for); });
}

}  // namespace flash_ext
