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
constexpr int64_t SPLIT_ROWS = 4;      // items of at most this many rows (decode, verify) ...
constexpr int64_t SPLIT_KEYS = 512;    // ... split their keys into runs of this many (a multiple of KEY_CHUNK)

// What one work item (rows [r0, r1) of one sequence, one KV head) accumulates: (r1 - r0) * group
// lanes (lane = row * group + head within the group), the scores of the keys it sees, and per
// split of its keys the partial maxima and sums. Every partial is exact (integers, or a max), so
// however the keys are split and whichever thread takes a split, the result has the same bits.
struct ItemState {
  int64_t r0 = 0, r1 = 0, kv_head = 0, first = 0, last = 0, keys = 0, lanes = 0, splits = 1;
  const int64_t* table = nullptr;
  std::vector<int64_t> lo, hi;  // per lane: the keys it sees, [lo, hi]
  std::vector<double> q;        // per lane: q on its grid
  std::vector<float> scores;    // [lane][key - first]
  std::vector<int> v_exp;       // [key - first]
  std::vector<float> m;         // [split][lane]: the largest score seen
  std::vector<int> top;         // [split][lane]: the largest V exponent seen
  std::vector<double> den;      // [split][lane]
  std::vector<int64_t> num;     // [split][lane][d]
};

