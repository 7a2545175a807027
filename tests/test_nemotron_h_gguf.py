"""Nemotron-H from GGUF files in llama.cpp's layout (architectures nemotron_h and nemotron_h_moe),
served as stored: every projection and expert in its blocks through the exact GEMM.

Tiny nemotron_h checkpoints (tools/tiny_checkpoint.py) written as llama.cpp's converter and
quantizer write them (write_tiny_gguf: its names, per-layer head_count_kv / feed_forward_length for
the layer kinds, -exp(A_log) as ssm_a, the gated norm's weight per group, Q/K rows in its rope order,
stacked experts; every matrix q8_0), one dense (M, *, -) and one MoE (M, *, E with latent
projections, groups, a correction bias):
- the file has llama.cpp's architecture, names, types and metadata;
- it loads into the layer specs of the directory and serves its bits: logits of a prefill and
  decode rows equal, bitwise, the directory's quantized at load (quantize_checkpoint q8_0); the
  engine's greedy and sampled replies have the same token_sha;
- an MTP block (nextn_predict_layers) is skipped; the command line writes one.
"""
import gguf
import numpy as np
import pytest
import torch

from test_models import _rows
from tensorfold.api.replies import token_sha
from tensorfold.backends import backend_ops
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.kernels.delta_net import decay_rate
from tensorfold.models.gguf_file import _Reader, load_gguf
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model, quantize_checkpoint
from tensorfold.sampling.params import SamplingParams
from tools.tiny_checkpoint import NEMOTRON_H_GGUF_SIZES, main, make_tiny_checkpoint, write_tiny_gguf

PATTERNS = {"nemotron_h": "M*M-M", "nemotron_h_moe": NEMOTRON_H_GGUF_SIZES["hybrid_override_pattern"]}


@pytest.fixture(scope="module", params=list(PATTERNS))
def q8(request, tmp_path_factory, smollm2_tokenizer):
    """(the directory, its q8_0 GGUF, llama.cpp's architecture name)."""
    folder = str(tmp_path_factory.mktemp(request.param))
    path = make_tiny_checkpoint(folder, "nemotron_h", tokenizer=smollm2_tokenizer,
                                **dict(NEMOTRON_H_GGUF_SIZES, hybrid_override_pattern=PATTERNS[request.param]))
    return path, write_tiny_gguf(path, "q8_0"), request.param


def test_the_file_is_in_llama_cpp_layout(q8):
    _, path, arch = q8
    reader = _Reader(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    assert meta["general.architecture"] == arch
    pattern = PATTERNS[arch]
    assert meta[f"{arch}.attention.head_count_kv"] == [2 if c == "*" else 0 for c in pattern]
    assert [bool(n) for n in meta[f"{arch}.feed_forward_length"]] == [c in "-E" for c in pattern]
    types = {t.name: (t.tensor_type, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}
    assert types["blk.0.ssm_a"] == (gguf.GGMLQuantizationType.F32, (8, 1))
    assert types["blk.0.ssm_norm.weight"] == (gguf.GGMLQuantizationType.F32, (2, 32))
    assert types["blk.0.ssm_conv1d.weight"] == (gguf.GGMLQuantizationType.F32, (128, 4))
    assert types["blk.0.ssm_in.weight"][0] == types["blk.1.attn_q.weight"][0] == gguf.GGMLQuantizationType.Q8_0
    if arch == "nemotron_h_moe":
        assert types["blk.2.ffn_up_exps.weight"] == (gguf.GGMLQuantizationType.Q8_0, (8, 32, 32))
        assert types["blk.2.ffn_gate_inp.weight"][0] == gguf.GGMLQuantizationType.F32
        assert {"blk.2.exp_probs_b.bias", "blk.2.ffn_latent_down.weight", "blk.2.ffn_up_shexp.weight"} <= set(types)
    else:
        assert "blk.3.ffn_up.weight" in types and not any("exps" in n for n in types)


@pytest.fixture(scope="module")
def models(q8):
    directory, path, _ = q8
    ops = backend_ops("cpu")
    ckpt = load_hf_dir(directory)
    quantize_checkpoint(ckpt, "q8_0")
    return build_model(load_gguf(path, keep_quantized=True), torch.float32, ops), build_model(ckpt, torch.float32, ops)


def test_loads_as_the_directory_and_serves_its_bits(q8, models):
    served, directory = models
    assert served.specs == directory.specs and served.weight_formats() == directory.weight_formats()
    a_log = load_hf_dir(q8[0]).tensors["backbone.layers.0.mixer.A_log"].float()
    assert torch.equal(served.layers[0].mixer.params.rate, decay_rate(a_log))  # -ssm_a, as stored
    torch.manual_seed(5)
    seqs = [torch.randint(0, 49152, (n,)).tolist() for n in (70, 9)]
    outs = []
    for model in (served, directory):
        cache = model.allocate_cache(8, 32, torch.float32)
        got = [model.forward(_rows([[0, 1, 2], [5, 6]], [(0, seqs[0][:60], 0, True), (1, seqs[1][:5], 0, True)]),
                             cache)]
        for step in range(4):
            got.append(model.forward(_rows([[0, 1, 2], [5, 6]], [(0, seqs[0][60 + step:61 + step], 60 + step, True),
                                                                   (1, seqs[1][5 + step:6 + step], 5 + step, True)]),
                                     cache))
        outs.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_the_engine_replies_with_the_same_token_sha(q8):
    directory, path, _ = q8
    replies = []
    for model, extra in ((path, {}), (directory, {"quantize": "q8_0"})):
        engine = Engine(model, EngineConfig(probe=False, kv_cache_gib=0.01, drafting=False, **extra))
        ids = list(range(200, 240))
        replies.append([token_sha(engine.generate(ids, SamplingParams(max_tokens=24, ignore_eos=True, **p)).token_ids)
                        for p in (dict(temperature=0.0), dict(temperature=1.0, seed=7))])
    assert replies[0] == replies[1]


def test_an_mtp_block_is_skipped(q8, models, tmp_path):
    """llama.cpp folds a Nemotron 3 MTP head into one block past the last layer (nextn_predict_layers):
    skipped at load, the rest the same."""
    _, path, arch = q8
    reader = _Reader(path)
    out = str(tmp_path / "mtp.gguf")
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == f"{arch}.block_count":
            value += 1
        elif name in (f"{arch}.attention.head_count_kv", f"{arch}.feed_forward_length"):
            value = value + [value[1] if "head_count_kv" in name else 0]
        writer.add_key_value(name, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    writer.add_nextn_predict_layers(1)
    layers = len(PATTERNS[arch])
    for t in reader.tensors:
        data = np.array(t.data)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
        if t.name.startswith("blk.1."):  # an attention block's tensors as the MTP block's
            writer.add_tensor(t.name.replace("blk.1.", f"blk.{layers}.", 1), data, raw_shape=data.shape,
                              raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model = build_model(load_gguf(out, keep_quantized=True), torch.float32, backend_ops("cpu"))
    assert model.specs == models[1].specs


def test_the_command_line_writes_a_nemotron_h_gguf(tmp_path):
    path = main([str(tmp_path), "--arch", "nemotron_h", "--gguf", "q8_0", "--plain"])
    assert path.endswith("tiny-q8_0.gguf")
    assert load_gguf(path).config["layers_block_type"] == ["mamba", "attention", "moe", "mamba", "attention", "moe"]
