// What every binding shares: dtype codes, checks, the thread count, `out=` handling.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace tf_binding {

inline int dtype_code(const torch::Tensor& t, const char* what) {
  if (t.scalar_type() == torch::kFloat32) return 0;
  if (t.scalar_type() == torch::kBFloat16) return 1;
  TORCH_CHECK(false, what, ": the cpu kernels take float32 or bfloat16, got ", t.scalar_type());
}

inline void check_cpu(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
}

inline int threads() { return at::get_num_threads(); }

using Out = c10::optional<torch::Tensor>;

// The caller's `out` (checked) or a new tensor: tests pass NaN-filled ones, so a kernel that
// leaves an element unwritten fails.
inline torch::Tensor output(const Out& out, torch::IntArrayRef sizes, const torch::Tensor& like, const char* what) {
  if (!out) return torch::empty(sizes, like.options());
  TORCH_CHECK(out->sizes() == sizes && out->scalar_type() == like.scalar_type() && out->is_contiguous() &&
                  out->device().is_cpu(),
              what, ": out must be a contiguous CPU tensor of shape ", sizes, " and dtype ", like.scalar_type());
  return *out;
}

// The rows of an attention call against their sequences' block tables: every block a row can read
// exists (the kernels index the cache with these numbers unchecked).
inline void check_rows(const int64_t* row_starts, int64_t num_seqs, int64_t num_rows, const int64_t* positions,
                       const int64_t* tables, int64_t width, int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(row_starts[0] == 0 && row_starts[num_seqs] == num_rows,
              "paged_attention: row_starts must run from 0 to the number of rows");
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(row_starts[s] <= row_starts[s + 1], "paged_attention: row_starts must not decrease");
    for (int64_t r = row_starts[s]; r < row_starts[s + 1]; ++r) {
      TORCH_CHECK(positions[r] >= 0 && positions[r] / block_size < width, "paged_attention: position ", positions[r],
                  " past its table");
      for (int64_t b = 0; b <= positions[r] / block_size; ++b)
        TORCH_CHECK(tables[s * width + b] >= 0 && tables[s * width + b] < num_blocks,
                    "paged_attention: block out of range");
    }
  }
}

// Cache slots in range (the cache write indexes with them unchecked).
inline void check_slots(const int64_t* slots, int64_t count, int64_t num_slots) {
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "write_kv: slot out of range");
}

// A cache's record of its V rows' exponents (write_kv's v_exp): int16 [blocks, block_size,
// kv_heads], contiguous, beside a cache [blocks, block_size, kv_heads, head_dim]; null when absent.
inline int16_t* exponent_record(const c10::optional<torch::Tensor>& v_exp, const torch::Tensor& cache,
                                const char* what) {
  if (!v_exp) return nullptr;
  TORCH_CHECK(v_exp->device().is_cpu() && v_exp->scalar_type() == torch::kInt16 && v_exp->is_contiguous() &&
                  v_exp->dim() == 3 && v_exp->sizes() == cache.sizes().slice(0, 3),
              what, ": v_exp must be a contiguous int16 CPU tensor [blocks, block_size, kv_heads] beside the cache");
  return v_exp->data_ptr<int16_t>();
}

// A delta_net call's recurrent state and its slots (kernels.h: delta_net), checked: float32 states
// of matching shapes, one state_in per sequence and one state_out per row, every block in range,
// and no block written by two sequences (the kernel indexes with these numbers unchecked).
struct StateSlots {
  torch::Tensor in_, out_, starts_;  // int64, contiguous
  int64_t num_seqs;
  const int64_t* in() const { return in_.data_ptr<int64_t>(); }
  const int64_t* out() const { return out_.data_ptr<int64_t>(); }
  const int64_t* starts() const { return starts_.data_ptr<int64_t>(); }
};

inline StateSlots state_slots(const torch::Tensor& conv_state, const torch::Tensor& ssm_state,
                              const torch::Tensor& state_in, const torch::Tensor& state_out,
                              const torch::Tensor& row_starts, int64_t rows, int64_t C, int64_t K, int64_t num_heads,
                              int64_t key_dim, int64_t value_dim) {
  check_cpu(conv_state, "delta_net: conv_state");
  check_cpu(ssm_state, "delta_net: ssm_state");
  TORCH_CHECK(conv_state.scalar_type() == torch::kFloat32 && conv_state.is_contiguous() && conv_state.dim() == 3 &&
                  conv_state.size(1) == K - 1 && conv_state.size(2) == C,
              "delta_net: conv_state a contiguous float32 [blocks, ", K - 1, ", ", C, "] expected, got ",
              conv_state.sizes());
  const int64_t num_blocks = conv_state.size(0);
  TORCH_CHECK(ssm_state.scalar_type() == torch::kFloat32 && ssm_state.is_contiguous() &&
                  ssm_state.sizes() == torch::IntArrayRef({num_blocks, num_heads, key_dim, value_dim}),
              "delta_net: ssm_state a contiguous float32 [", num_blocks, ", ", num_heads, ", ", key_dim, ", ",
              value_dim, "] expected, got ", ssm_state.sizes());
  check_cpu(state_in, "delta_net: state_in");
  check_cpu(state_out, "delta_net: state_out");
  check_cpu(row_starts, "delta_net: row_starts");
  StateSlots slots{state_in.to(torch::kInt64).contiguous(), state_out.to(torch::kInt64).contiguous(),
                   row_starts.to(torch::kInt64).contiguous(), state_in.numel()};
  const int64_t num_seqs = slots.num_seqs;
  TORCH_CHECK(slots.starts_.numel() == num_seqs + 1, "delta_net: one state_in per sequence (row_starts has ",
              slots.starts_.numel(), " entries, state_in ", num_seqs, ")");
  TORCH_CHECK(slots.out_.numel() == rows, "delta_net: one state_out per row");
  const int64_t *st = slots.starts(), *si = slots.in(), *so = slots.out();
  TORCH_CHECK(st[0] == 0 && st[num_seqs] == rows, "delta_net: row_starts must run from 0 to the number of rows");
  std::vector<std::pair<int64_t, int64_t>> written;  // (block, sequence)
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(st[s] <= st[s + 1], "delta_net: row_starts must not decrease");
    TORCH_CHECK(si[s] >= -1 && si[s] < num_blocks, "delta_net: state_in block ", si[s], " out of range");
    for (int64_t r = st[s]; r < st[s + 1]; ++r) {
      TORCH_CHECK(so[r] >= -1 && so[r] < num_blocks, "delta_net: state_out block ", so[r], " out of range");
      if (so[r] >= 0) written.push_back({so[r], s});
    }
  }
  std::sort(written.begin(), written.end());
  for (size_t i = 1; i < written.size(); ++i)
    TORCH_CHECK(written[i].first != written[i - 1].first || written[i].second == written[i - 1].second,
                "delta_net: block ", written[i].first, " written by two sequences");
  return slots;
}

}  // namespace tf_binding
