// Dropout's random numbers and mask, without torch or a GPU:
//  1. Philox4x32-10 against the Random123 known-answer vectors (tests/kat_vectors of Random123).
//  2. The contract of dropout.h written out a second time here, from its text (group of (i, j), counter, key,
//     slot, 16-bit threshold), agrees with dropout_keep on random coordinates, seeds and offsets.
//  3. The kernels' tile masks (dropout_keep_bits, then apply_dropout_bits on a fragment of ones) equal the
//     contract element by element for every thread of every GPU tile config (Sm80 traits, run on the host:
//     the same partitions the GPU and the warp emulator use; their (slot, group) view follows the contract's
//     slot order) and for the host tiles with every CPU level's micro-kernels (vectors of group rows per
//     Philox call), including partly live tiles, at tile origins that are not at the sequence start.
//  4. The keep fraction is within a binomial tolerance of 1 - p, and the 16-bit threshold rounds as documented.
#include <cmath>
#include <cstdio>
#include <random>

#include "flash_ext/dispatch.h"
#include "flash_ext/dispatch_bwd.h"
#include "flash_ext/dropout.h"
#include "flash_ext/traits_host.h"
#include "flash_ext/launch_host.h"
#include "flash_ext/launch_host_bwd.h"
#include "flash_ext/traits_sm80.h"
#include "flash_ext/traits_sm80_bwd.h"
#include "host_levels.h"
#include "check.h"

using namespace cute;
using flash_ext::DropoutRng;


