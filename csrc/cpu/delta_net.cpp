// Gated DeltaNet's mixing (kernels/delta_net.py: delta_net, gated_rms_norm), one call per layer.
//
// The reference's steps, each one IEEE operation in its order (-ffp-contract=off, no fast-math):
//   phase A, per row (rows over the threads): the causal conv tap by tap (acc = x_0 w_0, then
//     acc + x_j w_j), SiLU (silu32), the l2 norms of q and k (reference._normalized: an exact
//     integer sum of squares on the row's grid, float32 sqrt and division), q / f32(sqrt(key_dim)),
//     q and k on their 22-bit grids; the gates: softplus in float64 with exp64 / log64,
//     g = -rate * softplus, decay = exp_neg(g), beta = sigmoid32(b);
//   phase B, per (sequence, value head, 16 columns of the state) (items over the threads), row
//     after row (delta_net.delta_step):
//       S = S * decay; kv = grid_dot(S, k); delta = (v - kv) * beta; S = S + k delta^T;
//       out = grid_dot(S, q).
// grid_dot is exact: each column of S and the vector as integers on their own 22-bit grids, the
// products and their sums exact in float64, one rounding to float32 at the end, so the order the
// sum runs in is free, and so is the arithmetic that carries it: AVX2 and AVX-512 builds sum in
// int64 (dots_int) wherever the grids' scales are normal float32 numbers, every other case in
// float64 (dots_f64), the same integers either way. A column of S never reads another column, so
// the columns split into work items; each item runs its rows in order with nothing shared, and no
// thread count, batch or chunking of a prefill changes a bit.
//
// The state: the slots the batch names (ForwardBatch.state_slots; the kernel knows nothing of block
// sizes or tables): sequence s starts from block state_in[s] (zeros at -1), and the state after row
// r (the conv window and S) is written to block state_out[r] unless that is -1. Each work item
// keeps its columns of S in a buffer of its own and copies them into state_out's blocks. Every
// starting state is read before any is written: the conv windows are copied first, and an ssm
// block that one sequence starts from and another writes is copied before the recurrence (a
// sequence's own items read their start before they write). A block written by two sequences is
// refused (module.cpp); one sequence's rows writing one block twice leave the last, as the reference.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

