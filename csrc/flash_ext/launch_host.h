// The CPU backend: the kernel body instantiated with HostTraits, one call per (m_block, batch, head),
// spread over CPU threads by a caller-supplied parallel-for (at::parallel_for in the extension, a plain
// loop in the C++ tests).  Every flag is a runtime bool here: two tile heights per (dtype, head dim).  The
// micro-kernels of one instruction-set level (host_isa.h) serve the whole call.
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "block_info.h"
#include "combine.h"
#include "host_isa.h"
#include "kernel_fwd.h"
#include "params.h"
#include "traits_host.h"

namespace flash_ext {

// One online-softmax algorithm: the host's vector step lags its references by the GPU body's slack.
static_assert(kHostSoftmaxSlack == kSoftmaxSlack);

// Host tiles: 128 query rows amortise each K/V tile's copy into operand fragments (measured 37 -> 46 GF/s
// per core at d=64 vs 64 rows).  Everything a "CTA" touches (~100-400 KB) stays in L2.  A problem of at
// most 16 query rows (decode: one token, or the query heads of one K/V group run as rows) gets a 16-row
// tile instead: in a 128-row tile it would pay for 112 empty rows in every Q.K^T and P.V.
inline constexpr int kHostBlockM = 128;
inline constexpr int kHostBlockMShort = 16;
// Key columns per tile, by element type.  O lives in memory on the host and P.V reads and writes it once
// per K/V tile, so a deeper P.V pays where the GEMM itself is fast: bf16 (vdpbf16ps, AMX tiles) measured
// 5-10% faster with 128 than with 64; fp32 measured 3-7% slower (its S tile doubles to 64 KiB) and fp16
// even (Intel Xeon with AMX, 2026-12-02, docs/perf.md), then, split on the AMX tiles, 4-13% slower
// (2026-12-05: its packed K tile, hi and lo, would double to 64 KiB at d = 128).  Per element type, so no
// extra instantiation.
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

// --- Decode: a split's K/V rows warmed into L2 before its heads run ---
//
// A decode tile (at most 16 query rows) does little arithmetic per byte of K/V, so a step runs at the speed
// K and V arrive from memory.  A KV cache keeps the heads of one key side by side ((b, s, h_k, d)), and one
// head's work item reads d of every h_k * d elements, tile by tile from the right: one Zen 4 core streams
// that pattern at ~8 GB/s, a front-to-back read of the same rows at ~25 (docs/perf.md).  So decode work items
// run the heads of one (batch, split) back to back on one thread, and the first of them reads the split's
// rows of all those heads once, front to back, one load per cache line (warm_decode_split); the bodies then
// read their whole K/V tiles there, in place rather than staged (HostTraits::read_in_place).  The splits are
// sized so that those rows fit in half of L2 (host_decode_splits).  The warming pass computes nothing while it
// waits; prefetching the next split's lines from inside this split's GEMM loops instead was measured no faster
// (Zen 4: the prefetches cost the step what the pass did; docs/perf.md, "a Zen 4 again").

// Bytes of one key over K/V heads [kv_first, kv_last] of K and V together, as the warming reads them (from
// the first head's first element to the last head's d-th, per tensor); 0 when those heads do not lie side by
// side (fewer than half of the bytes spanned are theirs, e.g. a (b, h_k, s, d) layout, whose head rows are one
// stream each already): warming would read what no work item needs.
// Elements from head kv_first's first element to head kv_last's d-th, in one key's row of K or V.
inline int64_t host_warm_span(index_t head_stride, int kv_first, int kv_last, int d) {
  return int64_t(kv_last - kv_first) * head_stride + d;
}

inline int64_t host_warm_row_bytes(FwdParams const& p, int kv_first, int kv_last, int element_size) {
  int64_t const heads = kv_last - kv_first + 1;
  auto span = [&](index_t head_stride) -> int64_t {
    int64_t const elems = host_warm_span(head_stride, kv_first, kv_last, p.d);
    return 2 * heads * p.d >= elems ? elems : -1;
  };
  int64_t const k = span(p.k_head_stride), v = span(p.v_head_stride);
  return k > 0 && v > 0 ? (k + v) * element_size : 0;
}

// Splits of a decode problem's seqlen_k keys such that one split's rows of every K/V head (row_bytes per key)
// fit in `budget` bytes: whole tiles of block_n keys, at least one per split, at most max_splits splits.
constexpr int host_decode_splits(int seqlen_k, int block_n, int64_t row_bytes, int64_t budget, int max_splits) {
  if (seqlen_k <= 0 || row_bytes <= 0) { return 1; }
  int64_t const tile_bytes = row_bytes * block_n;
  int64_t const tiles_per_split = tile_bytes >= budget ? 1 : budget / tile_bytes;
  int64_t const splits = (ceil_div(seqlen_k, block_n) + tiles_per_split - 1) / tiles_per_split;
  return int(splits < 1 ? 1 : splits > max_splits ? max_splits : splits);
}
// 32768 keys of 2 bf16 heads of 128 (K and V: 1 KiB per key) in 512 KiB: 4 tiles of 128 keys per split.
static_assert(host_decode_splits(32768, 128, 1024, 512 << 10, 128) == 64);
static_assert(host_decode_splits(32768, 128, 1024, 512 << 10, 32) == 32, "capped");
static_assert(host_decode_splits(300, 128, 1024, 512 << 10, 128) == 1, "3 tiles fit in one split");
static_assert(host_decode_splits(1024, 128, 8192, 512 << 10, 128) == 8, "a tile larger than the budget: one per split");

// Byte ranges of K and V, in the order they are read.
struct HostWarmRange {
  char const* first;
  int64_t bytes;
};

// Streams the warming reads in at once: a core's L1 misses of one front-to-back stream measured ~12 GB/s on an
// AMX Xeon, four streams interleaved ~15 (two cores at once: 12 and 15 each; docs/perf.md), as the hardware
// prefetchers then run ahead in four places.
constexpr int kWarmStreams = 4;

// Calls touch(p) for an address p in every 64-byte line of ranges[0, count) (total bytes), and for no address
// outside them.  The bytes are cut into kWarmStreams shares, one per cursor, and the cursors advance together,
// a line each per step, so that kWarmStreams front-to-back streams are in flight.  Consecutive addresses of a
// cursor lie at most 64 bytes apart, and each range's first and last bytes are among them, so no line is
// skipped whatever the ranges' alignment.
template <class Touch>
void for_each_warm_line(HostWarmRange const* ranges, int count, int64_t total, Touch&& touch) {
  struct Cursor {
    int range;
    int64_t offset;  // within ranges[range]
    int64_t left;    // bytes of this cursor's share still to read
  };
  Cursor cur[kWarmStreams];
  int64_t const share = (total / kWarmStreams + 63) / 64 * 64;
  int r = 0;
  int64_t base = 0;  // bytes before ranges[r]
  for (int s = 0; s < kWarmStreams; ++s) {
    int64_t const start = s * share;
    while (r < count && base + ranges[r].bytes <= start) { base += ranges[r++].bytes; }
    cur[s] = r < count ? Cursor{r, start - base, cute::min(share, total - start)} : Cursor{count, 0, 0};
  }
  for (;;) {
    int64_t step = INT64_MAX;
    for (Cursor const& c : cur) {
      if (c.left > 0) { step = cute::min(step, cute::min(c.left, ranges[c.range].bytes - c.offset)); }
    }
    if (step == INT64_MAX) { return; }
    char const* p[kWarmStreams];
    for (int s = 0; s < kWarmStreams; ++s) { p[s] = cur[s].left > 0 ? ranges[cur[s].range].first + cur[s].offset : nullptr; }
    for (int64_t i = 0; i < step; i += 64) {
#pragma GCC unroll 4
      for (int s = 0; s < kWarmStreams; ++s) {
        if (p[s] != nullptr) { touch(p[s] + i); }  // a finished cursor (the tail of the last share) is skipped
      }
    }
    for (Cursor& c : cur) {
      if (c.left <= 0) { continue; }
      c.left -= step, c.offset += step;
      if (c.offset >= ranges[c.range].bytes) {
        touch(ranges[c.range].first + ranges[c.range].bytes - 1);
        ++c.range, c.offset = 0;
      }
    }
  }
}

// The byte ranges of K and V that the work items (bidb, n_split, bidh_first .. bidh_last) will read, as
// warm_decode_split reads them: their tiles as the body computes them (window, split), heads kv_first ..
// kv_last, rows below seqlen_k, up to the last head's d-th element (a subset of the bytes between the
// body's own reads, so never outside the tensors).  fn(char const* first, int64_t bytes) per range; nothing
// when the heads do not lie side by side or the rows would not fit in L2 (a forced long split).
template <class Traits, class Fn>
void for_each_warm_range(FwdParams const& params, DynamicFlags const& flags, int bidb, int n_split, int bidh_first,
                         int bidh_last, Fn&& fn) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN;
  BlockInfo const binfo(params, bidb);
  if (binfo.seqlen_q <= 0) { return; }  // the body returns before reading K/V
  Window<DynamicFlags> const window(params, flags);
  int n_min = n_block_min<Traits::kBlockM, kBlockN>(binfo, window, 0);
  int n_max = n_block_max<Traits::kBlockM, kBlockN>(binfo, window, 0);
  if (flags.split) { restrict_to_split<kBlockN>(binfo, params.num_splits, n_split, n_min, n_max); }
  int const kv_first = bidh_first / params.h_h_k_ratio, kv_last = bidh_last / params.h_h_k_ratio;
  int64_t const row_bytes = host_warm_row_bytes(params, kv_first, kv_last, int(sizeof(Element)));
  if (n_max <= n_min || row_bytes == 0) { return; }
  int const rows = cute::min(n_max * kBlockN, binfo.seqlen_k) - n_min * kBlockN;
  if (int64_t(rows) * row_bytes > host_l2_bytes()) { return; }
  auto ranges = [&](void const* base, index_t batch_stride, index_t row_stride, index_t head_stride) {
    int64_t const span = host_warm_span(head_stride, kv_first, kv_last, params.d) * int64_t(sizeof(Element));
    int64_t const row_step = row_stride * int64_t(sizeof(Element));
    for (int n = n_min; n < n_max; ++n) {
      char const* tile = reinterpret_cast<char const*>(
          static_cast<Element const*>(base) + head_stride * kv_first +
          binfo.kv_tile_offset(params, bidb, n, kBlockN, batch_stride, row_stride));
      int const tile_rows = cute::min(kBlockN, binfo.seqlen_k - n * kBlockN);
      if (row_step == span) {  // rows abut (every head of a (b, s, h_k, d) cache): one range per tile
        fn(tile, int64_t(tile_rows) * span);
      } else {
        for (int r = 0; r < tile_rows; ++r) { fn(tile + int64_t(r) * row_step, span); }
      }
    }
  };
  ranges(params.k_ptr, params.k_batch_stride, params.k_row_stride, params.k_head_stride);
  ranges(params.v_ptr, params.v_batch_stride, params.v_row_stride, params.v_head_stride);
}

