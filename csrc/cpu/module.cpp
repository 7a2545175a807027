// Python bindings of the cpu kernels (tensorfold._cpu): shape and dtype checks, output
// allocation, then one call into kernels.h. Threads: torch's intra-op count, read per call.
#include <torch/extension.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "binding.h"
#include "exact64.h"
#include "kernels.h"
#include "latent_attention.h"
#include "layer.h"
#include "mamba2.h"
#include "mamba2_layer.h"
#include "quant_gemm.h"

namespace {

using namespace tf_binding;

torch::Tensor pack_weight(const torch::Tensor& weight) {
  check_cpu(weight, "pack_weight");
  TORCH_CHECK(weight.dim() == 2, "pack_weight: weight [N, K] expected, got ", weight.sizes());
  const int code = dtype_code(weight, "pack_weight");
  auto wc = weight.contiguous();
  auto packed = torch::empty({tf::packed_numel(code, weight.size(0), weight.size(1))}, weight.options());
  tf::pack_weight(code, wc.data_ptr(), packed.data_ptr(), weight.size(0), weight.size(1));
  return packed;
}

torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t k,
                            const Out& out_arg) {
  check_cpu(x, "linear: x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "linear: x [M, ", k, "] expected, got ", x.sizes());
  const int code = dtype_code(x, "linear");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.is_contiguous() && packed.numel() == tf::packed_numel(code, n, k),
              "linear: the packed weight does not match x's dtype or [", n, ", ", k, "]");
  auto xc = x.contiguous();
  auto out = output(out_arg, {x.size(0), n}, x, "linear");
  if (out.numel() > 0) tf::linear(code, xc.data_ptr(), packed.data_ptr(), out.data_ptr(), x.size(0), n, k, threads());
  return out;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const Out& out) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() == 2 && x.size(1) == weight.size(1),
              "linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "linear: x and weight dtypes differ");
  return linear_packed(x, pack_weight(weight), weight.size(0), weight.size(1), out);
}

const char* const QUANT_KINDS[] = {"q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q5_1"};  // quant_gemm.TYPES

int quant_kind(const std::string& kind) {
  for (int i = 0; i < tf::quant::NUM_KINDS; ++i)
    if (kind == QUANT_KINDS[i]) return i;
  TORCH_CHECK(false, "quantized weights: unknown kind ", kind, " (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, q5_1)");
}

// The K-quants (act 256) assume one E (and F) per super-block of 8 blocks (quant_gemm.check_weight).
void check_super_exponents(const std::string& kind, const torch::Tensor& e, int64_t n, int64_t blocks,
                           const char* what) {
  if (n == 0 || blocks == 0) return;
  auto groups = e.view({n, blocks / 8, 8});
  TORCH_CHECK(groups.eq(groups.select(2, 0).unsqueeze(2)).all().item<bool>(), "pack_quant: ", kind,
              " weights need one ", what, " per super-block of 256 (their 8 blocks' exponents differ)");
}

torch::Tensor int32_field(const torch::Tensor& t, int64_t numel, const char* what) {
  check_cpu(t, what);
  TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.numel() == numel, "pack_quant: ", what, " int32 of ", numel,
              " elements expected, got ", t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

// quant_gemm.QuantWeight's fields -> the kernel's packed bytes (uint8 [quant_packed_bytes]).
torch::Tensor pack_quant(const std::string& kind, const torch::Tensor& codes, const torch::Tensor& scale,
                         const torch::Tensor& scale_exp, const c10::optional<torch::Tensor>& min,
                         const c10::optional<torch::Tensor>& min_exp) {
  const int k = quant_kind(kind);
  check_cpu(codes, "pack_quant: codes");
  const tf::quant::QKind& info = tf::quant::KINDS[k];
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8 && codes.size(1) % info.act == 0,
              "pack_quant: ", kind, " codes [N, K] int8 with K a multiple of ", info.act, " expected, got ",
              codes.sizes());
  const int64_t n = codes.size(0), kk = codes.size(1), blocks = kk / 32, sub = info.sub;
  const bool has_min = info.has_min;
  TORCH_CHECK(has_min == (min.has_value() && min->defined()) && has_min == (min_exp.has_value() && min_exp->defined()),
              "pack_quant: min and min_exp are given exactly for q4_1, q4_k, q5_k and q5_1");
  auto cc = codes.contiguous();
  const int64_t code_min[] = {-128, -8, 0, 0, 0, -32, 0}, code_max[] = {127, 7, 15, 15, 31, 31, 31};
  if (cc.numel() > 0) {
    auto [lo, hi] = torch::aminmax(cc);
    TORCH_CHECK(lo.item<int64_t>() >= code_min[k] && hi.item<int64_t>() <= code_max[k], "pack_quant: ", kind,
                " codes must lie in [", code_min[k], ", ", code_max[k], "], got [", lo.item<int64_t>(), ", ",
                hi.item<int64_t>(), "]");
  }
  auto sc = int32_field(scale, n * kk / sub, "scale");
  auto se = int32_field(scale_exp, n * blocks, "scale_exp");
  torch::Tensor mc, me;
  if (has_min) {
    mc = int32_field(*min, n * blocks, "min");
    me = int32_field(*min_exp, n * blocks, "min_exp");
  }
  if (info.act != 32) {
    check_super_exponents(kind, se, n, blocks, "scale_exp");
    if (has_min) check_super_exponents(kind, me, n, blocks, "min_exp");
  }
  const int32_t* mp = has_min ? mc.data_ptr<int32_t>() : nullptr;
  const int32_t* mep = has_min ? me.data_ptr<int32_t>() : nullptr;
  const int nt = threads();
  const int form = tf::quant_pack_form(k, sc.data_ptr<int32_t>(), se.data_ptr<int32_t>(), mp, mep, n, kk, nt);
  auto packed = torch::empty({tf::quant_packed_bytes(k, form, n, kk)}, torch::kUInt8);
  tf::pack_quant(k, form, cc.data_ptr<int8_t>(), sc.data_ptr<int32_t>(), se.data_ptr<int32_t>(), mp, mep,
                 packed.data_ptr<uint8_t>(), n, kk, nt);
  return packed;
}

// The bytes pack_quant(quant_weight(raw)) gives, packed straight from a GGUF's blocks into `out`
// (uint8 [quant_file_bytes(kind, n, k)], the caller's: huge pages): row i of the matrix at file
// offset row_offsets[i] (int64 [n]) of path. A short read or a bad scale is a ValueError saying so.
int64_t quant_file_bytes(const std::string& kind, int64_t n, int64_t k) {
  const int code = quant_kind(kind);
  return tf::quant_packed_bytes(code, tf::quant_file_form(code), n, k);
}

void pack_quant_file(const torch::Tensor& out, const std::string& kind, const std::string& path,
                     const torch::Tensor& row_offsets, int64_t k) {
  const int code = quant_kind(kind);
  TORCH_CHECK(code != 6, "pack_quant_file: ", kind, " blocks are not packed from the file (pack_quant their QuantWeight)");
  check_cpu(row_offsets, "pack_quant_file: row_offsets");
  TORCH_CHECK(row_offsets.dim() == 1 && row_offsets.scalar_type() == torch::kInt64,
              "pack_quant_file: row_offsets int64 [n] expected");
  TORCH_CHECK(k > 0 && k % tf::quant::KINDS[code].act == 0, "pack_quant_file: K ", k, " is not whole blocks of ", kind);
  auto offsets = row_offsets.contiguous();
  const int64_t n = offsets.numel();
  TORCH_CHECK(n == 0 || offsets.min().item<int64_t>() >= 0, "pack_quant_file: negative offset");
  check_cpu(out, "pack_quant_file: out");
  TORCH_CHECK(out.scalar_type() == torch::kUInt8 && out.is_contiguous() && out.numel() == quant_file_bytes(kind, n, k),
              "pack_quant_file: out must be uint8 of quant_file_bytes(kind, n, k) = ", quant_file_bytes(kind, n, k));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK_VALUE(fd >= 0, path, ": cannot open (", std::strerror(errno), ")");
  std::string error;
  {
    py::gil_scoped_release released;
    error = tf::pack_quant_file(code, fd, offsets.data_ptr<int64_t>(), n, k, out.data_ptr<uint8_t>(), threads());
  }
  ::close(fd);
  TORCH_CHECK_VALUE(error.empty(), error);
}

