// The float64 inner loops of the exact attention (attention.cpp): rows converted to float64, the
// scores q . k_j of eight keys, and the weighted sum of V rows.
//
// Every product and every partial sum in them is an integer multiple of one power of two and
// stays below 2^53 (paged_attention.py's bit budget), so each is exact and the order they run in
// is free: the AVX-512 spellings and the plain loops beside them give the same bits, and the
// AVX-512 ones may add in whatever order is fastest (lanes first, a transposing tree after).
#pragma once

#include <algorithm>
#include <cstdint>

#include "exact.h"
#include "vec16.h"

namespace tf {

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

// The cache lines of a row of `bytes` bytes, asked for ahead of their use (a hint: no effect on
// any result).
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

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
#endif
  for (int j = 0; j < 8; ++j) {
    double acc = 0.0;
    for (int64_t i = 0; i < d; ++i) acc += q[i] * k[j * d + i];
    dots[j] = acc;
  }
}

// out[j] = float(dots[j] * scale), j < n (two roundings, as the reference: the product, then to
// float32); returns the largest of m and the out[j] (a NaN score is passed over, as std::max does).
inline float scale_scores(const double* dots, double scale, float* out, int64_t n, float m) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if (n >= 8) {
    const __m512d sv = _mm512_set1_pd(scale);
    __m256 mv = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
      const __m256 x = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_loadu_pd(dots + j), sv));
      _mm256_storeu_ps(out + j, x);
      mv = _mm256_max_ps(x, mv);  // x > m ? x : m: a NaN x keeps m
    }
    float parts[8];
    _mm256_storeu_ps(parts, mv);
    for (float part : parts) m = std::max(m, part);
  }
#endif
  for (; j < n; ++j) {
    out[j] = static_cast<float>(dots[j] * scale);
    m = std::max(m, out[j]);
  }
  return m;
}

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
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < d; ++i) acc[i] += w[j] * v[j * d + i];
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
#endif
  for (; j < n; ++j) {
    const double pj = p[j];
    den += round_even(pj * den_up);
    w[j] = round_even(pj * key_up[j] * lane_up) * key_down[j];
  }
  return den;
}

}  // namespace tf
