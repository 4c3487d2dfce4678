// The warp emulator's own tests, without torch and without the attention kernel:
//  1. instruction semantics (csrc/emu/ptx.cpp) against values fixed by the IEEE formats and the PTX ISA;
//  2. ldmatrix (plain and .trans) composed with mma.m16n8k16 through emulated warps gives the matrix
//     product: the two instructions' fragment tables were written separately, from the PTX text, and only
//     agree if both are right;
//  3. every check fires on a small kernel that has exactly that bug, and stays silent on the fixed kernel.
// Built twice by CMake: with the x86-64 fiber switch and with the ucontext fallback.
#undef NDEBUG
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "emu/ptx.h"
#include "emu/runtime.h"
#include "check.h"

using namespace flash_ext::emu;


// ---------------------------------------------------------------------------------------------------
// 1. Conversions

void test_conversions() {
  using namespace ptx;
  struct F16Case {
    float x;
    uint16_t bits;
  };
  F16Case const f16[] = {
      {1.f, 0x3c00}, {-2.f, 0xc000}, {65504.f, 0x7bff},               // largest finite
      {65519.f, 0x7bff}, {65520.f, 0x7c00},                          // below / at the tie with infinity
      {1e9f, 0x7c00}, {-INFINITY, 0xfc00},
      {std::ldexp(1.f, -24), 0x0001},                                 // smallest subnormal
      {std::ldexp(1.f, -25), 0x0000},                                 // tie between 0 and 2^-24: to even (0)
      {std::ldexp(3.f, -25), 0x0002},                                 // 1.5 x 2^-24: tie, to even (2)
      {std::ldexp(1.f, -14), 0x0400},                                 // smallest normal
      {1.f + std::ldexp(1.f, -11), 0x3c00},                           // tie at 1: to even (1.0)
      {1.f + 3 * std::ldexp(1.f, -11), 0x3c02},                       // tie at 1 + 2^-10: to even (1 + 2^-9)
      {0.1f, 0x2e66},
  };
  for (auto const& c : f16) {
    uint16_t const got = float_to_f16_rn(c.x);
    CHECK(got == c.bits, "f16(%g) = 0x%04x, expected 0x%04x", double(c.x), got, c.bits);
    if (c.bits != 0x7c00 && c.bits != 0xfc00 && std::fabs(c.x) < 65505.f && c.bits != 0x0000) {
      float const back = f16_to_float(c.bits);
      CHECK(std::fabs(back - c.x) <= std::fabs(c.x) * 1e-3f + 1e-7f, "f16 0x%04x -> %g, expected about %g", c.bits,
            double(back), double(c.x));
    }
  }
  CHECK(std::isnan(f16_to_float(float_to_f16_rn(NAN))), "f16 NaN");
  CHECK(f16_to_float(0x0001) == std::ldexp(1.f, -24), "f16 subnormal decode");
  struct BfCase {
    float x;
    uint16_t bits;
  };
  BfCase const bf[] = {
      {1.f, 0x3f80}, {-1.5f, 0xbfc0},
      {1.f + std::ldexp(1.f, -8), 0x3f80},      // tie: to even
      {1.f + 3 * std::ldexp(1.f, -8), 0x3f82},  // tie: to even (up)
      {3.3895314e38f, 0x7f7f},                  // largest finite bf16
      {3.4e38f, 0x7f80},                        // rounds past it: infinity
      {0.1f, 0x3dcd},
  };
  for (auto const& c : bf) {
    uint16_t const got = float_to_bf16_rn(c.x);
    CHECK(got == c.bits, "bf16(%g) = 0x%04x, expected 0x%04x", double(c.x), got, c.bits);
  }
  CHECK(std::isnan(bf16_to_float(float_to_bf16_rn(NAN))), "bf16 NaN");
  // Every f16 bit pattern survives decode + encode (except NaN payloads).
  int bad = 0;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float const f = f16_to_float(uint16_t(h));
    if (!std::isnan(f) && float_to_f16_rn(f) != h) { ++bad; }
  }
  CHECK(bad == 0, "%d f16 patterns do not round-trip", bad);
}

// ---------------------------------------------------------------------------------------------------
// Test harness for small emulated kernels.

struct Harness {
  KernelDesc kernel;
  Report report;
  std::function<void(int, char*)> body;
  std::vector<char> global;  // registered as a read/write global tensor

