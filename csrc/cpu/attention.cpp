// Exact paged attention and the cache write, kernels/paged_attention.py's steps per query lane.
//
// The cache holds every K vector on its 22-bit fixed-point grid and every V vector on a 20-bit
// one (write_kv). A lane (one query row, one head) then computes:
//   1. q on its grid; each score q.k an exact float64 dot product, rounded to float32, times scale;
//   2. m = the largest score it sees; p = exp_neg(score - m) in float32;
//   3. w_j = round(p_j 2^(e_j - E + W_BITS)) with e_j the exponent of v_j and E the largest e_j seen:
//      sum_j w_j v_j is a sum of integers on one grid, exact in float64 per SPLIT_SIZE keys and in
//      int64 across them; the denominator sum_j round(p_j 2^L_BITS) is exact too;
//   4. out = float(num 2^(E - V_BITS - W_BITS + 1)) / (float(den) 2^-L_BITS), a float32 division,
//      then q's dtype (no float64 after the sums: the mlx backend computes the same bits).
// The cache's dtype C may differ from the activations' T (a bfloat16 cache under float32
// activations): write_kv rounds k, v to C (nearest even, as torch's .to) before the grid, and
// attention widens the cache's values exactly, so the arithmetic is the same for every pair.
// Every sum is exact, so the order keys are visited in, the lanes a thread takes and the rows
// that share the call cannot change a bit.
#include <algorithm>
#include <cmath>
#include <omp.h>
#include <type_traits>
#include <utility>
#include <vector>

#include "dot64.h"
#include "exact.h"
#include "kernels.h"
#include "lanes.h"
#include "prefetch.h"
#include "vec16.h"

namespace tf {
namespace {

using namespace attention_grid;  // QK_BITS, V_BITS, W_BITS, L_BITS, SPLIT_SIZE (kernels.h)

// exponent(max_abs(row)) of four rows of d elements at once: the per-row maxima folded together
// (the same integer maxima in another order, so the same exponents as max_abs gives); AVX-512 and
// AVX2 spell the same steps.
inline void exponents4(const float* const* rows, int64_t d, int* out) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i m[4];
    for (int j = 0; j < 4; ++j) {
      m[j] = _mm512_setzero_si512();
      for (int64_t i = 0; i < d; i += 16) m[j] = _mm512_max_epu32(m[j], _mm512_and_si512(_mm512_loadu_si512(rows[j] + i), mask));
    }
    const __m512i a = _mm512_max_epu32(_mm512_unpacklo_epi32(m[0], m[1]), _mm512_unpackhi_epi32(m[0], m[1]));
    const __m512i b = _mm512_max_epu32(_mm512_unpacklo_epi32(m[2], m[3]), _mm512_unpackhi_epi32(m[2], m[3]));
    const __m512i c = _mm512_max_epu32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));  // rows 0 1 2 3 0 1 2 3 ...
    const __m256i c2 = _mm256_max_epu32(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1));
    alignas(16) uint32_t top[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(top),
                    _mm_max_epu32(_mm256_castsi256_si128(c2), _mm256_extracti128_si256(c2, 1)));
    for (int j = 0; j < 4; ++j) out[j] = exponent(f32_from_bits(top[j]));
    return;
  }
#elif defined(TF_AVX2)
  if (d % 8 == 0) {
    const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i m[4];
    for (int j = 0; j < 4; ++j) {
      m[j] = _mm256_setzero_si256();
      for (int64_t i = 0; i < d; i += 8)
        m[j] = _mm256_max_epu32(m[j], _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + i)), mask));
    }
    const __m256i a = _mm256_max_epu32(_mm256_unpacklo_epi32(m[0], m[1]), _mm256_unpackhi_epi32(m[0], m[1]));
    const __m256i b = _mm256_max_epu32(_mm256_unpacklo_epi32(m[2], m[3]), _mm256_unpackhi_epi32(m[2], m[3]));
    const __m256i c = _mm256_max_epu32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));  // rows 0 1 2 3 0 1 2 3
    alignas(16) uint32_t top[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(top), _mm_max_epu32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
    for (int j = 0; j < 4; ++j) out[j] = exponent(f32_from_bits(top[j]));
    return;
  }
#endif
  for (int j = 0; j < 4; ++j) out[j] = exponent(max_abs(rows[j], d));
}
inline void exponents4(const bf16* const* rows, int64_t d, int* out) {
#if defined(__AVX512BW__)
  if (d % 32 == 0) {
    const __m512i mask = _mm512_set1_epi16(0x7FFF);
    __m512i m[4];
    for (int j = 0; j < 4; ++j) {
      m[j] = _mm512_setzero_si512();
      for (int64_t i = 0; i < d; i += 32) m[j] = _mm512_max_epu16(m[j], _mm512_and_si512(_mm512_loadu_si512(rows[j] + i), mask));
    }
    const __m512i a = _mm512_max_epu16(_mm512_unpacklo_epi16(m[0], m[1]), _mm512_unpackhi_epi16(m[0], m[1]));
    const __m512i b = _mm512_max_epu16(_mm512_unpacklo_epi16(m[2], m[3]), _mm512_unpackhi_epi16(m[2], m[3]));
    const __m512i c = _mm512_max_epu16(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));  // rows 0 1 2 3 0 1 2 3 ...
    const __m256i c2 = _mm256_max_epu16(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1));
    const __m128i c3 = _mm_max_epu16(_mm256_castsi256_si128(c2), _mm256_extracti128_si256(c2, 1));
    alignas(16) uint16_t top[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(top), _mm_max_epu16(c3, _mm_unpackhi_epi64(c3, c3)));
    for (int j = 0; j < 4; ++j) out[j] = exponent(f32_from_bits(static_cast<uint32_t>(top[j]) << 16));
    return;
  }
