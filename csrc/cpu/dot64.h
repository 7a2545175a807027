// The float64 inner loops of the exact attention (attention.cpp): rows converted to float64, the
// scores q . k_j of eight keys, and the weighted sum of V rows.
//
// Every product and every partial sum in them is an integer multiple of one power of two and
// stays below 2^53 (paged_attention.py's bit budget), so each is exact and the order they run in
// is free: the AVX-512 spellings, the four-lane compiler vectors used elsewhere (AVX2, SSE2,
// NEON) and the plain loops beside them give the same bits, and each may add in whatever order
// is fastest (lanes first, a transposing tree after).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "exact.h"
#include "vec16.h"

namespace tf {

#if !defined(__AVX512F__) && defined(__GNUC__)
// Without AVX-512, four float64 lanes as a compiler vector (GCC and Clang's vector extensions): one
// register with AVX2, two with SSE2 or NEON. The loops below keep several sums per lane and add
// the lanes at the end, which the plain loops' single chains cannot do (without fast-math the
// compiler keeps their order); every sum is exact, so the bits are the same.
#define TF_F64X4 1
typedef double f64x4 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x4 __attribute__((vector_size(8)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
inline f64x4 f64x4_load(const double* p) {
  f64x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void f64x4_store(double* p, f64x4 v) { std::memcpy(p, &v, sizeof v); }
inline f64x4 f64x4_widen(const float* p) {  // four elements of a row as float64 (exact)
  f32x4 v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, f64x4);
}
inline f64x4 f64x4_widen(const bf16* p) {
  u16x4 h;
  std::memcpy(&h, p, sizeof h);
  const u32x4 bits = __builtin_convertvector(h, u32x4) << 16;
  f32x4 v;
  std::memcpy(&v, &bits, sizeof v);
  return __builtin_convertvector(v, f64x4);
}
inline double f64x4_total(f64x4 v) { return (v[0] + v[1]) + (v[2] + v[3]); }
#endif

// out[i] = x[i] as float64, i < d (exact).
inline void row_to_f64(const float* x, double* out, int64_t d) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= d; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    _mm512_storeu_pd(out + i, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    _mm512_storeu_pd(out + i + 8, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
#endif
  for (; i < d; ++i) out[i] = x[i];
}

inline void row_to_f64(const bf16* x, double* out, int64_t d) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= d; i += 16) {
    const __m512 v = v16_load(x + i).v;
    _mm512_storeu_pd(out + i, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    _mm512_storeu_pd(out + i + 8, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
#endif
  for (; i < d; ++i) out[i] = to_f32(x[i]);
}

#if defined(TF_F64X4)
// dots8 four lanes at a time, d a multiple of 4; with d a constant (the common head sizes) the
// eight rows are one base register and constant offsets, not eight pointers spilled to the stack.
template <typename D>
inline void dots8_x4(const double* q, const double* k, double* dots, D d) {
  f64x4 acc[8] = {};
  for (int64_t b = 0; b < d; b += 4) {
    const f64x4 qv = f64x4_load(q + b);
    for (int j = 0; j < 8; ++j) acc[j] += qv * f64x4_load(k + j * d + b);
  }
  for (int j = 0; j < 8; ++j) dots[j] = f64x4_total(acc[j]);
}
#endif

// dots[j] = q . k_j for the eight rows k_j = k + j * d (float64, exact sums).
inline void dots8(const double* q, const double* k, double* dots, int64_t d) {
#if defined(__AVX512F__)
  if (d % 8 == 0) {
    __m512d acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_pd();
    for (int64_t b = 0; b < d; b += 8) {
      const __m512d qv = _mm512_loadu_pd(q + b);
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_pd(qv, _mm512_loadu_pd(k + j * d + b), acc[j]);
    }
    // Fold the eight accumulators into one register of eight sums: pairs by unpacking, then
    // 128- and 256-bit halves by lane shuffles (any order: every sum is exact).
    __m512d t[4];
    for (int p = 0; p < 4; ++p)
      t[p] = _mm512_add_pd(_mm512_unpacklo_pd(acc[2 * p], acc[2 * p + 1]), _mm512_unpackhi_pd(acc[2 * p], acc[2 * p + 1]));
    __m512d u[2];
    for (int p = 0; p < 2; ++p)
      u[p] = _mm512_add_pd(_mm512_shuffle_f64x2(t[2 * p], t[2 * p + 1], 0x88),
                           _mm512_shuffle_f64x2(t[2 * p], t[2 * p + 1], 0xDD));
    _mm512_storeu_pd(dots, _mm512_add_pd(_mm512_shuffle_f64x2(u[0], u[1], 0x88), _mm512_shuffle_f64x2(u[0], u[1], 0xDD)));
    return;
  }
#elif defined(TF_F64X4)
  if (d == 64) return dots8_x4(q, k, dots, std::integral_constant<int64_t, 64>{});
  if (d == 128) return dots8_x4(q, k, dots, std::integral_constant<int64_t, 128>{});
  if (d % 4 == 0) return dots8_x4(q, k, dots, d);
#endif
  for (int j = 0; j < 8; ++j) {
    double acc = 0.0;
    for (int64_t i = 0; i < d; ++i) acc += q[i] * k[j * d + i];
    dots[j] = acc;
  }
}

#if defined(__AVX512F__)
// dots[l * 32 + j] = q_l . k_j for four lanes l (q_l = q + l * d) and 32 keys stored by column
// (element i of key j at kt[i * 32 + j]): each lane's dots are four registers of eight keys, one
// product added per element, so no sums are folded across lanes at the end (dots8's last steps),
// and each key element loaded serves four lanes.
inline void dots4x32(const double* q, const double* kt, double* dots, int64_t d) {
  __m512d acc[4][4];
  for (int l = 0; l < 4; ++l)
    for (int b = 0; b < 4; ++b) acc[l][b] = _mm512_setzero_pd();
  for (int64_t i = 0; i < d; ++i) {
    __m512d k[4];
    for (int b = 0; b < 4; ++b) {
      k[b] = _mm512_loadu_pd(kt + i * 32 + 8 * b);
      __asm__("" : "+v"(k[b]));  // loaded once into a register (GCC would fold a load into each lane's FMA)
    }
    for (int l = 0; l < 4; ++l) {
      const __m512d ql = _mm512_set1_pd(q[l * d + i]);
      for (int b = 0; b < 4; ++b) acc[l][b] = _mm512_fmadd_pd(ql, k[b], acc[l][b]);
    }
  }
  for (int l = 0; l < 4; ++l)
    for (int b = 0; b < 4; ++b) _mm512_storeu_pd(dots + l * 32 + 8 * b, acc[l][b]);
}
#endif

// out[j] = float(dots[j]) * scale, j < n (two roundings, as the reference: the exact dot to
// float32, then the float32 product); returns the largest of m and the out[j] (a NaN score is passed over, as std::max does).
inline float scale_scores(const double* dots, float scale, float* out, int64_t n, float m) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if (n >= 8) {
    const __m256 sv = _mm256_set1_ps(scale);
    __m256 mv = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
      const __m256 x = _mm256_mul_ps(_mm512_cvtpd_ps(_mm512_loadu_pd(dots + j)), sv);
      _mm256_storeu_ps(out + j, x);
      mv = _mm256_max_ps(x, mv);  // x > m ? x : m: a NaN x keeps m
    }
    float parts[8];
    _mm256_storeu_ps(parts, mv);
    for (float part : parts) m = std::max(m, part);
  }
#elif defined(TF_F64X4)
  if (n >= 4) {
    f32x4 mv = {m, m, m, m};
    for (; j + 4 <= n; j += 4) {
      const f32x4 x = __builtin_convertvector(f64x4_load(dots + j), f32x4) * scale;
      std::memcpy(out + j, &x, sizeof x);
      mv = x > mv ? x : mv;  // a NaN x keeps m, as above
    }
    for (int l = 0; l < 4; ++l) m = std::max(m, mv[l]);
  }
#endif
  for (; j < n; ++j) {
    out[j] = static_cast<float>(dots[j]) * scale;
    m = std::max(m, out[j]);
  }
  return m;
}

#if defined(__AVX512F__)
// weighted_sum for two lanes over the same rows, d a multiple of 64: each V element loaded serves
// both lanes' sums (acc_a with weights wa, acc_b with wb).
inline void weighted_sum2(const double* wa, const double* wb, const double* v, int64_t n, double* acc_a,
                          double* acc_b, int64_t d) {
  for (int64_t c = 0; c < d; c += 64) {  // 64 columns (eight registers a lane) at a time
    __m512d a[8], b[8];
    for (int r = 0; r < 8; ++r) {
      a[r] = _mm512_loadu_pd(acc_a + c + 8 * r);
      b[r] = _mm512_loadu_pd(acc_b + c + 8 * r);
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m512d wj = _mm512_set1_pd(wa[j]), xj = _mm512_set1_pd(wb[j]);
      const double* row = v + j * d + c;
      for (int r = 0; r < 8; ++r) {
        __m512d x = _mm512_loadu_pd(row + 8 * r);
        __asm__("" : "+v"(x));  // one load for both lanes' FMAs
        a[r] = _mm512_fmadd_pd(wj, x, a[r]);
        b[r] = _mm512_fmadd_pd(xj, x, b[r]);
      }
    }
    for (int r = 0; r < 8; ++r) {
      _mm512_storeu_pd(acc_a + c + 8 * r, a[r]);
      _mm512_storeu_pd(acc_b + c + 8 * r, b[r]);
    }
  }
}
#endif

// acc[i] += sum_j w[j] v_j[i] over the n rows v_j = v + j * d (float64, exact sums).
inline void weighted_sum(const double* w, const double* v, int64_t n, double* acc, int64_t d) {
#if defined(__AVX512F__)
  if (d % 64 == 0) {
    for (int64_t c = 0; c < d; c += 64) {  // 64 columns (eight registers) at a time
      __m512d a[8];
      for (int b = 0; b < 8; ++b) a[b] = _mm512_loadu_pd(acc + c + 8 * b);
      for (int64_t j = 0; j < n; ++j) {
        const __m512d wj = _mm512_set1_pd(w[j]);
        const double* row = v + j * d + c;
        for (int b = 0; b < 8; ++b) a[b] = _mm512_fmadd_pd(wj, _mm512_loadu_pd(row + 8 * b), a[b]);
      }
      for (int b = 0; b < 8; ++b) _mm512_storeu_pd(acc + c + 8 * b, a[b]);
    }
    return;
  }
#elif defined(TF_F64X4)
  if (d % 16 == 0) {
    // 16 columns (four vectors) at a time; even and odd rows in sums of their own, so that two
    // chains of additions overlap (one chain waited on each addition's latency), added at the end.
    for (int64_t c = 0; c < d; c += 16) {
      f64x4 a[4], odd[4] = {};
      for (int b = 0; b < 4; ++b) a[b] = f64x4_load(acc + c + 4 * b);
      int64_t j = 0;
      for (; j + 2 <= n; j += 2)
        for (int b = 0; b < 4; ++b) {
          a[b] += w[j] * f64x4_load(v + j * d + c + 4 * b);
          odd[b] += w[j + 1] * f64x4_load(v + (j + 1) * d + c + 4 * b);
        }
      if (j < n)
        for (int b = 0; b < 4; ++b) a[b] += w[j] * f64x4_load(v + j * d + c + 4 * b);
      for (int b = 0; b < 4; ++b) f64x4_store(acc + c + 4 * b, a[b] + odd[b]);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < d; ++i) acc[i] += w[j] * v[j * d + i];
}

// ---- reading cache rows directly (the decode path: a few lanes per key, no float64 copy) -----

#if defined(__AVX512F__)
// Sixteen elements of a cache row as two registers of float64 (exact), in order.
inline void f64x16(const float* p, __m512d& lo, __m512d& hi) {
  lo = _mm512_cvtps_pd(_mm256_loadu_ps(p));
  hi = _mm512_cvtps_pd(_mm256_loadu_ps(p + 8));
}
inline void f64x16(const bf16* p, __m512d& lo, __m512d& hi) {
  const __m128i* w = reinterpret_cast<const __m128i*>(p);
  lo = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(w)), 16)));
  hi = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(w + 1)), 16)));
}

