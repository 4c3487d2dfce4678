// The backward kernel body instantiated with host traits, against a double-precision loop, without torch: a
// fast check of the backward's logic (recomputed P, softcap derivative, ALiBi, masks, windows, GQA sums,
// uneven shapes, rows and K/V tiles that see nothing) for ctest.  The forward output and LSE it consumes come
// from the host forward; the reference gradient is the exact one of the double-precision attention.
// Determinism: every case also runs with a parallel-for that executes its chunks in reverse order with a
// different chunking (as a different thread count would), and must give bitwise identical gradients.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "flash_ext/launch_host.h"
#include "flash_ext/launch_host_bwd.h"

using namespace flash_ext;

struct Case {
  int b, sq, sk, h, hk, d;
  bool causal;
  int wl, wr;  // window; -1 unbounded
  float softcap;
  bool alibi;
};

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
bool run_case(Case const& c, const char* dtype) {
  std::mt19937 rng(4321);
  std::normal_distribution<float> nd;
  size_t const nq = size_t(c.b) * c.sq * c.h * c.d, nk = size_t(c.b) * c.sk * c.hk * c.d;
  std::vector<T> q(nq), k(nk), v(nk), dout(nq), o(nq, T(NAN));
  float const q_scale = c.softcap > 0 ? 4.f : 1.f;  // scores reach the non-linear part of tanh
  for (auto& x : q) x = T(q_scale * nd(rng));
  for (auto& x : k) x = T(nd(rng));
  for (auto& x : v) x = T(nd(rng));
  for (auto& x : dout) x = T(nd(rng));
  std::vector<float> lse(size_t(c.b) * c.h * c.sq, NAN), slopes(c.h);
  for (int i = 0; i < c.h; ++i) slopes[i] = std::exp2(-8.f * (i + 1) / c.h);

  BwdParams p;
  p.q_ptr = q.data(), p.k_ptr = k.data(), p.v_ptr = v.data(), p.o_ptr = o.data(), p.softmax_lse_ptr = lse.data();
  p.q_batch_stride = index_t(c.sq) * c.h * c.d, p.q_row_stride = c.h * c.d, p.q_head_stride = c.d;
  p.k_batch_stride = index_t(c.sk) * c.hk * c.d, p.k_row_stride = c.hk * c.d, p.k_head_stride = c.d;
  p.v_batch_stride = p.k_batch_stride, p.v_row_stride = p.k_row_stride, p.v_head_stride = c.d;
  p.o_batch_stride = p.q_batch_stride, p.o_row_stride = p.q_row_stride, p.o_head_stride = c.d;
  p.b = c.b, p.h = c.h, p.h_k = c.hk, p.h_h_k_ratio = c.h / c.hk, p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.d = c.d;
  p.softmax_scale = 1.f / std::sqrt(float(c.d));
  p.softcap = c.softcap;
  p.softcap_prescale = c.softcap > 0 ? p.softmax_scale / c.softcap : 0.f;
  p.score_scale = c.softcap > 0 ? c.softcap : p.softmax_scale;
  p.score_scale_log2 = p.score_scale * float(M_LOG2E);
  p.window_left = c.causal ? -1 : c.wl;
  p.window_right = c.causal ? 0 : c.wr;
  p.is_causal = c.causal;
  p.is_local = !c.causal && (c.wl >= 0 || c.wr >= 0);
  p.alibi_slopes_ptr = c.alibi ? slopes.data() : nullptr;
  auto serial = [](int64_t b0, int64_t e0, auto&& f) { f(b0, e0); };
  run_fwd_host<T>(p, serial);

  // Backward buffers, poisoned: every element must be written.
  std::vector<T> dq(nq, T(NAN)), dk(nk, T(NAN)), dv(nk, T(NAN));
  p.do_ptr = dout.data(), p.dq_ptr = dq.data(), p.dk_ptr = dk.data(), p.dv_ptr = dv.data();
  p.do_batch_stride = p.q_batch_stride, p.do_row_stride = p.q_row_stride, p.do_head_stride = c.d;
  p.dq_batch_stride = p.q_batch_stride, p.dq_row_stride = p.q_row_stride, p.dq_head_stride = c.d;
  p.dk_batch_stride = p.k_batch_stride, p.dk_row_stride = p.k_row_stride, p.dk_head_stride = c.d;
  p.dv_batch_stride = p.k_batch_stride, p.dv_row_stride = p.k_row_stride, p.dv_head_stride = c.d;
  p.accum_rows = c.b * c.sq;
  p.dq_accum_splits = host_bwd_splits(c.b, c.hk, ceil_div(c.sk, kHostBwdBlockN));
  std::vector<float> d_sum(size_t(c.b) * c.h * c.sq, NAN);
  std::vector<float> dq_accum(size_t(p.dq_accum_splits) * c.h * p.accum_rows * c.d, NAN);
  p.softmax_d_ptr = d_sum.data();
  p.dq_accum_ptr = dq_accum.data();
  run_bwd_host<T>(p, serial);

  // Determinism: reversed, re-chunked execution order; poisoned again.
  std::vector<T> dq1 = dq, dk1 = dk, dv1 = dv;
  std::fill(dq.begin(), dq.end(), T(NAN)), std::fill(dk.begin(), dk.end(), T(NAN)), std::fill(dv.begin(), dv.end(), T(NAN));
  std::fill(dq_accum.begin(), dq_accum.end(), NAN), std::fill(d_sum.begin(), d_sum.end(), NAN);
  run_bwd_host<T>(p, ReversedChunks{3});
  bool const same = std::memcmp(dq.data(), dq1.data(), nq * sizeof(T)) == 0 &&
                    std::memcmp(dk.data(), dk1.data(), nk * sizeof(T)) == 0 &&
                    std::memcmp(dv.data(), dv1.data(), nk * sizeof(T)) == 0;

  // Double-precision reference gradient of the exact attention.
  std::vector<double> rdq(nq, 0.0), rdk(nk, 0.0), rdv(nk, 0.0);
  auto at = [&](std::vector<T> const& x, int ib, int row, int rows, int heads, int ih, int e) {
    return double(float(x[((size_t(ib) * rows + row) * heads + ih) * c.d + e]));
  };
  for (int ib = 0; ib < c.b; ++ib)
    for (int ih = 0; ih < c.h; ++ih) {
      int const ik = ih / (c.h / c.hk);
      for (int i = 0; i < c.sq; ++i) {
        std::vector<double> s(c.sk), dtanh(c.sk, 1.0);
        double mx = -INFINITY;
        int const diag = i + c.sk - c.sq;
        for (int j = 0; j < c.sk; ++j) {
          double acc = 0;
          for (int e = 0; e < c.d; ++e) acc += at(q, ib, i, c.sq, c.h, ih, e) * at(k, ib, j, c.sk, c.hk, ik, e);
          acc *= p.softmax_scale;
          if (c.softcap > 0) {
            double const t = std::tanh(acc / c.softcap);
            acc = c.softcap * t;
            dtanh[j] = 1.0 - t * t;
          }
          if (c.alibi) acc -= slopes[ih] * std::abs(diag - j);
          bool const hidden = (p.window_right >= 0 && j > diag + p.window_right) || (p.window_left >= 0 && j < diag - p.window_left);
          s[j] = hidden ? -INFINITY : acc;
          mx = std::max(mx, s[j]);
        }
        if (mx == -INFINITY) continue;  // no visible key: no gradient flows through this row
        double sum = 0;
        for (int j = 0; j < c.sk; ++j) sum += std::exp(s[j] - mx);
        std::vector<double> P(c.sk), dP(c.sk, 0.0);
        double D = 0;
        for (int j = 0; j < c.sk; ++j) {
          P[j] = std::exp(s[j] - mx) / sum;
          for (int e = 0; e < c.d; ++e) dP[j] += at(dout, ib, i, c.sq, c.h, ih, e) * at(v, ib, j, c.sk, c.hk, ik, e);
          D += P[j] * dP[j];
        }
        for (int j = 0; j < c.sk; ++j) {
          if (P[j] == 0) continue;
          double const dS = P[j] * (dP[j] - D) * dtanh[j] * p.softmax_scale;
          for (int e = 0; e < c.d; ++e) {
            rdq[((size_t(ib) * c.sq + i) * c.h + ih) * c.d + e] += dS * at(k, ib, j, c.sk, c.hk, ik, e);
            rdk[((size_t(ib) * c.sk + j) * c.hk + ik) * c.d + e] += dS * at(q, ib, i, c.sq, c.h, ih, e);
            rdv[((size_t(ib) * c.sk + j) * c.hk + ik) * c.d + e] += P[j] * at(dout, ib, i, c.sq, c.h, ih, e);
          }
        }
      }
    }
  // Errors relative to each gradient's largest magnitude.  The kernel rounds O (which enters D) and the
  // gradients to the element type, and accumulates in fp32; P and dS stay fp32 on the host.
  auto rel_err = [](std::vector<T> const& got, std::vector<double> const& ref, bool& nan) {
    double mx = 0, err = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      double const g = double(float(got[i]));
      nan |= std::isnan(g);
      mx = std::max(mx, std::abs(ref[i]));
      err = std::max(err, std::abs(g - ref[i]));
    }
    return err / std::max(mx, 1e-30);
  };
  bool nan = false;
  double const eq = rel_err(dq, rdq, nan), ek = rel_err(dk, rdk, nan), ev = rel_err(dv, rdv, nan);
  double const tol = sizeof(T) == 4 ? 2e-5 : (std::is_same_v<T, cutlass::half_t> ? 4e-3 : 2.5e-2);
  bool const ok = !nan && same && eq <= tol && ek <= tol && ev <= tol;
  std::printf("%s %-5s b%d sq%-4d sk%-4d h%d/%d d%-3d causal%d win(%d,%d) cap%.0f alibi%d splits%d: rel err dq %.1e dk %.1e dv %.1e%s%s\n",
              ok ? "ok  " : "FAIL", dtype, c.b, c.sq, c.sk, c.h, c.hk, c.d, c.causal, c.wl, c.wr, c.softcap, c.alibi,
              p.dq_accum_splits, eq, ek, ev, nan ? " NaN" : "", same ? "" : " (not bitwise reproducible)");
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
  };
  int failures = 0;
  for (auto const& c : cases) failures += !run_case<cutlass::bfloat16_t>(c, "bf16");
  failures += !run_case<cutlass::half_t>(cases[0], "fp16");
  failures += !run_case<float>(cases[0], "fp32");
  failures += !run_case<float>(cases[3], "fp32");
  failures += !run_case<float>(cases[5], "fp32");
  failures += !run_case<float>(cases[8], "fp32");
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
