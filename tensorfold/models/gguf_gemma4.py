"""Gemma 4 GGUF files (llama.cpp's architecture gemma4) read back into the config and tensor names
of the Hugging Face text model (transformers' Gemma4ForCausalLM), which models/gemma4.py reads.

What llama.cpp's converter (Gemma4Model, on Gemma3Model) writes, and how each is read back:
  key_length / value_length          the global layers' head size (global_head_dim)
  key_length_swa / value_length_swa  the sliding layers' (head_dim)
  head_count_kv                      one count, or one per layer: the sliding layers' is
                                     num_key_value_heads, the global layers' num_global_key_value_heads
  feed_forward_length                one width, or one per layer (use_double_wide_mlp: the KV-shared
                                     layers' is twice the others')
  attention.sliding_window(_pattern) the window, and per layer whether it slides (layer_types)
  attention.shared_kv_layers         num_kv_shared_layers
  embedding_length_per_layer_input   hidden_size_per_layer_input (0: no per-layer inputs)
  final_logit_softcapping, rope.freq_base (the global layers'), rope.freq_base_swa (the sliding
  layers', 10000 where absent), rope.dimension_count_swa (the sliding layers' rotated dims)
  rope_freqs.weight                  the global layers' proportional rope as llama.cpp runs it: a
                                     divisor per frequency, 1 for the rotated ones and 1e30 for the
                                     rest: partial_rotary_factor = 2 * (count of 1s) / global_head_dim
Tensors keep transformers' values (the norms multiply by their weight as stored: no +1 here, unlike
Gemma 2/3); a global layer without attn_v is attention_k_eq_v; the KV-shared layers have no K or V;
layer_output_scale.weight [1] is the layer scalar.

The MoE variant (26B-A4B: enable_moe_block) has, on every layer, gguf's gemma4 tensors for its
experts and llama.cpp's converter's two `.scale` tensors for the router (Gemma4Model.modify_tensors:
router.scale -> ffn_gate_inp.scale, router.per_expert_scale -> ffn_down_exps.scale):
  ffn_gate_inp.weight [E, hidden]        router.proj.weight
  ffn_gate_inp.scale [hidden]            router.scale
  ffn_down_exps.scale [E]                router.per_expert_scale
  ffn_gate_up_exps.weight [E, 2 I, hidden]  experts.gate_up_proj, as stored: experts.E.gate_proj /
                                         up_proj.weight, a row range each (read in its blocks)
  ffn_down_exps.weight [E, hidden, I]    experts.E.down_proj.weight, likewise
  pre_ffw_norm_2, post_ffw_norm_1, post_ffw_norm_2   the MoE's norms (pre/post_feedforward_layernorm_2,
                                         post_feedforward_layernorm_1)
and in its metadata expert_count, expert_used_count (top_k_experts) and
expert_feed_forward_length (moe_intermediate_size; read from the tensors where absent).
"""
from typing import Any

import numpy as np

from tensorfold.models.checkpoint import CheckpointError

