"""Nemotron-H (nemotron_h) against transformers, and exact.

A tiny random checkpoint saved by transformers (tools/tiny_checkpoint.py) with every layer kind
(pattern M*EM-E: Mamba2, attention without rope, MoE, Mamba2, relu^2 MLP, MoE) and every option
the real checkpoints turn on (grouped B/C, a conv bias, sigmoid routing with a correction bias over
expert groups, a scaling factor, a shared expert, latent projections), in the Hub's layout
(backbone., experts one by one, hybrid_override_pattern), with a seed whose greedy tokens and
routes no float rounding can flip:
- prefill logits (three seeds, one in transformers' own layout: model., stacked experts,
  layers_block_type; one without latent projections) and batched paged decode within float32
  tolerance of transformers in float64, greedy 32 tokens equal, the startup probes pass;
- chunked prefill (chunks of 1, 3, 16, 64, 512) == token by token, bitwise, beside another
  sequence: logits, K/V and the Mamba2 states;
- over a real loopback server: drafted == serial, concurrent == solo, a cached prefix == fresh, a
  preempted reply == its uninterrupted run;
- the routing against transformers' router, the cache kinds counted, unknown layer kinds and
  missing tensors as startup errors naming them, MTP tensors skipped with a log line.
"""
import json
import logging
import os

import pytest
import torch

import family_cases as cases
from tensorfold.backends import backend_ops, cpu_ops
from tensorfold.kernels.moe import route_sigmoid
from tensorfold.models.cache import Mamba2State, PagedKV
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model
from tensorfold.models.mamba2 import Mamba2
from tensorfold.models.nemotron_h import NemotronMoE, ReluSquaredMLP, layer_specs
from tools.tiny_checkpoint import build_tiny_model, family_tokenizer, make_tiny_checkpoint, well_separated_seed

ATOL = 1e-3  # logits up to ~10; this forward is within ~3e-5 of transformers in float64
BLOCK = cases.BLOCK
EAGER = dict(experts_implementation="eager")  # transformers' grouped_mm experts take no float64


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory, smollm2_tokenizer):
    seed = well_separated_seed("nemotron_h", smollm2_tokenizer)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("nemotron_h")), "nemotron_h", seed=seed,
                                tokenizer=smollm2_tokenizer)


def _model(path, ops="cpu"):
    return build_model(load_hf_dir(path), torch.float32, cpu_ops if ops == "torch" else backend_ops(ops))


@pytest.fixture(scope="module")
def hf_model64(nemotron):
    return cases.hf_model(nemotron, torch.float64, **EAGER)


def test_the_tiny_checkpoint_has_every_layer_kind(nemotron):
    with open(os.path.join(nemotron, "config.json")) as f:
        config = json.load(f)
    assert config["hybrid_override_pattern"] == "M*EM-E" and "layers_block_type" not in config
    model = _model(nemotron)
    kinds = [(type(layer.mixer).__name__, type(layer.ffn).__name__) for layer in model.layers]
    assert kinds == [("Mamba2", "NoneType"), ("Attention", "NoneType"), ("NoneType", "NemotronMoE"),
                     ("Mamba2", "NoneType"), ("NoneType", "ReluSquaredMLP"), ("NoneType", "NemotronMoE")]
    assert [type(spec).__name__ for spec in model.cache_specs()] == ["Mamba2State", "PagedKV", "NoneType",
                                                                   "Mamba2State", "NoneType", "NoneType"]
    assert model.specs[1].mixer.rope is None and model.layers[1].mixer.rope is None
    moe = model.layers[2].ffn
    assert (moe.spec.n_group, moe.spec.topk_group, moe.spec.latent_size, moe.spec.routed_scaling_factor) == (2, 1, 32,
                                                                                                           2.5)
    assert moe.bias.abs().min() > 0 and model.layers[0].mixer.params.conv_bias is not None
    assert isinstance(model.layers[4].ffn, ReluSquaredMLP) and isinstance(moe, NemotronMoE)
    assert isinstance(model.layers[3].mixer, Mamba2) and model.layers[0].mixer.spec.n_groups == 2


def test_prefill_logits_match_transformers(nemotron, hf_model64):
    cases.check_prefill_logits(_model(nemotron), hf_model64, ATOL)


