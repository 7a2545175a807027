"""The decoder on MLX arrays: attention (plain or gated: llama, qwen3, the Qwen hybrids' full
layers; with or without rope) or Gated DeltaNet mixers, with dense SwiGLU or mixture-of-experts
feed-forwards; and Nemotron-H's single-block layers (one norm, then a Mamba2 mixer, attention
without rope, a relu^2 MLP or its sigmoid-routed MoE: mlx/mamba2.py, mlx/nemotron_h.py).

Built from the same layer specs (models/spec.py) and checkpoint readers (HF directories, GGUF
blocks served as stored) as the torch model, with this backend's ops (tensorfold/mlx/ops.py)
and weights (ops.MLXLinear). Layer kinds this backend does not run (another family's) are a
startup error that names them.

A forward reads an MLXBatch (the round's rows, flattened; one entry per sequence) and the
layers' caches, and returns the logits rows as an mx.array; the runner evaluates them together
with the caches it wrote, so no round leaves a graph behind.
"""
import dataclasses
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import torch

from tensorfold.backends.linear_weight import count_formats, named_gemms
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs, rope_inv_freq
from tensorfold.models.forward_batch import state_slots
from tensorfold.models.linear_attention import LinearAttentionSpec, input_matrices, read_params
from tensorfold.models.cache import PagedKV, RecurrentState, layer_groups
from tensorfold.models.moe import MoESpec
from tensorfold.models.spec import AttentionSpec, LayerSpec, MLPSpec
from tensorfold.models.weights import WeightReader
from tensorfold.kernels.reference import rope_table
from tensorfold.models.rope import FIRST_ROWS
from tensorfold.mlx import delta_net, mamba2, moe, nemotron_h, ops
from tensorfold.models.mamba2 import Mamba2Spec
from tensorfold.models.nemotron_h import NemotronMoESpec, ReluSquaredMLPSpec


class _WeightOps:
    """What WeightReader asks of an op set: its weight type."""
    Linear = ops.MLXLinear


@dataclass
class SequenceSpan:
    start: int                 # first row of the sequence in the batch
    end: int
    positions: np.ndarray      # its rows' positions (ascending)
    key_slots: mx.array        # cache slots of its positions 0 .. positions[-1] (ops.key_slots: padded)


@dataclass
class MLXBatch:
    input_ids: mx.array        # [rows] int32
    positions: np.ndarray      # [rows] int64 (host)
    slots: mx.array            # [rows] flat cache slot each row's K/V goes to
    sequences: list[SequenceSpan]
    logits_rows: mx.array      # rows whose logits are returned
    state_in: np.ndarray       # [num_seqs] block holding each sequence's starting state (-1: zero)
    state_out: np.ndarray      # [rows] block a row's recurrent state is written to (-1: none)
    groups: list = field(default_factory=list)  # the batch as cache groups 1, 2, ... read it (MLXBatch each)

    def in_group(self, g: int | None) -> "MLXBatch":
        """The batch as the layers of cache group g (models/cache.layer_groups: a sliding window's
        own block table) read it: their slots and key slots; group 0 (or none) reads this one."""
        return self if not g else self.groups[g - 1]


