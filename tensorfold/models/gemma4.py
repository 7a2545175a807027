"""Gemma 4 (gemma4_text, and the text model of the multimodal gemma4 checkpoints).

Layers are sliding-window or global attention, in the config's layer_types; each kind has its
own head size, KV head count and rope (the global layers' head_dim and KV heads come from
per_layer_config, or the Hub's global_head_dim / num_global_key_value_heads; their rope is
"proportional": a share of the head's frequencies turns, the rest stand still). Every layer:

    x -> input norm -> attention -> post-attention norm -> + residual
      -> pre-FFN norm -> GeGLU MLP -> post-FFN norm -> + residual
      -> [per-layer input: proj(gelu(gate(h)) * input_i) -> norm -> + residual]
      -> times the layer's scalar

With enable_moe_block (26B-A4B) every layer also runs a mixture of experts beside its MLP
(models/gemma4_moe.py): the MLP's output and the experts' each get a norm of their own, and their
sum is what the post-FFN norm takes.

Attention: Q and K RMS-normed per head (weights), V RMS-normed without a weight (v_norm), rope
on Q and K, score scale 1. With attention_k_eq_v the global layers have no v_proj: V is
v_norm of the keys' projection (before k_norm and rope). The last num_kv_shared_layers layers
compute Q only and read the K/V of the last earlier layer of their kind (cache kind SharedKV);
with use_double_wide_mlp their MLP is twice as wide.

Model-level parts (Gemma4Model): the embedding times sqrt(hidden) (rounded to the dtype, as
transformers does), the per-layer inputs (a second embedding table, [vocab, layers * width],
times sqrt(width), plus an RMS-normed projection of the embedding, times 2^-0.5), and the
logits soft-capped: cap * tanh(logits / cap) (kernels/reference.softcap, no libm).
Every norm multiplies by its weight as stored (x * w, not Qwen3.5's x * (1 + w)).

Not served yet (a startup error that names the option): bidirectional attention over all tokens.
The vision and audio towers are skipped at load.
"""
import logging
from dataclasses import dataclass

import torch

from tensorfold.exact.float32 import f32
from tensorfold.models.blocks import BLOCKS, BuildContext
from tensorfold.models.cache import PagedKV, SharedKV
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs, rope_config
from tensorfold.models.decoder import Model
from tensorfold.models.forward_batch import ForwardBatch
from tensorfold.models.gemma4_moe import Gemma4MoE
from tensorfold.models.moe import MoESpec
from tensorfold.models.spec import AttentionSpec, Family, LayerSpec, MLPSpec
from tensorfold.models.weights import WeightReader

log = logging.getLogger("tensorfold.models")
SLIDING, GLOBAL = "sliding_attention", "full_attention"
SKIPPED = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}  # the config's hidden_activation -> MLPSpec's
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # what per_layer_config may change
# transformers' Gemma4TextConfig defaults for the keys a config.json may leave out
DEFAULTS = dict(sliding_window=512, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262_144,
                hidden_activation="gelu_pytorch_tanh", global_head_dim=512)


def option(hf: dict, key: str):
    """A Gemma 4 config option: the config's value (None included: an option set off), else
    transformers' default."""
    return hf[key] if key in hf else DEFAULTS.get(key)


@dataclass(frozen=True)
class Gemma4AttentionSpec(AttentionSpec):
    """Gemma 4's attention: QK-norm and v_norm, score scale 1. values_are_keys: no v_proj, V is
    the keys' projection (attention_k_eq_v, global layers); kv_source: a KV-shared layer reads
    that layer's K/V and computes none."""
    values_are_keys: bool = False
    kv_source: int | None = None

    @property
    def scale(self) -> float:
        return 1.0  # Q and K are RMS-normed: no 1 / sqrt(head_dim)


@dataclass(frozen=True)
class Gemma4LayerSpec(LayerSpec):
    per_layer_input: int = 0  # width of the layer's per-layer input (0: none)
    moe: MoESpec | None = None  # the experts beside the MLP (enable_moe_block; None: none)


