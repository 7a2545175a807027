// Multi-head latent attention over the paged latent cache and the DSA indexer's choice of keys, for
// every row of a batch in one call, bitwise kernels/latent_attention.py (its docstring has the
// steps; this file follows them in the same arithmetic).
//
// Each sequence's keys are put on their grids once per call (only the positions some row of the
// call reads), read through the block table in place. Then the work items, (row, block of four
// heads) for the attention and (row, chunk of keys) for the indexer, run on the threads in any
// order: every item's result depends on its row's query, position and keys alone, so a row's bits
// do not depend on what shares the call or how many threads run it.
//
// The dot products: both sides integers on their grids (dot_bits of the width), so every product
// and partial sum is an integer below 2^53 and a float64 sum of them is exact in any order (eight
// lanes, four heads by four keys a step); scaled by one power of two and rounded once to float32,
// as exact_dots. The weighted latent sum: integer weights <= 2^W_BITS times integer values <=
// 2^V_BITS, exact in float64 over at most SPLIT_SIZE keys, chunks added in int64 (the reference's
// integers, whatever its chunking).
#include "latent_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "exact.h"
#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tf {
namespace {

using attention_grid::L_BITS;      // the paged attention's grids (kernels.h)
using attention_grid::SPLIT_SIZE;
using attention_grid::V_BITS;
using attention_grid::W_BITS;
constexpr int HB = 4;                  // heads per dot block
constexpr int KB = 4;                  // keys per dot block
constexpr int64_t INDEX_CHUNK = 256;   // keys per indexer work item

typedef double v8d __attribute__((vector_size(64)));

inline v8d load8(const double* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<v8d>(_mm512_loadu_pd(p));
#else
  v8d v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

// c + a * b. Every use multiplies and adds integers whose results stay below 2^53 (exact), so a
// fused multiply-add gives the bits of the two roundings it replaces (as dot64.h's do).
inline v8d mul_add(v8d a, v8d b, v8d c) {
#if defined(__AVX512F__)
  return reinterpret_cast<v8d>(_mm512_fmadd_pd(reinterpret_cast<__m512d>(a), reinterpret_cast<__m512d>(b),
                                               reinterpret_cast<__m512d>(c)));
#else
  return c + a * b;
#endif
}

// latent_attention.dot_bits: bits per element of an exact dot of `width` terms.
int dot_bits(int64_t width) {
  int c = 0;
  while ((int64_t{1} << c) < std::max<int64_t>(width, 2)) ++c;
  return (53 - c) / 2;
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// x[0:n] on its grid of `bits` (grid.to_fixed): the integers (as doubles) in out[0:n], zeros in
// out[n:stride]; returns the exponent.
template <typename T>
int to_grid(const T* x, int64_t n, int64_t stride, int bits, double* out) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(to_f32(x[i])));
  const int e = exponent(amax);
  const double s = pow2(bits - 1 - e);
  for (int64_t i = 0; i < n; ++i) out[i] = round_even(static_cast<double>(to_f32(x[i])) * s);
  for (int64_t i = n; i < stride; ++i) out[i] = 0.0;
  return e;
}

// out[a][b] = x[a] . y[b] over n elements (n a multiple of 8): exact (the file's header).
inline void dot_block(const double* const* x, const double* const* y, int64_t n, double out[HB][KB]) {
  v8d acc[HB][KB];
  for (int a = 0; a < HB; ++a)
    for (int b = 0; b < KB; ++b) acc[a][b] = v8d{};
  for (int64_t d = 0; d < n; d += 8) {
    v8d xv[HB], yv[KB];
    for (int a = 0; a < HB; ++a) xv[a] = load8(x[a] + d);
    for (int b = 0; b < KB; ++b) yv[b] = load8(y[b] + d);
    for (int a = 0; a < HB; ++a)
      for (int b = 0; b < KB; ++b) acc[a][b] = mul_add(xv[a], yv[b], acc[a][b]);
  }
  for (int a = 0; a < HB; ++a)
    for (int b = 0; b < KB; ++b) {
      double t = 0.0;
      for (int l = 0; l < 8; ++l) t += acc[a][b][l];
      out[a][b] = t;
    }
}

// One sequence's keys on their grids: the positions some row of the call reads, ascending.
struct SeqKeys {
  std::vector<int32_t> index;     // position -> row of the grids, -1 where not read
  std::vector<int64_t> position;  // row of the grids -> position
  std::vector<double> k;          // [n, k_stride] the dot grid
  std::vector<double> v;          // the value grid in tiles of 16 dims: [v_stride / 16, n, 16]
  std::vector<int> k_exp, v_exp;
};

// The cache row of position j of sequence s.
template <typename T>
inline const T* cache_row(const T* cache, const int64_t* table, int64_t j, int64_t block_size, int64_t dim) {
  return cache + (table[j / block_size] * block_size + j % block_size) * dim;
}

// Every marked position of every sequence onto its grids (k: dot_bits over dim; v: V_BITS over the
// first `latent`, when v_stride > 0), in parallel over the keys.
template <typename T>
void convert_keys(std::vector<SeqKeys>& seqs, const T* cache, const int64_t* tables, int64_t width,
                  int64_t block_size, int64_t dim, int bits, int64_t k_stride, int64_t latent, int64_t v_stride,
                  int threads) {
  std::vector<std::pair<int32_t, int32_t>> jobs;
  for (size_t s = 0; s < seqs.size(); ++s) {
    SeqKeys& sk = seqs[s];
    const int64_t n = static_cast<int64_t>(sk.position.size());
    sk.k.resize(n * k_stride);
    sk.k_exp.resize(n);
    sk.v.resize(n * v_stride);
    sk.v_exp.resize(v_stride > 0 ? n : 0);
    for (int64_t i = 0; i < n; ++i) jobs.emplace_back(static_cast<int32_t>(s), static_cast<int32_t>(i));
  }
  const int64_t count = static_cast<int64_t>(jobs.size());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && count > 64)
  for (int64_t g = 0; g < count; ++g) {
    SeqKeys& sk = seqs[jobs[g].first];
    const int64_t i = jobs[g].second;
    const T* row = cache_row(cache, tables + jobs[g].first * width, sk.position[i], block_size, dim);
    sk.k_exp[i] = to_grid(row, dim, k_stride, bits, sk.k.data() + i * k_stride);
    if (v_stride > 0) {
      thread_local std::vector<double> v_row;
      v_row.resize(v_stride);
      sk.v_exp[i] = to_grid(row, latent, v_stride, V_BITS, v_row.data());
      const int64_t n = static_cast<int64_t>(sk.position.size());
      for (int64_t t = 0; t < v_stride / 16; ++t)
        std::memcpy(sk.v.data() + (t * n + i) * 16, v_row.data() + t * 16, 16 * sizeof(double));
    }
  }
}

