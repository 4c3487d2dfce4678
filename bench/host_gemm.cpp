// The CPU backend's tile GEMMs in isolation, against the core's own FMA peak: how much of a prefill call's
// gap to a faster kernel is the micro-kernel, and how much the work around it (docs/perf.md, #13).
//
//   cmake -S . -B build/cpp-tests -DPython3_EXECUTABLE=$(which python) &&
//   cmake --build build/cpp-tests --target bench_host_gemm && ./build/cpp-tests/bench_host_gemm [iters [tiles]]
//
// Per level this CPU runs, per operand type and head dim: the forward's two GEMMs on one host tile with the
// layouts the body gives them on a staging level (S = Q.K^T: Q column-major fp32 as the body's padded Q fragment
// holds it, its values those of the element type, K row-major in the element type, S overwritten;
// O += P.V: P column-major fp32, V row-major, O accumulated; fp32 K/V rows padded as the K/V mirror pads them,
// gemm.h), the tile's key count as launch_host.h picks it
// (128 for bf16, 64 otherwise); then a decode step's tile (16 rows of which 1, 4 or 8 are live, 128 keys,
// d = 128: the few-rows paths), Q.K^T and P.V timed apart.  `tiles` (default 1) K/V tiles are used in turn, one per call: with 1 the
// operands stay in cache (an upper bound for the micro-kernel inside a call); 16 is a 2048-key sequence's K
// and V at 128 keys, as a call walks them (in L2, not L1).  One thread; best of 7 repetitions.  Not a test: it checks
// nothing beyond one product against a double-precision loop (a wrong kernel must not report a speed).
// The peak is fp32 FMA at the level's vector width; the avx512_bf16 and amx_bf16 levels multiply bf16 on
// other instructions (vdpbf16ps: two products per lane; AMX tiles), so their bf16 rows may exceed 100%.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include <cutlass/numeric_types.h>

#include "flash_ext/gemm.h"
#include "flash_ext/host_isa.h"

namespace {

using flash_ext::HostDType;
using flash_ext::HostGemmArgs;
using flash_ext::HostIsa;
using flash_ext::HostKernels;

// fp32 FMA throughput of one core: independent accumulator chains, enough of them to cover the FMA latency
// of every current x86 core (4 cycles x 2 ports), kLanes wide.  Distinct starting values keep the compiler
// from merging chains.
// Inlined into each level's target function below, so that it is compiled for that level's vectors.
template <int kLanes, int kChains>
inline __attribute__((always_inline)) double fma_peak_gflops_impl() {
  typedef float v __attribute__((vector_size(4 * kLanes)));
  v acc[kChains];
  for (int i = 0; i < kChains; ++i) { acc[i] = v{} + (1.0f + 0.001f * float(i)); }
  v const a = v{} + 0.9999f, b = v{} + 0.0001f;
  long const n = 20'000'000;
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    auto const t0 = std::chrono::steady_clock::now();
    for (long it = 0; it < n; ++it) {
#pragma GCC unroll 32
      for (int i = 0; i < kChains; ++i) { acc[i] = acc[i] * a + b; }
    }
    double const s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = s < best ? s : best;
  }
  float sink = 0.f;
  for (int i = 0; i < kChains; ++i) { sink += acc[i][0]; }
  if (sink == 12345.f) { std::printf(" "); }  // keeps the chains live
  return 2.0 * kLanes * kChains * double(n) / best / 1e9;
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) double fma_peak_avx2() { return fma_peak_gflops_impl<8, 12>(); }
__attribute__((target("avx512f,fma"))) double fma_peak_avx512() { return fma_peak_gflops_impl<16, 24>(); }
#endif

double fma_peak_for(HostKernels const& k) {
#if defined(__x86_64__)
  if (k.lanes == 16) { return fma_peak_avx512(); }
  if (k.lanes == 8) { return fma_peak_avx2(); }
#endif
  return 0.0;  // the generic level: no FMA to measure against (baseline x86-64 has none; other CPUs vary)
}

