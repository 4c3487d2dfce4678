// flash_ext._C: the pybind11 module.  Importing it loads the shared library, whose TORCH_LIBRARY blocks
// (csrc/ops/*.cpp) register the torch.ops.flash_ext.* ops; the module itself exposes what Python needs that
// is not an op: what the build contains, the plans behind explain(), the split heuristic, and test hooks.
// Nothing is both an op and a module function.
#include <torch/extension.h>

#include <array>
#include <string>
#include <vector>

#include "flash_ext/dispatch.h"
#include "flash_ext/grid.h"
#include "flash_ext/launch_host.h"
#include "ops/common.h"
#include "ops/index_values.h"
#include "ops/ops.h"

namespace flash_ext {
namespace {

namespace py = pybind11;

#if defined(FLASH_EXT_WITH_CUDA)
constexpr int kGpuHeadDimsMask = FLASH_EXT_GPU_HEADDIMS_MASK;
std::string const kCudaArchs = FLASH_EXT_CUDA_ARCHS_STR;
#else
constexpr int kGpuHeadDimsMask = 0;
std::string const kCudaArchs;
#endif

std::vector<int> emulator_head_dims() {
  std::vector<int> out;
  std::string const list = ops::emulator_head_dims_list();  // "64, 128"
  for (size_t i = 0; i < list.size();) {
    size_t const end = list.find(',', i);
    out.push_back(std::stoi(list.substr(i, end == std::string::npos ? std::string::npos : end - i)));
    i = end == std::string::npos ? list.size() : end + 1;
  }
  return out;
}

std::vector<int> gpu_head_dims() { return ops::gpu_head_dims_in(kGpuHeadDimsMask); }

std::vector<std::string> cuda_archs() {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < kCudaArchs.size()) {
    size_t const end = kCudaArchs.find(';', start);
    std::string const a = kCudaArchs.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!a.empty()) { out.push_back(a); }
    if (end == std::string::npos) { break; }
    start = end + 1;
  }
  return out;
}

py::dict build_info() {
  py::dict info;
  std::vector<int> host;
  for (int hd : kHostHeadDims) {
    if (host_head_dim_compiled(hd)) { host.push_back(hd); }
  }
  info["cuda"] = kGpuHeadDimsMask != 0 || !kCudaArchs.empty();
  info["cuda_archs"] = kCudaArchs;
  info["gpu_head_dims"] = gpu_head_dims();
  info["gpu_bwd_head_dims"] = ops::gpu_bwd_head_dims();
  info["host_head_dims"] = host;
  info["emulator"] = ops::emulator_built();
  info["emulator_head_dims"] = emulator_head_dims();
  // The forward tiles' warps: dispatch.h's per-variant rule, or the 8-warp baseline (FLASH_EXT_GPU_FWD_WARPS).
  info["gpu_fwd_warps"] = kBaselineFwdWarps != 0 ? "8 (baseline build)" : "per variant";
  // The CPU backend's instruction-set levels: compiled into this build, runnable on this CPU (else why not),
  // the best runnable one, and the one calls use (FLASH_EXT_CPU_ISA or set_cpu_isa, else the best).
  py::dict levels;
  for (int i = 0; i < kNumHostIsas; ++i) {
    HostIsa const isa = HostIsa(i);
    py::dict l;
    l["compiled"] = host_isa_compiled(isa);
    l["supported"] = host_isa_supported(isa);
    l["unavailable"] = std::string(host_isa_unavailable_reason(isa));
    levels[host_isa_name(isa)] = l;
  }
  info["cpu_isas"] = levels;
  info["cpu_isa_best"] = host_isa_name(host_isa_best());
  info["cpu_isa"] = host_isa_name(host_isa_selected());
  // The L2 size per core that sizes CPU decode splits (launch_host.h); the OS's figure, else 1 MiB.
  info["cpu_l2_bytes"] = host_l2_bytes();
  return info;
}