// exact64.h first: its functions' `using namespace c64` names (EXP_MIN, LN2_HI) are bound where they
// are defined, before exact.h declares tf:: names of the same spelling.
#include "exact64.h"
#include "exact.h"
#include "kernels.h"
#include "recurrent.h"
#include "vec16.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace tf {
namespace {

constexpr int STATE_BITS = 22;            // delta_net.STATE_BITS
constexpr int NORM_BITS = 20;             // reference.NORM_BITS
constexpr double L2_EPS = 1e-6;           // delta_net.NORM_EPS
constexpr int64_t PARALLEL_ELEMENTS = 1 << 15;
using recurrent::conv_tap;
using recurrent::silu_inplace;
using recurrent::softplus32;

template <typename V> inline V load(const void* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
template <typename V> inline void store(void* p, const V& v) { std::memcpy(p, &v, sizeof v); }

// Lanes of state columns. Native: GCC / Clang vector extensions of one register of float64 lanes
// (AVX-512: eight, elsewhere four: one AVX2 register, two SSE2 or NEON ones) beside as many float32
// lanes; Scalar: one column (an odd value_dim's last ones). Each lane takes its column's own steps,
// each one IEEE operation, so every width gives the same bits.
struct Scalar {
  static constexpr int L = 1;
  using F = float;
  using D = double;
  static D widen(F x) { return x; }
};
#if defined(__GNUC__)
struct Native {
#if defined(__AVX512F__)
  static constexpr int L = 8;
#else
  static constexpr int L = 4;
#endif
  typedef float F __attribute__((vector_size(4 * L)));
  typedef double D __attribute__((vector_size(8 * L)));
#if defined(__AVX512F__)  // one instruction (GCC lowers the generic conversion in halves)
  static D widen(F x) { return reinterpret_cast<D>(_mm512_cvtps_pd(reinterpret_cast<__m256>(x))); }
#elif defined(__AVX__)
  static D widen(F x) { return reinterpret_cast<D>(_mm256_cvtps_pd(reinterpret_cast<__m128>(x))); }
#else
  static D widen(F x) { return __builtin_convertvector(x, D); }
#endif
};
#else
using Native = Scalar;
#endif

// G float32 lanes of state columns, as one compiler vector (whatever registers it takes), for the
// elementwise steps; the magnitudes' bits as integers: their max is the max of the magnitudes
// (lanes.h: max_abs): a NaN ranks above inf, and its exponent reads 128, as torch's amax then gives.
template <int G>
struct Columns {
#if defined(__GNUC__)
  typedef float F __attribute__((vector_size(4 * G)));
  typedef uint32_t U __attribute__((vector_size(4 * G)));
#endif
};
template <>
struct Columns<1> {
  using F = float;
  using U = uint32_t;
};
template <typename F, typename U> inline U magnitude_bits(F x) { return load<U>(&x) & 0x7FFFFFFFu; }
template <typename U> inline U max_bits(U a, U b) { return a > b ? a : b; }

// max |x| of a row as a float (lanes.h: max_abs's integer max of the bits, eight lanes at a time).
inline float max_magnitude(const float* x, int64_t n) {
  uint32_t top = 0;
  int64_t i = 0;
#if defined(__GNUC__)
  using F = Columns<8>::F;
  using U = Columns<8>::U;
  if (n >= 8) {
    U m = U{} + 0u;
    for (; i + 8 <= n; i += 8) m = max_bits(m, magnitude_bits<F, U>(load<F>(x + i)));
    for (int l = 0; l < 8; ++l) top = std::max(top, static_cast<uint32_t>(m[l]));
  }
#endif
  for (; i < n; ++i) top = std::max(top, f32_bits(x[i]) & 0x7FFFFFFFu);
  return f32_from_bits(top);
}

// reference._normalized of one float32 row up to the weight: 1 / sqrt(float(ss) 2^(2 (e - 19)) /
// divisor + eps) in float32 (ss: the exact sum of the squares on the row's grid), for x * inv.
// The squares are integers and every partial sum is below 2^53: any order (here Native::L
// partial sums) gives the same ss.
inline float inverse_norm(const float* x, int64_t n, float divisor, float eps) {
  const int e = exponent(max_magnitude(x, n));
  const double grid = pow2(2 * (NORM_BITS - 1 - e));
  double ss = 0.0;
  int64_t i = 0;
  if constexpr (Native::L > 1) {
    using D = Native::D;
    D acc = D{} + 0.0;
    for (; i + Native::L <= n; i += Native::L) {
      const D d = Native::widen(load<Native::F>(x + i));
      const D sq = (d * d) * grid;
      acc = acc + ((sq + ROUND_MAGIC) - ROUND_MAGIC);
    }
    double lanes[Native::L];
    store(lanes, acc);
    for (int l = 0; l < Native::L; ++l) ss += lanes[l];
  }
  for (; i < n; ++i) {
    const double d = x[i];
    double sq = d * d;
    sq = sq * grid;
    ss += round_even(sq);
  }
  float var = scale32(static_cast<float>(ss), 2 * (e - NORM_BITS + 1));
  var = var / divisor;
  return 1.0f / std::sqrt(var + eps);
}

// l2_norm in place (divisor 1), then, for q, the division by f32(sqrt(key_dim)).
inline void l2_norm_inplace(float* x, int64_t n, float divide_by) {
  const float inv = inverse_norm(x, n, 1.0f, static_cast<float>(L2_EPS));
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv;
  if (divide_by != 0.0f)
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] / divide_by;
}

// A vector on its grid (grid_dot's v_int): round_even(x 2^(21 - e)), e = exponent(max |x|).
inline int vector_on_grid(const float* x, int64_t n, double* x_int) {
  const int e = exponent(max_magnitude(x, n));
  const double scale = pow2(STATE_BITS - 1 - e);
  for (int64_t i = 0; i < n; ++i) x_int[i] = round_even(static_cast<double>(x[i]) * scale);
  return e;
}

// The grids of G columns whose largest magnitudes are top[j] (float bits): scale = 2^(21 - e_j)
// puts column j on it, step = 2^(e_j - 21) is its unit (grid_dot's e_s). Returns whether every
// scale is a normal float32 (e_j in [-106, 127]: no inf or NaN in the column, which gives 128),
// which the integer dots below need; scale_f holds them then.
template <int G>
inline bool column_grids(const uint32_t* top, double* scale, double* step, float* scale_f) {
  bool normal = true;
  for (int j = 0; j < G; ++j) {
    const int e = exponent(f32_from_bits(top[j]));
    scale[j] = pow2(STATE_BITS - 1 - e);
    step[j] = pow2(e - STATE_BITS + 1);
    normal = normal && e >= -106 && e <= 127;
    scale_f[j] = normal ? f32_from_bits(static_cast<uint32_t>(STATE_BITS - 1 - e + 127) << 23) : 0.0f;
  }
  return normal;
}

// x on its column grids as integers (float64): round_even(x scale), (x scale + M) - M.
template <typename Tr>
inline typename Tr::D on_grid(typename Tr::F x, typename Tr::D scale) {
  typename Tr::D s = Tr::widen(x) * scale;
  return (s + ROUND_MAGIC) - ROUND_MAGIC;
}

// Pass (a) of a row over G = NV Tr::L columns of S (rows dv apart), in float64: with q_int (the
// previous row's q on its grid; null: none) q_sum[j] = sum_i round_even(src[i][j] q_scale[j])
// q_int[i]; S = src * d; kv_sum[j] = the same over S with k. Integers below 2^53: exact.
template <typename Tr, int NV>
void dots_f64(const float* src, float* S, int64_t dk, int64_t dv, float d, const double* q_scale,
              const int32_t* q_int, const double* k_scale, const int32_t* k_int, double* q_sum, double* kv_sum) {
  using F = typename Tr::F;
  using D = typename Tr::D;
  constexpr int L = Tr::L;
  D qs[NV], ks[NV], qa[NV], ka[NV];
  for (int v = 0; v < NV; ++v) {
    qs[v] = load<D>(q_scale + v * L);
    ks[v] = load<D>(k_scale + v * L);
    qa[v] = ka[v] = D{} + 0.0;
  }
  if (q_int != nullptr) {
    for (int64_t i = 0; i < dk; ++i) {
      const double qi = q_int[i], ki = k_int[i];
      for (int v = 0; v < NV; ++v) {
        const F x = load<F>(src + i * dv + v * L);
        qa[v] = qa[v] + on_grid<Tr>(x, qs[v]) * qi;
        const F y = x * d;
        store(S + i * dv + v * L, y);
        ka[v] = ka[v] + on_grid<Tr>(y, ks[v]) * ki;
      }
    }
  } else {
    for (int64_t i = 0; i < dk; ++i) {
      const double ki = k_int[i];
      for (int v = 0; v < NV; ++v) {
        const F y = load<F>(src + i * dv + v * L) * d;
        store(S + i * dv + v * L, y);
        ka[v] = ka[v] + on_grid<Tr>(y, ks[v]) * ki;
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    store(q_sum + v * L, qa[v]);
    store(kv_sum + v * L, ka[v]);
  }
}

// The last row's output: q_sum[j] = sum_i round_even(S[i][j] q_scale[j]) q_int[i] (float64).
template <typename Tr, int NV>
void q_dot_f64(const float* S, int64_t dk, int64_t dv, const double* q_scale, const int32_t* q_int,
               double* q_sum) {
  using D = typename Tr::D;
  constexpr int L = Tr::L;
  D qs[NV], qa[NV];
  for (int v = 0; v < NV; ++v) {
    qs[v] = load<D>(q_scale + v * L);
    qa[v] = D{} + 0.0;
  }
  for (int64_t i = 0; i < dk; ++i) {
    const double qi = q_int[i];
    for (int v = 0; v < NV; ++v) qa[v] = qa[v] + on_grid<Tr>(load<typename Tr::F>(S + i * dv + v * L), qs[v]) * qi;
  }
  for (int v = 0; v < NV; ++v) store(q_sum + v * L, qa[v]);
}

#if defined(__AVX512F__) || defined(__AVX2__)
// The same sums in integers, one float register of columns at a time (AVX-512: 16, AVX2: 8), where
// every column's scale is a normal float32 (column_grids): x scale is then exact in float32 (a
// power of two; a product below 2^-126 is far below 1/2 and rounds to 0 either way, as in
// float64), |x scale| < 2^22, and the conversion to int32 rounds to nearest even (MXCSR's
// default) as round_even does. The products (< 2^44) and sums (< 2^52) are exact in int64;
// the even and odd columns sum apart (vpmuldq takes each 64-bit lane's low half).
#define TF_INT_DOTS 1
struct IntLanes {
#if defined(__AVX512F__)
  static constexpr int G = 16;
  using VF = __m512;
  using VI = __m512i;
  static VF loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, VF v) { _mm512_storeu_ps(p, v); }
  static VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  static VF set1(float x) { return _mm512_set1_ps(x); }
  static VI zero() { return _mm512_setzero_si512(); }
  static VI set1(int32_t x) { return _mm512_set1_epi32(x); }  // vpmuldq reads the low half of each 64 bits
  static VI to_int(VF x) { return _mm512_cvtps_epi32(x); }
  static void add_products(VI& even, VI& odd, VI x, VI v) {
    even = _mm512_add_epi64(even, _mm512_mul_epi32(x, v));
    odd = _mm512_add_epi64(odd, _mm512_mul_epi32(_mm512_srli_epi64(x, 32), v));
  }
  static void store64(int64_t* p, VI v) { _mm512_storeu_si512(p, v); }
#else
  static constexpr int G = 8;
  using VF = __m256;
  using VI = __m256i;
  static VF loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, VF v) { _mm256_storeu_ps(p, v); }
  static VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
  static VF set1(float x) { return _mm256_set1_ps(x); }
  static VI zero() { return _mm256_setzero_si256(); }
  static VI set1(int32_t x) { return _mm256_set1_epi32(x); }  // vpmuldq reads the low half of each 64 bits
  static VI to_int(VF x) { return _mm256_cvtps_epi32(x); }
  static void add_products(VI& even, VI& odd, VI x, VI v) {
    even = _mm256_add_epi64(even, _mm256_mul_epi32(x, v));
    odd = _mm256_add_epi64(odd, _mm256_mul_epi32(_mm256_srli_epi64(x, 32), v));
  }
  static void store64(int64_t* p, VI v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
#endif
  // the even and odd columns' sums back in column order, as float64 (exact: below 2^53)
  static void sums(VI even, VI odd, double* out) {
    int64_t e[G / 2], o[G / 2];
    store64(e, even);
    store64(o, odd);
    for (int l = 0; l < G / 2; ++l) {
      out[2 * l] = static_cast<double>(e[l]);
      out[2 * l + 1] = static_cast<double>(o[l]);
    }
  }
};

// dots_f64 over R IntLanes::G columns in integers (the same sums), S [dk, R IntLanes::G] in place.
template <int R>
inline void dots_int(float* S, int64_t dk, float d, const float* q_scale, const int32_t* q_int,
                     const float* k_scale, const int32_t* k_int, double* q_sum, double* kv_sum) {
  using I = IntLanes;
  constexpr int G = R * I::G;
  const I::VF dd = I::set1(d);
  I::VF qs[R], ks[R];
  I::VI qe[R], qo[R], ke[R], ko[R];
  for (int v = 0; v < R; ++v) {
    qs[v] = I::loadf(q_scale + v * I::G);
    ks[v] = I::loadf(k_scale + v * I::G);
    qe[v] = qo[v] = ke[v] = ko[v] = I::zero();
  }
  if (q_int != nullptr) {
    for (int64_t i = 0; i < dk; ++i) {
      const I::VI qi = I::set1(q_int[i]), ki = I::set1(k_int[i]);
      for (int v = 0; v < R; ++v) {
        const I::VF x = I::loadf(S + i * G + v * I::G);
        I::add_products(qe[v], qo[v], I::to_int(I::mul(x, qs[v])), qi);
        const I::VF y = I::mul(x, dd);
        I::storef(S + i * G + v * I::G, y);
        I::add_products(ke[v], ko[v], I::to_int(I::mul(y, ks[v])), ki);
      }
    }
    for (int v = 0; v < R; ++v) I::sums(qe[v], qo[v], q_sum + v * I::G);
  } else {
    for (int64_t i = 0; i < dk; ++i) {
      const I::VI ki = I::set1(k_int[i]);
      for (int v = 0; v < R; ++v) {
        const I::VF y = I::mul(I::loadf(S + i * G + v * I::G), dd);
        I::storef(S + i * G + v * I::G, y);
        I::add_products(ke[v], ko[v], I::to_int(I::mul(y, ks[v])), ki);
      }
    }
  }
  for (int v = 0; v < R; ++v) I::sums(ke[v], ko[v], kv_sum + v * I::G);
}

template <int R>
inline void q_dot_int(const float* S, int64_t dk, const float* q_scale, const int32_t* q_int, double* q_sum) {
  using I = IntLanes;
  constexpr int G = R * I::G;
  I::VF qs[R];
  I::VI qe[R], qo[R];
  for (int v = 0; v < R; ++v) {
    qs[v] = I::loadf(q_scale + v * I::G);
    qe[v] = qo[v] = I::zero();
  }
  for (int64_t i = 0; i < dk; ++i) {
    const I::VI qi = I::set1(q_int[i]);
    for (int v = 0; v < R; ++v)
      I::add_products(qe[v], qo[v], I::to_int(I::mul(I::loadf(S + i * G + v * I::G), qs[v])), qi);
  }
  for (int v = 0; v < R; ++v) I::sums(qe[v], qo[v], q_sum + v * I::G);
}
#endif

// Everything one call reads and writes (kernels.h: delta_net).
struct Call {
  const void* qkv;
  int64_t qkv_stride;
  const float* a;
  const float* b;
  float* conv;
  float* ssm;
  const int64_t* state_in;   // [num_seqs]: the block each sequence's starting state is read from (-1: zeros)
  const int64_t* state_out;  // [rows]: the block the state after each row is written to (-1: none)
  const int64_t* row_starts;
  int64_t num_seqs;
  const float* conv_taps;  // [K, C]: tap j of every channel, C apart
  const float* rate;
  const float* dt_bias;
  int64_t key_heads, heads, dk, dv, taps;  // taps: K
  void* out;
  int threads;

  int64_t channels() const { return 2 * key_heads * dk + heads * dv; }
};

// What phase A leaves for the recurrence, per row: `mixed` [rows, C], the conv's output with q and
// k normalized (q scaled); q and k on their grids, q_int and k_int [rows, key_heads, dk] (|x| <=
// 2^22), with their exponents e_q and e_k [rows, key_heads]; decay and beta [rows, heads]. start:
// sequence s's starting ssm state [heads, dk, dv] (null: zeros), in the cache or in a copy.
struct Rows {
  float *mixed, *decay, *beta;
  int32_t *q_int, *k_int, *e_q, *e_k;
  const float* const* start;
};

// Phase A's buffers, kept by the calling thread from call to call up to KEEP_ELEMENTS each (a
// 512-row prefill chunk of Qwen3.5-0.8B's layers needs 3.2M floats and 2.1M int32): fresh pages
// for every layer's call cost about a sixth of the whole call (the kernel clears each page on
// first touch).
constexpr size_t KEEP_ELEMENTS = size_t{1} << 23;
template <typename X>
struct Workspace {
  std::unique_ptr<X[]> kept;
  size_t capacity = 0;
  std::unique_ptr<X[]> once;  // a larger call's own

  X* get(size_t n) {
    if (n > KEEP_ELEMENTS) {
      once.reset(new X[n]);
      return once.get();
    }
    once.reset();
    if (n > capacity) {
      kept.reset(new X[n]);
      capacity = n;
    }
    return kept.get();
  }
};

constexpr int64_t MAX_KEY_DIM = 256;  // the grid dots' exact sums (module.cpp checks it)

// The columns [j0, j0 + NV Tr::L) of one (sequence, head)'s state through all the sequence's rows:
// grid_dot's sums run over the rows of S within each column, and every other step is elementwise,
// so a column's values never depend on another column's. Per row t (delta_net.delta_step):
//   S = S * decay; kv = grid_dot(S, k); delta = (v - kv) * beta; S = S + k delta^T; out = grid_dot(S, q).
// The running state is the item's own: S [dk, G] contiguous (G floats a row: dk G 4 bytes, at most
// 16 KB, stays in L1 for all the rows; the cache's columns are dv floats apart, which map a head's
// 128 rows onto a few of L1's sets), read from the starting state and written to state_out's
// blocks. Two passes over S per row: (a) out of row t - 1 (grid_dot with q over S, as row t - 1
// left it) together with S = S * decay and grid_dot with k; (b) the update, with each column's
// largest magnitude (and the copy into the row's state_out block). Multiplying by decay >= 0
// rounds monotonically, so the largest magnitude of S * decay is float32(the largest of S * decay):
// pass (a) knows the k grid before it starts. Pass (a) sums in integers where the grids allow it
// (dots_int), else in float64 (dots_f64).
template <typename Tr, int NV, typename T>
void run_columns(const Call& c, const Rows& rw, int64_t s, int64_t h, int64_t j0, float* S) {
  constexpr int G = NV * Tr::L;
  // the elementwise steps in vectors of one register (W columns; GCC spells a wider generic vector
  // in pieces through the stack), NW of them a state row
  constexpr int W = G < 2 * Native::L ? G : 2 * Native::L, NW = G / W;
  using F = typename Columns<W>::F;
  using U = typename Columns<W>::U;
#if defined(TF_INT_DOTS)
  constexpr bool int_dots = G % IntLanes::G == 0;
  constexpr int R = int_dots ? G / IntLanes::G : 1;
#else
  constexpr bool int_dots = false;
#endif
  const int64_t start = c.row_starts[s], n = c.row_starts[s + 1] - start;
  const int64_t dk = c.dk, dv = c.dv, C = c.channels(), H = c.heads, KH = c.key_heads;
  const int64_t kh = h / (H / KH);  // key head h / group serves value head h
  auto columns = [&](int64_t block) { return c.ssm + (block * H + h) * dk * dv + j0; };  // rows dv apart
  U top[NW];  // the largest magnitude in each column of S (float bits)
  for (int w = 0; w < NW; ++w) top[w] = U{} + 0u;
  if (rw.start[s] == nullptr) {
    std::memset(S, 0, dk * G * sizeof(float));
  } else {
    const float* src = rw.start[s] + h * dk * dv + j0;
    for (int64_t i = 0; i < dk; ++i)
      for (int w = 0; w < NW; ++w) {
        const F x = load<F>(src + i * dv + w * W);
        store(S + i * G + w * W, x);
        top[w] = max_bits(top[w], magnitude_bits<F, U>(x));
      }
  }
  T* out = static_cast<T*>(c.out);
  auto write_out = [&](int64_t r, const double* sum, const double* step, int e_vec) {
    const double vec_step = pow2(e_vec - STATE_BITS + 1);
    T* dst = out + (r * H + h) * dv + j0;
    for (int j = 0; j < G; ++j) dst[j] = from_f32<T>(static_cast<float>(sum[j] * (step[j] * vec_step)));
  };
  double q_scale[G] = {}, q_step[G] = {}, k_scale[G], k_step[G], q_sum[G], kv_sum[G];
  float q_scale_f[G] = {}, k_scale_f[G];
  uint32_t bits[G];
  bool q_normal = false;
  const int32_t* q_int = nullptr;  // the previous row's q on its grid, and that row
  int64_t q_row = -1;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t r = start + t;
    const float d = rw.decay[r * H + h], beta = rw.beta[r * H + h];
    const int32_t* k_int = rw.k_int + (r * KH + kh) * dk;
    const float* k = rw.mixed + r * C + (KH + kh) * dk;
    for (int w = 0; w < NW; ++w) store(bits + w * W, top[w]);
    for (int j = 0; j < G; ++j) bits[j] = f32_bits(f32_from_bits(bits[j]) * d) & 0x7FFFFFFFu;
    const bool k_normal = column_grids<G>(bits, k_scale, k_step, k_scale_f);
    if (int_dots && k_normal && (q_int == nullptr || q_normal)) {
#if defined(TF_INT_DOTS)
      dots_int<R>(S, dk, d, q_scale_f, q_int, k_scale_f, k_int, q_sum, kv_sum);
#endif
    } else {
      dots_f64<Tr, NV>(S, S, dk, G, d, q_scale, q_int, k_scale, k_int, q_sum, kv_sum);
    }
    if (q_int != nullptr) write_out(q_row, q_sum, q_step, rw.e_q[q_row * KH + kh]);
    const double k_vec_step = pow2(rw.e_k[r * KH + kh] - STATE_BITS + 1);
    const float* v_row = rw.mixed + r * C + 2 * KH * dk + h * dv + j0;
    float delta_f[G];
    for (int j = 0; j < G; ++j) {
      const float kv = static_cast<float>(kv_sum[j] * (k_step[j] * k_vec_step));
      delta_f[j] = (v_row[j] - kv) * beta;
    }
    F delta[NW];
    for (int w = 0; w < NW; ++w) {
      delta[w] = load<F>(delta_f + w * W);
      top[w] = U{} + 0u;
    }
    const int64_t slot = c.state_out[r];
    if (slot < 0) {
      for (int64_t i = 0; i < dk; ++i)  // (b) S = S + k delta^T: the product rounded, then the sum
        for (int w = 0; w < NW; ++w) {
          const F x = load<F>(S + i * G + w * W) + k[i] * delta[w];
          store(S + i * G + w * W, x);
          top[w] = max_bits(top[w], magnitude_bits<F, U>(x));
        }
    } else {
      float* dst = columns(slot);
      for (int64_t i = 0; i < dk; ++i)
        for (int w = 0; w < NW; ++w) {
          const F x = load<F>(S + i * G + w * W) + k[i] * delta[w];
          store(S + i * G + w * W, x);
          store(dst + i * dv + w * W, x);
          top[w] = max_bits(top[w], magnitude_bits<F, U>(x));
        }
    }
    for (int w = 0; w < NW; ++w) store(bits + w * W, top[w]);
    q_normal = column_grids<G>(bits, q_scale, q_step, q_scale_f);
    q_int = rw.q_int + (r * KH + kh) * dk;
    q_row = r;
  }
  if (int_dots && q_normal) {  // the last row's output
#if defined(TF_INT_DOTS)
    q_dot_int<R>(S, dk, q_scale_f, q_int, q_sum);
#endif
  } else {
    q_dot_f64<Tr, NV>(S, dk, G, q_scale, q_int, q_sum);
  }
  write_out(q_row, q_sum, q_step, rw.e_q[q_row * KH + kh]);
}

// The columns run_columns takes at most: 64 bytes of each state row, a cache line.
constexpr int64_t RUN_COLUMNS = 16;

// One work item: columns [j0, end) of (sequence s, head h), RUN_COLUMNS at a time (two native
// vectors at a time, then one, then column by column: an odd value_dim's last columns). S: dk
// RUN_COLUMNS floats.
template <typename T>
void run_item(const Call& c, const Rows& rw, int64_t s, int64_t h, int64_t j0, int64_t end, float* S) {
  int64_t j = j0;
  if constexpr (Native::L > 1) {
    constexpr int NV = RUN_COLUMNS / Native::L;  // a whole run at once: AVX2 four, AVX-512 two
    for (; j + NV * Native::L <= end; j += NV * Native::L) run_columns<Native, NV, T>(c, rw, s, h, j, S);
    for (; j + 2 * Native::L <= end; j += 2 * Native::L) run_columns<Native, 2, T>(c, rw, s, h, j, S);
    for (; j + Native::L <= end; j += Native::L) run_columns<Native, 1, T>(c, rw, s, h, j, S);
  }
  for (; j < end; ++j) run_columns<Scalar, 1, T>(c, rw, s, h, j, S);
}

template <typename T>
void delta_net_impl(const Call& c) {
  const int64_t rows = c.row_starts[c.num_seqs], C = c.channels(), K = c.taps, W = K - 1, H = c.heads;
  const int64_t dk = c.dk, KH = c.key_heads;
  const T* qkv = static_cast<const T*>(c.qkv);
  // Every starting state is read before any is written (recurrent.h).
  const int64_t state_elements = H * dk * c.dv;
  const recurrent::Starts st(c.num_seqs, c.row_starts, c.state_in, c.state_out, c.conv, c.ssm, W, C, state_elements);
  const std::vector<int64_t>& seq_of_row = st.seq_of_row;
  const std::vector<float>& windows = st.windows;
  recurrent::write_windows(st, c.row_starts, c.state_out, c.conv, qkv, c.qkv_stride, W, C);
  // Phase A, row by row: conv, SiLU, norms and grids, gates.
  thread_local Workspace<float> floats;
  thread_local Workspace<int32_t> ints;
  float* f = floats.get(static_cast<size_t>(rows * (C + 2 * H)));
  int32_t* i32 = ints.get(static_cast<size_t>(rows * KH * (2 * dk + 2)));
  const Rows rw{f,   f + rows * C, f + rows * (C + H), i32, i32 + rows * KH * dk, i32 + 2 * rows * KH * dk,
                i32 + rows * KH * (2 * dk + 1), st.states.data()};
  const float q_scale = static_cast<float>(std::sqrt(static_cast<double>(dk)));  // f32(key_dim ** 0.5)
  const bool parallel_rows = c.threads > 1 && rows > 1 && rows * C >= PARALLEL_ELEMENTS;
#pragma omp parallel num_threads(c.threads) if (parallel_rows)
  {
    std::vector<float> tmp(C), t_buf(C);
    std::vector<double> grid(dk);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = seq_of_row[r], t = r - c.row_starts[s];
      float* m = rw.mixed + r * C;
      for (int64_t j = 0; j < K; ++j) {  // acc = in_0 w_0, then acc + in_j w_j
        const int64_t u = t + j;         // the row of the padded inputs: the window's, then qkv's
        if (u < W)
          conv_tap(windows.data() + (s * W + u) * C, c.conv_taps + j * C, m, C, j == 0);
        else
          conv_tap(qkv + (c.row_starts[s] + u - W) * c.qkv_stride, c.conv_taps + j * C, m, C, j == 0);
      }
      silu_inplace(m, tmp.data(), t_buf.data(), C);
      for (int64_t kh = 0; kh < KH; ++kh) {
        float* q = m + kh * dk;
        float* k = m + (KH + kh) * dk;
        l2_norm_inplace(q, dk, q_scale);
        l2_norm_inplace(k, dk, 0.0f);
        // q and k on their grids (grid_dot's v_int)
        rw.e_q[r * KH + kh] = vector_on_grid(q, dk, grid.data());
        int32_t* q_int = rw.q_int + (r * KH + kh) * dk;
        for (int64_t i = 0; i < dk; ++i) q_int[i] = static_cast<int32_t>(grid[i]);
        rw.e_k[r * KH + kh] = vector_on_grid(k, dk, grid.data());
        int32_t* k_int = rw.k_int + (r * KH + kh) * dk;
        for (int64_t i = 0; i < dk; ++i) k_int[i] = static_cast<int32_t>(grid[i]);
      }
      for (int64_t h = 0; h < H; ++h) {
        const float y = c.a[r * H + h] + c.dt_bias[h];
        const float g = -c.rate[h] * softplus32(y);
        rw.decay[r * H + h] = exp_neg(g);
        rw.beta[r * H + h] = sigmoid32(c.b[r * H + h]);
      }
    }
  }
  // Phase B: the recurrence, a work item (sequence, head, state columns) at a time
  // (recurrent::work_items).
  const std::vector<recurrent::WorkItem> items =
      recurrent::work_items(c.num_seqs, c.row_starts, H, c.dv, c.threads, RUN_COLUMNS);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const bool parallel_items = c.threads > 1 && num_items > 1;
#pragma omp parallel num_threads(c.threads) if (parallel_items)
  {
    alignas(64) float S[MAX_KEY_DIM * RUN_COLUMNS];  // the running state of the item's columns at hand
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) run_item<T>(c, rw, items[i].s, items[i].h, items[i].j0, items[i].j1, S);
  }
}

