"""The reply's text split into reasoning, content and tool calls, as it arrives.

One ReplyParser per request sits between the engine's text and the reply writer, for streamed
and whole replies alike: push() each new piece of text, finish() at the end; the deltas it
returns concatenate to what one push of the whole text and finish() return, whatever the
chunking (text that could still turn out to be a marker is held back until it cannot).

Rules (the model card gives the markers and the call format):
- A think block (the reply starts inside one when the prompt opened it, or opens one with its
  first non-blank text) is reasoning up to the close marker; the answer's leading blanks after
  it are dropped. A card's think label (Gemma 4's "thought\n" after <|channel>) right after the
  opener names the block and is not reasoning.
- In the answer, a call block (opener ... closer, or opener ... end of reply) that parses in the
  card's format and names an offered tool is a tool call; anything else, a malformed block or one
  naming a tool not offered included, stays content with its text. Blank text between calls is
  dropped once a call is made.
- A call written inside a think block that never closes is the reply's call; the reasoning stops
  where it starts, and streamed reasoning never carries its markup. A call block inside a think
  block that closes after it stays reasoning.
- With parallel_tool_calls false, only the first valid call is returned; later ones are dropped.

The call formats (the card's tool_format): hermes_json ({"name", "arguments"} JSON), qwen_xml
(<function=NAME><parameter=P>...), gemma4 (call:NAME{key:value}), glm_xml
(NAME<arg_key>K</arg_key><arg_value>V</arg_value>...).
"""
import json
import re
from dataclasses import dataclass, field

from tensorfold.chat.gemma4_values import read_call

THINK, ANSWER, CALL = "think", "answer", "call"


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text

    def as_message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ReplyDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def add(self, other: "ReplyDelta") -> "ReplyDelta":
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        return self


