// Which instruction set runs the CPU backend's inner loops, chosen at run time.
//
// The kernel body (kernel_fwd.h with HostTraits) is compiled once, for the compiler's baseline target (no
// -march): a build runs on any CPU of its architecture.  Its per-element work goes through HostKernels, a
// table of small micro-kernels — a tile GEMM, the online-softmax step, the fp32 -> fp16/bf16 conversion —
// of which each instruction-set level has its own copy, compiled in its own translation unit
// (csrc/host/isa_<level>.cpp) with that level's instructions enabled.  The table used is that of the best
// level the CPU reports (as ATen's CPU capability), or of FLASH_EXT_CPU_ISA when set (a lower one, for
// testing; a level the CPU lacks is refused by name).  Only the micro-kernels are compiled per level: the
// body, which dominates compile time, is compiled once.
//
// This header is also included by the per-level translation units, so it holds only types and
// declarations: an inline function here would be emitted by those units too, compiled with their
// instructions, and the linker could keep that copy for the whole program.
#pragma once

#include <cstdint>

namespace flash_ext {

// Ordered: a level includes the instructions of the levels below it (on x86-64).
enum class HostIsa : int {
  kGeneric = 0,     // the compiler's baseline (x86-64: SSE2; aarch64: NEON), 4 fp32 lanes
  kAvx2 = 1,        // AVX2 + FMA + F16C (Haswell, Zen 1 and later), 8 fp32 lanes, 16 registers
  kAvx512 = 2,      // AVX-512 F/BW/DQ/VL (Skylake-SP, Zen 4 and later), 16 fp32 lanes, 32 registers
  kAvx512Bf16 = 3,  // + AVX512_BF16: bf16 GEMMs by vdpbf16ps (Cooper Lake, Sapphire Rapids, Zen 4)
  kAmxBf16 = 4,     // + AMX-TILE/AMX-BF16: bf16 GEMMs of whole 16 x 16 tiles by tdpbf16ps (Sapphire Rapids)
};
inline constexpr int kNumHostIsas = 5;

enum class HostDType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// C(m, n) += sum_k A(m, k) * B(n, k) for m < rows, n < cols, k < depth, with fp32 accumulation.
//   C: fp32, column-major: C(m, n) = c[m + n * ldc].
//   A: A(m, k) = a[m * a_ms + k * a_ks] of type a_type;  B: B(n, k) = b[n * b_ns + k * b_ks] of type b_type.
// Rows are computed a whole vector at a time: rows up to rows rounded up to a multiple of 16 must exist in
// A and C (their values there are unspecified afterwards).  Columns >= cols of C are neither read nor written.
// A level with bf16 dot products (kAvx512Bf16, kAmxBf16) computes a bf16 x bf16 product with both operands
// rounded to bf16 (exact for bf16 inputs; the fp32 P of P.V is rounded, as on the GPU).  kAmxBf16 computes
// the fp16 products of more than a few rows on its bf16 tiles, and the fp32 ones whose B is a tile of b_cache,
// both operands split into sums of 2 (fp16 B) or 3 (fp32 B) bf16 pieces (kernels.h): within ~2^-15 (fp16) and
// ~2^-23 (fp32) of each exact product.  Every other case multiplies in fp32.
// With overwrite, C's prior contents are not read: C(m, n) = sum_k A(m, k) * B(n, k) (the S = Q.K^T of every
// tile, which would otherwise be cleared in memory and read straight back).
// Scratch in which a level may keep a GEMM operand A in its packed form, packed once and used by several
// GEMMs: the forward's Q.K^T, whose A (the Q fragment) is loaded once per CTA and multiplies every K tile.
// `valid` with `key` (A's address) and `rows`, `depth` (the GEMM's, rows rounded up to 16) says that `data`
// holds A in the packed form of the level that set it; whoever owns A clears `valid` when A may change (the
// launcher, at every CTA).  A level that finds it valid uses it, else may pack into it (when A's packed form
// fits `bytes`) and set it.
struct HostPackCache {
  void* data = nullptr;
  int64_t bytes = 0;
  void const* key = nullptr;
  int rows = 0, depth = 0;
  bool valid = false;
};

// Scratch in which a level may keep whole B operands (K and V tiles) in the form its GEMM reads in place,
// packed once and used by every GEMM of the call that multiplies the same tile: in prefill, each K/V tile of
// a head is the B of one GEMM per query tile (16 of them at 2048 queries), and a level that must repack V
// (transposed into pairs) or that reads K's rows a head's stride apart (a few L1 sets) pays that again each
// time.  Entries are found by the operand's address and shape; the cache belongs to one call and one worker
// thread, and holds only tiles of global K/V, which no kernel writes during a call (kvcache_fwd appends
// before it starts), so an entry never goes stale.  Slots fill in order and are never evicted: whoever owns
// the cache empties it (`count = 0, used = 0`) when the tiles it will see next are others (the launcher, when
// the K/V head changes); tiles that do not fit are packed as without a cache.
struct HostTileCache {
  struct Entry {
    void const* key;   // B's first element
    int64_t b_ns, b_ks;
    int cols, depth;
    int64_t offset;    // bytes into data
  };
  void* data = nullptr;
  int64_t bytes = 0, used = 0;
  Entry* entries = nullptr;
  int capacity = 0, count = 0;
};

struct HostGemmArgs {
  float* c;
  int64_t ldc;
  void const* a;
  HostDType a_type;
  int64_t a_ms, a_ks;
  void const* b;
  HostDType b_type;
  int64_t b_ns, b_ks;
  int rows, cols, depth;
  bool overwrite = false;
  HostPackCache* a_cache = nullptr;  // A unchanged since the last call with this cache while it is valid
  HostTileCache* b_cache = nullptr;  // B a tile of global K/V (HostTileCache), where the caller has a cache
};

// One step of the online softmax (softmax.h, OnlineSoftmax::rescale_o) over column-major tiles: scores S
// (rows x cols, S(m, n) = s[m + n * lds]) become exp2((S - ref) * scale_log2) against each row's
// reference ref (row_max), and the running sums and O (rows x o_cols, O(m, j) = o[m + j * ldo]) are kept
// relative to it.  As in rescale_o, the reference moves only when a score of the tile exceeds it by more than
// kHostSoftmaxSlack in the exp2 domain, and then to the row's running maximum (here per row, there per warp); so
// it is a score the row has seen, at most kHostSoftmaxSlack below its maximum (a first tile sets it to the
// tile's maximum), and -inf while the row has seen only masked keys.  What the kernel derives, O / row_sum
// and the LSE row_max * scale + log2(row_sum), is the same up to rounding.  row_max/row_sum hold one value per
// row.  Rows are processed a vector at a time, as in HostGemmArgs.  With `first`, row_max, row_sum and O are
// neither read nor written before the step sets them (O not at all: the body's first P.V writes it).
inline constexpr float kHostSoftmaxSlack = 8.f;  // log2 units: probabilities <= 256
struct HostSoftmaxArgs {
  float* s;
  int64_t lds;
  int cols;
  float* o;
  int64_t ldo;
  int o_cols;
  float* row_max;
  float* row_sum;
  int rows;
  float scale_log2;
  bool first;
  // Where a level whose bf16 GEMM packs its A operand (AMX: pairs of keys per row, as pack_a_tiles lays them
  // out) may also leave the probabilities in that form, rounded as that GEMM would round them, for the P.V
  // that follows: packed here from the final fp32 values while they are in L1, rather than read back from the
  // whole S tile by the GEMM.  A level that does sets it valid with key s, rows rounded up to 16 and depth
  // cols, and leaves the scores in S rather than the probabilities (64 KiB less written per 128 x 128 tile):
  // the pairs are then P's only copy, so the level packs only what its GEMM takes whole from the cache
  // (host_tile_gemm hands the valid cache to the P.V whose A is S).  Else it leaves the cache as it was
  // (invalid: the caller clears `valid` first) and S holds P.  Null: S only.
  HostPackCache* p_pairs = nullptr;
};

// Dropout's keep bits of one tile (the mask contract of dropout.h, evaluated kLanes group rows per Philox
// call).  The tile is rows x cols elements starting at query row row0 and key column col0 of the sequence
// (all four multiples of 16); bit (m + rows * n) of words (bit b: (words[b / 32] >> (b % 32)) & 1) is
// the keep decision of element (row0 + m, col0 + n), i.e. the bits follow the column-major accumulator.
// Only rows below live_rows rounded up to 16 are evaluated; the bits of the others are 0.  key0, key1,
// bh, offset_lo and threshold are DropoutRng's fields.
struct HostDropoutArgs {
  uint32_t* words;
  int rows, cols, live_rows;
  int row0, col0;
  uint32_t key0, key1, bh, offset_lo, threshold;
};

// mask.h's score edits on a whole host tile (HostKernels::mask_scores): s[m + n * lds] for m < rows (a multiple
// of 16), n < cols, whose first key is col0 and whose first row has its diagonal at key diag0
// (BlockInfo::diagonal), so row m's is diag0 + m.  bias: s -= alibi_slope * |diag - key| with key = col0 + n.
// mask: -inf where the key is past seqlen_k, past the diagonal by more than `right` (has_right), or before it
// by more than `left` (has_left).  The bias comes first, as in ScoreMask::apply.
struct HostMaskArgs {
  float* s;
  int64_t lds;
  int rows, cols;
  int diag0, col0;
  int seqlen_k;
  bool bias;
  float alibi_slope;
  bool mask;
  bool has_left, has_right;
  int left, right;
};

struct HostKernels {
  HostIsa isa;
  char const* name;  // "generic", "avx2", "avx512", "avx512_bf16", "amx_bf16"
  int lanes;         // fp32 lanes of one vector
  void (*gemm)(HostGemmArgs const&);
  void (*softmax_rescale)(HostSoftmaxArgs const&);
  void (*mask_scores)(HostMaskArgs const&);
  // dst[i] = src[i] rounded to nearest even (NaN stays NaN), i < n; dst has type `to` (kF32: a copy).
  void (*convert)(float const* src, void* dst, HostDType to, int64_t n);
  void (*dropout_keep)(HostDropoutArgs const&);
  // P(m, n) = p[m + n * ldp] becomes 0 where the bit (m + rows * n) of words (dropout_keep's order) is 0,
  // for m < live_rows rounded up to a whole vector, n < cols; rows is a multiple of 16.
  void (*dropout_apply)(float* p, int64_t ldp, int rows, int cols, int live_rows, uint32_t const* words);
  // The output tile: dst[m * ldd + j] = src[m + j * lds] rounded to type `to` as convert does, for m < rows,
  // j < cols; src (column-major fp32) holds rows rounded up to a multiple of 16.  Row by row into global O,
  // where a conversion and then a transposing copy went element by element.
  void (*store_rows)(float const* src, int64_t lds, void* dst, int64_t ldd, HostDType to, int rows, int cols);
  // The backward's dQ share: dst[m * ldd + j] += src[m + j * lds] for m < rows, j < cols, each a single fp32
  // addition as the element-by-element accumulation did; src as for store_rows.
  void (*add_rows)(float const* src, int64_t lds, float* dst, int64_t ldd, int rows, int cols);
  // A row-major tile into a column-major one, bits unchanged: dst[m + j * ldd] = src[m * lds + j] for m < rows,
  // j < cols, elements of elem_bytes (2 or 4).  Only those elements are read and written.  The backward's Q and
  // dO tiles, copied into their column-major shared tiles once per query tile (element by element before).
  void (*rows_to_columns)(void const* src, int64_t lds, void* dst, int64_t ldd, int elem_bytes, int rows, int cols);
  // The backward's probabilities from the forward's LSE: s[m + n * lds] = p = exp2(s[m + n * lds] * scale_log2 -
  // row_bias[m]) for m < rows rounded up to a whole vector, n < cols (row_bias: the rows' LSE in log2 units, +inf
  // for a row without keys, whose probabilities are then 0), by the same exp2 as the softmax step; and, where dp
  // is not null, dS in the same pass: dp[m + n * ldp] = p * (dp[m + n * ldp] - row_d[m]) (row_d null: p * dp).
  void (*exp2_rows)(float* s, int64_t lds, int rows, int cols, float const* row_bias, float scale_log2, float* dp,
                    int64_t ldp, float const* row_d);
  // Whether prefill reads whole bf16 K/V tiles where they lie instead of staging them (HostCtaContext::
  // kv_in_place): true where the bf16 GEMM loads K's rows by tile loads from any stride and packs V itself
  // (AMX), so the staging copy is one more pass over both.
  bool bf16_kv_in_place;
  // The same for fp16 and fp32 K/V: true where their GEMMs of whole tiles pack both operands themselves, split
  // into bf16 pieces (AMX).
  bool f16_kv_in_place;
  bool f32_kv_in_place;
};

// --- Selection (csrc/host/host_isa.cpp) ---

char const* host_isa_name(HostIsa isa);
// Parses "generic", "avx2", "avx512", "avx512_bf16", "amx_bf16" (also "avx512bf16", "amxbf16", "default" =
// best supported).
// Returns false for anything else.
bool host_isa_parse(char const* name, HostIsa* out, bool* is_default);
// Compiled into this build (x86-64: every level; elsewhere: generic only).
bool host_isa_compiled(HostIsa isa);
// The CPU (and the OS, for the AVX-512 register state and, on Linux, the AMX tile data it grants on request)
// supports it.
bool host_isa_supported(HostIsa isa);
// Empty when `isa` can run here, else why not ("the CPU lacks avx512_bf16", "not compiled into this build").
char const* host_isa_unavailable_reason(HostIsa isa);
// The best level compiled and supported: the highest that runs (host_isa_automatic_choice).
HostIsa host_isa_best();

// The automatic choice among the runnable levels, `highest` the highest of them: that one, except avx512 in place
// of avx512_bf16 on a core of the AMX generation (CPUID reports AMX-BF16) whose tile state is not granted or not
// compiled.  On such a Xeon a zmm vdpbf16ps ran at a quarter of vfmadd231ps's instruction rate (1.87 against
// 7.4 G/s, 12 independent accumulators), half its products, so the bf16 tile GEMMs ran at 104-109 GF/s on
// avx512_bf16 against 184-195 widened to fp32 on avx512, and a bf16 prefill call took 1.5-1.75x the time
// (docs/perf.md, "vdpbf16ps on an AMX-class Xeon").  Other avx512_bf16 cores keep it: AMD Zen 4/5 (bf16 prefill
// 1.8-3.1x SDPA there on it; not timed against avx512) and Cooper Lake (not measured); fp16 and fp32 run the
// same code on both levels.
constexpr HostIsa host_isa_automatic_choice(HostIsa highest, bool amx_class_core) {
  return highest == HostIsa::kAvx512Bf16 && amx_class_core ? HostIsa::kAvx512 : highest;
}
static_assert(host_isa_automatic_choice(HostIsa::kAvx512Bf16, true) == HostIsa::kAvx512);
static_assert(host_isa_automatic_choice(HostIsa::kAvx512Bf16, false) == HostIsa::kAvx512Bf16);
static_assert(host_isa_automatic_choice(HostIsa::kAmxBf16, true) == HostIsa::kAmxBf16);
static_assert(host_isa_automatic_choice(HostIsa::kAvx2, true) == HostIsa::kAvx2);
// The table of a level; nullptr when it is not compiled.
HostKernels const* host_kernels_for(HostIsa isa);

// The level calls use: FLASH_EXT_CPU_ISA when set (read once), else the best; host_isa_override changes it
// for the calls that start afterwards (tests: every level in one process).  A call reads it once and uses
// that table throughout, so a change during a call never mixes levels within the call.
HostIsa host_isa_selected();
// True while the selection is automatic (no FLASH_EXT_CPU_ISA, or "default").
bool host_isa_automatic();
// Sets the level ("default" restores the automatic choice).  Returns an empty string on success, else the
// reason it was refused (unknown name, not compiled, not supported by this CPU); nothing changes then.
char const* host_isa_override(char const* name);
// Why FLASH_EXT_CPU_ISA cannot be honoured (an unknown level, or one not compiled or not supported), else
// "".  The op layer then refuses CPU calls with this reason rather than run another level.
char const* host_isa_selection_error();

// Bytes of one core's L2 as the system reports it (sysconf), else 1 MiB; read once.  Sizes the decode
// splits whose K/V rows are warmed into L2 (launch_host.h).
int64_t host_l2_bytes();

// --- The running call's context, per thread ---

// A shared-memory K/V tile that was not filled: the tile GEMM reads the tile it would have held elsewhere,
// whose rows lie gmem_row_stride elements apart instead of smem_row_stride (the dense tile's kHeadDim): the
// global tile itself (global), or its copy in a HostKvMirror (whose storage holds other tiles later in the
// call, so it is no key for a HostTileCache).
struct HostTileInPlace {
  void const* smem = nullptr;
  void const* gmem = nullptr;
  int64_t gmem_row_stride = 0;
  int64_t smem_row_stride = 0;
  bool global = true;
};

// One worker thread's dense copies of whole K/V tiles, in prefill on a level that stages them (HostKernels::
// *_kv_in_place false): the first row block that reads a tile copies it here instead of into its shared tile,
// and the head's later row blocks read the copy (HostTraits::read_in_place).  Why: in a (b, s, h, d) layout a
// head's rows are h * d elements apart, so its lines fall into 1/h of the L2's sets (the low set-index bits
// come from the offset in the page); at h = 8 a head's K and V (1 MiB at bf16, d = 128, 2048 keys) overflowed
// the eighth of a 2 MiB L2 they could use, and every row block's staged copy read them from L3 again.  Dense,
// they use every set.  An entry is found by the global tile's address and row stride, which with the tile's
// shape (the traits') determine its contents: K/V are not written during a call (kvcache_fwd appends before),
// so an entry is valid for the whole call, whichever head asks.  Slots fill in order and are never evicted; the
// launcher empties the mirror when the K/V head changes, to make room; a tile that does not fit is staged.
struct HostKvMirror {
  struct Entry {
    void const* key;
    int64_t key_row_stride;
    void const* copy;
  };
  char* data = nullptr;
  int64_t bytes = 0, used = 0;
  Entry* entries = nullptr;
  int capacity = 0, count = 0;
  int hint = 0;  // where the next lookup starts
};

// What the host hooks of one CTA need that the kernel body does not pass them: the micro-kernels of the
// call and how many query rows of the tile are real.  Rows at and beyond live_rows (past the sequence end)
// are zero-filled inputs whose outputs are never stored, so the micro-kernels may skip them (a decode
// step fills 1-16 rows of a 16-row tile).  kv_in_place: this CTA's whole K/V tiles are read where they lie
// instead of staged (a decode CTA whose rows were warmed into L2; traits_host.h says why), and in_place
// says which shared tiles currently stand for a global one (or for its copy in kv_mirror).  Set by the
// launcher (launch_host.h) around each CTA.
// q_cache (the forward launcher's; null elsewhere): HostGemmArgs::a_cache of the forward's Q.K^T.
struct HostCtaContext {
  HostKernels const* kernels = nullptr;
  int live_rows = 1 << 30;
  bool kv_in_place = false;
  HostTileInPlace in_place[2];  // sK and sV
  HostPackCache* q_cache = nullptr;
  HostTileCache* kv_cache = nullptr;  // the forward launcher's, in prefill: HostGemmArgs::b_cache of in-place tiles
  HostPackCache* p_cache = nullptr;   // the forward launcher's, in prefill without dropout: HostSoftmaxArgs::p_pairs
  HostKvMirror* kv_mirror = nullptr;  // the forward launcher's, in prefill on a staging level (HostKvMirror)
};
HostCtaContext& host_cta_context();

}  // namespace flash_ext
