// The Sm80 backward kernel (Sm80BwdTraits on EmuSm80Arch: the real tile config, swizzled shared memory,
// ldmatrix(.trans)/mma fragments, cp.async, barriers, the atomic fp32 dQ accumulation) on the warp emulator,
// against the exact double-precision gradient (bwd_problem.h).  Each case must give zero findings of every
// check (races, unlanded reads, bad addresses incl. the atomic adds, divergence, exits at a barrier, copies in
// flight, bank conflicts) and gradients within the GPU path's tolerance; the variant is the one the CUDA
// dispatcher picks.  dQ is never compared bitwise between runs: its atomic adds have no fixed order.
//
// Deliberate errors must be reported, so the test can fail: the barrier between the P/dS stores and their
// reads by other warps dropped (a race), shared memory one dS tile short of what the kernel addresses, a dQ
// accumulator the launch declares read-only (the atomic adds' range check), an LSE tensor one row short of
// what the kernel reads (the range check of its plain global loads), and a wrong LSE input (the gradient
// comparison must reject the result).
//
// Instantiated: head dim 64, fp16, variants general (non-causal and causal) and dropout (non-causal), the
// general non-causal variant once more on the barrier-dropping policy, and head dim 256 bf16 general
// non-causal (the other extreme tile: 32 x 32, 4 warps, single-buffered Q, 32-column P/dS rows).
#undef NDEBUG
#include <cassert>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <source_location>

#include "emu_bwd_case.h"

using namespace flash_ext;
using namespace flash_ext::emu;
using namespace emu_bwd_test;
using bwd_test::Case;
using T = cutlass::half_t;
using Traits = EmuBwd<64, T>::Traits;
using Traits256 = EmuBwd<256, cutlass::bfloat16_t>::Traits;

#ifndef FLASH_EXT_SOURCE_DIR
#error "CMakeLists.txt defines FLASH_EXT_SOURCE_DIR"
#endif

namespace {

enum class Fault { kNone, kNoPdSBarrier, kShortSmem, kReadOnlyAccum, kShortLse, kWrongLse };

// The line of kernel_bwd.h whose barrier FaultArch drops (found in the source, so edits elsewhere keep it).
int g_skip_barrier_line = -1;

// The emulated policy without the barrier that makes sP/sdS visible to the warps that read them.
struct FaultArch : EmuSm80Arch {
  static void barrier(std::source_location site = std::source_location::current()) {
    char const* file = site.file_name();
    size_t const n = std::strlen(file);
    bool const skip = int(site.line()) == g_skip_barrier_line && n >= 12 && std::strcmp(file + n - 12, "kernel_bwd.h") == 0;
    if (!skip) { EmuSm80Arch::barrier(site); }
  }
};
using FaultTraits = Sm80BwdTraits<64, Traits::kBlockM, Traits::kBlockN, Traits::kNWarps, EmuBwd<64, T>::kTile.atom_m_sdp,
                                  EmuBwd<64, T>::kTile.atom_n_dkv, EmuBwd<64, T>::kTile.atom_m_dq,
                                  Traits::kDoubleBufferQ, T, FaultArch>;

// The first Traits::barrier() after the comment that introduces the P/dS barrier.
bool find_pds_barrier() {
  std::ifstream in(std::string(FLASH_EXT_SOURCE_DIR) + "/csrc/flash_ext/kernel_bwd.h");
  std::string line;
  bool after = false;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find("sP and sdS were written") != std::string::npos) { after = true; }
    if (after && line.find("Traits::barrier()") != std::string::npos) {
      g_skip_barrier_line = n;
      return true;
    }
  }
  std::printf("FAIL: the P/dS barrier of kernel_bwd.h (after \"sP and sdS were written\") was not found\n");
  return false;
}

std::string run_no_pds_barrier(BwdParams const& p, EmuLaunch& launch, KernelDesc const*) {
  KernelDesc const desc = bwd_kernel_desc<FaultTraits>("fault: P/dS barrier dropped, variant general");
  return run_bwd_variant_emu<FaultTraits, false, 1>(p, launch, &desc);
}

template <bool kCausal, int kVariant, class Tr = Traits>
std::string run(BwdParams const& p, EmuLaunch& launch, KernelDesc const* desc) {
  return run_variant<Tr, kCausal, kVariant>(p, launch, desc);
}

