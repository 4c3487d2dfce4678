// flash_ext::fwd — fixed-length batches: q (b, sq, h, d), k/v (b, sk, h_k, d).
#include <torch/library.h>
#include <c10/core/DeviceGuard.h>

#include "common.h"
#include "dropout.h"
#include "ops.h"

namespace flash_ext::ops {

namespace {

// Every check of fwd; returns whether the shapes were readable (later steps need them).
bool check_fwd(ArgChecker& c, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale,
               double softcap, std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits, double dropout_p,
               std::optional<at::Tensor> const& rng_state) {
  bool const shapes_ok = check_qkv(c, q, k, v, /*varlen=*/false);
  check_options(c, q, shapes_ok ? q.size(0) : -1, shapes_ok ? q.size(2) : -1, softmax_scale, softcap, alibi_slopes,
                num_splits);
  check_dropout(c, q.device(), dropout_p, rng_state);
  if (shapes_ok) {
    check_lengths(c, q.size(1), k.size(1), "q.shape[1]/k.shape[1]", q.size(0) * q.size(1), num_splits);
  }
  return shapes_ok;
}

// Params of a checked fwd problem (layouts, lengths, semantics); outputs and split accumulators excluded.
void fill_params(FwdParams& p, at::Tensor const& q, at::Tensor const& k, double softmax_scale, bool causal,
                 int64_t window_left, int64_t window_right, double softcap,
                 std::optional<at::Tensor> const& alibi_slopes) {
  p.b = int(q.size(0));
  p.seqlen_q = int(q.size(1));
  p.seqlen_k = int(k.size(1));
  set_semantics(p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes);
}

// The decode trick (swap_query_groups) exchanges query heads and rows, the dropout mask's coordinates: it is
// not used with dropout.
bool swap_groups(at::Tensor const& q, at::Tensor const& k, int64_t window_left,
                 std::optional<at::Tensor> const& alibi_slopes, double dropout_p) {
  return dropout_p == 0 && swap_query_groups(q, k, window_left, k.size(1), alibi_slopes);
}

// The forward of a checked call into out (b, sq, h, d) and lse (b, h, sq), which may be views of the caller's
// tensors (grouped_outputs); returns the rng_state output.
at::Tensor run_checked(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale, bool causal,
                       int64_t window_left, int64_t window_right, double softcap,
                       std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits, double dropout_p,
                       std::optional<at::Tensor> const& rng_state, at::Tensor out, at::Tensor lse) {
  if (out.numel() == 0) { return idle_rng_state(q, dropout_p, rng_state); }
  if (k.size(1) == 0) {  // no key at all: every row is empty
    out.zero_();
    lse.fill_(INFINITY);
    return idle_rng_state(q, dropout_p, rng_state);
  }
  FwdParams p;
  KernelInputs const in = prepare_inputs(p, q, k, v, out, lse, alibi_slopes);
  fill_params(p, q, k, softmax_scale, causal, window_left, window_right, softcap, in.alibi);
  auto const accum = set_splits(p, in.q, num_splits, q.size(0) * q.size(1));
  DropoutState const dropout = set_dropout(p, q, dropout_p, rng_state);
  launch(p, in, out, accum, "flash_ext.fwd");
  return dropout.out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                                   double softmax_scale, bool causal, int64_t window_left,
                                                   int64_t window_right, double softcap,
                                                   std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits,
                                                   double dropout_p, std::optional<at::Tensor> const& rng_state,
                                                   bool /*deterministic: read by the autograd formula only*/) {
  // Everything below (the index read, the capture test, dropout's RNG state, allocations) on q's device, not
  // the current one: tensors on cuda:1 with cuda:0 current would otherwise query, and create a context on, 0.
  c10::OptionalDeviceGuard const device_guard(cuda_device_of(q));
  ArgChecker c("flash_ext.fwd");
  check_fwd(c, q, k, v, softmax_scale, softcap, alibi_slopes, num_splits, dropout_p, rng_state);
  c.raise_if_any();
  if (swap_groups(q, k, window_left, alibi_slopes, dropout_p)) {
    GroupedOutputs const g = grouped_outputs(q, k.size(2));
    at::Tensor rng = run_checked(groups_as_rows(q, k.size(2)), k, v, softmax_scale, /*causal=*/false, -1, -1, softcap,
                                 alibi_slopes, num_splits, 0.0, std::nullopt, g.out_rows, g.lse_rows);
    return {g.out, g.lse, rng};
  }
  int64_t const b = q.size(0), sq = q.size(1), h = q.size(2), d = q.size(3);
  at::Tensor out = at::empty({b, sq, h, d}, q.options());
  at::Tensor lse = at::empty({b, h, sq}, q.options().dtype(at::kFloat));
  at::Tensor rng = run_checked(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                               num_splits, dropout_p, rng_state, out, lse);
  return {out, lse, rng};
}

Plan plan_fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale, bool causal,
              int64_t window_left, int64_t window_right, double softcap,
              std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits, double dropout_p) {
  // Everything below (the index read, the capture test, dropout's RNG state, allocations) on q's device, not
  // the current one: tensors on cuda:1 with cuda:0 current would otherwise query, and create a context on, 0.
  c10::OptionalDeviceGuard const device_guard(cuda_device_of(q));
  ArgChecker c("flash_ext.fwd");
  check_fwd(c, q, k, v, softmax_scale, softcap, alibi_slopes, num_splits, dropout_p, std::nullopt);
  if (!c.errors().empty()) {
    Plan plan;
    plan.ok = false;
    plan.reasons = c.errors();
    return plan;
  }
  if (swap_groups(q, k, window_left, alibi_slopes, dropout_p)) {
    return plan_fwd(groups_as_rows(q, k.size(2)), k, v, softmax_scale, false, -1, -1, softcap, alibi_slopes,
                    num_splits);
  }
  FwdParams p;
  p.h = int(q.size(2)), p.d = int(q.size(3)), p.h_k = int(k.size(2)), p.h_h_k_ratio = p.h / p.h_k;
  fill_params(p, q, k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes);
  set_input_shapes(p, q, k, v);
  set_splits(p, q, num_splits, int64_t(p.b) * p.seqlen_q, /*allocate=*/false);
  p.is_dropout = dropout_p > 0;
  return make_plan(p, q);
}

// dropout_p > 0 without rng_state draws from the default generator: nondeterministic_seeded keeps graph
// passes from merging or reordering such calls as if they were pure.  rng_state (output): the (seed, offset)
// the mask used, int64 (2,); empty (0,) without dropout.
TORCH_LIBRARY_FRAGMENT(flash_ext, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, Tensor? alibi_slopes, int num_splits=0, float dropout_p=0.0, Tensor? rng_state=None, "
      "bool deterministic=False) -> (Tensor out, Tensor softmax_lse, Tensor rng_state)",
      {at::Tag::nondeterministic_seeded});
}

TORCH_LIBRARY_IMPL(flash_ext, CPU, m) { m.impl("fwd", &fwd); }

#if defined(FLASH_EXT_WITH_CUDA)
TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) { m.impl("fwd", &fwd); }
#endif

}  // namespace flash_ext::ops
