// The torch op layer: schema, argument checks, FA2 window normalisation, output allocation, and the
// call into the CPU or CUDA backend through raw pointers (flash_ext/fwd_api.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <Python.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#if defined(FLASH_EXT_WITH_CUDA)
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "flash_ext/fwd_api.h"
#include "flash_ext/dispatch.h"
#include "flash_ext/launch_host.h"

// Importing flash_ext._C registers the ops below; the module itself exposes nothing.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}

namespace flash_ext {
namespace {

std::atomic<bool> g_poison_outputs{false};
constexpr int64_t kMaxSplits = 128;

// Collects every unmet requirement so the caller sees all of them in one error.
class ArgChecker {
 public:
  explicit ArgChecker(std::string op) : op_(std::move(op)) {}
  void require(bool ok, std::string const& arg, std::string const& got, std::string const& rule) {
    if (!ok) { errors_.push_back(arg + ": got " + got + "; " + rule); }
  }
  void raise_if_any() const {
    if (errors_.empty()) { return; }
    std::ostringstream os;
    os << op_ << ": " << errors_.size() << " invalid argument" << (errors_.size() > 1 ? "s" : "") << ":";
    for (auto const& e : errors_) { os << "\n  - " << e; }
    TORCH_CHECK_VALUE(false, os.str());
  }
  std::vector<std::string> const& errors() const { return errors_; }

