"""GLM-5.x GGUF files (llama.cpp's architecture glm-dsa) read back into the config and tensor names
of the Hugging Face checkpoint (transformers' GlmMoeDsaForCausalLM), which models/glm_moe_dsa.py reads.

What llama.cpp's converter (GlmMoeDsaModel, on DeepseekV2Model) writes, and how each is read back:
  sizes              attention.q_lora_rank, kv_lora_rank; key_length_mla = nope + rope,
                     value_length_mla = v, rope.dimension_count = rope (key_length / value_length
                     and head_count_kv = 1 are the MQA view of the latent: not read);
                     leading_dense_block_count = first_k_dense_replace; expert_count, _used_count,
                     _shared_count, _feed_forward_length, _weights_scale, _weights_norm, group counts;
                     attention.indexer.head_count / key_length / top_k
  attn_q_a, attn_q_b, attn_kv_a_mqa, attn_output, their norms     as they are
  attn_k_b [H, kv_lora, nope], attn_v_b [H, v, kv_lora]           kv_b_proj split per head, the key
                     part transposed: kept so, as self_attn.absorb.h.k_b_proj / v_b_proj (a row range
                     of the stacked matrix each, in blocks as stored), the absorbed GEMMs' own
                     matrices (models/latent_attention.absorbed_parts); a file with attn_kv_b
                     instead gives kv_b_proj back
  indexer.attn_q_b, attn_k, k_norm (weight, bias), proj           indexer.wq_b, wk, k_norm, weights_proj;
                     a layer without them reuses the last indexed layer's choice ("shared")
  ffn_gate_inp, exp_probs_b.bias     the router and its correction bias
  ffn_{gate,up,down}_exps [E, out, in] -> experts.E.*_proj (a row range each); *_shexp -> shared_experts
  norms              as they are (no offset in this family)
The next-n (MTP) block past block_count - nextn_predict_layers is read as the Hugging Face
checkpoint's model.layers.{L}.*: its decoder layer's tensors as any layer's (an indexer of its own,
the MoE), and nextn.eh_proj, nextn.enorm, nextn.hnorm, nextn.shared_head_norm as eh_proj, enorm,
hnorm, shared_head.norm (nextn.embed_tokens and nextn.shared_head_head, copies of the model's own,
are accepted where the file has them and dropped). A file without the
block's tensors declares it all the same; the server then drafts with ngram.
"""
from typing import Any

from tensorfold.models.checkpoint import CheckpointError

GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID, GLM's routing