// Half of thirty-two bfloat16 elements of a cache row as two registers of float64 (exact), in the
// order one 16-bit unpack leaves them: half 0 is elements 0-3, 8-11 | 16-19, 24-27, half 1 is
// 4-7, 12-15 | 20-23, 28-31 (the row's widening order, widening_order below): one instruction per
// sixteen elements instead of three.
inline void f64x32_half(const bf16* p, int half, __m512d& a, __m512d& b) {
  const __m512i v = _mm512_loadu_si512(p), zero = _mm512_setzero_si512();
  const __m512d x = _mm512_castsi512_pd(half == 0 ? _mm512_unpacklo_epi16(zero, v) : _mm512_unpackhi_epi16(zero, v));
  a = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_castpd512_pd256(x)));
  b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(x, 1)));
}

// Four registers of 32 float64 in order <-> in bfloat16's widening order (both directions are one
// exchange of 256-bit halves: registers 0, 1 hold elements 0-15, 2, 3 hold 16-31).
inline void bf16_order(const __m512d* in, __m512d* out) {
  out[0] = _mm512_shuffle_f64x2(in[0], in[1], 0x44);  // 0-3, 8-11
  out[1] = _mm512_shuffle_f64x2(in[2], in[3], 0x44);  // 16-19, 24-27
  out[2] = _mm512_shuffle_f64x2(in[0], in[1], 0xEE);  // 4-7, 12-15
  out[3] = _mm512_shuffle_f64x2(in[2], in[3], 0xEE);  // 20-23, 28-31
}
inline void natural_order(const __m512d* in, __m512d* out) {
  out[0] = _mm512_shuffle_f64x2(in[0], in[2], 0x44);
  out[1] = _mm512_shuffle_f64x2(in[0], in[2], 0xEE);
  out[2] = _mm512_shuffle_f64x2(in[1], in[3], 0x44);
  out[3] = _mm512_shuffle_f64x2(in[1], in[3], 0xEE);
}

