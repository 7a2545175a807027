"""Gemma 4's dense text model (gemma4, gemma4_text) on MLX arrays: models/gemma4.py's layers and
model-level parts over this backend's ops, bitwise the torch references wherever they are.

    gelu_tanh_and_mul  x sigmoid32(2u), u = sqrt(2/pi) (x + 0.044715 x^3), times up, in float32
                       steps, rounded once to gate's dtype     = kernels/reference.gelu_tanh_and_mul
    tanh32             the odd polynomial below |x| = 0.625, (1 - t) / (1 + t) with t =
                       exp_neg(-2|x|) above, the sign put back  = reference.tanh32
    softcap            tanh32(logits / cap) * cap, float32       = reference.softcap

Gemma4Attention: Q and K RMS-normed per head, then rope over the whole head (the global layers'
proportional rope is a table whose still frequencies are 0: cos 1, sin 0); V normed without a
weight (a weight of ones, as the reference multiplies by); with values_are_keys V is the keys'
projection before k_norm and rope; a KV-shared layer computes Q only and attends over its source
layer's cache, which that layer wrote earlier in the same forward (MLXBackend.allocate hands both
layers one LayerCache). Score scale 1, the layer's window in ops.attention's mask.

Gemma4Layer: models/gemma4.Gemma4Layer's steps (four norms, GeGLU, the per-layer input's gate
and projection, the layer scalar). Gemma4Model: the embedding times sqrt(hidden) rounded to the
dtype, the per-layer inputs (models/gemma4.PerLayerInputs' roundings) and soft-capped logits.

With enable_moe_block (26B-A4B) every layer runs Gemma4MoE beside its MLP: the MLP's output and
the experts' each normed, their sum what the post-FFN norm takes (models/gemma4_moe.py).
"""
import mlx.core as mx
import numpy as np
import torch

from tensorfold.exact.float32 import f32
from tensorfold.kernels.reference import TANH_POLY, TANH_SMALL
from tensorfold.mlx import grid, moe, ops
from tensorfold.mlx.model import Attention, MLXModel, RopeRows, _mx
from tensorfold.models.cache import PagedKV, SharedKV
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.gemma4 import Gemma4AttentionSpec, Gemma4LayerSpec, layer_gemms, per_layer_table
from tensorfold.models.moe import MoESpec, block_gemms
from tensorfold.models.spec import MLPSpec
from tensorfold.models.weights import WeightReader

GELU_CUBIC = f32(0.044715)
GELU_SCALE = f32(2 * 0.7978845608028654)  # 2 sqrt(2/pi)


# ---- elementwise: the references' float32 steps ----

def gelu_tanh32(x: mx.array) -> mx.array:
    """reference.gelu_tanh32's steps on float32 x."""
    u = x * x
    u = u * GELU_CUBIC
    u = u * x
    u = u + x
    u = u * GELU_SCALE
    return x * ops.sigmoid32(u)


@grid.fused
def gelu_tanh_and_mul(gate: mx.array, up: mx.array) -> mx.array:
    return (gelu_tanh32(gate.astype(mx.float32)) * up.astype(mx.float32)).astype(gate.dtype)


def tanh32(x: mx.array) -> mx.array:
    """reference.tanh32's steps on float32 x."""
    z = x * x
    p = z * TANH_POLY[0]
    for c in TANH_POLY[1:]:
        p = (p + c) * z
    small = x + x * p
    t = grid.exp_neg(mx.abs(x) * -2.0)
    large = (1.0 - t) / (1.0 + t)
    negative = (x.view(mx.uint32) >> 31) == 1  # copysign: the sign bit, -0.0 and NaN's included
    large = mx.where(negative, -large, large)
    return mx.where(mx.abs(x) < TANH_SMALL, small, large)


@grid.fused
def _softcap(logits: mx.array, cap: mx.array) -> mx.array:
    return tanh32(logits.astype(mx.float32) / cap) * cap


def softcap(logits: mx.array, cap: float) -> mx.array:
    """cap * tanh(logits / cap) in float32 (reference.softcap)."""
    return _softcap(logits, mx.array(f32(cap), dtype=mx.float32))


# ---- blocks ----