 private:
  std::string op_;
  std::vector<std::string> errors_;
};

// The host head dims this build compiled (FLASH_EXT_HOST_HEADDIMS), comma-separated.
std::string host_head_dims_list() {
  std::string s;
  for (int hd : kHostHeadDims) {
    if (host_head_dim_compiled(hd)) { s += (s.empty() ? "" : ", ") + std::to_string(hd); }
  }
  return s.empty() ? "none" : s;
}

std::string str(at::IntArrayRef a) {
  std::ostringstream os;
  os << a;
  return os.str();
}
std::string str(at::ScalarType t) { return std::string(c10::toString(t)); }
std::string str(at::Device d) { return d.str(); }

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

// The GPU traits move 16-byte vectors: every row must start on a 16-byte boundary.
bool aligned16(at::Tensor const& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) { return false; }
  for (int i = 0; i < t.dim() - 1; ++i) {
    if (t.size(i) > 1 && t.stride(i) % 8 != 0) { return false; }
  }
  return true;
}

// Shapes: fixed-length q (b, sq, h, d), k/v (b, sk, hk, d); varlen q (total_q, h, d), k/v (total_k, hk, d).
// Returns false if the ranks are wrong (later shape checks would be meaningless).
// kv_cache: k/v are (batch_cache or num_pages, rows, heads_k, head_dim), not indexed by q's batch.
// paged_varlen: varlen q with k/v as pages (num_pages, page_size, heads_k, head_dim).
bool check_qkv(ArgChecker& c, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, bool varlen,
               bool kv_cache = false, bool paged_varlen = false) {
  int64_t const rank = varlen ? 3 : 4;
  int64_t const kv_rank = varlen && !paged_varlen ? 3 : 4;
  std::string const q_rule = varlen ? "must be (total_q, heads, head_dim)" : "must be (batch, seqlen_q, heads, head_dim)";
  std::string const kv_rule = paged_varlen ? "must be (num_pages, page_size, heads_k, head_dim) with block_table"
                              : varlen     ? "must be (total_k, heads_k, head_dim)"
                                           : "must be (batch, seqlen_k, heads_k, head_dim)";
  c.require(q.dim() == rank, "q", std::to_string(q.dim()) + " dims " + str(q.sizes()), q_rule);
  c.require(k.dim() == kv_rank, "k", std::to_string(k.dim()) + " dims " + str(k.sizes()), kv_rule);
  c.require(v.dim() == kv_rank, "v", std::to_string(v.dim()) + " dims " + str(v.sizes()), kv_rule);
  auto const dt = q.scalar_type();
  bool const dtype_ok = dt == at::kHalf || dt == at::kBFloat16 || (dt == at::kFloat && q.device().is_cpu());
  c.require(dtype_ok, "q.dtype", str(dt), q.device().is_cpu() ? "must be float16, bfloat16 or float32" : "must be float16 or bfloat16 on CUDA");
  c.require(k.scalar_type() == dt && v.scalar_type() == dt, "k.dtype/v.dtype",
            str(k.scalar_type()) + "/" + str(v.scalar_type()), "must equal q.dtype (" + str(dt) + ")");
  c.require(k.device() == q.device() && v.device() == q.device(), "k.device/v.device",
            str(k.device()) + "/" + str(v.device()), "must equal q.device (" + str(q.device()) + ")");
  for (auto const& [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
    if (t->dim() >= 1) {
      c.require(t->stride(-1) == 1 || t->size(-1) <= 1, std::string(name) + ".stride(-1)", std::to_string(t->stride(-1)),
                "the last dimension must be contiguous");
    }
  }
  bool const ranks_ok = q.dim() == rank && k.dim() == kv_rank && v.dim() == kv_rank;
  if (!ranks_ok) { return false; }
  int64_t const d = q.size(-1), h = q.size(-2), hk = k.size(-2);
  c.require(d >= 1 && d <= 256, "head_dim", std::to_string(d), "must be in [1, 256]");
  c.require(d % 8 == 0, "head_dim", std::to_string(d), "must be a multiple of 8 at the op (the Python functions pad other sizes)");
  if (q.device().is_cpu() && d >= 1 && d <= 256 && host_head_dim_for(int(d)) < 0) {
    c.require(false, "head_dim", std::to_string(d),
              "no CPU kernel for it in this build (compiled host head dims: " + host_head_dims_list() +
                  "); rebuild with FLASH_EXT_HOST_HEADDIMS including a head dim >= " + std::to_string(d));
  }
  c.require(k.sizes() == v.sizes(), "v.shape", str(v.sizes()), "must equal k.shape " + str(k.sizes()));
  if (!varlen && !kv_cache) {
    c.require(k.size(0) == q.size(0), "k.shape[0]", std::to_string(k.size(0)), "must equal q batch " + std::to_string(q.size(0)));
  }
  c.require(k.size(-1) == d, "k.shape[-1]", std::to_string(k.size(-1)), "must equal q head_dim " + std::to_string(d));
  c.require(hk > 0 && h % hk == 0, "heads", "q " + std::to_string(h) + ", k/v " + std::to_string(hk),
            "q heads must be a multiple of k/v heads (MQA/GQA)");
  return true;
}

void check_options(ArgChecker& c, at::Tensor const& q, int64_t batch, int64_t heads, double softmax_scale,
                   int64_t window_left, int64_t window_right, double softcap,
                   std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits) {
  c.require(num_splits >= 0 && num_splits <= kMaxSplits, "num_splits", std::to_string(num_splits),
            "must be 0 (heuristic), 1 (no split) or a split count up to " + std::to_string(kMaxSplits));
  c.require(window_left >= -1, "window_size[0]", std::to_string(window_left), "must be >= -1 (-1: unbounded)");
  c.require(window_right >= -1, "window_size[1]", std::to_string(window_right), "must be >= -1 (-1: unbounded)");
  c.require(softcap >= 0 && std::isfinite(softcap), "softcap", std::to_string(softcap), "must be finite and >= 0 (0: off)");
  // Masked scores are -inf in the kernel's unscaled domain; a scale <= 0 would turn them into NaN or +inf.
  c.require(std::isfinite(softmax_scale) && softmax_scale > 0, "softmax_scale", std::to_string(softmax_scale),
            "must be finite and > 0");
  if (alibi_slopes.has_value()) {
    auto const& a = *alibi_slopes;
    bool const shape_ok = (a.dim() == 1 && a.size(0) == heads) || (a.dim() == 2 && a.size(0) == batch && a.size(1) == heads);
    c.require(shape_ok || heads < 0, "alibi_slopes.shape", str(a.sizes()),
              "must be (heads,) = (" + std::to_string(heads) + ",) or (batch, heads) = (" + std::to_string(batch) + ", " +
                  std::to_string(heads) + ")");
    c.require(a.scalar_type() == at::kFloat, "alibi_slopes.dtype", str(a.scalar_type()), "must be float32");
    c.require(a.device() == q.device(), "alibi_slopes.device", str(a.device()), "must equal q.device (" + str(q.device()) + ")");
  }
}

// Tensor layouts into params; q/k/v/out are 4-D (fixed length) or 3-D (varlen: no batch stride).  Paged
// k/v are 4-D under a 3-D varlen q: their "batch" stride is the page stride.
void set_inputs(FwdParams& p, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v) {
  int const r = int(q.dim()) - 3;   // index of q's row (sequence) dimension
  int const rk = int(k.dim()) - 3;  // and of k's and v's
  p.q_ptr = q.data_ptr();
  p.k_ptr = k.data_ptr();
  p.v_ptr = v.data_ptr();
  p.q_batch_stride = r ? q.stride(0) : 0, p.q_row_stride = q.stride(r), p.q_head_stride = q.stride(r + 1);
  p.k_batch_stride = rk ? k.stride(0) : 0, p.k_row_stride = k.stride(rk), p.k_head_stride = k.stride(rk + 1);
  p.v_batch_stride = rk ? v.stride(0) : 0, p.v_row_stride = v.stride(rk), p.v_head_stride = v.stride(rk + 1);
  p.h = int(q.size(r + 1));
  p.d = int(q.size(r + 2));
  p.h_k = int(k.size(rk + 1));
  p.h_h_k_ratio = p.h / p.h_k;
}

void set_outputs(FwdParams& p, at::Tensor& out, at::Tensor& lse) {
  int const r = int(out.dim()) - 3;
  p.o_ptr = out.data_ptr();
  p.softmax_lse_ptr = lse.data_ptr<float>();
  p.o_batch_stride = r ? out.stride(0) : 0, p.o_row_stride = out.stride(r), p.o_head_stride = out.stride(r + 1);
}

// Score domain, FA2 2.8 window semantics and ALiBi.  Needs p.seqlen_q/p.seqlen_k (maxima for varlen).
void set_semantics(FwdParams& p, double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                   double softcap, std::optional<at::Tensor> const& alibi_slopes) {
  p.softmax_scale = float(softmax_scale);
  p.softcap = float(softcap);
  if (softcap > 0) {
    p.softcap_prescale = float(softmax_scale / softcap);
    p.score_scale = float(softcap);
  } else {
    p.score_scale = float(softmax_scale);
  }
  p.score_scale_log2 = float(double(p.score_scale) * M_LOG2E);

  // A side that bounds nothing becomes -1, so the cheaper kernel runs: the left bound i + sk - sq - left is
  // <= 0 for every row when left >= sk - 1, the right bound i + sk - sq + right >= sk - 1 for every row
  // when right >= sq - 1.  (flash_attn 2.8 uses right >= sk, which also drops keys the window hides when
  // sq > sk + 1; the documented rule is kept here.)  For varlen, sq and sk are the maxima: still exact.
  // causal is window (-1, 0) (a finite left window with causal makes a local problem).  With one query
  // row, bottom-right causal shows every key.
  if (window_left >= std::max(p.seqlen_k - 1, 0)) { window_left = -1; }
  if (window_right >= std::max(p.seqlen_q - 1, 0)) { window_right = -1; }
  if (causal) { window_right = 0; }
  p.window_left = int(window_left);
  p.window_right = int(window_right);
  p.is_causal = window_left < 0 && window_right == 0;
  if (p.is_causal && p.seqlen_q == 1) {
    p.is_causal = false;
    p.window_right = -1;
  }
  p.is_local = !p.is_causal && (p.window_left >= 0 || p.window_right >= 0);

  if (alibi_slopes.has_value()) {
    p.alibi_slopes_ptr = alibi_slopes->data_ptr<float>();
    p.alibi_slopes_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  }
}

std::string json_escape(std::string const& x) {
  std::string out;
  for (char ch : x) {
    if (ch == '"' || ch == '\\') { out += '\\'; }
    out += ch;
  }
  return out;
}

// What would run for these params, as one JSON object: the backend, the traits' tile, the flag values the
// kernel is specialised on, the variant, shared memory and grid; or ok=false with the reasons.
std::string plan_json(FwdParams const& p, at::Tensor const& q) {
  std::ostringstream os;
  int block_m = 0, block_n = 0, head_dim = 0, threads = 0, smem = 0;
  std::string backend, variant = "runtime flags", why, device = q.device().str();
  bool ok = true;
  if (q.device().is_cpu()) {
    backend = "host traits (CPU)";
    head_dim = host_head_dim_for(p.d);
    block_m = host_block_m(p.seqlen_q);
    block_n = kHostBlockN;
    threads = 1;
    smem = (block_m + 2 * block_n) * head_dim * int(q.element_size());
  } else {
#if defined(FLASH_EXT_WITH_CUDA)
    backend = "Sm80 traits (CUDA)";
    int const idx = q.device().index();
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, idx) == cudaSuccess) {
      device += " (" + std::string(prop.name) + ", sm_" + std::to_string(prop.major * 10 + prop.minor) + ")";
      CudaPlan const cp = plan_fwd_cuda(p, to_dtype(q.scalar_type()), prop.major, prop.minor,
                                        int(prop.sharedMemPerBlockOptin));
      ok = cp.ok;
      why = cp.why;
      head_dim = cp.head_dim, block_m = cp.block_m, block_n = cp.block_n, threads = 32 * cp.num_warps,
      smem = cp.smem_bytes;
      variant = cp.variant_name;
    } else {
      ok = false;
      why = "cannot query the CUDA device";
    }
#else
    ok = false;
    why = "flash_ext was built without CUDA";
#endif
  }
  ProblemFlags const f = ok && block_m ? problem_flags(p, block_m, block_n, head_dim) : ProblemFlags{};
  int const grid_m = block_m ? (p.seqlen_q + block_m - 1) / block_m : 0;
  auto b = [](bool x) { return x ? "true" : "false"; };
  os << "{\"ok\": " << b(ok) << ", \"reasons\": [" << (why.empty() ? "" : "\"" + json_escape(why) + "\"") << "]"
     << ", \"device\": \"" << json_escape(device) << "\", \"backend\": \"" << backend << "\""
     << ", \"head_dim\": " << p.d << ", \"head_dim_tile\": " << head_dim << ", \"block_m\": " << block_m
     << ", \"block_n\": " << block_n << ", \"threads_per_cta\": " << threads << ", \"smem_bytes\": " << smem
     << ", \"variant\": \"" << variant << "\", \"grid\": [" << grid_m << ", " << p.b << ", " << p.h << "]"
     << ", \"num_splits\": " << p.num_splits << ", \"varlen\": " << b(p.cu_seqlens_q != nullptr)
     << ", \"flags\": {\"even_mn\": " << b(f.even_mn) << ", \"even_k\": " << b(f.even_k) << ", \"causal\": "
     << b(p.is_causal) << ", \"local\": " << b(p.is_local) << ", \"alibi\": " << b(p.alibi_slopes_ptr != nullptr)
     << ", \"softcap\": " << b(p.softcap > 0) << ", \"split\": " << b(p.num_splits > 1) << "}, \"window\": [" << p.window_left << ", " << p.window_right << "]}";
  return os.str();
}

