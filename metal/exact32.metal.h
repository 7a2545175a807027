// exact32.metal.h: the integer grid and the float32 steps every exact shader shares.
//
// Metal has no double, so the sums the torch references carry in float64 are long (int64) here,
// and every float32 step that must be correctly rounded is either one IEEE float32 operation
// the Metal compiler cannot change (+, -, *, floor, compares, in the reference's order, one per
// statement) or integer arithmetic on the bits:
// - division: div_rn, the quotient's significand by integer long division, rounded half to even
//   (not Metal's `/`: it is only correctly rounded while fast math is off);
// - int64 -> float32: float32_of_int, float32(float64(total) 2^g) with both roundings done on
//   integers (the reference's two conversions);
// - float32 -> float16: half_parts, float16's significand and exponent rounded on integers.
// exp is exp_neg, tensorfold/exact/float32.py's polynomial, step for step.
//
// Contraction: `a * b + c` must stay two roundings. Each product here is its own statement
// (Metal's safe math mode contracts only within a statement) and, where the compiler knows it,
// `#pragma METAL fp contract(off)` forbids contraction outright (MSL 3.2, macOS 15; older
// compilers get clang's spelling). The constants (TF_*) come from the Python modules that define
// them (tensorfold/mlx/metal.py writes them in front of this header), never retyped here.
#ifndef TF_EXACT32
#define TF_EXACT32

#if defined(__METAL_VERSION__)
#if __METAL_VERSION__ >= 320
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
#else
#pragma clang fp contract(off)
#endif
#endif

struct Significand {  // x == m 2^e exactly
  long m;
  int e;
};

inline float f32_of_bits(uint bits) { return as_type<float>(bits); }

// floor(log2(amax)) of a non-negative float32 (0 and subnormals: -127): exact.grid.exponent.
inline int exponent_of(float amax) { return ((as_type<int>(amax) >> 23) & 0xFF) - 127; }

// 2^e as a float32, e in [-126, 127], from its bits.
inline float pow2f(int e) { return as_type<float>(uint(e + 127) << 23); }

// A finite float32 as m 2^e, |m| < 2^24 (exact; zero: m = 0).
inline Significand significand(float x) {
  uint bits = as_type<uint>(x);
  int biased = int((bits >> 23) & 0xFF);
  long m = long(bits & 0x7FFFFFu);
  if (biased > 0) m |= 0x800000;
  Significand out;
  out.m = (bits >> 31) ? -m : m;
  out.e = biased > 0 ? biased - 150 : -149;
  return out;
}

inline int bit_length64(ulong a) {
  uint high = uint(a >> 32);
  return high ? 64 - int(clz(high)) : 32 - int(clz(uint(a)));
}

// a / 2^drop rounded half to even, with `sticky`: whether a nonzero value lies below a's last
// bit (it breaks a tie upward). drop >= 0; a < 2^63.
inline ulong round_shift(ulong a, int drop, bool sticky) {
  if (drop == 0) return a;
  if (drop >= 64) return 0;
  ulong floor_part = a >> drop;
  ulong rem = a & ((ulong(1) << drop) - 1);
  ulong halfway = ulong(1) << (drop - 1);  // (not `half`: a Metal type)
  bool up = rem > halfway || (rem == halfway && (sticky || (floor_part & 1)));
  return floor_part + (up ? 1 : 0);
}

// Signed v / 2^down rounded half to even (exact.grid.round_even's rule on integers), down >= 0;
// a shift of 62 or more gives 0 for every |v| < 2^61.
inline long shift_round(long v, int down) {
  if (down <= 0) return v;
  if (down > 62) down = 62;
  long floor_part = v >> down;  // arithmetic: the floor
  long rem = long(ulong(v) - (ulong(floor_part) << down));
  long halfway = long(1) << (down - 1);
  bool up = rem > halfway || (rem == halfway && (floor_part & 1));
  return floor_part + (up ? 1 : 0);
}

// v 2^by for either sign of `by`: a left shift, or shift_round.
inline long shift_by(long v, int by) {
  return by >= 0 ? long(ulong(v) << by) : shift_round(v, -by);
}

// float32 x on its vector's grid as an integer: round_even(x 2^(bits - 1 - e)) (exact.grid.to_fixed).
inline long to_grid(float x, int e, int bits) {
  Significand s = significand(x);
  return shift_by(s.m, s.e + bits - 1 - e);
}

// The float32 nearest (m + sticky) 2^e, ties to even, subnormal and overflowing results included:
// m < 2^63; where sticky is set the rounding drops at least one bit of m.
inline float round_to_float32(uint sign, ulong m, int e, bool sticky) {
  if (m == 0) return as_type<float>(sign);
  int top = bit_length64(m);
  int drop = (top - 1 + e < -126) ? -149 - e : top - 24;  // bits below float32's last place
  ulong kept = drop >= 0 ? round_shift(m, drop, sticky) : m << (-drop);
  int kept_exp = drop + e;  // value = kept 2^kept_exp, kept <= 2^24
  if (kept >> 24) {         // rounding carried into a new bit
    kept >>= 1;
    kept_exp += 1;
  }
  if (kept < 0x800000) return as_type<float>(sign | uint(kept));  // subnormal (or 0): kept_exp == -149
  int biased = kept_exp + 23 + 127;
  if (biased >= 255) return as_type<float>(sign | 0x7F800000u);
  return as_type<float>(sign | (uint(biased) << 23) | (uint(kept) & 0x7FFFFFu));
}