class Gemma4Attention(Attention):
    """models/gemma4.Gemma4Attention on MLX arrays (the module docstring)."""

    def __init__(self, spec: Gemma4AttentionSpec, w: WeightReader, eps: float, rope: RopeRows, dtype):
        self.spec, self.eps, self.rope = spec, eps, rope
        attn = w.under("self_attn.")
        projections = ["q"] if spec.kv_source is not None else ["q", "k"] if spec.values_are_keys else ["q", "k", "v"]
        self.qkv = attn.linear(*(f"{p}_proj.weight" for p in projections),
                               biases=tuple(f"{p}_proj.bias" for p in projections))
        self.o = attn.linear("o_proj.weight", biases=("o_proj.bias",))
        self.q_norm = _mx(attn.norm("q_norm.weight"))
        if spec.kv_source is None:
            self.k_norm = _mx(attn.norm("k_norm.weight"))
            self.v_norm = mx.ones((spec.head_dim,), dtype=dtype)  # v_norm has no weight
            self.cache_spec = PagedKV(spec.num_kv_heads, spec.head_dim, spec.window)
        else:
            self.k_norm = self.v_norm = None
            self.cache_spec = SharedKV(spec.kv_source)

    def __call__(self, x: mx.array, batch, cache: ops.LayerCache, rope_rows) -> mx.array:
        s, rows = self.spec, x.shape[0]
        qkv = self.qkv(x)  # [rows, (heads + kv_heads (x2 with v_proj)) * head_dim]; q alone if shared
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        cos, sin = rope_rows(self.rope)
        q = self._norm_rope(qkv[:, :q_size].reshape(rows, s.num_heads, s.head_dim), self.q_norm, cos, sin)
        if s.kv_source is None:  # else the source layer wrote this forward's K/V already
            k = qkv[:, q_size:q_size + kv_size].reshape(rows, s.num_kv_heads, s.head_dim)
            v = k if s.values_are_keys else qkv[:, q_size + kv_size:].reshape(rows, s.num_kv_heads, s.head_dim)
            ops.write_kv(cache, self._norm_rope(k, self.k_norm, cos, sin), ops.rms_norm(v, self.v_norm, self.eps),
                         batch.slots)
        out = [ops.attention(q[seq.start:seq.end], cache, seq.positions, seq.key_slots, s.scale, s.window)
               for seq in batch.sequences]
        out = out[0] if len(out) == 1 else mx.concatenate(out)
        return self.o(out.reshape(rows, -1))

    def _norm_rope(self, x, norm, cos, sin):
        return ops.apply_rope(ops.rms_norm(x, norm, self.eps), cos, sin)


class GeGLU:
    """Gemma's MLP (and each expert): gate and up in one GEMM, gelu_tanh_and_mul, down; the
    weights {gate,up,down}_proj.weight under w."""

    def __init__(self, spec: MLPSpec | MoESpec, w: WeightReader):
        if spec.activation != "gelu_tanh":
            raise CheckpointError(f"{w.prefix}: activation {spec.activation!r}; Gemma 4 on mlx runs gelu_tanh")
        self.size = spec.intermediate_size
        self.gate_up = w.linear("gate_proj.weight", "up_proj.weight")
        self.down = w.linear("down_proj.weight")

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = self.gate_up(x)
        return self.down(gelu_tanh_and_mul(gate_up[:, :self.size], gate_up[:, self.size:]))

    def gemms(self) -> dict:
        return {"gate_up": self.gate_up, "down": self.down}


