"""The Responses API over a real socket, spoken to by the official openai client: create and
stream (the same reply as the equivalent chat completion), the store (retrieve, input items,
delete, store false), previous_response_id continuing a conversation through the prefix cache,
function calls and their outputs, text.format, incomplete replies, and 400s naming the field."""
import json

import jsonschema
import openai
import pytest

from serving import check_error, post, serving
from tensorfold.engine.engine import EngineConfig
from tensorfold.server import ServeSettings

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def srv():
    with serving(ServeSettings(port=0, engine=EngineConfig(dtype="bfloat16", max_num_seqs=2, kv_cache_gib=0.25))) as s:
        yield s


def sha(obj) -> str:
    return obj.model_extra["tensorfold"]["token_sha"]


def test_create_equals_the_chat_completion(srv):
    r = srv.client.responses.create(model=MODEL, input="Say hi.", instructions="Be brief.", max_output_tokens=60,
                                    temperature=0.7, extra_body={"seed": 5})
    chat = srv.client.chat.completions.create(model=MODEL, max_tokens=60, temperature=0.7, seed=5, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}])
    assert r.object == "response" and r.output_text == chat.choices[0].message.content
    assert sha(r) == sha(chat) and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")


def test_stream_events_in_order_and_equal_to_the_whole_reply(srv):
    kwargs = dict(model=MODEL, input="Name a colour.", max_output_tokens=60, temperature=0.0)
    whole = srv.client.responses.create(**kwargs)
    r = post(srv, "/v1/responses", {**kwargs, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    numbers = [e["sequence_number"] for e in events]
    assert numbers == sorted(set(numbers))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == whole.output_text
    assert events[-1]["response"]["tensorfold"]["token_sha"] == sha(whole)


def test_store_retrieve_input_items_delete_and_store_false(srv):
    r = srv.client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hi"}], max_output_tokens=8,
                                    metadata={"k": "v"})
    got = srv.client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    items = srv.client.responses.input_items.list(r.id).data
    assert [(i.type, i.role) for i in items] == [("message", "user")]
    srv.client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        srv.client.responses.retrieve(r.id)
    unstored = srv.client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        srv.client.responses.retrieve(unstored.id)


def test_previous_response_id_continues_through_the_prefix_cache(srv):
    first = srv.client.responses.create(model=MODEL, input="Tell me a fact about owls.", instructions="Be brief.",
                                        max_output_tokens=24, temperature=0.0)
    second = srv.client.responses.create(model=MODEL, input="And one about cats?", previous_response_id=first.id,
                                         max_output_tokens=12, temperature=0.0)
    chat = srv.client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0.0, messages=[
        {"role": "user", "content": "Tell me a fact about owls."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And one about cats?"}])  # instructions are not carried to a later turn
    assert sha(second) == sha(chat) and second.usage.input_tokens == chat.usage.prompt_tokens
    # without instructions the earlier turn's prompt is a prefix of the next one: the cache resumes it
    plain = srv.client.responses.create(model=MODEL, input="Tell me a fact about bees, in detail.",
                                        max_output_tokens=24, temperature=0.0)
    more = srv.client.responses.create(model=MODEL, input="More?", previous_response_id=plain.id,
                                       max_output_tokens=4, temperature=0.0)
    assert more.usage.input_tokens_details.cached_tokens >= 32  # at least one full block
    check_error(post(srv, "/v1/responses", {"input": "x", "previous_response_id": "resp_missing"}), 400,
                "previous_response_id")


def test_function_calls_and_their_outputs(srv):
    r = srv.client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=60)
    call = [o for o in r.output if o.type == "function_call"][0]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str) and call.call_id
    follow = srv.client.responses.create(model=MODEL, previous_response_id=r.id, max_output_tokens=10, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
    assert follow.usage.input_tokens > r.usage.input_tokens
    check_error(post(srv, "/v1/responses", {"input": [{"type": "function_call_output", "call_id": "nope",
                                                       "output": "x"}]}), 400, "input[0].call_id")
    allowed = srv.client.responses.create(model=MODEL, input="Time?", max_output_tokens=60, tools=[WEATHER], tool_choice={
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]})
    assert [o.type for o in allowed.output] == ["function_call"]


def test_text_format_json_schema_and_incomplete_replies(srv):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"],
              "additionalProperties": False}
    r = srv.client.responses.create(model=MODEL, input="A person as JSON.", max_output_tokens=60, text={
        "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    cut = srv.client.responses.create(model=MODEL, input="Write a long story.", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    # an image without --vision: the chat check refuses it, and its messages[...] path maps back to "input"
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format"),
    ({}, "input"),
])
def test_malformed_input_is_400_naming_the_field(srv, body, param):
    check_error(post(srv, "/v1/responses", {"model": MODEL, **body}), 400, param)


