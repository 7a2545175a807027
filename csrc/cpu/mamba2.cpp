// Mamba2's mixing (kernels/mamba2.py: mamba2, gated_group_norm), one call per layer.
//
// The reference's steps, each one IEEE operation in its order (-ffp-contract=off, no fast-math):
//   phase A, per row (rows over the threads): the causal conv tap by tap (acc = x_0 w_0, then
//     acc + x_j w_j), + bias, SiLU (silu32); dt = clamp(softplus(dt + dt_bias), lo, hi) (softplus in
//     float64 with exp64 / log64, rounded once), decay = exp_neg(-(rate dt)); each group's C on its
//     22-bit grid (grid_dot's v_int);
//   phase B, per work item (sequence, head, columns of the state: up to a whole row, recurrent.h)
//     (mamba2.ssm_step):
//       x_dt = x dt;  h = h decay;  h = h + B x_dt^T;  y = grid_dot(h, C);  out = y + x D.
// grid_dot is exact: each column of h and C as integers on their own 22-bit grids, the products
// (< 2^44) and their sums (state_size <= 256: < 2^52) exact, one rounding to float32 at the end, so
// no order of the sum, lane width or thread count changes a bit, and neither does the arithmetic
// that carries it: int64 under AVX-512 and AVX2 where the columns' scales are normal float32 numbers
// (int_dot16), float64 elsewhere (read_out_f64), the same integers either way. A column of h never
// reads another column, so the columns split into work items, each running its rows in order.
//
// The state: the slots the batch names (ForwardBatch.state_slots), as delta_net.cpp reads them:
// sequence s starts from block state_in[s] (zeros at -1), and the state after row r (the conv
// window and h) is written to block state_out[r] unless that is -1. Every starting state is read
// before any is written: the conv windows are copied first, and an ssm block that one sequence
// starts from and another writes is copied before the recurrence (a sequence's own items read their
// start before they write). A block written by two sequences is refused (binding.h).
//
// The gated norm (gated_group_norm): g = y silu32(z); each of n_groups slices of a row through
// reference.rms_norm's steps (an exact integer sum of squares on the slice's grid, float32 steps);
// rounded to the model's dtype, times the weight (one float32 product, rounded to the result's dtype).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

// exact64.h first (as delta_net.cpp: its c64 names are bound before exact.h declares tf:: ones).
#include "exact64.h"
#include "exact.h"
#include "mamba2.h"
#include "recurrent.h"
#include "vec16.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The lanes' vectors never cross a translation unit (this file's functions only), so the ABI note
// GCC gives for wide vectors in builds without the matching ISA does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace tf {
namespace {

constexpr int STATE_BITS = 22;  // delta_net.STATE_BITS (grid_dot's)
constexpr int NORM_BITS = 20;   // reference.NORM_BITS
constexpr int64_t PARALLEL_ELEMENTS = 1 << 15;  // phase A and the norm split rows over threads above this
constexpr int RUN_COLUMNS = 16;                 // the columns run_columns takes at most: 64 bytes of each state row
using recurrent::conv_tap;
using recurrent::silu_inplace;
using recurrent::softplus32;

template <typename V> inline V load(const void* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
template <typename V> inline void store(void* p, const V& v) { std::memcpy(p, &v, sizeof v); }

// G columns of the state as compiler vectors (G = 1: plain scalars). Each lane takes its column's
// own steps, one IEEE operation each, so every width gives the same bits.
template <int G>
struct Lanes;
#if defined(__GNUC__)
// (spelled out per width: GCC takes __builtin_convertvector of a concrete vector type only)
#define TF_MAMBA2_LANES(WIDTH)                                              \
  template <>                                                               \
  struct Lanes<WIDTH> {                                                     \
    typedef float F __attribute__((vector_size(4 * WIDTH)));                \
    typedef double D __attribute__((vector_size(8 * WIDTH)));               \
    typedef uint32_t U __attribute__((vector_size(4 * WIDTH)));             \
    static D widen(F x) { return __builtin_convertvector(x, D); }           \
    static U max(U a, U b) { return a > b ? a : b; }                        \
  };
TF_MAMBA2_LANES(16)
TF_MAMBA2_LANES(8)
TF_MAMBA2_LANES(4)
#undef TF_MAMBA2_LANES
#endif
template <>
struct Lanes<1> {
  using F = float;
  using D = double;
  using U = uint32_t;
  static D widen(F x) { return x; }
  static U max(U a, U b) { return a > b ? a : b; }
};

// torch.clamp(x, lo, hi) of float32 x: min(max(x, lo), hi), NaN stays NaN.
inline float clamp(float x, float lo, float hi) {
  const float up = x < lo ? lo : x;
  return up > hi ? hi : up;
}

// max |x| of n floats (the integer max of the magnitudes' bits: a NaN ranks above inf, as amax).
inline float max_magnitude(const float* x, int64_t n) {
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, f32_bits(x[i]) & 0x7FFFFFFFu);
  return f32_from_bits(top);
}

// reference._normalized's factor: 1 / sqrt(float(ss) 2^(2 (e - 19)) / divisor + eps) in float32, ss
// the exact sum of the squares on the row's grid (integers, partial sums below 2^53: any order).
inline float inverse_norm(const float* x, int64_t n, float divisor, float eps) {
  const int e = exponent(max_magnitude(x, n));
  const double grid = pow2(2 * (NORM_BITS - 1 - e));
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = x[i];
    ss += round_even((d * d) * grid);
  }
  float var = scale32(static_cast<float>(ss), 2 * (e - NORM_BITS + 1));
  var = var / divisor;
  return 1.0f / std::sqrt(var + eps);
}

