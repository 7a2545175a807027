"""Message normalisation: OpenAI chat messages -> the messages a chat template renders.

The rules (spec/http-api.md, "Developer messages use system-message semantics"):

- role "developer" means "system";
- only the LEADING run of system/developer messages merges, in order, into one leading system
  message; their texts are joined with a blank line ("\\n\\n"), the separator templates
  themselves put between paragraphs of a system prompt; empty texts are skipped so no stray
  separators appear;
- later system/developer messages stay where they are, as role "system"; when the template
  refuses to render them (many raise_exception on a system message past index 0),
  `render_chat` renders them as role "user" instead;
- a content list of text parts concatenates in order with no separator (parts of other types
  are left out; the API layer rejects them before we get here); content None becomes "", which
  every template can print, test and trim; a list with image_url parts (--vision) stays a list
  of text and image_url parts, which the template writes as its image placeholders;
- a tool call's `function.arguments`, a JSON string on the wire, becomes the object it encodes
  (templates iterate it with `|items` or print it with `|tojson`); a string that is not a JSON
  object stays a string;
- every other field (name, tool_calls, tool_call_id, reasoning_content, ...) is kept.

Invariant: the caller's messages are never mutated; the result shares no mutable object with them.
"""
import copy
import json

from tensorfold.chat.template import ChatTemplate, TemplateError

SYSTEM_ROLES = ("system", "developer")


def content_text(content) -> str:
    """A message's content as one string: None -> "", text parts concatenated in order."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content
                   if isinstance(part, dict) and part.get("type") == "text")


def _decode_arguments(tool_calls):
    for call in tool_calls if isinstance(tool_calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                continue
            if isinstance(arguments, dict):
                function["arguments"] = arguments


def normalize_messages(messages: list[dict]) -> list[dict]:
    """A new list of new messages, normalised as the module docstring says."""
    out = []
    for message in messages:
        message = copy.deepcopy(message)
        content = message.get("content")
        has_image = isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url"
                                                      for p in content)
        message["content"] = ([p for p in content if p.get("type") in ("text", "image_url")] if has_image
                              else content_text(content))
        if message.get("role") == "developer":
            message["role"] = "system"
        if "tool_calls" in message:
            _decode_arguments(message["tool_calls"])
        out.append(message)

    num_leading = 0
    while num_leading < len(out) and out[num_leading].get("role") == "system":
        num_leading += 1
    if num_leading > 1:
        merged = out[0]
        merged["content"] = "\n\n".join(m["content"] for m in out[:num_leading] if m["content"])
        out[1:num_leading] = []
    return out


def later_system_as_user(messages: list[dict]) -> list[dict]:
    """Normalised messages with every system message after index 0 given role "user"."""
    return [m if i == 0 or m.get("role") != "system" else {**m, "role": "user"}
            for i, m in enumerate(messages)]


def render_chat(template: ChatTemplate, messages: list[dict], *, tools: list | None = None,
                template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> str:
    """Normalise `messages` and render them; fall back to later system messages as user ones.

    When the fallback fails too, its TemplateError propagates (the original one chained to it):
    it describes the prompt the server actually tried last.
    """
    normalized = normalize_messages(messages)
    kwargs = dict(tools=tools, template_kwargs=template_kwargs, add_generation_prompt=add_generation_prompt)
    try:
        return template.render(normalized, **kwargs)
    except TemplateError as first:
        if not any(m.get("role") == "system" for m in normalized[1:]):
            raise
        try:
            return template.render(later_system_as_user(normalized), **kwargs)
        except TemplateError as second:
            raise second from first
