// What every op of the torch layer shares: argument checking that reports every unmet requirement at once,
// the FA2 2.8 argument semantics (window normalisation, score domain), tensor layouts into FwdParams, the
// split-KV decision, the one place that asks the CUDA device for its properties, output poisoning for tests,
// and the launch into the CPU or CUDA backend.  The op families (fwd.cpp, varlen.cpp, kvcache.cpp) are thin:
// check, allocate, fill params, launch.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flash_ext/fwd_api.h"
#include "flash_ext/params.h"

namespace flash_ext::ops {

inline constexpr int64_t kMaxSplits = 128;

// The kernels index rows and keys with 32-bit ints (tile arithmetic like m_block * kBlockM + kBlockM and
// the diagonal i + seqlen_k - seqlen_q + window_right stay below seqlen_q + seqlen_k + 512).  Problems whose
// lengths could overflow that are refused, never truncated.
inline constexpr int64_t kMaxLengthSum = (int64_t(1) << 31) - 1024;

// Collects every unmet requirement so the caller sees all of them in one error.
class ArgChecker {
 public:
  explicit ArgChecker(std::string op) : op_(std::move(op)) {}
  // One unmet requirement: what the argument got and the rule it breaks (FLASH_EXT_REQUIRE checks first).
  void fail(std::string const& arg, std::string const& got, std::string const& rule) {
    errors_.push_back(arg + ": got " + got + "; " + rule);
  }
  // Throws one ValueError listing every requirement that failed so far.  Every op calls it once, after all of
  // its checks and before anything is allocated for the kernel or written; in check-only mode (below) it
  // throws even with nothing to list, so the op runs its checks and nothing else.
  void raise_if_any() const;
  std::vector<std::string> const& errors() const { return errors_; }
  std::string const& op() const { return op_; }