def layer_specs(args: ModelArgs) -> list[LayerSpec]:
    hf = args.hf
    _refuse_unserved(hf)
    types = _layer_types(hf, args.num_layers)
    ropes = {**DEFAULT_ROPE, **(hf.get("rope_parameters") or {})}
    rope = {kind: rope_config(dict(ropes[kind]), 10_000.0) for kind in set(types)}
    shapes = _layer_shapes(hf, types, args)
    sources = _kv_sources(types, int(hf.get("num_kv_shared_layers") or 0))
    activation = ACTIVATIONS[option(hf, "hidden_activation")]
    per_layer = int(option(hf, "hidden_size_per_layer_input") or 0)
    moe = _moe(hf, activation)
    specs = []
    for i, kind in enumerate(types):
        head_dim, kv_heads = shapes[i]
        attention = Gemma4AttentionSpec(
            args.num_heads, kv_heads, head_dim, rope[kind], args.max_position,
            window=int(option(hf, "sliding_window")) if kind == SLIDING else None, qk_norm=True,
            values_are_keys=bool(hf.get("attention_k_eq_v")) and kind == GLOBAL, kv_source=sources[i])
        wide = 2 if hf.get("use_double_wide_mlp") and sources[i] is not None else 1
        specs.append(Gemma4LayerSpec(attention, MLPSpec(args.intermediate_size * wide, activation),
                                     args.rms_norm_eps, per_layer_input=per_layer, moe=moe))
    return specs


def _moe(hf: dict, activation: str) -> MoESpec | None:
    """The experts every layer runs beside its MLP with enable_moe_block (models/gemma4_moe.py):
    num_experts of moe_intermediate_size, top_k_experts per token, GeGLU, no shared expert."""
    if not hf.get("enable_moe_block"):
        return None
    sizes = {key: hf.get(key) for key in ("num_experts", "top_k_experts", "moe_intermediate_size")}
    if not all(isinstance(v, int) and v > 0 for v in sizes.values()):
        raise CheckpointError(f"config.json: enable_moe_block needs positive num_experts, top_k_experts and "
                              f"moe_intermediate_size; got {sizes}")
    experts, top_k = sizes["num_experts"], sizes["top_k_experts"]
    if top_k > experts or experts > 1 << 13:
        raise CheckpointError(f"config.json: top_k_experts {top_k} of num_experts {experts}: served are "
                              "1 <= top_k_experts <= num_experts <= 8192")
    return MoESpec(experts, top_k, sizes["moe_intermediate_size"], 0, norm_topk_prob=True, activation=activation)


def _refuse_unserved(hf: dict) -> None:
    """Options whose forward is not served here: a startup error naming each."""
    if hf.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": text tokens stay causal
        raise CheckpointError(f"config.json: use_bidirectional_attention {hf['use_bidirectional_attention']!r} is "
                              "not served (served: null, 'vision')")
    if option(hf, "hidden_activation") not in ACTIVATIONS:
        raise CheckpointError(f"config.json: hidden_activation {hf['hidden_activation']!r} is not served "
                              f"(served: {', '.join(ACTIVATIONS)})")
    for key in ("attn_logit_softcapping", "altup_num_inputs"):  # earlier Gemmas' options, not Gemma 4's
        if hf.get(key):
            raise CheckpointError(f"config.json: {key} is not a Gemma 4 option this server runs")


def _layer_types(hf: dict, num_layers: int) -> list[str]:
    """The config's layer_types, else transformers' default (five sliding layers to one global);
    the last layer is global, as transformers forces it."""
    types = list(hf.get("layer_types") or [SLIDING if (i + 1) % 6 else GLOBAL for i in range(num_layers)])
    if len(types) != num_layers:
        raise CheckpointError(f"config.json: layer_types lists {len(types)} layers, num_hidden_layers is {num_layers}")
    for i, kind in enumerate(types):
        if kind not in (SLIDING, GLOBAL):
            raise CheckpointError(f"config.json: layer_types[{i}] is {kind!r}; served: {SLIDING}, {GLOBAL}")
    if types[-1] != GLOBAL:
        log.warning("config.json: the last layer is %s; Gemma 4's last layer is global (as transformers runs it)",
                    types[-1])
        types[-1] = GLOBAL
    if SLIDING in types and not option(hf, "sliding_window"):
        raise CheckpointError("config.json: sliding layers and no sliding_window")
    return types


