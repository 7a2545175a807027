"""Every known top-level field of a POST /v1/responses body, and what this server does with it.

Each field is in exactly one table:
- SERVED: read by api/responses.py (and, through the chat body, by api/request.py);
- HARMLESS: accepted, changes no token and no reply field. prompt_cache_key and friends: the
  prefix cache is automatic and shared, so there is nothing to key; client_metadata, user and
  safety_identifier are bookkeeping; max_tool_calls caps built-in tool calls, of which this server
  makes none; stream_options only holds include_obfuscation (no obfuscation is sent);
- NEUTRAL: features this server does not run; refused with a 400 naming the field before any
  event, unless the value means "nothing to do" (background false, truncation "disabled", ...);
- INCLUDE: the values `include` may list; others are a 400 naming include[i].
Anything else is ignored and logged, the chat route's rule for unknown fields.
"""
import json
from typing import Any

from tensorfold.api import fields
from tensorfold.api.errors import ApiError

SERVED = frozenset({
    "model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "parallel_tool_calls",
    "max_output_tokens", "temperature", "top_p", "reasoning", "text", "stream", "store", "metadata", "include",
    # TensorFold's chat extensions, passed through
    "top_k", "min_p", "seed", "draft", "thinking_budget", "stop", "ignore_eos", "chat_template_kwargs", "priority",
})

HARMLESS = frozenset({
    "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "client_metadata", "user",
    "safety_identifier", "service_tier", "max_tool_calls", "stream_options",
})

# field -> the values (besides null) that ask for nothing, and why anything else is refused
NEUTRAL = {
    "background": ((False,), "background responses are not run; send the request and wait"),
    "background_options": ((), "background responses are not run"),
    "truncation": (("disabled",), "the input is never truncated; a prompt beyond the window is a 400"),
    "top_logprobs": ((0,), "logprobs are not returned"),
    "conversation": ((), "conversations are not stored; use previous_response_id"),
    "prompt": ((), "prompt templates are not stored; send input and instructions"),
    "context_management": (([],), "server-side compaction is not run"),
    "moderation": ((), "moderation is not run"),
    "image": ((), "image generation is not run"),
    "access_programs": (([],), "access programs are not available"),
}

INCLUDE = ("reasoning.encrypted_content",)

KNOWN = SERVED | HARMLESS | NEUTRAL.keys()


def check_fields(body: dict) -> tuple[str, ...]:
    """Refuse the NEUTRAL fields set to something; the unknown fields, sorted, for a log line."""
    for key, (neutral, reason) in NEUTRAL.items():
        value = body.get(key)
        if value is None or any(fields.same_value(value, v) for v in neutral):
            continue
        accepted = " or ".join(json.dumps(v) for v in (None, *neutral))
        raise ApiError(f"'{key}' is not supported by this server: {reason} (accepted: {accepted})", param=key)
    return tuple(sorted(k for k in body if k not in KNOWN))


def included(value: Any) -> frozenset[str]:
    """The `include` list, each entry one this server serves."""
    out = set()
    for i, entry in enumerate(fields.array(value, "include") or []):
        entry = fields.string(entry, f"include[{i}]", required=True)
        if entry not in INCLUDE:
            raise ApiError(f"include {entry!r} is not supported (supported: {', '.join(INCLUDE)})",
                           param=f"include[{i}]")
        out.add(entry)
    return frozenset(out)
