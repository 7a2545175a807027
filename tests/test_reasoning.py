"""Reasoning end to end on a tiny qwen3 with a Qwen3-style template (tools/tiny_checkpoint.py,
family=True: its think and tool-call markers are single tokens; the qwen3 card).

The template opens a think block in the generation prompt unless thinking is off, and the random
model never closes it by itself, so: with thinking on, the whole reply is reasoning; a thinking
budget closes the block at exactly the budget-th token ("\\n</think>\\n\\n") and the answer
follows; a forced tool call comes after the block; reasoning_effort none turns thinking off and
other efforts reach the template under the card's names. Drafting and batching keep every reply.
"""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from serving import check_error, post, serving
from tensorfold.engine.engine import EngineConfig
from tensorfold.server import ServeSettings

ASK = [{"role": "user", "content": "Think about the weather."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def srv(tiny_qwen3_family):
    with serving(ServeSettings(model=tiny_qwen3_family, port=0, served_model_name="tiny",
                               engine=EngineConfig(max_num_seqs=4, probe=False))) as s:
        yield s


def ask(s, **kwargs):
    kwargs.setdefault("max_tokens", 24)
    return s.client.chat.completions.create(model="tiny", messages=ASK, temperature=1.0, seed=3, **kwargs)


def sha(reply) -> str:
    return reply.model_extra["tensorfold"]["token_sha"]


def test_the_card_is_qwen3_and_the_markers_are_single_tokens(srv):
    assert srv.health()["model_card"] == "qwen3"
    assert srv.server.service.think_ids is not None


def test_thinking_replies_are_reasoning_streamed_or_not(srv):
    whole = ask(srv)
    message = whole.choices[0].message
    assert message.content in (None, "") and message.model_extra["reasoning_content"]
    assert whole.usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens
    chunks = list(ask(srv, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == message.model_extra[
        "reasoning_content"]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("budget", [1, 5, 9])
def test_the_budget_closes_the_think_block_at_exactly_the_budget(srv, budget):
    r = ask(srv, extra_body={"thinking_budget": budget})
    tok = srv.server.service.engine.tokenizer
    # through "\n</think>": the budget-th token is the newline, the close marker follows
    assert r.usage.completion_tokens_details.reasoning_tokens == budget + 1
    assert r.choices[0].message.content  # the answer goes on after the block
    reasoning = r.choices[0].message.model_extra.get("reasoning_content") or ""
    assert "</think>" not in reasoning and "</think>" not in r.choices[0].message.content
    drafted_off = ask(srv, extra_body={"thinking_budget": budget, "draft": False})
    assert sha(drafted_off) == sha(r)
    assert tok.token_to_id("</think>") is not None


def test_budget_and_forced_call_together_and_batched(srv):
    bodies = [dict(extra_body={"thinking_budget": b}, tools=[WEATHER], tool_choice="required", max_tokens=96)
              for b in (2, 4, 6)]
    bodies += [dict(extra_body={"thinking_budget": 3}, max_tokens=16)]
    solo = [ask(srv, **b) for b in bodies]
    for r in solo[:3]:
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    with ThreadPoolExecutor(len(bodies)) as pool:
        batched = list(pool.map(lambda b: sha(ask(srv, **b)), bodies))
    assert batched == [sha(r) for r in solo]


def test_effort_none_turns_thinking_off_and_names_map_per_card(srv):
    off = ask(srv, reasoning_effort="none")
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    assert off.choices[0].message.content and not off.choices[0].message.model_extra.get("reasoning_content")
    # the qwen3 card maps high to xhigh and minimal to low: the template writes the effort it hears
    prompts = {e: ask(srv, reasoning_effort=e, max_tokens=1).usage.prompt_tokens
               for e in ("minimal", "low", "medium", "high", "xhigh")}
    assert prompts["high"] == prompts["xhigh"] and prompts["minimal"] == prompts["low"]
    service = srv.server.service
    assert service.card.effort_name("high") == "xhigh" and service.card.effort_name("minimal") == "low"
    # chat_template_kwargs' effort is heard too, the top-level one wins, enable_thinking wins over both
    inner = ask(srv, max_tokens=1, extra_body={"chat_template_kwargs": {"reasoning_effort": "none"}})
    assert inner.usage.prompt_tokens == off.usage.prompt_tokens
    top = ask(srv, max_tokens=1, reasoning_effort="high",
              extra_body={"chat_template_kwargs": {"reasoning_effort": "none"}})
    assert top.usage.prompt_tokens == prompts["high"]
    forced_on = ask(srv, reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert forced_on.usage.completion_tokens_details.reasoning_tokens > 0


def test_a_bad_budget_is_400(srv):
    for value in (-1, 1.5, "10"):
        check_error(post(srv, "/v1/chat/completions", {"messages": ASK, "thinking_budget": value}), 400,
                    "thinking_budget")
