"""Nemotron-H GGUF files (llama.cpp's architectures nemotron_h and nemotron_h_moe) read back into the
config and tensor names of the Hugging Face checkpoint (transformers' names: model.embeddings,
model.layers.N.norm / mixer.*, model.norm_f), which models/nemotron_h.py reads.

What llama.cpp's converter (NemotronHModel, on GraniteHybridModel / Mamba2Model) writes, and how
each is read back:
  layer kinds        no pattern key: per layer attention.head_count_kv > 0 is attention ("*"),
                     feed_forward_length > 0 the feed-forward (nemotron_h: "-" MLP; nemotron_h_moe:
                     "E" MoE), both 0 Mamba2 ("M"); a file has MLP or MoE layers, not both
  ssm_in, ssm_out    mixer.in_proj / out_proj as they are
  ssm_conv1d         [C, K] (squeezed), its bias        -> conv1d.weight [C, 1, K], conv1d.bias
  ssm_dt.bias        dt_bias
  ssm_a [H, 1]       -exp(A_log), kept as stored: mixer.A (the block's rate is -A; no log back)
  ssm_d [H, 1]       D
  ssm_norm [G, I/G]  the gated norm's weight, reshaped -> norm.weight [I]
  attn_q, attn_k     rows permuted per head for llama.cpp's rope (undo_permute) though Nemotron-H
                     has none: put back (rope_row_order), so Q and K are the checkpoint's rows
  ffn_up, ffn_down   the MLP's up_proj / down_proj
  MoE                ffn_gate_inp (router), exp_probs_b.bias (correction bias), ffn_up_exps /
                     ffn_down_exps stacked [E, out, in] -> experts.E.*_proj (a row range each),
                     ffn_up_shexp / ffn_down_shexp (shared expert), ffn_latent_down / _up
                     (fc1 / fc2_latent_proj); expert_weights_scale, _norm, group counts, latent size
  norms              attn_norm, output_norm as they are (no offset in this family); their eps from
                     attention.layer_norm_rms_epsilon, else attention.layer_norm_epsilon (the key
                     llama.cpp's nemotron_h loader reads)
Blocks past block_count - nextn_predict_layers (the MTP block) are skipped.
"""
from typing import Any

from tensorfold.models.checkpoint import CheckpointError


