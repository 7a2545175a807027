// One decoder layer in one call: the composition models/blocks.py runs op by op, through the same
// kernels in the same order, so it gives the same bits with one Python-to-C++ crossing per layer
// instead of eleven (what a decode round spends between kernels). No arithmetic of its own lives
// here. DecoderLayer: llama, SmolLM2, qwen3; DeltaNetLayer: the Qwen hybrids' linear-attention
// layers with a SwiGLU MLP (steps at DeltaNetLayer::forward).
//
// Steps of forward (torch reference: llama.Model.forward's layer, op by op):
//   qkv = x @ qkv^T; q, k = rope(qkv's parts) (qwen3: per-head norm first); write_kv(k, v);
//   attn = paged_attention(q); o = attn @ o^T; x2, h = add_rms_norm(o, residual, post_norm);
//   mlp = silu_and_mul(x2 @ gate_up^T) @ down^T; then add_rms_norm(mlp, h, next_norm), or h + mlp.
// The weights are checked once, when the layer is built at load; a forward checks its batch.
#include "layer.h"

#include <algorithm>
#include <cstring>

#include "binding.h"
#include "kernels.h"

namespace {

using namespace tf_binding;

const void* ptr_or_null(const c10::optional<torch::Tensor>& t) { return t ? t->data_ptr() : nullptr; }

// A GEMM weight is packed dense (the layer's dtype, pack_weight) or packed quantized (uint8, pack_quant).
LayerGemm gemm_weight(const torch::Tensor& w, int64_t n, int64_t k, int code, torch::ScalarType dtype,
                      const char* owner, const char* name) {
  check_cpu(w, owner);
  TORCH_CHECK(w.is_contiguous(), owner, ": ", name, " weight is not contiguous");
  const bool quant = w.scalar_type() == torch::kUInt8;
  if (quant) {
    TORCH_CHECK(tf::quant_packed_matches(w.data_ptr<uint8_t>(), w.numel(), n, k), owner, ": ", name,
                " is not a packed quantized weight of [", n, ", ", k, "]");
  } else {
    TORCH_CHECK(w.scalar_type() == dtype && w.numel() == tf::packed_numel(code, n, k), owner, ": ", name,
                " is not a packed weight of [", n, ", ", k, "] in the layer's dtype (", dtype, "), got ",
                w.scalar_type(), " of ", w.numel(), " elements");
  }
  return {w, quant, n, k};
}

void check_norm(const torch::Tensor& w, int64_t size, torch::ScalarType dtype, const char* name) {
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.scalar_type() == dtype && w.numel() == size,
              "DecoderLayer: ", name, " must be a contiguous CPU tensor of ", size, " elements in the layer's dtype (",
              dtype, "), got ", w.scalar_type(), " ", w.sizes());
}

// A layer's feed-forward, checked: gate_up and down of a SwiGLU MLP, or an MoEBlock.
LayerFFN layer_ffn(const c10::optional<torch::Tensor>& gate_up, const c10::optional<torch::Tensor>& down,
                   int64_t intermediate, int64_t hidden, int code, torch::ScalarType dtype, const char* owner,
                   std::shared_ptr<const MoEBlock> moe) {
  LayerFFN ffn;
  if (moe) {
    TORCH_CHECK(!gate_up && !down, owner, ": an MoE feed-forward or gate_up and down, not both");
    TORCH_CHECK(moe->shape().hidden == hidden && (moe->dense_code() < 0 || moe->dense_code() == code), owner,
                ": the MoE block's hidden size or dense dtype is not the layer's");
    ffn.moe = std::move(moe);
    return ffn;
  }
  TORCH_CHECK(gate_up && down && intermediate > 0, owner,
              ": gate_up and down with intermediate > 0 expected (or an MoE feed-forward)");
  ffn.gate_up = gemm_weight(*gate_up, 2 * intermediate, hidden, code, dtype, owner, "gate_up");
  ffn.down = gemm_weight(*down, hidden, intermediate, code, dtype, owner, "down");
  ffn.intermediate = intermediate;
  return ffn;
}

