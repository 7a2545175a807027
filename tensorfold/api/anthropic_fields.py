"""The Messages route's request fields: one table of every known top-level field and its handling,
and the readers of the fields that steer reasoning and context (thinking, output_config,
context_management). api/anthropic.py translates the body; this module decides what each field
may be.

Every known field is in FIELDS, with one of three handlings:
- SERVED: read by the translation (api/anthropic.py) or below;
- NO_OP: accepted whatever its value, because it asks for nothing this server would do
  differently (bookkeeping, billing, routing, prompt-cache hints: the prefix cache is automatic);
- Refused(neutral): a 400 naming the field, before any token, unless the value is null or one of
  `neutral`, the values that mean "nothing to do".
Unknown fields are ignored, as this route always did (clients send vendor extras).

Decisions where the reference is silent:
- output_config.effort names map onto the chat efforts: low, medium, high, xhigh as themselves,
  max -> xhigh; the model card then names them for the template (chat/cards.py). The effort is the
  chat reasoning_effort, so it follows the chat effort rule (it turns thinking on unless thinking
  is disabled, which wins).
- thinking adaptive: thinking on, at output_config.effort, else the server's default effort.
- context_management clear_thinking_20251015 keeps the thinking of the `keep` most recent
  assistant messages that carry thinking (default 1, Anthropic's); older ones lose their thinking
  blocks before the prompt is built. Edits that fire on an input-token trigger (clear_tool_uses,
  compact) are no-ops when the trigger is at or beyond the model's window (no prompt can reach it);
  otherwise they are refused.
"""
from dataclasses import dataclass
import json
from typing import Any

from tensorfold.api import fields
from tensorfold.api.errors import ApiError

SERVED = "served"
NO_OP = "no-op"


@dataclass(frozen=True)
class Refused:
    reason: str
    neutral: tuple = ()  # values, besides null, that mean "nothing to do"


FIELDS: dict[str, str | Refused] = {
    "model": SERVED,
    "max_tokens": SERVED,
    "messages": SERVED,
    "system": SERVED,
    "stop_sequences": SERVED,
    "temperature": SERVED,
    "top_p": SERVED,
    "top_k": SERVED,
    "stream": SERVED,
    "tools": SERVED,
    "tool_choice": SERVED,
    "thinking": SERVED,
    "output_config": SERVED,
    "context_management": SERVED,
    "seed": SERVED,                  # ours
    "draft": SERVED,                 # ours
    "metadata": NO_OP,               # user_id: bookkeeping
    "cache_control": NO_OP,          # the prefix cache is automatic
    "service_tier": NO_OP,
    "inference_geo": NO_OP,
    "user_profile_id": NO_OP,
    "workspace_id": NO_OP,
    "billing_policy": NO_OP,
    "fallbacks": NO_OP,              # this server never declines a request for policy reasons
    "container": Refused("code execution containers are not available on this server"),
    "mcp_servers": Refused("server-side MCP connectors are not available on this server; "
                           "connect MCP servers in the client", ([],)),
    "diagnostics": Refused("prompt-cache diagnostics are not available on this server", ({},)),
    "speed": Refused("speed modes are not available on this server", ("standard",)),
    "compaction": Refused("server-side compaction is not available on this server"),
    "thread": Refused("server-held threads are not available on this server; send the whole conversation"),
    "fallback_credit_token": Refused("this server issues no fallback credit tokens"),
}

# Anthropic effort -> the chat reasoning effort (api/request.py REASONING_EFFORTS).
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}
DEFAULT_KEEP_THINKING = 1
TRIGGER_DEFAULTS = {"clear_tool_uses_20250919": 100_000, "compact_20260112": 150_000}


def refuse_unserved(body: dict) -> None:
    """400 naming the first Refused field whose value asks for something."""
    for key, handling in FIELDS.items():
        if not isinstance(handling, Refused):
            continue
        value = body.get(key)
        if value is None or any(fields.same_value(value, v) for v in handling.neutral):
            continue
        accepted = " or ".join(json.dumps(v) for v in (None, *handling.neutral))
        raise ApiError(f"'{key}': {handling.reason} (accepted: {accepted})", param=key)