// Everything one call reads and writes (mamba2.h: mamba2).
struct Call {
  const void* xbc;
  int64_t xbc_stride;
  const float* dt;  // [rows, heads]
  float* conv;
  float* ssm;
  const int64_t* state_in;
  const int64_t* state_out;
  const int64_t* row_starts;
  int64_t num_seqs;
  const float* conv_taps;  // [K, C]
  const float* conv_bias;  // [C] or null
  const float* rate;
  const float* dt_bias;
  const float* d;
  float dt_min, dt_max;
  int64_t heads, head_dim, groups, state_size, taps;
  float* out;  // [rows, heads, head_dim]
  int threads;

  int64_t width() const { return heads * head_dim; }
  int64_t channels() const { return width() + 2 * groups * state_size; }
};

// What phase A leaves per row: `mixed` [rows, C] (the conv's output: x, B, C), step and decay
// [rows, heads], C on its grid: c_int [rows, groups, N] (integers as float64) and e_c [rows,
// groups]. start: sequence s's starting ssm state [heads, N, P] (null: zeros).
struct Rows {
  float *mixed, *step, *decay;
  double* c_int;
  int32_t* e_c;
  const float* const* start;
};

// grid_dot's integer sums for G columns of the state S [N, G]: sums[j] = sum_i round_even(S[i][j]
// scale[j]) c_int[i], in float64 (integers below 2^53: exact in any order). Accumulators of at most
// eight doubles (one AVX-512 register: GCC keeps a wider vector in memory, and the add chain then
// waits on a store each step).
template <int G>
inline void read_out_f64(const float* S, int64_t stride, int64_t N, const double* scale, const double* c_int,
                         double* sums) {
  constexpr int W = G >= 8 ? 8 : G, A = G / W;
  using HF = typename Lanes<W>::F;
  using HD = typename Lanes<W>::D;
  HD sv[A], acc[A];
  for (int a = 0; a < A; ++a) {
    sv[a] = load<HD>(scale + a * W);
    acc[a] = HD{} + 0.0;
  }
  for (int64_t i = 0; i < N; ++i) {
    const double ci = c_int[i];
    for (int a = 0; a < A; ++a) {
      const HD on_grid = (Lanes<W>::widen(load<HF>(S + i * stride + a * W)) * sv[a] + ROUND_MAGIC) - ROUND_MAGIC;
      acc[a] = acc[a] + on_grid * ci;
    }
  }
  for (int a = 0; a < A; ++a) store(sums + a * W, acc[a]);
}