// Marks positions [0, length) of a sequence as read.
void mark_all(SeqKeys& sk, int64_t length) {
  sk.index.resize(length);
  sk.position.resize(length);
  for (int64_t j = 0; j < length; ++j) sk.index[j] = static_cast<int32_t>(j), sk.position[j] = j;
}

// What a latent attention item reads and writes.
struct LatentCall {
  const float* q;
  const int64_t* positions;
  const int32_t* selected;
  int64_t top_k, heads, dim, latent, k_stride, v_stride;
  int bits;
  float scale;
  float* out;
};

// One row's keys (rows of its sequence's grids, ascending): its selection's, or every one at or
// before its position.
void row_keys(const LatentCall& c, const SeqKeys& sk, int64_t r, std::vector<int32_t>& keys) {
  const int64_t p = c.positions[r];
  keys.clear();
  if (c.selected == nullptr) {
    for (int64_t j = 0; j <= p; ++j) keys.push_back(sk.index[j]);
    return;
  }
  for (int64_t i = 0; i < c.top_k; ++i) {
    const int64_t j = c.selected[r * c.top_k + i];
    if (j >= 0 && j <= p) keys.push_back(sk.index[j]);
  }
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
}

// Heads [h0, h0 + hb) of row r (latent_attention's step 2).
void latent_item(const LatentCall& c, const SeqKeys& sk, int64_t r, int64_t h0, int hb) {
  thread_local std::vector<int32_t> keys;
  thread_local std::vector<double> qg, w;
  thread_local std::vector<float> sc;
  thread_local std::vector<int64_t> num;
  row_keys(c, sk, r, keys);
  const int64_t n = static_cast<int64_t>(keys.size());
  const int64_t ks = c.k_stride, vs = c.v_stride;
  qg.resize(HB * ks);
  int q_exp[HB];
  const double* qp[HB];
  for (int a = 0; a < HB; ++a) {
    if (a < hb) q_exp[a] = to_grid(c.q + (r * c.heads + h0 + a) * c.dim, c.dim, ks, c.bits, qg.data() + a * ks);
    qp[a] = qg.data() + std::min(a, hb - 1) * ks;
  }
  // scores: float32(dot) * float32(scale)
  sc.resize(HB * std::max<int64_t>(n, 1));
  for (int64_t j0 = 0; j0 < n; j0 += KB) {
    const double* kp[KB];
    for (int b = 0; b < KB; ++b) kp[b] = sk.k.data() + keys[std::min(j0 + b, n - 1)] * ks;
    double dots[HB][KB];
    dot_block(qp, kp, ks, dots);
    for (int b = 0; b < KB && j0 + b < n; ++b) {
      const int ke = sk.k_exp[keys[j0 + b]];
      for (int a = 0; a < hb; ++a)
        sc[a * n + j0 + b] = static_cast<float>(dots[a][b] * pow2(q_exp[a] + ke - 2 * c.bits + 2)) * c.scale;
    }
  }
  int top = 0;  // the largest value exponent among the row's keys (0 where it has none)
  for (int64_t j = 0; j < n; ++j) top = j == 0 ? sk.v_exp[keys[0]] : std::max(top, sk.v_exp[keys[j]]);
  // p = exp_neg(score - max); the denominator and the integer weights
  w.assign(HB * std::max<int64_t>(n, 1), 0.0);
  int64_t den[HB] = {0, 0, 0, 0};
  for (int a = 0; a < hb; ++a) {
    const float* s = sc.data() + a * n;
    float m = n > 0 ? s[0] : 0.0f;
    for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
    for (int64_t j = 0; j < n; ++j) {
      const double p = exp_neg(s[j] - m);
      den[a] += static_cast<int64_t>(round_even(p * pow2(L_BITS)));
      w[a * n + j] = round_even(p * pow2(sk.v_exp[keys[j]] - top + W_BITS));
    }
  }
  // the weighted latent sums, exact: float64 over chunks of SPLIT_SIZE keys, int64 across them
  num.assign(HB * vs, 0);
  for (int64_t c0 = 0; c0 < n; c0 += SPLIT_SIZE) {
    const int64_t c1 = std::min(n, c0 + SPLIT_SIZE);
    for (int64_t d = 0; d < vs; d += 16) {
      v8d acc[HB][2];
      for (int a = 0; a < HB; ++a) acc[a][0] = acc[a][1] = v8d{};
      const double* tile = sk.v.data() + d / 16 * static_cast<int64_t>(sk.position.size()) * 16;
      for (int64_t j = c0; j < c1; ++j) {
        const double* vr = tile + keys[j] * 16;  // 16 dims of key j, beside the other keys' (tile layout)
        const v8d v0 = load8(vr), v1 = load8(vr + 8);
        for (int a = 0; a < HB; ++a) {
          const v8d wa = v8d{} + (a < hb ? w[a * n + j] : 0.0);
          acc[a][0] = mul_add(v0, wa, acc[a][0]);
          acc[a][1] = mul_add(v1, wa, acc[a][1]);
        }
      }
      for (int a = 0; a < hb; ++a)
        for (int l = 0; l < 8; ++l) {
          num[a * vs + d + l] += static_cast<int64_t>(acc[a][0][l]);
          num[a * vs + d + 8 + l] += static_cast<int64_t>(acc[a][1][l]);
        }
    }
  }
  const double out_scale = pow2(top - V_BITS - W_BITS + 1);
  for (int a = 0; a < hb; ++a) {
    const float total = static_cast<float>(static_cast<double>(den[a] == 0 ? 1 : den[a])) * pow2f(-L_BITS);
    float* o = c.out + (r * c.heads + h0 + a) * c.latent;
    for (int64_t d = 0; d < c.latent; ++d)
      o[d] = static_cast<float>(static_cast<double>(num[a * vs + d]) * out_scale) / total;
  }
}