void launch(FwdParams const& params, at::Tensor const& q, char const* op) {
  static bool const log = [] {
    char const* e = std::getenv("FLASH_EXT_LOG");
    return e != nullptr && std::string(e) == "1";
  }();
  if (log) { std::fprintf(stderr, "[flash_ext] %s %s\n", op, plan_json(params, q).c_str()); }
  if (q.device().is_cpu()) {
    run_fwd_cpu(params, to_dtype(q.scalar_type()));
    return;
  }
#if defined(FLASH_EXT_WITH_CUDA)
  c10::cuda::CUDAGuard guard(q.device());
  std::string const err = run_fwd_cuda(params, to_dtype(q.scalar_type()), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err.empty(), op, " (CUDA): ", err);
#else
  TORCH_CHECK(false, op, ": flash_ext was built without CUDA; rebuild with a CUDA toolkit or pass CPU tensors");
#endif
}

// CUDA inputs whose rows are not 16-byte aligned are copied into fresh (aligned) storage; CPU inputs are
// read element-wise and used as they are.
at::Tensor aligned_for_kernel(at::Tensor const& t) {
  if (!t.is_cuda() || aligned16(t)) { return t; }
  at::Tensor c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}

// The tile sizes and processor count the split heuristic works with, for the device that will run.
struct SplitContext {
  int block_m = 0, block_n = 0, processors = 1;
};

SplitContext split_context(FwdParams const& p, at::Tensor const& q) {
  SplitContext ctx;
  if (q.device().is_cpu()) {
    ctx.block_m = host_block_m(p.seqlen_q), ctx.block_n = kHostBlockN, ctx.processors = at::get_num_threads();
    return ctx;
  }
#if defined(FLASH_EXT_WITH_CUDA)
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, q.device().index()) == cudaSuccess) {
    CudaPlan const plan =
        plan_fwd_cuda(p, to_dtype(q.scalar_type()), prop.major, prop.minor, int(prop.sharedMemPerBlockOptin));
    ctx.block_m = plan.block_m, ctx.block_n = plan.block_n, ctx.processors = prop.multiProcessorCount;
  }
#endif
  return ctx;
}

// num_splits: 0 = heuristic (dispatch.h, num_splits_heuristic), 1 = off, > 1 = forced.  With more than one
// split, allocates the fp32 accumulators for the partials (returned to keep them alive for the launch).
std::tuple<at::Tensor, at::Tensor> set_splits(FwdParams& p, at::Tensor const& q, int64_t requested, int64_t accum_rows,
                                              bool allocate = true) {
  p.num_splits = 1;
  if (requested != 1) {
    SplitContext const ctx = split_context(p, q);
    if (requested > 1) {
      p.num_splits = int(requested);
    } else if (ctx.block_m > 0) {
      int const ctas = p.b * p.h * ceil_div(p.seqlen_q, ctx.block_m);
      p.num_splits = num_splits_heuristic(ctas, ctx.processors, ceil_div(p.seqlen_k, ctx.block_n), int(kMaxSplits));
    }
  }
  if (p.num_splits == 1 || !allocate) { return {}; }
  auto const opts = q.options().dtype(at::kFloat);
  at::Tensor oaccum = at::empty({p.num_splits, p.h, accum_rows, p.d}, opts);
  at::Tensor lseaccum = at::empty({p.num_splits, p.h, accum_rows}, opts);
  if (g_poison_outputs.load(std::memory_order_relaxed)) {  // every partial must be written, empty splits too
    oaccum.fill_(NAN);
    lseaccum.fill_(NAN);
  }
  p.accum_rows = int(accum_rows);
  p.oaccum_ptr = oaccum.data_ptr<float>();
  p.lseaccum_ptr = lseaccum.data_ptr<float>();
  return {oaccum, lseaccum};
}

void maybe_poison(at::Tensor& out, at::Tensor& lse) {
  if (g_poison_outputs.load(std::memory_order_relaxed)) {
    out.fill_(NAN);
    lse.fill_(NAN);
  }
}

