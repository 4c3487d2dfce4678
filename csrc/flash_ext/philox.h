// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
// counter-based generator behind dropout.  It maps a 128-bit counter and a 64-bit key to 128 random bits
// with no state: any element's random bits can be computed by whoever needs them (forward, backward, CPU,
// GPU, warp emulator, a Python reference) in any order, which is what lets the dropout mask be a pure
// function of coordinates.  The algorithm and its constants are the published ones; the Random123
// known-answer vectors are checked in tests/cpp/test_dropout.cpp.
//
// One round on counter (c0, c1, c2, c3) with key (k0, k1), all 32-bit:
//     (hi0, lo0) = M0 * c0 as 64 bits,  (hi1, lo1) = M1 * c2 as 64 bits
//     counter <- (hi1 ^ c1 ^ k0,  lo1,  hi0 ^ c3 ^ k1,  lo0)
// Ten rounds; the key is bumped by (W0, W1) (mod 2^32) before every round but the first.
//
// The round is written once, over a word type `Word`: uint32_t (the GPU, the emulator, the scalar reference)
// or a vector of lanes that holds several independent counters (the CPU micro-kernels, csrc/host/isa/kernels.h,
// which evaluate a vector of groups per instruction).  A Word needs `^`, `+ uint32_t` (the low 32 bits of each lane must behave as
// uint32_t arithmetic; higher bits, if a lane has them, are don't-care) and an overload of
// philox_mul_hi_lo(uint32_t m, Word x, Word& hi) -> lo giving the two halves of the 64-bit product m * x.
#pragma once

#include <cstdint>

#include <cute/config.hpp>

namespace flash_ext {

inline constexpr uint32_t kPhiloxM0 = 0xD2511F53u;  // round multipliers
inline constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
inline constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // key bumps (golden ratio, sqrt(3) - 1)
inline constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
inline constexpr int kPhiloxRounds = 10;

// The 32x32 -> 64-bit product: one IMAD.WIDE.U32 on the GPU, one MUL on x86-64.
CUTE_HOST_DEVICE constexpr uint32_t philox_mul_hi_lo(uint32_t m, uint32_t x, uint32_t& hi) {
  uint64_t const p = uint64_t(m) * uint64_t(x);
  hi = uint32_t(p >> 32);
  return uint32_t(p);
}

template <class Word>
struct Philox4 {
  Word x[4];
};

template <class Word>
CUTE_HOST_DEVICE constexpr Philox4<Word> philox4x32_10(Word c0, Word c1, Word c2, Word c3, Word k0, Word k1) {
  CUTE_UNROLL
  for (int round = 0; round < kPhiloxRounds; ++round) {
    if (round > 0) {
      k0 = k0 + kPhiloxW0;
      k1 = k1 + kPhiloxW1;
    }
    Word hi0, hi1;
    Word const lo0 = philox_mul_hi_lo(kPhiloxM0, c0, hi0);
    Word const lo1 = philox_mul_hi_lo(kPhiloxM1, c2, hi1);
    Word const n0 = hi1 ^ c1 ^ k0;
    Word const n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return {{c0, c1, c2, c3}};
}

}  // namespace flash_ext
