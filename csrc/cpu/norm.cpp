// Row-wise exact ops: RMSNorm (+ the residual add), LayerNorm (the DSA indexer's), rope (+ qwen3's per-head norm), SiLU-, sigmoid- and
// GELU(tanh)-and-mul, ReLU squared, the logits' soft cap.
// Each line is one IEEE rounding in the order of kernels/reference.py; the one reduction (the sum
// of squares) is an exact integer sum, so its order is free.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "exact.h"
#include "kernels.h"
#include "lanes.h"
#include "vec16.h"

namespace tf {
namespace {

constexpr int NORM_BITS = 20;
constexpr int64_t PARALLEL_ELEMENTS = 1 << 15;  // below this a call runs on one thread
constexpr int64_t SILU_BLOCK = 256;             // elements of a row per exp_neg batch

// reference.rms_norm of one row: squares on the row's grid, an exact sum, float32 sqrt/div.
// Sixteen elements at a time where AVX-512 is compiled in, the same roundings lane by lane
// (the sum is of integers below 2^53 in total, so its order is free); a scalar tail.
template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t n, double eps) {
  const int e = exponent(max_abs(x, n));  // a NaN row reads 128 here; its outputs are NaN either way
  const double grid = pow2(2 * (NORM_BITS - 1 - e));
  double ss = 0.0;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512d grid_v = _mm512_set1_pd(grid), magic = _mm512_set1_pd(ROUND_MAGIC);
  __m512d acc = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    __m512d half[2];
    widen16(load16(x + i), half[0], half[1]);
    for (__m512d d : half) {
      const __m512d sq = _mm512_mul_pd(_mm512_mul_pd(d, d), grid_v);
      acc = _mm512_add_pd(acc, _mm512_sub_pd(_mm512_add_pd(sq, magic), magic));
    }
  }
  ss = _mm512_reduce_add_pd(acc);
#endif
  for (; i < n; ++i) {
    const double d = to_f32(x[i]);
    double sq = d * d;
    sq = sq * grid;
    ss += round_even(sq);
  }
  float var = scale32(static_cast<float>(ss), 2 * (e - NORM_BITS + 1));
  var = var / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(var + static_cast<float>(eps));
  i = 0;
#if defined(__AVX512F__)
  const __m512 inv_v = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16)
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i), inv_v), load16(weight + i)));
#endif
  for (; i < n; ++i) {
    float y = to_f32(x[i]) * inv;
    y = y * to_f32(weight[i]);
    out[i] = from_f32<T>(y);
  }
}

// reference.layer_norm of one row (the DSA indexer's key norm): the mean from an exact sum (each x
// on the row's grid of 2 NORM_BITS bits below its largest), float32(sum) scaled, divided by n in
// float32; then rms_norm's steps on the float32 differences d (in `d`, the caller's [n]), times
// weight, plus bias (float32 steps), rounded to the dtype.
template <typename T>
void layer_norm_row(const T* x, const T* weight, const T* bias, T* out, float* d, int64_t n, double eps) {
  int e = exponent(max_abs(x, n));
  const double up = pow2(2 * NORM_BITS - 1 - e);
  double sum = 0.0;  // integers of at most 2^40, at most 2^13 of them: exact in any order
  for (int64_t i = 0; i < n; ++i) sum += round_even(static_cast<double>(to_f32(x[i])) * up);
  float mean = scale32(static_cast<float>(sum), e - 2 * NORM_BITS + 1);
  mean = mean / static_cast<float>(n);
  for (int64_t i = 0; i < n; ++i) d[i] = to_f32(x[i]) - mean;
  e = exponent(max_abs(d, n));
  const double grid = pow2(2 * (NORM_BITS - 1 - e));
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    double sq = static_cast<double>(d[i]) * d[i];
    sq = sq * grid;
    ss += round_even(sq);
  }
  float var = scale32(static_cast<float>(ss), 2 * (e - NORM_BITS + 1));
  var = var / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(var + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) {
    float y = d[i] * inv;
    y = y * to_f32(weight[i]);
    y = y + to_f32(bias[i]);
    out[i] = from_f32<T>(y);
  }
}

