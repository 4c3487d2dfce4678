#include "emu/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace flash_ext::emu {

FiberStack::FiberStack(size_t bytes) {
  size_t const page = size_t(sysconf(_SC_PAGESIZE));
  guard_ = page;
  size_ = (bytes + page - 1) / page * page;
  void* p = mmap(nullptr, guard_ + size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("flash_ext emulator: mmap of a fiber stack");
    std::abort();
  }
  base_ = static_cast<char*>(p);
  mprotect(base_, guard_, PROT_NONE);
}

FiberStack::~FiberStack() { munmap(base_, guard_ + size_); }

#if defined(FLASH_EXT_EMU_FIBER_UCONTEXT)

namespace {
// makecontext passes int arguments only: the pointers travel as two 32-bit halves.
void ucontext_entry(unsigned fn_lo, unsigned fn_hi, unsigned arg_lo, unsigned arg_hi) {
  auto fn = reinterpret_cast<void (*)(void*)>((uintptr_t(fn_hi) << 32) | fn_lo);
  auto arg = reinterpret_cast<void*>((uintptr_t(arg_hi) << 32) | arg_lo);
  fn(arg);
  std::abort();  // entry functions switch away for good instead of returning
}
}  // namespace

void Context::prepare(FiberStack const& stack, void (*entry)(void*), void* arg) {
  getcontext(&uc_);
  uc_.uc_stack.ss_sp = stack.lo();
  uc_.uc_stack.ss_size = size_t(stack.hi() - stack.lo());
  uc_.uc_link = nullptr;
  auto const fn = uint64_t(reinterpret_cast<uintptr_t>(entry)), a = uint64_t(reinterpret_cast<uintptr_t>(arg));
  makecontext(&uc_, reinterpret_cast<void (*)()>(ucontext_entry), 4, unsigned(fn), unsigned(fn >> 32), unsigned(a),
              unsigned(a >> 32));
}

void Context::switch_to(Context& from, Context& to) { swapcontext(&from.uc_, &to.uc_); }

#else

// System V x86-64: rbx, rbp, r12-r15 are callee-saved, and so are MXCSR's control bits and the x87 control
// word.  flash_ext_emu_switch(&from_sp, to_sp) pushes them, stores rsp in *from_sp, loads to_sp and pops the
// same frame back.  A new fiber's stack is prepared to look like such a frame whose return address is
// flash_ext_emu_trampoline, which calls entry(arg) (held in r13 / r12).
extern "C" void flash_ext_emu_switch(void** from_sp, void* to_sp);
extern "C" void flash_ext_emu_trampoline();
asm(R"(
  .text
  .globl flash_ext_emu_switch
  .type flash_ext_emu_switch, @function
flash_ext_emu_switch:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size flash_ext_emu_switch, .-flash_ext_emu_switch

  .globl flash_ext_emu_trampoline
  .type flash_ext_emu_trampoline, @function
flash_ext_emu_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size flash_ext_emu_trampoline, .-flash_ext_emu_trampoline
)");

void Context::prepare(FiberStack const& stack, void (*entry)(void*), void* arg) {
  // The frame flash_ext_emu_switch pops, from low to high addresses: control words (8 bytes), r15, r14, r13,
  // r12, rbx, rbp, return address.  After the ret, rsp must be 16-byte aligned so that the trampoline's call
  // leaves the entry function with the ABI's rsp % 16 == 8.
  auto top = reinterpret_cast<uintptr_t>(stack.hi()) & ~uintptr_t(15);
  auto* frame = reinterpret_cast<uint64_t*>(top) - 8;  // 8 slots; top itself stays 16-byte aligned
  uint32_t mxcsr = 0;
  uint16_t fpucw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  std::memset(frame, 0, 8 * sizeof(uint64_t));
  std::memcpy(&frame[0], &mxcsr, sizeof(mxcsr));
  std::memcpy(reinterpret_cast<char*>(&frame[0]) + 4, &fpucw, sizeof(fpucw));
  frame[1] = 0;                                                    // r15
  frame[2] = 0;                                                    // r14
  frame[3] = reinterpret_cast<uint64_t>(entry);                    // r13
  frame[4] = reinterpret_cast<uint64_t>(arg);                      // r12
  frame[5] = 0;                                                    // rbx
  frame[6] = 0;                                                    // rbp
  frame[7] = reinterpret_cast<uint64_t>(&flash_ext_emu_trampoline);  // return address, at top - 8
  // After popping slots 0..6 and returning through slot 7, rsp == top: 16-byte aligned.
  sp_ = frame;
}

void Context::switch_to(Context& from, Context& to) { flash_ext_emu_switch(&from.sp_, to.sp_); }

#endif

}  // namespace flash_ext::emu
