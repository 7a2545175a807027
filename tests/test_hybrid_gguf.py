"""The Qwen hybrids from GGUF files in llama.cpp's layout (architectures qwen35, qwen35moe,
qwen3next), served as stored: every projection and expert in its blocks through the exact GEMM.

Tiny checkpoints of each hybrid (tools/tiny_checkpoint.py) written the way llama.cpp's converter
and quantizer write them (write_tiny_gguf: llama.cpp's tensor names, metadata, value-head order,
stored norms and -exp(A_log); every matrix q8_0, or the Q4_K_M-style mix on sizes whose row
lengths are multiples of 256):
- the file has llama.cpp's names, types and metadata;
- it loads into the Hugging Face names and config the hybrid family reads: the same layer specs,
  the same blocks, row for row, as the directory quantized at load (quantize_checkpoint), the same
  norms and decay rates as served;
- it serves the same bits: every forward's logits (prefill of three sequences, then decode) equal
  the directory's quantized at load with the same block types, and the engine's greedy and sampled
  replies have the same token_sha;
- llama.cpp's other spellings read the same (fused attn_qkv, ffn_gate_up_exps, Qwen3-Next's legacy
  ssm_in) and an MTP block is skipped; a quantized ssm_out whose value heads are stored in tiled
  order stays as stored, its GEMM taking its input in that order (every block type, the
  K-quants' super-blocks included);
- the command line writes them (--arch qwen3_next --gguf q4_0);
- an architecture not served is a startup error that lists the served ones.
"""
import importlib

import gguf
import numpy as np
import pytest
import torch

from tensorfold.api.replies import token_sha
from tensorfold.backends import backend_ops
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.kernels import quant_gemm
from tensorfold.kernels.delta_net import decay_rate
from tensorfold.kernels.quant_gemm import QuantWeight
from tensorfold.models.gguf_quants import FileBlocks, StoredColumns
from tensorfold.models import qwen3_5
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.gguf_file import ARCHITECTURES, _Reader, _take_columns, _untiled, load_gguf
from tensorfold.models.gguf_quants import quant_weight
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.linear_attention import LinearAttentionSpec, _ba_order, _qkvz_order
from tensorfold.models.loader import build_model, quantize_checkpoint, split_stacked_experts
from tensorfold.models.quantize import QTYPES, gguf_blocks
from tensorfold.sampling.params import SamplingParams
from test_native_backend import greedy_run
from tools.tiny_checkpoint import (GGUF_ARCHS, HYBRID_ARCHS, HYBRID_GGUF_SIZES, HYBRID_K_QUANT_SIZES, SEED_PROMPT,
                                   main, make_tiny_checkpoint, write_tiny_gguf)

PROMPTS = [[1, 5, 9, 200, 31, 7, 7, 64] * 3, [3, 4], list(range(40, 77))]
FLOAT = ("ssm_a", "ssm_dt", "ssm_conv1d", "ssm_norm", "ffn_gate_inp", "ffn_gate_inp_shexp")  # + every *_norm


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def q8(request, tmp_path_factory, smollm2_tokenizer):
    """(arch, Hugging Face directory, its q8_0 GGUF)."""
    arch = request.param
    hf_dir = make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, tokenizer=smollm2_tokenizer, family=True,
                                  **HYBRID_GGUF_SIZES)
    return arch, hf_dir, write_tiny_gguf(hf_dir, "q8_0", str(tmp_path_factory.mktemp("gguf") / f"{arch}.gguf"))


@pytest.fixture(scope="module")
def q8_loaded(q8):
    """(the q8_0 GGUF as the server loads it, the directory quantized at load to q8_0)."""
    _, hf_dir, path = q8
    reference = load_hf_dir(hf_dir)
    quantize_checkpoint(reference, "q8_0")
    return load_blocks(path), reference


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def k_quants(request, tmp_path_factory, smollm2_tokenizer):
    arch = request.param
    hf_dir = make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch + "_k")), arch, tokenizer=smollm2_tokenizer,
                                  family=True, **HYBRID_K_QUANT_SIZES)
    return arch, hf_dir, write_tiny_gguf(hf_dir, "q4_k_m", str(tmp_path_factory.mktemp("gguf") / f"{arch}-k.gguf"))


def _text_tensors(hf_dir: str) -> dict:
    return {name.replace("model.language_model.", "model.", 1): t for name, t in load_hf_dir(hf_dir).tensors.items()
            if not name.startswith("model.visual.")}


