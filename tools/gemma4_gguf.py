"""Write a tiny gemma4 directory (tools/tiny_checkpoint.py's) as llama.cpp's converter writes Gemma 4:
architecture gemma4; the global layers' head size as key_length / value_length and the sliding
layers' as the _swa ones; head_count_kv per layer where the global layers have their own KV heads,
feed_forward_length per layer with the double-wide MLP of the KV-shared layers; the sliding
window, its per-layer pattern, the shared KV layer count, the per-layer input width, the final
soft-cap, both rope bases and rope_freqs.weight (1 for each rotated frequency of the global layers'
proportional rope, 1e30 for the rest); tensors under gguf's tensor map for gemma4, norms as stored
(Gemma 4's norms multiply by their weight: the converter adds nothing), the layer scalar as
blk.N.layer_output_scale.weight, the tied head left out. A MoE directory (tools/tiny_checkpoint.py's
gemma4_moe) adds the converter's expert metadata (expert_count, expert_used_count,
expert_feed_forward_length) and tensors: router.proj as ffn_gate_inp.weight, router.scale as
ffn_gate_inp.scale, router.per_expert_scale as ffn_down_exps.scale, the stacked experts as
ffn_gate_up_exps / ffn_down_exps.weight [E, rows, K], the MoE's norms as pre_ffw_norm_2,
post_ffw_norm_1 and post_ffw_norm_2.

In blocks (`mix`: q8_0 or q4_0; f32 keeps every tensor float32) go the matrices `--quantize` puts
in blocks (models/loader.QUANTIZABLE: the projections, each expert's, and the embedding), so a file
and its directory quantized at load serve the same bits; the per-layer table, its projection and
gates, the router's projection (as llama.cpp's quantizer keeps ffn_gate_inp), norms and scalars
stay float32.

    python tools/gemma4_gguf.py HF_DIR [--mix q8_0|q4_0|f32]
"""
import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIXES = ("q8_0", "q4_0", "f32")  # f32: every tensor as float32
STACKED = ("experts.gate_up_proj", "experts.down_proj")  # the MoE's experts, [E, rows, K] (no .weight suffix)
ROUTER_SCALES = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}


def write_gemma4_gguf(hf_dir: str, mix: str = "q8_0", out_path: str | None = None) -> str:
    import gguf
    import torch
    from safetensors.torch import load_file

    from tensorfold.models.gemma4 import option
    from tensorfold.models.loader import QUANTIZABLE
    from tensorfold.models.quantize import QTYPES, gguf_blocks
    from tools.tiny_checkpoint import _add_tokenizer, _finish_gguf

    if mix not in MIXES:
        raise ValueError(f"mix {mix!r}: the gemma4 writer takes {', '.join(MIXES)}")
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    hf = {**hf, **hf.get("text_config", {})}
    layers, types = hf["num_hidden_layers"], hf["layer_types"]
    swa = [t == "sliding_attention" for t in types]
    shared = int(hf.get("num_kv_shared_layers") or 0)
    writer = gguf.GGUFWriter(out_path or os.path.join(hf_dir, f"tiny-gemma4-{mix}.gguf"), "gemma4")
    writer.add_block_count(layers)
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    inter = hf["intermediate_size"]
    if hf.get("use_double_wide_mlp"):
        writer.add_feed_forward_length([inter if i < layers - shared else 2 * inter for i in range(layers)])
    else:
        writer.add_feed_forward_length(inter)
    writer.add_head_count(hf["num_attention_heads"])
    if hf.get("num_global_key_value_heads") is not None:
        writer.add_head_count_kv([hf["num_key_value_heads"] if s else hf["num_global_key_value_heads"] for s in swa])
    else:
        writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(float(hf["rms_norm_eps"]))
    global_head_dim, head_dim = int(option(hf, "global_head_dim")), hf["head_dim"]
    writer.add_key_length(global_head_dim)
    writer.add_value_length(global_head_dim)
    writer.add_key_length_swa(head_dim)
    writer.add_value_length_swa(head_dim)
    ropes = hf["rope_parameters"]
    writer.add_rope_freq_base(float(ropes["full_attention"]["rope_theta"]))
    writer.add_rope_freq_base_swa(float(ropes["sliding_attention"]["rope_theta"]))
    writer.add_rope_dimension_count(global_head_dim)
    writer.add_rope_dimension_count_swa(head_dim)
    if hf.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(hf["final_logit_softcapping"]))
    writer.add_sliding_window(hf["sliding_window"])
    writer.add_sliding_window_pattern(swa)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(int(hf.get("hidden_size_per_layer_input") or 0))
    if hf.get("enable_moe_block"):
        writer.add_expert_count(hf["num_experts"])
        writer.add_expert_used_count(hf["top_k_experts"])
        writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    _add_tokenizer(writer, hf_dir, hf["vocab_size"])

    rotated = int(global_head_dim * ropes["full_attention"]["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight", torch.tensor([1.0] * rotated + [1e30] * (global_head_dim // 2 - rotated),
                                                        dtype=torch.float32).numpy())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if name.startswith(("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")):
            continue
        name = name.replace("model.language_model.", "model.")
        t = t.float()
        if name.endswith(tuple(ROUTER_SCALES)):  # the converter's .scale tensors (Gemma4Model.modify_tensors)
            parts = name.split(".")  # model.layers.N.router.<scale>
            gguf_name = f"blk.{parts[2]}.{ROUTER_SCALES['.'.join(parts[-2:])]}"
        elif name.endswith("layer_scalar") or name.endswith(STACKED):
            gguf_name = names.get_name(name) + ".weight"
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if gguf_name is None:
            raise ValueError(f"{name}: no gemma4 name in gguf's tensor map")
        if mix != "f32" and (t.dim() == 2 and name.endswith(QUANTIZABLE) or name.endswith(STACKED)):
            if t.shape[-1] % 32:
                raise ValueError(f"{name}: rows of {t.shape[-1]} are not whole blocks of 32")
            blocks = gguf_blocks(t.reshape(-1, t.shape[-1]), mix)  # an expert's rows as its own matrix's
            writer.add_tensor(gguf_name, blocks.reshape(*t.shape[:-1], -1).numpy(), raw_dtype=QTYPES[mix])
        else:
            writer.add_tensor(gguf_name, t.contiguous().numpy())
    return _finish_gguf(writer)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir")
    parser.add_argument("--mix", default="q8_0", choices=MIXES)
    args = parser.parse_args(argv)
    path = write_gemma4_gguf(args.hf_dir, args.mix)
    print(path)
    return path


if __name__ == "__main__":
    main()
