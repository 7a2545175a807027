"""The checks every model family's tests make (tests/test_hybrids.py, tests/test_gemma4.py): its
tiny checkpoint against transformers, chunked prefill against token by token, and the four
exactness equalities over a real loopback server. Each family's file holds its fixtures and
calls these with its own tolerances and numbers."""
import json
import os
import threading

import torch

from test_exactness import (LOAD, Background, assert_equal_solo, at_once, complete, run, serving, stream,
                            tiny_engine, user)
from test_models import _rows
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.sampling.params import SamplingParams
from tools.tiny_checkpoint import SEED_PROMPT

BLOCK = 32


# ---- against transformers ----------------------------------------------------------------------

def hf_model(path: str, dtype: torch.dtype, **kwargs):
    """The checkpoint's transformers model, by its config's architecture."""
    import transformers
    with open(os.path.join(path, "config.json")) as f:
        cls = getattr(transformers, json.load(f)["architectures"][0])
    return cls.from_pretrained(path, dtype=dtype, **kwargs).eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def check_prefill_logits(model, hf64, atol: float, seed: int = 1, length: int = 75) -> None:
    torch.manual_seed(seed)
    ids = torch.randint(0, model.args.vocab_size, (length,)).tolist()
    got = model.forward(_rows([[4, 0, 7]], [(0, ids, 0, True)]), model.allocate_cache(8, BLOCK, torch.float32))
    torch.testing.assert_close(got, hf_logits(hf64, ids), atol=atol, rtol=0)


def check_batched_paged_decode(model, hf64, atol: float, steps: int) -> None:
    """Three sequences with scattered block tables: prompt chunks that stop mid-block, decode rows
    beside prefill chunks, then `steps` rounds of decode rows of all three in one forward."""
    cache = model.allocate_cache(64, BLOCK, torch.float32)
    torch.manual_seed(2)
    seqs = [torch.randint(0, model.args.vocab_size, (n + steps + 2,)).tolist() for n in (40, 7, 66)]
    tables = [[9, 2, 30], [5, 17, 1], [40, 3, 22, 8]]
    model.forward(_rows(tables, [(0, seqs[0][:40], 0, False), (1, seqs[1][:7], 0, False),
                                 (2, seqs[2][:33], 0, False)]), cache)
    model.forward(_rows(tables, [(0, seqs[0][40:41], 40, False), (2, seqs[2][33:66], 33, False),
                                 (1, seqs[1][7:8], 7, False)]), cache)
    offsets = [41, 8, 66]
    for step in range(steps):
        order = (2, 0, 1)
        pieces = [(s, seqs[s][offsets[s] + step:offsets[s] + step + 1], offsets[s] + step, True) for s in order]
        got = model.forward(_rows(tables, pieces), cache)
        for row, s in enumerate(order):
            expected = hf_logits(hf64, seqs[s][:offsets[s] + step + 1])[-1]
            torch.testing.assert_close(got[row], expected, atol=atol, rtol=0)


def check_greedy_32_tokens(path: str, hf32, backend: str = "cpu", **config) -> None:
    config = {"context": 1024, "kv_cache_gib": 0.05, **config}
    engine = Engine(path, EngineConfig(backend=backend, drafting=False, **config))
    assert engine.exact, engine.probe_failures  # the startup probes pass on the family's shapes
    assert engine.info.backend == backend
    ids = engine.tokenizer.encode(SEED_PROMPT, add_special_tokens=False)
    got = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    expected = hf32.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                             do_sample=False)[0, len(ids):].tolist()
    assert got.token_ids == expected


# ---- chunked prefill == token by token, bitwise ------------------------------------------------

def prefill_in_chunks(model, ids: list[int], chunk: int, other: list[int], blocks: int):
    """ids prefilled in chunks of `chunk` (a second sequence decoding beside each chunk), each
    sequence with `blocks` blocks; returns the last row's logits and a copy of every layer's
    cache part this sequence wrote (K/V through its last block; a recurrent layer's state after
    the prompt, kept in its last block)."""
    cache = model.allocate_cache(2 * blocks, BLOCK, torch.float32)
    tables = [list(range(0, blocks)), list(range(blocks, 2 * blocks))]
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
        if layer is None:  # a layer that keeps nothing (Nemotron-H's MLP and MoE layers)
            continue
        if hasattr(layer, "ssm"):
            parts += [layer.ssm[last].clone(), layer.conv[last].clone()]
        elif hasattr(layer, "latent_dim"):  # a latent cache: the latent and rope key, the indexer's keys
            parts += [t[:last + 1].clone() for t in (layer.kv, layer.index_keys) if t is not None]
        else:
            parts += [layer.k[:last + 1].clone(), layer.v[:last + 1].clone()]
    return logits, parts


