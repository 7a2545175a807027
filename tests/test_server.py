"""The whole server over a real loopback socket, spoken to by the official `openai` client.

tests/serving.py runs the server (serve_forever on a daemon thread of the test process, the
loop itself single-threaded) and gives the clients. The model is a tiny
random checkpoint: it writes gibberish, which is all a protocol test needs. Raw httpx (the
openai client's own HTTP library) reads the SSE framing and sends the malformed bodies.

Two servers:
- `served`: the tiny llama, window 1024, aliases, a default reply limit of 16 tokens;
- `eos_served`: a tiny qwen3 whose weights are edited so it often writes its end token (the
  random model almost never does), with a 64-token window, for ignore_eos and the window rules.
"""
import hashlib
import json
import math
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from malformed_cases import (ACCEPTED_CHAT_CASES, BASE_CHAT_BODY, BASE_COMPLETION_BODY,
                             MALFORMED_CHAT_CASES, MALFORMED_COMPLETION_CASES)
from serving import Served, check_error, post, serving
from tensorfold.backends import backend_ops
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.sampling.params import SamplingParams
from tensorfold.server import ServeSettings

NAME = "tiny-llama"
ALIASES = ("alias-a", "alias-b")
DEFAULT_MAX_TOKENS = 16
EOS_WINDOW = 64
HEALTH_COUNTERS = ("requests_total", "completion_tokens_total", "prompt_tokens_total",
                   "cached_tokens_total", "prefill_seconds_total", "decode_seconds_total",
                   "rounds_total", "drafted_total", "accepted_total")
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def served(tiny_llama):
    settings = ServeSettings(model=tiny_llama, port=0, served_model_name=NAME, aliases=ALIASES,
                             max_tokens=DEFAULT_MAX_TOKENS, engine=EngineConfig(probe=False))
    with serving(settings) as s:
        yield s


def make_eos_prone(src: str, dst: str, eos_id: int) -> str:
    """Copy a tiny qwen3 checkpoint and edit it so its end token has a steady ~10% chance.

    Embedding column 0 is a large constant, so the last hidden state's dimension 0 is large and
    positive whatever the context; the lm_head reads dimension 0 only for the end token.
    """
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"][:, 0] = 8.0
    head = tensors["lm_head.weight"]   # [vocab, hidden]
    head[:, 0] = 0.0
    head[eos_id] = 0.0
    head[eos_id, 0] = 5.0
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def eos_served(tiny_qwen3, tmp_path_factory, smollm2_tokenizer):
    model = make_eos_prone(tiny_qwen3, str(tmp_path_factory.mktemp("eos") / "tiny-eos"),
                           smollm2_tokenizer.eos_token_id)
    settings = ServeSettings(model=model, port=0,
                             engine=EngineConfig(probe=False, context=EOS_WINDOW))
    with serving(settings) as s:
        yield s


# -- helpers ------------------------------------------------------------------------------------

def token_sha(ids) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:12]


def check_usage(usage: dict, tf: dict) -> None:
    """The usage and tensorfold blocks every reply carries, as plain dicts."""
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert type(usage[key]) is int
    assert usage["prompt_tokens"] >= 1 and usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert type(cached) is int and 0 <= cached < usage["prompt_tokens"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 0
    assert set(tf) >= {"token_sha", "ttft_s", "decode_tps", "prefill_s", "drafted", "accepted"}
    assert re.fullmatch(r"[0-9a-f]{12}", tf["token_sha"])
    assert isinstance(tf["ttft_s"], float) and tf["ttft_s"] >= 0
    assert isinstance(tf["prefill_s"], (int, float)) and tf["prefill_s"] >= 0
    if usage["completion_tokens"] > 1:
        assert isinstance(tf["decode_tps"], float) and tf["decode_tps"] > 0
    assert type(tf["drafted"]) is int and type(tf["accepted"]) is int
    assert 0 <= tf["accepted"] <= tf["drafted"]


def dumped(obj) -> dict:
    """An openai reply object back as the JSON the server sent (extra fields included)."""
    return obj.model_dump(exclude_unset=True)


def sse_data(text: str) -> list[str]:
    """The data of each server-sent event, in order; every event is data lines only."""
    assert text.endswith("\n\n"), text[-200:]
    events = []
    for block in text[:-2].split("\n\n"):
        lines = block.split("\n")
        assert all(line.startswith("data: ") for line in lines), block
        events.append("\n".join(line[len("data: "):] for line in lines))
    return events


def chat_stream(s: Served, **kwargs):
    """(text pieces of the content chunks, all chunks) of a streamed chat reply."""
    chunks = list(s.client.chat.completions.create(model=NAME, messages=CHAT, stream=True, **kwargs))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    return pieces, chunks


# -- models, names, routes ----------------------------------------------------------------------

def test_models_lists_served_name_and_aliases(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [NAME, *ALIASES]
    assert all(m.object == "model" and m.owned_by for m in models.data)


def test_an_alias_is_accepted_as_model_and_an_unknown_model_is_404(served):
    reply = served.client.chat.completions.create(model=ALIASES[1], messages=CHAT, max_tokens=2)
    assert reply.model == ALIASES[1]
    reply = served.client.completions.create(model=ALIASES[0], prompt="Hello", max_tokens=2)
    assert reply.model == ALIASES[0]
    omitted = post(served, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}).json()
    assert omitted["model"] == NAME
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as info:
            served.client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2,
                                                  stream=stream)
        assert (info.value.code, info.value.param) == ("model_not_found", "model")
        r = post(served, "/v1/completions", {"model": "nope", "prompt": "Hi", "stream": stream})
        assert check_error(r, 404, "model")["code"] == "model_not_found"


