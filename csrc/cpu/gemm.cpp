// The row-invariant GEMM: out[m, n] = sum_k x[m, k] w[n, k], for float32 and bfloat16 weights.
//
// The order of every sum is fixed by K alone (vec16.h): lane l accumulates the products at
// k = l (mod 16) in increasing k, a K tail is padded with zeros, then a halving tree folds the
// lanes. float32 products are rounded and then added (a multiply and an add, never fused);
// bfloat16 products use FMA, one rounding of acc + x w (the torch reference, kernels/reference.py
// `linear`, gets that rounding from float64, where the sum is exact or too lopsided to differ).
// How rows are grouped into
// register tiles, how columns are split over threads and how many threads run change the speed,
// never a bit: a row alone and the same row among 511 others give the same outputs.
#include <algorithm>
#include <cstring>

#include "kernels.h"
#include "vec16.h"

namespace tf {
namespace {

constexpr int64_t COLS_PER_TASK = 64;   // columns of W one thread takes at a time
constexpr int64_t ROWS_PER_BLOCK = 64;  // rows of x kept in cache while a column task runs
constexpr int NR = 8;                   // columns of a register tile

inline V16 madd(V16 acc, V16 a, V16 b, float) { return v16_mul_add(acc, a, b); }
inline V16 madd(V16 acc, V16 a, V16 b, bf16) { return v16_fma(acc, a, b); }

// A register tile: MR rows of x times NC rows of W, over all of K.
template <typename T, int MR, int NC>
void tile(const T* x, int64_t ldx, const T* w, int64_t ldw, T* out, int64_t ldo, int64_t K) {
  V16 acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = v16_zero();
  const int64_t body = K - K % 16;
  for (int64_t k = 0; k < body; k += 16) {
    V16 wv[NC];
    for (int j = 0; j < NC; ++j) wv[j] = v16_load(w + j * ldw + k);
    for (int i = 0; i < MR; ++i) {
      const V16 xv = v16_load(x + i * ldx + k);
      for (int j = 0; j < NC; ++j) acc[i][j] = madd(acc[i][j], xv, wv[j], T{});
    }
  }
  if (body < K) {  // the tail, zero-padded to 16 (adding +0 to a sum never changes it)
    T xb[MR][16], wb[NC][16];
    std::memset(xb, 0, sizeof(xb));
    std::memset(wb, 0, sizeof(wb));
    for (int i = 0; i < MR; ++i) std::memcpy(xb[i], x + i * ldx + body, (K - body) * sizeof(T));
    for (int j = 0; j < NC; ++j) std::memcpy(wb[j], w + j * ldw + body, (K - body) * sizeof(T));
    for (int i = 0; i < MR; ++i) {
      const V16 xv = v16_load(xb[i]);
      for (int j = 0; j < NC; ++j) acc[i][j] = madd(acc[i][j], xv, v16_load(wb[j]), T{});
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) out[i * ldo + j] = from_f32<T>(v16_tree(acc[i][j]));
}

// The same with the column count chosen at run time (a full tile, or the last columns of W).
template <typename T, int MR, int NC_MAX>
void tile_upto(const T* x, int64_t ldx, const T* w, int64_t ldw, T* out, int64_t ldo, int64_t K, int nc) {
  if constexpr (NC_MAX > 1) {
    if (nc < NC_MAX) return tile_upto<T, MR, NC_MAX - 1>(x, ldx, w, ldw, out, ldo, K, nc);
  }
  tile<T, MR, NC_MAX>(x, ldx, w, ldw, out, ldo, K);
}

// Rows [m0, m1) against the columns [n, n + nc) of one register tile width.
template <typename T>
void rows_by_columns(const T* x, const T* w, T* out, int64_t m0, int64_t m1, int64_t n, int nc,
                     int64_t N, int64_t K) {
  const T* wn = w + n * K;
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) {  // 4 x 4 tiles: 16 accumulators, each W load used by 4 rows
    tile_upto<T, 4, 4>(x + m * K, K, wn, K, out + m * N + n, N, K, std::min(nc, 4));
    if (nc > 4) tile_upto<T, 4, 4>(x + m * K, K, wn + 4 * K, K, out + m * N + n + 4, N, K, nc - 4);
  }
  if (m + 2 <= m1) {
    tile_upto<T, 2, NR>(x + m * K, K, wn, K, out + m * N + n, N, K, nc);
    m += 2;
  }
  if (m < m1) tile_upto<T, 1, NR>(x + m * K, K, wn, K, out + m * N + n, N, K, nc);
}

template <typename T>
void linear_impl(const T* x, const T* w, T* out, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t tasks = (N + COLS_PER_TASK - 1) / COLS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n0 = t * COLS_PER_TASK, n1 = std::min(N, n0 + COLS_PER_TASK);
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_BLOCK) {
      const int64_t m1 = std::min(M, m0 + ROWS_PER_BLOCK);
      for (int64_t n = n0; n < n1; n += NR) {
        if (n + 3 * NR <= N) {  // the weights two tiles ahead on their way to L2 while this one runs
          const char* ahead = reinterpret_cast<const char*>(w + (n + 2 * NR) * K);
          for (int64_t b = 0; b < NR * K * static_cast<int64_t>(sizeof(T)); b += 64)
            __builtin_prefetch(ahead + b, 0, 2);
        }
        rows_by_columns(x, w, out, m0, m1, n, static_cast<int>(std::min<int64_t>(NR, n1 - n)), N, K);
      }
    }
  }
}

}  // namespace

void linear_f32(const float* x, const float* w, float* out, int64_t M, int64_t N, int64_t K, int threads) {
  linear_impl(x, w, out, M, N, K, threads);
}

void linear_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t M, int64_t N, int64_t K,
                 int threads) {
  linear_impl(reinterpret_cast<const bf16*>(x), reinterpret_cast<const bf16*>(w), reinterpret_cast<bf16*>(out),
              M, N, K, threads);
}

}  // namespace tf
