// One forward kernel with the GPU bug named by the test-only compile switch FLASH_EXT_EMU_FAULT (emu_faults.h),
// on the warp emulator.  Compiled once per fault by CMakeLists.txt.
#undef NDEBUG
#include <cstring>
#include <source_location>

#include "emu/launch_emu.h"
#include "emu_faults.h"

#ifndef FLASH_EXT_EMU_FAULT
#error "compile with -DFLASH_EXT_EMU_FAULT=<fault number> (tests/cpp/emu_faults.h)"
#endif

namespace flash_ext::emu::faults {

namespace {

constexpr Fault kFault = Fault(FLASH_EXT_EMU_FAULT);

bool from(std::source_location const& site, char const* file) {
  char const* name = site.file_name();
  size_t const n = std::strlen(name), m = std::strlen(file);
  return n >= m && std::strcmp(name + n - m, file) == 0;
}

// The emulated policy minus one instruction at one place of the kernel.
struct FaultArch : EmuSm80Arch {
  static void barrier(std::source_location site = std::source_location::current()) {
    bool const skip = (kFault == kNoLoopBarrierK && from(site, "kernel_fwd.h") && int(site.line()) == g_fault_lines.barrier_k) ||
                      (kFault == kNoLoopBarrierV && from(site, "kernel_fwd.h") && int(site.line()) == g_fault_lines.barrier_v) ||
                      (kFault == kNoEpilogueBarrier && from(site, "epilogue.h"));
    if (!skip) { EmuSm80Arch::barrier(site); }
  }
  template <int N>
  static void cp_async_wait(std::source_location site = std::source_location::current()) {
    bool const skip = kFault == kNoCpAsyncWait && from(site, "kernel_fwd.h") && int(site.line()) == g_fault_lines.wait_k;
    if (!skip) { EmuSm80Arch::cp_async_wait<N>(site); }
  }
};

// The tile dispatch.h gives the variant launched below ("uneven", head dim 64: 4 warps x 32 rows), so the
// faults are planted in the kernel a GPU would run.
constexpr int kVariant = 1;
constexpr TileConfig kTile = sm80_tile_config(64, kVariant, /*causal=*/false);
using Base = Sm80Traits<64, kTile.block_m, kTile.block_n, kTile.num_warps, cutlass::half_t, FaultArch>;

// The traits with one layout decision of the GPU path done wrong.  Every type the kernel reads from the
// traits and that the fault changes is redefined here (the base's aliases would otherwise stay).
struct Traits : Base {
  using SmemLayoutAtom = std::conditional_t<
      kFault == kUnswizzled,
      decltype(cute::composition(cute::Swizzle<0, 3, 3>{},
                                 cute::Layout<cute::Shape<cute::_8, cute::Int<Base::kBlockKSmem>>,
                                              cute::Stride<cute::Int<Base::kBlockKSmem>, cute::_1>>{})),
      typename Base::SmemLayoutAtom>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = SmemLayoutQ;

  template <class Op>
  static float row_allreduce(float x, Op op) {
    if constexpr (kFault == kShuffleMasks) {
      x = op(x, FaultArch::shfl_xor(x, 8));
      x = op(x, FaultArch::shfl_xor(x, 4));
      return x;
    } else {
      return Base::row_allreduce(x, op);
    }
  }

  template <class Layout>
  static constexpr auto acc_to_a_layout(Layout acc) {
    if constexpr (kFault == kPPairing) {
      constexpr int kHalf = decltype(cute::size<2>(acc))::value / 2;
      auto l = cute::logical_divide(
          acc, cute::Shape<cute::Underscore, cute::Underscore, cute::Layout<cute::_2, cute::Int<kHalf>>>{});
      return cute::make_layout(cute::make_layout(cute::get<0>(l), cute::get<2, 0>(l)), cute::get<1>(l),
                               cute::get<2, 1>(l));
    } else {
      return Base::acc_to_a_layout(acc);
    }
  }
};

}  // namespace

#define FLASH_EXT_EMU_FAULT_FN_(n) run_fault_##n
#define FLASH_EXT_EMU_FAULT_FN(n) FLASH_EXT_EMU_FAULT_FN_(n)

std::string FLASH_EXT_EMU_FAULT_FN(FLASH_EXT_EMU_FAULT)(FwdParams const& params, EmuLaunch& launch) {
  return launch_fwd_emu<Traits, VariantFlags<kVariant, false>>(params, launch,
                                                               std::string("fault: ") + fault_name(kFault));
}

}  // namespace flash_ext::emu::faults