// The totals of four registers, in order, into out[0..3] (any order of adds: the sums are exact).
inline void store_totals4(const __m512d* a, double* out) {
  const __m512d t0 = _mm512_add_pd(_mm512_unpacklo_pd(a[0], a[1]), _mm512_unpackhi_pd(a[0], a[1]));
  const __m512d t1 = _mm512_add_pd(_mm512_unpacklo_pd(a[2], a[3]), _mm512_unpackhi_pd(a[2], a[3]));
  // 128-bit lanes: [a0 a1], [a0 a1], [a2 a3], [a2 a3] (partial sums), then each pair of lanes added
  const __m512d u = _mm512_add_pd(_mm512_shuffle_f64x2(t0, t1, 0x88), _mm512_shuffle_f64x2(t0, t1, 0xDD));
  const __m512d v = _mm512_add_pd(u, _mm512_shuffle_f64x2(u, u, 0xB1));
  _mm256_storeu_pd(out, _mm512_castpd512_pd256(_mm512_permutexvar_pd(_mm512_setr_epi64(0, 1, 4, 5, 0, 1, 4, 5), v)));
}
#endif

#if defined(TF_AVX2)
// AVX2's spellings of the direct kernels: the compiler vectors above widen a bfloat16 row four
// elements at a time in ten instructions and keep products and sums apart (no contraction); here
// eight elements take one load, two unpacks and two conversions, and each product-and-sum is one
// FMA (the product is exact, so the FMA's one rounding is the addition's).
// Eight elements of a cache row as two registers of float64 (exact), in order.
inline void f64x8(const float* p, __m256d& lo, __m256d& hi) {
  lo = _mm256_cvtps_pd(_mm_loadu_ps(p));
  hi = _mm256_cvtps_pd(_mm_loadu_ps(p + 4));
}
inline void f64x8(const bf16* p, __m256d& lo, __m256d& hi) {  // a bfloat16 is the top half of its float32
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), zero = _mm_setzero_si128();
  lo = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpacklo_epi16(zero, v)));
  hi = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpackhi_epi16(zero, v)));
}

