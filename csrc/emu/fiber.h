// Fibers: cooperative user-space threads, one per emulated GPU thread.  A fiber runs until it switches back
// to the scheduler that resumed it; nothing preempts it, so the schedule (and therefore every emulated run)
// is deterministic.
//
// An emulated CTA switches fibers tens of thousands of times per K/V tile, so the switch must be cheap: on
// x86-64 it is a few instructions (callee-saved registers, stack pointer, the SSE/x87 control words), where
// swapcontext also makes a signal-mask system call per switch.  Elsewhere the portable ucontext fallback is
// used (also selectable on x86-64 with -DFLASH_EXT_EMU_UCONTEXT; the C++ tests run both).
#pragma once

#include <cstddef>
#include <cstdint>

#if !defined(__x86_64__) || defined(FLASH_EXT_EMU_UCONTEXT)
#define FLASH_EXT_EMU_FIBER_UCONTEXT 1
#include <ucontext.h>
#endif

namespace flash_ext::emu {

// A fiber's stack: mmap'ed with an inaccessible guard page below it, so an overflow faults instead of
// silently corrupting a neighbour.
class FiberStack {
 public:
  explicit FiberStack(size_t bytes);
  ~FiberStack();
  FiberStack(FiberStack const&) = delete;
  FiberStack& operator=(FiberStack const&) = delete;
  char* lo() const { return base_ + guard_; }
  char* hi() const { return base_ + guard_ + size_; }

 private:
  char* base_ = nullptr;
  size_t guard_ = 0, size_ = 0;
};

// The execution context of one fiber, or of the scheduler (a plain thread) that resumes fibers.
class Context {
 public:
  // Prepares `this` to run entry(arg) on `stack` when first switched to.  entry must never return: it ends
  // by switching away for the last time.
  void prepare(FiberStack const& stack, void (*entry)(void*), void* arg);
  // Saves the running context into `from` and continues `to`.
  static void switch_to(Context& from, Context& to);

 private:
#if defined(FLASH_EXT_EMU_FIBER_UCONTEXT)
  ucontext_t uc_;
#else
  void* sp_ = nullptr;
#endif
};

}  // namespace flash_ext::emu
