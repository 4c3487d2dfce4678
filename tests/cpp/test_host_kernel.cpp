// The kernel body instantiated with host traits, against a double-precision loop, without torch: a fast
// check of the kernel logic (masks, windows, ALiBi, softcap, GQA, uneven shapes, empty rows, dropout with the
// mask of dropout.h's per-element contract) for ctest, with the micro-kernels of every instruction-set level
// this CPU runs (host_isa.h), and on x86-64 also with the 16-lane AVX-512-BF16 kernel source emulated on
// AVX2 (tests/cpp/host_isa_emulated.cpp).
// The pytest suite covers the same ground through the torch op with many more shapes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "flash_ext/launch_host.h"
#include "host_levels.h"
#include "problem_params.h"

using namespace flash_ext;


struct Case {
  int b, sq, sk, h, hk, d;
  bool causal;
  int wl, wr;  // window; -1 unbounded
  float softcap;
  bool alibi;
  int num_splits = 1;  // split-KV: partials plus the combine
  double p_dropout = 0;
};

template <class T>
bool run_case(Case const& c, const char* dtype, HostKernels const& kernels) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd;
  size_t const nq = size_t(c.b) * c.sq * c.h * c.d, nk = size_t(c.b) * c.sk * c.hk * c.d;
  std::vector<T> q(nq), k(nk), v(nk), o(nq, T(NAN));
  for (auto& x : q) x = T(nd(rng));
  for (auto& x : k) x = T(nd(rng));
  for (auto& x : v) x = T(nd(rng));
  std::vector<float> lse(size_t(c.b) * c.h * c.sq, NAN), slopes(c.h);
  for (int i = 0; i < c.h; ++i) slopes[i] = std::exp2(-8.f * (i + 1) / c.h);

  FwdParams p;
  set_dense_problem(p, c, q.data(), k.data(), v.data(), o.data(), lse.data(), slopes.data());
  // Dropout: the seed and offset are read through pointers (the rng_state-input path) and written back.
  int64_t const rng_in[2] = {int64_t(0x9e3779b97f4a7c15ull), 1ll << 33 | 12345};
  int64_t rng_out[2] = {0, 0};
  if (c.p_dropout > 0) {
    p.is_dropout = true;
    p.dropout_threshold = uint32_t(std::floor((1.0 - c.p_dropout) * 65536.0 + 0.5));
    p.dropout_scale = float(1.0 / (1.0 - c.p_dropout));
    p.rng_seed_ptr = &rng_in[0];
    p.rng_offset_ptr = &rng_in[1];
    p.rng_state_out = rng_out;
  }
  std::vector<float> oaccum, lseaccum;
  if (c.num_splits > 1) {
    p.num_splits = c.num_splits;
    p.accum_rows = c.b * c.sq;
    oaccum.assign(size_t(c.num_splits) * c.h * p.accum_rows * c.d, NAN);  // poisoned: every partial is written
    lseaccum.assign(size_t(c.num_splits) * c.h * p.accum_rows, NAN);
    p.oaccum_ptr = oaccum.data();
    p.lseaccum_ptr = lseaccum.data();
  }
  // Work items in chunks of 3, as threads would take them: chunk boundaries inside a (batch, split) group of
  // decode heads, whose first item on a thread warms the group's K/V rows (launch_host.h).
  run_fwd_host<T>(p, [](int64_t b0, int64_t e0, auto&& f) {
    for (int64_t i = b0; i < e0; i += 3) { f(i, std::min(i + 3, e0)); }
  }, &kernels);

  double max_err = 0, max_lse_err = 0;
  bool nan_found = false, inf_mismatch = false;
  for (int ib = 0; ib < c.b; ++ib)
    for (int ih = 0; ih < c.h; ++ih)
      for (int i = 0; i < c.sq; ++i) {
        int const ik = ih / (c.h / c.hk);
        std::vector<double> s(c.sk);
        double mx = -INFINITY;
        for (int j = 0; j < c.sk; ++j) {
          double acc = 0;
          for (int e = 0; e < c.d; ++e)
            acc += double(float(q[((size_t(ib) * c.sq + i) * c.h + ih) * c.d + e])) *
                   double(float(k[((size_t(ib) * c.sk + j) * c.hk + ik) * c.d + e]));
          acc *= p.softmax_scale;
          if (c.softcap > 0) acc = c.softcap * std::tanh(acc / c.softcap);
          int const diag = i + c.sk - c.sq;
          if (c.alibi) acc -= slopes[ih] * std::abs(diag - j);
          bool hidden = (p.window_right >= 0 && j > diag + p.window_right) || (p.window_left >= 0 && j < diag - p.window_left);
          s[j] = hidden ? -INFINITY : acc;
          mx = std::max(mx, s[j]);
        }
        float const got_lse = lse[(size_t(ib) * c.h + ih) * c.sq + i];
        if (mx == -INFINITY) {  // no visible key: O = 0, LSE = +inf
          inf_mismatch |= !(got_lse == INFINITY);
          for (int e = 0; e < c.d; ++e) max_err = std::max(max_err, std::abs(double(float(o[((size_t(ib) * c.sq + i) * c.h + ih) * c.d + e]))));
          continue;
        }
        double sum = 0;
        for (int j = 0; j < c.sk; ++j) sum += std::exp(s[j] - mx);
        double const l = mx + std::log(sum);  // of the undropped scores
        max_lse_err = std::max(max_lse_err, std::abs(l - double(got_lse)));
        // Dropout: O = (P o keep) V / (1 - p), keep from the per-element contract.
        std::vector<double> w(c.sk);
        DropoutRng const rng = DropoutRng::make({uint64_t(rng_in[0]), uint64_t(rng_in[1])}, ib, ih, c.h, p.dropout_threshold);
        for (int j = 0; j < c.sk; ++j) {
          bool const keep = c.p_dropout == 0 || dropout_keep(rng, i, j);
          w[j] = keep ? std::exp(s[j] - l) / (1.0 - c.p_dropout) : 0.0;
        }
        for (int e = 0; e < c.d; ++e) {
          double acc = 0;
          for (int j = 0; j < c.sk; ++j)
            acc += w[j] * double(float(v[((size_t(ib) * c.sk + j) * c.hk + ik) * c.d + e]));
          float const got = float(o[((size_t(ib) * c.sq + i) * c.h + ih) * c.d + e]);
          nan_found |= std::isnan(got);
          max_err = std::max(max_err, std::abs(acc - double(got)));
        }
      }
  // Output rounding of the dtype plus fp32 accumulation (P stays fp32, or bf16 where the level multiplies
  // bf16 pairs: the GPU's rounding).
  double const tol = sizeof(T) == 4 ? 1e-5 : (std::is_same_v<T, cutlass::half_t> ? 2e-3 : 1.6e-2);
  bool const rng_ok = c.p_dropout == 0 || (rng_out[0] == rng_in[0] && rng_out[1] == rng_in[1]);
  bool const ok = !nan_found && !inf_mismatch && max_err <= tol && max_lse_err <= 1e-4 && rng_ok;
  std::printf("%s %-12s %-5s b%d sq%-4d sk%-4d h%d/%d d%-3d causal%d win(%d,%d) cap%.0f alibi%d splits%d p%.2f: |o|err %.2e lse err %.2e%s%s\n",
              ok ? "ok  " : "FAIL", kernels.name, dtype, c.b, c.sq, c.sk, c.h, c.hk, c.d, c.causal, c.wl, c.wr, c.softcap, c.alibi,
              c.num_splits, c.p_dropout, max_err, max_lse_err, inf_mismatch ? " (+inf LSE pattern wrong)" : "",
              rng_ok ? "" : " (rng_state not written back)");
  return ok;
}