class ReplyParser:
    def __init__(self, card=None, tools: list[dict] | None = None, *, parallel_tool_calls: bool = True,
                 thinking: bool = False, call_id_prefix: str = "call"):
        self.think = card.think if card is not None else None
        self.call_markers = card.tool_call if card is not None and tools else None
        self.call_format = card.tool_format if self.call_markers is not None else None
        self.tools = {t["function"]["name"]: t["function"] for t in tools or ()}
        self.parallel = parallel_tool_calls
        self.call_id_prefix = call_id_prefix
        self.mode = THINK if thinking and self.think else ANSWER
        self.after_think = self.mode == THINK  # a think block was entered: none opens later
        self.label_pending = False   # the reply just opened a think block: its label may follow
        self.call_in_think = False   # the call block being read was written inside a think block
        self.at_answer_start = True  # only blanks so far in the answer (or before a think block)
        self.held_blank = ""         # blanks in the answer not sent yet (dropped if a call follows)
        self.buf = ""                # text not classified yet
        self.calls: list[ToolCall] = []
        self.whole = ReplyDelta()

    # -- the interface ------------------------------------------------------------------------

    def push(self, text: str) -> ReplyDelta:
        self.buf += text
        return self._record(self._drain(final=False))

    def finish(self) -> ReplyDelta:
        return self._record(self._drain(final=True))

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def _record(self, delta: ReplyDelta) -> ReplyDelta:
        self.whole.add(ReplyDelta(delta.content, delta.reasoning, list(delta.tool_calls)))
        return delta

    # -- the state machine --------------------------------------------------------------------

    def _drain(self, final: bool) -> ReplyDelta:
        out = ReplyDelta()
        while True:
            before = (self.mode, len(self.buf))
            if self.mode == THINK:
                self._think(out, final)
            elif self.mode == CALL:
                self._call(out, final)
            else:
                self._answer(out, final)
            if (self.mode, len(self.buf)) == before:
                break
        if final:
            if self.held_blank and not self.calls:
                out.content += self.held_blank
            self.held_blank = ""
        return out

    def _think(self, out: ReplyDelta, final: bool) -> None:
        if self.label_pending:
            label = self.think.label
            if label.startswith(self.buf) and len(self.buf) < len(label) and not final:
                return  # may still become the label
            if self.buf.startswith(label):
                self.buf = self.buf[len(label):]
            self.label_pending = False
        close = self.buf.find(self.think.close)
        opener = self.call_markers.open if self.call_markers else None
        call_at = self.buf.find(opener) if opener else -1
        if call_at >= 0 and (close < 0 or call_at < close):
            # a call inside the block: reasoning up to it; the rest waits for the block's fate
            out.reasoning += self.buf[:call_at]
            self.buf = self.buf[call_at:]
            if close >= 0:  # the block closes after it: it was only reasoning
                out.reasoning += self.buf[:close - call_at]
                self.buf = self.buf[close - call_at + len(self.think.close):]
                self._enter_answer()
            elif final:     # the reply ends inside the block: the call is the reply's
                self.mode = CALL
                self.call_in_think = True
            return
        if close >= 0:
            out.reasoning += self.buf[:close]
            self.buf = self.buf[close + len(self.think.close):]
            self._enter_answer()
            return
        keep = 0 if final else _partial_suffix(self.buf, [self.think.close] + ([opener] if opener else []))
        out.reasoning += self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]

    def _enter_answer(self) -> None:
        self.mode = ANSWER
        self.at_answer_start = True

    def _answer(self, out: ReplyDelta, final: bool) -> None:
        if self.at_answer_start:
            stripped = self.buf.lstrip()
            if not stripped and not final:
                return  # blanks only: wait
            if self.think and not self.after_think:
                opener = self.think.open
                if stripped.startswith(opener):
                    self.buf = stripped[len(opener):]
                    self.mode = THINK
                    self.after_think = True
                    self.label_pending = bool(self.think.label)
                    self.at_answer_start = False
                    return
                if opener.startswith(stripped) and not final:
                    return  # may still become the opener
            if self.after_think:
                self.buf = stripped  # the answer's leading blanks after a think block
            self.at_answer_start = False
        opener = self.call_markers.open if self.call_markers else None
        at = self.buf.find(opener) if opener else -1
        if at >= 0:
            self._content(out, self.buf[:at])
            self.buf = self.buf[at:]
            self.mode = CALL
            return
        keep = 0 if final else _partial_suffix(self.buf, [opener] if opener else [])
        self._content(out, self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]

    def _content(self, out: ReplyDelta, text: str) -> None:
        """Content; with tools offered, trailing blanks wait: dropped if a call comes next."""
        if not text:
            return
        if self.call_markers is None:
            out.content += text
            return
        body = text.rstrip()
        if body:
            out.content += self.held_blank + body
            self.held_blank = ""
        self.held_blank += text[len(body):]

    def _call(self, out: ReplyDelta, final: bool) -> None:
        markers = self.call_markers
        end = self.buf.find(markers.close, len(markers.open))
        if end < 0 and not final:
            return
        block = self.buf if end < 0 else self.buf[:end + len(markers.close)]
        body = self.buf[len(markers.open):] if end < 0 else self.buf[len(markers.open):end]
        self.buf = "" if end < 0 else self.buf[end + len(markers.close):]
        in_think, self.call_in_think = self.call_in_think, False
        self.mode = THINK if in_think else ANSWER
        call = self._parse(body)
        if call is None:  # not a call after all: its text is what it was written in
            if in_think:
                out.reasoning += block
            else:
                self._content(out, block)
            return
        self.held_blank = ""
        if self.parallel or not self.calls:
            name, arguments = call
            tool_call = ToolCall(len(self.calls), f"{self.call_id_prefix}_{len(self.calls)}", name, arguments)
            self.calls.append(tool_call)
            out.tool_calls.append(tool_call)

    # -- the call formats -----------------------------------------------------------------------

    def _parse(self, body: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of a call block's body, or None if it is not a valid call."""
        if self.call_format == "hermes_json":
            return self._hermes(body)
        if self.call_format == "qwen_xml":
            return self._qwen_xml(body)
        if self.call_format == "glm_xml":
            return self._glm_xml(body)
        if self.call_format == "gemma4":
            call = read_call(body)
            if call is None or call[0] not in self.tools:
                return None
            return call[0], json.dumps(call[1], ensure_ascii=False)
        return None

    def _hermes(self, body: str) -> tuple[str, str] | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.tools:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)

    def _qwen_xml(self, body: str) -> tuple[str, str] | None:
        m = _FUNCTION.fullmatch(body.strip())
        if m is None or m.group(1) not in self.tools:
            return None
        name, params = m.group(1), m.group(2)
        properties = (self.tools[name].get("parameters") or {}).get("properties") or {}
        arguments = {}
        pos = 0
        for p in _PARAMETER.finditer(params):
            if params[pos:p.start()].strip():
                return None  # text between parameters: not this format
            pos = p.end()
            arguments[p.group(1)] = _typed(_param_text(p.group(2)), properties.get(p.group(1)))
        if params[pos:].strip():
            return None
        return name, json.dumps(arguments, ensure_ascii=False)


    def _glm_xml(self, body: str) -> tuple[str, str] | None:
        """GLM's NAME<arg_key>K</arg_key><arg_value>V</arg_value>...: the name up to the first key,
        then pairs with only blanks between them; a value typed by the offered schema, as Qwen
        XML's are (the template writes a string as it is, any other value as JSON)."""
        at = body.find("<arg_key>")
        name = (body if at < 0 else body[:at]).strip()
        if name not in self.tools:
            return None
        properties = (self.tools[name].get("parameters") or {}).get("properties") or {}
        arguments = {}
        pos = len(body) if at < 0 else at
        for p in _ARG.finditer(body, pos):
            if body[pos:p.start()].strip():
                return None  # text between pairs: not this format
            pos = p.end()
            arguments[p.group(1).strip()] = _typed(p.group(2), properties.get(p.group(1).strip()))
        if body[pos:].strip():
            return None
        return name, json.dumps(arguments, ensure_ascii=False)


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _param_text(raw: str) -> str:
    """A parameter's text without the one newline the template writes on each side."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


def _typed(text: str, schema: dict | None):
    """A Qwen XML parameter's value by the offered schema's explicit type; a value that does not
    fit it, a union type or no type stays the string it was written as."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    value = text.strip()
    if kind == "string" or not isinstance(kind, str):
        return text
    if kind == "null":
        return None if value == "null" else text
    if kind == "boolean":
        return {"true": True, "false": False}.get(value.lower(), text)
    if kind == "integer":
        return int(value) if re.fullmatch(r"-?\d+", value) else text
    if kind == "number":
        try:
            number = float(value)
        except ValueError:
            return text
        return int(value) if re.fullmatch(r"-?\d+", value) else number
    if kind in ("array", "object"):
        try:
            parsed = json.loads(value)
        except ValueError:
            return text
        return parsed if isinstance(parsed, list if kind == "array" else dict) else text
    return text


def _partial_suffix(text: str, markers: list[str]) -> int:
    """The length of the longest end of `text` that is a proper start of one of the markers."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