// Test hook: the instruction-set level CPU calls use from now on ("default": the best this CPU runs).
// Returns the previous selection ("default" when it was automatic); raises ValueError (naming the missing
// CPU feature) when refused.
std::string set_cpu_isa(std::string const& name) {
  std::string const previous = host_isa_automatic() ? "default" : host_isa_name(host_isa_selected());
  char const* why = host_isa_override(name.c_str());
  if (*why != '\0') { throw py::value_error("set_cpu_isa('" + name + "'): " + why); }
  return previous;
}

// One entry per compiled kernel instance: the CUDA forward kernels (arch x head dim x dtype x causal x
// static variant, with their tile; smem_budget_kb 163, or 99 for the kernels a file adds for sm_86/sm_89's
// shared memory where a tile differs there) and the host instances (head dim x dtype x tile height).
py::list compiled_kernels() {
  py::list out;
  for (auto const& arch : cuda_archs()) {
    for (int hd : gpu_head_dims()) {
      for (char const* dtype : {"fp16", "bf16"}) {
        for (bool causal : {false, true}) {
          for (int vi = 0; vi < kNumVariants; ++vi) {
            for (SmemBudget budget : {SmemBudget::kSm80, SmemBudget::kSm86}) {
              TileConfig const t = sm80_tile_config(hd, vi, causal, budget);
              if (budget == SmemBudget::kSm86 && t == sm80_tile_config(hd, vi, causal)) { continue; }
              py::dict k;
              k["backend"] = "cuda", k["arch"] = "sm_" + arch, k["kernel"] = "fwd", k["head_dim"] = hd;
              k["dtype"] = dtype, k["causal"] = causal, k["variant"] = kVariants[vi].name;
              k["block_m"] = t.block_m, k["block_n"] = t.block_n, k["threads"] = 32 * t.num_warps;
              k["smem_budget_kb"] = int(budget) / 1024;
              out.append(k);
            }
          }
        }
      }
    }
  }
  for (int hd : emulator_head_dims()) {  // the same Sm80 instances, with the emulated architecture policy
    for (char const* dtype : {"fp16", "bf16"}) {
      for (bool causal : {false, true}) {
        for (int vi = 0; vi < kNumVariants; ++vi) {
          TileConfig const t = sm80_tile_config(hd, vi, causal);
          py::dict k;
          k["backend"] = "emulator", k["arch"] = "sm_80", k["kernel"] = "fwd", k["head_dim"] = hd;
          k["dtype"] = dtype, k["causal"] = causal, k["variant"] = kVariants[vi].name;
          k["block_m"] = t.block_m, k["block_n"] = t.block_n, k["threads"] = 32 * t.num_warps;
          out.append(k);
        }
      }
    }
  }
  for (int hd : kHostHeadDims) {
    if (!host_head_dim_compiled(hd)) { continue; }
    for (char const* dtype : {"fp32", "fp16", "bf16"}) {
      for (int block_m : {kHostBlockMShort, kHostBlockM}) {
        py::dict k;
        k["backend"] = "cpu", k["kernel"] = "fwd", k["head_dim"] = hd, k["dtype"] = dtype;
        k["variant"] = "runtime flags", k["block_m"] = block_m, k["block_n"] = host_block_n(std::string(dtype) == "bf16"), k["threads"] = 1;
        out.append(k);
      }
    }
  }
  return out;
}

// A per-thread op mode (check-only, plan-only) switched on for one scope and restored however it ends.
class ScopedMode {
 public:
  explicit ScopedMode(bool (*set)(bool)) : set_(set), previous_(set(true)) {}
  ~ScopedMode() { set_(previous_); }
  ScopedMode(ScopedMode const&) = delete;
  ScopedMode& operator=(ScopedMode const&) = delete;

 private:
  bool (*set_)(bool);
  bool previous_;
};