// Tensors a launch reads, kept alive until it returns: CUDA inputs realigned where needed (copies),
// contiguous ALiBi slopes.  Also poisons the outputs in test mode and records all layouts in params.
struct KernelInputs {
  at::Tensor q, k, v;
  std::optional<at::Tensor> alibi;
};

KernelInputs prepare_inputs(FwdParams& p, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                            at::Tensor& out, at::Tensor& lse, std::optional<at::Tensor> const& alibi_slopes) {
  maybe_poison(out, lse);
  KernelInputs in{aligned_for_kernel(q), aligned_for_kernel(k), aligned_for_kernel(v), std::nullopt};
  if (alibi_slopes.has_value()) { in.alibi = alibi_slopes->contiguous(); }
  set_inputs(p, in.q, in.k, in.v);
  set_outputs(p, out, lse);
  return in;
}

// Decode with grouped heads: one query row per sequence and g = h / h_k query heads per K/V head.  Viewing
// the g query heads of a group as g query rows of one head (flash_attn's "seqlenq_ngroups_swapped") fills
// the M tile with g real rows instead of 1 and reads each K/V tile once per group instead of g times.
// Exact without ALiBi (slopes differ per query head) and without a left window (the rows would get
// different diagonals); a one-row causal mask shows every key anyway.
bool swap_query_groups(at::Tensor const& q, at::Tensor const& k, int64_t window_left, int64_t seqlen_k,
                       std::optional<at::Tensor> const& alibi_slopes) {
  return q.dim() == 4 && q.size(1) == 1 && q.size(2) > k.size(2) && !alibi_slopes.has_value() &&
         (window_left < 0 || window_left >= seqlen_k - 1);
}

// (b, 1, h, d) -> (b, g, h_k, d): query head kh * g + i becomes row i of head kh.
at::Tensor groups_as_rows(at::Tensor const& q, int64_t h_k) {
  int64_t const b = q.size(0), h = q.size(2), d = q.size(3);
  return q.reshape({b, h_k, h / h_k, d}).transpose(1, 2);
}

// The inverse for the results: out (b, g, h_k, d) -> (b, 1, h, d), lse (b, h_k, g) -> (b, h, 1).
std::tuple<at::Tensor, at::Tensor> rows_as_groups(std::tuple<at::Tensor, at::Tensor> const& r) {
  auto const& [out, lse] = r;
  int64_t const b = out.size(0), g = out.size(1), hk = out.size(2), d = out.size(3);
  return {out.transpose(1, 2).reshape({b, 1, hk * g, d}), lse.reshape({b, hk * g, 1})};
}

std::tuple<at::Tensor, at::Tensor> fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                       double softmax_scale, bool causal, int64_t window_left,
                                       int64_t window_right, double softcap,
                                       std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits) {
  ArgChecker c("flash_ext.fwd");
  bool const shapes_ok = check_qkv(c, q, k, v, /*varlen=*/false);
  check_options(c, q, shapes_ok ? q.size(0) : -1, shapes_ok ? q.size(2) : -1, softmax_scale, window_left,
                window_right, softcap, alibi_slopes, num_splits);
  c.raise_if_any();
  if (swap_query_groups(q, k, window_left, k.size(1), alibi_slopes)) {
    return rows_as_groups(fwd(groups_as_rows(q, k.size(2)), k, v, softmax_scale, /*causal=*/false, -1, -1, softcap,
                              alibi_slopes, num_splits));
  }
  int64_t const b = q.size(0), sq = q.size(1), h = q.size(2), d = q.size(3), sk = k.size(1);
  at::Tensor out = at::empty({b, sq, h, d}, q.options());
  at::Tensor lse = at::empty({b, h, sq}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) { return {out, lse}; }
  if (sk == 0) {  // no key at all: every row is empty
    out.zero_();
    lse.fill_(INFINITY);
    return {out, lse};
  }
  FwdParams p;
  KernelInputs const in = prepare_inputs(p, q, k, v, out, lse, alibi_slopes);
  p.b = int(b);
  p.seqlen_q = int(sq);
  p.seqlen_k = int(sk);
  set_semantics(p, softmax_scale, causal, window_left, window_right, softcap, in.alibi);
  auto const accum = set_splits(p, in.q, num_splits, b * sq);
  launch(p, q, "flash_ext.fwd");
  return {out, lse};
}

// Index values (cu_seqlens, cache lengths, batch indices, pages) are checked on the CPU: a host copy when
// they live on the GPU (one synchronisation).  FLASH_EXT_TRUST_CU_SEQLENS=1 skips that on CUDA for callers
// that guarantee valid values; invalid values are then undefined behaviour, as in flash_attn.
bool check_index_values(at::Device device) {
  static bool const trust = [] {
    char const* e = std::getenv("FLASH_EXT_TRUST_CU_SEQLENS");
    return e != nullptr && std::string(e) == "1";
  }();
  return device.is_cpu() || !trust;
}

// An optional int32 index tensor with `rank` dims and `batch` rows (batch < 0: unknown yet) on `device`.
bool check_index_tensor(ArgChecker& c, std::optional<at::Tensor> const& t, char const* name, int64_t rank,
                        int64_t batch, at::Device device, char const* device_owner) {
  if (!t.has_value()) { return true; }
  bool const ok = t->dim() == rank && t->scalar_type() == at::kInt && t->device() == device &&
                  (batch < 0 || t->size(0) == batch);
  c.require(ok, name, str(t->scalar_type()) + " " + str(t->sizes()) + " on " + str(t->device()),
            "must be an int32 tensor with " + std::to_string(rank) + " dims and batch (" + std::to_string(batch) +
                ") rows on " + device_owner + "'s device");
  return ok;
}

// Every value of the 1-D int32 index tensor `idx` must lie in [0, upper).
void check_index_range(ArgChecker& c, at::Tensor const& idx, char const* name, int64_t upper, std::string const& what) {
  at::Tensor host = idx.to(at::kCPU).contiguous();
  int64_t bad = -1;
  for (int64_t i = 0; i < host.numel() && bad < 0; ++i) {
    int const x = host.data_ptr<int>()[i];
    if (x < 0 || x >= upper) { bad = i; }
  }
  c.require(bad < 0, name, "value at index " + std::to_string(bad),
            "must index " + what + " [0, " + std::to_string(upper) + ")");
}