class Gemma4MoE:
    """models/gemma4_moe.Gemma4MoE (models/moe.MoE.compose's steps with Gemma's router) on MLX
    arrays: the router's input rms_norm(h) (no weight) * router.scale, then times hidden^-0.5 in
    float32, rounded to the dtype; mlx/moe.route's softmax top k (normalized over the chosen);
    each weight times its expert's per_expert_scale (float32); each chosen expert's GeGLU on
    pre_feedforward_layernorm_2(h), added per row from 0 in float32 in ascending expert index;
    the sum in the dtype through post_feedforward_layernorm_2."""

    def __init__(self, spec: MoESpec, w: WeightReader, eps: float, dtype):
        self.spec, self.eps = spec, eps
        router = w.under("router.")
        self.router = router.linear("proj.weight")  # [E, hidden]
        self.router_scale = _mx(router.dense("scale"))  # [hidden], the dtype's
        self.expert_scale = ops.from_torch(router.dense("per_expert_scale").float())  # [E]
        hidden = self.router_scale.shape[0]
        self.unit = mx.ones((hidden,), dtype=dtype)  # the router's norm has no weight
        self.root = f32(hidden ** -0.5)
        self.pre_norm = _mx(w.norm("pre_feedforward_layernorm_2.weight"))
        self.post_norm = _mx(w.norm("post_feedforward_layernorm_2.weight"))
        self.experts = [GeGLU(spec, w.under(f"experts.{e}.")) for e in range(spec.num_experts)]
        self.shared = self.shared_gate = None

    def gemms(self) -> dict:
        return block_gemms(self)

    def __call__(self, h: mx.array) -> mx.array:
        x = ops.rms_norm(h, self.pre_norm, self.eps)
        routed_on = ((ops.rms_norm(h, self.unit, self.eps) * self.router_scale).astype(mx.float32)
                     * self.root).astype(h.dtype)
        logits = self.router(routed_on).astype(mx.float32)              # [rows, E]
        chosen, weights = moe.route(logits, self.spec.top_k, self.spec.norm_topk_prob)  # [rows, k] each
        weights = weights * self.expert_scale[mx.array(chosen)]          # one float32 product each
        out = mx.zeros(x.shape, dtype=mx.float32)
        for e in np.unique(chosen).tolist():  # ascending: each row's terms in expert order
            rows, slot = (mx.array(i.astype(np.int32)) for i in np.nonzero(chosen == e))
            out = out.at[rows].add(self.experts[e](x[rows]).astype(mx.float32) * weights[rows, slot][:, None])
        return ops.rms_norm(out.astype(h.dtype), self.post_norm, self.eps)


class Gemma4Layer:
    """models/gemma4.Gemma4Layer on MLX arrays: takes its input normed, returns the residual."""

    def __init__(self, spec: Gemma4LayerSpec, w: WeightReader, rope: RopeRows, dtype):
        if not isinstance(spec.mixer, Gemma4AttentionSpec) or type(spec.ffn) is not MLPSpec:
            raise CheckpointError(f"Gemma 4 on mlx runs Gemma 4 attention and MLP layers; this checkpoint has "
                                  f"{type(spec.mixer).__name__} + {type(spec.ffn).__name__}")
        self.spec, self.eps = spec, spec.norm_eps
        self.input_norm = _mx(w.norm("input_layernorm.weight"))
        self.post_mixer_norm = _mx(w.norm("post_attention_layernorm.weight"))
        self.pre_ffn_norm = _mx(w.norm("pre_feedforward_layernorm.weight"))
        self.post_ffn_norm = _mx(w.norm("post_feedforward_layernorm.weight"))
        self.mixer = Gemma4Attention(spec.mixer, w, spec.norm_eps, rope, dtype)
        self.ffn = GeGLU(spec.ffn, w.under("mlp."))
        self.moe = self.post_mlp_norm = None
        if spec.moe is not None:  # the experts beside the MLP, each output normed before the sum
            self.moe = Gemma4MoE(spec.moe, w, spec.norm_eps, dtype)
            self.post_mlp_norm = _mx(w.norm("post_feedforward_layernorm_1.weight"))
        self.per_layer_gate = self.per_layer_proj = self.per_layer_norm = None
        if spec.per_layer_input:
            self.per_layer_gate = w.linear("per_layer_input_gate.weight")  # [width, hidden]
            self.per_layer_proj = w.linear("per_layer_projection.weight")  # [hidden, width]
            self.per_layer_norm = _mx(w.norm("post_per_layer_input_norm.weight"))
        self.scalar = _mx(w.dense("layer_scalar"))  # [1]

    @property
    def cache_spec(self):
        return self.mixer.cache_spec

    def gemms(self) -> dict:
        return layer_gemms(self)

    def __call__(self, x, residual, batch, cache, rope_rows, per_layer_input=None) -> mx.array:
        eps = self.eps
        h = residual + ops.rms_norm(self.mixer(x, batch, cache, rope_rows), self.post_mixer_norm, eps)
        out = self.ffn(ops.rms_norm(h, self.pre_ffn_norm, eps))
        if self.moe is not None:  # the experts read the residual stream itself (their own norms)
            out = ops.rms_norm(out, self.post_mlp_norm, eps) + self.moe(h)
        h = h + ops.rms_norm(out, self.post_ffn_norm, eps)
        if self.per_layer_gate is not None:
            gated = gelu_tanh_and_mul(self.per_layer_gate(h), per_layer_input)  # [rows, width]
            h = h + ops.rms_norm(self.per_layer_proj(gated), self.per_layer_norm, eps)
        return h * self.scalar