def nemotron_config(path: str, meta: dict[str, Any], arch_name: str, tensor_names: set[str]) -> dict[str, Any]:
    from tensorfold.models.gguf_file import _REQUIRED, _check_positive, _f32, _require

    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        return _require(path, meta, f"{arch_name}.{suffix}", default)

    blocks, hidden = key("block_count"), key("embedding_length")
    layers = blocks - key("nextn_predict_layers", 0)
    _check_positive(path, {f"{arch_name}.block_count - nextn_predict_layers": layers,
                           f"{arch_name}.embedding_length": hidden})

    def per_layer(suffix: str) -> list[int]:
        value = key(suffix)
        values = list(value) if isinstance(value, list) else [value] * blocks
        if len(values) < layers:
            raise CheckpointError(f"{path}: {arch_name}.{suffix} lists {len(values)} layers, the file has {layers}")
        return [int(v) for v in values[:layers]]

    kv, ff = per_layer("attention.head_count_kv"), per_layer("feed_forward_length")
    moe = arch_name == "nemotron_h_moe"
    kinds = ["attention" if kv[i] else ("moe" if moe else "mlp") if ff[i] else "mamba" for i in range(layers)]
    heads = max(per_layer("attention.head_count"))
    head_dim = key("attention.key_length", hidden // heads if heads else 0)
    kv_heads = max(kv)
    if "attention" in kinds and (not heads or not kv_heads or heads % kv_heads or not head_dim):
        raise CheckpointError(f"{path}: attention layers with {heads} heads, {kv_heads} KV heads of {head_dim}")
    num_heads, inner = key("ssm.time_step_rank"), key("ssm.inner_size")
    _check_positive(path, {f"{arch_name}.ssm.time_step_rank": num_heads, f"{arch_name}.ssm.inner_size": inner})
    if inner % num_heads:
        raise CheckpointError(f"{path}: ssm.inner_size {inner} does not split into {num_heads} heads")
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "layers_block_type": kinds,
        "num_attention_heads": heads or 1,
        "num_key_value_heads": kv_heads or 1,
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length"),
        "vocab_size": key("vocab_size", None) or len(_require(path, meta, "tokenizer.ggml.tokens")),
        "intermediate_size": max(ff) if not moe else 0,
        "layer_norm_epsilon": _f32(key("attention.layer_norm_rms_epsilon", None) or key("attention.layer_norm_epsilon")),
        "mamba_num_heads": num_heads,
        "mamba_head_dim": inner // num_heads,
        "n_groups": key("ssm.group_count"),
        "ssm_state_size": key("ssm.state_size"),
        "conv_kernel": key("ssm.conv_kernel"),
        "use_conv_bias": any(n.endswith("ssm_conv1d.bias") for n in tensor_names),
        "mlp_hidden_act": "relu2",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if moe:
        n_group = key("expert_group_count", 1)
        used = key("expert_group_used_count", None)
        if n_group > 1 and used is None:
            raise CheckpointError(f"{path}: {arch_name}.expert_group_count is {n_group} and the file does not say "
                                  f"how many groups are chosen ({arch_name}.expert_group_used_count)")
        latent = key("moe_latent_size", None)
        config.update(n_routed_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                      moe_intermediate_size=key("expert_feed_forward_length"),
                      moe_shared_expert_intermediate_size=key("expert_shared_feed_forward_length"),
                      norm_topk_prob=bool(key("expert_weights_norm", True)),
                      routed_scaling_factor=_f32(key("expert_weights_scale", 1.0)), n_group=n_group,
                      topk_group=used if used is not None else 1, moe_latent_size=latent or None)
    return config


def nemotron_rules(path: str, config: dict[str, Any]):
    """(rules for the global tensors, rules per layer (GGUF name after blk.N. -> _Rule), and the
    Hugging Face name -> shape of every tensor the checkpoint must have), as gguf_file's hybrids'."""
    from tensorfold.models.gguf_file import _Rule, _row_range, _take_rows, rope_row_order

    c = config
    hidden, vocab = c["hidden_size"], c["vocab_size"]

    def same(hf: str, shape: tuple, matrix: bool = True, accept: tuple = ()) -> _Rule:
        return _Rule((shape, *accept), lambda w: {hf: w.reshape(shape) if not matrix else w}, matrix)

    global_rules = {"token_embd.weight": same("model.embeddings.weight", (vocab, hidden)),
                    "output_norm.weight": same("model.norm_f.weight", (hidden,), matrix=False)}
    expected = {"model.embeddings.weight": (vocab, hidden), "model.norm_f.weight": (hidden,)}
    if not c["tie_word_embeddings"]:
        global_rules["output.weight"] = same("lm_head.weight", (vocab, hidden))
        expected["lm_head.weight"] = (vocab, hidden)

    heads, num_kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    nh, p, g, n, k = c["mamba_num_heads"], c["mamba_head_dim"], c["n_groups"], c["ssm_state_size"], c["conv_kernel"]
    inner, conv_dim = nh * p, nh * p + 2 * g * n
    m = "mixer."

    def unpermuted(hf: str, rows: int, num_heads: int) -> _Rule:
        return _Rule(((rows, hidden),), lambda w: {hf: _take_rows(w, rope_row_order(rows, num_heads))})

    kinds = {
        "attention": ({"attn_q.weight": unpermuted(m + "q_proj.weight", heads * hd, heads),
                       "attn_k.weight": unpermuted(m + "k_proj.weight", num_kv * hd, num_kv),
                       "attn_v.weight": same(m + "v_proj.weight", (num_kv * hd, hidden)),
                       "attn_output.weight": same(m + "o_proj.weight", (hidden, heads * hd))},
                      {m + "q_proj.weight": (heads * hd, hidden), m + "k_proj.weight": (num_kv * hd, hidden),
                       m + "v_proj.weight": (num_kv * hd, hidden), m + "o_proj.weight": (hidden, heads * hd)}),
        "mamba": ({"ssm_in.weight": same(m + "in_proj.weight", (2 * inner + 2 * g * n + nh, hidden)),
                   "ssm_conv1d.weight": same(m + "conv1d.weight", (conv_dim, 1, k), False, ((conv_dim, k),)),
                   "ssm_conv1d.bias": same(m + "conv1d.bias", (conv_dim,), False),
                   "ssm_dt.bias": same(m + "dt_bias", (nh,), False),
                   "ssm_a": same(m + "A", (nh,), False, ((nh, 1),)),
                   "ssm_d": same(m + "D", (nh,), False, ((nh, 1),)),
                   "ssm_norm.weight": same(m + "norm.weight", (inner,), False, ((g, inner // g),)),
                   "ssm_out.weight": same(m + "out_proj.weight", (hidden, inner))},
                  {m + "in_proj.weight": (2 * inner + 2 * g * n + nh, hidden), m + "conv1d.weight": (conv_dim, 1, k),
                   m + "dt_bias": (nh,), m + "A": (nh,), m + "D": (nh,), m + "norm.weight": (inner,),
                   m + "out_proj.weight": (hidden, inner)}),
    }
    if c["use_conv_bias"]:
        kinds["mamba"][1][m + "conv1d.bias"] = (conv_dim,)
    if c["intermediate_size"]:
        ff = c["intermediate_size"]
        kinds["mlp"] = ({"ffn_up.weight": same(m + "up_proj.weight", (ff, hidden)),
                         "ffn_down.weight": same(m + "down_proj.weight", (hidden, ff))},
                        {m + "up_proj.weight": (ff, hidden), m + "down_proj.weight": (hidden, ff)})
    if c.get("n_routed_experts"):
        e, size, shared = c["n_routed_experts"], c["moe_intermediate_size"], c["moe_shared_expert_intermediate_size"]
        width = c.get("moe_latent_size") or hidden

        def per_expert(proj: str, rows: int):
            return lambda w: {f"{m}experts.{x}.{proj}.weight": _row_range(w, x * rows, (x + 1) * rows) for x in range(e)}

        rules = {"ffn_gate_inp.weight": same(m + "gate.weight", (e, hidden)),
                 "exp_probs_b.bias": same(m + "gate.e_score_correction_bias", (e,), False),
                 "ffn_up_exps.weight": _Rule(((e, size, width),), per_expert("up_proj", size)),
                 "ffn_down_exps.weight": _Rule(((e, width, size),), per_expert("down_proj", width)),
                 "ffn_up_shexp.weight": same(m + "shared_experts.up_proj.weight", (shared, hidden)),
                 "ffn_down_shexp.weight": same(m + "shared_experts.down_proj.weight", (hidden, shared))}
        rules["exp_probs_b"] = rules["exp_probs_b.bias"]
        shapes = {m + "gate.weight": (e, hidden), m + "gate.e_score_correction_bias": (e,),
                  m + "shared_experts.up_proj.weight": (shared, hidden),
                  m + "shared_experts.down_proj.weight": (hidden, shared)}
        for x in range(e):
            shapes.update({f"{m}experts.{x}.up_proj.weight": (size, width),
                           f"{m}experts.{x}.down_proj.weight": (width, size)})
        if c.get("moe_latent_size"):
            rules.update({"ffn_latent_down.weight": same(m + "fc1_latent_proj.weight", (width, hidden)),
                          "ffn_latent_up.weight": same(m + "fc2_latent_proj.weight", (hidden, width))})
            shapes.update({m + "fc1_latent_proj.weight": (width, hidden), m + "fc2_latent_proj.weight": (hidden, width)})
        kinds["moe"] = (rules, shapes)

    norm = {"attn_norm.weight": same("norm.weight", (hidden,), matrix=False)}
    layer_rules = []
    for i, kind in enumerate(c["layers_block_type"]):
        rules, shapes = kinds[kind]
        layer_rules.append({**norm, **rules})
        for name, shape in {"norm.weight": (hidden,), **shapes}.items():
            expected[f"model.layers.{i}.{name}"] = shape
    return global_rules, layer_rules, expected
