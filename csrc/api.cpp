// The torch op layer: schema, argument checks, FA2 window normalisation, output allocation, and the
// call into the CPU or CUDA backend through raw pointers (flash_ext/fwd_api.h).
#include <ATen/ATen.h>
#include <Python.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#if defined(FLASH_EXT_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
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

 private:
  std::string op_;
  std::vector<std::string> errors_;
};

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

bool aligned16(at::Tensor const& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) { return false; }
  for (int i = 0; i < t.dim() - 1; ++i) {
    if (t.size(i) > 1 && t.stride(i) % 8 != 0) { return false; }
  }
  return true;
}

void check_fwd_args(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale,
                    int64_t window_left, int64_t window_right, double softcap,
                    std::optional<at::Tensor> const& alibi_slopes) {
  ArgChecker c("flash_ext.fwd");
  bool const ranks_ok = q.dim() == 4 && k.dim() == 4 && v.dim() == 4;
  c.require(q.dim() == 4, "q", std::to_string(q.dim()) + " dims " + str(q.sizes()), "must be (batch, seqlen_q, heads, head_dim)");
  c.require(k.dim() == 4, "k", std::to_string(k.dim()) + " dims " + str(k.sizes()), "must be (batch, seqlen_k, heads_k, head_dim)");
  c.require(v.dim() == 4, "v", std::to_string(v.dim()) + " dims " + str(v.sizes()), "must be (batch, seqlen_k, heads_k, head_dim)");
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
  if (ranks_ok) {
    int64_t const d = q.size(3), h = q.size(2), hk = k.size(2);
    c.require(d <= 256, "head_dim", std::to_string(d), "must be <= 256");
    c.require(d % 8 == 0, "head_dim", std::to_string(d), "must be a multiple of 8 at the op (flash_attn_func pads other sizes)");
    c.require(k.sizes() == v.sizes(), "v.shape", str(v.sizes()), "must equal k.shape " + str(k.sizes()));
    c.require(k.size(0) == q.size(0), "k.shape[0]", std::to_string(k.size(0)), "must equal q batch " + std::to_string(q.size(0)));
    c.require(k.size(3) == d, "k.shape[3]", std::to_string(k.size(3)), "must equal q head_dim " + std::to_string(d));
    c.require(hk > 0 && h % hk == 0, "heads", "q " + std::to_string(h) + ", k/v " + std::to_string(hk),
              "q heads must be a multiple of k/v heads (MQA/GQA)");
    if (alibi_slopes.has_value()) {
      auto const& a = *alibi_slopes;
      bool const shape_ok = (a.dim() == 1 && a.size(0) == h) || (a.dim() == 2 && a.size(0) == q.size(0) && a.size(1) == h);
      c.require(shape_ok, "alibi_slopes.shape", str(a.sizes()),
                "must be (heads,) = (" + std::to_string(h) + ",) or (batch, heads) = (" + std::to_string(q.size(0)) + ", " + std::to_string(h) + ")");
      c.require(a.scalar_type() == at::kFloat, "alibi_slopes.dtype", str(a.scalar_type()), "must be float32");
      c.require(a.device() == q.device(), "alibi_slopes.device", str(a.device()), "must equal q.device (" + str(q.device()) + ")");
      c.require(a.stride(-1) == 1 || a.size(-1) <= 1, "alibi_slopes.stride(-1)", std::to_string(a.stride(-1)), "must be contiguous");
    }
  }
  c.require(window_left >= -1, "window_size[0]", std::to_string(window_left), "must be >= -1 (-1: unbounded)");
  c.require(window_right >= -1, "window_size[1]", std::to_string(window_right), "must be >= -1 (-1: unbounded)");
  c.require(softcap >= 0 && std::isfinite(softcap), "softcap", std::to_string(softcap), "must be finite and >= 0 (0: off)");
  c.require(std::isfinite(softmax_scale), "softmax_scale", std::to_string(softmax_scale), "must be finite");
  if (q.device().is_cuda() && ranks_ok) {
    for (auto const& [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
      c.require(aligned16(*t), name, "data_ptr/strides not 16-byte aligned",
                "CUDA inputs need a 16-byte aligned start and strides that are multiples of 8 (flash_attn_func copies such inputs)");
    }
  }
  c.raise_if_any();
}

FwdParams make_params(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor& out,
                      at::Tensor& lse, double softmax_scale, bool causal, int64_t window_left,
                      int64_t window_right, double softcap, std::optional<at::Tensor> const& alibi_slopes) {
  FwdParams p;
  p.q_ptr = q.data_ptr();
  p.k_ptr = k.data_ptr();
  p.v_ptr = v.data_ptr();
  p.o_ptr = out.data_ptr();
  p.softmax_lse_ptr = lse.data_ptr<float>();
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
  p.b = int(q.size(0));
  p.seqlen_q = int(q.size(1));
  p.h = int(q.size(2));
  p.d = int(q.size(3));
  p.seqlen_k = int(k.size(1));
  p.h_k = int(k.size(2));
  p.h_h_k_ratio = p.h / p.h_k;

  p.softmax_scale = float(softmax_scale);
  p.softcap = float(softcap);
  if (softcap > 0) {
    p.softcap_prescale = float(softmax_scale / softcap);
    p.score_scale = float(softcap);
  } else {
    p.score_scale = float(softmax_scale);
  }
  p.score_scale_log2 = float(double(p.score_scale) * M_LOG2E);

  // FA2 2.8 window semantics.  A side at least seqlen_k wide bounds nothing.  causal is window (-1, 0)
  // (a finite left window with causal makes a local problem).  With one query row, bottom-right causal
  // shows every key, so it is plain attention.
  if (window_left >= p.seqlen_k) { window_left = -1; }
  if (window_right >= p.seqlen_k) { window_right = -1; }
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
  return p;
}

std::tuple<at::Tensor, at::Tensor> fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                       double softmax_scale, bool causal, int64_t window_left,
                                       int64_t window_right, double softcap,
                                       std::optional<at::Tensor> const& alibi_slopes) {
  check_fwd_args(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes);
  int64_t const b = q.size(0), sq = q.size(1), h = q.size(2), d = q.size(3), sk = k.size(1);
  at::Tensor out = at::empty({b, sq, h, d}, q.options());
  at::Tensor lse = at::empty({b, h, sq}, q.options().dtype(at::kFloat));
  if (b == 0 || sq == 0 || h == 0) { return {out, lse}; }
  if (sk == 0 || d == 0) {  // no key at all: every row is empty
    out.zero_();
    lse.fill_(INFINITY);
    return {out, lse};
  }
  if (g_poison_outputs.load(std::memory_order_relaxed)) {
    out.fill_(NAN);
    lse.fill_(NAN);
  }
  std::optional<at::Tensor> alibi;
  if (alibi_slopes.has_value()) { alibi = alibi_slopes->contiguous(); }
  FwdParams const params = make_params(q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi);
  if (q.device().is_cpu()) {
    run_fwd_cpu(params, to_dtype(q.scalar_type()));
  } else {
#if defined(FLASH_EXT_WITH_CUDA)
    c10::cuda::CUDAGuard guard(q.device());
    std::string const err = run_fwd_cuda(params, to_dtype(q.scalar_type()), at::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err.empty(), "flash_ext.fwd (CUDA): ", err);
#else
    TORCH_CHECK(false, "flash_ext was built without CUDA; rebuild with a CUDA toolkit or pass CPU tensors");
#endif
  }
  return {out, lse};
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
  for (int i = 0; i < int(sizeof(kHostHeadDims) / sizeof(int)); ++i) { os << (i ? ", " : "") << kHostHeadDims[i]; }
  os << "]}";
  return os.str();
}

}  // namespace

TORCH_LIBRARY(flash_ext, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, Tensor? alibi_slopes) -> (Tensor out, Tensor softmax_lse)");
  m.def("_set_poison_outputs(bool enable) -> bool", &set_poison_outputs);
  m.def("_build_info() -> str", &build_info);
}

TORCH_LIBRARY_IMPL(flash_ext, CPU, m) { m.impl("fwd", &fwd); }

#if defined(FLASH_EXT_WITH_CUDA)
TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) { m.impl("fwd", &fwd); }
#endif

}  // namespace flash_ext
