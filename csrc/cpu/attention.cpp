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
#include "vec16.h"

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

constexpr int64_t ROWS_PER_ITEM = 16;  // query rows of one sequence that share each K/V load
constexpr int64_t KEY_CHUNK = 64;      // keys converted to float64 at a time (divides SPLIT_SIZE)

// Per-thread buffers, grown as needed and reused across work items and calls.
struct Scratch {
  std::vector<double> q, kt, v_int, dots, w, num_part;
  std::vector<int64_t> num;
  std::vector<float> scores, p;
  std::vector<double> den;
  std::vector<float> m;
  std::vector<int> v_exp, top;
  std::vector<int64_t> lo, hi;
};

template <typename T>
struct Cache {
  const T* k;
  const T* v;
  int64_t block_size, kv_heads, head_dim;
  // Where key `key` of the sequence with block table `table` sits for KV head `head`.
  int64_t offset(const int64_t* table, int64_t key, int64_t head) const {
    return ((table[key / block_size] * block_size + key % block_size) * kv_heads + head) * head_dim;
  }
};

// The two inner products of a work item, with the head size known at compile time where it is a
// usual one (64, 128, 256: the accumulators then stay in registers) and at run time otherwise.
// Every product and partial sum in them is exact, so how they are ordered is free.

// dots[j] = q . k_j for the KEY_CHUNK keys of kt ([d][KEY_CHUNK], float64).
template <int D>
void chunk_dots(const double* q, const double* kt, double* dots, int64_t d) {
  const int64_t dims = D > 0 ? D : d;
  double acc[KEY_CHUNK] = {};
  for (int64_t i = 0; i < dims; ++i) {
    const double qi = q[i];
    const double* kr = kt + i * KEY_CHUNK;
    for (int64_t j = 0; j < KEY_CHUNK; ++j) acc[j] += qi * kr[j];
  }
  for (int64_t j = 0; j < KEY_CHUNK; ++j) dots[j] = acc[j];
}

// acc += sum_j w[j] v_int[j] over the n keys of the chunk (v_int [n][d], float64).
template <int D>
void chunk_weighted_sum(const double* w, const double* v_int, int64_t n, double* acc, int64_t d) {
  if constexpr (D > 0) {
    double a[D];
    for (int64_t i = 0; i < D; ++i) a[i] = acc[i];
    for (int64_t j = 0; j < n; ++j) {
      if (w[j] == 0.0) continue;
      const double wj = w[j];
      const double* vr = v_int + j * D;
      for (int64_t i = 0; i < D; ++i) a[i] += wj * vr[i];
    }
    for (int64_t i = 0; i < D; ++i) acc[i] = a[i];
  } else {
    for (int64_t j = 0; j < n; ++j) {
      if (w[j] == 0.0) continue;
      const double* vr = v_int + j * d;
      for (int64_t i = 0; i < d; ++i) acc[i] += w[j] * vr[i];
    }
  }
}

