"""The exactness promises end to end: every reply is a pure function of (checkpoint, template,
prompt, seed, sampling settings), whatever the path that produced it.

- drafted == serial ("draft": false), on the default model repeating a passage (most drafts
  accepted), greedy and sampled, fresh and with a reused prefix, with ignore_eos, and with stop
  strings, EOS and max_tokens ending the reply inside an accepted draft run;
- under load (tiny random checkpoints, a real loopback server, the official openai client):
  concurrent == solo with --parallel 4, with and without drafts, with a long prompt arriving
  mid-decode under decode share 0.25 and 0; cached prefix == fresh, also under a tiny cache
  budget; a background request preempted by a foreground one and replayed == its solo run, its
  stream seamless; a flood beyond the KV pool queued and preempted == solo.

Every comparison is between genuinely different paths, and each test checks that the path it
claims was taken: drafted/accepted > 0, cached_tokens > 0, num_preemptions > 0, rounds that
really held 4 requests. Solo references run one request at a time with drafts off.
The torch thread count is pinned to 1 here: on 2 shared cores, two threads oversubscribe.
"""
import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass

import openai
import pytest
import torch

from serving import running
from tensorfold.api.replies import token_sha
from tensorfold.api.service import Service
from tensorfold.backends import backend_ops, keeps_v_exponents
from tensorfold.chat.messages import render_chat
from tensorfold.chat.template import ChatTemplate
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.backends.torch_backend import kv_cache_dtype
from tensorfold.engine.request import Status
from tensorfold.http.server import HttpServer
from tensorfold.models.cache import PagedKV
from tensorfold.sampling.params import SamplingParams
from tensorfold.server import build_router, served_model_of


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- engine-level runs ------------------------------------------------------------------------

@dataclass
class Step:
    num_tokens: int     # tokens this round appended to the reply
    drafted: int        # drafts verified this round
    accepted: int       # of which accepted

    @property
    def ends_on_a_draft(self) -> bool:
        """Every appended token was an accepted draft: the reply ended inside an accepted run."""
        return self.accepted >= self.num_tokens


@dataclass
class Run:
    tokens: list[int]
    text: str
    finish: str
    drafted: int
    accepted: int
    cached: int
    steps: list[Step]


def run(engine: Engine, prompt_ids: list[int], **params) -> Run:
    """One request alone, round by round, recording what each round appended."""
    req_id = engine.add_request(prompt_ids, SamplingParams(**params))
    req = engine.requests[req_id]
    pieces, steps = [], []
    while req.status is not Status.FINISHED:
        drafted, accepted = req.stats.drafted, req.stats.accepted
        for out in engine.step():
            assert out.req_id == req_id
            pieces.append(out.new_text)
            if out.new_token_ids:
                steps.append(Step(len(out.new_token_ids), req.stats.drafted - drafted,
                                  req.stats.accepted - accepted))
    assert not engine.has_work()
    s = req.stats
    return Run(list(req.output_ids), "".join(pieces), req.finish_reason, s.drafted, s.accepted,
               s.cached_tokens, steps)


def chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    """The prompt ids the server renders for these messages (api/service.py _prompt_ids)."""
    ckpt = engine.checkpoint
    template = ChatTemplate(ckpt.chat_template, bos_token=ckpt.tokenizer_config.get("bos_token") or "",
                            eos_token=ckpt.tokenizer_config.get("eos_token") or "")
    return engine.tokenizer.encode(render_chat(template, messages), add_special_tokens=False)


# ---- the default model repeating a passage --------------------------------------------------

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern "
           "and a notebook. He recorded the color of the sky, the direction of the wind, and the names "
           "of the ships that passed the rocky point.")
REPEAT = [{"role": "user", "content": "Repeat this passage exactly, word for word:\n\n" + PASSAGE}]
COPY = [{"role": "system", "content": "You are a careful copyist."},
        {"role": "user", "content": "Copy this sentence exactly: Seven silver swans swam slowly south "
                                    "across the silent lake."}]
NUM_REPEAT = 64   # covers the passage (45 tokens), its EOS and what follows under ignore_eos


@pytest.fixture(scope="module")
def smol():
    # Proposals run whole (no draft budget): the round structure is then a function of the text
    # alone, so the tests below can aim a reply limit, a stop string or an end token at a
    # chosen point inside an accepted run. (The budget only chooses how many drafts run.)
    return Engine(None, EngineConfig(probe=False, context=1024, kv_cache_gib=0.1, draft_budget=False))


