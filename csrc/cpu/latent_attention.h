// Multi-head latent attention and the DSA indexer's choice of keys (latent_attention.cpp;
// kernels/latent_attention.py), on raw pointers as kernels.h's.
#pragma once

#include <cstdint>

namespace tf {

// kernels/latent_attention.latent_attention for the rows of several sequences in one call. q [rows,
// heads, dim] float32; cache [blocks, block_size, dim] (cache_dtype: 0 float32, 1 bfloat16), each
// position's [latent, rope] vector, read through sequence s's block table (tables + s * width);
// sequence s owns rows [row_starts[s], row_starts[s + 1]); positions [rows]. selected: null (every
// row sees each key at or before its position) or [rows, top_k] int32, each row's chosen positions
// (-1 pads, entries past the row's position ignored). out [rows, heads, latent] float32.
void latent_attention(int cache_dtype, const float* q, const void* cache, const int64_t* positions,
                      const int64_t* tables, int64_t width, const int64_t* row_starts, int64_t num_seqs,
                      const int32_t* selected, int64_t top_k, int64_t heads, int64_t dim, int64_t latent,
                      int64_t block_size, float scale, float* out, int threads);

// kernels/latent_attention.indexer_scores then select_top_keys, for the rows of several sequences:
// q [rows, heads, dim] float32, weights [rows, heads] float32, keys [blocks, block_size, dim]
// (keys_dtype) read as latent_attention's cache. out [rows, top_k] int32: each row's top_k keys
// among those at or before its position, ties to the lower position, ascending, -1 padded (a row
// that sees top_k keys or fewer takes them all).
void dsa_select(int keys_dtype, const float* q, const float* weights, const void* keys, const int64_t* positions,
                const int64_t* tables, int64_t width, const int64_t* row_starts, int64_t num_seqs, int64_t heads,
                int64_t dim, int64_t block_size, float scale, int64_t top_k, int32_t* out, int threads);

}  // namespace tf