// The totals of four registers, in order, into out[0..3] (any order of adds: the sums are exact).
inline void store_totals4(const __m256d* a, double* out) {
  const __m256d t0 = _mm256_hadd_pd(a[0], a[1]), t1 = _mm256_hadd_pd(a[2], a[3]);  // a0 a1 a0 a1, a2 a3 a2 a3
  _mm256_storeu_pd(out, _mm256_add_pd(_mm256_permute2f128_pd(t0, t1, 0x20), _mm256_permute2f128_pd(t0, t1, 0x31)));
}

// dots[l * stride + j] = q_l . k_j for L lanes and J keys (J of 2 or 4: L x J accumulators and a
// widened row fit AVX2's sixteen registers), d a multiple of 8.
template <int L, int J, typename C>
inline void dots_avx2(const double* const* q, const C* const* k, int64_t d, double* dots, int64_t stride) {
  __m256d acc[L][4];
  for (int l = 0; l < L; ++l)
    for (int j = 0; j < 4; ++j) acc[l][j] = _mm256_setzero_pd();
  for (int64_t b = 0; b < d; b += 8)
    for (int j = 0; j < J; ++j) {
      __m256d lo, hi;
      f64x8(k[j] + b, lo, hi);
      for (int l = 0; l < L; ++l)
        acc[l][j] = _mm256_fmadd_pd(_mm256_loadu_pd(q[l] + b + 4), hi, _mm256_fmadd_pd(_mm256_loadu_pd(q[l] + b), lo, acc[l][j]));
    }
  for (int l = 0; l < L; ++l) {
    double totals[4];
    store_totals4(acc[l], totals);
    for (int j = 0; j < J; ++j) dots[l * stride + j] = totals[j];
  }
}

