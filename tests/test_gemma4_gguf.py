"""Gemma 4 from GGUF files in llama.cpp's layout (architecture gemma4), served as stored.

The tiny gemma4 (every option on: sliding window 16 and global layers of another head size and KV
head count, proportional rope, values that are the keys, the last two layers sharing K/V with a
double-wide MLP, per-layer inputs, soft-capped logits) written as llama.cpp's converter writes it
(tools/gemma4_gguf.py):
- the file has llama.cpp's architecture, metadata, names, shapes and types;
- float32: it loads into the directory's layer specs and gives the directory's logits, bitwise;
- q8_0: the projections stay in their blocks and give, bitwise, the directory quantized at load
  (--quantize q8_0): prefill and decode logits, and the engine's greedy and sampled token_sha;
- a missing tensor is a startup error naming it.
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
from tools.gemma4_gguf import main, write_gemma4_gguf
from tools.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_tokenizer):
    """(the directory, its float32 GGUF, its q8_0 GGUF)."""
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("gemma4_gguf")), "gemma4", tokenizer=smollm2_tokenizer)
    return path, write_gemma4_gguf(path, "f32"), write_gemma4_gguf(path, "q8_0")


def test_the_file_is_in_llama_cpp_layout(files):
    reader = _Reader(files[2])
    meta = {name: field.contents() for name, field in reader.fields.items()}
    assert meta["general.architecture"] == "gemma4"
    assert meta["gemma4.attention.sliding_window_pattern"] == [True, True, False, True, True, False]
    assert (meta["gemma4.attention.head_count_kv"], meta["gemma4.feed_forward_length"]) == (
        [2, 2, 1, 2, 2, 1], [128, 128, 128, 128, 256, 256])
    assert (meta["gemma4.attention.key_length"], meta["gemma4.attention.key_length_swa"],
            meta["gemma4.attention.shared_kv_layers"],
            meta["gemma4.embedding_length_per_layer_input"]) == (32, 16, 2, 8)
    types = {t.name: (t.tensor_type, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}
    q8_0, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    assert types["blk.0.attn_q.weight"] == (q8_0, (64, 64)) and types["blk.2.attn_q.weight"] == (q8_0, (128, 64))
    assert "blk.2.attn_v.weight" not in types and "blk.0.attn_v.weight" in types  # k_eq_v on the global layers
    assert "blk.4.attn_k.weight" not in types and types["blk.4.ffn_up.weight"] == (q8_0, (256, 64))  # KV-shared
    assert types["blk.0.layer_output_scale.weight"] == (f32, (1,)) and types["rope_freqs.weight"] == (f32, (16,))
    assert types["per_layer_token_embd.weight"] == (f32, (49152, 48)) and "output.weight" not in types


def _logits(model, seqs):
    """Prefill chunks of two sequences, then decode rows beside each other (the window slides)."""
    cache, tables = model.allocate_cache(8, 32, torch.float32), [[0, 1], [5]]
    got = [model.forward(_rows(tables, [(0, seqs[0][:30], 0, True), (1, seqs[1][:5], 0, True)]), cache)]
    for step in range(4):
        got.append(model.forward(_rows(tables, [(0, seqs[0][30 + step:31 + step], 30 + step, True),
                                                (1, seqs[1][5 + step:6 + step], 5 + step, True)]), cache))
    return got


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_loads_as_the_directory_and_gives_its_logits(files, kind):
    directory, f32_path, q8_path = files
    ops = backend_ops("cpu")
    ckpt = load_hf_dir(directory)
    if kind == "q8_0":
        quantize_checkpoint(ckpt, "q8_0")
    served = build_model(load_gguf(f32_path if kind == "f32" else q8_path, keep_quantized=True), torch.float32, ops)
    dense = build_model(ckpt, torch.float32, ops)
    assert served.specs == dense.specs and served.weight_formats() == dense.weight_formats()
    assert served.weight_formats().get("q8_0", 0) == (25 if kind == "q8_0" else 0)
    torch.manual_seed(5)
    seqs = [torch.randint(0, 49152, (n,)).tolist() for n in (40, 9)]
    assert all(torch.equal(a, b) for a, b in zip(_logits(served, seqs), _logits(dense, seqs)))


def test_the_engine_replies_with_the_same_token_sha(files):
    directory, _, path = files
    replies = []
    for model, extra in ((path, {}), (directory, {"quantize": "q8_0"})):
        engine = Engine(model, EngineConfig(probe=False, kv_cache_gib=0.01, drafting=False, **extra))
        ids = list(range(200, 240))  # longer than the window
        replies.append([token_sha(engine.generate(ids, SamplingParams(max_tokens=16, ignore_eos=True, **p)).token_ids)
                        for p in (dict(temperature=0.0), dict(temperature=1.0, seed=7))])
    assert replies[0] == replies[1]


def test_a_missing_tensor_is_named(files, tmp_path):
    cut = rewrite_gguf(files[2], str(tmp_path / "cut.gguf"), without("blk.3.attn_k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.3\.self_attn\.k_norm"):
        load_gguf(cut, keep_quantized=True)


def test_the_command_line_writes_one(files):
    path = main([files[0], "--mix", "q4_0"])
    assert path.endswith("tiny-gemma4-q4_0.gguf") and load_gguf(path).config["attention_k_eq_v"] is True
