// Host checks of the backward traits' partitions, run without a GPU, for every GPU tile config of
// dispatch_bwd.h and for the host traits:
//  1. each tiled MMA's C partition covers its output tile exactly once, and its A/B partitions cover their
//     operand tiles once per warp that needs them (warps along the other dimension);
//  2. every shared->register copy (ldmatrix, plain or .trans) fills each register with exactly the (row, col)
//     coordinate the MMA reads from that register, and every register->shared copy (P, dS, dK, dV) stores
//     each accumulator register at its own coordinate;
//  3. each transposed view addresses the same bytes as the tile it transposes (so P stored at (m, n) is read
//     as P^T at (n, m));
//  4. the global<->shared copies cover their tiles exactly once;
//  5. shared memory matches dispatch_bwd.h's formula and fits sm_86/89's 99 KB.
// Together with the forward's test_traits.cpp this is what can be verified of the GPU layouts without a GPU:
// the instructions' own semantics (ldmatrix lane mapping, mma.sync fragments) come from CuTe's atom traits.
#include <cstdio>
#include <string>
#include <vector>

#include "flash_ext/dispatch_bwd.h"
#include "flash_ext/gemm.h"
#include "flash_ext/traits_host_bwd.h"
#include "flash_ext/traits_sm80_bwd.h"
#include "check.h"

using namespace cute;


struct Coverage {
  int rows, cols;
  std::vector<int> count;
  Coverage(int r, int c) : rows(r), cols(c), count(r * c, 0) {}
  template <class T>
  void add(T const& part) {
    for (int i = 0; i < size(part); ++i) {
      int const r = int(get<0>(part(i))), c = int(get<1>(part(i)));
      if (r >= 0 && r < rows && c >= 0 && c < cols) { ++count[r * cols + c]; } else { count[0] += 1000; }
    }
  }
  bool exactly(int n) const {
    for (int x : count) {
      if (x != n) { return false; }
    }
    return true;
  }
};

template <class A, class B>
bool same_coords(A const& a, B const& b) {
  if (size(a) != size(b)) { return false; }
  for (int i = 0; i < size(a); ++i) {
    if (int(get<0>(a(i))) != int(get<0>(b(i))) || int(get<1>(a(i))) != int(get<1>(b(i)))) { return false; }
  }
  return true;
}

// Lanes of a warp whose source addresses a copy instruction uses: ldmatrix.x2 takes rows from lanes 0-15 only
// (CuTe gives lanes 16-31 copies of those rows' addresses, which the hardware ignores).
template <class CopyAtom>
constexpr int kSourceLanes = 32;
template <class E>
constexpr int kSourceLanes<Copy_Atom<SM75_U32x2_LDSM_N, E>> = 16;

