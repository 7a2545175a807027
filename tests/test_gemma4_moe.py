"""Gemma 4's mixture of experts (the 26B-A4B layout: enable_moe_block), exact.

tests/test_gemma4.py runs the family's checks on the tiny gemma4_moe (prefill logits and batched
decode within tolerance of transformers, its greedy 32 tokens with the startup probes passing,
chunked prefill == token by token, the native and torch op sets' greedy tokens equal). Here, the
block itself and its files:
- the router as transformers' Gemma4TextRouter computes it: the same experts, the weights close;
- the native block (one _cpu.MoEBlock call: the router on Gemma's router input, the per-expert
  scale, GeGLU experts) == its composition on the torch references, bitwise, in float32 and
  bfloat16, dense and in blocks; each row alone gives its bits in the batch, whatever other rows
  chose;
- the model: a sequence's logits beside others == alone, bitwise;
- the startup probes run on the MoE block (one whose rows depend on the batch is caught);
- --quantize q8_0 (experts in blocks): every forward's logits and the token_sha equal on the native
  and torch op sets, and the engine's replies too;
- GGUF in llama.cpp's gemma4 layout (tools/gemma4_gguf.py: gguf's names for the experts, the
  converter's ffn_gate_inp.scale / ffn_down_exps.scale for the router's scales): the file's layout;
  float32 == the directory, q8_0 (the experts read in their blocks) == the directory quantized at
  load, bitwise, and the engine's token_sha on both op sets;
- missing tensors are startup errors naming them.
"""
import types

import gguf
import pytest
import torch

import family_cases as cases
from test_native_backend import greedy_run, reference_ops
from test_quantized_model import cpu_op_set
from tensorfold.api.replies import token_sha
from tensorfold.backends import backend_ops, cpu_ops, native_problem
from tensorfold.backends.probes import probe_ops
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.gemma4_moe import Gemma4MoE
from tensorfold.models.gguf_file import _Reader, load_gguf
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model, quantize_checkpoint
from tensorfold.models.moe import MoESpec
from tensorfold.models.quantize import quantize
from tensorfold.models.weights import WeightReader
from tensorfold.sampling.params import SamplingParams
from tools.gemma4_gguf import write_gemma4_gguf
from tools.tiny_checkpoint import make_tiny_checkpoint, well_separated_seed

pytestmark = pytest.mark.skipif(native_problem() is not None, reason=str(native_problem()))
PROMPTS = [list(range(100, 140)), [7, 9, 11], [5, 300, 5, 300, 8] * 4]  # the first past the window (16)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, smollm2_tokenizer):
    seed = well_separated_seed("gemma4_moe", smollm2_tokenizer)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("gemma4_moe")), "gemma4_moe", seed=seed,
                                tokenizer=smollm2_tokenizer)


# ---- the block ---------------------------------------------------------------------------------

def _block_tensors(spec: MoESpec, hidden: int, fmt: str, gen: torch.Generator) -> dict:
    """A Gemma 4 MoE block's tensors under a layer's names: the experts in `fmt` ("dense", "q8_0",
    "q4_0"), the router dense (routes with clear winners, some experts chosen by no row), random
    scales and norms."""
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    tensors = {"router.proj.weight": rand(spec.num_experts, hidden, scale=2.0),
               "router.scale": 1 + rand(hidden, scale=0.2),
               "router.per_expert_scale": 0.5 + torch.rand(spec.num_experts, generator=gen),
               "pre_feedforward_layernorm_2.weight": 1 + rand(hidden, scale=0.2),
               "post_feedforward_layernorm_2.weight": 1 + rand(hidden, scale=0.2)}
    for e in range(spec.num_experts):
        for proj, shape in (("gate", (spec.intermediate_size, hidden)), ("up", (spec.intermediate_size, hidden)),
                            ("down", (hidden, spec.intermediate_size))):
            w = rand(*shape, scale=shape[1] ** -0.5)
            tensors[f"experts.{e}.{proj}_proj.weight"] = w if fmt == "dense" else quantize(w, fmt)
    return tensors


def _block(tensors: dict, spec: MoESpec, dtype: torch.dtype, ops) -> Gemma4MoE:
    return Gemma4MoE(spec, WeightReader(tensors, dtype, CPU, ops), types.SimpleNamespace(norm_eps=1e-6))


SPEC = MoESpec(num_experts=16, top_k=4, intermediate_size=32, shared_intermediate_size=0, activation="gelu_tanh")


