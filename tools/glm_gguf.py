"""Write a tiny glm_moe_dsa directory (tools/tiny_checkpoint.py's) as llama.cpp's converter writes GLM-5:
architecture glm-dsa, DeepseekV2's metadata (q/kv lora ranks, key_length_mla / value_length_mla, the
MQA view of the latent as key_length / value_length with head_count_kv 1, leading dense blocks, the
experts' counts, scale, norm and groups) and the DSA indexer's (head count, key length, top k);
tensors under llama.cpp's names (gguf's tensor map for glm-dsa), kv_b_proj split per head into
attn_k_b [H, kv_lora, nope] (the key part, transposed) and attn_v_b [H, v, kv_lora], experts stacked
per projection, the correction bias as exp_probs_b.bias; a "shared" layer has no indexer tensors.

In blocks (`mix`: q8_0 or q4_0) go the matrices `--quantize` puts in blocks (models/loader.QUANTIZABLE:
the projections, the split kv_b, experts, the indexer's head weights, embedding and head), so a file
and its directory quantized at load serve the same bits; the indexer's wq_b and wk (which llama.cpp's
quantizer would put in blocks too), the router, norms and vectors stay float32. Row lengths must be
multiples of 32: GLM_GGUF_SIZES widens the tiny q_lora and nope dims to 64 and 32.

    python tools/glm_gguf.py HF_DIR [--mix q8_0|q4_0]
"""
import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GLM_GGUF_SIZES = dict(q_lora_rank=64, qk_nope_head_dim=32)
MIXES = ("q8_0", "q4_0")


def write_glm_gguf(hf_dir: str, mix: str = "q8_0", out_path: str | None = None) -> str:
    import gguf
    import torch
    from safetensors.torch import load_file

    from tensorfold.models.glm_moe_dsa import option
    from tensorfold.models.latent_attention import LatentAttentionSpec, absorbed_parts
    from tensorfold.models.loader import QUANTIZABLE
    from tensorfold.models.quantize import QTYPES, gguf_blocks
    from tools.tiny_checkpoint import _add_tokenizer, _finish_gguf

    if mix not in MIXES:
        raise ValueError(f"mix {mix!r}: the glm-dsa writer takes {', '.join(MIXES)}")
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    kv_lora, nope, rope, v = hf["kv_lora_rank"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    writer = gguf.GGUFWriter(out_path or os.path.join(hf_dir, f"tiny-glm-{mix}.gguf"), "glm-dsa")
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    # the next-n block (model.layers.{layers}.*, a trained one: tools/train_mtp.py) where the directory has one
    nextn = int(hf.get("num_nextn_predict_layers") or 0) if any(
        n.startswith(f"model.layers.{layers}.") for n in tensors) else 0
    writer.add_block_count(layers + nextn)
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)  # MLA as MQA over the latent
    writer.add_rope_freq_base(float((hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(hf["rms_norm_eps"]))
    writer.add_expert_used_count(hf["num_experts_per_tok"])
    writer.add_expert_group_count(int(option(hf, "n_group")))
    writer.add_expert_group_used_count(int(option(hf, "topk_group")))
    writer.add_leading_dense_block_count(int(option(hf, "first_k_dense_replace")))
    writer.add_vocab_size(hf["vocab_size"])
    if hf.get("q_lora_rank"):
        writer.add_q_lora_rank(hf["q_lora_rank"])
    writer.add_kv_lora_rank(kv_lora)
    writer.add_key_length(kv_lora + rope)
    writer.add_value_length(kv_lora)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(v)
    writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    writer.add_expert_count(hf["n_routed_experts"])
    writer.add_expert_shared_count(int(option(hf, "n_shared_experts")))
    writer.add_expert_weights_scale(float(option(hf, "routed_scaling_factor")))
    if option(hf, "norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rope)
    writer.add_nextn_predict_layers(nextn)
    writer.add_indexer_head_count(int(option(hf, "index_n_heads")))
    writer.add_indexer_key_length(int(option(hf, "index_head_dim")))
    writer.add_indexer_top_k(int(option(hf, "index_topk")))
    _add_tokenizer(writer, hf_dir, hf["vocab_size"])

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, layers + nextn)
    spec = LatentAttentionSpec(0, heads, None, kv_lora, nope, rope, v, None, 0, 0.0)
    out, experts = {}, {}  # gguf name -> (tensor, in blocks?)
    for name, t in tensors.items():
        t = t.float()
        if name.endswith("kv_b_proj.weight"):  # llama.cpp's split: per head, the key part transposed
            parts = absorbed_parts(t, spec)
            blk = names.get_name(name, try_suffixes=(".weight",)).rsplit(".", 1)[0]
            out[blk.replace("attn_kv_b", "attn_k_b") + ".weight"] = (
                torch.stack([parts[f"absorb.{h}.k_b_proj.weight"] for h in range(heads)]), True)
            out[blk.replace("attn_kv_b", "attn_v_b") + ".weight"] = (
                torch.stack([parts[f"absorb.{h}.v_b_proj.weight"] for h in range(heads)]), True)
        elif ".mlp.experts." in name:  # model.layers.N.mlp.experts.E.proj.weight -> stacked per projection
            layer, rest = name.split(".mlp.experts.")
            expert, proj = rest.split(".", 1)
            experts.setdefault((layer, proj), {})[int(expert)] = t
        elif name.endswith("e_score_correction_bias"):
            out[f"blk.{name.split('.')[2]}.exp_probs_b.bias"] = (t, False)
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))  # with the suffix
            if gguf_name is None:
                raise ValueError(f"{name}: no glm-dsa name in gguf's tensor map")
            out[gguf_name] = (t, t.dim() == 2 and name.endswith(QUANTIZABLE))
    for (layer, proj), by_index in experts.items():
        part = {"gate_proj.weight": "ffn_gate_exps", "up_proj.weight": "ffn_up_exps",
                "down_proj.weight": "ffn_down_exps"}[proj]
        out[f"blk.{layer.split('.')[-1]}.{part}.weight"] = (torch.stack([by_index[e] for e in sorted(by_index)]), True)
    for name, (t, blocks) in out.items():
        if not blocks:
            writer.add_tensor(name, t.contiguous().numpy())
            continue
        if t.shape[-1] % 32:
            raise ValueError(f"{name}: rows of {t.shape[-1]} are not whole blocks of 32 (GLM_GGUF_SIZES)")
        data = gguf_blocks(t.reshape(-1, t.shape[-1]), mix)
        writer.add_tensor(name, data.reshape(*t.shape[:-1], -1).numpy(), raw_dtype=QTYPES[mix])
    return _finish_gguf(writer)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir")
    parser.add_argument("--mix", default="q8_0", choices=MIXES)
    args = parser.parse_args(argv)
    path = write_glm_gguf(args.hf_dir, args.mix)
    print(path)
    return path


if __name__ == "__main__":
    main()