// One tiled MMA of an (R x C) output with operand tiles A (R x K) and B (C x K): coverage and operand copies.
// warps_r / warps_c: warps along the output's rows / columns (each A element is read by warps_c warps).
template <class TiledMma, class CopyAtomA, class CopyAtomB, class CopyAtomC, int R, int C, int K>
void check_mma(std::string const& name, int threads, int warps_r, int warps_c) {
  TiledMma mma;
  CHECK(int(size(mma)) == threads, "%s: %d MMA threads, traits say %d", name.c_str(), int(size(mma)), threads);
  auto cC = make_identity_tensor(Shape<Int<R>, Int<C>>{});
  auto cA = make_identity_tensor(Shape<Int<R>, Int<K>>{});
  auto cB = make_identity_tensor(Shape<Int<C>, Int<K>>{});
  Coverage covC(R, C), covA(R, K), covB(C, K), cpyA(R, K), cpyB(C, K);
  bool a_pairs = true, b_pairs = true, c_pairs = true;
  auto copy_a = make_tiled_copy_A(CopyAtomA{}, mma);
  auto copy_b = make_tiled_copy_B(CopyAtomB{}, mma);
  auto copy_c = make_tiled_copy_C(CopyAtomC{}, mma);
  for (int t = 0; t < threads; ++t) {
    auto thr = mma.get_thread_slice(t);
    auto tCcC = thr.partition_C(cC);
    auto tCcA = thr.partition_A(cA);
    auto tCcB = thr.partition_B(cB);
    covC.add(tCcC);
    covA.add(tCcA);
    covB.add(tCcB);
    auto ta = copy_a.get_thread_slice(t);
    auto tb = copy_b.get_thread_slice(t);
    auto tc = copy_c.get_thread_slice(t);
    if (t % 32 < kSourceLanes<CopyAtomA>) { cpyA.add(ta.partition_S(cA)); }
    if (t % 32 < kSourceLanes<CopyAtomB>) { cpyB.add(tb.partition_S(cB)); }
    // The coordinate a copy delivers into register slot i (its D partition) against the coordinate the MMA
    // reads from the register that slot is (retile_D of the MMA's own partition).
    a_pairs = a_pairs && same_coords(ta.partition_D(cA), ta.retile_D(tCcA));
    b_pairs = b_pairs && same_coords(tb.partition_D(cB), tb.retile_D(tCcB));
    c_pairs = c_pairs && same_coords(tc.partition_D(cC), tc.retile_S(tCcC));
  }
  CHECK(covC.exactly(1), "%s: C partition does not cover the %dx%d output exactly once", name.c_str(), R, C);
  CHECK(covA.exactly(warps_c), "%s: A partition is not read once per column warp (%d)", name.c_str(), warps_c);
  CHECK(covB.exactly(warps_r), "%s: B partition is not read once per row warp (%d)", name.c_str(), warps_r);
  CHECK(cpyA.exactly(warps_c), "%s: smem->reg copy of A does not match the A coverage", name.c_str());
  CHECK(cpyB.exactly(warps_r), "%s: smem->reg copy of B does not match the B coverage", name.c_str());
  CHECK(a_pairs, "%s: the A copy fills registers with other coordinates than the MMA reads", name.c_str());
  CHECK(b_pairs, "%s: the B copy fills registers with other coordinates than the MMA reads", name.c_str());
  CHECK(c_pairs, "%s: the C store copy writes registers to other coordinates than they hold", name.c_str());
}

// L2 (cols x rows) is the transpose of L1 (rows x cols): same offsets.
template <class L1, class L2>
bool is_transpose(L1 const& l1, L2 const& l2) {
  for (int r = 0; r < int(size<0>(l1)); ++r) {
    for (int c = 0; c < int(size<1>(l1)); ++c) {
      if (int(l1(r, c)) != int(l2(c, r))) { return false; }
    }
  }
  return true;
}

