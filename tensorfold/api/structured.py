"""The structured-output fields of a request body, read into one GrammarSpec (or None).

Five spellings, one meaning each (spec: "Structured output"):
- response_format: {"type": "text"} (none), {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
- vLLM's guided_json (a schema, as an object or a JSON string), guided_regex, guided_choice (a
  nonempty list of strings), guided_grammar (EBNF); guided_decoding_backend may name xgrammar;
- structured_outputs: exactly one of json, json_object (true), regex, choice, grammar.
At most one field may ask for a grammar; a second is a 400 naming it. A schema is checked for
shape here; whether xgrammar can compile it is the compiler's 400 (tensorfold/grammar).
Both strict and non-strict json_schema requests get the same grammar: the reply matches the
schema either way (strict only adds what OpenAI requires of the schema itself).
"""
import json
from typing import Any

from tensorfold.api import fields
from tensorfold.api.errors import ApiError
from tensorfold.grammar.spec import GrammarSpec

BACKENDS = ("xgrammar", "auto")
STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM's structured_outputs options this server does not implement: only their off values.
STRUCTURED_OFF = {"disable_fallback": False, "disable_any_whitespace": False,
                  "disable_additional_properties": False, "whitespace_pattern": None, "structural_tag": None}
FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "structured_outputs", "guided_decoding_backend")


def parse_grammar(body: dict) -> GrammarSpec | None:
    """The one grammar the body asks for, or None; ApiError (400) for a malformed field or two."""
    backend = fields.string(body.get("guided_decoding_backend"), "guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise ApiError(f"guided_decoding_backend {backend!r} is not available; this server uses xgrammar",
                       param="guided_decoding_backend")
    found: list[GrammarSpec] = []
    for reader in (_response_format, _guided, _structured_outputs):
        found += reader(body)
    if len(found) > 1:
        raise ApiError(f"'{found[0].field}' and '{found[1].field}' both ask for structured output; send one",
                       param=found[1].field)
    return found[0] if found else None


def _response_format(body: dict) -> list[GrammarSpec]:
    rf = fields.obj(body.get("response_format"), "response_format")
    if rf is None:
        return []
    kind = fields.string(rf.get("type"), "response_format.type", choices=("text", "json_object", "json_schema"),
                         required=True)
    if kind == "text":
        return []
    if kind == "json_object":
        return [GrammarSpec("json_object", "", "response_format")]
    js = fields.obj(rf.get("json_schema"), "response_format.json_schema", required=True)
    fields.string(js.get("name"), "response_format.json_schema.name")
    fields.string(js.get("description"), "response_format.json_schema.description")
    fields.boolean(js.get("strict"), "response_format.json_schema.strict")
    schema = _schema(js.get("schema"), "response_format.json_schema.schema", required=True)
    return [GrammarSpec.json_schema(schema, "response_format")]


def _guided(body: dict) -> list[GrammarSpec]:
    out = []
    if body.get("guided_json") is not None:
        out.append(GrammarSpec.json_schema(_schema(body["guided_json"], "guided_json"), "guided_json"))
    regex = fields.string(body.get("guided_regex"), "guided_regex", nonempty=True)
    if regex is not None:
        out.append(GrammarSpec("regex", regex, "guided_regex"))
    if body.get("guided_choice") is not None:
        out.append(GrammarSpec.choice(_choices(body["guided_choice"], "guided_choice"), "guided_choice"))
    ebnf = fields.string(body.get("guided_grammar"), "guided_grammar", nonempty=True)
    if ebnf is not None:
        out.append(GrammarSpec("ebnf", ebnf, "guided_grammar"))
    return out


def _structured_outputs(body: dict) -> list[GrammarSpec]:
    so = fields.obj(body.get("structured_outputs"), "structured_outputs")
    if so is None:
        return []
    for key, off in STRUCTURED_OFF.items():
        if so.get(key) not in (None, off):
            raise ApiError(f"structured_outputs.{key} is not supported by this server",
                           param=f"structured_outputs.{key}")
    unknown = sorted(k for k in so if k not in STRUCTURED_KEYS and k not in STRUCTURED_OFF)
    if unknown:
        raise ApiError(f"unknown structured_outputs option '{unknown[0]}'", param=f"structured_outputs.{unknown[0]}")
    at = "structured_outputs"
    out = []
    if so.get("json") is not None:
        out.append(GrammarSpec.json_schema(_schema(so["json"], f"{at}.json"), f"{at}.json"))
    if fields.boolean(so.get("json_object"), f"{at}.json_object"):
        out.append(GrammarSpec("json_object", "", f"{at}.json_object"))
    regex = fields.string(so.get("regex"), f"{at}.regex", nonempty=True)
    if regex is not None:
        out.append(GrammarSpec("regex", regex, f"{at}.regex"))
    if so.get("choice") is not None:
        out.append(GrammarSpec.choice(_choices(so["choice"], f"{at}.choice"), f"{at}.choice"))
    ebnf = fields.string(so.get("grammar"), f"{at}.grammar", nonempty=True)
    if ebnf is not None:
        out.append(GrammarSpec("ebnf", ebnf, f"{at}.grammar"))
    if not out:
        raise ApiError("structured_outputs names none of json, json_object, regex, choice, grammar", param=at)
    return out


def _schema(value: Any, param: str, required: bool = False) -> dict | bool:
    """A JSON schema: an object (or true/false), or a string holding one."""
    if value is None and required:
        raise ApiError(f"'{param}' is required", param=param)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ApiError(f"'{param}' is not valid JSON: {e}", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise ApiError(f"'{param}' must be a JSON schema object, got {fields.json_type(value)}", param=param)
    return value


def _choices(value: Any, param: str) -> list[str]:
    items = fields.array(value, param, nonempty=True)
    return [fields.string(c, f"{param}[{i}]", nonempty=True, required=True) for i, c in enumerate(items)]
