"""The tools of a Responses body as chat tools: function tools, namespace tools, built-in tools,
tool_choice, and the way back from a call's flat name to its namespace.

- function: {"type": "function", "name", "description"?, "parameters"?, "strict"?} -> a chat tool.
- namespace: {"type": "namespace", "name", "description"?, "tools": [function tools]} (Codex sends
  its MCP servers' tools so). The template sees each function under one flat, qualified name:
  the namespace and the name joined by "__" (nothing is added when the namespace already ends in
  "__" or "." as Codex's "mcp__server__" does). A call of that name goes back as a function_call
  item with `name` the function's own name and `namespace` the namespace (ToolNames.split).
- built-in tools (web_search, file_search, computer use, ...) run on OpenAI's side; this server
  runs none. builtin_tools "refuse" (the default) answers 400 naming the tool and how to turn it
  off in Codex; "ignore" drops them, and the caller lists them in the reply's tensorfold block.
- custom (freeform) tools have no grammar here: refused.
Invariant: flat names are unique across the offer (a 400 names the second one).
"""
from dataclasses import dataclass, field
from typing import Any

from tensorfold.api import fields
from tensorfold.api.errors import ApiError
from tensorfold.api.tools import NAME

BUILTIN_TOOLS = ("refuse", "ignore")
CODEX_HINT = {
    "web_search": 'in Codex, set web_search = "disabled" in ~/.codex/config.toml',
    "web_search_preview": 'in Codex, set web_search = "disabled" in ~/.codex/config.toml',
    "image_generation": "in Codex, turn the image generation feature off in ~/.codex/config.toml",
}


@dataclass
class ToolNames:
    """Flat (template) name -> (namespace, name) for the functions offered inside namespaces."""
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def split(self, flat: str) -> tuple[str | None, str]:
        return self.namespaced.get(flat, (None, flat))


def qualified(namespace: str, name: str) -> str:
    return namespace + name if namespace.endswith(("__", ".")) else f"{namespace}__{name}"


@dataclass
class OfferedTools:
    chat_tools: list[dict]           # chat tools, namespaces flattened
    names: ToolNames
    ignored: list[str]               # built-in tool types dropped under builtin_tools "ignore"


def offered_tools(value: Any, builtin_tools: str = "refuse") -> OfferedTools:
    offer = OfferedTools([], ToolNames(), [])
    for i, tool in enumerate(fields.array(value, "tools") or []):
        at = f"tools[{i}]"
        tool = fields.obj(tool, at, required=True)
        kind = fields.string(tool.get("type"), f"{at}.type", required=True)
        if kind == "function":
            offer.chat_tools.append(_function(tool, at))
        elif kind == "namespace":
            namespace = fields.string(tool.get("name"), f"{at}.name", required=True, nonempty=True)
            for j, inner in enumerate(fields.array(tool.get("tools"), f"{at}.tools", required=True)):
                inner_at = f"{at}.tools[{j}]"
                inner = fields.obj(inner, inner_at, required=True)
                if inner.get("type") != "function":
                    raise ApiError(f"tools of type {inner.get('type')!r} inside a namespace are not supported; "
                                   "send function tools", param=f"{inner_at}.type")
                chat = _function(inner, inner_at)
                own = chat["function"]["name"]
                flat = qualified(namespace, own)
                _check_name(flat, f"{inner_at}.name")
                chat["function"]["name"] = flat
                offer.names.namespaced[flat] = (namespace, own)
                offer.chat_tools.append(chat)
        elif kind == "custom":
            raise ApiError("custom (freeform) tools are not supported; send function tools", param=f"{at}.type")
        elif builtin_tools == "ignore":
            offer.ignored.append(kind)
        else:
            hint = CODEX_HINT.get(kind, "in Codex, turn that tool off in ~/.codex/config.toml")
            raise ApiError(f"{at} is the built-in tool {kind!r}, which this server does not run; {hint}, "
                           "or start the server with --builtin-tools ignore to drop built-in tools",
                           param=f"{at}.type")
    flats = [t["function"]["name"] for t in offer.chat_tools]
    for k, name in enumerate(flats):
        if name in flats[:k]:
            raise ApiError(f"tool name {name!r} is offered twice", param="tools")
    return offer


def _function(tool: dict, at: str) -> dict:
    name = fields.string(tool.get("name"), f"{at}.name", required=True)
    function = {"name": name}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _check_name(name: str, at: str) -> None:
    if not NAME.fullmatch(name):
        raise ApiError(f"the qualified tool name {name!r} must be 1-64 of A-Z a-z 0-9 _ . -", param=at)


def tool_choice(value: Any, chat: dict, names: ToolNames) -> None:
    """The chat tool_choice (and, for allowed_tools, the chat tools kept) of a Responses one."""
    if isinstance(value, str):
        chat["tool_choice"] = value
        return
    choice = fields.obj(value, "tool_choice")
    kind = choice.get("type")
    if kind == "function":
        name = fields.string(choice.get("name"), "tool_choice.name", required=True)
        namespace = fields.string(choice.get("namespace"), "tool_choice.namespace")
        chat["tool_choice"] = {"type": "function", "function": {
            "name": qualified(namespace, name) if namespace else name}}
    elif kind == "allowed_tools":
        mode = fields.string(choice.get("mode"), "tool_choice.mode", choices=("auto", "required"), required=True)
        allowed = set()
        for i, t in enumerate(fields.array(choice.get("tools"), "tool_choice.tools", required=True)):
            t = fields.obj(t, f"tool_choice.tools[{i}]", required=True)
            name = fields.string(t.get("name"), f"tool_choice.tools[{i}].name", required=True)
            namespace = fields.string(t.get("namespace"), f"tool_choice.tools[{i}].namespace")
            allowed.add(qualified(namespace, name) if namespace else name)
        # a namespace named whole allows all of its functions
        chat["tools"] = [t for t in chat.get("tools", []) if t["function"]["name"] in allowed
                         or names.split(t["function"]["name"])[0] in allowed]
        chat["tool_choice"] = mode
    else:
        raise ApiError("tool_choice must be none, auto, required, a function or allowed_tools",
                       param="tool_choice.type")
