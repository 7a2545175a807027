"""POST /v1/messages (and /v1/messages/count_tokens): the Anthropic Messages API over the same
chat path, so Anthropic-protocol agents (Claude Code among them) work.

A Messages body is translated into the equivalent chat completions body, which then goes
through the chat parser, template, engine and reply parser unchanged (same prompt tokens, same
token_sha, drafting on); only the reply's shape is Anthropic's (MessagesFormat). Which top-level
fields are served, refused or accepted as no-ops is api/anthropic_fields.py's table. Translation:
- system (a string or text blocks) -> a system message; a system-role message inside `messages`
  stays in place as a system message (the chat rule for later system messages: the template's
  system turn where it renders one, else a user turn); user text blocks -> the user's text;
  tool_result blocks -> tool messages (their text content); assistant text / tool_use / thinking
  blocks -> content / tool_calls (input as JSON arguments) / reasoning_content, the thinking of
  turns a context_management clear_thinking edit clears left out;
- tools ({name, description, input_schema}) -> function tools; tool_choice auto / any / tool /
  none -> auto / required / the named function / none; disable_parallel_tool_use ->
  parallel_tool_calls false;
- thinking {"type": "enabled", "budget_tokens": N} -> thinking on with thinking_budget N;
  {"type": "adaptive"} -> thinking on; {"type": "disabled"} -> reasoning effort none;
  output_config.effort -> reasoning_effort; output_config.format -> response_format json_schema;
- max_tokens (required), stop_sequences, temperature, top_p, top_k, stream.
cache_control on blocks and tools is accepted and changes nothing (the prefix cache is automatic).
What is not served (images, documents, server tools) is a 400 in Anthropic's error shape,
{"type": "error", "error": {"type", "message"}}, naming the field.
"""
import json
from typing import Any

from tensorfold.api import anthropic_fields, fields
from tensorfold.api.errors import ApiError
from tensorfold.api.replies import ReplyFormat, tensorfold_block
from tensorfold.chat.reply_parser import ReplyDelta
from tensorfold.engine.request import Request
from tensorfold.http.errors import HttpError
from tensorfold.http.messages import HttpResponse

# chat fields only the translation writes -> the Messages fields they came from (for error messages)
CHAT_NAMES = {"response_format.json_schema.schema": "output_config.format.schema",
              "response_format": "output_config.format"}
PASSED = ("model", "temperature", "top_p", "top_k", "stream", "stop_sequences", "seed", "draft")  # seed, draft: ours


def error_response(status: int, message: str, kind: str | None = None) -> HttpResponse:
    kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error"}.get(status, "api_error")
    return HttpResponse.json_response({"type": "error", "error": {"type": kind, "message": message}}, status)


def api_error(err: HttpError) -> HttpResponse:
    """An ApiError, or the HTTP layer's refusal of the body, in Anthropic's shape (a chat field the
    translation made named by the Messages field it came from)."""
    message = err.message if not err.param or err.param in err.message else f"{err.param}: {err.message}"
    for chat_name, name in CHAT_NAMES.items():
        message = message.replace(chat_name, name)
    return error_response(err.status, message)


