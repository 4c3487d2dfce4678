#include "common.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <sstream>

#if defined(FLASH_EXT_WITH_CUDA)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <array>
#include <mutex>
#endif

#include "flash_ext/dispatch.h"
#include "flash_ext/grid.h"
#include "flash_ext/launch_host.h"
#if defined(FLASH_EXT_WITH_EMULATOR)
#include "emu/fwd_emu.h"
#endif

namespace flash_ext::ops {

namespace {
std::atomic<bool> g_poison_outputs{false};
}  // namespace

bool aligned16(at::Tensor const& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) { return false; }
  for (int i = 0; i < t.dim() - 1; ++i) {
    if (t.size(i) > 1 && t.stride(i) % 8 != 0) { return false; }
  }
  return true;
}

// Sm80 inputs (CUDA, or the emulated GPU, which checks them) whose rows are not 16-byte aligned are copied into
// fresh (aligned) storage; the host backend reads element-wise and uses its inputs as they are.
at::Tensor aligned_for_kernel(at::Tensor const& t, bool sm80) {
  if (!sm80 || aligned16(t)) { return t; }
  at::Tensor c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}

at::Tensor element_aligned(at::Tensor const& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % uintptr_t(c.element_size()) == 0 ? c : c.clone();
}

void set_inputs(FwdParams& p, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v) {
  p.q_ptr = q.data_ptr();
  p.k_ptr = k.data_ptr();
  p.v_ptr = v.data_ptr();
  set_input_shapes(p, q, k, v);
}

void set_input_shapes(FwdParams& p, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v) {
  int const r = int(q.dim()) - 3;   // index of q's row (sequence) dimension
  int const rk = int(k.dim()) - 3;  // and of k's and v's
  p.q_batch_stride = r ? q.stride(0) : 0, p.q_row_stride = q.stride(r), p.q_head_stride = q.stride(r + 1);
  p.k_batch_stride = rk ? k.stride(0) : 0, p.k_row_stride = k.stride(rk), p.k_head_stride = k.stride(rk + 1);
  p.v_batch_stride = rk ? v.stride(0) : 0, p.v_row_stride = v.stride(rk), p.v_head_stride = v.stride(rk + 1);
  p.h = int(q.size(r + 1));
  p.d = int(q.size(r + 2));
  p.h_k = int(k.size(rk + 1));
  p.h_h_k_ratio = p.h / p.h_k;
}

void set_outputs(FwdParams& p, at::Tensor const& out, at::Tensor const& lse) {
  int const r = int(out.dim()) - 3;
  p.o_ptr = out.data_ptr();
  p.softmax_lse_ptr = lse.data_ptr<float>();
  p.o_batch_stride = r ? out.stride(0) : 0, p.o_row_stride = out.stride(r), p.o_head_stride = out.stride(r + 1);
}

