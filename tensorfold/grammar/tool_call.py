"""The grammar of a forced tool call (tool_choice "required" or a named function).

The reply's answer must be one call, in the card's format, to one of the tools the template was
shown, with arguments that match that tool's parameters:
- hermes_json: opener "\\n" {"name": "<tool>", "arguments": <parameters>} "\\n" closer, the
  JSON written as the template writes it (", " and ": " separators);
- qwen_xml: opener "\\n<function=<tool>>\\n" then <parameter=P>\\n...\\n</parameter>\\n for
  the tool's parameters (any text without "<" as the value), then "</function>\\n" closer.
Then the end token. With thinking on, the grammar starts after the think block (the
constraint's start marker), so the model still thinks first. The arguments' numbers carry the
JSON grammars' default bounds (json_bounds.py).
"""
import json

from tensorfold.grammar.json_bounds import json_grammar
from tensorfold.grammar.spec import GrammarSpec, ebnf_literal


def tool_call_spec(card, tools: list[dict]) -> GrammarSpec:
    """The spec a forced call compiles from (cached like any grammar, by its text)."""
    text = json.dumps({"format": card.tool_format, "open": card.tool_call.open, "close": card.tool_call.close,
                       "tools": [t["function"] for t in tools]}, sort_keys=True)
    return GrammarSpec("tool_call", text, "tool_choice")


def tool_call_grammar(spec: GrammarSpec):
    import xgrammar as xgr

    d = json.loads(spec.text)
    calls = []
    for function in d["tools"]:
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if d["format"] == "hermes_json":
            body = {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                    "required": ["name", "arguments"], "additionalProperties": False}
            calls.append(xgr.Grammar.concat(
                xgr.Grammar.from_ebnf(f"root ::= {ebnf_literal(d['open'] + chr(10))}"),
                json_grammar(json.dumps(body), any_whitespace=False, separators=(", ", ": ")),
                xgr.Grammar.from_ebnf(f"root ::= {ebnf_literal(chr(10) + d['close'])}")))
        else:
            params = " ".join(f"({ebnf_literal(f'<parameter={p}>' + chr(10))} value "
                              f"{ebnf_literal(chr(10) + '</parameter>' + chr(10))})?"
                              for p in (parameters.get("properties") or {}))
            head = ebnf_literal(f"{d['open']}\n<function={function['name']}>\n")
            tail = ebnf_literal(f"</function>\n{d['close']}")
            calls.append(xgr.Grammar.from_ebnf(f"root ::= {head} {params} {tail}\nvalue ::= [^<]*"))
    return calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
