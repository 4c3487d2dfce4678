// Dropout in the op layer (see dropout.h), and flash_ext::dropout_mask: the keep mask of the contract in
// csrc/flash_ext/dropout.h as a tensor, for return_attn_probs (S_dmask), tests and the backward's checks.
#include "dropout.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <c10/core/DeviceGuard.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <utility>

#if defined(FLASH_EXT_WITH_CUDA)
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "flash_ext/dropout.h"

namespace flash_ext::ops {

namespace {

// PyTorch hands out CUDA Philox offsets in multiples of 4.  The mask uses the offset as one counter word
// (csrc/flash_ext/dropout.h), so any two distinct offsets give disjoint counters: one step per call suffices.
constexpr uint64_t kPhiloxOffsetIncrement = 4;

uint32_t keep_threshold(double dropout_p) { return uint32_t(std::floor((1.0 - dropout_p) * 65536.0 + 0.5)); }

}  // namespace

void check_dropout(ArgChecker& c, at::Device device, double dropout_p, std::optional<at::Tensor> const& rng_state,
                   bool reads_state) {
  // The mask holds 1 - p to 16 bits (keep_threshold): past 1 - 2^-17 the threshold rounds to 0 and every
  // probability would be dropped, an all-zero output scaled by a huge 1 / (1 - p).
  bool const p_ok = std::isfinite(dropout_p) && dropout_p >= 0 && dropout_p < 1 && keep_threshold(dropout_p) >= 1;
  FLASH_EXT_REQUIRE(c, p_ok, "dropout_p", str(dropout_p),
            "must be in [0, 1 - 2^-17] (the keep probability 1 - p is held to 16 bits; a larger p drops every "
            "probability)");
  if (rng_state.has_value()) {
    auto const& r = *rng_state;
    // A forward without dropout returns an empty rng_state; handed back to a call without dropout (a backward
    // fed what its forward returned), nothing reads it, so it is taken.
    bool const unread = dropout_p == 0 && !reads_state;
    bool const shape_ok = r.dim() == 1 && (r.size(0) == 2 || (unread && r.size(0) == 0));
    FLASH_EXT_REQUIRE(c, shape_ok && r.scalar_type() == at::kLong && r.device() == device,
              "rng_state", str(r.scalar_type()) + " " + str(r.sizes()) + " on " + str(r.device()),
              "must be an int64 tensor of shape (2,) = (seed, offset), as a previous call returned it, on " +
                  str(device) + (unread ? " (or the empty one a call without dropout returned)" : ""));
  }
}

at::Tensor idle_rng_state(at::Tensor const& q, double dropout_p, std::optional<at::Tensor> const& rng_state) {
  auto const opts = q.options().dtype(at::kLong);
  if (dropout_p == 0) { return at::empty({0}, opts); }
  return rng_state.has_value() ? rng_state->clone() : at::zeros({2}, opts);
}

// The Philox (seed, offset) come from the rng_state input when given (the kernel reads it: the call is pure and
// touches no generator), else from the default generator of q's device, drawn under its mutex:
//   CPU:  a fresh 64-bit seed from the CPU generator for every call, offset 0: consecutive calls differ, and
//         torch.manual_seed repeats them bit for bit;
//   CUDA: the generator's Philox state, its offset advanced by kPhiloxOffsetIncrement.  Under CUDA graph
//         capture the seed and the offset base are device pointers that the kernel reads at replay (not values
//         baked in at capture), so every replay draws a fresh mask, as PyTorch's own fused kernels do.
DropoutState set_dropout(FwdParams& p, at::Tensor const& q, double dropout_p,
                         std::optional<at::Tensor> const& rng_state) {
  auto const opts = q.options().dtype(at::kLong);
  if (dropout_p == 0) { return {at::empty({0}, opts), {}}; }
  p.is_dropout = true;
  p.dropout_threshold = keep_threshold(dropout_p);
  p.dropout_scale = float(1.0 / (1.0 - dropout_p));
  DropoutState st{at::empty({2}, opts), {}};
  if (poison_outputs()) { st.out.fill_(std::numeric_limits<int64_t>::min()); }  // the kernel must write it
  p.rng_state_out = st.out.data_ptr<int64_t>();
  if (plan_only()) { return st; }  // no launch follows: the generator stays where it is
  if (rng_state.has_value()) {
    st.in = element_aligned(*rng_state);
    p.rng_seed_ptr = st.in.data_ptr<int64_t>();
    p.rng_offset_ptr = p.rng_seed_ptr + 1;
    return st;
  }
  if (q.device().is_cpu()) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    p.rng_seed = gen.get<at::CPUGeneratorImpl>()->random64();
    return st;
  }
#if defined(FLASH_EXT_WITH_CUDA)
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(q.device().index());
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::PhiloxCudaState const philox = gen.get<at::CUDAGeneratorImpl>()->philox_cuda_state(kPhiloxOffsetIncrement);
  if (philox.captured_) {
    p.rng_seed_ptr = philox.seed_.ptr;
    p.rng_offset_ptr = philox.offset_.ptr;
    p.rng_offset = philox.offset_intragraph_;
  } else {
    p.rng_seed = philox.seed_.val;
    p.rng_offset = philox.offset_.val;
  }
#endif
  return st;
}

