// The keyed sampler's draw for rows without an order-dependent cut (sampling/sampler.py: greedy
// rows, and sampled rows with top-k and top-p off), fused into two passes over the vocabulary
// instead of a dozen tensor-wide torch ops. The same bits as the torch steps:
//   greedy (T = 0): the first index of the largest logit;
//   sampled: z = double(x) / T, m = max z; token v is kept when z_v > -inf and, with min-p on,
//   floor(exp64(z_v - m) 2^32) >= min_q; the draw is the kept v with the largest z_v +
//   gumbel(row key, offset + v), ties to the lowest v.
// Maxima are exact, and the best (score, id) of two vocabulary chunks combine in any order, so the
// chunks, the threads and the other rows change nothing.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "exact64.h"
#include "kernels.h"

namespace tf {
namespace {

constexpr int64_t CHUNK = 4096;  // vocabulary entries per task

struct ChunkScan {
  bool nan = false, pos_inf = false;
  double top = -std::numeric_limits<double>::infinity();  // max x (greedy) or max z (sampled)
  int64_t top_id = -1;                                      // its first index
};

struct ChunkBest {
  double score = -std::numeric_limits<double>::infinity();
  int64_t id = -1;
};

}  // namespace

void draw_rows(const float* x, int64_t rows, int64_t vocab, const double* temps, const int64_t* keys,
               const int64_t* min_q, int64_t offset, int64_t* tokens, int32_t* status, int threads) {
  const int64_t chunks = (vocab + CHUNK - 1) / CHUNK, tasks = rows * chunks;
  std::vector<ChunkScan> scans(tasks);
  std::vector<ChunkBest> bests(tasks);
  std::vector<double> m(rows);
  std::vector<int64_t> top_id(rows);
  const double inf = std::numeric_limits<double>::infinity();
#pragma omp parallel num_threads(threads) if (threads > 1 && rows * vocab >= (1 << 14))
  {
    // Pass 1: NaN and +inf, and each chunk's largest logit (greedy) or scaled logit (sampled).
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t r = t / chunks, v0 = (t % chunks) * CHUNK, v1 = std::min(vocab, v0 + CHUNK);
      const float* row = x + r * vocab;
      ChunkScan& s = scans[t];
      const bool greedy = temps[r] == 0.0;
      for (int64_t v = v0; v < v1; ++v) {
        const double z = greedy ? static_cast<double>(row[v]) : static_cast<double>(row[v]) / temps[r];
        s.nan |= std::isnan(z);
        s.pos_inf |= !greedy && z == inf;  // a greedy row may hold +inf: its argmax
        if (z > s.top) {  // strict: the first index of the largest
          s.top = z;
          s.top_id = v;
        }
      }
    }
#pragma omp single
    for (int64_t r = 0; r < rows; ++r) {
      ChunkScan row{};
      for (int64_t c = 0; c < chunks; ++c) {
        const ChunkScan& s = scans[r * chunks + c];
        row.nan |= s.nan;
        row.pos_inf |= s.pos_inf;
        if (s.top > row.top) {  // chunks in order: ties keep the lower index
          row.top = s.top;
          row.top_id = s.top_id;
        }
      }
      m[r] = row.top;
      top_id[r] = row.top_id;
      status[r] = row.nan ? 1 : row.pos_inf ? 2 : row.top == -inf ? 3 : 0;
      tokens[r] = temps[r] == 0.0 ? offset + row.top_id : -1;
    }
    // Pass 2, sampled rows: each chunk's best kept (score, id). Most tokens are passed over
    // without their noise's two logarithms: with u the token's uniform, its noise g = -log(-log u)
    // is at most u / (1 - u) (log y <= y - 1, twice), so a token with z + u / (1 - u) + 1 below
    // a score already reached cannot win or tie (the 1 covers every rounding while |m| < 2^40;
    // above that each token's noise is computed). The score reached starts at the row's first
    // largest z, a token always kept (its min-p weight is 2^32); the winner's score is computed
    // as for every other, so the draw is the full computation's.
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t r = t / chunks, v0 = (t % chunks) * CHUNK, v1 = std::min(vocab, v0 + CHUNK);
      if (temps[r] == 0.0 || status[r] != 0) continue;
      const float* row = x + r * vocab;
      const uint64_t key = static_cast<uint64_t>(keys[r]);
      const bool bounded = std::fabs(m[r]) < 0x1p40;
      double reached = m[r] + gumbel(key, offset + top_id[r]);
      ChunkBest& b = bests[t];
      for (int64_t v = v0; v < v1; ++v) {
        const double z = static_cast<double>(row[v]) / temps[r];
        if (!(z > -inf)) continue;
        const double u = gumbel_uniform(key, offset + v);
        if (bounded && z + u / (1.0 - u) + 1.0 < reached) continue;
        if (min_q[r] > 0 && token_weight(z - m[r]) < min_q[r]) continue;
        const double score = z + gumbel_of_uniform(u);
        if (score > b.score) {  // strict: ties keep the lower id
          b.score = score;
          b.id = offset + v;
        }
        reached = std::max(reached, score);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (temps[r] == 0.0 || status[r] != 0) continue;
    ChunkBest best{};
    for (int64_t c = 0; c < chunks; ++c)
      if (bests[r * chunks + c].score > best.score) best = bests[r * chunks + c];
    tokens[r] = best.id;
  }
}

}  // namespace tf
