"""Message normalisation (spec: "Developer messages use system-message semantics") and render_chat.

Expected normalised messages are written out by hand from the spec; prompts are compared with
transformers' renderer fed those expected messages.
"""
import copy

import pytest
from hypothesis import given, settings, strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

from tensorfold.chat.messages import later_system_as_user, normalize_messages, render_chat
from tensorfold.chat.template import ChatTemplate, TemplateError
from test_chat_template import GEMMA_STYLE, QWEN3_STYLE, SMOLLM2


def hf_render(source, messages, **kwargs):
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=source,
                                        add_generation_prompt=True, bos_token="", eos_token="", **kwargs)
    return rendered[0]


def test_developer_is_system():
    messages = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Hi"}]
    assert normalize_messages(messages) == [{"role": "system", "content": "Rules."},
                                            {"role": "user", "content": "Hi"}]
    expected = hf_render(SMOLLM2, normalize_messages(messages))
    assert render_chat(ChatTemplate(SMOLLM2), messages) == expected
    assert expected.startswith("<|im_start|>system\nRules.<|im_end|>\n")


def test_leading_system_and_developer_merge_in_order():
    messages = [{"role": "system", "content": "A"}, {"role": "developer", "content": "B"},
                {"role": "system", "content": [{"type": "text", "text": "C"}]},
                {"role": "user", "content": "Hi"}]
    assert normalize_messages(messages) == [{"role": "system", "content": "A\n\nB\n\nC"},
                                            {"role": "user", "content": "Hi"}]
    assert render_chat(ChatTemplate(SMOLLM2), messages) == (
        "<|im_start|>system\nA\n\nB\n\nC<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_empty_leading_texts_add_no_separators():
    messages = [{"role": "system", "content": ""}, {"role": "developer", "content": "B"},
                {"role": "system", "content": None}, {"role": "user", "content": "Hi"}]
    assert normalize_messages(messages)[0] == {"role": "system", "content": "B"}


def test_later_system_messages_stay_in_place():
    messages = [{"role": "developer", "content": "A"}, {"role": "user", "content": "Hi"},
                {"role": "developer", "content": "Late"}, {"role": "system", "content": "Later"},
                {"role": "user", "content": "Go"}]
    expected = [{"role": "system", "content": "A"}, {"role": "user", "content": "Hi"},
                {"role": "system", "content": "Late"}, {"role": "system", "content": "Later"},
                {"role": "user", "content": "Go"}]
    assert normalize_messages(messages) == expected
    # SmolLM2's template accepts a system message anywhere: rendered in place, no fallback.
    got = render_chat(ChatTemplate(SMOLLM2), messages)
    assert got == hf_render(SMOLLM2, expected)
    assert "<|im_start|>user\nHi<|im_end|>\n<|im_start|>system\nLate<|im_end|>\n<|im_start|>system\nLater" in got


def test_rejected_later_system_message_renders_as_user():
    messages = [{"role": "system", "content": "A"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "developer", "content": "Be terse."},
                {"role": "user", "content": "Go"}]
    template = ChatTemplate(QWEN3_STYLE)
    with pytest.raises(TemplateError, match="System message must be at the beginning"):
        template.render(normalize_messages(messages))
    as_user = [{"role": "system", "content": "A"}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Be terse."},
               {"role": "user", "content": "Go"}]
    got = render_chat(template, messages)
    assert got == hf_render(QWEN3_STYLE, as_user)
    assert "<|im_start|>user\nBe terse.<|im_end|>\n<|im_start|>user\nGo<|im_end|>" in got
    assert got.startswith("<|im_start|>system\nA<|im_end|>\n")  # the leading one stays system


def test_fallback_that_still_fails_propagates():
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late"},
                {"role": "assistant", "content": "Yo"}]
    with pytest.raises(TemplateError, match="roles must alternate") as info:
        render_chat(ChatTemplate(GEMMA_STYLE), messages)
    assert "System role is only supported" in str(info.value.__cause__)


