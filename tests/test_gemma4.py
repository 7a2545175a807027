"""Gemma 4 (gemma4, gemma4_text, and the MoE variant) against transformers, and exact.

Tiny random checkpoints saved by transformers (tools/tiny_checkpoint.py): gemma4 with every option
the real checkpoints turn on (sliding window 16, shorter than the prompts, so it slides; global
layers with their own head size, KV heads and proportional rope; the last two layers sharing K/V
with a double-wide MLP; values that are the keys on the global layers; per-layer inputs; soft-capped
logits), gemma4_text with the other settings (v_proj everywhere, no sharing, no per-layer inputs),
and gemma4_moe, the 26B-A4B layout (8 experts, 2 per token, beside every layer's MLP; values that
are the keys, no per-layer inputs), each with a seed whose greedy tokens (and routes) no float
rounding can flip:
- prefill logits (three seeds of gemma4) and batched paged decode within float32 tolerance of
  transformers in float64, greedy 32 tokens equal, the startup probes pass;
- chunked prefill (chunks of 1, 3, 16, 64) == token by token, bitwise, beside another sequence;
- over a real loopback server: drafted == serial, concurrent == solo, a cached prefix == fresh, a
  preempted reply == its uninterrupted run;
- global heads of 512 (the released checkpoints'): the native op set's logits and token_sha are the
  torch references' bit for bit, near transformers', greedy tokens equal; wider heads are refused;
- the new elementwise ops against float64, options not served and missing tensors as startup errors.
The MoE block's own checks (the fused block against its composition, batch invariance, the probes,
quantized and GGUF files) are in tests/test_gemma4_moe.py.
"""
import json
import os
import types

import pytest
import torch

import family_cases as cases
from test_native_backend import greedy_run
from tensorfold.backends import backend_ops, cpu_ops, native_problem
from tensorfold.kernels.reference import gelu_tanh_and_mul, softcap, tanh32
from tensorfold.models.cache import SharedKV
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.gemma4 import layer_specs
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model
from tools.tiny_checkpoint import GEMMA4_ARCHS, make_tiny_checkpoint, well_separated_seed

ATOL = 1e-3  # logits up to ~10; this forward is within ~3e-4 of transformers in float64
BLOCK = cases.BLOCK
EAGER = dict(experts_implementation="eager")  # transformers' grouped_mm experts take no float64


@pytest.fixture(scope="module", params=GEMMA4_ARCHS)
def gemma(request, tmp_path_factory, smollm2_tokenizer):
    arch = request.param
    seed = well_separated_seed(arch, smollm2_tokenizer)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, seed=seed, tokenizer=smollm2_tokenizer)


@pytest.fixture(scope="module")
def full_gemma(tmp_path_factory, smollm2_tokenizer):
    """gemma4, every option on: the HTTP checks run on it."""
    seed = well_separated_seed("gemma4", smollm2_tokenizer)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("gemma4_http")), "gemma4", seed=seed,
                                tokenizer=smollm2_tokenizer)


def _model(path, ops="cpu"):
    return build_model(load_hf_dir(path), torch.float32, cpu_ops if ops == "torch" else backend_ops(ops))


@pytest.fixture(scope="module")
def hf_model64(gemma):
    return cases.hf_model(gemma, torch.float64, **EAGER)


def test_the_tiny_checkpoints_turn_their_options_on(gemma):
    model = _model(gemma)
    specs = [spec.mixer for spec in model.specs]
    windows = {s.window for s in specs}
    assert windows == {16, None} and {(s.head_dim, s.rope.rope_type) for s in specs} == {(16, "default"),
                                                                                       (32, "proportional")}
    kinds = [type(layer.cache_spec) for layer in model.layers]
    experts = [layer.moe for layer in model.layers]
    if "gemma4_moe" in gemma:  # every layer: the MLP and 8 experts of 32, 2 per token, GeGLU
        assert SharedKV not in kinds and model.per_layer_inputs is None and specs[2].values_are_keys
        assert all(type(e).__name__ == "Gemma4MoE" for e in experts)
        assert {(s.moe.num_experts, s.moe.top_k, s.moe.intermediate_size, s.moe.activation) for s in model.specs} == {
            (8, 2, 32, "gelu_tanh")}
        return
    assert experts == [None] * len(model.layers)
    if "gemma4_text" in gemma:
        assert SharedKV not in kinds and model.per_layer_inputs is None and not any(s.values_are_keys for s in specs)
    else:
        assert kinds[-2:] == [SharedKV, SharedKV] and [s.kv_source for s in specs[-2:]] == [3, 2]
        assert model.per_layer_inputs is not None and specs[2].values_are_keys and specs[2].num_kv_heads == 1
        assert model.specs[-1].ffn.intermediate_size == 2 * model.specs[0].ffn.intermediate_size
    assert model.softcap == 30.0


