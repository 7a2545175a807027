"""GLM-5 (glm_moe_dsa) against transformers, and exact.

A tiny random checkpoint saved by transformers (tools/tiny_checkpoint.GLM_TINY) with every option
the real checkpoints turn on: q_lora, the latent cache, a DSA indexer whose index_topk (12) is
smaller than the prompts (so it selects) and a layer that reuses another's choice, a dense first
layer, then MoE layers with noaux_tc routing over expert groups and a shared expert. Its seed is
one whose greedy tokens, expert routes and indexer choices no float rounding can flip (gaps
asserted, SelectionGaps); prefill logits are checked on three seeds.
- prefill logits and batched paged decode within float32 tolerance of transformers in float64,
  greedy 32 tokens equal, the startup probes pass;
- chunked prefill (chunks of 1, 3, 16, 64, 512) == token by token, bitwise, cache included;
- the op sets give the same bits; over a real loopback server: drafted == serial, concurrent ==
  solo, a cached prefix == fresh, a preempted reply == its uninterrupted run;
- the exact kernels (latent attention, the indexer's choice, layer_norm) on their own;
- unknown kinds and missing tensors as startup errors, next-n layers skipped with a log line.
"""
import json
import logging
import os

import pytest
import torch

import family_cases as cases
from test_models import _rows
from test_native_backend import reference_ops
from tensorfold.backends import backend_ops, cpu_ops
from tensorfold.backends.probes import probe_ops
from tensorfold.kernels import latent_attention as kernels
from tensorfold.kernels.reference import layer_norm
from tensorfold.models.cache import LatentKV, ModelCache
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.glm_moe_dsa import layer_specs
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model
from tensorfold.models.moe import MoESpec
from tensorfold.models.spec import MLPSpec
from tools.tiny_checkpoint import SEED_PROMPT, build_tiny_model, hybrid_margins, make_tiny_checkpoint

ARCH = "glm_moe_dsa"
ATOL = 1e-3       # logits up to ~10; this forward is within ~1e-4 of transformers in float64
INDEX_GAP = 1e-3  # the indexer's k-th minus (k+1)-th score, relative, on the greedy path (float32 oracle)
TIE_GAP = 1e-5    # on random prompts (float64 oracle): the scores agree with transformers' to ~1e-7
SEED = 19         # the first separated seed (_separated_checkpoint searches on from here if it is not)


class SelectionGaps:
    """Records, while active, the smallest relative gap between each selecting row's k-th and
    (k+1)-th indexer score (kernels.select_top_keys' inputs) and how many rows selected. The torch
    op set calls select_top_keys; the native one (_cpu.dsa_select) gives its bits without it, so
    the gaps are read on models of the torch op set."""

    def __enter__(self):
        self.gap, self.rows, self._real = float("inf"), 0, kernels.select_top_keys

        def spy(scores, positions, top_k):
            for row, pos in zip(scores, positions.tolist()):
                if pos + 1 > top_k:
                    seen = row[:pos + 1].sort(descending=True).values
                    scale = max(1.0, seen.abs().max().item())
                    self.gap = min(self.gap, (seen[top_k - 1] - seen[top_k]).item() / scale)
                    self.rows += 1
            return self._real(scores, positions, top_k)
        kernels.select_top_keys = spy
        return self

    def __exit__(self, *exc):
        kernels.select_top_keys = self._real


def _model(path, ops="cpu"):
    return build_model(load_hf_dir(path), torch.float32, cpu_ops if ops == "torch" else backend_ops(ops))


def _prefill(model, ids):
    return model.forward(_rows([list(range(8))], [(0, ids, 0, True)]), model.allocate_cache(8, cases.BLOCK,
                                                                                           torch.float32))


