// The row-invariant GEMM: out[m, n] = sum_k x[m, k] w[n, k], for float32 and bfloat16 weights.
//
// The order of every sum is fixed by K alone (vec16.h). float32: lane l accumulates the
// products at k = l (mod 16) in increasing k by fused multiply-adds (acc + x w rounded once to
// float32). bfloat16: in each chunk of 32, lane l adds the product at k = 2l + 1, then the one at
// 2l, each step rounded and flushed as AVX512_BF16's vdpbf16ps does it (one instruction per
// chunk where the CPU has it: twice the multiply-adds of an FMA, and no widening). A K tail is
// padded with zeros, then a halving tree folds the lanes. The torch reference
// (kernels/reference.py `linear`) gets each step's rounding from float64 rounded to odd. How rows
// are grouped into register tiles, how columns are split over threads and how many threads run
// change the speed, never a bit: a row alone and the same row among 511 others give the same
// outputs. No row count picks other arithmetic: bfloat16 one-row tiles spell the same steps as
// two FMAs (ChunkFor), the same bits. On AVX2 gemm_by_lane.cpp computes the same sums with
// a register layout AVX2's sixteen registers suit (and a packed layout of its own).
#include <algorithm>
#include <cstring>

#include "gemm_by_lane.h"
#include "kernels.h"
#include "prefetch.h"
#include "vec16.h"

namespace tf {
namespace {

constexpr int64_t TILE_COLS = 8;         // columns of W per packed tile (and per register tile)
constexpr int64_t TILES_PER_TASK = 8;    // tiles one thread takes at a time
constexpr int64_t ROWS_PER_BLOCK = 64;   // rows of x kept in cache while a task runs
constexpr int64_t PREFETCH_BYTES = 2048; // how far ahead of its loads a tile asks for W

// What one step of the sums takes, by dtype: a chunk of `width` elements of x and of a column
// of W, loaded into registers, then `step` adds their products into the sixteen lanes.
template <typename T>
struct Chunk;
template <>
struct Chunk<float> {
  static constexpr int64_t width = 16;
  using Reg = V16;
  static Reg load(const float* p) { return v16_load(p); }
  static V16 step(V16 acc, const Reg& x, const Reg& w) { return v16_fma(acc, x, w); }
  struct Mode {
    void done(V16*, int) {}
  };
};
// bfloat16 chunks: 32 elements, the pairs stepped by v16_dot_pairs on the register type R (loaded
// by Load) under the flush mode M.
template <typename R, R (*Load)(const bf16*), typename M>
struct PairChunk {
  static constexpr int64_t width = 32;
  using Reg = R;
  static Reg load(const bf16* p) { return Load(p); }
  static V16 step(V16 acc, const Reg& x, const Reg& w) { return v16_dot_pairs(acc, x, w); }
  using Mode = M;
};
template <>
struct Chunk<bf16> : PairChunk<P32, p32_load, PairFlush> {};

// The chunk steps a register tile of MR rows takes. With AVX512_BF16, one-row tiles take the
// pairs as two FMAs under MXCSR's flushes instead of vdpbf16ps: the same steps, flushed alike, so
// the same bits (the kernel tests run both tile shapes against the reference, and the startup
// probes a row alone against it among others); faster where a row has no other to share each
// widened W chunk with and vdpbf16ps runs at half the FMA rate (an Intel Xeon: bf16 one-stream
// decode +7%). Two-row tiles keep the instruction (prefill 12% faster with it there).
template <typename T, int MR>
struct ChunkFor {
  using type = Chunk<T>;
};
#if defined(__AVX512BF16__)
template <>
struct ChunkFor<bf16, 1> {
  using type = PairChunk<SplitPairs, split_pairs_load, MxcsrFlush>;
};
#endif

// The packed layout: W's columns in tiles of TILE_COLS (the last may be narrower), K padded
// with zeros to a multiple of the chunk width; inside a tile, chunk c of column j at
// (c * cols + j) * width. So a tile is one contiguous run that the kernel reads front to back,
// which is what the hardware prefetcher streams best (rows of W read side by side are as many
// short streams).
template <typename T>
int64_t padded_k(int64_t K) {
  constexpr int64_t width = Chunk<T>::width;
  return (K + width - 1) / width * width;
}

template <typename T>
void pack_impl(const T* w, T* packed, int64_t N, int64_t K) {
  constexpr int64_t width = Chunk<T>::width;
  const int64_t kp = padded_k<T>(K), chunks = kp / width;
  for (int64_t n0 = 0; n0 < N; n0 += TILE_COLS) {
    const int64_t cols = std::min(TILE_COLS, N - n0);
    T* tile = packed + n0 * kp;
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t j = 0; j < cols; ++j)
        for (int64_t l = 0; l < width; ++l) {
          const int64_t k = c * width + l;
          tile[(c * cols + j) * width + l] = k < K ? w[(n0 + j) * K + k] : T{};
        }
  }
}

// What a register tile asks the memory for ahead of its loads, into L2: at chunk c, the bytes
// [from + c per_chunk, from + (c + 1) per_chunk) (nothing when per_chunk is 0). A task streams its
// packed tiles front to back, and the row tiles after the first find their packed tile in cache
// and would leave the memory idle: so the first pass over a packed tile asks PREFETCH_BYTES ahead
// of itself, and each later pass a slice of the next packed tile (ahead_of). L2, not L1: an L1
// prefetch holds a fill buffer until its line arrives, and four-row GEMMs ran 15% slower so.
// Measured: csrc/cpu/README.md, "The GEMM".
struct Ahead {
  const char* from = nullptr;
  int64_t per_chunk = 0;
  void at(int64_t c) const {
    if (per_chunk > 0) prefetch_lines<TO_L2>(from + c * per_chunk, per_chunk);
  }
};

// A register tile: MR rows of x times NC columns (j0, j0 + 1, ...) of one packed tile of `cols`.
template <typename T, int MR, int NC>
void tile(const T* x, int64_t ldx, const T* w, int64_t cols, int64_t j0, T* out, int64_t ldo, int64_t K,
          const Ahead& ahead) {
  using C = typename ChunkFor<T, MR>::type;
  constexpr int64_t width = C::width;
  V16 sums[MR * NC];  // the lanes after the last step, folded once the steps' mode is over
  {
    typename C::Mode mode;
    V16 acc[MR][NC];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NC; ++j) acc[i][j] = v16_zero();
    const int64_t body = K / width;
    for (int64_t c = 0; c < body; ++c) {
      const T* wc = w + (c * cols + j0) * width;
      ahead.at(c);
      typename C::Reg xv[MR];  // each column's chunk is loaded once and serves the MR rows
      for (int i = 0; i < MR; ++i) xv[i] = C::load(x + i * ldx + c * width);
      for (int j = 0; j < NC; ++j) {
        const typename C::Reg wv = C::load(wc + j * width);
        for (int i = 0; i < MR; ++i) acc[i][j] = C::step(acc[i][j], xv[i], wv);
      }
    }
    if (body * width < K) {  // x's tail, zero-padded like W's (adding +0 to a sum changes nothing)
      T xb[MR][width];
      std::memset(xb, 0, sizeof(xb));
      for (int i = 0; i < MR; ++i) std::memcpy(xb[i], x + i * ldx + body * width, (K - body * width) * sizeof(T));
      const T* wc = w + (body * cols + j0) * width;
      for (int i = 0; i < MR; ++i) {
        const typename C::Reg xv = C::load(xb[i]);
        for (int j = 0; j < NC; ++j) acc[i][j] = C::step(acc[i][j], xv, C::load(wc + j * width));
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NC; ++j) sums[i * NC + j] = acc[i][j];
    mode.done(sums, MR * NC);
  }
  if constexpr (MR * NC == 16) {  // the 4 x 4 and 2 x 8 tiles: all sixteen trees at once
    float folded[16];
    v16_tree16(sums, folded);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NC; ++j) out[i * ldo + j] = from_f32<T>(folded[i * NC + j]);
  } else {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NC; ++j) out[i * ldo + j] = from_f32<T>(v16_tree(sums[i * NC + j]));
  }
}

