"""Gemma 4's notation for structured values, as its tool calls write their arguments.

A call block's body is `call:NAME{key:value,...}`: JSON's shapes with two differences, object keys
bare (no quotes) and strings between the single token <|"|> on both sides, their text as it is
(no escapes). Numbers, true, false and null are JSON's. read_call() turns a body into the tool's
name and its arguments as a dict; anything that is not this notation, text after the closing brace
included, is None (the block stays text). Blanks between the parts are allowed.
"""
import json
import re

QUOTE = '<|"|>'
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_KEY = re.compile(r"[^\s:{}\[\],<\"]+")
_NAME = re.compile(r"call:([^\s{}]+)\s*")
_WORDS = {"true": True, "false": False, "null": None}


class _NotGemma(ValueError):
    pass


def read_call(body: str) -> tuple[str, dict] | None:
    """(name, arguments) of a call block's body, or None if it is not `call:NAME{...}`."""
    text = body.strip()
    m = _NAME.match(text)
    if m is None or not text[m.end():].startswith("{"):
        return None
    try:
        arguments, end = _value(text, m.end())
    except _NotGemma:
        return None
    if end != len(text):
        return None
    return m.group(1), arguments


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _value(text: str, i: int):
    """The value starting at text[i] (after blanks) and the index after it."""
    i = _skip(text, i)
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise _NotGemma("an unclosed string")
        return text[i + len(QUOTE):end], end + len(QUOTE)
    if text.startswith("{", i):
        return _object(text, i + 1)
    if text.startswith("[", i):
        return _array(text, i + 1)
    if text.startswith('"', i):  # a JSON string, as a model may still write one
        try:
            return json.JSONDecoder().raw_decode(text, i)
        except ValueError:
            raise _NotGemma("a bad JSON string") from None
    for word, value in _WORDS.items():
        if text.startswith(word, i):
            return value, i + len(word)
    m = _NUMBER.match(text, i)
    if m is None:
        raise _NotGemma(f"no value at {i}")
    number = m.group()
    return (float(number) if any(c in number for c in ".eE") else int(number)), m.end()


def _object(text: str, i: int) -> tuple[dict, int]:
    result = {}
    i = _skip(text, i)
    if text.startswith("}", i):
        return result, i + 1
    while True:
        i = _skip(text, i)
        if text.startswith(QUOTE, i) or text.startswith('"', i):
            key, i = _value(text, i)
        else:
            m = _KEY.match(text, i)
            if m is None:
                raise _NotGemma(f"no key at {i}")
            key, i = m.group(), m.end()
        i = _skip(text, i)
        if not text.startswith(":", i):
            raise _NotGemma(f"no ':' at {i}")
        result[key], i = _value(text, i + 1)
        closed, i = _after_item(text, i, "}")
        if closed:
            return result, i


def _array(text: str, i: int) -> tuple[list, int]:
    result = []
    i = _skip(text, i)
    if text.startswith("]", i):
        return result, i + 1
    while True:
        value, i = _value(text, i)
        result.append(value)
        closed, i = _after_item(text, i, "]")
        if closed:
            return result, i


def _after_item(text: str, i: int, close: str) -> tuple[bool, int]:
    """Past an object's or array's item: (True, after `close`) at its end, (False, after the ',')
    before the next item."""
    i = _skip(text, i)
    if text.startswith(close, i):
        return True, i + 1
    if not text.startswith(",", i):
        raise _NotGemma(f"no ',' or '{close}' at {i}")
    return False, i + 1
