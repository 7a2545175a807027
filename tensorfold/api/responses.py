"""POST /v1/responses: OpenAI's Responses API over the same chat path, with a response store.

A Responses body becomes the equivalent chat completions body (to_chat_body), which runs through
the chat parser, template, engine and reply parser unchanged: the same prompt tokens, token_sha
and drafting. Translation:
- input: a string (one user message) or items: messages (role, content as a string or
  input_text / output_text parts), function_call (an assistant tool call), function_call_output
  (a tool message; its call_id must answer a call before it), reasoning (its reasoning_text goes
  back to the template as the next assistant message's reasoning);
- instructions -> a leading system message, for this turn only (not carried by
  previous_response_id); previous_response_id -> the stored conversation, then this input;
- tools (function: name, description, parameters), tool_choice (none, auto, required,
  {"type": "function", "name"}, {"type": "allowed_tools", "mode", "tools"}), parallel_tool_calls;
- max_output_tokens (reasoning included), temperature, top_p, top_k, min_p, seed,
  reasoning.effort (reasoning.summary accepted, none written), text.format (json_schema,
  json_object, text), stream, and the TensorFold passthroughs (draft, thinking_budget, stop,
  ignore_eos, chat_template_kwargs, priority);
- store (default true), metadata (at most 16 string pairs, keys <= 64 and values <= 512 chars).
The reply (ResponsesFormat): output items reasoning (reasoning_text content, empty summary),
message (output_text) and function_call; status completed, or incomplete with
incomplete_details.reason max_output_tokens; usage with cached and reasoning tokens; typed stream
events with strictly increasing sequence_number, ending in response.completed,
response.incomplete or response.failed. Stored responses (api/response_store.py) are complete
before their last event or body is sent.
"""
import json
from dataclasses import dataclass, field
from typing import Any

from tensorfold.api import fields
from tensorfold.api.errors import ApiError
from tensorfold.api.replies import ReplyFormat, tensorfold_block
from tensorfold.api.response_store import ResponseStore
from tensorfold.chat.reply_parser import ReplyDelta
from tensorfold.engine.request import Request

PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stream", "parallel_tool_calls",
          "draft", "thinking_budget", "stop", "ignore_eos", "chat_template_kwargs", "priority")
MAX_METADATA = 16


@dataclass
class ResponsesRequest:
    chat: dict                       # the equivalent chat completions body
    input_items: list[dict]
    conversation: list[dict]         # the chat messages without instructions (what continues)
    echo: dict = field(default_factory=dict)  # request fields the response object repeats


def to_chat_body(body: Any, store: ResponseStore) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {fields.json_type(body)}")
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
    items = _input_items(body.get("input"))
    conversation = history + _messages(items, history)
    instructions = fields.string(body.get("instructions"), "instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    tools = fields.array(body.get("tools"), "tools")
    if tools:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
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
            "tools": tools or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": None},
            "text": {"format": fmt or {"type": "text"}}}
    return ResponsesRequest(chat, items, conversation, echo)


def _input_items(value: Any) -> list[dict]:
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
            role = fields.string(item.get("role"), f"{at}.role", choices=("user", "assistant", "system", "developer"),
                                 required=True)
            content = item.get("content")
            if isinstance(content, str):
                parts = [{"type": "input_text" if role != "assistant" else "output_text", "text": content}]
            else:
                parts = []
                for j, part in enumerate(fields.array(content, f"{at}.content", required=True)):
                    part = fields.obj(part, f"{at}.content[{j}]", required=True)
                    ptype = fields.string(part.get("type"), f"{at}.content[{j}].type", required=True)
                    if ptype not in ("input_text", "output_text", "text"):
                        raise ApiError(f"content parts of type {ptype!r} are not supported",
                                       param=f"{at}.content[{j}].type")
                    parts.append({"type": ptype, "text": fields.string(part.get("text"), f"{at}.content[{j}].text",
                                                                       required=True)})
            out.append({"type": "message", "role": role, "content": parts})
        elif kind == "function_call":
            out.append({"type": "function_call",
                        "call_id": fields.string(item.get("call_id"), f"{at}.call_id", required=True),
                        "name": fields.string(item.get("name"), f"{at}.name", required=True),
                        "arguments": fields.string(item.get("arguments"), f"{at}.arguments", required=True)})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output) if output is not None else ""
            out.append({"type": "function_call_output",
                        "call_id": fields.string(item.get("call_id"), f"{at}.call_id", required=True),
                        "output": output})
        elif kind == "reasoning":
            texts = [fields.string(c.get("text"), f"{at}.content[{j}].text") or ""
                     for j, c in enumerate(fields.array(item.get("content"), f"{at}.content") or [])
                     if isinstance(c, dict)]
            out.append({"type": "reasoning", "content": [{"type": "reasoning_text", "text": "".join(texts)}],
                        "summary": []})
        else:
            raise ApiError(f"input items of type {kind!r} are not supported", param=f"{at}.type")
    return out