 private:
  std::string op_;
  std::vector<std::string> errors_;
};

// Records an unmet requirement (checker.fail(arg, got, rule)) when ok is false, building arg, got and rule only
// then: built on every call, the messages (shapes and devices formatted through streams, concatenations) cost
// more than the checks themselves.  A macro because a function's arguments are evaluated before the call (as
// TORCH_CHECK's are not).
#define FLASH_EXT_REQUIRE(checker, ok, arg, got, rule)    \
  do {                                                   \
    if (!(ok)) { (checker).fail((arg), (got), (rule)); } \
  } while (false)

std::string str(at::IntArrayRef a);
std::string str(at::ScalarType t);
std::string str(at::Device d);
std::string str(double x);  // shortest round-trip form
DType to_dtype(at::ScalarType t);

// t's device if it is a CUDA device, else none: what an op's device guard takes (a CPU or meta tensor leaves
// the current device alone).
inline std::optional<c10::Device> cuda_device_of(at::Tensor const& t) {
  return t.is_cuda() ? std::optional<c10::Device>(t.device()) : std::nullopt;
}

// The facts about the device a call runs on that the dispatcher and the split heuristic need.  On CUDA this is
// the only code that queries the device: ATen caches the properties per device, so a call costs no driver
// round trip (cudaGetDeviceProperties costs about a millisecond, more than a decode step's kernel).
struct DeviceInfo {
  bool cuda = false;
  bool emulated = false;    // the warp emulator's sm_80 (see emulated())
  int cc_major = 0, cc_minor = 0;
  int processors = 1;       // SMs on CUDA (and of the emulated GPU), at::get_num_threads() on the CPU
  int smem_per_block_optin = 0;
  std::string name;         // "cpu", "<GPU name>, sm_XY" or "emulated sm_80"
};
DeviceInfo device_info(at::Device device);
// The device a call with this q runs on: device_info(q.device()), or the emulated sm_80 under emulated(q).
DeviceInfo call_device(at::Tensor const& q);

// The warp emulator (csrc/emu/, build knob FLASH_EXT_EMULATOR=1).  While the calling thread's mode is "sm80"
// (every thread starts from FLASH_EXT_EMULATE; flash_ext.emulate() sets its own thread's), CPU fp16/bf16 calls
// of every op run the Sm80 CUDA kernels on emulated warps instead of the host backend, and any finding of its
// checks fails the call.
// set_emulate returns the previous mode; "" turns it off; another mode, or "sm80" in a build without the
// emulator, is a ValueError (so is a call under such a FLASH_EXT_EMULATE value: never a silent fallback).
std::string set_emulate(std::string const& mode);
bool emulated(at::Tensor const& q);
bool emulator_built();
std::string emulator_head_dims_list();
std::string emulator_last_report();  // JSON report of the latest emulated launch ("{}" before the first)
// Test only: "narrow:<q|k|v|out>" tells the emulator that the last 16 bytes of that tensor are outside it, so
// a correct kernel's legitimate accesses there become bad_address findings; this shows that a finding fails
// the op call with its location.  "" (the default) turns it off; returns the previous setting.
std::string set_emulator_test_fault(std::string const& fault);

// q/k/v ranks, dtypes, devices, strides, head dims and heads.  Returns false if the ranks are wrong (later
// shape checks would be meaningless).  kv_cache: k/v are (batch_cache or num_pages, rows, heads_k, head_dim),
// not indexed by q's batch.  paged_varlen: varlen q with k/v as pages (num_pages, page_size, heads_k, d).
// any_head_dim: the op pads head dims that are not a multiple of 8 itself (the KV-cache op).
bool check_qkv(ArgChecker& c, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, bool varlen,
               bool kv_cache = false, bool paged_varlen = false, bool any_head_dim = false);

// Scale, softcap, ALiBi and num_splits rules (every window is valid: set_semantics normalises it).
// batch/heads < 0: not known (shape errors elsewhere).
void check_options(ArgChecker& c, at::Tensor const& q, int64_t batch, int64_t heads, double softmax_scale,
                   double softcap, std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits);

// Tensors an op writes must not share elements with one another, with themselves (an expand()ed tensor) or
// with what it reads: the result would depend on the order of the writes.  Dense tensors as torch decides it;
// strided views of one layout (the slices of one packed dqkv or KV cache, which interleave without sharing an
// element) exactly, from their offsets; other interleaved views sharing a byte range are refused as not
// provably disjoint (flash_attn checks none of it).
void check_no_overlap(ArgChecker& c, std::vector<std::pair<at::Tensor const*, char const*>> const& written,
                      std::vector<std::pair<at::Tensor const*, char const*>> const& read);

// seqlen_q + seqlen_k must leave the kernels' 32-bit row/key arithmetic room (kMaxLengthSum); with forced
// split-KV the partial accumulators' rows (b * seqlen_q, or total_q) must fit an int too.  `what` names the
// arguments the lengths come from.
void check_lengths(ArgChecker& c, int64_t seqlen_q, int64_t seqlen_k, std::string const& what, int64_t rows = 0,
                   int64_t num_splits = 1);

// Score domain, FA2 2.8 window semantics and ALiBi.  Needs p.seqlen_q/p.seqlen_k (maxima for varlen).
void set_semantics(FwdParams& p, double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                   double softcap, std::optional<at::Tensor> const& alibi_slopes);

// The GPU traits move 16-byte vectors: every row must start on a 16-byte boundary.
bool aligned16(at::Tensor const& t);
// Inputs of an Sm80 kernel (sm80: CUDA, or the emulated GPU) whose rows are not 16-byte aligned are copied
// into fresh (aligned) storage; the host backend reads element-wise and uses its inputs as they are.
at::Tensor aligned_for_kernel(at::Tensor const& t, bool sm80);
// A small tensor the kernels read by element (index arrays, ALiBi slopes, LSE and its gradient, RNG state), as
// they read it: contiguous and at an address that is a multiple of its element size.  A view made by
// torch.frombuffer or imported through DLPack can start at any byte, and .contiguous() keeps the address: on
// a GPU a misaligned 4- or 8-byte load is a fault that ends the CUDA context (the emulator flags it as a bad
// address), and on the host it is undefined behaviour.  Such a tensor is copied to fresh storage.
at::Tensor element_aligned(at::Tensor const& t);
// Tensor layouts into params; q/k/v are 4-D (fixed length) or 3-D (varlen: no batch stride).  Paged k/v are
// 4-D under a 3-D varlen q: their "batch" stride is the page stride.
void set_inputs(FwdParams& p, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v);
// The same without the pointers (a plan: the CPU's decode splits depend on how K/V heads lie in memory).
void set_input_shapes(FwdParams& p, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v);
// out and softmax_lse layouts (outputs of the forward, inputs of the backward).
void set_outputs(FwdParams& p, at::Tensor const& out, at::Tensor const& lse);

// Tensors a launch reads, kept alive until it returns: CUDA inputs realigned where needed (copies),
// contiguous ALiBi slopes.  prepare_inputs also poisons the outputs in test mode and records every layout.
struct KernelInputs {
  at::Tensor q, k, v;
  std::optional<at::Tensor> alibi;
};
KernelInputs prepare_inputs(FwdParams& p, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                            at::Tensor& out, at::Tensor& lse, std::optional<at::Tensor> const& alibi_slopes);

// num_splits: 0 = heuristic (dispatch.h), 1 = off, > 1 = forced.  With more than one split, allocates the
// fp32 partial accumulators (returned to keep them alive for the launch; poisoned in test mode).  Needs
// p.b/h/d/seqlen_q/seqlen_k; accum_rows is b * seqlen_q, or total_q for varlen.
std::tuple<at::Tensor, at::Tensor> set_splits(FwdParams& p, at::Tensor const& q, int64_t requested,
                                              int64_t accum_rows, bool allocate = true);

// Test mode: outputs (and split partials) are filled with NaN before a kernel runs, so an element a kernel
// forgets to write fails the comparison.  Returns the previous setting.
bool set_poison_outputs(bool enable);
bool poison_outputs();

// Check-only mode, per thread: an op called in it checks its arguments and returns nothing, always through
// ArgChecker::raise_if_any's ValueError (with the list it found, perhaps empty).  The Python layer uses it to
// list the op's own unmet requirements beside the Python-side ones when a call breaks both (varlen's
// dropout_p given as a tensor and a bad q dtype): one error with everything.  Returns the previous setting.
// Python reaches it only through _C.check_only(fn, *args), which restores it however fn ends.
bool set_check_only(bool enable);

// What would run for these params: backend, tile, the flags the kernel is specialised on, variant, shared
// memory, grid, estimated HBM traffic; or ok=false with the reasons.  Runs nothing.
struct Plan {
  bool ok = true;
  std::vector<std::string> reasons;
  std::string device, backend, variant;
  std::string cpu_isa;  // CPU: the instruction-set level whose micro-kernels run (host_isa.h)
  int head_dim = 0, head_dim_tile = 0, block_m = 0, block_n = 0, threads_per_cta = 0, smem_bytes = 0;
  int ctas_per_sm = 1;  // Sm80 paths: resident CTAs per SM of the tile (the split heuristic's slots)
  int64_t grid[3] = {0, 0, 0};  // Sm80 paths: the launch grid (grid.h); host: (m_blocks, batch, heads x splits)
  bool emulated = false;
  int num_splits = 1;
  bool varlen = false;
  bool even_mn = false, even_k = false, causal = false, local = false, alibi = false, softcap = false;
  bool dropout = false;
  int window_left = -1, window_right = -1;
  int64_t hbm_bytes = 0, naive_hbm_bytes = 0;  // estimates: flash_ext vs attention materialising S and P
  // The problem as the kernel sees it (after the decode query-group swap), for the roofline model.
  int b = 0, h = 0, h_k = 0, seqlen_q = 0, seqlen_k = 0, element_size = 0;
};
Plan make_plan(FwdParams const& p, at::Tensor const& q);
std::string plan_to_json(Plan const& plan);

// Plan-only mode, per thread: a forward op checks its arguments and prepares its launch as usual, then records
// the plan (make_plan) instead of launching.  Nothing of the caller's is written (kvcache_fwd skips its append)
// and no generator is drawn (set_dropout); the backward ops refuse to run in it.  Python reaches it only
// through _C.plan_only(fn, *args, **kwargs), which returns the plan recorded and restores the mode: what
// flash_ext.explain_call reports for any public forward function.
bool set_plan_only(bool enable);
bool plan_only();
// The plan the last launch recorded in plan-only mode on this thread (reset by set_plan_only(true)).
std::optional<Plan> const& recorded_plan();

// Runs the kernel for params on q's device (CPU backend, CUDA, or the warp emulator), logging the plan with
// FLASH_EXT_LOG=1.  `in`, `out` and the split accumulators are the tensors the kernel may touch (the
// emulator checks every global access against them).
void launch(FwdParams const& params, KernelInputs const& in, at::Tensor const& out,
            std::tuple<at::Tensor, at::Tensor> const& accum, char const* op);

// Decode with grouped heads: one query row per sequence and g = h / h_k query heads per K/V head.  Viewing
// the g query heads of a group as g query rows of one head (flash_attn's "seqlenq_ngroups_swapped") fills
// the M tile with g real rows instead of 1 and reads each K/V tile once per group instead of g times.
// Exact without ALiBi (slopes differ per query head) and without a left window (the rows would get
// different diagonals); a one-row causal mask shows every key anyway.
bool swap_query_groups(at::Tensor const& q, at::Tensor const& k, int64_t window_left, int64_t seqlen_k,
                       std::optional<at::Tensor> const& alibi_slopes);
// (b, 1, h, d) -> (b, g, h_k, d): query head kh * g + i becomes row i of head kh.
at::Tensor groups_as_rows(at::Tensor const& q, int64_t h_k);
// The results of such a call, allocated in the caller's layout (out (b, 1, h, d), lse (b, h, 1)), and the views
// of them that the kernel writes as rows (out_rows (b, g, h_k, d), lse_rows (b, h_k, g)): the kernel's strided
// output lands where the caller wants it, with no copy afterwards (that copy was about a quarter of the op's
// time in a small decode call on the CPU: ATen's dispatch, not the bytes; docs/perf.md).
struct GroupedOutputs {
  at::Tensor out, lse, out_rows, lse_rows;
};
GroupedOutputs grouped_outputs(at::Tensor const& q, int64_t h_k);

// The host / GPU head dims this build compiled (FLASH_EXT_HOST_HEADDIMS, FLASH_EXT_HEADDIMS), comma-separated.
std::string host_head_dims_list();
std::string gpu_head_dims_list();
// The head dims of kGpuHeadDims whose bit is set in mask (a FLASH_EXT_*_HEADDIMS_MASK), in order.
std::vector<int> gpu_head_dims_in(int mask);
// The smallest compiled GPU head dim >= d, or -1 (the CUDA dispatcher's rule).
int gpu_built_head_dim_for(int d);

}  // namespace flash_ext::ops