template <typename T>
void layer_norm_impl(const T* x, const T* weight, const T* bias, T* out, int64_t rows, int64_t width, double eps,
                     int threads) {
  const bool parallel = threads > 1 && rows > 1 && rows * width >= PARALLEL_ELEMENTS;
#pragma omp parallel num_threads(threads) if (parallel)
  {
    std::vector<float> d(width);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) layer_norm_row(x + r * width, weight, bias, out + r * width, d.data(), width, eps);
  }
}

// h = a + b, rounded to the dtype (the residual add).
template <typename T>
void add_row(const T* a, const T* b, T* h, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) store16(h + i, _mm512_add_ps(load16(a + i), load16(b + i)));
#endif
  for (; i < n; ++i) h[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

template <typename T>
void rms_norm_impl(const T* x, int64_t xs, const T* residual, int64_t rs, T* h_out, const T* weight, T* out,
                   int64_t rows, int64_t width, double eps, int threads) {
  const bool parallel = threads > 1 && rows > 1 && rows * width >= PARALLEL_ELEMENTS;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * xs;
    if (residual != nullptr) {  // h = residual + x, rounded to the dtype, then its norm
      T* h = h_out + r * width;
      add_row(residual + r * rs, row, h, width);
      row = h;
    }
    norm_row(row, weight, out + r * width, width, eps);
  }
}

// reference.apply_rope of one head vector: x cos + rotate_half(x) sin, in float32.
template <typename T>
void rope_row(const T* x, T* out, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (half % 16 == 0) {  // the two halves sixteen lanes at a time: -x[i + half], then x[i - half]
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
    for (; i < d; i += 16) {
      const __m512 rot = i < half ? _mm512_xor_ps(load16(x + i + half), sign) : load16(x + i - half);
      const __m512 a = _mm512_mul_ps(load16(x + i), _mm512_loadu_ps(cos + i));
      const __m512 b = _mm512_mul_ps(rot, _mm512_loadu_ps(sin + i));
      store16(out + i, _mm512_add_ps(a, b));
    }
  }
#endif
  for (; i < d; ++i) {
    const float rot = i < half ? -to_f32(x[i + half]) : to_f32(x[i - half]);
    const float a = to_f32(x[i]) * cos[i];
    const float b = rot * sin[i];
    out[i] = from_f32<T>(a + b);
  }
}

// Heads head_stride apart in each token's row; rope over the first rope_dim of each head (cos, sin
// [tokens, rope_dim]), the rest copied: Attention._position's partial rope.
template <typename T>
void rope_impl(const T* x, int64_t x_stride, int64_t head_stride, T* out, const float* cos, const float* sin,
               int64_t tokens, int64_t heads, int64_t d, int64_t rope_dim, const T* norm_weight, double eps,
               int threads) {
  const bool parallel = threads > 1 && tokens > 1 && tokens * heads * d >= PARALLEL_ELEMENTS;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t t = 0; t < tokens; ++t) {
    T normed[MAX_HEAD_DIM];  // head_dim <= MAX_HEAD_DIM (kernels.h; checked by the bindings)
    for (int64_t h = 0; h < heads; ++h) {
      const T* row = x + t * x_stride + h * head_stride;
      if (norm_weight != nullptr) {  // qwen3: the head's norm, rounded to the dtype, then rope
        norm_row(row, norm_weight, normed, d, eps);
        row = normed;
      }
      T* dst = out + (t * heads + h) * d;
      rope_row(row, dst, cos + t * rope_dim, sin + t * rope_dim, rope_dim);
      if (rope_dim < d) std::memcpy(dst + rope_dim, row + rope_dim, (d - rope_dim) * sizeof(T));
    }
  }
}

