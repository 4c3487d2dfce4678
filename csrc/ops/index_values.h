// Index tensors (cu_seqlens, seqused_k, cache lengths, cache batch indices, left padding, block tables) are
// validated on the host before a kernel reads through them: a bad value is a ValueError, never an
// out-of-bounds read or write.  On CUDA that needs their values on the host: IndexValues gathers every index
// tensor of one op call and reads them with ONE device-to-host copy (one synchronisation per call).  Values
// are trusted instead (and invalid ones are undefined behaviour, as in flash_attn) while the current CUDA
// stream is capturing a graph, where a copy would break the capture, or with FLASH_EXT_TRUST_CU_SEQLENS=1.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace flash_ext::ops {

class IndexValues {
 public:
  // Registers an int32 tensor to be read; returns its slot (absent tensors get an empty slot).
  int add(std::optional<at::Tensor> const& t);
  // Reads every registered tensor on the host: no copy on the CPU, one copy of their concatenation on
  // CUDA.  Returns false, reading nothing, when the values are to be trusted (see above).  Call once.
  bool read(at::Device device);
  int const* values(int slot) const { return numel_[slot] ? host_ptr_ + offset_[slot] : nullptr; }
  int64_t numel(int slot) const { return numel_[slot]; }

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<int64_t> offset_, numel_;
  at::Tensor host_;
  int const* host_ptr_ = nullptr;
};

// How many IndexValues::read calls have read values (CPU or CUDA) since the extension was loaded: a debug
// counter, so tests can assert one host read per op call.
int64_t index_reads();

// An optional int32 index tensor with `rank` dims and `batch` rows (batch < 0: not known) on `device`.
bool check_index_tensor(ArgChecker& c, std::optional<at::Tensor> const& t, char const* name, int64_t rank,
                        int64_t batch, at::Device device, char const* device_owner);

// cu_seqlens_q and cu_seqlens_k of a varlen call: 1-D int32 of one length (batch + 1 >= 1) on `device`.
// Returns false if either is unusable (their values must not be read then).
bool check_cu_seqlens_pair(ArgChecker& c, at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k,
                           at::Device device);

// Every value of `name` (n values at v) lies in [0, upper).
void check_index_range(ArgChecker& c, int const* v, int64_t n, char const* name, int64_t upper,
                       std::string const& what);

// cu_seqlens (n values): starts at 0, never decreases, ends at (total_exact) or within `total` rows, longest
// sequence <= max_seqlen.
void check_cu_seqlens_values(ArgChecker& c, int const* x, int64_t n, char const* name, int64_t total, bool total_exact,
                             int64_t max_seqlen, char const* max_name);

// Rows [rows(i).first, rows(i).second) of batch entry i live in pages table[i * width + row / page_size]; each
// such page must be one of the num_pages pages.  Rows past the table's width are reported by the caller.
void check_pages(ArgChecker& c, int const* table, int64_t width, int64_t batch, int64_t page_size, int64_t num_pages,
                 char const* which, std::string const& pages_of,
                 std::function<std::pair<int64_t, int64_t>(int64_t)> const& rows);

// A paged append writes rows [len[i], len[i] + seqlen_new) of each entry i through its pages while every entry
// reads rows [0, len[i] + seqlen_new).  A page row written as one (entry, row) and read or written as another
// makes the result depend on the order of the writes: refused.  Pages shared only for reading (a common
// prefix) are fine.
void check_paged_append(ArgChecker& c, int const* table, int64_t width, int64_t batch, int64_t page_size,
                        int const* len, int64_t seqlen_new);

}  // namespace flash_ext::ops