// The rows of each sequence, and its sequence per row.
std::vector<int64_t> row_sequences(const int64_t* row_starts, int64_t num_seqs) {
  std::vector<int64_t> seq_of(row_starts[num_seqs]);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t r = row_starts[s]; r < row_starts[s + 1]; ++r) seq_of[r] = s;
  return seq_of;
}

template <typename T>
void latent_attention_t(const float* q, const T* cache, const int64_t* positions, const int64_t* tables,
                        int64_t width, const int64_t* row_starts, int64_t num_seqs, const int32_t* selected,
                        int64_t top_k, int64_t heads, int64_t dim, int64_t latent, int64_t block_size, float scale,
                        float* out, int threads) {
  const int bits = dot_bits(dim);
  const int64_t k_stride = round_up(dim, 8), v_stride = round_up(latent, 16);
  std::vector<SeqKeys> seqs(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    SeqKeys& sk = seqs[s];
    int64_t length = 0;
    for (int64_t r = row_starts[s]; r < row_starts[s + 1]; ++r) length = std::max(length, positions[r] + 1);
    if (selected == nullptr) {
      mark_all(sk, length);
      continue;
    }
    sk.index.assign(length, -1);
    for (int64_t r = row_starts[s]; r < row_starts[s + 1]; ++r)
      for (int64_t i = 0; i < top_k; ++i) {
        const int64_t j = selected[r * top_k + i];
        if (j >= 0 && j <= positions[r]) sk.index[j] = 1;  // read
      }
    for (int64_t j = 0; j < length; ++j)
      if (sk.index[j] >= 0) {
        sk.index[j] = static_cast<int32_t>(sk.position.size());
        sk.position.push_back(j);
      }
  }
  convert_keys(seqs, cache, tables, width, block_size, dim, bits, k_stride, latent, v_stride, threads);
  const LatentCall c{q, positions, selected, top_k, heads, dim, latent, k_stride, v_stride, bits, scale, out};
  const std::vector<int64_t> seq_of = row_sequences(row_starts, num_seqs);
  const int64_t blocks = (heads + HB - 1) / HB, items = row_starts[num_seqs] * blocks;
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (threads > 1 && items > 1)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t r = it / blocks, h0 = it % blocks * HB;
    latent_item(c, seqs[seq_of[r]], r, h0, static_cast<int>(std::min<int64_t>(HB, heads - h0)));
  }
}

