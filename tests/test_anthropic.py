"""POST /v1/messages spoken to by the official anthropic SDK over a real socket: text, tool use
and thinking, whole (messages.create) and streamed (messages.stream), the same tokens as the
equivalent chat completion; count_tokens; 400s in Anthropic's error shape."""
import anthropic
import pytest

from serving import anthropic_serving, serving
from tensorfold.engine.engine import EngineConfig
from tensorfold.server import ServeSettings

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv():
    with anthropic_serving() as s:
        yield s


def test_text_whole_and_streamed_equal_the_chat_reply(srv):
    # this SDK version types no sampling fields: they go as extra body fields, as the API takes them
    kwargs = dict(model=MODEL, max_tokens=24, system="Be brief.", messages=[{"role": "user", "content": "Say hi."}],
                  extra_body={"temperature": 0.8, "top_k": 40, "seed": 3})
    m = srv.anthropic.messages.create(**kwargs)
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    with srv.anthropic.messages.stream(**kwargs) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop" and "content_block_delta" in types
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    chat = srv.client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0.8, top_p=1.0,
                                              seed=3, extra_body={"top_k": 40}, messages=[{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "Say hi."}])
    assert chat.choices[0].message.content == m.content[0].text
    assert chat.usage.prompt_tokens == m.usage.input_tokens
    assert m.model_extra["tensorfold"]["token_sha"] == chat.model_extra["tensorfold"]["token_sha"]


def test_stop_sequences_report_which_one(srv):
    m = srv.anthropic.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Count: 1, 2,"}],
                                      stop_sequences=[" ", "\n"], extra_body={"temperature": 0})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence in (" ", "\n")


def test_tool_use_whole_and_streamed_then_a_tool_result_turn(srv):
    m = srv.anthropic.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER],
                                      tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and isinstance(use.input["city"], str)
    with srv.anthropic.messages.stream(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == use.input
    follow = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                       "input": use.input}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": "18 C, sunny"}, {"type": "text", "text": "Thanks!"}]}]
    again = srv.anthropic.messages.create(model=MODEL, max_tokens=16, messages=follow, tools=[WEATHER])
    assert again.usage.input_tokens > m.usage.input_tokens
    counted = srv.anthropic.messages.count_tokens(model=MODEL, messages=follow, tools=[WEATHER])
    assert counted.input_tokens == again.usage.input_tokens


def test_unserved_and_malformed_input_is_400_in_anthropic_shape(srv):
    bad = [dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}], max_tokens=5),
           dict(messages=ASK),  # no max_tokens
           dict(messages=[{"role": "robot", "content": "x"}], max_tokens=5),
           dict(messages=ASK, max_tokens=5, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
           dict(messages=ASK, max_tokens=5, tool_choice={"type": "tool", "name": "nope"}, tools=[WEATHER])]
    for body in bad:
        r = srv.http.post("/v1/messages", json={"model": MODEL, **body})
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and err["error"]["message"]


def test_thinking_blocks_and_budget_on_a_thinking_model(tiny_qwen3_family):
    with serving(ServeSettings(model=tiny_qwen3_family, port=0, served_model_name="tiny",
                               engine=EngineConfig(max_num_seqs=2, probe=False))) as s:
        client = anthropic.Anthropic(base_url=s.root, api_key="unused", max_retries=0)
        kwargs = dict(model="tiny", max_tokens=30, messages=[{"role": "user", "content": "Think."}],
                      thinking={"type": "enabled", "budget_tokens": 6}, extra_body={"temperature": 1.0})
        m = client.messages.create(**kwargs)
        assert [b.type for b in m.content][:2] == ["thinking", "text"]
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert final.content[0].thinking == m.content[0].thinking and final.content[1].text == m.content[1].text
        off = client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Think."}],
                                     thinking={"type": "disabled"})
        assert [b.type for b in off.content] == ["text"]