namespace {

std::string json_escape(std::string const& x) {
  std::string out;
  for (char ch : x) {
    if (ch == '"' || ch == '\\') { out += '\\'; }
    out += ch;
  }
  return out;
}

// The tile sizes the split heuristic and the plan work with, for the device that will run.
struct TileChoice {
  bool ok = false;
  std::string why;
  int head_dim = 0, block_m = 0, block_n = 0, threads = 0, smem = 0;
  int ctas_per_sm = 1;  // Sm80 paths: CTAs of this tile resident per SM; host: one work item per thread
  std::string variant;
  GridDims grid;  // Sm80 paths: the launch grid
};

TileChoice from_cuda_plan(CudaPlan const& cp) {
  TileChoice t;
  t.ok = cp.ok, t.why = cp.why, t.head_dim = cp.head_dim, t.block_m = cp.block_m, t.block_n = cp.block_n;
  t.threads = 32 * cp.num_warps, t.smem = cp.smem_bytes, t.variant = cp.variant_name, t.grid = cp.grid;
  t.ctas_per_sm = cp.ctas_per_sm;
  return t;
}

TileChoice choose_tile(FwdParams const& p, at::Tensor const& q, DeviceInfo const& dev) {
  TileChoice t;
  if (dev.emulated) {
#if defined(FLASH_EXT_WITH_EMULATOR)
    return from_cuda_plan(emu::plan_fwd_emu(p, to_dtype(q.scalar_type())));
#endif
  }
  if (!dev.cuda) {
    t.head_dim = host_head_dim_for(p.d);
    t.ok = t.head_dim > 0;
    if (!t.ok) { t.why = "no CPU kernel for head dim " + std::to_string(p.d) + " in this build"; }
    t.block_m = host_block_m(p.seqlen_q);
    t.block_n = host_block_n(q.scalar_type() == at::kBFloat16);
    t.threads = 1;
    t.smem = (t.block_m + 2 * t.block_n) * t.head_dim * int(q.element_size());
    t.variant = "runtime flags";
    return t;
  }
#if defined(FLASH_EXT_WITH_CUDA)
  return from_cuda_plan(plan_fwd_cuda(p, to_dtype(q.scalar_type()), dev.cc_major, dev.cc_minor,
                                      dev.smem_per_block_optin));
#else
  t.why = "flash_ext was built without CUDA";
#endif
  return t;
}

std::string emulate_from_env() {
  char const* e = std::getenv("FLASH_EXT_EMULATE");
  return e == nullptr ? std::string() : std::string(e);
}
// The emulate mode is per thread, as the check-only and plan-only modes are: FLASH_EXT_EMULATE is every
// thread's starting mode, flash_ext.emulate() changes its own thread's only.  One process-wide mode let a
// block in one thread move every other thread's calls onto the emulator, and two threads' overlapping blocks
// (A enters, B enters, A leaves, B leaves) left it on for good: B restored the mode A had set.  The report and
// the test fault are per thread for the same reason (a thread's report is its own latest launch's).
std::string const g_emulate_env = emulate_from_env();
thread_local std::string t_emulate = g_emulate_env;
thread_local std::string t_emulator_report = "{}";
thread_local std::string t_emulator_test_fault;  // see set_emulator_test_fault

#if defined(FLASH_EXT_WITH_EMULATOR)
// Bytes [data_ptr, data_ptr + extent) a kernel may touch for a tensor view.
emu::GlobalRange range_of(at::Tensor const& t, bool writable, char const* name) {
  int64_t last = 0;
  for (int64_t i = 0; i < t.dim(); ++i) { last += (t.size(i) - 1) * t.stride(i); }
  auto const begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  auto const bytes = t.numel() == 0 ? 0 : uintptr_t(last + 1) * uintptr_t(t.element_size());
  return {begin, begin + bytes, writable, name};
}

// The emulated Sm80 launch: the CUDA dispatcher's kernels on emulated warps, CTAs over at::parallel_for.  The
// kernel reads q/k/v (and the index arrays, ALiBi slopes, RNG state) and writes out, LSE (and the split
// accumulators); any finding fails the call with its report.
void launch_emulated(FwdParams const& params, KernelInputs const& in, at::Tensor const& out,
                     std::tuple<at::Tensor, at::Tensor> const& accum, char const* op) {
  emu::EmuLaunch run;
  run.globals = {range_of(in.q, false, "q"), range_of(in.k, false, "k"), range_of(in.v, false, "v"),
                 range_of(out, true, "out")};
  if (std::get<0>(accum).defined()) {
    run.globals.push_back(range_of(std::get<0>(accum), true, "split partials"));
    run.globals.push_back(range_of(std::get<1>(accum), true, "split partial LSE"));
  }
  emu::add_param_ranges(run, params, /*backward=*/false);  // LSE, index arrays, ALiBi, RNG state
  std::string const fault = t_emulator_test_fault;
  if (!fault.empty()) {  // test only: the kernel's last 16 bytes (or fewer) of one tensor are off limits
    bool named = false;
    std::string names;
    for (emu::GlobalRange& r : run.globals) {
      names += std::string(names.empty() ? "" : ", ") + r.name;
      if (fault == std::string("narrow:") + r.name) {
        r.end -= std::min<uintptr_t>(16, r.end - r.begin);
        named = true;
      }
    }
    TORCH_CHECK(named, op, " (warp emulator): the test fault '", fault, "' names no tensor of this launch (",
                names, ")");
  }
  run.parallel_for = [](int64_t begin, int64_t end, std::function<void(int64_t, int64_t)> const& body) {
    at::parallel_for(begin, end, /*grain_size=*/1, body);
  };
  std::string const err = emu::run_fwd_emu(params, to_dtype(in.q.scalar_type()), run);
  t_emulator_report = run.report.json();
  TORCH_CHECK(err.empty(), op, " (warp emulator): ", err);
  TORCH_CHECK(run.report.total() == 0, op, " (warp emulator, emulated sm_80): ", run.report.text());
}
#endif

}  // namespace

bool emulator_built() {
#if defined(FLASH_EXT_WITH_EMULATOR)
  return true;
#else
  return false;
#endif
}

std::string emulator_head_dims_list() {
#if defined(FLASH_EXT_WITH_EMULATOR)
  return emu::emu_head_dims();
#else
  return "";
#endif
}

std::string set_emulate(std::string const& mode) {
  TORCH_CHECK_VALUE(mode.empty() || mode == "sm80", "flash_ext.emulate: got '", mode,
                    "'; the warp emulator emulates 'sm80' ('' turns it off)");
  TORCH_CHECK_VALUE(mode.empty() || emulator_built(), "flash_ext.emulate('sm80'): flash_ext was built without the "
                    "warp emulator; rebuild with FLASH_EXT_EMULATOR=1");
  return std::exchange(t_emulate, mode);
}

bool emulated(at::Tensor const& q) {
  if (!q.device().is_cpu() || (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16)) { return false; }
  std::string const& mode = t_emulate;
  if (mode.empty()) { return false; }
  TORCH_CHECK_VALUE(mode == "sm80", "FLASH_EXT_EMULATE: got '", mode,
                    "'; the warp emulator emulates 'sm80' (or unset it)");
  TORCH_CHECK_VALUE(emulator_built(), "FLASH_EXT_EMULATE=sm80: flash_ext was built without the warp emulator; "
                    "rebuild with FLASH_EXT_EMULATOR=1");
  return true;
}

std::string set_emulator_test_fault(std::string const& fault) {
  TORCH_CHECK_VALUE(fault.empty() || (fault.rfind("narrow:", 0) == 0 && fault.size() > 7),
                    "set_emulator_test_fault: got '", fault,
                    "'; expected '' or 'narrow:' followed by the name of a tensor the emulated launch registers "
                    "(q, k, v, out, softmax_lse, split partials, cu_seqlens_q, block_table, ...)");
  return std::exchange(t_emulator_test_fault, fault);
}

std::string emulator_last_report() { return t_emulator_report; }

DeviceInfo call_device(at::Tensor const& q) {
  if (!emulated(q)) { return device_info(q.device()); }
  DeviceInfo info;
  info.emulated = true;
  info.cc_major = 8, info.cc_minor = 0;
#if defined(FLASH_EXT_WITH_EMULATOR)
  info.processors = emu::kEmuProcessors;
  info.smem_per_block_optin = emu::kEmuSmemOptin;
#endif
  info.name = "emulated sm_80";
  return info;
}

namespace {
thread_local bool t_check_only = false;
thread_local bool t_plan_only = false;
thread_local std::optional<Plan> t_recorded_plan;
}  // namespace

