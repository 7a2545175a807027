"""The qwen3_5 model card and tools/templates/qwen3_5.jinja, the Qwen3.5-family template of the tiny
hybrid checkpoints: the card is chosen for the family's architectures; the template renders the
family's format (ChatML, tools and Qwen XML calls, tool responses in user turns, think blocks) the
same way transformers' apply_chat_template does; request efforts reach it under the card's names
(high as xhigh, minimal as low; unset, the template's own default xhigh and its instruction;
medium without one; none turns thinking off); a reply in its format parses into reasoning and
typed calls, and the next turn's prompt extends this turn's prompt and reply."""
import json

import pytest

from card_cases import CHATML_SPECIALS, WEATHER, FamilyTemplate, assistant_turn, chunks_of, parse as parse_with
from tensorfold.api.errors import ApiError
from tensorfold.chat.cards import EFFORTS, load_cards, select_card
from tensorfold.chat.template import ChatTemplate, TemplateError

FAMILY = FamilyTemplate("qwen3_5", "Qwen3_5MoeForCausalLM", CHATML_SPECIALS, "<|im_end|>")
TEMPLATE, render, transformers_render, serving, prompt_of = (FAMILY.text, FAMILY.render, FAMILY.transformers_render,
                                                             FAMILY.serving, FAMILY.prompt_of)
CARDS = load_cards()
ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                 "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
XHIGH_LINE = "Reasoning effort: xhigh."
LOW_LINE = "Reasoning effort: low."

CONVERSATION = [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "\nNeed the tool.\n",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
                    {"id": "c2", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Bern\nnorth", "hours": [6, 18]}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "  12 °C, rain  "},
    {"role": "tool", "tool_call_id": "c2", "content": "wind 3 m/s"},
    {"role": "assistant", "content": "Rainy, 12 °C.", "reasoning_content": "Summarise."},
    {"role": "user", "content": "Thanks!"},
]


# -- the card ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_card_is_chosen_for_each_architecture(architecture):
    assert select_card(architecture, TEMPLATE).name == "qwen3_5"
    assert select_card(architecture, None).name == "qwen3_5"  # the family's fallback: no markers
    served, _ = serving(architecture)
    assert served.card.name == "qwen3_5"
    assert served.think_ids == (3, 4) and served.think_close_sequence is not None  # single tokens
    assert served.reasoning_effort is None  # unset: the template's own default


def test_the_card_declares_think_markers_xml_calls_and_the_effort_names():
    card = CARDS["qwen3_5"]
    assert set(card.architectures) == set(ARCHITECTURES)
    assert (card.think.open, card.think.close) == ("<think>", "</think>")
    assert card.tool_format == "qwen_xml"
    assert (card.tool_call.open, card.tool_call.close, card.tool_call.name_prefix) == \
        ("<tool_call>", "</tool_call>", "\n<function=")
    assert {e: card.effort_name(e) for e in EFFORTS if e != "none"} == \
        {"minimal": "low", "low": "low", "medium": "medium", "high": "xhigh", "xhigh": "xhigh"}
    assert card.default_effort is None and card.template is None and card.end_tokens == ("<|im_end|>",)
    # The template names exactly the efforts the card maps to, so no name reaches it unmapped.
    template = ChatTemplate(TEMPLATE)
    assert {"low", "medium", "xhigh"} <= template.string_constants
    assert not {"minimal", "high"} & template.string_constants
    assert {"reasoning_effort", "enable_thinking", "tools", "messages"} <= template.variables


def test_a_hermes_qwen3_next_template_takes_the_hermes_card():
    hermes = ('{{- "<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
              '</tool_call>" }}')
    assert select_card("Qwen3NextForCausalLM", hermes).name == "qwen3_next"
    assert CARDS["qwen3_next"].tool_format == "hermes_json"
    assert select_card("Qwen3_5MoeForCausalLM", hermes).name == "qwen3_5"  # only Qwen3Next has such checkpoints
    assert "<function-name>" not in TEMPLATE


# -- the template -----------------------------------------------------------------------------------

def test_a_conversation_with_tools_renders_in_the_family_format():
    prompt = render(CONVERSATION, tools=[WEATHER], reasoning_effort="medium")
    head, tools_block, rest = prompt.partition("<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>")
    assert tools_block and head == "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou can call the functions below. " \
                                   "Their signatures, one JSON object per line:\n"
    assert "\n<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER_NAME>\n" in rest
    assert rest.split("<|im_end|>\n", 1)[1] == (
        "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n"  # reasoning before the last user query is dropped
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\nnorth\n</parameter>\n"
        "<parameter=hours>\n[6, 18]\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n12 °C, rain\n</tool_response>\n"
        "<tool_response>\nwind 3 m/s\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nRainy, 12 °C.<|im_end|>\n"
        "<|im_start|>user\nThanks!<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")


def test_reasoning_is_kept_after_the_last_user_query_only():
    # Mid tool loop (the last real query is the first user turn): both assistant turns keep theirs.
    prompt = render(CONVERSATION[:-1], enable_thinking=False)
    assert "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>" in prompt
    assert "<|im_start|>assistant\n<think>\nSummarise.\n</think>\n\nRainy, 12 °C.<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Reasoning written into the content is taken from there; one without any gets an empty block.
    inline = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nA"},
              {"role": "assistant", "content": "B"}]
    assert render(inline).endswith("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\n"
                                   "A<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nB<|im_end|>\n"
                                   "<|im_start|>assistant\n<think>\n")
    assert "hm" not in render(inline + [{"role": "user", "content": "again"}])