// A layer's second half (DecoderLayer.forward after the mixer): x2, h = add_rms_norm(mixed,
// residual, post_norm); out = silu_and_mul(x2 @ gate_up^T) @ down^T, or the MoE block's forward;
// then add_rms_norm(out, h, next_norm), or h + out after the last layer.
std::tuple<torch::Tensor, torch::Tensor> ffn_and_next_norm(int code, const torch::Tensor& mixed,
                                                           const torch::Tensor& residual, const torch::Tensor& post_norm,
                                                           const LayerFFN& ffn,
                                                           const c10::optional<torch::Tensor>& next_norm, double eps,
                                                           int nt) {
  const int64_t tokens = mixed.size(0), hidden = mixed.size(1), intermediate = ffn.intermediate;
  auto empty = [&](std::initializer_list<int64_t> shape) { return torch::empty(shape, mixed.options()); };
  auto x2 = empty({tokens, hidden});
  auto h = empty({tokens, hidden});
  tf::rms_norm(code, mixed.data_ptr(), hidden, residual.data_ptr(), hidden, h.data_ptr(), post_norm.data_ptr(),
               x2.data_ptr(), tokens, hidden, eps, nt);
  torch::Tensor mlp;
  if (ffn.moe) {
    mlp = ffn.moe->forward(x2);
  } else {
    auto gate_up = empty({tokens, 2 * intermediate});
    auto act = empty({tokens, intermediate});
    mlp = empty({tokens, hidden});
    tf::matmul(code, x2.data_ptr(), ffn.gate_up.packed.data_ptr(), ffn.gate_up.quant, gate_up.data_ptr(), tokens,
               2 * intermediate, hidden, nt);
    char* gu = static_cast<char*>(gate_up.data_ptr());
    tf::silu_and_mul(code, gu, gu + intermediate * mixed.element_size(), 2 * intermediate, act.data_ptr(), tokens,
                     intermediate, nt);
    tf::matmul(code, act.data_ptr(), ffn.down.packed.data_ptr(), ffn.down.quant, mlp.data_ptr(), tokens, hidden,
               intermediate, nt);
  }
  if (next_norm) {  // the residual add and the next layer's norm
    auto x_next = empty({tokens, hidden});
    auto h_next = empty({tokens, hidden});
    tf::rms_norm(code, mlp.data_ptr(), hidden, h.data_ptr(), hidden, h_next.data_ptr(), next_norm->data_ptr(),
                 x_next.data_ptr(), tokens, hidden, eps, nt);
    return {x_next, h_next};
  }
  return {torch::Tensor(), h + mlp};  // the last layer: the add alone (torch's, as the model does it)
}

// A GEMM of a batch: weight, input rows, output rows (out_stride elements apart; 0: the weight's n).
struct GemmCall {
  const LayerGemm* w;
  const void* x;
  void* out;
  int64_t rows;
  int64_t out_stride = 0;
};

// The calls' GEMMs: the quantized ones in one parallel region (tf::quant_linears), dense ones each
// (their outputs' rows back to back).
void run_gemms(int code, const std::vector<GemmCall>& calls, int nt) {
  std::vector<tf::QuantJob> quant;
  for (const GemmCall& c : calls) {
    if (c.w->quant) {
      quant.push_back({c.x, c.w->packed.data_ptr<uint8_t>(), c.out, c.rows, c.w->n, c.w->k, c.out_stride});
    } else {
      TORCH_CHECK(c.out_stride == 0 || c.out_stride == c.w->n, "run_gemms: a dense GEMM writes its rows back to back");
      tf::linear(code, c.x, c.w->packed.data_ptr(), c.out, c.rows, c.w->n, c.w->k, nt);
    }
  }
  if (!quant.empty()) tf::quant_linears(code, quant.data(), static_cast<int64_t>(quant.size()), nt);
}

// x and residual [tokens, hidden] in the layer's dtype, contiguous; next_norm [hidden] if given.
void check_rows_in(const torch::Tensor& x, const torch::Tensor& residual, const c10::optional<torch::Tensor>& next_norm,
                   int64_t hidden, torch::ScalarType dtype, const char* what) {
  check_cpu(x, what);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && x.scalar_type() == dtype && x.is_contiguous(), what,
              ": x must be contiguous [tokens, ", hidden, "] in the layer's dtype (", dtype, "), got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.device().is_cpu(),
              what, ": residual must be contiguous and of x's shape and dtype");
  if (next_norm) check_norm(*next_norm, hidden, dtype, "next_norm");
}

}  // namespace