// kernels/quant_gemm.linear over a packed weight of [n, k].
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t k,
                           const Out& out_arg) {
  check_cpu(x, "quant_linear: x");
  const int code = dtype_code(x, "quant_linear");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "quant_linear: x [M, ", k, "] expected, got ", x.sizes());
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  tf::quant_packed_matches(packed.data_ptr<uint8_t>(), packed.numel(), n, k),
              "quant_linear: not a packed quantized weight of [", n, ", ", k, "]");
  auto xc = x.contiguous();
  auto out = output(out_arg, {x.size(0), n}, x, "quant_linear");
  if (out.numel() > 0)
    tf::quant_linear(code, xc.data_ptr(), packed.data_ptr<uint8_t>(), out.data_ptr(), x.size(0), n, k, threads());
  return out;
}

// QuantWeight.rows(ids).dequantize() from a packed weight of [n, k]: an embedding lookup.
torch::Tensor quant_rows(const torch::Tensor& packed, const torch::Tensor& ids, int64_t n, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  tf::quant_packed_matches(packed.data_ptr<uint8_t>(), packed.numel(), n, k),
              "quant_rows: not a packed quantized weight of [", n, ", ", k, "]");
  check_cpu(ids, "quant_rows: ids");
  auto idc = ids.to(torch::kInt64).contiguous().view({-1});
  const int64_t* p = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < idc.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < n, "quant_rows: id ", p[i], " outside [0, ", n, ")");
  auto out = torch::empty({idc.numel(), k}, torch::kFloat32);
  tf::quant_rows(packed.data_ptr<uint8_t>(), p, idc.numel(), out.data_ptr<float>(), n, k);
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_impl(const torch::Tensor& x, const Out& residual,
                                                           const torch::Tensor& weight, double eps, const Out& out_arg) {
  check_cpu(x, "rms_norm: x");
  const int code = dtype_code(x, "rms_norm");
  const int64_t width = x.size(-1);
  TORCH_CHECK(weight.numel() == width && weight.scalar_type() == x.scalar_type(), "rms_norm: weight must be [",
              width, "] in x's dtype");
  TORCH_CHECK(width <= 8192, "rms_norm rows are at most 8192 wide (an exact float64 sum), got ", width);
  auto xc = x.contiguous();
  auto out = output(out_arg, xc.sizes(), xc, "rms_norm");
  const int64_t rows = width ? xc.numel() / width : 0;
  torch::Tensor rc, h;
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "add_rms_norm: residual must match x");
    rc = residual->contiguous();
    h = torch::empty_like(xc);
  }
  if (rows > 0)
    tf::rms_norm(code, xc.data_ptr(), width, residual ? rc.data_ptr() : nullptr, width, residual ? h.data_ptr() : nullptr,
                 weight.contiguous().data_ptr(), out.data_ptr(), rows, width, eps, threads());
  return {out, h};
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, const Out& out) {
  return std::get<0>(add_rms_norm_impl(x, c10::nullopt, weight, eps, out));
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps, const Out& out) {
  return add_rms_norm_impl(x, residual, weight, eps, out);
}

torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, double eps) {
  check_cpu(x, "layer_norm: x");
  const int code = dtype_code(x, "layer_norm");
  const int64_t width = x.size(-1);
  TORCH_CHECK(weight.numel() == width && weight.scalar_type() == x.scalar_type() && bias.numel() == width &&
                  bias.scalar_type() == x.scalar_type(),
              "layer_norm: weight and bias must be [", width, "] in x's dtype");
  TORCH_CHECK(width <= 8192, "layer_norm rows are at most 8192 wide (an exact float64 sum), got ", width);
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t rows = width ? xc.numel() / width : 0;
  if (rows > 0)
    tf::layer_norm(code, xc.data_ptr(), weight.contiguous().data_ptr(), bias.contiguous().data_ptr(), out.data_ptr(),
                   rows, width, eps, threads());
  return out;
}

torch::Tensor rope_impl(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const Out& norm_weight, double eps, const Out& out_arg) {
  check_cpu(x, "rope: x");
  const int code = dtype_code(x, "rope");
  TORCH_CHECK(x.dim() == 3, "rope: x [tokens, heads, head_dim] expected, got ", x.sizes());
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && d <= tf::MAX_HEAD_DIM, "rope: head_dim must be even and at most ", tf::MAX_HEAD_DIM,
              ", got ", d);
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.sizes() == torch::IntArrayRef({tokens, d}) && sin.sizes() == cos.sizes(),
              "rope: cos and sin must be float32 [tokens, head_dim]");
  auto xc = x.contiguous();
  auto cc = cos.contiguous(), sc = sin.contiguous();
  auto out = output(out_arg, xc.sizes(), xc, "rope");
  torch::Tensor nw;
  if (norm_weight) {
    TORCH_CHECK(norm_weight->numel() == d && norm_weight->scalar_type() == x.scalar_type(),
                "rms_norm_rope: weight must be [head_dim] in x's dtype");
    nw = norm_weight->contiguous();
  }
  if (xc.numel() > 0)
    tf::rope(code, xc.data_ptr(), heads * d, out.data_ptr(), cc.data_ptr<float>(), sc.data_ptr<float>(), tokens, heads, d,
             norm_weight ? nw.data_ptr() : nullptr, eps, threads());
  return out;
}

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const Out& out) {
  return rope_impl(x, cos, sin, c10::nullopt, 0.0, out);
}

torch::Tensor rms_norm_rope(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                            const torch::Tensor& cos, const torch::Tensor& sin, const Out& out) {
  return rope_impl(x, cos, sin, weight, eps, out);
}

// silu(gate) * up, sigmoid(gate) * up (an attention's output gate) or gelu_tanh(gate) * up (Gemma's GeGLU).
enum GateKind { SILU, SIGMOID, GELU_TANH };
template <GateKind KIND>
torch::Tensor gate_and_mul(const torch::Tensor& gate, const torch::Tensor& up, const Out& out_arg) {
  const char* name = KIND == SIGMOID ? "sigmoid_and_mul" : KIND == SILU ? "silu_and_mul" : "gelu_tanh_and_mul";
  check_cpu(gate, name);
  const int code = dtype_code(gate, name);
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              name, ": gate and up must be [rows, width] of one dtype");
  torch::Tensor g = gate, u = up;
  if (g.stride(1) != 1 || u.stride(1) != 1 || g.stride(0) != u.stride(0)) {
    g = gate.contiguous();
    u = up.contiguous();
  }
  auto out = output(out_arg, gate.sizes(), gate, name);
  if (out.numel() > 0)
    (KIND == SIGMOID ? tf::sigmoid_and_mul : KIND == SILU ? tf::silu_and_mul : tf::gelu_tanh_and_mul)(
        code, g.data_ptr(), u.data_ptr(), g.stride(0), out.data_ptr(), g.size(0), g.size(1), threads());
  return out;
}

// reference.relu_squared of x (any shape), a new tensor of x's dtype.
torch::Tensor relu_squared(const torch::Tensor& x) {
  check_cpu(x, "relu_squared: x");
  const int code = dtype_code(x, "relu_squared");
  const torch::Tensor xc = x.contiguous();
  auto out = torch::empty_like(xc);
  if (xc.numel() > 0) tf::relu_squared(code, xc.data_ptr(), out.data_ptr(), xc.numel(), threads());
  return out;
}

// reference.softcap of float32 logits (any shape), a new tensor.
torch::Tensor softcap(const torch::Tensor& logits, double cap) {
  check_cpu(logits, "softcap: logits");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32, "softcap: float32 logits expected, got ", logits.scalar_type());
  const torch::Tensor x = logits.contiguous();
  auto out = torch::empty_like(x);
  if (x.numel() > 0)
    tf::softcap(x.data_ptr<float>(), out.data_ptr<float>(), x.numel(), static_cast<float>(cap), threads());
  return out;
}

