// The row-invariant GEMM one lane at a time, for AVX2 (gemm_by_lane.h says why).
//
// The sums are gemm.cpp's (vec16.h): float32 lane l of an output adds x[k] w[k] at
// k = l, l + 16, ... (chunk c's step at k = 16c + l) by fused multiply-adds; bfloat16 lane l adds
// chunk c's k = 32c + 2l + 1, then k = 32c + 2l, under MXCSR's DAZ and FTZ (PairFlush); K is
// zero-padded to whole chunks; the lanes fold as (l + (l + 8)), + 4, + 2, + 1. What changes is
// which sums share a register: one lane of eight columns, so a W load serves every row of the
// tile and an x element is one broadcast.
//
// Layouts (C = the padded K's chunks, S = steps per chunk: 1 float32, 2 bfloat16):
// - W in panels of 16 columns (the last zero-padded); in a panel, lane l's chunk c (one 64-byte
//   line in either dtype) at w_step(l, c), column j at (w_step + j) S; for bfloat16 the pair
//   (k even, k odd) is one 32-bit word, the odd element in its high half.
// - x, per group of G rows, widened to float32 once per call: chunk c, lane l, step s, row i at
//   ((c 16 + l) S + s) G + i.
#include "gemm_by_lane.h"

#if TF_GEMM_BY_LANE
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace tf::by_lane {
namespace {

constexpr int LANES = 16;
constexpr int64_t PANEL = 16;           // columns per packed panel: two registers
constexpr int64_t PANELS_PER_TASK = 4;  // a thread's share at a time: 64 columns
constexpr int64_t GROUPS_PER_BLOCK = 8; // rows in cache while a task's panels pass over them

// The order of a lane's steps, by dtype (the same as gemm.cpp's Chunk).
template <typename T>
struct Steps;
template <>
struct Steps<float> {
  static constexpr int64_t width = 16;
  static constexpr int count = 1;
  static constexpr int64_t k(int64_t c, int l, int) { return c * 16 + l; }
  static constexpr int group = 6;  // rows per register tile: 12 accumulators, 2 W, 1 broadcast
  struct Mode {
    void done(V16*, int) {}
  };
};
template <>
struct Steps<bf16> {
  static constexpr int64_t width = 32;
  static constexpr int count = 2;
  static constexpr int64_t k(int64_t c, int l, int s) { return c * 32 + 2 * l + 1 - s; }
  static constexpr int group = 5;  // 10 accumulators, 4 widened W (odd, even), 1 broadcast
  using Mode = PairFlush;
};

template <typename T>
int64_t padded_k(int64_t K) {
  return (K + Steps<T>::width - 1) / Steps<T>::width * Steps<T>::width;
}

int64_t panels(int64_t N) { return (N + PANEL - 1) / PANEL; }

// Lanes are stored in runs of four: run r holds chunk c of lanes 4r .. 4r + 3 side by side. A
// one-row tile runs four lanes at once (lanes_at_once), so a decode step reads W as one stream;
// lane by lane (one run per lane) it read four streams and the one-row GEMMs of the default
// model took 25-30% longer. Tiles of more rows run fewer lanes at once and read a run's lines
// over several passes (the first pass prefetches them all: PREFETCH_CHUNKS).
constexpr int LANE_RUN = 4;
constexpr int64_t PREFETCH_CHUNKS = 8;

// Where lane l's chunk c starts in a panel, in columns (times S elements for bfloat16's pairs).
inline int64_t w_step(int l, int64_t c, int64_t C) {
  return (((l / LANE_RUN) * C + c) * LANE_RUN + l % LANE_RUN) * PANEL;
}

template <typename T>
void pack_impl(const T* w, T* packed, int64_t N, int64_t K) {
  using St = Steps<T>;
  constexpr int S = St::count;
  const int64_t kp = padded_k<T>(K), C = kp / St::width;
  for (int64_t p = 0; p < panels(N); ++p) {
    T* panel = packed + p * PANEL * kp;
    for (int l = 0; l < LANES; ++l)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t j = 0; j < PANEL; ++j)
          for (int s = 0; s < S; ++s) {
            const int64_t n = p * PANEL + j, k = St::k(c, l, s);
            panel[(w_step(l, c, C) + j) * S + (S - 1 - s)] = n < N && k < K ? w[n * K + k] : T{};
          }
  }
}

// W's step s of lane l, chunk c, for columns 8h .. 8h + 7.
struct WSteps {
  __m256 v[2][2];
};
inline void load_steps(const float* p, WSteps& w) {
  w.v[0][0] = _mm256_loadu_ps(p);
  w.v[0][1] = _mm256_loadu_ps(p + 8);
}
inline void load_steps(const bf16* p, WSteps& w) {  // DAZ (PairFlush) zeroes the subnormals
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int h = 0; h < 2; ++h) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h));
    w.v[0][h] = _mm256_castsi256_ps(_mm256_and_si256(pairs, odd));
    w.v[1][h] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  }
}

