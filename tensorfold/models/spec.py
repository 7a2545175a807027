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
    """Grouped-query attention over a paged K/V cache, with rope."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    max_position: int                 # the rope table's length
    window: int | None = None         # sliding window in tokens; None: full attention
    qk_norm: bool = False             # qwen3: RMSNorm per head on Q and K before rope (required;
                                      # a llama checkpoint that has the weights uses them too)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


@dataclass(frozen=True)
class MLPSpec:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    intermediate_size: int


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: x + mixer(norm(x)), then + ffn(norm(.)), RMSNorm with norm_eps."""
    mixer: object
    ffn: object
    norm_eps: float


@dataclass(frozen=True)
class Family:
    """An architecture: its spec parser and the block class of each spec type it uses."""
    name: str
    layer_specs: Callable[[ModelArgs], list[LayerSpec]]
    blocks: dict              # spec type -> block class (models/blocks.BLOCKS, plus its own)


def dense_attention_layers(args: ModelArgs, qk_norm: bool = False) -> list[LayerSpec]:
    """The llama layout: every layer GQA attention (with the config's per-layer windows) and a
    SwiGLU MLP."""
    specs = []
    for i in range(args.num_layers):
        attention = AttentionSpec(args.num_heads, args.num_kv_heads, args.head_dim, args.rope, args.max_position,
                                  window=args.layer_windows[i] if args.layer_windows else None, qk_norm=qk_norm)
        specs.append(LayerSpec(attention, MLPSpec(args.intermediate_size), args.rms_norm_eps))
    return specs
