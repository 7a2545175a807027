"""Block classes: each layer kind's weights, its reference forward, its GEMMs and its cache.

A block is built from its spec (models/spec.py) and a WeightReader at its checkpoint prefix; it
runs on the op set it was built with (`ops`: the backend's batch-invariant ops), so the same
block serves every backend. The composition written here is the reference; a backend may run a
whole layer in a fused form of its own (ops.fuse), which tests hold bitwise equal to this one.

    Attention  GQA over paged K/V, rope (whole, partial or none), optional QK-norm, window
               and output gate                                          cache: PagedKV
    MLP        SwiGLU, or GeGLU (GELU's tanh form)                      cache: none
    DecoderLayer  norm -> mixer -> add & norm -> ffn -> add & next norm; or, a single-block
               layer (mixer or ffn None), norm -> the block -> add & next norm

`gemms()` names each block's LinearWeights: the probes and the weight-format report read it.
"""
from dataclasses import dataclass

import torch

from tensorfold.models.cache import LayerKV, PagedKV
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.forward_batch import ForwardBatch
from tensorfold.models.rope import RopeTables
from tensorfold.models.spec import ACTIVATIONS, AttentionSpec, LayerSpec, MLPSpec
from tensorfold.models.weights import WeightReader


@dataclass
class BuildContext:
    """What a block may need beyond its spec and weights: the model's shared rope tables, and
    its layer's norm eps."""
    rope_tables: RopeTables
    norm_eps: float