  explicit Harness(int threads = 64, int smem = 4096, size_t global_bytes = 4096) : global(global_bytes + 16) {
    kernel.name = "test kernel";
    kernel.threads = threads;
    kernel.smem_bytes = smem;
    kernel.regions = {{0u, "smem"}};
    auto const base = (reinterpret_cast<uintptr_t>(global.data()) + 15) & ~uintptr_t(15);
    kernel.globals = {{base, base + global_bytes, true, "g"}};
  }
  char* g() { return reinterpret_cast<char*>(kernel.globals[0].begin); }
  Report const& run() {
    CtaCoord coord;
    coord.work = "test";
    run_cta(kernel, coord, [](void const* ctx, int tid, char* smem) {
      (*static_cast<std::function<void(int, char*)> const*>(ctx))(tid, smem);
    }, &body, report);
    return report;
  }
};

uint64_t count(Report const& r, Check c) { return r.counts[int(c)]; }

std::string dump(Report const& r) { return r.text(); }

Site here(std::source_location s = std::source_location::current()) { return s; }

// ---------------------------------------------------------------------------------------------------
// 2. ldmatrix + mma = matrix product

template <bool kTransB>
void test_ldmatrix_mma(ptx::Type16 type) {
  // A 16x16 row-major at smem 0; B as 16 columns (two n8 blocks): for the plain load stored as B^T (n rows of
  // 16 k values, row-major at 512), for .trans stored as B (k rows of 16 n values, at 512).
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-8, 8);
  uint16_t A[16][16], B[16][16];  // B[k][n]
  for (auto& r : A) for (auto& x : r) x = ptx::from_float_rn(type, float(small(rng)) / 4);
  for (auto& r : B) for (auto& x : r) x = ptx::from_float_rn(type, float(small(rng)) / 8);
  float C[16][16];
  for (auto& r : C) for (auto& x : r) x = float(small(rng));
  Harness h(32, 1024);
  float D[16][16] = {};
  h.body = [&](int lane, char* smem) {
    auto* s = reinterpret_cast<uint16_t*>(smem);
    if (lane == 0) {  // one thread fills shared memory with plain stores
      for (int i = 0; i < 256; ++i) { clear_store(s + i, 2); }
      for (int i = 0; i < 256; ++i) { clear_store(s + 256 + i, 2); }
      std::memcpy(s, A, 512);
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < 16; ++n) s[256 + (kTransB ? k * 16 + n : n * 16 + k)] = B[k][n];
    }
    clear_done(here());
    barrier(here());
    // A: lane -> row lane % 16, column block lane / 16 (matrices: rows 0-7/8-15 x columns 0-7/8-15).
    uint32_t a[4], b[4];
    ldmatrix_x4(false, s + (lane % 16) * 16 + (lane / 16) * 8, a[0], a[1], a[2], a[3]);
    int const mat = lane / 8, r = lane % 8;
    if (!kTransB) {  // B^T rows are n: matrices (n0-7, k0-7), (n0-7, k8-15), (n8-15, k0-7), (n8-15, k8-15)
      ldmatrix_x4(false, s + 256 + (r + 8 * (mat / 2)) * 16 + 8 * (mat % 2), b[0], b[1], b[2], b[3]);
    } else {  // B rows are k: matrices (k0-7, n0-7), (k8-15, n0-7), (k0-7, n8-15), (k8-15, n8-15)
      ldmatrix_x4(true, s + 256 + (r + 8 * (mat % 2)) * 16 + 8 * (mat / 2), b[0], b[1], b[2], b[3]);
    }
    int const g = lane / 4, t = lane % 4;
    for (int nb = 0; nb < 2; ++nb) {
      ptx::MmaLane in{{a[0], a[1], a[2], a[3]}, {b[2 * nb], b[2 * nb + 1]}, {}};
      float d[4];
      for (int i = 0; i < 4; ++i) in.c[i] = C[i < 2 ? g : g + 8][8 * nb + 2 * t + (i & 1)];
      mma_m16n8k16(type, in, d[0], d[1], d[2], d[3]);
      for (int i = 0; i < 4; ++i) D[i < 2 ? g : g + 8][8 * nb + 2 * t + (i & 1)] = d[i];
    }
  };
  Report const& r = h.run();
  // Unswizzled 32-byte rows: the 8 rows of each ldmatrix phase span 256 bytes, two wavefronts instead of
  // one, in each of the 4 phases of both loads; nothing else may be reported.
  CHECK(r.total() == 8 && count(r, Check::kBankConflict) == 8 && r.stats.extra_wavefronts == 8,
        "ldmatrix+mma kernel: expected exactly the 8 two-way bank conflicts of its layout: %s", dump(r).c_str());
  double max_err = 0;
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      double ref = C[m][n];
      for (int k = 0; k < 16; ++k) ref += double(ptx::to_float(type, A[m][k])) * double(ptx::to_float(type, B[k][n]));
      max_err = std::max(max_err, std::abs(ref - D[m][n]));
    }
  // Small integers / 32: every product and sum is exact in fp32.
  CHECK(max_err == 0, "ldmatrix%s + mma (%s) differs from A.B + C by %g", kTransB ? ".trans" : "",
        type == ptx::Type16::kF16 ? "f16" : "bf16", max_err);
  CHECK(r.stats.ldmatrix == 2 && r.stats.mma == 2, "executed %llu ldmatrix, %llu mma", (unsigned long long)r.stats.ldmatrix,
        (unsigned long long)r.stats.mma);
}

