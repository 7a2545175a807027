"""The grammar of a forced tool call (tool_choice "required" or a named function).

The reply's answer must be one call, in the card's format, to one of the tools the template was
shown, with arguments that match that tool's parameters:
- hermes_json: opener "\\n" {"name": "<tool>", "arguments": <parameters>} "\\n" closer, the
  JSON written as the template writes it (", " and ": " separators);
- qwen_xml: opener "\\n<function=<tool>>\\n" then <parameter=P>\\n...\\n</parameter>\\n for
  the tool's parameters (any text without "<" as the value), then "</function>\\n" closer;
- glm_xml: opener "<tool>" then <arg_key>P</arg_key><arg_value>...</arg_value> for the tool's
  parameters in their declared order, each optional (any text without "<" as the value), closer;
- gemma4: opener "call:<tool>{key:value,...}" closer, in Gemma 4's notation (chat/gemma4_values.py):
  the tool's parameters in their declared order, the required ones present, each value by its
  schema's type (a string: text without "<" between <|"|> tokens, at most maxLength characters;
  an enum of strings: one of them; another type: any value of the notation of that shape; the
  digits of a number at most 19 before and after its point).
Then the end token. With thinking on, the grammar starts after the think block (the
constraint's start marker), so the model still thinks first. The arguments' numbers carry the
JSON grammars' default bounds (json_bounds.py).
"""
import json

from tensorfold.grammar.json_bounds import json_grammar
from tensorfold.grammar.spec import GrammarSpec, ebnf_literal


def tool_call_spec(card, tools: list[dict]) -> GrammarSpec:
    """The spec a forced call compiles from (cached like any grammar, by its text)."""
    # the parameters' declared order, which sort_keys (one text per grammar) would lose
    order = [list(((t["function"].get("parameters") or {}).get("properties") or {})) for t in tools]
    text = json.dumps({"format": card.tool_format, "open": card.tool_call.open, "close": card.tool_call.close,
                       "tools": [t["function"] for t in tools], "order": order}, sort_keys=True)
    return GrammarSpec("tool_call", text, "tool_choice")


def tool_call_grammar(spec: GrammarSpec):
    import xgrammar as xgr

    d = json.loads(spec.text)
    calls = []
    for function, order in zip(d["tools"], d["order"]):
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if d["format"] == "hermes_json":
            body = {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                    "required": ["name", "arguments"], "additionalProperties": False}
            calls.append(xgr.Grammar.concat(
                xgr.Grammar.from_ebnf(f"root ::= {ebnf_literal(d['open'] + chr(10))}"),
                json_grammar(json.dumps(body), any_whitespace=False, separators=(", ", ": ")),
                xgr.Grammar.from_ebnf(f"root ::= {ebnf_literal(chr(10) + d['close'])}")))
        elif d["format"] == "glm_xml":
            pairs = " ".join(f"({ebnf_literal(f'<arg_key>{p}</arg_key><arg_value>')} value "
                             f"{ebnf_literal('</arg_value>')})?" for p in order)
            head = ebnf_literal(d["open"] + function["name"])
            calls.append(xgr.Grammar.from_ebnf(f"root ::= {head} {pairs} {ebnf_literal(d['close'])}\n"
                                               "value ::= [^<]*"))
        elif d["format"] == "gemma4":
            calls.append(xgr.Grammar.from_ebnf(_gemma4_call_ebnf(d["open"], d["close"], function["name"],
                                                                 parameters, order)))
        else:
            params = " ".join(f"({ebnf_literal(f'<parameter={p}>' + chr(10))} value "
                              f"{ebnf_literal(chr(10) + '</parameter>' + chr(10))})?"
                              for p in (parameters.get("properties") or {}))
            head = ebnf_literal(f"{d['open']}\n<function={function['name']}>\n")
            tail = ebnf_literal(f"</function>\n{d['close']}")
            calls.append(xgr.Grammar.from_ebnf(f"root ::= {head} {params} {tail}\nvalue ::= [^<]*"))
    return calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)


_GEMMA4_VALUES = r"""
value ::= string | object | array | number | "true" | "false" | "null"
string ::= quote [^<]* quote
quote ::= "<|\"|>"
object ::= "{" (key ":" value ("," key ":" value)*)? "}"
key ::= [a-zA-Z_] [a-zA-Z0-9_]*
array ::= "[" (value ("," value)*)? "]"
integer ::= "-"? [0-9]{1,19}
number ::= integer ("." [0-9]{1,19})?
boolean ::= "true" | "false"
"""
_GEMMA4_TYPED = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean",
                 "object": "object", "array": "array"}


def _gemma4_call_ebnf(opener: str, closer: str, name: str, parameters: dict, order: list[str]) -> str:
    """A Gemma 4 call of one tool: its parameters in their declared order (start_k: none written
    yet, tail_k: one written, so the next takes a comma), the required ones present."""
    properties = [(key, (parameters.get("properties") or {})[key]) for key in order]
    required = set(parameters.get("required") or ())
    rules = [f"root ::= {ebnf_literal(opener + 'call:' + name + '{')} start_0 {ebnf_literal('}' + closer)}"]
    for k, (key, schema) in enumerate(properties):
        pair = f"{ebnf_literal(key + ':')} {_gemma4_value_rule(schema)}"
        optional = key not in required
        rules.append(f"start_{k} ::= {pair} tail_{k + 1}" + (f" | start_{k + 1}" if optional else ""))
        rules.append(f'tail_{k} ::= "," {pair} tail_{k + 1}' + (f" | tail_{k + 1}" if optional else ""))
    rules += [f'start_{len(properties)} ::= ""', f'tail_{len(properties)} ::= ""']
    return "\n".join(rules) + _GEMMA4_VALUES


def _gemma4_value_rule(schema) -> str:
    """The grammar rule of a parameter's value, by its schema's enum of strings or its type."""
    if not isinstance(schema, dict):
        return "value"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) and "<" not in e for e in enum):
        return 'quote (' + " | ".join(ebnf_literal(e) for e in enum) + ') quote'
    kind = schema.get("type")
    if kind == "string" and isinstance(schema.get("maxLength"), int):
        return f"quote [^<]{{0,{schema['maxLength']}}} quote"
    return _GEMMA4_TYPED.get(kind, "value") if isinstance(kind, str) else "value"