// for_each_warm_range's ranges into `ranges` (abutting ones merged: one per K and V when a split's rows lie back
// to back, as in a (b, s, h_k, d) cache); returns their bytes.
template <class Traits>
int64_t collect_warm_ranges(FwdParams const& params, DynamicFlags const& flags, int bidb, int n_split, int bidh_first,
                            int bidh_last, std::vector<HostWarmRange>& ranges) {
  ranges.clear();
  int64_t total = 0;
  for_each_warm_range<Traits>(params, flags, bidb, n_split, bidh_first, bidh_last, [&](char const* p, int64_t n) {
    if (!ranges.empty() && ranges.back().first + ranges.back().bytes == p) {
      ranges.back().bytes += n;
    } else {
      ranges.push_back({p, n});
    }
    total += n;
  });
  return total;
}

// Reads one byte of every line of those ranges into this core's caches (for_each_warm_line); false when there
// were none.  `ranges`: the caller's, reused across calls.
template <class Traits>
bool warm_decode_split(FwdParams const& params, DynamicFlags const& flags, int bidb, int n_split, int bidh_first,
                       int bidh_last, std::vector<HostWarmRange>& ranges) {
  int64_t const total = collect_warm_ranges<Traits>(params, flags, bidb, n_split, bidh_first, bidh_last, ranges);
  unsigned char acc = 0;
  for_each_warm_line(ranges.data(), int(ranges.size()), total,
                     [&](char const* p) { acc |= static_cast<unsigned char>(*p); });
  asm volatile("" : : "r"(acc));  // the loads are the point; keep them
  return total > 0;
}