LAYER_NAMES = {  # blk.N.<key>.weight -> model.layers.N.<value>
    "attn_norm": "input_layernorm.weight", "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight", "attn_k_norm": "self_attn.k_norm.weight",
    "post_attention_norm": "post_attention_layernorm.weight", "ffn_norm": "pre_feedforward_layernorm.weight",
    "post_ffw_norm": "post_feedforward_layernorm.weight", "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight", "ffn_down": "mlp.down_proj.weight", "inp_gate": "per_layer_input_gate.weight",
    "proj": "per_layer_projection.weight", "post_norm": "post_per_layer_input_norm.weight",
    "layer_output_scale": "layer_scalar",
}
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "inp_gate", "proj")
MOE_NAMES = {  # blk.N.<key> -> model.layers.N.<value>: the MoE's tensors that keep their shape
    "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale", "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}
UNROTATED = 1e30  # llama.cpp's divisor for a frequency that stands still


def gemma4_config(path: str, meta: dict[str, Any], arch_name: str, reader) -> dict[str, Any]:
    from tensorfold.models.gguf_file import _REQUIRED, _check_positive, _f32, _require

    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        return _require(path, meta, f"{arch_name}.{suffix}", default)

    tensors = {t.name: t for t in reader.tensors}
    layers = key("block_count")
    pattern = key("attention.sliding_window_pattern", None)
    if pattern is None or np.ndim(pattern) == 0 or len(pattern) != layers:
        raise CheckpointError(f"{path}: {arch_name}.attention.sliding_window_pattern must list each of the "
                              f"{layers} layers")
    types = ["sliding_attention" if bool(s) else "full_attention" for s in pattern]
    kv = _per_layer(path, key("attention.head_count_kv"), layers, "head_count_kv")
    ff = _per_layer(path, key("feed_forward_length"), layers, "feed_forward_length")
    shared = key("attention.shared_kv_layers", 0)
    first_shared = layers - shared
    sliding = [kv[i] for i, t in enumerate(types) if t == "sliding_attention"]
    full = [kv[i] for i, t in enumerate(types) if t == "full_attention"]
    if len(set(sliding)) > 1 or len(set(full)) > 1:
        raise CheckpointError(f"{path}: {arch_name}.head_count_kv differs among layers of one kind: not a Gemma 4")
    head_dim, global_head_dim = key("attention.key_length_swa"), key("attention.key_length")
    sizes = {"hidden_size": key("embedding_length"), "num_hidden_layers": layers,
             "num_attention_heads": key("attention.head_count"), "intermediate_size": ff[0],
             "head_dim": head_dim, "global_head_dim": global_head_dim,
             "max_position_embeddings": key("context_length"), "sliding_window": key("attention.sliding_window")}
    _check_positive(path, sizes)
    if key("attention.value_length_swa", head_dim) != head_dim or key("attention.value_length") != global_head_dim:
        raise CheckpointError(f"{path}: {arch_name}: value lengths other than the key lengths are not Gemma 4's")
    wide = ff != [ff[0]] * layers
    if wide and ff != [ff[0] if i < first_shared else 2 * ff[0] for i in range(layers)]:
        raise CheckpointError(f"{path}: {arch_name}.feed_forward_length {ff}: served: one width, or twice it on "
                              "the KV-shared layers (use_double_wide_mlp)")
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{path}: missing tensor token_embd.weight")
    vocab = int(tensors["token_embd.weight"].shape[1])
    per_layer = key("embedding_length_per_layer_input", 0)
    per_layer_table = tensors.get("per_layer_token_embd.weight")
    first_full = types.index("full_attention") if full else None
    k_eq_v = first_full is not None and first_full < first_shared and f"blk.{first_full}.attn_v.weight" not in tensors
    rotated_swa = key("rope.dimension_count_swa", head_dim)
    if rotated_swa != head_dim:
        raise CheckpointError(f"{path}: {arch_name}.rope.dimension_count_swa {rotated_swa}: the sliding layers "
                              f"rotate all {head_dim} dims in Gemma 4")
    config = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        **sizes,
        "layer_types": types,
        "num_key_value_heads": sliding[0] if sliding else full[0],
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": wide,
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": int(per_layer_table.shape[1]) if per_layer_table is not None else vocab,
        "vocab_size": vocab,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "final_logit_softcapping": _f32(key("final_logit_softcapping")) if f"{arch_name}.final_logit_softcapping"
        in meta else None,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": _f32(key("rope.freq_base_swa", 10000.0))},
            "full_attention": {"rope_type": "proportional", "rope_theta": _f32(key("rope.freq_base", 1_000_000.0)),
                               "partial_rotary_factor": _partial_factor(path, tensors, global_head_dim)}},
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    config.update(_moe_config(path, meta, arch_name, tensors, layers, key))
    if k_eq_v and full:
        config["num_global_key_value_heads"] = full[0]
    elif full and full[0] != config["num_key_value_heads"]:
        raise CheckpointError(f"{path}: {arch_name}: global layers with their own KV heads and a v projection "
                              "are not a Gemma 4 layout")
    return config