def to_chat_body(body: Any, *, count_only: bool = False, context_length: int | None = None) -> dict:
    """The chat completions body equivalent to a Messages body (ApiError naming the field).
    context_length, the model's window, decides whether a token-triggered context edit can fire."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {fields.json_type(body)}")
    anthropic_fields.refuse_unserved(body)
    max_tokens = fields.integer(body.get("max_tokens"), "max_tokens", lo=1, required=not count_only)
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    if "stop_sequences" in chat:
        chat["stop"] = chat.pop("stop_sequences")
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    messages = _system(body.get("system"))
    wire = fields.array(body.get("messages"), "messages", nonempty=True, required=True)
    kept = anthropic_fields.thinking_kept(body, wire, context_length)
    for i, message in enumerate(wire):
        messages += _message(message, f"messages[{i}]", keep_thinking=i in kept)
    chat["messages"] = messages
    tools = fields.array(body.get("tools"), "tools")
    if tools:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    choice = fields.obj(body.get("tool_choice"), "tool_choice")
    if choice is not None:
        kind = fields.string(choice.get("type"), "tool_choice.type", choices=("auto", "any", "tool", "none"),
                             required=True)
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
            "type": "function", "function": {"name": fields.string(choice.get("name"), "tool_choice.name",
                                                                   required=True)}}
        if fields.boolean(choice.get("disable_parallel_tool_use"), "tool_choice.disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    chat.update(anthropic_fields.reasoning(body))
    return chat


def _system(value: Any) -> list[dict]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}] if value else []
    blocks = fields.array(value, "system")
    text = "".join(_text_block(b, f"system[{i}]") for i, b in enumerate(blocks))
    return [{"role": "system", "content": text}]


def _text_block(block: Any, at: str) -> str:
    block = fields.obj(block, at, required=True)
    if block.get("type") != "text":
        raise ApiError(f"'{at}' must be a text block", param=f"{at}.type")
    return fields.string(block.get("text"), f"{at}.text", required=True)


def _message(message: Any, at: str, keep_thinking: bool = True) -> list[dict]:
    message = fields.obj(message, at, required=True)
    role = fields.string(message.get("role"), f"{at}.role", choices=("user", "assistant", "system"), required=True)
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "system":
        blocks = fields.array(content, f"{at}.content", required=True)
        return [{"role": "system", "content": "".join(_text_block(b, f"{at}.content[{j}]")
                                                      for j, b in enumerate(blocks))}]
    blocks = fields.array(content, f"{at}.content", required=True)
    text, calls, results, reasoning = [], [], [], []
    for j, block in enumerate(blocks):
        where = f"{at}.content[{j}]"
        block = fields.obj(block, where, required=True)
        kind = fields.string(block.get("type"), f"{where}.type", required=True)
        if kind == "text":
            text.append(fields.string(block.get("text"), f"{where}.text", required=True))
        elif kind == "tool_use" and role == "assistant":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise ApiError(f"'{where}.input' must be an object", param=f"{where}.input")
            calls.append({"id": fields.string(block.get("id"), f"{where}.id", required=True), "type": "function",
                          "function": {"name": fields.string(block.get("name"), f"{where}.name", required=True),
                                       "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": fields.string(block.get("tool_use_id"),
                                                                          f"{where}.tool_use_id", required=True),
                            "content": _result_text(block.get("content"), f"{where}.content")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if keep_thinking:
                reasoning.append(block.get("thinking") or "")
        else:
            raise ApiError(f"content blocks of type {kind!r} are not supported in {role} messages",
                           param=f"{where}.type")
    out = list(results)
    if role == "assistant":
        out.append({"role": "assistant", "content": "".join(text) or None, **({"tool_calls": calls} if calls else {}),
                    **({"reasoning_content": "".join(reasoning)} if reasoning else {})})
    elif text or not results:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _result_text(value: Any, at: str) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    return "".join(_text_block(b, f"{at}[{i}]") for i, b in enumerate(fields.array(value, at)))


def _tool(tool: Any, at: str) -> dict:
    tool = fields.obj(tool, at, required=True)
    if tool.get("type") not in (None, "custom"):
        raise ApiError(f"server tools ({tool.get('type')!r}) are not supported; send custom tools", param=f"{at}.type")
    schema = fields.obj(tool.get("input_schema"), f"{at}.input_schema", required=True)
    function = {"name": tool.get("name"), "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


class MessagesFormat(ReplyFormat):
    """Anthropic's message object and its typed stream events. Blocks come in the reply's
    order: thinking, text, tool_use (each call one block whose input arrives as one JSON delta)."""
    id_prefix = "msg_"

    def __init__(self, model: str):
        super().__init__(model)
        self.index = -1
        self.open: str | None = None  # the kind of the block being streamed

    def final(self, reply: ReplyDelta, finish_reason: str, req: Request) -> dict:
        content = []
        if reply.reasoning:
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        if reply.content:
            content.append({"type": "text", "text": reply.content})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                    for c in reply.tool_calls]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": _stop_reason(finish_reason, req), "stop_sequence": req.stop_string,
                "usage": _usage(req), "tensorfold": tensorfold_block(req)}

    def opening(self, req: Request) -> list:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": req.num_prompt_tokens, "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": message})]

    def deltas(self, delta: ReplyDelta) -> list:
        events = []
        if delta.reasoning:
            events += self._text_delta("thinking", "thinking_delta", "thinking", delta.reasoning)
        if delta.content:
            events += self._text_delta("text", "text_delta", "text", delta.content)
        for call in delta.tool_calls:
            events += self._close()
            self.index += 1
            events += [("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": {
                        "type": "tool_use", "id": call.id, "name": call.name, "input": {}}}),
                       ("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                "delta": {"type": "input_json_delta", "partial_json": call.arguments}}),
                       ("content_block_stop", {"type": "content_block_stop", "index": self.index})]
        return events

    def closing(self, finish_reason: str, req: Request) -> list:
        return self._close() + [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": _stop_reason(finish_reason, req),
                                         "stop_sequence": req.stop_string},
                               "usage": _usage(req), "tensorfold": tensorfold_block(req)}),
            ("message_stop", {"type": "message_stop"})]

    def error_events(self, message: str) -> list:
        return [("error", {"type": "error", "error": {"type": "api_error", "message": message}})]

    def error_response(self, status: int, message: str) -> HttpResponse:
        return error_response(status, message)

    def api_error(self, err: ApiError) -> HttpResponse:
        return api_error(err)

    def _text_delta(self, kind: str, delta_type: str, key: str, text: str) -> list:
        events = []
        if self.open != kind:
            events += self._close()
            self.index += 1
            self.open = kind
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            events.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                                   "content_block": block}))
        events.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                               "delta": {"type": delta_type, key: text}}))
        return events

    def _close(self) -> list:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def _stop_reason(finish_reason: str, req: Request) -> str:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if req.stop_string is not None else "end_turn"


def _usage(req: Request) -> dict:
    return {"input_tokens": req.num_prompt_tokens, "output_tokens": len(req.output_ids),
            "cache_read_input_tokens": req.stats.cached_tokens}