def _separated_checkpoint(out_dir: str, tokenizer) -> str:
    """The first seed from SEED whose greedy tokens and expert routes on SEED_PROMPT are separated
    (well_separated_seed's rule: transformers' top-1/top-2 logit and router gaps, relative) and
    whose indexer choices on the prompt and that reply are too (INDEX_GAP)."""
    prompt = tokenizer(SEED_PROMPT, add_special_tokens=False)["input_ids"]
    for seed in range(SEED, SEED + 64):
        m = hybrid_margins(build_tiny_model(ARCH, seed, tokenizer), prompt)
        if min(m["token_gap"], m["route_gap"]) <= INDEX_GAP or m["distinct"] < 4:
            continue
        path = make_tiny_checkpoint(os.path.join(out_dir, str(seed)), ARCH, seed=seed, tokenizer=tokenizer)
        with SelectionGaps() as gaps:
            _prefill(_model(path, "torch"), prompt + m["tokens"])
        if gaps.gap > INDEX_GAP:
            return path
    raise ValueError(f"no seed in {SEED}..{SEED + 63} separates {ARCH}'s tokens, routes and indexer choices")


@pytest.fixture(scope="module")
def glm(tmp_path_factory, smollm2_tokenizer):
    return _separated_checkpoint(str(tmp_path_factory.mktemp(ARCH)), smollm2_tokenizer)


@pytest.fixture(scope="module")
def hf_model64(glm):
    return cases.hf_model(glm, torch.float64, experts_implementation="eager")


def test_the_tiny_checkpoint_turns_its_options_on(glm):
    model = _model(glm)
    mixers = [spec.mixer for spec in model.specs]
    assert all(m.q_lora_rank for m in mixers) and mixers[0].indexer.top_k == 12
    assert [m.indexer is not None for m in mixers] == [True, False, True] and mixers[1].selection_source == 0
    assert [type(spec.ffn) for spec in model.specs] == [MLPSpec, MoESpec, MoESpec]
    routing = model.specs[1].ffn.sigmoid_routing
    assert (routing.n_group, routing.topk_group, routing.scale) == (4, 2, 2.5)
    assert model.cache_specs() == [LatentKV(32, 8, 16), LatentKV(32, 8, 0), LatentKV(32, 8, 16)]
    cache = model.allocate_cache(4, cases.BLOCK, torch.float32)
    assert cache.describe() == "3 x LatentKV"  # the startup log's and /health's cache line
    per_block = ModelCache.bytes_per_block(model.cache_specs(), torch.float32, cases.BLOCK)  # memory sizing
    assert per_block == cases.BLOCK * 4 * (3 * (32 + 8) + 2 * 16) and cache.nbytes == 4 * per_block


def test_the_startup_probe_runs_the_latent_layer_in_chunks(glm):
    """The probes pass on the layer as it is and catch an attention whose rows depend on the call
    (a torch op set's, whose attention_by_sequence calls kernels.latent_attention)."""
    assert probe_ops(_model(glm), backend_ops("cpu")) == []
    model, ops = _model(glm, "torch"), cpu_ops
    real = kernels.latent_attention
    kernels.latent_attention = lambda q, *args: real(q, *args) + 1e-6 * q.shape[0]
    try:
        assert probe_ops(model, ops) == ["latent attention: chunks [1] differ from one pass"]
    finally:
        kernels.latent_attention = real


@pytest.mark.parametrize("ops", ["cpu", "torch"])
def test_prefill_logits_match_transformers(glm, hf_model64, ops):
    with SelectionGaps() as gaps:
        cases.check_prefill_logits(_model(glm, ops), hf_model64, ATOL)
    if ops == "torch":  # the native op set's choices are the torch op set's (test_the_native_op_set_...)
        assert gaps.rows > 0 and gaps.gap > TIE_GAP  # the indexer chose, and by clear margins


@pytest.mark.parametrize("seed", [1, 2])
def test_prefill_logits_match_transformers_other_seeds(seed, tmp_path, smollm2_tokenizer):
    path = make_tiny_checkpoint(str(tmp_path), ARCH, seed=seed, tokenizer=smollm2_tokenizer)
    with SelectionGaps() as gaps:
        cases.check_prefill_logits(_model(path, "torch"),
                                   cases.hf_model(path, torch.float64, experts_implementation="eager"),
                                   ATOL, seed=seed, length=40)
    assert gaps.rows > 0 and gaps.gap > TIE_GAP


def test_batched_paged_decode_matches_transformers(glm, hf_model64):
    with SelectionGaps() as gaps:
        cases.check_batched_paged_decode(_model(glm, "torch"), hf_model64, ATOL, steps=3)
    assert gaps.rows > 0 and gaps.gap > TIE_GAP