def first_eos(engine, tokens):
    return next(i for i, t in enumerate(tokens) if t in engine.tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def serial_repeat(smol):
    """The serial reference: greedy, ignore_eos, on a fresh cache. Its prefixes are the serial
    replies under any smaller max_tokens, and up to its first EOS the reply without ignore_eos."""
    ids = chat_ids(smol, REPEAT)
    ref = run(smol, ids, temperature=0.0, max_tokens=NUM_REPEAT, ignore_eos=True, draft=False)
    assert ref.cached == 0 and ref.drafted == 0 and len(ref.tokens) == NUM_REPEAT
    assert PASSAGE in ref.text  # the model copies faithfully: drafting has something to accept
    return ids, ref


@pytest.fixture(scope="module")
def drafted_repeat(smol, serial_repeat):
    ids, _ = serial_repeat
    return run(smol, ids, temperature=0.0, max_tokens=NUM_REPEAT, ignore_eos=True)


@pytest.mark.slow
def test_drafted_equals_serial_greedy_with_ignore_eos(smol, serial_repeat, drafted_repeat):
    _, ref = serial_repeat
    got = drafted_repeat
    assert got.cached > 0  # the prefix the serial run left in the cache
    assert got.accepted > 0 and got.drafted > 0
    assert got.tokens == ref.tokens and got.text == ref.text and got.finish == ref.finish == "length"
    eos = first_eos(smol, ref.tokens)
    assert eos < NUM_REPEAT - 4  # ignore_eos decoded through the EOS into more text
    # most drafts over the passage were accepted: it took at most a third of the serial rounds
    passage_steps = []
    n = 0
    for step in got.steps:
        passage_steps.append(step)
        n += step.num_tokens
        if n > eos:
            break
    assert sum(s.accepted for s in passage_steps) >= 0.75 * sum(s.drafted for s in passage_steps)
    assert len(passage_steps) <= eos // 3


@pytest.mark.slow
def test_drafted_equals_serial_when_eos_lands_inside_an_accepted_run(smol, serial_repeat):
    ids, ref = serial_repeat
    got = run(smol, ids, temperature=0.0, max_tokens=NUM_REPEAT)
    eos = first_eos(smol, ref.tokens)
    assert got.tokens == ref.tokens[:eos + 1] and got.finish == "stop"
    assert got.text == PASSAGE and ref.text.startswith(got.text)
    assert got.steps[-1].ends_on_a_draft  # the EOS itself was an accepted draft


@pytest.mark.slow
def test_drafted_equals_serial_when_max_tokens_lands_inside_an_accepted_run(smol, serial_repeat, drafted_repeat):
    ids, ref = serial_repeat
    # a round of the unlimited drafted run that appended >= 4 tokens through accepted drafts:
    # end the reply on its second token
    before = 0
    for step in drafted_repeat.steps:
        if step.accepted >= 3 and before > 0:
            break
        before += step.num_tokens
    else:
        raise AssertionError("no accepted run of 3 drafts")
    max_tokens = before + 2
    got = run(smol, ids, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    assert got.tokens == ref.tokens[:max_tokens] and got.finish == "length"
    # the reply limit cut the drafts short; the rows it kept were accepted
    assert got.steps[-1].accepted >= 1 and got.steps[-1].num_tokens == 2
    # the serial path honours the same limit (a literal serial run, not only a prefix)
    serial = run(smol, ids, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, draft=False)
    assert serial.tokens == got.tokens and serial.text == got.text


def _stop_inside_a_run(engine, ref: Run, drafted: Run):
    """A word whose first occurrence completes on an accepted draft with more accepted after it."""
    index = 0
    for step in drafted.steps:
        if step.accepted >= 3 and index > 0:
            for j in range(index, index + step.accepted - 1):
                word = engine.tokenizer.decode([ref.tokens[j]]).strip()
                if len(word) >= 4 and word.isalpha() and ref.text.count(word) == 1:
                    return word, j
        index += step.num_tokens
    raise AssertionError("no stop word inside an accepted run")


@pytest.mark.slow
def test_drafted_equals_serial_when_a_stop_string_lands_inside_an_accepted_run(smol, serial_repeat,
                                                                                drafted_repeat):
    ids, ref = serial_repeat
    word, j = _stop_inside_a_run(smol, ref, drafted_repeat)
    stop = ("never-in-this-reply", word)
    got = run(smol, ids, temperature=0.0, max_tokens=NUM_REPEAT, stop=stop)
    assert got.tokens == ref.tokens[:j + 1] and got.finish == "stop"
    assert got.text == ref.text[:ref.text.index(word)]
    assert got.steps[-1].ends_on_a_draft
    serial = run(smol, ids, temperature=0.0, max_tokens=NUM_REPEAT, stop=stop, draft=False)
    assert serial.tokens == got.tokens and serial.text == got.text and serial.finish == "stop"


@pytest.mark.slow
def test_drafted_fresh_equals_serial_with_a_reused_prefix(smol):
    ids = chat_ids(smol, COPY)
    drafted = run(smol, ids, temperature=0.0, max_tokens=40)
    serial = run(smol, ids, temperature=0.0, max_tokens=40, draft=False)
    assert drafted.cached == 0 and serial.cached > 0
    assert drafted.accepted > 0
    assert drafted.tokens == serial.tokens and drafted.text == serial.text
    assert "Seven silver swans" in drafted.text


SAMPLED = [
    dict(temperature=0.7, seed=1, top_p=0.9),
    dict(temperature=1.0, seed=2, top_k=40),
    dict(temperature=0.8, seed=3, min_p=0.1),
    dict(temperature=1.3, seed=4, top_p=0.95, top_k=50, min_p=0.05),
]


NUM_SAMPLED = 20


@pytest.fixture(scope="module")
def serial_sampled(smol, serial_repeat):
    """Serial references of the repeat prompt under each of SAMPLED (a reused prefix)."""
    ids, _ = serial_repeat
    runs = [run(smol, ids, max_tokens=NUM_SAMPLED, draft=False, **settings) for settings in SAMPLED]
    assert all(r.cached > 0 for r in runs)
    assert len({tuple(r.tokens) for r in runs}) > 1  # the settings and seeds matter
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(SAMPLED)),
                         ids=[",".join(f"{k}={v}" for k, v in s.items()) for s in SAMPLED])
