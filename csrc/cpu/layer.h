// The fused decoder layers (layer.cpp): a llama/qwen3 layer and a Gated DeltaNet layer of the Qwen
// hybrids, each built once at load from its fixed parts (weights, norms, shapes), then run once
// per forward on a batch.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <tuple>
#include <vector>

// A layer's shapes and constants, fixed at load.
struct LayerShape {
  int64_t num_heads, num_kv_heads, head_dim, hidden, intermediate;
  double eps, scale;
  int64_t window;       // 0: none
  int64_t rope_dim;     // rope over the first rope_dim of each head (head_dim: all of it)
  bool output_gate;     // Qwen3.5's gated attention: q_proj gives [q, gate] per head, out * sigmoid(gate)
};

// A GEMM weight [n, k] as the layer keeps it: packed dense (pack_weight, in the layer's dtype) or
// packed quantized (pack_quant, uint8).
struct LayerGemm {
  torch::Tensor packed;
  bool quant;
  int64_t n, k;
};

// A mixture-of-experts feed-forward's shapes (models/moe.py: MoESpec).
struct MoEShape {
  int64_t hidden, experts, top_k, intermediate, shared_intermediate;  // shared_intermediate 0: no shared expert
  bool normalize;                                                     // norm_topk_prob
  int64_t activation;  // the experts' gate: 0 SiLU (SwiGLU), 1 GELU's tanh form (GeGLU: Gemma 4)
  // n_group > 0: sigmoid routing (models/moe.SigmoidRouting, GLM-5's noaux_tc: route_sigmoid with the
  // block's correction bias, n_group / topk_group, weights times route_scale), the router in float32
  // on x in float32; 0: route's softmax, the router in x's dtype
  int64_t n_group = 0, topk_group = 0;
  double route_scale = 1.0;
  bool shared_gated = true;  // false: the shared expert's output added without a gate (GLM-5's)
};

// Qwen3.6 / Qwen3-Next's, Gemma 4's and GLM-5's MoE feed-forward in one call (models/moe.MoE.forward,
// the same bits): router GEMM, route (softmax, or GLM-5's sigmoid routing with its correction bias),
// the weights times a per-expert scale where the block has one (Gemma 4), tokens grouped by expert
// through each chosen expert's SwiGLU or GeGLU GEMMs, the shared expert (sigmoid-gated, or added
// as it is: GLM-5), and the sum in ascending expert order. Every GEMM weight is packed,
// dense ones in one dtype (x's), quantized ones in any of the quantized kinds.
class __attribute__((visibility("hidden"))) MoEBlock {
 public:
  MoEBlock(const torch::Tensor& router, const std::vector<torch::Tensor>& gate_ups,
           const std::vector<torch::Tensor>& downs, const c10::optional<torch::Tensor>& shared_gate_up,
           const c10::optional<torch::Tensor>& shared_down, const c10::optional<torch::Tensor>& shared_gate,
           const MoEShape& shape, const c10::optional<torch::Tensor>& expert_scale = c10::nullopt,
           const c10::optional<torch::Tensor>& route_bias = c10::nullopt);

  // x [tokens, hidden] -> [tokens, hidden], x's dtype. router_x: the router's input where it is not
  // x (Gemma 4 routes on its own norm of the residual), [tokens, hidden] in x's dtype.
  torch::Tensor forward(const torch::Tensor& x, const c10::optional<torch::Tensor>& router_x = c10::nullopt) const;

  const MoEShape& shape() const { return shape_; }
  int dense_code() const { return code_; }

 private:
  MoEShape shape_;
  int code_;  // the dense weights' dtype code, -1 when every weight is quantized
  LayerGemm router_, shared_gate_up_, shared_down_, shared_gate_;
  std::vector<LayerGemm> gate_ups_, downs_;
  torch::Tensor expert_scale_;  // float32 [experts], or undefined: none
  torch::Tensor route_bias_;    // float32 [experts]: sigmoid routing's correction bias (n_group > 0)
};

// A layer's feed-forward: a SwiGLU MLP (gate_up [2 intermediate, hidden], down) or a mixture of
// experts (moe; the MLP's fields unused), shared with the Python block that built it.
struct LayerFFN {
  LayerGemm gate_up, down;
  int64_t intermediate = 0;
  std::shared_ptr<const MoEBlock> moe;
};

