"""The nemotron_h model card and tools/templates/nemotron_h.jinja, the Nemotron 3 template of the tiny
nemotron_h checkpoints: the card is chosen for NemotronHForCausalLM where the template writes Qwen XML
calls (not for a <TOOLCALL> template); the template renders the family's format (ChatML, tools
declared in XML, XML calls, tool responses in user turns, think blocks, the history's thinking
truncated) as transformers' apply_chat_template does; efforts only turn thinking on; a reply in its
format parses into reasoning and typed calls, whole and streamed, and the next turn's prompt extends
this turn's prompt and reply; over HTTP on a tiny nemotron_h checkpoint with the family's tokens and
template, forced calls (required, a named function) come back as calls, streamed as whole."""
import pytest

from card_cases import CHATML_SPECIALS, FamilyTemplate, assistant_turn, check_forced_calls, chunks_of, parse, \
    weather_tool
from tensorfold.chat.cards import EFFORTS, load_cards, select_card
from tensorfold.engine.engine import EngineConfig
from tensorfold.server import ServeSettings
from serving import serving
from tools.tiny_checkpoint import make_tiny_checkpoint

FAMILY = FamilyTemplate("nemotron_h", "NemotronHForCausalLM", CHATML_SPECIALS, "<|im_end|>")
TEMPLATE, render, transformers_render, prompt_of = (FAMILY.text, FAMILY.render, FAMILY.transformers_render,
                                                    FAMILY.prompt_of)
CARD = load_cards()["nemotron_h"]
WEATHER = weather_tool(city_description="a city")
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


def test_a_reply_parses_into_reasoning_content_and_typed_calls_whole_and_streamed():
    whole = parse(CARD, REPLY, tools=[WEATHER])
    assert whole == ("The user wants Paris weather.\n", "Let me check.",
                     [("get_weather", {"city": "Paris", "days": 3, "metric": False, "hours": [9, 21]})])
    for size in (1, 3, 7):
        assert parse(CARD, REPLY, chunks_of(REPLY, size), tools=[WEATHER]) == whole


def test_the_next_turn_extends_this_turns_prompt_and_reply():
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    prompt = prompt_of(body)
    assistant = assistant_turn(parse(CARD, REPLY, tools=[WEATHER]))
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


def test_forced_calls_over_http_stream_as_whole(srv):
    """The grammar still lets the model open a think block first (the call comes after it)."""
    check_forced_calls(srv.client, max_tokens=60)
