// The host micro-kernels of every instruction-set level this build contains and this CPU can run
// (host_isa.h), each against a plain scalar reference, without torch: the GEMM over operand types, strides,
// ragged sizes and chunked depths; the online-softmax step over first/later tiles, masked (-inf) rows and
// NaN, in double and against softmax.h's own OnlineSoftmax::rescale_o (the code it stands in for on the
// host: a change to one that the other lacks fails here); the fp32 -> bf16/fp16 conversion bit for bit
// against cutlass's.  Levels the CPU lacks are reported
// as skipped with the missing feature; an extra level (test_host_isa_emulated) runs the 16-lane AVX-512
// kernel source on AVX2, bf16 dot products emulated, so that its blocking is exercised on any x86-64 CPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include <cutlass/numeric_types.h>

#include "flash_ext/host_isa.h"
#include "flash_ext/mask.h"
#include "flash_ext/softmax.h"
#include "flash_ext/traits_host.h"
#include "check.h"
#include "test_window.h"

namespace flash_ext {
HostKernels const* host_kernels_avx512_emulated();  // tests/cpp/host_isa_emulated.cpp (x86-64 only)
HostKernels const* host_kernels_amx_emulated();     // tests/cpp/host_isa_emulated_amx.cpp (x86-64 only)
HostKernels const* host_kernels_avx512_plain_emulated();  // tests/cpp/host_isa_emulated_avx512.cpp (x86-64 only)
}

using namespace flash_ext;


