// The row-invariant GEMM: out[m, n] = sum_k x[m, k] w[n, k], for float32 and bfloat16 weights.
//
// The order of every sum is fixed by K alone (vec16.h): lane l accumulates the products at
// k = l (mod 16) in increasing k by fused multiply-adds (acc + x w rounded once to float32), a
// K tail is padded with zeros, then a halving tree folds the lanes. The torch reference
// (kernels/reference.py `linear`) gets each FMA's rounding from float64 rounded to odd. How rows
// are grouped into register tiles, how columns are split over threads and how many threads run
// change the speed, never a bit: a row alone and the same row among 511 others give the same
// outputs. There is no switch by row count.
#include <algorithm>
#include <cstring>

#include "kernels.h"
#include "vec16.h"

namespace tf {
namespace {

constexpr int64_t TILE_COLS = 8;         // columns of W per packed tile (and per register tile)
constexpr int64_t TILES_PER_TASK = 8;    // tiles one thread takes at a time
constexpr int64_t ROWS_PER_BLOCK = 64;   // rows of x kept in cache while a task runs

// The packed layout: W's columns in tiles of TILE_COLS (the last may be narrower), K padded
// with zeros to a multiple of 16; inside a tile, chunk c of column j at (c * cols + j) * 16.
// So a tile is one contiguous run that the kernel reads front to back, which is what the
// hardware prefetcher streams best (rows of W read side by side are as many short streams).
inline int64_t padded_k(int64_t K) { return (K + 15) / 16 * 16; }

template <typename T>
void pack_impl(const T* w, T* packed, int64_t N, int64_t K) {
  const int64_t kp = padded_k(K), chunks = kp / 16;
  for (int64_t n0 = 0; n0 < N; n0 += TILE_COLS) {
    const int64_t cols = std::min(TILE_COLS, N - n0);
    T* tile = packed + n0 * kp;
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t j = 0; j < cols; ++j)
        for (int64_t l = 0; l < 16; ++l) {
          const int64_t k = c * 16 + l;
          tile[(c * cols + j) * 16 + l] = k < K ? w[(n0 + j) * K + k] : T{};
        }
  }
}

// A register tile: MR rows of x times NC columns (j0, j0 + 1, ...) of one packed tile of `cols`.
template <typename T, int MR, int NC>
void tile(const T* x, int64_t ldx, const T* w, int64_t cols, int64_t j0, T* out, int64_t ldo, int64_t K) {
  V16 acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NC; ++j) acc[i][j] = v16_zero();
  const int64_t body = K / 16;
  for (int64_t c = 0; c < body; ++c) {
    const T* wc = w + (c * cols + j0) * 16;
    V16 wv[NC];
    for (int j = 0; j < NC; ++j) wv[j] = v16_load(wc + j * 16);
    for (int i = 0; i < MR; ++i) {
      const V16 xv = v16_load(x + i * ldx + c * 16);
      for (int j = 0; j < NC; ++j) acc[i][j] = v16_fma(acc[i][j], xv, wv[j]);
    }
  }
  if (body * 16 < K) {  // x's tail, zero-padded to 16 like W's (adding +0 to a sum changes nothing)
    T xb[MR][16];
    std::memset(xb, 0, sizeof(xb));
    for (int i = 0; i < MR; ++i) std::memcpy(xb[i], x + i * ldx + body * 16, (K - body * 16) * sizeof(T));
    const T* wc = w + (body * cols + j0) * 16;
    for (int i = 0; i < MR; ++i) {
      const V16 xv = v16_load(xb[i]);
      for (int j = 0; j < NC; ++j) acc[i][j] = v16_fma(acc[i][j], xv, v16_load(wc + j * 16));
    }
  }
  if constexpr (MR * NC == 16) {  // the 4 x 4 and 2 x 8 tiles: all sixteen trees at once
    float sums[16];
    v16_tree16(&acc[0][0], sums);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NC; ++j) out[i * ldo + j] = from_f32<T>(sums[i * NC + j]);
  } else {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NC; ++j) out[i * ldo + j] = from_f32<T>(v16_tree(acc[i][j]));
  }
}

// The same with the column count chosen at run time (a full tile, or the narrower last one).
template <typename T, int MR, int NC_MAX>
void tile_upto(const T* x, int64_t ldx, const T* w, int64_t cols, int64_t j0, T* out, int64_t ldo, int64_t K,
               int nc) {
  if constexpr (NC_MAX > 1) {
    if (nc < NC_MAX) return tile_upto<T, MR, NC_MAX - 1>(x, ldx, w, cols, j0, out, ldo, K, nc);
  }
  tile<T, MR, NC_MAX>(x, ldx, w, cols, j0, out, ldo, K);
}

// Rows [m0, m1) against the packed tile of columns [n, n + cols): 2 x 8 register tiles (16
// accumulators; each W load serves 2 rows and the tile stays in L1 for the next pair), the odd
// last row alone.
template <typename T>
void rows_by_tile(const T* x, const T* tile_w, T* out, int64_t m0, int64_t m1, int64_t n, int cols, int64_t N,
                  int64_t K) {
  int64_t m = m0;
  for (; m + 2 <= m1; m += 2) tile_upto<T, 2, TILE_COLS>(x + m * K, K, tile_w, cols, 0, out + m * N + n, N, K, cols);
  if (m < m1) tile_upto<T, 1, TILE_COLS>(x + m * K, K, tile_w, cols, 0, out + m * N + n, N, K, cols);
}

template <typename T>
void linear_impl(const T* x, const T* packed, T* out, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t kp = padded_k(K);
  const int64_t tiles = (N + TILE_COLS - 1) / TILE_COLS;
  const int64_t tasks = (tiles + TILES_PER_TASK - 1) / TILES_PER_TASK;
  // Dynamic: a thread that the OS parks takes fewer tasks instead of stalling every call.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t t1 = std::min(tiles, (t + 1) * TILES_PER_TASK);
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_BLOCK) {
      const int64_t m1 = std::min(M, m0 + ROWS_PER_BLOCK);
      for (int64_t tile_i = t * TILES_PER_TASK; tile_i < t1; ++tile_i) {
        const int64_t n = tile_i * TILE_COLS;
        rows_by_tile(x, packed + n * kp, out, m0, m1, n, static_cast<int>(std::min(TILE_COLS, N - n)), N, K);
      }
    }
  }
}

}  // namespace

int64_t packed_numel(int64_t N, int64_t K) { return N * padded_k(K); }

void pack_weight(int dtype, const void* w, void* packed, int64_t N, int64_t K) {
  if (dtype == 0)
    pack_impl(static_cast<const float*>(w), static_cast<float*>(packed), N, K);
  else
    pack_impl(static_cast<const bf16*>(w), static_cast<bf16*>(packed), N, K);
}

void linear(int dtype, const void* x, const void* packed, void* out, int64_t M, int64_t N, int64_t K, int threads) {
  if (dtype == 0)
    linear_impl(static_cast<const float*>(x), static_cast<const float*>(packed), static_cast<float*>(out), M, N, K,
                threads);
  else
    linear_impl(static_cast<const bf16*>(x), static_cast<const bf16*>(packed), static_cast<bf16*>(out), M, N, K,
                threads);
}

}  // namespace tf