DecoderLayer::DecoderLayer(const std::vector<torch::Tensor>& qkv, const std::vector<int64_t>& qkv_widths,
                           const torch::Tensor& o,
                           const c10::optional<torch::Tensor>& gate_up, const c10::optional<torch::Tensor>& down,
                           const torch::Tensor& post_norm, const c10::optional<torch::Tensor>& q_norm,
                           const c10::optional<torch::Tensor>& k_norm, const LayerShape& shape,
                           std::shared_ptr<const MoEBlock> moe)
    : shape_(shape), code_(dtype_code(post_norm, "DecoderLayer: post_norm")), post_norm_(post_norm),
      q_norm_(q_norm), k_norm_(k_norm) {
  const auto& s = shape_;
  TORCH_CHECK(s.num_heads > 0 && s.num_kv_heads > 0 && s.hidden > 0 && s.window >= 0,
              "DecoderLayer: positive num_heads, num_kv_heads, hidden and a window >= 0 expected");
  TORCH_CHECK(s.head_dim > 0 && s.head_dim % 2 == 0 && s.head_dim <= tf::MAX_HEAD_DIM &&
                  s.num_heads % s.num_kv_heads == 0,
              "DecoderLayer: head_dim must be even and at most ", tf::MAX_HEAD_DIM,
              ", num_heads a multiple of num_kv_heads");
  TORCH_CHECK(s.rope_dim > 0 && s.rope_dim % 2 == 0 && s.rope_dim <= s.head_dim,
              "DecoderLayer: rope_dim must be even, positive and at most head_dim");
  const auto dtype = post_norm.scalar_type();
  const int64_t q_size = s.num_heads * s.head_dim;
  const int64_t qkv_width = q_size * (s.output_gate ? 2 : 1) + 2 * s.num_kv_heads * s.head_dim;
  const std::vector<int64_t> widths = qkv_widths.empty() ? std::vector<int64_t>{qkv_width} : qkv_widths;
  TORCH_CHECK(!qkv.empty() && qkv.size() == widths.size(), "DecoderLayer: one width per qkv part expected");
  int64_t width = 0;
  for (size_t i = 0; i < qkv.size(); ++i) {
    qkv_.push_back(gemm_weight(qkv[i], widths[i], s.hidden, code_, dtype, "DecoderLayer", "qkv"));
    width += widths[i];
  }
  TORCH_CHECK(width == qkv_width, "DecoderLayer: the qkv parts are ", width, " wide, the heads need ", qkv_width);
  o_ = gemm_weight(o, s.hidden, q_size, code_, dtype, "DecoderLayer", "o_proj");
  ffn_ = layer_ffn(gate_up, down, s.intermediate, s.hidden, code_, dtype, "DecoderLayer", std::move(moe));
  check_norm(post_norm, s.hidden, dtype, "post_norm");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecoderLayer: q_norm and k_norm come together (qwen3)");
  if (q_norm) {
    check_norm(*q_norm, s.head_dim, dtype, "q_norm");
    check_norm(*k_norm, s.head_dim, dtype, "k_norm");
  }
}

// x @ qkv^T into qkv [tokens, qkv_width]: one GEMM, or the parts' side by side, as LinearWeight
// concatenates them: each quantized part writes its columns of qkv in place (run_gemms: in one
// parallel region), a dense one its own output, copied in.
void DecoderLayer::qkv_gemms(int code, const torch::Tensor& x, torch::Tensor& qkv, int nt) const {
  const int64_t tokens = x.size(0), width = qkv.size(1);
  if (qkv_.size() == 1) {
    tf::matmul(code, x.data_ptr(), qkv_[0].packed.data_ptr(), qkv_[0].quant, qkv.data_ptr(), tokens, width,
               shape_.hidden, nt);
    return;
  }
  std::vector<torch::Tensor> dense_outs;  // the dense parts' outputs, with their columns
  std::vector<int64_t> dense_at;
  std::vector<GemmCall> calls;
  char* out = static_cast<char*>(qkv.data_ptr());
  int64_t at = 0;
  for (const auto& part : qkv_) {
    if (part.quant) {
      calls.push_back({&part, x.data_ptr(), out + at * qkv.element_size(), tokens, width});
    } else {
      dense_outs.push_back(torch::empty({tokens, part.n}, x.options()));
      dense_at.push_back(at);
      calls.push_back({&part, x.data_ptr(), dense_outs.back().data_ptr(), tokens});
    }
    at += part.n;
  }
  run_gemms(code, calls, nt);
  for (size_t i = 0; i < dense_outs.size(); ++i) qkv.narrow(1, dense_at[i], dense_outs[i].size(1)).copy_(dense_outs[i]);
}

