// Sixteen float32 lanes: the accumulator of the row-invariant GEMM (gemm.cpp).
//
// Lane l of an accumulator holds the running sum of the products at k = l, l + 16, l + 32, ...
// (one fused multiply-add each: std::fma on the scalar path, a correctly rounded operation,
// not an approximation) and the lanes are combined by one fixed halving tree, so the bits of an output depend on K
// only. Every instruction set below is a different spelling of the same arithmetic (AVX-512: one
// register; AVX2: two; NEON: four; the scalar path: sixteen floats), so all give the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "exact.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define TF_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TF_ISA "avx2"
#define TF_AVX2 1  // AVX2 with FMA, no AVX-512: the one test every file's AVX2 loops use
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define TF_ISA "neon"
#else
#define TF_ISA "scalar"
#endif

namespace tf {

struct V16 {
#if defined(__AVX512F__)
  __m512 v;
#elif defined(TF_AVX2)
  __m256 lo, hi;
#elif defined(__ARM_NEON)
  float32x4_t q[4];
#else
  float s[16];
#endif
};

#if defined(__AVX512F__)
inline V16 v16_zero() { return {_mm512_setzero_ps()}; }
inline V16 v16_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 v16_load(const bf16* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline void v16_store(V16 a, float* p) { _mm512_storeu_ps(p, a.v); }
inline V16 v16_fma(V16 acc, V16 a, V16 b) { return {_mm512_fmadd_ps(a.v, b.v, acc.v)}; }
inline float v16_tree(V16 a) {
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a.v),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}
#elif defined(TF_AVX2)
inline V16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(const bf16* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline V16 v16_load(const bf16* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline void v16_store(V16 a, float* p) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline V16 v16_fma(V16 acc, V16 a, V16 b) {
  return {_mm256_fmadd_ps(a.lo, b.lo, acc.lo), _mm256_fmadd_ps(a.hi, b.hi, acc.hi)};
}
inline float v16_tree(V16 a) {
  __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}
#elif defined(__ARM_NEON)
inline V16 v16_zero() { float32x4_t z = vdupq_n_f32(0.0f); return {{z, z, z, z}}; }
inline V16 v16_load(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline float32x4_t bf16x4(const bf16* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}
inline V16 v16_load(const bf16* p) { return {{bf16x4(p), bf16x4(p + 4), bf16x4(p + 8), bf16x4(p + 12)}}; }
inline void v16_store(V16 a, float* p) { for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, a.q[i]); }
inline V16 v16_fma(V16 acc, V16 a, V16 b) {
  V16 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vfmaq_f32(acc.q[i], a.q[i], b.q[i]);
  return r;
}
inline float v16_tree(V16 a) {
  float32x4_t s8a = vaddq_f32(a.q[0], a.q[2]), s8b = vaddq_f32(a.q[1], a.q[3]);  // lanes i + (i + 8)
  float32x4_t s4 = vaddq_f32(s8a, s8b);                                          // i + (i + 4)
  float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));                 // i + (i + 2)
  return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
}
#else
inline V16 v16_zero() { V16 r; for (float& x : r.s) x = 0.0f; return r; }
inline V16 v16_load(const float* p) { V16 r; for (int i = 0; i < 16; ++i) r.s[i] = p[i]; return r; }
inline V16 v16_load(const bf16* p) { V16 r; for (int i = 0; i < 16; ++i) r.s[i] = to_f32(p[i]); return r; }
inline void v16_store(V16 a, float* p) { for (int i = 0; i < 16; ++i) p[i] = a.s[i]; }
inline V16 v16_fma(V16 acc, V16 a, V16 b) {
  for (int i = 0; i < 16; ++i) acc.s[i] = std::fma(a.s[i], b.s[i], acc.s[i]);
  return acc;
}
inline float v16_tree(V16 a) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a.s[i] + a.s[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
  return s2a + s2b;
}
#endif

}  // namespace tf

