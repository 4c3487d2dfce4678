// The architecture policy of the GPU traits: every primitive instruction the Sm80 kernels issue, in one
// place.  `Sm80Traits<..., Arch>` (and the backward's traits) take the tile shapes, shared-memory layouts and
// tiled copy/MMA layouts from the real sm_80 atoms, and the instructions themselves from `Arch`:
//
//   Sm80Arch   the CUDA instructions (mma.sync, ldmatrix, cp.async, shfl, bar.sync, ex2/tanh.approx, cvt);
//   EmuSm80Arch (csrc/emu/) host emulations of the same instructions, executed by emulated warps, so that the
//              unchanged kernel body with the real GPU layouts runs on the CPU under race/address/bank checks.
//
// Two instances of one traits template that differ only in Arch therefore have identical partitions: a
// wrong use of CuTe (a layout, a partition, a fragment pairing) is wrong in both, and the emulator, whose
// instruction semantics come from the PTX ISA rather than from CuTe, shows it as a wrong result.
//
// Requirements on an Arch (checked by use):
//   template <class Element> using Mma   MMA op with the register interface and MMA_Traits of the sm_80
//                                        m16n8k16 fp32-accumulating atom for Element (fp16 or bf16)
//   using LdsmN, LdsmT                    ldmatrix .x4 (b16 pairs) and .x4.trans ops (SM75_U32x4_LDSM_N /
//                                        SM75_U16x8_LDSM_T interface and Copy_Traits)
//   using LdsmNx2                         ldmatrix .x2 (SM75_U32x2_LDSM_N): an n8 B operand (the backward's
//                                        S/dP at head dim 256)
//   using CpAsync                         16-byte cp.async.cg global->shared op
//   using VecCopy                         16-byte register<->shared / register->global vector moves
//   cp_async_fence(), cp_async_wait<N>()  commit the copies issued so far as a group / wait for all but N groups
//   barrier()                             CTA-wide barrier with shared-memory ordering (__syncthreads)
//   shfl_xor(x, lane_mask)                warp butterfly exchange of one fp32
//   warp_any(p)                           true on every lane if p is true on any lane (vote.any)
//   exp2(x), tanh(x)                      the approximate transcendental units (ex2.approx, tanh.approx)
//   convert<To>(cutlass::Array<float, N>) fp32 -> fp16/bf16 round-to-nearest-even conversion (cvt.rn)
//   clear_smem(tensor)                    zero-fill of a shared-memory partition with plain stores
//   atomic_add(float* dst, float v)       red.global.add.f32 (atomicAdd, result unused): fp32 accumulation into
//                                         global memory from many CTAs, e.g. the backward's dQ (order unspecified)
//   load_global(p), store_global(p, v)    plain scalar global accesses (global_memory.h)
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cute/atom/copy_traits.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_types.h>
#if defined(__CUDACC__)
#include <cutlass/numeric_conversion.h>
#endif

#include "global_memory.h"

namespace flash_ext {

struct Sm80Arch : PlainGlobalMemory {
  template <class Element>
  using Mma = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, cute::SM80_16x8x16_F32F16F16F32_TN,
                                 cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  using LdsmN = cute::SM75_U32x4_LDSM_N;
  using LdsmT = cute::SM75_U16x8_LDSM_T;
  using LdsmNx2 = cute::SM75_U32x2_LDSM_N;
  using CpAsync = cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>;
  using VecCopy = cute::AutoVectorizingCopyWithAssumedAlignment<128>;

#if defined(__CUDACC__)
  // cp.async groups: a fence closes the group of copies issued so far; wait<N> blocks until at most N
  // groups are still in flight.  Data is visible to *other* threads only after the following barrier.
  CUTE_DEVICE static void cp_async_fence() { cute::cp_async_fence(); }
  template <int N>
  CUTE_DEVICE static void cp_async_wait() { cute::cp_async_wait<N>(); }
  CUTE_DEVICE static void barrier() { __syncthreads(); }
  CUTE_DEVICE static float shfl_xor(float x, int lane_mask) { return __shfl_xor_sync(0xffffffffu, x, lane_mask); }
  CUTE_DEVICE static bool warp_any(bool p) { return __any_sync(0xffffffffu, p); }
  // ex2.approx under --use_fast_math: one MUFU op; exp2(-inf) = 0 as the softmax needs.
  CUTE_DEVICE static float exp2(float x) { return exp2f(x); }
  // Softcap's tanh as one MUFU op (sm_75+; relative error about 2^-11, below the 2^-8 of the bf16 scores
  // it caps).  tanhf is a ~20-instruction sequence per score that also pushed the head-dim-256
  // runtime-flag kernels into spilling.
  CUTE_DEVICE static float tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
  // Whole-array conversion, so pairs go through one packed cvt.rn.{f16x2,bf16x2}.f32.
  template <class To, int N>
  CUTE_DEVICE static cutlass::Array<To, N> convert(cutlass::Array<float, N> const& in) {
    return cutlass::NumericArrayConverter<To, float, N>{}(in);
  }
  template <class Tensor>
  CUTE_DEVICE static void clear_smem(Tensor&& t) { cute::clear(t); }
  // Unused by the forward kernel; compiles to RED.E.ADD.F32 when the result is ignored.
  CUTE_DEVICE static void atomic_add(float* dst, float value) { atomicAdd(dst, value); }
#endif
};

}  // namespace flash_ext