// Whether index a comes before index b in a stable descending sort of `scores` (torch.sort's:
// NaN first, ties to the lower index).
inline bool ranks_before(const float* scores, int32_t a, int32_t b) {
  const float x = scores[a], y = scores[b];
  const bool xn = std::isnan(x), yn = std::isnan(y);
  if (xn != yn) return xn;
  if (!xn && x != y) return x > y;
  return a < b;
}

template <typename T>
void dsa_select_t(const float* q, const float* weights, const T* keys, const int64_t* positions,
                  const int64_t* tables, int64_t width, const int64_t* row_starts, int64_t num_seqs, int64_t heads,
                  int64_t dim, int64_t block_size, float scale, int64_t top_k, int32_t* out, int threads) {
  const int bits = dot_bits(dim);
  const int64_t stride = round_up(dim, 8), rows = row_starts[num_seqs];
  std::vector<SeqKeys> seqs(num_seqs);
  std::vector<int64_t> offset(rows + 1, 0);  // each choosing row's scores in `scores`
  std::vector<std::pair<int64_t, int64_t>> items;  // (row, first key)
  for (int64_t s = 0; s < num_seqs; ++s) {
    int64_t length = 0;
    for (int64_t r = row_starts[s]; r < row_starts[s + 1]; ++r)
      if (positions[r] + 1 > top_k) length = std::max(length, positions[r] + 1);
    mark_all(seqs[s], length);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t seen = positions[r] + 1;
    offset[r + 1] = offset[r] + (seen > top_k ? seen : 0);
    if (seen > top_k)
      for (int64_t j0 = 0; j0 < seen; j0 += INDEX_CHUNK) items.emplace_back(r, j0);
  }
  convert_keys(seqs, keys, tables, width, block_size, dim, bits, stride, 0, 0, threads);
  const std::vector<int64_t> seq_of = row_sequences(row_starts, num_seqs);
  std::vector<float> scores(offset[rows]);
  const int64_t count = static_cast<int64_t>(items.size());
  // indexer_scores: per head relu(float32(dot) * scale), times the head's weight, added from head 0
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (threads > 1 && count > 1)
  for (int64_t it = 0; it < count; ++it) {
    thread_local std::vector<double> qg;
    thread_local std::vector<int> q_exp;
    const int64_t r = items[it].first, j0 = items[it].second, j1 = std::min(j0 + INDEX_CHUNK, positions[r] + 1);
    const SeqKeys& sk = seqs[seq_of[r]];
    const int64_t padded = round_up(heads, HB);
    qg.resize(padded * stride);
    q_exp.resize(padded);
    for (int64_t h = 0; h < heads; ++h) q_exp[h] = to_grid(q + (r * heads + h) * dim, dim, stride, bits, qg.data() + h * stride);
    const float* wr = weights + r * heads;
    float* total = scores.data() + offset[r];
    for (int64_t j = j0; j < j1; j += KB) {
      const double* kp[KB];
      for (int b = 0; b < KB; ++b) kp[b] = sk.k.data() + std::min(j + b, j1 - 1) * stride;
      float per_head[KB] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int64_t h0 = 0; h0 < heads; h0 += HB) {
        const double* qp[HB];
        for (int a = 0; a < HB; ++a) qp[a] = qg.data() + std::min(h0 + a, heads - 1) * stride;
        double dots[HB][KB];
        dot_block(qp, kp, stride, dots);
        for (int a = 0; a < HB && h0 + a < heads; ++a)
          for (int b = 0; b < KB; ++b) {
            const int64_t key = std::min(j + b, j1 - 1);
            float s = static_cast<float>(dots[a][b] * pow2(q_exp[h0 + a] + sk.k_exp[key] - 2 * bits + 2)) * scale;
            s = s < 0.0f ? 0.0f : s;  // relu (NaN stays NaN)
            const float term = s * wr[h0 + a];
            per_head[b] = h0 + a == 0 ? term : per_head[b] + term;
          }
      }
      for (int b = 0; b < KB && j + b < j1; ++b) total[j + b] = per_head[b];
    }
  }
  // select_top_keys: the top_k by a stable descending sort, then ascending by position
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (threads > 1 && rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    thread_local std::vector<int32_t> order;
    int32_t* o = out + r * top_k;
    const int64_t seen = positions[r] + 1;
    if (seen <= top_k) {
      for (int64_t i = 0; i < top_k; ++i) o[i] = i < seen ? static_cast<int32_t>(i) : -1;
      continue;
    }
    const float* total = scores.data() + offset[r];
    order.resize(seen);
    for (int64_t j = 0; j < seen; ++j) order[j] = static_cast<int32_t>(j);
    std::nth_element(order.begin(), order.begin() + top_k, order.end(),
                     [total](int32_t a, int32_t b) { return ranks_before(total, a, b); });
    std::sort(order.begin(), order.begin() + top_k);
    std::copy(order.begin(), order.begin() + top_k, o);
  }
}

}  // namespace