def _layer_shapes(hf: dict, types: list[str], args: ModelArgs) -> list[tuple[int, int]]:
    """(head_dim, num_kv_heads) per layer: the config's, with per_layer_config's overrides, or (the
    Hub's spelling) global_head_dim and, with attention_k_eq_v, num_global_key_value_heads on the
    global layers, as transformers reads them."""
    overrides = hf.get("per_layer_config")
    if overrides is None:
        wide = {"head_dim": int(option(hf, "global_head_dim"))}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads") is not None:
            wide["num_key_value_heads"] = int(hf["num_global_key_value_heads"])
        overrides = {i: wide for i, kind in enumerate(types) if kind == GLOBAL}
    shapes = [(args.head_dim, args.num_kv_heads)] * len(types)
    for key, layer in overrides.items():
        i = int(key)
        unknown = sorted(set(layer) - set(LAYER_OVERRIDES))
        if unknown or not 0 <= i < len(types):
            raise CheckpointError(f"config.json: per_layer_config[{key}] sets {unknown or 'a layer past the last'}; "
                                  f"served: {', '.join(LAYER_OVERRIDES)} of layers 0-{len(types) - 1}")
        shapes[i] = (int(layer.get("head_dim", args.head_dim)),
                     int(layer.get("num_key_value_heads", args.num_kv_heads)))
    return shapes


def _kv_sources(types: list[str], num_shared: int) -> list[int | None]:
    """For each layer, the layer whose K/V it reads (None: its own). The last num_shared layers
    read the last earlier layer of their kind (transformers' kv_sharing_modes)."""
    first = len(types) - num_shared
    if num_shared and first <= 0:
        raise CheckpointError(f"config.json: num_kv_shared_layers {num_shared} leaves no layer to compute K/V")
    sources: list[int | None] = [None] * len(types)
    for i in range(first, len(types)):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise CheckpointError(f"config.json: layer {i} ({types[i]}) shares K/V, and no layer before the shared "
                                  "ones is of its kind")
        sources[i] = owners[-1]
    return sources


class Gemma4Attention:
    def __init__(self, spec: Gemma4AttentionSpec, w: WeightReader, ctx: BuildContext):
        self.spec, self.ops, self.eps = spec, w.ops, ctx.norm_eps
        self.rope = ctx.rope_tables.get(spec.rope, spec.head_dim, spec.max_position)
        attn = w.under("self_attn.")
        projections = ["q"] if spec.kv_source is not None else ["q", "k"] if spec.values_are_keys else ["q", "k", "v"]
        self.qkv = attn.linear(*(f"{p}_proj.weight" for p in projections),
                               biases=tuple(f"{p}_proj.bias" for p in projections))
        self.o = attn.linear("o_proj.weight", biases=("o_proj.bias",))
        self.q_norm = attn.norm("q_norm.weight")
        if spec.kv_source is None:
            self.k_norm = attn.norm("k_norm.weight")
            self.v_norm = torch.ones(spec.head_dim, dtype=w.dtype, device=w.device)  # v_norm has no weight
            self.cache_spec = PagedKV(spec.num_kv_heads, spec.head_dim, spec.window)
        else:
            self.k_norm = self.v_norm = None
            self.cache_spec = SharedKV(spec.kv_source)

    def gemms(self) -> dict:
        return {"qkv": self.qkv, "o_proj": self.o}

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv) -> torch.Tensor:
        s, ops = self.spec, self.ops
        num_rows = x.shape[0]
        cos, sin = batch.rope_rows(self.rope)  # [num_rows, head_dim] each
        qkv = self.qkv(x)  # [num_rows, (heads + kv_heads (x2 with v_proj)) * head_dim]; q alone if shared
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = ops.rms_norm_rope(qkv[:, :q_size].reshape(num_rows, s.num_heads, s.head_dim), self.q_norm, self.eps,
                              cos, sin)
        if s.kv_source is None:  # else the source layer wrote this forward's K/V already
            k = qkv[:, q_size:q_size + kv_size].reshape(num_rows, s.num_kv_heads, s.head_dim)
            v = k if s.values_are_keys else qkv[:, q_size + kv_size:].reshape(num_rows, s.num_kv_heads, s.head_dim)
            ops.write_kv(kv, ops.rms_norm_rope(k, self.k_norm, self.eps, cos, sin),
                         ops.rms_norm(v, self.v_norm, self.eps), batch.slot_mapping)
        out = ops.attention(q, kv, batch, s.scale, s.window).reshape(num_rows, -1)
        return self.o(out)