#elif defined(TF_AVX2)
  if (d % 16 == 0) {
    const __m256i mask = _mm256_set1_epi16(0x7FFF);
    __m256i m[4];
    for (int j = 0; j < 4; ++j) {
      m[j] = _mm256_setzero_si256();
      for (int64_t i = 0; i < d; i += 16)
        m[j] = _mm256_max_epu16(m[j], _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + i)), mask));
    }
    const __m256i a = _mm256_max_epu16(_mm256_unpacklo_epi16(m[0], m[1]), _mm256_unpackhi_epi16(m[0], m[1]));
    const __m256i b = _mm256_max_epu16(_mm256_unpacklo_epi16(m[2], m[3]), _mm256_unpackhi_epi16(m[2], m[3]));
    const __m256i c = _mm256_max_epu16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));  // rows 0 1 2 3 0 1 2 3 ...
    const __m128i c2 = _mm_max_epu16(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    alignas(16) uint16_t top[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(top), _mm_max_epu16(c2, _mm_unpackhi_epi64(c2, c2)));
    for (int j = 0; j < 4; ++j) out[j] = exponent(f32_from_bits(static_cast<uint32_t>(top[j]) << 16));
    return;
  }
#endif
  for (int j = 0; j < 4; ++j) out[j] = exponent(max_abs(rows[j], d));
}

// exact.on_grid of one vector: rounded to 2^(e - bits + 1), e = exponent(max|x|); a second pass
// when the rounding lifted the largest element to the next power of two.
template <typename T>
void on_grid(const T* x, T* out, int64_t n, int bits) {
  double y[MAX_HEAD_DIM];  // n <= MAX_HEAD_DIM (kernels.h; checked by the bindings)
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

constexpr int64_t ROWS_PER_ITEM = 16;  // prefill rows of one sequence that share each K/V load
constexpr int64_t KEY_CHUNK = 32;      // keys converted to float64 at a time (divides SPLIT_SIZE; a multiple of 8)
static_assert(KEY_CHUNK == 32, "scores_of's dots4x32 takes a chunk of 32 keys by column");
constexpr int64_t SPLIT_ROWS = 4;      // items of at most this many rows (decode, verify) take every KV head
constexpr int64_t SPLIT_KEYS = 256;    // and split their keys into runs of at most this many (a multiple of KEY_CHUNK)

// One work item: rows [r0, r1) of one sequence with KV heads [h0, h1). Its lanes are
// (row, KV head, query head of the group), in that order; it keeps the scores of the keys they
// see and, per split of its keys, the partial maxima and sums. Every partial is exact (integers,
// or a max), so however the keys are split and whichever thread takes a split, the result has the
// same bits. Prefill items take one KV head (their rows share its K/V); decode and verify items
// take all of them, so a split reads each key's K/V of all heads as one contiguous run.
struct ItemState {
  int64_t r0 = 0, r1 = 0, h0 = 0, h1 = 0, first = 0, last = 0, keys = 0, lanes = 0, splits = 1, split_keys = 0;
  const int64_t* table = nullptr;
  std::vector<int64_t> lo, hi;  // per lane: the keys it sees, [lo, hi]
  std::vector<double> q;        // per lane: q on its grid
  std::vector<float> scores;    // [lane][key - first]
  std::vector<int> v_exp;       // [KV head - h0][key - first]
  std::vector<float> m;         // [split][lane]: the largest score seen
  std::vector<int> top;         // [split][lane]: the largest V exponent seen
  std::vector<double> den;      // [split][lane]
  std::vector<int64_t> num;     // [split][lane][d]
  int64_t heads() const { return h1 - h0; }
};

// Per-thread buffers.
struct Scratch {
  std::vector<double> rows;      // [KV head][KEY_CHUNK][d]: a chunk's K or V rows as float64
  std::vector<double> columns;   // [d][KEY_CHUNK]: a chunk's K rows by column (scores_of's dots4x32)
  std::vector<double> scales;    // [KV head][2][KEY_CHUNK]: per key 2^e_j and 2^(V_BITS - 1 - e_j)
  std::vector<double> num_part;  // [lane][d]: the weighted sums of up to SPLIT_SIZE keys
  std::vector<float> m;          // [lane]: the largest score over all splits
  std::vector<double> lane_up;   // [lane]: 2^(W_BITS - E), E the largest V exponent over all splits
  std::vector<double> w;         // [lane][KEY_CHUNK]: a chunk's integer weights (the direct path)
  std::vector<int64_t> lanes;    // the item's lanes by KV head (the direct path); sums_of's lanes of a chunk
  std::vector<double> dots;      // [lane by KV head][KEY_CHUNK]: a chunk's dot products (the direct path)
  ItemState whole;               // the state of an item this thread runs alone
};

// A stored V row's exponent (step 3's e_j: that of its largest magnitude), which write_kv records
// beside the cache and the attention otherwise takes from the row itself.
template <typename C>
inline int v_row_exponent(const C* row, int64_t d) {
  return exponent(max_abs(row, d));
}

template <typename T>
struct Cache {
  const T* k;
  const T* v;
  const int16_t* v_exp;  // per slot and KV head, its V row's exponent as write_kv recorded it; or null
  int64_t block_size, kv_heads, head_dim;
  int block_shift = -1;  // log2(block_size) when it is a power of two
  Cache(const T* k_, const T* v_, const int16_t* v_exp_, int64_t block_size_, int64_t kv_heads_, int64_t head_dim_)
      : k(k_), v(v_), v_exp(v_exp_), block_size(block_size_), kv_heads(kv_heads_), head_dim(head_dim_) {
    for (int b = 0; b < 31; ++b)
      if ((int64_t{1} << b) == block_size) block_shift = b;
  }
  // Where key `key` of the sequence with block table `table` sits for KV head `head`.
  int64_t offset(const int64_t* table, int64_t key, int64_t head) const {
    const int64_t block = block_shift >= 0 ? key >> block_shift : key / block_size;
    return ((table[block] * block_size + key - block * block_size) * kv_heads + head) * head_dim;
  }
  // The exponent of the V row at `offset` (an offset() of this cache): as write_kv recorded it,
  // or, without the record, read from the row.
  int v_exponent(int64_t offset) const {
    return v_exp != nullptr ? v_exp[offset / head_dim] : v_row_exponent(v + offset, head_dim);
  }
};

// Which keys the item's lanes see, q on its grid (step 1), its buffers sized. A split item's keys
// go in runs of at most SPLIT_KEYS, at least `min_splits` of them where there are keys enough
// (so that a sequence alone still gives every thread a run); 0: one run, not split.
template <typename T>
void prepare(ItemState& s, const T* q, int64_t d, const int64_t* positions, int64_t group, int64_t heads,
             int64_t window, int64_t min_splits) {
  const int64_t per_row = s.heads() * group;
  const int64_t lanes = (s.r1 - s.r0) * per_row;
  s.lanes = lanes;
  s.first = positions[s.r0];
  s.last = positions[s.r0];
  s.lo.resize(lanes);
  s.hi.resize(lanes);
  for (int64_t r = s.r0; r < s.r1; ++r) {
    const int64_t pos = positions[r];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    std::fill_n(s.lo.begin() + (r - s.r0) * per_row, per_row, lo);
    std::fill_n(s.hi.begin() + (r - s.r0) * per_row, per_row, pos);
    s.first = std::min(s.first, lo);
    s.last = std::max(s.last, pos);
  }
  s.keys = s.last - s.first + 1;
  if (min_splits > 0) {
    const int64_t even = (s.keys + min_splits - 1) / min_splits;
    s.split_keys = std::min(SPLIT_KEYS, (even + KEY_CHUNK - 1) / KEY_CHUNK * KEY_CHUNK);
    s.splits = (s.keys + s.split_keys - 1) / s.split_keys;
  } else {
    s.split_keys = s.keys;
    s.splits = 1;
  }
  s.q.resize(lanes * d);
  s.scores.resize(lanes * s.keys);
  s.v_exp.resize(s.heads() * s.keys);
  s.m.assign(s.splits * lanes, -INFINITY);
  s.top.assign(s.splits * lanes, -1024);
  s.den.assign(s.splits * lanes, 0.0);
  s.num.assign(s.splits * lanes * d, 0);
  for (int64_t lane = 0; lane < lanes; ++lane) {  // query head h0 * group + lane % per_row of its row
    const T* qv = q + ((s.r0 + lane / per_row) * heads + s.h0 * group + lane % per_row) * d;
    const int qe = exponent(max_abs(qv, d));
    const double up = pow2(QK_BITS - 1 - qe), down = pow2(qe - QK_BITS + 1);
    for (int64_t i = 0; i < d; ++i) s.q[lane * d + i] = round_even(static_cast<double>(to_f32(qv[i])) * up) * down;
  }
}

// The rows of keys [c0, c0 + n) for the item's KV heads, from `base` (the K or V cache), as
// float64 [head][key][d]; each key's rows of all the heads are one contiguous run, and the next
// chunk's runs (up to k_end) are asked for while this one is converted, in `base` and, if given,
// in `also` (the other cache, when the caller reads both). `each(hh, j, row)` sees every row in
// its cache dtype.
template <typename T, typename Each>
void load_chunk(const ItemState& s, const Cache<T>& c, const T* base, const T* also, int64_t c0, int64_t n,
                int64_t k_end, double* out, Each each) {
  const int64_t d = c.head_dim, run = s.heads() * d * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < n; ++j) {
    if (c0 + KEY_CHUNK + j < k_end) {
      const int64_t ahead = c.offset(s.table, c0 + KEY_CHUNK + j, s.h0);
      prefetch_lines(base + ahead, run);
      if (also != nullptr) prefetch_lines(also + ahead, run);
    }
    const T* row = base + c.offset(s.table, c0 + j, s.h0);
    for (int64_t hh = 0; hh < s.heads(); ++hh) {
      row_to_f64(row + hh * d, out + (hh * KEY_CHUNK + j) * d, d);
      each(hh, j, row + hh * d);
    }
  }
}

