"""The Qwen hybrids (qwen3_5, qwen3_5_moe, qwen3_next) against transformers, and exact.

Tiny random checkpoints laid out as the Hub's (tools/tiny_checkpoint.py), each with a seed whose
greedy tokens and expert routes no float rounding can flip (well_separated_seed):
- prefill logits and batched paged decode (sequences starting mid-block, chunks mixed with decode
  rows) within float32 tolerance of transformers, greedy 32 tokens equal;
- a prompt prefilled in chunks of 1, 3, 16, 64 and 512 gives bitwise the logits, the recurrent
  states and the K/V of a token-by-token run, beside another sequence, at 1 and 2 threads;
- over a real loopback server: drafted == serial (rejected drafts rewind the state to a block
  boundary), concurrent == solo, a cached prefix == fresh (resumed from a block's state), a
  preempted reply == its uninterrupted run; greedy and sampled.
"""
import json
import os
import threading

import pytest
import torch

from test_exactness import (LOAD, Background, assert_equal_solo, at_once, complete, run, serving, stream,
                            tiny_engine, user)
from test_models import _rows
from tensorfold.backends import backend_ops
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model
from tensorfold.sampling.params import SamplingParams
from tools.tiny_checkpoint import HYBRID_ARCHS, SEED_PROMPT, make_tiny_checkpoint, well_separated_seed

ATOL = 2e-3  # logits up to ~10: both transformers in float32 and this forward are within ~1e-3 of float64
BLOCK = 32


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def hybrid(request, tmp_path_factory, smollm2_tokenizer):
    arch = request.param
    seed = well_separated_seed(arch, smollm2_tokenizer, family=True)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, seed=seed, tokenizer=smollm2_tokenizer,
                                family=True)


def _hf(path, dtype):
    import transformers
    with open(os.path.join(path, "config.json")) as f:
        cls = getattr(transformers, json.load(f)["architectures"][0])
    return cls.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf_model(hybrid):
    return _hf(hybrid, torch.float32)


@pytest.fixture(scope="module")
def hf_model64(hybrid):
    """The logits oracle: transformers in float64 (its float32 chunked DeltaNet is itself ~1e-3 off)."""
    return _hf(hybrid, torch.float64)


def _hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([ids])).logits[0].float()


def _model(path, ops="cpu"):
    return build_model(load_hf_dir(path), torch.float32, backend_ops(ops))


def test_prefill_logits_match_transformers(hybrid, hf_model64):
    model = _model(hybrid)
    torch.manual_seed(1)
    ids = torch.randint(0, model.args.vocab_size, (75,)).tolist()
    got = model.forward(_rows([[4, 0, 7]], [(0, ids, 0, True)]), model.allocate_cache(8, BLOCK, torch.float32))
    torch.testing.assert_close(got, _hf_logits(hf_model64, ids), atol=ATOL, rtol=0)


def test_batched_paged_decode_matches_transformers(hybrid, hf_model64):
    """Three sequences with scattered block tables: a prompt chunk that stops mid-block, decode
    rows beside prefill chunks, then decode rows of all three in one forward."""
    model = _model(hybrid)
    cache = model.allocate_cache(64, BLOCK, torch.float32)
    torch.manual_seed(2)
    seqs = [torch.randint(0, model.args.vocab_size, (n + 6,)).tolist() for n in (40, 7, 66)]
    tables = [[9, 2, 30], [5, 17, 1], [40, 3, 22, 8]]
    model.forward(_rows(tables, [(0, seqs[0][:40], 0, False), (1, seqs[1][:7], 0, False),
                                 (2, seqs[2][:33], 0, False)]), cache)
    model.forward(_rows(tables, [(0, seqs[0][40:41], 40, False), (2, seqs[2][33:66], 33, False),
                                 (1, seqs[1][7:8], 7, False)]), cache)
    offsets = [41, 8, 66]
    for step in range(4):
        order = (2, 0, 1)
        pieces = [(s, seqs[s][offsets[s] + step:offsets[s] + step + 1], offsets[s] + step, True) for s in order]
        got = model.forward(_rows(tables, pieces), cache)
        for row, s in enumerate(order):
            expected = _hf_logits(hf_model64, seqs[s][:offsets[s] + step + 1])[-1]
            torch.testing.assert_close(got[row], expected, atol=ATOL, rtol=0)