class Attention:
    def __init__(self, spec: AttentionSpec, w: WeightReader, ctx: BuildContext):
        self.spec, self.ops, self.eps = spec, w.ops, ctx.norm_eps
        self.rope = None if spec.rope is None else ctx.rope_tables.get(spec.rope, spec.rope_dim, spec.max_position)
        attn = w.under("self_attn.")
        self.qkv = attn.linear("q_proj.weight", "k_proj.weight", "v_proj.weight",
                               biases=("q_proj.bias", "k_proj.bias", "v_proj.bias"))
        self.o = attn.linear("o_proj.weight", biases=("o_proj.bias",))
        self.q_norm, self.k_norm = attn.maybe_norm("q_norm.weight"), attn.maybe_norm("k_norm.weight")
        if spec.qk_norm and (self.q_norm is None or self.k_norm is None):
            raise CheckpointError(f"{attn.prefix}: the config asks for QK-norm, the checkpoint lacks "
                                  "q_norm / k_norm weights")
        self.cache_spec = PagedKV(spec.num_kv_heads, spec.head_dim, spec.window)

    def gemms(self) -> dict:
        return {"qkv": self.qkv, "o_proj": self.o}

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: LayerKV) -> torch.Tensor:
        s, ops = self.spec, self.ops
        num_rows = x.shape[0]
        cos, sin = batch.rope_rows(self.rope) if self.rope is not None else (None, None)  # [num_rows, head_dim] each
        qkv = self.qkv(x)  # [num_rows, (heads (x2 with the gate) + 2 kv_heads) * head_dim]
        q_size, kv_size = s.num_heads * s.head_dim * (2 if s.output_gate else 1), s.num_kv_heads * s.head_dim
        q = qkv[:, :q_size].reshape(num_rows, s.num_heads, -1)
        gate = None
        if s.output_gate:  # [q, gate] per head
            q, gate = q[..., :s.head_dim].contiguous(), q[..., s.head_dim:].reshape(num_rows, q_size // 2)
        k = qkv[:, q_size:q_size + kv_size].reshape(num_rows, s.num_kv_heads, s.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(num_rows, s.num_kv_heads, s.head_dim)
        q, k = self._position(q, self.q_norm, cos, sin), self._position(k, self.k_norm, cos, sin)
        ops.write_kv(kv, k, v, batch.slot_mapping)
        # Every row of every sequence in one call: each row's result is the one it gets alone.
        out = ops.attention(q, kv, batch, s.scale, s.window).reshape(num_rows, -1)
        if gate is not None:
            out = ops.sigmoid_and_mul(gate, out)
        return self.o(out)

    def _position(self, x, norm, cos, sin):
        """The per-head norm (where the layer has one) and rope, over the first rope_dim dims of
        each head (no rope where the spec has none: the norm alone)."""
        ops, rope_dim = self.ops, self.spec.rope_dim
        if cos is None:
            return ops.rms_norm(x, norm, self.eps) if norm is not None else x
        if rope_dim == self.spec.head_dim:
            return ops.rms_norm_rope(x, norm, self.eps, cos, sin) if norm is not None else ops.apply_rope(x, cos, sin)
        if norm is not None:
            x = ops.rms_norm(x, norm, self.eps)
        turned = ops.apply_rope(x[..., :rope_dim].contiguous(), cos, sin)
        return torch.cat([turned, x[..., rope_dim:]], dim=-1)


class MLP:
    def __init__(self, spec: MLPSpec, w: WeightReader, ctx: BuildContext):
        self.spec, self.ops = spec, w.ops
        mlp = w.under("mlp.")
        self.gate_up = mlp.linear("gate_proj.weight", "up_proj.weight")
        self.down = mlp.linear("down_proj.weight")
        if spec.activation not in ACTIVATIONS:
            raise CheckpointError(f"{mlp.prefix}: activation {spec.activation!r} is not served "
                                  f"(served: {', '.join(ACTIVATIONS)})")
        self.act_and_mul = w.ops.gelu_tanh_and_mul if spec.activation == "gelu_tanh" else w.ops.silu_and_mul
        self.cache_spec = None

    def gemms(self) -> dict:
        return {"gate_up": self.gate_up, "down": self.down}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.spec.intermediate_size, dim=-1)  # [num_rows, intermediate] each
        return self.down(self.act_and_mul(gate, up))


BLOCKS = {AttentionSpec: Attention, MLPSpec: MLP}  # spec type -> block class


class DecoderLayer:
    """x + mixer(norm(x)), then + ffn(norm(.)). The layer's input arrives normed (the previous
    layer's add and this layer's norm are one op) and it returns the next layer's normed input
    with the residual stream. A single-block layer (the spec's mixer or ffn None) has one norm,
    the input norm: x + block(norm(x)); a feed-forward-only layer keeps no cache (None)."""

    def __init__(self, spec: LayerSpec, w: WeightReader, rope_tables: RopeTables, blocks: dict):
        """blocks: spec type -> block class (BLOCKS, or a family's own)."""
        self.spec, self.ops, self.eps = spec, w.ops, spec.norm_eps
        if spec.mixer is None and spec.ffn is None:
            raise CheckpointError(f"{w.prefix}: a layer needs a mixer or a feed-forward")
        self.input_norm = w.norm("input_layernorm.weight")
        both = spec.mixer is not None and spec.ffn is not None
        self.post_mixer_norm = w.norm("post_attention_layernorm.weight") if both else None
        ctx = BuildContext(rope_tables, spec.norm_eps)
        self.mixer = None if spec.mixer is None else _block(blocks, spec.mixer, w)(spec.mixer, w, ctx)
        self.ffn = None if spec.ffn is None else _block(blocks, spec.ffn, w)(spec.ffn, w, ctx)

    @property
    def cache_spec(self):
        return self.mixer.cache_spec if self.mixer is not None else None

    def gemms(self) -> dict:
        return {**(self.mixer.gemms() if self.mixer else {}), **(self.ffn.gemms() if self.ffn else {})}

    def forward(self, x, residual, next_norm, batch: ForwardBatch, cache):
        """Returns (the next layer's normed input, or None after the last layer; the residual)."""
        ops = self.ops
        if self.mixer is None:
            out = self.ffn.forward(x)
        elif self.ffn is None:
            out = self.mixer.forward(x, batch, cache)
        else:
            mixed = self.mixer.forward(x, batch, cache)
            x, residual = ops.add_rms_norm(mixed, residual, self.post_mixer_norm, self.eps)
            out = self.ffn.forward(x)
        if next_norm is None:
            return None, residual + out
        return ops.add_rms_norm(out, residual, next_norm, self.eps)  # the add and the next norm, in one op


def _block(blocks: dict, spec, w: WeightReader):
    """The block class of `spec` (a startup error naming the kind where the family has none)."""
    if type(spec) not in blocks:
        raise CheckpointError(f"{w.prefix}: no block class for {type(spec).__name__} in this family")
    return blocks[type(spec)]