std::tuple<torch::Tensor, torch::Tensor> DecoderLayer::forward(const LayerBatch& b) const {
  const auto& s = shape_;
  const int64_t heads = s.num_heads, kv_heads = s.num_kv_heads, d = s.head_dim, hidden = s.hidden;
  const double eps = s.eps;
  const auto& x = b.x;
  const int code = code_;
  check_rows_in(x, b.residual, b.next_norm, hidden, post_norm_.scalar_type(), "DecoderLayer.forward");
  const int cache_code = dtype_code(b.k_cache, "DecoderLayer.forward: the cache");  // may differ from x's
  const int64_t tokens = x.size(0);
  const int64_t q_size = heads * d, kv_size = kv_heads * d, rope_dim = s.rope_dim;
  const int64_t q_width = q_size * (s.output_gate ? 2 : 1), qkv_width = q_width + 2 * kv_size;
  TORCH_CHECK(b.k_cache.dim() == 4 && b.k_cache.size(2) == kv_heads && b.k_cache.size(3) == d &&
                  b.k_cache.is_contiguous() && b.v_cache.is_contiguous() && b.k_cache.device().is_cpu() &&
                  b.v_cache.device().is_cpu() && b.v_cache.scalar_type() == b.k_cache.scalar_type() &&
                  b.v_cache.sizes() == b.k_cache.sizes(),
              "DecoderLayer.forward: contiguous CPU caches of one shape and dtype [blocks, block_size, ", kv_heads,
              ", ", d, "] expected, got ", b.k_cache.sizes(), " and ", b.v_cache.sizes());
  TORCH_CHECK(b.cos.is_contiguous() && b.sin.is_contiguous() && b.cos.scalar_type() == torch::kFloat32 &&
                  b.sin.scalar_type() == torch::kFloat32 && b.cos.sizes() == torch::IntArrayRef({tokens, rope_dim}) &&
                  b.sin.sizes() == b.cos.sizes(),
              "DecoderLayer.forward: contiguous float32 cos/sin [tokens, rope_dim] expected");
  const auto &k_cache = b.k_cache, &v_cache = b.v_cache;
  int16_t* record = exponent_record(b.v_exp, k_cache, "DecoderLayer.forward");
  auto pos = b.positions.contiguous(), sl = b.slots.contiguous(), tab = b.tables.contiguous(),
       st = b.row_starts.contiguous();
  TORCH_CHECK(pos.scalar_type() == torch::kInt64 && sl.scalar_type() == torch::kInt64 &&
                  tab.scalar_type() == torch::kInt64 && st.scalar_type() == torch::kInt64 && pos.numel() == tokens &&
                  sl.numel() == tokens && tab.dim() == 2 && st.numel() == tab.size(0) + 1,
              "DecoderLayer.forward: int64 positions, slots [tokens], tables [seqs, width], row_starts [seqs + 1]");
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
  const size_t el = x.element_size();
  char* qkv_p = static_cast<char*>(qkv.data_ptr());

  qkv_gemms(code, x, qkv, nt);
  const int64_t q_head_stride = s.output_gate ? 2 * d : d;  // [q, gate] per head
  tf::rope_heads(code, qkv_p, qkv_width, q_head_stride, q.data_ptr(), b.cos.data_ptr<float>(), b.sin.data_ptr<float>(),
                 tokens, heads, d, rope_dim, ptr_or_null(q_norm_), eps, nt);
  tf::rope_heads(code, qkv_p + q_width * el, qkv_width, d, k.data_ptr(), b.cos.data_ptr<float>(),
                 b.sin.data_ptr<float>(), tokens, kv_heads, d, rope_dim, ptr_or_null(k_norm_), eps, nt);
  tf::write_kv(code, cache_code, k_cache.data_ptr(), v_cache.data_ptr(), record, k.data_ptr(), kv_size,
               qkv_p + (q_width + kv_size) * el, qkv_width, sl.data_ptr<int64_t>(), tokens, kv_heads, d, nt);
  tf::paged_attention(code, cache_code, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), record, attn.data_ptr(),
                      pos.data_ptr<int64_t>(), tab.data_ptr<int64_t>(), tab.size(1), st.data_ptr<int64_t>(),
                      tab.size(0), heads, kv_heads, d, k_cache.size(1), s.scale, s.window, nt);
  if (s.output_gate) {  // attn * sigmoid(gate), the gates copied out of the [q, gate] heads
    auto gate = qkv.narrow(1, 0, q_width).view({tokens, heads, 2, d}).select(2, 1).contiguous();
    auto gated = empty({tokens, heads, d});
    tf::sigmoid_and_mul(code, gate.data_ptr(), attn.data_ptr(), q_size, gated.data_ptr(), tokens, q_size, nt);
    attn = gated;
  }
  tf::matmul(code, attn.data_ptr(), o_.packed.data_ptr(), o_.quant, o.data_ptr(), tokens, hidden, q_size, nt);
  return ffn_and_next_norm(code, o, b.residual, post_norm_, ffn_, b.next_norm, eps, nt);
}