// The keys of [c0, c0 + n) that `lane` sees, as [j0, j1) relative to c0: a contiguous run, maybe empty.
inline std::pair<int64_t, int64_t> seen_run(const ItemState& s, int64_t lane, int64_t c0, int64_t n) {
  return {std::max<int64_t>(s.lo[lane] - c0, 0), std::min<int64_t>(s.hi[lane] - c0 + 1, n)};
}

// A lane's scores of keys [c0, c0 + n): float(dots[j] scale) for the keys it sees ([j0, j1), the
// only dots read), -inf for the others; the split's largest score and V exponent (`ve`: the V
// exponents of the lane's KV head from key c0) take them in.
inline void record_scores(ItemState& s, int64_t lane, int64_t split, int64_t c0, int64_t n, int64_t j0, int64_t j1,
                          const double* dots, float scale32, const int* ve) {
  float* sc = s.scores.data() + lane * s.keys + (c0 - s.first);
  if (j0 >= j1) {
    std::fill_n(sc, n, -INFINITY);
    return;
  }
  std::fill(sc, sc + j0, -INFINITY);
  std::fill(sc + j1, sc + n, -INFINITY);
  float& m = s.m[split * s.lanes + lane];
  m = scale_scores(dots + j0, scale32, sc + j0, j1 - j0, m);
  int top = s.top[split * s.lanes + lane];
  for (int64_t j = j0; j < j1; ++j) top = std::max(top, ve[j]);
  s.top[split * s.lanes + lane] = top;
}