// kernels/moe.route: (chosen [rows, top_k] int64, weights [rows, top_k] float32).
std::tuple<torch::Tensor, torch::Tensor> moe_route(const torch::Tensor& logits, int64_t top_k, bool normalize) {
  check_cpu(logits, "moe_route: logits");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32,
              "moe_route: float32 logits [rows, experts] expected, got ", logits.scalar_type(), " ", logits.sizes());
  const int64_t rows = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(experts <= (1 << 13) && 1 <= top_k && top_k <= experts, "moe_route: top ", top_k, " of ", experts,
              " experts (at most 8192)");
  auto l = logits.contiguous();
  auto chosen = torch::empty({rows, top_k}, l.options().dtype(torch::kInt64));
  auto weights = torch::empty({rows, top_k}, l.options());
  if (rows > 0)
    tf::moe_route(l.data_ptr<float>(), rows, experts, top_k, normalize, chosen.data_ptr<int64_t>(),
                  weights.data_ptr<float>(), threads());
  return {chosen, weights};
}

// kernels/moe.route_sigmoid: (chosen [rows, top_k] int64, weights [rows, top_k] float32).
std::tuple<torch::Tensor, torch::Tensor> moe_route_sigmoid(const torch::Tensor& logits, const torch::Tensor& bias,
                                                           int64_t top_k, int64_t n_group, int64_t topk_group,
                                                           bool normalize, double scale) {
  check_cpu(logits, "moe_route_sigmoid: logits");
  check_cpu(bias, "moe_route_sigmoid: bias");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32, "moe_route_sigmoid: float32 logits [rows, "
              "experts] expected, got ", logits.scalar_type(), " ", logits.sizes());
  const int64_t rows = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(bias.numel() == experts, "moe_route_sigmoid: one bias per expert (", experts, ") expected");
  TORCH_CHECK(1 <= top_k && top_k <= experts, "moe_route_sigmoid: top ", top_k, " of ", experts, " experts");
  TORCH_CHECK(n_group >= 1 && experts % n_group == 0 && (n_group == 1 || experts / n_group >= 2) &&
                  1 <= topk_group && topk_group <= n_group,
              "moe_route_sigmoid: n_group ", n_group, " / topk_group ", topk_group, " do not divide ", experts,
              " experts into groups of two or more");
  auto l = logits.contiguous();
  auto b = bias.to(torch::kFloat32).contiguous();
  auto chosen = torch::empty({rows, top_k}, l.options().dtype(torch::kInt64));
  auto weights = torch::empty({rows, top_k}, l.options());
  if (rows > 0)
    tf::moe_route_sigmoid(l.data_ptr<float>(), b.data_ptr<float>(), rows, experts, top_k, n_group, topk_group,
                          normalize, scale, chosen.data_ptr<int64_t>(), weights.data_ptr<float>(), threads());
  return {chosen, weights};
}

void write_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& slots, const c10::optional<torch::Tensor>& v_exp) {
  check_cpu(k_cache, "write_kv: k_cache");
  const int cache_code = dtype_code(k_cache, "write_kv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: caches must be contiguous and of one shape and dtype");
  const int64_t kv_heads = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(d <= tf::MAX_HEAD_DIM, "write_kv: head_dim must be at most ", tf::MAX_HEAD_DIM, ", got ", d);
  // k and v in their own dtype when the kernels take it (the kernel rounds them to the cache's),
  // else converted to the cache's dtype here
  const auto kv_type = k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16
                           ? k.scalar_type() : k_cache.scalar_type();
  auto kc = k.to(kv_type).contiguous(), vc = v.to(kv_type).contiguous();
  const int code = dtype_code(kc, "write_kv");
  auto sl = slots.to(torch::kInt64).contiguous();
  const int64_t tokens = sl.numel();
  TORCH_CHECK(kc.numel() == tokens * kv_heads * d && vc.numel() == kc.numel(),
              "write_kv: k and v must be [tokens, kv_heads, head_dim]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* s = sl.data_ptr<int64_t>();
  check_slots(s, tokens, num_slots);
  tf::write_kv(code, cache_code, k_cache.data_ptr(), v_cache.data_ptr(), exponent_record(v_exp, k_cache, "write_kv"),
               kc.data_ptr(), kv_heads * d, vc.data_ptr(), kv_heads * d, s, tokens, kv_heads, d, threads());
}

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& positions, const torch::Tensor& tables,
                              const torch::Tensor& row_starts, double scale, int64_t window,
                              const c10::optional<torch::Tensor>& v_exp, const Out& out_arg) {
  check_cpu(q, "paged_attention: q");
  const int code = dtype_code(q, "paged_attention");
  const int cache_code = dtype_code(k_cache, "paged_attention: the cache");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: q [rows, heads, head_dim] and contiguous caches of one shape and dtype expected");
  const int64_t heads = q.size(1), d = q.size(2), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && heads % kv_heads == 0, "paged_attention: head shapes disagree");
  TORCH_CHECK(d <= tf::MAX_HEAD_DIM, "paged_attention: head_dim must be at most ", tf::MAX_HEAD_DIM, ", got ", d);
  auto qc = q.contiguous();
  auto pos = positions.to(torch::kInt64).contiguous();
  auto tab = tables.to(torch::kInt64).contiguous();
  auto starts = row_starts.to(torch::kInt64).contiguous();
  TORCH_CHECK(tab.dim() == 2 && starts.numel() == tab.size(0) + 1, "paged_attention: one table row per sequence");
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t num_seqs = tab.size(0), width = tab.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(pos.numel() == q.size(0), "paged_attention: one position per row");
  const int64_t* t = tab.data_ptr<int64_t>();
  check_rows(st, num_seqs, q.size(0), p, t, width, block_size, num_blocks);
  auto out = output(out_arg, qc.sizes(), qc, "paged_attention");
  if (q.numel() > 0)
    tf::paged_attention(code, cache_code, qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                        exponent_record(v_exp, k_cache, "paged_attention"), out.data_ptr(), p, t, width, st, num_seqs,
                        heads, kv_heads, d, block_size, scale, window, threads());
  return out;
}

// delta_net.delta_net over the rows of a ForwardBatch (row_starts_tensor, and state_slots: state_in
// [num_seqs], the block each sequence's starting state is read from, -1 zeros; state_out [rows], the
// block the state after each row is written to, -1 none) and a LayerState's conv [blocks, K - 1, C]
// and ssm [blocks, heads, key_dim, value_dim] (float32, contiguous, written in place): out [rows,
// heads, value_dim] in qkv's dtype. A block two sequences write is refused (the order of their
// writes would decide it).
torch::Tensor delta_net(const torch::Tensor& qkv, const torch::Tensor& a, const torch::Tensor& b,
                        torch::Tensor& conv_state, torch::Tensor& ssm_state, const torch::Tensor& state_in,
                        const torch::Tensor& state_out, const torch::Tensor& row_starts,
                        const torch::Tensor& conv_weight, const torch::Tensor& rate, const torch::Tensor& dt_bias,
                        int64_t num_key_heads, int64_t num_heads, int64_t key_dim, int64_t value_dim,
                        const Out& out_arg) {
  check_cpu(qkv, "delta_net: qkv");
  const int code = dtype_code(qkv, "delta_net");
  TORCH_CHECK(num_key_heads > 0 && num_heads > 0 && num_heads % num_key_heads == 0 && key_dim > 0 &&
                  key_dim <= 256 && value_dim > 0,
              "delta_net: num_heads must be a multiple of num_key_heads, 0 < key_dim <= 256 (the grid dots' exact "
              "sums), value_dim positive");
  const int64_t C = 2 * num_key_heads * key_dim + num_heads * value_dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == C, "delta_net: qkv [rows, ", C, "] expected, got ", qkv.sizes());
  const int64_t rows = qkv.size(0);
  auto x = qkv.stride(1) == 1 ? qkv : qkv.contiguous();
  TORCH_CHECK(a.numel() == rows * num_heads && b.numel() == rows * num_heads && a.size(0) == rows &&
                  b.size(0) == rows,
              "delta_net: a and b [rows, num_heads] expected");
  check_cpu(a, "delta_net: a");
  check_cpu(b, "delta_net: b");
  auto af = a.to(torch::kFloat32).contiguous(), bf = b.to(torch::kFloat32).contiguous();  // exact from bf16
  TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == C && conv_weight.size(1) >= 1 &&
                  conv_weight.scalar_type() == torch::kFloat32,
              "delta_net: conv_weight float32 [", C, ", K] expected");
  const int64_t K = conv_weight.size(1);
  TORCH_CHECK(rate.numel() == num_heads && dt_bias.numel() == num_heads && rate.scalar_type() == torch::kFloat32 &&
                  dt_bias.scalar_type() == torch::kFloat32,
              "delta_net: rate and dt_bias float32 [num_heads] expected");
  auto taps = conv_weight.t().contiguous(), rc = rate.contiguous(), dc = dt_bias.contiguous();  // taps [K, C]
  const StateSlots slots = state_slots(conv_state, ssm_state, state_in, state_out, row_starts, rows, C, K, num_heads,
                                       key_dim, value_dim);
  auto out = output(out_arg, {rows, num_heads, value_dim}, qkv, "delta_net");
  if (rows > 0)
    tf::delta_net(code, x.data_ptr(), x.stride(0), af.data_ptr<float>(), bf.data_ptr<float>(),
                  conv_state.data_ptr<float>(), ssm_state.data_ptr<float>(), slots.in(), slots.out(), slots.starts(),
                  slots.num_seqs, taps.data_ptr<float>(), K, rc.data_ptr<float>(), dc.data_ptr<float>(), num_key_heads, num_heads,
                  key_dim, value_dim, out.data_ptr(), threads());
  return out;
}