DeltaNetLayer::DeltaNetLayer(const torch::Tensor& in_proj, const torch::Tensor& out_proj,
                             const c10::optional<torch::Tensor>& gate_up, const c10::optional<torch::Tensor>& down,
                             const torch::Tensor& post_norm, const torch::Tensor& gated_norm,
                             const torch::Tensor& conv_weight, const torch::Tensor& rate, const torch::Tensor& dt_bias,
                             const DeltaNetShape& shape, std::shared_ptr<const MoEBlock> moe,
                             const c10::optional<torch::Tensor>& out_order)
    : shape_(shape), code_(dtype_code(post_norm, "DeltaNetLayer: post_norm")),
      gated_norm_code_(dtype_code(gated_norm, "DeltaNetLayer: the gated norm's weight")), post_norm_(post_norm),
      gated_norm_(gated_norm), rate_(rate), dt_bias_(dt_bias), out_order_(out_order) {
  const auto& s = shape_;
  TORCH_CHECK(s.key_heads > 0 && s.heads > 0 && s.heads % s.key_heads == 0 && s.key_dim > 0 && s.key_dim <= 256 &&
                  s.value_dim > 0 && s.hidden > 0,
              "DeltaNetLayer: heads a multiple of key_heads, 0 < key_dim <= 256 (the grid dots' exact sums), positive "
              "value_dim and hidden expected");
  const auto dtype = post_norm.scalar_type();
  const int64_t C = 2 * s.key_heads * s.key_dim + s.heads * s.value_dim, width = s.heads * s.value_dim;
  in_proj_ = gemm_weight(in_proj, C + width + 2 * s.heads, s.hidden, code_, dtype, "DeltaNetLayer", "in_proj");
  out_proj_ = gemm_weight(out_proj, s.hidden, width, code_, dtype, "DeltaNetLayer", "out_proj");
  ffn_ = layer_ffn(gate_up, down, s.intermediate, s.hidden, code_, dtype, "DeltaNetLayer", std::move(moe));
  check_norm(post_norm, s.hidden, dtype, "post_norm");
  TORCH_CHECK(gated_norm.device().is_cpu() && gated_norm.is_contiguous() && gated_norm.numel() == s.value_dim,
              "DeltaNetLayer: the gated norm's weight must be a contiguous CPU tensor of value_dim elements");
  TORCH_CHECK(conv_weight.device().is_cpu() && conv_weight.is_contiguous() && conv_weight.dim() == 2 &&
                  conv_weight.size(0) == C && conv_weight.size(1) >= 1 && conv_weight.scalar_type() == torch::kFloat32,
              "DeltaNetLayer: conv_weight a contiguous float32 [", C, ", K] expected");
  conv_taps_ = conv_weight.t().contiguous();  // what the conv reads, transposed once here
  for (const auto* t : {&rate, &dt_bias})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->numel() == s.heads &&
                    t->scalar_type() == torch::kFloat32,
                "DeltaNetLayer: rate and dt_bias contiguous float32 [heads] expected");
  if (out_order_)
    TORCH_CHECK(out_order_->device().is_cpu() && out_order_->scalar_type() == torch::kInt64 &&
                    out_order_->dim() == 1 && out_order_->numel() == width,
                "DeltaNetLayer: out_order an int64 [heads * value_dim] expected");
}

// GatedDeltaNet.forward, then DecoderLayer's second half:
//   [qkv z b a] = x @ in_proj^T; core = delta_net(qkv, a, b, state); normed = gated_rms_norm(core,
//   z) per value head; mixed = normed @ out_proj^T (normed's columns first put in out_proj's stored
//   order where it keeps its file's, out_order); then ffn_and_next_norm.
std::tuple<torch::Tensor, torch::Tensor> DeltaNetLayer::forward(const DeltaNetBatch& b) const {
  const auto& s = shape_;
  const int code = code_;
  check_rows_in(b.x, b.residual, b.next_norm, s.hidden, post_norm_.scalar_type(), "DeltaNetLayer.forward");
  const int64_t tokens = b.x.size(0), K = conv_taps_.size(0);
  const int64_t C = 2 * s.key_heads * s.key_dim + s.heads * s.value_dim, width = s.heads * s.value_dim;
  const int64_t total = C + width + 2 * s.heads;
  const StateSlots slots = state_slots(b.conv_state, b.ssm_state, b.state_in, b.state_out, b.row_starts, tokens, C, K,
                                       s.heads, s.key_dim, s.value_dim);
  const int nt = threads();
  auto projected = torch::empty({tokens, total}, b.x.options());
  tf::matmul(code, b.x.data_ptr(), in_proj_.packed.data_ptr(), in_proj_.quant, projected.data_ptr(), tokens, total,
             s.hidden, nt);
  auto z = projected.narrow(1, C, width).contiguous();
  auto beta_in = projected.narrow(1, C + width, s.heads).to(torch::kFloat32).contiguous();  // exact from bf16
  auto a = projected.narrow(1, C + width + s.heads, s.heads).to(torch::kFloat32).contiguous();
  auto core = torch::empty({tokens, s.heads, s.value_dim}, b.x.options());
  auto normed = torch::empty({tokens, width}, b.x.options());
  auto mixed = torch::empty({tokens, s.hidden}, b.x.options());
  if (tokens > 0) {
    tf::delta_net(code, projected.data_ptr(), total, a.data_ptr<float>(), beta_in.data_ptr<float>(),
                  b.conv_state.data_ptr<float>(), b.ssm_state.data_ptr<float>(), slots.in(), slots.out(),
                  slots.starts(), slots.num_seqs, conv_taps_.data_ptr<float>(), K, rate_.data_ptr<float>(),
                  dt_bias_.data_ptr<float>(), s.key_heads, s.heads, s.key_dim, s.value_dim, core.data_ptr(), nt);
    tf::gated_rms_norm(code, core.data_ptr(), code, z.data_ptr(), s.value_dim, gated_norm_code_,
                       gated_norm_.data_ptr(), normed.data_ptr(), tokens * s.heads, s.value_dim, s.eps, nt);
  }
  if (out_order_) normed = normed.index_select(1, *out_order_);
  tf::matmul(code, normed.data_ptr(), out_proj_.packed.data_ptr(), out_proj_.quant, mixed.data_ptr(), tokens, s.hidden,
             width, nt);
  return ffn_and_next_norm(code, mixed, b.residual, post_norm_, ffn_, b.next_norm, s.eps, nt);
}