namespace {

// (batch, heads, seqlen_q, seqlen_k) bool on rng_state's device, element-wise: one Philox evaluation per
// element (the contract's reference form, not the kernels' grouped evaluation it is compared against).  For
// varlen batches, sequence b's mask is [b, :, :seqlen_q_b, :seqlen_k_b].
at::Tensor dropout_mask(at::Tensor const& rng_state, double dropout_p, int64_t batch, int64_t heads, int64_t seqlen_q,
                        int64_t seqlen_k) {
  // Everything below (the index read, the capture test, dropout's RNG state, allocations) on rng_state's device, not
  // the current one: tensors on cuda:1 with cuda:0 current would otherwise query, and create a context on, 0.
  c10::OptionalDeviceGuard const device_guard(cuda_device_of(rng_state));
  ArgChecker c("flash_ext.dropout_mask");
  check_dropout(c, rng_state.device(), dropout_p, rng_state, /*reads_state=*/true);
  for (auto const& [name, x] : {std::pair{"batch", batch}, std::pair{"heads", heads}, std::pair{"seqlen_q", seqlen_q},
                                std::pair{"seqlen_k", seqlen_k}}) {
    FLASH_EXT_REQUIRE(c, x >= 0 && x <= std::numeric_limits<int>::max(), name, std::to_string(x),
              "must be in [0, 2^31)");
  }
  c.raise_if_any();
  at::Tensor mask = at::empty({batch, heads, seqlen_q, seqlen_k}, rng_state.options().dtype(at::kBool));
  if (mask.numel() == 0) { return mask; }
  at::Tensor const state = element_aligned(rng_state);
  FwdParams p;
  p.rng_seed_ptr = state.data_ptr<int64_t>();
  p.rng_offset_ptr = p.rng_seed_ptr + 1;
  p.dropout_threshold = keep_threshold(dropout_p);
  if (rng_state.device().is_cpu()) {
    PhiloxSeedOffset const so = dropout_seed_offset(p);
    bool* const out = mask.data_ptr<bool>();
    at::parallel_for(0, batch * heads * seqlen_q, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        int const i = int(r % seqlen_q), bh = int(r / seqlen_q);
        DropoutRng const rng = DropoutRng::make(so, bh / int(heads), bh % int(heads), int(heads), p.dropout_threshold);
        for (int64_t j = 0; j < seqlen_k; ++j) { out[r * seqlen_k + j] = dropout_keep(rng, i, int(j)); }
      }
    });
    return mask;
  }
#if defined(FLASH_EXT_WITH_CUDA)
  c10::cuda::CUDAGuard guard(rng_state.device());
  std::string const err = run_dropout_mask_cuda(p, mask.data_ptr<bool>(), int(batch), int(heads), int(seqlen_q),
                                                int(seqlen_k), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err.empty(), "flash_ext.dropout_mask (CUDA): ", err);
#endif
  return mask;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flash_ext, m) {
  m.def("dropout_mask(Tensor rng_state, float dropout_p, SymInt batch, SymInt heads, SymInt seqlen_q, "
        "SymInt seqlen_k) -> Tensor");
}

TORCH_LIBRARY_IMPL(flash_ext, CPU, m) { m.impl("dropout_mask", &dropout_mask); }

#if defined(FLASH_EXT_WITH_CUDA)
TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) { m.impl("dropout_mask", &dropout_mask); }
#endif

}  // namespace flash_ext::ops
