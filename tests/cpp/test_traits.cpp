// Host checks of the GPU traits' tile partitions, run without a GPU: every tiled copy and the tiled MMA
// cover each tile element exactly once (operands shared by the warps: once per warp); each accumulator row is owned by one quad (the group that
// Sm80Traits::row_allreduce combines); P's accumulator registers re-viewed as an A operand hold exactly the
// (row, key) coordinates the P.V MMA expects; shared memory fits and matches what the launcher requests.
// The host traits get the same checks, so the degenerate single-thread instance is held to one standard.
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "flash_ext/dispatch.h"
#include "flash_ext/gemm.h"
#include "flash_ext/traits_host.h"
#include "flash_ext/traits_sm80.h"
#include "check.h"

using namespace cute;


using Coord = std::pair<int, int>;

// Counts how often each (row, col) of an R x C tile appears in per-thread partitions.
struct Coverage {
  int rows, cols;
  std::vector<int> count;
  Coverage(int r, int c) : rows(r), cols(c), count(r * c, 0) {}
  template <class T>
  void add(T const& part) {
    for (int i = 0; i < size(part); ++i) {
      auto c = part(i);
      int r = int(get<0>(c)), k = int(get<1>(c));
      if (r >= 0 && r < rows && k >= 0 && k < cols) { ++count[r * cols + k]; } else { count[0] += 1000; }
    }
  }
  bool exactly(int n) const {
    for (int x : count) {
      if (x != n) { return false; }
    }
    return true;
  }
  bool exactly_once() const { return exactly(1); }
};