namespace {

// The (row, choice) pairs of `chosen` [tokens, k] grouped by expert: expert e's pairs take rows
// [start[e], start[e + 1]) of the grouped order, rows ascending within an expert; at[p] is pair
// p's row there.
struct ExpertGroups {
  std::vector<int64_t> start;
  torch::Tensor at;
};
ExpertGroups group_by_expert(const torch::Tensor& chosen, int64_t experts) {
  const int64_t pairs = chosen.numel();
  const int64_t* c = chosen.data_ptr<int64_t>();
  ExpertGroups g{std::vector<int64_t>(experts + 1, 0), torch::empty({pairs}, chosen.options())};
  for (int64_t p = 0; p < pairs; ++p) ++g.start[c[p] + 1];
  for (int64_t e = 0; e < experts; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  int64_t* at = g.at.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) at[p] = next[c[p]]++;
  return g;
}

}  // namespace

// MoEBlock::forward's steps (models/moe.MoE.forward):
//   logits = float(router_x @ router^T) (router_x: x unless given); chosen, w = moe_route(logits,
//   top_k); with sigmoid routing (n_group > 0) logits = float(x) @ router^T in float32 and chosen,
//   w = moe_route_sigmoid(logits, bias, ...); with a per-expert scale, w_j = w_j * scale[chosen_j]
//   (one float32 product);
//   the (row, choice) pairs grouped by expert, ascending, rows ascending within an expert: xs = x's
//   rows in that order; for each chosen expert e: y[e's pairs] = act_and_mul(xs[e's pairs] @
//   gate_up_e^T) @ down_e^T, act SiLU or GELU's tanh form (each expert's GEMM is row-invariant: its
//   rows' bits do not depend on which other tokens chose it);
//   shared = silu_and_mul(x @ shared_gate_up^T) @ shared_down^T, gate = x @ shared_gate^T (none
//   where the shared expert is ungated);
//   (every gate_up and the shared gate as one batch of GEMMs, every down as another: a decode
//   round forks twice for its experts, not twice per expert);
//   out = moe_combine(y, w, gate, shared): the terms added in ascending expert order.
MoEBlock::MoEBlock(const torch::Tensor& router, const std::vector<torch::Tensor>& gate_ups,
                   const std::vector<torch::Tensor>& downs, const c10::optional<torch::Tensor>& shared_gate_up,
                   const c10::optional<torch::Tensor>& shared_down, const c10::optional<torch::Tensor>& shared_gate,
                   const MoEShape& shape, const c10::optional<torch::Tensor>& expert_scale,
                   const c10::optional<torch::Tensor>& route_bias)
    : shape_(shape), code_(-1) {
  const auto& s = shape_;
  TORCH_CHECK(s.hidden > 0 && s.intermediate > 0 && s.shared_intermediate >= 0 && s.experts > 0 &&
                  s.experts <= (1 << 13) && 1 <= s.top_k && s.top_k <= s.experts,
              "MoEBlock: positive hidden and intermediate, 1 <= top_k <= experts <= 8192 expected");
  TORCH_CHECK(s.activation == 0 || s.activation == 1, "MoEBlock: activation silu or gelu_tanh expected");
  if (expert_scale) {
    check_cpu(*expert_scale, "MoEBlock: expert_scale");
    TORCH_CHECK(expert_scale->scalar_type() == torch::kFloat32 && expert_scale->numel() == s.experts,
                "MoEBlock: expert_scale must be float32 with one value per expert (", s.experts, ")");
    expert_scale_ = expert_scale->contiguous();
  }
  TORCH_CHECK(static_cast<int64_t>(gate_ups.size()) == s.experts && static_cast<int64_t>(downs.size()) == s.experts,
              "MoEBlock: one gate_up and one down per expert expected");
  const bool sigmoid = s.n_group > 0;
  if (sigmoid) {
    TORCH_CHECK(route_bias.has_value(), "MoEBlock: sigmoid routing needs its correction bias");
    check_cpu(*route_bias, "MoEBlock: route_bias");
    TORCH_CHECK(route_bias->scalar_type() == torch::kFloat32 && route_bias->numel() == s.experts,
                "MoEBlock: route_bias must be float32 with one value per expert (", s.experts, ")");
    TORCH_CHECK(s.experts % s.n_group == 0 && s.experts / s.n_group >= 2 && 1 <= s.topk_group &&
                    s.topk_group <= s.n_group,
                "MoEBlock: n_group ", s.n_group, " / topk_group ", s.topk_group, " do not divide ", s.experts,
                " experts into groups of two or more");
    route_bias_ = route_bias->contiguous();
  } else {
    TORCH_CHECK(!route_bias.has_value(), "MoEBlock: a correction bias without sigmoid routing (n_group > 0)");
  }
  const bool shared = s.shared_intermediate > 0;
  TORCH_CHECK(shared_gate_up.has_value() == shared && shared_down.has_value() == shared &&
                  shared_gate.has_value() == (shared && s.shared_gated),
              "MoEBlock: the shared expert's gate_up, down and (where gated) gate come together, with "
              "shared_intermediate > 0");
  torch::ScalarType dtype = torch::kFloat32;  // the dense weights': the first dense one's
  auto note = [&](const torch::Tensor& w) {
    if (code_ < 0 && w.scalar_type() != torch::kUInt8) {
      dtype = w.scalar_type();
      code_ = dtype_code(w, "MoEBlock: a dense weight");
    }
  };
  if (!sigmoid) note(router);  // sigmoid routing's router is float32 (or quantized) whatever the dtype
  for (int64_t e = 0; e < s.experts; ++e) note(gate_ups[e]), note(downs[e]);
  if (shared) note(*shared_gate_up), note(*shared_down);
  if (shared && s.shared_gated) note(*shared_gate);
  const int code = std::max(code_, 0);
  router_ = sigmoid ? gemm_weight(router, s.experts, s.hidden, 0, torch::kFloat32, "MoEBlock", "router")
                    : gemm_weight(router, s.experts, s.hidden, code, dtype, "MoEBlock", "router");
  for (int64_t e = 0; e < s.experts; ++e) {
    gate_ups_.push_back(gemm_weight(gate_ups[e], 2 * s.intermediate, s.hidden, code, dtype, "MoEBlock", "gate_up"));
    downs_.push_back(gemm_weight(downs[e], s.hidden, s.intermediate, code, dtype, "MoEBlock", "down"));
  }
  if (shared) {
    const int64_t si = s.shared_intermediate;
    shared_gate_up_ = gemm_weight(*shared_gate_up, 2 * si, s.hidden, code, dtype, "MoEBlock", "shared gate_up");
    shared_down_ = gemm_weight(*shared_down, s.hidden, si, code, dtype, "MoEBlock", "shared down");
    if (s.shared_gated) shared_gate_ = gemm_weight(*shared_gate, 1, s.hidden, code, dtype, "MoEBlock", "shared gate");
  }
}