def test_rejection_without_later_system_propagates_unchanged():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="roles must alternate") as info:
        render_chat(ChatTemplate(GEMMA_STYLE), messages)
    assert info.value.__cause__ is None


def test_text_parts_concatenate_in_order():
    messages = [{"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"},
                                             {"type": "text", "text": ""}, {"type": "text", "text": " three"}]}]
    assert normalize_messages(messages) == [{"role": "user", "content": "one two three"}]
    assert "<|im_start|>user\none two three<|im_end|>" in render_chat(ChatTemplate(SMOLLM2), messages)


def test_content_none_and_other_fields_kept():
    messages = [
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": None, "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
                        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "12 °C"}]},
    ]
    assert normalize_messages(messages) == [
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": "", "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
                        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 °C"},
    ]
    got = render_chat(ChatTemplate(QWEN3_STYLE), messages)
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in got
    assert '{"name": "f", "arguments": not json}' in got


def test_caller_messages_are_not_mutated():
    messages = [{"role": "developer", "content": [{"type": "text", "text": "A"}]},
                {"role": "system", "content": "B"}, {"role": "user", "content": "Hi"},
                {"role": "developer", "content": "Late"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "user", "content": "Go"}]
    before = copy.deepcopy(messages)
    normalized = normalize_messages(messages)
    render_chat(ChatTemplate(QWEN3_STYLE), messages)  # takes the fallback path
    assert messages == before
    normalized[3]["tool_calls"][0]["function"]["name"] = "changed"  # shares nothing with the caller
    assert messages == before


def test_template_kwargs_reach_the_template():
    messages = [{"role": "developer", "content": "A"}, {"role": "user", "content": "Hi"}]
    template = ChatTemplate(QWEN3_STYLE)
    thinking = render_chat(template, messages)
    not_thinking = render_chat(template, messages, template_kwargs={"enable_thinking": False})
    assert not_thinking == thinking + "<think>\n\n</think>\n\n"
    assert not_thinking == hf_render(QWEN3_STYLE, normalize_messages(messages), enable_thinking=False)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert "<tools>\n" + '{"type": "function"' in render_chat(template, messages, tools=tools)
    assert render_chat(template, messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_raise_exception_message_surfaces():
    template = ChatTemplate("{{ raise_exception('Only user turns, please: ' ~ messages[0].role) }}")
    with pytest.raises(TemplateError) as info:
        render_chat(template, [{"role": "developer", "content": "x"}])
    assert str(info.value) == "Only user turns, please: system"


def test_later_system_as_user_keeps_index_zero():
    messages = [{"role": "system", "content": "A"}, {"role": "system", "content": "B", "name": "n"}]
    assert later_system_as_user(messages) == [{"role": "system", "content": "A"},
                                              {"role": "user", "content": "B", "name": "n"}]


_roles = st.sampled_from(["system", "developer", "user", "assistant"])
_content = st.one_of(st.none(), st.text(max_size=5),
                     st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)}), max_size=3))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.fixed_dictionaries({"role": _roles, "content": _content}), max_size=8))
def test_normalisation_properties(messages):
    before = copy.deepcopy(messages)
    out = normalize_messages(messages)
    assert messages == before
    assert normalize_messages(out) == out  # idempotent
    assert all(m["role"] != "developer" and isinstance(m["content"], str) for m in out)
    # Leading system/developer messages become at most one; everything else keeps its order.
    num_leading = next((i for i, m in enumerate(messages) if m["role"] not in ("system", "developer")),
                       len(messages))
    rest = out[1:] if num_leading else out
    assert [m["role"] for m in rest] == [
        "system" if m["role"] == "developer" else m["role"] for m in messages[num_leading:]]
    if num_leading:
        texts = [normalize_messages([m])[0]["content"] for m in messages[:num_leading]]
        assert out[0] == {"role": "system", "content": "\n\n".join(t for t in texts if t)}