// One work item: rows [r0, r1) of one sequence against one KV head, that is (r1 - r0) * group
// lanes (lane = row * group + head within the group). Keys are visited in chunks converted to
// float64 once for all lanes; every sum is exact, so the chunking and the sharing change no bit.
template <typename T, int D>
void attend_item(const T* q, T* out, const Cache<T>& c, const int64_t* table, const int64_t* positions,
                 int64_t r0, int64_t r1, int64_t kv_head, int64_t group, int64_t heads, float scale, int64_t window,
                 Scratch& s) {
  const int64_t d = c.head_dim, lanes = (r1 - r0) * group;
  int64_t first = positions[r0], last = positions[r0];
  s.lo.resize(lanes); s.hi.resize(lanes);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t pos = positions[r];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    for (int64_t g = 0; g < group; ++g) {
      s.lo[(r - r0) * group + g] = lo;
      s.hi[(r - r0) * group + g] = pos;
    }
    first = std::min(first, lo);
    last = std::max(last, pos);
  }
  const int64_t keys = last - first + 1;
  s.q.resize(lanes * d); s.kt.resize(d * KEY_CHUNK); s.v_int.resize(KEY_CHUNK * d); s.dots.resize(KEY_CHUNK);
  s.scores.resize(lanes * keys); s.p.resize(KEY_CHUNK); s.w.resize(KEY_CHUNK); s.v_exp.resize(keys);
  s.m.assign(lanes, -INFINITY); s.top.assign(lanes, -1024); s.den.assign(lanes, 0.0);
  s.num.assign(lanes * d, 0); s.num_part.assign(lanes * d, 0.0);

  for (int64_t lane = 0; lane < lanes; ++lane) {  // 1. q on its grid
    const T* qv = q + ((r0 + lane / group) * heads + kv_head * group + lane % group) * d;
    const int qe = exponent(max_abs(qv, d));
    const double up = pow2(QK_BITS - 1 - qe), down = pow2(qe - QK_BITS + 1);
    for (int64_t i = 0; i < d; ++i) s.q[lane * d + i] = round_even(static_cast<double>(to_f32(qv[i])) * up) * down;
  }
  const double scale64 = scale;
  for (int64_t c0 = first; c0 <= last; c0 += KEY_CHUNK) {  // exact scores, chunk by chunk
    const int64_t n = std::min(KEY_CHUNK, last + 1 - c0);
    for (int64_t j = 0; j < n; ++j) {  // K transposed to [d][key], float64
      const int64_t at = c.offset(table, c0 + j, kv_head);
      for (int64_t i = 0; i < d; ++i) s.kt[i * KEY_CHUNK + j] = to_f32(c.k[at + i]);
      s.v_exp[c0 - first + j] = exponent(max_abs(c.v + at, d));
    }
    for (int64_t lane = 0; lane < lanes; ++lane) {
      if (s.hi[lane] < c0 || s.lo[lane] >= c0 + n) {  // sees no key of this chunk
        std::fill_n(s.scores.data() + lane * keys + (c0 - first), n, -INFINITY);
        continue;
      }
      const double* dot = s.dots.data();
      chunk_dots<D>(s.q.data() + lane * d, s.kt.data(), s.dots.data(), d);
      float* sc = s.scores.data() + lane * keys + (c0 - first);
      const int* ve = s.v_exp.data() + (c0 - first);
      const int64_t j0 = std::max<int64_t>(s.lo[lane] - c0, 0), j1 = std::min<int64_t>(s.hi[lane] - c0 + 1, n);
      float m = s.m[lane];  // the lane sees keys [j0, j1) of this chunk: a contiguous run
      int top = s.top[lane];
      for (int64_t j = 0; j < j0; ++j) sc[j] = -INFINITY;
      for (int64_t j = j0; j < j1; ++j) {
        sc[j] = static_cast<float>(dot[j] * scale64);
        m = std::max(m, sc[j]);
        top = std::max(top, ve[j]);
      }
      for (int64_t j = j1; j < n; ++j) sc[j] = -INFINITY;
      s.m[lane] = m;
      s.top[lane] = top;
    }
  }

  for (int64_t c0 = first; c0 <= last; c0 += KEY_CHUNK) {  // 2.-3. integer weights on one grid
    const int64_t n = std::min(KEY_CHUNK, last + 1 - c0);
    if (c0 > first && (c0 - first) % SPLIT_SIZE == 0) {  // a float64 partial holds SPLIT_SIZE keys exactly
      for (int64_t i = 0; i < lanes * d; ++i) s.num[i] += static_cast<int64_t>(s.num_part[i]);
      std::fill(s.num_part.begin(), s.num_part.end(), 0.0);
    }
    int ve[KEY_CHUNK] = {};  // the chunk's V exponents, zero past its end (their weights are 0)
    std::copy_n(s.v_exp.data() + (c0 - first), n, ve);
    for (int64_t j = 0; j < n; ++j) {  // V as integers (float64), [key][d]
      const int64_t at = c.offset(table, c0 + j, kv_head);
      const double up = pow2(V_BITS - 1 - s.v_exp[c0 - first + j]);
      for (int64_t i = 0; i < d; ++i) s.v_int[j * d + i] = static_cast<double>(to_f32(c.v[at + i])) * up;
    }
    for (int64_t lane = 0; lane < lanes; ++lane) {
      if (s.hi[lane] < c0 || s.lo[lane] >= c0 + n) continue;
      const float* sc = s.scores.data() + lane * keys + (c0 - first);
      float p[KEY_CHUNK];
      exp_neg_shifted(sc, s.m[lane], p, n);  // 0 where unseen (-inf)
      for (int64_t j = n; j < KEY_CHUNK; ++j) p[j] = 0.0f;
      const int shift = W_BITS - s.top[lane];
      double den[8] = {};  // integers, exact in any order
      for (int64_t j0 = 0; j0 < KEY_CHUNK; j0 += 8)
        for (int64_t l = 0; l < 8; ++l) {
          const double pj = p[j0 + l];
          den[l] += round_even(pj * pow2(L_BITS));
          s.w[j0 + l] = round_even(pj * pow2(ve[j0 + l] + shift));
        }
      for (double part : den) s.den[lane] += part;
      chunk_weighted_sum<D>(s.w.data(), s.v_int.data(), n, s.num_part.data() + lane * d, d);
    }
  }
  for (int64_t i = 0; i < lanes * d; ++i) s.num[i] += static_cast<int64_t>(s.num_part[i]);

  for (int64_t lane = 0; lane < lanes; ++lane) {  // 4. one division, one scaling, two roundings
    T* o = out + ((r0 + lane / group) * heads + kv_head * group + lane % group) * d;
    const double den = s.den[lane] == 0.0 ? 1.0 : s.den[lane];
    const double out_scale = pow2(s.top[lane] - V_BITS - W_BITS + 1 + L_BITS);
    for (int64_t i = 0; i < d; ++i) {
      const double ratio = static_cast<double>(s.num[lane * d + i]) / den;
      o[i] = from_f32<T>(static_cast<float>(ratio * out_scale));
    }
  }
}