// How many lanes a tile of G rows runs side by side: enough independent sums to cover the
// FMA's latency (eight), no more accumulators than a full group's (2 per row).
template <typename T, int G>
constexpr int lanes_at_once() {
  int n = 4;
  while (n > 1 && n * G > Steps<T>::group) n /= 2;
  return n;
}

// Every lane's sums of G rows (x group xg) against one panel (wp), into sums[l * G + i] (a V16
// holding the panel's sixteen columns), then folded into out rows.
template <typename T, int G>
void group_by_panel(const float* xg, const T* wp, int64_t C, T* out, int64_t ldo, int cols) {
  using St = Steps<T>;
  constexpr int S = St::count, LC = lanes_at_once<T, G>();
  V16 sums[LANES * G];
  {
    typename St::Mode mode;
    for (int l0 = 0; l0 < LANES; l0 += LC) {
      __m256 acc[LC][G][2];
      for (int a = 0; a < LC; ++a)
        for (int i = 0; i < G; ++i) acc[a][i][0] = acc[a][i][1] = _mm256_setzero_ps();
      for (int64_t c = 0; c < C; ++c) {
        if (LC < LANE_RUN && l0 % LANE_RUN == 0)  // a run's first pass: its lines ahead
          for (int line = 0; line < LANE_RUN; ++line)
            _mm_prefetch(reinterpret_cast<const char*>(wp + (w_step(l0, c + PREFETCH_CHUNKS, C) + line * PANEL) * S),
                         _MM_HINT_T0);
#pragma GCC unroll 8
        for (int a = 0; a < LC; ++a) {
          const int l = l0 + a;
          WSteps w;
          load_steps(wp + w_step(l, c, C) * S, w);
          const float* xs = xg + (c * LANES + l) * S * G;
#pragma GCC unroll 2
          for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
            for (int i = 0; i < G; ++i) {
              const __m256 xb = _mm256_broadcast_ss(xs + s * G + i);
              acc[a][i][0] = _mm256_fmadd_ps(xb, w.v[s][0], acc[a][i][0]);
              acc[a][i][1] = _mm256_fmadd_ps(xb, w.v[s][1], acc[a][i][1]);
            }
        }
      }
      for (int a = 0; a < LC; ++a)
        for (int i = 0; i < G; ++i) sums[(l0 + a) * G + i] = {acc[a][i][0], acc[a][i][1]};
    }
    mode.done(sums, LANES * G);
  }
  for (int i = 0; i < G; ++i) {
    float folded[PANEL];
    for (int h = 0; h < 2; ++h) {
      auto lane = [&](int l) { return h ? sums[l * G + i].hi : sums[l * G + i].lo; };
      __m256 t8[8], t4[4];
      for (int l = 0; l < 8; ++l) t8[l] = _mm256_add_ps(lane(l), lane(l + 8));
      for (int l = 0; l < 4; ++l) t4[l] = _mm256_add_ps(t8[l], t8[l + 4]);
      const __m256 t2a = _mm256_add_ps(t4[0], t4[2]), t2b = _mm256_add_ps(t4[1], t4[3]);
      _mm256_storeu_ps(folded + 8 * h, _mm256_add_ps(t2a, t2b));
    }
    for (int j = 0; j < cols; ++j) out[i * ldo + j] = from_f32<T>(folded[j]);
  }
}