// Tiles on 64-byte lines, as the body's accumulators and Q fragment are (gemm.h: UninitializedArrayEngine): a
// std::vector's 16-byte alignment split every 64-byte column of a 16-row S across two lines, a cost the body
// does not pay (the 1-row decode tile's P.V timed 1.3-1.6x, its Q.K^T 1.1-1.2x the aligned time; docs/perf.md).
template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  LineAllocator(LineAllocator<U> const&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  friend bool operator==(LineAllocator, LineAllocator) { return true; }
};
using Tile = std::vector<float, LineAllocator<float>>;

// An operand in one element type, with its fp32 values for the reference.
struct Operand {
  std::vector<uint16_t> half;
  std::vector<float> full;
  void const* data(HostDType t) const { return t == HostDType::kF32 ? static_cast<void const*>(full.data()) : half.data(); }
};
Operand random_operand(size_t n, HostDType t) {
  Operand o{std::vector<uint16_t>(n), std::vector<float>(n)};
  for (size_t i = 0; i < n; ++i) {
    float const x = float(std::rand()) / float(RAND_MAX) - 0.5f;
    if (t == HostDType::kF16) {
      cutlass::half_t const h(x);
      o.half[i] = h.raw(), o.full[i] = float(h);
    } else {
      cutlass::bfloat16_t const h(x);
      o.half[i] = h.raw(), o.full[i] = t == HostDType::kF32 ? x : float(h);
    }
  }
  return o;
}

