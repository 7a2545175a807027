"""GLM-5.x from GGUF files in llama.cpp's layout (architecture glm-dsa), served as stored: every
projection, the per-head absorbed kv_b parts (attn_k_b / attn_v_b) and the experts in their blocks.

A tiny glm_moe_dsa checkpoint (every option on: q_lora, the DSA indexer choosing fewer keys than the
prompt on layers 0 and 2, layer 1 reusing layer 0's choice, a dense first layer, grouped sigmoid
routing with a correction bias and a shared expert) written as llama.cpp's converter writes it
(tools/glm_gguf.py), q8_0:
- the file has llama.cpp's architecture, metadata, names, shapes and types;
- it loads into the directory's config and layer specs and serves its bits: prefill and decode logits
  equal, bitwise, the directory's quantized at load (--quantize q8_0, which splits kv_b as llama.cpp
  does); the engine's greedy and sampled replies have the same token_sha;
- a file with kv_b whole (attn_kv_b) loads too; a missing tensor is a startup error naming it.
"""
import gguf
import pytest
import torch

from family_cases import rewrite_gguf, without
from test_models import _rows
from tensorfold.api.replies import token_sha
from tensorfold.backends import backend_ops
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.gguf_file import _Reader, load_gguf
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model, quantize_checkpoint
from tensorfold.sampling.params import SamplingParams
from tools.glm_gguf import GLM_GGUF_SIZES, main, write_glm_gguf
from tools.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def q8(tmp_path_factory, smollm2_tokenizer):
    """(the directory, its q8_0 GGUF)."""
    folder = str(tmp_path_factory.mktemp("glm_gguf"))
    path = make_tiny_checkpoint(folder, "glm_moe_dsa", tokenizer=smollm2_tokenizer, **GLM_GGUF_SIZES)
    return path, write_glm_gguf(path, "q8_0")


def test_the_file_is_in_llama_cpp_layout(q8):
    _, path = q8
    reader = _Reader(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    assert meta["general.architecture"] == "glm-dsa"
    assert (meta["glm-dsa.attention.head_count_kv"], meta["glm-dsa.attention.kv_lora_rank"],
            meta["glm-dsa.attention.key_length_mla"], meta["glm-dsa.attention.value_length_mla"],
            meta["glm-dsa.attention.key_length"]) == (1, 32, 40, 16, 40)
    assert (meta["glm-dsa.attention.indexer.head_count"], meta["glm-dsa.attention.indexer.top_k"],
            meta["glm-dsa.leading_dense_block_count"], meta["glm-dsa.expert_group_count"]) == (16, 12, 1, 4)
    types = {t.name: (t.tensor_type, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}
    q8_0, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    assert types["blk.0.attn_k_b.weight"] == (q8_0, (4, 32, 32)) and types["blk.0.attn_v_b.weight"] == (q8_0, (4, 16, 32))
    assert types["blk.1.ffn_gate_exps.weight"] == (q8_0, (8, 32, 64)) and types["blk.1.ffn_gate_inp.weight"][0] == f32
    assert types["blk.1.exp_probs_b.bias"] == (f32, (8,)) and types["blk.0.indexer.k_norm.bias"] == (f32, (16,))
    assert types["blk.0.indexer.proj.weight"][0] == q8_0 and "blk.0.ffn_up.weight" in types
    assert "blk.1.indexer.attn_k.weight" not in types and "blk.2.indexer.attn_k.weight" in types  # layer 1: shared
    assert not any("attn_kv_b" in n for n in types)


@pytest.fixture(scope="module")
def models(q8):
    directory, path = q8
    ops = backend_ops("cpu")
    ckpt = load_hf_dir(directory)
    quantize_checkpoint(ckpt, "q8_0")
    served = load_gguf(path, keep_quantized=True)
    assert {k: v for k, v in served.config.items() if ckpt.config.get(k) != v} == {}
    return build_model(served, torch.float32, ops), build_model(ckpt, torch.float32, ops)


def test_loads_as_the_directory_and_serves_its_bits(models):
    served, directory = models
    assert served.specs == directory.specs and served.weight_formats() == directory.weight_formats()
    assert served.weight_formats()["q8_0"] > 0
    torch.manual_seed(5)
    seqs = [torch.randint(0, 49152, (n,)).tolist() for n in (40, 9)]
    outs = []
    for model in (served, directory):
        cache = model.allocate_cache(8, 32, torch.float32)
        got = [model.forward(_rows([[0, 1], [5]], [(0, seqs[0][:30], 0, True), (1, seqs[1][:5], 0, True)]), cache)]
        for step in range(4):
            got.append(model.forward(_rows([[0, 1], [5]], [(0, seqs[0][30 + step:31 + step], 30 + step, True),
                                                          (1, seqs[1][5 + step:6 + step], 5 + step, True)]), cache))
        outs.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_the_engine_replies_with_the_same_token_sha(q8):
    directory, path = q8
    replies = []
    for model, extra in ((path, {}), (directory, {"quantize": "q8_0"})):
        engine = Engine(model, EngineConfig(probe=False, kv_cache_gib=0.01, drafting=False, **extra))
        ids = list(range(200, 230))
        replies.append([token_sha(engine.generate(ids, SamplingParams(max_tokens=16, ignore_eos=True, **p)).token_ids)
                        for p in (dict(temperature=0.0), dict(temperature=1.0, seed=7))])
    assert replies[0] == replies[1]


def test_a_whole_kv_b_loads_and_a_missing_tensor_is_named(q8, models, tmp_path):
    directory, path = q8
    dense = load_hf_dir(directory).tensors

    def whole(name, data, kind):
        if "attn_k_b" in name:
            layer = name.split(".")[1]
            return [(f"blk.{layer}.attn_kv_b.weight",
                     dense[f"model.layers.{layer}.self_attn.kv_b_proj.weight"].float().numpy(), gguf.GGMLQuantizationType.F32)]
        return [] if "attn_v_b" in name else [(name, data, kind)]

    model = build_model(load_gguf(rewrite_gguf(path, str(tmp_path / "kv_b.gguf"), whole), keep_quantized=True),
                        torch.float32, backend_ops("cpu"))
    assert model.specs == models[1].specs
    cut = rewrite_gguf(path, str(tmp_path / "cut.gguf"), without("blk.2.attn_v_b.weight"))
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.2\.self_attn\.absorb\.0\.v_b_proj"):
        load_gguf(cut, keep_quantized=True)


def test_the_command_line_writes_one(tmp_path, smollm2_tokenizer):
    folder = make_tiny_checkpoint(str(tmp_path), "glm_moe_dsa", tokenizer=smollm2_tokenizer, **GLM_GGUF_SIZES)
    path = main([folder, "--mix", "q4_0"])
    assert path.endswith("tiny-glm-q4_0.gguf") and load_gguf(path).config["indexer_types"] == ["full", "shared", "full"]