// Per-thread buffers for one chunk of keys.
struct Scratch {
  std::vector<double> kt, v_int, dots, w, num_part;
  ItemState whole;  // the state of an item this thread runs alone
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

// Which keys the item's lanes see, q on its grid (step 1), its buffers sized.
template <typename T>
void prepare(ItemState& s, const T* q, int64_t d, const int64_t* positions, int64_t group, int64_t heads,
             int64_t window, bool split) {
  const int64_t lanes = (s.r1 - s.r0) * group;
  s.lanes = lanes;
  s.first = positions[s.r0];
  s.last = positions[s.r0];
  s.lo.resize(lanes);
  s.hi.resize(lanes);
  for (int64_t r = s.r0; r < s.r1; ++r) {
    const int64_t pos = positions[r];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    for (int64_t g = 0; g < group; ++g) {
      s.lo[(r - s.r0) * group + g] = lo;
      s.hi[(r - s.r0) * group + g] = pos;
    }
    s.first = std::min(s.first, lo);
    s.last = std::max(s.last, pos);
  }
  s.keys = s.last - s.first + 1;
  s.splits = split ? (s.keys + SPLIT_KEYS - 1) / SPLIT_KEYS : 1;
  s.q.resize(lanes * d);
  s.scores.resize(lanes * s.keys);
  s.v_exp.resize(s.keys);
  s.m.assign(s.splits * lanes, -INFINITY);
  s.top.assign(s.splits * lanes, -1024);
  s.den.assign(s.splits * lanes, 0.0);
  s.num.assign(s.splits * lanes * d, 0);
  for (int64_t lane = 0; lane < lanes; ++lane) {
    const T* qv = q + ((s.r0 + lane / group) * heads + s.kv_head * group + lane % group) * d;
    const int qe = exponent(max_abs(qv, d));
    const double up = pow2(QK_BITS - 1 - qe), down = pow2(qe - QK_BITS + 1);
    for (int64_t i = 0; i < d; ++i) s.q[lane * d + i] = round_even(static_cast<double>(to_f32(qv[i])) * up) * down;
  }
}

// Keys [k0, k1) of split `split`: exact scores (step 1) and the split's maxima.
template <typename T, int D>
void scores_of(ItemState& s, const Cache<T>& c, int64_t k0, int64_t k1, int64_t split, double scale64,
               Scratch& t) {
  const int64_t d = c.head_dim;
  t.kt.resize(d * KEY_CHUNK);
  t.dots.resize(KEY_CHUNK);
  for (int64_t c0 = k0; c0 < k1; c0 += KEY_CHUNK) {
    const int64_t n = std::min(KEY_CHUNK, k1 - c0);
    for (int64_t j = 0; j < n; ++j) {  // K transposed to [d][key], float64
      const int64_t at = c.offset(s.table, c0 + j, s.kv_head);
      for (int64_t i = 0; i < d; ++i) t.kt[i * KEY_CHUNK + j] = to_f32(c.k[at + i]);
      s.v_exp[c0 - s.first + j] = exponent(max_abs(c.v + at, d));
    }
    for (int64_t lane = 0; lane < s.lanes; ++lane) {
      float* sc = s.scores.data() + lane * s.keys + (c0 - s.first);
      const int64_t j0 = std::max<int64_t>(s.lo[lane] - c0, 0), j1 = std::min<int64_t>(s.hi[lane] - c0 + 1, n);
      if (j0 >= j1) {  // sees no key of this chunk
        std::fill_n(sc, n, -INFINITY);
        continue;
      }
      chunk_dots<D>(s.q.data() + lane * d, t.kt.data(), t.dots.data(), d);
      const int* ve = s.v_exp.data() + (c0 - s.first);
      float m = s.m[split * s.lanes + lane];  // the lane sees keys [j0, j1) of this chunk: a contiguous run
      int top = s.top[split * s.lanes + lane];
      for (int64_t j = 0; j < j0; ++j) sc[j] = -INFINITY;
      for (int64_t j = j0; j < j1; ++j) {
        sc[j] = static_cast<float>(t.dots[j] * scale64);
        m = std::max(m, sc[j]);
        top = std::max(top, ve[j]);
      }
      for (int64_t j = j1; j < n; ++j) sc[j] = -INFINITY;
      s.m[split * s.lanes + lane] = m;
      s.top[split * s.lanes + lane] = top;
    }
  }
}

// Keys [k0, k1) of split `split`: integer weights on one grid and their exact sums (steps 2-3),
// against the item's maxima over all splits.
template <typename T, int D>
void sums_of(ItemState& s, const Cache<T>& c, int64_t k0, int64_t k1, int64_t split, Scratch& t) {
  const int64_t d = c.head_dim;
  t.v_int.resize(KEY_CHUNK * d);
  t.w.resize(KEY_CHUNK);
  t.num_part.assign(s.lanes * d, 0.0);
  int64_t* num = s.num.data() + split * s.lanes * d;
  for (int64_t c0 = k0; c0 < k1; c0 += KEY_CHUNK) {
    const int64_t n = std::min(KEY_CHUNK, k1 - c0);
    if (c0 > k0 && (c0 - k0) % SPLIT_SIZE == 0) {  // a float64 partial holds SPLIT_SIZE keys exactly
      for (int64_t i = 0; i < s.lanes * d; ++i) num[i] += static_cast<int64_t>(t.num_part[i]);
      std::fill(t.num_part.begin(), t.num_part.end(), 0.0);
    }
    int ve[KEY_CHUNK] = {};  // the chunk's V exponents, zero past its end (their weights are 0)
    std::copy_n(s.v_exp.data() + (c0 - s.first), n, ve);
    for (int64_t j = 0; j < n; ++j) {  // V as integers (float64), [key][d]
      const int64_t at = c.offset(s.table, c0 + j, s.kv_head);
      const double up = pow2(V_BITS - 1 - ve[j]);
      for (int64_t i = 0; i < d; ++i) t.v_int[j * d + i] = static_cast<double>(to_f32(c.v[at + i])) * up;
    }
    for (int64_t lane = 0; lane < s.lanes; ++lane) {
      if (s.hi[lane] < c0 || s.lo[lane] >= c0 + n) continue;
      float m = -INFINITY;
      int top = -1024;
      for (int64_t sp = 0; sp < s.splits; ++sp) {
        m = std::max(m, s.m[sp * s.lanes + lane]);
        top = std::max(top, s.top[sp * s.lanes + lane]);
      }
      const float* sc = s.scores.data() + lane * s.keys + (c0 - s.first);
      float p[KEY_CHUNK];
      exp_neg_shifted(sc, m, p, n);  // 0 where unseen (-inf)
      for (int64_t j = n; j < KEY_CHUNK; ++j) p[j] = 0.0f;
      const int shift = W_BITS - top;
      double den[8] = {};  // integers, exact in any order
      for (int64_t j0 = 0; j0 < KEY_CHUNK; j0 += 8)
        for (int64_t l = 0; l < 8; ++l) {
          const double pj = p[j0 + l];
          den[l] += round_even(pj * pow2(L_BITS));
          t.w[j0 + l] = round_even(pj * pow2(ve[j0 + l] + shift));
        }
      for (double part : den) s.den[split * s.lanes + lane] += part;
      chunk_weighted_sum<D>(t.w.data(), t.v_int.data(), n, t.num_part.data() + lane * d, d);
    }
  }
  for (int64_t i = 0; i < s.lanes * d; ++i) num[i] += static_cast<int64_t>(t.num_part[i]);
}

// Step 4: the splits' exact sums added, one division, one scaling, two roundings.
template <typename T>
void finish(const ItemState& s, T* out, int64_t d, int64_t group, int64_t heads) {
  for (int64_t lane = 0; lane < s.lanes; ++lane) {
    T* o = out + ((s.r0 + lane / group) * heads + s.kv_head * group + lane % group) * d;
    double den = 0.0;
    int top = -1024;
    for (int64_t sp = 0; sp < s.splits; ++sp) {
      den += s.den[sp * s.lanes + lane];
      top = std::max(top, s.top[sp * s.lanes + lane]);
    }
    if (den == 0.0) den = 1.0;
    const double out_scale = pow2(top - V_BITS - W_BITS + 1 + L_BITS);
    for (int64_t i = 0; i < d; ++i) {
      int64_t num = 0;
      for (int64_t sp = 0; sp < s.splits; ++sp) num += s.num[(sp * s.lanes + lane) * d + i];
      const double ratio = static_cast<double>(num) / den;
      o[i] = from_f32<T>(static_cast<float>(ratio * out_scale));
    }
  }
}

// The split [k0, k1) of an item's keys.
inline void split_range(const ItemState& s, int64_t split, int64_t* k0, int64_t* k1) {
  *k0 = s.first + split * SPLIT_KEYS;
  *k1 = s.splits == 1 ? s.last + 1 : std::min(s.last + 1, *k0 + SPLIT_KEYS);
}

template <typename T, int D>
void attention_d(const T* q, const Cache<T>& cache, T* out, const int64_t* positions, const int64_t* tables,
                 int64_t table_width, const int64_t* row_starts, int64_t num_seqs, int64_t heads, int64_t window,
                 float scale, int threads) {
  const int64_t d = cache.head_dim, group = heads / cache.kv_heads;
  std::vector<ItemState> split_items, whole_items;  // items with a few rows over many keys are split
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t r0 = row_starts[s]; r0 < row_starts[s + 1]; r0 += ROWS_PER_ITEM)
      for (int64_t h = 0; h < cache.kv_heads; ++h) {
        ItemState it;
        it.r0 = r0;
        it.r1 = std::min(row_starts[s + 1], r0 + ROWS_PER_ITEM);
        it.kv_head = h;
        it.table = tables + s * table_width;
        const bool long_run = positions[it.r1 - 1] + 1 > 2 * SPLIT_KEYS;
        (it.r1 - it.r0 <= SPLIT_ROWS && long_run ? split_items : whole_items).push_back(std::move(it));
      }
  const double scale64 = scale;
  const int64_t num_split = static_cast<int64_t>(split_items.size()), num_whole = static_cast<int64_t>(whole_items.size());
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (split item, split)
#pragma omp parallel num_threads(threads) if (threads > 1 && num_split + num_whole > 1)
  {
    thread_local Scratch t;
    if (num_split > 0) {  // every thread takes the same branch, so each sees the same worksharing
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < num_split; ++i) prepare(split_items[i], q, d, positions, group, heads, window, true);
#pragma omp single
      for (int64_t i = 0; i < num_split; ++i)
        for (int64_t sp = 0; sp < split_items[i].splits; ++sp) tasks.emplace_back(i, sp);
      const int64_t num_tasks = static_cast<int64_t>(tasks.size());
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < num_tasks; ++i) {  // pass 1: scores and each run's maxima
        ItemState& s = split_items[tasks[i].first];
        int64_t k0, k1;
        split_range(s, tasks[i].second, &k0, &k1);
        scores_of<T, D>(s, cache, k0, k1, tasks[i].second, scale64, t);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < num_tasks; ++i) {  // pass 2: each run's exact sums
        ItemState& s = split_items[tasks[i].first];
        int64_t k0, k1;
        split_range(s, tasks[i].second, &k0, &k1);
        sums_of<T, D>(s, cache, k0, k1, tasks[i].second, t);
      }
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t i = 0; i < num_split; ++i) finish(split_items[i], out, d, group, heads);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_whole; ++i) {  // one item, start to end, on this thread's buffers
      ItemState& s = t.whole;
      s.r0 = whole_items[i].r0;
      s.r1 = whole_items[i].r1;
      s.kv_head = whole_items[i].kv_head;
      s.table = whole_items[i].table;
      prepare(s, q, d, positions, group, heads, window, false);
      scores_of<T, D>(s, cache, s.first, s.last + 1, 0, scale64, t);
      sums_of<T, D>(s, cache, s.first, s.last + 1, 0, t);
      finish(s, out, d, group, heads);
    }
  }
}

