#include "emu/ptx.h"

#include <cmath>
#include <cstring>

namespace flash_ext::emu::ptx {

namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

}  // namespace

float f16_to_float(uint16_t h) {
  uint32_t const sign = uint32_t(h >> 15) << 31;
  int const exp = (h >> 10) & 0x1f;
  uint32_t const man = h & 0x3ffu;
  if (exp == 0x1f) { return float_of(sign | 0x7f800000u | (man << 13)); }  // inf / NaN (payload kept)
  if (exp == 0) {                                                         // zero / subnormal: man * 2^-24
    float const v = std::ldexp(float(man), -24);
    return sign ? -v : v;
  }
  return float_of(sign | (uint32_t(exp - 15 + 127) << 23) | (man << 13));
}

float bf16_to_float(uint16_t h) { return float_of(uint32_t(h) << 16); }

uint16_t float_to_bf16_rn(float x) {
  uint32_t const u = bits_of(x);
  if (std::isnan(x)) { return uint16_t((u >> 16) | 0x40); }  // quiet NaN, sign kept
  // Round to nearest even on the 16 discarded bits; a carry into the exponent is the correct rounding
  // (up to infinity for values past the largest finite bf16).
  uint32_t const lsb = (u >> 16) & 1u;
  return uint16_t((u + 0x7fffu + lsb) >> 16);
}

uint16_t float_to_f16_rn(float x) {
  uint32_t const u = bits_of(x);
  uint16_t const sign = uint16_t((u >> 16) & 0x8000u);
  if (std::isnan(x)) { return uint16_t(sign | 0x7e00u); }
  float const a = std::fabs(x);
  if (a >= 65520.f) { return uint16_t(sign | 0x7c00u); }  // 65520 = max half + half an ulp: rounds to inf
  if (a < 6.103515625e-05f) {                              // below 2^-14: subnormal half, units of 2^-24
    // a * 2^24 is exact in float (a is a float below 2^-14); nearbyint rounds half to even.
    float const q = std::nearbyint(std::ldexp(a, 24));
    return uint16_t(sign | uint16_t(q));  // q == 1024 is the smallest normal, encoded correctly as 0x0400
  }
  int const exp = int((u >> 23) & 0xff) - 127 + 15;  // 1..30
  uint32_t man = u & 0x7fffffu;
  uint32_t const rest = man & 0x1fffu;  // the 13 discarded bits
  man >>= 13;
  uint32_t h = (uint32_t(exp) << 10) | man;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) { ++h; }  // carries into the exponent correctly
  return uint16_t(sign | h);
}

namespace {
// fp16 -> fp32 of all 65536 patterns, computed once from f16_to_float (the MMA decodes 512 values per call).
float const* f16_table() {
  static float const* const table = [] {
    static float t[65536];
    for (uint32_t h = 0; h < 65536; ++h) { t[h] = f16_to_float(uint16_t(h)); }
    return t;
  }();
  return table;
}
}  // namespace

void mma_m16n8k16(Type16 type, MmaLane const (&in)[kWarp], float (&d)[kWarp][4]) {
  float const* const f16 = f16_table();
  auto to_float = [&](Type16 t, uint16_t h) { return t == Type16::kF16 ? f16[h] : bf16_to_float(h); };
  float A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < kWarp; ++lane) {
    int const group = lane >> 2, tig = lane % 4;
    for (int i = 0; i < 8; ++i) {
      uint32_t const reg = in[lane].a[i / 2];
      uint16_t const e = (i & 1) ? hi16(reg) : lo16(reg);
      int const row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
      int const col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = to_float(type, e);
    }
    for (int i = 0; i < 4; ++i) {
      uint32_t const reg = in[lane].b[i / 2];
      uint16_t const e = (i & 1) ? hi16(reg) : lo16(reg);
      int const k = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      B[k][group] = to_float(type, e);
    }
    for (int i = 0; i < 4; ++i) {
      int const row = i < 2 ? group : group + 8;
      C[row][tig * 2 + (i & 1)] = in[lane].c[i];
    }
  }
  // D = A.B + C: the 16 products of 16-bit values (exact), summed with C in double precision, rounded to fp32
  // once.
  double acc[16][8];
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 8; ++n) { acc[m][n] = C[m][n]; }
    for (int k = 0; k < 16; ++k) {
      double const a = A[m][k];
      for (int n = 0; n < 8; ++n) { acc[m][n] += a * double(B[k][n]); }
    }
  }
  float D[16][8];
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 8; ++n) { D[m][n] = float(acc[m][n]); }
  }
  for (int lane = 0; lane < kWarp; ++lane) {
    int const group = lane >> 2, tig = lane % 4;
    for (int i = 0; i < 4; ++i) { d[lane][i] = D[i < 2 ? group : group + 8][tig * 2 + (i & 1)]; }
  }
}

void mma_m16n8k16_reference(Type16 type, uint16_t const (&A)[16][16], uint16_t const (&B)[16][8],
                            float const (&C)[16][8], float (&D)[16][8]) {
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 8; ++n) {
      double acc = C[m][n];
      for (int k = 0; k < 16; ++k) { acc += double(to_float(type, A[m][k])) * double(to_float(type, B[k][n])); }
      D[m][n] = float(acc);
    }
  }
}

void ldmatrix(int num, bool trans, uint16_t const (&rows)[kWarp][8], uint32_t (&d)[kWarp][4]) {
  for (int lane = 0; lane < kWarp; ++lane) {
    for (int i = 0; i < num; ++i) {
      uint16_t const* m = &rows[8 * i][0];  // matrix i: row r is rows[8 * i + r]
      auto at = [&](int r, int c) { return m[8 * r + c]; };
      uint16_t lo, hi;
      if (!trans) {
        lo = at(lane / 4, 2 * (lane % 4));
        hi = at(lane / 4, 2 * (lane % 4) + 1);
      } else {
        lo = at(2 * (lane % 4), lane / 4);
        hi = at(2 * (lane % 4) + 1, lane / 4);
      }
      d[lane][i] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
  }
}

void shfl_bfly(float const (&a)[kWarp], int const (&lane_mask)[kWarp], float (&d)[kWarp]) {
  for (int lane = 0; lane < kWarp; ++lane) { d[lane] = a[(lane ^ lane_mask[lane]) & 31]; }
}

}  // namespace flash_ext::emu::ptx