def test_greedy_32_tokens_equal_transformers(hybrid, hf_model):
    engine = Engine(hybrid, EngineConfig(drafting=False, context=1024, kv_cache_gib=0.05))
    assert engine.exact, engine.probe_failures  # the startup probes pass: DeltaNet chunks, MoE rows
    ids = engine.tokenizer.encode(SEED_PROMPT, add_special_tokens=False)
    got = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                 do_sample=False)[0, len(ids):].tolist()
    assert got.token_ids == expected


# ---- chunked prefill == token by token, bitwise ------------------------------------------------

PROMPT_LEN = 530


def _prefill_in_chunks(model, ids, chunk, other):
    """ids prefilled in chunks of `chunk` (a second sequence decoding beside each chunk); returns
    the last row's logits and a copy of every layer's cache part this sequence wrote."""
    cache = model.allocate_cache(40, BLOCK, torch.float32)
    tables = [list(range(0, 20)), list(range(20, 40))]
    model.forward(_rows(tables, [(1, other[:5], 0, False)]), cache)
    logits, start, other_at = None, 0, 5
    while start < len(ids):
        piece = ids[start:start + chunk]
        out = model.forward(_rows(tables, [(1, other[other_at:other_at + 1], other_at, False),
                                           (0, piece, start, False)]), cache)
        logits, start, other_at = out[-1], start + len(piece), other_at + 1
    last = (len(ids) - 1) // BLOCK
    parts = []
    for layer in cache.layers:
        if hasattr(layer, "ssm"):  # the state after the prompt, in its last block
            parts += [layer.ssm[last].clone(), layer.conv[last].clone()]
        else:
            parts += [layer.k[:last + 1].clone(), layer.v[:last + 1].clone()]
    return logits, parts


@pytest.mark.parametrize("threads", [1, 2])
def test_chunked_prefill_is_bitwise_token_by_token(hybrid, threads):
    model = _model(hybrid)
    torch.manual_seed(3)
    ids = torch.randint(0, model.args.vocab_size, (PROMPT_LEN,)).tolist()
    other = torch.randint(0, model.args.vocab_size, (PROMPT_LEN,)).tolist()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want_logits, want = _prefill_in_chunks(model, ids, 1, other)
        for chunk in (3, 16, 64, 512):
            logits, got = _prefill_in_chunks(model, ids, chunk, other)
            assert torch.equal(logits, want_logits), f"chunk {chunk}: last logits differ"
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"chunk {chunk}: cache differs"
    finally:
        torch.set_num_threads(before)


def test_one_call_per_layer_equals_the_op_by_op_layer(hybrid):
    """The fused layers (native_ops.fuse: one _cpu.DeltaNetLayer or _cpu.DecoderLayer call per
    layer, the latter with the output gate and partial rope; native_ops.fuse_moe: one
    _cpu.MoEBlock call per MoE feed-forward) against the same kernels called op by op: the same
    logits, recurrent states and K/V through a chunked prefill beside a decoding sequence, float32
    and bfloat16, quantized and dense."""
    import types

    from tensorfold.models.loader import quantize_checkpoint
    from tensorfold.models.moe import MoE

    native = backend_ops("cpu")
    if not native.NAME.startswith("native-"):
        pytest.skip("the compiled op set is not built")
    unfused = types.SimpleNamespace(**{n: getattr(native, n) for n in dir(native) if not n.startswith("_")})
    unfused.fuse = unfused.fuse_moe = lambda block: None
    torch.manual_seed(5)
    for dtype, quant in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, "q4_0")):
        def build(ops):
            ckpt = load_hf_dir(hybrid)
            if quant:
                quantize_checkpoint(ckpt, quant)
            return build_model(ckpt, dtype, ops)
        fused, op_by_op = build(native), build(unfused)
        one_call = [getattr(run, "__self__", None) is not layer for run, layer in zip(fused._run, fused.layers)]
        assert all(one_call), "every layer (DeltaNet and gated attention, MLP and MoE alike) is one call"
        assert all(layer.ffn._fused is not None for layer in fused.layers if type(layer.ffn) is MoE)
        ids = torch.randint(0, fused.args.vocab_size, (70,)).tolist()
        other = torch.randint(0, fused.args.vocab_size, (70,)).tolist()
        got_logits, got = _prefill_in_chunks(fused, ids, 16, other)
        want_logits, want = _prefill_in_chunks(op_by_op, ids, 16, other)
        assert torch.equal(got_logits, want_logits), f"{dtype} {quant}: logits differ"
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{dtype} {quant}: cache differs"


