// Semantics of the warp-wide instructions the Sm80 kernels issue, written from the PTX ISA's descriptions
// (section "Warp Level Matrix Multiply-Accumulate Instructions": the mma.m16n8k16 fragment tables and
// ldmatrix; shfl.sync), never from CuTe's layouts.  The kernels reach these instructions through CuTe's atom
// layouts; if a layout, a partition or a fragment pairing is used wrongly, the emulated result is wrong.
//
// Every function takes the operands of all 32 lanes at once (the emulator gathers them) and produces every
// lane's results.  Numerics: see mma_m16n8k16 and convert_rn.
#pragma once

#include <cstdint>

namespace flash_ext::emu::ptx {

inline constexpr int kWarp = 32;

// ---------------------------------------------------------------------------------------------------
// 16-bit floating point formats (IEEE binary16 and bfloat16), as raw bits.

float f16_to_float(uint16_t h);
float bf16_to_float(uint16_t h);
// cvt.rn.f16.f32 / cvt.rn.bf16.f32: round to nearest, ties to even; overflow gives infinity; NaN stays NaN.
uint16_t float_to_f16_rn(float x);
uint16_t float_to_bf16_rn(float x);

enum class Type16 { kF16, kBF16 };

inline float to_float(Type16 t, uint16_t h) { return t == Type16::kF16 ? f16_to_float(h) : bf16_to_float(h); }
inline uint16_t from_float_rn(Type16 t, float x) { return t == Type16::kF16 ? float_to_f16_rn(x) : float_to_bf16_rn(x); }

// A .f16x2 / .bf16x2 register: element 0 (the lower-indexed one) in bits 0-15.
inline uint16_t lo16(uint32_t r) { return uint16_t(r & 0xffffu); }
inline uint16_t hi16(uint32_t r) { return uint16_t(r >> 16); }

// ---------------------------------------------------------------------------------------------------
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32  d, a, b, c:  D = A (16x16) . B (16x8) + C.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// groupID = lane >> 2 and tig = lane % 4 (threadID_in_group):
//   A: four .f16x2 registers = elements a0..a7 (a[2j] low half of register j, a[2j+1] high half);
//      row(a_i) = groupID for i in {0,1,4,5}, groupID + 8 otherwise;
//      col(a_i) = tig * 2 + (i & 1) for i < 4, tig * 2 + (i & 1) + 8 for i >= 4.
//   B: two .f16x2 registers = b0..b3; row(b_i) (the k index) = tig * 2 + (i & 1) for i < 2, + 8 for i >= 2;
//      col(b_i) (the n index) = groupID.
//   C, D: four .f32 = c0..c3; row(c_i) = groupID for i < 2, groupID + 8 otherwise; col(c_i) = tig * 2 + (i & 1).
//
// Products of two 16-bit values are exact; the 16 products and c are summed in double precision and rounded
// once to fp32.  Real tensor cores round (or truncate) their internal sums differently: results may differ
// from a GPU in the last bits of fp32, which no test here relies on.
struct MmaLane {
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
};
void mma_m16n8k16(Type16 type, MmaLane const (&in)[kWarp], float (&d)[kWarp][4]);

// The same operation from whole matrices, for tests: A row-major 16x16, B 16x8 (k rows, n columns), C/D 16x8.
void mma_m16n8k16_reference(Type16 type, uint16_t const (&A)[16][16], uint16_t const (&B)[16][8],
                            float const (&C)[16][8], float (&D)[16][8]);

// ---------------------------------------------------------------------------------------------------
// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16  {d0, d1, d2, d3}, [p]   (num = 4), and
// ldmatrix.sync.aligned.m8n8.x2{.trans}.shared.b16  {d0, d1}, [p]           (num = 2).
//
// Lanes 8i..8i+7 supply the addresses of rows 0..7 of matrix i (16 bytes each, 16-byte aligned); with .x2
// the addresses of lanes 16-31 are not used.  Register d_i of every lane receives a fragment of matrix i:
// without .trans, lane l gets row l / 4, elements 2 * (l % 4) and 2 * (l % 4) + 1 (low and high half); with
// .trans, the matrix is transposed first: lane l gets elements (row 2 * (l % 4), column l / 4) and
// (row 2 * (l % 4) + 1, column l / 4).  rows[l] holds the 8 b16 values at lane l's address; d[l][i] for
// i >= num is left unchanged.
void ldmatrix(int num, bool trans, uint16_t const (&rows)[kWarp][8], uint32_t (&d)[kWarp][4]);

// ---------------------------------------------------------------------------------------------------
// shfl.sync.bfly.b32 d, a, lane_mask, 0x1f, 0xffffffff: lane l receives a from lane l ^ lane_mask (each lane
// may pass its own mask; with the full member mask every source lane is in range).
void shfl_bfly(float const (&a)[kWarp], int const (&lane_mask)[kWarp], float (&d)[kWarp]);

}  // namespace flash_ext::emu::ptx