def test_content_before_calls_and_refusals():
    call = {"function": {"name": "get_weather", "arguments": {"city": "Rome", "metric": True}}}
    prompt = render([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Checking.", "tool_calls": [call]}],
                    enable_thinking=False)
    assert "<think>\n\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n" \
           "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call><|im_end|>" in prompt
    with pytest.raises(TemplateError, match="must come first"):
        render([{"role": "user", "content": "Q"}, {"role": "system", "content": "late"}])
    with pytest.raises(TemplateError, match="JSON object"):
        render([{"role": "user", "content": "Q"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])
    with pytest.raises(TemplateError, match="Unknown reasoning effort high"):
        render([{"role": "user", "content": "Q"}], reasoning_effort="high")
    # Thinking off, the effort is not heard at all.
    assert render([{"role": "user", "content": "Q"}], reasoning_effort="high", enable_thinking=False) == \
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


ORACLE_CASES = [
    ("conversation_tools", CONVERSATION, [WEATHER], {}),
    ("conversation_thinking_off", CONVERSATION, None, {"enable_thinking": False}),
    ("mid_tool_loop_low", CONVERSATION[:-2], [WEATHER], {"reasoning_effort": "low"}),
    ("medium_no_system", CONVERSATION[1:2], None, {"reasoning_effort": "medium"}),
    ("xhigh_no_system", CONVERSATION[1:2], None, {"reasoning_effort": "xhigh"}),
    ("text_parts", [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}],
     None, {}),
    ("inline_think", [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>x</think>A"}],
     None, {}),
]


@pytest.mark.parametrize("name,messages,tools,kwargs", ORACLE_CASES, ids=[c[0] for c in ORACLE_CASES])
def test_matches_transformers_apply_chat_template(name, messages, tools, kwargs):
    expected = transformers_render(messages, tools, **kwargs)
    assert render(messages, tools, **kwargs) == expected
    assert expected.startswith("<|im_start|>") and expected.endswith("<|im_start|>assistant\n" + (
        "<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False else "<think>\n"))


# -- efforts, as the server passes them -------------------------------------------------------------

ASK = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}


def test_each_effort_name_renders_as_the_spec_says():
    prompts = {effort: prompt_of({**ASK, "reasoning_effort": effort}) for effort in EFFORTS}
    unset = prompt_of(ASK)
    assert prompts["none"] == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                              "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for effort in ("minimal", "low", "medium", "high", "xhigh"):
        assert prompts[effort].endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert prompts["high"] == prompts["xhigh"] == unset  # high renders xhigh, the template's default
    assert prompts["minimal"] == prompts["low"]          # minimal renders low
    assert prompts["xhigh"].startswith("<|im_start|>system\nBe brief.\n\n" + XHIGH_LINE)
    assert prompts["low"].startswith("<|im_start|>system\nBe brief.\n\n" + LOW_LINE)
    assert prompts["medium"] == prompts["none"].replace("<think>\n\n</think>\n\n", "<think>\n")  # no instruction
    # Without a system message the instruction makes the system turn; medium adds none.
    alone = {"messages": ASK["messages"][1:]}
    assert prompt_of(alone).startswith("<|im_start|>system\n" + XHIGH_LINE)
    assert prompt_of({**alone, "reasoning_effort": "medium"}).startswith("<|im_start|>user\nHi")


def test_effort_sources_and_precedence():
    high = prompt_of({**ASK, "reasoning_effort": "high"})
    assert prompt_of({**ASK, "chat_template_kwargs": {"reasoning_effort": "high"}}) == high
    assert prompt_of({**ASK, "reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}) == high
    off = prompt_of({**ASK, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}})
    assert XHIGH_LINE not in off and off.endswith("<think>\n\n</think>\n\n")  # heard only while thinking
    # The server's --reasoning-effort stands in for a request's.
    assert prompt_of(ASK, reasoning_effort="minimal") == prompt_of({**ASK, "reasoning_effort": "low"})
    served, _ = serving()
    assert served.opens_think(high) and not served.opens_think(off)


# -- replies ----------------------------------------------------------------------------------------

REPLY = ("The user wants Paris weather.\n</think>\n\nLet me check.\n\n"
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n"
         "<parameter=hours>\n[9, 21]\n</parameter>\n</function>\n</tool_call>")


def parse(text, chunks=None):
    return parse_with(CARDS["qwen3_5"], text, chunks)


def test_a_reply_parses_into_reasoning_content_and_typed_calls():
    whole = parse(REPLY)
    assert whole == ("The user wants Paris weather.\n", "Let me check.",
                     [("get_weather", {"city": "Paris", "days": 3, "metric": False, "hours": [9, 21]})])
    assert parse(REPLY, chunks=list(REPLY)) == whole
    assert parse(REPLY, chunks=chunks_of(REPLY, 7)) == whole


def test_the_next_turn_extends_this_turns_prompt_and_reply():
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    prompt = prompt_of(body)
    assistant = assistant_turn(parse(REPLY))
    follow = {**body, "messages": body["messages"] + [assistant, {"role": "tool", "tool_call_id": "c0", "content": "sun"}]}
    assert prompt_of(follow).startswith(prompt + REPLY + "<|im_end|>\n<|im_start|>user\n<tool_response>\nsun\n")


def test_a_later_system_message_is_rendered_as_a_user_one():
    body = {"messages": [{"role": "user", "content": "Q"}, {"role": "system", "content": "Now in French."}],
            "reasoning_effort": "medium"}
    assert prompt_of(body) == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>user\nNow in French.<|im_end|>\n" \
                              "<|im_start|>assistant\n<think>\n"
    with pytest.raises(ApiError, match="JSON object"):
        prompt_of({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "nope"}}]}],
            "tools": [WEATHER]})
