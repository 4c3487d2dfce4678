// Predicated tile copies between global and shared memory.  The predicates come from identity tensors
// partitioned exactly like the data, so a thread tests the true (row, column) of each vector it moves.
#pragma once

#include <cute/tensor.hpp>

namespace flash_ext {

// Copy a (CPY, CPY_M, CPY_K) partition.  Rows at or beyond max_row and columns at or beyond max_col are not
// read; their (shared-memory) destination is zero-filled when clear_oob is set, with the traits' plain
// stores (Traits::clear_smem, which the warp emulator records like any other shared-memory write).  Zeros
// matter for: head-dim padding of Q and K (it enters every dot product), and rows of V beyond seqlen_k (P is
// 0 there but 0 * NaN is NaN).
template <class Traits, class TiledCopy, class Src, class Dst, class Coord, class EvenMN, class EvenK>
CUTE_HOST_DEVICE void copy_tile(TiledCopy const& tiled_copy, Src const& S, Dst& D, Coord const& identity,
                                int max_row, int max_col, EvenMN even_mn, EvenK even_k, bool clear_oob = true) {
  using namespace cute;
  CUTE_STATIC_ASSERT_V(rank(S) == Int<3>{});
  CUTE_STATIC_ASSERT_V(size<1>(S) == size<1>(D));
  CUTE_STATIC_ASSERT_V(size<2>(S) == size<2>(D));
  if constexpr (Traits::kIsHost) {  // the CPU may leave a whole K/V tile where it is (traits_host.h)
    if (Traits::read_in_place(S, D, even_k && get<0>(identity(0, size<1>(S) - 1, 0)) < max_row)) { return; }
    // or clear a tile with missing rows at once, where its rows are strided (Q's, traits_host.h)
    if (!even_mn && clear_oob && Traits::clear_tile_if_rows_strided(D)) { clear_oob = false; }
  }
  if (even_mn && even_k) {
    copy(tiled_copy, S, D);
  } else {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(S); ++m) {
      if (even_mn || get<0>(identity(0, m, 0)) < max_row) {
        CUTE_UNROLL
        for (int k = 0; k < size<2>(S); ++k) {
          if (even_k || get<1>(identity(0, m, k)) < max_col) {
            copy(tiled_copy, S(_, m, k), D(_, m, k));
          } else if (clear_oob) {
            Traits::clear_smem(D(_, m, k));
          }
        }
      } else if (clear_oob) {
        Traits::clear_smem(D(_, m, _));
      }
    }
  }
}

}  // namespace flash_ext