void latent_attention(int cache_dtype, const float* q, const void* cache, const int64_t* positions,
                      const int64_t* tables, int64_t width, const int64_t* row_starts, int64_t num_seqs,
                      const int32_t* selected, int64_t top_k, int64_t heads, int64_t dim, int64_t latent,
                      int64_t block_size, float scale, float* out, int threads) {
  if (cache_dtype == 0)
    latent_attention_t(q, static_cast<const float*>(cache), positions, tables, width, row_starts, num_seqs, selected,
                       top_k, heads, dim, latent, block_size, scale, out, threads);
  else
    latent_attention_t(q, static_cast<const bf16*>(cache), positions, tables, width, row_starts, num_seqs, selected,
                       top_k, heads, dim, latent, block_size, scale, out, threads);
}

void dsa_select(int keys_dtype, const float* q, const float* weights, const void* keys, const int64_t* positions,
                const int64_t* tables, int64_t width, const int64_t* row_starts, int64_t num_seqs, int64_t heads,
                int64_t dim, int64_t block_size, float scale, int64_t top_k, int32_t* out, int threads) {
  if (keys_dtype == 0)
    dsa_select_t(q, weights, static_cast<const float*>(keys), positions, tables, width, row_starts, num_seqs, heads,
                 dim, block_size, scale, top_k, out, threads);
  else
    dsa_select_t(q, weights, static_cast<const bf16*>(keys), positions, tables, width, row_starts, num_seqs, heads,
                 dim, block_size, scale, top_k, out, threads);
}

}  // namespace tf