bool set_check_only(bool enable) { return std::exchange(t_check_only, enable); }

bool set_plan_only(bool enable) {
  if (enable) { t_recorded_plan.reset(); }
  return std::exchange(t_plan_only, enable);
}
bool plan_only() { return t_plan_only; }
std::optional<Plan> const& recorded_plan() { return t_recorded_plan; }

void ArgChecker::raise_if_any() const {
  if (errors_.empty() && !t_check_only) { return; }
  std::ostringstream os;
  os << op_ << ": " << errors_.size() << " invalid argument" << (errors_.size() > 1 ? "s" : "") << ":";
  for (auto const& e : errors_) { os << "\n  - " << e; }
  TORCH_CHECK_VALUE(false, os.str());
}

std::string str(at::IntArrayRef a) {
  std::ostringstream os;
  os << a;
  return os.str();
}
std::string str(at::ScalarType t) { return std::string(c10::toString(t)); }
std::string str(at::Device d) { return d.str(); }

std::string str(double x) {
  // The shortest %g text that reads back as x: std::to_string's fixed six decimals print 1 - 1e-9 as
  // "1.000000" and -1e-9 as "-0.000000", naming a value the caller did not pass.  (snprintf rather than
  // std::to_chars: libstdc++ has the floating-point overloads only from GCC 11.)
  std::array<char, 40> buf{};
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf.data(), buf.size(), "%.*g", precision, x);
    if (!std::isfinite(x) || std::strtod(buf.data(), nullptr) == x) { break; }
  }
  return std::string(buf.data());
}

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

#if defined(FLASH_EXT_WITH_CUDA)
constexpr int kGpuHeadDimsMask = FLASH_EXT_GPU_HEADDIMS_MASK;
#else
constexpr int kGpuHeadDimsMask = 0;
#endif

int gpu_built_head_dim_for(int d) {
  for (int i = 0; i < int(sizeof(kGpuHeadDims) / sizeof(int)); ++i) {
    if (((kGpuHeadDimsMask >> i) & 1) && d <= kGpuHeadDims[i]) { return kGpuHeadDims[i]; }
  }
  return -1;
}

std::vector<int> gpu_head_dims_in(int mask) {
  std::vector<int> out;
  for (int i = 0; i < int(sizeof(kGpuHeadDims) / sizeof(int)); ++i) {
    if ((mask >> i) & 1) { out.push_back(kGpuHeadDims[i]); }
  }
  return out;
}

std::string gpu_head_dims_list() {
  std::string s;
  for (int i = 0; i < int(sizeof(kGpuHeadDims) / sizeof(int)); ++i) {
    if ((kGpuHeadDimsMask >> i) & 1) { s += (s.empty() ? "" : ", ") + std::to_string(kGpuHeadDims[i]); }
  }
  return s.empty() ? "none" : s;
}

std::string host_head_dims_list() {
  std::string s;
  for (int hd : kHostHeadDims) {
    if (host_head_dim_compiled(hd)) { s += (s.empty() ? "" : ", ") + std::to_string(hd); }
  }
  return s.empty() ? "none" : s;
}

DeviceInfo device_info(at::Device device) {
  DeviceInfo info;
  if (!device.is_cuda()) {
    info.name = "cpu";
    info.processors = at::get_num_threads();
    return info;
  }
#if defined(FLASH_EXT_WITH_CUDA)
  // Queried once per device and cached (cudaGetDeviceProperties costs about a millisecond).  Not ATen's
  // cache: its header pulls in cuSPARSE/cuBLAS headers that a CUDA toolkit need not ship.
  constexpr int kMaxDevices = 64;
  static std::array<cudaDeviceProp, kMaxDevices> props;
  static std::array<std::once_flag, kMaxDevices> once;
  int const index = device.has_index() ? device.index() : c10::cuda::current_device();
  TORCH_CHECK(index >= 0 && index < kMaxDevices, "flash_ext: CUDA device index ", index, " out of range");
  std::call_once(once[index], [&] {
    C10_CUDA_CHECK(cudaGetDeviceProperties(&props[index], index));
  });
  cudaDeviceProp const* prop = &props[index];
  info.cuda = true;
  info.cc_major = prop->major, info.cc_minor = prop->minor;
  info.processors = prop->multiProcessorCount;
  info.smem_per_block_optin = int(prop->sharedMemPerBlockOptin);
  info.name = std::string(prop->name) + ", sm_" + std::to_string(prop->major * 10 + prop->minor);
#else
  info.name = device.str();
#endif
  return info;
}