def check_chunked_prefill(model, length: int, chunks: tuple[int, ...]) -> None:
    torch.manual_seed(3)
    ids = torch.randint(0, model.args.vocab_size, (length,)).tolist()
    other = torch.randint(0, model.args.vocab_size, (length,)).tolist()
    blocks = -(-(length + 8) // BLOCK)
    want_logits, want = prefill_in_chunks(model, ids, 1, other, blocks)
    for chunk in chunks:
        logits, got = prefill_in_chunks(model, ids, chunk, other, blocks)
        assert torch.equal(logits, want_logits), f"chunk {chunk}: last logits differ"
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"chunk {chunk}: cache differs"


def check_op_sets_agree(make_model, steps: int = 8) -> None:
    """The compiled op set (make_model("cpu"): C++ norms, rope, attention, GEMMs) and the torch
    references (make_model("torch")) give the same greedy tokens, a 40-token prompt then one row
    a step; each is exact on its own (the family's other tests)."""
    prompt = list(range(100, 140))
    replies = []
    for ops in ("cpu", "torch"):
        model = make_model(ops)
        cache, ids = model.allocate_cache(8, BLOCK, torch.float32), list(prompt)
        for step in range(steps):
            start = 0 if step == 0 else len(ids) - 1
            logits = model.forward(_rows([[0, 1, 2, 3]], [(0, ids[start:], start, False)]), cache)
            ids.append(int(logits[-1].argmax()))
        replies.append(ids[len(prompt):])
    assert replies[0] == replies[1]


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


def check_drafted_equals_serial(path: str, samplings: list[dict], max_tokens: int) -> None:
    """Drafts accepted and rejected (mid-block and across block ends) leave the reply unchanged.
    Proposals run whole (no draft budget): this checks the verify path, not when drafts pay."""
    engine = tiny_engine(path, context=1024, draft_budget=False)
    ids = engine.tokenizer.encode(SEED_PROMPT, add_special_tokens=False)
    for params in samplings:
        serial = run(engine, ids, max_tokens=max_tokens, ignore_eos=True, draft=False, **params)
        engine.drafter = KnowingDrafter(len(ids), serial.tokens)
        drafted = run(engine, ids, max_tokens=max_tokens, ignore_eos=True, **params)
        assert drafted.tokens == serial.tokens and drafted.text == serial.text
        assert 0 < drafted.accepted < drafted.drafted  # some kept, some rejected


def solo_replies(path: str):
    """A generator for a module fixture: body -> its reply alone on a one-lane server, drafts off
    (each body run once)."""
    done = {}
    with serving(tiny_engine(path, max_num_seqs=1, drafting=False)) as s:
        def reference(body):
            key = json.dumps(body, sort_keys=True)
            if key not in done:
                done[key] = complete(s.client, dict(body, draft=False))
            return done[key]
        yield reference


def check_concurrent_equals_solo(path: str, solo) -> None:
    bodies = LOAD[:6]
    refs = [solo(b) for b in bodies]
    with serving(tiny_engine(path, max_num_seqs=4, max_tokens_per_step=64)) as s:
        s.pause()
        calls = at_once([lambda b=b: complete(s.client, b) for b in bodies])
        s.wait_queued(len(bodies))
        s.resume()
        for call, ref in zip(calls, refs):
            assert_equal_solo(call.result(), ref)
        assert max(len(plan) for plan in s.plans) == 4


SYSTEM = "You keep the harbor's logbook: ships, tides, weather and cargo, day by day. " * 6


def check_cached_equals_fresh(path: str, solo, whole_blocks: bool) -> None:
    """A second prompt sharing the first's system prompt is served from the cache (whole blocks
    only where a recurrent state resumes at a block's start) and equals its fresh run."""
    a = dict(messages=[{"role": "system", "content": SYSTEM}, user("Which ship came first?")], max_tokens=16,
             temperature=0.7, seed=5)
    b = dict(messages=[{"role": "system", "content": SYSTEM}, user("What was the weather?")], max_tokens=40,
             temperature=1.0, seed=6, ignore_eos=True)
    with serving(tiny_engine(path)) as s:
        fresh = complete(s.client, b)
        assert fresh.cached == 0
        other = complete(s.client, a)
        assert other.cached >= 2 * BLOCK and (other.cached % BLOCK == 0 or not whole_blocks)
        again = stream(s.client, b)
        assert again.cached >= other.cached
        assert_equal_solo(again, fresh)
        assert_equal_solo(fresh, solo(b))


def check_preempted_equals_uninterrupted(path: str, solo, **background) -> None:
    """A background reply preempted by a foreground request replays and equals its solo run."""
    bg = dict(messages=[user("Write a long background report.")], max_tokens=120, temperature=0.8, seed=21,
              ignore_eos=True, priority="background", **background)
    fg = dict(messages=[user("Quick question?")], max_tokens=8, temperature=0.0)
    bg_ref = solo({k: v for k, v in bg.items() if k != "priority"})
    engine = tiny_engine(path, max_num_seqs=1)
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


def rewrite_gguf(path: str, out: str, change) -> str:
    """A copy of the GGUF at `path` (its metadata as they are) with its tensors passed through
    change(name, array, type) -> list of (name, array, type): [] drops a tensor."""
    import gguf
    import numpy as np

    from tensorfold.models.gguf_file import _Reader

    reader = _Reader(path)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            writer.add_key_value(name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        for name, data, kind in change(t.name, np.array(t.data), t.tensor_type):
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def without(name: str):
    """rewrite_gguf's change that drops the tensor `name`."""
    return lambda n, data, kind: [] if n == name else [(n, data, kind)]