// Keys [k0, k1) of split `split`: exact scores (step 1) and the split's maxima. Reads K, and V for
// its exponents unless the cache has their record.
template <typename T>
void scores_of(ItemState& s, const Cache<T>& c, int64_t k0, int64_t k1, int64_t split, float scale32,
               Scratch& t) {
  const int64_t d = c.head_dim, per_row = s.lanes / (s.r1 - s.r0), group = per_row / s.heads();
  t.rows.resize(s.heads() * KEY_CHUNK * d);
  double* kf = t.rows.data();
  for (int64_t c0 = k0; c0 < k1; c0 += KEY_CHUNK) {
    const int64_t n = std::min(KEY_CHUNK, k1 - c0);
    int* ve = s.v_exp.data() + c0 - s.first;
    const T* v_read = c.v_exp != nullptr ? nullptr : c.v;  // V's rows, prefetched, only without the record
    load_chunk(s, c, c.k, v_read, c0, n, k1, kf, [&](int64_t hh, int64_t j, const T* k_row) {
      ve[hh * s.keys + j] = c.v_exponent(k_row - c.k);
    });
    for (int64_t hh = 0; hh < s.heads(); ++hh)  // a short chunk's last keys: their dots are not used
      std::fill(kf + (hh * KEY_CHUNK + n) * d, kf + (hh * KEY_CHUNK + KEY_CHUNK) * d, 0.0);
    int64_t lane = 0;
#if defined(__AVX512F__)
    if (s.heads() == 1 && s.lanes >= 8) {  // a prefill item: four lanes at a time over K by column
      t.columns.resize(d * KEY_CHUNK);
      for (int64_t j = 0; j < KEY_CHUNK; ++j)
        for (int64_t i = 0; i < d; ++i) t.columns[i * KEY_CHUNK + j] = kf[j * d + i];
      for (; lane + 4 <= s.lanes; lane += 4) {
        std::pair<int64_t, int64_t> runs[4];
        bool any = false;
        for (int l = 0; l < 4; ++l) {
          runs[l] = seen_run(s, lane + l, c0, n);
          any |= runs[l].first < runs[l].second;
        }
        alignas(64) double dots[4 * KEY_CHUNK];
        if (any) dots4x32(s.q.data() + lane * d, t.columns.data(), dots, d);
        for (int l = 0; l < 4; ++l)
          record_scores(s, lane + l, split, c0, n, runs[l].first, runs[l].second, dots + l * KEY_CHUNK, scale32,
                        s.v_exp.data() + (c0 - s.first));
      }
    }
#endif
    for (; lane < s.lanes; ++lane) {
      const int64_t hh = lane % per_row / group;
      const auto [j0, j1] = seen_run(s, lane, c0, n);
      double dots[KEY_CHUNK];
      for (int64_t g = j0 / 8 * 8; g < j1; g += 8)
        dots8(s.q.data() + lane * d, kf + (hh * KEY_CHUNK + g) * d, dots + g, d);
      record_scores(s, lane, split, c0, n, j0, j1, dots, scale32, s.v_exp.data() + hh * s.keys + (c0 - s.first));
    }
  }
}

// Per lane, the largest score and V exponent over all the item's splits: t.m, t.lane_up = 2^(W_BITS - E).
inline void lane_totals(const ItemState& s, Scratch& t) {
  t.m.resize(s.lanes);
  t.lane_up.resize(s.lanes);
  for (int64_t lane = 0; lane < s.lanes; ++lane) {
    float m = -INFINITY;
    int top = -1024;
    for (int64_t sp = 0; sp < s.splits; ++sp) {
      m = std::max(m, s.m[sp * s.lanes + lane]);
      top = std::max(top, s.top[sp * s.lanes + lane]);
    }
    t.m[lane] = m;
    t.lane_up[lane] = pow2(W_BITS - top);
  }
}

// The float64 partial sums into the split's int64 ones (a float64 partial holds SPLIT_SIZE keys exactly).
inline void flush_partial(Scratch& t, int64_t* num) {
  const int64_t size = static_cast<int64_t>(t.num_part.size());
  for (int64_t i = 0; i < size; ++i) num[i] += static_cast<int64_t>(t.num_part[i]);
  std::fill(t.num_part.begin(), t.num_part.end(), 0.0);
}

// Per key of a chunk, from its V exponent e_j: up[j] = 2^e_j, down[j] = 2^(V_BITS - 1 - e_j), for
// j < n; 1 for j in [n, n8), where p = 0 makes w = 0.
inline void key_scales(const int* ve, int64_t n, int64_t n8, double* up, double* down) {
  for (int64_t j = 0; j < n8; ++j) {
    up[j] = j < n ? pow2(ve[j]) : 1.0;
    down[j] = j < n ? pow2(V_BITS - 1 - ve[j]) : 1.0;
  }
}

// A lane's integer weights of keys [c0, c0 + n) into w (n8 of them): p = exp_neg(score - m), 0
// where unseen, w_j = round(p_j 2^(e_j - E + W_BITS)) 2^(V_BITS - 1 - e_j) in exact steps (no over-
// or underflow on the way); the denominator's terms round(p_j 2^L_BITS) go to the split's.
inline void lane_weights(ItemState& s, const Scratch& t, int64_t lane, int64_t split, int64_t c0, int64_t n,
                         int64_t n8, const double* key_up, const double* key_down, double* w) {
  float p[KEY_CHUNK] = {};
  exp_neg_shifted(s.scores.data() + lane * s.keys + (c0 - s.first), t.m[lane], p, n);
  s.den[split * s.lanes + lane] += attention_weights(p, key_up, key_down, t.lane_up[lane], pow2(L_BITS), w, n8);
}