def test_the_router_is_transformers_router():
    """Gemma4TextRouter (norm without a weight, scale, hidden^-0.5, softmax, top k, renormalized,
    per-expert scale) and ours (top k logits, kernels/moe.route normalized, times the scale)."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

    gen = torch.Generator().manual_seed(11)
    tensors = _block_tensors(SPEC, 64, "dense", gen)
    config = Gemma4TextConfig(hidden_size=64, num_experts=16, top_k_experts=4, rms_norm_eps=1e-6)
    hf = Gemma4TextRouter(config).eval()
    with torch.no_grad():
        hf.proj.weight.copy_(tensors["router.proj.weight"])
        hf.scale.copy_(tensors["router.scale"])
        hf.per_expert_scale.copy_(tensors["router.per_expert_scale"])
        h = torch.randn(50, 64, generator=gen) * 3
        _, want_weights, want_experts = hf(h)
    for ops in (reference_ops(), backend_ops("cpu")):
        block = _block(tensors, SPEC, torch.float32, ops)
        experts, weights = ops.route(block.router(block.router_input(h)).float(), SPEC.top_k, True)
        weights = weights * block.expert_scale[experts]
        assert torch.equal(experts, want_experts)
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "dense"), (torch.bfloat16, "dense"), (torch.float32, "q8_0"),
                                       (torch.bfloat16, "q4_0")], ids=["f32", "bf16", "q8_0", "bf16-q4_0"])
def test_the_native_block_equals_its_composition(dtype, fmt):
    """One _cpu.MoEBlock call == the block op by op on the torch references (the fixed-order GEMM)
    and on the native ops; a row alone == the same row in a batch, where the other rows choose
    other experts (or the same ones)."""
    gen = torch.Generator().manual_seed(len(fmt) + (dtype == torch.bfloat16))
    tensors = _block_tensors(SPEC, 64, fmt, gen)
    native = _block(tensors, SPEC, dtype, backend_ops("cpu"))
    reference = _block(tensors, SPEC, dtype, reference_ops())
    assert native._fused is not None and reference._fused is None
    used = {}
    for rows in (1, 3, 37):
        h = (torch.randn(rows, 64, generator=gen) * 3).to(dtype)
        chosen = native.ops.route(native.router(native.router_input(h)).float(), SPEC.top_k, True)[0]
        used[rows] = len(set(chosen.flatten().tolist()))
        got = native.forward(h)
        assert got.dtype == dtype and got.shape == h.shape
        assert torch.equal(got, reference.forward(h)), f"{rows} rows: the native block != the torch references"
        x, routed_on = native.ops.rms_norm(h, native.pre_norm, 1e-6), native.router_input(h)
        assert torch.equal(native._fused(x, routed_on), native.compose(x, routed_on)), f"{rows} rows: != op by op"
        alone = torch.cat([native.forward(h[i:i + 1]) for i in range(rows)])
        assert torch.equal(got, alone), f"{rows} rows: a row alone differs from the batch"
    assert used[3] < SPEC.num_experts and used[37] < 37 * SPEC.top_k  # experts unused, and experts shared


# ---- the model ---------------------------------------------------------------------------------

def _model(path, ops, kind=None):
    ckpt = load_hf_dir(path)
    if kind is not None:
        quantize_checkpoint(ckpt, kind)
    return build_model(ckpt, torch.float32, ops)


def test_a_sequence_beside_others_equals_it_alone(moe_dir):
    model = _model(moe_dir, backend_ops("cpu"))
    together, together_sha = greedy_run(model, PROMPTS, steps=4)
    for s, prompt in enumerate(PROMPTS):
        alone, alone_sha = greedy_run(model, [prompt], steps=4)
        assert all(torch.equal(a[0], t[s]) for a, t in zip(alone, together)), f"sequence {s}"
        assert alone_sha[0] == together_sha[s]


def test_the_startup_probes_run_on_the_moe_block(moe_dir):
    model = _model(moe_dir, backend_ops("cpu"))
    assert probe_ops(model, model.ops) == []
    block = model.layers[0].moe
    exact = block.forward
    block.forward = lambda h: exact(h) + 1e-3 * h.shape[0]  # rows that depend on the batch's size
    assert any(f.startswith("moe") for f in probe_ops(model, model.ops))


def test_quantized_at_load_native_equals_torch_references(moe_dir):
    """--quantize q8_0: the MLPs', attention's and every expert's matrices in blocks (the router
    stays dense, as llama.cpp's quantizer keeps ffn_gate_inp): every forward's logits and the
    token_sha equal on the two op sets."""
    native = _model(moe_dir, backend_ops("cpu"), "q8_0")
    reference = _model(moe_dir, cpu_ops, "q8_0")
    block = native.layers[0].moe
    assert {e.gate_up.formats + e.down.formats for e in block.experts} == {("q8_0", "q8_0")}
    assert block.router.formats == ("float32",) and block._fused is not None
    got, got_sha = greedy_run(native, PROMPTS, steps=4)
    want, want_sha = greedy_run(reference, PROMPTS, steps=4)
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and got_sha == want_sha


REPLIES = [dict(temperature=0.0), dict(temperature=1.0, seed=7)]


def _engine_shas(model: str, **config) -> list[str]:
    engine = Engine(model, EngineConfig(kv_cache_gib=0.01, drafting=False, context=512, **config))
    ids = list(range(200, 240))  # longer than the window
    return [token_sha(engine.generate(ids, SamplingParams(max_tokens=16, ignore_eos=True, **p)).token_ids)
            for p in REPLIES]


def test_the_engine_replies_alike_on_both_op_sets_quantized(moe_dir):
    native = _engine_shas(moe_dir, quantize="q8_0")  # probes on: they pass
    with cpu_op_set("torch"):
        torch_refs = _engine_shas(moe_dir, quantize="q8_0", probe=False)
    assert native == torch_refs


# ---- GGUF --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(moe_dir):
    """(the directory, its float32 GGUF, its q8_0 GGUF)."""
    return moe_dir, write_gemma4_gguf(moe_dir, "f32"), write_gemma4_gguf(moe_dir, "q8_0")


def test_the_file_is_in_llama_cpp_layout(files):
    reader = _Reader(files[2])
    meta = {name: field.contents() for name, field in reader.fields.items()}
    assert (meta["gemma4.expert_count"], meta["gemma4.expert_used_count"],
            meta["gemma4.expert_feed_forward_length"]) == (8, 2, 32)
    types_ = {t.name: (t.tensor_type, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}
    q8_0, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    names = gguf.TENSOR_NAMES
    assert {names[t].format(bid=3) for t in (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_UP_EXP,
                                             gguf.MODEL_TENSOR.FFN_DOWN_EXP)} == {
        "blk.3.ffn_gate_inp", "blk.3.ffn_gate_up_exps", "blk.3.ffn_down_exps"}  # gguf's gemma4 names
    assert types_["blk.3.ffn_gate_up_exps.weight"] == (q8_0, (8, 64, 64))
    assert types_["blk.3.ffn_down_exps.weight"] == (q8_0, (8, 64, 32))
    assert types_["blk.3.ffn_gate_inp.weight"] == (f32, (8, 64))
    assert types_["blk.3.ffn_gate_inp.scale"] == (f32, (64,)) and types_["blk.3.ffn_down_exps.scale"] == (f32, (8,))
    for norm in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2", "ffn_norm", "post_ffw_norm"):
        assert types_[f"blk.3.{norm}.weight"] == (f32, (64,))
    assert types_["blk.3.ffn_gate.weight"] == (q8_0, (128, 64))  # the dense MLP beside the experts


def _prefill_and_decode(model):
    cache, tables = model.allocate_cache(8, 32, torch.float32), [[0, 1], [5]]
    seqs = PROMPTS[0] + [3, 4, 5, 6], PROMPTS[1] + [8, 9, 10, 11]
    got = [model.forward(cases._rows(tables, [(0, seqs[0][:30], 0, True), (1, seqs[1][:3], 0, True)]), cache)]
    for step in range(4):
        got.append(model.forward(cases._rows(tables, [(0, seqs[0][30 + step:31 + step], 30 + step, True),
                                                      (1, seqs[1][3 + step:4 + step], 3 + step, True)]), cache))
    return got


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_the_file_loads_as_the_directory_and_gives_its_logits(files, kind):
    directory, f32_path, q8_path = files
    ops = backend_ops("cpu")
    served = build_model(load_gguf(f32_path if kind == "f32" else q8_path, keep_quantized=True), torch.float32, ops)
    dense = _model(directory, ops, None if kind == "f32" else "q8_0")
    assert served.specs == dense.specs and served.weight_formats() == dense.weight_formats()
    assert served.layers[0].moe._fused is not None
    assert all(torch.equal(a, b) for a, b in zip(_prefill_and_decode(served), _prefill_and_decode(dense)))


def test_the_engine_serves_the_file_as_the_quantized_directory(files):
    directory, _, q8_path = files
    want = _engine_shas(directory, quantize="q8_0", probe=False)
    assert _engine_shas(q8_path) == want  # probes on
    with cpu_op_set("torch"):
        assert _engine_shas(q8_path, probe=False) == want


def test_a_missing_tensor_is_named(files, tmp_path):
    directory = files[0]
    ckpt = load_hf_dir(directory)
    name = next(n for n in ckpt.tensors if n.endswith("layers.2.router.per_expert_scale"))
    del ckpt.tensors[name]
    with pytest.raises(CheckpointError, match=r"layers\.2\.router\.per_expert_scale"):
        build_model(ckpt, torch.float32, cpu_ops)
    cut = cases.rewrite_gguf(files[2], str(tmp_path / "cut.gguf"), cases.without("blk.4.ffn_gate_inp.scale"))
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.4\.router\.scale"):
        load_gguf(cut, keep_quantized=True)