def test_prefill_logits_match_transformers(gemma, hf_model64):
    cases.check_prefill_logits(_model(gemma), hf_model64, ATOL)


@pytest.mark.parametrize("seed", [1, 2])
def test_prefill_logits_match_transformers_other_seeds(seed, tmp_path, smollm2_tokenizer):
    path = make_tiny_checkpoint(str(tmp_path), "gemma4", seed=seed, tokenizer=smollm2_tokenizer)
    cases.check_prefill_logits(_model(path), cases.hf_model(path, torch.float64, **EAGER), ATOL, seed=seed,
                               length=50)


def test_batched_paged_decode_matches_transformers(gemma, hf_model64):
    """Past the window: the sliding layers' rows see only its last 16 keys."""
    cases.check_batched_paged_decode(_model(gemma), hf_model64, ATOL, steps=3)


def test_greedy_32_tokens_equal_transformers(gemma):
    cases.check_greedy_32_tokens(gemma, cases.hf_model(gemma, torch.float32, **EAGER))


# ---- chunked prefill == token by token, bitwise ------------------------------------------------

PROMPT_LEN = 100  # past the window (16), over four blocks


def test_chunked_prefill_is_bitwise_token_by_token(gemma):
    cases.check_chunked_prefill(_model(gemma), PROMPT_LEN, chunks=(3, 16, 64))


def test_the_op_sets_agree(gemma):
    cases.check_op_sets_agree(lambda ops: _model(gemma, ops))


# ---- over HTTP ---------------------------------------------------------------------------------

def test_drafted_equals_serial(full_gemma):
    cases.check_drafted_equals_serial(full_gemma, [dict(temperature=0.0), dict(temperature=1.1, seed=4, top_p=0.9)],
                                      max_tokens=50)


@pytest.fixture(scope="module")
def solo(full_gemma):
    yield from cases.solo_replies(full_gemma)


def test_concurrent_replies_equal_their_solo_runs(full_gemma, solo):
    cases.check_concurrent_equals_solo(full_gemma, solo)


def test_cached_prefix_reply_equals_the_fresh_one(full_gemma, solo):
    cases.check_cached_equals_fresh(full_gemma, solo, whole_blocks=False)  # the sliding and shared layers too


def test_preempted_reply_equals_its_uninterrupted_run(full_gemma, solo):
    cases.check_preempted_equals_uninterrupted(full_gemma, solo)


# ---- ops, options, tensors ---------------------------------------------------------------------

def test_tanh_gelu_and_softcap_are_close_to_float64():
    x = torch.cat([torch.linspace(-12, 12, 200_001), torch.logspace(-30, 1, 2_000), -torch.logspace(-30, 1, 2_000)])
    want = torch.tanh(x.double())
    ulp = (torch.nextafter(want.float(), torch.tensor(float("inf"))).double() - want.float().double()).abs()
    assert ((tanh32(x).double() - want).abs() / ulp).max() <= 2
    gelu = torch.nn.functional.gelu(x.double(), approximate="tanh")
    up = torch.full_like(x, 1.5)
    torch.testing.assert_close(gelu_tanh_and_mul(x, up).double(), gelu * 1.5, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(softcap(x * 10, 30.0).double(), 30 * torch.tanh(x.double() * 10 / 30), atol=1e-5,
                               rtol=1e-6)
    rows = torch.randn(13, 300)  # elementwise: a row's bits are its own
    assert torch.equal(softcap(rows, 30.0)[5], softcap(rows[5:6], 30.0)[0])
    assert torch.equal(gelu_tanh_and_mul(rows, rows)[7], gelu_tanh_and_mul(rows[7:8], rows[7:8])[0])


def _args(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    text.update(changes)
    return ModelArgs.from_hf(config)


@pytest.mark.parametrize("change, named", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=None, moe_intermediate_size=32), "top_k_experts"),
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=5, moe_intermediate_size=32), "top_k_experts 5"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(hidden_activation="relu"), "hidden_activation"),
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 3), "chunked_attention"),
    (dict(per_layer_config={"2": {"head_dim": 32, "rope_theta": 5.0}}), "rope_theta"),
    (dict(num_kv_shared_layers=6), "num_kv_shared_layers"),
    (dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "rope_theta": 1e6}}), "dynamic"),
])
def test_options_not_served_are_startup_errors_naming_them(gemma, change, named):
    with pytest.raises(CheckpointError, match=named):
        layer_specs(_args(gemma, **change))


