// GPU traits for sm_80 and newer (Ampere instructions, also the path used on Hopper by this library):
// 16-byte cp.async global->shared copies, swizzled shared layouts, ldmatrix shared->register copies,
// mma.sync m16n8k16 with fp32 accumulation, and quad shuffles for row reductions.  The instructions come
// from the architecture policy `Arch` (arch_sm80.h): the real ones on the GPU, emulated ones under the warp
// emulator; everything else here (tiles, layouts, partitions) is the same for both.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/numeric_types.h>

#include "arch_sm80.h"
#include "dispatch.h"
#include "traits_sm80_common.h"

namespace flash_ext {

// The primitives (cp_async_fence/wait, barrier, exp2, tanh, convert, clear_smem, shfl_xor) are Arch's own
// static members, inherited so that the kernel body calls them as Traits::barrier() on every backend.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, class Element_, class Arch_ = Sm80Arch>
struct Sm80Traits : Sm80TraitsCommon<Arch_, Element_, kHeadDim_, kNWarps_ * 32> {
  using Common = Sm80TraitsCommon<Arch_, Element_, kHeadDim_, kNWarps_ * 32>;
  using Common::kBlockKSmem;
  using typename Common::SmemLayoutAtom;
  using Arch = Arch_;
  using Element = Element_;
  using ElementAccum = float;
  using ElementP = Element;  // P feeds a 16-bit tensor-core MMA
  static constexpr bool kIsHost = false;
  // Q is re-read from shared memory for every K tile: holding it in registers would cost 32-64
  // registers per thread that the accumulators need (and cause spills at head dim 128+).
  static constexpr bool kQInRegs = false;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0, "head dim tiles are multiples of 32");
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns 16-row slabs of the M tile");
  static_assert(kBlockN % 16 == 0 && kBlockN % 8 == 0, "P = S tile must split into k16 A fragments");
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>,
                "tensor-core path takes fp16 or bf16");

  // Warps are stacked along M: a warp owns whole rows of S and O, so row statistics never cross warps.
  using MmaOp = typename Arch::template Mma<Element>;
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<MmaOp>,
                                  cute::Layout<cute::Shape<cute::Int<kNWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kNWarps>, cute::_16, cute::_16>>;

  // Shared memory: whole tiles of the swizzled row atom (traits_sm80_common.h).
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemLayoutAtom{},
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemLayoutAtom{},
                                                    cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V read as the B operand of P.V: (head dim, key) view of the same bytes.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = SmemLayoutQ;

  using SmemCopyAtom = cute::Copy_Atom<typename Arch::LdsmN, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<typename Arch::LdsmT, Element>;
  using SmemCopyAtomO = cute::Copy_Atom<typename Arch::VecCopy, Element>;

  using GmemTiledCopyQKV = typename Common::GmemTiledCopyAsync;
  using GmemTiledCopyO = typename Common::GmemTiledCopyVec;

  // Q tile, then K and V tiles; O reuses the Q bytes in the epilogue.
  static constexpr int kSmemQBytes = int(cute::cosize_v<SmemLayoutQ>) * int(sizeof(Element));
  static constexpr int kSmemKVBytes = int(cute::cosize_v<SmemLayoutKV>) * int(sizeof(Element));
  static constexpr int kSmemBytes = kSmemQBytes + 2 * kSmemKVBytes;
  static_assert(int(cute::cosize_v<SmemLayoutO>) * int(sizeof(Element)) <= kSmemQBytes);

  // A row of the S accumulator is spread over the 4 lanes of a quad (lanes 4r..4r+3, see the
  // partition tests); xor-shuffles over lane bits 0 and 1 combine exactly that group.
  template <class Op>
  CUTE_HOST_DEVICE static float row_allreduce(float x, Op op) {
    x = op(x, Arch::shfl_xor(x, 2));
    x = op(x, Arch::shfl_xor(x, 1));
    return x;
  }
  // Whether p holds on any lane of the warp; the same answer on every lane (softmax.h branches on it).
  CUTE_HOST_DEVICE static bool warp_any(bool p) { return Arch::warp_any(p); }
};

// The forward instantiations of one (head dim, dtype, causal) file: the traits of each static variant
// (dispatch.h's tile for it), all of one M x N shape, so the variant is picked from flags computed with that
// shape.  Arch is Sm80Arch on the GPU and the emulated policy under the warp emulator: same tiles for both.
template <int kHeadDim_, class Element, bool kCausal_, SmemBudget kBudget_, class Arch>
struct Sm80FwdTiles {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kCausal = kCausal_;
  static constexpr SmemBudget kBudget = kBudget_;
  template <int kVariant>
  static constexpr TileConfig kTile = sm80_tile_config(kHeadDim, kVariant, kCausal, kBudget);
  template <int kVariant>
  using Traits = Sm80Traits<kHeadDim, kTile<kVariant>.block_m, kTile<kVariant>.block_n, kTile<kVariant>.num_warps,
                            Element, Arch>;
  // A smaller shared-memory budget only adds kernels where it changes a tile.
  static constexpr bool kBudgetMatters = [] {
    for (int v = 0; v < kNumVariants; ++v) {
      if (sm80_tile_config(kHeadDim, v, kCausal, SmemBudget::kSm86) !=
          sm80_tile_config(kHeadDim, v, kCausal, SmemBudget::kSm80)) {
        return true;
      }
    }
    return false;
  }();
};

}  // namespace flash_ext