def mlx_batch(pieces: list, logits_rows: list[int], block_size: int, num_groups: int = 0) -> MLXBatch:
    """The MLXBatch of sequences laid end to end: pieces, one per sequence, (first position, token
    ids, block ids, the further cache groups' block ids: num_groups lists); logits_rows: the
    batch rows whose logits are returned. (The runner's rounds, the MTP layer's catch-ups and
    chained steps.)"""
    bs = block_size
    input_ids, positions, slots, sequences, tables = [], [], [], [], []
    groups = [([], []) for _ in range(num_groups)]  # per further cache group: slots, sequences
    for first, token_ids, block_ids, group_block_ids in pieces:
        start, num = len(input_ids), len(token_ids)
        pos = np.arange(first, first + num)
        table = np.asarray(block_ids, dtype=np.int64)
        input_ids += token_ids
        positions.append(pos)
        tables.append(table)
        slots.append(table[pos // bs] * bs + pos % bs)
        sequences.append(SequenceSpan(start, start + num, pos, ops.key_slots(table, int(pos[-1]), bs)))
        for (group_slots, group_seqs), group_table in zip(groups, group_block_ids):
            # a freed block (NULL_BLOCK, -1) is before every row's window: never read, any id will do
            group_table = np.maximum(np.asarray(group_table, dtype=np.int64), 0)
            group_slots.append(group_table[pos // bs] * bs + pos % bs)
            group_seqs.append(SequenceSpan(start, start + num, pos, ops.key_slots(group_table, int(pos[-1]), bs)))
    state_in, state_out = (np.asarray(x, dtype=np.int64) for x in state_slots(tables, positions, bs))
    ids, rows = mx.array(np.asarray(input_ids, dtype=np.int32)), mx.array(np.asarray(logits_rows, dtype=np.int32))
    positions = np.concatenate(positions)
    views = [MLXBatch(ids, positions, mx.array(np.concatenate(s)), seqs, rows, state_in, state_out)
             for s, seqs in groups] if pieces else []
    return MLXBatch(ids, positions, mx.array(np.concatenate(slots)), sequences, rows, state_in, state_out, views)


class RopeRows:
    """A rope table (the torch reference's float32 values) and its rows gathered per batch; made
    as far as the positions so far need, doubling (models/rope.RopeTable's rule: the same bits)."""

    def __init__(self, spec: AttentionSpec):
        self.inv_freq, self.scale = rope_inv_freq(spec.rope, spec.rope_dim)
        self.max_position = spec.max_position
        self._make(min(FIRST_ROWS, self.max_position))

    def _make(self, rows: int) -> None:
        cos, sin = rope_table(self.inv_freq, self.scale, rows)
        self.cos, self.sin = ops.from_torch(cos), ops.from_torch(sin)

    def at(self, positions: np.ndarray) -> tuple[mx.array, mx.array]:
        end = int(positions.max()) + 1 if positions.size else 0
        if end > self.cos.shape[0]:
            self._make(min(max(end, 2 * self.cos.shape[0]), self.max_position))
        index = mx.array(positions)
        return self.cos[index], self.sin[index]


class Attention:
    def __init__(self, spec: AttentionSpec, w: WeightReader, eps: float):
        self.spec, self.eps = spec, eps
        attn = w.under("self_attn.")
        self.qkv = attn.linear("q_proj.weight", "k_proj.weight", "v_proj.weight",
                               biases=("q_proj.bias", "k_proj.bias", "v_proj.bias"))
        self.o = attn.linear("o_proj.weight", biases=("o_proj.bias",))
        self.q_norm, self.k_norm = (_mx(attn.maybe_norm(n)) for n in ("q_norm.weight", "k_norm.weight"))
        if spec.qk_norm and (self.q_norm is None or self.k_norm is None):
            raise CheckpointError(f"{attn.prefix}: the config asks for QK-norm, the checkpoint lacks "
                                  "q_norm / k_norm weights")
        self.rope = RopeRows(spec) if spec.rope is not None else None
        self.cache_spec = PagedKV(spec.num_kv_heads, spec.head_dim, spec.window)

    def __call__(self, x: mx.array, batch: MLXBatch, cache: ops.LayerCache, rope_rows) -> mx.array:
        s, rows = self.spec, x.shape[0]
        qkv = self.qkv(x)  # [rows, (heads (x2 with the gate) + 2 kv_heads) * head_dim]
        q_size, kv_size = s.num_heads * s.head_dim * (2 if s.output_gate else 1), s.num_kv_heads * s.head_dim
        q = qkv[:, :q_size].reshape(rows, s.num_heads, -1)
        gate = None
        if s.output_gate:  # [q, gate] per head (Qwen3.5/Next)
            q, gate = q[..., :s.head_dim], q[..., s.head_dim:].reshape(rows, q_size // 2)
        k = qkv[:, q_size:q_size + kv_size].reshape(rows, s.num_kv_heads, s.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(rows, s.num_kv_heads, s.head_dim)
        cos, sin = rope_rows(self.rope) if self.rope is not None else (None, None)
        q, k = self._position(q, self.q_norm, cos, sin), self._position(k, self.k_norm, cos, sin)
        ops.write_kv(cache, k, v, batch.slots)
        out = [ops.attention(q[seq.start:seq.end], cache, seq.positions, seq.key_slots, s.scale, s.window)
               for seq in batch.sequences]
        out = out[0] if len(out) == 1 else mx.concatenate(out)
        out = out.reshape(rows, -1)
        if gate is not None:
            out = ops.sigmoid_and_mul(gate, out)
        return self.o(out)

    def gemms(self) -> dict:
        return {"qkv": self.qkv, "o_proj": self.o}

    def _position(self, x, norm, cos, sin):
        if norm is not None:
            x = ops.rms_norm(x, norm, self.eps)
        if cos is None:  # no positional encoding (Nemotron-H)
            return x
        rope_dim = self.spec.rope_dim
        if rope_dim == self.spec.head_dim:
            return ops.apply_rope(x, cos, sin)
        return mx.concatenate([ops.apply_rope(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], axis=-1)


class MLP:
    def __init__(self, spec: MLPSpec, w: WeightReader):
        mlp = w.under("mlp.")
        self.size = spec.intermediate_size
        self.gate_up = mlp.linear("gate_proj.weight", "up_proj.weight")
        self.down = mlp.linear("down_proj.weight")

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = self.gate_up(x)
        return self.down(ops.silu_and_mul(gate_up[:, :self.size], gate_up[:, self.size:]))

    def gemms(self) -> dict:
        return {"gate_up": self.gate_up, "down": self.down}


class GatedDeltaNet:
    """models/linear_attention.GatedDeltaNet on MLX arrays: the same weights (both spellings of
    the input projection), mlx/delta_net.py's mixing over the layer's LayerState, the gated norm."""

    def __init__(self, spec: LinearAttentionSpec, w: WeightReader, eps: float):
        self.spec, self.eps = spec, eps
        la = w.under("linear_attn.")
        self.in_proj = ops.MLXLinear.of(*input_matrices(spec, la))
        self.out_proj = la.linear("out_proj.weight")
        params = read_params(spec, la)
        self.params = dataclasses.replace(params, conv_weight=_mx(params.conv_weight), rate=_mx(params.rate),
                                          dt_bias=_mx(params.dt_bias))
        self.norm = _mx(la.dense("norm.weight"))  # the gated norm's weight: a plain multiplier
        self.cache_spec = RecurrentState(spec.conv_dim, spec.conv_kernel, spec.num_heads, spec.key_dim,
                                         spec.value_dim)

    def gemms(self) -> dict:
        return {"in_proj": self.in_proj, "out_proj": self.out_proj}

    def __call__(self, x: mx.array, batch: MLXBatch, state: delta_net.LayerState, rope_rows) -> mx.array:
        s, rows = self.spec, x.shape[0]
        width = s.num_heads * s.value_dim
        proj = self.in_proj(x)  # [rows, conv_dim + width + 2 heads]: qkv, z, b, a
        qkv, z = proj[:, :s.conv_dim], proj[:, s.conv_dim:s.conv_dim + width]
        b, a = proj[:, s.conv_dim + width:s.conv_dim + width + s.num_heads], proj[:, s.conv_dim + width + s.num_heads:]
        core = delta_net.delta_net(qkv, a, b, state, batch, self.params)  # [rows, heads, value_dim]
        normed = ops.gated_rms_norm(core.reshape(-1, s.value_dim), z.reshape(-1, s.value_dim), self.norm, self.eps)
        return self.out_proj(normed.reshape(rows, width))


# spec type -> MLX block
MIXERS = {AttentionSpec: Attention, LinearAttentionSpec: GatedDeltaNet, Mamba2Spec: mamba2.Mamba2}
FFNS = {MLPSpec: MLP, MoESpec: moe.MoE, ReluSquaredMLPSpec: nemotron_h.ReluSquaredMLP,
        NemotronMoESpec: nemotron_h.NemotronMoE}


class DecoderLayer:
    """norm -> mixer -> add & norm -> ffn -> add; or a single-block layer (the spec's mixer or ffn
    None: models/blocks.DecoderLayer's rule), norm -> the block -> add, one norm, and no cache
    where the block is a feed-forward."""

    def __init__(self, spec: LayerSpec, w: WeightReader):
        if (spec.mixer is None and spec.ffn is None) or (spec.mixer is not None and type(spec.mixer) not in MIXERS) \
                or (spec.ffn is not None and type(spec.ffn) not in FFNS):
            raise CheckpointError(f"the mlx backend runs attention, gated attention, Gated DeltaNet and Mamba2 mixers "
                                  f"with dense, relu^2 or MoE feed-forwards; this checkpoint has "
                                  f"{type(spec.mixer).__name__} + {type(spec.ffn).__name__} layers: use --backend cpu")
        self.eps = spec.norm_eps
        self.input_norm = _mx(w.norm("input_layernorm.weight"))
        both = spec.mixer is not None and spec.ffn is not None
        self.post_mixer_norm = _mx(w.norm("post_attention_layernorm.weight")) if both else None
        self.mixer = None if spec.mixer is None else MIXERS[type(spec.mixer)](spec.mixer, w, spec.norm_eps)
        self.ffn = None if spec.ffn is None else FFNS[type(spec.ffn)](spec.ffn, w)
        self.spec = spec

    @property
    def cache_spec(self):
        return self.mixer.cache_spec if self.mixer is not None else None

    def gemms(self) -> dict:
        return {**(self.mixer.gemms() if self.mixer else {}), **(self.ffn.gemms() if self.ffn else {})}


class MLXModel:
    """forward(batch, caches) -> logits [num_logits, vocab] float32 (an mx.array). A family with
    layers or model-level parts of its own subclasses it (layer(), forward(): mlx/gemma4.py)."""
    weight_ops = _WeightOps
    mtp = None  # the multi-token-prediction layer (mlx/mtp.py), where one is loaded

    def __init__(self, args: ModelArgs, specs: list[LayerSpec], tensors: dict, dtype: torch.dtype,
                 norm_offset: float = 0.0):
        self.args, self.specs, self.dtype = args, list(specs), dtype
        self.mx_dtype = ops.DTYPES[dtype]
        w = WeightReader(tensors, dtype, torch.device("cpu"), self.weight_ops, norm_offset=norm_offset)
        embed = w.matrix("model.embed_tokens.weight")
        if tuple(embed.shape) != (args.vocab_size, args.hidden_size):
            raise CheckpointError(f"model.embed_tokens.weight has shape {tuple(embed.shape)}, "
                                  f"config says ({args.vocab_size}, {args.hidden_size})")
        self.layers = [self.layer(spec, w.under(f"model.layers.{i}.")) for i, spec in enumerate(self.specs)]
        self.group_of, self.windows = layer_groups(self.cache_specs())  # each layer's block table
        self.norm = _mx(w.norm("model.norm.weight"))
        self.norm_offset = norm_offset
        quantized = ops.MLXLinear.quantized(embed)
        self.table = ops.MLXLinear.of(embed) if quantized else None
        self.embed = self.table.rows if quantized else ops.from_torch(embed).__getitem__
        if w.has("lm_head.weight"):
            self.lm_head = w.linear("lm_head.weight")
        elif args.tie_word_embeddings:
            self.lm_head = self.table or ops.MLXLinear.of(embed)
        else:
            raise CheckpointError("lm_head.weight is missing and the config does not tie embeddings")

    def layer(self, spec: LayerSpec, w: WeightReader):
        return DecoderLayer(spec, w)

    def add_mtp(self, spec, tensors: dict) -> None:
        """Build the checkpoint's MTP layer (mlx/mtp.py, models/mtp.py's names) on this model's
        embedding and head; its layers' caches follow the model's, behind the first block table."""
        from tensorfold.mlx.mtp import MLXMultiTokenPredictor
        w = WeightReader(tensors, self.dtype, torch.device("cpu"), self.weight_ops, norm_offset=self.norm_offset)
        self.mtp = MLXMultiTokenPredictor(spec, w, self)
        self.group_of, self.windows = layer_groups(self.cache_specs())
        if any(g for g in self.group_of[len(self.layers):]):
            raise CheckpointError(f"{spec.names.prefix}: a sliding-window layer in the MTP layer is not served")

    def cache_specs(self) -> list:
        """Each layer's cache kind (models/cache.PagedKV, SharedKV or RecurrentState; None: a
        feed-forward layer); the MTP layer's last."""
        return [layer.cache_spec for layer in self.layers] + (self.mtp.cache_specs if self.mtp else [])

    def begin(self, batch: MLXBatch) -> None:
        """Before a forward of this model's layers over `batch` (the model's or its MTP layer's):
        what a family keeps per forward starts afresh (mlx/glm.py's DSA choices)."""

    def forward(self, batch: MLXBatch, caches: list[ops.LayerCache], hidden: bool = False):
        """hidden: also return every row's final hidden state (after the final norm, what the MTP
        layer reads) as (logits, hidden [rows, hidden])."""
        self.begin(batch)
        residual = self.embed(batch.input_ids).astype(self.mx_dtype)
        residual = self.run_layers(self.layers, residual, batch, caches, self.group_of)
        eps = self.specs[-1].norm_eps
        if hidden:  # the norm is per row: the logits rows' bits are those of the branch below
            out = ops.rms_norm(residual, self.norm, eps)
            return self.lm_head(out[batch.logits_rows]).astype(mx.float32), out
        out = ops.rms_norm(residual[batch.logits_rows], self.norm, eps)
        return self.lm_head(out).astype(mx.float32)

    @staticmethod
    def run_layers(layers: list, residual: mx.array, batch: MLXBatch, caches: list, group_of: list) -> mx.array:
        """The residual stream through `layers` (each with its cache, caches[i], behind the block
        table of group_of[i]): norm, the mixer and the feed-forward (or a single block) per
        layer; returns the last layer's residual, before any final norm."""
        rope_cache: dict[int, tuple] = {}

        def rope_rows(table):  # each table's rows once per forward
            if id(table) not in rope_cache:
                rope_cache[id(table)] = table.at(batch.positions)
            return rope_cache[id(table)]

        x = ops.rms_norm(residual, layers[0].input_norm, layers[0].eps)
        for i, layer in enumerate(layers):
            if layer.mixer is None:  # a single-block layer: x + block(norm(x))
                residual = residual + layer.ffn(x)
            elif layer.ffn is None:
                residual = residual + layer.mixer(x, batch.in_group(group_of[i]), caches[i], rope_rows)
            else:
                residual = residual + layer.mixer(x, batch.in_group(group_of[i]), caches[i], rope_rows)
                residual = residual + layer.ffn(ops.rms_norm(residual, layer.post_mixer_norm, layer.eps))
            if i + 1 < len(layers):
                x = ops.rms_norm(residual, layers[i + 1].input_norm, layer.eps)
        return residual

    def gemms(self) -> dict:
        """Every MLXLinear by name (layers.{i}.qkv, ..., lm_head; mtp.* where loaded)."""
        return {**named_gemms(self.layers, self.lm_head), **(self.mtp.gemms() if self.mtp else {})}

    def weight_formats(self) -> dict[str, int]:
        return count_formats(self.gemms().values())


def model_class(family) -> type:
    """The MLX model of a family (models/spec.Family): its own where it has one, else MLXModel."""
    if family.name == "gemma4":
        from tensorfold.mlx.gemma4 import Gemma4Model
        return Gemma4Model
    if family.name == "glm_moe_dsa":
        from tensorfold.mlx.glm import GLMModel
        return GLMModel
    return MLXModel


def _mx(t: torch.Tensor | None) -> mx.array | None:
    return None if t is None else ops.from_torch(t)
