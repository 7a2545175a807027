// A Nemotron-H Mamba2 layer in one call (mamba2_layer.cpp): built once at load from its packed
// GEMMs, conv taps, gates and norm weight, then run once per forward on a batch.
#pragma once

#include <torch/extension.h>

#include <tuple>

// The Mamba2 layer's shapes and constants (models/mamba2.py: Mamba2Spec, the layer's eps).
struct Mamba2Shape {
  int64_t heads, head_dim, groups, state_size, hidden;
  double eps, dt_min, dt_max;
};

// What one forward brings: the rows, the layer's recurrent state (written in place) and its slots
// (ForwardBatch.state_slots, row_starts).
struct Mamba2Batch {
  torch::Tensor x, residual;               // [tokens, hidden], the layer's dtype; x normed by the input norm
  c10::optional<torch::Tensor> next_norm;  // the next layer's input norm [hidden]; none after the last layer
  torch::Tensor conv_state, ssm_state;
  torch::Tensor state_in, state_out, row_starts;
};

// A single-block Mamba2 layer: Mamba2.forward and DecoderLayer's add and next norm, through the same
// kernels in the same order. Its GEMMs are packed (dense in the layer's dtype, or quantized).
class __attribute__((visibility("hidden"))) Mamba2Layer {
 public:
  Mamba2Layer(const torch::Tensor& in_proj, const torch::Tensor& out_proj, const torch::Tensor& norm,
              const torch::Tensor& conv_weight, const c10::optional<torch::Tensor>& conv_bias,
              const torch::Tensor& rate, const torch::Tensor& dt_bias, const torch::Tensor& d,
              const Mamba2Shape& shape);

  // (the next layer's normed input, or an undefined tensor without next_norm; the new residual).
  std::tuple<torch::Tensor, torch::Tensor> forward(const Mamba2Batch& batch) const;

 private:
  Mamba2Shape shape_;
  int code_;  // the layer's dtype (the norm weight's): 0 float32, 1 bfloat16
  torch::Tensor in_proj_, out_proj_, norm_, conv_taps_, conv_bias_, rate_, dt_bias_, d_;  // conv_taps_ [K, C]
  bool in_quant_, out_quant_;
};