// float32(float64(total) 2^g) for |total| < 2^62: total rounded to 53 significant bits, then to
// float32 (or its subnormal quantum), both half to even: the references' two conversions.
inline float float32_of_int(long total, int g) {
  uint sign = total < 0 ? 0x80000000u : 0u;
  ulong a = total < 0 ? ulong(0) - ulong(total) : ulong(total);
  int top = bit_length64(a);
  if (top > 53) a = round_shift(a, top - 53, false) << (top - 53);  // float64(total)
  return round_to_float32(sign, a, g, false);
}

// Correctly rounded float32 a / b, on integers: IEEE specials, subnormals, overflow to inf.
inline float div_rn(float a, float b) {
  uint ua = as_type<uint>(a), ub = as_type<uint>(b);
  uint sign = (ua ^ ub) & 0x80000000u;
  uint abs_a = ua & 0x7FFFFFFFu, abs_b = ub & 0x7FFFFFFFu;
  if (abs_a > 0x7F800000u || abs_b > 0x7F800000u) return as_type<float>(0x7FC00000u);  // NaN in
  if (abs_a == 0x7F800000u || abs_b == 0) {                                  // inf / x, x / 0
    bool nan = (abs_a == 0x7F800000u && abs_b == 0x7F800000u) || (abs_a == 0 && abs_b == 0);
    return as_type<float>(nan ? 0x7FC00000u : (sign | 0x7F800000u));
  }
  if (abs_a == 0 || abs_b == 0x7F800000u) return as_type<float>(sign);     // 0 / x, x / inf
  // Both finite and nonzero: significands normalised into [2^23, 2^24).
  int ea = int(abs_a >> 23), eb = int(abs_b >> 23);
  uint ma = abs_a & 0x7FFFFFu, mb = abs_b & 0x7FFFFFu;
  if (ea) ma |= 0x800000u; else { ea = 1; while (!(ma & 0x800000u)) { ma <<= 1; ea -= 1; } }
  if (eb) mb |= 0x800000u; else { eb = 1; while (!(mb & 0x800000u)) { mb <<= 1; eb -= 1; } }
  int e = ea - eb;
  uint rem = ma;
  if (rem < mb) {
    rem <<= 1;
    e -= 1;
  }
  uint q = 0;  // 26 quotient bits: q in [2^25, 2^26)
  for (int i = 0; i < 26; ++i) {
    q <<= 1;
    if (rem >= mb) {
      rem -= mb;
      q |= 1;
    }
    rem <<= 1;
  }
  return round_to_float32(sign, q, e - 25, rem != 0);
}

// float16(v) as (m, e), v == m 2^e, |m| < 2^11 (quant_gemm.significand's integers; zero: (0, -24)),
// rounded half to even from float32 v; |v| <= 65504.
inline Significand half_parts(float v) {
  Significand s = significand(v);
  ulong a = ulong(s.m < 0 ? -s.m : s.m);
  Significand out;
  out.e = -24;
  out.m = 0;
  if (a == 0) return out;
  int top = bit_length64(a);
  int drop = (top - 11) > (-24 - s.e) ? (top - 11) : (-24 - s.e);  // 11 bits, or the 2^-24 quantum
  ulong m = drop >= 0 ? round_shift(a, drop, false) : a << (-drop);
  int e = s.e + drop;
  if (m >> 11) {
    m >>= 1;
    e += 1;
  }
  out.m = s.m < 0 ? -long(m) : long(m);
  out.e = m == 0 ? -24 : e;
  return out;
}

// exact.float32.exp_neg: exp of float32 x <= 0 (-inf: 0), the reference's steps in its order.
inline float exp_neg(float x) {
  const float exp_min = f32_of_bits(TF_EXP_MIN_BITS);
  x = x < exp_min ? exp_min : x;  // not metal::max: NaN stays NaN, as clamp_min keeps it
  float t = x * f32_of_bits(TF_LOG2E_BITS);
  t = t + 0.5f;
  float n = metal::floor(t);
  float hi = n * f32_of_bits(TF_LN2_HI_BITS);
  float r = x - hi;
  float lo = n * f32_of_bits(TF_LN2_LO_BITS);
  r = r - lo;
  float p = r * f32_of_bits(TF_EXP_P0_BITS);
  p = p + f32_of_bits(TF_EXP_P1_BITS);
  p = p * r;
  p = p + f32_of_bits(TF_EXP_P2_BITS);
  p = p * r;
  p = p + f32_of_bits(TF_EXP_P3_BITS);
  p = p * r;
  p = p + f32_of_bits(TF_EXP_P4_BITS);
  p = p * r;
  p = p + f32_of_bits(TF_EXP_P5_BITS);
  p = p * r;
  p = p * r;
  p = p + r;
  p = p + 1.0f;
  float scale = as_type<float>(uint(int(n) + 127) << 23);  // 2^n
  p = p * scale;
  return x <= exp_min ? 0.0f : p;
}

#endif  // TF_EXACT32