// delta_net.gated_rms_norm: rms_norm(x) * weight * silu(gate) over the last dim, in x's dtype.
torch::Tensor gated_rms_norm(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& weight,
                             double eps, const Out& out_arg) {
  check_cpu(x, "gated_rms_norm: x");
  check_cpu(gate, "gated_rms_norm: gate");
  check_cpu(weight, "gated_rms_norm: weight");
  const int code = dtype_code(x, "gated_rms_norm");
  const int gate_code = dtype_code(gate, "gated_rms_norm: gate");
  const int weight_code = dtype_code(weight, "gated_rms_norm: weight");
  TORCH_CHECK(x.dim() >= 1 && gate.sizes() == x.sizes(), "gated_rms_norm: gate must have x's shape");
  const int64_t width = x.size(-1);
  TORCH_CHECK(weight.numel() == width, "gated_rms_norm: weight must be [", width, "]");
  TORCH_CHECK(width <= 8192, "rms_norm rows are at most 8192 wide (an exact float64 sum), got ", width);
  auto xc = x.contiguous();
  auto g = gate.dim() == 2 && gate.stride(1) == 1 ? gate : gate.contiguous();
  const int64_t rows = width ? xc.numel() / width : 0;
  const int64_t gate_stride = g.dim() == 2 ? g.stride(0) : width;
  auto out = output(out_arg, xc.sizes(), xc, "gated_rms_norm");
  if (rows > 0)
    tf::gated_rms_norm(code, xc.data_ptr(), gate_code, g.data_ptr(), gate_stride, weight_code,
                       weight.contiguous().data_ptr(), out.data_ptr(), rows, width, eps, threads());
  return out;
}

// mamba2.mamba2 over the rows of a ForwardBatch (state_slots as delta_net's; ssm_state [blocks,
// heads, state_size, head_dim]): out [rows, heads, head_dim] float32, with the D skip.
torch::Tensor mamba2(const torch::Tensor& xbc, const torch::Tensor& dt, torch::Tensor& conv_state,
                     torch::Tensor& ssm_state, const torch::Tensor& state_in, const torch::Tensor& state_out,
                     const torch::Tensor& row_starts, const torch::Tensor& conv_weight, const Out& conv_bias,
                     const torch::Tensor& rate, const torch::Tensor& dt_bias, const torch::Tensor& d, double dt_min,
                     double dt_max, int64_t num_heads, int64_t head_dim, int64_t n_groups, int64_t state_size,
                     const Out& out_arg) {
  check_cpu(xbc, "mamba2: xbc");
  check_cpu(dt, "mamba2: dt");
  const int code = dtype_code(xbc, "mamba2");
  TORCH_CHECK(num_heads > 0 && head_dim > 0 && n_groups > 0 && num_heads % n_groups == 0 && state_size > 0 &&
                  state_size <= 256,
              "mamba2: num_heads must be a multiple of n_groups, 0 < state_size <= 256 (the grid dot's exact sums), "
              "head_dim positive");
  const int64_t C = num_heads * head_dim + 2 * n_groups * state_size;
  TORCH_CHECK(xbc.dim() == 2 && xbc.size(1) == C, "mamba2: xbc [rows, ", C, "] expected, got ", xbc.sizes());
  const int64_t rows = xbc.size(0);
  auto x = xbc.stride(1) == 1 ? xbc : xbc.contiguous();
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == rows && dt.size(1) == num_heads, "mamba2: dt [rows, num_heads] expected");
  auto dtf = dt.to(torch::kFloat32).contiguous();  // exact from bf16
  TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == C && conv_weight.size(1) >= 1 &&
                  conv_weight.scalar_type() == torch::kFloat32,
              "mamba2: conv_weight float32 [", C, ", K] expected");
  const int64_t K = conv_weight.size(1);
  torch::Tensor bias;
  if (conv_bias && conv_bias->defined()) {
    TORCH_CHECK(conv_bias->numel() == C && conv_bias->scalar_type() == torch::kFloat32,
                "mamba2: conv_bias float32 [", C, "] expected");
    bias = conv_bias->contiguous();
  }
  for (const torch::Tensor* t : {&rate, &dt_bias, &d})
    TORCH_CHECK(t->numel() == num_heads && t->scalar_type() == torch::kFloat32,
                "mamba2: rate, dt_bias and D float32 [num_heads] expected");
  auto taps = conv_weight.t().contiguous(), rc = rate.contiguous(), bc = dt_bias.contiguous(), dc = d.contiguous();
  const StateSlots slots = state_slots(conv_state, ssm_state, state_in, state_out, row_starts, rows, C, K, num_heads,
                                       state_size, head_dim);
  auto out = output(out_arg, {rows, num_heads, head_dim}, dtf, "mamba2");
  if (rows > 0)
    tf::mamba2(code, x.data_ptr(), x.stride(0), dtf.data_ptr<float>(), conv_state.data_ptr<float>(),
               ssm_state.data_ptr<float>(), slots.in(), slots.out(), slots.starts(), slots.num_seqs,
               taps.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr, K, rc.data_ptr<float>(),
               bc.data_ptr<float>(), dc.data_ptr<float>(), static_cast<float>(dt_min), static_cast<float>(dt_max),
               num_heads, head_dim, n_groups, state_size, out.data_ptr<float>(), threads());
  return out;
}

// mamba2.gated_group_norm(y, z, weight, n_groups, eps, dtype): y [rows, I] float32, z [rows, I]
// (rows may be strided), out in torch's promotion of dtype and weight's dtype.
torch::Tensor mamba2_gated_norm(const torch::Tensor& y, const torch::Tensor& z, const torch::Tensor& weight,
                                int64_t n_groups, double eps, at::ScalarType dtype, const Out& out_arg) {
  check_cpu(y, "mamba2_gated_norm: y");
  check_cpu(z, "mamba2_gated_norm: z");
  check_cpu(weight, "mamba2_gated_norm: weight");
  TORCH_CHECK(y.scalar_type() == torch::kFloat32 && y.dim() == 2, "mamba2_gated_norm: y float32 [rows, width] expected");
  TORCH_CHECK(z.sizes() == y.sizes(), "mamba2_gated_norm: z must have y's shape");
  const int64_t rows = y.size(0), width = y.size(1);
  TORCH_CHECK(n_groups > 0 && width % n_groups == 0 && width / n_groups <= 8192,
              "mamba2_gated_norm: width must split into n_groups slices of at most 8192 (an exact float64 sum)");
  TORCH_CHECK(weight.numel() == width, "mamba2_gated_norm: weight must be [", width, "]");
  const int z_code = dtype_code(z, "mamba2_gated_norm: z"), w_code = dtype_code(weight, "mamba2_gated_norm: weight");
  const int code = dtype_code(torch::empty({0}, y.options().dtype(dtype)), "mamba2_gated_norm: dtype");
  const auto out_type = c10::promoteTypes(dtype, weight.scalar_type());
  const auto like = torch::empty({0}, y.options().dtype(out_type));
  const int out_code = dtype_code(like, "mamba2_gated_norm: out");
  auto yc = y.contiguous();
  auto zc = z.stride(1) == 1 ? z : z.contiguous();
  auto out = output(out_arg, {rows, width}, like, "mamba2_gated_norm");
  if (rows > 0 && width > 0)
    tf::mamba2_gated_norm(yc.data_ptr<float>(), z_code, zc.data_ptr(), zc.stride(0), w_code,
                          weight.contiguous().data_ptr(), code, out_code, out.data_ptr(), rows, width, n_groups, eps,
                          threads());
  return out;
}

