// The cpu backend's exact kernels on raw pointers (no torch types: module.cpp binds them).
// Each is bitwise equal to its torch reference in tensorfold/kernels (reference.py,
// paged_attention.py): the rule is tensorfold/exact's, and the file of each kernel says how.
#pragma once

#include <cstdint>
#include <string>

namespace tf {

const char* isa();  // the vector code compiled in: avx512, avx2, neon or scalar

// The GEMM: x [M, K] (row-major) @ w[N, K]^T -> out [M, N], with w packed once by pack_weight
// into packed_numel(N, K) elements. `dtype` 0: float32, 1: bfloat16 (here and below).
int64_t packed_numel(int dtype, int64_t N, int64_t K);
const char* pair_steps();  // how the bfloat16 GEMM runs its steps: "vdpbf16ps", "fma-mxcsr" or "emulated"
void pack_weight(int dtype, const void* w, void* packed, int64_t N, int64_t K);
void linear(int dtype, const void* x, const void* packed, void* out, int64_t M, int64_t N, int64_t K, int threads);

// The exact quantized GEMM (kernels/quant_gemm.py): x [M, K] against w [N, K] in blocks, packed
// once by pack_quant from the reference's QuantWeight fields (kind: the index in
// quant_gemm.TYPES; codes [N, K], scale [N, K / sub], scale_exp, min, min_exp [N, K / 32]; min and
// min_exp null for the types without a minimum) into quant_packed_bytes(kind, form, N, K) bytes,
// form = quant_pack_form(...) (how the scales are kept), which carry their kind and shape
// (quant_packed_matches checks them). out [M, N] in x's dtype.
int quant_pack_form(int kind, const int32_t* scale, const int32_t* scale_exp, const int32_t* min,
                    const int32_t* min_exp, int64_t N, int64_t K, int threads);
int64_t quant_packed_bytes(int kind, int form, int64_t N, int64_t K);
void pack_quant(int kind, int form, const int8_t* codes, const int32_t* scale, const int32_t* scale_exp,
                const int32_t* min, const int32_t* min_exp, uint8_t* packed, int64_t N, int64_t K, int threads);
bool quant_packed_matches(const uint8_t* packed, int64_t bytes, int64_t N, int64_t K);
// The same bytes straight from a GGUF's blocks (gguf_quants.FileBlocks): row n of K weights at
// row_offsets[n] of the open file fd (stacked parts, a rope row order), packed into `packed`
// (quant_packed_bytes(kind, quant_file_form(kind), N, K) bytes, the caller's) a group of 16 rows
// at a time. Returns "" or what is wrong with the bytes (a short read, an infinite or NaN scale).
int quant_file_form(int kind);
int64_t quant_file_row_bytes(int kind, int64_t K);
std::string pack_quant_file(int kind, int fd, const int64_t* row_offsets, int64_t N, int64_t K, uint8_t* packed,
                            int threads);
// Rows `ids` of a packed weight as float32 [count, K] (QuantWeight.rows(ids).dequantize()).
void quant_rows(const uint8_t* packed, const int64_t* ids, int64_t count, float* out, int64_t N, int64_t K);
void quant_linear(int dtype, const void* x, const uint8_t* packed, void* out, int64_t M, int64_t N, int64_t K,
                  int threads);
// Several quantized GEMMs in one parallel region (out_j = x_j @ w_j^T, each as quant_linear
// computes it): what a token's experts run as, one fork for all of them.
struct QuantJob {
  const void* x;
  const uint8_t* packed;
  void* out;
  int64_t M, N, K;
  int64_t out_stride = 0;  // elements from one output row to the next (0: N, rows back to back)
};
void quant_linears(int dtype, const QuantJob* jobs, int64_t count, int threads);
// Prompt rows' block dots on AMX-INT8 tiles (where the build and the CPU have them and the kernel
// grants the tile state), else on AVX-512 VNNI: the same integers, so the same bits either way.
// quant_amx_path: which the GEMM takes ("amx", or why not); set_quant_amx(false) keeps it off
// (tests compare both), returning whether it was allowed before.
const char* quant_amx_path();
bool set_quant_amx(bool allowed);

// One GEMM of either kind: `w` a dense packed weight (pack_weight) when `quant` is false, else a
// packed quantized one.
inline void matmul(int dtype, const void* x, const void* w, bool quant, void* out, int64_t M, int64_t N, int64_t K,
                   int threads) {
  if (quant)
    quant_linear(dtype, x, static_cast<const uint8_t*>(w), out, M, N, K, threads);
  else
    linear(dtype, x, w, out, M, N, K, threads);
}

// Row-wise ops over `rows` vectors of `width` elements.
// rms_norm: out = norm(x) * weight; with `residual` (may be null), h = residual + x is written to
// `h_out` first and normalized. Strides are in elements, between rows.
void rms_norm(int dtype, const void* x, int64_t x_stride, const void* residual, int64_t r_stride,
              void* h_out, const void* weight, void* out, int64_t rows, int64_t width, double eps,
              int threads);
// x [tokens, heads, head_dim] (heads contiguous, tokens x_stride apart) into out (contiguous);
// cos/sin [tokens, head_dim] float32. With `norm_weight` (may be null), each head vector is
// RMS-normalized (rounded to the dtype) before the rotation.
void rope(int dtype, const void* x, int64_t x_stride, void* out, const float* cos, const float* sin, int64_t tokens,
          int64_t heads, int64_t head_dim, const void* norm_weight, double eps, int threads);
// The same over heads head_stride apart (q beside its output gate) with rope over the first
// rope_dim elements of each head (cos/sin [tokens, rope_dim]) and the rest copied (partial rope).
void rope_heads(int dtype, const void* x, int64_t x_stride, int64_t head_stride, void* out, const float* cos,
                const float* sin, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rope_dim,
                const void* norm_weight, double eps, int threads);
// out [rows, width] = silu(gate) * up, gate/up rows at their strides.
void silu_and_mul(int dtype, const void* gate, const void* up, int64_t in_stride, void* out,
                  int64_t rows, int64_t width, int threads);
// out [rows, width] = sigmoid(gate) * up (an attention's output gate), the same layout.
void sigmoid_and_mul(int dtype, const void* gate, const void* up, int64_t in_stride, void* out,
                     int64_t rows, int64_t width, int threads);
// out [rows, width] = gelu(gate) * up with GELU's tanh form (Gemma's GeGLU), the same layout.
void gelu_tanh_and_mul(int dtype, const void* gate, const void* up, int64_t in_stride, void* out,
                       int64_t rows, int64_t width, int threads);
// out[i] = relu(x[i])^2 in the dtype (reference.relu_squared: Nemotron-H's MLPs), n elements.
void relu_squared(int dtype, const void* x, void* out, int64_t n, int threads);
// out[i] = cap tanh32(x[i] / cap) (reference.softcap: Gemma's final logit soft-capping), float32.
void softcap(const float* x, float* out, int64_t n, float cap, int threads);

// The widest attention head that rope, write_kv, paged_attention and the fused DecoderLayer take
// (their bindings check it; fixed-size row buffers are this long): kernels/paged_attention.py's
// MAX_HEAD_DIM, where the bound is worked out. q.k sums head_dim products of |q_int| <= 2^22 and
// |k_int| < 2^22 on one grid: 512 of them stay below 2^53, exact in float64 in any order.
constexpr int64_t MAX_HEAD_DIM = 512;

// The exact attention's grids (kernels/paged_attention.py): K/V and q bits, the softmax weights'
// and denominator's fixed points, keys per exact float64 chunk of the weighted sum. Shared by the
// paged attention (attention.cpp) and the latent attention (latent_attention.cpp).
namespace attention_grid {
constexpr int QK_BITS = 22;
constexpr int V_BITS = 20;
constexpr int W_BITS = 24;
constexpr int L_BITS = 30;
constexpr int64_t SPLIT_SIZE = 512;
}  // namespace attention_grid

// The cache has a dtype of its own, `cache_dtype` (same codes): a bfloat16 cache may serve float32
// activations and the reverse.
// k, v [tokens, kv_heads, head_dim] of `dtype` (tokens k_stride / v_stride apart) into the cache
// slots, each vector rounded to the cache's dtype, then put on its fixed-point grid. v_exp, when
// not null ([slots][kv_heads] int16), records each stored V row's exponent (that of its largest
// magnitude): what the attention would otherwise read the V rows for in its first pass.
void write_kv(int dtype, int cache_dtype, void* k_cache, void* v_cache, int16_t* v_exp, const void* k,
              int64_t k_stride, const void* v, int64_t v_stride, const int64_t* slots, int64_t tokens,
              int64_t kv_heads, int64_t head_dim, int threads);
// Rows of several sequences: sequence s owns rows [row_starts[s], row_starts[s + 1]) of q
// [rows, heads, head_dim] and row s of tables [num_seqs, table_width]. window <= 0: none. q and
// out are of `dtype`, the caches of `cache_dtype`. v_exp: write_kv's record, or null (then the
// exponents are read from V).
void paged_attention(int dtype, int cache_dtype, const void* q, const void* k_cache, const void* v_cache,
                     const int16_t* v_exp, void* out, const int64_t* positions, const int64_t* tables,
                     int64_t table_width, const int64_t* row_starts, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, int64_t block_size, double scale, int64_t window, int threads);

// Gated DeltaNet's mixing over the rows of several sequences (delta_net.cpp; kernels/delta_net.py:
// delta_net). qkv [rows, C] of `dtype` (rows qkv_stride apart), C = 2 key_heads key_dim + heads
// value_dim; a, b [rows, heads] float32; conv_state [blocks, K - 1, C] and ssm_state [blocks, heads,
// key_dim, value_dim] float32: sequence s (rows [row_starts[s], row_starts[s + 1])) starts from block
// state_in[s] (-1: zeros), and the state after row r is written to block state_out[r] (-1: none);
// every starting state is read before any is written, and no block is written by two sequences
// (the caller checks). conv_taps [K, C] (the conv weight [C, K] transposed: tap-major, as the
// conv reads it), rate and dt_bias [heads] float32. out [rows, heads,
// value_dim] of `dtype`. key_dim <= 256 (the grid dots' exact sums).
void delta_net(int dtype, const void* qkv, int64_t qkv_stride, const float* a, const float* b, float* conv_state,
               float* ssm_state, const int64_t* state_in, const int64_t* state_out, const int64_t* row_starts,
               int64_t num_seqs, const float* conv_taps, int64_t conv_kernel, const float* rate,
               const float* dt_bias, int64_t key_heads, int64_t heads, int64_t key_dim, int64_t value_dim, void* out,
               int threads);
// reference.layer_norm: out [rows, width] = (x - mean) / sqrt(var + eps) * weight + bias per row, the
// mean and the variance from exact sums (norm.cpp); weight and bias [width] in x's dtype.
void layer_norm(int dtype, const void* x, const void* weight, const void* bias, void* out, int64_t rows, int64_t width,
                double eps, int threads);
// delta_net.gated_rms_norm: out [rows, width] (x's dtype) = rms_norm(x) * weight * silu(gate); x
// contiguous, gate rows gate_stride apart, each of its own dtype code.
void gated_rms_norm(int dtype, const void* x, int gate_dtype, const void* gate, int64_t gate_stride,
                    int weight_dtype, const void* weight, void* out, int64_t rows, int64_t width, double eps,
                    int threads);

// The MoE router's choice (moe.cpp; kernels/moe.route): logits [rows, experts] float32 -> chosen
// [rows, top_k] (the largest first, ties to the lower index) and their weights [rows, top_k].
void moe_route(const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool normalize, int64_t* chosen,
               float* weights, int threads);
// Sigmoid routing with a correction bias and group-limited choice (moe.cpp; kernels/moe.route_sigmoid:
// GLM-5, Nemotron-H): logits [rows, experts] float32, bias [experts] float32 -> chosen [rows, top_k]
// and their weights (the chosen experts' sigmoid scores, normalized where asked, times scale).
void moe_route_sigmoid(const float* logits, const float* bias, int64_t rows, int64_t experts, int64_t top_k,
                       int64_t n_group, int64_t topk_group, bool normalize, double scale, int64_t* chosen,
                       float* weights, int threads);
// The MoE's sum (kernels/moe.combine: MoE.compose's): out [rows, hidden] = each row's expert outputs (row j of
// its choice at y [y_rows[r * top_k + j]], y [*, hidden]) times weights, added in ascending expert
// index, plus sigmoid(shared_gate [rows]) * shared [rows, hidden] when shared is not null (plus
// shared alone when shared_gate is null: GLM-5's ungated shared experts).
void moe_combine(int dtype, const void* y, const int64_t* y_rows, const int64_t* chosen, const float* weights,
                 int64_t rows, int64_t top_k, const void* shared_gate, const void* shared, void* out, int64_t hidden,
                 int threads);

// The keyed sampler's draw of rows without an order-dependent cut (draw.cpp): x [rows, vocab]
// float32 logits (global ids offset ..), temps [rows] (0: greedy), keys [rows] the rows' noise
// keys, min_q [rows] (0: min-p off). tokens [rows]; status [rows]: 0 drawn, 1 a NaN logit, 2 a
// scaled logit at +inf, 3 no drawable token.
void draw_rows(const float* x, int64_t rows, int64_t vocab, const double* temps, const int64_t* keys,
               const int64_t* min_q, int64_t offset, int64_t* tokens, int32_t* status, int threads);

}  // namespace tf
