"""The nemotron_h model card and tools/templates/nemotron_h.jinja, the Nemotron 3 template of the tiny
nemotron_h checkpoints: the card is chosen for NemotronHForCausalLM where the template writes Qwen XML
calls (not for a <TOOLCALL> template); the template renders the family's format (ChatML, tools
declared in XML, XML calls, tool responses in user turns, think blocks, the history's thinking
truncated) as transformers' apply_chat_template does; efforts only turn thinking on; a reply in its
format parses into reasoning and typed calls, whole and streamed, and the next turn's prompt extends
this turn's prompt and reply; over HTTP on a tiny nemotron_h checkpoint with the family's tokens and
template, forced calls (required, a named function) come back as calls, streamed as whole."""
import json
import os

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from tensorfold.api.prompt import Prompts
from tensorfold.api.request import ServerDefaults, parse_chat_request
from tensorfold.chat.cards import EFFORTS, load_cards, select_card
from tensorfold.chat.reply_parser import ReplyParser
from tensorfold.chat.served import served_model
from tensorfold.chat.template import ChatTemplate
from tensorfold.engine.engine import EngineConfig
from tensorfold.models.tokenizer import Tokenizer
from tensorfold.server import ServeSettings
from serving import serving
from tools.tiny_checkpoint import make_tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "tools", "templates", "nemotron_h.jinja"), encoding="utf-8") as f:
    TEMPLATE = f.read()
CARDS = load_cards()
SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, «now»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "a city"},
                                                    "days": {"type": "integer"}, "metric": {"type": "boolean"},
                                                    "hours": {"type": "array"}},
                   "required": ["city"]}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "\nNeed the tool.\n",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "  12 °C, rain  "},
    {"role": "assistant", "content": "Rainy, 12 °C.", "reasoning_content": "Summarise."},
    {"role": "user", "content": "Thanks!"},
]


def hf_tokenizer() -> HFTokenizer:
    tok = HFTokenizer(WordLevel({"<unk>": 0, **{t: i + 1 for i, t in enumerate(SPECIAL)}}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(SPECIAL)
    return tok


def transformers_render(messages, tools=None, **kwargs) -> str:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer(), unk_token="<unk>", eos_token="<|im_end|>",
                                        chat_template=TEMPLATE)
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)


def render(messages, tools=None, **kwargs) -> str:
    return ChatTemplate(TEMPLATE, eos_token="<|im_end|>").render(messages, tools=tools, template_kwargs=kwargs)


def prompt_of(body: dict) -> str:
    tokenizer = Tokenizer(hf_tokenizer(), bos_token_id=None, eos_token_ids=(2,))
    served = served_model("NemotronHForCausalLM", TEMPLATE, {"eos_token": "<|im_end|>"}, {}, tokenizer)
    prompts = Prompts(served, None, ("tiny",), default_max_tokens=1)
    greq = parse_chat_request({"model": "tiny", **body}, ServerDefaults())
    return prompts.render(greq, greq.tools.shown() if greq.tools is not None else None)


def test_the_card_is_chosen_for_nemotron_3_templates_only():
    card = select_card("NemotronHForCausalLM", TEMPLATE)
    assert card.name == "nemotron_h"
    assert (card.think.open, card.think.close, card.tool_format) == ("<think>", "</think>", "qwen_xml")
    assert (card.tool_call.open, card.tool_call.close, card.tool_call.name_prefix) == \
        ("<tool_call>", "</tool_call>", "\n<function=")
    assert card.end_tokens == ("<|im_end|>",) and card.efforts == {} and card.default_effort is None
    assert select_card("NemotronHForCausalLM", "{{ '<TOOLCALL>' + tools | tojson + '</TOOLCALL>' }}") is None
    assert select_card("NemotronHForCausalLM", None) is None


def test_a_conversation_renders_in_the_family_format():
    prompt = render(CONVERSATION, tools=[WEATHER])
    system, rest = prompt.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert ("<tools>\n<function>\n<name>get_weather</name>\n<description>Weather in a city, «now»</description>\n"
            "<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n<description>a city</description>\n"
            "</parameter>\n") in system and '<required>["city"]</required>\n</parameters>\n</function>\n</tools>' in system
    assert rest == ("<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
                    "<|im_start|>assistant\n<think></think>"  # the history's thinking truncated
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n12 °C, rain\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n<think></think>Rainy, 12 °C.<|im_end|>\n"
                    "<|im_start|>user\nThanks!<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n")
    # mid tool loop, the turns after the last real query keep their reasoning; thinking off closes the block
    mid = render(CONVERSATION[:-1], enable_thinking=False)
    assert "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>" in mid
    assert mid.endswith("<think>\nSummarise.\n</think>\n\nRainy, 12 °C.<|im_end|>\n<|im_start|>assistant\n"
                        "<think></think>")