// gated_rms_norm of one row: y = f32(x64 * inv) * f32(weight); out = y * silu32(gate), rounded to T.
template <typename T, typename G, typename Wt>
void gated_norm_impl(const T* x, const G* gate, int64_t gate_stride, const Wt* weight, T* out, int64_t rows,
                     int64_t width, double eps, int threads) {
  const bool parallel = threads > 1 && rows > 1 && rows * width >= PARALLEL_ELEMENTS;
#pragma omp parallel num_threads(threads) if (parallel)
  {
    std::vector<float> xf(width), g(width), tmp(width), t(width);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * width;
      const G* gr = gate + r * gate_stride;
      for (int64_t i = 0; i < width; ++i) xf[i] = to_f32(xr[i]);
      for (int64_t i = 0; i < width; ++i) g[i] = to_f32(gr[i]);
      const float inv = inverse_norm(xf.data(), width, static_cast<float>(width), static_cast<float>(eps));
      silu_inplace(g.data(), tmp.data(), t.data(), width);
      T* o = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        float y = xf[i] * inv;
        y = y * to_f32(weight[i]);
        o[i] = from_f32<T>(y * g[i]);
      }
    }
  }
}

template <typename T, typename G>
void gated_norm_weight(const void* x, const void* gate, int64_t gate_stride, int weight_dtype, const void* weight,
                       void* out, int64_t rows, int64_t width, double eps, int threads) {
  if (weight_dtype == 0)
    gated_norm_impl(static_cast<const T*>(x), static_cast<const G*>(gate), gate_stride,
                    static_cast<const float*>(weight), static_cast<T*>(out), rows, width, eps, threads);
  else
    gated_norm_impl(static_cast<const T*>(x), static_cast<const G*>(gate), gate_stride,
                    static_cast<const bf16*>(weight), static_cast<T*>(out), rows, width, eps, threads);
}

}  // namespace

