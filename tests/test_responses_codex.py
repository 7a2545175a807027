"""What Codex sends to POST /v1/responses: namespace tools, encrypted reasoning (include
reasoning.encrypted_content with store false), prompt_cache_key, client_metadata, developer
messages, built-in tools (refused, or dropped under --builtin-tools ignore), and the route's field
table (each refused field a 400 naming it, plain and streamed, before any event, with a concurrent
reply unchanged). Also: every parameter of the installed openai client's create methods is in its
route's table."""
import inspect
import json
import threading

import openai
import pytest

from serving import check_error, post, serving
from tensorfold.api import request as chat_request
from tensorfold.api import responses_fields
from tensorfold.api.errors import ApiError
from tensorfold.api.reasoning_token import ReasoningSealer, key_from_file, new_key
from tensorfold.api.response_store import ResponseStore
from tensorfold.api.responses_tools import offered_tools
from tensorfold.engine.engine import EngineConfig
from tensorfold.server import ServeSettings

LOOKUP = {"type": "function", "name": "lookup", "description": "Look up a customer",
          "parameters": {"type": "object", "properties": {"id": {"type": "string", "maxLength": 8}},
                         "required": ["id"]}}
CRM = {"type": "namespace", "name": "mcp__crm__", "description": "The CRM", "tools": [LOOKUP]}
THINK = {"model": "tiny", "max_output_tokens": 24, "temperature": 1.0, "seed": 3, "thinking_budget": 6,
         "reasoning": {"effort": "high", "summary": "auto"}}
CLIENT_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}


def params(method) -> set[str]:
    return set(inspect.signature(method).parameters) - CLIENT_ONLY


def test_every_openai_client_parameter_is_in_its_routes_table():
    from openai.resources.chat.completions import Completions as Chat
    from openai.resources.completions import Completions
    from openai.resources.responses import Responses

    assert params(Responses.create) - responses_fields.KNOWN == set()
    assert params(Chat.create) - chat_request.KNOWN == set()
    assert params(Completions.create) - chat_request.KNOWN == set()
    tables = [responses_fields.SERVED, responses_fields.HARMLESS, set(responses_fields.NEUTRAL)]
    assert sum(len(t) for t in tables) == len(responses_fields.KNOWN)  # no field in two tables


def test_a_reasoning_token_opens_with_its_key_only(tmp_path):
    sealer = ReasoningSealer(new_key())
    token = sealer.seal("first, think\n" * 50)
    assert sealer.open(token, "x") == "first, think\n" * 50 and "think" not in token
    assert sealer.seal("first, think\n" * 50) == token  # the same text, the same token (a synthetic nonce)
    middle = len(token) // 2
    flipped = token[:middle] + ("A" if token[middle] != "A" else "B") + token[middle + 1:]
    last = token.rstrip("=")  # the last data character: its padding bits changed alone is another spelling
    respelled = last[:-1] + chr(ord(last[-1]) ^ 1) + token[len(last):]
    for bad in (flipped, respelled, token.replace("tfr2.", "tfr1."),
                "tfr2.!!", "tfr2." + token[5:20], 7, ReasoningSealer(new_key()).seal("first, think\n" * 50)):
        with pytest.raises(ApiError) as e:
            sealer.open(bad, "input[2].encrypted_content")
        assert e.value.param == "input[2].encrypted_content" and e.value.status == 400
    path = str(tmp_path / "key")
    assert key_from_file(path) == key_from_file(path) and len(key_from_file(path)) == 32
    db = str(tmp_path / "store.sqlite")
    assert ResponseStore(path=db).key(new_key) == ResponseStore(path=db).key(new_key)
    assert ResponseStore().key(new_key) is None


def test_namespace_tools_are_offered_flat_and_built_in_tools_refused_or_dropped():
    offer = offered_tools([CRM, {**LOOKUP, "name": "plain"}])
    assert [t["function"]["name"] for t in offer.chat_tools] == ["mcp__crm__lookup", "plain"]
    assert offer.names.split("mcp__crm__lookup") == ("mcp__crm__", "lookup") and offer.names.split("plain") == (
        None, "plain")
    assert offered_tools([{**CRM, "name": "crm"}]).chat_tools[0]["function"]["name"] == "crm__lookup"
    web = {"type": "web_search", "external_web_access": False}
    with pytest.raises(ApiError) as e:
        offered_tools([CRM, web])
    assert e.value.param == "tools[1].type" and 'web_search = "disabled"' in e.value.message
    assert "--builtin-tools ignore" in e.value.message
    assert offered_tools([CRM, web], builtin_tools="ignore").ignored == ["web_search"]
    with pytest.raises(ApiError) as e:
        offered_tools([{**CRM, "tools": [{"type": "custom", "name": "apply_patch"}]}])
    assert e.value.param == "tools[0].tools[0].type"


