// flash_ext::bwd and flash_ext::varlen_bwd — the backward pass, with flash_attn 2.8's contract
// (_flash_attn_backward / _flash_attn_varlen_backward): the gradients of out = attention(q, k, v) for an
// upstream gradient dout, computed from the forward's out and softmax_lse that the CALLER passes, written into
// the caller's dq, dk, dv buffers; the op returns D = rowsum(dout * out) (flash_attn's softmax_d), minus the
// optional gradient of softmax_lse (an addition to flash_attn's contract: the LSE is differentiable).  out and
// softmax_lse need not come from one forward call: context-parallel (ring) attention passes the merged global
// ones, and the gradient w.r.t. this call's k/v block and its share of dq's come out right (P is recomputed as
// exp(score - global LSE)).  Autograd (flash_ext/_ops.py) calls the same ops with fresh buffers.
#include <torch/library.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>

#if defined(FLASH_EXT_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "common.h"
#include "dropout.h"
#include "flash_ext/bwd_api.h"
#include "flash_ext/dispatch.h"
#include "index_values.h"
#include "ops.h"

namespace flash_ext::ops {

namespace {

// dout and out like q; softmax_lse fp32 of lse_shape; dq like q, dk and dv like k (any strides with a
// contiguous last dimension: they are written in place).
void check_bwd_tensors(ArgChecker& c, at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k,
                       at::Tensor const& v, at::Tensor const& out, at::Tensor const& lse, at::Tensor const& dq,
                       at::Tensor const& dk, at::Tensor const& dv, std::vector<int64_t> const& lse_shape) {
  auto like = [&](at::Tensor const& t, char const* name, at::Tensor const& ref, char const* ref_name, bool written) {
    if (!t.defined() || !ref.defined()) {  // None where a tensor belongs (flash_attn's op allocates missing dq/dk/dv)
      FLASH_EXT_REQUIRE(c, t.defined(), name, "None",
                written ? "must be a tensor: the op writes the gradient into it (flash_ext.flash_attn_backward "
                          "allocates missing buffers)"
                        : "must be a tensor");
      return;
    }
    bool const same = t.sizes() == ref.sizes() && t.scalar_type() == ref.scalar_type() && t.device() == ref.device();
    FLASH_EXT_REQUIRE(c, same, name, str(t.scalar_type()) + " " + str(t.sizes()) + " on " + str(t.device()),
              std::string("must match ") + ref_name + " (" + str(ref.scalar_type()) + " " + str(ref.sizes()) + " on " +
                  str(ref.device()) + ")");
    if (t.dim() >= 1) {
      FLASH_EXT_REQUIRE(c, t.stride(-1) == 1 || t.size(-1) <= 1 || t.numel() == 0, std::string(name) + ".stride(-1)",
                std::to_string(t.stride(-1)),
                written ? "the last dimension must be contiguous (the gradient is written in place)"
                        : "the last dimension must be contiguous");
    }
  };
  like(dout, "dout", q, "q", false);
  like(out, "out", q, "q", false);
  like(dq, "dq", q, "q", true);
  like(dk, "dk", k, "k", true);
  like(dv, "dv", k, "k/v", true);
  bool const lse_ok = lse.scalar_type() == at::kFloat && lse.device() == q.device() &&
                      lse.sizes() == at::IntArrayRef(lse_shape);
  FLASH_EXT_REQUIRE(c, lse_ok, "softmax_lse",
            str(lse.scalar_type()) + " " + str(lse.sizes()) + " on " + str(lse.device()),
            "must be float32 " + str(at::IntArrayRef(lse_shape)) + " on q's device (the forward's softmax_lse)");
  check_no_overlap(c, {{&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}},
                   {{&dout, "dout"}, {&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&lse, "softmax_lse"}});
}

// The optional gradient of softmax_lse: fp32, softmax_lse's shape, q's device.
void check_dlse(ArgChecker& c, std::optional<at::Tensor> const& dlse, at::Tensor const& lse) {
  if (!dlse.has_value()) { return; }
  bool const ok = dlse->scalar_type() == at::kFloat && dlse->sizes() == lse.sizes() && dlse->device() == lse.device();
  FLASH_EXT_REQUIRE(c, ok, "dsoftmax_lse",
            str(dlse->scalar_type()) + " " + str(dlse->sizes()) + " on " + str(dlse->device()),
            "must be float32 with softmax_lse's shape " + str(lse.sizes()) + " and device");
}

// Dropout's backward regenerates the forward's mask from the (seed, offset) the forward returned as rng_state
// (flash_attn's contract): with dropout_p > 0 it is required, since any other mask gives a wrong gradient.
void check_bwd_dropout(ArgChecker& c, at::Tensor const& q, double dropout_p,
                       std::optional<at::Tensor> const& rng_state) {
  check_dropout(c, q.device(), dropout_p, rng_state);
  FLASH_EXT_REQUIRE(c, !(dropout_p > 0) || rng_state.has_value(), "rng_state", "None",
            "is required with dropout_p > 0: the forward's rng_state (seed, offset), from which the backward "
            "regenerates its dropout mask");
}

#if defined(FLASH_EXT_WITH_CUDA)
constexpr int kGpuBwdHeadDimsMask = FLASH_EXT_GPU_BWD_HEADDIMS_MASK;
#else
constexpr int kGpuBwdHeadDimsMask = 0;
#endif

// A CUDA build may compile the backward for fewer head dims than the forward (FLASH_EXT_BWD_HEADDIMS): such
// a head dim is refused here, with the forward's head-dim checks, before anything is written.
void check_bwd_head_dim(ArgChecker& c, at::Tensor const& q) {
  if (!q.is_cuda() || q.dim() < 1) { return; }
  int64_t const d = q.size(-1), padded = (d + 7) / 8 * 8;
  std::string built;
  bool found = false;
  for (int hd : gpu_bwd_head_dims()) {
    built += (built.empty() ? "" : ", ") + std::to_string(hd);
    found = found || padded <= hd;
  }
  FLASH_EXT_REQUIRE(c, found || d > 256, "head_dim", std::to_string(d),
            "no GPU backward kernel for it in this build (compiled backward head dims: " +
                (built.empty() ? std::string("none") : built) +
                "); rebuild with FLASH_EXT_BWD_HEADDIMS including a head dim >= " + std::to_string(d));
}

// The caller's gradient buffer, or (CUDA rows not 16-byte aligned) an aligned stand-in copied back after.
struct GradBuffer {
  at::Tensor& user;
  at::Tensor kernel;
  explicit GradBuffer(at::Tensor& t)
      : user(t), kernel(t.is_cuda() && !aligned16(t) ? at::empty(t.sizes(), t.options()) : t) {}
  void finish() {
    if (!kernel.is_same(user)) { user.copy_(kernel); }
  }
};

// Everything after the checks, shared by both ops: p holds the problem (b, lengths, varlen index pointers,
// semantics); this records the layouts, allocates D and the dQ accumulators, poisons in test mode, launches.
// zero_grads: some dq/dk/dv rows belong to no (used) position of any sequence and are never written by the
// kernels, so they are zero-filled first.
at::Tensor launch_bwd(BwdParams& p, at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k,
                      at::Tensor const& v, at::Tensor const& out, at::Tensor const& lse, at::Tensor& dq, at::Tensor& dk,
                      at::Tensor& dv, std::optional<at::Tensor> const& alibi_slopes, bool deterministic,
                      std::optional<at::Tensor> const& dlse, double dropout_p,
                      std::optional<at::Tensor> const& rng_state, int64_t accum_rows,
                      std::vector<int64_t> const& d_shape, bool zero_grads, char const* op) {
  bool const sm80 = q.is_cuda();  // the backward has no emulated path yet: CPU tensors run the host backend
  at::Tensor const in_q = aligned_for_kernel(q, sm80), in_k = aligned_for_kernel(k, sm80);
  at::Tensor const in_v = aligned_for_kernel(v, sm80), in_do = aligned_for_kernel(dout, sm80);
  at::Tensor const in_o = aligned_for_kernel(out, sm80), in_lse = element_aligned(lse);
  std::optional<at::Tensor> in_dlse;
  if (dlse.has_value()) { in_dlse = element_aligned(*dlse); }
  std::optional<at::Tensor> alibi;
  if (alibi_slopes.has_value()) { alibi = element_aligned(*alibi_slopes); }
  GradBuffer gq(dq), gk(dk), gv(dv);
  set_inputs(p, in_q, in_k, in_v);
  set_outputs(p, in_o, in_lse);
  int const r = int(q.dim()) - 3;
  auto strides = [r](at::Tensor const& t, index_t& batch, index_t& row, index_t& head) {
    batch = r ? t.stride(0) : 0, row = t.stride(r), head = t.stride(r + 1);
  };
  p.do_ptr = in_do.data_ptr(), p.dq_ptr = gq.kernel.data_ptr(), p.dk_ptr = gk.kernel.data_ptr(),
      p.dv_ptr = gv.kernel.data_ptr();
  strides(in_do, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  strides(gq.kernel, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  strides(gk.kernel, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  strides(gv.kernel, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  if (alibi.has_value()) {
    p.alibi_slopes_ptr = alibi->data_ptr<float>();
    p.alibi_slopes_batch_stride = alibi->dim() == 2 ? alibi->stride(0) : 0;
  }
  p.deterministic = deterministic;
  p.accum_rows = int(accum_rows);
  p.dsoftmax_lse_ptr = in_dlse.has_value() ? in_dlse->data_ptr<float>() : nullptr;
  // Dropout: the forward's rules (threshold, 1 / (1 - p)) and its (seed, offset), read by the kernel from
  // rng_state.  The backward reports no rng_state of its own.
  DropoutState const dropout = set_dropout(p, q, dropout_p, rng_state);
  p.rng_state_out = nullptr;

  DeviceInfo const dev = device_info(q.device());
  DType const dtype = to_dtype(q.scalar_type());
  if (dev.cuda) {
#if defined(FLASH_EXT_WITH_CUDA)
    CudaBwdPlan const plan = plan_bwd_cuda(p, dtype, dev.cc_major, dev.cc_minor, dev.smem_per_block_optin,
                                           dev.processors);
    TORCH_CHECK_VALUE(plan.ok, op, " (CUDA): ", plan.why);  // before anything is written
    p.dq_accum_splits = plan.dq_splits;
#endif
  } else {
    p.dq_accum_splits = bwd_cpu_dq_splits(p);
  }
  auto const f32 = q.options().dtype(at::kFloat);
  at::Tensor softmax_d = at::empty(d_shape, f32);
  at::Tensor dq_accum = at::empty({p.dq_accum_splits, p.h, accum_rows, p.d}, f32);
  if (poison_outputs()) {  // every gradient, D and accumulator element must be written by the kernels
    for (at::Tensor* t : {&gq.kernel, &gk.kernel, &gv.kernel, &softmax_d, &dq_accum}) { t->fill_(NAN); }
  }
  if (zero_grads) {
    gq.kernel.zero_();
    gk.kernel.zero_();
    gv.kernel.zero_();
    softmax_d.zero_();
  }
  p.softmax_d_ptr = softmax_d.data_ptr<float>();
  p.dq_accum_ptr = dq_accum.data_ptr<float>();

  if (dev.cuda) {
#if defined(FLASH_EXT_WITH_CUDA)
    c10::cuda::CUDAGuard guard(q.device());
    std::string const err = run_bwd_cuda(p, dtype, dev.cc_major, dev.cc_minor, dev.smem_per_block_optin,
                                         c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err.empty(), op, " (CUDA): ", err);
#else
    TORCH_CHECK(false, op, ": flash_ext was built without CUDA; rebuild with a CUDA toolkit or pass CPU tensors");
#endif
  } else {
    run_bwd_cpu(p, dtype);
  }
  gq.finish();
  gk.finish();
  gv.finish();
  return softmax_d;
}

at::Tensor bwd(at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
               at::Tensor const& out, at::Tensor const& softmax_lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
               double dropout_p, double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
               double softcap, std::optional<at::Tensor> const& alibi_slopes, bool deterministic,
               std::optional<at::Tensor> const& rng_state, std::optional<at::Tensor> const& dsoftmax_lse) {
  TORCH_CHECK_VALUE(!plan_only(), "flash_ext.bwd: explain_call covers the forward functions; the backward "
                    "would run (and write its buffers) in plan-only mode");
  // Everything below (the index read, the capture test, dropout's RNG state, allocations) on q's device, not
  // the current one: tensors on cuda:1 with cuda:0 current would otherwise query, and create a context on, 0.
  c10::OptionalDeviceGuard const device_guard(cuda_device_of(q));
  ArgChecker c("flash_ext.bwd");
  bool const shapes_ok = check_qkv(c, q, k, v, /*varlen=*/false);
  check_options(c, q, shapes_ok ? q.size(0) : -1, shapes_ok ? q.size(2) : -1, softmax_scale, softcap, alibi_slopes,
                /*num_splits=*/1);
  check_bwd_dropout(c, q, dropout_p, rng_state);
  check_bwd_head_dim(c, q);
  if (shapes_ok) {
    check_lengths(c, q.size(1), k.size(1), "q.shape[1]/k.shape[1]");
    check_bwd_tensors(c, dout, q, k, v, out, softmax_lse, dq, dk, dv, {q.size(0), q.size(2), q.size(1)});
    check_dlse(c, dsoftmax_lse, softmax_lse);
    FLASH_EXT_REQUIRE(c, q.size(0) * q.size(1) <= INT32_MAX, "q", str(q.sizes()),
              "batch x seqlen_q must be < 2^31 (the dQ accumulators are addressed with 32-bit rows)");
  }
  c.raise_if_any();

  int64_t const b = q.size(0), sq = q.size(1), h = q.size(2), sk = k.size(1);
  if (q.numel() == 0 || k.numel() == 0) {  // no query or no key: nothing flows; D is still computed
    dq.zero_();
    dk.zero_();
    dv.zero_();
    at::Tensor d = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(-1).transpose(1, 2).contiguous();
    return dsoftmax_lse.has_value() ? d - *dsoftmax_lse : d;
  }
  BwdParams p;
  p.b = int(b);
  p.seqlen_q = int(sq);
  p.seqlen_k = int(sk);
  set_semantics(p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes);
  return launch_bwd(p, dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, deterministic, dsoftmax_lse,
                    dropout_p, rng_state, b * sq,
                    {b, h, sq}, /*zero_grads=*/false, "flash_ext.bwd");
}

at::Tensor varlen_bwd(at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                      at::Tensor const& out, at::Tensor const& softmax_lse, at::Tensor& dq, at::Tensor& dk,
                      at::Tensor& dv, at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k,
                      int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, double softmax_scale, bool causal,
                      int64_t window_left, int64_t window_right, double softcap,
                      std::optional<at::Tensor> const& alibi_slopes, bool deterministic,
                      std::optional<at::Tensor> const& rng_state, std::optional<at::Tensor> const& seqused_k,
                      std::optional<at::Tensor> const& dsoftmax_lse) {
  TORCH_CHECK_VALUE(!plan_only(), "flash_ext.varlen_bwd: explain_call covers the forward functions; the backward "
                    "would run (and write its buffers) in plan-only mode");
  // Everything below (the index read, the capture test, dropout's RNG state, allocations) on q's device, not
  // the current one: tensors on cuda:1 with cuda:0 current would otherwise query, and create a context on, 0.
  c10::OptionalDeviceGuard const device_guard(cuda_device_of(q));
  ArgChecker c("flash_ext.varlen_bwd");
  bool const shapes_ok = check_qkv(c, q, k, v, /*varlen=*/true);
  bool const cu_ok = check_cu_seqlens_pair(c, cu_seqlens_q, cu_seqlens_k, q.device());
  int64_t const b = std::max<int64_t>(cu_seqlens_q.numel() - 1, 0);
  bool const used_ok = check_index_tensor(c, seqused_k, "seqused_k", 1, b, q.device(), "q");
  FLASH_EXT_REQUIRE(c, max_seqlen_q >= 0, "max_seqlen_q", std::to_string(max_seqlen_q), "must be >= 0");
  FLASH_EXT_REQUIRE(c, max_seqlen_k >= 0, "max_seqlen_k", std::to_string(max_seqlen_k), "must be >= 0");
  check_lengths(c, max_seqlen_q, max_seqlen_k, "max_seqlen_q/max_seqlen_k");
  check_options(c, q, b, shapes_ok ? q.size(1) : -1, softmax_scale, softcap, alibi_slopes, /*num_splits=*/1);
  check_bwd_dropout(c, q, dropout_p, rng_state);
  check_bwd_head_dim(c, q);
  if (shapes_ok) {
    check_bwd_tensors(c, dout, q, k, v, out, softmax_lse, dq, dk, dv, {q.size(1), q.size(0)});
    check_dlse(c, dsoftmax_lse, softmax_lse);
    FLASH_EXT_REQUIRE(c, q.size(0) <= INT32_MAX, "q", str(q.sizes()), "total_q must be < 2^31");
  }

  // Index values: one host read (on CUDA one copy; trusted while capturing or with FLASH_EXT_TRUST_CU_SEQLENS=1).
  // Rows no used key or query covers are never written by the kernels (nor their softmax_d); zero_grads says
  // whether there may be any.
  bool zero_grads = true;
  IndexValues idx;
  int const s_cu_q = idx.add(cu_ok ? std::optional<at::Tensor>(cu_seqlens_q) : std::nullopt);
  int const s_cu_k = idx.add(cu_ok ? std::optional<at::Tensor>(cu_seqlens_k) : std::nullopt);
  int const s_used = idx.add(used_ok ? seqused_k : std::nullopt);
  if (shapes_ok && cu_ok && used_ok && idx.read(q.device())) {
    int const* cu_q = idx.values(s_cu_q);
    int const* cu_k = idx.values(s_cu_k);
    // Rows of q past the last sequence (a padded batch, as the forward accepts) get zero gradients.
    check_cu_seqlens_values(c, cu_q, b + 1, "cu_seqlens_q", q.size(0), /*total_exact=*/false, max_seqlen_q,
                            "max_seqlen_q");
    check_cu_seqlens_values(c, cu_k, b + 1, "cu_seqlens_k", k.size(0), /*total_exact=*/false, max_seqlen_k,
                            "max_seqlen_k");
    bool every_row_covered = cu_k[b] == k.size(0) && cu_q[b] == q.size(0);
    if (seqused_k.has_value()) {
      int const* used = idx.values(s_used);
      int64_t bad = -1;
      for (int64_t i = 0; i < b; ++i) {
        int64_t const keys = int64_t(cu_k[i + 1]) - cu_k[i];
        if (bad < 0 && (used[i] < 0 || used[i] > keys)) { bad = i; }
        every_row_covered = every_row_covered && used[i] == keys;
      }
      FLASH_EXT_REQUIRE(c, bad < 0, "seqused_k",
                bad < 0 ? "" : "value " + std::to_string(used[bad]) + " at index " + std::to_string(bad),
                "must be within [0, that sequence's key count" +
                    (bad < 0 ? "" : " " + std::to_string(int64_t(cu_k[bad + 1]) - cu_k[bad])) + "]");
    }
    zero_grads = !every_row_covered;
  }
  c.raise_if_any();

  int64_t const total_q = q.size(0), h = q.size(1);
  if (b == 0 || max_seqlen_q == 0 || max_seqlen_k == 0 || q.numel() == 0 || k.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    at::Tensor d = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(-1).transpose(0, 1).contiguous();
    return dsoftmax_lse.has_value() ? d - *dsoftmax_lse : d;
  }
  at::Tensor const cu_q = element_aligned(cu_seqlens_q), cu_k = element_aligned(cu_seqlens_k);
  std::optional<at::Tensor> used;
  if (seqused_k.has_value()) { used = element_aligned(*seqused_k); }
  BwdParams p;
  p.b = int(b);
  p.seqlen_q = int(max_seqlen_q);
  p.seqlen_k = int(max_seqlen_k);
  p.total_q = int(total_q);
  p.cu_seqlens_q = cu_q.data_ptr<int>();
  p.cu_seqlens_k = cu_k.data_ptr<int>();
  p.seqused_k = used.has_value() ? used->data_ptr<int>() : nullptr;
  set_semantics(p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes);
  return launch_bwd(p, dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, deterministic, dsoftmax_lse,
                    dropout_p, rng_state, total_q,
                    {h, total_q}, zero_grads, "flash_ext.varlen_bwd");
}

}  // namespace

std::vector<int> gpu_bwd_head_dims() { return gpu_head_dims_in(kGpuBwdHeadDimsMask); }

TORCH_LIBRARY_FRAGMENT(flash_ext, m) {
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a!) dq, Tensor(b!) dk, "
      "Tensor(c!) dv, float dropout_p, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, Tensor? alibi_slopes, bool deterministic, Tensor? rng_state=None, "
      "Tensor? dsoftmax_lse=None) -> Tensor softmax_d");
  m.def(
      "varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a!) dq, "
      "Tensor(b!) dk, Tensor(c!) dv, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
      "SymInt max_seqlen_k, "
      "float dropout_p, float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
      "Tensor? alibi_slopes, bool deterministic, Tensor? rng_state=None, Tensor? seqused_k=None, "
      "Tensor? dsoftmax_lse=None) -> Tensor softmax_d");
}

TORCH_LIBRARY_IMPL(flash_ext, CPU, m) {
  m.impl("bwd", &bwd);
  m.impl("varlen_bwd", &varlen_bwd);
}

#if defined(FLASH_EXT_WITH_CUDA)
TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) {
  m.impl("bwd", &bwd);
  m.impl("varlen_bwd", &varlen_bwd);
}
#endif

}  // namespace flash_ext::ops
