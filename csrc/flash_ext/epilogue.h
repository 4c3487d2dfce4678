// Epilogue: the only HBM writes of the kernel.  The normalised fp32 accumulator is converted to the
// output dtype in registers, staged through shared memory (so that global stores are 16-byte vectors in
// row order instead of the MMA's scattered 2-element pieces), and stored with row/column predicates.
// Each row's LSE is written by the one thread that holds that row's column 0.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/array.h>

#include "block_info.h"
#include "copy.h"
#include "flags.h"
#include "gemm.h"
#include "params.h"

namespace flash_ext {

// Split-KV partial: the fp32 accumulator rows, normalised by this split's own sum, and the split's LSE go
// straight from registers to the accumulators (num_splits, h, accum_rows, d); combine.h merges them.  No
// shared memory is touched, so no barrier is needed.
//
// On the GPU each store is 16 bytes.  In the m16n8 accumulator lanes 2q and 2q + 1 hold columns {4q', 4q'+1}
// and {4q'+2, 4q'+3} (q' = q mod 2) of rows r and r + 8; one exchange of two values over lane bit 0 leaves
// the even lane with row r's four columns and the odd lane with row r + 8's, each a 16-byte aligned run
// (the op requires d % 8 == 0, so a run is either wholly inside d or wholly past it).  The host traits hold
// one value per (row, column) and store them one by one.
template <class Traits, class AccO, class Lse>
CUTE_HOST_DEVICE void write_partial(FwdParams const& params, BlockInfo const& binfo, AccO const& acc_o,
                                    Lse const& lse, int tidx, int bidb, int bidh, int m_block, int n_split) {
  using namespace cute;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor acc_o_rc = acc_rowcol<Traits::kAccValCols>(acc_o);                                 // (ROWS,COLS)
  Tensor taccOcO = acc_rowcol<Traits::kAccValCols>(
      thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));    // (ROWS,COLS) -> (m,k)
  index_t const split_base = (index_t(n_split) * params.h + bidh) * params.accum_rows;
  CUTE_UNROLL
  for (int i = 0; i < size<0>(acc_o_rc); ++i) {
    int const row = m_block * kBlockM + get<0>(taccOcO(i, 0));
    if (get<1>(taccOcO(i, 0)) == 0 && row < binfo.seqlen_q) {
      Traits::store_global(params.lseaccum_ptr + split_base + binfo.accum_row(params, bidb, row), lse(i));
    }
  }
  if constexpr (!Traits::kIsHost) {
    static_assert(Traits::kAccValCols == 2 && decltype(size<0>(acc_o_rc))::value % 2 == 0);
    using Vec = cutlass::AlignedArray<float, 4>;
    bool const odd = (tidx & 1) != 0;
    CUTE_UNROLL
    for (int i = 0; i < size<0>(acc_o_rc); i += 2) {  // rows r (i) and r + 8 (i + 1) of one 16-row slab
      int const row = m_block * kBlockM + get<0>(taccOcO(odd ? i + 1 : i, 0));
      bool const row_ok = row < binfo.seqlen_q;
      index_t const r = split_base + binfo.accum_row(params, bidb, row_ok ? row : 0);
      float* const orow = params.oaccum_ptr + r * params.d;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(acc_o_rc); j += 2) {  // columns c, c + 1 of one n8 atom
        // Even lanes send their row r + 8 pair and keep row r's; odd lanes the reverse.
        float const send0 = odd ? acc_o_rc(i, j) : acc_o_rc(i + 1, j);
        float const send1 = odd ? acc_o_rc(i, j + 1) : acc_o_rc(i + 1, j + 1);
        float const got0 = Traits::shfl_xor(send0, 1);
        float const got1 = Traits::shfl_xor(send1, 1);
        Vec v;
        if (odd) {
          v[0] = got0, v[1] = got1, v[2] = acc_o_rc(i + 1, j), v[3] = acc_o_rc(i + 1, j + 1);
        } else {
          v[0] = acc_o_rc(i, j), v[1] = acc_o_rc(i, j + 1), v[2] = got0, v[3] = got1;
        }
        int const col = get<1>(taccOcO(i, j)) & ~3;
        // A full head dim needs no column predicate: 2 x kHeadDim / 8 of them per thread would otherwise be
        // live at once next to the accumulator (the head-dim-256 kernels spilled for it).
        if (row_ok && (params.d == kHeadDim || col < params.d)) {
          Traits::store_global(reinterpret_cast<Vec*>(orow + col), v);
        }
      }
    }
  } else {
    // d read once: the float stores may alias params as far as the compiler knows (-fno-strict-aliasing), and
    // it reloaded params.d for every column's predicate.
    int const d = params.d;
    CUTE_UNROLL
    for (int i = 0; i < size<0>(acc_o_rc); ++i) {
      int const row = m_block * kBlockM + get<0>(taccOcO(i, 0));
      if (row >= binfo.seqlen_q) { continue; }
      float* const orow = params.oaccum_ptr + (split_base + binfo.accum_row(params, bidb, row)) * d;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(acc_o_rc); ++j) {
        int const col = get<1>(taccOcO(i, j));
        if (d == kHeadDim || col < d) { Traits::store_global(orow + col, acc_o_rc(i, j)); }
      }
    }
  }
}