// 1. Random123 tests/kat_vectors, "philox4x32 10" lines: counter (4 words), key (2 words) -> output (4 words).
struct Kat {
  uint32_t ctr[4], key[2], out[4];
};
constexpr Kat kKat[] = {
    {{0x00000000u, 0x00000000u, 0x00000000u, 0x00000000u}, {0x00000000u, 0x00000000u},
     {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
    {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu},
     {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
    {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u},
     {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
};

void check_known_answers() {
  for (Kat const& k : kKat) {
    auto const r = flash_ext::philox4x32_10<uint32_t>(k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3], k.key[0], k.key[1]);
    for (int w = 0; w < 4; ++w) {
      CHECK(r.x[w] == k.out[w], "philox4x32_10(%08x ...) word %d = %08x, Random123 says %08x", k.ctr[0], w, r.x[w],
            k.out[w]);
    }
  }
}

// 2. The contract, restated from the text of dropout.h with its own arithmetic (no helper of dropout.h but
// the Philox function checked above).
bool contract_keep(uint64_t seed, uint64_t offset, double p, int b, int h, int num_heads, int i, int j) {
  int const grow = 8 * (i / 16) + i % 8;
  int const gcol = 4 * (j / 16) + (j % 8) / 2;
  int const s = j % 2 + 2 * ((i % 16) / 8) + 4 * ((j % 16) / 8);
  uint32_t const bh = uint32_t(uint64_t(b) * uint64_t(num_heads) + uint64_t(h));
  auto const x = flash_ext::philox4x32_10<uint32_t>(uint32_t(gcol), uint32_t(grow), bh, uint32_t(offset & 0xffffffffu),
                                                    uint32_t(seed & 0xffffffffu), uint32_t((seed >> 32) ^ (offset >> 32)));
  uint32_t const r = (x.x[s / 2] >> (16 * (s % 2))) & 0xffffu;
  double const t = std::floor((1.0 - p) * 65536.0 + 0.5);
  return double(r) < t;
}

uint32_t threshold_of(double p) { return uint32_t(std::floor((1.0 - p) * 65536.0 + 0.5)); }

DropoutRng make_rng(uint64_t seed, uint64_t offset, int b, int h, int num_heads, double p) {
  return DropoutRng::make({seed, offset}, b, h, num_heads, threshold_of(p));
}

void check_contract() {
  std::mt19937_64 rng(42);
  int mismatches = 0;
  for (int n = 0; n < 20000; ++n) {
    uint64_t const seed = rng(), offset = n % 3 == 0 ? rng() : rng() % 4096;
    double const p = (rng() % 1000) / 1000.0;
    int const num_heads = 1 + int(rng() % 64), h = int(rng() % num_heads), b = int(rng() % 100);
    int const i = int(rng() % 100000), j = int(rng() % 100000);
    bool const want = contract_keep(seed, offset, p, b, h, num_heads, i, j);
    if (flash_ext::dropout_keep(make_rng(seed, offset, b, h, num_heads, p), i, j) != want) { ++mismatches; }
  }
  CHECK(mismatches == 0, "dropout_keep disagrees with the contract's text on %d of 20000 random elements", mismatches);
  CHECK(threshold_of(0.0) == 65536 && threshold_of(0.5) == 32768 && threshold_of(0.1) == 58982 &&
            threshold_of(1.0 - 0.4 / 65536.0) == 0 && threshold_of(1.0 - 0.6 / 65536.0) == 1,
        "threshold = floor((1 - p) 65536 + 0.5)");
}

// 3. The tile mask == the per-element contract.  TiledMma: the MMA of the S = Q.K^T tile (the backward traits
// name it TiledMmaSdP).  live_rows: the rows the host micro-kernels evaluate (the launcher's live rows); the
// rest must come out dropped (bits 0) or untouched past the vector that holds the last live row.
template <class Traits, class TiledMma = typename Traits::TiledMma>
void check_tile_mask(char const* name, int live_rows = 1 << 30) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  TiledMma tiled_mma;
  using AccLayout = decltype(partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{}).layout());
  auto cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  std::mt19937_64 rng(7);
  int bad = 0, checked = 0;
  for (int trial = 0; trial < 3; ++trial) {
    uint64_t const seed = rng(), offset = rng();
    int const b = int(rng() % 7), h = int(rng() % 5), num_heads = 5;
    double const p = 0.1 + 0.3 * trial;
    DropoutRng const r = make_rng(seed, offset, b, h, num_heads, p);
    int const row0 = kBlockM * int(rng() % 40), col0 = kBlockN * int(rng() % 40);
    for (int t = 0; t < Traits::kNThreads; ++t) {
      auto tScS = tiled_mma.get_thread_slice(t).partition_C(cS);
      if constexpr (requires { Traits::dropout_groups(tScS.layout()); }) {
        // The GPU's (slot, group) view follows the contract's slot order: whole groups (8 slots from slot 0)
        // or half groups (4 slots from slot 0 or 4).
        auto gC = make_tensor(tScS.data(), Traits::dropout_groups(tScS.layout()));
        constexpr int kSlots = decltype(size<0>(gC))::value;
        static_assert(kSlots == 8 || kSlots == 4);
        for (int g = 0; g < size<1>(gC); ++g) {
          int const i0 = row0 + int(get<0>(gC(0, g))), j0 = col0 + int(get<1>(gC(0, g)));
          int const first = flash_ext::dropout_slot(i0, j0);
          if (first % kSlots != 0 || first + kSlots > 8) { ++bad; }
          // (R, c): the group's slot-0 element, whether or not this view holds it.
          int const R = i0 - flash_ext::dropout_slot_row(first), c = j0 - flash_ext::dropout_slot_col(first);
          for (int s = 0; s < kSlots; ++s) {
            int const i = row0 + int(get<0>(gC(s, g))), j = col0 + int(get<1>(gC(s, g)));
            if (i != R + flash_ext::dropout_slot_row(first + s) || j != c + flash_ext::dropout_slot_col(first + s) ||
                flash_ext::dropout_slot(i, j) != first + s) {
              ++bad;
            }
          }
        }
      }
      // The kernel's two steps on a fragment of ones: what survives is the keep decision.
      auto frag = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      fill(frag, 1.f);
      auto const bits = flash_ext::dropout_keep_bits<Traits, AccLayout>(tScS, r, row0, col0);
      flash_ext::apply_dropout_bits<Traits>(frag, bits);
      for (int e = 0; e < size(frag); ++e) {
        int const m = int(get<0>(tScS(e))), n = int(get<1>(tScS(e)));
        if (m >= live_rows) { continue; }  // never stored: whatever the kernel leaves there
        bool const want = contract_keep(seed, offset, p, b, h, num_heads, row0 + m, col0 + n);
        if (frag(e) != (want ? 1.f : 0.f)) { ++bad; }
        ++checked;
      }
    }
  }
  int const live = live_rows < kBlockM ? live_rows : kBlockM;
  CHECK(checked == 3 * live * kBlockN, "%s: %d elements checked, tile has %d", name, checked, live * kBlockN);
  CHECK(bad == 0, "%s: %d keep decisions disagree with the contract", name, bad);
  std::printf("%s %-52s %d elements\n", bad == 0 ? "ok" : "FAILED", name, checked);
}

// The host tiles, with each CPU level's micro-kernels (tests/cpp/host_levels.h), whole and partly live.
template <class Traits, class TiledMma = typename Traits::TiledMma>
void check_host_tile_masks(char const* tile) {
  for (flash_ext::HostKernels const* level : flash_ext::host_levels_to_test()) {
    for (int live : {Traits::kBlockM, 5}) {
      flash_ext::HostCtaScope scope(*level);
      scope.set_live_rows(live);
      char name[96];
      std::snprintf(name, sizeof(name), "Host %s, %s, %d live rows", tile, level->name, live);
      check_tile_mask<Traits, TiledMma>(name, live);
    }
  }
}

template <int kHeadDim>
void check_tile_masks() {
  constexpr int kDropoutVariant = flash_ext::select_variant(false, {false, false, false, false, false, false, true});
  constexpr auto tile = flash_ext::sm80_tile_config(kHeadDim, kDropoutVariant, /*causal=*/false);
  char name[64];
  std::snprintf(name, sizeof(name), "Sm80 hd%d %dx%d w%d", kHeadDim, tile.block_m, tile.block_n, tile.num_warps);
  check_tile_mask<flash_ext::Sm80Traits<kHeadDim, tile.block_m, tile.block_n, tile.num_warps, cutlass::half_t>>(name);
}

// The backward's S tile (dispatch_bwd.h's config: warps split the columns as well as the rows), and the host
// backward (the forward's host tile shapes).
template <int kHeadDim>
void check_bwd_tile_masks() {
  constexpr auto t = flash_ext::sm80_bwd_tile_config(kHeadDim);
  using Traits = flash_ext::Sm80BwdTraits<kHeadDim, t.block_m, t.block_n, t.num_warps, t.atom_m_sdp, t.atom_n_dkv,
                                          t.atom_m_dq, t.double_buffer_q, cutlass::half_t>;
  char name[80];
  std::snprintf(name, sizeof(name), "Sm80 bwd hd%d %dx%d w%d (%d warps on rows)", kHeadDim, t.block_m, t.block_n,
                t.num_warps, t.atom_m_sdp);
  check_tile_mask<Traits, typename Traits::TiledMmaSdP>(name);
}

// 4. Statistics: the keep fraction over a 512 x 512 block is within 5 binomial sigmas of t / 65536.
void check_keep_fraction() {
  for (double p : {0.1, 0.5, 0.9}) {
    DropoutRng const r = make_rng(0x1234567887654321ull, 4096, 3, 2, 8, p);
    int kept = 0, n = 0;
    for (int i = 0; i < 512; ++i) {
      for (int j = 0; j < 512; ++j, ++n) { kept += flash_ext::dropout_keep(r, i, j); }
    }
    double const q = threshold_of(p) / 65536.0, sigma = std::sqrt(n * q * (1 - q));
    CHECK(std::abs(kept - n * q) <= 5 * sigma, "p=%.1f: kept %d of %d, expected %.0f +- %.0f", p, kept, n, n * q, sigma);
  }
}

int main() {
  check_known_answers();
  check_contract();
  check_tile_masks<32>();
  check_tile_masks<64>();
  check_tile_masks<128>();
  check_tile_masks<192>();  // 128 x 32: the dropout kernel's own N at this head dim (dispatch.h)
  check_tile_masks<256>();
  check_host_tile_masks<flash_ext::HostTraits<64, 128, 64, float>>("128x64");
  check_host_tile_masks<flash_ext::HostTraits<64, 16, 64, float>>("16x64 (short queries)");
  check_bwd_tile_masks<32>();
  check_bwd_tile_masks<64>();
  check_bwd_tile_masks<96>();
  check_bwd_tile_masks<128>();
  check_bwd_tile_masks<192>();
  check_bwd_tile_masks<256>();
  using HostBwd = flash_ext::HostBwdTraits<64, flash_ext::kHostBwdBlockM, flash_ext::kHostBwdBlockN, float>;
  check_host_tile_masks<HostBwd, typename HostBwd::TiledMmaSdP>("bwd");
  check_keep_fraction();
  return check_summary();
}