// The decode warm-up's ranges (for_each_warm_range) against the bytes the body reads: every range inside K or
// V, and every element of a visible key's head (first d elements) covered, for the heads a group warms.
// layout 0: (b, s, h_k, d) K and V; 1: K and V interleaved per row, (b, s, 2, h_k, d) (per-row ranges);
// 2: (b, h_k, s, d) (heads apart: nothing warmed).
bool check_warm_ranges(int layout, int num_splits, int wl, int d) {
  using T = cutlass::bfloat16_t;
  using Traits = HostTraits<64, kHostBlockMShort, kHostBlockN<T>, T>;
  int const b = 2, sq = 4, sk = 1000, h = 6, hk = 3;
  std::vector<T> kv(size_t(b) * sk * 2 * hk * 64);
  FwdParams p;
  p.b = b, p.h = h, p.h_k = hk, p.h_h_k_ratio = h / hk, p.seqlen_q = sq, p.seqlen_k = sk, p.d = d;
  p.window_left = wl, p.window_right = wl >= 0 ? 0 : -1, p.is_local = wl >= 0;
  index_t const head = 64;  // d < 64: a padded head, elements d..63 are never read
  if (layout == 0) {
    p.k_ptr = kv.data(), p.v_ptr = kv.data() + kv.size() / 2;
    p.k_row_stride = p.v_row_stride = hk * head, p.k_head_stride = p.v_head_stride = head;
    p.k_batch_stride = p.v_batch_stride = index_t(sk) * hk * head;
  } else if (layout == 1) {
    p.k_ptr = kv.data(), p.v_ptr = kv.data() + hk * head;
    p.k_row_stride = p.v_row_stride = 2 * hk * head, p.k_head_stride = p.v_head_stride = head;
    p.k_batch_stride = p.v_batch_stride = index_t(sk) * 2 * hk * head;
  } else {
    p.k_ptr = kv.data(), p.v_ptr = kv.data() + kv.size() / 2;
    p.k_row_stride = p.v_row_stride = head, p.k_head_stride = p.v_head_stride = index_t(sk) * head;
    p.k_batch_stride = p.v_batch_stride = index_t(hk) * sk * head;
  }
  p.num_splits = num_splits;
  DynamicFlags const flags = flags_from_params<Traits, DynamicFlags>(p);
  char const* const lo = reinterpret_cast<char const*>(kv.data());
  char const* const hi = lo + kv.size() * sizeof(T);
  std::vector<unsigned char> marked(kv.size() * sizeof(T), 0);
  bool inside = true;
  int64_t ranges = 0;
  for (int ib = 0; ib < b; ++ib)
    for (int s = 0; s < num_splits; ++s)
      for_each_warm_range<Traits>(p, flags, ib, s, 0, h - 1, [&](char const* first, int64_t n) {
        ++ranges;
        inside &= first >= lo && first + n <= hi && n > 0;
        if (first >= lo && first + n <= hi) { std::fill(marked.begin() + (first - lo), marked.begin() + (first - lo) + n, 1); }
      });
  // Every element the body reads: keys visible to some row (window), heads 0..hk-1, elements 0..d-1.
  int64_t missed = 0;
  for (int ib = 0; ib < b; ++ib)
    for (int j = 0; j < sk; ++j) {
      if (wl >= 0 && j < sk - sq - wl) { continue; }  // left of every row's window
      for (int kh = 0; kh < hk; ++kh)
        for (int e = 0; e < d; ++e)
          for (void const* base : {p.k_ptr, p.v_ptr}) {
            T const* el = static_cast<T const*>(base) + ib * p.k_batch_stride + j * p.k_row_stride + kh * p.k_head_stride + e;
            char const* c = reinterpret_cast<char const*>(el);
            missed += !(marked[c - lo] && marked[c - lo + 1]);
          }
    }
  // The warming's reads (for_each_warm_line over the merged ranges, per group): every address inside a range,
  // every line of every range read.
  std::vector<unsigned char> touched_line(marked.size() / 64 + 2, 0);
  int64_t outside = 0, lines_missed = 0;
  std::vector<HostWarmRange> merged;
  auto const line = [&](char const* c) { return (reinterpret_cast<uintptr_t>(c) - reinterpret_cast<uintptr_t>(lo) / 64 * 64) / 64; };
  for (int ib = 0; ib < b; ++ib)
    for (int s = 0; s < num_splits; ++s) {
      std::fill(touched_line.begin(), touched_line.end(), 0);
      int64_t const total = collect_warm_ranges<Traits>(p, flags, ib, s, 0, h - 1, merged);
      for_each_warm_line(merged.data(), int(merged.size()), total, [&](char const* c) {
        bool const in = c >= lo && c < hi && marked[c - lo];
        outside += !in;
        if (in) { touched_line[line(c)] = 1; }
      });
      for (HostWarmRange const& r : merged)
        for (uintptr_t l = line(r.first); l <= line(r.first + r.bytes - 1); ++l) { lines_missed += !touched_line[l]; }
    }
  bool const ok = inside && outside == 0 && lines_missed == 0 && (layout == 2 ? ranges == 0 : missed == 0 && ranges > 0);
  std::printf("%s warm ranges, layout %d d %d splits %d window %d: %lld ranges, %s, %lld elements not covered; "
              "reads: %lld outside, %lld lines not read\n",
              ok ? "ok  " : "FAIL", layout, d, num_splits, wl, (long long)ranges, inside ? "all inside" : "SOME OUTSIDE",
              (long long)missed, (long long)outside, (long long)lines_missed);
  return ok;
}