// Owned bytes with a 64-byte-aligned start, for the per-thread tile stores below.
class HostAlignedBytes {
 public:
  char* reset(int64_t bytes) {
    storage_.reset(new char[size_t(bytes) + 64]);
    return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(storage_.get()) + 63) / 64 * 64);
  }

 private:
  std::unique_ptr<char[]> storage_;
};

// A worker thread's HostTileCache for one call: room for the K and V tiles of one K/V head (seqlen_k keys, 32-deep
// steps, in `pieces` bf16 pieces: 2 for fp16, 3 for fp32), up to one L2's worth, two for fp32 (what does not fit
// is packed per GEMM, as without it).  A tile is packed once and read by each of the head's row blocks on this
// thread, in place of a repacking (V, transposed into pairs; fp16/fp32: split) or of reads of rows a head's stride
// apart (K) per row block.  fp32's tiles, 96 KiB at d = 128, overflowed one L2 at 2048 keys: two measured
// 1.07-1.19x SDPA against 0.93-1.01x; two for fp16 measured no different from one (docs/perf.md).
class HostKvTileCache {
 public:
  HostTileCache cache;
  void reserve(int seqlen_k, int block_n, int head_dim, int pieces) {
    auto padded = [](int n) { return int64_t(n + 31) / 32 * 32; };
    int const tiles = ceil_div(seqlen_k, block_n);
    int64_t const tile_bytes =
        (int64_t(block_n) * padded(head_dim) + int64_t(head_dim) * padded(block_n)) * 2 * pieces;
    int64_t const room = host_l2_bytes() * (pieces == 3 ? 2 : 1);
    int64_t const bytes = cute::min<int64_t>(int64_t(tiles) * tile_bytes, room) + 2 * 64;
    entries_.reset(new HostTileCache::Entry[size_t(2 * tiles)]);
    cache = {storage_.reset(bytes), bytes, 0, entries_.get(), 2 * tiles, 0};
  }
  void clear() { cache.used = 0, cache.count = 0; }