def test_an_unknown_stored_response_is_404_and_a_wrong_method_405(served):
    for method in ("GET", "DELETE"):
        check_error(served.http.request(method, "/v1/responses/resp_1"), 404, "response_id")
    r = served.http.get("/v1/chat/completions")
    check_error(r, 405, None)
    assert "POST" in r.headers["allow"]


def test_health_reports_every_counter_and_counts_a_request(served):
    before = served.health()
    assert before["status"] == "ok" and before["busy"] is False and before["requests_running"] == 0
    assert before["context_length"] == 1024
    assert set(before["streams"]) == {"decoding", "prefilling", "maximum"}
    assert before["streams"]["maximum"] == 8
    assert before["ops"] == backend_ops("cpu").NAME  # the C++ kernels where built, else "torch"
    assert before["weights"] == served.engine.info.weights == {"float32": 9} and sum(before["weights"].values()) > 0
    assert before["kv_dtype"] == "float32"  # --kv-dtype auto: a dense model's own dtype
    for key in HEALTH_COUNTERS:
        assert isinstance(before[key], (int, float)) and before[key] >= 0, key
    reply = served.client.completions.create(model=NAME, prompt="Count me", max_tokens=5, seed=1)
    after = served.health()
    u, tf = reply.usage, reply.tensorfold
    assert after["requests_total"] == before["requests_total"] + 1
    assert after["prompt_tokens_total"] == before["prompt_tokens_total"] + u.prompt_tokens
    assert after["completion_tokens_total"] == before["completion_tokens_total"] + u.completion_tokens
    assert after["cached_tokens_total"] == (before["cached_tokens_total"]
                                            + u.prompt_tokens_details.cached_tokens)
    assert after["drafted_total"] == before["drafted_total"] + tf["drafted"]
    assert after["accepted_total"] == before["accepted_total"] + tf["accepted"]
    assert after["rounds_total"] >= before["rounds_total"] + 1
    assert after["decode_seconds_total"] > before["decode_seconds_total"]
    assert after["busy"] is False and after["requests_running"] == 0


# -- replies: plain and streamed ----------------------------------------------------------------

def test_chat_plain_and_streamed_give_the_same_reply(served):
    kwargs = dict(max_tokens=10, seed=7, temperature=1.0)
    reply = served.client.chat.completions.create(model=NAME, messages=CHAT, **kwargs)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert isinstance(choice.message.content, str) and choice.message.content
    body = dumped(reply)
    check_usage(body["usage"], body["tensorfold"])
    assert reply.usage.completion_tokens == 10

    pieces, chunks = chat_stream(served, **kwargs)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(pieces) == choice.message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    streamed = dumped(last)
    check_usage(streamed["usage"], streamed["tensorfold"])
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert streamed["usage"][key] == body["usage"][key]
    assert streamed["tensorfold"]["token_sha"] == body["tensorfold"]["token_sha"]