bool check_qkv(ArgChecker& c, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, bool varlen,
               bool kv_cache, bool paged_varlen, bool any_head_dim) {
  int64_t const rank = varlen ? 3 : 4;
  int64_t const kv_rank = varlen && !paged_varlen ? 3 : 4;
  char const* const q_rule = varlen ? "must be (total_q, heads, head_dim)"
                                    : "must be (batch, seqlen_q, heads, head_dim)";
  char const* const kv_rule = paged_varlen ? "must be (num_pages, page_size, heads_k, head_dim) with block_table"
                              : varlen     ? "must be (total_k, heads_k, head_dim)"
                              : kv_cache   ? "must be (batch_cache, seqlen_cache, heads_k, head_dim) or pages"
                                           : "must be (batch, seqlen_k, heads_k, head_dim)";
  std::string const kname = kv_cache ? "k_cache" : "k", vname = kv_cache ? "v_cache" : "v";
  FLASH_EXT_REQUIRE(c, q.dim() == rank, "q", std::to_string(q.dim()) + " dims " + str(q.sizes()), q_rule);
  FLASH_EXT_REQUIRE(c, k.dim() == kv_rank, kname, std::to_string(k.dim()) + " dims " + str(k.sizes()), kv_rule);
  FLASH_EXT_REQUIRE(c, v.dim() == kv_rank, vname, std::to_string(v.dim()) + " dims " + str(v.sizes()), kv_rule);
  auto const dt = q.scalar_type();
  bool const dtype_ok = dt == at::kHalf || dt == at::kBFloat16 || (dt == at::kFloat && q.device().is_cpu());
  FLASH_EXT_REQUIRE(c, dtype_ok, "q.dtype", str(dt),
            q.device().is_cpu() ? "must be float16, bfloat16 or float32" : "must be float16 or bfloat16 on CUDA");
  FLASH_EXT_REQUIRE(c, k.scalar_type() == dt && v.scalar_type() == dt, kname + ".dtype/" + vname + ".dtype",
            str(k.scalar_type()) + "/" + str(v.scalar_type()), "must equal q.dtype (" + str(dt) + ")");
  FLASH_EXT_REQUIRE(c, k.device() == q.device() && v.device() == q.device(), kname + ".device/" + vname + ".device",
            str(k.device()) + "/" + str(v.device()), "must equal q.device (" + str(q.device()) + ")");
  for (auto const& [name, t] : {std::pair{std::string("q"), &q}, std::pair{kname, &k}, std::pair{vname, &v}}) {
    if (t->dim() >= 1) {
      FLASH_EXT_REQUIRE(c, t->stride(-1) == 1 || t->size(-1) <= 1 || t->numel() == 0, name + ".stride(-1)",
                std::to_string(t->stride(-1)), "the last dimension must be contiguous");
    }
  }
  bool const ranks_ok = q.dim() == rank && k.dim() == kv_rank && v.dim() == kv_rank;
  if (!ranks_ok) { return false; }
  int64_t const d = q.size(-1), h = q.size(-2), hk = k.size(-2);
  FLASH_EXT_REQUIRE(c, d >= 1 && d <= 256, "head_dim", std::to_string(d), "must be in [1, 256]");
  // In check-only mode the Python layer checks the caller's unpadded tensors (the explicit backward's given
  // buffers, before it pads): the multiple-of-8 rule is the padding's business then, not the caller's.
  if (!any_head_dim && !t_check_only && d >= 1 && d <= 256) {  // one rule per value: the range comes first
    FLASH_EXT_REQUIRE(c, d % 8 == 0, "head_dim", std::to_string(d),
              "must be a multiple of 8 at the op (the Python functions pad other sizes)");
  }
  // FLASH_EXT_CPU_ISA naming a level this build or CPU cannot run: refused, never replaced by another (an
  // emulated call runs the Sm80 kernels, not the host micro-kernels).
  if (q.device().is_cpu() && !emulated(q)) {
    char const* isa_error = host_isa_selection_error();
    char const* env = std::getenv("FLASH_EXT_CPU_ISA");
    FLASH_EXT_REQUIRE(c, *isa_error == '\0', "FLASH_EXT_CPU_ISA (environment)",
              std::string("'") + (env ? env : "") + "'",
              std::string(isa_error) + "; unset it or name a level this CPU runs (best here: " +
                  host_isa_name(host_isa_best()) + ")");
  }
  // A partial build (FLASH_EXT_HOST_HEADDIMS / FLASH_EXT_HEADDIMS) has no kernel for larger head dims.
  int64_t const padded = (d + 7) / 8 * 8;
  if (d >= 1 && d <= 256 && emulated(q)) {
#if defined(FLASH_EXT_WITH_EMULATOR)
    std::string const why = emu::head_dim_unavailable(int(padded));
    FLASH_EXT_REQUIRE(c, why.empty(), "head_dim", std::to_string(d), why);
#endif
  } else if (d >= 1 && d <= 256) {
    bool const cpu = q.device().is_cpu();
    if (cpu ? host_head_dim_for(int(padded)) < 0 : gpu_built_head_dim_for(int(padded)) < 0) {
      FLASH_EXT_REQUIRE(c, false, "head_dim", std::to_string(d),
                std::string("no ") + (cpu ? "CPU" : "GPU") + " kernel for it in this build (compiled " +
                    (cpu ? "host" : "GPU") + " head dims: " + (cpu ? host_head_dims_list() : gpu_head_dims_list()) +
                    "); rebuild with " + (cpu ? "FLASH_EXT_HOST_HEADDIMS" : "FLASH_EXT_HEADDIMS") +
                    " including a head dim >= " + std::to_string(d));
    }
  }
  FLASH_EXT_REQUIRE(c, k.sizes() == v.sizes(), vname + ".shape", str(v.sizes()),
            "must equal " + kname + ".shape " + str(k.sizes()));
  if (!varlen && !kv_cache) {
    FLASH_EXT_REQUIRE(c, k.size(0) == q.size(0), "k.shape[0]", std::to_string(k.size(0)),
              "must equal q batch " + std::to_string(q.size(0)));
  }
  FLASH_EXT_REQUIRE(c, k.size(-1) == d, kname + ".shape[-1]", std::to_string(k.size(-1)),
            "must equal q head_dim " + std::to_string(d));
  FLASH_EXT_REQUIRE(c, hk > 0 && h % hk == 0, "heads",
            "q " + std::to_string(h) + ", " + kname + " " + std::to_string(hk),
            "q heads must be a multiple of k/v heads (MQA/GQA)");
  return true;
}