 private:
  HostAlignedBytes storage_;
  std::unique_ptr<HostTileCache::Entry[]> entries_;
};

// A worker thread's HostKvMirror for one call: room for the K and V tiles of one K/V head (seqlen_k keys), up
// to four L2s' worth (what does not fit is staged, as without it).  Past one L2 the copies are read from L3, still
// faster dense than staged from rows a head's stride apart: with room for a whole head at 4 MiB (bf16 d = 128
// at 8192 keys, fp32 at 4096) a call measured 4-9% less time than with room for half of it (docs/perf.md).
class HostKvMirrorStorage {
 public:
  HostKvMirror mirror;
  void reserve(int seqlen_k, int block_n, int head_dim, int elem_bytes) {
    int const tiles = ceil_div(seqlen_k, block_n);
    int64_t const tile_bytes = int64_t(block_n) * host_mirror_row_elems(head_dim, elem_bytes) * elem_bytes;
    int64_t const bytes = cute::min<int64_t>(int64_t(tiles) * tile_bytes * 2, host_l2_bytes() * 4);
    entries_.reset(new HostKvMirror::Entry[size_t(2 * tiles)]);
    mirror = {storage_.reset(bytes), bytes, 0, entries_.get(), 2 * tiles, 0, 0};
  }
  void clear() { mirror.used = 0, mirror.count = 0, mirror.hint = 0; }