// What one forward brings: the batch's rows and the layer's part of the cache.
struct LayerBatch {
  torch::Tensor x, residual;               // [tokens, hidden], the layer's dtype
  c10::optional<torch::Tensor> next_norm;  // the next layer's input norm [hidden]; none after the last layer
  torch::Tensor cos, sin;                  // float32 [tokens, head_dim]
  torch::Tensor k_cache, v_cache;          // [blocks, block_size, num_kv_heads, head_dim], written in place
  c10::optional<torch::Tensor> v_exp;      // write_kv's record of V's exponents [blocks, block_size, num_kv_heads]
  torch::Tensor slots, positions;          // int64 [tokens]
  torch::Tensor tables, row_starts;        // int64 [seqs, width], [seqs + 1]
};

// The layer's weights are checked once, here, and kept alive for as long as the layer is.
// The layer's dtype (float32 or bfloat16) is post_norm's: x, the norms and dense weights take it.
// Hidden, as pybind11's own types are: module.cpp binds it (py::class_), and a class visible beyond
// the extension would outlive pybind11's hidden base.
class __attribute__((visibility("hidden"))) DecoderLayer {
 public:
  // The feed-forward: gate_up and down (shape.intermediate), or moe (then neither).
  // qkv: its packed parts side by side (one, or several: Q4_K_M files keep v in Q6_K beside q and k
  // in Q4_K), qkv_widths their output widths.
  DecoderLayer(const std::vector<torch::Tensor>& qkv, const std::vector<int64_t>& qkv_widths,
               const torch::Tensor& o, const c10::optional<torch::Tensor>& gate_up,
               const c10::optional<torch::Tensor>& down, const torch::Tensor& post_norm,
               const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
               const LayerShape& shape, std::shared_ptr<const MoEBlock> moe = nullptr);

  // (the next layer's normed input, or an undefined tensor without next_norm; the new residual
  // stream). The caches (and v_exp, when given) are written in place.
  std::tuple<torch::Tensor, torch::Tensor> forward(const LayerBatch& batch) const;

  const LayerShape& shape() const { return shape_; }

 private:
  void qkv_gemms(int code, const torch::Tensor& x, torch::Tensor& qkv, int threads) const;

  LayerShape shape_;
  int code_;  // the layer's dtype: 0 float32, 1 bfloat16
  std::vector<LayerGemm> qkv_;  // the parts, outputs side by side
  LayerGemm o_;
  LayerFFN ffn_;
  torch::Tensor post_norm_;
  c10::optional<torch::Tensor> q_norm_, k_norm_;  // qwen3's per-head norms [head_dim], both or neither
};

// The Gated DeltaNet layer's shapes and constants (models/linear_attention.py: LinearAttentionSpec).
struct DeltaNetShape {
  int64_t key_heads, heads, key_dim, value_dim, hidden, intermediate;
  double eps;
};

// What one forward of a DeltaNet layer brings: the rows, the layer's recurrent state (written in
// place) and its slots (ForwardBatch.state_slots, row_starts).
struct DeltaNetBatch {
  torch::Tensor x, residual;
  c10::optional<torch::Tensor> next_norm;
  torch::Tensor conv_state, ssm_state;
  torch::Tensor state_in, state_out, row_starts;
};

// A Qwen hybrid's linear-attention layer with its SwiGLU MLP: GatedDeltaNet.forward and
// DecoderLayer's add, norm and MLP, through the same kernels in the same order.
class __attribute__((visibility("hidden"))) DeltaNetLayer {
 public:
  DeltaNetLayer(const torch::Tensor& in_proj, const torch::Tensor& out_proj, const c10::optional<torch::Tensor>& gate_up,
                const c10::optional<torch::Tensor>& down, const torch::Tensor& post_norm,
                const torch::Tensor& gated_norm, const torch::Tensor& conv_weight, const torch::Tensor& rate,
                const torch::Tensor& dt_bias, const DeltaNetShape& shape, std::shared_ptr<const MoEBlock> moe = nullptr,
                const c10::optional<torch::Tensor>& out_order = c10::nullopt);

  std::tuple<torch::Tensor, torch::Tensor> forward(const DeltaNetBatch& batch) const;

  const DeltaNetShape& shape() const { return shape_; }

 private:
  DeltaNetShape shape_;
  int code_, gated_norm_code_;  // the layer's dtype (post_norm's), the gated norm weight's
  LayerGemm in_proj_, out_proj_;
  LayerFFN ffn_;
  torch::Tensor post_norm_, gated_norm_, conv_taps_, rate_, dt_bias_;  // conv_taps_: [K, C], once at load
  c10::optional<torch::Tensor> out_order_;  // out_proj's input columns in its file's order (int64 [width]), if any
};