py::dict plan_to_dict(ops::Plan const& p) {
  py::dict d;
  d["ok"] = p.ok;
  d["reasons"] = p.reasons;
  if (!p.ok && p.backend.empty()) { return d; }
  d["device"] = p.device, d["backend"] = p.backend, d["head_dim"] = p.head_dim, d["head_dim_tile"] = p.head_dim_tile;
  d["block_m"] = p.block_m, d["block_n"] = p.block_n, d["threads_per_cta"] = p.threads_per_cta;
  d["smem_bytes"] = p.smem_bytes, d["ctas_per_sm"] = p.ctas_per_sm, d["variant"] = p.variant;
  d["grid"] = std::vector<int64_t>{p.grid[0], p.grid[1], p.grid[2]};
  d["num_splits"] = p.num_splits, d["varlen"] = p.varlen, d["emulated"] = p.emulated;
  py::dict flags;
  flags["even_mn"] = p.even_mn, flags["even_k"] = p.even_k, flags["causal"] = p.causal, flags["local"] = p.local;
  flags["alibi"] = p.alibi, flags["softcap"] = p.softcap, flags["split"] = p.num_splits > 1;
  flags["dropout"] = p.dropout;
  d["flags"] = flags;
  d["window"] = std::vector<int>{p.window_left, p.window_right};
  d["hbm_bytes"] = p.hbm_bytes, d["naive_hbm_bytes"] = p.naive_hbm_bytes;
  if (!p.cpu_isa.empty()) { d["cpu_isa"] = p.cpu_isa; }
  py::dict problem;
  problem["b"] = p.b, problem["h"] = p.h, problem["h_k"] = p.h_k, problem["seqlen_q"] = p.seqlen_q;
  problem["seqlen_k"] = p.seqlen_k, problem["d"] = p.head_dim, problem["element_size"] = p.element_size;
  d["kernel_problem"] = problem;
  return d;
}

// The GPU kernel's tile for a problem (dispatch.h: the static variant select_fwd_variant picks and its
// sm80_tile_config), whatever this build compiled: the roofline model of explain(gpu=...) needs it on
// machines without a GPU too.  The problem is given by its shape and flags, as a plan reports them.
py::dict gpu_tile_config(int head_dim, bool causal, int max_smem_per_block_optin, int64_t seqlen_q, int64_t seqlen_k,
                         bool varlen, bool local, bool alibi, bool softcap, int num_splits, bool dropout) {
  int const hd = gpu_head_dim_for(head_dim);
  TORCH_CHECK_VALUE(hd > 0, "gpu_tile_config: head_dim ", head_dim, " is above the largest GPU tile (256)");
  TORCH_CHECK_VALUE(seqlen_q >= 0 && seqlen_k >= 0 && num_splits >= 1, "gpu_tile_config: seqlen_q ", seqlen_q,
                    ", seqlen_k ", seqlen_k, ", num_splits ", num_splits, ": lengths must be >= 0 and splits >= 1");
  // Only the fields problem_flags reads; the pointers stand for "present" and are never dereferenced.
  static int const kPresent = 0;
  FwdParams p{};
  p.seqlen_q = int(seqlen_q), p.seqlen_k = int(seqlen_k), p.d = head_dim;
  p.cu_seqlens_q = varlen ? &kPresent : nullptr;
  p.is_local = local, p.softcap = softcap ? 1.f : 0.f, p.num_splits = num_splits, p.is_dropout = dropout;
  p.alibi_slopes_ptr = alibi ? reinterpret_cast<float const*>(&kPresent) : nullptr;
  SmemBudget const budget = smem_budget_for(max_smem_per_block_optin);
  int const variant = select_fwd_variant(p, hd, causal, budget);
  TORCH_CHECK_VALUE(variant >= 0, "gpu_tile_config: no static variant admits causal=", causal, " local=", local);
  TileConfig const t = sm80_tile_config(hd, variant, causal, budget);
  py::dict d;
  d["head_dim_tile"] = hd, d["block_m"] = t.block_m, d["block_n"] = t.block_n, d["num_warps"] = t.num_warps;
  d["threads"] = 32 * t.num_warps, d["smem_bytes"] = tile_smem_bytes(t, hd), d["variant"] = kVariants[variant].name;
  d["ctas_per_sm"] = sm80_ctas_per_sm(t, hd, budget);
  return d;
}