// reference.silu_and_mul: silu(g) = g / (1 + exp(-g)) for g >= 0 and g e / (1 + e), e = exp(g),
// below, both with the project's exp_neg of -|g|, times up. SIGMOID: reference.sigmoid_and_mul,
// the same steps with 1 (or e) in place of g (or g e).
template <bool SIGMOID, typename T>
void silu_impl(const T* gate, const T* up, int64_t in_stride, T* out, int64_t rows, int64_t width, int threads) {
  const bool parallel = threads > 1 && rows > 1 && rows * width >= PARALLEL_ELEMENTS;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    float g[SILU_BLOCK], t[SILU_BLOCK];
    const T* gate_row = gate + r * in_stride;
    const T* up_row = up + r * in_stride;
    T* out_row = out + r * width;
    for (int64_t i0 = 0; i0 < width; i0 += SILU_BLOCK) {
      const int64_t n = std::min(SILU_BLOCK, width - i0);
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps(g + i, _mm512_or_ps(load16(gate_row + i0 + i), sign));  // -|g|
#elif defined(TF_AVX2)
      const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(0x80000000u)));
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(g + i, _mm256_or_ps(load8(gate_row + i0 + i), sign));
#endif
      for (; i < n; ++i) g[i] = -std::fabs(to_f32(gate_row[i0 + i]));
      exp_neg_shifted(g, 0.0f, t, n);  // exp_neg(-|g| - 0), and -|g| - 0 is -|g| bit for bit
      i = 0;
#if defined(__AVX512F__)
      const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
      for (; i + 16 <= n; i += 16) {
        const __m512 gi = load16(gate_row + i0 + i), ti = _mm512_loadu_ps(t + i);
        const __m512 factor = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(gi, zero, _CMP_GE_OQ), ti, one);
        const __m512 s = _mm512_div_ps(SIGMOID ? factor : _mm512_mul_ps(gi, factor), _mm512_add_ps(one, ti));
        store16(out_row + i0 + i, _mm512_mul_ps(s, load16(up_row + i0 + i)));
      }
#elif defined(TF_AVX2)
      const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= n; i += 8) {  // the same steps eight lanes at a time
        const __m256 gi = load8(gate_row + i0 + i), ti = _mm256_loadu_ps(t + i);
        const __m256 factor = _mm256_blendv_ps(ti, one, _mm256_cmp_ps(gi, zero, _CMP_GE_OQ));
        const __m256 s = _mm256_div_ps(SIGMOID ? factor : _mm256_mul_ps(gi, factor), _mm256_add_ps(one, ti));
        store8(out_row + i0 + i, _mm256_mul_ps(s, load8(up_row + i0 + i)));
      }
#endif
      for (; i < n; ++i) {
        const float gi = to_f32(gate_row[i0 + i]);
        const float factor = gi >= 0.0f ? 1.0f : t[i];
        const float num = SIGMOID ? factor : gi * factor;  // silu: g, or g t (g * 1 is g exactly)
        const float s = num / (1.0f + t[i]);
        out_row[i0 + i] = from_f32<T>(s * to_f32(up_row[i0 + i]));
      }
    }
  }
}