// ---- bfloat16 pairs: the bfloat16 GEMM's step (vdpbf16ps's arithmetic) --------------------------
//
// A chunk of 32 bfloat16 elements feeds the sixteen lanes two products each: lane l adds
// element 2l + 1's product, then element 2l's, each step one fused multiply-add with the flushes
// of AVX512_BF16's vdpbf16ps: a subnormal input counts as zero of its sign, and a step whose
// result, rounded to 24 bits with an unbounded exponent, is below 2^-126 gives zero of its sign
// (kernels/reference.py: fma32_flushed). With AVX512_BF16 that is one instruction per chunk
// (except in the GEMM's one-row tiles: SplitPairs); on other x86 targets two FMAs under MXCSR's DAZ
// and FTZ (which flush the same way: measured, and tests/test_cpu_isa_variants.py builds them), set
// by PairFlush around the steps; on NEON and the scalar path the flushes are written out
// (step_flushed).
namespace tf {

constexpr float TINY32 = 0x1p-126f;  // the smallest normal float32

// fma(a, b, acc) flushed as vdpbf16ps flushes (a, b, acc not subnormal). A result of magnitude
// 2^-126 may come from a sum that, rounded with an unbounded exponent, stays just below it: that
// case is settled on the sum scaled by 2^64 (exact: such a sum's terms are far from overflow).
inline float step_flushed(float acc, float a, float b) {
  const float r = std::fma(a, b, acc);
  const float mag = std::fabs(r);
  if (!(mag <= TINY32)) return r;  // normal, infinite or NaN
  if (mag < TINY32) return std::copysign(0.0f, r);
  const float scaled = std::fma(a * 0x1p32f, b * 0x1p32f, acc * 0x1p64f);
  return std::fabs(scaled) < 0x1p-62f ? std::copysign(0.0f, scaled) : r;
}

// A bfloat16 element's bits (as the high half of a float32's) with a subnormal made zero of its sign.
inline uint32_t bf16_daz(uint32_t high) { return (high & 0x7F800000u) == 0 ? high & 0x80000000u : high; }

#if defined(__AVX512F__)
// A chunk's pairs split into odd and even elements, each widened to float32 by a mask or a shift
// (exact): two FMAs per pair. Under MXCSR's DAZ and FTZ (MxcsrFlush below) they flush as
// vdpbf16ps does, so they give its bits; where the CPU has the instruction too, the GEMM's one-row
// tiles take these (gemm.cpp: faster there on an Intel Xeon, the same bits).
struct SplitPairs {
  V16 odd, even;  // elements 2l + 1 and 2l of the chunk in lane l
};
inline SplitPairs split_pairs_load(const bf16* p) {  // DAZ (MxcsrFlush) zeroes the subnormals
  const __m512i v = _mm512_loadu_si512(p);
  return {{_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))},
          {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16))}};
}
inline V16 v16_dot_pairs(V16 acc, SplitPairs a, SplitPairs b) {
  return v16_fma(v16_fma(acc, a.odd, b.odd), a.even, b.even);
}
#endif

