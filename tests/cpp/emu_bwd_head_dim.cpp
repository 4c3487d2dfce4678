// The Sm80 backward of one head dim (FLASH_EXT_EMU_BWD_HD, one object per head dim: CMakeLists.txt) on the
// warp emulator, for test_emu_bwd_heads: every static variant the dispatcher has (even, general causal and
// not, dropout) with both dtypes, and the deterministic dQ order with several dQ slices.  Each run must be
// clean (zero findings) and within the GPU path's tolerance of the float64 gradient (emu_bwd_case.h).
// test_emu_bwd.cpp holds head dim 64 (every variant), one head-dim-256 case and the injected faults; this covers
// the other tile configs and head dim 256's other variants (its S/dP steps of 8 columns give dropout half groups).
#undef NDEBUG
#include <string>

#include "emu_bwd_case.h"

#ifndef FLASH_EXT_EMU_BWD_HD
#error "compile with -DFLASH_EXT_EMU_BWD_HD=<head dim>"
#endif

namespace emu_bwd_test {
namespace {

int cases() {
  constexpr int kHd = FLASH_EXT_EMU_BWD_HD;
  using Fp16 = EmuBwd<kHd, cutlass::half_t>::Traits;
  using Bf16 = EmuBwd<kHd, cutlass::bfloat16_t>::Traits;
  constexpr int kM = Fp16::kBlockM, kN = Fp16::kBlockN;
  static_assert(Bf16::kBlockM == kM && Bf16::kBlockN == kN);
  std::string const tag = "d" + std::to_string(kHd) + " (" + std::to_string(kM) + "x" + std::to_string(kN) + " tile) ";
  auto label = [&](char const* what) { return tag + what; };
  using bwd_test::Case;
  // Whole tiles, no mask: the "even" variant.
  Case const even{1, 2 * kM, 2 * kN, 2, 2, kHd, false, -1, -1, 0.f, false};
  // GQA 4:2, two sequences, neither seqlen a tile multiple, d 8 short of the tile (columns predicated off).
  Case const gqa_causal{2, kM + 13, kN + 3, 4, 2, kHd - 8, true, -1, -1, 0.f, false};
  // MQA, local window, softcap and ALiBi at once, sk > sq.
  Case const window{1, 45, kN + 30, 2, 1, kHd, false, 20, 3, 30.f, true};
  // Dropout: the forward's mask regenerated, GQA, uneven.
  Case const dropout{2, kM + 13, kN + 3, 4, 2, kHd, false, -1, -1, 0.f, false, 0.3f};
  // Deterministic dQ: three K/V tiles over two dQ slices (slice x walks tiles x, x + 2, ...), causal.
  Case const det{1, 3 * kN - 5, 3 * kN + 5, 2, 2, kHd, true, -1, -1, 0.f, false};
  int failures = 0;
  failures += !run_clean<cutlass::half_t>(even, &run_variant<Fp16, false, 0>, false, 1, label("fp16 even").c_str());
  failures += !run_clean<cutlass::half_t>(gqa_causal, &run_variant<Fp16, true, 1>, false, 1,
                                          label("fp16 gqa causal, d - 8").c_str());
  failures += !run_clean<cutlass::bfloat16_t>(window, &run_variant<Bf16, false, 1>, false, 1,
                                              label("bf16 mqa window softcap alibi").c_str());
  failures += !run_clean<cutlass::bfloat16_t>(dropout, &run_variant<Bf16, false, 2>, false, 1,
                                              label("bf16 gqa dropout 0.3").c_str());
  failures += !run_clean<cutlass::half_t>(det, &run_variant<Fp16, true, 1>, true, 2,
                                          label("fp16 causal deterministic, 2 dQ slices").c_str());
  return failures;
}

RegisterHeadDim const registered{FLASH_EXT_EMU_BWD_HD, &cases};

}  // namespace
}  // namespace emu_bwd_test
