// One decoder layer of the llama family (llama, SmolLM2, qwen3) in one call: the composition
// models/llama.py runs op by op, through the same kernels in the same order, so it gives the same
// bits with one Python-to-C++ crossing per layer instead of eleven (what a decode round spends
// between kernels). No arithmetic of its own lives here.
#include <torch/extension.h>

#include "binding.h"
#include "kernels.h"
#include "layer.h"

namespace {

using namespace tf_binding;

const void* ptr_or_null(const c10::optional<torch::Tensor>& t) { return t ? t->data_ptr() : nullptr; }

// A GEMM weight is packed dense (x's dtype, pack_weight) or packed quantized (uint8, pack_quant).
bool is_quant(const torch::Tensor& w) { return w.scalar_type() == torch::kUInt8; }

void check_weight(const torch::Tensor& w, int64_t n, int64_t k, const torch::Tensor& x, const char* name) {
  TORCH_CHECK(w.is_contiguous(), "decoder_layer: ", name, " weight is not contiguous");
  if (is_quant(w)) {
    TORCH_CHECK(tf::quant_packed_matches(w.data_ptr<uint8_t>(), w.numel(), n, k), "decoder_layer: ", name,
                " is not a packed quantized weight of [", n, ", ", k, "]");
  } else {
    const int code = dtype_code(x, "decoder_layer");
    TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.numel() == tf::packed_numel(code, n, k), "decoder_layer: ",
                name, " does not match the layer's shape [", n, ", ", k, "] or x's dtype");
  }
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> decoder_layer(
    const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& qkv_w, const torch::Tensor& o_w,
    const torch::Tensor& post_norm, const torch::Tensor& gate_up_w, const torch::Tensor& down_w,
    const c10::optional<torch::Tensor>& next_norm, const c10::optional<torch::Tensor>& q_norm,
    const c10::optional<torch::Tensor>& k_norm, const torch::Tensor& cos, const torch::Tensor& sin,
    torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& positions,
    const torch::Tensor& tables, const torch::Tensor& row_starts, int64_t heads, int64_t intermediate, double eps,
    double scale, int64_t window, const c10::optional<torch::Tensor>& v_exp) {
  check_cpu(x, "decoder_layer: x");
  const int code = dtype_code(x, "decoder_layer");
  const int cache_code = dtype_code(k_cache, "decoder_layer: the cache");  // may differ from x's
  const int64_t tokens = x.size(0), hidden = x.size(1), kv_heads = k_cache.size(2), d = k_cache.size(3);
  const int64_t q_size = heads * d, kv_size = kv_heads * d, qkv_width = q_size + 2 * kv_size;
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && v_cache.sizes() == k_cache.sizes() &&
                  cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.size(0) == tokens && cos.size(1) == d,
              "decoder_layer: contiguous x/residual [tokens, hidden], caches of one shape and dtype, float32 cos/sin "
              "[tokens, head_dim] expected");
  TORCH_CHECK(d % 2 == 0 && d <= 256 && heads % kv_heads == 0,
              "decoder_layer: head_dim must be even and at most 256, heads a multiple of kv_heads");
  check_weight(qkv_w, qkv_width, hidden, x, "qkv");
  check_weight(o_w, hidden, q_size, x, "o_proj");
  check_weight(gate_up_w, 2 * intermediate, hidden, x, "gate_up");
  check_weight(down_w, hidden, intermediate, x, "down");
  int16_t* record = exponent_record(v_exp, k_cache, "decoder_layer");  // checked with the rest
  auto pos = positions.contiguous(), sl = slots.contiguous(), tab = tables.contiguous(), st = row_starts.contiguous();
  TORCH_CHECK(pos.scalar_type() == torch::kInt64 && sl.scalar_type() == torch::kInt64 &&
                  tab.scalar_type() == torch::kInt64 && st.scalar_type() == torch::kInt64 && pos.numel() == tokens &&
                  sl.numel() == tokens && st.numel() == tab.size(0) + 1,
              "decoder_layer: int64 positions, slots [tokens], tables [seqs, width], row_starts [seqs + 1]");
  check_slots(sl.data_ptr<int64_t>(), tokens, k_cache.size(0) * k_cache.size(1));
  check_rows(st.data_ptr<int64_t>(), tab.size(0), tokens, pos.data_ptr<int64_t>(), tab.data_ptr<int64_t>(), tab.size(1),
             k_cache.size(1), k_cache.size(0));
  const int nt = threads();
  auto empty = [&](std::initializer_list<int64_t> shape) { return torch::empty(shape, x.options()); };
  auto qkv = empty({tokens, qkv_width});
  auto q = empty({tokens, heads, d});
  auto k = empty({tokens, kv_heads, d});
  auto attn = empty({tokens, heads, d});
  auto o = empty({tokens, hidden});
  auto x2 = empty({tokens, hidden});
  auto h = empty({tokens, hidden});
  auto gate_up = empty({tokens, 2 * intermediate});
  auto act = empty({tokens, intermediate});
  auto mlp = empty({tokens, hidden});
  auto x_next = empty({tokens, hidden});
  auto h_next = empty({tokens, hidden});
  const size_t el = x.element_size();
  char* qkv_p = static_cast<char*>(qkv.data_ptr());