// Rows [rows(i).first, rows(i).second) of batch entry i live in pages block_table[i, row / page_size]; each
// such page must be one of the num_pages pages.  Rows past the table's width are someone else's error.
template <class Rows>
void check_pages(ArgChecker& c, at::Tensor const& block_table, int64_t batch, int64_t page_size, int64_t num_pages,
                 char const* which, std::string const& pages_of, Rows rows) {
  at::Tensor table = block_table.to(at::kCPU).contiguous();
  int64_t const width = table.size(1);
  int64_t bad = -1;
  for (int64_t i = 0; i < batch && bad < 0; ++i) {
    auto const [begin, end] = rows(i);
    for (int64_t j = std::max<int64_t>(begin, 0) / page_size; j < std::min(width, (end + page_size - 1) / page_size); ++j) {
      int const page = table.data_ptr<int>()[i * width + j];
      if (page < 0 || page >= num_pages) { bad = i; }
    }
  }
  c.require(bad < 0, "block_table", "an entry of batch row " + std::to_string(bad),
            std::string(which) + " must index " + pages_of + " pages [0, " + std::to_string(num_pages) + ")");
}

// cu_seqlens: starts at 0, never decreases, ends at (or within) `total` rows, longest <= max_seqlen.
void check_cu_seqlens_values(ArgChecker& c, at::Tensor const& cu, char const* name, int64_t total, bool total_exact,
                             int64_t max_seqlen, char const* max_name) {
  at::Tensor host = cu.to(at::kCPU).contiguous();
  auto const* x = host.data_ptr<int>();
  int64_t const n = host.numel();
  c.require(x[0] == 0, std::string(name) + "[0]", std::to_string(x[0]), "must be 0");
  int64_t first_drop = -1, longest = 0;
  for (int64_t i = 0; i + 1 < n; ++i) {
    if (x[i + 1] < x[i] && first_drop < 0) { first_drop = i + 1; }
    longest = std::max<int64_t>(longest, int64_t(x[i + 1]) - x[i]);
  }
  c.require(first_drop < 0, name, "a decrease at index " + std::to_string(first_drop), "must be non-decreasing");
  bool const total_ok = total_exact ? x[n - 1] == total : (x[n - 1] >= 0 && x[n - 1] <= total);
  c.require(total_ok, std::string(name) + "[-1]", std::to_string(x[n - 1]),
            std::string(total_exact ? "must equal " : "must be <= ") + "the number of rows " + std::to_string(total));
  c.require(longest <= max_seqlen, max_name, std::to_string(max_seqlen),
            "must be >= the longest sequence in " + std::string(name) + " (" + std::to_string(longest) + ")");
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                              at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k,
                                              std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q,
                                              int64_t max_seqlen_k, double softmax_scale, bool causal,
                                              int64_t window_left, int64_t window_right, double softcap,
                                              std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits,
                                              std::optional<at::Tensor> const& block_table) {
  ArgChecker c("flash_ext.varlen_fwd");
  bool const paged = block_table.has_value();
  bool const shapes_ok = check_qkv(c, q, k, v, /*varlen=*/true, /*kv_cache=*/false, /*paged_varlen=*/paged);
  bool cu_ok = true;
  for (auto const& [name, t] : {std::pair{"cu_seqlens_q", &cu_seqlens_q}, std::pair{"cu_seqlens_k", &cu_seqlens_k}}) {
    bool const ok = t->dim() == 1 && t->numel() >= 1 && t->scalar_type() == at::kInt && t->device() == q.device();
    c.require(ok, name, str(t->scalar_type()) + " " + str(t->sizes()) + " on " + str(t->device()),
              "must be a 1-D int32 tensor of length batch + 1 on q's device");
    cu_ok = cu_ok && ok;
  }
  if (cu_ok) {
    c.require(cu_seqlens_k.numel() == cu_seqlens_q.numel(), "cu_seqlens_k", "length " + std::to_string(cu_seqlens_k.numel()),
              "must have the length of cu_seqlens_q (" + std::to_string(cu_seqlens_q.numel()) + ")");
    cu_ok = cu_seqlens_k.numel() == cu_seqlens_q.numel();
  }
  int64_t const b = std::max<int64_t>(cu_seqlens_q.numel() - 1, 0);
  bool used_ok = true;
  if (seqused_k.has_value()) {
    auto const& s = *seqused_k;
    used_ok = s.dim() == 1 && s.numel() == b && s.scalar_type() == at::kInt && s.device() == q.device();
    c.require(used_ok, "seqused_k", str(s.scalar_type()) + " " + str(s.sizes()) + " on " + str(s.device()),
              "must be a 1-D int32 tensor of length batch (" + std::to_string(b) + ") on q's device");
  }
  // Paged K/V (flash_attn's varlen + block_table): sequence i's keys are rows [0, its length) of the pages
  // block_table[i, :]; cu_seqlens_k still gives the lengths.  Pages are whole multiples of every tile's N,
  // so a K/V tile never straddles two pages.
  bool table_ok = true;
  int64_t page_size = 0, capacity = 0;
  if (paged) {
    auto const& t = *block_table;
    table_ok = t.dim() == 2 && t.size(0) == b && t.scalar_type() == at::kInt && t.device() == q.device();
    c.require(table_ok, "block_table", str(t.scalar_type()) + " " + str(t.sizes()) + " on " + str(t.device()),
              "must be a 2-D int32 tensor (batch = " + std::to_string(b) + ", max_pages) on q's device");
    if (shapes_ok) {
      page_size = k.size(1);
      c.require(page_size > 0 && page_size % 128 == 0, "k.shape[1] (page size)", std::to_string(page_size),
                "must be a positive multiple of 128 with block_table");
      capacity = table_ok ? t.size(1) * page_size : 0;
    }
  }
  c.require(max_seqlen_q >= 0, "max_seqlen_q", std::to_string(max_seqlen_q), "must be >= 0");
  c.require(max_seqlen_k >= 0, "max_seqlen_k", std::to_string(max_seqlen_k), "must be >= 0");
  check_options(c, q, b, shapes_ok ? q.size(1) : -1, softmax_scale, window_left, window_right, softcap,
                alibi_slopes, num_splits);
  if (shapes_ok && cu_ok && table_ok && check_index_values(q.device())) {
    check_cu_seqlens_values(c, cu_seqlens_q, "cu_seqlens_q", q.size(0), /*total_exact=*/true, max_seqlen_q, "max_seqlen_q");
    // Paged: the keys are not rows of k, so only the per-sequence bounds below limit cu_seqlens_k.
    int64_t const k_rows = paged ? std::max<int64_t>(b * capacity, 0) : k.size(0);
    check_cu_seqlens_values(c, cu_seqlens_k, "cu_seqlens_k", k_rows, /*total_exact=*/false, max_seqlen_k, "max_seqlen_k");
    if (paged && page_size > 0) {
      at::Tensor cu = cu_seqlens_k.to(at::kCPU).contiguous();
      auto const keys = [&](int64_t i) { return int64_t(cu.data_ptr<int>()[i + 1]) - cu.data_ptr<int>()[i]; };
      int64_t too_long = -1;
      for (int64_t i = 0; i < b && too_long < 0; ++i) {
        if (keys(i) > capacity) { too_long = i; }
      }
      c.require(too_long < 0, "cu_seqlens_k", "sequence " + std::to_string(too_long) + " longer than its pages",
                "each sequence must fit block_table.shape[1] x page size = " + std::to_string(capacity) + " keys");
      check_pages(c, *block_table, b, page_size, k.size(0), "pages in use", "k's",
                  [&](int64_t i) { return std::pair<int64_t, int64_t>{0, keys(i)}; });
    }
    if (seqused_k.has_value() && used_ok) {
      at::Tensor used = seqused_k->to(at::kCPU).contiguous(), cu = cu_seqlens_k.to(at::kCPU).contiguous();
      int64_t bad = -1;
      for (int64_t i = 0; i < b && bad < 0; ++i) {
        int const u = used.data_ptr<int>()[i];
        if (u < 0 || u > cu.data_ptr<int>()[i + 1] - cu.data_ptr<int>()[i]) { bad = i; }
      }
      c.require(bad < 0, "seqused_k", "value at index " + std::to_string(bad), "must be within [0, that sequence's key count]");
    }
  }
  c.raise_if_any();

  int64_t const total_q = q.size(0), h = q.size(1), d = q.size(2);
  at::Tensor out = at::empty({total_q, h, d}, q.options());
  at::Tensor lse = at::empty({h, total_q}, q.options().dtype(at::kFloat));
  if (out.numel() == 0 || b == 0 || max_seqlen_q == 0) { return {out, lse}; }
  at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
  std::optional<at::Tensor> used;
  if (seqused_k.has_value()) { used = seqused_k->contiguous(); }
  FwdParams p;
  KernelInputs const in = prepare_inputs(p, q, k, v, out, lse, alibi_slopes);
  p.b = int(b);
  p.seqlen_q = int(max_seqlen_q);
  p.seqlen_k = int(max_seqlen_k);
  p.total_q = int(total_q);
  p.cu_seqlens_q = cu_q.data_ptr<int>();
  p.cu_seqlens_k = cu_k.data_ptr<int>();
  p.seqused_k = used.has_value() ? used->data_ptr<int>() : nullptr;
  std::optional<at::Tensor> table;
  if (paged) {
    table = block_table->contiguous();
    p.block_table = table->data_ptr<int>();
    p.block_table_batch_stride = table->stride(0);
    p.page_size = int(page_size);
  }
  set_semantics(p, softmax_scale, causal, window_left, window_right, softcap, in.alibi);
  auto const accum = set_splits(p, in.q, num_splits, total_q);
  launch(p, q, "flash_ext.varlen_fwd");
  return {out, lse};
}