// exact.exp64 / exact.log64 over a float64 tensor (any shape), a new tensor back.
template <double (*F)(double)>
torch::Tensor elementwise64(const torch::Tensor& x) {
  check_cpu(x, "exp64/log64");
  TORCH_CHECK(x.scalar_type() == torch::kFloat64, "exp64/log64 take float64, got ", x.scalar_type());
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const double* in = xc.data_ptr<double>();
  double* o = out.data_ptr<double>();
  const int64_t n = xc.numel();
  const int nt = threads();
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && n >= (1 << 15))
  for (int64_t i = 0; i < n; ++i) o[i] = F(in[i]);
  return out;
}

// keyed.gumbel: noise [R, N] of row keys [R, 1] (int64 words) and token ids [R or 1, N].
torch::Tensor gumbel(const torch::Tensor& keys, const torch::Tensor& ids) {
  TORCH_CHECK(keys.scalar_type() == torch::kInt64 && ids.scalar_type() == torch::kInt64 && keys.dim() == 2 &&
                  keys.size(1) == 1 && ids.dim() == 2 && (ids.size(0) == 1 || ids.size(0) == keys.size(0)),
              "gumbel: int64 keys [R, 1] and ids [R or 1, N] expected");
  check_cpu(keys, "gumbel: keys");
  check_cpu(ids, "gumbel: ids");
  auto kc = keys.contiguous(), ic = ids.contiguous();
  const int64_t rows = keys.size(0), n = ids.size(1), id_stride = ids.size(0) == 1 ? 0 : n;
  auto out = torch::empty({rows, n}, keys.options().dtype(torch::kFloat64));
  const int64_t* k = kc.data_ptr<int64_t>();
  const int64_t* id = ic.data_ptr<int64_t>();
  double* o = out.data_ptr<double>();
  const int nt = threads();
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && rows * n >= (1 << 14))
  for (int64_t i = 0; i < rows * n; ++i)
    o[i] = tf::gumbel(static_cast<uint64_t>(k[i / n]), id[(i / n) * id_stride + i % n]);
  return out;
}

// sampler._keys: for z [R, V] (float64, scaled logits), m [R, 1] and ids [1, V] (global token
// ids), each drawable token's weight q = floor(exp64(z - m) 2^32) (0 where z = -inf) and its
// order key q << 30 | (2^30 - 1 - id) (-1 where not drawable), both int64 [R, V].
std::tuple<torch::Tensor, torch::Tensor> sample_keys(const torch::Tensor& z, const torch::Tensor& m,
                                                     const torch::Tensor& ids) {
  check_cpu(z, "sample_keys: z");
  TORCH_CHECK(z.scalar_type() == torch::kFloat64 && z.dim() == 2 && m.scalar_type() == torch::kFloat64 &&
                  m.numel() == z.size(0) && ids.scalar_type() == torch::kInt64 && ids.numel() == z.size(1),
              "sample_keys: float64 z [R, V], m [R, 1] and int64 ids [1, V] expected");
  auto zc = z.contiguous(), mc = m.contiguous(), ic = ids.contiguous();
  auto q = torch::empty(z.sizes(), z.options().dtype(torch::kInt64));
  auto keys = torch::empty_like(q);
  const int64_t rows = z.size(0), v = z.size(1);
  const double* zp = zc.data_ptr<double>();
  const double* mp = mc.data_ptr<double>();
  const int64_t* id = ic.data_ptr<int64_t>();
  int64_t* qp = q.data_ptr<int64_t>();
  int64_t* kp = keys.data_ptr<int64_t>();
  const int nt = threads();
  constexpr int64_t ID_MASK = (int64_t{1} << 30) - 1;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && rows * v >= (1 << 15))
  for (int64_t i = 0; i < rows * v; ++i) {
    const double zi = zp[i], d = zi - mp[i / v];
    const bool valid = zi > -std::numeric_limits<double>::infinity();
    const int64_t w = tf::token_weight(d);
    qp[i] = valid ? w : 0;
    kp[i] = valid ? ((w << 30) | (ID_MASK - id[i % v])) : -1;
  }
  return {q, keys};
}

// torch.topk(keys, k, dim=1) of distinct int64 keys (the sampler's order keys; not-drawable
// entries are all -1, and which of them fill a head's tail does not matter): the k largest per
// row, descending, with their indices.
std::tuple<torch::Tensor, torch::Tensor> top_keys(const torch::Tensor& keys, int64_t k) {
  check_cpu(keys, "top_keys");
  TORCH_CHECK(keys.scalar_type() == torch::kInt64 && keys.dim() == 2 && k >= 0 && k <= keys.size(1),
              "top_keys: int64 keys [R, V] and 0 <= k <= V expected");
  auto kc = keys.contiguous();
  const int64_t rows = keys.size(0), v = keys.size(1);
  auto values = torch::empty({rows, k}, keys.options()), index = torch::empty({rows, k}, keys.options());
  const int64_t* in = kc.data_ptr<int64_t>();
  int64_t* vp = values.data_ptr<int64_t>();
  int64_t* ip = index.data_ptr<int64_t>();
  const int nt = threads();
  // (key, index) pairs side by side: the selection compares keys without a gather per comparison
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1 && rows > 1 && rows * v >= (1 << 15))
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* row = in + r * v;
    std::vector<std::pair<int64_t, int64_t>> order(v);
    for (int64_t i = 0; i < v; ++i) order[i] = {row[i], -i};  // larger pair: larger key, then lower index
    auto larger = [](const std::pair<int64_t, int64_t>& a, const std::pair<int64_t, int64_t>& b) { return a > b; };
    if (k < v) std::nth_element(order.begin(), order.begin() + k, order.end(), larger);
    std::sort(order.begin(), order.begin() + k, larger);
    for (int64_t j = 0; j < k; ++j) {
      vp[r * k + j] = order[j].first;
      ip[r * k + j] = -order[j].second;
    }
  }
  return {values, index};
}

// sampler.sample's draw for rows without an order-dependent cut (draw.cpp): (tokens, status), one
// per row. The per-row settings come and go as host lists: a decode round's draw is then one
// call, without a tensor made for each of them.
std::pair<std::vector<int64_t>, std::vector<int32_t>> draw_rows(const torch::Tensor& x, const std::vector<double>& temps,
                                                                const std::vector<int64_t>& keys,
                                                                const std::vector<int64_t>& min_q, int64_t offset) {
  check_cpu(x, "draw_rows: logits");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "draw_rows: float32 logits [R, V] expected");
  const int64_t rows = x.size(0);
  TORCH_CHECK(static_cast<int64_t>(temps.size()) == rows && static_cast<int64_t>(keys.size()) == rows &&
                  static_cast<int64_t>(min_q.size()) == rows,
              "draw_rows: temps, keys and min_q, one per row, expected");
  auto xc = x.contiguous();
  std::vector<int64_t> tokens(rows);
  std::vector<int32_t> status(rows);
  {
    py::gil_scoped_release released;
    tf::draw_rows(xc.data_ptr<float>(), rows, x.size(1), temps.data(), keys.data(), min_q.data(), offset,
                  tokens.data(), status.data(), threads());
  }
  return {tokens, status};
}

