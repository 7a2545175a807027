"""The Responses API's reply: the response object, its output items and its typed stream events.

Output items: reasoning (reasoning_text content, empty summary, and encrypted_content when the
request's include asks for reasoning.encrypted_content: api/reasoning_token.py), message
(output_text) and function_call (with `namespace` when the tool came inside a namespace tool);
status completed, or incomplete with incomplete_details.reason max_output_tokens; usage with cached
and reasoning tokens; the tensorfold block (with ignored_tools when built-in tools were dropped).
Typed stream events carry strictly increasing sequence_number and end in response.completed,
response.incomplete or response.failed; a streamed reasoning item gets its encrypted_content on
response.output_item.done. `on_complete(response)` (the store) runs before the last event or the
body goes out.
"""
from dataclasses import dataclass, field

from tensorfold.api.errors import ApiError
from tensorfold.api.reasoning_token import ReasoningSealer
from tensorfold.api.replies import ReplyFormat, tensorfold_block
from tensorfold.api.responses_tools import ToolNames, qualified
from tensorfold.chat.reply_parser import ReplyDelta
from tensorfold.engine.request import Request


@dataclass
class ReplyOptions:
    """What the request asks of the reply beyond the echoed fields."""
    names: ToolNames = field(default_factory=ToolNames)
    sealer: ReasoningSealer | None = None    # set: reasoning items carry encrypted_content
    ignored_tools: tuple[str, ...] = ()      # built-in tool types dropped (--builtin-tools ignore)


class ResponsesFormat(ReplyFormat):
    """The response object, its output items and its typed stream events. `on_complete(response)`
    runs (the store) before the last event or the body goes out."""
    id_prefix = "resp_"

    def __init__(self, model: str, echo: dict | None = None, on_complete=None, options: ReplyOptions | None = None):
        super().__init__(model)
        self.echo = echo or {}
        self.on_complete = on_complete
        self.options = options or ReplyOptions()
        self.sequence = 0
        self.items: list[dict] = []      # output items so far (streaming)
        self.open: dict | None = None    # the reasoning or message item being streamed

    # -- whole --------------------------------------------------------------------------------

    def final(self, reply: ReplyDelta, finish_reason: str, req: Request) -> dict:
        items = []
        if reply.reasoning:
            items.append(self._sealed(self._reasoning_item(reply.reasoning)))
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
        if self.options.ignored_tools:
            response["tensorfold"]["ignored_tools"] = list(self.options.ignored_tools)
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

    def _sealed(self, item: dict) -> dict:
        if self.options.sealer is not None:
            item["encrypted_content"] = self.options.sealer.seal(item["content"][0]["text"])
        return item

    def _message_item(self, text: str, status: str = "completed") -> dict:
        return {"id": f"msg_{self.id[5:]}_{len(self.items)}", "type": "message", "status": status,
                "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def _call_item(self, call) -> dict:
        namespace, name = self.options.names.split(call.name)
        item = {"id": f"fc_{self.id[5:]}_{call.index}", "type": "function_call", "status": "completed",
                "call_id": call.id, "name": name, "arguments": call.arguments}
        if namespace is not None:
            item["namespace"] = namespace
        return item

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
            self._sealed(item)
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
            # cache_write_tokens: the openai SDK's usage model requires it; the prefix cache is
            # automatic and nothing is written on request, so 0
            "input_tokens_details": {"cached_tokens": req.stats.cached_tokens, "cache_write_tokens": 0},
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
            name = qualified(item["namespace"], item["name"]) if item.get("namespace") else item["name"]
            message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": name, "arguments": item["arguments"]}})
    return message