def test_greedy_32_tokens_equal_transformers(glm):
    cases.check_greedy_32_tokens(glm, cases.hf_model(glm, torch.float32, experts_implementation="eager"))


def test_the_indexer_decides_what_attention_sees(glm, hf_model64):
    """With index_topk past the prompt every key is seen: other logits, and transformers agrees."""
    ckpt = load_hf_dir(glm)
    ckpt.config["index_topk"] = 4096
    dense = build_model(ckpt, torch.float32, backend_ops("cpu"))
    ids = list(range(200, 250))
    got, sparse = _prefill(dense, ids), _prefill(_model(glm), ids)
    assert (got - sparse).abs().max() > 10 * ATOL
    hf64 = cases.hf_model(glm, torch.float64, experts_implementation="eager", index_topk=4096)
    torch.testing.assert_close(got, cases.hf_logits(hf64, ids), atol=ATOL, rtol=0)


# ---- chunked prefill == token by token, bitwise ------------------------------------------------

def test_chunked_prefill_is_bitwise_token_by_token(glm):
    cases.check_chunked_prefill(_model(glm), 70, chunks=(3, 16, 64, 512))  # past index_topk and two blocks


def test_the_native_op_set_gives_the_reference_bits(glm):
    """The native op set (C++ norms, rope, GEMMs) and the torch references with the fixed-order
    GEMM: the same logits, bitwise."""
    ids = list(range(100, 130))  # past index_topk: the indexer chooses
    outs = []
    for model in (_model(glm, "cpu"), build_model(load_hf_dir(glm), torch.float32, reference_ops())):
        cache = model.allocate_cache(2, cases.BLOCK, torch.float32)
        logits = model.forward(_rows([[0, 1]], [(0, ids, 0, False)]), cache)
        outs.append([logits] + [t for layer in cache.layers for t in (layer.kv, layer.index_keys) if t is not None])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


# ---- over HTTP ---------------------------------------------------------------------------------

def test_drafted_equals_serial(glm):
    cases.check_drafted_equals_serial(glm, [dict(temperature=0.0), dict(temperature=1.1, seed=4, top_p=0.9)],
                                      max_tokens=32)


@pytest.fixture(scope="module")
def solo(glm):
    yield from cases.solo_replies(glm)


def test_concurrent_replies_equal_their_solo_runs(glm, solo):
    cases.check_concurrent_equals_solo(glm, solo)


def test_cached_prefix_reply_equals_the_fresh_one(glm, solo):
    cases.check_cached_equals_fresh(glm, solo, whole_blocks=False)


def test_preempted_reply_equals_its_uninterrupted_run(glm, solo):
    cases.check_preempted_equals_uninterrupted(glm, solo)


# ---- the exact kernels -------------------------------------------------------------------------

def test_latent_attention_is_row_invariant_and_close_to_float64():
    gen = torch.Generator().manual_seed(0)
    keys, q = torch.randn(70, 40, generator=gen), torch.randn(30, 4, 40, generator=gen)
    positions = torch.arange(40, 70)
    selected = torch.rand(30, 70, generator=gen) < 0.5
    whole = kernels.latent_attention(q, keys, positions, 0.3, 32, selected)
    for row in (0, 13, 29):
        alone = kernels.latent_attention(q[row:row + 1], keys[:positions[row] + 1], positions[row:row + 1], 0.3, 32,
                                         selected[row:row + 1, :positions[row] + 1])
        assert torch.equal(alone[0], whole[row])
    seen = (torch.arange(70)[None] <= positions[:, None]) & selected
    scores = torch.einsum("rhd,ld->rhl", q.double(), keys.double()) * 0.3
    p = torch.softmax(scores.masked_fill(~seen[:, None], float("-inf")), dim=-1)
    torch.testing.assert_close(whole.double(), p @ keys[:, :32].double(), atol=1e-5, rtol=1e-5)