def load_blocks(path: str):
    """load_gguf(keep_quantized=True) with every matrix read from the file (gguf_quants.FileBlocks.load)."""
    ckpt = load_gguf(path, keep_quantized=True)
    load = (lambda t: t.load() if isinstance(t, FileBlocks) else t)
    ckpt.tensors = {name: t.map(load) if isinstance(t, StoredColumns) else load(t) for name, t in ckpt.tensors.items()}
    return ckpt


def _same_blocks(a: QuantWeight, b: QuantWeight) -> bool:
    fields = ("codes", "scale", "scale_exp", "min", "min_exp")
    return a.kind == b.kind and all((getattr(a, f) is None and getattr(b, f) is None)
                                    or torch.equal(getattr(a, f), getattr(b, f)) for f in fields)


# ---- the file ----------------------------------------------------------------------------------

def test_the_file_is_in_llama_cpp_layout(q8):
    arch, hf_dir, path = q8
    name = GGUF_ARCHS[arch]
    reader = _Reader(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)
    known = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[model_arch] for i in range(4)}
    types = {t.name: t.tensor_type for t in reader.tensors}
    for tensor, kind in types.items():
        base = tensor.rsplit(".", 1)[0] if tensor.endswith((".weight", ".bias")) else tensor
        assert base in known, f"{tensor}: not one of llama.cpp's {name} tensors"
        part = base.split(".")[-1]
        dense = part in FLOAT or part.endswith("_norm")
        want = gguf.GGMLQuantizationType.F32 if dense else gguf.GGMLQuantizationType.Q8_0
        assert kind == want, f"{tensor}: {kind.name}"
    assert meta["general.architecture"] == name
    assert meta[f"{name}.full_attention_interval"] == 4
    if arch != "qwen3_next":  # the converter writes layer_types where config.json has them (Qwen3.5's)
        assert meta[f"{name}.attention.recurrent_layers"] == [True, True, True, False]
    assert meta[f"{name}.rope.dimension_count"] == 8  # a quarter of head_dim 32
    assert meta[f"{name}.ssm.state_size"] == 32 and meta[f"{name}.ssm.inner_size"] == 8 * 32
    assert (meta[f"{name}.ssm.group_count"], meta[f"{name}.ssm.time_step_rank"]) == (4, 8)
    assert ("blk.0.ssm_ba.weight" in types) == (arch == "qwen3_next") != ("blk.0.ssm_beta.weight" in types)
    assert ("blk.0.ffn_gate_exps.weight" in types) == (arch != "qwen3_5")
    # The converter's transforms, seen in the file: dt_bias tiled for Qwen3.5 (value head j of
    # key head k at j * 4 + k), A_log stored as -exp(A_log), norms as 1 + w.
    hf = _text_tensors(hf_dir)
    stored = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors if t.name.startswith("blk.0.")}
    dt = hf["model.layers.0.linear_attn.dt_bias"]
    tiled = dt.reshape(4, 2).t().reshape(-1) if arch != "qwen3_next" else dt
    assert torch.equal(stored["blk.0.ssm_dt.bias"], tiled)
    a_log = hf["model.layers.0.linear_attn.A_log"]
    a_log = a_log.reshape(4, 2).t().reshape(-1) if arch != "qwen3_next" else a_log
    torch.testing.assert_close(stored["blk.0.ssm_a"], -torch.exp(a_log), rtol=2e-7, atol=0)  # torch's exp: 1 ulp
    assert torch.equal(stored["blk.0.attn_norm.weight"], hf["model.layers.0.input_layernorm.weight"] + 1)


# ---- the checkpoint it loads into --------------------------------------------------------------

