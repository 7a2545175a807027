// The scalar steps of tensorfold/exact (grid.py, float32.py), one IEEE operation each, in the same order.
// Built with -ffp-contract=off and without fast-math: the compiler may neither fuse a multiply
// into an add nor reorder a sum, so every line below rounds exactly where the torch one does.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tf {

constexpr double ROUND_MAGIC = 6755399441055744.0;  // 1.5 * 2^52

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// 2^e as a double for integer e in [-1022, 1023], from its bits (exact.pow2).
inline double pow2(int e) {
  uint64_t bits = static_cast<uint64_t>(static_cast<int64_t>(e) + 1023) << 52;
  double d; std::memcpy(&d, &bits, 8); return d;
}

// 2^e as a float for integer e in [-126, 127], from its bits (exact.grid.pow2_32).
inline float pow2f(int e) { return f32_from_bits(static_cast<uint32_t>(e + 127) << 23); }

// float x times 2^e: two multiplies by float powers of two, the first exact (exact.grid.scale32).
inline float scale32(float x, int e) {
  const int first = std::min(std::max(e, -126), 127);
  return x * pow2f(first) * pow2f(std::min(std::max(e - first, -126), 127));
}

// floor(log2(amax)) of a non-negative float from its bits; 0 and subnormals give -127 (exact.exponent).
inline int exponent(float amax) { return static_cast<int>((f32_bits(amax) >> 23) & 0xFF) - 127; }

// x rounded to an integer, ties to even, for |x| < 2^51 (exact.round_even).
inline double round_even(double x) { return (x + ROUND_MAGIC) - ROUND_MAGIC; }

// bfloat16 <-> float: widening is exact; narrowing rounds to nearest even as c10::BFloat16 does.
inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u = f32_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The two element types of the cpu backend: float32 and bfloat16 (stored as its bits).
struct bf16 { uint16_t bits; };
inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return bf16_to_f32(x.bits); }
template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) { return bf16{f32_to_bf16(x)}; }

// exp(x) for float x <= 0 (-inf gives 0), exact.exp_neg's steps: Cephes expf's reduction and
// degree-7 polynomial, each line one float32 rounding.
constexpr float EXP_MIN = -87.0f;
constexpr float LOG2E = 1.44269502162933349609375f;
constexpr float LN2_HI = 0.693359375f;
constexpr float EXP_LN2_LO = static_cast<float>(-2.12194440e-4);
constexpr float EXP_POLY[6] = {static_cast<float>(1.9875691500e-4), static_cast<float>(1.3981999507e-3),
                               static_cast<float>(8.3334519073e-3), static_cast<float>(4.1665795894e-2),
                               static_cast<float>(1.6666665459e-1), static_cast<float>(5.0000001201e-1)};
inline float exp_neg(float x) {
  if (x < EXP_MIN) x = EXP_MIN;  // NaN stays NaN
  float n = x * LOG2E;
  n = n + 0.5f;
  n = std::floor(n);
  float r = x - n * LN2_HI;
  r = r - n * EXP_LN2_LO;
  float p = r * EXP_POLY[0];
  for (int i = 1; i < 6; ++i) {
    p = p + EXP_POLY[i];
    p = p * r;
  }
  p = p * r;
  p = p + r;
  p = p + 1.0f;
  p = p * f32_from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return x <= EXP_MIN ? 0.0f : p;
}

// sigmoid32 of one float (reference.sigmoid32): t = exp_neg(-|x|); (x >= 0 ? 1 : t) / (1 + t).
inline float sigmoid32(float x) {
  const float t = exp_neg(-std::fabs(x));
  return (x >= 0.0f ? 1.0f : t) / (1.0f + t);
}

}  // namespace tf