template <class Traits>
void check_traits(std::string const& name, int warps_m_sdp, int warps_n_dkv, int warps_m_dq) {
  constexpr int M = Traits::kBlockM, N = Traits::kBlockN, D = Traits::kHeadDim, T = Traits::kNThreads;
  int const w = Traits::kNWarps;
  using E = typename Traits::Element;
  using P = typename Traits::ElementPdS;
  // S = Q.K^T, dP = dO.V^T: A = Q/dO (M, D), B = K/V (N, D).
  check_mma<typename Traits::TiledMmaSdP, typename Traits::SmemCopyAtom, typename Traits::SmemCopyAtomSdPB,
            typename Traits::SmemCopyAtomStorePdS, M, N, D>(name + " S/dP", T, warps_m_sdp, w / warps_m_sdp);
  // dV = P^T.dO, dK = dS^T.Q: A = P^T/dS^T (N, M), B = dO^T/Q^T (D, M).
  check_mma<typename Traits::TiledMmadKV, typename Traits::SmemCopyAtomPdSTransposed,
            typename Traits::SmemCopyAtomTransposed, typename Traits::SmemCopyAtomdKV, N, D, M>(
      name + " dK/dV", T, warps_n_dkv, w / warps_n_dkv);
  // dQ = dS.K: A = dS (M, N), B = K^T (D, N).  (The C copy is unused: dQ goes to HBM from registers.)
  check_mma<typename Traits::TiledMmadQ, typename Traits::SmemCopyAtomPdS, typename Traits::SmemCopyAtomTransposed,
            typename Traits::SmemCopyAtomdKV, M, D, N>(name + " dQ", T, warps_m_dq, w / warps_m_dq);

  CHECK(is_transpose(typename Traits::SmemLayoutQdO{}, typename Traits::SmemLayoutQdOt{}), "%s: Q^T view", name.c_str());
  CHECK(is_transpose(typename Traits::SmemLayoutKV{}, typename Traits::SmemLayoutKt{}), "%s: K^T view", name.c_str());
  CHECK(is_transpose(typename Traits::SmemLayoutPdS{}, typename Traits::SmemLayoutPdSt{}), "%s: P^T view", name.c_str());

  Coverage gQ(M, D), gK(N, D), gdK(N, D);
  typename Traits::GmemTiledCopyQKV gmem_copy;
  typename Traits::GmemTiledCopydKV gmem_copy_dkv;
  for (int t = 0; t < T; ++t) {
    gQ.add(gmem_copy.get_thread_slice(t).partition_S(make_identity_tensor(Shape<Int<M>, Int<D>>{})));
    gK.add(gmem_copy.get_thread_slice(t).partition_S(make_identity_tensor(Shape<Int<N>, Int<D>>{})));
    gdK.add(gmem_copy_dkv.get_thread_slice(t).partition_D(make_identity_tensor(Shape<Int<N>, Int<D>>{})));
  }
  CHECK(gQ.exactly(1) && gK.exactly(1) && gdK.exactly(1), "%s: a global<->shared copy misses or repeats elements",
        name.c_str());

  int const expect = (Traits::kDoubleBufferQ ? 3 : 2) * M * D * int(sizeof(E)) + 2 * N * D * int(sizeof(E)) +
                     2 * M * N * int(sizeof(P));
  CHECK(Traits::kSmemBytes == expect, "%s: kSmemBytes %d != %d", name.c_str(), Traits::kSmemBytes, expect);
  std::printf("ok %-40s threads=%3d smem=%6d B\n", name.c_str(), T, Traits::kSmemBytes);
}

template <int kHeadDim, class Element>
void check_gpu_config() {
  constexpr auto c = flash_ext::sm80_bwd_tile_config(kHeadDim);
  using Traits = flash_ext::Sm80BwdTraits<kHeadDim, c.block_m, c.block_n, c.num_warps, c.atom_m_sdp, c.atom_n_dkv,
                                          c.atom_m_dq, c.double_buffer_q, Element>;
  char name[96];
  std::snprintf(name, sizeof(name), "Sm80 bwd hd%d %s %dx%d w%d", kHeadDim,
                std::is_same_v<Element, cutlass::half_t> ? "fp16" : "bf16", c.block_m, c.block_n, c.num_warps);
  check_traits<Traits>(name, c.atom_m_sdp, c.atom_n_dkv, c.atom_m_dq);
  CHECK(Traits::kSmemBytes == flash_ext::bwd_tile_smem_bytes(c, kHeadDim), "%s: smem differs from dispatch_bwd.h", name);
  CHECK(Traits::kSmemBytes <= int(flash_ext::SmemBudget::kSm86), "%s: exceeds 99 KB", name);
}

template <int kHeadDim>
void check_head_dim() {
  check_gpu_config<kHeadDim, cutlass::half_t>();
  check_gpu_config<kHeadDim, cutlass::bfloat16_t>();
  char name[64];
  std::snprintf(name, sizeof(name), "Host bwd hd%d bf16 64x64", kHeadDim);
  check_traits<flash_ext::HostBwdTraits<kHeadDim, 64, 64, cutlass::bfloat16_t>>(name, 1, 1, 1);
}

int main() {
  check_head_dim<32>();
  check_head_dim<64>();
  check_head_dim<96>();
  check_head_dim<128>();
  check_head_dim<192>();
  check_head_dim<256>();
  return check_summary();
}
