// What the two recurrent mixers (delta_net.cpp: Gated DeltaNet, mamba2.cpp: Mamba2) share: the
// short causal conv's steps, the float64 softplus and SiLU of their references, and a batch's
// starting states read from the recurrent cache before anything is written.
//
// The state cache: block b holds a conv window [W, C] (the last W = K - 1 inputs) in `conv` and a
// state of `state_elements` floats in `ssm`. Sequence s (rows [row_starts[s], row_starts[s + 1]))
// starts from block state_in[s] (zeros at -1), and the state after row r is written to block
// state_out[r] unless that is -1. Every starting state is read before any is written: the windows
// are copied here, and a state block that one sequence starts from and another writes is copied
// too (a sequence's own work items read their start before they write it). A block written by two
// sequences is refused by the caller (binding.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "exact.h"
#include "exact64.h"
#include "vec16.h"

namespace tf {
namespace recurrent {

constexpr double SOFTPLUS_THRESHOLD = 20.0;

// softplus32 (delta_net.softplus32): log64(1 + exp64(min(y, 20))) in float64, rounded once; y above
// 20 is itself.
inline float softplus32(float y) {
  const double y64 = y;
  const double c = y64 > SOFTPLUS_THRESHOLD ? SOFTPLUS_THRESHOLD : y64;  // clamp_max: NaN stays NaN
  const double soft = log64(1.0 + exp64(c));
  return static_cast<float>(y64 > SOFTPLUS_THRESHOLD ? y64 : soft);
}

// silu32 of n floats in place: t = exp_neg(-|g|), (g >= 0 ? g : g t) / (1 + t). tmp, t: n floats.
// (Eight lanes at a time as a compiler vector: the same operations, a blend for the branch.)
inline void silu_inplace(float* g, float* tmp, float* t, int64_t n) {
  for (int64_t i = 0; i < n; ++i) tmp[i] = -std::fabs(g[i]);
  exp_neg_shifted(tmp, 0.0f, t, n);  // exp_neg(-|g| - 0): -|g| - 0 is -|g| bit for bit
  int64_t i = 0;
#if defined(__GNUC__)
  typedef float f32x8 __attribute__((vector_size(32)));
  const f32x8 zero = f32x8{} + 0.0f, one = f32x8{} + 1.0f;
  for (; i + 8 <= n; i += 8) {
    f32x8 gi, ti;
    std::memcpy(&gi, g + i, sizeof gi);
    std::memcpy(&ti, t + i, sizeof ti);
    const f32x8 factor = gi >= zero ? one : ti;
    const f32x8 out = (gi * factor) / (one + ti);
    std::memcpy(g + i, &out, sizeof out);
  }
#endif
  for (; i < n; ++i) g[i] = (g[i] * (g[i] >= 0.0f ? 1.0f : t[i])) / (1.0f + t[i]);  // g * 1 is g
}

// One tap of the conv over a row: acc = x w (the first tap), else acc + x w (x widened exactly).
template <typename X>
inline void conv_tap(const X* x, const float* w, float* acc, int64_t n, bool first) {
  if (first)
    for (int64_t i = 0; i < n; ++i) acc[i] = to_f32(x[i]) * w[i];
  else
    for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + to_f32(x[i]) * w[i];
}

// A batch's starting states: each row's sequence, each sequence's window (copied) and state (in
// the cache, or a copy where another sequence of the batch writes that block; nullptr: zeros).
struct Starts {
  std::vector<int64_t> seq_of_row;
  std::vector<float> windows;        // [num_seqs, W, C]
  std::vector<const float*> states;  // [num_seqs]
  std::vector<float> copies;