def test_exact_dots_equal_the_integer_dot_scaled_once():
    """exact_dots scales q and the keys back onto their grids before the matmul: bit for bit the
    integer dot scaled once by 2^(e_q + e_k - 2 bits + 2), at every float32 exponent (zero,
    subnormal, huge vectors included)."""
    from tensorfold.exact.grid import pow2, to_fixed

    gen = torch.Generator().manual_seed(2)
    for width in (16, 40, 576):
        for scale_q, scale_k in ((1.0, 1.0), (1e-30, 1e30), (1e-38, 1e-38), (1e38, 1e-3)):
            q = (torch.randn(5, 3, width, generator=gen, dtype=torch.float64) * scale_q).float()
            keys = (torch.randn(9, width, generator=gen, dtype=torch.float64) * scale_k).float()
            q[0, 1], keys[2], keys[3] = 0.0, 0.0, 1e-44
            bits = kernels.dot_bits(width)
            (q_int, q_exp), (k_int, k_exp) = to_fixed(q, bits), to_fixed(keys, bits)
            once = (torch.matmul(q_int, k_int.T) * pow2(q_exp[..., None] + k_exp - 2 * bits + 2)).float()
            got = kernels.exact_dots(q, keys)
            assert torch.equal(got.view(torch.int32), once.view(torch.int32)), (width, scale_q, scale_k)


def test_the_indexer_keeps_ties_at_the_lower_position_and_rows_alone():
    scores = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 9.0]])
    got = kernels.select_top_keys(scores, torch.tensor([5]), 3)  # 9.0 at position 6 is not seen yet
    assert got[0].tolist() == [False, True, True, True, False, False, False]
    gen = torch.Generator().manual_seed(1)
    q, keys, weights = torch.randn(9, 16, 24, generator=gen), torch.randn(50, 24, generator=gen), torch.randn(9, 16)
    whole = kernels.indexer_scores(q, weights, keys, 0.2)
    assert torch.equal(kernels.indexer_scores(q[4:5], weights[4:5], keys, 0.2)[0], whole[4])
    want = (torch.einsum("rhd,ld->rhl", q.double(), keys.double()) * 0.2).relu()
    torch.testing.assert_close(whole.double(), (want * weights.double()[..., None]).sum(1), atol=1e-5, rtol=1e-5)


def test_layer_norm_is_close_to_torch_and_row_invariant():
    x = torch.randn(17, 128) * torch.logspace(-3, 3, 17)[:, None]
    w, b = torch.randn(128), torch.randn(128)
    got = layer_norm(x, w, b, 1e-6)
    torch.testing.assert_close(got.double(), torch.nn.functional.layer_norm(x.double(), (128,), w.double(), b.double(),
                                                                            1e-6), atol=1e-5, rtol=1e-5)
    assert torch.equal(layer_norm(x[6:7], w, b, 1e-6)[0], got[6])


# ---- options, tensors --------------------------------------------------------------------------

def _args(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    return ModelArgs.from_hf(config)


@pytest.mark.parametrize("change, named", [
    (dict(mlp_layer_types=["dense", "sparse", "wide"]), "wide"),
    (dict(indexer_types=["full", "sparse", "full"]), "sparse"),
    (dict(indexer_types=["shared", "full", "full"]), "shared"),
    (dict(layer_types=["indexed_attention", "sliding_attention", "indexed_attention"]), "sliding_attention"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(n_group=3), "n_group"),
    (dict(kv_lora_rank=None), "kv_lora_rank"),
])
def test_options_not_served_are_startup_errors_naming_them(glm, change, named):
    with pytest.raises(CheckpointError, match=named):
        layer_specs(_args(glm, **change))


def test_a_missing_tensor_is_a_startup_error_naming_it(glm):
    ckpt = load_hf_dir(glm)
    del ckpt.tensors["model.layers.2.self_attn.indexer.wk.weight"]
    with pytest.raises(CheckpointError, match="model.layers.2.self_attn.indexer.wk.weight"):
        build_model(ckpt, torch.float32, cpu_ops)


def test_next_n_layers_are_skipped_with_a_log_line(glm, caplog):
    ckpt = load_hf_dir(glm)
    for name in [n for n in ckpt.tensors if n.startswith("model.layers.2.")]:
        ckpt.tensors[name.replace("layers.2.", "layers.3.")] = ckpt.tensors[name]
    ckpt.tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    with caplog.at_level(logging.INFO, logger="tensorfold.models"):
        build_model(ckpt, torch.float32, cpu_ops)
    assert any("next-n (MTP) layers [3]" in r.getMessage() for r in caplog.records)