@pytest.mark.parametrize("seed, layout", [(1, "transformers"), (2, "hub")])
def test_prefill_logits_match_transformers_other_seeds(seed, layout, tmp_path, smollm2_tokenizer):
    """Seed 1 in transformers' own layout (model., stacked experts, layers_block_type), seed 2 in the
    Hub's without latent projections (the experts at the hidden width)."""
    if layout == "hub":
        path = make_tiny_checkpoint(str(tmp_path), "nemotron_h", seed=seed, tokenizer=smollm2_tokenizer,
                                    moe_latent_size=None)
    else:
        tokenizer = family_tokenizer("nemotron_h", smollm2_tokenizer)
        build_tiny_model("nemotron_h", seed, tokenizer).save_pretrained(str(tmp_path), save_original_format=False)
        tokenizer.save_pretrained(str(tmp_path))
        path = str(tmp_path)
        with open(os.path.join(path, "config.json")) as f:
            assert "layers_block_type" in json.load(f)
    cases.check_prefill_logits(_model(path), cases.hf_model(path, torch.float64, **EAGER), ATOL, seed=seed, length=50)


def test_batched_paged_decode_matches_transformers(nemotron, hf_model64):
    cases.check_batched_paged_decode(_model(nemotron), hf_model64, ATOL, steps=3)


def test_greedy_32_tokens_equal_transformers(nemotron):
    cases.check_greedy_32_tokens(nemotron, cases.hf_model(nemotron, torch.float32, **EAGER))


# ---- chunked prefill == token by token, bitwise ------------------------------------------------

PROMPT_LEN = 100  # over three blocks


def test_chunked_prefill_is_bitwise_token_by_token(nemotron):
    cases.check_chunked_prefill(_model(nemotron), PROMPT_LEN, chunks=(3, 16, 64, 512))


def test_the_op_sets_agree(nemotron):
    cases.check_op_sets_agree(lambda ops: _model(nemotron, ops))


# ---- over HTTP ---------------------------------------------------------------------------------

def test_drafted_equals_serial(nemotron):
    cases.check_drafted_equals_serial(nemotron, [dict(temperature=0.0), dict(temperature=1.1, seed=4, top_p=0.9)],
                                      max_tokens=50)


@pytest.fixture(scope="module")
def solo(nemotron):
    yield from cases.solo_replies(nemotron)


def test_concurrent_replies_equal_their_solo_runs(nemotron, solo):
    cases.check_concurrent_equals_solo(nemotron, solo)


def test_cached_prefix_reply_equals_the_fresh_one(nemotron, solo):
    cases.check_cached_equals_fresh(nemotron, solo, whole_blocks=True)  # Mamba2 resumes at block starts


def test_preempted_reply_equals_its_uninterrupted_run(nemotron, solo):
    cases.check_preempted_equals_uninterrupted(nemotron, solo)


# ---- routing, cache kinds, options, tensors ----------------------------------------------------