// reference.gelu_tanh_and_mul (Gemma's GeGLU): u = x x; u = u C1; u = u x; u = u + x; u = u C2
// (C1 = 0.044715, C2 = 2 sqrt(2/pi), each rounded to float32), then gelu = x sigmoid32(u) with
// t = exp_neg(-|u|) and sigmoid32(u) = (u >= 0 ? 1 : t) / (1 + t) as in silu_impl; out = gelu up,
// rounded to the dtype. Each step one float32 rounding, in reference.gelu_tanh32's order.
template <typename T>
void gelu_impl(const T* gate, const T* up, int64_t in_stride, T* out, int64_t rows, int64_t width, int threads) {
  constexpr float C1 = static_cast<float>(0.044715), C2 = static_cast<float>(2 * 0.7978845608028654);
  const bool parallel = threads > 1 && rows > 1 && rows * width >= PARALLEL_ELEMENTS;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    float u[SILU_BLOCK], g[SILU_BLOCK], t[SILU_BLOCK];
    const T* gate_row = gate + r * in_stride;
    const T* up_row = up + r * in_stride;
    T* out_row = out + r * width;
    for (int64_t i0 = 0; i0 < width; i0 += SILU_BLOCK) {
      const int64_t n = std::min(SILU_BLOCK, width - i0);
      for (int64_t i = 0; i < n; ++i) {
        const float x = to_f32(gate_row[i0 + i]);
        float v = x * x;
        v = v * C1;
        v = v * x;
        v = v + x;
        v = v * C2;
        u[i] = v;
        g[i] = -std::fabs(v);
      }
      exp_neg_shifted(g, 0.0f, t, n);  // exp_neg(-|u| - 0), and -|u| - 0 is -|u| bit for bit
      for (int64_t i = 0; i < n; ++i) {
        const float s = (u[i] >= 0.0f ? 1.0f : t[i]) / (1.0f + t[i]);
        const float gelu = to_f32(gate_row[i0 + i]) * s;
        out_row[i0 + i] = from_f32<T>(gelu * to_f32(up_row[i0 + i]));
      }
    }
  }
}

template <typename T> const T* in(const void* p) { return static_cast<const T*>(p); }
template <typename T> T* io(void* p) { return static_cast<T*>(p); }

}  // namespace

void rms_norm(int dtype, const void* x, int64_t x_stride, const void* residual, int64_t r_stride, void* h_out,
              const void* weight, void* out, int64_t rows, int64_t width, double eps, int threads) {
  if (dtype == 0)
    rms_norm_impl(in<float>(x), x_stride, in<float>(residual), r_stride, io<float>(h_out), in<float>(weight),
                  io<float>(out), rows, width, eps, threads);
  else
    rms_norm_impl(in<bf16>(x), x_stride, in<bf16>(residual), r_stride, io<bf16>(h_out), in<bf16>(weight),
                  io<bf16>(out), rows, width, eps, threads);
}

// reference.relu_squared (Nemotron-H's MLPs and experts): r = relu(x) (a NaN stays NaN, as
// torch.relu), then r r rounded to the dtype: one rounding.
template <typename T>
void relu_squared_impl(const T* x, T* out, int64_t n, int threads) {
  const bool parallel = threads > 1 && n >= PARALLEL_ELEMENTS;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f32(x[i]);
    const float r = v > 0.0f || v != v ? v : 0.0f;
    out[i] = from_f32<T>(r * r);
  }
}

void relu_squared(int dtype, const void* x, void* out, int64_t n, int threads) {
  if (dtype == 0)
    relu_squared_impl(in<float>(x), io<float>(out), n, threads);
  else
    relu_squared_impl(in<bf16>(x), io<bf16>(out), n, threads);
}