void delta_net(int dtype, const void* qkv, int64_t qkv_stride, const float* a, const float* b, float* conv_state,
               float* ssm_state, const int64_t* state_in, const int64_t* state_out, const int64_t* row_starts,
               int64_t num_seqs, const float* conv_taps, int64_t conv_kernel, const float* rate,
               const float* dt_bias, int64_t key_heads, int64_t heads, int64_t key_dim, int64_t value_dim, void* out,
               int threads) {
  const Call c{qkv,         qkv_stride,  a,         b,          conv_state, ssm_state, state_in,  state_out,
               row_starts,  num_seqs,    conv_taps,   rate,     dt_bias,    key_heads, heads,     key_dim,
               value_dim,   conv_kernel, out,         threads};
  if (dtype == 0)
    delta_net_impl<float>(c);
  else
    delta_net_impl<bf16>(c);
}

void gated_rms_norm(int dtype, const void* x, int gate_dtype, const void* gate, int64_t gate_stride,
                    int weight_dtype, const void* weight, void* out, int64_t rows, int64_t width, double eps,
                    int threads) {
  if (dtype == 0) {
    if (gate_dtype == 0)
      gated_norm_weight<float, float>(x, gate, gate_stride, weight_dtype, weight, out, rows, width, eps, threads);
    else
      gated_norm_weight<float, bf16>(x, gate, gate_stride, weight_dtype, weight, out, rows, width, eps, threads);
  } else {
    if (gate_dtype == 0)
      gated_norm_weight<bf16, float>(x, gate, gate_stride, weight_dtype, weight, out, rows, width, eps, threads);
    else
      gated_norm_weight<bf16, bf16>(x, gate, gate_stride, weight_dtype, weight, out, rows, width, eps, threads);
  }
}

}  // namespace tf