def test_completion_plain_and_streamed_give_the_same_reply(served):
    kwargs = dict(model=NAME, prompt="Once upon a time", max_tokens=9, seed=3, temperature=1.0)
    reply = served.client.completions.create(**kwargs)
    assert reply.object == "text_completion" and reply.choices[0].finish_reason == "length"
    body = dumped(reply)
    check_usage(body["usage"], body["tensorfold"])
    chunks = list(served.client.completions.create(stream=True, **kwargs))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = dumped(chunks[-1])
    assert last["choices"] == []
    check_usage(last["usage"], last["tensorfold"])
    assert last["usage"]["completion_tokens"] == body["usage"]["completion_tokens"] == 9
    assert last["tensorfold"]["token_sha"] == body["tensorfold"]["token_sha"]


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_raw_stream_ends_with_usage_then_done(served, route):
    body = {"max_tokens": 4, "seed": 1, "stream": True}
    if route == "chat":
        path, body["messages"] = "/v1/chat/completions", CHAT
    else:
        path, body["prompt"] = "/v1/completions", "Hello there"
    with served.http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = sse_data(text)
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    usage_event = objs[-1]
    assert usage_event["choices"] == []
    check_usage(usage_event["usage"], usage_event["tensorfold"])
    assert usage_event["usage"]["completion_tokens"] == 4
    assert objs[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in o and o["choices"][0]["finish_reason"] is None for o in objs[:-2])


def test_usage_comes_last_even_when_include_usage_is_false(served):
    body = {"messages": CHAT, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": False}}
    events = sse_data(post(served, "/v1/chat/completions", body).text)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    check_usage(last["usage"], last["tensorfold"])


def test_concurrent_replies_equal_their_solo_runs(served):
    def fetch(body):
        r = post(served, "/v1/completions", body)
        assert r.status_code == 200
        if not body["stream"]:
            reply = r.json()
            return reply["choices"][0]["text"], reply["tensorfold"]["token_sha"]
        objs = [json.loads(e) for e in sse_data(r.text)[:-1]]
        return "".join(o["choices"][0]["text"] for o in objs if o["choices"]), objs[-1]["tensorfold"]["token_sha"]

    bodies = [{"prompt": f"Story number {i}:", "max_tokens": 6, "seed": i, "temperature": 1.0,
               "stream": i % 2 == 1} for i in range(4)]
    solo = [fetch(b) for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(fetch, bodies))
    assert together == solo


def test_token_sha_fingerprints_the_reply_token_ids(served, tiny_llama):
    prompt_ids = [1, 504, 2947, 314, 253, 1135]
    reply = served.client.completions.create(model=NAME, prompt=prompt_ids, max_tokens=6, seed=11,
                                             temperature=1.0)
    # The same request on a private engine: its reply token ids must give the server's sha.
    engine = Engine(tiny_llama, EngineConfig(probe=False))
    solo = engine.generate(prompt_ids, SamplingParams(max_tokens=6, seed=11, temperature=1.0))
    assert len(solo.token_ids) == reply.usage.completion_tokens == 6
    assert reply.tensorfold["token_sha"] == token_sha(solo.token_ids)
    assert reply.choices[0].text == solo.text
    assert reply.usage.prompt_tokens == len(prompt_ids)


def test_draft_false_gives_the_same_tokens_and_drafts_nothing(served):
    # Greedy, the tiny model repeats a word at once: prompt lookup has something to draft.
    kwargs = dict(model=NAME, prompt="x", max_tokens=12, temperature=0)
    drafted = served.client.completions.create(**kwargs)
    serial = served.client.completions.create(**kwargs, extra_body={"draft": False})
    assert drafted.tensorfold["drafted"] > 0, drafted.choices[0].text
    assert serial.tensorfold["drafted"] == serial.tensorfold["accepted"] == 0
    assert serial.tensorfold["token_sha"] == drafted.tensorfold["token_sha"]
    assert serial.choices[0].text == drafted.choices[0].text


def test_a_repeated_prompt_reports_cached_tokens(served):
    # A prompt no other test sends, longer than one 32-token cache block.
    prompt = "zebra quartz " * 24 + str(time.time_ns())
    first = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    second = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 32


def test_default_reply_limit_is_the_served_max_tokens(served):
    reply = served.client.completions.create(model=NAME, prompt="Tell me", seed=2)
    assert reply.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert reply.choices[0].finish_reason == "length"
    reply = served.client.chat.completions.create(model=NAME, messages=CHAT, seed=2,
                                                  max_completion_tokens=3)
    assert reply.usage.completion_tokens == 3


# -- completions: token ids and chat bodies -----------------------------------------------------

def test_completions_take_token_ids_and_refuse_out_of_vocabulary(served):
    vocab = served.engine.tokenizer.vocab_size
    reply = served.client.completions.create(model=NAME, prompt=[1, 2, vocab - 1], max_tokens=2)
    assert reply.usage.prompt_tokens == 3
    nested = post(served, "/v1/completions", {"prompt": [[5, 6, 7, 8]], "max_tokens": 2})
    assert nested.status_code == 200 and nested.json()["usage"]["prompt_tokens"] == 4
    as_text = post(served, "/v1/completions", {"prompt": "Hi there", "max_tokens": 1}).json()
    in_list = post(served, "/v1/completions", {"prompt": ["Hi there"], "max_tokens": 1}).json()
    assert in_list["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"]
    for stream in (False, True):
        r = post(served, "/v1/completions", {"prompt": [5, vocab, 7], "max_tokens": 2, "stream": stream})
        check_error(r, 400, "prompt[1]")
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model=NAME, prompt=[3, 10**6], max_tokens=2)
    assert info.value.param == "prompt[1]"