void check_options(ArgChecker& c, at::Tensor const& q, int64_t batch, int64_t heads, double softmax_scale,
                   double softcap, std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits) {
  // As flash_attn 2.8's C++ API: num_splits < 1 picks the heuristic, a negative window side is unbounded and a
  // softcap <= 0 is off (its Python docstring: "<= 0.0 means deactivate"); set_semantics maps them.
  FLASH_EXT_REQUIRE(c, num_splits <= kMaxSplits, "num_splits", std::to_string(num_splits),
            "must be <= " + std::to_string(kMaxSplits) + " (0 or less: heuristic, 1: no split, n: n splits)");
  // The kernels scale in float32 (set_semantics): the scale, the cap, their quotient and each times log2(e)
  // must be normal floats.  Checked in double only, 1e-50 became 0 (masked keys -inf * 0 = NaN in every row),
  // 3e38 became inf once times log2(e), and so did a cap of 1e39: all-NaN outputs from accepted arguments.
  // (A subnormal would be 0 on the GPU, whose fast-math code flushes them.)
  auto const normal_float = [](double x) { return x >= double(FLT_MIN) && x <= double(FLT_MAX) / M_LOG2E; };
  std::string const range = "[" + str(double(FLT_MIN)) + ", " + str(double(FLT_MAX) / M_LOG2E) + "]";
  FLASH_EXT_REQUIRE(c, std::isfinite(softcap) && (softcap <= 0 || normal_float(softcap)), "softcap", str(softcap),
            "must be finite: <= 0 is off, else in " + range + " (the kernels compute in float32)");
  // Masked scores are -inf in the kernel's unscaled domain; a scale <= 0 would turn them into NaN or +inf.
  FLASH_EXT_REQUIRE(c, normal_float(softmax_scale), "softmax_scale", str(softmax_scale),
            "must be finite and > 0, in " + range + " (the kernels compute in float32, also scale * log2(e))");
  FLASH_EXT_REQUIRE(c, !(softcap > 0 && normal_float(softcap) && normal_float(softmax_scale)) ||
                           normal_float(softmax_scale / softcap), "softmax_scale / softcap",
            str(softmax_scale / softcap), "must be in " + range + " (the kernels pre-scale scores by it in float32)");
  if (alibi_slopes.has_value()) {
    auto const& a = *alibi_slopes;
    bool const shape_ok = (a.dim() == 1 && a.size(0) == heads) ||
                          (a.dim() == 2 && a.size(0) == batch && a.size(1) == heads);
    FLASH_EXT_REQUIRE(c, shape_ok || heads < 0, "alibi_slopes.shape", str(a.sizes()),
              "must be (heads,) = (" + std::to_string(heads) + ",) or (batch, heads) = (" + std::to_string(batch) +
                  ", " + std::to_string(heads) + ")");
    FLASH_EXT_REQUIRE(c, a.scalar_type() == at::kFloat, "alibi_slopes.dtype", str(a.scalar_type()), "must be float32");
    FLASH_EXT_REQUIRE(c, a.device() == q.device(), "alibi_slopes.device", str(a.device()),
              "must equal q.device (" + str(q.device()) + ")");
  }
}

namespace {

// The dimensions of t with more than one element as (size, stride), strides ascending.
std::vector<std::pair<int64_t, int64_t>> live_dims(at::Tensor const& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t k = 0; k < t.dim(); ++k) {
    if (t.size(k) > 1) { dims.emplace_back(t.size(k), t.stride(k)); }
  }
  std::sort(dims.begin(), dims.end(), [](auto const& x, auto const& y) { return x.second < y.second; });
  return dims;
}

// Each stride exceeds the span of the smaller ones (the layouts of slices, transposes and packed views of a
// contiguous buffer): then the view's elements are distinct.
bool nested(std::vector<std::pair<int64_t, int64_t>> const& dims) {
  int64_t span = 0;
  for (auto const& [n, s] : dims) {
    if (s <= span) { return false; }
    span += (n - 1) * s;
  }
  return true;
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

// One dimension of two views with the same stride there: their index difference i_a - i_b is in [lo, hi].
struct DiffDim {
  int64_t stride, lo, hi;
};

// Whether some element of view a lies `delta` elements after some element of view b: delta = sum_k d_k * s_k
// with d_k in [lo_k, hi_k] over the first `count` dims (strides ascending).  Exact: at the largest stride only
// the d that leave a remainder the smaller dims can reach are tried, at most two for the layouts of slices of
// one buffer (each stride above the others' reach); more than four (an exotic interleaving) counts as reachable.
bool reachable(std::vector<DiffDim> const& dims, size_t count, int64_t delta) {
  if (count == 0) { return delta == 0; }
  DiffDim const& top = dims[count - 1];
  int64_t low = 0, high = 0;  // what the smaller dims can add
  for (size_t j = 0; j + 1 < count; ++j) {
    low += dims[j].lo * dims[j].stride;
    high += dims[j].hi * dims[j].stride;
  }
  // delta - d * s in [low, high]
  int64_t const lo = std::max(top.lo, -floor_div(high - delta, top.stride));
  int64_t const hi = std::min(top.hi, floor_div(delta - low, top.stride));
  if (hi - lo >= 4) { return true; }
  for (int64_t d = lo; d <= hi; ++d) {
    if (reachable(dims, count - 1, delta - d * top.stride)) { return true; }
  }
  return false;
}

// Whether a and b may share an element.  torch answers for dense tensors (and the same TensorImpl); for other
// views it answers "too hard", which is not "no": two objects for one packed slice dkv[:, :, 0], or two views a
// few elements apart, alias without being dense.  Byte ranges that do not meet cannot share; views with the
// same element type and the same stride in every dimension that has more than one element in either (the
// slices of a packed dqkv or KV cache, a GQA qkv split into h, h_k, h_k heads) are decided exactly; other
// interleaved layouts count as sharing (not provably disjoint).
bool may_share(at::Tensor const& a, at::Tensor const& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0 || !a.storage().is_alias_of(b.storage())) {
    return false;
  }
  at::MemOverlapStatus const status = at::get_overlap_status(a, b);
  if (status != at::MemOverlapStatus::TooHard) {
    return status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial;
  }
  auto const extent = [](at::Tensor const& t) {  // bytes [lo, hi) from the storage's start
    int64_t last = 0;
    for (int64_t k = 0; k < t.dim(); ++k) { last += (t.size(k) - 1) * t.stride(k); }
    int64_t const lo = t.storage_offset() * int64_t(t.element_size());
    return std::pair<int64_t, int64_t>{lo, lo + (last + 1) * int64_t(t.element_size())};
  };
  auto const [a_lo, a_hi] = extent(a);
  auto const [b_lo, b_hi] = extent(b);
  if (a_hi <= b_lo || b_hi <= a_lo) { return false; }
  if (a.scalar_type() != b.scalar_type() || a.dim() != b.dim()) { return true; }
  std::vector<DiffDim> dims;
  for (int64_t k = 0; k < a.dim(); ++k) {
    if (a.size(k) == 1 && b.size(k) == 1) { continue; }
    // a size-1 side's stride never multiplies a nonzero index: the other side's stands for both
    int64_t const stride = a.size(k) == 1 ? b.stride(k) : a.stride(k);
    if ((a.size(k) > 1 && b.size(k) > 1 && a.stride(k) != b.stride(k)) || stride <= 0) { return true; }
    dims.push_back({stride, -(b.size(k) - 1), a.size(k) - 1});
  }
  std::sort(dims.begin(), dims.end(), [](DiffDim const& x, DiffDim const& y) { return x.stride < y.stride; });
  return reachable(dims, dims.size(), b.storage_offset() - a.storage_offset());
}

