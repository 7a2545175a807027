"""What a request's structured-output field asks for, reduced to one of five grammar kinds."""
import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf", "tool_call")
MAX_WHITESPACE = 32  # blank characters a JSON grammar allows in a row (pretty-printing fits)


@dataclass(frozen=True)
class GrammarSpec:
    """kind: one of KINDS; text: the schema as JSON, the regex, the choices as a JSON list, the
    EBNF source ("" for json_object), a forced tool call's format and tools (grammar/tool_call.py). `field` names the request field it came from,
    for error messages. Equal specs compile to the same grammar (the cache key)."""
    kind: str
    text: str
    field: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}")

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.text

    @classmethod
    def json_schema(cls, schema, field: str) -> "GrammarSpec":
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), field)  # key order kept: it orders the reply

    @classmethod
    def choice(cls, options: list[str], field: str) -> "GrammarSpec":
        return cls("choice", json.dumps(options), field)

    def choice_ebnf(self) -> str:
        """The EBNF of a choice: the root is one of the literal strings."""
        options = json.loads(self.text)
        return "root ::= " + " | ".join(ebnf_literal(o) for o in options)


def ebnf_literal(text: str) -> str:
    """A double-quoted EBNF string literal matching `text` exactly."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