void test_shfl() {
  Harness h(32, 128);
  float got[32][2];
  h.body = [&](int lane, char*) {
    got[lane][0] = shfl_bfly(float(lane), 1, here());
    got[lane][1] = shfl_bfly(float(lane * 10), lane % 2 ? 2 : 16, here());  // per-lane masks
  };
  Report const& r = h.run();
  bool ok = r.total() == 0;
  for (int l = 0; l < 32; ++l) {
    ok = ok && got[l][0] == float(l ^ 1) && got[l][1] == float(10 * (l ^ (l % 2 ? 2 : 16)));
  }
  CHECK(ok, "shfl.bfly results wrong or findings: %s", dump(r).c_str());
}

// ---------------------------------------------------------------------------------------------------
// 3. Each check on a kernel with exactly that bug.

// Thread 0 stores 16 bytes, thread 40 (another warp) loads them.
void test_race(bool with_barrier) {
  Harness h(64, 256);
  alignas(16) char loaded[16] = {};
  h.body = [&](int tid, char* smem) {
    alignas(16) char regs[16];
    if (tid == 0) {
      std::memset(regs, 7, 16);
      vector_move(regs, smem + 32, 16);
    }
    if (with_barrier) { barrier(here()); }
    if (tid == 40) {
      vector_move(smem + 32, regs, 16);
      std::memcpy(loaded, regs, 16);
    }
  };
  Report const& r = h.run();
  if (with_barrier) {
    CHECK(r.total() == 0 && loaded[5] == 7, "store, barrier, load: %s", dump(r).c_str());
  } else {
    CHECK(count(r, Check::kRace) == 1 && r.total() == 1, "store and load in one epoch: %s", dump(r).c_str());
  }
}

// A write after other threads' reads in the same epoch (the "sV free" hazard).
void test_write_after_read() {
  Harness h(64, 256);
  h.body = [&](int tid, char* smem) {
    alignas(16) char regs[16] = {};
    if (tid == 0) { vector_move(regs, smem, 16); }
    barrier(here());
    vector_move(smem, regs, 16);                  // everybody reads bytes 0..15
    if (tid == 63) { vector_move(regs, smem, 16); }              // and thread 63 overwrites them
  };
  Report const& r = h.run();
  CHECK(count(r, Check::kRace) >= 1, "write after read in one epoch not reported: %s", dump(r).c_str());
}

enum class CopyBug { kNone, kNoWait, kNoBarrier, kNeverWaited, kBadSource, kMisaligned };

