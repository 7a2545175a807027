"""The decoder shape every architecture file reads, parsed once from a Hugging Face config dict.

Handles both config spellings transformers has used: `rope_theta` + `rope_scaling` (4.x) and
`rope_parameters` (5.x). Derived values (head_dim, per-layer windows) are computed here, once.
"""
import math
from dataclasses import dataclass, field
from typing import Any

from tensorfold.models.checkpoint import CheckpointError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0        # llama3
    high_freq_factor: float = 4.0       # llama3
    beta_fast: float = 32.0             # yarn
    beta_slow: float = 1.0              # yarn
    attention_factor: float | None = None  # yarn: scales cos/sin
    mrope_section: tuple[int, ...] | None = None  # Qwen's multimodal rope: frequencies per (t, h, w)
                                        # axis, interleaved (models/rope.mrope_axes)
    partial_rotary_factor: float = 1.0  # proportional (Gemma 4's global layers): the share of a head's
                                        # frequencies that turn; the others are 0 (those dims keep still)


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_windows: tuple[int | None, ...] = ()   # per layer: sliding window size or None (full)
    hf: dict = field(default_factory=dict, compare=False, repr=False)  # the (text) config as read,
                                                                        # for a family's own fields

    @classmethod
    def from_hf(cls, config: dict[str, Any], path: str = "config.json") -> "ModelArgs":
        """A multimodal config's text model is read from its text_config (the outer config's
        other keys, such as architectures and tie_word_embeddings, beneath it)."""
        if isinstance(config.get("text_config"), dict):
            config = {**{k: v for k, v in config.items() if k not in ("text_config", "vision_config")},
                      **config["text_config"], "architectures": config.get("architectures")}

        def need(key):
            if key not in config or config[key] is None:
                raise CheckpointError(f"{path}: missing required key '{key}'")
            return config[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        # transformers' Nemotron-H configs give the layer count only as their layer pattern's length
        pattern = config.get("layers_block_type") or config.get("hybrid_override_pattern")
        layers = len(pattern) if config.get("num_hidden_layers") is None and pattern else int(need("num_hidden_layers"))
        head_dim = config.get("head_dim") or hidden // heads
        return cls(
            architecture=(config.get("architectures") or ["?"])[0],
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(config, path),
            max_position=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            layer_windows=_layer_windows(config, layers),
            hf=dict(config),
        )


def _rope_config(config: dict, path: str) -> RopeConfig:
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    params.update(scaling)
    return rope_config(params, config.get("rope_theta", 10000.0), path)


def rope_config(params: dict, default_theta: float, path: str = "config.json") -> RopeConfig:
    """One rope's parameters (a rope_parameters dict; Gemma 4 has one per layer type)."""
    theta = params.get("rope_theta", default_theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{path}: rope type '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        original_max_position=params.get("original_max_position_embeddings"),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        attention_factor=params.get("attention_factor"),
        # proportional only: for the other types a partial rope is the spec's rotary_dim (Qwen's
        # rope_parameters carry the factor too; a GGUF states the rotary dims instead)
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0,
        mrope_section=tuple(int(n) for n in params["mrope_section"]) if params.get("mrope_section") else None,
    )


def _layer_windows(config: dict, num_layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if not window or not config.get("use_sliding_window", True):
        return (None,) * num_layers
    # Qwen2/3 4.x style: the first max_window_layers layers slide... transformers applies the
    # window to layers at index >= max_window_layers.
    start = config.get("max_window_layers", 0) or 0
    return tuple(window if i >= start else None for i in range(num_layers))


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[list[float], float]:
    """Inverse frequencies (float64 list, head_dim // 2 of them) and the cos/sin scale."""
    base = [1.0 / (rope.theta ** (2 * i / head_dim)) for i in range(head_dim // 2)]
    if rope.rope_type == "default":
        return base, 1.0
    if rope.rope_type == "proportional":
        # the first partial_rotary_factor of the head_dim // 2 frequencies turn, at the whole head's
        # spacing (theta^(-2i / head_dim)); the rest are 0, so their dims pass through rope unchanged
        turning = int(rope.partial_rotary_factor * head_dim // 2)
        return [f / rope.factor if i < turning else 0.0 for i, f in enumerate(base)], 1.0
    if rope.rope_type == "linear":
        return [f / rope.factor for f in base], 1.0
    if rope.rope_type == "llama3":
        old = rope.original_max_position or 8192
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        out = []
        for f in base:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / rope.factor)
            else:
                smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
                out.append((1 - smooth) * f / rope.factor + smooth * f)
        return out, 1.0
    # yarn
    old = rope.original_max_position or 4096
    dim = head_dim

    def correction_dim(rotations):
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(base):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation = 1.0 - ramp
        out.append(f / rope.factor * (1 - extrapolation) + f * extrapolation)
    scale = rope.attention_factor
    if scale is None:
        scale = 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
    return out, float(scale)