// Keys [k0, k1) of split `split`: integer weights on one grid and their exact sums (steps 2-3),
// against the item's maxima over all splits. w_j v_int_j is formed as (w_j 2^(V_BITS - 1 - e_j))
// v_j: the same integer (both factors are exact), without scaling the V row.
template <typename T>
void sums_of(ItemState& s, const Cache<T>& c, int64_t k0, int64_t k1, int64_t split, Scratch& t) {
  const int64_t d = c.head_dim, per_row = s.lanes / (s.r1 - s.r0), group = per_row / s.heads();
  t.rows.resize(s.heads() * KEY_CHUNK * d);
  t.scales.resize(s.heads() * 2 * KEY_CHUNK);
  t.num_part.assign(s.lanes * d, 0.0);
  lane_totals(s, t);
  double* vf = t.rows.data();
  int64_t* num = s.num.data() + split * s.lanes * d;
  for (int64_t c0 = k0; c0 < k1; c0 += KEY_CHUNK) {
    const int64_t n = std::min(KEY_CHUNK, k1 - c0), n8 = (n + 7) / 8 * 8;
    if (c0 > k0 && (c0 - k0) % SPLIT_SIZE == 0) flush_partial(t, num);
    load_chunk(s, c, c.v, static_cast<const T*>(nullptr), c0, n, k1, vf, [](int64_t, int64_t, const T*) {});
    for (int64_t hh = 0; hh < s.heads(); ++hh)
      key_scales(s.v_exp.data() + hh * s.keys + (c0 - s.first), n, n8, t.scales.data() + (hh * 2) * KEY_CHUNK,
                 t.scales.data() + (hh * 2 + 1) * KEY_CHUNK);
    t.lanes.clear();  // the lanes that see keys of this chunk
    for (int64_t lane = 0; lane < s.lanes; ++lane)
      if (s.hi[lane] >= c0 && s.lo[lane] < c0 + n) t.lanes.push_back(lane);
    const auto head = [&](int64_t lane) { return lane % per_row / group; };
    for (size_t i = 0; i < t.lanes.size();) {
      const int64_t lane = t.lanes[i], hh = head(lane);
      const double* key_up = t.scales.data() + (hh * 2) * KEY_CHUNK;
      const double* rows = vf + hh * KEY_CHUNK * d;
      double w[2][KEY_CHUNK];
      lane_weights(s, t, lane, split, c0, n, n8, key_up, key_up + KEY_CHUNK, w[0]);
#if defined(__AVX512F__)
      if (d % 64 == 0 && i + 1 < t.lanes.size() && head(t.lanes[i + 1]) == hh) {  // two lanes share each V load
        const int64_t next = t.lanes[i + 1];
        lane_weights(s, t, next, split, c0, n, n8, key_up, key_up + KEY_CHUNK, w[1]);
        weighted_sum2(w[0], w[1], rows, n, t.num_part.data() + lane * d, t.num_part.data() + next * d, d);
        i += 2;
        continue;
      }
#endif
      weighted_sum(w[0], rows, n, t.num_part.data() + lane * d, d);
      i += 1;
    }
  }
  flush_partial(t, num);
}

// ---- the direct path: items of a few rows (decode, verify), cache rows read as stored ----------
//
// A decode or verify item has only rows x group lanes per KV head, too few to amortize a float64
// copy of every K and V row (the path above); here the kernels read the cache rows themselves and
// widen sixteen elements at a time in registers (dots_x4, weighted_rows), for up to four lanes at
// once. The arithmetic is the path above's, operation for operation: the same bits.

constexpr int MAX_PASS_LANES = 4;  // lanes that share each widened row (dots_x4, weighted_rows)

// Calls f(std::integral_constant<int, L>, first) for the passes of at most MAX_PASS_LANES lanes
// over `count` lanes.
template <typename F>
void by_passes(int64_t count, F f) {
  for (int64_t first = 0; first < count; first += MAX_PASS_LANES) {
    switch (std::min<int64_t>(MAX_PASS_LANES, count - first)) {
      case 1: f(std::integral_constant<int, 1>{}, first); break;
      case 2: f(std::integral_constant<int, 2>{}, first); break;
      case 3: f(std::integral_constant<int, 3>{}, first); break;
      default: f(std::integral_constant<int, 4>{}, first); break;
    }
  }
}

// The item's lanes by the KV head they read (h0, h0 + 1, ...), each head's as (row, query head of
// the group), in order: rows x group lanes per head.
inline void head_lanes(const ItemState& s, int64_t group, std::vector<int64_t>& out) {
  const int64_t per_row = s.heads() * group;
  out.clear();
  for (int64_t hh = 0; hh < s.heads(); ++hh)
    for (int64_t r = 0; r < s.r1 - s.r0; ++r)
      for (int64_t g = 0; g < group; ++g) out.push_back(r * per_row + hh * group + g);
}

// Where keys [c0, c0 + n) of the item's first KV head sit (-1 past k_end).
template <typename T>
void chunk_offsets(const ItemState& s, const Cache<T>& c, int64_t c0, int64_t n, int64_t k_end, int64_t* offsets) {
  for (int64_t j = 0; j < n; ++j) offsets[j] = c0 + j < k_end ? c.offset(s.table, c0 + j, s.h0) : -1;
}

// The rows of KV head `head` of keys [j, j + n) in `ahead` (the next chunk's offsets) of `base`,
// asked for ahead of their use (a hint: no effect on any result), into the outer caches: a
// chunk's rows asked into L1 at once (prefetcht0, 64 lines a head) filled the core's miss buffers
// and stalled it until they came (docs/benchmarks.md, "The Zen 4 EPYC again").
template <typename T>
inline void prefetch_keys(const int64_t* ahead, int64_t j, int64_t n, int64_t head, int64_t d, const T* base) {
  for (int64_t i = j; i < j + n; ++i) {
    if (ahead[i] < 0) return;
    prefetch_lines<TO_FAR>(base + ahead[i] + head * d, d * static_cast<int64_t>(sizeof(T)));
  }
}

template <typename T>
const T* zero_row() {  // stands in for the keys past a chunk's last in a group of four
  static const T zeros[MAX_HEAD_DIM] = {};
  return zeros;
}