// The same with the column count chosen at run time (a full tile, or the narrower last one).
template <typename T, int MR, int NC_MAX>
void tile_upto(const T* x, int64_t ldx, const T* w, int64_t cols, int64_t j0, T* out, int64_t ldo, int64_t K,
               int nc, const Ahead& ahead) {
  if constexpr (NC_MAX > 1) {
    if (nc < NC_MAX) return tile_upto<T, MR, NC_MAX - 1>(x, ldx, w, cols, j0, out, ldo, K, nc, ahead);
  }
  tile<T, MR, NC_MAX>(x, ldx, w, cols, j0, out, ldo, K, ahead);
}

// Register tiles of rows x cols accumulators; each W load serves the tile's rows, and the packed
// tile stays in cache for the next rows. With AVX-512 a V16 is one of 32 registers: 2 x 8. Without
// it (NEON: four of 32 registers; the scalar path) 2 x 8 accumulators cannot stay in registers,
// and float32 blocks of 16 rows or more take 2 x 2 (measured on AVX2 before gemm_by_lane.cpp
// took that target over: 30 layers' GEMMs at 512 rows 73-83 GFLOP/s against 52-54 with 2 x 8),
// while fewer rows keep 2 x 8. A last row alone runs 1 x 8 everywhere. None of this changes a
// bit: a tile only groups whole sums.
template <typename T>
struct TileShape {
  static constexpr int rows = 2, cols = 8, from_rows = 0;
};
#if !defined(__AVX512F__)
template <>
struct TileShape<float> {
  static constexpr int rows = 2, cols = 2, from_rows = 16;
};
#endif

// Columns [0, cols) of a packed tile for MR rows, NC columns at a time.
template <typename T, int MR, int NC>
void rows_by_cols(const T* x, const T* tile_w, T* out, int cols, int64_t N, int64_t K, const Ahead& ahead) {
  for (int j0 = 0; j0 < cols; j0 += NC)  // the first column tile's chunks span the packed tile's: it asks
    tile_upto<T, MR, NC>(x, K, tile_w, cols, j0, out + j0, N, K, std::min(NC, cols - j0), j0 == 0 ? ahead : Ahead{});
}

