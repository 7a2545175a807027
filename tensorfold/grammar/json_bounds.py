"""Default bounds on the numbers of a JSON grammar, so a small model's integers end.

xgrammar's JSON-schema grammars let an unbounded integer, and a number's integer part, fraction
and exponent, grow forever: a 135M model asked for `population: int` keeps choosing another
digit until max_tokens. llama.cpp's JSON-schema grammars cap them; these do the same:
- an integer with no limit of its own: "0" or an optional "-" and at most 16 digits;
- a number with no limit of its own: an optional "-", at most 16 integer digits, at most 16
  fraction digits, an exponent of at most 3 digits (every finite double's fits);
- an integer or number with one side of a range (minimum / exclusiveMinimum without a maximum,
  or the reverse) gets the other side at +-(10**16 - 1) (numbers: +-1e16), unless its own side
  lies beyond that; xgrammar then writes the range as usual. A schema's own two-sided range is
  never touched, so a schema that states its limits means what it says.
Strings and arrays are left unbounded, as llama.cpp leaves them: xgrammar 0.2.9's counted
repetition of "a character or an escape" costs seconds per token mask, and its maxLength form
forbids escapes (no quotes, no newlines), so an injected maxLength would reject ordinary text;
max_tokens ends a runaway string, and text, unlike digits, has natural ends.

How: the schema's one-sided ranges are closed (bound_schema), xgrammar converts it, and the
unbounded basic_integer / basic_number rules of its EBNF are replaced by the bounded ones.
Grammars only mask tokens, so exactness is untouched.
"""
import json

MAX_INT_DIGITS = 16
MAX_FRACTION_DIGITS = 16
MAX_EXPONENT_DIGITS = 3
INT_LIMIT = 10 ** MAX_INT_DIGITS - 1
NUMBER_LIMIT = 1e16

# The rules xgrammar 0.2.9 emits for unbounded values, and their bounded replacements.
BOUNDED_RULES = {
    "basic_integer": f'"0" | "-"? [1-9] [0-9]{{0,{MAX_INT_DIGITS - 1}}}',
    "basic_number": (f'"-"? ("0" | [1-9] [0-9]{{0,{MAX_INT_DIGITS - 1}}}) ("." [0-9]{{1,{MAX_FRACTION_DIGITS}}})? '
                     f'([eE] [+\\-]? [0-9]{{1,{MAX_EXPONENT_DIGITS}}})?'),
}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames",
                "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def json_grammar(schema_text: str, **options):
    """xgrammar's grammar of a JSON schema (text), its numbers bounded; options go to from_json_schema."""
    import xgrammar as xgr

    bounded = json.dumps(bound_schema(json.loads(schema_text)), separators=(",", ":"))
    ebnf = str(xgr.Grammar.from_json_schema(bounded, **options))
    return xgr.Grammar.from_ebnf(bound_ebnf(ebnf))


def bound_ebnf(ebnf: str) -> str:
    """xgrammar's printed JSON grammar with its unbounded number rules replaced (one rule a line)."""
    lines = []
    for line in ebnf.splitlines():
        name = line.split(" ::= ", 1)[0]
        lines.append(f"{name} ::= {BOUNDED_RULES[name]}" if name in BOUNDED_RULES else line)
    return "\n".join(lines)


def bound_schema(schema):
    """A copy of the schema whose one-sided integer and number ranges have their other side."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" in types or "number" in types:
        limit = INT_LIMIT if "number" not in types else NUMBER_LIMIT
        lower = _first_number(schema, "minimum", "exclusiveMinimum")
        upper = _first_number(schema, "maximum", "exclusiveMaximum")
        if lower is not None and upper is None and lower < limit:
            out["maximum"] = limit
        if upper is not None and lower is None and upper > -limit:
            out["minimum"] = -limit
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {k: bound_schema(v) for k, v in schema[key].items()}
    for key in _SCHEMA_ONES:
        if isinstance(schema.get(key), dict):
            out[key] = bound_schema(schema[key])
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [bound_schema(s) for s in schema[key]]
    return out


def _first_number(schema: dict, *keys):
    for key in keys:
        value = schema.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None