def glm_config(path: str, meta: dict[str, Any], arch_name: str, tensor_names: set[str]) -> dict[str, Any]:
    from tensorfold.models.gguf_file import _REQUIRED, _check_positive, _f32, _require

    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        return _require(path, meta, f"{arch_name}.{suffix}", default)

    blocks = key("block_count")
    layers = blocks - key("nextn_predict_layers", 0)
    rope = key("rope.dimension_count")
    sizes = {"hidden_size": key("embedding_length"), "num_hidden_layers": layers,
             "num_attention_heads": key("attention.head_count"), "kv_lora_rank": key("attention.kv_lora_rank"),
             "qk_rope_head_dim": rope, "qk_nope_head_dim": key("attention.key_length_mla") - rope,
             "v_head_dim": key("attention.value_length_mla"), "intermediate_size": key("feed_forward_length"),
             "moe_intermediate_size": key("expert_feed_forward_length"), "n_routed_experts": key("expert_count"),
             "num_experts_per_tok": key("expert_used_count"), "index_n_heads": key("attention.indexer.head_count"),
             "index_head_dim": key("attention.indexer.key_length"), "index_topk": key("attention.indexer.top_k"),
             "max_position_embeddings": key("context_length")}
    _check_positive(path, sizes)
    if key("rope.scaling.type", "none") != "none":
        raise CheckpointError(f"{path}: {arch_name} with rope scaling {key('rope.scaling.type')!r} is not served yet")
    if key("expert_gating_func", GATING_SIGMOID) != GATING_SIGMOID:
        raise CheckpointError(f"{path}: {arch_name}.expert_gating_func {key('expert_gating_func')} is not served "
                              "(served: sigmoid, GLM's routing)")
    q_lora = key("attention.q_lora_rank", None)
    indexed = [f"blk.{i}.indexer.attn_k.weight" in tensor_names for i in range(layers)]
    dense = min(key("leading_dense_block_count", 0), layers)
    config = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        **sizes,
        "num_key_value_heads": sizes["num_attention_heads"],
        "q_lora_rank": q_lora or None,
        "vocab_size": key("vocab_size", None) or len(_require(path, meta, "tokenizer.ggml.tokens")),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": _f32(key("rope.freq_base", 10000.0))},
        "first_k_dense_replace": dense,
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (layers - dense),
        "indexer_types": ["full" if full else "shared" for full in indexed],
        "n_shared_experts": key("expert_shared_count", 0),
        "routed_scaling_factor": _f32(key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "n_group": key("expert_group_count", 1),
        "topk_group": key("expert_group_used_count", 1),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if blocks > layers:  # the next-n block(s) (models/glm_moe_dsa.mtp_layer)
        config["num_nextn_predict_layers"] = blocks - layers
    if layers and not indexed[0]:
        raise CheckpointError(f"{path}: blk.0 has no DSA indexer (indexer.attn_k); a layer without one reuses an "
                              "earlier layer's choice, and none comes before it")
    return config


def glm_rules(path: str, config: dict[str, Any], tensor_names: set[str]):
    """(rules for the global tensors, rules per layer (GGUF name after blk.N. -> _Rule), and the
    Hugging Face name -> shape of every tensor the checkpoint must have), as gguf_file's hybrids'.
    A layer's kv_b comes split (attn_k_b / attn_v_b, as llama.cpp's converter writes it) or whole
    (attn_kv_b), as the file has it."""
    from tensorfold.models.gguf_file import _Rule, _row_range

    c = config
    hidden, vocab, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    q_lora, kv_lora, nope, rope, v = (c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"],
                                      c["qk_rope_head_dim"], c["v_head_dim"])
    ih, idim = c["index_n_heads"], c["index_head_dim"]

    def same(hf: str, shape: tuple, matrix: bool = True) -> _Rule:
        return _Rule((shape,), lambda w: {hf: w}, matrix)

    def per_head(hf: str, rows: int):  # a stacked [H, rows, K] tensor read as [H * rows, K]
        return lambda w: {f"self_attn.absorb.{h}.{hf}": _row_range(w, h * rows, (h + 1) * rows) for h in range(heads)}

    global_rules = {"token_embd.weight": same("model.embed_tokens.weight", (vocab, hidden)),
                    "output_norm.weight": same("model.norm.weight", (hidden,), matrix=False)}
    expected = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not c["tie_word_embeddings"]:
        global_rules["output.weight"] = same("lm_head.weight", (vocab, hidden))
        expected["lm_head.weight"] = (vocab, hidden)

    a = "self_attn."
    q_rows = heads * (nope + rope)
    attn = {"attn_norm.weight": same("input_layernorm.weight", (hidden,), False),
            "ffn_norm.weight": same("post_attention_layernorm.weight", (hidden,), False),
            "attn_kv_a_mqa.weight": same(a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden)),
            "attn_kv_a_norm.weight": same(a + "kv_a_layernorm.weight", (kv_lora,), False),
            "attn_k_b.weight": _Rule(((heads, kv_lora, nope),), per_head("k_b_proj.weight", kv_lora)),
            "attn_v_b.weight": _Rule(((heads, v, kv_lora),), per_head("v_b_proj.weight", v)),
            "attn_kv_b.weight": same(a + "kv_b_proj.weight", (heads * (nope + v), kv_lora)),
            "attn_output.weight": same(a + "o_proj.weight", (hidden, heads * v))}
    attn_shapes = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
                   a + "kv_a_proj_with_mqa.weight": (kv_lora + rope, hidden), a + "kv_a_layernorm.weight": (kv_lora,),
                   a + "o_proj.weight": (hidden, heads * v)}
    split_shapes = {}
    for h in range(heads):
        split_shapes.update({f"{a}absorb.{h}.k_b_proj.weight": (kv_lora, nope),
                             f"{a}absorb.{h}.v_b_proj.weight": (v, kv_lora)})
    whole_shapes = {a + "kv_b_proj.weight": (heads * (nope + v), kv_lora)}
    if q_lora:
        attn.update({"attn_q_a.weight": same(a + "q_a_proj.weight", (q_lora, hidden)),
                     "attn_q_a_norm.weight": same(a + "q_a_layernorm.weight", (q_lora,), False),
                     "attn_q_b.weight": same(a + "q_b_proj.weight", (q_rows, q_lora))})
        attn_shapes.update({a + "q_a_proj.weight": (q_lora, hidden), a + "q_a_layernorm.weight": (q_lora,),
                            a + "q_b_proj.weight": (q_rows, q_lora)})
    else:
        attn["attn_q.weight"] = same(a + "q_proj.weight", (q_rows, hidden))
        attn_shapes[a + "q_proj.weight"] = (q_rows, hidden)
    i = a + "indexer."
    indexer = {"indexer.attn_q_b.weight": same(i + "wq_b.weight", (ih * idim, q_lora or hidden)),
               "indexer.attn_k.weight": same(i + "wk.weight", (idim, hidden)),
               "indexer.k_norm.weight": same(i + "k_norm.weight", (idim,), False),
               "indexer.k_norm.bias": same(i + "k_norm.bias", (idim,), False),
               "indexer.proj.weight": same(i + "weights_proj.weight", (ih, hidden))}
    indexer_shapes = {i + "wq_b.weight": (ih * idim, q_lora or hidden), i + "wk.weight": (idim, hidden),
                      i + "k_norm.weight": (idim,), i + "k_norm.bias": (idim,), i + "weights_proj.weight": (ih, hidden)}

    inter = c["intermediate_size"]
    mlp = {"ffn_gate.weight": same("mlp.gate_proj.weight", (inter, hidden)),
           "ffn_up.weight": same("mlp.up_proj.weight", (inter, hidden)),
           "ffn_down.weight": same("mlp.down_proj.weight", (hidden, inter))}
    mlp_shapes = {"mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
                  "mlp.down_proj.weight": (hidden, inter)}
    e, size = c["n_routed_experts"], c["moe_intermediate_size"]
    shared = size * c["n_shared_experts"]

    def per_expert(proj: str, rows: int):
        return lambda w: {f"mlp.experts.{x}.{proj}.weight": _row_range(w, x * rows, (x + 1) * rows) for x in range(e)}

    moe = {"ffn_gate_inp.weight": same("mlp.gate.weight", (e, hidden)),
           "exp_probs_b.bias": same("mlp.gate.e_score_correction_bias", (e,), False),
           "ffn_gate_exps.weight": _Rule(((e, size, hidden),), per_expert("gate_proj", size)),
           "ffn_up_exps.weight": _Rule(((e, size, hidden),), per_expert("up_proj", size)),
           "ffn_down_exps.weight": _Rule(((e, hidden, size),), per_expert("down_proj", hidden))}
    moe_shapes = {"mlp.gate.weight": (e, hidden), "mlp.gate.e_score_correction_bias": (e,)}
    for x in range(e):
        moe_shapes.update({f"mlp.experts.{x}.gate_proj.weight": (size, hidden),
                           f"mlp.experts.{x}.up_proj.weight": (size, hidden),
                           f"mlp.experts.{x}.down_proj.weight": (hidden, size)})
    if shared:
        moe.update({"ffn_gate_shexp.weight": same("mlp.shared_experts.gate_proj.weight", (shared, hidden)),
                    "ffn_up_shexp.weight": same("mlp.shared_experts.up_proj.weight", (shared, hidden)),
                    "ffn_down_shexp.weight": same("mlp.shared_experts.down_proj.weight", (hidden, shared))})
        moe_shapes.update({"mlp.shared_experts.gate_proj.weight": (shared, hidden),
                           "mlp.shared_experts.up_proj.weight": (shared, hidden),
                           "mlp.shared_experts.down_proj.weight": (hidden, shared)})

    nextn = {"nextn.eh_proj.weight": same("eh_proj.weight", (hidden, 2 * hidden)),
             "nextn.enorm.weight": same("enorm.weight", (hidden,), False),
             "nextn.hnorm.weight": same("hnorm.weight", (hidden,), False),
             "nextn.shared_head_norm.weight": same("shared_head.norm.weight", (hidden,), False),
             # copies of the model's embedding and head: accepted, dropped (the model's own serve)
             "nextn.embed_tokens.weight": _Rule(((vocab, hidden),), lambda w: {}),
             "nextn.shared_head_head.weight": _Rule(((vocab, hidden),), lambda w: {})}
    nextn_shapes = {"eh_proj.weight": (hidden, 2 * hidden), "enorm.weight": (hidden,), "hnorm.weight": (hidden,),
                    "shared_head.norm.weight": (hidden,)}
    layers = len(c["mlp_layer_types"])
    kinds = list(zip(c["mlp_layer_types"], c["indexer_types"]))
    kinds += [(c["mlp_layer_types"][-1] if layers else "sparse", "full")] * c.get("num_nextn_predict_layers", 0)
    layer_rules = []
    for n, (ffn_type, index_type) in enumerate(kinds):
        full = index_type == "full"
        ffn, ffn_shapes = (moe, moe_shapes) if ffn_type == "sparse" else (mlp, mlp_shapes)
        extra, extra_shapes = (nextn, nextn_shapes) if n >= layers else ({}, {})
        layer_rules.append({**attn, **(indexer if full else {}), **ffn, **extra})
        if n >= layers and not any(name.startswith(f"blk.{n}.") for name in tensor_names):
            continue  # a next-n block declared, its tensors left out of the file
        kv_b_shapes = whole_shapes if f"blk.{n}.attn_kv_b.weight" in tensor_names else split_shapes
        for name, shape in {**attn_shapes, **kv_b_shapes, **(indexer_shapes if full else {}), **ffn_shapes,
                            **extra_shapes}.items():
            expected[f"model.layers.{n}.{name}"] = shape
    return global_rules, layer_rules, expected
