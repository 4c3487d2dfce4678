// One case of the Sm80 backward on the warp emulator (tests/cpp/test_emu_bwd.cpp, emu_bwd_head_dim.cpp): the
// launch's global ranges, a run that must be clean, and its report line.
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "bwd_problem.h"
#include "emu/launch_emu_bwd.h"

namespace emu_bwd_test {

using namespace flash_ext;
using namespace flash_ext::emu;

using RunFn = std::string (*)(BwdParams const&, EmuLaunch&, KernelDesc const*);

// One static variant of the dispatcher (kVariant indexes kBwdVariants), on the emulated Sm80 traits Tr.
template <class Tr, bool kCausal, int kVariant>
std::string run_variant(BwdParams const& p, EmuLaunch& launch, KernelDesc const* desc) {
  return run_bwd_variant_emu<Tr, kCausal, kVariant>(p, launch, desc);
}

// The global tensors the kernels may touch, and whether they may write them: every other address faults.
template <class E>
void set_up(EmuLaunch& launch, bwd_test::Problem<E> const& pb, bool accum_writable) {
  auto add = [&](auto const& vec, bool w, char const* name) {
    launch.globals.push_back({uintptr_t(vec.data()), uintptr_t(vec.data() + vec.size()), w, name});
  };
  add(pb.q, false, "q"), add(pb.k, false, "k"), add(pb.v, false, "v"), add(pb.o, false, "out");
  add(pb.dout, false, "dout"), add(pb.lse, false, "softmax_lse"), add(pb.d_sum, false, "softmax_d");
  add(pb.dq_accum, accum_writable, "dq_accum"), add(pb.dk, true, "dk"), add(pb.dv, true, "dv");
  launch.parallel_for = [](int64_t b0, int64_t e0, std::function<void(int64_t, int64_t)> const& f) { f(b0, e0); };
}

// The gradients of a finished run against the float64 reference, relative errors and the GPU path's tolerance.
struct Accuracy {
  double eq, ek, ev, tol;
  bool nan;
  bool ok() const { return !nan && eq <= tol && ek <= tol && ev <= tol; }
};

template <class E>
Accuracy accuracy(bwd_test::Problem<E> const& pb) {
  std::vector<double> rdq, rdk, rdv;
  pb.reference(rdq, rdk, rdv);
  Accuracy a{};
  a.eq = bwd_test::rel_err(pb.dq, rdq, a.nan, 1e-2 * pb.dq_mag);
  a.ek = bwd_test::rel_err(pb.dk, rdk, a.nan, 1e-2 * pb.dk_mag);
  a.ev = bwd_test::rel_err(pb.dv, rdv, a.nan);
  a.tol = bwd_test::tolerance<E>(/*p16=*/true);
  return a;
}

// A run that must be clean: zero findings, every instruction class exercised, gradients within tolerance.
// Prints one line (and the emulator's report when it is not clean); returns whether it passed.
template <class E>
bool check_clean(bwd_test::Problem<E> const& pb, EmuLaunch const& launch, char const* label) {
  Report const& r = launch.report;
  Accuracy const a = accuracy(pb);
  Stats const& s = r.stats;
  bool const ran = s.ctas > 0 && s.ldmatrix > 0 && s.mma > 0 && s.cp_async > 0 && s.red_global > 0 && s.global_plain > 0;
  bool const ok = r.total() == 0 && ran && a.ok();
  std::printf("%s %s [%s]: rel err dq %.1e dk %.1e dv %.1e (tol %.0e)%s; %llu CTAs, %llu mma, %llu ldmatrix, "
              "%llu red.global.add, %llu ld/st.global, %llu findings\n",
              ok ? "ok  " : "FAIL", label, r.kernels.empty() ? "?" : r.kernels.front().c_str(), a.eq, a.ek, a.ev,
              a.tol, a.nan ? " NaN" : "", (unsigned long long)s.ctas, (unsigned long long)s.mma,
              (unsigned long long)s.ldmatrix, (unsigned long long)s.red_global, (unsigned long long)s.global_plain,
              (unsigned long long)r.total());
  if (r.total() != 0 || !ran) { std::printf("%s\n", r.text().c_str()); }
  return ok;
}

// Sets up, runs `fn` (dQ in `dq_splits` slices when deterministic) and checks a clean case.
template <class E>
bool run_clean(bwd_test::Case const& c, RunFn fn, bool deterministic, int dq_splits, char const* label) {
  bwd_test::Problem<E> pb;
  pb.init(c, dq_splits);
  pb.p.deterministic = deterministic;
  EmuLaunch launch;
  set_up(launch, pb, true);
  std::string const err = fn(pb.p, launch, nullptr);
  if (!err.empty()) {
    std::printf("FAIL %s: launch error: %s\n", label, err.c_str());
    return false;
  }
  return check_clean(pb, launch, label);
}

// The head dims linked into test_emu_bwd_heads: each emu_bwd_head_dim.cpp object registers the function that
// runs its cases and returns their failures.
using HeadDimCases = int (*)();
inline std::vector<std::pair<int, HeadDimCases>>& head_dim_registry() {
  static std::vector<std::pair<int, HeadDimCases>> registry;
  return registry;
}
struct RegisterHeadDim {
  RegisterHeadDim(int head_dim, HeadDimCases cases) { head_dim_registry().emplace_back(head_dim, cases); }
};

}  // namespace emu_bwd_test
