// float64_soft.metal.h: IEEE binary64 arithmetic on ulong bit patterns, for the keyed sampler.
//
// Metal has no double, and the sampler's reference (tensorfold/sampling/sampler.py) computes in
// float64: z = x / T, q = floor(exp64(z - m) 2^32), z + gumbel. So the shaders carry each float64
// as its 64 bits and compute every operation the way IEEE defines it: the exact result rounded
// once, half to even, subnormals and infinities included (f64_add, f64_sub, f64_mul, f64_div;
// f64_of_f32 and f64_of_long convert exactly, or round once). Then exp64 and log64 below are
// tensorfold/exact/float64.py's fdlibm sequences, step for step, and give its bits.
// Needs exact32.metal.h (round_shift, bit_length64). Only integer operations: nothing here can be
// contracted, reassociated or flushed by a compiler's float mode.
#ifndef TF_FLOAT64_SOFT
#define TF_FLOAT64_SOFT

#define TF_F64_SIGN 0x8000000000000000ul
#define TF_F64_ABS 0x7FFFFFFFFFFFFFFFul
#define TF_F64_INF 0x7FF0000000000000ul
#define TF_F64_NAN 0x7FF8000000000000ul
#define TF_F64_FRAC 0x000FFFFFFFFFFFFFul
#define TF_F64_ONE 0x3FF0000000000000ul
#define TF_F64_TWO 0x4000000000000000ul
#define TF_F64_HALF 0x3FE0000000000000ul

struct F64Parts {  // a finite nonzero float64 as sign and m 2^e (m < 2^53)
  ulong sign;
  ulong m;
  int e;
};

inline bool f64_is_nan(ulong a) { return (a & TF_F64_ABS) > TF_F64_INF; }
inline bool f64_is_inf(ulong a) { return (a & TF_F64_ABS) == TF_F64_INF; }
inline bool f64_is_zero(ulong a) { return (a & TF_F64_ABS) == 0; }
inline ulong f64_neg(ulong a) { return a ^ TF_F64_SIGN; }

inline F64Parts f64_parts(ulong a) {
  F64Parts p;
  p.sign = a & TF_F64_SIGN;
  int biased = int((a >> 52) & 0x7FF);
  p.m = a & TF_F64_FRAC;
  if (biased > 0) p.m |= ulong(1) << 52;
  p.e = biased > 0 ? biased - 1075 : -1074;
  return p;
}

// The float64 nearest (m + sticky) 2^e, ties to even (sticky: a nonzero value below m's last bit,
// only where the rounding drops bits of m).
inline ulong f64_round(ulong sign, ulong m, int e, bool sticky) {
  if (m == 0) return sign;
  int top = bit_length64(m);
  int drop = (top - 1 + e < -1022) ? -1074 - e : top - 53;
  ulong kept = drop >= 0 ? round_shift(m, drop, sticky) : m << (-drop);
  int kept_exp = drop + e;
  if (kept >> 53) {
    kept >>= 1;
    kept_exp += 1;
  }
  if (kept < (ulong(1) << 52)) return sign | kept;  // subnormal: kept_exp == -1074
  int biased = kept_exp + 52 + 1023;
  if (biased >= 2047) return sign | TF_F64_INF;
  return sign | (ulong(biased) << 52) | (kept & TF_F64_FRAC);
}

inline ulong f64_add(ulong a, ulong b) {
  if (f64_is_nan(a) || f64_is_nan(b)) return TF_F64_NAN;
  if (f64_is_inf(a)) return (f64_is_inf(b) && a != b) ? TF_F64_NAN : a;
  if (f64_is_inf(b)) return b;
  if (f64_is_zero(b)) return f64_is_zero(a) ? (a & b) : a;  // -0 + -0 = -0, else +0
  if (f64_is_zero(a)) return b;
  if ((a & TF_F64_ABS) < (b & TF_F64_ABS)) {  // |a| >= |b| from here
    ulong t = a;
    a = b;
    b = t;
  }
  F64Parts x = f64_parts(a), y = f64_parts(b);
  const int guard = 9;  // m << 9 < 2^62: room for a carry
  ulong mx = x.m << guard, my = y.m << guard;
  int diff = x.e - y.e;
  if (diff >= 64) {
    my = 1;  // all of it below the last bit: jammed into one sticky bit
  } else if (diff > 0) {
    bool lost = (my & ((ulong(1) << diff) - 1)) != 0;
    my = (my >> diff) | (lost ? 1 : 0);
  }
  ulong total = x.sign == y.sign ? mx + my : mx - my;
  if (total == 0) return 0;  // exact cancellation: +0
  return f64_round(x.sign, total, x.e - guard, false);
}

inline ulong f64_sub(ulong a, ulong b) { return f64_add(a, f64_neg(b)); }