def test_drafted_equals_serial_sampled(smol, serial_repeat, serial_sampled, i):
    ids, _ = serial_repeat
    drafted = run(smol, ids, max_tokens=NUM_SAMPLED, **SAMPLED[i])
    assert drafted.cached > 0 and drafted.accepted > 0
    assert drafted.tokens == serial_sampled[i].tokens and drafted.text == serial_sampled[i].text


# ---- a real loopback server ------------------------------------------------------------------

@dataclass
class Served:
    server: HttpServer
    service: Service
    engine: Engine
    client: openai.OpenAI
    gate: threading.Event      # engine rounds run only while set
    plans: list                # every round: [(req_id, num fed, num rows, rows_prefill, num drafts)]

    def pause(self):
        self.gate.clear()

    def resume(self):
        self.gate.set()
        self.server.wake()

    def wait_queued(self, count: int, timeout=30.0):
        deadline = time.monotonic() + timeout
        while len(self.service.replies) < count:
            assert time.monotonic() < deadline, "requests never reached the engine"
            time.sleep(0.005)

    def rounds_of(self, req_id: str) -> list[int]:
        return [i for i, plan in enumerate(self.plans) if any(r[0] == req_id for r in plan)]


@contextlib.contextmanager
def serving(engine: Engine, name="tiny"):
    service = Service(engine, served_model_of(engine), (name,))
    gate = threading.Event()
    gate.set()
    plans = []
    execute = engine.runner.execute

    def spy(plan):
        plans.append([(r.req_id, len(r.token_ids), len(r.rows), r.rows_prefill, r.num_drafts)
                      for r in plan.requests])
        return execute(plan)

    engine.runner.execute = spy
    server = HttpServer(build_router(service), port=0,
                        tick=lambda: service.tick() if gate.is_set() else False)
    try:
        with running(server):
            client = openai.OpenAI(base_url="http://%s:%d/v1" % server.address, api_key="none",
                                   max_retries=0, timeout=120)
            try:
                yield Served(server, service, engine, client, gate, plans)
            finally:
                gate.set()
                client.close()
    finally:
        del engine.runner.execute  # the class's method again