template <typename T>
void attention_impl(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* positions,
                    const int64_t* tables, int64_t table_width, const int64_t* row_starts, int64_t num_seqs,
                    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, double scale,
                    int64_t window, int threads) {
  const Cache<T> cache{k_cache, v_cache, block_size, kv_heads, head_dim};
  const float scale32 = static_cast<float>(scale);  // the kernels take scale as float32
  switch (head_dim) {
    case 64: return attention_d<T, 64>(q, cache, out, positions, tables, table_width, row_starts, num_seqs, heads,
                                       window, scale32, threads);
    case 128: return attention_d<T, 128>(q, cache, out, positions, tables, table_width, row_starts, num_seqs, heads,
                                         window, scale32, threads);
    case 256: return attention_d<T, 256>(q, cache, out, positions, tables, table_width, row_starts, num_seqs, heads,
                                         window, scale32, threads);
    default: return attention_d<T, 0>(q, cache, out, positions, tables, table_width, row_starts, num_seqs, heads,
                                      window, scale32, threads);
  }
}

template <typename T>
void write_kv_impl(T* k_cache, T* v_cache, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                   const int64_t* slots, int64_t tokens, int64_t kv_heads, int64_t head_dim, int threads) {
  const bool parallel = threads > 1 && tokens * kv_heads >= 64;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t dst = (slots[t] * kv_heads + h) * head_dim;
      on_grid(k + t * k_stride + h * head_dim, k_cache + dst, head_dim, QK_BITS);
      on_grid(v + t * v_stride + h * head_dim, v_cache + dst, head_dim, V_BITS);
    }
}

}  // namespace

void write_kv(int dtype, void* k_cache, void* v_cache, const void* k, int64_t k_stride, const void* v,
              int64_t v_stride, const int64_t* slots, int64_t tokens, int64_t kv_heads, int64_t head_dim, int threads) {
  if (dtype == 0)
    write_kv_impl(static_cast<float*>(k_cache), static_cast<float*>(v_cache), static_cast<const float*>(k), k_stride,
                  static_cast<const float*>(v), v_stride, slots, tokens, kv_heads, head_dim, threads);
  else
    write_kv_impl(static_cast<bf16*>(k_cache), static_cast<bf16*>(v_cache), static_cast<const bf16*>(k), k_stride,
                  static_cast<const bf16*>(v), v_stride, slots, tokens, kv_heads, head_dim, threads);
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