def test_encrypted_reasoning_items_become_the_messages_previous_response_id_rebuilds():
    from tensorfold.api.response_store import StoredResponse
    from tensorfold.api.responses import to_chat_body
    from tensorfold.api.responses_format import assistant_message

    sealer, store = ReasoningSealer(new_key()), ResponseStore()
    output = [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Weigh it.\n"}]},
              {"type": "function_call", "call_id": "c1", "name": "lookup", "namespace": "mcp__crm__",
               "arguments": '{"id": "7"}'}]
    first = to_chat_body({"input": "Find 7.", "tools": [CRM]}, store, sealer)
    store.put(StoredResponse({"id": "resp_1", "output": output}, [], first.conversation + [
        assistant_message({"output": output})]))
    answer = {"type": "function_call_output", "call_id": "c1", "output": "Ada"}
    stored = to_chat_body({"previous_response_id": "resp_1", "input": [answer], "tools": [CRM]}, store, sealer)
    sent = [{"role": "user", "content": "Find 7."},
            {"type": "reasoning", "summary": [], "encrypted_content": sealer.seal("Weigh it.\n")},
            {k: v for k, v in output[1].items()}, answer]
    resumed = to_chat_body({"input": sent, "tools": [CRM], "store": False}, store, sealer)
    assert resumed.chat["messages"] == stored.chat["messages"]
    assert resumed.chat["messages"][1]["reasoning_content"] == "Weigh it.\n"
    assert resumed.chat["messages"][1]["tool_calls"][0]["function"]["name"] == "mcp__crm__lookup"


@pytest.fixture(scope="module")
def srv(tiny_qwen3_family, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("codex") / "responses.sqlite")
    settings = ServeSettings(model=tiny_qwen3_family, port=0, served_model_name="tiny", response_store=store,
                             engine=EngineConfig(max_num_seqs=2, probe=False))
    with serving(settings) as s:
        yield s


def sha(body: dict) -> str:
    return body["tensorfold"]["token_sha"]