  tf::matmul(code, x.data_ptr(), qkv_w.data_ptr(), is_quant(qkv_w), qkv_p, tokens, qkv_width, hidden, nt);
  tf::rope(code, qkv_p, qkv_width, q.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), tokens, heads, d,
           ptr_or_null(q_norm), eps, nt);
  tf::rope(code, qkv_p + q_size * el, qkv_width, k.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), tokens,
           kv_heads, d, ptr_or_null(k_norm), eps, nt);
  tf::write_kv(code, cache_code, k_cache.data_ptr(), v_cache.data_ptr(), record, k.data_ptr(), kv_size,
               qkv_p + (q_size + kv_size) * el, qkv_width, sl.data_ptr<int64_t>(), tokens, kv_heads, d, nt);
  const int64_t* tp = tab.data_ptr<int64_t>();
  tf::paged_attention(code, cache_code, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), record, attn.data_ptr(),
                      pos.data_ptr<int64_t>(), tp, tab.size(1), st.data_ptr<int64_t>(), tab.size(0), heads, kv_heads, d,
                      k_cache.size(1), scale, window, nt);
  tf::matmul(code, attn.data_ptr(), o_w.data_ptr(), is_quant(o_w), o.data_ptr(), tokens, hidden, q_size, nt);
  tf::rms_norm(code, o.data_ptr(), hidden, residual.data_ptr(), hidden, h.data_ptr(), post_norm.data_ptr(),
               x2.data_ptr(), tokens, hidden, eps, nt);
  tf::matmul(code, x2.data_ptr(), gate_up_w.data_ptr(), is_quant(gate_up_w), gate_up.data_ptr(), tokens, 2 * intermediate, hidden, nt);
  char* gu = static_cast<char*>(gate_up.data_ptr());
  tf::silu_and_mul(code, gu, gu + intermediate * el, 2 * intermediate, act.data_ptr(), tokens, intermediate, nt);
  tf::matmul(code, act.data_ptr(), down_w.data_ptr(), is_quant(down_w), mlp.data_ptr(), tokens, hidden, intermediate, nt);
  if (next_norm) {  // the residual add and the next layer's norm
    tf::rms_norm(code, mlp.data_ptr(), hidden, h.data_ptr(), hidden, h_next.data_ptr(), next_norm->data_ptr(),
                 x_next.data_ptr(), tokens, hidden, eps, nt);
    return {x_next, h_next};
  }
  return {torch::Tensor(), h + mlp};  // the last layer: the add alone (torch's, as the model does it)
}
