"""The reply parser on real-looking Qwen3 (Hermes JSON), Qwen XML and SmolLM2 replies: each text
fed whole and in random chunkings gives the same reasoning, content and calls."""
import json
import random

import pytest

from tensorfold.chat.cards import load_cards
from tensorfold.chat.reply_parser import ReplyParser

CARDS = load_cards()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TYPED = {"type": "function", "function": {"name": "configure", "parameters": {"type": "object", "properties": {
    "count": {"type": "integer"}, "ratio": {"type": "number"}, "on": {"type": "boolean"}, "tags": {"type": "array"},
    "opts": {"type": "object"}, "nothing": {"type": "null"}, "text": {"type": "string"},
    "either": {"type": ["string", "integer"]}}}}}
TOOLS = [WEATHER, TYPED]


def parse(card, text, *, tools=TOOLS, thinking=False, parallel=True, chunks=None):
    parser = ReplyParser(CARDS[card], tools, parallel_tool_calls=parallel, thinking=thinking)
    out = [parser.push(piece) for piece in (chunks or [text])]
    out.append(parser.finish())
    content = "".join(d.content for d in out)
    reasoning = "".join(d.reasoning for d in out)
    calls = [(c.name, json.loads(c.arguments)) for d in out for c in d.tool_calls]
    return content, reasoning, calls


def chunkings(text, rng, n=30):
    yield [text]
    yield list(text)
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def same_whatever_the_chunking(card, text, **kwargs):
    whole = parse(card, text, **kwargs)
    rng = random.Random(text)
    for chunks in chunkings(text, rng):
        assert parse(card, text, chunks=chunks, **kwargs) == whole, chunks
    return whole


QWEN3_CALL = ('<think>\nThe user wants weather. I should call get_weather.\n</think>\n\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')


def test_qwen3_reasoning_then_two_calls():
    content, reasoning, calls = same_whatever_the_chunking("qwen3", QWEN3_CALL)
    assert reasoning == "\nThe user wants weather. I should call get_weather.\n"
    assert content == ""
    assert calls == [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Lyon"})]


def test_parallel_tool_calls_false_keeps_the_first_valid_call():
    content, _, calls = same_whatever_the_chunking("qwen3", '<tool_call>\n{"name": "nope"}\n</tool_call>' + QWEN3_CALL[QWEN3_CALL.index("<tool_call>"):],
                                                   parallel=False)
    assert calls == [("get_weather", {"city": "Paris", "days": 2})]
    assert content.startswith('<tool_call>\n{"name": "nope"}')  # an unoffered call keeps its text


def test_prose_json_answers_and_malformed_blocks_are_content():
    for text in ["The weather is fine.  ", '{"name": "get_weather", "arguments": {}}',
                 'Sure: <tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> done',
                 "<tool_call>not json</tool_call>", "a <tool_cal b", "ends with <tool_"]:
        content, reasoning, calls = same_whatever_the_chunking("qwen3", text)
        assert (content, reasoning, calls) == (text, "", []), text


def test_a_call_left_open_at_the_end_still_counts():
    _, _, calls = same_whatever_the_chunking("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert calls == [("get_weather", {"city": "Oslo"})]


def test_thinking_prompt_and_calls_inside_an_open_think_block():
    # the prompt opened the block: the reply starts inside it
    assert same_whatever_the_chunking("qwen3", "hmm\n</think>\n\nHi!", thinking=True) == ("Hi!", "hmm\n", [])
    # a call inside a block that never closes is the reply's call; reasoning stops before it
    text = 'Let me call.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    content, reasoning, calls = same_whatever_the_chunking("qwen3", text, thinking=True)
    assert reasoning == "Let me call.\n" and calls == [("get_weather", {"city": "Rome"})] and content == ""
    # ... but one the block closes after is only reasoning
    closed = text + "\nNo, answer directly.\n</think>\n\nIt is sunny."
    content, reasoning, calls = same_whatever_the_chunking("qwen3", closed, thinking=True)
    assert calls == [] and content == "It is sunny." and "<tool_call>" in reasoning


def test_no_tools_means_no_calls_and_plain_text():
    text = '<think>x</think>\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    content, reasoning, calls = same_whatever_the_chunking("qwen3", text, tools=None)
    assert reasoning == "x" and calls == [] and content.startswith("<tool_call>")
    assert same_whatever_the_chunking("llama", " <think>a</think> b ", tools=None) == (" <think>a</think> b ", "", [])


QWEN_XML = ('<tool_call>\n<function=configure>\n<parameter=count>\n12\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n'
            '<parameter=on>\ntrue\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
            '<parameter=opts>\n{"k": 1}\n</parameter>\n<parameter=nothing>\nnull\n</parameter>\n'
            '<parameter=text>\n  two  spaces\n\n</parameter>\n<parameter=either>\n7\n</parameter>\n'
            '</function>\n</tool_call>')


def test_qwen_xml_parameters_take_the_schema_types():
    content, _, calls = same_whatever_the_chunking("qwen3_xml", QWEN_XML)
    assert content == ""
    assert calls == [("configure", {"count": 12, "ratio": 0.5, "on": True, "tags": ["a", "b"], "opts": {"k": 1},
                                    "nothing": None, "text": "  two  spaces\n", "either": "7"})]


def test_qwen_xml_malformed_values_stay_strings_and_unoffered_stay_content():
    text = QWEN_XML.replace("\n12\n", "\ntwelve\n").replace('\n["a", "b"]\n', "\n[a, b\n")
    _, _, calls = same_whatever_the_chunking("qwen3_xml", text)
    assert calls[0][1]["count"] == "twelve" and calls[0][1]["tags"] == "[a, b"
    other = "<tool_call>\n<function=launch>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
    assert same_whatever_the_chunking("qwen3_xml", other) == (other, "", [])


@pytest.mark.parametrize("name", sorted(CARDS))
def test_every_card_loads_and_declares_what_it_uses(name):
    card = CARDS[name]
    assert card.architectures
    if card.tool_format:
        assert card.tool_call.open and card.tool_call.close
