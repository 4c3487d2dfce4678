#include "index_values.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>

#if defined(FLASH_EXT_WITH_CUDA)
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace flash_ext::ops {

namespace {
std::atomic<int64_t> g_index_reads{0};

bool trust_index_values_on_cuda() {
  static bool const trust = [] {
    char const* e = std::getenv("FLASH_EXT_TRUST_CU_SEQLENS");
    return e != nullptr && std::string(e) == "1";
  }();
  return trust;
}
}  // namespace

int64_t index_reads() { return g_index_reads.load(); }

int IndexValues::add(std::optional<at::Tensor> const& t) {
  int64_t const start = offset_.empty() ? 0 : offset_.back() + numel_.back();
  offset_.push_back(start);
  numel_.push_back(t.has_value() ? t->numel() : 0);
  if (t.has_value() && t->numel() > 0) { tensors_.push_back(t->reshape({-1})); }
  return int(offset_.size()) - 1;
}

bool IndexValues::read(at::Device device) {
  if (device.is_cuda()) {
    if (trust_index_values_on_cuda()) { return false; }
#if defined(FLASH_EXT_WITH_CUDA)
    if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) { return false; }
#endif
  }
  g_index_reads.fetch_add(1);
  if (tensors_.empty()) { return true; }
  at::Tensor const all = tensors_.size() == 1 ? tensors_[0] : at::cat(tensors_);
  host_ = all.to(at::kCPU).contiguous();  // the one device-to-host copy (a no-op on the CPU)
  host_ptr_ = host_.data_ptr<int>();
  return true;
}

bool check_index_tensor(ArgChecker& c, std::optional<at::Tensor> const& t, char const* name, int64_t rank,
                        int64_t batch, at::Device device, char const* device_owner) {
  if (!t.has_value()) { return true; }
  bool const ok = t->dim() == rank && t->scalar_type() == at::kInt && t->device() == device &&
                  (batch < 0 || t->size(0) == batch);
  FLASH_EXT_REQUIRE(c, ok, name, str(t->scalar_type()) + " " + str(t->sizes()) + " on " + str(t->device()),
            "must be an int32 tensor with " + std::to_string(rank) + " dims and batch (" + std::to_string(batch) +
                ") rows on " + device_owner + "'s device");
  return ok;
}

bool check_cu_seqlens_pair(ArgChecker& c, at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k,
                           at::Device device) {
  bool cu_ok = true;
  for (auto const& [name, t] : {std::pair{"cu_seqlens_q", &cu_seqlens_q}, std::pair{"cu_seqlens_k", &cu_seqlens_k}}) {
    bool const ok = t->dim() == 1 && t->numel() >= 1 && t->scalar_type() == at::kInt && t->device() == device;
    FLASH_EXT_REQUIRE(c, ok, name, str(t->scalar_type()) + " " + str(t->sizes()) + " on " + str(t->device()),
              "must be a 1-D int32 tensor of length batch + 1 on q's device");
    cu_ok = cu_ok && ok;
  }
  if (cu_ok) {
    FLASH_EXT_REQUIRE(c, cu_seqlens_k.numel() == cu_seqlens_q.numel(), "cu_seqlens_k",
              "length " + std::to_string(cu_seqlens_k.numel()),
              "must have the length of cu_seqlens_q (" + std::to_string(cu_seqlens_q.numel()) + ")");
    cu_ok = cu_seqlens_k.numel() == cu_seqlens_q.numel();
  }
  return cu_ok;
}

void check_index_range(ArgChecker& c, int const* v, int64_t n, char const* name, int64_t upper,
                       std::string const& what) {
  int64_t bad = -1;
  for (int64_t i = 0; i < n && bad < 0; ++i) {
    if (v[i] < 0 || v[i] >= upper) { bad = i; }
  }
  FLASH_EXT_REQUIRE(c, bad < 0, name,
            bad < 0 ? "" : "value " + std::to_string(v[bad]) + " at index " + std::to_string(bad),
            "must index " + what + " [0, " + std::to_string(upper) + ")");
}

void check_cu_seqlens_values(ArgChecker& c, int const* x, int64_t n, char const* name, int64_t total, bool total_exact,
                             int64_t max_seqlen, char const* max_name) {
  FLASH_EXT_REQUIRE(c, x[0] == 0, std::string(name) + "[0]", std::to_string(x[0]), "must be 0");
  int64_t first_drop = -1, longest = 0;
  for (int64_t i = 0; i + 1 < n; ++i) {
    if (x[i + 1] < x[i] && first_drop < 0) { first_drop = i + 1; }
    longest = std::max<int64_t>(longest, int64_t(x[i + 1]) - x[i]);
  }
  FLASH_EXT_REQUIRE(c, first_drop < 0, name,
            first_drop < 0 ? "" : "a decrease at index " + std::to_string(first_drop) + " (" +
                                      std::to_string(x[first_drop - 1]) + " then " +
                                      std::to_string(x[first_drop]) + ")",
            "must be non-decreasing");
  bool const total_ok = total_exact ? x[n - 1] == total : (x[n - 1] >= 0 && x[n - 1] <= total);
  FLASH_EXT_REQUIRE(c, total_ok, std::string(name) + "[-1]", std::to_string(x[n - 1]),
            std::string(total_exact ? "must equal " : "must be <= ") + "the number of rows " + std::to_string(total));
  // A negative max_seqlen is its own error (the caller's); one rule per wrong value.
  FLASH_EXT_REQUIRE(c, longest <= max_seqlen || max_seqlen < 0, max_name, std::to_string(max_seqlen),
            "must be >= the longest sequence in " + std::string(name) + " (" + std::to_string(longest) + ")");
}

