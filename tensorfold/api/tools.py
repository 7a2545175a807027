"""The tool fields of a chat body: tools, tool_choice, parallel_tool_calls, and the tool messages'
call ids. Everything is checked before any token; a 400 names the offending field.

- tools: a list of {"type": "function", "function": {"name", "description"?, "parameters"?,
  "strict"?}}; a name is 1-64 of [A-Za-z0-9_.-] (what templates and clients can carry), unique;
  parameters, when given, is a JSON Schema object ({"type": "object", ...}).
- tool_choice: "none" (the template is shown no tools), "auto", "required", or
  {"type": "function", "function": {"name"}} naming an offered tool (the only one shown).
- A tool message's tool_call_id must answer a call of an earlier assistant message.
"""
import re
from dataclasses import dataclass
from typing import Any

from tensorfold.api import fields
from tensorfold.api.errors import ApiError

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]          # as offered (validated copies)
    choice: str                      # "none" | "auto" | "required" | "named"
    named: str | None = None         # the function tool_choice names
    parallel: bool = True

    def shown(self) -> list[dict] | None:
        """The tools the template renders: none for "none", only the named one for a named choice."""
        if self.choice == "none" or not self.tools:
            return None
        if self.choice == "named":
            return [t for t in self.tools if t["function"]["name"] == self.named]
        return list(self.tools)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")


def parse_tools(body: dict, messages) -> ToolRequest | None:
    tools = fields.array(body.get("tools"), "tools")
    parallel = fields.boolean(body.get("parallel_tool_calls"), "parallel_tool_calls")
    choice, named = _choice(body.get("tool_choice"))
    if not tools:
        if choice in ("required", "named"):
            raise ApiError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        _check_tool_messages(messages)
        return None
    checked = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ApiError(f"tool name {name!r} is offered twice", param=f"tools[{i}].function.name")
    if named is not None and named not in names:
        raise ApiError(f"tool_choice names {named!r}, which is not among the offered tools ({', '.join(names)})",
                       param="tool_choice.function.name")
    _check_tool_messages(messages)
    return ToolRequest(checked, choice, named, parallel is not False)


def _choice(value: Any) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        return fields.string(value, "tool_choice", choices=CHOICES), None
    choice = fields.obj(value, "tool_choice")
    if choice.get("type") != "function":
        raise ApiError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", param="tool_choice.type")
    function = fields.obj(choice.get("function"), "tool_choice.function", required=True)
    return "named", fields.string(function.get("name"), "tool_choice.function.name", nonempty=True, required=True)


def _tool(value: Any, at: str) -> dict:
    tool = fields.obj(value, at, required=True)
    if tool.get("type") != "function":
        raise ApiError(f"'{at}.type' must be \"function\"", param=f"{at}.type")
    function = fields.obj(tool.get("function"), f"{at}.function", required=True)
    name = fields.string(function.get("name"), f"{at}.function.name", required=True)
    if not NAME.fullmatch(name):
        raise ApiError(f"tool name {name!r} must be 1-64 letters, digits, '_', '.' or '-'",
                       param=f"{at}.function.name")
    fields.string(function.get("description"), f"{at}.function.description")
    fields.boolean(function.get("strict"), f"{at}.function.strict")
    parameters = fields.obj(function.get("parameters"), f"{at}.function.parameters")
    if parameters is not None and parameters.get("type", "object") != "object":
        raise ApiError(f"'{at}.function.parameters' must be a JSON Schema object (type \"object\")",
                       param=f"{at}.function.parameters")
    if parameters is not None and not isinstance(parameters.get("properties", {}), dict):
        raise ApiError(f"'{at}.function.parameters.properties' must be an object",
                       param=f"{at}.function.parameters.properties")
    return {"type": "function", "function": dict(function)}


def _check_tool_messages(messages) -> None:
    if not messages:
        return
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                call_ids.add(call["id"])
        if message.get("role") == "tool" and message.get("tool_call_id") not in call_ids:
            raise ApiError(f"messages[{i}] answers tool call {message.get('tool_call_id')!r}, which no earlier "
                           "assistant message made", param=f"messages[{i}].tool_call_id")