// Attention of q against a KV cache whose new entries (if any) the Python layer has already appended and
// rotated: batch entry b sees keys [leftpad_k[b], leftpad_k[b] + seqlens_k[b]) of cache batch
// kv_batch_idx[b] (or of its pages in block_table).  Index values are checked like cu_seqlens (on CUDA one
// device-to-host copy, skipped with FLASH_EXT_TRUST_CU_SEQLENS=1): never an out-of-bounds read.
std::tuple<at::Tensor, at::Tensor> kvcache_fwd(at::Tensor const& q, at::Tensor const& k_cache, at::Tensor const& v_cache,
                                               at::Tensor const& seqlens_k, std::optional<at::Tensor> const& kv_batch_idx,
                                               std::optional<at::Tensor> const& leftpad_k,
                                               std::optional<at::Tensor> const& block_table, double softmax_scale,
                                               bool causal, int64_t window_left, int64_t window_right, double softcap,
                                               std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits) {
  ArgChecker c("flash_ext.kvcache_fwd");
  bool const shapes_ok = check_qkv(c, q, k_cache, v_cache, /*varlen=*/false, /*kv_cache=*/true);
  int64_t const b = shapes_ok ? q.size(0) : -1;
  check_options(c, q, b, shapes_ok ? q.size(2) : -1, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                num_splits);
  auto index_ok = [&](std::optional<at::Tensor> const& t, char const* name, int64_t rank) {
    return check_index_tensor(c, t, name, rank, b, q.device(), "q");
  };
  // & rather than &&: every malformed index tensor is reported, not just the first.
  bool const idx_ok = index_ok(seqlens_k, "seqlens_k", 1) & index_ok(kv_batch_idx, "cache_batch_idx", 1) &
                      index_ok(leftpad_k, "cache_leftpad", 1) & index_ok(block_table, "block_table", 2);
  bool const paged = block_table.has_value();
  int64_t page_size = 0, capacity = 0;
  if (shapes_ok) {
    page_size = paged ? k_cache.size(1) : 0;
    capacity = paged ? (block_table->dim() == 2 ? block_table->size(1) * page_size : 0) : k_cache.size(1);
    if (paged) {
      c.require(page_size % 128 == 0 && page_size > 0, "k_cache.shape[1] (page size)", std::to_string(page_size),
                "must be a positive multiple of 128 with block_table");
      c.require(!leftpad_k.has_value(), "cache_leftpad", "given with block_table",
                "left padding and paged KV cannot be combined");
      c.require(!kv_batch_idx.has_value(), "cache_batch_idx", "given with block_table",
                "paged KV selects pages through block_table; cache_batch_idx must be None");
    }
  }
  if (shapes_ok && idx_ok && check_index_values(q.device())) {
    at::Tensor len = seqlens_k.to(at::kCPU).contiguous();
    at::Tensor pad = leftpad_k.has_value() ? leftpad_k->to(at::kCPU).contiguous() : at::zeros({b}, len.options());
    int64_t bad_len = -1;
    for (int64_t i = 0; i < b && bad_len < 0; ++i) {
      int const l = len.data_ptr<int>()[i], lp = pad.data_ptr<int>()[i];
      if (l < 0 || lp < 0 || int64_t(l) + lp > capacity) { bad_len = i; }
    }
    c.require(bad_len < 0, "cache_seqlens/cache_leftpad", "batch entry " + std::to_string(bad_len),
              "need 0 <= cache_leftpad <= cache_seqlens and cache_seqlens (+ new keys) <= cache capacity " +
                  std::to_string(capacity));
    if (kv_batch_idx.has_value()) {
      check_index_range(c, *kv_batch_idx, "cache_batch_idx", k_cache.size(0), "k_cache's batch dimension");
    }
    if (paged) {
      check_pages(c, *block_table, b, page_size, k_cache.size(0), "pages in use", "k_cache's",
                  [&](int64_t i) { return std::pair<int64_t, int64_t>{0, len.data_ptr<int>()[i]}; });
    }
  }
  c.raise_if_any();
  if (swap_query_groups(q, k_cache, window_left, capacity, alibi_slopes)) {
    return rows_as_groups(kvcache_fwd(groups_as_rows(q, k_cache.size(2)), k_cache, v_cache, seqlens_k, kv_batch_idx,
                                      leftpad_k, block_table, softmax_scale, /*causal=*/false, -1, -1, softcap,
                                      alibi_slopes, num_splits));
  }

  int64_t const sq = q.size(1), h = q.size(2), d = q.size(3);
  at::Tensor out = at::empty({b, sq, h, d}, q.options());
  at::Tensor lse = at::empty({b, h, sq}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) { return {out, lse}; }
  at::Tensor const len = seqlens_k.contiguous();
  std::optional<at::Tensor> idx, pad, table;
  if (kv_batch_idx.has_value()) { idx = kv_batch_idx->contiguous(); }
  if (leftpad_k.has_value()) { pad = leftpad_k->contiguous(); }
  if (block_table.has_value()) { table = block_table->contiguous(); }
  FwdParams p;
  KernelInputs const in = prepare_inputs(p, q, k_cache, v_cache, out, lse, alibi_slopes);
  p.b = int(b);
  p.seqlen_q = int(sq);
  p.seqlen_k = int(std::max<int64_t>(capacity, 1));  // an upper bound: per-batch key counts are in seqused_k
  p.seqused_k = len.data_ptr<int>();
  p.kv_batch_idx = idx.has_value() ? idx->data_ptr<int>() : nullptr;
  p.leftpad_k = pad.has_value() ? pad->data_ptr<int>() : nullptr;
  if (table.has_value()) {
    p.block_table = table->data_ptr<int>();
    p.block_table_batch_stride = table->stride(0);
    p.page_size = int(page_size);
  }
  set_semantics(p, softmax_scale, causal, window_left, window_right, softcap, in.alibi);
  auto const accum = set_splits(p, in.q, num_splits, b * sq);
  launch(p, q, "flash_ext.kvcache_fwd");
  return {out, lse};
}