// Whether t's elements are provably distinct (a written tensor must not write one element twice).
bool distinct_elements(at::Tensor const& t) {
  if (at::has_internal_overlap(t) == at::MemOverlap::Yes) { return false; }
  return t.numel() <= 1 || t.is_non_overlapping_and_dense() || nested(live_dims(t));
}

}  // namespace

void check_no_overlap(ArgChecker& c, std::vector<std::pair<at::Tensor const*, char const*>> const& written,
                      std::vector<std::pair<at::Tensor const*, char const*>> const& read) {
  for (size_t i = 0; i < written.size(); ++i) {
    auto const& [t, name] = written[i];
    if (!t->defined()) { continue; }  // a missing buffer is its op's error
    FLASH_EXT_REQUIRE(c, distinct_elements(*t), name,
              "strides " + str(t->strides()) + " with elements that share memory (or cannot be shown not to)",
              "is written: must not overlap itself (e.g. not an expand()ed tensor)");
    for (size_t j = i + 1; j < written.size(); ++j) {
      FLASH_EXT_REQUIRE(c, !may_share(*t, *written[j].first), std::string(name) + "/" + written[j].second,
                "tensors sharing memory", "are both written: must not overlap each other");
    }
    for (auto const& [r, r_name] : read) {
      FLASH_EXT_REQUIRE(c, !may_share(*t, *r), std::string(name) + "/" + r_name, "tensors sharing memory",
                std::string(name) + " is written while " + r_name + " is read: they must not overlap");
    }
  }
}

void check_lengths(ArgChecker& c, int64_t seqlen_q, int64_t seqlen_k, std::string const& what, int64_t rows,
                   int64_t num_splits) {
  FLASH_EXT_REQUIRE(c, seqlen_q + seqlen_k <= kMaxLengthSum, what,
            "seqlen_q " + std::to_string(seqlen_q) + " + seqlen_k " + std::to_string(seqlen_k),
            "the sum must be <= " + std::to_string(kMaxLengthSum) +
                ": the kernels index rows and keys with 32-bit ints");
  FLASH_EXT_REQUIRE(c, num_splits <= 1 || rows <= INT32_MAX, "num_splits", std::to_string(num_splits) + " with " +
            std::to_string(rows) + " query rows", "split-KV partials are addressed with 32-bit rows: at most " +
            std::to_string(INT32_MAX) + " rows (use num_splits=0 or 1)");
}

