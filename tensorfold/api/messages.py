"""Validation of chat `messages` as they arrive on the wire: roles, content shapes, content part
types and the tool-call structure. Normalisation for the template (merging system messages,
decoding tool arguments) is tensorfold.chat.messages' job; this module only accepts or refuses.

Accepted per role (the OpenAI chat contract):
- system, developer, tool: content is a string or a nonempty list of text parts;
  a tool message also needs a string tool_call_id.
- user: a string or a nonempty list of text parts and, with --vision only, image_url parts.
- assistant: a string, a list of text parts, or null/absent when it carries tool_calls;
  tool_calls is a list of {id, type: "function", function: {name, arguments: <JSON string>}};
  reasoning_content / reasoning, when present, are strings (our own replies carry them).
Every message may carry a string `name`. Other keys are left in place for the template.
Refused: audio, video, file and any unknown part type; images outside user messages;
the deprecated function_call message field; assistant audio.
Invariant: the caller's objects are never mutated; the result is a deep copy.
"""
import copy
from typing import Any

from tensorfold.api import fields
from tensorfold.api.errors import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")
IMAGE_DETAILS = ("auto", "low", "high")
# Part types a client may send that this server cannot read, with the words its 400 uses.
UNSUPPORTED_PARTS = {
    "input_audio": "audio input",
    "audio": "audio input",
    "audio_url": "audio input",
    "video": "video input",
    "video_url": "video input",
    "file": "file input",
    "input_file": "file input",
    "image_embeds": "image embeddings",
    "image_pil": "image input other than image_url",
}


def check_messages(value: Any, *, vision: bool) -> tuple[dict, ...]:
    """The validated messages, deep-copied, or an ApiError naming the first bad field."""
    fields.array(value, "messages", required=True, nonempty=True)
    for i, message in enumerate(value):
        _check_message(message, f"messages[{i}]", vision)
    return tuple(copy.deepcopy(m) for m in value)


def _check_message(message: Any, at: str, vision: bool) -> None:
    if not isinstance(message, dict):
        raise ApiError(f"'{at}' must be an object, got {fields.json_type(message)}", param=at)
    role = message.get("role")
    fields.string(role, f"{at}.role", required=True, choices=ROLES)
    fields.string(message.get("name"), f"{at}.name")

    tool_calls = message.get("tool_calls")
    if tool_calls is not None and role != "assistant":
        raise ApiError(f"'{at}.tool_calls' is only accepted on assistant messages",
                       param=f"{at}.tool_calls")
    if role == "assistant":
        _check_assistant_extras(message, at)
    if role == "tool":
        fields.string(message.get("tool_call_id"), f"{at}.tool_call_id", required=True)

    content = message.get("content")
    if content is None:
        if role == "assistant" and tool_calls:
            return
        raise ApiError(f"'{at}.content' is required for a {role} message"
                       + (" without tool_calls" if role == "assistant" else ""),
                       param=f"{at}.content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ApiError(f"'{at}.content' must be a string or an array of content parts, "
                       f"got {fields.json_type(content)}", param=f"{at}.content")
    fields.array(content, f"{at}.content", nonempty=True)
    for j, part in enumerate(content):
        _check_part(part, f"{at}.content[{j}]", role, vision)


def _check_assistant_extras(message: dict, at: str) -> None:
    for key in ("reasoning_content", "reasoning", "refusal"):
        fields.string(message.get(key), f"{at}.{key}")
    if message.get("function_call") is not None:
        raise ApiError("the deprecated 'function_call' message field is not supported; "
                       "send tool_calls", param=f"{at}.function_call")
    if message.get("audio") is not None:
        raise ApiError("assistant audio is not supported", param=f"{at}.audio")
    tool_calls = fields.array(message.get("tool_calls"), f"{at}.tool_calls")
    for k, call in enumerate(tool_calls or ()):
        _check_tool_call(call, f"{at}.tool_calls[{k}]")


def _check_tool_call(call: Any, at: str) -> None:
    if not isinstance(call, dict):
        raise ApiError(f"'{at}' must be an object, got {fields.json_type(call)}", param=at)
    fields.string(call.get("id"), f"{at}.id", required=True)
    fields.string(call.get("type", "function"), f"{at}.type", choices=("function",))
    function = call.get("function")
    fields.obj(function, f"{at}.function", required=True)
    fields.string(function.get("name"), f"{at}.function.name", nonempty=True, required=True)
    fields.string(function.get("arguments"), f"{at}.function.arguments", required=True)


def _check_part(part: Any, at: str, role: str, vision: bool) -> None:
    if not isinstance(part, dict):
        raise ApiError(f"'{at}' must be a content part object, got {fields.json_type(part)}",
                       param=at)
    kind = part.get("type")
    fields.string(kind, f"{at}.type", required=True)
    if kind == "text":
        fields.string(part.get("text"), f"{at}.text", required=True)
    elif kind == "image_url":
        _check_image_part(part, at, role, vision)
    elif kind in UNSUPPORTED_PARTS:
        raise ApiError(f"{UNSUPPORTED_PARTS[kind]} is not supported", param=f"{at}.type")
    else:
        raise ApiError(f"content part type {kind!r} is not supported", param=f"{at}.type")


def _check_image_part(part: dict, at: str, role: str, vision: bool) -> None:
    if not vision:
        raise ApiError("image input needs a vision-language checkpoint served with --vision "
                       "(python -m tensorfold --model DIR --vision)", param=f"{at}.type")
    if role != "user":
        raise ApiError(f"image input is only accepted in user messages, not {role} messages",
                       param=f"{at}.type")
    image = part.get("image_url")
    fields.obj(image, f"{at}.image_url", required=True)
    fields.string(image.get("url"), f"{at}.image_url.url", required=True, nonempty=True)
    fields.string(image.get("detail"), f"{at}.image_url.detail", choices=IMAGE_DETAILS)