// The 128-bit product of two 64-bit integers, as (high, low), from 32-bit halves.
inline void mul_wide(ulong a, ulong b, thread ulong& high, thread ulong& low) {
  ulong a0 = a & 0xFFFFFFFFul, a1 = a >> 32, b0 = b & 0xFFFFFFFFul, b1 = b >> 32;
  ulong p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
  ulong mid = (p00 >> 32) + (p01 & 0xFFFFFFFFul) + (p10 & 0xFFFFFFFFul);
  low = (p00 & 0xFFFFFFFFul) | (mid << 32);
  high = p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
}

inline ulong f64_mul(ulong a, ulong b) {
  ulong sign = (a ^ b) & TF_F64_SIGN;
  if (f64_is_nan(a) || f64_is_nan(b)) return TF_F64_NAN;
  if (f64_is_inf(a) || f64_is_inf(b)) {
    return (f64_is_zero(a) || f64_is_zero(b)) ? TF_F64_NAN : (sign | TF_F64_INF);
  }
  if (f64_is_zero(a) || f64_is_zero(b)) return sign;
  F64Parts x = f64_parts(a), y = f64_parts(b);
  ulong high, low;
  mul_wide(x.m, y.m, high, low);  // < 2^106
  int e = x.e + y.e;
  bool sticky = false;
  ulong m = low;
  if (high != 0 || (low >> 62) != 0) {  // keep 62 bits, the rest as a sticky bit
    int top = high != 0 ? 64 + bit_length64(high) : bit_length64(low);
    int shift = top - 62;
    ulong below = shift >= 64 ? low : (low & ((ulong(1) << shift) - 1));
    sticky = below != 0 || (shift > 64 && (high & ((ulong(1) << (shift - 64)) - 1)) != 0);
    m = shift >= 64 ? (high >> (shift - 64)) : ((low >> shift) | (high << (64 - shift)));
    e += shift;
  }
  return f64_round(sign, m, e, sticky);
}

inline ulong f64_div(ulong a, ulong b) {
  ulong sign = (a ^ b) & TF_F64_SIGN;
  if (f64_is_nan(a) || f64_is_nan(b)) return TF_F64_NAN;
  if (f64_is_inf(a)) return f64_is_inf(b) ? TF_F64_NAN : (sign | TF_F64_INF);
  if (f64_is_inf(b)) return sign;
  if (f64_is_zero(b)) return f64_is_zero(a) ? TF_F64_NAN : (sign | TF_F64_INF);
  if (f64_is_zero(a)) return sign;
  F64Parts x = f64_parts(a), y = f64_parts(b);
  while (!(x.m >> 52)) {  // subnormals: significands into [2^52, 2^53)
    x.m <<= 1;
    x.e -= 1;
  }
  while (!(y.m >> 52)) {
    y.m <<= 1;
    y.e -= 1;
  }
  int e = x.e - y.e;
  ulong rem = x.m;
  if (rem < y.m) {
    rem <<= 1;
    e -= 1;
  }
  ulong q = 0;  // 55 quotient bits: q in [2^54, 2^55)
  for (int i = 0; i < 55; ++i) {
    q <<= 1;
    if (rem >= y.m) {
      rem -= y.m;
      q |= 1;
    }
    rem <<= 1;
  }
  return f64_round(sign, q, e - 54, rem != 0);
}

inline ulong f64_of_f32(float x) {
  uint bits = as_type<uint>(x);
  ulong sign = ulong(bits >> 31) << 63;
  int biased = int((bits >> 23) & 0xFF);
  ulong frac = ulong(bits & 0x7FFFFFu);
  if (biased == 0xFF) return sign | TF_F64_INF | (frac << 29);
  if (biased == 0) return frac == 0 ? sign : f64_round(sign, frac, -149, false);
  return sign | (ulong(biased - 127 + 1023) << 52) | (frac << 29);
}

inline ulong f64_of_long(long v) {
  ulong sign = v < 0 ? TF_F64_SIGN : 0;
  ulong a = v < 0 ? ulong(0) - ulong(v) : ulong(v);
  return f64_round(sign, a, 0, false);
}

// floor(a) as a long for a finite float64 0 <= a < 2^63.
inline long f64_floor_nonneg(ulong a) {
  if (f64_is_zero(a)) return 0;
  F64Parts p = f64_parts(a);
  if (p.e >= 0) return long(p.m << p.e);
  return p.e <= -64 ? 0 : long(p.m >> (-p.e));
}

// A long that orders float64s as their values do (NaN excluded; -0 == +0).
inline long f64_order(ulong a) { return (a & TF_F64_SIGN) ? -long(a & TF_F64_ABS) : long(a); }

