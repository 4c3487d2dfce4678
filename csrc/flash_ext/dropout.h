// Dropout on the attention probabilities: the mask as a pure function of coordinates, and its application to
// a tile of P in registers.
//
// THE MASK (the contract shared by the forward, the backward, every backend and the Python test reference).
// Inputs: the Philox seed and offset (64-bit; the op returns them as rng_state = (seed, offset)), the drop
// probability p, and the element's coordinates: batch entry b (for varlen batches: the sequence index), query
// head h (with GQA/MQA the query head, not the K/V head), query row i and key column j, both counted from 0
// within the sequence; H is the number of query heads.
//
//   group of (i, j): the 8 elements in rows {R, R + 8} x columns {c, c + 1, c + 8, c + 9}, where
//                    R = 16 * (i / 16) + i % 8 and c = 16 * (j / 16) + 2 * ((j % 8) / 2)   (integer division)
//   group ids:       grow = 8 * (i / 16) + i % 8,   gcol = 4 * (j / 16) + (j % 8) / 2
//   slot of (i, j):  s = j % 2 + 2 * ((i % 16) / 8) + 4 * ((j % 16) / 8)                       (0 <= s < 8)
//   (x0, x1, x2, x3) = Philox4x32-10(counter = (gcol, grow, (b * H + h) mod 2^32, offset mod 2^32),
//                                    key = (seed mod 2^32, (seed / 2^32) XOR (offset / 2^32)))
//   r(i, j) = (x[s / 2] >> (16 * (s % 2))) mod 2^16                                    (16 random bits)
//   keep(i, j) = r(i, j) < t,   t = floor((1 - p) * 65536 + 0.5) evaluated in double precision
//
// So P(keep) = t / 65536, within 2^-17 of 1 - p.  The output is O = (P o keep) V / (1 - p) with P the
// softmax of the undropped scores (the LSE is that of the undropped scores too).
//
// Why this grouping: one Philox call yields 128 bits = 8 x 16 bits, and in the sm_80 m16n8k16 accumulator a
// thread holds exactly rows {R, R + 8} x columns {c, c + 1} of each 16 x 8 atom, i.e. one whole group per
// pair of neighbouring atoms, in slot order (s = register index within the pair).  So the GPU makes one call
// per 8 elements and wastes none, while the mask itself depends only on coordinates: not on tile sizes,
// thread layout, split-KV, the backend or the order of evaluation.  16-bit thresholds keep the keep
// probability within 2^-17 of 1 - p (an 8-bit threshold would bias it by up to 2^-9).
// Separate calls never share a counter: the offset advances per call (CUDA) or the seed is redrawn (CPU).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "global_memory.h"
#include "params.h"
#include "philox.h"

namespace flash_ext {

struct PhiloxSeedOffset {
  uint64_t seed, offset;
};

// The (seed, offset) this launch uses (params.h: values, or read through pointers under graph capture or
// from an rng_state input), the pointers read through the memory policy Mem (global_memory.h).
template <class Mem = PlainGlobalMemory>
CUTE_HOST_DEVICE PhiloxSeedOffset dropout_seed_offset(FwdParams const& p) {
  uint64_t const seed = p.rng_seed_ptr ? uint64_t(Mem::load_global(p.rng_seed_ptr)) : p.rng_seed;
  uint64_t const offset = (p.rng_offset_ptr ? uint64_t(Mem::load_global(p.rng_offset_ptr)) : 0) + p.rng_offset;
  return {seed, offset};
}

// The per-(batch, head) constants of the mask: the key, the counter words that do not depend on (i, j),
// and the keep threshold.
struct DropoutRng {
  uint32_t key0 = 0, key1 = 0;  // (seed mod 2^32, (seed >> 32) ^ (offset >> 32))
  uint32_t bh = 0;              // counter word 2: b * H + h (mod 2^32)
  uint32_t offset_lo = 0;       // counter word 3: offset mod 2^32
  uint32_t threshold = 0;       // keep iff r < threshold