#if defined(__AVX512F__) || defined(__AVX2__)
#define TF_MAMBA2_INT_DOTS 1
// The same sums for sixteen columns in int64, where every column's scale is a normal float32
// (scale_f; delta_net.cpp's dots_int): x scale is then exact in float32 (a power of two; a product
// below 2^-126 rounds to 0 either way), |x scale| < 2^22, and the conversion to int32 rounds to
// nearest even (MXCSR's default) as round_even does; the products (< 2^44) and sums (< 2^52) are
// exact in int64, the even and odd columns summed apart (vpmuldq reads each 64-bit lane's low half).
#if defined(__AVX512F__)
inline void int_dot16(const float* S, int64_t stride, int64_t N, const float* scale_f, const double* c_int,
                      double* sums) {
  const __m512 sv = _mm512_loadu_ps(scale_f);
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
  for (int64_t i = 0; i < N; ++i) {
    const __m512i xi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(S + i * stride), sv));
    const __m512i ci = _mm512_set1_epi32(static_cast<int32_t>(c_int[i]));
    even = _mm512_add_epi64(even, _mm512_mul_epi32(xi, ci));
    odd = _mm512_add_epi64(odd, _mm512_mul_epi32(_mm512_srli_epi64(xi, 32), ci));
  }
  int64_t e[8], o[8];
  _mm512_storeu_si512(e, even);
  _mm512_storeu_si512(o, odd);
  for (int l = 0; l < 8; ++l) {
    sums[2 * l] = static_cast<double>(e[l]);
    sums[2 * l + 1] = static_cast<double>(o[l]);
  }
}
#else  // AVX2: the sixteen columns as two registers of eight
inline void int_dot16(const float* S, int64_t stride, int64_t N, const float* scale_f, const double* c_int,
                      double* sums) {
  const __m256 lo = _mm256_loadu_ps(scale_f), hi = _mm256_loadu_ps(scale_f + 8);
  __m256i even_lo = _mm256_setzero_si256(), odd_lo = even_lo, even_hi = even_lo, odd_hi = even_lo;
  for (int64_t i = 0; i < N; ++i) {
    const __m256i ci = _mm256_set1_epi32(static_cast<int32_t>(c_int[i]));
    const __m256i xl = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(S + i * stride), lo));
    const __m256i xh = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(S + i * stride + 8), hi));
    even_lo = _mm256_add_epi64(even_lo, _mm256_mul_epi32(xl, ci));
    odd_lo = _mm256_add_epi64(odd_lo, _mm256_mul_epi32(_mm256_srli_epi64(xl, 32), ci));
    even_hi = _mm256_add_epi64(even_hi, _mm256_mul_epi32(xh, ci));
    odd_hi = _mm256_add_epi64(odd_hi, _mm256_mul_epi32(_mm256_srli_epi64(xh, 32), ci));
  }
  int64_t e[8], o[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(e), even_lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(e + 4), even_hi);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), odd_lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 4), odd_hi);
  for (int l = 0; l < 8; ++l) {
    sums[2 * l] = static_cast<double>(e[l]);
    sums[2 * l + 1] = static_cast<double>(o[l]);
  }
}
#endif
#endif