// acc[l][b, b + 8R) += sum_j w[l][j] v_j[b, b + 8R) for L lanes, R groups of eight columns.
template <int L, int R, typename C>
inline void weighted_block(const double* const* w, const C* const* v, int64_t n, double* const* acc, int64_t b) {
  __m256d a[L][2 * R];
  for (int l = 0; l < L; ++l)
    for (int r = 0; r < 2 * R; ++r) a[l][r] = _mm256_loadu_pd(acc[l] + b + 4 * r);
  for (int64_t j = 0; j < n; ++j) {
    __m256d x[2 * R];
    for (int r = 0; r < R; ++r) f64x8(v[j] + b + 8 * r, x[2 * r], x[2 * r + 1]);
    for (int l = 0; l < L; ++l) {
      const __m256d wj = _mm256_broadcast_sd(w[l] + j);
      for (int r = 0; r < 2 * R; ++r) a[l][r] = _mm256_fmadd_pd(wj, x[r], a[l][r]);
    }
  }
  for (int l = 0; l < L; ++l)
    for (int r = 0; r < 2 * R; ++r) _mm256_storeu_pd(acc[l] + b + 4 * r, a[l][r]);
}
#endif

// Whether the direct kernels take a row of d elements of C in 32-element blocks (f64x32), and so
// want q in the widening order: bfloat16 rows whose length is a multiple of 32, on AVX-512.
template <typename C>
constexpr bool widens_by_32(int64_t d) {
#if defined(__AVX512F__)
  return std::is_same_v<C, bf16> && d % 32 == 0;
#else
  return (void)d, false;
#endif
}

// q (d float64) in the order dots_x4 reads it for rows of C: the widening order where
// widens_by_32, else as it is. out may not alias q.
template <typename C>
inline void widening_order(const double* q, double* out, int64_t d) {
  if (!widens_by_32<C>(d)) {
    std::copy(q, q + d, out);
    return;
  }
  static constexpr int FROM[32] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27,
                                   4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  for (int64_t b = 0; b < d; b += 32)
    for (int i = 0; i < 32; ++i) out[b + i] = q[b + FROM[i]];
}

// dots[l * stride + j] = q_l . k_j for L lanes (q[l]: d float64 on the lane's grid, in the
// widening order for C) and the four cache rows k[j] (d elements of the cache dtype C), float64,
// exact sums (so the order the elements are taken in is free).
template <int L, typename C>
inline void dots_x4(const double* const* q, const C* const* k, int64_t d, double* dots, int64_t stride) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    __m512d acc[L][4];
    for (int l = 0; l < L; ++l)
      for (int j = 0; j < 4; ++j) acc[l][j] = _mm512_setzero_pd();
    bool done = false;
    if constexpr (std::is_same_v<C, bf16>) {
      if (widens_by_32<C>(d)) {
        done = true;
        for (int64_t b = 0; b < d; b += 32)
        for (int half = 0; half < 2; ++half) {
          __m512d x[4][2];
          for (int j = 0; j < 4; ++j) f64x32_half(k[j] + b, half, x[j][0], x[j][1]);  // loads twice: an L1 hit
          for (int l = 0; l < L; ++l) {  // q in the widening order: this half's sixteen are next to each other
            const __m512d q0 = _mm512_loadu_pd(q[l] + b + 16 * half), q1 = _mm512_loadu_pd(q[l] + b + 16 * half + 8);
            for (int j = 0; j < 4; ++j) acc[l][j] = _mm512_fmadd_pd(q1, x[j][1], _mm512_fmadd_pd(q0, x[j][0], acc[l][j]));
          }
        }
      }
    }
    if (!done) {
      for (int64_t b = 0; b < d; b += 16) {
        __m512d lo[4], hi[4];
        for (int j = 0; j < 4; ++j) f64x16(k[j] + b, lo[j], hi[j]);
        for (int l = 0; l < L; ++l) {
          const __m512d q_lo = _mm512_loadu_pd(q[l] + b), q_hi = _mm512_loadu_pd(q[l] + b + 8);
          for (int j = 0; j < 4; ++j) acc[l][j] = _mm512_fmadd_pd(q_hi, hi[j], _mm512_fmadd_pd(q_lo, lo[j], acc[l][j]));
        }
      }
    }
    for (int l = 0; l < L; ++l) store_totals4(acc[l], dots + l * stride);
    return;
  }