// The append half of flash_attn_with_kvcache (the Python layer has already rotated k): rows
// cache_seqlens[i] .. cache_seqlens[i] + seqlen_new of batch entry i's cache (batch cache_batch_idx[i], or
// its pages in block_table) receive k[i] and v[i].  Every index is checked before anything is written (on
// CUDA one device-to-host copy, skipped with FLASH_EXT_TRUST_CU_SEQLENS=1): a bad index is a ValueError,
// never an out-of-bounds or wrapped-around write.  With rotary tables of rotary_len rows, the positions
// cache_seqlens[i] + [0, rotary_rows) that k and q were rotated at must exist (rotary_len = -1: no rotary).
// Being an op (not Python indexing) keeps the check host-side without a data-dependent branch in the
// graph, so a whole decode step compiles into one graph.
void kvcache_append(at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor const& k, at::Tensor const& v,
                    at::Tensor const& cache_seqlens, std::optional<at::Tensor> const& cache_batch_idx,
                    std::optional<at::Tensor> const& block_table, int64_t rotary_len, int64_t rotary_rows) {
  ArgChecker c("flash_ext.kvcache_append_");
  bool const caches_ok = k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes();
  c.require(caches_ok, "k_cache/v_cache", str(k_cache.sizes()) + "/" + str(v_cache.sizes()),
            "must share one 4-D shape");
  bool const new_ok = k.dim() == 4 && v.sizes() == k.sizes() &&
                      (!caches_ok || (k.size(2) == k_cache.size(2) && k.size(3) == k_cache.size(3)));
  c.require(new_ok, "k/v", str(k.sizes()) + "/" + str(v.sizes()),
            "must share one shape (batch, seqlen_new, nheads_k, d) with k_cache's nheads_k and d");
  c.require(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                v_cache.scalar_type() == k_cache.scalar_type(),
            "k/v", str(k.scalar_type()) + "/" + str(v.scalar_type()), "must have the caches' dtype (" +
                str(k_cache.scalar_type()) + ")");
  bool const same_device = v_cache.device() == k_cache.device() && k.device() == k_cache.device() &&
                           v.device() == k_cache.device();
  c.require(same_device, "k/v/v_cache", "tensors on different devices", "must be on k_cache's device");
  int64_t const b = new_ok ? k.size(0) : -1;
  auto index_ok = [&](std::optional<at::Tensor> const& t, char const* name, int64_t rank) {
    return check_index_tensor(c, t, name, rank, b, k_cache.device(), "k_cache");
  };
  bool const idx_ok = index_ok(cache_seqlens, "cache_seqlens", 1) & index_ok(cache_batch_idx, "cache_batch_idx", 1) &
                      index_ok(block_table, "block_table", 2);
  bool const paged = block_table.has_value();
  if (paged) {
    c.require(!cache_batch_idx.has_value(), "cache_batch_idx", "given with block_table",
              "paged KV selects pages through block_table; cache_batch_idx must be None");
  }
  int64_t const page_size = caches_ok && paged ? k_cache.size(1) : 0;
  int64_t const seqlen_new = new_ok ? k.size(1) : 0;
  if (caches_ok && new_ok && idx_ok && check_index_values(k_cache.device())) {
    int64_t const capacity = paged ? block_table->size(1) * page_size : k_cache.size(1);
    at::Tensor len = cache_seqlens.to(at::kCPU).contiguous();
    int64_t bad_len = -1, bad_rotary = -1;
    for (int64_t i = 0; i < b; ++i) {
      int64_t const l = len.data_ptr<int>()[i];
      if (bad_len < 0 && (l < 0 || l + seqlen_new > capacity)) { bad_len = i; }
      if (bad_rotary < 0 && rotary_len >= 0 && l + rotary_rows > rotary_len) { bad_rotary = i; }
    }
    c.require(bad_len < 0, "cache_seqlens", "batch entry " + std::to_string(bad_len),
              "appending " + std::to_string(seqlen_new) + " rows needs 0 <= cache_seqlens and cache_seqlens + " +
                  std::to_string(seqlen_new) + " <= the cache capacity " + std::to_string(capacity));
    c.require(bad_rotary < 0, "rotary_cos/rotary_sin", std::to_string(rotary_len) + " positions",
              "must cover positions cache_seqlens + [0, " + std::to_string(rotary_rows) + ") (batch entry " +
                  std::to_string(bad_rotary) + " goes past them)");
    if (cache_batch_idx.has_value()) {
      check_index_range(c, *cache_batch_idx, "cache_batch_idx", k_cache.size(0), "k_cache's batch dimension");
    }
    if (paged && bad_len < 0) {
      check_pages(c, *block_table, b, page_size, k_cache.size(0), "the pages the new rows go to", "k_cache's",
                  [&](int64_t i) {
                    int64_t const start = len.data_ptr<int>()[i];
                    return std::pair<int64_t, int64_t>{start, start + seqlen_new};
                  });
    }
  }
  c.raise_if_any();
  if (b == 0 || seqlen_new == 0) { return; }
  auto const long_opts = cache_seqlens.options().dtype(at::kLong);
  at::Tensor const pos = cache_seqlens.to(at::kLong).unsqueeze(1) + at::arange(seqlen_new, long_opts).unsqueeze(0);  // (b, seqlen_new)
  if (paged) {
    at::Tensor const page = block_table->to(at::kLong).gather(1, at::div(pos, page_size, "floor"));
    at::Tensor const row = at::remainder(pos, page_size);
    k_cache.index_put_({page, row}, k);
    v_cache.index_put_({page, row}, v);
  } else {
    at::Tensor const batch = (cache_batch_idx.has_value() ? cache_batch_idx->to(at::kLong) : at::arange(b, long_opts)).unsqueeze(1);
    k_cache.index_put_({batch, pos}, k);
    v_cache.index_put_({batch, pos}, v);
  }
}