// One GEMM per head in one call: x [rows, heads, k] -> [rows, heads, n] (a view of [heads, rows, n]),
// head h times packed[h] (all quantized from pack_quant, or all dense from pack_weight, of [n, k]),
// each as quant_linear / linear_packed computes it (the quantized ones in one parallel region).
torch::Tensor linear_heads(const torch::Tensor& x, const std::vector<torch::Tensor>& packed, bool quantized,
                           int64_t n, int64_t k) {
  check_cpu(x, "linear_heads: x");
  const int code = dtype_code(x, "linear_heads");
  const int64_t heads = static_cast<int64_t>(packed.size());
  TORCH_CHECK(x.dim() == 3 && x.size(1) == heads && x.size(2) == k, "linear_heads: x [rows, ", heads, ", ", k,
              "] expected, got ", x.sizes());
  for (const auto& p : packed)
    TORCH_CHECK(p.is_contiguous() && (quantized ? p.scalar_type() == torch::kUInt8 &&
                                                      tf::quant_packed_matches(p.data_ptr<uint8_t>(), p.numel(), n, k)
                                                : p.scalar_type() == x.scalar_type() &&
                                                      p.numel() == tf::packed_numel(code, n, k)),
                "linear_heads: a packed weight does not match [", n, ", ", k, "] and x's dtype");
  auto xt = x.transpose(0, 1).contiguous();  // [heads, rows, k]
  const int64_t rows = x.size(0);
  auto out = torch::empty({heads, rows, n}, x.options());
  if (out.numel() == 0) return out.transpose(0, 1);
  const int64_t es = x.element_size();
  auto* xp = static_cast<char*>(xt.data_ptr());
  auto* op = static_cast<char*>(out.data_ptr());
  if (quantized) {
    std::vector<tf::QuantJob> jobs;
    for (int64_t h = 0; h < heads; ++h)
      jobs.push_back({xp + h * rows * k * es, packed[h].data_ptr<uint8_t>(), op + h * rows * n * es, rows, n, k});
    tf::quant_linears(code, jobs.data(), heads, threads());
  } else {
    for (int64_t h = 0; h < heads; ++h)
      tf::linear(code, xp + h * rows * k * es, packed[h].data_ptr(), op + h * rows * n * es, rows, n, k, threads());
  }
  return out.transpose(0, 1);
}

// The rows of a latent-attention call (latent_attention and dsa_select): q [rows, heads, dim] as
// float32, a contiguous paged cache [blocks, block_size, dim], positions, tables and row_starts as
// the C++ paged attention takes them, checked.
struct LatentRows {
  torch::Tensor q, pos, tab, starts;
  int cache_code;
  int64_t num_seqs() const { return tab.size(0); }
};

LatentRows latent_rows(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& positions,
                       const torch::Tensor& tables, const torch::Tensor& row_starts, const char* what) {
  check_cpu(q, what);
  check_cpu(cache, what);
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 3 && cache.is_contiguous() && cache.size(2) == q.size(2), what,
              ": q [rows, heads, dim] and a contiguous cache [blocks, block_size, dim] expected");
  LatentRows r{q.to(torch::kFloat32).contiguous(), positions.to(torch::kInt64).contiguous(),
               tables.to(torch::kInt64).contiguous(), row_starts.to(torch::kInt64).contiguous(),
               dtype_code(cache, what)};
  TORCH_CHECK(r.tab.dim() == 2 && r.starts.numel() == r.tab.size(0) + 1 && r.pos.numel() == q.size(0), what,
              ": one table row per sequence and one position per row expected");
  check_rows(r.starts.data_ptr<int64_t>(), r.num_seqs(), q.size(0), r.pos.data_ptr<int64_t>(),
             r.tab.data_ptr<int64_t>(), r.tab.size(1), cache.size(1), cache.size(0));
  return r;
}

// latent_attention.latent_attention for the rows of several sequences over a latent cache
// [blocks, block_size, latent + rope]; selected: None or int32 [rows, top_k] (dsa_select's).
torch::Tensor latent_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& positions,
                               const torch::Tensor& tables, const torch::Tensor& row_starts, double scale,
                               int64_t latent, const c10::optional<torch::Tensor>& selected) {
  const LatentRows r = latent_rows(q, cache, positions, tables, row_starts, "latent_attention");
  TORCH_CHECK(latent > 0 && latent <= q.size(2), "latent_attention: 0 < latent <= dim expected");
  torch::Tensor sel;
  int64_t top_k = 0;
  if (selected) {
    check_cpu(*selected, "latent_attention: selected");
    TORCH_CHECK(selected->scalar_type() == torch::kInt32 && selected->dim() == 2 && selected->size(0) == q.size(0),
                "latent_attention: selected int32 [rows, top_k] expected");
    sel = selected->contiguous();
    top_k = sel.size(1);
  }
  auto out = torch::empty({q.size(0), q.size(1), latent}, r.q.options());
  if (out.numel() > 0)
    tf::latent_attention(r.cache_code, r.q.data_ptr<float>(), cache.data_ptr(), r.pos.data_ptr<int64_t>(),
                         r.tab.data_ptr<int64_t>(), r.tab.size(1), r.starts.data_ptr<int64_t>(), r.num_seqs(),
                         selected ? sel.data_ptr<int32_t>() : nullptr, top_k, q.size(1), q.size(2), latent,
                         cache.size(1), static_cast<float>(scale), out.data_ptr<float>(), threads());
  return out;
}