EXTRA = ("top_k", "min_p", "ignore_eos", "draft", "priority")


def create(client, body: dict, stream=False):
    """POST a chat completion with the openai client; TensorFold's fields go in extra_body."""
    body = dict(body)
    extra = {k: body.pop(k) for k in EXTRA if k in body}
    return client.chat.completions.create(model=body.pop("model", "tiny"), stream=stream,
                                          extra_body=extra or None, **body)


@dataclass
class Reply:
    req_id: str
    text: str
    finish: str
    sha: str
    drafted: int
    accepted: int
    cached: int
    prompt_tokens: int
    done_s: float = 0.0


def complete(client, body: dict) -> Reply:
    r = create(client, body)
    tf = r.model_extra["tensorfold"]
    return Reply(r.id, r.choices[0].message.content, r.choices[0].finish_reason, tf["token_sha"],
                 tf["drafted"], tf["accepted"], r.usage.prompt_tokens_details.cached_tokens,
                 r.usage.prompt_tokens, time.monotonic())


def stream(client, body: dict, on_text=None) -> Reply:
    """A streamed reply: its text is the concatenation of the deltas; usage comes last."""
    pieces, finish, last, req_id = [], None, None, None
    for chunk in create(client, body, stream=True):
        req_id = chunk.id
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
                if on_text:
                    on_text(pieces)
            finish = choice.finish_reason or finish
        last = chunk
    tf = last.model_extra["tensorfold"]
    return Reply(req_id, "".join(pieces), finish, tf["token_sha"], tf["drafted"], tf["accepted"],
                 last.usage.prompt_tokens_details.cached_tokens, last.usage.prompt_tokens, time.monotonic())


class Background:
    """A client call on its own thread; result() re-raises what it raised."""

    def __init__(self, fn):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn):
        try:
            self._value = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in result()
            self._error = e

    def result(self, timeout=120.0):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "no reply in time"
        if self._error is not None:
            raise self._error
        return self._value


def at_once(fns) -> list[Background]:
    return [Background(fn) for fn in fns]


# ---- default model over HTTP --------------------------------------------------------------

@pytest.mark.slow
def test_http_drafted_and_serial_replies_equal_the_engines_serial_run(smol, serial_repeat, drafted_repeat):
    ids, ref = serial_repeat
    word, j = _stop_inside_a_run(smol, ref, drafted_repeat)
    base = dict(model="SmolLM2-135M-Instruct", messages=REPEAT, temperature=0.0)
    with serving(smol, name="SmolLM2-135M-Instruct") as s:
        got = complete(s.client, dict(base, max_tokens=NUM_REPEAT, ignore_eos=True))
        assert got.prompt_tokens == len(ids) and got.cached > 0
        assert got.sha == token_sha(ref.tokens) and got.text == ref.text
        assert got.accepted > 0 and got.finish == "length"
        serial = stream(s.client, dict(base, max_tokens=10, draft=False))
        assert serial.drafted == 0 and serial.sha == token_sha(ref.tokens[:10])
        assert ref.text.startswith(serial.text) and len(serial.text) > 20
        stopped = stream(s.client, dict(base, max_tokens=NUM_REPEAT, stop=[word]))
        assert stopped.accepted > 0 and stopped.finish == "stop"
        assert stopped.sha == token_sha(ref.tokens[:j + 1])
        assert stopped.text == ref.text[:ref.text.index(word)]


@pytest.mark.slow
def test_http_sampled_drafted_replies_equal_the_engines_serial_runs(smol, serial_sampled):
    with serving(smol, name="SmolLM2-135M-Instruct") as s:
        for settings, ref in zip(SAMPLED, serial_sampled):
            got = complete(s.client, dict(model="SmolLM2-135M-Instruct", messages=REPEAT,
                                          max_tokens=NUM_SAMPLED, **settings))
            assert got.accepted > 0 and got.cached > 0
            assert (got.sha, got.text) == (token_sha(ref.tokens), ref.text)


# ---- tiny model: load, decode share, prefix cache, priority, capacity ---------------------------

def user(text):
    return {"role": "user", "content": text}