template <typename T>
void attention_impl(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* positions,
                    const int64_t* tables, int64_t table_width, const int64_t* row_starts, int64_t num_seqs,
                    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, double scale,
                    int64_t window, int threads) {
  struct Item { int64_t seq, r0, r1, kv_head; };
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t r0 = row_starts[s]; r0 < row_starts[s + 1]; r0 += ROWS_PER_ITEM)
      for (int64_t h = 0; h < kv_heads; ++h)
        items.push_back({s, r0, std::min(row_starts[s + 1], r0 + ROWS_PER_ITEM), h});
  const Cache<T> cache{k_cache, v_cache, block_size, kv_heads, head_dim};
  const int64_t group = heads / kv_heads;
  const float scale32 = static_cast<float>(scale);  // the kernels take scale as float32
  const int64_t count = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(threads) if (threads > 1 && count > 1)
  {
    thread_local Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      const Item& it = items[i];
      const int64_t* table = tables + it.seq * table_width;
      switch (head_dim) {
        case 64: attend_item<T, 64>(q, out, cache, table, positions, it.r0, it.r1, it.kv_head, group, heads,
                                    scale32, window, scratch); break;
        case 128: attend_item<T, 128>(q, out, cache, table, positions, it.r0, it.r1, it.kv_head, group, heads,
                                      scale32, window, scratch); break;
        case 256: attend_item<T, 256>(q, out, cache, table, positions, it.r0, it.r1, it.kv_head, group, heads,
                                      scale32, window, scratch); break;
        default: attend_item<T, 0>(q, out, cache, table, positions, it.r0, it.r1, it.kv_head, group, heads,
                                   scale32, window, scratch);
      }
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