namespace {

std::mt19937 g_rng(42);

float bf16_round(float x) { return float(cutlass::bfloat16_t(x)); }

// Operand storage of one type, with an fp32 copy of the exact values it holds.
struct Operand {
  HostDType type;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  std::vector<float> value;  // what the stored element means, as fp32
  void const* ptr() const { return type == HostDType::kF32 ? static_cast<void const*>(f32.data()) : u16.data(); }
};

Operand make_operand(HostDType t, int64_t n) {
  std::normal_distribution<float> nd;
  Operand o{t, {}, {}, std::vector<float>(n)};
  if (t == HostDType::kF32) { o.f32.resize(n); } else { o.u16.resize(n); }
  for (int64_t i = 0; i < n; ++i) {
    float const x = nd(g_rng);
    if (t == HostDType::kF32) {
      o.f32[i] = o.value[i] = x;
    } else if (t == HostDType::kBF16) {
      cutlass::bfloat16_t const h(x);
      o.u16[i] = h.raw(), o.value[i] = float(h);
    } else {
      cutlass::half_t const h(x);
      o.u16[i] = h.raw(), o.value[i] = float(h);
    }
  }
  return o;
}

char const* type_name(HostDType t) { return t == HostDType::kF32 ? "f32" : t == HostDType::kBF16 ? "bf16" : "f16"; }

struct GemmCase {
  HostDType a_type, b_type;
  int rows, cols, depth;
  bool a_col_major;  // else row-major (a_ms = depth)
  bool b_k_contiguous;
  // B's rows several rows apart, not just padded (as in a (seq, heads, dim) tensor): the widened span then
  // outgrows the scratch at the larger shapes, so the GEMM's chunking is exercised too.
  bool b_wide = false;
  bool overwrite = false;  // C = A . B^T: C's prior contents (NaN here) must not be read
  // Through an A cache (HostGemmArgs::a_cache): first holding a stale entry (A's address, but packed for other
  // rows, over garbage), which must be repacked, not used; then again from what the first call left there.
  bool cached = false;
  // Through a B cache (HostGemmArgs::b_cache): holding a decoy entry first (B's address with another layout,
  // over bf16 infs), which must not be found; the first call packs B into it, the second must find that.
  bool b_cached = false;
  // The bound on the error relative to the sum of the products' magnitudes (and C's).
  double tolerance = 1e-5;
};

void check_gemm(HostKernels const& k, GemmCase const& gc) {
  int const rows_alloc = (gc.rows + 15) / 16 * 16;
  // Strides that are not the dense ones, except with B's rows far apart: then A's columns are exactly the
  // rows apart (the host tiles' own strides, e.g. 512 bytes at 128 rows), which the AVX-512 levels pack
  // rather than read in place (kernels.h, a_crowds_l1): both ways are checked.
  int64_t const lda_pad = gc.b_wide ? 0 : 3;
  int64_t const a_ms = gc.a_col_major ? 1 : gc.depth + lda_pad;
  int64_t const a_ks = gc.a_col_major ? rows_alloc + lda_pad : 1;
  int64_t const b_ns = gc.b_k_contiguous ? (gc.b_wide ? 3 * gc.depth + 8 : gc.depth + 2) : 1;
  int64_t const b_ks = gc.b_k_contiguous ? 1 : (gc.b_wide ? 4 * gc.cols + 8 : gc.cols + 5);
  Operand const a = make_operand(gc.a_type, a_ms * (rows_alloc - 1) + a_ks * (gc.depth - 1) + 1);
  Operand const b = make_operand(gc.b_type, b_ns * (gc.cols - 1) + b_ks * (gc.depth - 1) + 1);
  int64_t const ldc = rows_alloc + 8;
  std::vector<float> c(ldc * (gc.cols + 1), 0.f);
  std::normal_distribution<float> nd;
  for (auto& x : c) { x = nd(g_rng); }
  if (gc.overwrite) {
    for (int n = 0; n < gc.cols; ++n) {
      for (int m = 0; m < rows_alloc; ++m) { c[m + n * ldc] = NAN; }
    }
  }
  std::vector<float> const c0 = c;
  // The largest packed A any level keeps: bf16 pairs of the rows over whole 32-deep steps, once per bf16 piece
  // where a product is split (up to 3: fp32).
  std::vector<uint32_t> packed(size_t(rows_alloc) * ((gc.depth + 31) / 32 * 16) * 3, 0x7f807f80u);  // bf16 pairs of inf
  HostPackCache cache{packed.data(), int64_t(packed.size() * sizeof(uint32_t)), a.ptr(), rows_alloc + 16, gc.depth,
                      true};
  // Room for B packed as any level keeps it (rows of cols, depth in 32-deep steps, bf16; up to 3 times that
  // split) after the decoy's.
  int64_t const b_packed_bytes = int64_t(gc.cols + 32) * ((gc.depth + 31) / 32 * 32) * 2 * 3;
  std::vector<uint16_t> tiles(size_t(2 * b_packed_bytes / 2 + 64), 0x7f80u);
  HostTileCache::Entry entries[2] = {{b.ptr(), b_ks, b_ns, gc.cols, gc.depth, 0}};
  HostTileCache b_cache{tiles.data(), int64_t(tiles.size() * 2), (b_packed_bytes + 63) / 64 * 64, entries, 2, 1};
  HostGemmArgs const g{c.data(), ldc,  a.ptr(),  gc.a_type, a_ms,         a_ks,         b.ptr(),
                       gc.b_type, b_ns, b_ks,     gc.rows,   gc.cols,     gc.depth,     gc.overwrite,
                       gc.cached ? &cache : nullptr, gc.b_cached ? &b_cache : nullptr};
  for (int call = 0; call < (gc.cached || gc.b_cached ? 2 : 1); ++call) {
  if (call == 1) { c = c0; }
  k.gemm(g);
  if (gc.b_cached && call == 0) {  // a level that keeps B packed it once, past the decoy
    CHECK(b_cache.count <= 2 && (b_cache.count == 1 || b_cache.entries[1].key == b.ptr()),
          "%s gemm: B cache holds %d entries after one GEMM", k.name, b_cache.count);
    // And one that reads such K/V tiles in place keeps every whole tile it multiplies by tiles.
    bool const keeps = (gc.b_type == HostDType::kBF16  ? k.bf16_kv_in_place
                        : gc.b_type == HostDType::kF16 ? k.f16_kv_in_place
                                                       : k.f32_kv_in_place) &&
                       (gc.b_type == HostDType::kBF16 || gc.rows > 16) && gc.cols >= 16 && gc.depth <= 256;
    CHECK(!keeps || b_cache.count == 2, "%s gemm b=%s %dx%dx%d: B not kept in the cache", k.name,
          type_name(gc.b_type), gc.rows, gc.cols, gc.depth);
  }
  // A level with bf16 dot products rounds both operands of a bf16-B product to bf16.
  bool const rounds = (k.isa == HostIsa::kAvx512Bf16 || k.isa == HostIsa::kAmxBf16) && gc.b_type == HostDType::kBF16 && gc.a_type != HostDType::kF16;
  double max_err = 0;
  bool nan_seen = false;
  bool untouched_ok = true;
  for (int n = 0; n < gc.cols + 1; ++n) {
    for (int m = 0; m < ldc; ++m) {
      float const got = c[m + n * ldc];
      if (n == gc.cols || m >= rows_alloc) {  // columns >= cols and rows past the allocation: untouched
        untouched_ok = untouched_ok && got == c0[m + n * ldc];
        continue;
      }
      if (m >= gc.rows) { continue; }  // rows up to the vector boundary: unspecified
      double ref = gc.overwrite ? 0. : c0[m + n * ldc], mag = std::fabs(ref);
      for (int kk = 0; kk < gc.depth; ++kk) {
        double av = a.value[m * a_ms + kk * a_ks], bv = b.value[n * b_ns + kk * b_ks];
        if (rounds) { av = bf16_round(float(av)), bv = bf16_round(float(bv)); }
        ref += av * bv;
        mag += std::fabs(av * bv);
      }
      double const err = std::fabs(got - ref) / (mag + 1e-6);
      if (std::isnan(err)) {
        nan_seen = true;  // std::max would drop it
      } else {
        max_err = std::max(max_err, err);
      }
    }
  }
  CHECK(untouched_ok, "%s gemm a=%s b=%s %dx%dx%d: wrote outside its columns/rows", k.name, type_name(gc.a_type),
        type_name(gc.b_type), gc.rows, gc.cols, gc.depth);
  // fp32 accumulation of |terms|: a few ulps of the magnitude sum.  The AMX level's split fp16 and fp32
  // products (kernels.h: at most ~2^-15 and ~2^-23 relative per product in the worst case, far less on
  // average) are held to the same bound on these random operands, which a left-out product of pieces of
  // order 1 (~2^-9) fails; fp32's products of order 2 (~2^-18) are held by the single-product cases.
  char const* const b_layout = gc.b_k_contiguous ? (gc.b_wide ? "(k-contig, wide)" : "(k-contig)")
                                                 : (gc.b_wide ? "(n-contig, wide)" : "(n-contig)");
  CHECK(!nan_seen && max_err < gc.tolerance, "%s gemm%s%s%s a=%s%s b=%s%s %dx%dx%d: relative error %.3g%s", k.name,
        gc.overwrite ? " (overwrite)" : "", gc.cached ? (call == 0 ? " (stale cache)" : " (cached A)") : "",
        gc.b_cached ? (call == 0 ? " (B packed)" : " (cached B)") : "",
        type_name(gc.a_type), gc.a_col_major ? "(col)" : "(row)", type_name(gc.b_type), b_layout, gc.rows, gc.cols,
        gc.depth, max_err, nan_seen ? ", NaN results" : "");
  }
}

void check_gemms(HostKernels const& k) {
  HostDType const types[] = {HostDType::kF32, HostDType::kBF16, HostDType::kF16};
  int const shapes[][3] = {{128, 64, 64}, {16, 64, 256}, {128, 256, 64}, {4, 7, 5}, {33, 13, 40}, {16, 1, 1},
                           {128, 70, 300}, {48, 300, 70}, {128, 40, 128},
                           // few rows (decode), the vectors along B: whole and partial column vectors,
                           // depth past one chunk of the dot products, rows up to AVX-512's 8 (the bf16
                           // dot products up to 6: both sides of that bound), a depth tail short of a vector
                           {1, 64, 128}, {3, 130, 64}, {2, 37, 1040}, {4, 9, 16}, {5, 64, 48}, {8, 40, 24},
                           {6, 33, 80}, {7, 48, 96},
                           // few rows against whole 32-column blocks of n-contiguous B (the AMX level's decode
                           // P.V, tiles_few_rows_pv): 64- and 32-column groups, an odd depth, d = 256, A's
                           // scratch just filled (depth 512) and just exceeded (the C^T path instead)
                           {4, 128, 128}, {12, 96, 37}, {16, 256, 160}, {2, 32, 300}, {9, 64, 512}, {3, 64, 513}};
  int n = 0;
  for (HostDType at : types) {
    for (HostDType bt : types) {
      for (int si = 0; si < int(sizeof(shapes) / sizeof(shapes[0])); ++si) {
        auto const& s = shapes[si];
        for (int layout = 0; layout < 8; ++layout) {
          // Overwriting on every other shape and layout: each layout and each shape both ways.
          check_gemm(k, GemmCase{at, bt, s[0], s[1], s[2], (layout & 1) == 0, (layout & 2) == 0, (layout & 4) != 0,
                                 ((layout ^ si) & 1) != 0});
          ++n;
        }
      }
    }
  }
  // Q.K^T's A cache: fp32 column-major A (the Q fragment), bf16 K with its rows a head apart, overwriting.
  int const cached_shapes[][3] = {{128, 128, 64}, {128, 128, 128}, {16, 128, 128}, {128, 128, 256}, {48, 300, 70},
                                  {128, 64, 96},  {4, 7, 5},       {33, 13, 40}};
  // And the fp16 and fp32 forwards': Q and K of one type, which the AMX level splits into 2 or 3 bf16 pieces.
  for (auto const& s : cached_shapes) {
    for (bool wide : {false, true}) {
      check_gemm(k, GemmCase{HostDType::kF32, HostDType::kBF16, s[0], s[1], s[2], true, true, wide, true, true});
      check_gemm(k, GemmCase{HostDType::kF16, HostDType::kF16, s[0], s[1], s[2], true, true, wide, true, true});
      check_gemm(k, GemmCase{HostDType::kF32, HostDType::kF32, s[0], s[1], s[2], true, true, wide, true, true});
      n += 3;
    }
  }
  // The prefill's K/V tile cache: K (k-contiguous, rows a head apart) with Q's A cache, and V (n-contiguous)
  // under P (fp32, column-major), whole tiles and ragged ones.
  int const b_cached_shapes[][3] = {{128, 128, 64}, {128, 128, 128}, {128, 128, 256}, {128, 64, 128}, {48, 300, 70},
                                    {128, 256, 128}, {33, 13, 40}};
  // The same for fp16 and fp32 K/V (split where the level splits them), under Q of their type and fp32 P.
  for (auto const& s : b_cached_shapes) {
    for (bool k_contiguous : {true, false}) {  // K under Q.K^T (overwriting, Q cached), else V under P.V
      for (HostDType kv : {HostDType::kBF16, HostDType::kF16, HostDType::kF32}) {
        HostDType const a = kv == HostDType::kF16 && k_contiguous ? HostDType::kF16 : HostDType::kF32;
        check_gemm(k, GemmCase{.a_type = a, .b_type = kv, .rows = s[0], .cols = s[1], .depth = s[2],
                               .a_col_major = true, .b_k_contiguous = k_contiguous, .b_wide = k_contiguous,
                               .overwrite = k_contiguous, .cached = k_contiguous, .b_cached = true});
        ++n;
      }
    }
  }
  // Single products (depth 1-2, overwriting), each held to its own bound: fp32 x fp32 within 1e-6 (exact on the
  // FMA levels; AMX's 3-piece split within ~2^-23, where a left-out product of pieces of order 2 would cost
  // ~2^-18 on average), fp16 B within 4e-5 (AMX's 2-piece split: at most 2^-15 with an fp32 A).  With and
  // without a B cache: AMX splits fp32 only where B is a tile kept packed (kernels.h, gemm).
  int const single_shapes[][3] = {{32, 32, 1}, {48, 64, 2}, {128, 48, 1}};
  struct Single {
    HostDType a, b;
    double tolerance;
  };
  Single const singles[] = {{HostDType::kF32, HostDType::kF32, 1e-6},
                            {HostDType::kF16, HostDType::kF16, 4e-5},
                            {HostDType::kF32, HostDType::kF16, 4e-5}};
  for (auto const& s : single_shapes) {
    for (Single const& t : singles) {
      for (bool col_major : {true, false}) {
        for (bool b_cached : {false, true}) {
          check_gemm(k, GemmCase{.a_type = t.a, .b_type = t.b, .rows = s[0], .cols = s[1], .depth = s[2],
                                 .a_col_major = col_major, .b_k_contiguous = !col_major, .overwrite = true,
                                 .b_cached = b_cached, .tolerance = t.tolerance});
          ++n;
        }
      }
    }
  }
  std::printf("  gemm: %d cases\n", n);
}

// The online-softmax step (HostSoftmaxArgs), its contract written per row in double: the reference a row
// takes its probabilities against (row_max) stays put unless a score of the tile exceeds it by more than
// kHostSoftmaxSlack (exp2 domain), and then becomes the row's running maximum; probabilities, sums and O
// are relative to it (O's factor since the first tile: the product of the corrections).
// o_cols: 48, O's columns whole tiles, where a level with bf16 tiles leaves P packed only; 40, where its P.V
// would take the last 8 columns from S, which must then hold P.
void check_softmax(HostKernels const& k, int o_cols) {
  int const rows = 37, rows_alloc = 48, cols = 64;
  int64_t const lds = rows_alloc + 3, ldo = rows_alloc + 5;
  std::normal_distribution<float> nd;
  std::vector<float> s(lds * cols), o(ldo * o_cols), o_init(ldo * o_cols), mx(rows_alloc), sm(rows_alloc);
  // Per row: the running maximum, the sum of exp2((x - max) * scale) over every tile so far, O's factor.
  std::vector<double> run_max(rows_alloc), run_sum(rows_alloc), o_factor(rows_alloc);
  std::vector<float> prev_ref(rows_alloc);
  float const scale = 0.18f;
  int n_checked = 0, n_moved = 0, n_kept = 0;
  auto scaled = [&](double r) { return r == -INFINITY ? 0.0 : r * scale; };  // softmax.h's safe max
  for (int step = 0; step < 5; ++step) {
    bool const first = step == 0;
    for (int i = 0; i < lds * cols; ++i) { s[i] = nd(g_rng) * 3.f; }
    for (int m = 0; m < rows; ++m) {
      for (int n = 0; n < cols; ++n) {
        if (m % 7 == 3 && step < 2) { s[m + n * lds] = -INFINITY; }  // a row that sees no key (yet)
        if (m == 11 && n % 5 == 0) { s[m + n * lds] = -INFINITY; }   // masked keys among visible ones
        if (m == 20 && step == 1) { s[m + n * lds] = 50.f + n; }      // a raised maximum, rising along the tile
        if (m == 30 && step == 0) { s[m + n * lds] = 2.f * n; }       // a first tile rising far past its first score
        if (m == 33 && step == 3 && n == cols - 1) { s[m + n * lds] = 200.f; }  // a move at the last column
        if (m == 34 && step >= 2) { s[m + n * lds] = prev_ref[m] + (n == 17 ? 40.f : -1.f); }  // above, within the slack
        // Moves in the middle of a tile (80 * scale: past the slack), at an even and at an odd column, in row
        // vectors (of 16 rows) where no other row moves at an earlier column (a vector's rows move together, each
        // to the maximum of the rest of its row).
        if (m == 35 && step >= 2) { s[m + n * lds] = prev_ref[m] + (n == 30 ? 80.f : -1.f); }
        if (m == 25 && step >= 3) { s[m + n * lds] = prev_ref[m] + (n == 45 ? 80.f : -1.f); }
      }
    }
    if (first) {
      for (int i = 0; i < ldo * o_cols; ++i) { o[i] = o_init[i] = nd(g_rng); }
    }
    std::vector<float> const s_in = s;
    // P as the AMX level's tile GEMM packs its A (HostSoftmaxArgs::p_pairs), over stale garbage.
    int const pairs = (cols + 31) / 32 * 16;
    std::vector<uint32_t> packed(size_t(rows_alloc) * pairs, 0xdeadbeefu);
    HostPackCache pc{packed.data(), int64_t(packed.size() * 4), nullptr, 0, 0, false};
    HostSoftmaxArgs const args{s.data(), lds, cols, o.data(), ldo, o_cols, mx.data(), sm.data(), rows, scale, first, &pc};
    k.softmax_rescale(args);
    // A level with bf16 tiles (the only ones whose prefill reads K/V in place) leaves P packed, as bf16 pairs in
    // pack_a_all's blocks of 32 then 16 rows, zero past the columns, and S holding the scores it was given: the
    // pairs are P's only copy, checked below as the probabilities (with bf16's rounding added to the tolerance).
    CHECK(pc.valid == (k.bf16_kv_in_place && o_cols % 16 == 0), "%s softmax step %d, %d O columns: P %s packed", k.name,
          step, o_cols, pc.valid ? "was" : "was not");
    auto packed_p = [&](int m, int n) {  // the pair's half for row m, column n, as a float
      int const block = m / 32 * 32, height = block + 32 <= rows_alloc ? 32 : 16;
      uint32_t const pair = packed[size_t(block) * pairs + size_t(n / 2) * height + (m - block)];
      uint32_t const bits = (n % 2 == 0 ? pair & 0xffffu : pair >> 16) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      return f;
    };
    if (pc.valid) {
      CHECK(pc.key == s.data() && pc.rows == rows_alloc && pc.depth == cols, "%s softmax step %d: packed P's key, rows %d or depth %d",
            k.name, step, pc.rows, pc.depth);
      int changed = 0, pad = 0;
      for (int i = 0; i < lds * cols; ++i) { changed += std::memcmp(&s[i], &s_in[i], sizeof(float)) != 0; }
      for (int m = 0; m < rows_alloc; ++m) {
        for (int n = cols; n < pairs * 2; ++n) { pad += packed_p(m, n) != 0.f; }
      }
      CHECK(changed == 0, "%s softmax step %d: %d scores of S changed although P was packed", k.name, step, changed);
      CHECK(pad == 0, "%s softmax step %d: %d packed values past the columns are not 0", k.name, step, pad);
    }
    for (int m = 0; m < rows; ++m) {
      double tile_max = -INFINITY;
      for (int n = 0; n < cols; ++n) { tile_max = std::max(tile_max, double(s_in[m + n * lds])); }
      double const old_max = first ? -INFINITY : run_max[m];
      double const new_max = std::max(old_max, tile_max);
      // The reference: moved to the running maximum iff a score exceeded the old one by more than the slack.
      double const old_ref = first ? -INFINITY : prev_ref[m];
      double const limit = old_ref == -INFINITY ? -INFINITY : kHostSoftmaxSlack;
      bool const moves = tile_max * scale - scaled(old_ref) > limit;
      double const want_ref = moves ? new_max : old_ref;
      CHECK(mx[m] == float(want_ref), "%s softmax step %d row %d: reference %.9g, expected %.9g (%s)", k.name, step, m,
            mx[m], want_ref, moves ? "moved to the running maximum" : "kept");
      (moves ? n_moved : n_kept) += 1;
      double const ref = mx[m];
      CHECK(ref <= new_max && (new_max == -INFINITY || (new_max - ref) * scale <= kHostSoftmaxSlack + 1e-5),
            "%s softmax step %d row %d: reference %.9g is not within the slack below the maximum %.9g", k.name, step, m,
            ref, new_max);
      // The sum of every tile's exp2(x * scale) relative to the running maximum, kept in double.
      double z = first ? 0.0 : run_sum[m] * std::exp2(scaled(old_max) - scaled(new_max));
      if (first) {
        o_factor[m] = 1.0;
      } else if (ref != old_ref) {
        o_factor[m] *= old_ref == -INFINITY ? 0.0 : std::exp2(scaled(old_ref) - scaled(ref));
      }
      // fp32 forms x * scale - ref * scale: its rounding (a few ulps of the operands' magnitude) moves the
      // exponent; the polynomial adds ~2e-7.
      auto tol = [&](double x) { return std::isinf(x) ? 0.0 : 4e-7 + 0.7 * 2.5e-7 * (std::fabs(x * scale) + std::fabs(scaled(ref))); };
      for (int n = 0; n < cols; ++n) {
        double const p = std::exp2(double(s_in[m + n * lds]) * scale - scaled(ref));
        z += std::exp2(double(s_in[m + n * lds]) * scale - scaled(new_max));
        double const got = pc.valid ? packed_p(m, n) : s[m + n * lds];
        double const rounding = pc.valid ? std::ldexp(1.0, -8) * p : 0.0;  // bf16: half an ulp, 2^-8 relative
        CHECK(p <= 256.0 * (1 + 1e-6), "%s softmax step %d row %d col %d: p %.9g above 2^slack", k.name, step, m, n, p);
        CHECK(std::fabs(got - p) <= 2 * tol(s_in[m + n * lds]) * p + rounding + 1e-30,
              "%s softmax step %d row %d col %d: p %.9g, expected %.9g", k.name, step, m, n, got, p);
        ++n_checked;
      }
      run_max[m] = new_max;
      run_sum[m] = z;
      double const want_sum = new_max == -INFINITY ? 0.0 : z * std::exp2(scaled(new_max) - scaled(ref));
      double const sum_tol = 1e-5 + 2 * tol(new_max == -INFINITY ? 0 : new_max);
      CHECK(std::fabs(sm[m] - want_sum) <= sum_tol * want_sum + 1e-30,
            "%s softmax step %d row %d: sum %.9g, expected %.9g", k.name, step, m, sm[m], want_sum);
      CHECK(new_max == -INFINITY || sm[m] >= 1.f - 1e-6f, "%s softmax step %d row %d: a row with a visible key has sum %.9g < 1",
            k.name, step, m, sm[m]);
      for (int j = 0; j < o_cols; ++j) {
        double const want = o_init[m + j * ldo] * o_factor[m];
        CHECK(std::fabs(o[m + j * ldo] - want) <= (1e-5 + 2 * step * tol(new_max == -INFINITY ? 0 : new_max)) * std::fabs(want) + 1e-30,
              "%s softmax step %d: O(%d, %d) %.9g, expected %.9g", k.name, step, m, j, o[m + j * ldo], want);
      }
      prev_ref[m] = mx[m];
    }
  }
  CHECK(n_moved >= 35 && n_kept >= 100, "%s softmax: the cases moved %d and kept %d references", k.name,
        n_moved, n_kept);
  // NaN in: NaN out (the row's probabilities and sum), as the scalar code does, whatever the NaN's payload
  // and sign (a payload must not leak into the exponent arithmetic of exp2).
  for (uint32_t const nan_bits : {0x7fc00000u, 0x7fc12345u, 0xffc001ffu, 0x7f800001u}) {
    float nan_value;
    std::memcpy(&nan_value, &nan_bits, sizeof(nan_value));
    std::fill(s.begin(), s.end(), 0.f);
    s[5 + 3 * lds] = nan_value;
    s[30 + 0 * lds] = nan_value;  // the first column: the max starts from it
    HostSoftmaxArgs const args{s.data(), lds, cols, o.data(), ldo, o_cols, mx.data(), sm.data(), rows, scale, true};
    k.softmax_rescale(args);
    CHECK(std::isnan(sm[5]) && std::isnan(s[5 + 3 * lds]) && std::isnan(sm[30]),
          "%s softmax: NaN score 0x%08x does not give a NaN row", k.name, nan_bits);
    CHECK(!std::isnan(sm[4]) && !std::isnan(sm[6]), "%s softmax: NaN leaks into other rows", k.name);
  }
  std::printf("  softmax: %d probabilities\n", n_checked);
}

// softmax.h's generic step, instantiated with scalar traits (no host hook), on the same column-major tiles.
// All rows are one "warp": kEager makes every vote true, so every tile moves every row's reference to its
// running maximum (the textbook step the host's is compared with); otherwise the references lag as on the GPU.
template <bool kEager>
struct ScalarSoftmaxTraits {
  static float exp2(float x) { return host_exp2(x); }
  template <class Op>
  static float row_allreduce(float x, Op) { return x; }
  static bool warp_any(bool p) { return kEager || p; }
};

// The steady state's two ways to a probability (softmax_rescale on a bit-arithmetic level: an exp2 without range
// masks for a vector of rows whose scores at a column all lie from -126 to the slack in the exp2 domain, vexp2
// where one lane does not) give the same bits.  A tile against its copy in which one row per column is masked
// (-inf), far below its reference or NaN, sending that column's vector the other way: every other probability
// and the sums of the rows never changed agree bit for bit; no reference moves.
void check_softmax_paths(HostKernels const& k) {
  int const rows = 48, cols = 64, o_cols = 16;
  float const scale = 0.18f, ref = 4.f;
  std::normal_distribution<float> nd;
  std::vector<float> s_a(rows * cols), o(rows * o_cols, 1.f), mx_a(rows, ref), sm_a(rows, 1.f);
  for (auto& x : s_a) { x = ref + std::clamp(nd(g_rng) * 10.f, -500.f, 40.f); }  // (x - ref) * scale in [-90, 7.2]
  std::vector<float> s_b = s_a, mx_b = mx_a, sm_b = sm_a, o_b = o;
  auto const edited = [](int m, int n) { return m == (n * 7) % 24; };  // rows 24-47 never: their sums compare too
  for (int n = 0; n < cols; ++n) {
    float& x = s_b[(n * 7) % 24 + n * rows];
    x = n % 3 == 0 ? -INFINITY : n % 3 == 1 ? ref - 1000.f : NAN;  // 1000 * scale: past 126 below
  }
  k.softmax_rescale({s_a.data(), rows, cols, o.data(), rows, o_cols, mx_a.data(), sm_a.data(), rows, scale, false});
  k.softmax_rescale({s_b.data(), rows, cols, o_b.data(), rows, o_cols, mx_b.data(), sm_b.data(), rows, scale, false});
  int diff = 0, wrong_edit = 0;
  for (int n = 0; n < cols; ++n) {
    for (int m = 0; m < rows; ++m) {
      float const a = s_a[m + n * rows], b = s_b[m + n * rows];
      if (edited(m, n)) {
        wrong_edit += n % 3 == 2 ? !std::isnan(b) : b != 0.f;
      } else {
        diff += std::memcmp(&a, &b, sizeof(a)) != 0;
      }
    }
  }
  for (int m = 0; m < rows; ++m) {
    diff += mx_a[m] != ref || mx_b[m] != ref || o[m] != 1.f || o_b[m] != 1.f;
    if (m >= 24) { diff += std::memcmp(&sm_a[m], &sm_b[m], sizeof(float)) != 0; }
  }
  CHECK(diff == 0 && wrong_edit == 0,
        "%s softmax: %d probabilities, sums or references differ between the in-range exp2 and vexp2; %d edited "
        "scores not 0 (NaN: not NaN)", k.name, diff, wrong_edit);
  std::printf("  softmax: in-range against masked exponentials, %d probabilities compared\n", rows * cols - cols);
}

// The host step against softmax.h's rescale_o: the same probabilities, sums and O once the reference's
// factor exp2((max - ref) * scale) is taken out, and a reference that is rescale_o's maximum or the host's
// previous reference (host_isa.h).
void check_softmax_matches_generic(HostKernels const& k) {
  using namespace cute;
  constexpr int kRows = 48, kCols = 64, kOCols = 32;
  std::normal_distribution<float> nd;
  std::vector<float> s(kRows * kCols), o(kRows * kOCols), s_gen, o_gen;
  for (auto& x : o) { x = nd(g_rng); }
  o_gen = o;
  OnlineSoftmax<ScalarSoftmaxTraits<true>, kRows> gen;
  std::vector<float> mx(kRows), sm(kRows), prev(kRows);
  float const scale = 0.125f * 1.4426950f;
  double worst = 0;
  int kept = 0;
  for (int step = 0; step < 4; ++step) {
    for (int i = 0; i < kRows * kCols; ++i) { s[i] = nd(g_rng) * (step == 1 ? 6.f : 2.f); }
    for (int n = 0; n < kCols; n += 3) { s[5 + n * kRows] = -INFINITY; }  // masked keys
    if (step == 0) {
      for (int n = 0; n < kCols; ++n) { s[9 + n * kRows] = -INFINITY; }  // a row that sees nothing yet
    }
    s_gen = s;
    auto scores = make_tensor(s_gen.data(), make_layout(Shape<Int<kRows>, Int<kCols>>{}, LayoutLeft{}));
    auto acc_o = make_tensor(o_gen.data(), make_layout(Shape<Int<kRows>, Int<kOCols>>{}, LayoutLeft{}));
    gen.rescale_o(scores, acc_o, scale, step == 0);
    HostSoftmaxArgs const a{s.data(), kRows, kCols, o.data(), kRows, kOCols, mx.data(), sm.data(), kRows, scale,
                            step == 0};
    k.softmax_rescale(a);
    auto rel = [](double x, double y) { return x == y ? 0.0 : std::fabs(x - y) / std::max(std::fabs(y), 1e-30); };
    for (int m = 0; m < kRows; ++m) {
      float const g_max = gen.row_max(m);
      CHECK(mx[m] == g_max || (step > 0 && mx[m] == prev[m]), "%s softmax vs generic: row %d reference %g, maximum %g",
            k.name, m, mx[m], g_max);
      kept += step > 0 && mx[m] != g_max;
      // f = exp2((max - ref) * scale), as the fp32 arguments give it; 1 for a row without a visible key.
      double const f = std::isinf(g_max) ? 1.0 : std::exp2(double(g_max) * scale - double(mx[m]) * scale);
      for (int n = 0; n < kCols; ++n) { worst = std::max(worst, rel(s[m + n * kRows], f * s_gen[m + n * kRows])); }
      for (int j = 0; j < kOCols; ++j) { worst = std::max(worst, rel(o[m + j * kRows], f * o_gen[m + j * kRows])); }
      worst = std::max(worst, rel(sm[m], f * gen.row_sum(m)));
      prev[m] = mx[m];
      // Back in step for the next tile (rounding only): the host's O relative to the generic maximum.
      for (int j = 0; j < kOCols; ++j) { o_gen[m + j * kRows] = float(o[m + j * kRows] / f); }
    }
  }
  CHECK(kept > kRows, "%s softmax vs generic: only %d references stayed below the maximum", k.name, kept);
  // Same polynomial; the arguments differ by the fp32 rounding of max * scale and ref * scale.
  CHECK(worst < 4e-6, "%s softmax differs from softmax.h's rescale_o by %.3g (relative)", k.name, worst);
  std::printf("  softmax vs softmax.h's rescale_o: max relative difference %.2g (%d references kept below the maximum)\n",
              worst, kept);
}

// softmax.h's lagging reference (the GPU's step, one vote for all rows here) against its eager form: each
// reference is -inf exactly when the row's maximum is, else at most kSoftmaxSlack (log2 units) below it; the
// probabilities, sums and O are the eager ones times exp2((max - ref) * scale); tiles that rise less than the
// slack keep every reference, and one row rising past it moves them all (each to the larger of its reference
// and the tile's maximum, not always its running maximum: still within the slack).  Generic code: run once.
void check_generic_lagging_reference() {
  using namespace cute;
  constexpr int kRows = 16, kCols = 64, kOCols = 32;
  std::normal_distribution<float> nd;
  std::vector<float> s(kRows * kCols), o(kRows * kOCols), s_lag, o_lag;
  for (auto& x : o) { x = nd(g_rng); }
  // Row 9 sees no key before step 2, so its history is zero (in the kernel P = exp2(-inf) = 0 keeps the cleared
  // O at 0); a made-up history there would be wiped by the eager step's correction of 0 and kept by the lag.
  for (int j = 0; j < kOCols; ++j) { o[9 + j * kRows] = 0.f; }
  o_lag = o;
  OnlineSoftmax<ScalarSoftmaxTraits<true>, kRows> eager;
  OnlineSoftmax<ScalarSoftmaxTraits<false>, kRows> lag;
  float const scale = 0.125f * 1.4426950f;
  double worst = 0;
  int lagged_steps = 0, moved_steps = 0;
  for (int step = 0; step < 6; ++step) {
    for (int i = 0; i < kRows * kCols; ++i) { s[i] = nd(g_rng) * 2.f + float(step); }  // rises ~0.18 log2 a step
    for (int n = 0; n < kCols; n += 3) { s[5 + n * kRows] = -INFINITY; }                // masked keys
    if (step < 2) {
      for (int n = 0; n < kCols; ++n) { s[9 + n * kRows] = -INFINITY; }  // a row that sees nothing yet
    }
    if (step == 4) { s[7 + 11 * kRows] = 120.f; }  // one score ~19 log2 units up: every reference moves
    s_lag = s;
    std::vector<float> ref_before(kRows);
    for (int m = 0; m < kRows; ++m) { ref_before[m] = step == 0 ? -INFINITY : lag.row_max(m); }
    auto scores = make_tensor(s.data(), make_layout(Shape<Int<kRows>, Int<kCols>>{}, LayoutLeft{}));
    auto acc_o = make_tensor(o.data(), make_layout(Shape<Int<kRows>, Int<kOCols>>{}, LayoutLeft{}));
    auto scores_lag = make_tensor(s_lag.data(), make_layout(Shape<Int<kRows>, Int<kCols>>{}, LayoutLeft{}));
    auto acc_o_lag = make_tensor(o_lag.data(), make_layout(Shape<Int<kRows>, Int<kOCols>>{}, LayoutLeft{}));
    eager.rescale_o(scores, acc_o, scale, step == 0);
    lag.rescale_o(scores_lag, acc_o_lag, scale, step == 0);
    int moved = 0, below = 0;
    for (int m = 0; m < kRows; ++m) {
      float const mx = eager.row_max(m), ref = lag.row_max(m);
      CHECK(std::isinf(mx) == std::isinf(ref) && ref <= mx && (std::isinf(mx) || (double(mx) - ref) * scale <= kSoftmaxSlack + 1e-4),
            "lagging softmax, step %d row %d: reference %g, maximum %g", step, m, ref, mx);
      moved += ref != ref_before[m] && !std::isinf(ref_before[m]);
      below += ref < mx;
      double const f = std::isinf(mx) ? 1.0 : std::exp2(double(mx) * scale - double(ref) * scale);
      auto rel = [](double x, double y) { return x == y ? 0.0 : std::fabs(x - y) / std::max(std::fabs(y), 1e-30); };
      for (int n = 0; n < kCols; ++n) { worst = std::max(worst, rel(s_lag[m + n * kRows], f * s[m + n * kRows])); }
      for (int j = 0; j < kOCols; ++j) { worst = std::max(worst, rel(o_lag[m + j * kRows], f * o[m + j * kRows])); }
      worst = std::max(worst, rel(lag.row_sum(m), f * eager.row_sum(m)));
    }
    if (step > 0 && step != 4) {
      CHECK(moved == 0 || step == 2, "lagging softmax, step %d: %d references moved on a small rise", step, moved);
      lagged_steps += below > 0 && moved == 0;
    }
    if (step == 4) {  // the vote moves every row: to its maximum over the old reference and this tile
      CHECK(lag.row_max(7) == 120.f && moved > kRows / 2, "lagging softmax: row 7's jump (reference %g) moved %d references",
            lag.row_max(7), moved);
      ++moved_steps;
    }
  }
  CHECK(lagged_steps >= 2 && moved_steps == 1, "lagging softmax: %d lagging steps, %d moving", lagged_steps, moved_steps);
  CHECK(worst < 1e-5, "lagging softmax differs from the eager step by %.3g (relative) beyond exp2((max - ref) * scale)", worst);
  std::printf("  generic softmax, lagging vs eager: max relative difference %.2g\n", worst);
}

void check_convert(HostKernels const& k) {
  std::vector<float> in;
  std::uniform_real_distribution<float> ud(-8.f, 8.f);
  for (int i = 0; i < 1000; ++i) { in.push_back(ud(g_rng) * std::exp2(float(i % 40 - 20))); }
  float const special[] = {0.f, -0.f, INFINITY, -INFINITY, 65504.f, 65520.f, 70000.f, 1e-8f, -6e-8f, 3e38f,
                           1.0009765625f, 1.00048828125f, 1.00146484375f};
  for (float x : special) { in.push_back(x); }
  in.push_back(NAN);
  for (HostDType t : {HostDType::kBF16, HostDType::kF16}) {
    for (int64_t n : {int64_t(in.size()), int64_t(in.size()) - 3, int64_t(5)}) {
      std::vector<uint16_t> out(n + 1, 0xabcd);
      k.convert(in.data(), out.data(), t, n);
      int bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t const want = t == HostDType::kBF16 ? cutlass::bfloat16_t(in[i]).raw() : cutlass::half_t(in[i]).raw();
        bool const nan_ok = std::isnan(in[i]) && (t == HostDType::kBF16 ? (out[i] & 0x7fff) > 0x7f80 : (out[i] & 0x7fff) > 0x7c00);
        if (out[i] != want && !nan_ok) {
          if (bad++ < 3) { std::printf("    %s: %.9g -> 0x%04x, cutlass 0x%04x\n", type_name(t), in[i], out[i], want); }
        }
      }
      CHECK(bad == 0, "%s convert to %s (n=%lld): %d values differ from cutlass's rounding", k.name, type_name(t),
            (long long)n, bad);
      CHECK(out[n] == 0xabcd, "%s convert to %s wrote past n", k.name, type_name(t));
    }
  }
  std::printf("  convert: %zu values x 2 types\n", in.size());
}