  CUTE_HOST_DEVICE static DropoutRng make(PhiloxSeedOffset so, int b, int h, int num_heads, uint32_t threshold) {
    DropoutRng r;
    r.key0 = uint32_t(so.seed);
    r.key1 = uint32_t(so.seed >> 32) ^ uint32_t(so.offset >> 32);
    r.bh = uint32_t(b) * uint32_t(num_heads) + uint32_t(h);
    r.offset_lo = uint32_t(so.offset);
    r.threshold = threshold;
    return r;
  }
};

// Group ids and slot of element (i, j); see the contract at the top.
CUTE_HOST_DEVICE constexpr uint32_t dropout_group_row(int i) { return uint32_t(8 * (i / 16) + i % 8); }
CUTE_HOST_DEVICE constexpr uint32_t dropout_group_col(int j) { return uint32_t(4 * (j / 16) + (j % 8) / 2); }
CUTE_HOST_DEVICE constexpr int dropout_slot(int i, int j) { return j % 2 + 2 * ((i % 16) / 8) + 4 * ((j % 16) / 8); }
// Coordinates of slot s relative to the group's slot-0 element (R, c).
CUTE_HOST_DEVICE constexpr int dropout_slot_row(int s) { return 8 * ((s / 2) % 2); }
CUTE_HOST_DEVICE constexpr int dropout_slot_col(int s) { return s % 2 + 8 * (s / 4); }

// The 16 random bits of slot s from the group's Philox output.
CUTE_HOST_DEVICE constexpr uint32_t dropout_slot_bits(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3, int s) {
  uint32_t const x = s / 2 == 0 ? x0 : s / 2 == 1 ? x1 : s / 2 == 2 ? x2 : x3;
  return (x >> (16 * (s % 2))) & 0xffffu;
}

// The contract evaluated for one element (one Philox call per element): the reference that the mask op and
// the tests use.  The kernels evaluate the same function one group at a time (dropout_keep_bits).
CUTE_HOST_DEVICE bool dropout_keep(DropoutRng const& rng, int i, int j) {
  Philox4<uint32_t> const r = philox4x32_10<uint32_t>(dropout_group_col(j), dropout_group_row(i), rng.bh,
                                                      rng.offset_lo, rng.key0, rng.key1);
  return dropout_slot_bits(r.x[0], r.x[1], r.x[2], r.x[3], dropout_slot(i, j)) < rng.threshold;
}

// ---------------------------------------------------------------------------------------------------
// The mask of one tile in the kernel, in two steps: dropout_keep_bits packs the outcome into one bit per
// element and apply_dropout_bits zeroes the dropped probabilities after the softmax.  The kernels call the
// first after their GEMMs, not beside them: overlapping its integer work with the tensor cores kept the
// Philox state live next to the GEMM fragments, and the sm_90 dropout kernels spilled (kernel_fwd.h).  The
// 1 / (1 - p) scale is applied once, to O, in the softmax's finalize.
//
// GPU traits: Traits::dropout_groups views a thread's accumulator fragment (MMA, MMA_M, MMA_N) as (SLOT,
// GROUP) with the slots in the contract's order: 8 per whole group, or 4 per half group where a thread holds
// only half of each (traits_sm80_common.h).  Slot 0's coordinate anchors the group (its contract slot is 0 or
// 4), one Philox call per view group, and bit kSlots g + s is slot s of group g (tests/cpp/test_dropout.cpp
// checks the view against the contract for every thread of every tile config).
// Host traits: the whole tile is one thread's fragment, and both steps are the CPU level's micro-kernels
// (Traits::dropout_keep_tile / dropout_apply_tile, host_isa.h), which evaluate the contract a vector of group
// rows per Philox call and keep the bits in the accumulator's element order.  The test checks both the same
// way: bits applied to a fragment of ones, element by element against the contract.
// AccLayout: the (static) layout of the accumulator fragment the bits are for.
template <class Traits, class AccLayout>
struct DropoutBits {
  static constexpr int kElems = decltype(cute::size(AccLayout{}))::value;
  static constexpr int kWords = (kElems + 31) / 32;
  uint32_t word[kWords];  // one bit per element of the fragment, in the traits' order (above)
};

// coord: the thread's partition of an identity tensor over the tile, shaped like the accumulator fragment;
// row0/col0: the tile's first query row and key column within the sequence (multiples of 16, so no group
// straddles two tiles).
//
// kOneGroupAtATime: a rolled loop over the groups, so that one Philox state is live at a time instead of
// every group's (the unrolled loop lets the compiler interleave them).  The sm_90 backward's dropout kernel
// needs it to fit 255 registers; it requires a thread's bits to fit one word (the GPU tiles).
template <class Traits, class AccLayout, bool kOneGroupAtATime = false, class Coord>
CUTE_HOST_DEVICE DropoutBits<Traits, AccLayout> dropout_keep_bits(Coord const& coord, DropoutRng const& rng, int row0,
                                                                 int col0) {
  using namespace cute;
  static_assert(Traits::kBlockM % 16 == 0 && Traits::kBlockN % 16 == 0, "tiles hold whole 16 x 16 blocks");
  using Bits = DropoutBits<Traits, AccLayout>;
  Bits bits;
  if constexpr (requires { Traits::template dropout_keep_tile<AccLayout>(bits.word, rng, row0, col0); }) {
    Traits::template dropout_keep_tile<AccLayout>(bits.word, rng, row0, col0);
  } else {
    Tensor gC = make_tensor(coord.data(), Traits::dropout_groups(coord.layout()));  // (SLOT,GROUP) -> (m,n)
    // kSlots = 8: whole groups; 4: half groups (rows {R, R + 8} x columns {c, c + 1} or {c + 8, c + 9}), whose
    // contract slots are 0-3 or 4-7 by the column.
    constexpr int kSlots = decltype(size<0>(gC))::value;
    constexpr int kGroups = decltype(size<1>(gC))::value;
    static_assert((kSlots == 8 || kSlots == 4) && kGroups * kSlots == Bits::kElems);
    CUTE_UNROLL
    for (int w = 0; w < Bits::kWords; ++w) { bits.word[w] = 0; }
    auto group = [&](int g) {
      int const i = row0 + int(get<0>(gC(0, g))), j = col0 + int(get<1>(gC(0, g)));
      Philox4<uint32_t> const r = philox4x32_10<uint32_t>(dropout_group_col(j), dropout_group_row(i), rng.bh,
                                                          rng.offset_lo, rng.key0, rng.key1);
      int const first = kSlots == 8 ? 0 : dropout_slot(i, j);  // a half group's first slot: 0 or 4
      uint32_t byte = 0;
      CUTE_UNROLL
      for (int s = 0; s < kSlots; ++s) {
        byte |= uint32_t(dropout_slot_bits(r.x[0], r.x[1], r.x[2], r.x[3], first + s) < rng.threshold) << s;
      }
      int const bit = kSlots * g;
      bits.word[kOneGroupAtATime ? 0 : bit / 32] |= byte << (bit % 32);
    };
    if constexpr (kOneGroupAtATime) {
      static_assert(Bits::kWords == 1, "a rolled loop indexes the words at run time: one word stays in a register");
#pragma unroll 1
      for (int g = 0; g < kGroups; ++g) { group(g); }
    } else {
      CUTE_UNROLL
      for (int g = 0; g < kGroups; ++g) { group(g); }
    }
  }
  return bits;
}

// acc: the accumulator fragment the bits were made for, holding P.  Dropped elements become 0.
template <class Traits, class Acc, class Bits>
CUTE_HOST_DEVICE void apply_dropout_bits(Acc& acc, Bits const& bits) {
  using namespace cute;
  if constexpr (requires { Traits::dropout_apply_tile(acc, bits.word); }) {
    Traits::dropout_apply_tile(acc, bits.word);
  } else {
    Tensor gP = make_tensor(acc.data(), Traits::dropout_groups(acc.layout()));  // (SLOT,GROUP)
    constexpr int kSlots = decltype(size<0>(gP))::value;
    CUTE_UNROLL
    for (int g = 0; g < size<1>(gP); ++g) {
      CUTE_UNROLL
      for (int s = 0; s < kSlots; ++s) {
        bool const keep = (bits.word[(kSlots * g + s) / 32] >> ((kSlots * g + s) % 32)) & 1u;
        gP(s, g) = keep ? gP(s, g) : 0.f;  // a select: the outcome is random, a branch would mispredict
      }
    }
  }
}

}  // namespace flash_ext