// Each row's LSE, by the thread that holds the row's column 0: (b, h, seqlen_q) or, varlen, (h, total_q) fp32.
template <class Traits, class Lse>
CUTE_HOST_DEVICE void store_lse(FwdParams const& params, BlockInfo const& binfo, Lse const& lse, int tidx, int bidb,
                                int bidh, int m_block) {
  using namespace cute;
  constexpr int kBlockM = Traits::kBlockM;
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  float* const lse_row0 = params.softmax_lse_ptr + binfo.lse_offset(params, bidb, bidh);
  Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<Traits::kHeadDim>>{});          // (BLK_M,HEAD_DIM) -> (m,k)
  Tensor taccOcO = acc_rowcol<Traits::kAccValCols>(thr_mma.partition_C(cO));               // (ROWS,COLS) -> (m,k)
  CUTE_STATIC_ASSERT_V(size<0>(taccOcO) == size(lse));
  CUTE_UNROLL
  for (int i = 0; i < size<0>(taccOcO); ++i) {
    int const row = m_block * kBlockM + get<0>(taccOcO(i, 0));
    if (get<1>(taccOcO(i, 0)) == 0 && row < binfo.seqlen_q) { Traits::store_global(lse_row0 + row, lse(i)); }
  }
}

// This CTA's tile of O in global memory.
template <class Traits>
CUTE_HOST_DEVICE auto output_tile(FwdParams const& params, BlockInfo const& binfo, int bidb, int bidh, int m_block) {
  using namespace cute;
  using Element = typename Traits::Element;
  Tensor mO = make_tensor(make_gmem_ptr(static_cast<Element*>(params.o_ptr) + binfo.q_offset(params.o_batch_stride, params.o_row_stride, bidb)),
                          make_shape(binfo.seqlen_q, params.h, params.d),
                          make_stride(params.o_row_stride, params.o_head_stride, _1{}));   // (SEQ_Q,H,D)
  return local_tile(mO(_, bidh, _), Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}, make_coord(m_block, 0));  // (BLK_M,HEAD_DIM)
}

// acc_o: (MMA, MMA_M, MMA_K) normalised accumulator; lse: one value per row of its (row, col) view.
// Precondition: no thread still reads the shared-memory bytes of the Q tile (sO aliases them).
template <class Traits, class Flags, class AccO, class Lse>
CUTE_HOST_DEVICE void write_output(FwdParams const& params, BlockInfo const& binfo, Flags const& flags,
                                   AccO const& acc_o, Lse const& lse, char* smem, int tidx, int bidb,
                                   int bidh, int m_block, int n_split = 0) {
  using namespace cute;
  if (flags.split) {
    write_partial<Traits>(params, binfo, acc_o, lse, tidx, bidb, bidh, m_block, n_split);
    return;
  }
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  if constexpr (Traits::kIsHost) {  // one thread holds the whole tile: its rows go straight to global O
    store_lse<Traits>(params, binfo, lse, tidx, bidb, bidh, m_block);
    Tensor gO = output_tile<Traits>(params, binfo, bidb, bidh, m_block);                    // (BLK_M,HEAD_DIM)
    Traits::store_acc_rows(acc_o, raw_pointer_cast(gO.data()), params.o_row_stride,
                           cute::min(binfo.seqlen_q - m_block * kBlockM, kBlockM), params.d);
    return;
  }

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);

  Tensor rO = convert_fragment<Traits, Element>(acc_o);                                        // (MMA,MMA_M,MMA_K)
  Tensor sO = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutO{});  // (BLK_M,HEAD_DIM)
  auto smem_tiled_copy_O = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(tidx);
  Tensor taccOrO = smem_thr_copy_O.retile_S(rO);                                           // ((ATOM,ATOM_NUM),MMA_M,MMA_K)
  Tensor taccOsO = smem_thr_copy_O.partition_D(sO);                                        // ((ATOM,ATOM_NUM),MMA_M,MMA_K)
  copy(smem_tiled_copy_O, taccOrO, taccOsO);

  store_lse<Traits>(params, binfo, lse, tidx, bidb, bidh, m_block);

  // sO was written in the MMA's thread layout and is read back in the copy's layout.
  Traits::barrier();

  Tensor gO = output_tile<Traits>(params, binfo, bidb, bidh, m_block);                      // (BLK_M,HEAD_DIM)
  Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});                  // (BLK_M,HEAD_DIM) -> (m,k)
  typename Traits::GmemTiledCopyO gmem_tiled_copy_O;
  auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
  Tensor tOsO = gmem_thr_copy_O.partition_S(sO);                                           // (CPY,CPY_M,CPY_K)
  Tensor tOgO = gmem_thr_copy_O.partition_D(gO);                                           // (CPY,CPY_M,CPY_K)
  Tensor tOcO = gmem_thr_copy_O.partition_D(cO);                                           // (CPY,CPY_M,CPY_K) -> (m,k)
  Tensor tOrO = make_tensor<Element>(shape(tOgO));                                         // (CPY,CPY_M,CPY_K)
  copy(gmem_tiled_copy_O, tOsO, tOrO);
  // Runtime even flags are re-derived from this tile instead of read from `flags`: keeping them live across
  // the main loop costs a register, which the head-dim-256 kernels (255 registers) spill for.  A static
  // flag stays static; a block of full rows needs no row predicates even in an uneven problem.
  int const rows_left = binfo.seqlen_q - m_block * kBlockM;
  auto const full_rows = make_flag<std::remove_cv_t<decltype(flags.even_mn)>>(rows_left >= kBlockM);
  auto const full_cols = make_flag<std::remove_cv_t<decltype(flags.even_k)>>(params.d == kHeadDim);
  copy_tile<Traits>(gmem_tiled_copy_O, tOrO, tOgO, tOcO, rows_left, params.d, full_rows, full_cols, /*clear_oob=*/false);
}

}  // namespace flash_ext
