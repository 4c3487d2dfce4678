// flash_ext::kvcache_fwd — flash_attn_with_kvcache as ONE op: append the new keys/values (already rotated by
// the Python layer) to the cache in place, then attend.  Every check of the whole call — shapes, options,
// and every index value (cache lengths, batch indices, left padding, pages, rotary coverage) — runs before
// the first write, so a refused call leaves the cache bit-identical (flash_attn validates everything first).
// Being one op with the mutation declared in its schema keeps a decode step one graph under torch.compile.
#include <torch/library.h>
#include <c10/core/DeviceGuard.h>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "index_values.h"

namespace flash_ext::ops {

namespace {

struct CacheIndices {
  at::Tensor seqlens;  // int32 (b,): keys visible to entry i: [leftpad[i], seqlens[i])
  std::optional<at::Tensor> batch_idx, leftpad, block_table;
  int64_t capacity = 0, page_size = 0;
};

// attend's kernel call into out (b, sq, h, d) and lse (b, h, sq), which may be views of the caller's tensors
// (grouped_outputs); d a multiple of 8.
void attend_into(at::Tensor const& q, at::Tensor const& k_cache, at::Tensor const& v_cache, CacheIndices const& ix,
                 double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
                 std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits, at::Tensor out, at::Tensor lse) {
  if (out.numel() == 0) { return; }
  int64_t const b = q.size(0), sq = q.size(1);
  // seqused_k = keys per entry after the append, counted from the left padding.
  at::Tensor const used =
      element_aligned((ix.leftpad.has_value() ? ix.seqlens - *ix.leftpad : ix.seqlens).to(at::kInt));
  std::optional<at::Tensor> idx, pad, table;
  if (ix.batch_idx.has_value()) { idx = element_aligned(*ix.batch_idx); }
  if (ix.leftpad.has_value()) { pad = element_aligned(*ix.leftpad); }
  if (ix.block_table.has_value()) { table = element_aligned(*ix.block_table); }
  FwdParams p;
  KernelInputs const in = prepare_inputs(p, q, k_cache, v_cache, out, lse, alibi_slopes);
  p.b = int(b);
  p.seqlen_q = int(sq);
  p.seqlen_k = int(std::max<int64_t>(ix.capacity, 1));  // an upper bound: per-entry key counts are in seqused_k
  p.seqused_k = used.data_ptr<int>();
  p.kv_batch_idx = idx.has_value() ? idx->data_ptr<int>() : nullptr;
  p.leftpad_k = pad.has_value() ? pad->data_ptr<int>() : nullptr;
  if (table.has_value()) {
    p.block_table = table->data_ptr<int>();
    p.block_table_batch_stride = table->stride(0);
    p.page_size = int(ix.page_size);
  }
  set_semantics(p, softmax_scale, causal, window_left, window_right, softcap, in.alibi);
  auto const accum = set_splits(p, in.q, num_splits, b * sq);
  launch(p, in, out, accum, "flash_ext.kvcache_fwd");
}

// Attention of q against a cache whose new rows are in place; no checks (kvcache_fwd made them).
std::tuple<at::Tensor, at::Tensor> attend(at::Tensor const& q, at::Tensor const& k_cache, at::Tensor const& v_cache,
                                          CacheIndices const& ix, double softmax_scale, bool causal,
                                          int64_t window_left, int64_t window_right, double softcap,
                                          std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits) {
  int64_t const d = q.size(3);
  if (d % 8 != 0) {  // the kernels move 8-element vectors: zero head-dim padding changes no dot product
    int64_t const pad = 8 - d % 8;
    auto [out, lse] = attend(at::constant_pad_nd(q, {0, pad}), at::constant_pad_nd(k_cache, {0, pad}),
                             at::constant_pad_nd(v_cache, {0, pad}), ix, softmax_scale, causal, window_left,
                             window_right, softcap, alibi_slopes, num_splits);
    return {out.narrow(3, 0, d).contiguous(), lse};
  }
  if (swap_query_groups(q, k_cache, window_left, ix.capacity, alibi_slopes)) {
    int64_t const h_k = k_cache.size(2);
    GroupedOutputs const g = grouped_outputs(q, h_k);
    attend_into(groups_as_rows(q, h_k), k_cache, v_cache, ix, softmax_scale, /*causal=*/false, -1, -1, softcap,
                alibi_slopes, num_splits, g.out_rows, g.lse_rows);
    return {g.out, g.lse};
  }
  int64_t const b = q.size(0), sq = q.size(1), h = q.size(2);
  at::Tensor out = at::empty({b, sq, h, d}, q.options());
  at::Tensor lse = at::empty({b, h, sq}, q.options().dtype(at::kFloat));
  attend_into(q, k_cache, v_cache, ix, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
              num_splits, out, lse);
  return {out, lse};
}

// Rows cache_seqlens[i] .. cache_seqlens[i] + seqlen_new of entry i's cache (cache batch cache_batch_idx[i],
// or its pages) receive k[i] and v[i].  The cache is plain storage: no autograd history is recorded into it.
// `kept` (bool (b, seqlen_new), on the host): only those new rows are written; given when repeated cache batch
// indices make two entries write one cache row, so that the later entry's row is the one stored.
void append(at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor const& k, at::Tensor const& v,
            at::Tensor const& cache_seqlens, std::optional<at::Tensor> const& cache_batch_idx,
            std::optional<at::Tensor> const& block_table, int64_t page_size,
            std::optional<at::Tensor> const& kept = std::nullopt) {
  at::NoGradGuard no_grad;
  int64_t const b = k.size(0), seqlen_new = k.size(1);
  if (b == 0 || seqlen_new == 0) { return; }
  auto const long_opts = cache_seqlens.options().dtype(at::kLong);
  at::Tensor const pos = cache_seqlens.to(at::kLong).unsqueeze(1) +
                         at::arange(seqlen_new, long_opts).unsqueeze(0);  // (b, seqlen_new)
  if (block_table.has_value()) {
    at::Tensor const page = block_table->to(at::kLong).gather(1, at::div(pos, page_size, "floor"));
    at::Tensor const row = at::remainder(pos, page_size);
    k_cache.index_put_({page, row}, k.detach());
    v_cache.index_put_({page, row}, v.detach());
    return;
  }
  at::Tensor const batch =
      (cache_batch_idx.has_value() ? cache_batch_idx->to(at::kLong) : at::arange(b, long_opts)).unsqueeze(1);
  if (!kept.has_value()) {
    k_cache.index_put_({batch, pos}, k.detach());
    v_cache.index_put_({batch, pos}, v.detach());
    return;
  }
  // Rows selected first, so that no cache row is named twice in one index_put_ (whose order among duplicates
  // is unspecified).
  at::Tensor const sel = at::nonzero(kept->to(k.device()).flatten()).squeeze(1);  // (kept rows,)
  at::Tensor const rows = batch.expand({b, seqlen_new}).flatten().index_select(0, sel);
  at::Tensor const at_pos = pos.flatten().index_select(0, sel);
  k_cache.index_put_({rows, at_pos}, k.detach().flatten(0, 1).index_select(0, sel));
  v_cache.index_put_({rows, at_pos}, v.detach().flatten(0, 1).index_select(0, sel));
}

// For cache batch indices that repeat while new rows are appended: which (entry, new row) pairs are written,
// as flash_attn allows repeats ("the values updated in the cache might come from any of the duplicate
// indices"), made deterministic here: where two entries write one cache row, the later batch entry's row is
// stored.  Every entry then attends to the cache as it is after all appends.  None when no row is written twice.
std::optional<at::Tensor> rows_kept(int const* entry, int const* len, int64_t b, int64_t seqlen_new) {
  std::vector<int64_t> order(b);
  for (int64_t i = 0; i < b; ++i) { order[i] = i; }
  // By cache entry, then batch entry: a later entry with the same cache entry follows directly.
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return entry[x] < entry[y]; });
  std::optional<at::Tensor> kept;
  for (int64_t a = 0; a < b; ++a) {
    int64_t const i = order[a];
    for (int64_t c = a + 1; c < b && entry[order[c]] == entry[i]; ++c) {
      int64_t const j = order[c];  // j > i: its rows [len[j], len[j] + seqlen_new) win over entry i's
      int64_t const from = std::max<int64_t>(len[i], len[j]), to = std::min<int64_t>(len[i], len[j]) + seqlen_new;
      if (from >= to) { continue; }
      if (!kept.has_value()) { kept = at::ones({b, seqlen_new}, at::TensorOptions().dtype(at::kBool)); }
      kept->select(0, i).slice(0, from - len[i], to - len[i]).fill_(false);
    }
  }
  return kept;
}