// The launch geometry of grid.h for m_blocks x batch x heads x splits (and the combine kernel's for seqlen_q
// rows of head dim d), and the decode of the given (x, y, z) blocks: what the CUDA launchers and the emulator
// compute, as a pure function for tests and explain().
py::dict launch_geometry(int64_t m_blocks, int64_t b, int64_t h, int64_t num_splits, int64_t seqlen_q, int64_t d,
                         std::vector<std::array<int64_t, 3>> const& blocks) {
  TORCH_CHECK_VALUE(m_blocks >= 0 && b >= 1 && h >= 1 && num_splits >= 1 && seqlen_q >= 0 && d >= 1,
                    "launch_geometry: sizes must be positive");
  GridDims const g = fwd_grid(m_blocks, b, h, num_splits);
  GridDims const c = combine_grid(seqlen_q, d, b, h);
  char const* const fwd_err = grid_error(g);
  char const* const comb_err = grid_error(c);
  py::dict out;
  out["fwd_grid"] = std::vector<int64_t>{g.x, g.y, g.z};
  out["fwd_error"] = fwd_err ? fwd_err : "";
  out["combine_grid"] = std::vector<int64_t>{c.x, c.y, c.z};
  out["combine_error"] = comb_err ? comb_err : "";
  py::list decoded;
  for (auto const& [x, y, z] : blocks) {
    FwdBlock const f = fwd_block(unsigned(x), unsigned(y), unsigned(z), unsigned(g.y), int(b), int(h), int(num_splits));
    CombineBlock const cb = combine_block(unsigned(y), unsigned(z), unsigned(c.y), int(b), int(h));
    py::dict blk;
    blk["fwd"] = std::vector<int64_t>{f.m_block, f.bidb, f.bidh, f.n_split, f.valid};
    blk["combine"] = std::vector<int64_t>{cb.bidb, cb.bidh, cb.valid};
    decoded.append(blk);
  }
  out["blocks"] = decoded;
  return out;
}

}  // namespace
}  // namespace flash_ext