def test_completions_body_with_messages_is_handled_as_chat(served):
    body = {"messages": CHAT, "max_tokens": 4, "seed": 9}
    as_chat = post(served, "/v1/chat/completions", body).json()
    via_completions = post(served, "/v1/completions", body).json()
    assert via_completions["object"] == "chat.completion"
    assert via_completions["choices"][0]["message"]["content"] == as_chat["choices"][0]["message"]["content"]
    assert via_completions["usage"]["prompt_tokens"] == as_chat["usage"]["prompt_tokens"]
    assert via_completions["tensorfold"]["token_sha"] == as_chat["tensorfold"]["token_sha"]
    r = post(served, "/v1/completions", {**body, "stream": True})
    events = sse_data(r.text)
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"


# -- stop strings -------------------------------------------------------------------------------

def pick_stops(pieces: list[str]) -> tuple[str, str]:
    """From a streamed reply's chunks: a stop string inside one chunk (not at its start), and
    one spanning two chunks; each first occurs where it was taken, and at least one chunk
    follows its end (so the stopped reply is shorter in tokens too)."""
    text = "".join(pieces)
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    inside = spanning = None
    for i in range(1, len(pieces) - 1):
        p = pieces[i]
        for a in range(1, len(p) - 2):
            s = p[a:a + 3]
            if inside is None and s.strip() and text.find(s) == starts[i] + a:
                inside = s
        q = pieces[i + 1] if i + 2 < len(pieces) else ""
        if spanning is None and len(p) >= 2 and len(q) >= 2:
            s = p[-2:] + q[:2]
            if text.find(s) == starts[i] + len(p) - 2:
                spanning = s
    assert inside and spanning, f"no usable stop strings in {pieces!r}"
    return inside, spanning


def test_stop_strings_inside_and_across_streamed_chunks(served):
    kwargs = dict(max_tokens=12, seed=21, temperature=1.0)
    pieces, chunks = chat_stream(served, **kwargs)
    text = "".join(pieces)
    full_tokens = chunks[-1].usage.completion_tokens
    assert full_tokens == 12 and len(pieces) >= 6
    for stop in pick_stops(pieces):
        expected = text[:text.find(stop)]
        for stop_field in (stop, ["never-in-gibberish", stop]):
            reply = served.client.chat.completions.create(model=NAME, messages=CHAT, stop=stop_field,
                                                          **kwargs)
            assert reply.choices[0].message.content == expected, stop
            assert reply.choices[0].finish_reason == "stop"
            assert reply.usage.completion_tokens < full_tokens
            got, stop_chunks = chat_stream(served, stop=stop_field, **kwargs)
            assert "".join(got) == expected
            assert [c.choices[0].finish_reason for c in stop_chunks if c.choices][-1] == "stop"
            assert stop_chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
            assert stop_chunks[-1].tensorfold["token_sha"] == reply.tensorfold["token_sha"]


def test_text_held_back_for_a_stop_that_never_completes_is_released_at_the_end(served):
    kwargs = dict(max_tokens=8, seed=22, temperature=1.0)
    pieces, _ = chat_stream(served, **kwargs)
    text = "".join(pieces)
    stop = text[-3:] + "\u2603never"   # its start ends the reply; the whole never occurs
    reply = served.client.chat.completions.create(model=NAME, messages=CHAT, stop=stop, **kwargs)
    assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == "length"
    got, chunks = chat_stream(served, stop=stop, **kwargs)
    assert "".join(got) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stop_string_on_completions_streamed(served):
    kwargs = dict(model=NAME, prompt="The weather", max_tokens=10, seed=4, temperature=1.0)
    chunks = list(served.client.completions.create(stream=True, **kwargs))
    pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    _, spanning = pick_stops(pieces)
    text = "".join(pieces)
    stopped = list(served.client.completions.create(stream=True, stop=[spanning], **kwargs))
    assert "".join(c.choices[0].text for c in stopped if c.choices) == text[:text.find(spanning)]
    assert [c.choices[0].finish_reason for c in stopped if c.choices][-1] == "stop"


