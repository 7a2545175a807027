// A Nemotron-H Mamba2 layer in one call (models/mamba2.py: Mamba2.forward, in a single-block
// DecoderLayer of models/blocks.py), the same kernels in the same order as the op-by-op forward:
//   [z xBC dt] = x @ in_proj^T; y = mamba2(xBC, dt, state) (mamba2.cpp); normed =
//   gated_group_norm(y, z, norm); mixed = normed @ out_proj^T; then add_rms_norm(mixed, residual,
//   next_norm), or residual + mixed after the last layer.
// The weights are checked once, when the layer is built at load; a forward checks its batch.
#include "mamba2_layer.h"

#include "binding.h"
#include "kernels.h"
#include "mamba2.h"

namespace {

using namespace tf_binding;

torch::Tensor packed_gemm(const torch::Tensor& w, int64_t n, int64_t k, int code, torch::ScalarType dtype,
                          const char* name, bool& quant) {
  check_cpu(w, "Mamba2Layer");
  TORCH_CHECK(w.is_contiguous(), "Mamba2Layer: ", name, " is not contiguous");
  quant = w.scalar_type() == torch::kUInt8;
  if (quant) {
    TORCH_CHECK(tf::quant_packed_matches(w.data_ptr<uint8_t>(), w.numel(), n, k), "Mamba2Layer: ", name,
                " is not a packed quantized weight of [", n, ", ", k, "]");
  } else {
    TORCH_CHECK(w.scalar_type() == dtype && w.numel() == tf::packed_numel(code, n, k), "Mamba2Layer: ", name,
                " is not a packed weight of [", n, ", ", k, "] in the layer's dtype (", dtype, ")");
  }
  return w;
}

torch::Tensor float_vector(const torch::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.numel() == n, "Mamba2Layer: ", name,
              " must be a float32 CPU tensor of ", n, " elements");
  return t.contiguous();
}

}  // namespace

Mamba2Layer::Mamba2Layer(const torch::Tensor& in_proj, const torch::Tensor& out_proj, const torch::Tensor& norm,
                         const torch::Tensor& conv_weight, const c10::optional<torch::Tensor>& conv_bias,
                         const torch::Tensor& rate, const torch::Tensor& dt_bias, const torch::Tensor& d,
                         const Mamba2Shape& shape)
    : shape_(shape), code_(dtype_code(norm, "Mamba2Layer: norm")) {
  const auto& s = shape_;
  TORCH_CHECK(s.heads > 0 && s.head_dim > 0 && s.groups > 0 && s.heads % s.groups == 0 && s.state_size > 0 &&
                  s.state_size <= 256 && s.hidden > 0,
              "Mamba2Layer: heads a multiple of groups, 0 < state_size <= 256 (the grid dot's exact sums), positive "
              "head_dim and hidden expected");
  const auto dtype = norm.scalar_type();
  const int64_t width = s.heads * s.head_dim, C = width + 2 * s.groups * s.state_size;
  TORCH_CHECK(width / s.groups <= 8192, "Mamba2Layer: the gated norm's groups are at most 8192 wide");
  in_proj_ = packed_gemm(in_proj, width + C + s.heads, s.hidden, code_, dtype, "in_proj", in_quant_);
  out_proj_ = packed_gemm(out_proj, s.hidden, width, code_, dtype, "out_proj", out_quant_);
  TORCH_CHECK(norm.device().is_cpu() && norm.numel() == width, "Mamba2Layer: norm must be a CPU tensor of ", width,
              " elements");
  norm_ = norm.contiguous();
  TORCH_CHECK(conv_weight.device().is_cpu() && conv_weight.dim() == 2 && conv_weight.size(0) == C &&
                  conv_weight.size(1) >= 1 && conv_weight.scalar_type() == torch::kFloat32,
              "Mamba2Layer: conv_weight float32 [", C, ", K] expected");
  conv_taps_ = conv_weight.t().contiguous();  // [K, C]: what the conv reads, transposed once here
  if (conv_bias && conv_bias->defined()) conv_bias_ = float_vector(*conv_bias, C, "conv_bias");
  rate_ = float_vector(rate, s.heads, "rate");
  dt_bias_ = float_vector(dt_bias, s.heads, "dt_bias");
  d_ = float_vector(d, s.heads, "D");
}