ORACLE_CASES = [
    ("conversation_tools", CONVERSATION, [WEATHER], {}),
    ("thinking_off", CONVERSATION, None, {"enable_thinking": False}),
    ("mid_tool_loop", CONVERSATION[:-1], [WEATHER], {}),
    ("no_system", CONVERSATION[1:2], None, {}),
    ("inline_think", [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>x</think>A"}],
     None, {}),
]


@pytest.mark.parametrize("name,messages,tools,kwargs", ORACLE_CASES, ids=[c[0] for c in ORACLE_CASES])
def test_matches_transformers_apply_chat_template(name, messages, tools, kwargs):
    assert render(messages, tools, **kwargs) == transformers_render(messages, tools, **kwargs)


def test_efforts_only_turn_thinking_on():
    ask = {"messages": [{"role": "user", "content": "Hi"}]}
    prompts = {effort: prompt_of({**ask, "reasoning_effort": effort}) for effort in EFFORTS}
    assert prompts["none"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think></think>"
    assert {prompts[e] for e in EFFORTS if e != "none"} == {prompt_of(ask)} == \
        {"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"}


REPLY = ("The user wants Paris weather.\n</think>\n\nLet me check.\n\n"
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n"
         "<parameter=hours>\n[9, 21]\n</parameter>\n</function>\n</tool_call>")


def parse(text, chunks=None):
    parser = ReplyParser(CARDS["nemotron_h"], [WEATHER], thinking=True)
    deltas = [parser.push(piece) for piece in chunks or [text]] + [parser.finish()]
    return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
            [(c.name, json.loads(c.arguments)) for d in deltas for c in d.tool_calls])


def test_a_reply_parses_into_reasoning_content_and_typed_calls_whole_and_streamed():
    whole = parse(REPLY)
    assert whole == ("The user wants Paris weather.\n", "Let me check.",
                     [("get_weather", {"city": "Paris", "days": 3, "metric": False, "hours": [9, 21]})])
    for size in (1, 3, 7):
        assert parse(REPLY, chunks=[REPLY[i:i + size] for i in range(0, len(REPLY), size)]) == whole


def test_the_next_turn_extends_this_turns_prompt_and_reply():
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    prompt = prompt_of(body)
    reasoning, content, calls = parse(REPLY)
    assistant = {"role": "assistant", "content": content, "reasoning_content": reasoning,
                 "tool_calls": [{"id": "c0", "type": "function",
                                 "function": {"name": name, "arguments": json.dumps(arguments)}}
                                for name, arguments in calls]}
    follow = {**body, "messages": body["messages"] + [assistant, {"role": "tool", "tool_call_id": "c0",
                                                                  "content": "sun"}]}
    assert prompt_of(follow).startswith(prompt + REPLY + "<|im_end|>\n<|im_start|>user\n<tool_response>\nsun\n")


# ---- over HTTP on a tiny nemotron_h checkpoint ----------------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory, smollm2_tokenizer):
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("nemotron_h_card")), "nemotron_h",
                                tokenizer=smollm2_tokenizer, family=True)
    with serving(ServeSettings(model=path, port=0, engine=EngineConfig(max_num_seqs=2, kv_cache_gib=0.05,
                                                                       probe=False))) as s:
        yield s


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# bounded values (a string value is any text up to a "<", which a random model need not write)
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "The forecast for some days",
    "parameters": {"type": "object", "properties": {"days": {"type": "integer"}, "metric": {"type": "boolean"}},
                   "required": ["days"]}}}


def test_forced_calls_over_http_stream_as_whole(srv):
    """Thinking off. The grammar still lets the model open a think block first (the call comes
    after it); a draw whose reply ran out of tokens before its call ended is skipped, the others
    are calls of the one function offered (beside another: the named choice), streamed as whole."""
    model = srv.client.models.list().data[0].id
    for choice in ("required", {"type": "function", "function": {"name": "get_forecast"}}):
        called = 0
        for seed in range(1, 7):
            tools = [FORECAST] if choice == "required" else [WEATHER, FORECAST]
            body = dict(model=model, messages=ASK, tools=tools, tool_choice=choice, max_tokens=60,
                        temperature=1.0, seed=seed, reasoning_effort="none")
            whole = srv.client.chat.completions.create(**body)
            message = whole.choices[0].message
            if whole.choices[0].finish_reason == "length" and not message.tool_calls:
                continue
            assert whole.choices[0].finish_reason == "tool_calls", whole.choices[0]
            (call,) = message.tool_calls
            assert call.function.name == "get_forecast"
            # the qwen_xml call grammar (grammar/tool_call.py) fixes the names, not the values' types
            assert set(json.loads(call.function.arguments)) <= {"days", "metric"}
            pieces = {}
            for chunk in srv.client.chat.completions.create(**body, stream=True):
                for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    entry = pieces.setdefault(delta.index, {"name": "", "arguments": ""})
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
            assert pieces == {0: {"name": "get_forecast", "arguments": call.function.arguments}}
            called += 1
        assert called >= 2, choice