// exact.float64.exp64: exp of float64 x <= 0 (-inf: 0), its steps in its order.
inline ulong exp64(ulong x) {
  if (!f64_is_nan(x) && f64_order(x) < f64_order(TF_EXP64_MIN_BITS)) x = TF_EXP64_MIN_BITS;
  ulong t = f64_mul(x, TF_INV_LN2_BITS);
  t = f64_add(t, TF_ROUND_MAGIC_BITS);        // x / ln2 + M: n in the low bits
  ulong n = f64_sub(t, TF_ROUND_MAGIC_BITS);  // round(x / ln2)
  ulong hi = f64_mul(n, TF_LN2_HI64_BITS);
  hi = f64_sub(x, hi);                        // exact
  ulong lo = f64_mul(n, TF_LN2_LO64_BITS);
  ulong r = f64_sub(hi, lo);
  ulong rr = f64_mul(r, r);
  ulong c = f64_mul(rr, TF_EXP64_P5_BITS);
  c = f64_add(c, TF_EXP64_P4_BITS);
  c = f64_mul(c, rr);
  c = f64_add(c, TF_EXP64_P3_BITS);
  c = f64_mul(c, rr);
  c = f64_add(c, TF_EXP64_P2_BITS);
  c = f64_mul(c, rr);
  c = f64_add(c, TF_EXP64_P1_BITS);
  c = f64_mul(c, rr);
  c = f64_sub(r, c);
  ulong rc = f64_mul(r, c);
  rc = f64_div(rc, f64_sub(TF_F64_TWO, c));
  ulong y = f64_sub(lo, rc);
  y = f64_sub(y, hi);
  y = f64_sub(TF_F64_ONE, y);
  ulong scale = ulong(long(t) + long(TF_SCALE_BIAS)) << 52;  // 2^(n + 64) from t's bits
  y = f64_mul(y, scale);
  return f64_mul(y, TF_TWO_M64_BITS);
}

// exact.float64.log64: log of a float64 (log 0 = -inf, log +inf = +inf, negative and NaN: NaN).
inline ulong log64(ulong x) {
  if (f64_is_nan(x) || ((x & TF_F64_SIGN) && !f64_is_zero(x))) return TF_F64_NAN;
  if (f64_is_zero(x)) return TF_F64_SIGN | TF_F64_INF;
  if (f64_is_inf(x)) return x;
  bool sub = x < TF_TINY64_BITS;  // subnormal: log(x 2^54) - 54 ln2
  long bits = long(sub ? f64_mul(x, TF_TWO54_BITS) : x);
  long k = ((bits + long(TF_SQRT_HALF_SHIFT)) >> 52) - 1023;
  ulong f = ulong(bits - long(ulong(k) << 52));  // m in [sqrt(1/2), sqrt(2))
  f = f64_sub(f, TF_F64_ONE);
  ulong dk = f64_of_long(k);
  if (sub) dk = f64_sub(dk, f64_of_long(54));
  ulong hfsq = f64_mul(f, TF_F64_HALF);
  hfsq = f64_mul(hfsq, f);
  ulong s = f64_div(f, f64_add(f, TF_F64_TWO));
  ulong z = f64_mul(s, s);
  ulong w = f64_mul(z, z);
  ulong t1 = f64_mul(w, TF_LG6_BITS);
  t1 = f64_add(t1, TF_LG4_BITS);
  t1 = f64_mul(t1, w);
  t1 = f64_add(t1, TF_LG2_BITS);
  t1 = f64_mul(t1, w);
  ulong r = f64_mul(w, TF_LG7_BITS);
  r = f64_add(r, TF_LG5_BITS);
  r = f64_mul(r, w);
  r = f64_add(r, TF_LG3_BITS);
  r = f64_mul(r, w);
  r = f64_add(r, TF_LG1_BITS);
  r = f64_mul(r, z);
  r = f64_add(r, t1);
  r = f64_add(r, hfsq);
  r = f64_mul(r, s);
  r = f64_add(r, f64_mul(dk, TF_LN2_LO64_BITS));
  r = f64_sub(r, hfsq);
  r = f64_add(r, f);
  return f64_add(r, f64_mul(dk, TF_LN2_HI64_BITS));
}

// keyed.mix64: splitmix64's finalizer.
inline ulong mix64(ulong x) {
  x = (x ^ (x >> 30)) * TF_MIX_MUL1;
  x = (x ^ (x >> 27)) * TF_MIX_MUL2;
  return x ^ (x >> 31);
}

// keyed.gumbel for one (row key, token id): -log(-log(u)), u = (2k + 1) 2^-53 from the top 52
// bits k of the token's hash.
inline ulong gumbel64(ulong row_key, long token_id) {
  ulong h = mix64(row_key + (ulong(token_id) + 1) * TF_GAMMA);
  ulong u = f64_mul(f64_of_long(long((h >> 12) * 2 + 1)), TF_TWO_M53_BITS);
  return f64_neg(log64(f64_neg(log64(u))));
}

#endif  // TF_FLOAT64_SOFT