torch::Tensor MoEBlock::forward(const torch::Tensor& x, const c10::optional<torch::Tensor>& router_x) const {
  const auto& s = shape_;
  check_cpu(x, "MoEBlock.forward: x");
  const int code = dtype_code(x, "MoEBlock.forward: x");
  TORCH_CHECK(code_ < 0 || code == code_, "MoEBlock.forward: x must be in the dense weights' dtype");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == s.hidden && x.is_contiguous(), "MoEBlock.forward: contiguous x [tokens, ",
              s.hidden, "] expected, got ", x.sizes());
  if (router_x) {
    check_cpu(*router_x, "MoEBlock.forward: router_x");
    TORCH_CHECK(router_x->scalar_type() == x.scalar_type() && router_x->sizes() == x.sizes() &&
                    router_x->is_contiguous(),
                "MoEBlock.forward: router_x must be contiguous, of x's shape and dtype");
  }
  const torch::Tensor& rx = router_x ? *router_x : x;
  const int64_t tokens = x.size(0), k = s.top_k, hidden = s.hidden, inter = s.intermediate, pairs = tokens * k;
  const int nt = threads();
  const size_t el = x.element_size();
  auto empty = [&](std::initializer_list<int64_t> shape) { return torch::empty(shape, x.options()); };
  auto out = empty({tokens, hidden});
  if (tokens == 0) return out;
  auto chosen = torch::empty({tokens, k}, x.options().dtype(torch::kInt64));
  auto weights = torch::empty({tokens, k}, x.options().dtype(torch::kFloat32));
  if (s.n_group > 0) {  // the router in float32 on float32 rows (exact from bfloat16)
    auto rx32 = rx.to(torch::kFloat32).contiguous();
    auto logits32 = torch::empty({tokens, s.experts}, rx32.options());
    tf::matmul(0, rx32.data_ptr(), router_.packed.data_ptr(), router_.quant, logits32.data_ptr(), tokens, s.experts,
               hidden, nt);
    tf::moe_route_sigmoid(logits32.data_ptr<float>(), route_bias_.data_ptr<float>(), tokens, s.experts, k, s.n_group,
                          s.topk_group, s.normalize, s.route_scale, chosen.data_ptr<int64_t>(),
                          weights.data_ptr<float>(), nt);
  } else {
    auto logits = empty({tokens, s.experts});
    tf::matmul(code, rx.data_ptr(), router_.packed.data_ptr(), router_.quant, logits.data_ptr(), tokens, s.experts,
               hidden, nt);
    auto logits32 = logits.to(torch::kFloat32).contiguous();  // exact from bfloat16
    tf::moe_route(logits32.data_ptr<float>(), tokens, s.experts, k, s.normalize, chosen.data_ptr<int64_t>(),
                  weights.data_ptr<float>(), nt);
  }

  const int64_t* c = chosen.data_ptr<int64_t>();
  if (expert_scale_.defined()) {
    float* w = weights.data_ptr<float>();
    const float* scale = expert_scale_.data_ptr<float>();
    for (int64_t p = 0; p < pairs; ++p) w[p] = w[p] * scale[c[p]];
  }
  const ExpertGroups groups = group_by_expert(chosen, s.experts);
  const std::vector<int64_t>& start = groups.start;
  const int64_t* at = groups.at.data_ptr<int64_t>();
  auto xs = empty({pairs, hidden});
  char* xs_p = static_cast<char*>(xs.data_ptr());
  const char* x_p = static_cast<const char*>(x.data_ptr());