void set_semantics(FwdParams& p, double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                   double softcap, std::optional<at::Tensor> const& alibi_slopes) {
  softcap = std::max(softcap, 0.0);  // <= 0: off (flash_attn)
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
  // Both sides are then below the lengths, which check_lengths keeps in int range.  causal is window
  // (-1, 0) (a finite left window with causal makes a local problem).  With one query row, bottom-right
  // causal shows every key.
  if (window_left < 0 || window_left >= std::max(p.seqlen_k - 1, 0)) { window_left = -1; }
  if (window_right < 0 || window_right >= std::max(p.seqlen_q - 1, 0)) { window_right = -1; }
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

KernelInputs prepare_inputs(FwdParams& p, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                            at::Tensor& out, at::Tensor& lse, std::optional<at::Tensor> const& alibi_slopes) {
  if (poison_outputs()) {
    out.fill_(NAN);
    lse.fill_(NAN);
  }
  bool const sm80 = q.is_cuda() || emulated(q);
  KernelInputs in{aligned_for_kernel(q, sm80), aligned_for_kernel(k, sm80), aligned_for_kernel(v, sm80), std::nullopt};
  if (alibi_slopes.has_value()) { in.alibi = element_aligned(*alibi_slopes); }
  set_inputs(p, in.q, in.k, in.v);
  set_outputs(p, out, lse);
  return in;
}

std::tuple<at::Tensor, at::Tensor> set_splits(FwdParams& p, at::Tensor const& q, int64_t requested, int64_t accum_rows,
                                              bool allocate) {
  p.num_splits = 1;
  if (requested > 1) {
    p.num_splits = int(requested);
  } else if (requested <= 0) {
    DeviceInfo const dev = call_device(q);
    TileChoice const t = choose_tile(p, q, dev);
    if (t.ok) {
      // The heuristic fills the slots where CTAs run at once: SMs times the tile's resident CTAs per SM (the
      // one-warp decode tile keeps several per SM in flight to cover HBM latency).
      // In 64 bits, clamped: the heuristic multiplies the count by 10 in int (a grid this large never splits).
      int const ctas = int(std::min<int64_t>(int64_t(p.b) * p.h * ceil_div(p.seqlen_q, t.block_m), INT32_MAX / 16));
      p.num_splits = num_splits_heuristic(ctas, dev.processors * t.ctas_per_sm, ceil_div(p.seqlen_k, t.block_n),
                                          int(kMaxSplits));
      // CPU decode: at least as many splits as keep a split's K/V rows of every head in half of L2, where
      // they are warmed before its heads run (launch_host.h).
      if (!dev.cuda && !dev.emulated && t.block_m == kHostBlockMShort) {
        int64_t const row_bytes = host_warm_row_bytes(p, 0, p.h_k - 1, int(q.element_size()));
        p.num_splits = std::max(p.num_splits, host_decode_splits(p.seqlen_k, t.block_n, row_bytes,
                                                                 host_l2_bytes() / 2, int(kMaxSplits)));
      }
    }
  }
  // The partials are addressed with int rows (accum_rows); a problem with more rows runs unsplit (forced
  // splits of such a problem are refused by the ops before this point).
  if (accum_rows > INT32_MAX) { p.num_splits = 1; }
  if (p.num_splits == 1 || !allocate) { return {}; }
  auto const opts = q.options().dtype(at::kFloat);
  at::Tensor oaccum = at::empty({p.num_splits, p.h, accum_rows, p.d}, opts);
  at::Tensor lseaccum = at::empty({p.num_splits, p.h, accum_rows}, opts);
  if (poison_outputs()) {  // every partial must be written, empty splits too
    oaccum.fill_(NAN);
    lseaccum.fill_(NAN);
  }
  p.accum_rows = int(accum_rows);
  p.oaccum_ptr = oaccum.data_ptr<float>();
  p.lseaccum_ptr = lseaccum.data_ptr<float>();
  return {oaccum, lseaccum};
}

bool set_poison_outputs(bool enable) { return g_poison_outputs.exchange(enable); }
bool poison_outputs() { return g_poison_outputs.load(std::memory_order_relaxed); }

Plan make_plan(FwdParams const& p, at::Tensor const& q) {
  Plan plan;
  DeviceInfo const dev = call_device(q);
  plan.device = q.device().str() + (dev.cuda || dev.emulated ? " (" + dev.name + ")" : "");
  plan.backend = dev.emulated ? "Sm80 traits on the warp emulator (CPU)"
                 : dev.cuda   ? "Sm80 traits (CUDA)"
                              : "host traits (CPU)";
  plan.emulated = dev.emulated;
  if (!dev.cuda && !dev.emulated) { plan.cpu_isa = host_isa_name(host_isa_selected()); }
  TileChoice const t = choose_tile(p, q, dev);
  plan.ok = t.ok;
  if (!t.why.empty()) { plan.reasons.push_back(t.why); }
  plan.head_dim = p.d, plan.head_dim_tile = t.head_dim, plan.block_m = t.block_m, plan.block_n = t.block_n;
  plan.threads_per_cta = t.threads, plan.smem_bytes = t.smem, plan.variant = t.variant;
  plan.ctas_per_sm = t.ctas_per_sm;
  plan.num_splits = p.num_splits;
  plan.varlen = p.cu_seqlens_q != nullptr;
  if (t.ok) {
    ProblemFlags const f = problem_flags(p, t.block_m, t.block_n, t.head_dim);
    plan.even_mn = f.even_mn, plan.even_k = f.even_k;
    if (dev.cuda || dev.emulated) {  // the launch grid; (batch, head, split) folded over y and z (grid.h)
      plan.grid[0] = t.grid.x, plan.grid[1] = t.grid.y, plan.grid[2] = t.grid.z;
    } else {  // host work items
      plan.grid[0] = ceil_div(p.seqlen_q, t.block_m), plan.grid[1] = p.b, plan.grid[2] = int64_t(p.h) * p.num_splits;
    }
  }
  plan.causal = p.is_causal, plan.local = p.is_local, plan.alibi = p.alibi_slopes_ptr != nullptr;
  plan.softcap = p.softcap > 0, plan.dropout = p.is_dropout;
  plan.window_left = p.window_left, plan.window_right = p.window_right;
  plan.b = p.b, plan.h = p.h, plan.h_k = p.h_k, plan.seqlen_q = p.seqlen_q, plan.seqlen_k = p.seqlen_k;
  plan.element_size = int(q.element_size());

  // HBM traffic estimate.  flash_ext reads Q once and K/V once per query block of each head (an upper bound:
  // L2 absorbs some), about half of that under a causal mask, and writes O and the fp32 LSE; split-KV adds
  // the fp32 partials written and read back.  Attention that materialises the scores writes and reads back
  // S and P (b * h * sq * sk elements each).  For varlen the lengths are the maxima.
  int64_t const e = q.element_size(), b = p.b, h = p.h, hk = p.h_k, d = p.d, sq = p.seqlen_q, sk = p.seqlen_k;
  int64_t const qo = 2 * b * sq * h * d * e + b * h * sq * 4;
  int64_t const kv = 2 * b * sk * hk * d * e;
  double const m_blocks = t.block_m ? std::max<double>(1, ceil_div(int(sq), t.block_m) * (p.is_causal ? 0.5 : 1.0)) : 1;
  plan.hbm_bytes = qo + int64_t(double(kv) * double(h / hk) * m_blocks);
  if (p.num_splits > 1) { plan.hbm_bytes += 2 * int64_t(p.num_splits) * b * h * sq * (d + 1) * 4; }
  plan.naive_hbm_bytes = qo + kv + 4 * b * h * sq * sk * e;
  return plan;
}

std::string plan_to_json(Plan const& plan) {
  std::ostringstream os;
  auto b = [](bool x) { return x ? "true" : "false"; };
  os << "{\"ok\": " << b(plan.ok) << ", \"reasons\": [";
  for (size_t i = 0; i < plan.reasons.size(); ++i) {
    os << (i ? ", " : "") << "\"" << json_escape(plan.reasons[i]) << "\"";
  }
  os << "], \"device\": \"" << json_escape(plan.device) << "\", \"backend\": \"" << plan.backend << "\""
     << ", \"head_dim\": " << plan.head_dim << ", \"head_dim_tile\": " << plan.head_dim_tile
     << ", \"block_m\": " << plan.block_m << ", \"block_n\": " << plan.block_n
     << ", \"threads_per_cta\": " << plan.threads_per_cta << ", \"smem_bytes\": " << plan.smem_bytes
     << ", \"ctas_per_sm\": " << plan.ctas_per_sm
     << ", \"variant\": \"" << plan.variant << "\", \"grid\": [" << plan.grid[0] << ", " << plan.grid[1] << ", "
     << plan.grid[2] << "], \"num_splits\": " << plan.num_splits << ", \"varlen\": " << b(plan.varlen)
     << ", \"flags\": {\"even_mn\": " << b(plan.even_mn) << ", \"even_k\": " << b(plan.even_k)
     << ", \"causal\": " << b(plan.causal) << ", \"local\": " << b(plan.local) << ", \"alibi\": " << b(plan.alibi)
     << ", \"softcap\": " << b(plan.softcap) << ", \"split\": " << b(plan.num_splits > 1)
     << ", \"dropout\": " << b(plan.dropout) << "}, \"emulated\": " << b(plan.emulated) << ", \"window\": ["
     << plan.window_left << ", " << plan.window_right << "], \"hbm_bytes\": " << plan.hbm_bytes
     << ", \"naive_hbm_bytes\": " << plan.naive_hbm_bytes << ", \"cpu_isa\": \"" << plan.cpu_isa << "\"}";
  return os.str();
}

void launch(FwdParams const& params, KernelInputs const& in, at::Tensor const& out,
            std::tuple<at::Tensor, at::Tensor> const& accum, char const* op) {
  at::Tensor const& q = in.q;
  static bool const log = [] {
    char const* e = std::getenv("FLASH_EXT_LOG");
    return e != nullptr && std::string(e) == "1";
  }();
  if (log) { std::fprintf(stderr, "[flash_ext] %s %s\n", op, plan_to_json(make_plan(params, q)).c_str()); }
  if (t_plan_only) {  // explain_call: the plan this launch would run, and no launch
    t_recorded_plan = make_plan(params, q);
    return;
  }
  bool const emu = emulated(q);
  if (q.is_cuda() || emu) {
    // grid.h folds (batch, head, split) over grid.y and grid.z: at most 65,535^2 of them per query-row block.
    int64_t const items = int64_t(params.b) * params.h * params.num_splits;
    TORCH_CHECK_VALUE(grid_error(fwd_grid(1, params.b, params.h, params.num_splits)) == nullptr, op, ": batch ",
                      params.b, " x heads ", params.h, " x num_splits ", params.num_splits, " = ", items,
                      " CTAs per query-row block; one launch takes at most ", kMaxFoldedItems);
  }
  if (emu) {
#if defined(FLASH_EXT_WITH_EMULATOR)
    launch_emulated(params, in, out, accum, op);
#endif
    return;
  }
  if (q.device().is_cpu()) {
    run_fwd_cpu(params, to_dtype(q.scalar_type()));
    return;
  }
#if defined(FLASH_EXT_WITH_CUDA)
  c10::cuda::CUDAGuard guard(q.device());
  DeviceInfo const dev = device_info(q.device());
  std::string const err = run_fwd_cuda(params, to_dtype(q.scalar_type()), dev.cc_major, dev.cc_minor,
                                       dev.smem_per_block_optin, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err.empty(), op, " (CUDA): ", err);
#else
  TORCH_CHECK(false, op, ": flash_ext was built without CUDA; rebuild with a CUDA toolkit or pass CPU tensors");
#endif
}

bool swap_query_groups(at::Tensor const& q, at::Tensor const& k, int64_t window_left, int64_t seqlen_k,
                       std::optional<at::Tensor> const& alibi_slopes) {
  return q.dim() == 4 && q.size(1) == 1 && q.size(2) > k.size(2) && !alibi_slopes.has_value() &&
         (window_left < 0 || window_left >= seqlen_k - 1);
}

at::Tensor groups_as_rows(at::Tensor const& q, int64_t h_k) {
  int64_t const b = q.size(0), h = q.size(2), d = q.size(3);
  return q.reshape({b, h_k, h / h_k, d}).transpose(1, 2);
}

GroupedOutputs grouped_outputs(at::Tensor const& q, int64_t h_k) {
  int64_t const b = q.size(0), h = q.size(2), d = q.size(3), g = h / h_k;
  at::Tensor out = at::empty({b, 1, h, d}, q.options());
  at::Tensor lse = at::empty({b, h, 1}, q.options().dtype(at::kFloat));
  return {out, lse, out.view({b, h_k, g, d}).transpose(1, 2), lse.view({b, h_k, g})};
}

}  // namespace flash_ext::ops
