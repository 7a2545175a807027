"""Layer specs: a model's config parsed once into what each layer is.

A LayerSpec names the layer's mixer (what mixes positions: attention here; linear attention,
latent attention and Mamba beside it later), its feed-forward part (dense SwiGLU here; MoE
later) and its norm. Each spec is a frozen dataclass of plain numbers, read by the block class
that builds the layer (models/blocks.py: BLOCKS maps spec type to block class) and by the cache
it declares. A family is a spec parser (the family file's `layer_specs(args)`) plus the block
classes its specs name.
"""
from collections.abc import Callable
from dataclasses import dataclass

from tensorfold.models.config import ModelArgs, RopeConfig


@dataclass(frozen=True)
class AttentionSpec:
    """Grouped-query attention over a paged K/V cache, with rope, or with no positional encoding
    at all where rope is None (Nemotron-H: its Mamba2 layers carry the order)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig | None
    max_position: int                 # the rope table's length
    window: int | None = None         # sliding window in tokens; None: full attention
    qk_norm: bool = False             # qwen3: RMSNorm per head on Q and K before rope (required;
                                      # a llama checkpoint that has the weights uses them too)
    rotary_dim: int | None = None     # rope on the first rotary_dim dims of a head (None: all)
    output_gate: bool = False         # Qwen3.5/Next: q_proj also gives a gate per head
                                      # ([q, gate] per head), the output times sigmoid(gate)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim


ACTIVATIONS = ("silu", "gelu_tanh")  # MLPSpec.activation: SwiGLU, GeGLU with GELU's tanh form


@dataclass(frozen=True)
class MLPSpec:
    """A gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or GELU's tanh form (Gemma)."""
    intermediate_size: int
    activation: str = "silu"


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: x + mixer(norm(x)), then + ffn(norm(.)), RMSNorm with norm_eps. A
    single-block layer (Nemotron-H's: a mixer or a feed-forward, one norm) has the other None:
    x + block(norm(x))."""
    mixer: object | None
    ffn: object | None
    norm_eps: float


def keep_name(name: str) -> str:
    return name


@dataclass(frozen=True)
class Family:
    """An architecture: its spec parser and the block class of each spec type it uses.
    tensor_name: a checkpoint tensor's name as the decoder reads it (model.layers.N...), or None
    for tensors the family does not serve (a vision tower, MTP heads: skipped and logged).
    norm_offset: RMSNorm weights are stored as offsets from this (Qwen3.5: 1, the norm is
    x * (1 + w)); added once at load.
    model: the decoder class, for a family with model-level parts of its own (Gemma 4's scaled
    embedding, per-layer inputs and soft-capped logits); None: models/decoder.Model.
    mtp_layer: the family's multi-token-prediction layer for a config (models/mtp.MTPSpec: its
    names, its layers' specs, how many the config declares), for a family whose checkpoints may
    ship one; None: MTP weights are never loaded."""
    name: str
    layer_specs: Callable[[ModelArgs], list[LayerSpec]]
    blocks: dict              # spec type -> block class (models/blocks.BLOCKS, plus its own)
    tensor_name: Callable[[str], str | None] = keep_name
    norm_offset: float = 0.0
    model: type | None = None
    mtp_layer: Callable[[ModelArgs], object] | None = None


def dense_attention_layers(args: ModelArgs, qk_norm: bool = False) -> list[LayerSpec]:
    """The llama layout: every layer GQA attention (with the config's per-layer windows) and a
    SwiGLU MLP."""
    specs = []
    for i in range(args.num_layers):
        attention = AttentionSpec(args.num_heads, args.num_kv_heads, args.head_dim, args.rope, args.max_position,
                                  window=args.layer_windows[i] if args.layer_windows else None, qk_norm=qk_norm)
        specs.append(LayerSpec(attention, MLPSpec(args.intermediate_size), args.rms_norm_eps))
    return specs