@pytest.mark.parametrize("n_group, topk_group, top_k", [(1, 1, 2), (4, 2, 3), (2, 1, 2)])
def test_routing_equals_transformers_router(n_group, topk_group, top_k):
    """kernels/moe.route_sigmoid against transformers' NemotronHTopkRouter on the same logits: the
    same experts and weights (within float32 rounding), and a row's choice is its own."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    config = NemotronHConfig(hidden_size=16, n_routed_experts=16, num_experts_per_tok=top_k, n_group=n_group,
                             topk_group=topk_group, routed_scaling_factor=2.5, layers_block_type=["moe"])
    router = NemotronHTopkRouter(config)
    torch.manual_seed(n_group * 10 + top_k)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.2)
    x = torch.randn(64, 16)
    logits, hf_weights, hf_index = router(x)
    index, weights = route_sigmoid(logits, router.e_score_correction_bias, top_k, n_group, topk_group, True, 2.5)
    order = hf_index.argsort(dim=-1)
    assert torch.equal(index.sort(dim=-1).values, hf_index.gather(1, order))
    torch.testing.assert_close(weights.gather(1, index.argsort(dim=-1)), hf_weights.gather(1, order),
                               atol=1e-6, rtol=1e-6)
    alone = route_sigmoid(logits[5:6], router.e_score_correction_bias, top_k, n_group, topk_group, True, 2.5)
    assert torch.equal(alone[0][0], index[5]) and torch.equal(alone[1][0], weights[5])


def test_the_engine_counts_the_mamba2_states(nemotron):
    """Memory sizing, /health's cache line and the scheduler's resume rule see the Mamba2 states."""
    from tensorfold.engine.engine import Engine, EngineConfig

    engine = Engine(nemotron, EngineConfig(probe=True, kv_cache_gib=0.01, drafting=False))
    assert engine.exact, engine.probe_failures
    assert "2 x Mamba2State" in engine.info.cache and "1 x PagedKV" in engine.info.cache
    assert engine.book.resume_at_blocks
    specs = engine.backend.model.cache_specs()
    mamba = Mamba2State(128, 4, 8, 16, 8)  # conv_dim 64 + 2 * 2 * 16, 4 taps, 8 heads, state 16, head_dim 8
    assert specs[0] == mamba and mamba.bytes_per_block(torch.float32, BLOCK) == 4 * (3 * 128 + 8 * 16 * 8)
    per_block = sum(s.bytes_per_block(torch.float32, BLOCK, True) for s in specs if s is not None)
    assert per_block == 2 * mamba.bytes_per_block(torch.float32, BLOCK) + PagedKV(2, 16).bytes_per_block(
        torch.float32, BLOCK, True)
    assert engine.info.cache_bytes >= engine.info.num_blocks * per_block


def _args(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    return ModelArgs.from_hf(config)


@pytest.mark.parametrize("change, named", [
    (dict(hybrid_override_pattern="M*X-E-", num_hidden_layers=6), "'X'"),
    (dict(hybrid_override_pattern=None, layers_block_type=["mamba", "sliding_attention"], num_hidden_layers=2),
     "sliding_attention"),
    (dict(mlp_hidden_act="gelu"), "mlp_hidden_act"),
    (dict(num_hidden_layers=9), "num_hidden_layers"),
])
def test_unknown_layer_kinds_and_options_are_startup_errors_naming_them(nemotron, change, named):
    with pytest.raises(CheckpointError, match=named):
        layer_specs(_args(nemotron, **change))


def test_legacy_layer_names_are_read(nemotron):
    specs = layer_specs(_args(nemotron, hybrid_override_pattern=None, num_hidden_layers=None,
                              layers_block_type=["mamba", "attention", "moe", "mamba", "mlp", "moe"]))
    assert specs == layer_specs(_args(nemotron))


def test_a_missing_tensor_is_a_startup_error_naming_it(nemotron):
    ckpt = load_hf_dir(nemotron)
    del ckpt.tensors["backbone.layers.3.mixer.D"]
    with pytest.raises(CheckpointError, match="model.layers.3.mixer.D"):
        build_model(ckpt, torch.float32, cpu_ops)


def test_mtp_layers_are_skipped_with_a_log_line(nemotron, caplog):
    ckpt = load_hf_dir(nemotron)
    ckpt.tensors["mtp.layers.0.norm.weight"] = torch.ones(64)
    ckpt.tensors["mtp.layers.0.mixer.q_proj.weight"] = torch.ones(64, 64)
    with caplog.at_level(logging.INFO, logger="tensorfold.models"):
        model = build_model(ckpt, torch.float32, cpu_ops)
    assert len(model.layers) == 6
    assert any("skipped 2 tensors under mtp" in r.getMessage() for r in caplog.records)


def test_the_startup_probes_check_the_mamba2_scan_and_the_moe(nemotron):
    """The probes run the loaded Mamba2 layer's scan in chunks and the MoE's rows alone and in
    batches: they pass on the served ops and catch a scan whose bits depend on the chunking."""
    import types

    from tensorfold.backends.probes import probe_ops

    ops = backend_ops("cpu")
    model = _model(nemotron)
    assert probe_ops(model, ops) == []

    def chunk_dependent(xbc, dt, state, batch, params):  # what a chunked SSD form does: the bits move with the chunk
        return ops.mamba2(xbc, dt, state, batch, params) * (1 + 2.0 ** -20 * xbc.shape[0])

    broken = types.SimpleNamespace(**{n: getattr(ops, n) for n in dir(ops) if not n.startswith("__")})
    broken.mamba2 = chunk_dependent
    assert any(f.startswith("mamba2: chunks") for f in probe_ops(model, broken))
