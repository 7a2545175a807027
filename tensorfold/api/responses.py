"""POST /v1/responses: a Responses body as the equivalent chat completions body (to_chat_body).

The chat body runs through the chat parser, template, engine and reply parser unchanged: the same
prompt tokens, token_sha and drafting. What each top-level field gets is in api/responses_fields.py
(served, harmless, or refused unless neutral); the tools in api/responses_tools.py; the reply in
api/responses_format.py. Translation:
- input: a string (one user message) or items: messages (role user, assistant, system or
  developer; content as a string or input_text / output_text parts, and a user's input_image
  parts as the chat form's image_url parts), function_call (an assistant
  tool call; with `namespace`, the call of a namespace tool), function_call_output (a tool message;
  its call_id must answer a call before it), reasoning (its reasoning_text content, or the text of
  its encrypted_content once verified, goes back to the template as the next assistant message's
  reasoning: the same messages previous_response_id rebuilds for the same conversation);
- instructions -> a leading system message, for this turn only (not carried by
  previous_response_id); previous_response_id -> the stored conversation, then this input;
- max_output_tokens (reasoning included), temperature, top_p, reasoning.effort (reasoning.summary
  accepted, none written), text.format (json_schema, json_object, text), stream, and the
  TensorFold passthroughs (top_k, min_p, seed, draft, thinking_budget, stop, ignore_eos,
  chat_template_kwargs, priority);
- store (default true), metadata (at most 16 string pairs, keys <= 64 and values <= 512 chars),
  include (reasoning.encrypted_content).
"""
import json
from dataclasses import dataclass, field
from typing import Any

from tensorfold.api import fields, responses_fields
from tensorfold.api.errors import ApiError
from tensorfold.api.reasoning_token import ReasoningSealer
from tensorfold.api.response_store import ResponseStore
from tensorfold.api.responses_format import ReplyOptions
from tensorfold.api.responses_tools import offered_tools, qualified, tool_choice

PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stream", "parallel_tool_calls",
          "draft", "thinking_budget", "stop", "ignore_eos", "chat_template_kwargs", "priority")
MAX_METADATA = 16


@dataclass
class ResponsesRequest:
    chat: dict                       # the equivalent chat completions body
    input_items: list[dict]
    conversation: list[dict]         # the chat messages without instructions (what continues)
    echo: dict = field(default_factory=dict)  # request fields the response object repeats
    options: ReplyOptions = field(default_factory=ReplyOptions)
    ignored_fields: tuple[str, ...] = ()      # unknown top-level fields, for a log line


def to_chat_body(body: Any, store: ResponseStore, sealer: ReasoningSealer,
                 builtin_tools: str = "refuse") -> ResponsesRequest:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {fields.json_type(body)}")
    ignored = responses_fields.check_fields(body)
    include = responses_fields.included(body.get("include"))
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    max_output = fields.integer(body.get("max_output_tokens"), "max_output_tokens", lo=1)
    if max_output is not None:
        chat["max_tokens"] = max_output
    previous = fields.string(body.get("previous_response_id"), "previous_response_id")
    history: list[dict] = []
    if previous is not None:
        entry = store.get(previous)
        if entry is None:
            raise ApiError(f"previous response {previous!r} was not found (it was not stored, was deleted, "
                           "or the server restarted)", param="previous_response_id")
        history = [dict(m) for m in entry.conversation]
    items = _input_items(body.get("input"), sealer)
    conversation = history + _messages(items, history)
    instructions = fields.string(body.get("instructions"), "instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    offer = offered_tools(body.get("tools"), builtin_tools)
    if offer.chat_tools:
        chat["tools"] = offer.chat_tools
    if body.get("tool_choice") is not None:
        tool_choice(body["tool_choice"], chat, offer.names)
    reasoning = fields.obj(body.get("reasoning"), "reasoning")
    if reasoning is not None:
        effort = fields.string(reasoning.get("effort"), "reasoning.effort")
        if effort is not None:
            chat["reasoning_effort"] = effort
        fields.string(reasoning.get("summary"), "reasoning.summary", choices=("auto", "concise", "detailed"))
    text = fields.obj(body.get("text"), "text")
    fmt = fields.obj(text.get("format"), "text.format") if text else None
    if fmt is not None:
        kind = fields.string(fmt.get("type"), "text.format.type", choices=("text", "json_schema", "json_object"),
                             required=True)
        if kind == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif kind == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
            if fmt.get("schema") is None:
                raise ApiError("'text.format.schema' is required", param="text.format.schema")
    fields.boolean(body.get("store"), "store")
    metadata = _metadata(body.get("metadata"))
    echo = {"instructions": instructions, "max_output_tokens": max_output, "previous_response_id": previous,
            "metadata": metadata, "store": body.get("store") is not False,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": None},
            "text": {"format": fmt or {"type": "text"}}}
    options = ReplyOptions(offer.names, sealer if "reasoning.encrypted_content" in include else None,
                           tuple(offer.ignored))
    return ResponsesRequest(chat, items, conversation, echo, options, ignored)


def _input_items(value: Any, sealer: ReasoningSealer) -> list[dict]:
    if value is None:
        raise ApiError("'input' is required", param="input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    items = fields.array(value, "input", nonempty=True)
    out = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        item = fields.obj(item, at, required=True)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message_item(item, at))
        elif kind == "function_call":
            call = {"type": "function_call",
                    "call_id": fields.string(item.get("call_id"), f"{at}.call_id", required=True),
                    "name": fields.string(item.get("name"), f"{at}.name", required=True),
                    "arguments": fields.string(item.get("arguments"), f"{at}.arguments", required=True)}
            namespace = fields.string(item.get("namespace"), f"{at}.namespace")
            if namespace:
                call["namespace"] = namespace
            out.append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output) if output is not None else ""
            out.append({"type": "function_call_output",
                        "call_id": fields.string(item.get("call_id"), f"{at}.call_id", required=True),
                        "output": output})
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:
                text = sealer.open(item["encrypted_content"], f"{at}.encrypted_content")
            else:
                text = "".join(fields.string(c.get("text"), f"{at}.content[{j}].text") or ""
                               for j, c in enumerate(fields.array(item.get("content"), f"{at}.content") or [])
                               if isinstance(c, dict))
            out.append({"type": "reasoning", "content": [{"type": "reasoning_text", "text": text}], "summary": []})
        else:
            raise ApiError(f"input items of type {kind!r} are not supported", param=f"{at}.type")
    return out