// Runs one case; returns whether it behaved as expected (clean and accurate, or the fault reported).
template <class E = T>
bool run_case(Case const& c, RunFn fn, bool deterministic, Fault fault, char const* label) {
  bwd_test::Problem<E> pb;
  pb.init(c, 1);
  pb.p.deterministic = deterministic;
  EmuLaunch launch;
  set_up(launch, pb, fault != Fault::kReadOnlyAccum);
  if (fault == Fault::kShortLse) {
    for (GlobalRange& g : launch.globals) {
      if (std::strcmp(g.name, "softmax_lse") == 0) { g.end -= sizeof(float); }  // the last row's LSE is out of range
    }
  }
  KernelDesc desc;
  KernelDesc const* descp = nullptr;
  if (fault == Fault::kShortSmem) {
    desc = bwd_kernel_desc<Traits>("short shared memory");
    desc.smem_bytes -= Traits::kSmemPdSBytes;  // the dS tile lies past the end
    descp = &desc;
  }
  if (fault == Fault::kWrongLse) {
    for (float& x : pb.lse) { x += 0.1f; }  // every P 10% small: the gradient check itself must fail
  }
  std::string const err = fn(pb.p, launch, descp);
  Report const& r = launch.report;
  if (!err.empty()) {
    std::printf("FAIL %s: launch error: %s\n", label, err.c_str());
    return false;
  }
  if (fault != Fault::kNone && fault != Fault::kWrongLse) {
    Check const expected = fault == Fault::kNoPdSBarrier ? Check::kRace : Check::kBadAddress;
    uint64_t const found = r.counts[int(expected)];
    bool const caught = found > 0;
    std::printf("%s %s: %llu findings (%llu %s)%s\n", caught ? "ok  " : "FAIL", label, (unsigned long long)r.total(),
                (unsigned long long)found, kCheckNames[int(expected)], caught ? "" : ": the injected error went unseen");
    if (caught && !r.messages.empty()) { std::printf("     first: %s\n", r.messages.front().second.c_str()); }
    return caught;
  }
  if (fault == Fault::kWrongLse) {
    Accuracy const a = accuracy(pb);
    std::printf("%s %s: rel err dq %.1e dk %.1e dv %.1e (tol %.0e)%s\n", !a.ok() ? "ok  " : "FAIL", label, a.eq, a.ek,
                a.ev, a.tol, a.ok() ? ": the wrong gradients passed the check" : "");
    return !a.ok();
  }
  return check_clean(pb, launch, label);
}

}  // namespace

int main() {
  static_assert(Traits::kBlockM == 64 && Traits::kBlockN == 128, "the cases below are sized for this tile");
  // GQA 4:2, two sequences, uneven seqlens (neither a tile multiple, sq < sk): the general variant.
  Case const gqa{2, 77, 131, 4, 2, 64, false, -1, -1, 0.f, false};
  Case const gqa_causal{2, 77, 131, 4, 2, 64, true, -1, -1, 0.f, false};
  // sq > sk causal: leading query rows see no key (zero gradients, no NaN), one K/V tile per CTA.
  Case const tall_causal{1, 150, 70, 2, 1, 64, true, -1, -1, 0.f, false};
  Case const dropout{2, 77, 131, 4, 2, 64, false, -1, -1, 0.f, false, 0.3f};
  // d = 40 on the head-dim-64 tile (columns past d predicated off), GQA, causal.
  Case const d40_causal{2, 77, 131, 4, 2, 40, true, -1, -1, 0.f, false};
  // Head dim 256: local window, softcap and ALiBi at once, sk > sq, MQA.
  Case const hd256{1, 45, 70, 2, 1, 256, false, 20, 3, 30.f, true};
  int failures = 0;
  failures += !run_case(gqa, &run<false, 1>, false, Fault::kNone, "gqa 77x131");
  failures += !run_case(gqa_causal, &run<true, 1>, false, Fault::kNone, "gqa 77x131 causal");
  failures += !run_case(tall_causal, &run<true, 1>, false, Fault::kNone, "mqa 150x70 causal");
  // Deterministic order: one dQ column walks both K/V tiles in turn (the loop's leading barrier matters).
  failures += !run_case(gqa, &run<false, 1>, true, Fault::kNone, "gqa 77x131 deterministic");
  failures += !run_case(dropout, &run<false, 2>, false, Fault::kNone, "gqa 77x131 dropout 0.3");
  failures += !run_case(d40_causal, &run<true, 1>, false, Fault::kNone, "gqa 77x131 d40 causal");
  failures += !run_case<cutlass::bfloat16_t>(hd256, &run<false, 1, Traits256>, false, Fault::kNone,
                                              "mqa 45x70 d256 bf16 window softcap alibi");
  if (find_pds_barrier()) {
    failures += !run_case(gqa, &run_no_pds_barrier, false, Fault::kNoPdSBarrier, "fault: P/dS barrier dropped");
  } else {
    ++failures;
  }
  failures += !run_case(gqa, &run<false, 1>, false, Fault::kWrongLse, "fault: LSE off by 0.1 (wrong gradients)");
  failures += !run_case(gqa, &run<false, 1>, false, Fault::kShortSmem, "fault: shared memory one dS tile short");
  failures += !run_case(gqa, &run<false, 1>, false, Fault::kReadOnlyAccum, "fault: dQ accumulator read-only");
  failures += !run_case(gqa, &run<false, 1>, false, Fault::kShortLse, "fault: softmax_lse one row short");
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