def test_loads_as_the_directory_quantized_at_load(q8_loaded):
    """The same layer specs, and tensor for tensor the blocks quantize_checkpoint makes of the
    directory (the converter's reorders undone row for row), the norms and rates as served."""
    got, want = q8_loaded
    args, hf_args = ModelArgs.from_hf(got.config), ModelArgs.from_hf(want.config)
    assert qwen3_5.layer_specs(args) == qwen3_5.layer_specs(hf_args)
    assert (args.vocab_size, args.hidden_size, args.num_layers, args.tie_word_embeddings, args.rope) == (
        hf_args.vocab_size, hf_args.hidden_size, hf_args.num_layers, hf_args.tie_word_embeddings, hf_args.rope)
    assert got.architecture in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
    assert got.chat_template == want.chat_template
    text = SEED_PROMPT + " <think>x</think> <tool_call>"
    assert got.tokenizer.encode(text).ids == want.tokenizer.encode(text, add_special_tokens=False).ids

    wanted = {qwen3_5.tensor_name(n): t for n, t in want.tensors.items() if qwen3_5.tensor_name(n)}
    spec = LinearAttentionSpec(4, 8, 32, 32, 4, grouped=True)
    for name in list(wanted):  # Qwen3-Next's grouped projections in plain order, as GatedDeltaNet reads them
        la = name.rsplit(".", 2)[0]
        if name.endswith("in_proj_qkvz.weight"):
            plain = wanted.pop(name).rows(_qkvz_order(spec))
            wanted[la + ".in_proj_qkv.weight"] = plain.rows(torch.arange(spec.conv_dim))
            wanted[la + ".in_proj_z.weight"] = plain.rows(torch.arange(spec.conv_dim, plain.shape[0]))
        elif name.endswith("in_proj_ba.weight"):
            plain = wanted.pop(name).rows(_ba_order(spec))
            wanted[la + ".in_proj_b.weight"], wanted[la + ".in_proj_a.weight"] = (plain.rows(torch.arange(8)),
                                                                                  plain.rows(torch.arange(8, 16)))
    rates = [n for n in wanted if n.endswith(".A_log")]
    assert set(got.tensors) == (set(wanted) - set(rates)) | {n[:-len("_log")] for n in rates}
    for name, tensor in got.tensors.items():
        if name.endswith(".A"):  # -ssm_a is the rate the directory's A_log gives
            assert torch.equal(-tensor, decay_rate(wanted[name + "_log"]))
        elif isinstance(tensor, QuantWeight):
            assert _same_blocks(tensor, wanted[name]), name
        elif isinstance(tensor, StoredColumns):  # ssm_out in the file's (tiled) column order: its blocks moved whole
            assert isinstance(tensor.stored, QuantWeight) and torch.equal(tensor.dequantize(), wanted[name].dequantize())
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            assert torch.equal(tensor + 1, wanted[name] + 1), name  # as WeightReader.norm serves them
        else:
            assert torch.equal(tensor, wanted[name].float()), name


# ---- the same bits ----------------------------------------------------------------------------

def test_serves_the_bits_of_the_directory_quantized_at_load(q8, q8_loaded):
    arch = q8[0]
    ops = backend_ops("cpu")
    model, reference = (build_model(ckpt, torch.float32, ops) for ckpt in q8_loaded)
    formats = model.weight_formats()
    assert formats == reference.weight_formats() and set(formats) <= {"q8_0", "float32"}
    assert formats.get("float32", 0) == (8 if arch != "qwen3_5" else 0)  # the routers, as llama.cpp keeps them
    got, got_sha = greedy_run(model, PROMPTS, steps=4)
    want, want_sha = greedy_run(reference, PROMPTS, steps=4)
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{arch}: logits differ at step {step}, max diff {(g - w).abs().max()}"
    assert got_sha == want_sha


def test_the_engine_replies_with_the_same_token_sha(q8):
    """The GGUF as the server loads it (blocks as stored; the startup probes pass) and the
    directory with --quantize q8_0: a greedy and a sampled reply, token for token."""
    arch, hf_dir, path = q8
    config = dict(context=1024, kv_cache_gib=0.02)
    served = Engine(path, EngineConfig(**config))
    assert served.exact, served.probe_failures
    reference = Engine(hf_dir, EngineConfig(**config, quantize="q8_0", probe=False))
    ids = served.tokenizer.encode(SEED_PROMPT, add_special_tokens=False)
    assert ids == reference.tokenizer.encode(SEED_PROMPT, add_special_tokens=False)
    for params in (SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=8, ignore_eos=True)):
        got, want = served.generate(ids, params).token_ids, reference.generate(ids, params).token_ids
        assert len(got) == 8 and token_sha(got) == token_sha(want)


