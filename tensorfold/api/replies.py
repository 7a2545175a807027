"""OpenAI reply objects: chat.completion / chat.completion.chunk and text_completion, with the
usage block and the `tensorfold` block every reply carries.

token_sha is the first 12 hex digits of SHA-256 over the comma-joined reply token ids: the
fingerprint two runs compare to check the exactness promises from outside.
"""
import hashlib
import time
import uuid

from tensorfold.engine.request import Request


def token_sha(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:12]


def usage(req: Request) -> dict:
    completion = len(req.output_ids)
    return {
        "prompt_tokens": req.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": req.num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": req.stats.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
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
        **({"grammar_compile_ms": round(s.grammar_compile_s * 1e3, 3)} if s.grammar_compile_s is not None else {}),
    }


class ReplyFormat:
    """The JSON shapes of one reply; `kind` is "chat" or "completion"."""

    def __init__(self, kind: str, model: str):
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def final(self, text: str, finish_reason: str, req: Request) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(req)
        body["tensorfold"] = tensorfold_block(req)
        return body

    def first_chunk(self) -> dict | None:
        if self.kind != "chat":
            return None
        return self.chunk("", None, role=True)

    def chunk(self, text: str, finish_reason: str | None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            return self._envelope("chat.completion.chunk",
                                  [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])
        return self._envelope("text_completion",
                              [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}])

    def usage_chunk(self, req: Request) -> dict:
        body = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [])
        body["usage"] = usage(req)
        body["tensorfold"] = tensorfold_block(req)
        return body