// Columns [j0, j0 + R G) of (sequence s, head h), as R runs of G lanes side by side: the recurrence
// over the sequence's rows. The running state is `buffer` ([N, R G]), or, for a single row whose
// state goes back where it came from (a decode step within a block), the cache's own rows, updated
// in place: each state line is then read once and written once. A state row's R G columns are
// contiguous (R = 4, G = 16: a head's whole 64-column row). Every lane takes its column's own steps,
// whatever R, G and the state's place, so the bits are those of one column at a time.
template <int G, int R = 1>
void run_columns(const Call& c, const Rows& rw, int64_t s, int64_t h, int64_t j0, float* buffer) {
  using L = Lanes<G>;
  using F = typename L::F;
  using U = typename L::U;
  const int64_t N = c.state_size, P = c.head_dim, H = c.heads, C = c.channels(), I = c.width();
  const int64_t g = h / (H / c.groups);  // group g serves heads g * H / groups ...
  const int64_t start = c.row_starts[s], n = c.row_starts[s + 1] - start;
  const float* src = rw.start[s] == nullptr ? nullptr : rw.start[s] + h * N * P + j0;
  const int64_t last_slot = n > 0 ? c.state_out[start + n - 1] : -1;
  float* home = last_slot < 0 ? nullptr : c.ssm + (last_slot * H + h) * N * P + j0;
  const bool in_place = n == 1 && src != nullptr && src == home;
  float* S = in_place ? home : buffer;
  const int64_t stride = in_place ? P : R * G;
  if (!in_place) {  // the buffer starts from the sequence's state, or zeros
    if (src == nullptr) std::memset(S, 0, N * stride * sizeof(float));
    else for (int64_t i = 0; i < N; ++i) std::memcpy(S + i * stride, src + i * P, R * G * sizeof(float));
  }
  const float skip = c.d[h];
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = start + t;
    const float decay = rw.decay[row * H + h], step = rw.step[row * H + h];
    const float* x = rw.mixed + row * C + h * P + j0;
    const float* b = rw.mixed + row * C + I + g * N;
    F x_dt[R];
    U top[R];
    for (int r = 0; r < R; ++r) {
      x_dt[r] = load<F>(x + r * G) * step;
      top[r] = U{} + 0u;
    }
    for (int64_t i = 0; i < N; ++i) {  // h = h decay, then h + B x_dt^T (the product rounded, then the sum)
      for (int r = 0; r < R; ++r) {
        float* cell = S + i * stride + r * G;
        F v = load<F>(cell) * decay;
        v = v + b[i] * x_dt[r];
        store(cell, v);
        top[r] = L::max(top[r], load<U>(&v) & 0x7FFFFFFFu);
      }
    }
    const int64_t slot = c.state_out[row];
    if (slot >= 0 && !in_place) {
      float* dst = c.ssm + (slot * H + h) * N * P + j0;
      for (int64_t i = 0; i < N; ++i) std::memcpy(dst + i * P, S + i * stride, R * G * sizeof(float));
    }
    const int e_c = rw.e_c[row * c.groups + g];
    const double c_unit = pow2(e_c - STATE_BITS + 1);
    const double* c_int = rw.c_int + (row * c.groups + g) * N;
    for (int r = 0; r < R; ++r) {
      // grid_dot(h, C): each column on its grid (scale 2^(21 - e_j)), times C's integers, summed exactly
      const float* Sr = S + r * G;
      uint32_t tops[G];
      double scale[G], unit[G];
      store(tops, top[r]);
      float scale_f[G];
      bool normal = true;  // every column's scale a normal float32 (int_dot16's condition)
      for (int j = 0; j < G; ++j) {
        const int e = exponent(f32_from_bits(tops[j]));
        scale[j] = pow2(STATE_BITS - 1 - e);
        unit[j] = pow2(e - STATE_BITS + 1) * c_unit;
        normal = normal && e >= -106 && e <= 127;
        scale_f[j] = normal ? pow2f(STATE_BITS - 1 - e) : 0.0f;
      }
      double sums[G];
#if defined(TF_MAMBA2_INT_DOTS)
      if constexpr (G == 16) {
        if (normal) int_dot16(Sr, stride, N, scale_f, c_int, sums);
      }
      if (G != 16 || !normal)
#endif
      read_out_f64<G>(Sr, stride, N, scale, c_int, sums);
      float* o = c.out + (row * H + h) * P + j0 + r * G;
      const float* xr = x + r * G;
      for (int j = 0; j < G; ++j) {
        const float y = static_cast<float>(sums[j] * unit[j]);
        o[j] = y + xr[j] * skip;
      }
    }
  }
}

// One work item: columns [j0, end), up to four runs of RUN_COLUMNS (a 64-column row) in one pass
// (two where that is what is left), then sixteen, eight, four, one at a time.
void run_item(const Call& c, const Rows& rw, int64_t s, int64_t h, int64_t j0, int64_t end, float* S) {
  int64_t j = j0;
#if defined(__GNUC__)
  for (; j + 4 * RUN_COLUMNS <= end; j += 4 * RUN_COLUMNS) run_columns<RUN_COLUMNS, 4>(c, rw, s, h, j, S);
  if (j + 2 * RUN_COLUMNS <= end) {
    run_columns<RUN_COLUMNS, 2>(c, rw, s, h, j, S);
    j += 2 * RUN_COLUMNS;
  }
  for (; j + RUN_COLUMNS <= end; j += RUN_COLUMNS) run_columns<RUN_COLUMNS>(c, rw, s, h, j, S);
  for (; j + 8 <= end; j += 8) run_columns<8>(c, rw, s, h, j, S);
  for (; j + 4 <= end; j += 4) run_columns<4>(c, rw, s, h, j, S);
#endif
  for (; j < end; ++j) run_columns<1>(c, rw, s, h, j, S);
}