#if defined(__AVX512BF16__)
#define TF_PAIRS "vdpbf16ps"
struct P32 {
  __m512bh v;
};
inline P32 p32_load(const bf16* p) { return {(__m512bh)_mm512_loadu_si512(p)}; }
inline V16 v16_dot_pairs(V16 acc, P32 a, P32 b) { return {_mm512_dpbf16_ps(acc.v, a.v, b.v)}; }
#elif defined(__AVX512F__)
#define TF_PAIRS "fma-mxcsr"
using P32 = SplitPairs;
inline P32 p32_load(const bf16* p) { return split_pairs_load(p); }
#else
struct P32 {
  V16 odd, even;  // elements 2l + 1 and 2l of the chunk in lane l
};
#if defined(TF_AVX2)
#define TF_PAIRS "fma-mxcsr"
inline P32 p32_load(const bf16* p) {  // DAZ (PairFlush) zeroes the subnormals
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  return {{_mm256_castsi256_ps(_mm256_and_si256(a, hi_mask)), _mm256_castsi256_ps(_mm256_and_si256(b, hi_mask))},
          {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))}};
}
inline V16 v16_dot_pairs(V16 acc, P32 a, P32 b) { return v16_fma(v16_fma(acc, a.odd, b.odd), a.even, b.even); }
#else
#define TF_PAIRS "emulated"
inline P32 p32_load(const bf16* p) {  // the subnormals zeroed here
  float odd[16], even[16];
  for (int l = 0; l < 16; ++l) {
    odd[l] = f32_from_bits(bf16_daz(static_cast<uint32_t>(p[2 * l + 1].bits) << 16));
    even[l] = f32_from_bits(bf16_daz(static_cast<uint32_t>(p[2 * l].bits) << 16));
  }
  return {v16_load(odd), v16_load(even)};
}
inline V16 v16_dot_pairs(V16 acc, P32 a, P32 b) {
  float lanes[16], ao[16], bo[16], ae[16], be[16];
  v16_store(acc, lanes);
  v16_store(a.odd, ao);
  v16_store(b.odd, bo);
  v16_store(a.even, ae);
  v16_store(b.even, be);
  for (int l = 0; l < 16; ++l) lanes[l] = step_flushed(step_flushed(lanes[l], ao[l], bo[l]), ae[l], be[l]);
  return v16_load(lanes);
}
#endif
#endif

// No flush mode: the steps flush by themselves (vdpbf16ps, or written out).
class NoFlush {
 public:
  void done(V16*, int) {}
};
#if defined(__AVX512F__) || defined(TF_AVX2)
// MXCSR's DAZ and FTZ, held while it lives (x86 with AVX-512 or AVX2), for the split pair steps.
// `done(acc, n)` ends it early: the n accumulators are spilled to memory first, so that no step of
// theirs can be scheduled after the mode returns (what follows, the lanes' fold, is plain IEEE
// arithmetic).
class MxcsrFlush {
 public:
  MxcsrFlush() {
    unsigned csr;
    asm volatile("stmxcsr %0" : "=m"(csr));
    saved_ = csr;
    csr |= 0x8040u;  // FTZ (bit 15), DAZ (bit 6)
    asm volatile("ldmxcsr %0" : : "m"(csr) : "memory");
  }
  void done(V16* acc, int n) {
    if (restored_) return;
    asm volatile("ldmxcsr %1" : : "r"(acc), "m"(saved_), "g"(n) : "memory");
    restored_ = true;
  }
  ~MxcsrFlush() {
    if (!restored_) asm volatile("ldmxcsr %0" : : "m"(saved_) : "memory");
  }

 private:
  unsigned saved_ = 0;
  bool restored_ = false;
};
#endif

// The flush mode v16_dot_pairs on P32 needs: MXCSR's on x86 targets without AVX512_BF16 (the
// instruction flushes by itself; NEON and the scalar path write the flushes out).
#if !defined(__AVX512BF16__) && (defined(__AVX512F__) || defined(TF_AVX2))
using PairFlush = MxcsrFlush;
#else
using PairFlush = NoFlush;
#endif

}  // namespace tf