class PerLayerInputs:
    """models/gemma4.PerLayerInputs on MLX arrays: [rows, layers, width], the same roundings."""

    def __init__(self, w: WeightReader, args: ModelArgs, width: int, eps: float, dtype):
        self.dtype, self.eps = dtype, eps
        self.num_layers, self.width = args.num_layers, width
        table = per_layer_table(w, args, width)
        quantized = ops.MLXLinear.quantized(table)
        self.lookup = ops.MLXLinear.of(table).rows if quantized else ops.from_torch(table).__getitem__
        self.proj = w.linear("model.per_layer_model_projection.weight")  # [layers * width, hidden]
        self.norm = _mx(w.norm("model.per_layer_projection_norm.weight"))  # [width]
        self.table_scale = ops.from_torch(torch.tensor(width ** 0.5, dtype=torch.float32).to(w.dtype))
        self.proj_scale = f32(args.hidden_size ** -0.5)

    def __call__(self, ids: mx.array, embedded: mx.array) -> mx.array:
        shape = (ids.shape[0], self.num_layers, self.width)
        tokens = (self.lookup(ids).astype(self.dtype) * self.table_scale).reshape(shape)
        projected = (self.proj(embedded).astype(mx.float32) * self.proj_scale).astype(self.dtype)
        projected = ops.rms_norm(projected.reshape(shape), self.norm, self.eps)
        return ((projected + tokens).astype(mx.float32) * f32(2 ** -0.5)).astype(self.dtype)


class Gemma4Model(MLXModel):
    """MLXModel with Gemma 4's layers and model-level parts (the module docstring)."""

    def __init__(self, args: ModelArgs, specs: list, tensors: dict, dtype: torch.dtype, norm_offset: float = 0.0):
        self._ropes: dict = {}
        super().__init__(args, specs, tensors, dtype, norm_offset)
        w = WeightReader(tensors, dtype, torch.device("cpu"), type(self).weight_ops, norm_offset=norm_offset)
        # transformers rounds sqrt(hidden) to float32, then to the weights' dtype
        self.embed_scale = ops.from_torch(torch.tensor(args.hidden_size ** 0.5, dtype=torch.float32).to(dtype))
        width = self.specs[0].per_layer_input
        self.per_layer_inputs = PerLayerInputs(w, args, width, args.rms_norm_eps, self.mx_dtype) if width else None
        cap = args.hf.get("final_logit_softcapping")
        self.softcap = float(cap) if cap else None

    def layer(self, spec, w: WeightReader) -> Gemma4Layer:
        a = spec.mixer
        key = (a.rope, a.head_dim, a.max_position)
        if key not in self._ropes:  # one table per kind of layer
            self._ropes[key] = RopeRows(a)
        return Gemma4Layer(spec, w, self._ropes[key], self.mx_dtype)

    def forward(self, batch, caches: list) -> mx.array:
        rope_cache: dict[int, tuple] = {}

        def rope_rows(table):  # each table's rows once per forward
            if id(table) not in rope_cache:
                rope_cache[id(table)] = table.at(batch.positions)
            return rope_cache[id(table)]

        residual = self.embed(batch.input_ids).astype(self.mx_dtype) * self.embed_scale
        inputs = self.per_layer_inputs(batch.input_ids, residual) if self.per_layer_inputs else None
        x = ops.rms_norm(residual, self.layers[0].input_norm, self.layers[0].eps)
        for i, layer in enumerate(self.layers):
            residual = layer(x, residual, batch.in_group(self.group_of[i]), caches[i], rope_rows,
                             None if inputs is None else inputs[:, i])
            if i + 1 < len(self.layers):
                x = ops.rms_norm(residual, self.layers[i + 1].input_norm, layer.eps)
        out = ops.rms_norm(residual[batch.logits_rows], self.norm, self.specs[-1].norm_eps)
        logits = self.lm_head(out).astype(mx.float32)
        return logits if self.softcap is None else softcap(logits, self.softcap)