def test_an_sqlite_store_survives_a_restart(tiny_llama, tmp_path):
    path = str(tmp_path / "responses.sqlite")
    settings = ServeSettings(model=tiny_llama, port=0, response_store=path,
                             engine=EngineConfig(max_num_seqs=1, probe=False))
    with serving(settings) as s:
        kept = s.client.responses.create(model="", input="Hi", max_output_tokens=4)
        dropped = s.client.responses.create(model="", input="Hi again", max_output_tokens=4)
        s.client.responses.delete(dropped.id)
    with serving(settings) as s:
        assert s.client.responses.retrieve(kept.id).output_text == kept.output_text
        with pytest.raises(openai.NotFoundError):
            s.client.responses.retrieve(dropped.id)
        more = s.client.responses.create(model="", input="More", previous_response_id=kept.id, max_output_tokens=4)
        assert more.usage.input_tokens > kept.usage.input_tokens


def test_reasoning_items_whole_and_streamed(tiny_qwen3_family):
    with serving(ServeSettings(model=tiny_qwen3_family, port=0, served_model_name="tiny",
                               engine=EngineConfig(max_num_seqs=1, probe=False))) as s:
        body = {"model": "tiny", "input": "Think.", "max_output_tokens": 30, "temperature": 1.0, "seed": 2,
                "thinking_budget": 5, "reasoning": {"effort": "high", "summary": "auto"}}
        whole = post(s, "/v1/responses", body).json()
        assert [item["type"] for item in whole["output"]][:2] == ["reasoning", "message"]
        assert whole["output"][0]["summary"] == [] and whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
        events = [json.loads(line[6:]) for line in post(s, "/v1/responses", {**body, "stream": True}).text.splitlines()
                  if line.startswith("data: ")]
        reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert reasoning == whole["output"][0]["content"][0]["text"]
        texts = lambda output: [(i["type"], [c["text"] for c in i["content"]]) for i in output]  # noqa: E731
        assert texts(events[-1]["response"]["output"]) == texts(whole["output"])  # ids differ, items do not


def test_the_sdk_streaming_helper_parses_every_event(srv):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    kwargs = dict(model=MODEL, input="Pick a colour.", max_output_tokens=40,
                  text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    with srv.client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert json.loads(final.output_text)["colour"] in ("red", "green", "blue")
    with srv.client.responses.stream(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                     max_output_tokens=60) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and final.output[0].type == "function_call"


def test_a_tool_conversation_via_previous_response_id_equals_the_chat_one(srv):
    first = srv.client.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                        max_output_tokens=60, temperature=0.0)
    call = first.output[0]
    second = srv.client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                         max_output_tokens=16, temperature=0.0, input=[
                                             {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    chat_tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    chat = srv.client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0.0, tools=chat_tools, messages=[
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C"}])
    assert sha(second) == sha(chat) and second.usage.input_tokens == chat.usage.prompt_tokens


def test_the_store_evicts_the_oldest_by_count_and_by_bytes():
    from tensorfold.api.response_store import ResponseStore, StoredResponse

    def entry(i, pad=0):
        return StoredResponse({"id": f"resp_{i}", "pad": "x" * pad}, [], [])

    by_count = ResponseStore(max_entries=3)
    for i in range(5):
        by_count.put(entry(i))
    assert [by_count.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    by_bytes = ResponseStore(max_bytes=3000)
    for i in range(5):
        by_bytes.put(entry(i, pad=900))
    kept = [by_bytes.get(f"resp_{i}") is not None for i in range(5)]
    assert kept == [False, False, True, True, True] and by_bytes._bytes <= 3000
    assert by_bytes.delete("resp_4") and not by_bytes.delete("resp_4")
