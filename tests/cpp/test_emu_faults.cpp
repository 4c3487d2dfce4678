// The emulator tests can fail: the forward kernel with each GPU-only bug injected (emu_faults.h; one object
// per fault, built with the test-only switch FLASH_EXT_EMU_FAULT) must be caught -- by a finding of the right
// check, or by a result outside the error bound -- while the same kernel without a fault passes with zero
// findings.  None of these bugs shows on the host backend: one thread has no races, no banks and no quads.
#undef NDEBUG
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <cutlass/numeric_types.h>

#include "emu_faults.h"

using namespace flash_ext;
using namespace flash_ext::emu;
using namespace flash_ext::emu::faults;

namespace flash_ext::emu::faults {
FaultLines g_fault_lines;
}

#ifndef FLASH_EXT_SOURCE_DIR
#error "CMakeLists.txt defines FLASH_EXT_SOURCE_DIR"
#endif

// The lines of kernel_fwd.h with the main loop's two barriers and first cp.async wait, in source order.
static bool find_fault_lines() {
  std::ifstream in(std::string(FLASH_EXT_SOURCE_DIR) + "/csrc/flash_ext/kernel_fwd.h");
  std::string line;
  std::vector<int> barriers, waits;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find("Traits::barrier()") != std::string::npos) { barriers.push_back(n); }
    if (line.find("cp_async_wait<0>()") != std::string::npos) { waits.push_back(n); }
  }
  if (barriers.size() != 2 || waits.size() != 2) {
    std::printf("FAIL: expected 2 barriers and 2 cp.async waits in kernel_fwd.h, found %zu and %zu\n", barriers.size(),
                waits.size());
    return false;
  }
  g_fault_lines = {barriers[0], barriers[1], waits[0]};
  return true;
}

struct Problem {
  int b = 1, h = 2, sq = 200, sk = 333, d = 64;
  std::vector<cutlass::half_t> q, k, v, o;
  std::vector<float> lse;
  std::vector<double> ref;  // float64 attention
  FwdParams params;

  Problem() {
    std::mt19937 rng(11);
    std::normal_distribution<float> nd;
    size_t const nq = size_t(b) * sq * h * d, nk = size_t(b) * sk * h * d;
    q.resize(nq), k.resize(nk), v.resize(nk);
    for (auto& x : q) x = cutlass::half_t(nd(rng));
    for (auto& x : k) x = cutlass::half_t(nd(rng));
    for (auto& x : v) x = cutlass::half_t(nd(rng));
    FwdParams& p = params;
    p.k_ptr = k.data(), p.v_ptr = v.data(), p.q_ptr = q.data();
    p.q_batch_stride = index_t(sq) * h * d, p.q_row_stride = h * d, p.q_head_stride = d;
    p.k_batch_stride = index_t(sk) * h * d, p.k_row_stride = h * d, p.k_head_stride = d;
    p.v_batch_stride = p.k_batch_stride, p.v_row_stride = p.k_row_stride, p.v_head_stride = d;
    p.o_batch_stride = p.q_batch_stride, p.o_row_stride = p.q_row_stride, p.o_head_stride = d;
    p.b = b, p.h = h, p.h_k = h, p.h_h_k_ratio = 1, p.seqlen_q = sq, p.seqlen_k = sk, p.d = d;
    p.softmax_scale = 1.f / std::sqrt(float(d));
    p.score_scale = p.softmax_scale;
    p.score_scale_log2 = p.score_scale * float(M_LOG2E);
    ref.assign(nq, 0.0);
    for (int hh = 0; hh < h; ++hh)
      for (int i = 0; i < sq; ++i) {
        std::vector<double> s(sk);
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < sk; ++j) {
          double acc = 0;
          for (int e = 0; e < d; ++e) acc += double(float(q[(size_t(i) * h + hh) * d + e])) * double(float(k[(size_t(j) * h + hh) * d + e]));
          s[j] = acc * p.softmax_scale;
          mx = std::max(mx, s[j]);
        }
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (int e = 0; e < d; ++e) {
          double acc = 0;
          for (int j = 0; j < sk; ++j) acc += s[j] / sum * double(float(v[(size_t(j) * h + hh) * d + e]));
          ref[(size_t(i) * h + hh) * d + e] = acc;
        }
      }
  }

  // Runs one fault's kernel on fresh (NaN-poisoned) outputs; returns max |O - ref| (inf for NaN).
  double run(std::string (*fn)(FwdParams const&, EmuLaunch&), Report& report) {
    o.assign(q.size(), cutlass::half_t(NAN));
    lse.assign(size_t(b) * h * sq, NAN);
    params.o_ptr = o.data(), params.softmax_lse_ptr = lse.data();
    EmuLaunch launch;
    auto add = [&](void const* ptr, size_t bytes, bool w, char const* name) {
      launch.globals.push_back({uintptr_t(ptr), uintptr_t(ptr) + bytes, w, name});
    };
    add(q.data(), q.size() * 2, false, "q"), add(k.data(), k.size() * 2, false, "k");
    add(v.data(), v.size() * 2, false, "v"), add(o.data(), o.size() * 2, true, "out");
    add(lse.data(), lse.size() * 4, true, "softmax_lse");
    launch.parallel_for = [](int64_t b0, int64_t e0, std::function<void(int64_t, int64_t)> const& f) { f(b0, e0); };
    std::string const err = fn(params, launch);
    report = launch.report;
    if (!err.empty()) {
      std::printf("launch error: %s\n", err.c_str());
      return INFINITY;
    }
    double max_err = 0;
    for (size_t i = 0; i < o.size(); ++i) {
      double const got = float(o[i]);
      max_err = std::isnan(got) ? INFINITY : std::max(max_err, std::abs(got - ref[i]));
    }
    return max_err;
  }
};