#pragma omp parallel for num_threads(nt) schedule(static) if (pairs > 64)
  for (int64_t p = 0; p < pairs; ++p) std::memcpy(xs_p + at[p] * hidden * el, x_p + (p / k) * hidden * el, hidden * el);
  auto gate_up = empty({pairs, 2 * inter});
  auto act = empty({pairs, inter});
  auto y = empty({pairs, hidden});
  char *gu_p = static_cast<char*>(gate_up.data_ptr()), *y_p = static_cast<char*>(y.data_ptr());
  std::vector<GemmCall> ups, downs;
  for (int64_t e = 0; e < s.experts; ++e) {
    const int64_t off = start[e], n = start[e + 1] - off;
    if (n == 0) continue;
    ups.push_back({&gate_ups_[e], xs_p + off * hidden * el, gu_p + off * 2 * inter * el, n});
    downs.push_back({&downs_[e], static_cast<char*>(act.data_ptr()) + off * inter * el, y_p + off * hidden * el, n});
  }
  torch::Tensor shared, gate, shared_gate_up, shared_act;
  const int64_t si = s.shared_intermediate;
  if (si > 0) {
    shared_gate_up = empty({tokens, 2 * si});
    shared_act = empty({tokens, si});
    shared = empty({tokens, hidden});
    ups.push_back({&shared_gate_up_, x_p, shared_gate_up.data_ptr(), tokens});
    if (s.shared_gated) {
      gate = empty({tokens, 1});
      ups.push_back({&shared_gate_, x_p, gate.data_ptr(), tokens});
    }
    downs.push_back({&shared_down_, shared_act.data_ptr(), shared.data_ptr(), tokens});
  }
  run_gemms(code, ups, nt);
  const auto act_and_mul = s.activation == 1 ? tf::gelu_tanh_and_mul : tf::silu_and_mul;
  act_and_mul(code, gu_p, gu_p + inter * el, 2 * inter, act.data_ptr(), pairs, inter, nt);
  if (si > 0) {
    char* sgu = static_cast<char*>(shared_gate_up.data_ptr());
    act_and_mul(code, sgu, sgu + si * el, 2 * si, shared_act.data_ptr(), tokens, si, nt);
  }
  run_gemms(code, downs, nt);
  tf::moe_combine(code, y_p, at, c, weights.data_ptr<float>(), tokens, k,
                  gate.defined() ? gate.data_ptr() : nullptr, shared.defined() ? shared.data_ptr() : nullptr,
                  out.data_ptr(), hidden, nt);
  return out;
}