class Gemma4Layer:
    """Gemma 4's decoder layer (the module docstring's steps). Like blocks.DecoderLayer it takes
    its input normed and returns the next layer's normed input with the residual stream."""

    def __init__(self, spec: Gemma4LayerSpec, w: WeightReader, rope_tables, blocks: dict):
        self.spec, self.ops, self.eps = spec, w.ops, spec.norm_eps
        self.input_norm = w.norm("input_layernorm.weight")
        self.post_mixer_norm = w.norm("post_attention_layernorm.weight")
        self.pre_ffn_norm = w.norm("pre_feedforward_layernorm.weight")
        self.post_ffn_norm = w.norm("post_feedforward_layernorm.weight")
        ctx = BuildContext(rope_tables, spec.norm_eps)
        self.mixer = blocks[type(spec.mixer)](spec.mixer, w, ctx)
        self.ffn = blocks[type(spec.ffn)](spec.ffn, w, ctx)
        self.moe = self.post_mlp_norm = None
        if spec.moe is not None:  # the experts beside the MLP, each output normed before the sum
            self.moe = blocks[type(spec.moe)](spec.moe, w, ctx)
            self.post_mlp_norm = w.norm("post_feedforward_layernorm_1.weight")
        self.per_layer_gate = self.per_layer_proj = self.per_layer_norm = None
        if spec.per_layer_input:
            self.per_layer_gate = w.linear("per_layer_input_gate.weight")  # [width, hidden]
            self.per_layer_proj = w.linear("per_layer_projection.weight")  # [hidden, width]
            self.per_layer_norm = w.norm("post_per_layer_input_norm.weight")
        self.scalar = w.dense("layer_scalar")  # [1]

    @property
    def cache_spec(self):
        return self.mixer.cache_spec

    def gemms(self) -> dict:
        return layer_gemms(self)

    def forward(self, x, residual, next_norm, batch: ForwardBatch, cache, per_layer_input=None):
        """per_layer_input [num_rows, width] (Gemma4Model's). Returns (the next layer's normed
        input, or None after the last layer; the residual)."""
        ops, eps = self.ops, self.eps
        h = residual + ops.rms_norm(self.mixer.forward(x, batch, cache), self.post_mixer_norm, eps)
        out = self.ffn.forward(ops.rms_norm(h, self.pre_ffn_norm, eps))
        if self.moe is not None:  # the MoE reads the residual stream itself (its own norms)
            out = ops.rms_norm(out, self.post_mlp_norm, eps) + self.moe.forward(h)
        h = h + ops.rms_norm(out, self.post_ffn_norm, eps)
        if self.per_layer_gate is not None:
            gated = ops.gelu_tanh_and_mul(self.per_layer_gate(h), per_layer_input)  # [num_rows, width]
            h = h + ops.rms_norm(self.per_layer_proj(gated), self.per_layer_norm, eps)
        h = h * self.scalar
        return (None if next_norm is None else ops.rms_norm(h, next_norm, eps)), h


def layer_gemms(layer) -> dict:
    """A Gemma 4 layer's GEMMs by name (its mixer's, MLP's, MoE's, per-layer input gate and
    projection): the torch and the mlx layer alike (both keep these attributes)."""
    named = {**layer.mixer.gemms(), **layer.ffn.gemms(), **(layer.moe.gemms() if layer.moe is not None else {})}
    if layer.per_layer_gate is not None:
        named.update(per_layer_gate=layer.per_layer_gate, per_layer_proj=layer.per_layer_proj)
    return named


def per_layer_table(w: WeightReader, args: ModelArgs, width: int):
    """The per-layer input embedding [vocab_per_layer, layers * width], its shape checked against
    the config (every backend's PerLayerInputs reads it so)."""
    table = w.matrix("model.embed_tokens_per_layer.weight")
    vocab = int(option(args.hf, "vocab_size_per_layer_input"))
    if tuple(table.shape) != (vocab, args.num_layers * width) or vocab < args.vocab_size:
        raise CheckpointError(f"model.embed_tokens_per_layer.weight has shape {tuple(table.shape)}; served: "
                              f"({vocab} >= vocab_size {args.vocab_size}, {args.num_layers} x {width})")
    return table


