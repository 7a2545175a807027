"""What Claude Code sends to POST /v1/messages: a system message inside `messages`, thinking adaptive
with output_config.effort, context_management thinking-clearing edits, cache_control on blocks,
metadata.user_id, custom tools, the /v1/messages?beta=true route and a HEAD / probe. The table of
the route's fields against the installed anthropic client; the translation unit-tested; the server
over a real loopback socket with the official anthropic client."""
import inspect
import threading

import anthropic
import httpx2 as httpx
import pytest

from serving import anthropic_serving, serving
from tensorfold.api import anthropic_fields
from tensorfold.api.anthropic import to_chat_body
from tensorfold.api.errors import ApiError
from tensorfold.engine.engine import EngineConfig
from tensorfold.server import ServeSettings

MODEL = "SmolLM2-135M-Instruct"
CLIENT_SIDE = {"self", "extra_headers", "extra_query", "extra_body", "timeout", "betas"}
CACHE = {"type": "ephemeral"}
BASH = {"name": "Bash", "description": "Run a shell command", "input_schema": {
    "$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
    "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}}, "required": ["command"]}}
READ = {"name": "Read", "description": "Read a file", "input_schema": {
    "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}
TODO = {"name": "TodoWrite", "description": "Update the todo list", "cache_control": CACHE, "input_schema": {
    "type": "object", "properties": {"todos": {"type": "array", "items": {"type": "string"}}}, "required": ["todos"]}}


def claude_code_body(**changes) -> dict:
    """A body shaped like Claude Code 2.1's first request (trimmed; the prompt shortened to fit an 8k window)."""
    body = {
        "model": MODEL,
        "max_tokens": 16,
        "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                    "cache_control": CACHE},
                   {"type": "text", "text": "You are an interactive CLI tool that helps users with software "
                                            "engineering tasks. Be concise.", "cache_control": CACHE}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>As you answer, use the tools when needed.</system-reminder>"},
                {"type": "text", "text": "Say hello.", "cache_control": CACHE}]},
            {"role": "system", "content": "Today's date is 2026-01-01. The working directory is /tmp/project."}],
        "tools": [BASH, READ, TODO],
        "metadata": {"user_id": "user_0123_account__session_4567"},
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "temperature": 1,
        "stream": True,
    }
    body.update(changes)
    return body


def thinking_turns(n: int) -> list[dict]:
    """A tool loop with n assistant turns, each with a thinking block, a tool call and its result."""
    out = [{"role": "user", "content": "List the files."}]
    for i in range(n):
        out += [{"role": "assistant", "content": [{"type": "thinking", "thinking": f"thought {i}", "signature": ""},
                                                  {"type": "tool_use", "id": f"t{i}", "name": "Bash",
                                                   "input": {"command": "ls"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "a.txt"}]}]
    return out


def sdk_kwargs(create, body: dict) -> dict:
    """The body as an SDK call's arguments: what `create` types, the rest as extra_body."""
    typed = inspect.signature(create).parameters
    kwargs = {k: v for k, v in body.items() if k in typed and k != "stream"}
    return {**kwargs, "extra_body": {k: v for k, v in body.items() if k not in typed}}


def reasoning_of(chat: dict) -> list:
    return [m.get("reasoning_content") for m in chat["messages"] if m["role"] == "assistant"]


# ---- the table


@pytest.mark.parametrize("create", [anthropic.resources.messages.Messages.create,
                                    anthropic.resources.beta.messages.Messages.create])
def test_every_client_parameter_is_in_the_table(create):
    params = set(inspect.signature(create).parameters) - CLIENT_SIDE
    assert params and not params - anthropic_fields.FIELDS.keys(), sorted(params - anthropic_fields.FIELDS.keys())


def test_each_refused_field_is_a_400_naming_it_and_its_neutral_values_pass():
    base = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    refused = {k: h for k, h in anthropic_fields.FIELDS.items() if isinstance(h, anthropic_fields.Refused)}
    assert {"container", "mcp_servers", "speed", "diagnostics"} <= refused.keys()
    for key, handling in refused.items():
        with pytest.raises(ApiError) as e:
            to_chat_body({**base, key: {"asks": "something"}})
        assert e.value.param == key and key in e.value.message
        for neutral in (None, *handling.neutral):
            to_chat_body({**base, key: neutral})
    for key, handling in anthropic_fields.FIELDS.items():
        if handling == anthropic_fields.NO_OP:
            assert to_chat_body({**base, key: {"any": "value"}}) == to_chat_body(base)


# ---- the translation


def test_a_system_message_inside_messages_stays_in_place():
    chat = to_chat_body(claude_code_body())
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "system"]
    assert chat["messages"][2]["content"].startswith("Today's date")
    blocks = to_chat_body(claude_code_body(messages=[{"role": "user", "content": "x"}, {
        "role": "system", "content": [{"type": "text", "text": "a", "cache_control": CACHE}, {"type": "text", "text": "b"}]}]))
    assert blocks["messages"][-1] == {"role": "system", "content": "ab"}
    with pytest.raises(ApiError) as e:
        to_chat_body(claude_code_body(messages=[{"role": "system", "content": [{"type": "image", "source": {}}]}]))
    assert e.value.param == "messages[0].content[0].type"


@pytest.mark.parametrize("effort,chat_effort", [("low", "low"), ("medium", "medium"), ("high", "high"),
                                                ("xhigh", "xhigh"), ("max", "xhigh")])
def test_adaptive_thinking_at_the_requested_effort(effort, chat_effort):
    chat = to_chat_body(claude_code_body(output_config={"effort": effort}))
    assert chat["reasoning_effort"] == chat_effort and chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert "thinking_budget" not in chat


def test_thinking_settings_and_their_refusals():
    adaptive = to_chat_body(claude_code_body(output_config=None))
    assert adaptive["chat_template_kwargs"] == {"enable_thinking": True} and "reasoning_effort" not in adaptive
    off = to_chat_body(claude_code_body(thinking={"type": "disabled"}))
    assert off["reasoning_effort"] == "none" and "chat_template_kwargs" not in off  # disabled wins over an effort
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    structured = to_chat_body(claude_code_body(output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert structured["response_format"]["json_schema"]["schema"] == schema
    for change, param in [(dict(output_config={"effort": "extreme"}), "output_config.effort"),
                          (dict(output_config={"format": {"type": "regex"}}), "output_config.format.type"),
                          (dict(thinking={"type": "adaptive", "display": "omitted"}), "thinking.display"),
                          (dict(thinking={"type": "between_tools"}), "thinking.type")]:
        with pytest.raises(ApiError) as e:
            to_chat_body(claude_code_body(**change))
        assert e.value.param == param and param in e.value.message


@pytest.mark.parametrize("keep,kept", [("all", 3), ({"type": "all"}, 3), (None, 1),
                                       ({"type": "thinking_turns", "value": 2}, 2),
                                       ({"type": "thinking_turns", "value": 0}, 0)])
def test_clear_thinking_keeps_the_most_recent_turns_thinking(keep, kept):
    edit = {"type": "clear_thinking_20251015", **({"keep": keep} if keep is not None else {})}
    chat = to_chat_body(claude_code_body(messages=thinking_turns(3), context_management={"edits": [edit]}))
    assert reasoning_of(chat) == [None] * (3 - kept) + [f"thought {i}" for i in range(3 - kept, 3)]
    assert reasoning_of(to_chat_body(claude_code_body(messages=thinking_turns(3), context_management=None))) == [
        "thought 0", "thought 1", "thought 2"]


def test_other_context_edits_pass_only_where_they_cannot_fire():
    for edit in ({"type": "clear_tool_uses_20250919"}, {"type": "compact_20260112"},
                 {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 8192}}):
        body = claude_code_body(context_management={"edits": [edit]})
        assert to_chat_body(body, context_length=8192) == to_chat_body(claude_code_body(context_management=None),
                                                                       context_length=8192)
        with pytest.raises(ApiError) as e:
            to_chat_body(body, context_length=1_000_000)
        assert e.value.param == "context_management.edits[0].type"
    for edit, param in [({"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 3}},
                         "context_management.edits[0].trigger"),
                        ({"type": "something_new"}, "context_management.edits[0].type"),
                        ({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns"}},
                         "context_management.edits[0].keep.value")]:
        with pytest.raises(ApiError) as e:
            to_chat_body(claude_code_body(context_management={"edits": [edit]}), context_length=8192)
        assert e.value.param == param


# ---- over the socket


@pytest.fixture(scope="module")
def srv():
    with anthropic_serving() as s:
        yield s


def test_head_root_is_200_with_no_body(srv):
    r = srv.http.head("/")
    assert r.status_code == 200 and r.content == b""
    assert srv.http.get("/").status_code == 200


def test_claude_codes_first_request_streams_on_the_beta_route(srv):
    body = claude_code_body(stream=None)
    kwargs = sdk_kwargs(anthropic.resources.beta.messages.Messages.create, body)
    assert set(kwargs["extra_body"]) <= {"temperature", "stream"}
    # the beta resource posts to /v1/messages?beta=true, as Claude Code does
    with srv.anthropic.beta.messages.stream(**kwargs, betas=["context-management-2025-06-27"]) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop" and "content_block_delta" in types
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and final.usage.output_tokens > 0
    assert final.content and final.usage.input_tokens > 0
    r = srv.http.post("/v1/messages?beta=true", json=claude_code_body())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    counted = srv.http.post("/v1/messages/count_tokens?beta=true", json=claude_code_body(stream=None, max_tokens=None))
    assert counted.status_code == 200 and counted.json()["input_tokens"] == final.usage.input_tokens


def test_the_later_system_message_renders_as_chat_renders_it(srv):
    body = claude_code_body(stream=False, thinking=None, output_config=None, temperature=0)
    m = srv.anthropic.messages.create(**sdk_kwargs(anthropic.resources.messages.Messages.create, body))
    system = "".join(b["text"] for b in body["system"])
    user = "".join(b["text"] for b in body["messages"][0]["content"])
    chat = srv.client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": user},
        {"role": "system", "content": body["messages"][1]["content"]}],
        tools=[{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                 "parameters": t["input_schema"]}} for t in body["tools"]])
    assert chat.usage.prompt_tokens == m.usage.input_tokens
    assert chat.model_extra["tensorfold"]["token_sha"] == m.model_extra["tensorfold"]["token_sha"]


def test_refusals_come_before_any_event_in_anthropic_shape(srv):
    """...with a reply running beside them unchanged (its token_sha that of its solo run)."""
    long = {"model": MODEL, "max_tokens": 48, "temperature": 1.0, "seed": 9,
            "messages": [{"role": "user", "content": "Write on."}]}
    solo = srv.http.post("/v1/messages", json=long).json()["tensorfold"]["token_sha"]
    got = {}
    worker = threading.Thread(target=lambda: got.update(
        sha=httpx.post(srv.root + "/v1/messages", json=long, timeout=60).json()["tensorfold"]["token_sha"]))
    worker.start()
    for change, name in [(dict(output_config={"effort": "extreme"}), "output_config.effort"),
                         (dict(speed="fast"), "speed"),
                         (dict(context_management={"edits": [{"type": "something_new"}]}), "context_management")]:
        for stream in (True, False):
            r = srv.http.post("/v1/messages?beta=true", json=claude_code_body(stream=stream, **change))
            assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
            err = r.json()
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            assert name in err["error"]["message"]
    worker.join(60)
    assert got["sha"] == solo


def test_cleared_thinking_leaves_the_prompt_on_a_thinking_model(tiny_qwen3_family):
    # the tiny Qwen3-style template prints the thinking of a final (prefilled) assistant turn only
    final = {"role": "assistant", "content": [{"type": "thinking", "thinking": "the last thought " * 4, "signature": ""},
                                              {"type": "text", "text": "Here"}]}
    with serving(ServeSettings(model=tiny_qwen3_family, port=0, served_model_name="tiny",
                               engine=EngineConfig(max_num_seqs=2, probe=False))) as s:
        def count(keep):
            edits = {"edits": [{"type": "clear_thinking_20251015", "keep": keep}]}
            r = s.http.post("/v1/messages/count_tokens?beta=true", json={
                "model": "tiny", "messages": thinking_turns(2) + [final], "tools": [BASH], "context_management": edits})
            assert r.status_code == 200, r.text
            return r.json()["input_tokens"]
        cleared, kept = count({"type": "thinking_turns", "value": 0}), count({"type": "thinking_turns", "value": 1})
        assert cleared + 8 < kept and count("all") == kept