// scores_of's results (scores, the split's maxima, v_exp) for an item of a few rows, four keys at
// a time: their V exponents and, head by head, their dots with the head's lanes (q in the
// widening order for T, widening_order), then each lane's scores of the chunk.
template <typename T>
void scores_direct(ItemState& s, const Cache<T>& c, int64_t k0, int64_t k1, int64_t split, float scale32,
                   Scratch& t) {
  const int64_t d = c.head_dim, group = s.lanes / (s.r1 - s.r0) / s.heads(), per_head = s.lanes / s.heads();
  const int64_t run = s.heads() * d * static_cast<int64_t>(sizeof(T));
  int64_t offsets[KEY_CHUNK], ahead[KEY_CHUNK];
  t.dots.resize(s.lanes * KEY_CHUNK);  // [KV head][its lane][key]
  head_lanes(s, group, t.lanes);
  chunk_offsets(s, c, k0, KEY_CHUNK, k1, ahead);
  for (int64_t c0 = k0; c0 < k1; c0 += KEY_CHUNK) {
    const int64_t n = std::min(KEY_CHUNK, k1 - c0);
    std::copy_n(ahead, KEY_CHUNK, offsets);
    chunk_offsets(s, c, c0 + KEY_CHUNK, KEY_CHUNK, k1, ahead);
    const int64_t n4 = (n + 3) / 4 * 4;
    int* ve = s.v_exp.data() + (c0 - s.first);  // [head][key]
    if (c.v_exp != nullptr) {  // the exponents as recorded: V is not read in this pass
      for (int64_t j = 0; j < n; ++j)
        for (int64_t hh = 0; hh < s.heads(); ++hh) ve[hh * s.keys + j] = c.v_exponent(offsets[j] + hh * d);
    } else {  // from V, four rows at a time
      for (int64_t g = 0; g < n4; g += 4) {
        for (int64_t j = g; j < g + 4 && ahead[j] >= 0; ++j)  // the next chunk's V rows, a few at a time
          prefetch_lines<TO_FAR>(c.v + ahead[j], run);          // (needed after the next few hundred cycles)
        for (int64_t hh = 0; hh < s.heads(); ++hh) {
          const T* v_rows[4];
          for (int64_t j = 0; j < 4; ++j) v_rows[j] = g + j < n ? c.v + offsets[g + j] + hh * d : zero_row<T>();
          int e[4];
          exponents4(v_rows, d, e);
          for (int64_t j = 0; j < 4 && g + j < n; ++j) ve[hh * s.keys + g + j] = e[j];
        }
      }
    }
    for (int64_t hh = 0; hh < s.heads(); ++hh) {
      const T* k_rows[KEY_CHUNK];
      for (int64_t j = 0; j < n4; ++j) k_rows[j] = j < n ? c.k + offsets[j] + hh * d : zero_row<T>();
      const int64_t* lanes = t.lanes.data() + hh * per_head;
      double* dots = t.dots.data() + hh * per_head * KEY_CHUNK;
      by_passes(per_head, [&](auto lanes_in_pass, int64_t first) {
        constexpr int L = decltype(lanes_in_pass)::value;
        const double* q[L];
        for (int l = 0; l < L; ++l) q[l] = s.q.data() + lanes[first + l] * d;
        for (int64_t g = 0; g < n4; g += 4) {
          if (first == 0)  // the next chunk's K rows of this head, a few with each step of the dots
            for (int64_t j = g; j < g + 4 && ahead[j] >= 0; ++j)
              prefetch_lines<TO_FAR>(c.k + ahead[j] + hh * d, d * static_cast<int64_t>(sizeof(T)));
          dots_x4<L>(q, k_rows + g, d, dots + first * KEY_CHUNK + g, KEY_CHUNK);
        }
      });
    }
    for (int64_t i = 0; i < s.lanes; ++i) {  // i: the lane's place in t.lanes (by KV head)
      const int64_t lane = t.lanes[i], hh = i / per_head;
      const auto [j0, j1] = seen_run(s, lane, c0, n);
      record_scores(s, lane, split, c0, n, j0, j1, t.dots.data() + i * KEY_CHUNK, scale32,
                    s.v_exp.data() + hh * s.keys + (c0 - s.first));
    }
  }
}

// sums_of's results (the split's exact sums) for an item of a few rows.
template <typename T>
void sums_direct(ItemState& s, const Cache<T>& c, int64_t k0, int64_t k1, int64_t split, Scratch& t) {
  const int64_t d = c.head_dim, group = s.lanes / (s.r1 - s.r0) / s.heads(), per_head = s.lanes / s.heads();
  lane_totals(s, t);
  head_lanes(s, group, t.lanes);
  t.num_part.assign(s.lanes * d, 0.0);
  t.w.resize(s.lanes * KEY_CHUNK);
  int64_t* num = s.num.data() + split * s.lanes * d;
  int64_t offsets[KEY_CHUNK], ahead[KEY_CHUNK];
  const T* rows[KEY_CHUNK];
  double key_up[KEY_CHUNK], key_down[KEY_CHUNK];
  chunk_offsets(s, c, k0, KEY_CHUNK, k1, ahead);
  for (int64_t c0 = k0; c0 < k1; c0 += KEY_CHUNK) {
    const int64_t n = std::min(KEY_CHUNK, k1 - c0), n8 = (n + 7) / 8 * 8;
    if (c0 > k0 && (c0 - k0) % SPLIT_SIZE == 0) flush_partial(t, num);
    std::copy_n(ahead, KEY_CHUNK, offsets);
    chunk_offsets(s, c, c0 + KEY_CHUNK, KEY_CHUNK, k1, ahead);
    for (int64_t hh = 0; hh < s.heads(); ++hh) {
      prefetch_keys(ahead, 0, KEY_CHUNK, hh, d, c.v);
      key_scales(s.v_exp.data() + hh * s.keys + (c0 - s.first), n, n8, key_up, key_down);
      for (int64_t j = 0; j < n; ++j) rows[j] = c.v + offsets[j] + hh * d;
      const int64_t* lanes = t.lanes.data() + hh * per_head;
      for (int64_t i = 0; i < per_head; ++i)
        lane_weights(s, t, lanes[i], split, c0, n, n8, key_up, key_down, t.w.data() + lanes[i] * KEY_CHUNK);
      by_passes(per_head, [&](auto lanes_in_pass, int64_t first) {
        constexpr int L = decltype(lanes_in_pass)::value;
        const double* w[L];
        double* acc[L];
        for (int l = 0; l < L; ++l) {
          w[l] = t.w.data() + lanes[first + l] * KEY_CHUNK;
          acc[l] = t.num_part.data() + lanes[first + l] * d;
        }
        weighted_rows<L>(w, rows, n, acc, d);
      });
    }
  }
  flush_partial(t, num);
}