template <typename T>
void mamba2_impl(const Call& c) {
  const int64_t rows = c.row_starts[c.num_seqs], C = c.channels(), K = c.taps, W = K - 1, H = c.heads;
  const int64_t N = c.state_size, G = c.groups;
  const T* xbc = static_cast<const T*>(c.xbc);
  // Every starting state is read before any is written (recurrent.h).
  const int64_t state_elements = H * N * c.head_dim;
  const recurrent::Starts st(c.num_seqs, c.row_starts, c.state_in, c.state_out, c.conv, c.ssm, W, C, state_elements);
  const std::vector<int64_t>& seq_of_row = st.seq_of_row;
  const std::vector<float>& windows = st.windows;
  recurrent::write_windows(st, c.row_starts, c.state_out, c.conv, xbc, c.xbc_stride, W, C);
  // Phase A, row by row: conv + bias, SiLU, the time steps and decays, C on its grid.
  thread_local std::vector<float> floats;
  thread_local std::vector<double> grids;
  thread_local std::vector<int32_t> exps;
  floats.resize(static_cast<size_t>(rows * (C + 2 * H)));
  grids.resize(static_cast<size_t>(rows * G * N));
  exps.resize(static_cast<size_t>(rows * G));
  float* f = floats.data();
  const Rows rw{f, f + rows * C, f + rows * (C + H), grids.data(), exps.data(), st.states.data()};
  const int64_t I = c.width();
  const bool parallel_rows = c.threads > 1 && rows > 1 && rows * C >= PARALLEL_ELEMENTS;
#pragma omp parallel num_threads(c.threads) if (parallel_rows)
  {
    std::vector<float> tmp(C), t_buf(C);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = seq_of_row[r], t = r - c.row_starts[s];
      float* m = rw.mixed + r * C;
      for (int64_t j = 0; j < K; ++j) {  // acc = in_0 w_0, then acc + in_j w_j
        const int64_t u = t + j;         // the row of the padded inputs: the window's, then xbc's
        if (u < W)
          conv_tap(windows.data() + (s * W + u) * C, c.conv_taps + j * C, m, C, j == 0);
        else
          conv_tap(xbc + (c.row_starts[s] + u - W) * c.xbc_stride, c.conv_taps + j * C, m, C, j == 0);
      }
      if (c.conv_bias != nullptr)
        for (int64_t ch = 0; ch < C; ++ch) m[ch] = m[ch] + c.conv_bias[ch];
      silu_inplace(m, tmp.data(), t_buf.data(), C);
      for (int64_t h = 0; h < H; ++h) {
        const float step = clamp(softplus32(c.dt[r * H + h] + c.dt_bias[h]), c.dt_min, c.dt_max);
        rw.step[r * H + h] = step;
        rw.decay[r * H + h] = exp_neg(-(c.rate[h] * step));
      }
      for (int64_t g = 0; g < G; ++g) {  // C of group g on its grid: round_even(c 2^(21 - e))
        const float* cv = m + I + G * N + g * N;
        const int e = exponent(max_magnitude(cv, N));
        const double scale = pow2(STATE_BITS - 1 - e);
        double* dst = rw.c_int + (r * G + g) * N;
        for (int64_t i = 0; i < N; ++i) dst[i] = round_even(static_cast<double>(cv[i]) * scale);
        rw.e_c[r * G + g] = e;
      }
    }
  }
  // Phase B: the recurrence, a work item (sequence, head, state columns) at a time
  // (recurrent::work_items).
  const std::vector<recurrent::WorkItem> items =
      recurrent::work_items(c.num_seqs, c.row_starts, H, c.head_dim, c.threads, RUN_COLUMNS);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const bool parallel_items = c.threads > 1 && num_items > 1;
#pragma omp parallel num_threads(c.threads) if (parallel_items)
  {
    std::vector<float> S(4 * N * RUN_COLUMNS);  // the running state of the item's columns at hand
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) run_item(c, rw, items[i].s, items[i].h, items[i].j0, items[i].j1, S.data());
  }
}