#elif defined(TF_AVX2)
  if (d % 8 == 0) {
    if constexpr (L <= 3) {
      dots_avx2<L, 4>(q, k, d, dots, stride);
    } else {  // L x 4 accumulators would not leave room for the row: two keys at a time
      dots_avx2<L, 2>(q, k, d, dots, stride);
      dots_avx2<L, 2>(q, k + 2, d, dots + 2, stride);
    }
    return;
  }
#elif defined(TF_F64X4)
  if (d % 4 == 0) {
    f64x4 acc[L][4] = {};
    for (int64_t b = 0; b < d; b += 4) {
      f64x4 x[4];
      for (int j = 0; j < 4; ++j) x[j] = f64x4_widen(k[j] + b);
      for (int l = 0; l < L; ++l) {
        const f64x4 qv = f64x4_load(q[l] + b);
        for (int j = 0; j < 4; ++j) acc[l][j] += qv * x[j];
      }
    }
    for (int l = 0; l < L; ++l)
      for (int j = 0; j < 4; ++j) dots[l * stride + j] = f64x4_total(acc[l][j]);
    return;
  }
#endif
  for (int l = 0; l < L; ++l)
    for (int j = 0; j < 4; ++j) {
      double acc = 0.0;
      for (int64_t i = 0; i < d; ++i) acc += q[l][i] * static_cast<double>(to_f32(k[j][i]));
      dots[l * stride + j] = acc;
    }
}

#if defined(__AVX512F__)
// acc[l][b, b + 8R) += sum_j w[l][j] v_j[b, b + 8R) for L lanes, R registers per lane:
// `widen(v_j + b, x)` puts a row's 8R elements in x in its widening order; with REORDER (bfloat16's
// 32-element blocks) the accumulators are put in that order while in registers, and back.
template <int L, int R, bool REORDER, typename C, typename Widen>
inline void weighted_block(const double* const* w, const C* const* v, int64_t n, double* const* acc, int64_t b,
                           Widen widen) {
  __m512d a[L][R];
  for (int l = 0; l < L; ++l) {
    if constexpr (REORDER) {
      __m512d in[R];
      for (int r = 0; r < R; ++r) in[r] = _mm512_loadu_pd(acc[l] + b + 8 * r);
      bf16_order(in, a[l]);
    } else {
      for (int r = 0; r < R; ++r) a[l][r] = _mm512_loadu_pd(acc[l] + b + 8 * r);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512d x[R];
    widen(v[j] + b, x);
    for (int l = 0; l < L; ++l) {
      const __m512d wj = _mm512_set1_pd(w[l][j]);
      for (int r = 0; r < R; ++r) a[l][r] = _mm512_fmadd_pd(wj, x[r], a[l][r]);
    }
  }
  for (int l = 0; l < L; ++l) {
    if constexpr (REORDER) {
      __m512d out[R];
      natural_order(a[l], out);
      for (int r = 0; r < R; ++r) _mm512_storeu_pd(acc[l] + b + 8 * r, out[r]);
    } else {
      for (int r = 0; r < R; ++r) _mm512_storeu_pd(acc[l] + b + 8 * r, a[l][r]);
    }
  }
}
#endif

// acc[l][i] += sum_j w[l][j] v_j[i] for L lanes over the n cache rows v[j] (d elements of the
// cache dtype C), float64, exact sums. Blocks of 32 elements (four registers per lane: enough
// independent chains for the FMA unit), a 16-element tail.
template <int L, typename C>
inline void weighted_rows(const double* const* w, const C* const* v, int64_t n, double* const* acc, int64_t d) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<C, bf16>) {
    if (widens_by_32<C>(d)) {
      for (int64_t b = 0; b < d; b += 32)
        weighted_block<L, 4, true>(w, v, n, acc, b, [](const C* p, __m512d* x) {
          f64x32_half(p, 0, x[0], x[1]);
          f64x32_half(p, 1, x[2], x[3]);
        });
      return;
    }
  }
  if (d % 16 == 0) {
    int64_t b = 0;
    for (; b + 32 <= d; b += 32)
      weighted_block<L, 4, false>(w, v, n, acc, b, [](const C* p, __m512d* x) {
        f64x16(p, x[0], x[1]);
        f64x16(p + 16, x[2], x[3]);
      });
    for (; b < d; b += 16)
      weighted_block<L, 2, false>(w, v, n, acc, b, [](const C* p, __m512d* x) { f64x16(p, x[0], x[1]); });
    return;
  }