// Step 4: the splits' exact sums added; num to float64 (exact scaling) then float32, den to float32
// (exact scaling), one float32 division.
template <typename T>
void finish(const ItemState& s, T* out, int64_t d, int64_t group, int64_t heads) {
  const int64_t per_row = s.heads() * group;
  for (int64_t lane = 0; lane < s.lanes; ++lane) {
    T* o = out + ((s.r0 + lane / per_row) * heads + s.h0 * group + lane % per_row) * d;
    double den = 0.0;
    int top = -1024;
    for (int64_t sp = 0; sp < s.splits; ++sp) {
      den += s.den[sp * s.lanes + lane];
      top = std::max(top, s.top[sp * s.lanes + lane]);
    }
    if (den == 0.0) den = 1.0;
    const float total = static_cast<float>(den) * pow2f(-L_BITS);  // the sum of p: exact scaling
    const double num_scale = pow2(top - V_BITS - W_BITS + 1);
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    const __m512d scale_v = _mm512_set1_pd(num_scale);
    const __m256 total_v = _mm256_set1_ps(total);
    for (; i + 8 <= d; i += 8) {  // the same roundings eight at a time: to float64, *, to float32, /
      __m512i num = _mm512_setzero_si512();
      for (int64_t sp = 0; sp < s.splits; ++sp)
        num = _mm512_add_epi64(num, _mm512_loadu_si512(s.num.data() + (sp * s.lanes + lane) * d + i));
      alignas(32) float y[8];
      _mm256_store_ps(y, _mm256_div_ps(_mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtepi64_pd(num), scale_v)), total_v));
      for (int j = 0; j < 8; ++j) o[i + j] = from_f32<T>(y[j]);
    }
#endif
    for (; i < d; ++i) {
      int64_t num = 0;
      for (int64_t sp = 0; sp < s.splits; ++sp) num += s.num[(sp * s.lanes + lane) * d + i];
      o[i] = from_f32<T>(static_cast<float>(static_cast<double>(num) * num_scale) / total);
    }
  }
}

// The split [k0, k1) of an item's keys.
inline void split_range(const ItemState& s, int64_t split, int64_t* k0, int64_t* k1) {
  *k0 = s.first + split * s.split_keys;
  *k1 = std::min(s.last + 1, *k0 + s.split_keys);
}

// What a pool of split item states keeps between calls: at most KEEP_ITEMS states, none holding
// more than KEEP_ELEMENTS scores or partial sums (a very long context's buffers go back to the
// allocator after its call).
constexpr size_t KEEP_ITEMS = 64;
constexpr size_t KEEP_ELEMENTS = size_t{1} << 20;
inline void release_large(std::vector<ItemState>& pool) {
  if (pool.size() > KEEP_ITEMS) pool.resize(KEEP_ITEMS);
  for (ItemState& it : pool)
    if (it.scores.capacity() > KEEP_ELEMENTS || it.num.capacity() > KEEP_ELEMENTS) it = ItemState{};
}

template <typename T, typename C>
void attention_items(const T* q, const Cache<C>& cache, T* out, const int64_t* positions, const int64_t* tables,
                     int64_t table_width, const int64_t* row_starts, int64_t num_seqs, int64_t heads, int64_t window,
                     float scale, int threads) {
  const int64_t d = cache.head_dim, group = heads / cache.kv_heads;
  // The split items' states outlive the call, so their buffers (scores and partials of every key)
  // are allocated once, not per layer and step (up to a bound, release_large); whole items are
  // bare ranges (t.whole does their work).
  thread_local std::vector<ItemState> split_pool;
  int64_t num_split = 0;
  std::vector<ItemState> whole_items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = row_starts[s + 1] - row_starts[s];
    if (rows == 0) continue;
    if (rows <= SPLIT_ROWS && positions[row_starts[s + 1] - 1] + 1 > SPLIT_KEYS) {  // a few rows, many keys
      if (num_split == static_cast<int64_t>(split_pool.size())) split_pool.emplace_back();
      ItemState& it = split_pool[num_split++];
      it.r0 = row_starts[s];
      it.r1 = row_starts[s + 1];
      it.h0 = 0;
      it.h1 = cache.kv_heads;
      it.table = tables + s * table_width;
      continue;
    }
    for (int64_t r0 = row_starts[s]; r0 < row_starts[s + 1]; r0 += ROWS_PER_ITEM)
      for (int64_t h = 0; h < cache.kv_heads; ++h) {
        ItemState it;
        it.r0 = r0;
        it.r1 = std::min(row_starts[s + 1], r0 + ROWS_PER_ITEM);
        it.h0 = h;
        it.h1 = h + 1;
        it.table = tables + s * table_width;
        whole_items.push_back(std::move(it));
      }
  }
  const float scale32 = scale;
  ItemState* split_items = split_pool.data();
  const int64_t num_whole = static_cast<int64_t>(whole_items.size());
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (split item, split)
  std::vector<int> runner;                         // the thread that ran each task's pass 1
  // A split item alone is worth the threads (its splits are the tasks); whole items need two.