LOAD = [
    dict(messages=[user("Tell me about the sea.")], max_tokens=24, temperature=0.0),
    dict(messages=[{"role": "system", "content": "You are terse."}, user("List three colors. " * 8)],
         max_tokens=40, temperature=0.7, seed=11, top_p=0.9),
    dict(messages=[user("a b c " * 60)], max_tokens=16, temperature=1.0, seed=12, top_k=30),
    dict(messages=[user("Why is the sky blue?")], max_tokens=56, temperature=1.3, seed=13, min_p=0.05),
    dict(messages=[user("one two three " * 30)], max_tokens=32, temperature=0.0, ignore_eos=True),
    dict(messages=[user("x")], max_tokens=48, temperature=0.9, seed=14, top_p=0.8, top_k=50, min_p=0.02),
    dict(messages=[{"role": "system", "content": "Long system prompt. " * 40}, user("hi")],
         max_tokens=20, temperature=0.5, seed=15),
    dict(messages=[user("Count: 1 2 3 4 5 6 7 8 9 10")], max_tokens=64, temperature=0.0),
]


def tiny_engine(path, **config) -> Engine:
    return Engine(path, EngineConfig(probe=False, **{"kv_cache_gib": 0.01, **config}))


@pytest.fixture(scope="module")
def solo(tiny_llama):
    """Solo references: one request at a time, drafts off, on their own server."""
    done = {}
    with serving(tiny_engine(tiny_llama, max_num_seqs=1, drafting=False)) as s:
        def reference(body: dict) -> Reply:
            key = json.dumps(body, sort_keys=True)
            if key not in done:
                done[key] = complete(s.client, dict(body, draft=False))
                assert done[key].drafted == 0
            return done[key]
        yield reference


def assert_equal_solo(reply: Reply, ref: Reply):
    assert (reply.sha, reply.text, reply.finish) == (ref.sha, ref.text, ref.finish)


@pytest.mark.parametrize("draft", [True, False], ids=["drafts", "serial"])
def test_concurrent_replies_equal_their_solo_runs(tiny_llama, solo, draft):
    refs = [solo(body) for body in LOAD]
    with serving(tiny_engine(tiny_llama, max_num_seqs=4, max_tokens_per_step=64)) as s:
        s.pause()  # all 8 arrive before the first round
        calls = at_once([lambda b=b: complete(s.client, dict(b, draft=draft)) for b in LOAD])
        s.wait_queued(len(LOAD))
        s.resume()
        results = [c.result() for c in calls]
        for got, ref in zip(results, refs):
            assert_equal_solo(got, ref)
        sizes = [len(plan) for plan in s.plans]
        assert max(sizes) == 4  # --parallel 4: four lanes filled, never more
        assert any(any(r[3] for r in plan) and any(not r[3] for r in plan) for plan in s.plans), \
            "no round mixed a prompt chunk with decode rows"
        if draft:
            assert sum(r.drafted for r in results) > 0
            assert any(any(r[4] for r in plan) and len(plan) > 1 for plan in s.plans), \
                "no drafted rows verified beside other requests"
        else:
            assert all(r.drafted == 0 for r in results)


LONG = [user(" ".join(f"w{i}" for i in range(200)))]   # ~700 tokens: 11 chunks of 64


@pytest.mark.parametrize("share", [0.25, 0.0])
def test_long_prompt_arriving_mid_decode(tiny_llama, solo, share):
    shorts = [dict(messages=[user(f"Story number {i}.")], max_tokens=100, temperature=0.8, seed=30 + i,
                   ignore_eos=True) for i in range(3)]
    long = dict(messages=LONG, max_tokens=16, temperature=0.6, seed=40)
    refs = [solo(b) for b in shorts] + [solo(long)]
    with serving(tiny_engine(tiny_llama, max_num_seqs=4, max_tokens_per_step=64, decode_share=share)) as s:
        started = [threading.Event() for _ in shorts]
        calls = at_once([lambda i=i, b=b: stream(s.client, b, on_text=lambda _: started[i].set())
                         for i, b in enumerate(shorts)])
        for e in started:
            assert e.wait(60)
        s.pause()  # the shorts are decoding: the long prompt arrives now
        long_call = Background(lambda: complete(s.client, long))
        s.wait_queued(4)
        s.resume()
        results = [c.result() for c in calls]
        long_got = long_call.result()
        for got, ref in zip(results + [long_got], refs):
            assert_equal_solo(got, ref)
        long_id, short_ids = long_got.req_id, {r.req_id for r in results}
        chunks = [i for i in s.rounds_of(long_id) if any(r[0] == long_id and r[3] for r in s.plans[i])]
        assert len(chunks) >= 10
        during = s.plans[chunks[0]:chunks[-1] + 1]
        decode_rows = sum(1 for plan in during for r in plan if r[0] in short_ids)
        # the shorts were still decoding after the long prompt's prefill
        assert any(r[0] in short_ids for plan in s.plans[chunks[-1] + 1:] for r in plan)
        if share > 0:
            assert decode_rows >= len(chunks) * len(shorts)
            assert any(all(r[0] in short_ids for r in plan) for plan in during), "no decode-only round"
        else:
            assert decode_rows == 0