def reasoning(body: dict) -> dict:
    """The chat fields for thinking and output_config: chat_template_kwargs, reasoning_effort,
    thinking_budget, response_format."""
    chat = {}
    config = fields.obj(body.get("output_config"), "output_config") or {}
    effort = fields.string(config.get("effort"), "output_config.effort", choices=tuple(EFFORTS))
    if effort is not None:
        chat["reasoning_effort"] = EFFORTS[effort]
    output_format = fields.obj(config.get("format"), "output_config.format")
    if output_format is not None:
        fields.string(output_format.get("type"), "output_config.format.type", choices=("json_schema",), required=True)
        schema = fields.obj(output_format.get("schema"), "output_config.format.schema", required=True)
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    thinking = fields.obj(body.get("thinking"), "thinking")
    if thinking is None:
        return chat
    kind = fields.string(thinking.get("type"), "thinking.type", choices=("enabled", "disabled", "adaptive"),
                         required=True)
    if fields.string(thinking.get("display"), "thinking.display", choices=("summarized", "omitted")) == "omitted":
        raise ApiError("thinking.display 'omitted' is not supported; this server returns the thinking text",
                       param="thinking.display")
    if kind == "disabled":
        chat["reasoning_effort"] = "none"
        return chat
    chat["chat_template_kwargs"] = {"enable_thinking": True}
    budget = fields.integer(thinking.get("budget_tokens"), "thinking.budget_tokens", lo=1, required=kind == "enabled")
    if budget is not None:
        chat["thinking_budget"] = budget
    return chat


def thinking_kept(body: dict, messages: list, context_length: int | None) -> set[int]:
    """Indices of the messages whose thinking blocks stay in the prompt (all of them unless a
    clear_thinking edit says otherwise); other context_management edits checked."""
    with_thinking = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"
                     and isinstance(m.get("content"), list)
                     and any(isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking")
                             for b in m["content"])]
    keep = len(with_thinking)
    management = fields.obj(body.get("context_management"), "context_management")
    edits = fields.array(management.get("edits"), "context_management.edits") if management else None
    for k, edit in enumerate(edits or ()):
        at = f"context_management.edits[{k}]"
        edit = fields.obj(edit, at, required=True)
        kind = fields.string(edit.get("type"), f"{at}.type", required=True)
        if kind == "clear_thinking_20251015":
            keep = min(keep, _keep_turns(edit.get("keep"), f"{at}.keep", len(with_thinking)))
        elif kind in TRIGGER_DEFAULTS:
            _check_unreachable(edit, kind, at, context_length)
        else:
            raise ApiError(f"context_management edit {kind!r} is not supported", param=f"{at}.type")
    return set(with_thinking[len(with_thinking) - keep:]) if keep else set()


def _keep_turns(value: Any, at: str, num_turns: int) -> int:
    if value is None:
        return DEFAULT_KEEP_THINKING
    if value == "all":
        return num_turns
    value = fields.obj(value, at)
    kind = fields.string(value.get("type"), f"{at}.type", choices=("thinking_turns", "all"), required=True)
    if kind == "all":
        return num_turns
    return fields.integer(value.get("value"), f"{at}.value", lo=0, required=True)


def _check_unreachable(edit: dict, kind: str, at: str, context_length: int | None) -> None:
    """An edit that fires past an input-token trigger does nothing when no prompt can reach it."""
    trigger = fields.obj(edit.get("trigger"), f"{at}.trigger")
    threshold = TRIGGER_DEFAULTS[kind]
    if trigger is not None:
        if trigger.get("type") != "input_tokens":
            raise ApiError(f"context_management edit {kind!r} with a {trigger.get('type')!r} trigger is not "
                           "supported", param=f"{at}.trigger")
        threshold = fields.integer(trigger.get("value"), f"{at}.trigger.value", lo=1, required=True)
    if context_length is None or threshold < context_length:
        raise ApiError(f"context_management edit {kind!r} is not supported (it is accepted only when its trigger, "
                       f"{threshold} input tokens, is at or beyond the model's {context_length}-token window)",
                       param=f"{at}.type")