def events_of(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_encrypted_reasoning_resumes_as_previous_response_id_does(srv):
    first = post(srv, "/v1/responses", {**THINK, "input": "Think.", "include": ["reasoning.encrypted_content"]}).json()
    reasoning, message = first["output"][0], first["output"][1]
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"].startswith("tfr2.")
    assert message["type"] == "message"
    plain = post(srv, "/v1/responses", {**THINK, "input": "Think."}).json()
    assert "encrypted_content" not in plain["output"][0] and sha(plain) == sha(first)
    follow = {**THINK, "max_output_tokens": 8}
    stored = post(srv, "/v1/responses", {**follow, "input": "More.", "previous_response_id": first["id"]}).json()
    # what Codex sends with store false: the whole conversation, the reasoning as its token only
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Think."}]},
             {"type": "reasoning", "id": reasoning["id"], "summary": [],
              "encrypted_content": reasoning["encrypted_content"]},
             {k: message[k] for k in ("type", "id", "role", "content")},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "More."}]}]
    resumed = post(srv, "/v1/responses", {**follow, "input": items, "store": False}).json()
    assert sha(resumed) == sha(stored) and resumed["usage"]["input_tokens"] == stored["usage"]["input_tokens"]
    # the token survives a restart: the key lives in the --response-store file
    events = events_of(post(srv, "/v1/responses", {**THINK, "input": "Think.", "stream": True,
                                                   "include": ["reasoning.encrypted_content"]}))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "reasoning"]
    assert done[0]["encrypted_content"] == reasoning["encrypted_content"]
    assert events[-1]["response"]["output"][0]["encrypted_content"] == reasoning["encrypted_content"]
    # the template renders reasoning only after the last user turn: a tool turn shows it restored
    tool_turn = {**THINK, "max_output_tokens": 80, "tools": [CRM], "tool_choice": "required",
                 "include": ["reasoning.encrypted_content"]}
    called = post(srv, "/v1/responses", {**tool_turn, "input": "Find customer 7."}).json()
    thought, call = called["output"][0], called["output"][-1]
    assert thought["type"] == "reasoning" and call["type"] == "function_call" and call["namespace"] == "mcp__crm__"
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "Ada"}
    after = {**tool_turn, "max_output_tokens": 8, "tool_choice": "auto"}
    stored = post(srv, "/v1/responses", {**after, "previous_response_id": called["id"], "input": [answer]}).json()
    turn = [{"role": "user", "content": "Find customer 7."},
            {"type": "reasoning", "summary": [], "encrypted_content": thought["encrypted_content"]},
            {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")}, answer]
    resumed = post(srv, "/v1/responses", {**after, "store": False, "input": turn}).json()
    assert sha(resumed) == sha(stored) and resumed["usage"]["input_tokens"] == stored["usage"]["input_tokens"]
    # where the template shows it (an assistant turn last), the restored text is the reasoning itself
    last = {**follow, "store": False, "input": items[:3]}
    shown = post(srv, "/v1/responses", last).json()
    forgotten = post(srv, "/v1/responses", {**last, "input": [items[0], items[2]]}).json()
    chat = post(srv, "/v1/chat/completions", {**{k: follow[k] for k in ("model", "temperature", "seed",
                                                                        "thinking_budget")},
                                              "max_tokens": 8, "reasoning_effort": "high", "messages": [
        {"role": "user", "content": "Think."},
        {"role": "assistant", "content": message["content"][0]["text"],
         "reasoning_content": reasoning["content"][0]["text"]}]}).json()
    assert sha(shown) == sha(chat) and shown["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert forgotten["usage"]["input_tokens"] < shown["usage"]["input_tokens"]
    tampered = dict(items[1], encrypted_content=reasoning["encrypted_content"][:-4] + "AAAA")
    for stream in (False, True):
        check_error(post(srv, "/v1/responses", {**follow, "input": [items[0], tampered, *items[2:]],
                                                "stream": stream}), 400, "input[1].encrypted_content")


def test_a_namespace_tool_call_carries_its_namespace(srv):
    body = {"model": "tiny", "max_output_tokens": 120, "temperature": 0.0, "tools": [CRM], "tool_choice": "required",
            "reasoning": {"effort": "none"}}
    first = post(srv, "/v1/responses", {**body, "input": "Find customer 7."}).json()
    call = [o for o in first["output"] if o["type"] == "function_call"][0]
    assert call["name"] == "lookup" and call["namespace"] == "mcp__crm__"
    streamed = events_of(post(srv, "/v1/responses", {**body, "input": "Find customer 7.", "stream": True}))
    assert [e["item"]["namespace"] for e in streamed if e["type"] == "response.output_item.done"] == ["mcp__crm__"]
    follow = {**body, "tool_choice": "auto", "max_output_tokens": 6}
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "Ada"}
    stored = post(srv, "/v1/responses", {**follow, "previous_response_id": first["id"], "input": [output]}).json()
    items = [{"role": "user", "content": "Find customer 7."},
             {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")}, output]
    resumed = post(srv, "/v1/responses", {**follow, "store": False, "input": items}).json()
    assert sha(resumed) == sha(stored) and resumed["usage"]["input_tokens"] == stored["usage"]["input_tokens"]


def test_what_codex_sends_besides_is_accepted(srv):
    body = {"model": "tiny", "input": [{"role": "developer", "content": "Be terse."},
                                       {"role": "user", "content": "Hi"}],
            "max_output_tokens": 6, "temperature": 0.0, "seed": 1}
    base = post(srv, "/v1/responses", body).json()
    extras = {"prompt_cache_key": "0199-session", "client_metadata": {"x-codex-turn": "1"}, "store": False,
              "include": [], "background": False, "truncation": "disabled", "top_logprobs": 0,
              "reasoning": {"summary": "auto"}, "stream_options": {"include_obfuscation": False},
              "max_tool_calls": 3, "tensorfold_unknown_extra": 1}
    r = post(srv, "/v1/responses", {**body, **extras})
    assert r.status_code == 200 and sha(r.json()) == sha(base)
    chat = post(srv, "/v1/chat/completions", {"model": "tiny", "max_tokens": 6, "temperature": 0.0, "seed": 1,
                                              "messages": [{"role": "system", "content": "Be terse."},
                                                           {"role": "user", "content": "Hi"}]}).json()
    assert sha(chat) == sha(base)  # developer is system, as in chat


def test_builtin_tools_ignored_when_the_operator_says_so(tiny_qwen3_family):
    settings = ServeSettings(model=tiny_qwen3_family, port=0, served_model_name="tiny", builtin_tools="ignore",
                             engine=EngineConfig(max_num_seqs=1, probe=False))
    with serving(settings) as s:
        r = s.client.responses.create(model="tiny", input="Hi", max_output_tokens=4, tools=[
            {"type": "web_search", "external_web_access": False}, LOOKUP])
        assert r.model_extra["tensorfold"]["ignored_tools"] == ["web_search"]
        assert r.tools[0].type == "web_search"  # echoed as sent


REFUSED = [
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 5}, "top_logprobs"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include[1]"),
    ({"tools": [{"type": "web_search", "external_web_access": False}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools[0].type"),
]


def test_each_refused_field_is_a_400_naming_it_with_a_concurrent_reply_unchanged(srv):
    long = {"model": "tiny", "input": "Write on.", "max_output_tokens": 60, "temperature": 1.0, "seed": 9,
            "store": False}
    solo = sha(post(srv, "/v1/responses", long).json())
    got = {}
    worker = threading.Thread(target=lambda: got.update(r=post(srv, "/v1/responses", long).json()))
    worker.start()
    for extra, param in REFUSED:
        for stream in (False, True):
            r = post(srv, "/v1/responses", {"model": "tiny", "input": "x", "stream": stream, **extra})
            check_error(r, 400, param)
            assert "event:" not in r.text
    worker.join(60)
    assert sha(got["r"]) == solo
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.responses.create(model="tiny", input="x", background=True)
    assert e.value.body["param"] == "background"