# ---- over HTTP ---------------------------------------------------------------------------------

class KnowingDrafter:
    """Drafts from a serial run of the same request: the next tokens, the third of each run
    replaced in every other round, so that rounds are fully accepted, cut short mid-block and
    cut short across a block boundary. Any drafts must leave the reply unchanged."""

    def __init__(self, prompt_len: int, serial: list[int], depth: int = 5):
        self.prompt_len, self.serial, self.depth, self.rounds = prompt_len, serial, depth, 0

    def propose(self, tokens, state, limit):
        at = len(tokens) - self.prompt_len
        drafts = self.serial[at:at + min(self.depth, limit)]
        self.rounds += 1
        if self.rounds % 2 and len(drafts) > 2:
            drafts[2] = (drafts[2] + 1) % 1000
        return drafts

    def update(self, state, num_drafted, num_accepted):
        pass


def test_drafted_equals_serial(hybrid):
    """Verify rounds run drafts through the recurrence; a rejected draft rewinds the state to
    its block's start, and the reply equals the serial one, greedy and sampled."""
    engine = tiny_engine(hybrid, context=1024)
    ids = engine.tokenizer.encode(SEED_PROMPT, add_special_tokens=False)
    for params in (dict(temperature=0.0), dict(temperature=0.8, seed=3), dict(temperature=1.1, seed=4, top_p=0.9)):
        serial = run(engine, ids, max_tokens=70, ignore_eos=True, draft=False, **params)
        engine.drafter = KnowingDrafter(len(ids), serial.tokens)
        drafted = run(engine, ids, max_tokens=70, ignore_eos=True, **params)
        assert drafted.tokens == serial.tokens and drafted.text == serial.text
        assert drafted.accepted > 0 and drafted.accepted < drafted.drafted  # some kept, some rejected


@pytest.fixture(scope="module")
def solo(hybrid):
    done = {}
    with serving(tiny_engine(hybrid, max_num_seqs=1, drafting=False)) as s:
        def reference(body):
            key = json.dumps(body, sort_keys=True)
            if key not in done:
                done[key] = complete(s.client, dict(body, draft=False))
            return done[key]
        yield reference


def test_concurrent_replies_equal_their_solo_runs(hybrid, solo):
    bodies = LOAD[:6]
    refs = [solo(b) for b in bodies]
    with serving(tiny_engine(hybrid, max_num_seqs=4, max_tokens_per_step=64)) as s:
        s.pause()
        calls = at_once([lambda b=b: complete(s.client, b) for b in bodies])
        s.wait_queued(len(bodies))
        s.resume()
        for call, ref in zip(calls, refs):
            assert_equal_solo(call.result(), ref)
        assert max(len(plan) for plan in s.plans) == 4


SYSTEM = "You keep the harbor's logbook: ships, tides, weather and cargo, day by day. " * 6


def test_cached_prefix_reply_equals_the_fresh_one(hybrid, solo):
    a = dict(messages=[{"role": "system", "content": SYSTEM}, user("Which ship came first?")], max_tokens=16,
             temperature=0.7, seed=5)
    b = dict(messages=[{"role": "system", "content": SYSTEM}, user("What was the weather?")], max_tokens=40,
             temperature=1.0, seed=6, ignore_eos=True)
    with serving(tiny_engine(hybrid)) as s:
        fresh = complete(s.client, b)
        assert fresh.cached == 0
        other = complete(s.client, a)
        assert other.cached >= 2 * BLOCK and other.cached % BLOCK == 0  # resumed from a block's state
        again = stream(s.client, b)
        assert again.cached >= other.cached
        assert_equal_solo(again, fresh)
        assert_equal_solo(fresh, solo(b))


def test_preempted_reply_equals_its_uninterrupted_run(hybrid, solo):
    bg = dict(messages=[user("Write a long background report.")], max_tokens=120, temperature=0.8, seed=21,
              ignore_eos=True, priority="background", reasoning_effort="none")  # no think block: text streams
    fg = dict(messages=[user("Quick question?")], max_tokens=8, temperature=0.0)
    bg_ref = solo({k: v for k, v in bg.items() if k != "priority"})
    engine = tiny_engine(hybrid, max_num_seqs=1)
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