// latent_attention.indexer_scores + select_top_keys for the rows of several sequences over the
// indexer's keys [blocks, block_size, dim]: int32 [rows, top_k], chosen positions ascending, -1 pads.
torch::Tensor dsa_select(const torch::Tensor& q, const torch::Tensor& weights, const torch::Tensor& keys,
                         const torch::Tensor& positions, const torch::Tensor& tables, const torch::Tensor& row_starts,
                         double scale, int64_t top_k) {
  const LatentRows r = latent_rows(q, keys, positions, tables, row_starts, "dsa_select");
  check_cpu(weights, "dsa_select: weights");
  TORCH_CHECK(weights.scalar_type() == torch::kFloat32 && weights.dim() == 2 && weights.size(0) == q.size(0) &&
                  weights.size(1) == q.size(1) && top_k > 0,
              "dsa_select: float32 weights [rows, heads] and top_k > 0 expected");
  auto wc = weights.contiguous();
  auto out = torch::empty({q.size(0), top_k}, r.pos.options().dtype(torch::kInt32));
  if (q.size(0) > 0)
    tf::dsa_select(r.cache_code, r.q.data_ptr<float>(), wc.data_ptr<float>(), keys.data_ptr(),
                   r.pos.data_ptr<int64_t>(), r.tab.data_ptr<int64_t>(), r.tab.size(1), r.starts.data_ptr<int64_t>(),
                   r.num_seqs(), q.size(1), q.size(2), keys.size(1), static_cast<float>(scale), top_k,
                   out.data_ptr<int32_t>(), threads());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "TensorFold's exact cpu kernels (csrc/cpu)";
  m.def("isa", &tf::isa, "the vector code compiled in");
  m.def("pair_steps", &tf::pair_steps, "how the bfloat16 GEMM runs its steps (vdpbf16ps, fma-mxcsr or emulated)");
  const auto out = py::arg("out") = py::none();
  m.def("linear", &linear, "x [M, K] @ weight[N, K]^T, each output summed in one order fixed by K",
        py::arg("x"), py::arg("weight"), out);
  m.def("pack_quant", &pack_quant, "quant_gemm.QuantWeight's fields in the quantized GEMM's packed layout",
        py::arg("kind"), py::arg("codes"), py::arg("scale"), py::arg("scale_exp"), py::arg("min") = py::none(),
        py::arg("min_exp") = py::none());
  m.def("quant_file_bytes", &quant_file_bytes, "bytes of a GGUF tensor's blocks packed by pack_quant_file",
        py::arg("kind"), py::arg("n"), py::arg("k"));
  m.def("pack_quant_file", &pack_quant_file,
        "a GGUF tensor's blocks (row i at file offset row_offsets[i]) packed as pack_quant packs them, into out",
        py::arg("out"), py::arg("kind"), py::arg("path"), py::arg("row_offsets"), py::arg("k"));
  m.def("quant_rows", &quant_rows, "rows of a packed quantized weight, dequantized to float32 (an embedding)",
        py::arg("packed"), py::arg("ids"), py::arg("n"), py::arg("k"));
  m.def("quant_linear", &quant_linear, "kernels/quant_gemm.linear with a weight from pack_quant, of shape [n, k]",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("k"), out);
  m.def("quant_amx_path", &tf::quant_amx_path, "\"amx\" where prompt rows' block dots run on AMX-INT8 tiles, else why not");
  m.def("set_quant_amx", &tf::set_quant_amx, "allow (true) or forbid the AMX path; returns whether it was allowed",
        py::arg("allowed"));
  m.def("pack_weight", &pack_weight, "weight [N, K] in the GEMM's tile layout (1-D)", py::arg("weight"));
  m.def("linear_packed", &linear_packed, "linear with a weight from pack_weight, of shape [n, k]", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("k"), out);
  m.def("rms_norm", &rms_norm, "reference.rms_norm", py::arg("x"), py::arg("weight"), py::arg("eps"), out);
  m.def("add_rms_norm", &add_rms_norm, "reference.add_rms_norm: (rms_norm(residual + x), residual + x)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), out);
  m.def("layer_norm", &layer_norm, "reference.layer_norm", py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("eps"));
  m.def("apply_rope", &apply_rope, "reference.apply_rope", py::arg("x"), py::arg("cos"), py::arg("sin"), out);
  m.def("rms_norm_rope", &rms_norm_rope, "reference.rms_norm_rope", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("cos"), py::arg("sin"), out);
  m.def("silu_and_mul", &gate_and_mul<SILU>, "reference.silu_and_mul", py::arg("gate"), py::arg("up"), out);
  m.def("sigmoid_and_mul", &gate_and_mul<SIGMOID>, "reference.sigmoid_and_mul", py::arg("gate"), py::arg("up"), out);
  m.def("relu_squared", &relu_squared, "reference.relu_squared: relu(x)^2 in x's dtype", py::arg("x"));
  m.def("softcap", &softcap, "reference.softcap: cap * tanh32(logits / cap), float32", py::arg("logits"),
        py::arg("cap"));
  m.def("gelu_tanh_and_mul", &gate_and_mul<GELU_TANH>, "reference.gelu_tanh_and_mul", py::arg("gate"), py::arg("up"),
        out);
  m.def("write_kv", &write_kv, "paged_attention.write_kv_ref", py::arg("k_cache"), py::arg("v_cache"),
        py::arg("k"), py::arg("v"), py::arg("slots"), py::arg("v_exp") = py::none());
  m.def("delta_net", &delta_net,
        "delta_net.delta_net: conv, norms, gates and the recurrence of a ForwardBatch's rows in one call; writes "
        "the conv and ssm states in place",
        py::arg("qkv"), py::arg("a"), py::arg("b"), py::arg("conv_state"), py::arg("ssm_state"),
        py::arg("state_in"), py::arg("state_out"), py::arg("row_starts"),
        py::arg("conv_weight"), py::arg("rate"), py::arg("dt_bias"), py::arg("num_key_heads"), py::arg("num_heads"),
        py::arg("key_dim"), py::arg("value_dim"), out);
  m.def("gated_rms_norm", &gated_rms_norm, "delta_net.gated_rms_norm: rms_norm(x) * weight * silu(gate)",
        py::arg("x"), py::arg("gate"), py::arg("weight"), py::arg("eps"), out);
  m.def("mamba2", &mamba2,
        "mamba2.mamba2: conv, time steps and the SSD recurrence of a ForwardBatch's rows in one call; writes the "
        "conv and ssm states in place",
        py::arg("xbc"), py::arg("dt"), py::arg("conv_state"), py::arg("ssm_state"), py::arg("state_in"),
        py::arg("state_out"), py::arg("row_starts"), py::arg("conv_weight"), py::arg("conv_bias"), py::arg("rate"),
        py::arg("dt_bias"), py::arg("d"), py::arg("dt_min"), py::arg("dt_max"), py::arg("num_heads"),
        py::arg("head_dim"), py::arg("n_groups"), py::arg("state_size"), out);
  m.def("mamba2_gated_norm", &mamba2_gated_norm,
        "mamba2.gated_group_norm: rms_norm per group of y * silu(z), rounded to dtype, times weight", py::arg("y"),
        py::arg("z"), py::arg("weight"), py::arg("n_groups"), py::arg("eps"), py::arg("dtype"), out);
  m.def("exp64", &elementwise64<tf::exp64>, "exact.exp64: float64 exp without libm", py::arg("x"));
  m.def("log64", &elementwise64<tf::log64>, "exact.log64: float64 log without libm", py::arg("x"));
  m.def("sample_keys", &sample_keys, "sampler._keys: weights q and order keys", py::arg("z"), py::arg("m"),
        py::arg("ids"));
  m.def("top_keys", &top_keys, "torch.topk(keys, k, dim=1) for the sampler's distinct order keys", py::arg("keys"),
        py::arg("k"));
  m.def("draw_rows", &draw_rows, "sampler.sample's draw of greedy and order-free rows: (tokens, status)",
        py::arg("logits"), py::arg("temps"), py::arg("keys"), py::arg("min_q"), py::arg("offset"));
  m.def("gumbel", &gumbel, "keyed.gumbel: noise of (row key [R, 1], token ids [R|1, N])", py::arg("keys"),
        py::arg("ids"));
  m.def("moe_route", &moe_route, "kernels/moe.route: the top k experts of each row and their weights",
        py::arg("logits"), py::arg("top_k"), py::arg("normalize"));
  m.def("moe_route_sigmoid", &moe_route_sigmoid,
        "kernels/moe.route_sigmoid: each row's top k experts by sigmoid score plus bias within the best groups, "
        "and their weights", py::arg("logits"), py::arg("bias"), py::arg("top_k"), py::arg("n_group"),
        py::arg("topk_group"), py::arg("normalize"), py::arg("scale"));
  py::class_<MoEBlock, std::shared_ptr<MoEBlock>>(m, "MoEBlock",
                       "a mixture-of-experts feed-forward (router, routed SwiGLU or GeGLU experts, a per-expert "
                       "scale, gated shared expert) in one call, built once at load from its packed weights, "
                       "checked then")
      .def(py::init([](const torch::Tensor& router, const std::vector<torch::Tensor>& gate_ups,
                       const std::vector<torch::Tensor>& downs, const Out& shared_gate_up, const Out& shared_down,
                       const Out& shared_gate, int64_t hidden, int64_t top_k, int64_t intermediate,
                       int64_t shared_intermediate, bool normalize, const std::string& activation,
                       const Out& expert_scale, const Out& route_bias, int64_t n_group, int64_t topk_group,
                       double route_scale, bool shared_gated) {
             TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "MoEBlock: activation ", activation,
                         " is not served (silu, gelu_tanh)");
             MoEShape shape{hidden, static_cast<int64_t>(gate_ups.size()), top_k, intermediate, shared_intermediate,
                            normalize, activation == "gelu_tanh" ? 1 : 0};
             shape.n_group = n_group, shape.topk_group = topk_group, shape.route_scale = route_scale;
             shape.shared_gated = shared_gated;
             return MoEBlock(router, gate_ups, downs, shared_gate_up, shared_down, shared_gate, shape, expert_scale,
                             route_bias);
           }),
           py::arg("router"), py::arg("gate_ups"), py::arg("downs"), py::arg("shared_gate_up") = py::none(),
           py::arg("shared_down") = py::none(), py::arg("shared_gate") = py::none(), py::kw_only(), py::arg("hidden"),
           py::arg("top_k"), py::arg("intermediate"), py::arg("shared_intermediate") = 0, py::arg("normalize") = true,
           py::arg("activation") = "silu", py::arg("expert_scale") = py::none(), py::arg("route_bias") = py::none(),
           py::arg("n_group") = 0, py::arg("topk_group") = 0, py::arg("route_scale") = 1.0,
           py::arg("shared_gated") = true)
      .def("forward", &MoEBlock::forward,
           "x [tokens, hidden] -> the block's output, x's dtype; router_x: the router's input where not x",
           py::arg("x"), py::arg("router_x") = py::none())
      .def("__call__", &MoEBlock::forward, "forward(x, router_x)", py::arg("x"), py::arg("router_x") = py::none())
      .def_property_readonly("num_experts", [](const MoEBlock& b) { return b.shape().experts; })
      .def_property_readonly("top_k", [](const MoEBlock& b) { return b.shape().top_k; });
  py::class_<DecoderLayer>(m, "DecoderLayer",
                           "one llama/qwen3 decoder layer, built once at load from its packed weights "
                           "(pack_weight or pack_quant), norms and shapes, checked then")
      .def(py::init([](const py::object& qkv, const torch::Tensor& o, const Out& gate_up,
                       const Out& down, const torch::Tensor& post_norm, const Out& q_norm, const Out& k_norm,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden,
                       int64_t intermediate, double eps, double scale, int64_t window, int64_t rope_dim,
                       bool output_gate, std::shared_ptr<MoEBlock> moe, const std::vector<int64_t>& qkv_widths) {
             // qkv: one packed tensor, or a list of parts (qkv_widths then gives their widths)
             const bool parts = py::isinstance<py::list>(qkv) || py::isinstance<py::tuple>(qkv);
             return DecoderLayer(parts ? qkv.cast<std::vector<torch::Tensor>>()
                                       : std::vector<torch::Tensor>{qkv.cast<torch::Tensor>()},
                                 qkv_widths, o, gate_up, down, post_norm, q_norm, k_norm,
                                 {num_heads, num_kv_heads, head_dim, hidden, intermediate, eps, scale, window,
                                  rope_dim > 0 ? rope_dim : head_dim, output_gate},
                                 std::move(moe));
           }),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("post_norm"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("hidden"),
           py::arg("intermediate"), py::arg("eps"), py::arg("scale"), py::arg("window"), py::arg("rope_dim") = 0,
           py::arg("output_gate") = false, py::arg("moe") = py::none(),
           py::arg("qkv_widths") = std::vector<int64_t>{})
      .def(
          "forward",
          [](const DecoderLayer& layer, const torch::Tensor& x, const torch::Tensor& residual, const Out& next_norm,
             const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& k_cache,
             const torch::Tensor& v_cache, const Out& v_exp, const torch::Tensor& slots, const torch::Tensor& positions,
             const torch::Tensor& tables, const torch::Tensor& row_starts) {
            return layer.forward(
                {x, residual, next_norm, cos, sin, k_cache, v_cache, v_exp, slots, positions, tables, row_starts});
          },
          "(the next layer's normed input, or None without next_norm; the new residual); writes the caches "
          "(and v_exp) in place",
          py::arg("x"), py::arg("residual"), py::arg("next_norm"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
          py::arg("v_cache"), py::arg("v_exp"), py::arg("slots"), py::arg("positions"), py::arg("tables"),
          py::arg("row_starts"))
      .def_property_readonly("num_heads", [](const DecoderLayer& l) { return l.shape().num_heads; })
      .def_property_readonly("num_kv_heads", [](const DecoderLayer& l) { return l.shape().num_kv_heads; })
      .def_property_readonly("head_dim", [](const DecoderLayer& l) { return l.shape().head_dim; })
      .def_property_readonly("hidden", [](const DecoderLayer& l) { return l.shape().hidden; })
      .def_property_readonly("intermediate", [](const DecoderLayer& l) { return l.shape().intermediate; })
      .def_property_readonly("window", [](const DecoderLayer& l) { return l.shape().window; })
      .def_property_readonly("rope_dim", [](const DecoderLayer& l) { return l.shape().rope_dim; })
      .def_property_readonly("output_gate", [](const DecoderLayer& l) { return l.shape().output_gate; });
  py::class_<DeltaNetLayer>(m, "DeltaNetLayer",
                            "one Gated DeltaNet layer with its SwiGLU MLP or MoE block (the Qwen hybrids), built once at load "
                            "from its packed weights, norms, conv taps, rate and dt_bias, checked then")
      .def(py::init([](const torch::Tensor& in_proj, const torch::Tensor& out_proj, const Out& gate_up, const Out& down,
                       const torch::Tensor& post_norm, const torch::Tensor& gated_norm,
                       const torch::Tensor& conv_weight, const torch::Tensor& rate, const torch::Tensor& dt_bias,
                       int64_t num_key_heads, int64_t num_heads, int64_t key_dim, int64_t value_dim, int64_t hidden,
                       int64_t intermediate, double eps, std::shared_ptr<MoEBlock> moe,
                       const c10::optional<torch::Tensor>& out_order) {
             return DeltaNetLayer(in_proj, out_proj, gate_up, down, post_norm, gated_norm, conv_weight, rate, dt_bias,
                                  {num_key_heads, num_heads, key_dim, value_dim, hidden, intermediate, eps},
                                  std::move(moe), out_order);
           }),
           py::arg("in_proj"), py::arg("out_proj"), py::arg("gate_up"), py::arg("down"), py::arg("post_norm"),
           py::arg("gated_norm"), py::arg("conv_weight"), py::arg("rate"), py::arg("dt_bias"), py::arg("num_key_heads"),
           py::arg("num_heads"), py::arg("key_dim"), py::arg("value_dim"), py::arg("hidden"), py::arg("intermediate"),
           py::arg("eps"), py::arg("moe") = py::none(), py::arg("out_order") = py::none())
      .def(
          "forward",
          [](const DeltaNetLayer& layer, const torch::Tensor& x, const torch::Tensor& residual, const Out& next_norm,
             const torch::Tensor& conv_state, const torch::Tensor& ssm_state, const torch::Tensor& state_in,
             const torch::Tensor& state_out, const torch::Tensor& row_starts) {
            return layer.forward({x, residual, next_norm, conv_state, ssm_state, state_in, state_out, row_starts});
          },
          "(the next layer's normed input, or None without next_norm; the new residual); writes the recurrent "
          "state in place",
          py::arg("x"), py::arg("residual"), py::arg("next_norm"), py::arg("conv_state"), py::arg("ssm_state"),
          py::arg("state_in"), py::arg("state_out"), py::arg("row_starts"));
  py::class_<Mamba2Layer>(m, "Mamba2Layer",
                          "one Nemotron-H Mamba2 layer (input norm applied, the mixer, the residual add and the next "
                          "norm), built once at load from its packed GEMMs, norm weight, conv and gates, checked then")
      .def(py::init([](const torch::Tensor& in_proj, const torch::Tensor& out_proj, const torch::Tensor& norm,
                       const torch::Tensor& conv_weight, const Out& conv_bias, const torch::Tensor& rate,
                       const torch::Tensor& dt_bias, const torch::Tensor& d, int64_t num_heads, int64_t head_dim,
                       int64_t n_groups, int64_t state_size, int64_t hidden, double eps, double dt_min, double dt_max) {
             return Mamba2Layer(in_proj, out_proj, norm, conv_weight, conv_bias, rate, dt_bias, d,
                                {num_heads, head_dim, n_groups, state_size, hidden, eps, dt_min, dt_max});
           }),
           py::arg("in_proj"), py::arg("out_proj"), py::arg("norm"), py::arg("conv_weight"), py::arg("conv_bias"),
           py::arg("rate"), py::arg("dt_bias"), py::arg("d"), py::arg("num_heads"), py::arg("head_dim"),
           py::arg("n_groups"), py::arg("state_size"), py::arg("hidden"), py::arg("eps"), py::arg("dt_min"),
           py::arg("dt_max"))
      .def(
          "forward",
          [](const Mamba2Layer& layer, const torch::Tensor& x, const torch::Tensor& residual, const Out& next_norm,
             const torch::Tensor& conv_state, const torch::Tensor& ssm_state, const torch::Tensor& state_in,
             const torch::Tensor& state_out, const torch::Tensor& row_starts) {
            return layer.forward({x, residual, next_norm, conv_state, ssm_state, state_in, state_out, row_starts});
          },
          "(the next layer's normed input, or None without next_norm; the new residual); writes the recurrent "
          "state in place",
          py::arg("x"), py::arg("residual"), py::arg("next_norm"), py::arg("conv_state"), py::arg("ssm_state"),
          py::arg("state_in"), py::arg("state_out"), py::arg("row_starts"));
  m.def("linear_heads", &linear_heads,
        "one GEMM per head: x [rows, heads, k] -> [rows, heads, n], head h by packed[h] (all quantized or all dense)",
        py::arg("x"), py::arg("packed"), py::arg("quantized"), py::arg("n"), py::arg("k"));
  m.def("latent_attention", &latent_attention,
        "latent_attention.latent_attention of the rows of several sequences over the latent cache in one call",
        py::arg("q"), py::arg("cache"), py::arg("positions"), py::arg("tables"), py::arg("row_starts"),
        py::arg("scale"), py::arg("latent"), py::arg("selected") = py::none());
  m.def("dsa_select", &dsa_select,
        "the DSA indexer's top_k keys per row (indexer_scores + select_top_keys): int32 [rows, top_k], -1 pads",
        py::arg("q"), py::arg("weights"), py::arg("keys"), py::arg("positions"), py::arg("tables"),
        py::arg("row_starts"), py::arg("scale"), py::arg("top_k"));
  m.def("paged_attention", &paged_attention,
        "exact attention of the rows of several sequences: row_starts [S + 1], tables [S, width]; window 0: none",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("positions"), py::arg("tables"),
        py::arg("row_starts"), py::arg("scale"), py::arg("window"), py::arg("v_exp") = py::none(), out);
}