// The output tile's row-by-row store (HostKernels::store_rows): every element rounded as convert rounds it,
// nothing written past rows, cols or between the rows.
void check_store_rows(HostKernels const& k) {
  int const shapes[][2] = {{128, 64}, {128, 128}, {37, 40}, {16, 8}, {5, 1}, {1, 256}, {100, 24}};
  std::normal_distribution<float> nd;
  int n = 0;
  for (auto const& sh : shapes) {
    int const rows = sh[0], cols = sh[1], rows_alloc = (rows + 15) / 16 * 16;
    int64_t const lds = rows_alloc + 16, ldd = cols + 3;
    std::vector<float> src(size_t(lds) * cols);
    for (auto& x : src) { x = nd(g_rng) * 3.f; }
    src[0] = NAN;
    for (HostDType t : {HostDType::kF32, HostDType::kBF16, HostDType::kF16}) {
      int const esize = t == HostDType::kF32 ? 4 : 2;
      std::vector<unsigned char> dst(size_t(ldd) * (rows + 1) * esize, 0xab);
      k.store_rows(src.data(), lds, dst.data(), ldd, t, rows, cols);
      int bad = 0, outside = 0;
      for (int m = 0; m <= rows; ++m) {
        for (int j = 0; j < ldd; ++j) {
          unsigned char const* at = dst.data() + (size_t(m) * ldd + j) * esize;
          if (m == rows || j >= cols) {
            for (int b = 0; b < esize; ++b) { outside += at[b] != 0xab; }
            continue;
          }
          float const x = src[size_t(m) + size_t(j) * lds];
          if (t == HostDType::kF32) {
            float got;
            std::memcpy(&got, at, 4);
            bad += !(got == x || (std::isnan(x) && std::isnan(got)));
          } else {
            uint16_t got;
            std::memcpy(&got, at, 2);
            uint16_t const want = t == HostDType::kBF16 ? cutlass::bfloat16_t(x).raw() : cutlass::half_t(x).raw();
            bool const nan_ok = std::isnan(x) && (got & 0x7fff) > (t == HostDType::kBF16 ? 0x7f80 : 0x7c00);
            bad += got != want && !nan_ok;
          }
        }
      }
      CHECK(bad == 0 && outside == 0, "%s store_rows to %s %dx%d: %d values wrong, %d bytes written outside", k.name,
            type_name(t), rows, cols, bad, outside);
      ++n;
    }
  }
  std::printf("  store_rows: %d cases\n", n);
}

