// Mamba2's kernels (mamba2.cpp; kernels/mamba2.py), on raw pointers as kernels.h's.
#pragma once

#include <cstdint>

namespace tf {

// Mamba2's mixing over the rows of several sequences (kernels/mamba2.py: mamba2). xbc [rows, C] of
// `dtype` (rows xbc_stride apart), C = heads head_dim + 2 groups state_size (x, then B and C of
// each group); dt [rows, heads] float32; conv_state [blocks, K - 1, C] and ssm_state [blocks, heads,
// state_size, head_dim] float32: sequence s (rows [row_starts[s], row_starts[s + 1])) starts from
// block state_in[s] (-1: zeros), and the state after row r is written to block state_out[r] (-1:
// none); no block is written by two sequences (the caller checks). conv_taps [K, C] (the conv
// weight [C, K] transposed), conv_bias [C] or null, rate, dt_bias and d [heads] float32, dt clamped
// to [dt_min, dt_max]. out [rows, heads, head_dim] float32 (the D skip added, before the gated
// norm). state_size <= 256 (the grid dot's exact sums); heads a multiple of groups.
void mamba2(int dtype, const void* xbc, int64_t xbc_stride, const float* dt, float* conv_state, float* ssm_state,
            const int64_t* state_in, const int64_t* state_out, const int64_t* row_starts, int64_t num_seqs,
            const float* conv_taps, const float* conv_bias, int64_t conv_kernel, const float* rate,
            const float* dt_bias, const float* d, float dt_min, float dt_max, int64_t heads, int64_t head_dim,
            int64_t groups, int64_t state_size, float* out, int threads);

// mamba2.gated_group_norm: y [rows, width] float32 (contiguous), z rows z_stride apart (dtype code
// z_dtype), weight [width]; out [rows, width] (out_dtype: torch's promotion of dtype and the
// weight's) = (rms_norm of each of `groups` slices of y silu(z), rounded to dtype) * weight.
void mamba2_gated_norm(const float* y, int z_dtype, const void* z, int64_t z_stride, int weight_dtype,
                       const void* weight, int dtype, int out_dtype, void* out, int64_t rows, int64_t width,
                       int64_t groups, double eps, int threads);

}  // namespace tf
