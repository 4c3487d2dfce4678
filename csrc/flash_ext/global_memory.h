// Plain (scalar) global-memory accesses of the kernel bodies: the index arrays (cu_seqlens, seqused_k,
// leftpad_k, kv_batch_idx, block_table), ALiBi slopes, the RNG state, LSE and D rows, and the split-KV
// partials and their combine.  They go through the traits' memory policy rather than a bare `*p`, so that
// the warp emulator (EmuSm80Arch, csrc/emu/arch_emu.h) range-, alignment- and write-checks every one of them
// against the launch's tensors, as it checks cp.async and vector moves.  On the GPU and the host backend
// they are the bare access: inlined, they leave the generated code as it was.
//
// Data moved by tiles (Q/K/V/O, dO, dK/dV) does not use these: it goes through the tiled copies.
#pragma once

#include <type_traits>

#include <cute/config.hpp>

namespace flash_ext {

struct PlainGlobalMemory {
  template <class T>
  CUTE_HOST_DEVICE static T load_global(T const* p) {
    return *p;
  }
  template <class T>
  CUTE_HOST_DEVICE static void store_global(T* p, std::type_identity_t<T> value) {
    *p = value;
  }
};

// Names the memory policy a BlockInfo reads its index arrays through (a constructor cannot take explicit
// template arguments): BlockInfo(params, bidb, via<Traits>).
template <class Mem>
struct Via {};
template <class Mem>
inline constexpr Via<Mem> via{};

}  // namespace flash_ext