void test_cp_async(CopyBug bug) {
  Harness h(64, 2048);
  int mismatches = 0;
  for (int i = 0; i < 1024; ++i) h.g()[i] = char(i * 7);
  h.body = [&](int tid, char* smem) {
    char const* src = bug == CopyBug::kBadSource ? reinterpret_cast<char const*>(&mismatches) : h.g() + 16 * tid;
    char* dst = smem + 16 * tid + (bug == CopyBug::kMisaligned ? 8 : 0);
    cp_async_16(src, dst);
    cp_async_commit(here());
    if (bug == CopyBug::kNeverWaited) { return; }
    if (bug != CopyBug::kNoWait) { cp_async_wait(0, here()); }
    if (bug != CopyBug::kNoBarrier) { barrier(here()); }
    int const other = (tid + 1) % 64;  // read the neighbour's copy
    alignas(16) char regs[16];
    vector_move(smem + 16 * other, regs, 16);
    if (bug == CopyBug::kNone && std::memcmp(regs, h.g() + 16 * other, 16) != 0) { ++mismatches; }
    if (bug == CopyBug::kNoWait) { cp_async_wait(0, here()); }
  };
  Report const& r = h.run();
  switch (bug) {
    case CopyBug::kNone: CHECK(r.total() == 0 && mismatches == 0, "cp.async, wait, barrier: %s", dump(r).c_str()); break;
    case CopyBug::kNoWait:
      CHECK(count(r, Check::kUnlandedRead) > 0, "read before the wait not reported: %s", dump(r).c_str());
      break;
    case CopyBug::kNoBarrier:
      CHECK(count(r, Check::kRace) + count(r, Check::kUnlandedRead) > 0 && count(r, Check::kRace) > 0,
            "wait without barrier not reported: %s", dump(r).c_str());
      break;
    case CopyBug::kNeverWaited:
      CHECK(count(r, Check::kInFlightAtExit) == 64, "copies in flight at exit: %s", dump(r).c_str());
      break;
    case CopyBug::kBadSource:
      CHECK(count(r, Check::kBadAddress) == 64, "cp.async from outside the tensors: %s", dump(r).c_str());
      break;
    case CopyBug::kMisaligned:
      CHECK(count(r, Check::kBadAddress) == 64, "cp.async to a misaligned address: %s", dump(r).c_str());
      break;
  }
}

void test_exit_at_barrier() {
  Harness h(64, 128);
  h.body = [&](int tid, char*) {
    if (tid == 5) { return; }
    barrier(here());
  };
  Report const& r = h.run();
  CHECK(count(r, Check::kExitAtBarrier) == 1, "exit while others wait at a barrier: %s", dump(r).c_str());
}

void test_divergence() {
  Harness h(64, 128);
  h.body = [&](int tid, char*) {
    if (tid % 32 < 16) {
      shfl_bfly(1.f, 1, here());
    } else {
      barrier(here());
    }
  };
  Report const& r = h.run();
  CHECK(count(r, Check::kDivergence) == 1, "lanes at a shuffle and at the barrier: %s", dump(r).c_str());
  Harness h2(32, 128);
  h2.body = [&](int tid, char*) {
    if (tid == 3) { return; }
    shfl_bfly(1.f, 1, here());
  };
  Report const& r2 = h2.run();
  CHECK(count(r2, Check::kDivergence) == 1, "a shuffle an exited lane never joins: %s", dump(r2).c_str());
}

// ldmatrix.x2 feeds one n8 B operand: lanes 0-15 address B^T's 8 rows (k 0-7, then k 8-15); the addresses
// of lanes 16-31 are not used by the instruction, so a wild one there must be neither read nor reported.
void test_ldmatrix_x2_mma(ptx::Type16 type) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> small(-8, 8);
  uint16_t A[16][16], Bt[8][16];  // Bt[n][k]
  for (auto& r : A) for (auto& x : r) x = ptx::from_float_rn(type, float(small(rng)) / 4);
  for (auto& r : Bt) for (auto& x : r) x = ptx::from_float_rn(type, float(small(rng)) / 8);
  Harness h(32, 1024);
  float D[16][8] = {};
  h.body = [&](int lane, char* smem) {
    auto* s = reinterpret_cast<uint16_t*>(smem);
    if (lane == 0) {
      for (int i = 0; i < 256 + 128; ++i) { clear_store(s + i, 2); }
      std::memcpy(s, A, 512);
      std::memcpy(s + 256, Bt, 256);
    }
    clear_done(here());
    barrier(here());
    uint32_t a[4], b[2];
    ldmatrix_x4(false, s + (lane % 16) * 16 + (lane / 16) * 8, a[0], a[1], a[2], a[3]);
    char const* wild = smem + 4096 + 3;  // outside shared memory and misaligned
    ldmatrix_x2(lane < 16 ? static_cast<void const*>(s + 256 + (lane % 8) * 16 + 8 * (lane / 8)) : wild, b[0], b[1]);
    ptx::MmaLane in{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}, {}};
    float d[4];
    mma_m16n8k16(type, in, d[0], d[1], d[2], d[3]);
    int const g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) D[i < 2 ? g : g + 8][2 * t + (i & 1)] = d[i];
  };
  Report const& r = h.run();
  // 32-byte rows: two wavefronts in each of A's 4 phases and B's 2; nothing from lanes 16-31 of the .x2.
  CHECK(r.total() == 6 && count(r, Check::kBankConflict) == 6 && r.stats.extra_wavefronts == 6,
        "ldmatrix.x2 kernel: expected exactly the 6 two-way bank conflicts of its layout: %s", dump(r).c_str());
  double max_err = 0;
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double ref = 0;
      for (int k = 0; k < 16; ++k) ref += double(ptx::to_float(type, A[m][k])) * double(ptx::to_float(type, Bt[n][k]));
      max_err = std::max(max_err, std::abs(ref - D[m][n]));
    }
  CHECK(max_err == 0, "ldmatrix.x2 + mma (%s) differs from A.B by %g", type == ptx::Type16::kF16 ? "f16" : "bf16",
        max_err);
}

