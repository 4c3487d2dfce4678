// The warp emulator's runtime: emulated CTAs of fiber threads, the warp collectives, shared memory with a
// per-byte shadow, cp.async groups, and the checks.  Host code only.
//
// Execution model.  A CTA is one scheduler on one CPU thread; each GPU thread of the CTA is a fiber (fiber.h).
// Every instruction the kernel takes from the architecture policy (arch_emu.h) is an *event*: the fiber
// posts its operands and switches back to the scheduler.  The scheduler advances the warps in lockstep, one
// event per lane per step, and then executes what the lanes posted:
//   - warp collectives (ldmatrix, mma, shfl, vote) once all 32 lanes have arrived, by the PTX semantics (ptx.h);
//   - per-thread shared-memory moves (cp.async, vector loads/stores) of the lanes at the same kind of event
//     together, as one warp instruction, so their bank conflicts can be counted;
//   - the CTA barrier once every live thread has arrived: that closes a barrier epoch.
// The schedule is a pure function of the kernel's control flow, so every run is deterministic.
//
// Checks (each a counted finding with its location; see Check):
//   race               two threads access a shared byte in one barrier epoch, at least one writing (a
//                      cp.async destination counts as written from issue until the issuing thread's wait);
//   unlanded_read      a shared byte is read before any copy or store has landed in it (never written, or
//                      its cp.async still in flight: destinations are poisoned at issue, data lands at the wait);
//   bad_address        an ldmatrix / cp.async / vector / plain global access outside shared memory or the
//                      launch's global tensors, not aligned to its width, or a write into a read-only tensor;
//   divergence         the lanes of a warp wait at different collectives, at a collective and the barrier, or
//                      at a collective that an exited lane can never join (the CTA is abandoned);
//   exit_at_barrier    a thread exits while others wait at a barrier;
//   copy_in_flight_at_exit   a thread exits with cp.async copies it never waited for;
//   bank_conflict      a shared access of a warp needs more wavefronts than its width requires (the count is
//                      of instructions; Stats::extra_wavefronts sums the excess).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <source_location>
#include <string>
#include <vector>

#include "emu/ptx.h"

namespace flash_ext::emu {

enum class Check : int {
  kRace,
  kUnlandedRead,
  kBadAddress,
  kDivergence,
  kExitAtBarrier,
  kInFlightAtExit,
  kBankConflict,
  kNumChecks
};
inline constexpr int kNumChecks = int(Check::kNumChecks);
inline constexpr char const* kCheckNames[kNumChecks] = {
    "race", "unlanded_read", "bad_address", "divergence", "exit_at_barrier", "copy_in_flight_at_exit", "bank_conflict"};

// What the emulated launches executed: evidence that the emulated path (not the host backend) ran.
struct Stats {
  uint64_t ctas = 0, threads = 0, barriers = 0;
  uint64_t ldmatrix = 0, mma = 0, shfl = 0, cp_async = 0, smem_vector = 0, smem_clear = 0, global_vector = 0;
  uint64_t vote = 0, vote_true = 0;  // vote.any executed, and how many of them were true on the warp
  uint64_t red_global = 0, global_plain = 0;  // red.global.add; plain scalar global loads and stores
  uint64_t wavefronts = 0, extra_wavefronts = 0;  // shared-memory wavefronts of ldmatrix, cp.async, vector moves
  uint64_t fiber_switches = 0;
  void merge(Stats const& o);
};

// Findings and statistics of one or more emulated launches.
struct Report {
  static constexpr size_t kMaxMessages = 12;
  uint64_t counts[kNumChecks] = {};
  Stats stats;
  // The first findings in a deterministic order (by CTA, then by occurrence), as full sentences.
  std::vector<std::pair<uint64_t, std::string>> messages;
  // The kernels launched (KernelDesc::name, each once), e.g. to show which static variant ran.
  std::vector<std::string> kernels;

  void add(Check check, uint64_t cta_order, std::string message);
  void count(Check check) { ++counts[int(check)]; }
  // Whether a finding of CTA `cta_order` would be among the kept messages (so it is worth formatting).
  bool wants_message(uint64_t cta_order) const;
  void merge(Report const& o);
  uint64_t total() const;
  std::string json() const;
  std::string text() const;  // counts and the first findings, for an exception message
};

// A global-memory tensor the launch may touch: [begin, end) bytes.
struct GlobalRange {
  uintptr_t begin = 0, end = 0;
  bool writable = false;
  char const* name = "";
};

// A named part of the CTA's shared memory, for messages: bytes [begin, next region's begin).
struct SmemRegion {
  uint32_t begin;
  char const* name;
};

// The kernel an emulated CTA runs.
struct KernelDesc {
  std::string name;  // e.g. "fwd hd64 fp16 causal, variant uneven"
  int threads = 0;
  int smem_bytes = 0;
  std::vector<SmemRegion> regions;
  std::vector<GlobalRange> globals;
};

// Where a CTA sits in its grid, and what it stands for (for messages).
struct CtaCoord {
  unsigned x = 0, y = 0, z = 0;
  std::string work;      // e.g. "m_block 0, batch 1, head 3, split 0"
  uint64_t order = 0;    // linear block index: orders findings deterministically
};

using CtaBody = void (*)(void const* ctx, int tid, char* smem);

// Runs one CTA of `kernel` on the calling CPU thread (each CPU thread keeps its own fibers and shadow
// memory), body(ctx, tid, smem) for every thread; findings and statistics are added to `report`.
void run_cta(KernelDesc const& kernel, CtaCoord const& cta, CtaBody body, void const* ctx, Report& report);

// ---------------------------------------------------------------------------------------------------
// Instructions, called by the emulated ops (arch_emu.h) from inside an emulated thread.

using Site = std::source_location;

void ldmatrix_x4(bool trans, void const* row_address, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3);
void ldmatrix_x2(void const* row_address, uint32_t& d0, uint32_t& d1);  // non-transposed .x2
void mma_m16n8k16(ptx::Type16 type, ptx::MmaLane const& operands, float& d0, float& d1, float& d2, float& d3);
float shfl_bfly(float value, int lane_mask, Site site);
// vote.sync.any.pred with the full mask: true on every lane when the predicate is true on any lane.
bool vote_any(bool value, Site site);
void cp_async_16(void const* global_src, void* shared_dst);
void cp_async_commit(Site site);
void cp_async_wait(int pending_groups, Site site);
void barrier(Site site);
// A vector move of `bytes` (2, 4, 8 or 16) between any two of registers, shared and global memory.
void vector_move(void const* src, void* dst, int bytes);
// Plain stores of zeros: clear_store for each element, then clear_done once (one lockstep step).
void clear_store(void* shared_dst, int bytes);
void clear_done(Site site);
// A plain scalar global access of `bytes` (ld.global / st.global of an index, LSE, ALiBi slope, split
// partial): range-, alignment- and (stores) write-checked; a faulting load yields zeros, a faulting store is
// dropped, so the run goes on to report what else is wrong.
void global_load(void const* global_src, void* value, int bytes, Site site);
void global_store(void* global_dst, void const* value, int bytes, Site site);
// red.global.add.f32: an atomic fp32 add into global memory (for the backward's dQ accumulation).
void red_add_f32(float* global_dst, float value, Site site);
// Records the kernel source location of the thread's latest policy call (for messages).
void note_site(char const* what, Site site);

}  // namespace flash_ext::emu