// The backward's dQ share (HostKernels::add_rows): every element one fp32 addition onto what dst held,
// nothing changed past rows, cols or between the rows.
void check_add_rows(HostKernels const& k) {
  int const shapes[][2] = {{64, 128}, {64, 64}, {37, 40}, {16, 8}, {5, 1}, {1, 256}, {100, 24}, {64, 72}};
  std::normal_distribution<float> nd;
  int n = 0;
  for (auto const& sh : shapes) {
    int const rows = sh[0], cols = sh[1], rows_alloc = (rows + 15) / 16 * 16;
    int64_t const lds = rows_alloc + 16, ldd = cols + 3;
    std::vector<float> src(size_t(lds) * cols), dst(size_t(ldd) * (rows + 1));
    for (auto& x : src) { x = nd(g_rng) * 3.f; }
    for (auto& x : dst) { x = nd(g_rng); }
    std::vector<float> const before = dst;
    k.add_rows(src.data(), lds, dst.data(), ldd, rows, cols);
    int bad = 0, outside = 0;
    for (int m = 0; m <= rows; ++m) {
      for (int j = 0; j < ldd; ++j) {
        size_t const at = size_t(m) * ldd + j;
        if (m == rows || j >= cols) {
          outside += std::memcmp(&dst[at], &before[at], 4) != 0;
        } else {
          bad += dst[at] != before[at] + src[size_t(m) + size_t(j) * lds];
        }
      }
    }
    CHECK(bad == 0 && outside == 0, "%s add_rows %dx%d: %d sums wrong, %d values outside changed", k.name, rows, cols,
          bad, outside);
    ++n;
  }
  std::printf("  add_rows: %d cases\n", n);
}

