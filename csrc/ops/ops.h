// The op implementations, for the registration blocks of each op family and for the pybind module
// (which exposes the plans behind flash_ext.explain()).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common.h"

namespace flash_ext::ops {

// flash_ext::fwd: q (b, sq, h, d), k/v (b, sk, hk, d), d % 8 == 0.  Returns (out, softmax_lse, rng_state);
// deterministic is read by the autograd formula only (the backward's dQ accumulation order).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                                   double softmax_scale, bool causal, int64_t window_left,
                                                   int64_t window_right, double softcap,
                                                   std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits,
                                                   double dropout_p, std::optional<at::Tensor> const& rng_state,
                                                   bool deterministic);

// What fwd would run for these arguments (explain()); ok=false with every reason when it cannot.
Plan plan_fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale, bool causal,
              int64_t window_left, int64_t window_right, double softcap,
              std::optional<at::Tensor> const& alibi_slopes, int64_t num_splits, double dropout_p = 0);

// The head dims the CUDA backward was compiled for (FLASH_EXT_BWD_HEADDIMS; empty in a build without CUDA).
std::vector<int> gpu_bwd_head_dims();

}  // namespace flash_ext::ops