def _quantized_like(gguf_ckpt, hf_dir: str):
    """The directory's checkpoint with every matrix the GGUF keeps in blocks quantized from the
    directory's own weights to the GGUF's block type for it (gguf_blocks: the writer's encoder),
    Qwen3-Next's grouped projections split in the plain order first, stacked experts per expert."""
    ckpt = load_hf_dir(hf_dir)
    tensors = _text_tensors(hf_dir)
    h = ModelArgs.from_hf(ckpt.config).hf
    spec = LinearAttentionSpec(h["linear_num_key_heads"], h["linear_num_value_heads"], h["linear_key_head_dim"],
                               h["linear_value_head_dim"], h["linear_conv_kernel_dim"], grouped=True)
    for name in list(tensors):
        if name.endswith("in_proj_qkvz.weight"):
            plain = tensors.pop(name)[_qkvz_order(spec)]
            tensors[name.replace("qkvz", "qkv")], tensors[name.replace("qkvz", "z")] = plain.split(
                [spec.conv_dim, plain.shape[0] - spec.conv_dim])
        elif name.endswith("in_proj_ba.weight"):
            plain = tensors.pop(name)[_ba_order(spec)]
            tensors[name.replace("_ba", "_b")], tensors[name.replace("_ba", "_a")] = plain.chunk(2)
    split_stacked_experts(tensors)
    for name, w in tensors.items():
        kept = gguf_ckpt.tensors.get(name)
        if isinstance(kept, QuantWeight):
            tensors[name] = quant_weight(gguf_blocks(w.float(), kept.kind).reshape(-1), QTYPES[kept.kind],
                                         tuple(w.shape))
        elif isinstance(kept, StoredColumns):  # quantized in the file's column order, served in it
            stored = w.float()[:, kept.inputs]
            blocks = quant_weight(gguf_blocks(stored, kept.stored.kind).reshape(-1), QTYPES[kept.stored.kind],
                                  tuple(stored.shape))
            tensors[name] = StoredColumns(blocks, torch.argsort(kept.inputs))
    ckpt.tensors = tensors
    return ckpt


def test_k_quant_mix_serves_the_bits_of_the_directory_in_the_same_blocks(k_quants):
    arch, hf_dir, path = k_quants
    ops = backend_ops("cpu")
    gguf_ckpt = load_blocks(path)
    model = build_model(gguf_ckpt, torch.float32, ops)
    reference = build_model(_quantized_like(gguf_ckpt, hf_dir), torch.float32, ops)
    formats = model.weight_formats()
    assert formats == reference.weight_formats() and {"q4_k", "q6_k"} <= set(formats) <= {"q4_k", "q6_k", "float32"}
    got, got_sha = greedy_run(model, PROMPTS, steps=3)
    want, want_sha = greedy_run(reference, PROMPTS, steps=3)
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{arch}: logits differ at step {step}, max diff {(g - w).abs().max()}"
    assert got_sha == want_sha


# ---- llama.cpp's other spellings, the MTP block --------------------------------------------------

