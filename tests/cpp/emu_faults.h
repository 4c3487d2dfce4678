// Fault injection for the warp emulator's tests: GPU-only bugs of the forward kernel, each compiled into its
// own object from tests/cpp/emu_fault_kernel.cpp with the test-only switch -DFLASH_EXT_EMU_FAULT=<Fault>.
// Nothing here is part of the library; the kernel headers are not touched: a fault is either an
// architecture policy that leaves out one barrier / cp.async wait at a source line of the kernel, or a
// traits type with one GPU layout decision done wrong.
#pragma once

#include <string>

#include "emu/fwd_emu.h"
#include "flash_ext/params.h"

namespace flash_ext::emu::faults {

enum Fault : int {
  kNone = 0,
  kNoLoopBarrierK = 1,    // main loop: the barrier after "K(n) landed" is missing
  kNoLoopBarrierV = 2,    // main loop: the barrier after "V(n) landed / sK free" is missing
  kNoEpilogueBarrier = 3, // epilogue: sO read in the copy layout right after the MMA-layout writes
  kNoCpAsyncWait = 4,     // main loop: the wait for K(n) (and, first, Q) is missing
  kShuffleMasks = 5,      // row reductions shuffle across lane bits 2 and 3 instead of 0 and 1
  kUnswizzled = 6,        // shared tiles without the XOR swizzle
  kPPairing = 7,          // P's A fragment built from n8 accumulator tiles j and j + N/2, not 2j and 2j + 1
  kNumFaults = 8,
};

inline char const* fault_name(int f) {
  static char const* const names[] = {"none", "no main-loop barrier (K landed)", "no main-loop barrier (V landed, sK free)",
                                      "no epilogue barrier", "no cp.async wait", "wrong shuffle xor masks",
                                      "unswizzled shared memory", "P paired with the wrong accumulator tiles"};
  return names[f];
}

// Source lines of kernel_fwd.h where the faults leave out an instruction (found by the test driver in the
// header's text, so they follow edits of the kernel).
struct FaultLines {
  int barrier_k = -1, barrier_v = -1, wait_k = -1;
};
extern FaultLines g_fault_lines;

// hd 64, fp16, the "uneven" variant (runtime even-ness, no extras), non-causal: the launch of fault F.
std::string run_fault_0(FwdParams const&, EmuLaunch&);
std::string run_fault_1(FwdParams const&, EmuLaunch&);
std::string run_fault_2(FwdParams const&, EmuLaunch&);
std::string run_fault_3(FwdParams const&, EmuLaunch&);
std::string run_fault_4(FwdParams const&, EmuLaunch&);
std::string run_fault_5(FwdParams const&, EmuLaunch&);
std::string run_fault_6(FwdParams const&, EmuLaunch&);
std::string run_fault_7(FwdParams const&, EmuLaunch&);

}  // namespace flash_ext::emu::faults
