// Run-time choice of the host micro-kernels (host_isa.h): what the CPU supports, what the build compiled,
// FLASH_EXT_CPU_ISA and the test override.  Compiled for the baseline target like the kernel body.
#include "flash_ext/host_isa.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#endif
#if defined(__unix__)
#include <unistd.h>
#endif

namespace flash_ext {

HostKernels const* host_kernels_generic();
#if defined(__x86_64__)
HostKernels const* host_kernels_avx2();
HostKernels const* host_kernels_avx512();
HostKernels const* host_kernels_avx512_bf16();
HostKernels const* host_kernels_amx_bf16();  // nullptr where the compiler has no AMX intrinsics
#endif

namespace {

struct IsaInfo {
  HostIsa isa;
  char const* name;
};
constexpr IsaInfo kIsas[kNumHostIsas] = {
    {HostIsa::kGeneric, "generic"},
    {HostIsa::kAvx2, "avx2"},
    {HostIsa::kAvx512, "avx512"},
    {HostIsa::kAvx512Bf16, "avx512_bf16"},
    {HostIsa::kAmxBf16, "amx_bf16"},
};

#if defined(__x86_64__)
// AMX by CPUID (leaf 7: EDX bit 24 AMX-TILE, bit 22 AMX-BF16), not __builtin_cpu_supports, whose AMX names
// only newer compilers know.
bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) { return false; }
  return ((d >> 24) & 1u) != 0 && ((d >> 22) & 1u) != 0;
}

// The tile registers' state (8 KiB) is saved by the OS only where XCR0 enables it (bits 17, 18) and, on Linux,
// only for a process that asked for it (arch_prctl ARCH_REQ_XCOMP_PERM; without it the first tile instruction
// faults).  Asked once; a refusal (an old kernel, a hypervisor that hides the state) makes the level
// unsupported rather than a crash.
bool os_grants_amx_tiles() {
  static bool const granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || ((c >> 27) & 1u) == 0) { return false; }  // OSXSAVE: xgetbv exists
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) { return false; }
#if defined(__linux__)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return true;
#endif
  }();
  return granted;
}
#endif

constexpr char const* kNoTileState = "AMX tile state";

// The first CPU feature (as /proc/cpuinfo names it) that `isa` needs and the CPU lacks, else nullptr.
// __builtin_cpu_supports also checks that the OS saves the AVX / AVX-512 register state.
char const* missing_feature(HostIsa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  struct Need {
    HostIsa from;
    bool have;
    char const* flag;
  };
  Need const needs[] = {
      {HostIsa::kAvx2, __builtin_cpu_supports("avx2") != 0, "avx2"},
      {HostIsa::kAvx2, __builtin_cpu_supports("fma") != 0, "fma"},
      {HostIsa::kAvx2, __builtin_cpu_supports("f16c") != 0, "f16c"},
      {HostIsa::kAvx512, __builtin_cpu_supports("avx512f") != 0, "avx512f"},
      {HostIsa::kAvx512, __builtin_cpu_supports("avx512bw") != 0, "avx512bw"},
      {HostIsa::kAvx512, __builtin_cpu_supports("avx512dq") != 0, "avx512dq"},
      {HostIsa::kAvx512, __builtin_cpu_supports("avx512vl") != 0, "avx512vl"},
      {HostIsa::kAvx512Bf16, __builtin_cpu_supports("avx512bf16") != 0, "avx512_bf16"},
      {HostIsa::kAmxBf16, cpu_has_amx_bf16(), "amx_tile/amx_bf16"},
  };
  for (Need const& n : needs) {
    if (int(isa) >= int(n.from) && !n.have) { return n.flag; }
  }
  if (isa == HostIsa::kAmxBf16 && !os_grants_amx_tiles()) { return kNoTileState; }
  return nullptr;
#else
  return isa == HostIsa::kGeneric ? nullptr : "x86-64";
#endif
}

HostIsa best_supported() {
  static HostIsa const best = [] {
    HostIsa b = HostIsa::kGeneric;
    for (IsaInfo const& i : kIsas) {
      if (host_isa_compiled(i.isa) && host_isa_supported(i.isa)) { b = i.isa; }
    }
#if defined(__x86_64__)
    return host_isa_automatic_choice(b, cpu_has_amx_bf16());
#else
    return b;
#endif
  }();
  return best;
}

thread_local std::string t_reason;