// A row-major tile into a column-major one (HostKernels::rows_to_columns): every element's bits moved, nothing
// written outside, and nothing read past a row's cols: the source ends at an inaccessible page, so a read of
// one element too many faults.
void check_rows_to_columns(HostKernels const& k) {
  int const shapes[][2] = {{64, 128}, {16, 16}, {37, 40}, {5, 8}, {1, 24}, {64, 72}, {7, 3}};
  long const page = sysconf(_SC_PAGESIZE);
  int n = 0;
  for (auto const& sh : shapes) {
    int const rows = sh[0], cols = sh[1];
    for (int esize : {2, 4}) {
      int64_t const lds = cols + 5, ldd = rows + 7;
      size_t const src_bytes = size_t((rows - 1) * lds + cols) * esize;
      size_t const span = (src_bytes + page - 1) / page * page;
      void* const map = mmap(nullptr, span + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      CHECK(map != MAP_FAILED, "mmap");
      unsigned char* const base = static_cast<unsigned char*>(map);
      mprotect(base + span, page, PROT_NONE);
      unsigned char* const src = base + span - src_bytes;  // the last element ends at the guard page
      for (size_t b = 0; b < src_bytes; ++b) { src[b] = static_cast<unsigned char>(g_rng()); }
      std::vector<unsigned char> dst(size_t(ldd) * (cols + 1) * esize, 0xab);
      k.rows_to_columns(src, lds, dst.data(), ldd, esize, rows, cols);
      int bad = 0, outside = 0;
      for (int j = 0; j <= cols; ++j) {
        for (int m = 0; m < ldd; ++m) {
          unsigned char const* at = dst.data() + (size_t(j) * ldd + m) * esize;
          if (j == cols || m >= rows) {
            for (int b = 0; b < esize; ++b) { outside += at[b] != 0xab; }
          } else {
            bad += std::memcmp(at, src + (size_t(m) * lds + j) * esize, esize) != 0;
          }
        }
      }
      munmap(map, span + page);
      CHECK(bad == 0 && outside == 0, "%s rows_to_columns %dx%d of %d bytes: %d elements wrong, %d bytes written outside",
            k.name, rows, cols, esize, bad, outside);
      ++n;
    }
  }
  std::printf("  rows_to_columns: %d cases\n", n);
}

// The backward's probabilities (HostKernels::exp2_rows) against exp2 in double: relative error of the
// polynomial and of rounding x * scale - bias in fp32; exactly 0 for -inf scores and for a row whose bias is
// +inf (no keys); columns past cols untouched.  With dP given, dS = P * (dP - D) (D null: P * dP) in the same
// pass: each the fp32 product of the P written and the fp32 difference, and dP's other elements untouched.
void check_exp2_rows(HostKernels const& k) {
  int const rows = 48, cols = 37;
  int64_t const lds = rows + 16, ldp = rows + 32;
  std::uniform_real_distribution<float> ud(-40.f, 2.f);
  std::normal_distribution<float> nd;
  std::vector<float> dsum(rows);
  for (auto& x : dsum) { x = nd(g_rng); }
  double worst = 0.;
  int wrong_zero = 0, touched = 0, wrong_ds = 0;
  for (int mode = 0; mode < 3; ++mode) {  // 0: P only; 1: dS with D; 2: dS without D
    std::vector<float> s(size_t(lds) * (cols + 1)), bias(rows), dp(size_t(ldp) * (cols + 1));
    for (auto& x : s) { x = ud(g_rng); }
    for (auto& x : dp) { x = nd(g_rng) * 2.f; }
    for (int m = 0; m < rows; ++m) { bias[m] = m == 5 ? INFINITY : 0.25f * ud(g_rng); }
    s[3 + 2 * lds] = -INFINITY;
    float const scale = 1.4426950f * 0.125f;
    std::vector<float> const s0 = s, dp0 = dp;
    k.exp2_rows(s.data(), lds, rows, cols, bias.data(), scale, mode == 0 ? nullptr : dp.data(), ldp,
                mode == 1 ? dsum.data() : nullptr);
    for (int n = 0; n <= cols; ++n) {
      for (int m = 0; m < ldp; ++m) {
        float const got_ds = dp[m + size_t(n) * ldp], x_dp = dp0[m + size_t(n) * ldp];
        if (mode == 0 || n == cols || m >= rows) {
          touched += std::memcmp(&got_ds, &x_dp, 4) != 0;
          continue;
        }
        float const p = s[m + size_t(n) * lds];
        float const want = p * (mode == 1 ? x_dp - dsum[m] : x_dp);
        wrong_ds += std::memcmp(&got_ds, &want, 4) != 0;
      }
      for (int m = 0; m < lds; ++m) {
        float const got = s[m + size_t(n) * lds], x = s0[m + size_t(n) * lds];
        if (n == cols || m >= rows) {
          touched += got != x;
          continue;
        }
        if (m == 5 || std::isinf(x)) {
          wrong_zero += got != 0.f;
          continue;
        }
        double const want = std::exp2(double(x) * scale - double(bias[m]));
        worst = std::max(worst, std::fabs(got - want) / want);
      }
    }
  }
  CHECK(worst < 2e-6 && wrong_zero == 0 && touched == 0 && wrong_ds == 0,
        "%s exp2_rows: relative error %.3g, %d masked or keyless probabilities not 0, %d values outside changed, "
        "%d dS values wrong", k.name, worst, wrong_zero, touched, wrong_ds);
  std::printf("  exp2_rows: max relative error %.2g, dS exact\n", worst);
}

// mask_scores and the GPU's element-by-element rule that it stands in for, in both forms (mask.h: ScoreMask,
// absolute, and ThreadScoreMask, relative to a thread's first score), against the rule written here with absolute rows and
// keys: row r sees key c when c < seqlen_k, c <= diag(r) + right (has_right) and c >= diag(r) - left
// (has_left), diag(r) = r + seqlen_k - seqlen_q; the ALiBi bias is slope * |diag(r) - c|.  Cases: causal, local windows on either side or both, windows past any tile,
// bottom-right alignment (seqlen_q != seqlen_k both ways), keys past seqlen_k, ALiBi with and without a mask.
// Both also run on a thread's share of the tile as the GPU partitions it (every other row from an odd first row,
// every third key from the third): ThreadScoreMask's arithmetic is relative to the thread's first score.
// Hidden scores must be -inf exactly where the rule hides them; the bias may differ by the rounding of one
// fused multiply-add.
void check_mask_scores(HostKernels const& k) {
  using namespace cute;
  struct Case {
    int seqlen_q, seqlen_k, row0, col0;
    TestWindow w;
    bool bias, mask;
  };
  int const big = 2147483000;  // a window side past any tile (int arithmetic near its limit)
  Case const cases[] = {
      {300, 300, 128, 128, {false, true, 0, 0}, false, true},     // causal, the diagonal tile
      {300, 300, 128, 64, {false, true, 0, 0}, false, true},      // causal, left of the diagonal
      {100, 300, 0, 160, {false, true, 0, 0}, false, true},       // causal, seqlen_q < seqlen_k
      {300, 100, 128, 32, {false, true, 0, 0}, false, true},      // causal, seqlen_q > seqlen_k: rows see nothing
      {300, 300, 128, 100, {true, true, 7, 3}, false, true},      // local, both sides
      {300, 300, 128, 100, {true, false, 20, 0}, false, true},    // left side only
      {300, 300, 128, 100, {false, true, 0, 25}, false, true},    // right side only
      {300, 300, 128, 100, {true, true, big, big}, false, true},  // sides past every key
      {300, 150, 128, 130, {false, false, 0, 0}, false, true},    // keys past seqlen_k only
      {300, 300, 64, 160, {false, false, 0, 0}, true, false},     // ALiBi only
      {200, 300, 64, 96, {true, true, 9, 0}, true, true},         // ALiBi and a local causal window
      {90, 300, 0, 230, {false, true, 0, 0}, true, true},         // causal ALiBi, keys past seqlen_k
  };
  int const rows = 48, cols = 37;
  int64_t const lds = rows + 16;
  float const slope = 0.0625f;
  std::normal_distribution<float> nd;
  int wrong_hidden = 0, touched = 0, hidden_seen = 0;
  double worst_bias = 0.;
  // v: the tile's scores before the edits; got: after.  (r, c): the score's row and key in the problem.
  auto compare = [&](float v, float got, int r, int c, Case const& cs) {
    int const diag = r + cs.seqlen_k - cs.seqlen_q;
    bool const hidden = cs.mask && (c >= cs.seqlen_k || (cs.w.r && int64_t(c) > int64_t(diag) + cs.w.right_) ||
                                    (cs.w.l && int64_t(c) < int64_t(diag) - cs.w.left_));
    hidden_seen += hidden;
    if (hidden || std::isinf(got)) {
      wrong_hidden += !(hidden && std::isinf(got) && got < 0);
      return;
    }
    float const want = cs.bias ? v - slope * float(std::abs(diag - c)) : v;
    worst_bias = std::max(worst_bias, double(std::fabs(got - want)) / (1. + std::fabs(want)));
  };
  for (Case const& c : cases) {
    FwdParams params{};
    params.seqlen_q = c.seqlen_q, params.seqlen_k = c.seqlen_k;
    BlockInfo const binfo(params, 0);
    std::vector<float> got(size_t(lds) * (cols + 1));
    for (auto& x : got) { x = nd(g_rng) * 8.f; }
    std::vector<float> const before = got;
    // The whole tile, as the host holds it: both masks' apply and mask_scores.
    auto const tile_coord = make_identity_tensor(make_shape(rows, cols));
    ScoreMask<TestWindow> const mask{binfo, c.w, slope};
    ThreadScoreMask<TestWindow> const tmask(binfo, c.w, tile_coord);
    std::vector<float> ref = before, tref = before;
    auto view = [&](std::vector<float>& v) {
      return make_tensor(v.data(), make_layout(make_shape(rows, cols), make_stride(1, lds)));
    };
    Tensor ref_view = view(ref), tref_view = view(tref);
    mask.apply(ref_view, tile_coord, c.row0, c.col0, c.bias, c.mask);
    tmask.apply(tref_view, tile_coord, c.row0, c.col0, c.bias, slope, c.mask);
    HostMaskArgs const a{got.data(), lds,  rows,          cols,      binfo.diagonal(c.row0), c.col0, binfo.seqlen_k,
                         c.bias,     slope, c.mask,        c.w.l,     c.w.r,                  c.w.left_, c.w.right_};
    k.mask_scores(a);
    for (int n = 0; n <= cols; ++n) {
      for (int m = 0; m < lds; ++m) {
        size_t const i = m + size_t(n) * lds;
        if (n == cols || m >= rows) {
          touched += std::memcmp(&got[i], &before[i], 4) != 0 || std::memcmp(&ref[i], &before[i], 4) != 0 ||
                     std::memcmp(&tref[i], &before[i], 4) != 0;
          continue;
        }
        for (float const* out : {&got[i], &ref[i], &tref[i]}) { compare(before[i], *out, c.row0 + m, c.col0 + n, c); }
      }
    }
    // One thread's share: rows 1, 3, ..., keys 2, 5, 8, ... of the tile.
    int const trows = rows / 2, tcols = cols / 3;
    auto const thread_coord = [](int i, int j) { return make_tuple(1 + 2 * i, 2 + 3 * j); };
    ThreadScoreMask<TestWindow> const share_mask(binfo, c.w, thread_coord);
    std::vector<float> part(size_t(trows) * tcols);
    for (int j = 0; j < tcols; ++j)
      for (int i = 0; i < trows; ++i) { part[i + size_t(j) * trows] = before[1 + 2 * i + size_t(2 + 3 * j) * lds]; }
    std::vector<float> const part_before = part;
    std::vector<float> apart = part;
    Tensor tpart = make_tensor(part.data(), make_layout(make_shape(trows, tcols)));
    Tensor tapart = make_tensor(apart.data(), make_layout(make_shape(trows, tcols)));
    share_mask.apply(tpart, thread_coord, c.row0, c.col0, c.bias, slope, c.mask);
    mask.apply(tapart, thread_coord, c.row0, c.col0, c.bias, c.mask);
    for (int j = 0; j < tcols; ++j)
      for (int i = 0; i < trows; ++i) {
        size_t const e = i + size_t(j) * trows;
        compare(part_before[e], part[e], c.row0 + 1 + 2 * i, c.col0 + 2 + 3 * j, c);
        compare(part_before[e], apart[e], c.row0 + 1 + 2 * i, c.col0 + 2 + 3 * j, c);
      }
  }
  CHECK(wrong_hidden == 0 && touched == 0 && worst_bias < 1e-6 && hidden_seen > 0,
        "%s mask_scores / ScoreMask / ThreadScoreMask: %d scores hidden on one side only, %d values outside the tile changed, "
        "bias off by %.3g (%d hidden scores seen)", k.name, wrong_hidden, touched, worst_bias, hidden_seen);
  std::printf("  mask_scores, ScoreMask and ThreadScoreMask: %zu cases against the rule, bias within %.2g\n",
              sizeof(cases) / sizeof(cases[0]), worst_bias);
}

void check_level(HostKernels const& k) {
  std::printf("%s (%d lanes)\n", k.name, k.lanes);
  check_gemms(k);
  check_softmax(k, 48);
  check_softmax(k, 40);
  check_softmax_matches_generic(k);
  check_softmax_paths(k);
  check_convert(k);
  check_store_rows(k);
  check_add_rows(k);
  check_rows_to_columns(k);
  check_exp2_rows(k);
  check_mask_scores(k);
}

}  // namespace

int main() {
  check_generic_lagging_reference();
  for (int i = 0; i < kNumHostIsas; ++i) {
    HostIsa const isa = HostIsa(i);
    char const* why = host_isa_unavailable_reason(isa);
    if (*why != '\0') {
      std::printf("%s: skipped (%s)\n", host_isa_name(isa), why);
      continue;
    }
    check_level(*host_kernels_for(isa));
  }
#if defined(__x86_64__)
  if (host_isa_supported(HostIsa::kAvx2)) {
    check_level(*host_kernels_avx512_emulated());
    check_level(*host_kernels_amx_emulated());
    check_level(*host_kernels_avx512_plain_emulated());
  } else {
    std::printf("avx512, avx512_bf16 and amx emulated on avx2: skipped (this CPU lacks avx2)\n");
  }
#endif
  return check_summary();
}
