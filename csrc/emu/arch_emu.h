// EmuSm80Arch: the architecture policy of the GPU traits (csrc/flash_ext/arch_sm80.h) with every instruction
// replaced by its warp-emulator implementation.  Sm80Traits<..., EmuSm80Arch> has the real sm_80 tile shapes,
// swizzled shared layouts and tiled copy/MMA layouts (the op structs below keep the real ops' register
// interfaces, and their MMA_Traits / Copy_Traits *are* the real atoms' layouts); only what an instruction
// does comes from here, and that is the PTX ISA's definition (ptx.h), executed by emulated warps (runtime.h).
//
// Include only in host translation units of the emulator.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/copy_traits.hpp>
#include <cute/atom/copy_traits_sm75.hpp>
#include <cute/atom/copy_traits_sm80.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm80.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_types.h>

#include "emu/ptx.h"
#include "emu/runtime.h"

namespace flash_ext::emu {

template <class Element>
constexpr ptx::Type16 type16() {
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>);
  return std::is_same_v<Element, cutlass::half_t> ? ptx::Type16::kF16 : ptx::Type16::kBF16;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, register interface of
// SM80_16x8x16_F32{F16F16,BF16BF16}F32_TN.
template <class Element>
struct Mma16x8x16 {
  using DRegisters = float[4];
  using ARegisters = uint32_t[4];
  using BRegisters = uint32_t[2];
  using CRegisters = float[4];
  static void fma(float& d0, float& d1, float& d2, float& d3, uint32_t const& a0, uint32_t const& a1,
                  uint32_t const& a2, uint32_t const& a3, uint32_t const& b0, uint32_t const& b1, float const& c0,
                  float const& c1, float const& c2, float const& c3) {
    ptx::MmaLane const in{{a0, a1, a2, a3}, {b0, b1}, {c0, c1, c2, c3}};
    mma_m16n8k16(type16<Element>(), in, d0, d1, d2, d3);
  }
};

// ldmatrix .x4 and .x4.trans (SM75_U32x4_LDSM_N / SM75_U16x8_LDSM_T): each lane passes its row address.
struct LdsmN {
  using SRegisters = cute::uint128_t[1];
  using DRegisters = uint32_t[4];
  static void copy(cute::uint128_t const& smem_row, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3) {
    ldmatrix_x4(false, &smem_row, d0, d1, d2, d3);
  }
};
struct LdsmT {
  using SRegisters = cute::uint128_t[1];
  using DRegisters = uint32_t[4];
  static void copy(cute::uint128_t const& smem_row, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3) {
    ldmatrix_x4(true, &smem_row, d0, d1, d2, d3);
  }
};

// ldmatrix .x2 (SM75_U32x2_LDSM_N).
struct LdsmNx2 {
  using SRegisters = cute::uint128_t[1];
  using DRegisters = uint32_t[2];
  static void copy(cute::uint128_t const& smem_row, uint32_t& d0, uint32_t& d1) { ldmatrix_x2(&smem_row, d0, d1); }
};

// cp.async.cg.shared.global, 16 bytes (SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>).
struct CpAsync16 {
  using SRegisters = cute::uint128_t[1];
  using DRegisters = cute::uint128_t[1];
  static void copy(cute::uint128_t const& gmem_src, cute::uint128_t& smem_dst) { cp_async_16(&gmem_src, &smem_dst); }
};

// The vectorised register <-> shared / register -> global moves (AutoVectorizingCopyWithAssumedAlignment<128>
// on the GPU): same Copy_Traits, and the same choice of vector width (cute::copy below).
struct VecCopy {};

}  // namespace flash_ext::emu