// reference.softcap: y = x / cap, then reference.tanh32(y): below |y| = 0.625 the odd polynomial
// y + y (z P(z)), z = y y, P in Horner's order (p = z P0; p = (p + Pk) z ...); above, t =
// exp_neg(-2 |y|) and copysign((1 - t) / (1 + t), y); then times cap. Each step one float32
// rounding in the reference's order; both branches are computed and one is kept, as torch.where.
void softcap(const float* x, float* out, int64_t n, float cap, int threads) {
  constexpr float SMALL = 0.625f;
  static constexpr float POLY[5] = {static_cast<float>(-5.70498872745e-3), static_cast<float>(2.06390887954e-2),
                                    static_cast<float>(-5.37397155531e-2), static_cast<float>(1.33314422036e-1),
                                    static_cast<float>(-3.33332819422e-1)};
  const int64_t blocks = (n + SILU_BLOCK - 1) / SILU_BLOCK;
  const bool parallel = threads > 1 && n >= PARALLEL_ELEMENTS;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i0 = blk * SILU_BLOCK, m = std::min(SILU_BLOCK, n - i0);
    float y[SILU_BLOCK], g[SILU_BLOCK], t[SILU_BLOCK];
    for (int64_t i = 0; i < m; ++i) {
      y[i] = x[i0 + i] / cap;
      g[i] = std::fabs(y[i]) * -2.0f;
    }
    exp_neg_shifted(g, 0.0f, t, m);  // exp_neg(-2|y| - 0), and -2|y| - 0 is -2|y| bit for bit
    for (int64_t i = 0; i < m; ++i) {
      const float v = y[i], z = v * v;
      float p = z * POLY[0];
      for (int c = 1; c < 5; ++c) {
        p = p + POLY[c];
        p = p * z;
      }
      const float small = v + v * p;
      const float large = std::copysign((1.0f - t[i]) / (1.0f + t[i]), v);
      out[i0 + i] = (std::fabs(v) < SMALL ? small : large) * cap;
    }
  }
}

void layer_norm(int dtype, const void* x, const void* weight, const void* bias, void* out, int64_t rows, int64_t width,
                double eps, int threads) {
  if (dtype == 0)
    layer_norm_impl(in<float>(x), in<float>(weight), in<float>(bias), io<float>(out), rows, width, eps, threads);
  else
    layer_norm_impl(in<bf16>(x), in<bf16>(weight), in<bf16>(bias), io<bf16>(out), rows, width, eps, threads);
}

void rope(int dtype, const void* x, int64_t x_stride, void* out, const float* cos, const float* sin, int64_t tokens,
          int64_t heads, int64_t head_dim, const void* norm_weight, double eps, int threads) {
  rope_heads(dtype, x, x_stride, head_dim, out, cos, sin, tokens, heads, head_dim, head_dim, norm_weight, eps, threads);
}

void rope_heads(int dtype, const void* x, int64_t x_stride, int64_t head_stride, void* out, const float* cos,
                const float* sin, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rope_dim,
                const void* norm_weight, double eps, int threads) {
  if (dtype == 0)
    rope_impl(in<float>(x), x_stride, head_stride, io<float>(out), cos, sin, tokens, heads, head_dim, rope_dim,
              in<float>(norm_weight), eps, threads);
  else
    rope_impl(in<bf16>(x), x_stride, head_stride, io<bf16>(out), cos, sin, tokens, heads, head_dim, rope_dim,
              in<bf16>(norm_weight), eps, threads);
}

void silu_and_mul(int dtype, const void* gate, const void* up, int64_t in_stride, void* out, int64_t rows,
                  int64_t width, int threads) {
  if (dtype == 0)
    silu_impl<false>(in<float>(gate), in<float>(up), in_stride, io<float>(out), rows, width, threads);
  else
    silu_impl<false>(in<bf16>(gate), in<bf16>(up), in_stride, io<bf16>(out), rows, width, threads);
}

void sigmoid_and_mul(int dtype, const void* gate, const void* up, int64_t in_stride, void* out, int64_t rows,
                     int64_t width, int threads) {
  if (dtype == 0)
    silu_impl<true>(in<float>(gate), in<float>(up), in_stride, io<float>(out), rows, width, threads);
  else
    silu_impl<true>(in<bf16>(gate), in<bf16>(up), in_stride, io<bf16>(out), rows, width, threads);
}

void gelu_tanh_and_mul(int dtype, const void* gate, const void* up, int64_t in_stride, void* out, int64_t rows,
                       int64_t width, int threads) {
  if (dtype == 0)
    gelu_impl(in<float>(gate), in<float>(up), in_stride, io<float>(out), rows, width, threads);
  else
    gelu_impl(in<bf16>(gate), in<bf16>(up), in_stride, io<bf16>(out), rows, width, threads);
}

}  // namespace tf