template <class Traits>
void check_traits(const char* name, int smem_limit_bytes) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kThreads = Traits::kNThreads;
  typename Traits::TiledMma tiled_mma;
  CHECK(int(size(tiled_mma)) == kThreads, "%s: TiledMma has %d threads, traits say %d", name, int(size(tiled_mma)), kThreads);

  auto cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  auto cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  auto cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  auto cK = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});
  auto cVt = make_identity_tensor(Shape<Int<kHeadDim>, Int<kBlockN>>{});

  // 1. The MMA's C, A and B partitions of S = Q.K^T and O = P.V each cover their tile exactly once.
  Coverage covS(kBlockM, kBlockN), covO(kBlockM, kHeadDim), covQ(kBlockM, kHeadDim), covK(kBlockN, kHeadDim),
      covVt(kHeadDim, kBlockN);
  // 2. Row ownership of the S accumulator, for the allreduce groups.
  std::map<int, std::set<int>> row_owners;
  bool p_matches_a = true;
  for (int t = 0; t < kThreads; ++t) {
    auto thr_mma = tiled_mma.get_thread_slice(t);
    auto tScS = thr_mma.partition_C(cS);
    covS.add(tScS);
    covO.add(thr_mma.partition_C(cO));
    covQ.add(thr_mma.partition_A(cQ));
    covK.add(thr_mma.partition_B(cK));
    covVt.add(thr_mma.partition_B(cVt));
    auto rc = flash_ext::acc_rowcol<Traits::kAccValCols>(tScS);
    for (int i = 0; i < size<0>(rc); ++i) {
      int const row = int(get<0>(rc(i, 0)));
      for (int j = 0; j < size<1>(rc); ++j) {
        CHECK(int(get<0>(rc(i, j))) == row, "%s: thread %d row view (%d,%d) mixes rows", name, t, i, j);
      }
      row_owners[row].insert(t);
    }
    // 3. P in registers: the accumulator of S re-viewed by acc_to_a_layout must hold, register for
    //    register, the (m, k) coordinates the A operand of P.V has (k = key index).
    auto p_as_a = make_tensor(tScS.data(), Traits::acc_to_a_layout(tScS.layout()));
    auto a_part = thr_mma.partition_A(cS);  // A of P.V is (BLK_M, BLK_N)
    if (size(p_as_a) != size(a_part)) { p_matches_a = false; }
    for (int i = 0; i < size(a_part) && p_matches_a; ++i) {
      auto x = p_as_a(i);
      auto y = a_part(i);
      if (int(get<0>(x)) != int(get<0>(y)) || int(get<1>(x)) != int(get<1>(y))) { p_matches_a = false; }
    }
  }
  CHECK(covS.exactly_once(), "%s: MMA C partition of S does not cover the tile exactly once", name);
  CHECK(covO.exactly_once(), "%s: MMA C partition of O does not cover the tile exactly once", name);
  // Warps are stacked along M: each owns its rows of Q and P (once) and reads all of K and V (once per warp).
  CHECK(covQ.exactly_once(), "%s: MMA A partition of Q does not cover the tile exactly once", name);
  CHECK(covK.exactly(Traits::kNWarps), "%s: MMA B partition of K is not read once per warp", name);
  CHECK(covVt.exactly(Traits::kNWarps), "%s: MMA B partition of V^T is not read once per warp", name);
  CHECK(p_matches_a, "%s: P accumulator registers do not line up with the A operand of P.V", name);
  for (auto const& [row, owners] : row_owners) {
    if (Traits::kIsHost) {
      CHECK(owners.size() == 1, "%s: row %d has %zu owners on the host", name, row, owners.size());
    } else {
      // Exactly one quad {4g, 4g+1, 4g+2, 4g+3}: the lanes that xor-shuffles over bits 0 and 1 combine.
      int const g = *owners.begin() / 4;
      bool one_quad = owners.size() == 4;
      for (int t : owners) { one_quad = one_quad && t / 4 == g; }
      CHECK(one_quad, "%s: row %d is not owned by exactly one quad (%zu owners)", name, row, owners.size());
    }
  }

  // 4. Global->shared copies (Q, K/V, O) cover their tiles exactly once.
  Coverage gQ(kBlockM, kHeadDim), gK(kBlockN, kHeadDim), gOut(kBlockM, kHeadDim);
  typename Traits::GmemTiledCopyQKV gmem_copy;
  typename Traits::GmemTiledCopyO gmem_copy_o;
  for (int t = 0; t < kThreads; ++t) {
    gQ.add(gmem_copy.get_thread_slice(t).partition_S(cQ));
    gK.add(gmem_copy.get_thread_slice(t).partition_S(cK));
    gOut.add(gmem_copy_o.get_thread_slice(t).partition_D(cO));
  }
  CHECK(gQ.exactly_once(), "%s: gmem copy of Q does not cover the tile exactly once", name);
  CHECK(gK.exactly_once(), "%s: gmem copy of K/V does not cover the tile exactly once", name);
  CHECK(gOut.exactly_once(), "%s: gmem copy of O does not cover the tile exactly once", name);

  // 5. Shared->register copies (ldmatrix on the GPU) read each element of their operand exactly once per
  //    full pass, and write the same register slots the MMA partitions expect.
  Coverage sQ(kBlockM, kHeadDim), sK(kBlockN, kHeadDim), sVt(kHeadDim, kBlockN), sO(kBlockM, kHeadDim);
  auto copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  for (int t = 0; t < kThreads; ++t) {
    sQ.add(copy_q.get_thread_slice(t).partition_S(cQ));
    sK.add(copy_k.get_thread_slice(t).partition_S(cK));
    sVt.add(copy_v.get_thread_slice(t).partition_S(cVt));
    sO.add(copy_o.get_thread_slice(t).partition_D(cO));
  }
  CHECK(sQ.exactly_once(), "%s: smem->reg copy of Q does not cover the tile exactly once", name);
  CHECK(sK.exactly(Traits::kNWarps), "%s: smem->reg copy of K is not read once per warp", name);
  CHECK(sVt.exactly(Traits::kNWarps), "%s: smem->reg copy of V^T is not read once per warp", name);
  CHECK(sO.exactly_once(), "%s: reg->smem copy of O does not cover the tile exactly once", name);

  // 6. Shared memory: Q + K + V tiles, O fits in the Q tile, and the total fits the architecture.
  using E = typename Traits::Element;
  int const expect = (kBlockM + 2 * kBlockN) * kHeadDim * int(sizeof(E));
  CHECK(Traits::kSmemBytes == expect, "%s: kSmemBytes %d != (M + 2N) * D * sizeof = %d", name, Traits::kSmemBytes, expect);
  CHECK(Traits::kSmemBytes <= smem_limit_bytes, "%s: %d bytes of shared memory exceed the limit %d", name,
        Traits::kSmemBytes, smem_limit_bytes);
  // 7. Host accumulators (S, O) start on a cache line and their columns stay whole lines apart, so the
  //    micro-kernels' 64-byte vectors and AMX tile rows never straddle two lines.  A stack object of 16-byte
  //    alignment (cute's array) ahead of them once put S and O 48 bytes past a line.
  if constexpr (Traits::kIsHost) {
    volatile char before[16] = {};
    auto acc_s = flash_ext::make_acc_fragment<Traits>(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    volatile char between[16] = {};
    auto acc_o = flash_ext::make_acc_fragment<Traits>(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    CHECK(alignof(decltype(acc_s)) >= 64 && alignof(decltype(acc_o)) >= 64, "%s: host accumulators %zu-byte aligned",
          name, alignof(decltype(acc_s)));
    for (auto const* acc : {&acc_s(0), &acc_o(0)}) {
      CHECK(reinterpret_cast<uintptr_t>(acc) % 64 == 0, "%s: host accumulator at %p, not on a 64-byte line", name,
            static_cast<void const*>(acc));
    }
    int64_t const ld_s = int64_t(stride<2>(acc_s.layout())), ld_o = int64_t(stride<2>(acc_o.layout()));
    CHECK(ld_s * 4 % 64 == 0 && ld_o * 4 % 64 == 0, "%s: host accumulator column strides %lld, %lld floats", name,
          (long long)ld_s, (long long)ld_o);
    (void)before[0], (void)between[0];
    // The Q fragment (make_a_fragment): on a line, its columns an odd number of lines apart from 64 rows up (a
    // 512-byte stride put a register block's lines into 8 of L1's 64 sets), and the widening copy from sQ
    // (column by column on the host) leaves Q(m, k) at the fragment's (m, k), every element written.
    {
      static E q_smem[cosize_v<typename Traits::SmemLayoutQ>];
      Tensor sQt = make_tensor(make_smem_ptr(q_smem), typename Traits::SmemLayoutQ{});  // (BLK_M,BLK_K)
      for (int m = 0; m < kBlockM; ++m) {
        for (int k = 0; k < kHeadDim; ++k) { sQt(m, k) = E(float((m * 7 + k * 3) % 61 - 30)); }
      }
      auto thr_mma = tiled_mma.get_thread_slice(0);
      Tensor tSrQ = flash_ext::make_a_fragment<Traits>(thr_mma, sQt);  // (MMA,MMA_M,MMA_K)
      auto smem_thr_copy_Q = copy_q.get_thread_slice(0);
      for (int i = 0; i < int(size(tSrQ)); ++i) { tSrQ(i) = -1000.f; }  // poisoned: a missed element shows
      copy(copy_q, smem_thr_copy_Q.partition_S(sQt), smem_thr_copy_Q.retile_D(tSrQ));
      int64_t const ld_q = int64_t(stride<2>(tSrQ.layout()));
      CHECK(reinterpret_cast<uintptr_t>(&tSrQ(0)) % 64 == 0 && (kBlockM < 64 || ld_q * 4 % 128 == 64),
            "%s: host Q fragment at %p, column stride %lld floats", name, static_cast<void const*>(&tSrQ(0)),
            (long long)ld_q);
      int wrong = 0;
      for (int m = 0; m < kBlockM; ++m) {
        for (int k = 0; k < kHeadDim; ++k) { wrong += tSrQ(0, m, k) != float((m * 7 + k * 3) % 61 - 30); }
      }
      CHECK(wrong == 0, "%s: %d elements of the host Q fragment differ from sQ after the copy", name, wrong);
    }
    // The host's whole-tile score mask (mask_scores) takes fragment (i, j) as tile (i, j): the coordinates that
    // ScoreMask::apply reads from the partitioned identity must be that.
    auto tScS = flash_ext::acc_rowcol<Traits::kAccValCols>(tiled_mma.get_thread_slice(0).partition_C(cS));
    int off = 0;
    for (int i = 0; i < int(size<0>(tScS)); ++i) {
      for (int j = 0; j < int(size<1>(tScS)); ++j) { off += int(get<0>(tScS(i, j))) != i || int(get<1>(tScS(i, j))) != j; }
    }
    CHECK(size<0>(tScS) == kBlockM && size<1>(tScS) == kBlockN && off == 0,
          "%s: the host S fragment's (row, col) view is not the tile's own (%d coordinates differ)", name, off);
  }
  std::printf("ok %-44s threads=%3d smem=%6d B\n", name, kThreads, Traits::kSmemBytes);
}

// Launch configuration: the launcher requests Traits::kSmemBytes; sm_80 and sm_90 allow 163 KB and 227 KB
// of dynamic shared memory per block, sm_86/89 99 KB (their own budget in dispatch.h).  Each static variant
// has its own tile (dispatch.h: warps per variant, and for some the causal flag); a config shared with an
// earlier variant of the same file is checked once.
template <int kHeadDim, class Element, flash_ext::SmemBudget kBudget, bool kCausal, int kVariant = 0>
void check_gpu_config() {
  constexpr auto tile = flash_ext::sm80_tile_config(kHeadDim, kVariant, kCausal, kBudget);
  constexpr bool seen = [tile] {
    for (int v = 0; v < kVariant; ++v) {
      if (flash_ext::sm80_tile_config(kHeadDim, v, kCausal, kBudget) == tile) { return true; }
    }
    return false;
  }();
  if constexpr (!seen) {
    using Traits = flash_ext::Sm80Traits<kHeadDim, tile.block_m, tile.block_n, tile.num_warps, Element>;
    char name[112];
    std::snprintf(name, sizeof(name), "Sm80 hd%d %s %dx%d w%d budget %dK (from variant %s%s)", kHeadDim,
                  std::is_same_v<Element, cutlass::half_t> ? "fp16" : "bf16", tile.block_m, tile.block_n,
                  tile.num_warps, int(kBudget) / 1024, flash_ext::kVariants[kVariant].name, kCausal ? ", causal" : "");
    check_traits<Traits>(name, int(kBudget));
    CHECK(Traits::kSmemBytes <= 227 * 1024, "%s: exceeds sm_90's 227 KB", name);
  }
  if constexpr (kVariant + 1 < flash_ext::kNumVariants) { check_gpu_config<kHeadDim, Element, kBudget, kCausal, kVariant + 1>(); }
}

template <int kHeadDim>
void check_head_dim() {
  using flash_ext::SmemBudget;
  check_gpu_config<kHeadDim, cutlass::bfloat16_t, SmemBudget::kSm80, false>();
  check_gpu_config<kHeadDim, cutlass::bfloat16_t, SmemBudget::kSm80, true>();
  check_gpu_config<kHeadDim, cutlass::half_t, SmemBudget::kSm80, false>();
  check_gpu_config<kHeadDim, cutlass::bfloat16_t, SmemBudget::kSm86, false>();
  check_gpu_config<kHeadDim, cutlass::bfloat16_t, SmemBudget::kSm86, true>();
  char name[64];
  std::snprintf(name, sizeof(name), "Host hd%d bf16 128x64", kHeadDim);
  check_traits<flash_ext::HostTraits<kHeadDim, 128, 64, cutlass::bfloat16_t>>(name, 1 << 30);
  std::snprintf(name, sizeof(name), "Host hd%d bf16 16x64 (short queries)", kHeadDim);
  check_traits<flash_ext::HostTraits<kHeadDim, 16, 64, cutlass::bfloat16_t>>(name, 1 << 30);
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