#elif defined(TF_AVX2)
  if (d % 8 == 0) {  // sixteen columns per lane where L x 4 accumulators leave room, else eight
    constexpr int R = L <= 3 ? 2 : 1;
    int64_t b = 0;
    for (; b + 8 * R <= d; b += 8 * R) weighted_block<L, R>(w, v, n, acc, b);
    for (; b < d; b += 8) weighted_block<L, 1>(w, v, n, acc, b);
    return;
  }
#elif defined(TF_F64X4)
  if (d % 16 == 0) {
    for (int64_t b = 0; b < d; b += 16) {  // 16 columns per lane held in four vectors over all rows
      f64x4 a[L][4];
      for (int l = 0; l < L; ++l)
        for (int r = 0; r < 4; ++r) a[l][r] = f64x4_load(acc[l] + b + 4 * r);
      for (int64_t j = 0; j < n; ++j) {
        f64x4 x[4];
        for (int r = 0; r < 4; ++r) x[r] = f64x4_widen(v[j] + b + 4 * r);
        for (int l = 0; l < L; ++l)
          for (int r = 0; r < 4; ++r) a[l][r] += w[l][j] * x[r];
      }
      for (int l = 0; l < L; ++l)
        for (int r = 0; r < 4; ++r) f64x4_store(acc[l] + b + 4 * r, a[l][r]);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int l = 0; l < L; ++l)
      for (int64_t i = 0; i < d; ++i) acc[l][i] += w[l][j] * static_cast<double>(to_f32(v[j][i]));
}

// The attention's integer weights for n keys (n a multiple of 8; p = 0 past the keys):
// w[j] = round_even(p[j] key_up[j] lane_up) key_down[j], and the sum of round_even(p[j] den_up)
// returned (integers below 2^53: exact in any order). Each product is one exact scaling by a
// power of two, so the steps round only where round_even does.
inline double attention_weights(const float* p, const double* key_up, const double* key_down, double lane_up,
                                double den_up, double* w, int64_t n) {
  double den = 0.0;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512d magic = _mm512_set1_pd(ROUND_MAGIC), lane = _mm512_set1_pd(lane_up), up = _mm512_set1_pd(den_up);
  __m512d dens = _mm512_setzero_pd();
  for (; j + 8 <= n; j += 8) {
    const __m512d pj = _mm512_cvtps_pd(_mm256_loadu_ps(p + j));
    dens = _mm512_add_pd(dens, _mm512_sub_pd(_mm512_add_pd(_mm512_mul_pd(pj, up), magic), magic));
    const __m512d x = _mm512_mul_pd(_mm512_mul_pd(pj, _mm512_loadu_pd(key_up + j)), lane);
    _mm512_storeu_pd(w + j, _mm512_mul_pd(_mm512_sub_pd(_mm512_add_pd(x, magic), magic), _mm512_loadu_pd(key_down + j)));
  }
  double parts[8];
  _mm512_storeu_pd(parts, dens);
  for (double part : parts) den += part;
#elif defined(TF_F64X4)
  f64x4 dens = {};
  for (; j + 4 <= n; j += 4) {  // the same steps as below, four lanes at a time
    const f64x4 pj = f64x4_widen(p + j);
    dens += (pj * den_up + ROUND_MAGIC) - ROUND_MAGIC;
    const f64x4 x = pj * f64x4_load(key_up + j) * lane_up;
    f64x4_store(w + j, ((x + ROUND_MAGIC) - ROUND_MAGIC) * f64x4_load(key_down + j));
  }
  den += f64x4_total(dens);
#endif
  for (; j < n; ++j) {
    const double pj = p[j];
    den += round_even(pj * den_up);
    w[j] = round_even(pj * key_up[j] * lane_up) * key_down[j];
  }
  return den;
}

}  // namespace tf