// Validates a level name: on success stores the selection value (-1: automatic, else the level) and returns
// "", else returns why not.
char const* resolve(char const* name, int* value) {
  HostIsa isa;
  bool is_default;
  if (!host_isa_parse(name, &isa, &is_default)) {
    t_reason = std::string("unknown CPU instruction-set level '") + name +
               "' (choose generic, avx2, avx512, avx512_bf16, amx_bf16 or default)";
    return t_reason.c_str();
  }
  if (!is_default) {
    char const* why = host_isa_unavailable_reason(isa);
    if (*why != '\0') { return why; }
  }
  *value = is_default ? -1 : int(isa);
  t_reason.clear();
  return t_reason.c_str();
}

// The selection: -1 = automatic (the best).  The environment is read once, at the first use.
struct Selection {
  std::atomic<int> isa{-1};
  std::string env_error;            // why FLASH_EXT_CPU_ISA cannot be honoured; written once, at creation
  std::atomic<bool> env_bad{false};  // calls are refused with env_error until an override replaces it
};

Selection& selection() {
  static Selection* const s = [] {
    auto* sel = new Selection();
    char const* env = std::getenv("FLASH_EXT_CPU_ISA");
    if (env != nullptr && *env != '\0') {
      int value = -1;
      char const* why = resolve(env, &value);
      if (*why != '\0') {
        sel->env_error = why;
        sel->env_bad.store(true);
      } else {
        sel->isa.store(value);
      }
    }
    return sel;
  }();
  return *s;
}

}  // namespace

char const* host_isa_name(HostIsa isa) {
  for (IsaInfo const& i : kIsas) {
    if (i.isa == isa) { return i.name; }
  }
  return "?";
}

bool host_isa_parse(char const* name, HostIsa* out, bool* is_default) {
  *is_default = false;
  if (std::strcmp(name, "default") == 0) {
    *is_default = true;
    *out = HostIsa::kGeneric;
    return true;
  }
  if (std::strcmp(name, "avx512bf16") == 0) {
    *out = HostIsa::kAvx512Bf16;
    return true;
  }
  if (std::strcmp(name, "amxbf16") == 0) {
    *out = HostIsa::kAmxBf16;
    return true;
  }
  for (IsaInfo const& i : kIsas) {
    if (std::strcmp(name, i.name) == 0) {
      *out = i.isa;
      return true;
    }
  }
  return false;
}

bool host_isa_compiled(HostIsa isa) { return host_kernels_for(isa) != nullptr; }

bool host_isa_supported(HostIsa isa) { return missing_feature(isa) == nullptr; }

char const* host_isa_unavailable_reason(HostIsa isa) {
  if (!host_isa_compiled(isa)) {
    t_reason = std::string(host_isa_name(isa)) + " is not compiled into this build";
  } else if (char const* flag = missing_feature(isa); flag == kNoTileState) {
    t_reason = std::string("the OS does not grant this process the AMX tile state (needed by ") +
               host_isa_name(isa) + ")";
  } else if (flag != nullptr) {
    t_reason = std::string("this CPU lacks ") + flag + " (needed by " + host_isa_name(isa) + ")";
  } else {
    t_reason.clear();
  }
  return t_reason.c_str();
}

HostIsa host_isa_best() { return best_supported(); }

HostKernels const* host_kernels_for(HostIsa isa) {
  switch (isa) {
    case HostIsa::kGeneric: return host_kernels_generic();
#if defined(__x86_64__)
    case HostIsa::kAvx2: return host_kernels_avx2();
    case HostIsa::kAvx512: return host_kernels_avx512();
    case HostIsa::kAvx512Bf16: return host_kernels_avx512_bf16();
    case HostIsa::kAmxBf16: return host_kernels_amx_bf16();
#endif
    default: return nullptr;
  }
}

HostIsa host_isa_selected() {
  int const s = selection().isa.load(std::memory_order_relaxed);
  return s < 0 ? best_supported() : HostIsa(s);
}

bool host_isa_automatic() { return selection().isa.load(std::memory_order_relaxed) < 0; }

char const* host_isa_override(char const* name) {
  int value = -1;
  char const* why = resolve(name, &value);
  if (*why == '\0') {
    Selection& sel = selection();
    sel.isa.store(value, std::memory_order_relaxed);
    sel.env_bad.store(false);  // an explicit choice replaces an unusable environment setting
  }
  return why;
}

char const* host_isa_selection_error() {
  Selection& sel = selection();
  return sel.env_bad.load() ? sel.env_error.c_str() : "";
}

int64_t host_l2_bytes() {
  static int64_t const bytes = [] {
    long reported = -1;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    reported = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return reported > 0 ? int64_t(reported) : int64_t(1) << 20;
  }();
  return bytes;
}

HostCtaContext& host_cta_context() {
  thread_local HostCtaContext ctx;
  return ctx;
}

}  // namespace flash_ext