class PerLayerInputs:
    """Every layer's per-layer input for a batch's rows, [num_rows, layers, width]:
    (rms_norm(proj(embedded) * hidden^-0.5) + table[ids] * sqrt(width)) * 2^-0.5, each product
    in float32 and rounded to the dtype, as transformers' steps round."""

    def __init__(self, w: WeightReader, args: ModelArgs, width: int, eps: float):
        self.ops, self.dtype, self.eps = w.ops, w.dtype, eps
        self.num_layers, self.width = args.num_layers, width
        table = per_layer_table(w, args, width)
        linear = w.ops.Linear
        self.lookup = linear.of(table).rows if linear.quantized(table) else table.__getitem__
        self.proj = w.linear("model.per_layer_model_projection.weight")  # [layers * width, hidden]
        self.norm = w.norm("model.per_layer_projection_norm.weight")  # [width]
        self.table_scale = torch.tensor(width ** 0.5, dtype=torch.float32).to(w.dtype)
        self.proj_scale = f32(args.hidden_size ** -0.5)

    def __call__(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        shape = (ids.shape[0], self.num_layers, self.width)
        tokens = (self.lookup(ids).to(self.dtype) * self.table_scale).reshape(shape)
        projected = (self.proj(embedded).float() * self.proj_scale).to(self.dtype)
        projected = self.ops.rms_norm(projected.reshape(shape), self.norm, self.eps)
        return ((projected + tokens).float() * f32(2 ** -0.5)).to(self.dtype)


class Gemma4Model(Model):
    """models/decoder.Model with Gemma 4's model-level parts: the scaled embedding, the per-layer
    inputs and soft-capped logits (the module docstring)."""
    layer = Gemma4Layer

    def __init__(self, args: ModelArgs, specs: list[LayerSpec], tensors: dict, dtype: torch.dtype, ops,
                 device: torch.device | str = "cpu", blocks: dict = BLOCKS, norm_offset: float = 0.0,
                 reader=WeightReader):
        super().__init__(args, specs, tensors, dtype, ops, device, blocks, norm_offset, reader)
        w = reader(tensors, dtype, self.device, ops, norm_offset=norm_offset)
        # transformers rounds sqrt(hidden) to float32, then to the weights' dtype
        self.embed_scale = torch.tensor(args.hidden_size ** 0.5, dtype=torch.float32).to(dtype).to(self.device)
        width = self.specs[0].per_layer_input
        self.per_layer_inputs = PerLayerInputs(w, args, width, args.rms_norm_eps) if width else None
        cap = args.hf.get("final_logit_softcapping")
        self.softcap = float(cap) if cap else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache) -> torch.Tensor:
        ops, eps = self.ops, self.specs[0].norm_eps
        residual = self.embed(batch.input_ids).to(self.dtype) * self.embed_scale  # [num_rows, hidden]
        inputs = self.per_layer_inputs(batch.input_ids, residual) if self.per_layer_inputs else None
        x = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_norm if i < last else None
            x, residual = layer.forward(x, residual, next_norm, cache.batch(i, batch), cache.layer(i),
                                        None if inputs is None else inputs[:, i])
        out = ops.rms_norm(residual[batch.logits_rows], self.norm, self.specs[-1].norm_eps)
        logits = self.lm_head(out).float()  # [num_logits, vocab]
        return logits if self.softcap is None else ops.softcap(logits, self.softcap)


def tensor_name(name: str) -> str | None:
    """The text model's tensors under the decoder's names (a multimodal checkpoint keeps them under
    model.language_model.); the vision and audio towers skipped."""
    if name.startswith(SKIPPED):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


BLOCKS_GEMMA4 = {**BLOCKS, Gemma4AttentionSpec: Gemma4Attention, MoESpec: Gemma4MoE}
FAMILY = Family("gemma4", layer_specs, BLOCKS_GEMMA4, tensor_name=tensor_name, model=Gemma4Model)