std::tuple<torch::Tensor, torch::Tensor> Mamba2Layer::forward(const Mamba2Batch& b) const {
  const auto& s = shape_;
  const int code = code_;
  const auto dtype = norm_.scalar_type();
  check_cpu(b.x, "Mamba2Layer.forward: x");
  TORCH_CHECK(b.x.dim() == 2 && b.x.size(1) == s.hidden && b.x.scalar_type() == dtype && b.x.is_contiguous(),
              "Mamba2Layer.forward: x must be contiguous [tokens, ", s.hidden, "] in the layer's dtype");
  TORCH_CHECK(b.residual.is_contiguous() && b.residual.sizes() == b.x.sizes() &&
                  b.residual.scalar_type() == dtype && b.residual.device().is_cpu(),
              "Mamba2Layer.forward: residual must be contiguous and of x's shape and dtype");
  if (b.next_norm)
    TORCH_CHECK(b.next_norm->device().is_cpu() && b.next_norm->is_contiguous() && b.next_norm->numel() == s.hidden &&
                    b.next_norm->scalar_type() == dtype,
                "Mamba2Layer.forward: next_norm must be contiguous [hidden] in the layer's dtype");
  const int64_t tokens = b.x.size(0), K = conv_taps_.size(0), width = s.heads * s.head_dim;
  const int64_t C = width + 2 * s.groups * s.state_size, total = width + C + s.heads;
  const StateSlots slots = state_slots(b.conv_state, b.ssm_state, b.state_in, b.state_out, b.row_starts, tokens, C, K,
                                       s.heads, s.state_size, s.head_dim);
  const int nt = threads();
  auto projected = torch::empty({tokens, total}, b.x.options());  // [z xBC dt]
  tf::matmul(code, b.x.data_ptr(), in_proj_.data_ptr(), in_quant_, projected.data_ptr(), tokens, total, s.hidden, nt);
  auto dt = projected.narrow(1, width + C, s.heads).to(torch::kFloat32).contiguous();  // exact from bf16
  auto y = torch::empty({tokens, width}, b.x.options().dtype(torch::kFloat32));
  auto normed = torch::empty({tokens, width}, b.x.options());
  auto mixed = torch::empty({tokens, s.hidden}, b.x.options());
  if (tokens > 0) {
    char* base = static_cast<char*>(projected.data_ptr());
    tf::mamba2(code, base + width * projected.element_size(), total, dt.data_ptr<float>(),
               b.conv_state.data_ptr<float>(), b.ssm_state.data_ptr<float>(), slots.in(), slots.out(), slots.starts(),
               slots.num_seqs, conv_taps_.data_ptr<float>(),
               conv_bias_.defined() ? conv_bias_.data_ptr<float>() : nullptr, K, rate_.data_ptr<float>(),
               dt_bias_.data_ptr<float>(), d_.data_ptr<float>(), static_cast<float>(s.dt_min),
               static_cast<float>(s.dt_max), s.heads, s.head_dim, s.groups, s.state_size, y.data_ptr<float>(), nt);
    tf::mamba2_gated_norm(y.data_ptr<float>(), code, base, total, code, norm_.data_ptr(), code, code,
                          normed.data_ptr(), tokens, width, s.groups, s.eps, nt);
  }
  tf::matmul(code, normed.data_ptr(), out_proj_.data_ptr(), out_quant_, mixed.data_ptr(), tokens, s.hidden, width, nt);
  if (b.next_norm) {  // the residual add and the next layer's norm
    auto x_next = torch::empty({tokens, s.hidden}, b.x.options());
    auto h_next = torch::empty({tokens, s.hidden}, b.x.options());
    tf::rms_norm(code, mixed.data_ptr(), s.hidden, b.residual.data_ptr(), s.hidden, h_next.data_ptr(),
                 b.next_norm->data_ptr(), x_next.data_ptr(), tokens, s.hidden, s.eps, nt);
    return {x_next, h_next};
  }
  return {torch::Tensor(), b.residual + mixed};  // the last layer: the add alone (torch's, as the model does it)
}
