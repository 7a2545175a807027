"""OpenAI reply objects: chat.completion / chat.completion.chunk and text_completion, with the
usage block and the `tensorfold` block every reply carries.

token_sha is the first 12 hex digits of SHA-256 over the comma-joined reply token ids: the
fingerprint two runs compare to check the exactness promises from outside.
"""
import hashlib
import time
import uuid

from tensorfold.api.errors import ApiError
from tensorfold.chat.reply_parser import ReplyDelta
from tensorfold.engine.request import Request
from tensorfold.http.messages import HttpResponse


def token_sha(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:12]


def usage(req: Request) -> dict:
    completion = len(req.output_ids)
    return {
        "prompt_tokens": req.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": req.num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": req.stats.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": req.stats.reasoning_tokens},
    }


def tensorfold_block(req: Request) -> dict:
    s = req.stats
    ttft = (s.first_token_s - s.arrival_s) if s.first_token_s is not None else None
    decoded = len(req.output_ids) - 1
    return {
        "token_sha": token_sha(req.output_ids),
        "ttft_s": round(ttft, 6) if ttft is not None else None,
        "decode_tps": round(decoded / s.decode_s, 3) if decoded > 0 and s.decode_s > 0 else None,
        "prefill_s": round(s.prefill_s, 6),
        "drafted": s.drafted,
        "accepted": s.accepted,
        "drafted_by_position": list(s.drafted_by_position),   # [i]: drafts verified at depth i + 1
        "accepted_by_position": list(s.accepted_by_position),
        **({"grammar_compile_ms": round(s.grammar_compile_s * 1e3, 3)} if s.grammar_compile_s is not None else {}),
    }


class ReplyFormat:
    """The JSON shapes of one reply, one subclass per endpoint: ChatFormat and CompletionFormat
    below, api/anthropic.py's MessagesFormat. The reply arrives as ReplyDelta pieces
    (chat/reply_parser.py: content, reasoning, calls); a stream is a list of (event name or
    None, data) pairs: opening() once, deltas() per piece, closing() at the end."""
    obj = ""            # the whole reply's object name
    chunk_obj = ""      # a streamed chunk's
    id_prefix = ""

    def __init__(self, model: str):
        self.model = model
        self.id = self.id_prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def final(self, reply: ReplyDelta, finish_reason: str, req: Request) -> dict:
        body = self._envelope(self.obj, [{"index": 0, **self._whole(reply), "logprobs": None,
                                          "finish_reason": finish_reason}])
        body["usage"] = usage(req)
        body["tensorfold"] = tensorfold_block(req)
        return body

    def opening(self, req: Request) -> list:
        return []

    def deltas(self, delta: ReplyDelta) -> list:
        return [(None, self.chunk(delta, None))] if delta else []

    def closing(self, finish_reason: str, req: Request) -> list:
        return [(None, self.chunk(ReplyDelta(), finish_reason)), (None, self.usage_chunk(req)), (None, "[DONE]")]

    def error_events(self, message: str) -> list:
        return [(None, {"error": {"message": message, "type": "server_error", "param": None, "code": None}}),
                (None, "[DONE]")]

    def error_response(self, status: int, message: str) -> HttpResponse:
        return HttpResponse.error(status, message, type="server_error")

    def api_error(self, err: ApiError) -> HttpResponse:
        return HttpResponse.from_error(err)

    def chunk(self, delta: ReplyDelta, finish_reason: str | None) -> dict:
        return self._envelope(self.chunk_obj, [{"index": 0, **self._delta(delta), "logprobs": None,
                                                "finish_reason": finish_reason}])

    def usage_chunk(self, req: Request) -> dict:
        body = self._envelope(self.chunk_obj, [])
        body["usage"] = usage(req)
        body["tensorfold"] = tensorfold_block(req)
        return body

    def _whole(self, reply: ReplyDelta) -> dict:
        raise NotImplementedError

    def _delta(self, delta: ReplyDelta) -> dict:
        raise NotImplementedError


class ChatFormat(ReplyFormat):
    obj, chunk_obj, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def _whole(self, reply: ReplyDelta) -> dict:
        message = {"role": "assistant", "content": reply.content if reply.content or not reply.tool_calls else None}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [c.as_message() for c in reply.tool_calls]
        return {"message": message}

    def opening(self, req: Request) -> list:
        return [(None, self._envelope(self.chunk_obj, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]))]

    def _delta(self, delta: ReplyDelta) -> dict:
        out = {}
        if delta.reasoning:
            out["reasoning_content"] = delta.reasoning
        if delta.content:
            out["content"] = delta.content
        if delta.tool_calls:
            out["tool_calls"] = [{"index": c.index, **c.as_message()} for c in delta.tool_calls]
        return {"delta": out}


class CompletionFormat(ReplyFormat):
    obj = chunk_obj = "text_completion"
    id_prefix = "cmpl-"

    def _whole(self, reply: ReplyDelta) -> dict:
        return {"text": reply.content}

    def _delta(self, delta: ReplyDelta) -> dict:
        return {"text": delta.content}


FORMATS = {"chat": ChatFormat, "completion": CompletionFormat}