def _moe_config(path: str, meta: dict, arch_name: str, tensors: dict, layers: int, key) -> dict[str, Any]:
    """The MoE variant's config keys (the module docstring), {} for a dense file; every layer has
    its experts or none does."""
    moe_layers = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    if not moe_layers:
        if any(n.startswith("blk.") and "_exps." in n for n in tensors):
            raise CheckpointError(f"{path}: {arch_name}: expert tensors (*_exps) without a router (ffn_gate_inp)")
        return {}
    if len(moe_layers) != layers:
        missing = sorted(set(range(layers)) - set(moe_layers))
        raise CheckpointError(f"{path}: {arch_name}: a mixture of experts on some layers only (none on {missing}); "
                              "Gemma 4 runs its experts on every layer")
    gate_up = tensors.get("blk.0.ffn_gate_up_exps.weight")
    if gate_up is None:
        raise CheckpointError(f"{path}: missing tensor blk.0.ffn_gate_up_exps.weight (the experts' fused gate and "
                              "up projections)")
    stored_experts, rows = int(gate_up.shape[2]), int(gate_up.shape[1])  # GGUF lists [hidden, 2 I, E]
    experts = int(key("expert_count", stored_experts))
    inter = int(key("expert_feed_forward_length", rows // 2))
    if (experts, 2 * inter) != (stored_experts, rows):
        raise CheckpointError(f"{path}: {arch_name}.expert_count {experts} and expert_feed_forward_length {inter} "
                              f"do not match ffn_gate_up_exps' {stored_experts} experts of {rows} rows")
    return {"enable_moe_block": True, "num_experts": experts, "top_k_experts": int(key("expert_used_count")),
            "moe_intermediate_size": inter}


def _per_layer(path: str, value, layers: int, name: str) -> list[int]:
    """A scalar or per-layer metadata value as one int per layer."""
    values = [int(v) for v in value] if np.ndim(value) else [int(value)] * layers
    if len(values) != layers:
        raise CheckpointError(f"{path}: {name} lists {len(values)} values for {layers} layers")
    return values


def _partial_factor(path: str, tensors: dict, global_head_dim: int) -> float:
    """The global layers' partial_rotary_factor from rope_freqs.weight (the module docstring)."""
    info = tensors.get("rope_freqs.weight")
    if info is None:
        return 1.0
    divisors = np.array(info.data, dtype=np.float32).reshape(-1)
    rotated = int(np.sum(divisors == 1.0))
    if len(divisors) != global_head_dim // 2 or rotated + int(np.sum(divisors >= UNROTATED)) != len(divisors) \
            or not np.all(divisors[:rotated] == 1.0):
        raise CheckpointError(f"{path}: rope_freqs.weight is not Gemma 4's proportional rope (1s, then 1e30s, "
                              f"{global_head_dim // 2} in all)")
    return 2 * rotated / global_head_dim


def gemma4_rules(path: str, config: dict[str, Any], tensor_names: set[str]):
    """(rules for the global tensors, rules per layer (GGUF name after blk.N. -> _Rule), the Hugging
    Face name -> shape of every tensor the checkpoint must have), as gguf_file's hybrids'."""
    from tensorfold.models.config import ModelArgs
    from tensorfold.models.gemma4 import GLOBAL, _kv_sources, _layer_shapes
    from tensorfold.models.gguf_file import _Rule, split_experts

    c = config
    args = ModelArgs.from_hf(c)
    hidden, vocab, heads, layers = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["num_hidden_layers"]
    shapes = _layer_shapes(c, c["layer_types"], args)
    sources = _kv_sources(c["layer_types"], c["num_kv_shared_layers"])
    width = c["hidden_size_per_layer_input"]

    def same(hf: str, shape: tuple, matrix: bool = True) -> _Rule:
        return _Rule((shape,), lambda w: {hf: w}, matrix)

    globals_ = {"token_embd.weight": ("model.embed_tokens.weight", (vocab, hidden), True),
                "output_norm.weight": ("model.norm.weight", (hidden,), False)}
    if not c["tie_word_embeddings"]:
        globals_["output.weight"] = ("lm_head.weight", (vocab, hidden), True)
    if width:
        globals_.update({
            "per_layer_token_embd.weight": ("model.embed_tokens_per_layer.weight",
                                            (c["vocab_size_per_layer_input"], layers * width), True),
            "per_layer_model_proj.weight": ("model.per_layer_model_projection.weight", (layers * width, hidden), True),
            "per_layer_proj_norm.weight": ("model.per_layer_projection_norm.weight", (width,), False)})
    global_rules = {gguf: same(hf, shape, matrix) for gguf, (hf, shape, matrix) in globals_.items()}
    expected = {hf: shape for hf, shape, _ in globals_.values()}
    if "rope_freqs.weight" in tensor_names:  # read into the config already
        global_rules["rope_freqs.weight"] = _Rule(((c["global_head_dim"] // 2,),), lambda w: {}, False)

    layer_rules = []
    for i, kind in enumerate(c["layer_types"]):
        head_dim, kv_heads = shapes[i]
        inter = c["intermediate_size"] * (2 if c["use_double_wide_mlp"] and sources[i] is not None else 1)
        want = {"attn_norm": (hidden,), "attn_q": (heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
                "attn_q_norm": (head_dim,), "post_attention_norm": (hidden,), "ffn_norm": (hidden,),
                "post_ffw_norm": (hidden,), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
                "ffn_down": (hidden, inter), "layer_output_scale": (1,)}
        if sources[i] is None:
            want.update(attn_k=(kv_heads * head_dim, hidden), attn_k_norm=(head_dim,))
            if not (c["attention_k_eq_v"] and kind == GLOBAL):
                want["attn_v"] = (kv_heads * head_dim, hidden)
        if width:
            want.update(inp_gate=(width, hidden), proj=(hidden, width), post_norm=(hidden,))
        rules = {}
        for key, shape in want.items():
            hf = LAYER_NAMES[key]
            rules[f"{key}.weight"] = same(hf, shape, key in MATRICES)
            expected[f"model.layers.{i}.{hf}"] = shape
        if c.get("enable_moe_block"):
            moe_rules, moe_expected = _moe_rules(c, _Rule, split_experts)
            rules.update(moe_rules)
            expected.update({f"model.layers.{i}.{hf}": shape for hf, shape in moe_expected.items()})
        layer_rules.append(rules)
    return global_rules, layer_rules, expected


def _moe_rules(c: dict[str, Any], rule, split) -> tuple[dict, dict]:
    """A layer's MoE tensors: (rules by GGUF name after blk.N., the Hugging Face names and shapes
    they give under model.layers.N.)."""
    hidden, n, inter = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    shapes = {"router.proj.weight": (n, hidden), "router.scale": (hidden,), "router.per_expert_scale": (n,),
              "pre_feedforward_layernorm_2.weight": (hidden,), "post_feedforward_layernorm_1.weight": (hidden,),
              "post_feedforward_layernorm_2.weight": (hidden,)}
    rules = {gguf: rule((shapes[hf],), lambda w, hf=hf: {hf: w}, gguf == "ffn_gate_inp.weight")
             for gguf, hf in MOE_NAMES.items()}

    def per_expert(*parts):
        return split(n, "experts.", *parts)

    rules["ffn_gate_up_exps.weight"] = rule(((n, 2 * inter, hidden),), per_expert(("gate_proj", inter),
                                                                                   ("up_proj", inter)))
    rules["ffn_down_exps.weight"] = rule(((n, hidden, inter),), per_expert(("down_proj", hidden)))
    for e in range(n):
        shapes.update({f"experts.{e}.gate_proj.weight": (inter, hidden), f"experts.{e}.up_proj.weight": (inter, hidden),
                       f"experts.{e}.down_proj.weight": (hidden, inter)})
    return rules, shapes