std::tuple<at::Tensor, at::Tensor> kvcache_fwd(
    at::Tensor const& q, at::Tensor& k_cache, at::Tensor& v_cache, std::optional<at::Tensor> const& k,
    std::optional<at::Tensor> const& v, at::Tensor const& cache_seqlens,
    std::optional<at::Tensor> const& cache_batch_idx, std::optional<at::Tensor> const& cache_leftpad,
    std::optional<at::Tensor> const& block_table, double softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits,
    int64_t rotary_len, int64_t rotary_rows) {
  // Everything below (the index read, the capture test, dropout's RNG state, allocations) on q's device, not
  // the current one: tensors on cuda:1 with cuda:0 current would otherwise query, and create a context on, 0.
  c10::OptionalDeviceGuard const device_guard(cuda_device_of(q));
  ArgChecker c("flash_ext.kvcache_fwd");
  bool const shapes_ok = check_qkv(c, q, k_cache, v_cache, /*varlen=*/false, /*kv_cache=*/true,
                                   /*paged_varlen=*/false, /*any_head_dim=*/true);
  int64_t const b = shapes_ok ? q.size(0) : -1;
  check_options(c, q, b, shapes_ok ? q.size(2) : -1, softmax_scale, softcap, alibi_slopes, num_splits);

  // New keys/values: both or neither, (batch, seqlen_new, heads_k, d) in the cache's dtype and device.
  bool new_ok = k.has_value() == v.has_value();
  FLASH_EXT_REQUIRE(c, new_ok, "k/v", k.has_value() ? "k without v" : "v without k",
            "must be given together (or neither)");
  int64_t seqlen_new = 0;
  if (new_ok && k.has_value()) {
    bool const shape_ok = shapes_ok && k->dim() == 4 && v->sizes() == k->sizes() && k->size(0) == b &&
                          k->size(2) == k_cache.size(2) && k->size(3) == k_cache.size(3);
    FLASH_EXT_REQUIRE(c, shape_ok, "k/v", str(k->sizes()) + "/" + str(v->sizes()),
              shapes_ok ? "must both be (batch=" + std::to_string(b) + ", seqlen_new, heads_k=" +
                              std::to_string(k_cache.size(2)) + ", d=" + std::to_string(k_cache.size(3)) + ")"
                        : "must both be (batch, seqlen_new, heads_k, d) like the cache");
    FLASH_EXT_REQUIRE(c, k->scalar_type() == k_cache.scalar_type() && v->scalar_type() == k_cache.scalar_type(),
              "k/v.dtype", str(k->scalar_type()) + "/" + str(v->scalar_type()),
              "must equal the cache's dtype (" + str(k_cache.scalar_type()) + ")");
    FLASH_EXT_REQUIRE(c, k->device() == k_cache.device() && v->device() == k_cache.device(), "k/v.device",
              str(k->device()) + "/" + str(v->device()),
              "must equal the cache's device (" + str(k_cache.device()) + ")");
    new_ok = shape_ok;
    seqlen_new = shape_ok ? k->size(1) : 0;
    // Appending writes the caches: a cache whose entries share memory (an expand()ed tensor) or the same
    // storage passed as both caches would have one append overwrite another, a silently wrong result.  (New
    // rows that view a cache are copied before the append instead: below.)
    check_no_overlap(c, {{&k_cache, "k_cache"}, {&v_cache, "v_cache"}}, {});
    for (auto [cache, name] : {std::pair<at::Tensor const&, char const*>{k_cache, "k_cache"}, {v_cache, "v_cache"}}) {
      // torch refuses an in-place update of an inference tensor outside inference mode, but only after the op
      // has run (when it bumps the version counters): the caches would be appended to by a call that raises.
      FLASH_EXT_REQUIRE(c, !cache.is_inference() || c10::InferenceMode::is_enabled(), name,
                "an inference tensor (created under torch.inference_mode()) outside inference mode",
                "is appended to in place: call under torch.inference_mode(), or through "
                "flash_ext.flash_attn_with_kvcache, which does");
    }
  }

  auto index_ok = [&](std::optional<at::Tensor> const& t, char const* name, int64_t rank) {
    return check_index_tensor(c, t, name, rank, b, q.device(), "q");
  };
  // & rather than &&: every malformed index tensor is reported, not just the first.
  bool const idx_ok = index_ok(cache_seqlens, "cache_seqlens", 1) & index_ok(cache_batch_idx, "cache_batch_idx", 1) &
                      index_ok(cache_leftpad, "cache_leftpad", 1) & index_ok(block_table, "block_table", 2);
  bool const paged = block_table.has_value();
  int64_t page_size = 0, capacity = 0;
  if (shapes_ok) {
    page_size = paged ? k_cache.size(1) : 0;
    capacity = paged ? (block_table->dim() == 2 ? block_table->size(1) * page_size : 0) : k_cache.size(1);
    if (paged) {
      FLASH_EXT_REQUIRE(c, page_size % 128 == 0 && page_size > 0, "k_cache.shape[1] (page size)",
                std::to_string(page_size), "must be a positive multiple of 128 with block_table");
      FLASH_EXT_REQUIRE(c, !cache_leftpad.has_value(), "cache_leftpad", "given with block_table",
                "left padding and paged KV cannot be combined");
      FLASH_EXT_REQUIRE(c, !cache_batch_idx.has_value(), "cache_batch_idx", "given with block_table",
                "paged KV selects pages through block_table; cache_batch_idx must be None");
    } else if (!cache_batch_idx.has_value()) {
      // Entry i reads (and appends to) cache batch i.
      FLASH_EXT_REQUIRE(c, k_cache.size(0) >= b, "k_cache.shape[0]", std::to_string(k_cache.size(0)) + " cache entries",
                "must be >= q's batch " + std::to_string(b) + " without cache_batch_idx or block_table (entry i uses "
                "cache entry i)");
    }
    check_lengths(c, q.size(1), capacity, "q.shape[1]/cache capacity", b * q.size(1), num_splits);
  }

  // Index values: one host read of all of them (on CUDA one copy; trusted while capturing).
  IndexValues ix_values;
  std::optional<at::Tensor> kept;  // the new rows written, where repeated cache batch indices overlap
  int const s_len = ix_values.add(idx_ok ? std::optional<at::Tensor>(cache_seqlens) : std::nullopt);
  int const s_idx = ix_values.add(idx_ok ? cache_batch_idx : std::nullopt);
  int const s_pad = ix_values.add(idx_ok ? cache_leftpad : std::nullopt);
  int const s_table = ix_values.add(idx_ok ? block_table : std::nullopt);
  if (shapes_ok && new_ok && idx_ok && ix_values.read(q.device())) {
    int const* len = ix_values.values(s_len);
    int const* pad = ix_values.values(s_pad);
    int64_t bad_len = -1, bad_pad = -1, bad_rotary = -1;
    auto leftpad = [&](int64_t i) -> int64_t { return pad ? pad[i] : 0; };
    for (int64_t i = 0; i < b; ++i) {
      int64_t const l = len[i], lp = leftpad(i);
      if (bad_len < 0 && (l < 0 || l + seqlen_new > capacity)) { bad_len = i; }
      // Only a given cache_leftpad can be wrong; a negative length is reported above.
      if (bad_pad < 0 && pad && (lp < 0 || lp > l)) { bad_pad = i; }
      if (bad_rotary < 0 && rotary_len >= 0 && l + rotary_rows > rotary_len) { bad_rotary = i; }
    }
    auto at_entry = [&](int64_t value, int64_t i) {
      return std::to_string(value) + " at batch entry " + std::to_string(i);
    };
    FLASH_EXT_REQUIRE(c, bad_len < 0, "cache_seqlens", bad_len < 0 ? "" : at_entry(len[bad_len], bad_len),
              "need 0 <= cache_seqlens and cache_seqlens + seqlen_new (" + std::to_string(seqlen_new) +
                  ") <= the cache capacity " + std::to_string(capacity));
    FLASH_EXT_REQUIRE(c, bad_pad < 0, "cache_leftpad", bad_pad < 0 ? "" : at_entry(leftpad(bad_pad), bad_pad),
              "need 0 <= cache_leftpad <= cache_seqlens");
    FLASH_EXT_REQUIRE(c, bad_rotary < 0, "rotary_cos/rotary_sin", std::to_string(rotary_len) + " positions",
              "must cover positions cache_seqlens + [0, " + std::to_string(rotary_rows) + ") (batch entry " +
                  std::to_string(bad_rotary) + " goes past them)");
    if (cache_batch_idx.has_value()) {
      int const* entry = ix_values.values(s_idx);
      check_index_range(c, entry, b, "cache_batch_idx", k_cache.size(0), "k_cache's batch dimension");
      if (seqlen_new > 0 && bad_len < 0) { kept = rows_kept(entry, len, b, seqlen_new); }
    }
    if (paged && bad_len < 0) {
      check_pages(c, ix_values.values(s_table), block_table->size(1), b, page_size, k_cache.size(0),
                  "the pages in use", "k_cache's",
                  [&](int64_t i) { return std::pair<int64_t, int64_t>{0, int64_t(len[i]) + seqlen_new}; });
      check_paged_append(c, ix_values.values(s_table), block_table->size(1), b, page_size, len, seqlen_new);
    }
  }
  c.raise_if_any();

  // Inputs that view a cache would be read after the append has written it: copied first, so that the call
  // appends the new rows and attends with the q (and slopes) they were when it was made.  (flash_attn's
  // kernel appends and reads q in one launch: such a q is a race there.)
  bool const appends = k.has_value() && !plan_only();  // plan-only (explain_call): the plan, no append
  auto unaliased = [&](at::Tensor const& t) {
    for (at::Tensor const* cache : {&k_cache, &v_cache}) {
      if (appends && t.storage().is_alias_of(cache->storage()) &&
          at::get_overlap_status(t, *cache) != at::MemOverlapStatus::No) {
        return t.clone();
      }
    }
    return t;
  };
  at::Tensor const q_read = unaliased(q);
  std::optional<at::Tensor> const slopes_read =
      alibi_slopes.has_value() ? std::optional<at::Tensor>(unaliased(*alibi_slopes)) : std::nullopt;
  if (appends) {
    append(k_cache, v_cache, unaliased(*k), unaliased(*v), cache_seqlens, cache_batch_idx, block_table, page_size,
           kept);
  }
  CacheIndices ix{seqlen_new ? cache_seqlens + int(seqlen_new) : cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, capacity, page_size};
  return attend(q_read, k_cache, v_cache, ix, softmax_scale, causal, window_left, window_right, softcap,
                slopes_read, num_splits);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flash_ext, m) {
  m.def(
      "kvcache_fwd(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor cache_seqlens, "
      "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, float softmax_scale, bool causal, "
      "int window_left, int window_right, float softcap, Tensor? alibi_slopes, int num_splits=0, int rotary_len=-1, "
      "int rotary_rows=0) -> (Tensor out, Tensor softmax_lse)");
}

TORCH_LIBRARY_IMPL(flash_ext, CPU, m) { m.impl("kvcache_fwd", &kvcache_fwd); }

#if defined(FLASH_EXT_WITH_CUDA)
TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) { m.impl("kvcache_fwd", &kvcache_fwd); }
#endif

}  // namespace flash_ext::ops