// ldmatrix rows `stride` bytes apart: 16 (consecutive) is conflict-free, 128 puts all 8 rows of a phase
// on the same four banks: 8 wavefronts per phase instead of 1.
void test_banks(int stride, bool global_store_check) {
  Harness h(32, 8192);
  h.body = [&](int lane, char* smem) {
    for (int i = 0; i < 8192 / 32; i += 2) { clear_store(smem + lane * (8192 / 32) + i, 2); }
    clear_done(here());
    barrier(here());
    uint32_t d[4];
    ldmatrix_x4(false, smem + lane * stride, d[0], d[1], d[2], d[3]);
    if (global_store_check) {  // a vector store into global memory must be inside a tensor and aligned
      alignas(16) char regs[16] = {};
      vector_move(regs, h.g() + 16 * lane + (lane == 31 ? 8 : 0), 16);
    }
  };
  Report const& r = h.run();
  if (stride == 16) {
    CHECK(count(r, Check::kBankConflict) == 0 && r.stats.extra_wavefronts == 0, "stride 16: %s", dump(r).c_str());
  } else {
    CHECK(count(r, Check::kBankConflict) == 4 && r.stats.extra_wavefronts == 4 * 7, "stride %d: %s", stride,
          dump(r).c_str());
  }
  if (global_store_check) { CHECK(count(r, Check::kBadAddress) == 1, "misaligned global store: %s", dump(r).c_str()); }
}

void test_ldmatrix_address() {
  Harness h(32, 1024);
  h.body = [&](int lane, char* smem) {
    for (int i = 0; i < 32; i += 2) { clear_store(smem + lane * 32 + i, 2); }
    clear_done(here());
    barrier(here());
    uint32_t d[4];
    ldmatrix_x4(false, smem + (lane == 9 ? 1016 : lane * 16 + (lane == 3 ? 4 : 0)), d[0], d[1], d[2], d[3]);
  };
  Report const& r = h.run();
  CHECK(count(r, Check::kBadAddress) == 2, "misaligned and out-of-range ldmatrix rows: %s", dump(r).c_str());
}

void test_unwritten_read() {
  Harness h(32, 256);
  h.body = [&](int lane, char* smem) {
    uint32_t d[4];
    ldmatrix_x4(false, smem + lane % 16 * 16, d[0], d[1], d[2], d[3]);
  };
  Report const& r = h.run();
  CHECK(count(r, Check::kUnlandedRead) == 32, "ldmatrix of never-written shared memory: %s", dump(r).c_str());
}

void test_red_add() {
  Harness h(64, 128);
  h.body = [&](int tid, char*) { red_add_f32(reinterpret_cast<float*>(h.g()) + tid % 4, 1.f, here()); };
  std::memset(h.g(), 0, 16);
  Report const& r = h.run();
  float sum[4];
  std::memcpy(sum, h.g(), 16);
  CHECK(r.total() == 0 && sum[0] == 16.f && sum[3] == 16.f && r.stats.red_global == 64, "red.add: %s", dump(r).c_str());
}

int main() {
  test_conversions();
  test_ldmatrix_mma<false>(ptx::Type16::kF16);
  test_ldmatrix_mma<true>(ptx::Type16::kF16);
  test_ldmatrix_mma<false>(ptx::Type16::kBF16);
  test_ldmatrix_mma<true>(ptx::Type16::kBF16);
  test_ldmatrix_x2_mma(ptx::Type16::kF16);
  test_ldmatrix_x2_mma(ptx::Type16::kBF16);
  test_shfl();
  test_race(true);
  test_race(false);
  test_write_after_read();
  for (CopyBug b : {CopyBug::kNone, CopyBug::kNoWait, CopyBug::kNoBarrier, CopyBug::kNeverWaited, CopyBug::kBadSource,
                    CopyBug::kMisaligned}) {
    test_cp_async(b);
  }
  test_exit_at_barrier();
  test_divergence();
  test_banks(16, false);
  test_banks(128, true);
  test_ldmatrix_address();
  test_unwritten_read();
  test_red_add();
  return check_summary();
}
