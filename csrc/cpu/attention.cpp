// Exact paged attention and the cache write, kernels/paged_attention.py's steps per query lane.
//
// The cache holds every K vector on its 22-bit fixed-point grid and every V vector on a 20-bit
// one (write_kv). A lane (one query row, one head) then computes:
//   1. q on its grid; each score q.k an exact float64 dot product, times scale, rounded to float32;
//   2. m = the largest score it sees; p = exp_neg(score - m) in float32;
//   3. w_j = round(p_j 2^(e_j - E + W_BITS)) with e_j the exponent of v_j and E the largest e_j seen:
//      sum_j w_j v_j is a sum of integers on one grid, exact in float64 per SPLIT_SIZE keys and in
//      int64 across them; the denominator sum_j round(p_j 2^L_BITS) is exact too;
//   4. out = num / den * 2^(E - V_BITS - W_BITS + 1 + L_BITS), rounded to float32, then to the dtype.
// Every sum is exact, so the order keys are visited in, the lanes a thread takes and the rows
// that share the call cannot change a bit.
#include <algorithm>
#include <cmath>
#include <vector>

#include "exact.h"
#include "kernels.h"

namespace tf {
namespace {

constexpr int QK_BITS = 22;
constexpr int V_BITS = 20;
constexpr int W_BITS = 24;
constexpr int L_BITS = 30;
constexpr int64_t SPLIT_SIZE = 512;

// max |x| as a float, through the bits: for floats without the sign bit the integer order is the
// magnitude order (a NaN compares above inf, and its exponent field reads 128, as torch's amax
// then gives), and an integer max is a reduction the compiler vectorizes without fast-math.
inline uint32_t abs_bits(float x) { return f32_bits(x) & 0x7FFFFFFFu; }
inline uint32_t abs_bits(bf16 x) { return (static_cast<uint32_t>(x.bits) << 16) & 0x7FFFFFFFu; }
template <typename T>
float max_abs(const T* x, int64_t n) {
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, abs_bits(x[i]));
  return f32_from_bits(top);
}

// exact.on_grid of one vector: rounded to 2^(e - bits + 1), e = exponent(max|x|); a second pass
// when the rounding lifted the largest element to the next power of two.
template <typename T>
void on_grid(const T* x, T* out, int64_t n, int bits) {
  double y[256];
  for (int64_t i = 0; i < n; ++i) y[i] = to_f32(x[i]);
  int e = exponent(max_abs(x, n));
  for (int pass = 0; pass < 2; ++pass) {
    const double magic = pow2(e - bits + 1) * ROUND_MAGIC;
    double amax = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      y[i] = (y[i] + magic) - magic;
      amax = std::max(amax, std::fabs(y[i]));
    }
    const int lifted = exponent(static_cast<float>(amax));
    if (lifted == e) break;
    e = lifted;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = from_f32<T>(static_cast<float>(y[i]));
}

struct Scratch {
  std::vector<double> q, num_part;
  std::vector<int64_t> num;
  std::vector<float> scores;
  std::vector<int> v_exp;
};

template <typename T>
struct Cache {
  const T* k;
  const T* v;
  int64_t block_size, kv_heads, head_dim;
  // Visit keys [first, last] in order: f(j, k_vector, v_vector) with j counted from first.
  template <typename F>
  void each_key(const int64_t* table, int64_t first, int64_t last, int64_t head, F&& f) const {
    const int64_t stride = kv_heads * head_dim;
    int64_t j = 0;
    for (int64_t b = first / block_size; b <= last / block_size; ++b) {
      const int64_t lo = std::max(first, b * block_size), hi = std::min(last + 1, (b + 1) * block_size);
      const int64_t base = ((table[b] * block_size + (lo - b * block_size)) * kv_heads + head) * head_dim;
      const T* kp = k + base;
      const T* vp = v + base;
      for (int64_t key = lo; key < hi; ++key, ++j, kp += stride, vp += stride) f(j, kp, vp);
    }
  }
};

template <typename T>
void attend_lane(const T* q, T* out, const Cache<T>& c, const int64_t* table, int64_t kv_head, int64_t pos,
                 float scale, int64_t window, Scratch& s) {
  const int64_t d = c.head_dim;
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  const int64_t keys = pos - first + 1;
  s.q.resize(d); s.num_part.resize(d); s.num.resize(d);
  s.scores.resize(keys); s.v_exp.resize(keys);

  const int qe = exponent(max_abs(q, d));  // 1. q on its grid, exact dot products
  const double q_up = pow2(QK_BITS - 1 - qe), q_down = pow2(qe - QK_BITS + 1);
  for (int64_t i = 0; i < d; ++i) s.q[i] = round_even(static_cast<double>(to_f32(q[i])) * q_up) * q_down;
  const double scale64 = scale;
  float m = -INFINITY;
  int top = -1024;
  c.each_key(table, first, pos, kv_head, [&](int64_t j, const T* k, const T* v) {
    double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // every partial sum exact: any order (8 lanes)
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
      for (int l = 0; l < 8; ++l) part[l] += s.q[i + l] * static_cast<double>(to_f32(k[i + l]));
    for (; i < d; ++i) part[0] += s.q[i] * static_cast<double>(to_f32(k[i]));
    double dot = 0.0;
    for (double p : part) dot += p;
    const float score = static_cast<float>(dot * scale64);
    s.scores[j] = score;
    m = std::max(m, score);
    const int ve = exponent(max_abs(v, d));
    s.v_exp[j] = ve;
    top = std::max(top, ve);
  });

  double den = 0.0;  // 2.-3. weights on one grid, exact sums
  std::fill(s.num.begin(), s.num.end(), 0);
  std::fill(s.num_part.begin(), s.num_part.end(), 0.0);
  c.each_key(table, first, pos, kv_head, [&](int64_t j, const T*, const T* v) {
    if (j > 0 && j % SPLIT_SIZE == 0) {  // a float64 partial holds SPLIT_SIZE keys exactly
      for (int64_t i = 0; i < d; ++i) s.num[i] += static_cast<int64_t>(s.num_part[i]);
      std::fill(s.num_part.begin(), s.num_part.end(), 0.0);
    }
    const double p = exp_neg(s.scores[j] - m);
    den += round_even(p * pow2(L_BITS));
    const double w = round_even(p * pow2(s.v_exp[j] - top + W_BITS));
    if (w == 0.0) return;
    const double v_up = pow2(V_BITS - 1 - s.v_exp[j]);
    for (int64_t i = 0; i < d; ++i) s.num_part[i] += w * (static_cast<double>(to_f32(v[i])) * v_up);
  });
  for (int64_t i = 0; i < d; ++i) s.num[i] += static_cast<int64_t>(s.num_part[i]);
  if (den == 0.0) den = 1.0;  // 4.
  const double out_scale = pow2(top - V_BITS - W_BITS + 1 + L_BITS);
  for (int64_t i = 0; i < d; ++i) {
    const double ratio = static_cast<double>(s.num[i]) / den;
    out[i] = from_f32<T>(static_cast<float>(ratio * out_scale));
  }
}

template <typename T>
void attention_impl(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* positions,
                    const int64_t* tables, int64_t table_width, const int64_t* row_starts, int64_t num_seqs,
                    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, double scale,
                    int64_t window, int threads) {
  const int64_t rows = row_starts[num_seqs] - row_starts[0];
  std::vector<int64_t> seq_of_row(rows);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t r = row_starts[s]; r < row_starts[s + 1]; ++r) seq_of_row[r - row_starts[0]] = s;
  const Cache<T> cache{k_cache, v_cache, block_size, kv_heads, head_dim};
  const int64_t group = heads / kv_heads, lanes = rows * heads;
  const float scale32 = static_cast<float>(scale);  // the kernels take scale as float32
#pragma omp parallel num_threads(threads) if (threads > 1 && lanes > 1)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t lane = 0; lane < lanes; ++lane) {
      const int64_t r = lane / heads, h = lane % heads, row = row_starts[0] + r;
      const int64_t offset = (row * heads + h) * head_dim;
      attend_lane(q + offset, out + offset, cache, tables + seq_of_row[r] * table_width, h / group,
                  positions[row], scale32, window, scratch);
    }
  }
}