void check_pages(ArgChecker& c, int const* table, int64_t width, int64_t batch, int64_t page_size, int64_t num_pages,
                 char const* which, std::string const& pages_of,
                 std::function<std::pair<int64_t, int64_t>(int64_t)> const& rows) {
  int64_t bad = -1, bad_col = -1;
  for (int64_t i = 0; i < batch && bad < 0; ++i) {
    auto const [begin, end] = rows(i);
    for (int64_t j = std::max<int64_t>(begin, 0) / page_size;
         j < std::min(width, (end + page_size - 1) / page_size); ++j) {
      int const page = table[i * width + j];
      if (bad < 0 && (page < 0 || page >= num_pages)) { bad = i, bad_col = j; }
    }
  }
  FLASH_EXT_REQUIRE(c, bad < 0, "block_table",
            bad < 0 ? "" : "value " + std::to_string(table[bad * width + bad_col]) + " at [" + std::to_string(bad) +
                               ", " + std::to_string(bad_col) + "]",
            std::string(which) + " must index " + pages_of + " pages [0, " + std::to_string(num_pages) + ")");
}

void check_paged_append(ArgChecker& c, int const* table, int64_t width, int64_t batch, int64_t page_size,
                        int const* len, int64_t seqlen_new) {
  if (seqlen_new <= 0) { return; }
  struct Access {
    int page;
    int64_t begin, end;   // rows within the page
    int64_t entry, slot;  // which entry, through which column of its table row
    bool write;
  };
  auto pages_of = [&](int64_t i) {
    return std::min(width, (int64_t(len[i]) + seqlen_new + page_size - 1) / page_size);
  };
  // The written pages first (one or two per entry), so that the reads recorded are only those of pages
  // somebody writes: a decode step's check stays one pass over the table, however long the caches.
  std::vector<Access> accesses;
  for (int64_t i = 0; i < batch; ++i) {
    int64_t const end = int64_t(len[i]) + seqlen_new;
    for (int64_t j = len[i] / page_size; j < pages_of(i); ++j) {
      int64_t const base = j * page_size;
      accesses.push_back({table[i * width + j], std::max<int64_t>(len[i] - base, 0), std::min(page_size, end - base),
                          i, j, true});
    }
  }
  std::vector<int> written;
  for (Access const& a : accesses) { written.push_back(a.page); }
  std::sort(written.begin(), written.end());
  for (int64_t i = 0; i < batch; ++i) {
    int64_t const end = int64_t(len[i]) + seqlen_new;
    for (int64_t j = 0; j < pages_of(i); ++j) {
      int const page = table[i * width + j];
      if (std::binary_search(written.begin(), written.end(), page)) {
        accesses.push_back({page, 0, std::min(page_size, end - j * page_size), i, j, false});
      }
    }
  }
  std::sort(accesses.begin(), accesses.end(), [](Access const& a, Access const& b) { return a.page < b.page; });
  for (size_t g = 0; g < accesses.size();) {  // one written page at a time
    size_t e = g;
    while (e < accesses.size() && accesses[e].page == accesses[g].page) { ++e; }
    for (size_t w = g; w < e; ++w) {
      if (!accesses[w].write) { continue; }
      for (size_t o = g; o < e; ++o) {
        Access const &a = accesses[w], &b = accesses[o];
        bool const same = a.entry == b.entry && a.slot == b.slot;
        if (same || std::max(a.begin, b.begin) >= std::min(a.end, b.end)) { continue; }
        int64_t const row = std::max(a.begin, b.begin);
        FLASH_EXT_REQUIRE(c, false, "block_table",
                  "page " + std::to_string(a.page) + " row " + std::to_string(row) + " appended to by batch entry " +
                      std::to_string(a.entry) + " (its row " + std::to_string(a.slot * page_size + row) + ") and " +
                      (b.write ? "appended to" : "read") + " by entry " + std::to_string(b.entry) + " (its row " +
                      std::to_string(b.slot * page_size + row) + ")",
                  "the page rows an append writes must belong to that entry and row alone");
        return;
      }
    }
    g = e;
  }
}

}  // namespace flash_ext::ops
