"""Gemma 4 (gemma4, gemma4_text) against transformers, and exact.

Tiny random checkpoints saved by transformers (tools/tiny_checkpoint.py): gemma4 with every option
the real checkpoints turn on (sliding window 16, shorter than the prompts, so it slides; global
layers with their own head size, KV heads and proportional rope; the last two layers sharing K/V
with a double-wide MLP; values that are the keys on the global layers; per-layer inputs; soft-capped
logits), gemma4_text with the other settings (v_proj everywhere, no sharing, no per-layer inputs),
each with a seed whose greedy tokens no float rounding can flip:
- prefill logits (three seeds of gemma4) and batched paged decode within float32 tolerance of
  transformers in float64, greedy 32 tokens equal, the startup probes pass;
- chunked prefill (chunks of 1, 3, 16, 64) == token by token, bitwise, beside another sequence;
- over a real loopback server: drafted == serial, concurrent == solo, a cached prefix == fresh, a
  preempted reply == its uninterrupted run;
- the new elementwise ops against float64, options not served and missing tensors as startup errors.
"""
import json
import os
import threading

import pytest
import torch

from test_exactness import (LOAD, Background, assert_equal_solo, at_once, complete, run, serving, stream,
                            tiny_engine, user)
from test_hybrids import KnowingDrafter
from test_models import _rows
from tensorfold.backends import backend_ops, cpu_ops
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.kernels.reference import gelu_tanh_and_mul, softcap, tanh32
from tensorfold.models.cache import SharedKV
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.gemma4 import layer_specs
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model
from tensorfold.sampling.params import SamplingParams
from tools.tiny_checkpoint import GEMMA4_ARCHS, SEED_PROMPT, make_tiny_checkpoint, well_separated_seed

ATOL = 1e-3  # logits up to ~10; this forward is within ~3e-4 of transformers in float64
BLOCK = 32


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


def _hf(path, dtype):
    import transformers
    with open(os.path.join(path, "config.json")) as f:
        cls = getattr(transformers, json.load(f)["architectures"][0])
    return cls.from_pretrained(path, dtype=dtype).eval()


def _hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([ids])).logits[0].float()


def _model(path, ops="cpu"):
    return build_model(load_hf_dir(path), torch.float32, cpu_ops if ops == "torch" else backend_ops(ops))


@pytest.fixture(scope="module")
def hf_model64(gemma):
    return _hf(gemma, torch.float64)


def test_the_tiny_checkpoints_turn_their_options_on(gemma):
    model = _model(gemma)
    specs = [spec.mixer for spec in model.specs]
    windows = {s.window for s in specs}
    assert windows == {16, None} and {(s.head_dim, s.rope.rope_type) for s in specs} == {(16, "default"),
                                                                                       (32, "proportional")}
    kinds = [type(layer.cache_spec) for layer in model.layers]
    if "gemma4_text" in gemma:
        assert SharedKV not in kinds and model.per_layer_inputs is None and not any(s.values_are_keys for s in specs)
    else:
        assert kinds[-2:] == [SharedKV, SharedKV] and [s.kv_source for s in specs[-2:]] == [3, 2]
        assert model.per_layer_inputs is not None and specs[2].values_are_keys and specs[2].num_kv_heads == 1
        assert model.specs[-1].ffn.intermediate_size == 2 * model.specs[0].ffn.intermediate_size
    assert model.softcap == 30.0