PYBIND11_MODULE(_C, m) {
  using namespace flash_ext;
  m.doc() = "flash_ext's C++ extension: ops are registered as torch.ops.flash_ext.*; this module holds the rest";
  m.def("build_info", &build_info, "What this build contains: CUDA archs and head dims, host head dims, the CPU "
        "instruction-set levels (compiled, runnable here) and the one in use.");
  m.def("compiled_kernels", &compiled_kernels, "Every compiled kernel instance (backend, arch, head dim, dtype, "
        "causal, variant, tile).");
  m.def("plan_fwd",
        [](at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale, bool causal,
           int64_t window_left, int64_t window_right, double softcap, std::optional<at::Tensor> const& alibi_slopes,
           int64_t num_splits, double dropout_p) {
          return plan_to_dict(ops::plan_fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                            alibi_slopes, num_splits, dropout_p));
        },
        "What flash_ext.fwd would run for these arguments, or every reason it cannot; runs nothing.",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("softmax_scale"), py::arg("causal"), py::arg("window_left"),
        py::arg("window_right"), py::arg("softcap"), py::arg("alibi_slopes"), py::arg("num_splits") = 0,
        py::arg("dropout_p") = 0.0);
  m.def("gpu_tile_config", &gpu_tile_config,
        "The CUDA kernel's static variant and tile (block_m, block_n, warps, smem) for a problem, from dispatch.h.",
        py::arg("head_dim"), py::arg("causal"), py::arg("max_smem_per_block_optin"), py::arg("seqlen_q"),
        py::arg("seqlen_k"), py::arg("varlen"), py::arg("local"), py::arg("alibi"), py::arg("softcap"),
        py::arg("num_splits"), py::arg("dropout"));
  m.def("num_splits_heuristic",
        [](int ctas, int processors, int n_blocks) {
          return num_splits_heuristic(ctas, processors, n_blocks, int(ops::kMaxSplits));
        },
        "The split-KV heuristic of dispatch.h (a pure function).", py::arg("ctas"), py::arg("processors"),
        py::arg("n_blocks"));
  m.def("gpu_ctas_per_sm",
        [](int block_m, int block_n, int num_warps, int head_dim, int max_smem_per_block_optin) {
          TORCH_CHECK_VALUE(block_m > 0 && block_n > 0 && num_warps > 0 && head_dim > 0,
                            "gpu_ctas_per_sm: sizes must be positive");
          return sm80_ctas_per_sm({block_m, block_n, num_warps}, head_dim, smem_budget_for(max_smem_per_block_optin));
        },
        "Resident CTAs per SM of a tile (dispatch.h's sm80_ctas_per_sm, a pure function).", py::arg("block_m"),
        py::arg("block_n"), py::arg("num_warps"), py::arg("head_dim"), py::arg("max_smem_per_block_optin"));
  m.def("set_cpu_isa", &set_cpu_isa,
        "Test hook: the CPU instruction-set level later calls use ('generic', 'avx2', 'avx512', 'avx512_bf16', "
        "'amx_bf16' or 'default'); returns the previous one; ValueError when this build or CPU lacks it.", py::arg("name"));
  m.def("set_poison_outputs", &ops::set_poison_outputs,
        "Test mode: fill outputs and split partials with NaN before every kernel; returns the previous setting.",
        py::arg("enable"));
  m.def(
      "plan_only",
      [](py::function const& fn, py::args const& args, py::kwargs const& kwargs) -> py::object {
        ScopedMode const mode(&ops::set_plan_only);
        fn(*args, **kwargs);
        auto const& plan = ops::recorded_plan();
        if (!plan.has_value()) { return py::none(); }
        return plan_to_dict(*plan);
      },
      "fn(*args, **kwargs) with the forward ops in plan-only mode on this thread: they check their arguments and "
      "record the plan of their launch instead of launching (no write, no generator draw); returns that plan as "
      "plan_fwd does, or None when fn launched nothing (an empty problem).  Errors propagate.",
      py::arg("fn"));
  m.def("in_plan_only", &ops::plan_only,
        "Whether this thread is in plan-only mode (inside _C.plan_only): the Python layer then skips work done "
        "after the kernel on its outputs (return_attn_probs' S_dmask), which would read outputs never written.");
  m.def(
      "check_only",
      [](py::function const& fn, py::args const& args, py::kwargs const& kwargs) {
        // The mode is on exactly for this call, restored however it ends: set and reset from Python as two calls,
        // a torch.compile'd caller that refused in between (a graph break, the reset in a resumed frame never
        // run) left it on, and every later call on the thread was refused.
        ScopedMode const mode(&ops::set_check_only);
        return fn(*args, **kwargs);
      },
      "fn(*args, **kwargs) with the ops in check-only mode on this thread (they check their arguments, run nothing and "
      "always raise the ValueError listing what they found, possibly nothing); the mode is restored afterwards.",
      py::arg("fn"));
  m.def("set_emulate", &ops::set_emulate,
        "The calling thread's warp emulator mode for CPU fp16/bf16 calls: 'sm80' or '' (off); returns the previous "
        "one.  Every thread starts from FLASH_EXT_EMULATE.",
        py::arg("mode"));
  m.def("_set_emulator_test_fault", &ops::set_emulator_test_fault,
        "Test only: 'narrow:<name>' hides the last 16 bytes of the launch's tensor of that name (q, k, v, out, "
        "softmax_lse, split partials, cu_seqlens_q, block_table, ...) from the emulator's address check, so that "
        "the kernel's accesses there are findings; '' turns it off; returns the previous one.",
        py::arg("fault"));
  m.def("emulator_report", &ops::emulator_last_report,
        "The report of this thread's latest emulated launch as JSON: findings per check, what ran, the first "
        "findings.");
  m.def("launch_geometry", &launch_geometry,
        "grid.h as a pure function: forward and combine grids, and the decode of (x, y, z) blocks.",
        py::arg("m_blocks"), py::arg("batch"), py::arg("heads"), py::arg("num_splits"), py::arg("seqlen_q"),
        py::arg("head_dim"), py::arg("blocks") = std::vector<std::array<int64_t, 3>>{});
  m.def("index_reads", &ops::index_reads,
        "Debug counter: host reads of op index tensors (cu_seqlens, cache lengths, ...) so far; one per op call "
        "that validates values (on CUDA each is one device-to-host copy).");
}