#pragma omp parallel num_threads(threads) if (threads > 1 && (num_split > 0 || num_whole > 1))
  {
    thread_local Scratch t;
    if (num_split > 0) {  // every thread takes the same branch, so each sees the same worksharing
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < num_split; ++i) {
        ItemState& s = split_items[i];
        prepare(s, q, d, positions, group, heads, window, (threads + num_split - 1) / num_split);
        double widened[MAX_HEAD_DIM];
        for (int64_t lane = 0; lane < s.lanes; ++lane) {  // the order dots_x4 reads q in for rows of C
          widening_order<C>(s.q.data() + lane * d, widened, d);
          std::copy_n(widened, d, s.q.data() + lane * d);
        }
      }
#pragma omp single
      {
        for (int64_t i = 0; i < num_split; ++i)
          for (int64_t sp = 0; sp < split_items[i].splits; ++sp) tasks.emplace_back(i, sp);
        runner.assign(tasks.size(), 0);
      }
      const int64_t num_tasks = static_cast<int64_t>(tasks.size());
      const int me = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < num_tasks; ++i) {  // pass 1: scores and each run's maxima
        ItemState& s = split_items[tasks[i].first];
        int64_t k0, k1;
        split_range(s, tasks[i].second, &k0, &k1);
        scores_direct<C>(s, cache, k0, k1, tasks[i].second, scale32, t);
        runner[i] = me;
      }
      // Pass 2: each run's exact sums, on the thread that read its K and V in pass 1, last run
      // first: its V is still in that core's cache.
      for (int64_t i = num_tasks - 1; i >= 0; --i) {
        if (runner[i] != me) continue;
        ItemState& s = split_items[tasks[i].first];
        int64_t k0, k1;
        split_range(s, tasks[i].second, &k0, &k1);
        sums_direct<C>(s, cache, k0, k1, tasks[i].second, t);
      }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t i = 0; i < num_split; ++i) finish(split_items[i], out, d, group, heads);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_whole; ++i) {  // one item, start to end, on this thread's buffers
      ItemState& s = t.whole;
      s.r0 = whole_items[i].r0;
      s.r1 = whole_items[i].r1;
      s.h0 = whole_items[i].h0;
      s.h1 = whole_items[i].h1;
      s.table = whole_items[i].table;
      prepare(s, q, d, positions, group, heads, window, 0);
      scores_of<C>(s, cache, s.first, s.last + 1, 0, scale32, t);
      sums_of<C>(s, cache, s.first, s.last + 1, 0, t);
      finish(s, out, d, group, heads);
    }
  }
  release_large(split_pool);
}

template <typename T, typename C>
void attention_impl(const T* q, const C* k_cache, const C* v_cache, const int16_t* v_exp, T* out,
                    const int64_t* positions, const int64_t* tables, int64_t table_width, const int64_t* row_starts,
                    int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                    double scale, int64_t window, int threads) {
  const Cache<C> cache{k_cache, v_cache, v_exp, block_size, kv_heads, head_dim};
  const float scale32 = static_cast<float>(scale);  // the kernels take scale as float32
  attention_items(q, cache, out, positions, tables, table_width, row_starts, num_seqs, heads, window, scale32, threads);
}

// One vector of the activations' dtype T onto its grid in the cache's dtype C: first rounded to C
// (write_kv_ref's .to(cache dtype); nothing to do when T is C, exact when C is wider), then the
// grid of those values.
template <typename T, typename C>
void store_on_grid(const T* x, C* out, int64_t n, int bits) {
  if constexpr (std::is_same_v<T, C>) {
    on_grid(x, out, n, bits);
  } else {
    C narrowed[MAX_HEAD_DIM];
    for (int64_t i = 0; i < n; ++i) narrowed[i] = from_f32<C>(to_f32(x[i]));
    on_grid(narrowed, out, n, bits);
  }
}

template <typename T, typename C>
void write_kv_impl(C* k_cache, C* v_cache, int16_t* v_exp, const T* k, int64_t k_stride, const T* v,
                   int64_t v_stride, const int64_t* slots, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                   int threads) {
  const bool parallel = threads > 1 && tokens * kv_heads >= 64;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t dst = (slots[t] * kv_heads + h) * head_dim;
      store_on_grid(k + t * k_stride + h * head_dim, k_cache + dst, head_dim, QK_BITS);
      store_on_grid(v + t * v_stride + h * head_dim, v_cache + dst, head_dim, V_BITS);
      if (v_exp != nullptr)  // the stored row's exponent, as the attention would take it from the row
        v_exp[slots[t] * kv_heads + h] = static_cast<int16_t>(v_row_exponent(v_cache + dst, head_dim));
    }
}

// Calls f with a null pointer of the element type of each dtype code (0: float32, 1: bfloat16),
// activations first, then the cache.
template <typename F>
void dispatch(int dtype, int cache_dtype, F f) {
  if (dtype == 0) {
    if (cache_dtype == 0) f(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
    else f(static_cast<float*>(nullptr), static_cast<bf16*>(nullptr));
  } else {
    if (cache_dtype == 0) f(static_cast<bf16*>(nullptr), static_cast<float*>(nullptr));
    else f(static_cast<bf16*>(nullptr), static_cast<bf16*>(nullptr));
  }
}

}  // namespace

void write_kv(int dtype, int cache_dtype, void* k_cache, void* v_cache, int16_t* v_exp, const void* k,
              int64_t k_stride, const void* v, int64_t v_stride, const int64_t* slots, int64_t tokens,
              int64_t kv_heads, int64_t head_dim, int threads) {
  dispatch(dtype, cache_dtype, [&](auto* t, auto* c) {
    using T = std::remove_pointer_t<decltype(t)>;
    using C = std::remove_pointer_t<decltype(c)>;
    write_kv_impl(static_cast<C*>(k_cache), static_cast<C*>(v_cache), v_exp, static_cast<const T*>(k), k_stride,
                  static_cast<const T*>(v), v_stride, slots, tokens, kv_heads, head_dim, threads);
  });
}

void paged_attention(int dtype, int cache_dtype, const void* q, const void* k_cache, const void* v_cache,
                     const int16_t* v_exp, void* out, const int64_t* positions, const int64_t* tables,
                     int64_t table_width, const int64_t* row_starts, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, int64_t block_size, double scale, int64_t window, int threads) {
  dispatch(dtype, cache_dtype, [&](auto* t, auto* c) {
    using T = std::remove_pointer_t<decltype(t)>;
    using C = std::remove_pointer_t<decltype(c)>;
    attention_impl(static_cast<const T*>(q), static_cast<const C*>(k_cache), static_cast<const C*>(v_cache), v_exp,
                   static_cast<T*>(out), positions, tables, table_width, row_starts, num_seqs, heads, kv_heads,
                   head_dim, block_size, scale, window, threads);
  });
}

}  // namespace tf