# -- ignore_eos (a model edited to write its end token often) ---------------------------------

def find_eos_reply(s: Served, eos_text: str, **kwargs):
    """A seed whose sampled reply ends on the end token after a few tokens of text."""
    for seed in range(40):
        reply = s.client.completions.create(model=s.server.service.model_names[0], seed=seed,
                                            **kwargs)
        if reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens >= 3:
            assert eos_text not in reply.choices[0].text
            return seed, reply
    pytest.fail("the edited model never wrote its end token")


def test_ignore_eos_decodes_past_the_end_token(eos_served):
    eos_text = eos_served.engine.tokenizer.decode([eos_served.engine.tokenizer.eos_token_ids[0]])
    assert eos_text == "<|im_end|>"
    kwargs = dict(prompt="Once upon a time", max_tokens=12, temperature=1.0)
    seed, ended = find_eos_reply(eos_served, eos_text, **kwargs)
    n, text = ended.usage.completion_tokens, ended.choices[0].text
    model = eos_served.server.service.model_names[0]
    common = dict(model=model, prompt=kwargs["prompt"], temperature=1.0, seed=seed,
                  extra_body={"ignore_eos": True})

    # Up to the end token: the same tokens (usage counts the end token), its text now included.
    same = eos_served.client.completions.create(max_tokens=n, **common)
    assert same.choices[0].finish_reason == "length"
    assert same.tensorfold["token_sha"] == ended.tensorfold["token_sha"]
    assert same.choices[0].text == text + eos_text

    # Past it: the reply goes on to the limit, streamed or not.
    longer = eos_served.client.completions.create(max_tokens=n + 6, **common)
    assert longer.choices[0].finish_reason == "length"
    assert longer.usage.completion_tokens == n + 6
    assert longer.choices[0].text.startswith(text + eos_text)
    assert len(longer.choices[0].text) > len(text + eos_text)
    chunks = list(eos_served.client.completions.create(max_tokens=n + 6, stream=True, **common))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == longer.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].tensorfold["token_sha"] == longer.tensorfold["token_sha"]

    # Stop strings stay active under ignore_eos: the end token's own text can be one.
    stopped = eos_served.client.completions.create(max_tokens=n + 6, stop=[eos_text], **common)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text
    assert stopped.usage.completion_tokens == n


# -- the context window -------------------------------------------------------------------------

def test_a_reply_limit_past_the_window_is_400_with_the_counts(eos_served, served):
    prompt = list(range(100, 140))     # 40 tokens of a 64-token window
    for stream in (False, True):
        r = post(eos_served, "/v1/completions", {"prompt": prompt, "max_tokens": 30, "stream": stream})
        err = check_error(r, 400, "max_tokens")
        assert err["code"] == "context_length_exceeded"
        for number in ("64", "70", "40", "30", "24"):   # window, asked, prompt, reply, room
            assert re.search(rf"\b{number}\b", err["message"]), err["message"]
    fits = eos_served.client.completions.create(model=eos_served.server.service.model_names[0],
                                                prompt=prompt, max_tokens=24,
                                                extra_body={"ignore_eos": True})
    assert fits.usage.total_tokens == EOS_WINDOW
    with pytest.raises(openai.BadRequestError) as info:
        served.client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1024, stream=True)
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    r = post(eos_served, "/v1/completions", {"prompt": list(range(1, 65)), "max_tokens": 1})
    assert check_error(r, 400, "prompt")["code"] == "context_length_exceeded"


def test_without_a_reply_limit_the_default_is_capped_to_the_window(eos_served):
    prompt = list(range(200, 256))     # 56 tokens: room for 8
    body = {"prompt": prompt, "ignore_eos": True, "seed": 3}
    reply = post(eos_served, "/v1/completions", body).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == EOS_WINDOW - len(prompt)
    events = sse_data(post(eos_served, "/v1/completions", {**body, "stream": True}).text)
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == EOS_WINDOW - len(prompt)
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"


# -- malformed bodies: 400 before any token and before a stream opens ---------------------------

def non_finite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(non_finite(v) for v in value)
    return False