template <class F>
double best_seconds(F&& f, int iters) {
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    auto const t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) { f(); }
    double const s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = s < best ? s : best;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int const iters = argc > 1 ? std::atoi(argv[1]) : 1000;
  int const tiles = argc > 2 ? std::atoi(argv[2]) : 1;
  if (iters < 1 || tiles < 1) {
    std::printf("usage: bench_host_gemm [iters >= 1 [tiles >= 1]]\n");
    return 2;
  }
  std::printf("iterations %d, K/V tiles in turn %d\n", iters, tiles);
  std::printf("level        dtype  d    tile (M x N)  QK^T GF/s  P.V GF/s  of FMA peak (GF/s)\n");
  for (int li = 0; li < flash_ext::kNumHostIsas; ++li) {
    HostIsa const isa = HostIsa(li);
    if (*flash_ext::host_isa_unavailable_reason(isa) != '\0') {
      std::printf("%-12s skipped: %s\n", flash_ext::host_isa_name(isa), flash_ext::host_isa_unavailable_reason(isa));
      continue;
    }
    HostKernels const& k = *flash_ext::host_kernels_for(isa);
    double const peak = fma_peak_for(k);
    for (HostDType t : {HostDType::kBF16, HostDType::kF16, HostDType::kF32}) {
      for (int d : {64, 128}) {
        int const M = 128, N = t == HostDType::kBF16 ? 128 : 64;
        Operand const q = random_operand(size_t(M) * d, t);
        // K and V rows as a prefill call's staging levels read them: fp32 from the K/V mirror, whose rows are
        // padded (gemm.h: host_mirror_row_elems), 16-bit dense (widened by the GEMMs into their own scratch).
        int64_t const kv_ld = flash_ext::host_mirror_row_elems(d, t == HostDType::kF32 ? 4 : 2);
        std::vector<Operand> ks, vs;
        for (int i = 0; i < tiles; ++i) {
          ks.push_back(random_operand(size_t(N) * kv_ld, t));
          vs.push_back(random_operand(size_t(N) * kv_ld, t));
        }
        Operand const& kk = ks[0];
        // S, O and the Q fragment with the body's padded column stride (gemm.h: make_acc_fragment, make_a_fragment).
        int const ld = flash_ext::host_acc_column_stride(M);
        Tile s(size_t(ld) * N), o(size_t(ld) * d, 0.f), qf(size_t(ld) * d);
        for (int c = 0; c < d; ++c) {
          for (int m = 0; m < M; ++m) { qf[m + size_t(c) * ld] = q.full[m + size_t(c) * M]; }
        }
        // S(m, n) = s[m + n * ld]; Q(m, k) = qf[m + k * ld]; K(n, k) = kk[n * kv_ld + k]; V(n, j) = v[n * kv_ld + j].
        HostGemmArgs const qk{s.data(), ld, qf.data(), HostDType::kF32, 1, ld, kk.data(t), t, kv_ld, 1, M, N, d, true};
        k.gemm(qk);
        double err = 0.0;
        for (int m = 0; m < M; m += 13) {
          for (int n = 0; n < N; n += 7) {
            double ref = 0.0;
            for (int c = 0; c < d; ++c) { ref += double(q.full[m + size_t(c) * M]) * kk.full[size_t(n) * kv_ld + c]; }
            err = std::fmax(err, std::fabs(ref - s[m + size_t(n) * ld]));
          }
        }
        if (!(err < 0.05)) {
          std::printf("%-12s %s d=%d: Q.K^T differs from the reference by %g; not timed\n", k.name,
                      t == HostDType::kF32 ? "fp32" : t == HostDType::kBF16 ? "bf16" : "fp16", d, err);
          return 1;
        }
        for (float& x : s) { x *= 0.01f; }  // P-like magnitudes for P.V
        std::vector<HostGemmArgs> qks, pvs;
        for (int i = 0; i < tiles; ++i) {
          qks.push_back(qk);
          qks.back().b = ks[i].data(t);
          pvs.push_back({o.data(), ld, s.data(), HostDType::kF32, 1, ld, vs[i].data(t), t, 1, kv_ld, M, d, N, false});
        }
        int next = 0;
        double const flops = 2.0 * M * N * d * iters;
        double const qk_gf = flops / best_seconds([&] { k.gemm(qks[next++ % tiles]); }, iters) / 1e9;
        double const pv_gf = flops / best_seconds([&] { k.gemm(pvs[next++ % tiles]); }, iters) / 1e9;
        std::printf("%-12s %-5s  %-3d  %3d x %-3d     %9.1f  %8.1f", k.name,
                    t == HostDType::kF32 ? "fp32" : t == HostDType::kBF16 ? "bf16" : "fp16", d, M, N, qk_gf, pv_gf);
        if (peak > 0.0) {
          std::printf("  %4.0f%% / %3.0f%%  (%.1f)\n", 100.0 * qk_gf / peak, 100.0 * pv_gf / peak, peak);
        } else {
          std::printf("  -\n");
        }
      }
    }
    // A decode step's tile: 16 rows of which `live` are real (one query, or a GQA group of query heads),
    // 128 keys, d = 128, K/V in the element type; ns per tile for both GEMMs, GF/s over the live rows only.
    for (HostDType t : {HostDType::kBF16, HostDType::kF32}) {
      int const M = 16, N = 128, d = 128;
      Operand const q = random_operand(size_t(M) * d, t), kk = random_operand(size_t(N) * d, t),
                    vv = random_operand(size_t(N) * d, t);
      Tile s(size_t(M) * N), o(size_t(M) * d, 0.f), qf(q.full.begin(), q.full.end());
      for (int live : {1, 4, 8}) {
        HostGemmArgs const qk{s.data(), M, qf.data(), HostDType::kF32, 1, M, kk.data(t), t, d, 1, live, N, d, true};
        HostGemmArgs const pv{o.data(), M, s.data(), HostDType::kF32, 1, M, vv.data(t), t, 1, d, live, d, N, false};
        k.gemm(qk);
        for (float& x : s) { x *= 0.01f; }
        std::fill(o.begin(), o.end(), 0.f);
        k.gemm(pv);
        double err = 0.0;  // both products of the live rows against double-precision loops
        for (int m = 0; m < live; ++m) {
          for (int n = 0; n < N; ++n) {
            double ref = 0.0;
            for (int c = 0; c < d; ++c) { ref += double(q.full[m + size_t(c) * M]) * kk.full[size_t(n) * d + c]; }
            err = std::fmax(err, std::fabs(0.01 * ref - s[m + size_t(n) * M]));
          }
          for (int j = 0; j < d; ++j) {
            double ref = 0.0;
            for (int n = 0; n < N; ++n) { ref += double(s[m + size_t(n) * M]) * vv.full[size_t(n) * d + j]; }
            err = std::fmax(err, std::fabs(ref - o[m + size_t(j) * M]));
          }
        }
        if (!(err < 0.05)) {
          std::printf("%-12s decode tile, %d live rows: differs from the reference by %g; not timed\n", k.name, live, err);
          return 1;
        }
        double const qk_s = best_seconds([&] { k.gemm(qk); }, iters) / iters;
        double const pv_s = best_seconds([&] { k.gemm(pv); }, iters) / iters;
        std::printf("%-12s %-5s decode tile, %d live of 16 rows x 128 keys, d=128: QK^T %6.0f ns + P.V %6.0f ns, "
                    "%6.1f GF/s\n", k.name, t == HostDType::kF32 ? "fp32" : "bf16", live, qk_s * 1e9, pv_s * 1e9,
                    4.0 * live * N * d / (qk_s + pv_s) / 1e9);
      }
    }
    // The online-softmax step of one 128 x 128 tile (O 128 x 128) in the steady state (no row's maximum
    // changes, so O is not rescaled): the other per-element work of a call, next to the GEMMs above.
    {
      int const M = 128, N = 128, ld = flash_ext::host_acc_column_stride(M);  // S and O as the body holds them
      Tile scores(size_t(ld) * N), work(size_t(ld) * N), o(size_t(ld) * 128, 1.f), mx(M), sum(M);
      for (float& x : scores) { x = 3.f * (float(std::rand()) / float(RAND_MAX) - 0.5f); }
      flash_ext::HostSoftmaxArgs const a{work.data(), ld, N, o.data(), ld, 128, mx.data(), sum.data(), M, 1.4427f,
                                         false};
      // Seconds of `iters` steps on args, each on a fresh copy of the scores and the steady-state row statistics.
      auto time_step = [&](flash_ext::HostSoftmaxArgs const& args) {
        return best_seconds([&] {
          std::memcpy(work.data(), scores.data(), sizeof(float) * scores.size());
          for (int m = 0; m < M; ++m) { mx[m] = 2.f, sum[m] = 1.f; }
          if (args.p_pairs != nullptr) { args.p_pairs->valid = false; }
          k.softmax_rescale(args);
        }, iters);
      };
      double const secs = time_step(a);
      Tile copy_only(work.size());
      double const copy_secs = best_seconds([&] {
        std::memcpy(copy_only.data(), scores.data(), sizeof(float) * scores.size());
      }, iters);
      std::printf("%-12s softmax step 128 x 128: %.3f ns per score (the tile's reload of the scores subtracted)\n",
                  k.name, (secs - copy_secs) / iters / (M * N) * 1e9);
      // The same with the probabilities left as the P.V's packed pairs, where the level packs them (AMX).
      alignas(64) static uint32_t pairs[128 * 128 / 2];
      flash_ext::HostPackCache pc{pairs, sizeof(pairs)};
      flash_ext::HostSoftmaxArgs packed = a;
      packed.p_pairs = &pc;
      double const packed_secs = time_step(packed);
      if (pc.valid) {
        std::printf("%-12s softmax step 128 x 128, P as packed pairs: %.3f ns per score (likewise)\n", k.name,
                    (packed_secs - copy_secs) / iters / (M * N) * 1e9);
      }
    }
  }
  return 0;
}