def _message_item(item: dict, at: str) -> dict:
    role = fields.string(item.get("role"), f"{at}.role", choices=("user", "assistant", "system", "developer"),
                         required=True)
    content = item.get("content")
    if isinstance(content, str):
        return {"type": "message", "role": role,
                "content": [{"type": "input_text" if role != "assistant" else "output_text", "text": content}]}
    parts = []
    for j, part in enumerate(fields.array(content, f"{at}.content", required=True)):
        part = fields.obj(part, f"{at}.content[{j}]", required=True)
        ptype = fields.string(part.get("type"), f"{at}.content[{j}].type", required=True)
        if ptype == "input_image" and role == "user":  # the chat form's image_url part (--vision)
            url = fields.string(part.get("image_url"), f"{at}.content[{j}].image_url", required=True)
            parts.append({"type": "input_image", "image_url": url})
            continue
        if ptype not in ("input_text", "output_text", "text"):
            raise ApiError(f"content parts of type {ptype!r} are not supported", param=f"{at}.content[{j}].type")
        parts.append({"type": ptype, "text": fields.string(part.get("text"), f"{at}.content[{j}].text",
                                                           required=True)})
    return {"type": "message", "role": role, "content": parts}


def _messages(items: list[dict], history: list[dict]) -> list[dict]:
    """Chat messages of the input items; function_call_output ids must answer a call before them."""
    calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    out: list[dict] = []
    reasoning = None
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            if any(p["type"] == "input_image" for p in item["content"]):
                content = [{"type": "image_url", "image_url": {"url": p["image_url"]}} if p["type"] == "input_image"
                           else {"type": "text", "text": p["text"]} for p in item["content"]]
            else:
                content = "".join(p["text"] for p in item["content"])
            message = {"role": item["role"], "content": content}
            if item["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif kind == "reasoning":
            reasoning = item["content"][0]["text"]
        elif kind == "function_call":
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or last.get("content"):
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                out.append(last)
            name = qualified(item["namespace"], item["name"]) if item.get("namespace") else item["name"]
            last.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": name, "arguments": item["arguments"]}})
            calls.add(item["call_id"])
        else:  # function_call_output
            if item["call_id"] not in calls:
                raise ApiError(f"function_call_output for call {item['call_id']!r}, which no function_call before "
                               "it made", param=f"input[{i}].call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def _metadata(value: Any) -> dict:
    metadata = fields.obj(value, "metadata") or {}
    if len(metadata) > MAX_METADATA:
        raise ApiError(f"metadata holds {len(metadata)} pairs; at most {MAX_METADATA}", param="metadata")
    for key, item in metadata.items():
        if len(key) > 64:
            raise ApiError("metadata keys are at most 64 characters", param=f"metadata.{key}")
        if not isinstance(item, str) or len(item) > 512:
            raise ApiError("metadata values are strings of at most 512 characters", param=f"metadata.{key}")
    return dict(metadata)