template <typename T>
void group_by_panel(int G, const float* xg, const T* wp, int64_t C, T* out, int64_t ldo, int cols) {
  switch (G) {
    case 1: return group_by_panel<T, 1>(xg, wp, C, out, ldo, cols);
    case 2: return group_by_panel<T, 2>(xg, wp, C, out, ldo, cols);
    case 3: return group_by_panel<T, 3>(xg, wp, C, out, ldo, cols);
    case 4: return group_by_panel<T, 4>(xg, wp, C, out, ldo, cols);
    case 5: return group_by_panel<T, 5>(xg, wp, C, out, ldo, cols);
    default: if constexpr (Steps<T>::group >= 6) return group_by_panel<T, 6>(xg, wp, C, out, ldo, cols);
  }
}

// Rows [m0, m0 + G) of x into their group's layout, float32, K zero-padded.
template <typename T>
void widen_group(const T* x, int64_t K, int64_t C, int G, float* xg) {
  using St = Steps<T>;
  constexpr int S = St::count;
  for (int64_t c = 0; c < C; ++c)
    for (int l = 0; l < LANES; ++l)
      for (int s = 0; s < S; ++s) {
        const int64_t k = St::k(c, l, s);
        float* dst = xg + ((c * LANES + l) * S + s) * G;
        if (k < K)
          for (int i = 0; i < G; ++i) dst[i] = to_f32(x[i * K + k]);
        else
          for (int i = 0; i < G; ++i) dst[i] = 0.0f;
      }
}

template <typename T>
void linear_impl(const T* x, const T* packed, T* out, int64_t M, int64_t N, int64_t K, int threads) {
  constexpr int G = Steps<T>::group;
  const int64_t kp = padded_k<T>(K), C = kp / Steps<T>::width;
  const int64_t groups = (M + G - 1) / G;
  const int64_t column_tasks = (panels(N) + PANELS_PER_TASK - 1) / PANELS_PER_TASK;
  const int64_t blocks = (groups + GROUPS_PER_BLOCK - 1) / GROUPS_PER_BLOCK;
  static thread_local std::vector<float> widened;  // the caller's, reused: no page faults per call
  if (static_cast<int64_t>(widened.size()) < M * kp) widened.resize(M * kp);
  float* xw = widened.data();
  auto rows_of = [&](int64_t g) { return static_cast<int>(std::min<int64_t>(G, M - g * G)); };
#pragma omp parallel num_threads(threads) if (threads > 1 && column_tasks * blocks > 1)
  {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) widen_group(x + g * G * K, K, C, rows_of(g), xw + g * G * kp);
    // A task: a block of row groups against a few panels (the block's rows stay in cache while
    // the panels pass, each panel while the block's groups pass it).
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < column_tasks * blocks; ++t) {
      const int64_t p0 = t / blocks * PANELS_PER_TASK, p1 = std::min(panels(N), p0 + PANELS_PER_TASK);
      const int64_t g0 = t % blocks * GROUPS_PER_BLOCK, g1 = std::min(groups, g0 + GROUPS_PER_BLOCK);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n = p * PANEL;
        const int cols = static_cast<int>(std::min(PANEL, N - n));
        for (int64_t g = g0; g < g1; ++g)
          group_by_panel(rows_of(g), xw + g * G * kp, packed + n * kp, C, out + g * G * N + n, N, cols);
      }
    }
  }
}

}  // namespace

template <typename T>
int64_t packed_numel(int64_t N, int64_t K) {
  return panels(N) * PANEL * padded_k<T>(K);
}

template <typename T>
void pack_weight(const T* w, T* packed, int64_t N, int64_t K) {
  pack_impl(w, packed, N, K);
}

template <typename T>
void linear(const T* x, const T* packed, T* out, int64_t M, int64_t N, int64_t K, int threads) {
  linear_impl(x, packed, out, M, N, K, threads);
}

template int64_t packed_numel<float>(int64_t, int64_t);
template int64_t packed_numel<bf16>(int64_t, int64_t);
template void pack_weight(const float*, float*, int64_t, int64_t);
template void pack_weight(const bf16*, bf16*, int64_t, int64_t);
template void linear(const float*, const float*, float*, int64_t, int64_t, int64_t, int);
template void linear(const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t, int);

}  // namespace tf::by_lane

#endif  // TF_GEMM_BY_LANE