namespace cute {

template <>
struct MMA_Traits<flash_ext::emu::Mma16x8x16<cutlass::half_t>> : MMA_Traits<SM80_16x8x16_F32F16F16F32_TN> {};
template <>
struct MMA_Traits<flash_ext::emu::Mma16x8x16<cutlass::bfloat16_t>> : MMA_Traits<SM80_16x8x16_F32BF16BF16F32_TN> {};
template <>
struct Copy_Traits<flash_ext::emu::LdsmN> : Copy_Traits<SM75_U32x4_LDSM_N> {};
template <>
struct Copy_Traits<flash_ext::emu::LdsmT> : Copy_Traits<SM75_U16x8_LDSM_T> {};
template <>
struct Copy_Traits<flash_ext::emu::LdsmNx2> : Copy_Traits<SM75_U32x2_LDSM_N> {};
template <>
struct Copy_Traits<flash_ext::emu::CpAsync16> : Copy_Traits<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>> {};
template <>
struct Copy_Traits<flash_ext::emu::VecCopy> : Copy_Traits<AutoVectorizingCopyWithAssumedAlignment<128>> {};

// copy() with the emulated vector-move atom: the vector width is chosen exactly as for
// AutoVectorizingCopyWithAssumedAlignment<128> (cute/algorithm/copy.hpp: the widest common vector of source
// and destination, limited by their static alignment and 128 bits), then every vector is one emulated move.
template <class... Args, class SrcEngine, class SrcLayout, class DstEngine, class DstLayout>
void copy(Copy_Atom<flash_ext::emu::VecCopy, Args...> const&, Tensor<SrcEngine, SrcLayout> const& src,
          Tensor<DstEngine, DstLayout>& dst) {
  using DstType = typename DstEngine::value_type;
  constexpr int common_elem = CUTE_STATIC_V(max_common_vector(src, dst));
  auto move_each = [](auto const& s, auto& d) {
    using V = typename std::remove_reference_t<decltype(d)>::value_type;
    for (int i = 0; i < size(d); ++i) {
      flash_ext::emu::vector_move(&s(i), &d(i), int(sizeof(V)));
    }
  };
  if constexpr (common_elem > 1) {
    constexpr int align_bits = CUTE_STATIC_V(gcd(max_alignment(src), max_alignment(dst), Int<128>{}));
    constexpr int vec_bits = gcd(common_elem * sizeof_bits_v<DstType>, align_bits);
    if constexpr ((vec_bits % 8) == 0 && sizeof_bits_v<DstType> < vec_bits) {
      using VecType = uint_bit_t<vec_bits>;
      Tensor src_v = recast<VecType>(src);
      Tensor dst_v = recast<VecType>(dst);
      move_each(src_v, dst_v);
    } else {
      move_each(src, dst);
    }
  } else {
    move_each(src, dst);
  }
}

template <class... Args, class SrcEngine, class SrcLayout, class DstEngine, class DstLayout>
void copy(Copy_Atom<flash_ext::emu::VecCopy, Args...> const& atom, Tensor<SrcEngine, SrcLayout> const& src,
          Tensor<DstEngine, DstLayout>&& dst) {
  copy(atom, src, dst);
}

}  // namespace cute

namespace flash_ext {

// The policy: the same members as Sm80Arch (arch_sm80.h), emulated.  Each kernel-level primitive takes the
// caller's source location as a defaulted argument (the kernel calls them without it), so findings name the
// line of kernel_fwd.h / epilogue.h / softmax.h that issued them.
struct EmuSm80Arch {
  template <class Element>
  using Mma = emu::Mma16x8x16<Element>;
  using LdsmN = emu::LdsmN;
  using LdsmT = emu::LdsmT;
  using LdsmNx2 = emu::LdsmNx2;
  using CpAsync = emu::CpAsync16;
  using VecCopy = emu::VecCopy;

  static void cp_async_fence(std::source_location site = std::source_location::current()) { emu::cp_async_commit(site); }
  template <int N>
  static void cp_async_wait(std::source_location site = std::source_location::current()) {
    emu::cp_async_wait(N, site);
  }
  static void barrier(std::source_location site = std::source_location::current()) { emu::barrier(site); }
  static float shfl_xor(float x, int lane_mask, std::source_location site = std::source_location::current()) {
    return emu::shfl_bfly(x, lane_mask, site);
  }
  static bool warp_any(bool p, std::source_location site = std::source_location::current()) {
    return emu::vote_any(p, site);
  }
  // ex2.approx.ftz.f32 (what exp2f compiles to under --use_fast_math): modelled as the exact 2^x with the
  // result flushed to zero below the smallest normal.  The hardware's approximation error (about 2 ulp) is
  // not modelled.
  static float exp2(float x) {
    float const r = std::exp2(x);
    return r < 1.17549435e-38f ? 0.f : r;
  }
  // tanh.approx.f32: modelled as the exact tanh (the hardware's relative error is about 2^-11).
  static float tanh(float x) { return std::tanh(x); }
  // cvt.rn.{f16,bf16}.f32, element by element (the GPU packs pairs; the rounding is the same).
  template <class To, int N>
  static cutlass::Array<To, N> convert(cutlass::Array<float, N> const& in) {
    uint16_t bits[N];
    for (int i = 0; i < N; ++i) { bits[i] = emu::ptx::from_float_rn(emu::type16<To>(), in[i]); }
    cutlass::Array<To, N> out;
    static_assert(sizeof(out) == sizeof(bits));
    std::memcpy(out.raw_data(), bits, sizeof(bits));  // element i in bits 16i..16i+15, as the packed cvt writes
    return out;
  }
  template <class Tensor>
  static void clear_smem(Tensor&& t, std::source_location site = std::source_location::current()) {
    using T = typename std::remove_reference_t<Tensor>::value_type;
    for (int i = 0; i < cute::size(t); ++i) { emu::clear_store(&t(i), int(sizeof(T))); }
    emu::clear_done(site);
  }
  // red.global.add.f32 (atomicAdd without a returned value) into global memory; for the backward's dQ.
  static void atomic_add(float* dst, float value, std::source_location site = std::source_location::current()) {
    emu::red_add_f32(dst, value, site);
  }
  // ld.global / st.global of one scalar (global_memory.h), checked against the launch's tensors.
  template <class T>
  static T load_global(T const* p, std::source_location site = std::source_location::current()) {
    T value{};
    emu::global_load(p, &value, int(sizeof(T)), site);
    return value;
  }
  template <class T>
  static void store_global(T* p, std::type_identity_t<T> value,
                           std::source_location site = std::source_location::current()) {
    emu::global_store(p, &value, int(sizeof(T)), site);
  }
};

}  // namespace flash_ext
