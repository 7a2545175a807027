// A row's elements sixteen float32 lanes at a time in its stored dtype (loads widen exactly,
// stores round to nearest even as from_f32 does), and max |x| of a row: the pieces the row-wise
// ops (norm.cpp) and the attention (attention.cpp) share.
#pragma once

#include <algorithm>
#include <cstdint>

#include "exact.h"
#include "vec16.h"

namespace tf {

// max |x| as a float, through the bits: for floats without the sign bit the integer order is the
// magnitude order (a NaN compares above inf, and its exponent field reads 128, as torch's amax
// then gives), and an integer max is a reduction the compiler vectorizes without fast-math.
inline float max_abs(const float* x, int64_t n) {
  uint32_t top = 0;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i m = _mm512_setzero_si512();
    for (; i + 16 <= n; i += 16) m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_loadu_si512(x + i), mask));
    top = _mm512_reduce_max_epu32(m);
  }
#endif
  for (; i < n; ++i) top = std::max(top, f32_bits(x[i]) & 0x7FFFFFFFu);
  return f32_from_bits(top);
}
inline float max_abs(const bf16* x, int64_t n) {  // the same on the upper half of a float's bits
  uint32_t top = 0;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {  // widened to 32 bits (AVX-512F has no 16-bit max)
    const __m512i mask = _mm512_set1_epi32(0x7FFF);
    __m512i m = _mm512_setzero_si512();
    for (; i + 16 <= n; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_cvtepu16_epi32(h), mask));
    }
    top = _mm512_reduce_max_epu32(m);
  }
#endif
  for (; i < n; ++i) top = std::max<uint32_t>(top, x[i].bits & 0x7FFFu);
  return f32_from_bits(top << 16);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) { return v16_load(p).v; }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// f32_to_bf16 on sixteen lanes: the same integer rounding, NaN as 0x7FC0.
inline void store16(bf16* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
// Sixteen floats as two registers of float64 (exact), and two of float64 rounded back into one
// of float32 (each lane once, to nearest even, as static_cast<float>).
inline void widen16(__m512 v, __m512d& lo, __m512d& hi) {
  lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline __m512 narrow16(__m512d lo, __m512d hi) {
  const __m256 a = _mm512_cvtpd_ps(lo), b = _mm512_cvtpd_ps(hi);
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b), 1));
}
#endif

#if defined(TF_AVX2)
// Eight lanes, AVX2's spelling of load16 and store16.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) { return bf16x8(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {  // f32_to_bf16's integer rounding, NaN as 0x7FC0
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // 32 -> 16 bits (every value fits): the pack works per 128-bit half, the permute joins the halves
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

}  // namespace tf