int main() {
  Case const cases[] = {
      {2, 77, 131, 4, 2, 40, true, -1, -1, 0.f, false},     // GQA, uneven d and seqlens, causal
      {1, 128, 128, 2, 2, 64, false, -1, -1, 0.f, false},   // even tiles: no predicates taken
      {1, 300, 100, 2, 1, 64, true, -1, -1, 0.f, false},    // sq > sk causal: leading rows see nothing
      {1, 200, 333, 3, 3, 96, false, 17, 5, 0.f, false},    // local window
      {1, 150, 150, 2, 2, 32, false, 0, 0, 0.f, false},     // window of one key
      {2, 65, 190, 2, 2, 128, false, -1, -1, 30.f, true},   // softcap + ALiBi
      {1, 1, 239, 2, 2, 256, false, -1, -1, 0.f, true},     // decode-like row, largest head dim
      {1, 129, 64, 2, 2, 192, true, -1, -1, 0.f, true},     // causal + ALiBi
      {1, 3, 1000, 4, 1, 128, false, -1, -1, 0.f, false, 5},  // split-KV decode, MQA
      {1, 300, 100, 2, 2, 64, true, -1, -1, 0.f, false, 3},   // split-KV with empty rows and empty splits
      {2, 70, 700, 2, 2, 64, false, 40, 0, 0.f, true, 8},     // split-KV, local window: most splits empty
      {2, 77, 131, 4, 2, 40, true, -1, -1, 0.f, false, 1, 0.17},     // dropout: GQA, uneven, causal
      {1, 200, 333, 3, 3, 96, false, 17, 5, 30.f, true, 1, 0.5},     // dropout with window, softcap, ALiBi
      {1, 5, 1000, 4, 1, 128, false, -1, -1, 0.f, false, 5, 0.25},   // dropout with split-KV (short host tile)
  };
  std::vector<HostKernels const*> const levels = host_levels_to_test();
  int failures = 0;
  for (HostKernels const* k : levels) {
    for (auto const& c : cases) failures += !run_case<cutlass::bfloat16_t>(c, "bf16", *k);
    failures += !run_case<cutlass::half_t>(cases[0], "fp16", *k);
    failures += !run_case<cutlass::half_t>(cases[6], "fp16", *k);
    failures += !run_case<float>(cases[3], "fp32", *k);
    failures += !run_case<float>(cases[5], "fp32", *k);
    failures += !run_case<float>(cases[11], "fp32", *k);
    failures += !run_case<float>(cases[12], "fp32", *k);
  }
  for (int layout : {0, 1, 2}) {
    for (int d : {61, 64}) {  // 64 in layout 0: rows abut, one range per tile
      failures += !check_warm_ranges(layout, 3, -1, d);
      failures += !check_warm_ranges(layout, 8, 100, d);
    }
  }
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