def case_id(case):
    return json.dumps(case[0])[:50]


def check_refused(s: Served, path: str, body: dict, param: str, fields: dict) -> None:
    r = post(s, path, body)
    if non_finite(fields):
        # NaN and Infinity are not JSON: the body parser refuses them before the fields are read,
        # so the 400 names no field.
        err = check_error(r, 400, None)
        assert "not valid JSON" in err["message"]
    else:
        check_error(r, 400, param)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", MALFORMED_CHAT_CASES, ids=case_id)
def test_malformed_chat_field_is_400(served, case, stream):
    fields, param = case
    check_refused(served, "/v1/chat/completions", {**BASE_CHAT_BODY, "stream": stream, **fields},
                  param, fields)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", MALFORMED_COMPLETION_CASES, ids=case_id)
def test_malformed_completion_field_is_400(served, case, stream):
    fields, param = case
    check_refused(served, "/v1/completions", {**BASE_COMPLETION_BODY, "stream": stream, **fields},
                  param, fields)


def test_malformed_json_bodies_are_400(served):
    for content in (b"{", b"[1, 2]", b"null", b'{"messages": NaN}'):
        r = served.http.post("/v1/chat/completions", content=content,
                             headers={"content-type": "application/json"})
        check_error(r, 400, None)


def test_accepted_bodies_are_served(served):
    def send(case):
        fields, _ = case
        return fields, post(served, "/v1/chat/completions", {**BASE_CHAT_BODY, **fields})

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, ACCEPTED_CHAT_CASES))
    for fields, r in results:
        assert r.status_code == 200, (fields, r.text)
        if fields.get("stream"):
            events = sse_data(r.text)
            assert events[-1] == "[DONE]" and "usage" in json.loads(events[-2])
        else:
            reply = r.json()
            assert reply["object"] == "chat.completion"
            assert isinstance(reply["choices"][0]["message"]["content"], str)
            assert reply["usage"]["completion_tokens"] <= DEFAULT_MAX_TOKENS


# -- a generation error -------------------------------------------------------------------------

class FailOnce:
    """Replaces the engine runner's execute() for one round: that round raises."""

    def __init__(self, runner):
        self.runner, self.original = runner, runner.execute
        self.fired = threading.Event()

    def __call__(self, plan):
        self.runner.execute = self.original
        self.fired.set()
        raise RuntimeError("injected kernel failure")


def test_generation_error_is_500_or_an_error_event_and_serving_goes_on(served, monkeypatch):
    runner = served.engine.runner
    monkeypatch.setattr(runner, "execute", FailOnce(runner))
    with pytest.raises(openai.InternalServerError) as info:
        served.client.completions.create(model=NAME, prompt="Fail me", max_tokens=4)
    assert info.value.status_code == 500 and info.value.type == "server_error"
    assert "injected kernel failure" in info.value.message

    monkeypatch.setattr(runner, "execute", FailOnce(runner))
    r = post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_data(r.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert error["error"]["type"] == "server_error"
    assert all("error" not in json.loads(e) for e in events[:-2])

    monkeypatch.setattr(runner, "execute", FailOnce(runner))
    with pytest.raises(openai.APIError) as info:
        list(served.client.completions.create(model=NAME, prompt="Fail me", max_tokens=4, stream=True))
    assert "injected kernel failure" in info.value.message

    health = served.health()
    assert health["requests_running"] == 0 and health["busy"] is False
    assert served.engine.pool.num_free == served.engine.pool.num_blocks
    reply = served.client.completions.create(model=NAME, prompt="Then succeed", max_tokens=3)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def test_health_counters_never_go_back_after_a_generation_error(served, monkeypatch):
    runner, original = served.engine.runner, served.engine.runner.execute
    fail = threading.Event()

    def execute(plan):
        if fail.is_set():
            runner.execute = original
            raise RuntimeError("injected kernel failure")
        return original(plan)

    monkeypatch.setattr(runner, "execute", execute)
    body = {"messages": CHAT, "max_tokens": 200, "stream": True}
    with served.http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        seen = 0
        while seen < 4:   # the role chunk and three tokens
            seen += '"content"' in next(lines)
        mid = served.health()
        assert mid["requests_running"] == 1
        fail.set()
        rest = "\n".join(lines)
    assert '"server_error"' in rest and rest.rstrip().endswith("data: [DONE]")
    after = served.health()
    assert after["requests_running"] == 0
    for key in HEALTH_COUNTERS:
        assert after[key] >= mid[key], key