def test_a_missing_tensor_is_a_startup_error_naming_it(gemma):
    ckpt = load_hf_dir(gemma)
    name = next(n for n in ckpt.tensors if n.endswith("layers.3.layer_scalar"))
    del ckpt.tensors[name]
    with pytest.raises(CheckpointError, match="layers.3.layer_scalar"):
        build_model(ckpt, torch.float32, cpu_ops)


@pytest.fixture(scope="module")
def wide_gemma(tmp_path_factory, smollm2_tokenizer):
    """gemma4 with global heads of 512, as the released checkpoints (E2B, E4B) have them."""
    seed = well_separated_seed("gemma4", smollm2_tokenizer, global_head_dim=512)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("gemma4_wide")), "gemma4", seed=seed,
                                tokenizer=smollm2_tokenizer, global_head_dim=512)


def attention_references(native):
    """The native op set with the ops Gemma 4's attention makes (rms_norm_rope for q and k, the V
    norm, the cache write, the attention) swapped for their torch references: the oracle of the
    wide-head kernels inside the model (the native GEMMs are their references' bits already,
    test_native_backend, and the reference GEMM would make this slow)."""
    ops = {name: getattr(native, name) for name in dir(native) if not name.startswith("_")}
    ops.update({name: getattr(cpu_ops, name) for name in ("rms_norm", "rms_norm_rope", "write_kv", "attention")},
               NAME="native, attention on the torch references")
    return types.SimpleNamespace(**ops)


@pytest.mark.skipif(native_problem() is not None, reason=str(native_problem()))
def test_global_heads_of_512_serve_on_the_native_op_set(wide_gemma):
    """The released checkpoints' global heads are 512 wide (paged_attention.MAX_HEAD_DIM, the
    widest whose q.k stays exact): the native kernels serve them with the torch references' bits
    (every forward's logits and the token_sha, with a float32 and a bfloat16 cache), within
    tolerance of transformers in float64, and an engine on the native op set starts with its
    probes passing and decodes transformers' greedy 32 tokens."""
    native = backend_ops("cpu")
    assert native.NAME.startswith("native-")  # what the engine below serves on too
    model = build_model(load_hf_dir(wide_gemma), torch.float32, native)
    assert {s.mixer.head_dim for s in model.specs} == {16, 512}
    oracle = build_model(load_hf_dir(wide_gemma), torch.float32, attention_references(native))
    prompts = [list(range(100, 140)), [7, 9, 11]]  # 40 tokens: past the window (16)
    for kv_dtype in (torch.float32, torch.bfloat16):
        got, got_sha = greedy_run(model, prompts, steps=4, kv_dtype=kv_dtype)
        want, want_sha = greedy_run(oracle, prompts, steps=4, kv_dtype=kv_dtype)
        assert all(torch.equal(g, w) for g, w in zip(got, want)) and got_sha == want_sha, kv_dtype
    cases.check_prefill_logits(model, cases.hf_model(wide_gemma, torch.float64), ATOL)
    cases.check_greedy_32_tokens(wide_gemma, cases.hf_model(wide_gemma, torch.float32))


def test_heads_wider_than_the_exact_bound_are_a_startup_error(tmp_path, smollm2_tokenizer):
    """Past 512 dims q.k could leave float64's exact range: the load says so, naming the width,
    instead of failing in the first round."""
    from tensorfold.engine.engine import Engine, EngineConfig
    model = make_tiny_checkpoint(str(tmp_path), "gemma4", tokenizer=smollm2_tokenizer, global_head_dim=1024)
    with pytest.raises(CheckpointError, match="attention heads of 1024 dims: the .* kernels take at most 512"):
        Engine(model, EngineConfig())