  Starts(int64_t num_seqs, const int64_t* row_starts, const int64_t* state_in, const int64_t* state_out,
         const float* conv, const float* ssm, int64_t W, int64_t C, int64_t state_elements)
      : seq_of_row(row_starts[num_seqs]), windows(num_seqs * W * C, 0.0f), states(num_seqs, nullptr) {
    const int64_t rows = row_starts[num_seqs];
    for (int64_t s = 0; s < num_seqs; ++s)
      for (int64_t r = row_starts[s]; r < row_starts[s + 1]; ++r) seq_of_row[r] = s;
    for (int64_t s = 0; s < num_seqs; ++s) {
      if (row_starts[s + 1] == row_starts[s] || state_in[s] < 0) continue;
      if (W > 0) std::memcpy(windows.data() + s * W * C, conv + state_in[s] * W * C, W * C * sizeof(float));
      states[s] = ssm + state_in[s] * state_elements;
    }
    std::vector<std::pair<int64_t, int64_t>> read;  // (block, sequence) of every starting state
    for (int64_t s = 0; s < num_seqs; ++s)
      if (states[s] != nullptr) read.push_back({state_in[s], s});
    std::sort(read.begin(), read.end());
    std::vector<char> copy(num_seqs, 0);
    bool any_copy = false;
    for (int64_t r = 0; r < rows && !read.empty(); ++r) {
      const int64_t slot = state_out[r];
      if (slot < 0) continue;
      for (auto it = std::lower_bound(read.begin(), read.end(), std::make_pair(slot, int64_t{-1}));
           it != read.end() && it->first == slot; ++it)
        if (it->second != seq_of_row[r]) copy[it->second] = any_copy = true;
    }
    if (!any_copy) return;
    copies.resize(num_seqs * state_elements);
    for (int64_t s = 0; s < num_seqs; ++s)
      if (copy[s]) {
        std::memcpy(copies.data() + s * state_elements, states[s], state_elements * sizeof(float));
        states[s] = copies.data() + s * state_elements;
      }
  }
};

// The conv windows after each row state_out names: rows t + 1 .. t + W of the sequence's padded
// inputs (its starting window, then its rows of x, widened exactly).
template <typename T>
inline void write_windows(const Starts& starts, const int64_t* row_starts, const int64_t* state_out, float* conv,
                          const T* x, int64_t x_stride, int64_t W, int64_t C) {
  if (W == 0) return;
  const int64_t rows = static_cast<int64_t>(starts.seq_of_row.size());
  for (int64_t r = 0; r < rows; ++r) {
    if (state_out[r] < 0) continue;
    const int64_t s = starts.seq_of_row[r], t = r - row_starts[s];
    float* dst = conv + state_out[r] * W * C;
    for (int64_t i = 0; i < W; ++i) {
      const int64_t u = t + 1 + i;
      if (u < W) {
        std::memcpy(dst + i * C, starts.windows.data() + (s * W + u) * C, C * sizeof(float));
      } else {
        const T* row = x + (row_starts[s] + u - W) * x_stride;
        for (int64_t ch = 0; ch < C; ++ch) dst[i * C + ch] = to_f32(row[ch]);
      }
    }
  }
}

// The recurrence's work items: (sequence s, head h, state columns [j0, j1)), each row of a head's
// state `width` columns of float32. An item is `run` columns (a cache line's) doubled while every
// thread keeps ITEMS_PER_THREAD items or more, up to the whole row: one thread then reads a row's
// neighbouring lines, which the core's prefetchers bring in together (with an item per line, two
// threads took alternate lines of every row, each fetched the other's too, and two threads were
// no faster than one). Any split gives the same bits: a column never reads another.
struct WorkItem {
  int64_t s, h, j0, j1;
};
constexpr int64_t ITEMS_PER_THREAD = 4;

inline int64_t item_columns(int64_t seq_heads, int64_t width, int threads, int64_t run) {
  int64_t columns = run;
  while (columns < width && seq_heads * ((width + 2 * columns - 1) / (2 * columns)) >= ITEMS_PER_THREAD * threads)
    columns *= 2;
  return columns;
}

// Every sequence's items (those with rows), the longest sequences first.
inline std::vector<WorkItem> work_items(int64_t num_seqs, const int64_t* row_starts, int64_t heads, int64_t width,
                                        int threads, int64_t run) {
  auto length = [&](int64_t s) { return row_starts[s + 1] - row_starts[s]; };
  int64_t seq_heads = 0;
  for (int64_t s = 0; s < num_seqs; ++s) seq_heads += length(s) > 0 ? heads : 0;
  const int64_t columns = item_columns(seq_heads, width, threads, run);
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    if (length(s) > 0)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j0 = 0; j0 < width; j0 += columns) items.push_back({s, h, j0, std::min(width, j0 + columns)});
  std::stable_sort(items.begin(), items.end(),
                   [&](const WorkItem& x, const WorkItem& y) { return length(x.s) > length(y.s); });
  return items;
}

}  // namespace recurrent
}  // namespace tf
