// The backward kernel body instantiated with host traits, against a double-precision loop, without torch: a
// fast check of the backward's logic (recomputed P, softcap derivative, ALiBi, masks, windows, GQA sums,
// uneven shapes, rows and K/V tiles that see nothing, dropout with the forward's mask) for ctest.  The forward output and LSE it consumes come
// from the host forward; the reference gradient is the exact one of the double-precision attention.
// Determinism: every case also runs with a parallel-for that executes its chunks in reverse order with a
// different chunking (as a different thread count would), and must give bitwise identical gradients.
// Every case runs with the micro-kernels of every instruction-set level this CPU runs (host_isa.h), and on
// x86-64 also with the AVX-512-BF16 kernel source emulated on AVX2 (tests/cpp/host_isa_emulated.cpp).
#include <cstdio>
#include <cstring>

#include "bwd_problem.h"
#include "host_levels.h"

using namespace flash_ext;
using bwd_test::Case;


// Runs chunks of `chunk` work items, last chunk first.
struct ReversedChunks {
  int64_t chunk;
  template <class F>
  void operator()(int64_t begin, int64_t end, F&& f) const {
    int64_t const n = (end - begin + chunk - 1) / chunk;
    for (int64_t c = n - 1; c >= 0; --c) { f(begin + c * chunk, std::min(end, begin + (c + 1) * chunk)); }
  }
};

template <class T>
bool run_case(Case const& c, const char* dtype, HostKernels const& kernels) {
  bwd_test::Problem<T> pb;
  pb.init(c, host_bwd_splits(c.b, c.hk, ceil_div(c.sk, kHostBwdBlockN)));
  auto serial = [](int64_t b0, int64_t e0, auto&& f) { f(b0, e0); };
  run_bwd_host<T>(pb.p, serial, &kernels);

  // Determinism: reversed, re-chunked execution order; poisoned again.
  std::vector<T> const dq1 = pb.dq, dk1 = pb.dk, dv1 = pb.dv;
  pb.poison();
  run_bwd_host<T>(pb.p, ReversedChunks{3}, &kernels);
  bool const same = std::memcmp(pb.dq.data(), dq1.data(), pb.nq * sizeof(T)) == 0 &&
                    std::memcmp(pb.dk.data(), dk1.data(), pb.nk * sizeof(T)) == 0 &&
                    std::memcmp(pb.dv.data(), dv1.data(), pb.nk * sizeof(T)) == 0;

  std::vector<double> rdq, rdk, rdv;
  pb.reference(rdq, rdk, rdv);
  bool nan = false;
  double const eq = bwd_test::rel_err(pb.dq, rdq, nan, 1e-2 * pb.dq_mag), ek = bwd_test::rel_err(pb.dk, rdk, nan, 1e-2 * pb.dk_mag);
  double const ev = bwd_test::rel_err(pb.dv, rdv, nan);
  // A level with bf16 dot products rounds the fp32 P and dS operands of bf16 GEMMs to bf16 (as the GPU does).
  bool const p16 = std::is_same_v<T, cutlass::bfloat16_t> && (kernels.isa == HostIsa::kAvx512Bf16 || kernels.isa == HostIsa::kAmxBf16);
  double const tol = bwd_test::tolerance<T>(p16);
  bool const ok = !nan && same && eq <= tol && ek <= tol && ev <= tol;
  std::printf("%s %-12s %-5s b%d sq%-4d sk%-4d h%d/%d d%-3d causal%d win(%d,%d) cap%.0f alibi%d drop%.2f splits%d: rel err dq %.1e dk %.1e dv %.1e%s%s\n",
              ok ? "ok  " : "FAIL", kernels.name, dtype, c.b, c.sq, c.sk, c.h, c.hk, c.d, c.causal, c.wl, c.wr, c.softcap, c.alibi,
              c.dropout_p, pb.p.dq_accum_splits, eq, ek, ev, nan ? " NaN" : "", same ? "" : " (not bitwise reproducible)");
  return ok;
}

int main() {
  Case const cases[] = {
      {2, 77, 131, 4, 2, 40, true, -1, -1, 0.f, false},    // GQA, uneven d and seqlens, causal
      {1, 128, 128, 2, 2, 64, false, -1, -1, 0.f, false},  // even tiles
      {1, 300, 100, 2, 1, 64, true, -1, -1, 0.f, false},   // MQA, sq > sk causal: leading rows see nothing
      {1, 100, 300, 3, 3, 96, false, 17, 5, 0.f, false},   // local window: K/V tiles no row sees
      {1, 150, 150, 2, 2, 32, false, 0, 0, 0.f, false},    // window of one key
      {2, 65, 190, 2, 2, 128, false, -1, -1, 30.f, true},  // softcap + ALiBi
      {1, 1, 239, 2, 2, 256, false, -1, -1, 0.f, true},    // one query row, largest head dim
      {1, 129, 64, 2, 2, 192, true, -1, -1, 0.f, true},    // causal + ALiBi
      {1, 70, 200, 4, 1, 64, false, 40, 0, 8.f, true},     // everything at once, MQA
      {2, 77, 131, 4, 2, 40, true, -1, -1, 0.f, false, 0.3f},   // dropout: the forward's mask, GQA
      {1, 100, 300, 2, 1, 96, false, 17, 5, 5.f, true, 0.7f},  // dropout with window, softcap, ALiBi
  };
  std::vector<HostKernels const*> const levels = host_levels_to_test();
  int failures = 0;
  for (HostKernels const* k : levels) {
    for (auto const& c : cases) failures += !run_case<cutlass::bfloat16_t>(c, "bf16", *k);
    failures += !run_case<cutlass::half_t>(cases[0], "fp16", *k);
    failures += !run_case<float>(cases[0], "fp32", *k);
    failures += !run_case<float>(cases[3], "fp32", *k);
    failures += !run_case<float>(cases[5], "fp32", *k);
    failures += !run_case<float>(cases[8], "fp32", *k);
    failures += !run_case<float>(cases[9], "fp32", *k);
    failures += !run_case<cutlass::half_t>(cases[10], "fp16", *k);
  }
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
