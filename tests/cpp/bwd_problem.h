// A backward problem for the C++ tests (host backend and warp emulator): random inputs, the forward's O and
// LSE from the host forward, poisoned gradient buffers and BwdParams, and the exact double-precision gradient
// of the attention (with the dropout mask of the contract in dropout.h when dropout is on).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <type_traits>
#include <vector>

#include "flash_ext/dropout.h"
#include "flash_ext/launch_host.h"
#include "flash_ext/launch_host_bwd.h"
#include "problem_params.h"

namespace bwd_test {

using namespace flash_ext;

struct Case {
  int b, sq, sk, h, hk, d;
  bool causal;
  int wl, wr;  // window; -1 unbounded
  float softcap;
  bool alibi;
  float dropout_p = 0.f;
};

template <class T>
struct Problem {
  Case c;
  std::vector<T> q, k, v, dout, o, dq, dk, dv;
  std::vector<float> lse, slopes, d_sum, dq_accum;
  BwdParams p;
  size_t nq = 0, nk = 0;

  // Inputs, the forward (host backend, same dropout state), and the backward's buffers poisoned with NaN.
  // dq_splits: the dQ accumulator slices the backend under test uses.
  void init(Case const& c_, int dq_splits) {
    c = c_;
    std::mt19937 rng(4321);
    std::normal_distribution<float> nd;
    nq = size_t(c.b) * c.sq * c.h * c.d, nk = size_t(c.b) * c.sk * c.hk * c.d;
    q.resize(nq), k.resize(nk), v.resize(nk), dout.resize(nq), o.assign(nq, T(NAN));
    float const q_scale = c.softcap > 0 ? 4.f : 1.f;  // scores reach the non-linear part of tanh
    for (auto& x : q) x = T(q_scale * nd(rng));
    for (auto& x : k) x = T(nd(rng));
    for (auto& x : v) x = T(nd(rng));
    for (auto& x : dout) x = T(nd(rng));
    lse.assign(size_t(c.b) * c.h * c.sq, NAN), slopes.resize(c.h);
    for (int i = 0; i < c.h; ++i) slopes[i] = std::exp2(-8.f * (i + 1) / c.h);

    p = BwdParams{};
    set_dense_problem(p, c, q.data(), k.data(), v.data(), o.data(), lse.data(), slopes.data());
    if (c.dropout_p > 0) {
      p.is_dropout = true;
      p.dropout_threshold = uint32_t(std::floor((1.0 - double(c.dropout_p)) * 65536.0 + 0.5));
      p.dropout_scale = float(1.0 / (1.0 - double(c.dropout_p)));
      p.rng_seed = 0x0123456789abcdefull, p.rng_offset = 4 * 1000003ull;
    }
    auto serial = [](int64_t b0, int64_t e0, auto&& f) { f(b0, e0); };
    run_fwd_host<T>(p, serial);

    dq.assign(nq, T(NAN)), dk.assign(nk, T(NAN)), dv.assign(nk, T(NAN));
    p.do_ptr = dout.data(), p.dq_ptr = dq.data(), p.dk_ptr = dk.data(), p.dv_ptr = dv.data();
    p.do_batch_stride = p.q_batch_stride, p.do_row_stride = p.q_row_stride, p.do_head_stride = c.d;
    p.dq_batch_stride = p.q_batch_stride, p.dq_row_stride = p.q_row_stride, p.dq_head_stride = c.d;
    p.dk_batch_stride = p.k_batch_stride, p.dk_row_stride = p.k_row_stride, p.dk_head_stride = c.d;
    p.dv_batch_stride = p.k_batch_stride, p.dv_row_stride = p.k_row_stride, p.dv_head_stride = c.d;
    p.accum_rows = c.b * c.sq;
    p.dq_accum_splits = dq_splits;
    d_sum.assign(size_t(c.b) * c.h * c.sq, NAN);
    dq_accum.assign(size_t(dq_splits) * c.h * p.accum_rows * c.d, NAN);
    p.softmax_d_ptr = d_sum.data();
    p.dq_accum_ptr = dq_accum.data();
  }

  void poison() {
    std::fill(dq.begin(), dq.end(), T(NAN)), std::fill(dk.begin(), dk.end(), T(NAN));
    std::fill(dv.begin(), dv.end(), T(NAN));
    std::fill(dq_accum.begin(), dq_accum.end(), NAN), std::fill(d_sum.begin(), d_sum.end(), NAN);
  }

  // The exact gradient of the double-precision attention (inputs as rounded to T), dropout mask included.
  // Largest single term |dS_ij| |k_j| (|dS_ij| |q_i|) of the reference's dQ (dK) sums, with |dS| taken before
  // the cancellation of dP - D (set by reference()).  Where that difference cancels exactly (a row that sees
  // one key: its P is 1 whatever the scores, so dQ = dK = 0), a kernel's dQ and dK are rounding noise of this
  // size, and a relative error against max |ref| = 0 would be meaningless.
  mutable double dq_mag = 0, dk_mag = 0;