// gated_group_norm of rows: g = y silu32(z); each group slice x g * inv; rounded to T, times the
// weight in float32, rounded to O.
template <typename T, typename Z, typename Wt, typename O>
void gated_norm_impl(const float* y, const Z* z, int64_t z_stride, const Wt* weight, O* out, int64_t rows,
                     int64_t width, int64_t groups, double eps, int threads) {
  const int64_t gw = width / groups;
  const bool parallel = threads > 1 && rows > 1 && rows * width >= PARALLEL_ELEMENTS;
#pragma omp parallel num_threads(threads) if (parallel)
  {
    std::vector<float> g(width), tmp(width), t(width);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const Z* zr = z + r * z_stride;
      for (int64_t i = 0; i < width; ++i) g[i] = to_f32(zr[i]);
      silu_inplace(g.data(), tmp.data(), t.data(), width);
      const float* yr = y + r * width;
      for (int64_t i = 0; i < width; ++i) g[i] = yr[i] * g[i];
      O* o = out + r * width;
      for (int64_t k = 0; k < groups; ++k) {
        const float* slice = g.data() + k * gw;
        const float inv = inverse_norm(slice, gw, static_cast<float>(gw), static_cast<float>(eps));
        for (int64_t i = 0; i < gw; ++i) {
          const float normed = to_f32(from_f32<T>(slice[i] * inv));  // (* ones: the same bits)
          o[k * gw + i] = from_f32<O>(normed * to_f32(weight[i + k * gw]));
        }
      }
    }
  }
}

template <typename T, typename Z>
void gated_norm_weight(const float* y, const void* z, int64_t z_stride, int weight_dtype, const void* weight,
                       int out_dtype, void* out, int64_t rows, int64_t width, int64_t groups, double eps,
                       int threads) {
  const Z* zz = static_cast<const Z*>(z);
  if (weight_dtype == 0) {
    const float* w = static_cast<const float*>(weight);
    if (out_dtype == 0)
      gated_norm_impl<T>(y, zz, z_stride, w, static_cast<float*>(out), rows, width, groups, eps, threads);
    else
      gated_norm_impl<T>(y, zz, z_stride, w, static_cast<bf16*>(out), rows, width, groups, eps, threads);
  } else {
    const bf16* w = static_cast<const bf16*>(weight);
    if (out_dtype == 0)
      gated_norm_impl<T>(y, zz, z_stride, w, static_cast<float*>(out), rows, width, groups, eps, threads);
    else
      gated_norm_impl<T>(y, zz, z_stride, w, static_cast<bf16*>(out), rows, width, groups, eps, threads);
  }
}

}  // namespace

void mamba2(int dtype, const void* xbc, int64_t xbc_stride, const float* dt, float* conv_state, float* ssm_state,
            const int64_t* state_in, const int64_t* state_out, const int64_t* row_starts, int64_t num_seqs,
            const float* conv_taps, const float* conv_bias, int64_t conv_kernel, const float* rate,
            const float* dt_bias, const float* d, float dt_min, float dt_max, int64_t heads, int64_t head_dim,
            int64_t groups, int64_t state_size, float* out, int threads) {
  const Call c{xbc,       xbc_stride, dt,      conv_state, ssm_state, state_in,   state_out, row_starts,
               num_seqs,  conv_taps,  conv_bias, rate,     dt_bias,   d,          dt_min,    dt_max,
               heads,     head_dim,   groups,  state_size, conv_kernel, out,      threads};
  if (dtype == 0)
    mamba2_impl<float>(c);
  else
    mamba2_impl<bf16>(c);
}

void mamba2_gated_norm(const float* y, int z_dtype, const void* z, int64_t z_stride, int weight_dtype,
                       const void* weight, int dtype, int out_dtype, void* out, int64_t rows, int64_t width,
                       int64_t groups, double eps, int threads) {
  auto run = [&](auto t_tag) {
    using T = decltype(t_tag);
    if (z_dtype == 0)
      gated_norm_weight<T, float>(y, z, z_stride, weight_dtype, weight, out_dtype, out, rows, width, groups, eps,
                                  threads);
    else
      gated_norm_weight<T, bf16>(y, z, z_stride, weight_dtype, weight, out_dtype, out, rows, width, groups, eps,
                                 threads);
  };
  if (dtype == 0)
    run(float{});
  else
    run(bf16{});
}

}  // namespace tf