SYSTEM = ("You are the archivist of a harbor town. You answer questions about ships, tides, "
          "weather and the history of the port, citing the logbooks you keep. ") * 6


def test_cached_system_prompt_reply_equals_the_fresh_one(tiny_llama):
    a = dict(messages=[{"role": "system", "content": SYSTEM}, user("Which ship came in first?")],
             max_tokens=24, temperature=0.7, seed=5)
    b = dict(messages=[{"role": "system", "content": SYSTEM}, user("What was the weather?")],
             max_tokens=96, temperature=1.0, seed=6, ignore_eos=True)
    with serving(tiny_engine(tiny_llama)) as s:
        fresh = complete(s.client, b)
        assert fresh.cached == 0 and fresh.prompt_tokens > 200
        other = complete(s.client, a)
        assert other.cached >= 192  # the system prompt's full blocks
        again = complete(s.client, b)
        assert again.cached >= other.cached
        assert_equal_solo(again, fresh)
        streamed = stream(s.client, dict(b, draft=False))
        assert streamed.cached >= other.cached
        assert_equal_solo(streamed, fresh)


def test_a_prompt_whose_reply_ends_in_its_first_round_is_cached(tiny_llama):
    engine = tiny_engine(tiny_llama)
    ids = engine.tokenizer.encode(SYSTEM, add_special_tokens=True)
    warm = run(engine, ids, temperature=0.0, max_tokens=1)
    assert warm.cached == 0 and len(ids) > 96
    again = run(engine, ids + [1], temperature=0.0, max_tokens=1)
    assert again.cached == len(ids) // 32 * 32