def _rewrite(path: str, out: str, arch: str) -> str:
    """The file with llama.cpp's other spellings: the full-attention layer's Q, K, V fused
    (attn_qkv, --fuse-qkv), each MoE layer's gate and up experts fused (ffn_gate_up_exps,
    --fuse-gate-up-exps), Qwen3-Next's linear attn_qkv + attn_gate as the legacy grouped ssm_in;
    and an MTP block after the last layer (nextn_predict_layers 1), a copy of layer 3."""
    reader = _Reader(path)
    name = GGUF_ARCHS[arch]
    writer = gguf.GGUFWriter(out, name)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == f"{name}.block_count":
            value += 1
        elif key == f"{name}.attention.recurrent_layers":
            value = value + [False]
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub)
    writer.add_uint32(f"{name}.nextn_predict_layers", 1)
    data = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    q, k, v = (data.pop(f"blk.3.attn_{p}.weight") for p in "qkv")
    data["blk.3.attn_qkv.weight"] = (np.concatenate([q[0], k[0], v[0]]), q[1])
    for i in range(4):
        if f"blk.{i}.ffn_gate_exps.weight" in data:
            gate, up = data.pop(f"blk.{i}.ffn_gate_exps.weight"), data.pop(f"blk.{i}.ffn_up_exps.weight")
            data[f"blk.{i}.ffn_gate_up_exps.weight"] = (np.concatenate([gate[0], up[0]], axis=1), gate[1])
    if arch == "qwen3_next":
        spec = LinearAttentionSpec(4, 8, 32, 32, 4, grouped=True)
        grouped = torch.argsort(_qkvz_order(spec)).numpy()
        qkv, z = data.pop("blk.0.attn_qkv.weight"), data.pop("blk.0.attn_gate.weight")
        data["blk.0.ssm_in.weight"] = (np.concatenate([qkv[0], z[0]])[grouped], qkv[1])
    for tensor in [t for t in data if t.startswith("blk.3.")]:
        data[tensor.replace("blk.3.", "blk.4.")] = data[tensor]
    data["blk.4.nextn.eh_proj.weight"] = (np.zeros((64, 128), np.float32), gguf.GGMLQuantizationType.F32)
    for tensor, (array, kind) in data.items():
        quantized = kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        writer.add_tensor(tensor, array, raw_dtype=kind if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_fused_spellings_and_an_mtp_block_read_the_same(q8, q8_loaded, tmp_path):
    arch, _, path = q8
    want = q8_loaded[0]
    got = load_blocks(_rewrite(path, str(tmp_path / "fused.gguf"), arch))
    assert got.config == want.config and got.tensors.keys() == want.tensors.keys()
    for name, tensor in got.tensors.items():
        wanted = want.tensors[name]
        if isinstance(tensor, StoredColumns):
            same = torch.equal(tensor.inputs, wanted.inputs) and _same_blocks(tensor.stored, wanted.stored)
        else:
            same = _same_blocks(tensor, wanted) if isinstance(tensor, QuantWeight) else torch.equal(tensor, wanted)
        assert same, name


# ---- tiled value heads in blocks ---------------------------------------------------------------

@pytest.mark.parametrize("ops_name", ["cpu_ops", "native_ops"])
@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q5_1"])
def test_tiled_columns_stay_as_stored(kind, ops_name):
    """ssm_out's columns in tiled value-head order (8 value heads of 32 over 4 key heads) stay in
    the file's order (StoredColumns): the matrix means the stored one's columns in grouped order,
    and its GEMM on grouped activations is the stored matrix's on the activations put in tiled
    order, bitwise, on each op set (the K-quants' super-blocks are not split)."""
    ops = importlib.import_module(f"tensorfold.backends.{ops_name}")
    torch.manual_seed(0)
    ids = _untiled(4, 8, 32)
    stored = quant_weight(gguf_blocks(torch.randn(48, 256), kind).reshape(-1), QTYPES[kind], (48, 256))
    grouped = _take_columns(stored, ids)
    assert isinstance(grouped, StoredColumns) and grouped.shape == (48, 256)
    assert torch.equal(grouped.dequantize(), stored.dequantize()[:, ids])
    x = torch.randn(5, 256)
    tiled_x = torch.empty_like(x)
    tiled_x[:, ids] = x
    assert torch.equal(ops.Linear.of(grouped)(x), quant_gemm.linear(tiled_x, stored))


@pytest.mark.parametrize("kind", ["q4_0", "q4_k", "q6_k"])
def test_tiled_columns_stay_as_stored_on_mlx(kind):
    """The same on the mlx op set (MLXLinear takes its input's columns in the stored order)."""
    pytest.importorskip("mlx.core")
    from tensorfold.mlx.ops import MLXLinear, from_torch, to_torch
    torch.manual_seed(1)
    ids = _untiled(4, 8, 32)
    stored = quant_weight(gguf_blocks(torch.randn(24, 256), kind).reshape(-1), QTYPES[kind], (24, 256))
    x = torch.randn(3, 256)
    tiled_x = torch.empty_like(x)
    tiled_x[:, ids] = x
    got = to_torch(MLXLinear.of(_take_columns(stored, ids))(from_torch(x)))
    assert torch.equal(got, quant_gemm.linear(tiled_x, stored))


# ---- the command line, and what is not served ---------------------------------------------------

def test_the_command_line_writes_a_hybrid_gguf(tmp_path, smollm2_tokenizer):
    """tools/tiny_checkpoint.py OUT --arch qwen3_next --gguf q4_0 (in process: the tokenizer
    conversion and the default model's fields are cached): the sizes a GGUF needs, every matrix q4_0."""
    path = main([str(tmp_path / "next"), "--arch", "qwen3_next", "--gguf", "q4_0"])
    ckpt = load_blocks(path)
    assert (ckpt.config["linear_key_head_dim"], ckpt.config["linear_value_head_dim"]) == (32, 32)
    kinds = {t.kind for t in ckpt.tensors.values() if isinstance(t, QuantWeight)}
    assert kinds == {"q4_0"} and ckpt.architecture == "Qwen3NextForCausalLM"



def test_an_architecture_not_served_is_refused_with_the_served_ones(tmp_path):
    path = str(tmp_path / "moe.gguf")
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError) as error:
        load_gguf(path)
    message = str(error.value)
    assert "unsupported architecture 'qwen3moe'" in message
    assert "supported: " + ", ".join(ARCHITECTURES) in message
    assert all(a in message for a in ("llama", "qwen3", "qwen35", "qwen35moe", "qwen3next"))