template <typename T>
void write_kv_impl(T* k_cache, T* v_cache, const T* k, const T* v, const int64_t* slots, int64_t tokens,
                   int64_t kv_heads, int64_t head_dim, int threads) {
  const bool parallel = threads > 1 && tokens * kv_heads >= 64;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t src = (t * kv_heads + h) * head_dim, dst = (slots[t] * kv_heads + h) * head_dim;
      on_grid(k + src, k_cache + dst, head_dim, QK_BITS);
      on_grid(v + src, v_cache + dst, head_dim, V_BITS);
    }
}

}  // namespace

void write_kv(int dtype, void* k_cache, void* v_cache, const void* k, const void* v, const int64_t* slots,
              int64_t tokens, int64_t kv_heads, int64_t head_dim, int threads) {
  if (dtype == 0)
    write_kv_impl(static_cast<float*>(k_cache), static_cast<float*>(v_cache), static_cast<const float*>(k),
                  static_cast<const float*>(v), slots, tokens, kv_heads, head_dim, threads);
  else
    write_kv_impl(static_cast<bf16*>(k_cache), static_cast<bf16*>(v_cache), static_cast<const bf16*>(k),
                  static_cast<const bf16*>(v), slots, tokens, kv_heads, head_dim, threads);
}

void paged_attention(int dtype, const void* q, const void* k_cache, const void* v_cache, void* out,
                     const int64_t* positions, const int64_t* tables, int64_t table_width,
                     const int64_t* row_starts, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, int64_t block_size, double scale, int64_t window, int threads) {
  if (dtype == 0)
    attention_impl(static_cast<const float*>(q), static_cast<const float*>(k_cache),
                   static_cast<const float*>(v_cache), static_cast<float*>(out), positions, tables, table_width,
                   row_starts, num_seqs, heads, kv_heads, head_dim, block_size, scale, window, threads);
  else
    attention_impl(static_cast<const bf16*>(q), static_cast<const bf16*>(k_cache),
                   static_cast<const bf16*>(v_cache), static_cast<bf16*>(out), positions, tables, table_width,
                   row_starts, num_seqs, heads, kv_heads, head_dim, block_size, scale, window, threads);
}

}  // namespace tf
