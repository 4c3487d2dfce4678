// flash_ext::varlen_fwd — variable-length batches packed without padding: q (total_q, h, d), k/v
// (total_k, h_k, d) or pages (num_pages, page_size, h_k, d) with a block table; sequence i is rows
// [cu_seqlens_q[i], cu_seqlens_q[i+1]) of q and its keys rows [cu_seqlens_k[i], cu_seqlens_k[i+1]) of k/v
// (paged: the first cu_seqlens_k[i+1] - cu_seqlens_k[i] rows of its pages).
#include <torch/library.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cmath>

#include "common.h"
#include "dropout.h"
#include "index_values.h"

namespace flash_ext::ops {

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_fwd(
    at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& cu_seqlens_q,
    at::Tensor const& cu_seqlens_k, std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
    std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits, std::optional<at::Tensor> const& block_table,
    double dropout_p, std::optional<at::Tensor> const& rng_state,
    bool /*deterministic: read by the autograd formula only*/) {
  // Everything below (the index read, the capture test, dropout's RNG state, allocations) on q's device, not
  // the current one: tensors on cuda:1 with cuda:0 current would otherwise query, and create a context on, 0.
  c10::OptionalDeviceGuard const device_guard(cuda_device_of(q));
  ArgChecker c("flash_ext.varlen_fwd");
  bool const paged = block_table.has_value();
  bool const shapes_ok = check_qkv(c, q, k, v, /*varlen=*/true, /*kv_cache=*/false, /*paged_varlen=*/paged);
  // The kernels address LSE rows as head * total_q + row with total_q in an int (params.total_q).
  if (shapes_ok) { FLASH_EXT_REQUIRE(c, q.size(0) <= INT32_MAX, "q", str(q.sizes()), "total_q must be < 2^31"); }
  bool const cu_ok = check_cu_seqlens_pair(c, cu_seqlens_q, cu_seqlens_k, q.device());
  int64_t const b = std::max<int64_t>(cu_seqlens_q.numel() - 1, 0);
  bool const used_ok = check_index_tensor(c, seqused_k, "seqused_k", 1, b, q.device(), "q");
  // Paged K/V (flash_attn's varlen + block_table): sequence i's keys are rows [0, its length) of the pages
  // block_table[i, :]; cu_seqlens_k still gives the lengths.  Pages are whole multiples of every tile's N,
  // so a K/V tile never straddles two pages.
  bool const table_ok = check_index_tensor(c, block_table, "block_table", 2, b, q.device(), "q");
  int64_t page_size = 0, capacity = 0;
  if (paged && shapes_ok) {
    page_size = k.size(1);
    FLASH_EXT_REQUIRE(c, page_size > 0 && page_size % 128 == 0, "k.shape[1] (page size)", std::to_string(page_size),
              "must be a positive multiple of 128 with block_table");
    capacity = table_ok ? block_table->size(1) * page_size : 0;
  }
  FLASH_EXT_REQUIRE(c, max_seqlen_q >= 0, "max_seqlen_q", std::to_string(max_seqlen_q), "must be >= 0");
  FLASH_EXT_REQUIRE(c, max_seqlen_k >= 0, "max_seqlen_k", std::to_string(max_seqlen_k), "must be >= 0");
  check_lengths(c, max_seqlen_q, max_seqlen_k, "max_seqlen_q/max_seqlen_k", shapes_ok ? q.size(0) : 0, num_splits);
  check_options(c, q, b, shapes_ok ? q.size(1) : -1, softmax_scale, softcap, alibi_slopes, num_splits);
  check_dropout(c, q.device(), dropout_p, rng_state);

  // Index values: one host read of all of them (on CUDA one copy; trusted while capturing).
  IndexValues idx;
  // q may hold rows past the last sequence (cu_seqlens_q[-1] < total_q: a batch padded to a fixed token count,
  // as flash_attn accepts); they get O = 0 and LSE = +inf, like rows that see no key.  -1: not known (trusted
  // index values), then those rows are not written, as in flash_attn.
  int64_t q_rows_used = -1;
  int const s_cu_q = idx.add(cu_ok ? std::optional<at::Tensor>(cu_seqlens_q) : std::nullopt);
  int const s_cu_k = idx.add(cu_ok ? std::optional<at::Tensor>(cu_seqlens_k) : std::nullopt);
  int const s_used = idx.add(used_ok ? seqused_k : std::nullopt);
  int const s_table = idx.add(table_ok ? block_table : std::nullopt);
  if (shapes_ok && cu_ok && used_ok && table_ok && idx.read(q.device())) {
    int const* cu_q = idx.values(s_cu_q);
    int const* cu_k = idx.values(s_cu_k);
    int64_t const n = b + 1;
    check_cu_seqlens_values(c, cu_q, n, "cu_seqlens_q", q.size(0), /*total_exact=*/false, max_seqlen_q, "max_seqlen_q");
    q_rows_used = cu_q[n - 1];
    // Paged: the keys are not rows of k, so only the per-sequence bounds below limit cu_seqlens_k.
    int64_t const k_rows = paged ? std::max<int64_t>(b * capacity, 0) : k.size(0);
    check_cu_seqlens_values(c, cu_k, n, "cu_seqlens_k", k_rows, /*total_exact=*/false, max_seqlen_k, "max_seqlen_k");
    auto const keys = [&](int64_t i) { return int64_t(cu_k[i + 1]) - cu_k[i]; };
    if (paged && page_size > 0 && page_size % 128 == 0) {  // a bad page size is reported once, above
      int64_t too_long = -1;
      for (int64_t i = 0; i < b && too_long < 0; ++i) {
        if (keys(i) > capacity) { too_long = i; }
      }
      FLASH_EXT_REQUIRE(c, too_long < 0, "cu_seqlens_k",
                "sequence " + std::to_string(too_long) + " longer than its pages",
                "each sequence must fit block_table.shape[1] x page size = " + std::to_string(capacity) + " keys");
      check_pages(c, idx.values(s_table), block_table->size(1), b, page_size, k.size(0), "pages in use", "k's",
                  [&](int64_t i) { return std::pair<int64_t, int64_t>{0, std::max<int64_t>(keys(i), 0)}; });
    }
    if (seqused_k.has_value()) {
      int const* used = idx.values(s_used);
      int64_t bad = -1;
      for (int64_t i = 0; i < b && bad < 0; ++i) {
        if (used[i] < 0 || used[i] > keys(i)) { bad = i; }
      }
      FLASH_EXT_REQUIRE(c, bad < 0, "seqused_k",
                bad < 0 ? "" : "value " + std::to_string(used[bad]) + " at index " + std::to_string(bad),
                "must be within [0, that sequence's key count" +
                    (bad < 0 ? "" : " " + std::to_string(keys(bad))) + "]");
    }
  }
  c.raise_if_any();

  int64_t const total_q = q.size(0), h = q.size(1), d = q.size(2);
  at::Tensor out = at::empty({total_q, h, d}, q.options());
  at::Tensor lse = at::empty({h, total_q}, q.options().dtype(at::kFloat));
  auto write_padding_rows = [&] {  // the kernels write only rows of sequences
    if (q_rows_used >= 0 && q_rows_used < total_q) {
      out.narrow(0, q_rows_used, total_q - q_rows_used).zero_();
      lse.narrow(1, q_rows_used, total_q - q_rows_used).fill_(INFINITY);
    }
  };
  if (out.numel() == 0 || b == 0 || max_seqlen_q == 0) {
    write_padding_rows();
    return {out, lse, idle_rng_state(q, dropout_p, rng_state)};
  }
  at::Tensor cu_q = element_aligned(cu_seqlens_q), cu_k = element_aligned(cu_seqlens_k);
  std::optional<at::Tensor> used, table;
  if (seqused_k.has_value()) { used = element_aligned(*seqused_k); }
  FwdParams p;
  KernelInputs const in = prepare_inputs(p, q, k, v, out, lse, alibi_slopes);
  p.b = int(b);
  p.seqlen_q = int(max_seqlen_q);
  p.seqlen_k = int(max_seqlen_k);
  p.total_q = int(total_q);
  p.cu_seqlens_q = cu_q.data_ptr<int>();
  p.cu_seqlens_k = cu_k.data_ptr<int>();
  p.seqused_k = used.has_value() ? used->data_ptr<int>() : nullptr;
  if (paged) {
    table = element_aligned(*block_table);
    p.block_table = table->data_ptr<int>();
    p.block_table_batch_stride = table->stride(0);
    p.page_size = int(page_size);
  }
  set_semantics(p, softmax_scale, causal, window_left, window_right, softcap, in.alibi);
  auto const accum = set_splits(p, in.q, num_splits, total_q);
  DropoutState const dropout = set_dropout(p, q, dropout_p, rng_state);  // the mask's batch index: the sequence
  launch(p, in, out, accum, "flash_ext.varlen_fwd");
  write_padding_rows();  // after the launch: prepare_inputs poisons all of out and lse in test mode
  return {out, lse, dropout.out};
}

}  // namespace

// Dropout and rng_state as in fwd (fwd.cpp).
TORCH_LIBRARY_FRAGMENT(flash_ext, m) {
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, Tensor? alibi_slopes, int num_splits=0, Tensor? block_table=None, float dropout_p=0.0, "
      "Tensor? rng_state=None, bool deterministic=False) -> (Tensor out, Tensor softmax_lse, Tensor rng_state)",
      {at::Tag::nondeterministic_seeded});
}

TORCH_LIBRARY_IMPL(flash_ext, CPU, m) { m.impl("varlen_fwd", &varlen_fwd); }

#if defined(FLASH_EXT_WITH_CUDA)
TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) { m.impl("varlen_fwd", &varlen_fwd); }
#endif

}  // namespace flash_ext::ops
