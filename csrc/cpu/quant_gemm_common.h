// What every path of the quantized GEMM (quant_gemm.cpp) reads: which instruction set this build
// takes (TF_QUANT_VNNI, with TF_QUANT_AMX where the tiles are built, or TF_QUANT_AVX2; neither:
// plain C++), a row's quantized activations (RowQ), on_grid (a term's one rounding onto the
// output's grid, which every path must round alike to give the same bits) and the records'
// stream with its prefetch.
//
// This header and the per-path ones (quant_gemm_scalar.h, quant_gemm_vnni.h, quant_gemm_amx.h,
// quant_gemm_avx2.h) are quant_gemm.cpp's alone: their code sits in its anonymous namespace, in
// its one translation unit, so the compiler inlines across them as it did when they were one file.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "prefetch.h"
#include "quant_gemm.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TF_QUANT_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TF_QUANT_AMX 1
#endif
#elif defined(__AVX2__)
#include <immintrin.h>
#define TF_QUANT_AVX2 1
#endif

namespace tf {
namespace {

using namespace quant;

// How far ahead of the record in use a group's loop asks for the next ones (about 2 KiB, whole
// records). A thread streams its groups' records front to back, but the hardware prefetcher stops
// at each 4 KiB page: without this, one-stream decode of the default model (dtype auto) ran
// 142-155 tok/s against 206-223 with it, four streams 330-343 against 434-459 (an Intel Xeon).
// Into L1: the L2 hint, which the dense GEMM takes, was slower here (one stream 179-200).
constexpr int64_t PREFETCH_BYTES = 2048;
constexpr int64_t TILE_ROWS = 16;  // an AMX tile's rows (the activation buffer's slack after the last row)
// Which GEMM call a thread runs (quant_linears_impl counts them): a column group made ready for
// the AMX tiles serves only its own call, since a later weight may sit where a freed one was.
std::atomic<uint64_t> gemm_calls{0};
thread_local uint64_t current_call = 0;

// I 2^shift as an integer: a left shift, or a right shift rounded half to even.
inline int64_t on_grid(int64_t value, int shift, int term_bits) {
  if (shift >= 0) return value << shift;
  const int down = std::min(-shift, term_bits + 1);
  const int64_t floor = value >> down;
  const int64_t rem = value - (floor << down);
  const int64_t half = int64_t{1} << (down - 1);
  return floor + ((rem > half || (rem == half && (floor & 1))) ? 1 : 0);
}

// One row's activations (quant_gemm.quantize_activations): per group of the kind's act columns
// (32, or 256 for the K-quants), xq int8 as llama.cpp rounds it (float32: d = amax / 127,
// xq = round_even(x (127 / amax))), the group's scale float16(d) = m 2^k with k - kmax kept (kmax
// the row's largest k), the sums of xq per sub-block, and for the 32-column kinds with a minimum
// the minimum term's float16(d sum xq) = sm 2^se per block (se - kmax kept). The K-quants'
// minimum takes the exact block sums of xq instead (xsum: their sub-blocks are the blocks).
struct RowQ {
  int8_t* xq = nullptr;  // blocks * 32 codes, in the batch's buffer: a GEMM's rows K apart (quant_linears_impl)
  std::vector<int32_t> m, kdelta;  // per activation group
  std::vector<int32_t> xsum;       // per sub-block
  std::vector<int32_t> sm, sdelta;  // per block (the 32-column kinds with a minimum)
  std::vector<double> mf, smf;  // m 2^kdelta and sm 2^sdelta (exact), the vector kernels' row factors
  int kmax = 0;
  // the smallest kdelta of the groups whose m is not 0, and the smallest shift of a nonzero
  // minimum term's row factor (sdelta; the K-quants': kdelta), 0 where none
  int kmin = 0, smin = 0;
};

// How far ahead of record_at a group's first row tile asks for records: PREFETCH_BYTES in whole
// records (past the group's last block, the next group's first, which the task streams next); 0
// (nothing) for the later row tiles, which find the group in cache.
inline int64_t prefetch_distance(const Layout& L, int64_t r0) {
  return r0 == 0 ? (PREFETCH_BYTES + L.record - 1) / L.record * L.record : 0;
}

// Block b of group g's record, asking for the one `ahead` bytes on into L1 and the one
// L2_AHEAD times as far into L2 (none when ahead is 0). The L2 requests keep more of the stream in
// flight than L1's few fill buffers allow: where a tile of rows takes longer over each block than
// the memory does (four streams, Q8_0), the stream no longer waits on the memory block by block
// (four rows of Q8_0, 8192 x 2048 from memory on the 2-core Zen 4: 0.75-0.79 -> 0.48-0.58 ms).
constexpr int64_t L2_AHEAD = 4;
inline const uint8_t* streamed_record(const uint8_t* packed, const Layout& L, int64_t g, int64_t b, int64_t ahead) {
  const uint8_t* rec = record_at(packed, L, g, b);
  if (ahead > 0) {
    prefetch_lines(rec + ahead, L.record);
    prefetch_lines<TO_L2>(rec + L2_AHEAD * ahead, L.record);
  }
  return rec;
}

}  // namespace
}  // namespace tf