namespace tf {

// v16_tree of sixteen accumulators at once: out[i] = v16_tree(a[i]), bit for bit. The AVX-512
// version runs the same halving tree on all sixteen in shuffled registers (45 vector operations
// instead of about 150): level 1 pairs accumulators, each sum still a[i][l] + a[i][l + 8]; level 2
// l + (l + 4); level 3 l + (l + 2); level 4 l + (l + 1); the last register holds output
// 4 r + q in lane 4 q + r.
inline void v16_tree16(const V16* a, float* out) {
#if defined(__AVX512F__)
  __m512 l1[8], l2[4], l3[2];
  for (int p = 0; p < 8; ++p)
    l1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p].v, a[2 * p + 1].v, 0x44),
                          _mm512_shuffle_f32x4(a[2 * p].v, a[2 * p + 1].v, 0xEE));
  for (int p = 0; p < 4; ++p)
    l2[p] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * p], l1[2 * p + 1], 0x88),
                          _mm512_shuffle_f32x4(l1[2 * p], l1[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; ++p)
    l3[p] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * p], l2[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(l2[2 * p], l2[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 l4 = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  float lanes[16];
  _mm512_storeu_ps(lanes, l4);
  for (int q = 0; q < 4; ++q)
    for (int r = 0; r < 4; ++r) out[4 * r + q] = lanes[4 * q + r];
#else
  for (int i = 0; i < 16; ++i) out[i] = v16_tree(a[i]);
#endif
}

// out[j] = exp_neg(x[j] - m) for j < n: exact.h's exp_neg, sixteen (AVX-512) or eight (AVX2) lanes
// at a time (the same IEEE operations in the same order, blends for its two branches).
inline void exp_neg_shifted(const float* x, float m, float* out, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 lo = _mm512_set1_ps(EXP_MIN), log2e = _mm512_set1_ps(LOG2E), half = _mm512_set1_ps(0.5f);
  const __m512 ln2_hi = _mm512_set1_ps(LN2_HI), ln2_lo = _mm512_set1_ps(EXP_LN2_LO), one = _mm512_set1_ps(1.0f);
  const __m512 mv = _mm512_set1_ps(m);
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_sub_ps(_mm512_loadu_ps(x + j), mv);
    v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, lo, _CMP_LT_OQ), v, lo);  // NaN stays NaN
    __m512 k = _mm512_mul_ps(v, log2e);
    k = _mm512_add_ps(k, half);
    k = _mm512_roundscale_ps(k, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(v, _mm512_mul_ps(k, ln2_hi));
    r = _mm512_sub_ps(r, _mm512_mul_ps(k, ln2_lo));
    __m512 p = _mm512_mul_ps(r, _mm512_set1_ps(EXP_POLY[0]));
    for (int i = 1; i < 6; ++i) {
      p = _mm512_add_ps(p, _mm512_set1_ps(EXP_POLY[i]));
      p = _mm512_mul_ps(p, r);
    }
    p = _mm512_mul_ps(p, r);
    p = _mm512_add_ps(p, r);
    p = _mm512_add_ps(p, one);
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
    p = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, lo, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), p);
    _mm512_storeu_ps(out + j, p);
  }
#elif defined(TF_AVX2)
  const __m256 lo = _mm256_set1_ps(EXP_MIN), log2e = _mm256_set1_ps(LOG2E), half = _mm256_set1_ps(0.5f);
  const __m256 ln2_hi = _mm256_set1_ps(LN2_HI), ln2_lo = _mm256_set1_ps(EXP_LN2_LO), one = _mm256_set1_ps(1.0f);
  const __m256 mv = _mm256_set1_ps(m);
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_sub_ps(_mm256_loadu_ps(x + j), mv);
    v = _mm256_blendv_ps(v, lo, _mm256_cmp_ps(v, lo, _CMP_LT_OQ));  // NaN stays NaN
    __m256 k = _mm256_mul_ps(v, log2e);
    k = _mm256_add_ps(k, half);
    k = _mm256_floor_ps(k);
    __m256 r = _mm256_sub_ps(v, _mm256_mul_ps(k, ln2_hi));
    r = _mm256_sub_ps(r, _mm256_mul_ps(k, ln2_lo));
    __m256 p = _mm256_mul_ps(r, _mm256_set1_ps(EXP_POLY[0]));
    for (int i = 1; i < 6; ++i) {
      p = _mm256_add_ps(p, _mm256_set1_ps(EXP_POLY[i]));
      p = _mm256_mul_ps(p, r);
    }
    p = _mm256_mul_ps(p, r);
    p = _mm256_add_ps(p, r);
    p = _mm256_add_ps(p, one);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(v, lo, _CMP_GT_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    _mm256_storeu_ps(out + j, _mm256_and_ps(p, keep));
  }
#endif
  for (; j < n; ++j) out[j] = exp_neg(x[j] - m);
}

}  // namespace tf
