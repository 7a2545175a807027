"""Tools end to end: the default model (its card, smollm2: Hermes JSON calls through the card's
template) behind the real server, spoken to by the official openai client.

Forced calls (tool_choice "required" or a named function) must always name an offered tool with
arguments that validate against its parameters, whatever the seed; a named function is the one
called and the only one the template shows; "none" hides the tools; streamed tool_calls equal
the whole reply's; drafting and batching keep the reply; a multi-turn tool conversation renders
as the card's template writes it; a card without a tool format refuses tools.
"""
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from serving import check_error, post, serving
from tensorfold.chat.messages import render_chat
from tensorfold.engine.engine import EngineConfig
from tensorfold.server import ServeSettings

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What's the weather in Paris right now?"}]
DRAWS = [(0.0, None), (1.0, 1), (1.0, 2), (0.8, 3)]


@pytest.fixture(scope="module")
def srv():
    with serving(ServeSettings(port=0, engine=EngineConfig(dtype="bfloat16", max_num_seqs=4, kv_cache_gib=0.25))) as s:
        yield s


def ask(s, messages=ASK, **kwargs):
    kwargs.setdefault("max_tokens", 80)
    return s.client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def sha(reply) -> str:
    return reply.model_extra["tensorfold"]["token_sha"]


def check_calls(reply, offered):
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and choice.message.content is None
    by_name = {t["function"]["name"]: t["function"] for t in offered}
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["parameters"])
    return calls


@pytest.mark.parametrize("temperature,seed", DRAWS)
def test_required_always_calls_an_offered_tool_with_valid_arguments(srv, temperature, seed):
    check_calls(ask(srv, tools=TOOLS, tool_choice="required", temperature=temperature, seed=seed), TOOLS)


def test_a_named_function_is_the_one_called_and_the_only_one_shown(srv):
    for temperature, seed in DRAWS:
        r = ask(srv, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                temperature=temperature, seed=seed)
        assert [c.function.name for c in check_calls(r, TOOLS)] == ["get_time"]
    only = ask(srv, tools=[TIME], tool_choice="required")
    assert r.usage.prompt_tokens == only.usage.prompt_tokens  # the template saw get_time alone


def test_none_hides_the_tools_and_auto_may_answer_in_prose(srv):
    plain = ask(srv, max_tokens=8)
    hidden = ask(srv, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens and sha(hidden) == sha(plain)
    auto = ask(srv, tools=TOOLS, max_tokens=40)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_parallel_tool_calls_false_returns_one_call(srv):
    r = ask(srv, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=4)
    assert len(check_calls(r, TOOLS)) == 1


def test_streamed_tool_calls_equal_the_whole_reply(srv):
    kwargs = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=6)
    whole = ask(srv, **kwargs)
    chunks = list(ask(srv, stream=True, stream_options={"include_usage": True}, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [(t.function.name, t.function.arguments) for d in deltas for t in d.tool_calls or ()]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert all(t.id and t.index == i for i, t in enumerate(t for d in deltas for t in d.tool_calls or ()))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert "".join(d.content or "" for d in deltas) == ""
    assert chunks[-1].model_extra["tensorfold"]["token_sha"] == sha(whole)


def test_forced_calls_equal_drafted_or_not_solo_or_batched(srv):
    bodies = [dict(tools=TOOLS, tool_choice="required", temperature=t, seed=s) for t, s in DRAWS]
    bodies.append(dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                       temperature=0.9, seed=8))
    solo = [sha(ask(srv, **b)) for b in bodies]
    assert [sha(ask(srv, **b, extra_body={"draft": False})) for b in bodies] == solo
    with ThreadPoolExecutor(len(bodies)) as pool:
        assert list(pool.map(lambda b: sha(ask(srv, **b)), bodies)) == solo


def test_a_tool_conversation_renders_as_the_card_template_writes_it(srv):
    first = ask(srv, tools=TOOLS, tool_choice="required", temperature=0.0)
    call = first.choices[0].message.tool_calls[0]
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    r = ask(srv, turns, tools=TOOLS, max_tokens=30)
    service = srv.server.service
    text = render_chat(service.template, turns, tools=TOOLS)
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}\n</tool_call>' in text
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(service.engine.tokenizer.encode(text, add_special_tokens=False))
    bad = post(srv, "/v1/chat/completions", {"messages": turns[:2] + [{**turns[2], "tool_call_id": "other"}],
                                             "tools": TOOLS})
    check_error(bad, 400, "messages[2].tool_call_id")


def test_bad_tool_requests_are_400_and_others_go_on(srv):
    want = sha(ask(srv, tools=TOOLS, tool_choice="required", temperature=1.0, seed=12))
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("sha", sha(ask(
        srv, tools=TOOLS, tool_choice="required", temperature=1.0, seed=12))))
    runner.start()
    cases = [({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "tool_choice.function.name"),
             ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
              "tools[0].function.parameters")]
    for fields, param in cases:
        for stream in (False, True):
            check_error(post(srv, "/v1/chat/completions", {"messages": ASK, "stream": stream, **fields}), 400, param)
    runner.join()
    assert result["sha"] == want


def test_a_card_without_a_tool_format_refuses_tools(tiny_llama):
    with serving(ServeSettings(model=tiny_llama, port=0, model_card="llama",
                               engine=EngineConfig(max_num_seqs=2, probe=False))) as s:
        assert s.health()["model_card"] == "llama"
        err = check_error(post(s, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS}), 400, "tools")
        assert "declares no tool-call format" in err["message"]
        ok = post(s, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
        assert ok.status_code == 200