def _messages(items: list[dict], history: list[dict]) -> list[dict]:
    """Chat messages of the input items; function_call_output ids must answer a call before them."""
    calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    out: list[dict] = []
    reasoning = None
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            text = "".join(p["text"] for p in item["content"])
            message = {"role": item["role"], "content": text}
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
            last.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
            calls.add(item["call_id"])
        else:  # function_call_output
            if item["call_id"] not in calls:
                raise ApiError(f"function_call_output for call {item['call_id']!r}, which no function_call before "
                               "it made", param=f"input[{i}].call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def _tool(tool: Any, at: str) -> dict:
    tool = fields.obj(tool, at, required=True)
    if tool.get("type") != "function":
        raise ApiError(f"tools of type {tool.get('type')!r} are not supported; send function tools",
                       param=f"{at}.type")
    function = {"name": tool.get("name")}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_choice(value: Any, chat: dict) -> None:
    if isinstance(value, str):
        chat["tool_choice"] = value
        return
    choice = fields.obj(value, "tool_choice")
    kind = choice.get("type")
    if kind == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif kind == "allowed_tools":
        mode = fields.string(choice.get("mode"), "tool_choice.mode", choices=("auto", "required"), required=True)
        names = {fields.string((t or {}).get("name"), f"tool_choice.tools[{i}].name", required=True)
                 for i, t in enumerate(fields.array(choice.get("tools"), "tool_choice.tools", required=True))}
        chat["tools"] = [t for t in chat.get("tools", []) if t["function"]["name"] in names]
        chat["tool_choice"] = mode
    else:
        raise ApiError("tool_choice must be none, auto, required, a function or allowed_tools",
                       param="tool_choice.type")


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


class ResponsesFormat(ReplyFormat):
    """The response object, its output items and its typed stream events. `on_complete(response)`
    runs (the store) before the last event or the body goes out."""
    id_prefix = "resp_"

    def __init__(self, model: str, echo: dict | None = None, on_complete=None):
        super().__init__(model)
        self.echo = echo or {}
        self.on_complete = on_complete
        self.sequence = 0
        self.items: list[dict] = []      # output items so far (streaming)
        self.open: dict | None = None    # the reasoning or message item being streamed

    # -- whole --------------------------------------------------------------------------------

    def final(self, reply: ReplyDelta, finish_reason: str, req: Request) -> dict:
        items = []
        if reply.reasoning:
            items.append(self._reasoning_item(reply.reasoning))
        if reply.content or not (reply.reasoning or reply.tool_calls):
            items.append(self._message_item(reply.content))
        items += [self._call_item(c) for c in reply.tool_calls]
        return self._complete(items, finish_reason, req)

    def _complete(self, items: list[dict], finish_reason: str, req: Request) -> dict:
        response = self._response("incomplete" if finish_reason == "length" else "completed", items)
        if finish_reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["usage"] = _usage(req)
        response["tensorfold"] = tensorfold_block(req)
        if self.on_complete is not None:
            self.on_complete(response)
        return response

    def _response(self, status: str, output: list[dict]) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": None, "model": self.model, "output": output, "truncation": "disabled",
                "usage": None, **self.echo}

    def _reasoning_item(self, text: str) -> dict:
        return {"id": f"rs_{self.id[5:]}_{len(self.items)}", "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def _message_item(self, text: str, status: str = "completed") -> dict:
        return {"id": f"msg_{self.id[5:]}_{len(self.items)}", "type": "message", "status": status,
                "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def _call_item(self, call) -> dict:
        return {"id": f"fc_{self.id[5:]}_{call.index}", "type": "function_call", "status": "completed",
                "call_id": call.id, "name": call.name, "arguments": call.arguments}

    # -- streamed -----------------------------------------------------------------------------

    def _event(self, kind: str, **data) -> tuple:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence, **data}

    def opening(self, req: Request) -> list:
        return [self._event("response.created", response=self._response("in_progress", [])),
                self._event("response.in_progress", response=self._response("in_progress", []))]

    def deltas(self, delta: ReplyDelta) -> list:
        events = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            events += self._close()
            item = self._call_item(call)
            index = len(self.items)
            self.items.append(item)
            events += [self._event("response.output_item.added", output_index=index,
                                   item={**item, "status": "in_progress", "arguments": ""}),
                       self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=call.arguments),
                       self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=call.arguments),
                       self._event("response.output_item.done", output_index=index, item=item)]
        return events

    def _text(self, kind: str, text: str) -> list:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            item = self._reasoning_item("") if kind == "reasoning" else self._message_item("", "in_progress")
            self.open = item
            self.items.append(item)
            index = len(self.items) - 1
            added = dict(item, content=[])
            events.append(self._event("response.output_item.added", output_index=index, item=added))
            if kind == "message":
                events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                          content_index=0, part={"type": "output_text", "text": "",
                                                                 "annotations": []}))
        index = len(self.items) - 1
        self.open["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        events.append(self._event(name, item_id=self.open["id"], output_index=index, content_index=0, delta=text,
                                  **({"logprobs": []} if kind == "message" else {})))
        return events

    def _close(self) -> list:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        text = item["content"][0]["text"]
        if item["type"] == "reasoning":
            return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text),
                    self._event("response.output_item.done", output_index=index, item=item)]
        item["status"] = "completed"
        part = item["content"][0]
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def closing(self, finish_reason: str, req: Request) -> list:
        events = self._close()
        response = self._complete(list(self.items), finish_reason, req)
        kind = "response.incomplete" if finish_reason == "length" else "response.completed"
        return events + [self._event(kind, response=response)]

    def api_error(self, err: ApiError):
        return super().api_error(responses_error(err))

    def error_events(self, message: str) -> list:
        response = self._response("failed", list(self.items))
        response["error"] = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=response)]


# chat fields a Responses error may name, and what the Responses body calls them
CHAT_PARAMS = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input",
               "reasoning_effort": "reasoning.effort"}


def responses_error(err: ApiError) -> ApiError:
    """An error raised on the translated chat body, naming the Responses field instead."""
    if err.param:
        head, dot, rest = err.param.partition(".")
        name = head.split("[")[0]
        if name in CHAT_PARAMS and name != "messages":
            err.param = CHAT_PARAMS[name] + (head[len(name):] + dot + rest if head != name or dot else "")
        elif name == "messages":
            err.param = "input"
    return err


def _usage(req: Request) -> dict:
    reasoning = req.stats.reasoning_tokens
    return {"input_tokens": req.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": req.stats.cached_tokens},
            "output_tokens": len(req.output_ids), "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": req.num_prompt_tokens + len(req.output_ids)}


def assistant_message(response: dict) -> dict:
    """The chat message a stored response's output is, for the next turn's conversation."""
    message = {"role": "assistant", "content": None}
    for item in response["output"]:
        if item["type"] == "reasoning":
            message["reasoning_content"] = "".join(c["text"] for c in item["content"])
        elif item["type"] == "message":
            message["content"] = (message["content"] or "") + "".join(c["text"] for c in item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return message