def test_prefill_logits_match_transformers(gemma, hf_model64):
    model = _model(gemma)
    torch.manual_seed(1)
    ids = torch.randint(0, model.args.vocab_size, (75,)).tolist()
    got = model.forward(_rows([[4, 0, 7]], [(0, ids, 0, True)]), model.allocate_cache(8, BLOCK, torch.float32))
    torch.testing.assert_close(got, _hf_logits(hf_model64, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", [1, 2])
def test_prefill_logits_match_transformers_other_seeds(seed, tmp_path, smollm2_tokenizer):
    path = make_tiny_checkpoint(str(tmp_path), "gemma4", seed=seed, tokenizer=smollm2_tokenizer)
    model = _model(path)
    torch.manual_seed(seed)
    ids = torch.randint(0, model.args.vocab_size, (50,)).tolist()
    got = model.forward(_rows([[2, 5]], [(0, ids, 0, True)]), model.allocate_cache(8, BLOCK, torch.float32))
    torch.testing.assert_close(got, _hf_logits(_hf(path, torch.float64), ids), atol=ATOL, rtol=0)


def test_batched_paged_decode_matches_transformers(gemma, hf_model64):
    """Three sequences with scattered block tables: prompt chunks that stop mid-block, decode rows
    beside prefill chunks, then decode rows of all three in one forward, past the window."""
    model = _model(gemma)
    cache = model.allocate_cache(64, BLOCK, torch.float32)
    torch.manual_seed(2)
    seqs = [torch.randint(0, model.args.vocab_size, (n + 4,)).tolist() for n in (40, 7, 66)]
    tables = [[9, 2, 30], [5, 17, 1], [40, 3, 22, 8]]
    model.forward(_rows(tables, [(0, seqs[0][:40], 0, False), (1, seqs[1][:7], 0, False),
                                 (2, seqs[2][:33], 0, False)]), cache)
    model.forward(_rows(tables, [(0, seqs[0][40:41], 40, False), (2, seqs[2][33:66], 33, False),
                                 (1, seqs[1][7:8], 7, False)]), cache)
    offsets = [41, 8, 66]
    for step in range(3):
        order = (2, 0, 1)
        pieces = [(s, seqs[s][offsets[s] + step:offsets[s] + step + 1], offsets[s] + step, True) for s in order]
        got = model.forward(_rows(tables, pieces), cache)
        for row, s in enumerate(order):
            expected = _hf_logits(hf_model64, seqs[s][:offsets[s] + step + 1])[-1]
            torch.testing.assert_close(got[row], expected, atol=ATOL, rtol=0)


def test_greedy_32_tokens_equal_transformers(gemma):
    engine = Engine(gemma, EngineConfig(drafting=False, context=1024, kv_cache_gib=0.05))
    assert engine.exact, engine.probe_failures
    ids = engine.tokenizer.encode(SEED_PROMPT, add_special_tokens=False)
    got = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    expected = _hf(gemma, torch.float32).generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                                  do_sample=False)[0, len(ids):].tolist()
    assert got.token_ids == expected


# ---- chunked prefill == token by token, bitwise ------------------------------------------------

PROMPT_LEN = 100  # past the window (16), over four blocks


def _prefill_in_chunks(model, ids, chunk, other):
    """ids prefilled in chunks of `chunk` (a second sequence decoding beside each chunk); returns
    the last row's logits and a copy of the K/V this sequence wrote in every layer's cache."""
    cache = model.allocate_cache(20, BLOCK, torch.float32)
    tables = [list(range(0, 10)), list(range(10, 20))]
    model.forward(_rows(tables, [(1, other[:5], 0, False)]), cache)
    logits, start, other_at = None, 0, 5
    while start < len(ids):
        piece = ids[start:start + chunk]
        out = model.forward(_rows(tables, [(1, other[other_at:other_at + 1], other_at, False),
                                           (0, piece, start, False)]), cache)
        logits, start, other_at = out[-1], start + len(piece), other_at + 1
    last = (len(ids) - 1) // BLOCK
    parts = [t[:last + 1].clone() for layer in cache.layers for t in (layer.k, layer.v)]
    return logits, parts


def test_chunked_prefill_is_bitwise_token_by_token(gemma):
    model = _model(gemma)
    torch.manual_seed(3)
    ids = torch.randint(0, model.args.vocab_size, (PROMPT_LEN,)).tolist()
    other = torch.randint(0, model.args.vocab_size, (PROMPT_LEN,)).tolist()
    want_logits, want = _prefill_in_chunks(model, ids, 1, other)
    for chunk in (3, 16, 64):
        logits, got = _prefill_in_chunks(model, ids, chunk, other)
        assert torch.equal(logits, want_logits), f"chunk {chunk}: last logits differ"
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"chunk {chunk}: cache differs"


def test_the_op_sets_agree(gemma):
    """The compiled op set (C++ norms, rope, attention, GEMM) and the torch references give the
    same greedy tokens; each is exact on its own (the other tests)."""
    prompt = list(range(100, 140))
    replies = []
    for ops in ("cpu", "torch"):
        model = _model(gemma, ops)
        cache, ids = model.allocate_cache(8, BLOCK, torch.float32), list(prompt)
        for step in range(8):
            start = 0 if step == 0 else len(ids) - 1
            logits = model.forward(_rows([[0, 1, 2, 3]], [(0, ids[start:], start, False)]), cache)
            ids.append(int(logits[-1].argmax()))
        replies.append(ids[len(prompt):])
    assert replies[0] == replies[1]


# ---- over HTTP ---------------------------------------------------------------------------------

def test_drafted_equals_serial(full_gemma):
    """Drafts accepted and rejected (mid-block and across block ends) leave the reply unchanged."""
    engine = tiny_engine(full_gemma, context=1024)
    ids = engine.tokenizer.encode(SEED_PROMPT, add_special_tokens=False)
    for params in (dict(temperature=0.0), dict(temperature=1.1, seed=4, top_p=0.9)):
        serial = run(engine, ids, max_tokens=50, ignore_eos=True, draft=False, **params)
        engine.drafter = KnowingDrafter(len(ids), serial.tokens)
        drafted = run(engine, ids, max_tokens=50, ignore_eos=True, **params)
        assert drafted.tokens == serial.tokens and drafted.text == serial.text
        assert 0 < drafted.accepted < drafted.drafted


@pytest.fixture(scope="module")
def solo(full_gemma):
    done = {}
    with serving(tiny_engine(full_gemma, max_num_seqs=1, drafting=False)) as s:
        def reference(body):
            key = json.dumps(body, sort_keys=True)
            if key not in done:
                done[key] = complete(s.client, dict(body, draft=False))
            return done[key]
        yield reference


def test_concurrent_replies_equal_their_solo_runs(full_gemma, solo):
    bodies = LOAD[:6]
    refs = [solo(b) for b in bodies]
    with serving(tiny_engine(full_gemma, max_num_seqs=4, max_tokens_per_step=64)) as s:
        s.pause()
        calls = at_once([lambda b=b: complete(s.client, b) for b in bodies])
        s.wait_queued(len(bodies))
        s.resume()
        for call, ref in zip(calls, refs):
            assert_equal_solo(call.result(), ref)
        assert max(len(plan) for plan in s.plans) == 4


SYSTEM = "You keep the harbor's logbook: ships, tides, weather and cargo, day by day. " * 6


def test_cached_prefix_reply_equals_the_fresh_one(full_gemma, solo):
    a = dict(messages=[{"role": "system", "content": SYSTEM}, user("Which ship came first?")], max_tokens=16,
             temperature=0.7, seed=5)
    b = dict(messages=[{"role": "system", "content": SYSTEM}, user("What was the weather?")], max_tokens=40,
             temperature=1.0, seed=6, ignore_eos=True)
    with serving(tiny_engine(full_gemma)) as s:
        fresh = complete(s.client, b)
        assert fresh.cached == 0
        other = complete(s.client, a)
        assert other.cached >= 2 * BLOCK  # past the window: the sliding and shared layers read cached K/V
        again = stream(s.client, b)
        assert again.cached >= other.cached
        assert_equal_solo(again, fresh)
        assert_equal_solo(fresh, solo(b))


def test_preempted_reply_equals_its_uninterrupted_run(full_gemma, solo):
    bg = dict(messages=[user("Write a long background report.")], max_tokens=120, temperature=0.8, seed=21,
              ignore_eos=True, priority="background")
    fg = dict(messages=[user("Quick question?")], max_tokens=8, temperature=0.0)
    bg_ref = solo({k: v for k, v in bg.items() if k != "priority"})
    engine = tiny_engine(full_gemma, max_num_seqs=1)
    with serving(engine) as s:
        decoding = threading.Event()
        bg_call = Background(lambda: stream(s.client, bg, on_text=lambda p: len(p) >= 8 and decoding.set()))
        assert decoding.wait(60)
        s.pause()
        fg_call = Background(lambda: complete(s.client, fg))
        s.wait_queued(2)
        s.resume()
        assert_equal_solo(fg_call.result(), solo(fg))
        assert_equal_solo(bg_call.result(), bg_ref)
        assert engine.scheduler.num_preemptions >= 1


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
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32), "enable_moe_block"),
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