  void reference(std::vector<double>& rdq, std::vector<double>& rdk, std::vector<double>& rdv) const {
    rdq.assign(nq, 0.0), rdk.assign(nk, 0.0), rdv.assign(nk, 0.0);
    dq_mag = dk_mag = 0;
    auto at = [&](std::vector<T> const& x, int ib, int row, int rows, int heads, int ih, int e) {
      return double(float(x[((size_t(ib) * rows + row) * heads + ih) * c.d + e]));
    };
    double const rp = c.dropout_p > 0 ? 1.0 / (1.0 - double(c.dropout_p)) : 1.0;
    for (int ib = 0; ib < c.b; ++ib)
      for (int ih = 0; ih < c.h; ++ih) {
        int const ik = ih / (c.h / c.hk);
        DropoutRng const drng = DropoutRng::make({p.rng_seed, p.rng_offset}, ib, ih, c.h, p.dropout_threshold);
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
            bool const hidden = (p.window_right >= 0 && j > diag + p.window_right) ||
                                (p.window_left >= 0 && j < diag - p.window_left);
            s[j] = hidden ? -INFINITY : acc;
            mx = std::max(mx, s[j]);
          }
          if (mx == -INFINITY) continue;  // no visible key: no gradient flows through this row
          double sum = 0;
          for (int j = 0; j < c.sk; ++j) sum += std::exp(s[j] - mx);
          // out = sum_j P_j keep_j rp v_j: the gradient reaching P_j is keep_j rp (dO . v_j).
          std::vector<double> P(c.sk), dP(c.sk, 0.0), keep(c.sk, 1.0);
          double D = 0;
          for (int j = 0; j < c.sk; ++j) {
            P[j] = std::exp(s[j] - mx) / sum;
            if (c.dropout_p > 0) keep[j] = dropout_keep(drng, i, j) ? rp : 0.0;
            for (int e = 0; e < c.d; ++e) dP[j] += at(dout, ib, i, c.sq, c.h, ih, e) * at(v, ib, j, c.sk, c.hk, ik, e);
            dP[j] *= keep[j];
            D += P[j] * dP[j];
          }
          for (int j = 0; j < c.sk; ++j) {
            if (P[j] == 0) continue;
            double const dS = P[j] * (dP[j] - D) * dtanh[j] * p.softmax_scale;
            // dS without the cancellation of dP - D: the size of dS's rounding error in any fp32 kernel.
            double const dS_mag = P[j] * (std::abs(dP[j]) + std::abs(D)) * dtanh[j] * p.softmax_scale;
            for (int e = 0; e < c.d; ++e) {
              rdq[((size_t(ib) * c.sq + i) * c.h + ih) * c.d + e] += dS * at(k, ib, j, c.sk, c.hk, ik, e);
              rdk[((size_t(ib) * c.sk + j) * c.hk + ik) * c.d + e] += dS * at(q, ib, i, c.sq, c.h, ih, e);
              dq_mag = std::max(dq_mag, dS_mag * std::abs(at(k, ib, j, c.sk, c.hk, ik, e)));
              dk_mag = std::max(dk_mag, dS_mag * std::abs(at(q, ib, i, c.sq, c.h, ih, e)));
              rdv[((size_t(ib) * c.sk + j) * c.hk + ik) * c.d + e] += P[j] * keep[j] * at(dout, ib, i, c.sq, c.h, ih, e);
            }
          }
        }
      }
  }
};

// max |got - ref| / max(max |ref|, floor); nan is set when got holds a NaN.  floor: 1e-2 of the size of the
// sum's largest term (Problem::dq_mag), below which a gradient is all cancellation.
template <class T>
double rel_err(std::vector<T> const& got, std::vector<double> const& ref, bool& nan, double floor = 0) {
  double mx = 0, err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    double const g = double(float(got[i]));
    nan |= std::isnan(g);
    mx = std::max(mx, std::abs(ref[i]));
    err = std::max(err, std::abs(g - ref[i]));
  }
  return err / std::max({mx, floor, 1e-30});
}

// The kernels round O (which enters D) and the gradients to T and accumulate in fp32; the host keeps P and dS
// in fp32, the GPU path rounds them to T (p16 = true) for its tensor cores.
template <class T>
double tolerance(bool p16) {
  if constexpr (std::is_same_v<T, float>) {
    return 2e-5;
  } else if constexpr (std::is_same_v<T, cutlass::half_t>) {
    return p16 ? 8e-3 : 4e-3;
  } else {
    return p16 ? 4e-2 : 2.5e-2;
  }
}

}  // namespace bwd_test