 private:
  HostAlignedBytes storage_;
  std::unique_ptr<HostKvMirror::Entry[]> entries_;
};

// Installs a call's micro-kernels as this worker thread's context (host_isa.h) for the scope of one
// parallel-for chunk, and restores what was there (a nested or earlier call's).
class HostCtaScope {
 public:
  explicit HostCtaScope(HostKernels const& kernels) : ctx_(host_cta_context()), saved_(ctx_) {
    ctx_.kernels = &kernels;
    ctx_.q_cache = nullptr;
    ctx_.kv_cache = nullptr;
    ctx_.p_cache = nullptr;
    ctx_.kv_mirror = nullptr;
  }
  ~HostCtaScope() { ctx_ = saved_; }
  HostCtaScope(HostCtaScope const&) = delete;
  HostCtaScope& operator=(HostCtaScope const&) = delete;
  void set_live_rows(int rows) { ctx_.live_rows = rows; }
  // The forward's: where Q.K^T may keep Q's packed form (HostPackCache) for the CTAs of this scope.
  void set_q_cache(HostPackCache* cache) { ctx_.q_cache = cache; }
  // The forward's, in prefill: where the GEMMs may keep the K/V tiles they read in place (HostTileCache).
  void set_kv_cache(HostTileCache* cache) { ctx_.kv_cache = cache; }
  // The forward's, in prefill without dropout (which changes P after the softmax step): where the softmax step
  // may leave P packed for P.V (HostSoftmaxArgs::p_pairs).
  void set_p_cache(HostPackCache* cache) { ctx_.p_cache = cache; }
  // The forward's, in prefill on a level that stages K/V: where whole K/V tiles are copied once (HostKvMirror).
  void set_kv_mirror(HostKvMirror* mirror) { ctx_.kv_mirror = mirror; }
  // A forward CTA starts: its live rows, whether it reads its whole K/V tiles in place
  // (HostTraits::read_in_place; no tile does until its copy says so), and a new Q, so nothing packed from
  // the last CTA's is valid.
  void begin_cta(int live_rows, bool kv_in_place) {
    ctx_.live_rows = live_rows;
    ctx_.kv_in_place = kv_in_place;
    for (HostTileInPlace& t : ctx_.in_place) { t = {}; }
    if (ctx_.q_cache != nullptr) { ctx_.q_cache->valid = false; }
    if (ctx_.p_cache != nullptr) { ctx_.p_cache->valid = false; }
  }

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
  // One row block per head (decode): the heads of a (batch, split) run back to back, warmed by the first
  // (see warm_decode_split).  Else m_block varies fastest, so neighbouring work items reuse K/V in cache.
  bool const decode = num_m_blocks == 1;
  // Prefill stages its K/V tiles unless the level's GEMMs read them in place anyway (HostKernels).
  constexpr bool kBf16 = std::is_same_v<typename Traits::Element, cutlass::bfloat16_t>;
  constexpr bool kF16 = std::is_same_v<typename Traits::Element, cutlass::half_t>;
  bool const prefill_in_place =
      kBf16 ? kernels.bf16_kv_in_place : kF16 ? kernels.f16_kv_in_place : kernels.f32_kv_in_place;
  parallel_for(int64_t(0), total, [&](int64_t begin, int64_t end) {
    HostCtaScope scope(kernels);
    alignas(128) char smem[Traits::kSmemBytes];  // the "shared memory" of one CTA
    // Q as bf16 pairs over whole 32-deep steps, as a level with bf16 tiles packs it (HostPackCache); fp16 and
    // fp32 Q 2 and 3 times that, the pairs of each of its bf16 pieces (the split GEMMs of kernels.h).
    constexpr int kPieces = kBf16 ? 1 : kF16 ? 2 : 3;
    alignas(64) uint32_t q_pairs[Traits::kBlockM * ((Traits::kHeadDim + 31) / 32 * 16) * kPieces];
    HostPackCache q_cache{q_pairs, int64_t(sizeof(q_pairs))};
    scope.set_q_cache(&q_cache);
    // The K/V tiles of the head that this thread's run of row blocks reads in place, packed once (HostTileCache).
    HostKvTileCache kv_cache;
    // P as bf16 pairs of keys over whole 32-deep steps (HostSoftmaxArgs::p_pairs).
    alignas(64) uint32_t p_pairs[Traits::kBlockM * ((Traits::kBlockN + 31) / 32 * 16)];
    HostPackCache p_cache{p_pairs, int64_t(sizeof(p_pairs))};
    if (prefill_in_place && !decode) {
      kv_cache.reserve(params.seqlen_k, Traits::kBlockN, Traits::kHeadDim, kPieces);
      scope.set_kv_cache(&kv_cache.cache);
      // P packed by the softmax step as rounded bf16 pairs, for a bf16 P.V (fp16's split P.V measured no faster
      // with P split there: docs/perf.md).
      if (kBf16 && !flags.dropout) { scope.set_p_cache(&p_cache); }
    }
    // The K/V tiles of the head that this thread's run of row blocks reads, copied once (HostKvMirror).
    HostKvMirrorStorage kv_mirror;
    if (!prefill_in_place && !decode) {
      kv_mirror.reserve(params.seqlen_k, Traits::kBlockN, Traits::kHeadDim, int(sizeof(typename Traits::Element)));
      scope.set_kv_mirror(&kv_mirror.mirror);
    }
    std::vector<HostWarmRange> warm_ranges;  // decode: warm_decode_split's
    int64_t kv_head = -1;  // the (batch, K/V head) whose tiles kv_cache holds
    bool warmed = false;  // this (batch, split)'s K/V rows are in L2: its CTAs read whole tiles in place
    for (int64_t i = begin; i < end; ++i) {
      int m_block = 0, n_split, bidh, bidb;
      if (decode) {
        bidh = int(i % params.h);
        int64_t const rest = i / params.h;
        n_split = int(rest % num_splits);
        bidb = int(rest / num_splits);
        if (bidh == 0 || i == begin) {  // the first of this group's heads on this thread
          int const last = int(cute::min<int64_t>(params.h - 1, bidh + (end - 1 - i)));
          warmed = warm_decode_split<Traits>(params, flags, bidb, n_split, bidh, last, warm_ranges);
        }
      } else {
        m_block = int(i % num_m_blocks);
        int64_t rest = i / num_m_blocks;
        n_split = int(rest % num_splits);
        rest /= num_splits;
        bidh = int(rest % params.h);
        bidb = int(rest / params.h);
      }
      if (int64_t const kv = int64_t(bidb) * params.h_k + bidh / params.h_h_k_ratio; kv != kv_head) {
        kv_cache.clear();  // its tiles are another head's now
        kv_mirror.clear();
        kv_head = kv;
      }
      // Query rows of this tile that exist (the last tile of a sequence, a decode step's 1-16 rows).
      scope.begin_cta(BlockInfo(params, bidb).seqlen_q - m_block * Traits::kBlockM, decode ? warmed : prefill_in_place);
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