// What pass p of `passes` over a packed tile of `cols` columns asks for (Ahead): the first, the
// bytes PREFETCH_BYTES ahead of its own loads (into the next packed tile at its end); each later
// one an even slice of the next packed tile's bytes past those.
template <typename T>
Ahead ahead_of(const T* tile_w, int cols, int64_t K, int64_t p, int64_t passes) {
  constexpr int64_t width = Chunk<T>::width;
  const int64_t chunks = K / width, chunk_bytes = cols * width * static_cast<int64_t>(sizeof(T));
  const int64_t bytes = cols * padded_k<T>(K) * static_cast<int64_t>(sizeof(T));
  const char* w = reinterpret_cast<const char*>(tile_w);
  if (chunks == 0) return {};
  if (p == 0) return {w + PREFETCH_BYTES, chunk_bytes};
  const int64_t rest = bytes - PREFETCH_BYTES;  // the next tile's bytes the first pass leaves
  if (rest <= 0) return {};
  const int64_t lo = PREFETCH_BYTES + (p - 1) * rest / (passes - 1), hi = PREFETCH_BYTES + p * rest / (passes - 1);
  return {w + bytes + lo, (hi - lo + chunks - 1) / chunks};
}

template <typename T, int MR, int NC>
void rows_in_tiles(const T* x, const T* tile_w, T* out, int64_t m0, int64_t m1, int64_t n, int cols, int64_t N,
                   int64_t K) {
  const int64_t passes = (m1 - m0) / MR + (m1 - m0) % MR;
  int64_t m = m0, p = 0;
  for (; m + MR <= m1; m += MR, ++p)
    rows_by_cols<T, MR, NC>(x + m * K, tile_w, out + m * N + n, cols, N, K, ahead_of(tile_w, cols, K, p, passes));
  for (; m < m1; ++m, ++p)
    rows_by_cols<T, 1, TILE_COLS>(x + m * K, tile_w, out + m * N + n, cols, N, K, ahead_of(tile_w, cols, K, p, passes));
}

// Rows [m0, m1) against the packed tile of columns [n, n + cols).
template <typename T>
void rows_by_tile(const T* x, const T* tile_w, T* out, int64_t m0, int64_t m1, int64_t n, int cols, int64_t N,
                  int64_t K) {
  using S = TileShape<T>;
  if (m1 - m0 >= S::from_rows)
    rows_in_tiles<T, S::rows, S::cols>(x, tile_w, out, m0, m1, n, cols, N, K);
  else
    rows_in_tiles<T, 2, TILE_COLS>(x, tile_w, out, m0, m1, n, cols, N, K);
}

template <typename T>
void linear_impl(const T* x, const T* packed, T* out, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t kp = padded_k<T>(K);
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

// The kernel this target runs: gemm_by_lane.cpp's on AVX2, the tiles above elsewhere.
template <typename T>
int64_t packed_numel_of(int64_t N, int64_t K) {
#if TF_GEMM_BY_LANE
  return by_lane::packed_numel<T>(N, K);
#else
  return N * padded_k<T>(K);
#endif
}

template <typename T>
void pack_weight_of(const T* w, T* packed, int64_t N, int64_t K) {
#if TF_GEMM_BY_LANE
  by_lane::pack_weight(w, packed, N, K);
#else
  pack_impl(w, packed, N, K);
#endif
}

template <typename T>
void linear_of(const T* x, const T* packed, T* out, int64_t M, int64_t N, int64_t K, int threads) {
#if TF_GEMM_BY_LANE
  by_lane::linear(x, packed, out, M, N, K, threads);
#else
  linear_impl(x, packed, out, M, N, K, threads);
#endif
}

}  // namespace

int64_t packed_numel(int dtype, int64_t N, int64_t K) {
  return dtype == 0 ? packed_numel_of<float>(N, K) : packed_numel_of<bf16>(N, K);
}

const char* isa() { return TF_ISA; }
const char* pair_steps() { return TF_PAIRS; }

void pack_weight(int dtype, const void* w, void* packed, int64_t N, int64_t K) {
  if (dtype == 0)
    pack_weight_of(static_cast<const float*>(w), static_cast<float*>(packed), N, K);
  else
    pack_weight_of(static_cast<const bf16*>(w), static_cast<bf16*>(packed), N, K);
}

void linear(int dtype, const void* x, const void* packed, void* out, int64_t M, int64_t N, int64_t K, int threads) {
  if (dtype == 0)
    linear_of(static_cast<const float*>(x), static_cast<const float*>(packed), static_cast<float*>(out), M, N, K,
              threads);
  else
    linear_of(static_cast<const bf16*>(x), static_cast<const bf16*>(packed), static_cast<bf16*>(out), M, N, K,
              threads);
}

}  // namespace tf