int main() {
  if (!find_fault_lines()) { return 1; }
  std::string (*const fns[kNumFaults])(FwdParams const&, EmuLaunch&) = {run_fault_0, run_fault_1, run_fault_2, run_fault_3,
                                                                        run_fault_4, run_fault_5, run_fault_6, run_fault_7};
  Problem problem;
  // fp16 output rounding is 2^-11 relative; the baseline error is measured below and must stay under this.
  double const tol = 2e-3;
  int failures = 0;
  for (int f = 0; f < kNumFaults; ++f) {
    Report r;
    double const err = problem.run(fns[f], r);
    auto n = [&](Check c) { return r.counts[int(c)]; };
    bool caught = false;
    switch (Fault(f)) {
      case kNone: caught = r.total() == 0 && err <= tol && r.stats.mma > 0; break;  // "caught" = passes cleanly
      case kNoLoopBarrierK:
      case kNoLoopBarrierV:
      case kNoEpilogueBarrier: caught = n(Check::kRace) > 0; break;
      case kNoCpAsyncWait: caught = n(Check::kUnlandedRead) > 0; break;
      case kShuffleMasks:
      case kPPairing: caught = err > 10 * tol; break;
      case kUnswizzled: caught = n(Check::kBankConflict) > 0 && r.stats.extra_wavefronts > 0; break;
      default: break;
    }
    std::printf("%s fault %d %-45s findings %-6llu race %-6llu unlanded %-6llu bank %-5llu (extra wavefronts %llu) "
                "address %llu divergence %llu  max|O - ref| %.2e\n",
                caught ? "ok  " : "FAIL", f, fault_name(f), (unsigned long long)r.total(),
                (unsigned long long)n(Check::kRace), (unsigned long long)n(Check::kUnlandedRead),
                (unsigned long long)n(Check::kBankConflict), (unsigned long long)r.stats.extra_wavefronts,
                (unsigned long long)n(Check::kBadAddress), (unsigned long long)n(Check::kDivergence), err);
    if (!r.messages.empty()) { std::printf("       first finding: %s\n", r.messages.front().second.c_str()); }
    failures += !caught;
  }
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