// explain(): the plan for a fwd call, or every reason it cannot run.  Runs no kernel.
std::string plan_fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale, bool causal,
                     int64_t window_left, int64_t window_right, double softcap,
                     std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits) {
  ArgChecker c("flash_ext.fwd");
  bool const shapes_ok = check_qkv(c, q, k, v, /*varlen=*/false);
  check_options(c, q, shapes_ok ? q.size(0) : -1, shapes_ok ? q.size(2) : -1, softmax_scale, window_left,
                window_right, softcap, alibi_slopes, num_splits);
  if (c.errors().empty() && swap_query_groups(q, k, window_left, k.size(1), alibi_slopes)) {
    return plan_fwd(groups_as_rows(q, k.size(2)), k, v, softmax_scale, false, -1, -1, softcap, alibi_slopes, num_splits);
  }
  if (!c.errors().empty()) {
    std::string out = "{\"ok\": false, \"reasons\": [";
    for (size_t i = 0; i < c.errors().size(); ++i) { out += (i ? ", \"" : "\"") + json_escape(c.errors()[i]) + "\""; }
    return out + "]}";
  }
  FwdParams p;
  set_inputs(p, q, k, v);
  p.b = int(q.size(0));
  p.seqlen_q = int(q.size(1));
  p.seqlen_k = int(k.size(1));
  set_semantics(p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes);
  set_splits(p, q, num_splits, int64_t(p.b) * p.seqlen_q, /*allocate=*/false);
  return plan_json(p, q);
}

bool set_poison_outputs(bool enable) { return g_poison_outputs.exchange(enable); }

std::string build_info() {
  std::ostringstream os;
  os << "{\"cuda\": ";
#if defined(FLASH_EXT_WITH_CUDA)
  os << "true, \"cuda_archs\": \"" << FLASH_EXT_CUDA_ARCHS_STR << "\", \"gpu_head_dims\": [";
  bool first = true;
  for (int i = 0; i < int(sizeof(kGpuHeadDims) / sizeof(int)); ++i) {
    if ((FLASH_EXT_GPU_HEADDIMS_MASK >> i) & 1) {
      os << (first ? "" : ", ") << kGpuHeadDims[i];
      first = false;
    }
  }
  os << "]";
#else
  os << "false, \"cuda_archs\": \"\", \"gpu_head_dims\": []";
#endif
  os << ", \"host_head_dims\": [";
  os << host_head_dims_list();
  os << "]}";
  return os.str();
}

}  // namespace

TORCH_LIBRARY(flash_ext, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, Tensor? alibi_slopes, int num_splits=0) -> (Tensor out, Tensor softmax_lse)");
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_k, "
      "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, Tensor? alibi_slopes, int num_splits=0, Tensor? block_table=None) -> (Tensor out, "
      "Tensor softmax_lse)");
  m.def(
      "kvcache_fwd(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqlens_k, Tensor? cache_batch_idx, "
      "Tensor? cache_leftpad, Tensor? block_table, float softmax_scale, bool causal, int window_left, "
      "int window_right, float softcap, Tensor? alibi_slopes, int num_splits=0) -> (Tensor out, Tensor softmax_lse)");
  m.def(
      "kvcache_append_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor cache_seqlens, "
      "Tensor? cache_batch_idx, Tensor? block_table, int rotary_len=-1, int rotary_rows=0) -> ()");
  m.def("_set_poison_outputs(bool enable) -> bool", &set_poison_outputs);
  m.def(
      "_plan_fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, Tensor? alibi_slopes, int num_splits=0) -> str",
      &plan_fwd);
  m.def("_build_info() -> str", &build_info);
  m.def("_num_splits_heuristic(int ctas, int processors, int n_blocks) -> int",
        [](int64_t ctas, int64_t processors, int64_t n_blocks) -> int64_t {
          return num_splits_heuristic(int(ctas), int(processors), int(n_blocks), int(kMaxSplits));
        });
}

TORCH_LIBRARY_IMPL(flash_ext, CPU, m) {
  m.impl("fwd", &fwd);
  m.impl("varlen_fwd", &varlen_fwd);
  m.impl("kvcache_fwd", &kvcache_fwd);
  m.impl("kvcache_append_", &kvcache_append);
}

#if defined(FLASH_EXT_WITH_CUDA)
TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("varlen_fwd", &varlen_fwd);
  m.impl("kvcache_fwd", &kvcache_fwd);
  m.impl("kvcache_append_", &kvcache_append);
}
#endif

}  // namespace flash_ext