def _tiny_bytes_per_block(path, block_size=32):
    """A block's bytes in the cache tiny_engine allocates (--kv-dtype auto: a dense model's own
    dtype; the record of V's exponents where the cpu backend's op set keeps one)."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    layer = PagedKV(cfg["num_key_value_heads"], cfg["head_dim"])
    return cfg["num_hidden_layers"] * layer.bytes_per_token(kv_cache_dtype(EngineConfig(), quantized=False),
                                                            keeps_v_exponents(backend_ops("cpu"))) * block_size


def test_eviction_under_a_tiny_cache_budget_keeps_replies_exact(tiny_llama, solo):
    systems = [f"Archive {n}. " + SYSTEM[:700] for n in ("one", "two", "three")]
    body = lambda sys, q: dict(messages=[{"role": "system", "content": sys}, user(q)],  # noqa: E731
                               max_tokens=20, temperature=0.9, seed=8)
    budget = 3 * _tiny_bytes_per_block(tiny_llama) / 2**30
    engine = tiny_engine(tiny_llama, context=512, kv_cache_gib=1e-6, prompt_cache_gib=budget * 1.001)
    assert engine.pool.max_cached_blocks == 3 and engine.pool.num_blocks == 16
    with serving(engine) as s:
        first = complete(s.client, body(systems[0], "Q1"))
        assert first.cached == 0
        full = first.prompt_tokens // 32 * 32
        partial = complete(s.client, body(systems[0], "Q2"))
        assert 0 < partial.cached == 3 * 32 < full  # the budget kept only the first 3 blocks
        assert_equal_solo(partial, solo(body(systems[0], "Q2")))
        for system in systems[1:]:
            assert_equal_solo(complete(s.client, body(system, "Q1")), solo(body(system, "Q1")))
        evicted = complete(s.client, body(systems[0], "Q1"))
        assert evicted.cached == 0
        assert_equal_solo(evicted, first)
        assert_equal_solo(first, solo(body(systems[0], "Q1")))
        assert engine.pool.num_cached <= 3


@pytest.mark.parametrize("prompt_cache_gib", [None, 0.0], ids=["cached-replay", "full-replay"])
def test_foreground_overtakes_a_background_request_on_one_lane(tiny_llama, solo, prompt_cache_gib):
    bg = dict(messages=[user("Write a long background report.")], max_tokens=160, temperature=0.8,
              seed=21, ignore_eos=True, priority="background")
    fg = dict(messages=[user("Quick question?")], max_tokens=12, temperature=0.0)
    bg_ref, fg_ref = solo({k: v for k, v in bg.items() if k != "priority"}), solo(fg)
    engine = tiny_engine(tiny_llama, max_num_seqs=1, prompt_cache_gib=prompt_cache_gib)
    with serving(engine) as s:
        decoding = threading.Event()
        bg_call = Background(lambda: stream(s.client, bg,
                                            on_text=lambda pieces: len(pieces) >= 8 and decoding.set()))
        assert decoding.wait(60)
        s.pause()  # the background reply is decoding: the foreground request arrives now
        fg_call = Background(lambda: complete(s.client, fg))
        s.wait_queued(2)
        s.resume()
        fg_got, bg_got = fg_call.result(), bg_call.result()
        assert fg_got.done_s < bg_got.done_s  # the foreground request finished first
        assert engine.scheduler.num_preemptions >= 1
        # once admitted, the foreground request had the lane to itself until it finished
        fg_rounds = s.rounds_of(fg_got.req_id)
        assert all(len(s.plans[i]) == 1 for i in fg_rounds)
        assert not any(r[0] == bg_got.req_id for plan in s.plans[fg_rounds[0]:fg_rounds[-1] + 1] for r in plan)
        # the background reply resumed seamlessly: no text missing or sent twice
        assert_equal_solo(bg_got, bg_ref)
        assert_equal_solo(fg_got, fg_ref)
        if prompt_cache_gib == 0.0:
            replays = [r for i in s.rounds_of(bg_got.req_id) if i > fg_rounds[-1]
                       for r in s.plans[i] if r[0] == bg_got.req_id and r[3]]
            assert replays and sum(r[2] for r in replays) > 8, "the replay checked nothing"


def test_oversized_requests_get_400_and_the_server_keeps_serving(tiny_llama):
    with serving(tiny_engine(tiny_llama, context=256)) as s:
        with pytest.raises(openai.BadRequestError) as e:
            create(s.client, dict(messages=[user("hello there")], max_tokens=250))
        assert e.value.status_code == 400
        message = e.value.body["message"]
        assert "256" in message and "250" in message
        with pytest.raises(openai.BadRequestError):
            create(s.client, dict(messages=[user(" ".join(f"w{i}" for i in range(100)))], max_tokens=1))
        assert complete(s.client, dict(messages=[user("hello there")], max_tokens=4)).finish == "length"


def test_a_flood_beyond_the_pool_is_queued_and_replies_equal_solo(tiny_llama, solo):
    flood = [dict(messages=[user(f"Request {i}: " + "tell me more " * (2 + i))], max_tokens=40 + 4 * i,
                  temperature=[0.0, 0.7, 1.1][i % 3], seed=50 + i, ignore_eos=True,
                  **({"top_p": 0.9} if i % 2 else {"top_k": 40}))
             for i in range(10)]
    refs = [solo(b) for b in flood]
    engine = tiny_engine(tiny_llama, context=192, kv_cache_gib=1e-6, max_num_seqs=8, max_tokens_per_step=64)
    assert engine.pool.num_blocks == 6  # one window: any one request fits, not ten
    with serving(engine) as s:
        s.pause()
        calls = at_once([lambda b=b: complete(s.client, b) for b in flood])
        s.wait_queued(len(flood))
        s.resume()
        results = [c.result() for c in calls]
        for got, ref in zip(results, refs):
            assert_equal_solo(got, ref)
        assert engine.scheduler.num_preemptions > 0
        # a real preemption: a reply recomputed with check rows, not only a request turned back
        assert any(r[3] and r[2] > 1 for plan in s.plans for r in plan)
        assert max(len(plan) for plan in s.plans) > 1
        assert sum(r.drafted for r in results) > 0
        assert engine.pool.num_free == engine.pool.num_blocks
