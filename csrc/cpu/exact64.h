// float64 exp and log without libm: exact.exp64 and exact.log64 (fdlibm's algorithms as fixed
// sequences of correctly rounded float64 operations), spelled as exact_triton.py spells them, one
// IEEE rounding per operation (-ffp-contract=off: nothing fused). The keyed sampler's weights and
// Gumbel noise use them over whole vocabularies.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace tf {

inline double f64_from_bits(uint64_t b) { double d; std::memcpy(&d, &b, 8); return d; }
inline int64_t f64_bits(double d) { int64_t b; std::memcpy(&b, &d, 8); return b; }

namespace c64 {  // the constants of exact/float64.py, by their bits
inline const double LN2_HI = f64_from_bits(0x3FE62E42FEE00000ull);
inline const double LN2_LO = f64_from_bits(0x3DEA39EF35793C76ull);
inline const double INV_LN2 = f64_from_bits(0x3FF71547652B82FEull);
inline const double E1 = f64_from_bits(0x3FC555555555553Eull), E2 = f64_from_bits(0xBF66C16C16BEBD93ull),
                    E3 = f64_from_bits(0x3F11566AAF25DE2Cull), E4 = f64_from_bits(0xBEBBBD41C5D26BF1ull),
                    E5 = f64_from_bits(0x3E66376972BEA4D0ull);
inline const double LG1 = f64_from_bits(0x3FE5555555555593ull), LG2 = f64_from_bits(0x3FD999999997FA04ull),
                    LG3 = f64_from_bits(0x3FD2492494229359ull), LG4 = f64_from_bits(0x3FCC71C51D8E78AFull),
                    LG5 = f64_from_bits(0x3FC7466496CB03DEull), LG6 = f64_from_bits(0x3FC39A09D078C69Full),
                    LG7 = f64_from_bits(0x3FC2F112DF3E5244ull);
constexpr double EXP_MIN = -746.0;
constexpr double MAGIC = 6755399441055744.0;              // 1.5 * 2^52
constexpr int64_t SCALE_BIAS = 1023 + 64 - 0x4338000000000000ll;  // + the bits of MAGIC + n: n + 1087
constexpr double TWO_M64 = 5.421010862427522170037264e-20;  // 2^-64
constexpr double TINY = 2.2250738585072013830902327e-308;   // 2^-1022
constexpr double TWO54 = 18014398509481984.0;
constexpr int64_t SQRT_HALF_SHIFT = static_cast<int64_t>(0x3FF00000 - 0x3FE6A09E) << 32;
}  // namespace c64

// exp(x) for float64 x <= 0, under 1 ulp; x <= -746 (and -inf) give 0, NaN stays NaN.
inline double exp64(double x) {
  using namespace c64;
  if (x < EXP_MIN) x = EXP_MIN;
  double t = x * INV_LN2;
  t = t + MAGIC;
  const double n = t - MAGIC;  // round(x / ln2), ties to even
  const double hi = x - n * LN2_HI;
  const double lo = n * LN2_LO;
  const double r = hi - lo;
  const double rr = r * r;
  double c = rr * E5 + E4;
  c = c * rr + E3;
  c = c * rr + E2;
  c = c * rr + E1;
  c = r - c * rr;
  const double y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi);
  const double scale = f64_from_bits(static_cast<uint64_t>(f64_bits(t) + SCALE_BIAS) << 52);  // 2^(n + 64)
  return (y * scale) * TWO_M64;
}

// log(x) for float64 x, under 1 ulp for every positive x (subnormals included); log(0) = -inf,
// log(inf) = inf, negative x and NaN give NaN.
inline double log64(double x) {
  using namespace c64;
  const bool sub = x < TINY;
  const int64_t bits = f64_bits(x * (sub ? TWO54 : 1.0));
  const int64_t k = ((bits + SQRT_HALF_SHIFT) >> 52) - 1023;
  const double f = f64_from_bits(static_cast<uint64_t>(bits - (k << 52))) - 1.0;
  const double hfsq = (f * 0.5) * f;
  const double s = f / (f + 2.0);
  const double z = s * s;
  const double w = z * z;
  const double t1 = ((w * LG6 + LG4) * w + LG2) * w;
  const double t2 = (((w * LG7 + LG5) * w + LG3) * w + LG1) * z;
  const double dk = static_cast<double>(k) - (sub ? 54.0 : 0.0);
  double out = ((((t2 + t1) + hfsq) * s + dk * LN2_LO) - hfsq + f) + dk * LN2_HI;
  const double inf = std::numeric_limits<double>::infinity();
  out = x < inf ? out : x;
  return x > 0.0 ? out : (x == 0.0 ? -inf : std::numeric_limits<double>::quiet_NaN());
}

// The sampler's integer weight of a token: floor(exp64(d) 2^32), d = z - m <= 0 (keyed.py: the
// min-p cut compares it). exp64(d) 2^32 < 1 for d <= -23 (exp(-23) 2^32 = 0.44, and exp64 is
// within an ulp of exp), so the weight is 0 there without the exp.
inline int64_t token_weight(double d) {
  return d <= -23.0 ? 0 : static_cast<int64_t>(std::floor(exp64(d) * 4294967296.0));
}

// keyed.gumbel of one (row key, token id): splitmix64's finalizer over key + (id + 1) GAMMA, the
// top 52 bits k as u = (2k + 1) / 2^53, then -log(-log(u)) with log64.
inline double gumbel_uniform(uint64_t row_key, int64_t token_id) {
  uint64_t x = row_key + (static_cast<uint64_t>(token_id) + 1) * 0x9E3779B97F4A7C15ull;  // mod 2^64
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<double>(static_cast<int64_t>(((x >> 12) << 1) + 1)) * 1.1102230246251565404236317e-16;
}
inline double gumbel_of_uniform(double u) { return -log64(-log64(u)); }
inline double gumbel(uint64_t row_key, int64_t token_id) { return gumbel_of_uniform(gumbel_uniform(row_key, token_id)); }

}  // namespace tf
