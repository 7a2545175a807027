// The fused decoder layer (layer.cpp).
#pragma once

#include <torch/extension.h>

// Returns (the next layer's normed input, or an undefined tensor after the last layer; the new
// residual stream). Weights are packed (pack_weight); the caches (and v_exp, write_kv's record of
// V's exponents, when given) are written in place.
std::tuple<torch::Tensor, torch::Tensor> decoder_layer(
    const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& qkv_w, const torch::Tensor& o_w,
    const torch::Tensor& post_norm, const torch::Tensor& gate_up_w, const torch::Tensor& down_w,
    const c10::optional<torch::Tensor>& next_norm, const c10::optional<torch::Tensor>& q_norm,
    const c10::optional<torch::Tensor>& k_norm, const torch::Tensor& cos, const torch::Tensor& sin,
    torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& positions,
    const torch::Tensor& tables, const torch::Tensor& row_starts, int64_t heads, int64_t intermediate, double eps,
    double scale, int64_t window, const c10::optional<torch::Tensor>& v_exp);
