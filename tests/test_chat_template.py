"""ChatTemplate against the oracle: transformers' own chat-template renderer.

Each template below is rendered by ChatTemplate and by transformers (render_jinja_template, or a
PreTrainedTokenizerFast's apply_chat_template); the prompts must be equal strings.
"""
import datetime
import json

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast
from transformers.utils import chat_template_utils
from transformers.utils.chat_template_utils import render_jinja_template

from tensorfold.chat.template import ChatTemplate, TemplateError

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3-shaped: tools in the system turn, think blocks kept only after the last user query,
# enable_thinking=false pre-closes the think block, and a system message past index 0 is refused.
QWEN3_STYLE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call functions. Signatures:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\nReply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == 'user' and message.content is string and not message.content.startswith('<tool_response>') %}
        {%- set ns.last_query = index %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.reasoning_content is defined and loop.index0 > ns.last_query %}
            {{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- message.content if message.content is string else '' }}
        {%- for tool_call in message.tool_calls | default([]) %}
            {%- set fn = tool_call.function %}
            {{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama-3-shaped: bos_token, today's date from strftime_now unless date_string is given, tools as
# indented JSON, trimmed contents, tool calls with JSON-encoded arguments.
LLAMA3_STYLE = """\
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You may call these functions:\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- elif message.tool_calls is defined %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for tc in message.tool_calls %}
            {{- '{"name": "' + tc.function.name + '", "parameters": ' + tc.function.arguments | tojson + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Gemma-shaped: system text folded into the first user turn, strict user/model alternation.
GEMMA_STYLE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message['role'] == 'system' -%}
        {{ raise_exception("System role is only supported as the first message") }}
    {%- endif -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{ message['content'] | trim }}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

# No whitespace control: the output depends on trim_blocks and lstrip_blocks.
PLAIN_BLOCKS = """\
{% for message in messages %}
    {% if message.role == 'user' %}
U: {{ message.content }}
    {% elif message.role == 'assistant' %}
        {% for call in message.tool_calls | default([]) %}
CALL {{ call.function.name }}
        {% else %}
A: {{ message.content }}
        {% endfor %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
A:{% endif %}
"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, «now»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "\nNeed the tool.\n",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "  12 °C, rain  "},
    {"role": "tool", "tool_call_id": "c2", "content": "wind 3 m/s"},
    {"role": "assistant", "content": "Rainy, 12 °C.", "reasoning_content": "Summarise."},
    {"role": "user", "content": "Thanks!"},
]

FIXED_NOW = datetime.datetime(2025, 3, 7, 14, 30)


class _FixedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW


@pytest.fixture(autouse=True)
def fixed_hf_clock(monkeypatch):
    monkeypatch.setattr(chat_template_utils, "datetime", _FixedDatetime)


def hf_render(source, messages, *, tools=None, add_generation_prompt=True, bos_token="", eos_token="", **kwargs):
    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=source,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=bos_token, eos_token=eos_token, **kwargs)
    return rendered[0]


def ours(source, messages, *, tools=None, add_generation_prompt=True, bos_token="", eos_token="", **kwargs):
    template = ChatTemplate(source, bos_token=bos_token, eos_token=eos_token, clock=lambda: FIXED_NOW)
    return template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           template_kwargs=kwargs)


CASES = [
    ("smollm2_no_system", SMOLLM2, [{"role": "user", "content": "Hi"}], {}),
    ("smollm2_system", SMOLLM2, [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "?"}], {}),
    ("qwen3_tools", QWEN3_STYLE, TOOL_CONVERSATION, {"tools": [WEATHER_TOOL]}),
    ("qwen3_no_tools_thinking_off", QWEN3_STYLE, TOOL_CONVERSATION[:2], {"enable_thinking": False}),
    ("qwen3_thinking_on", QWEN3_STYLE, TOOL_CONVERSATION[1:], {"enable_thinking": True}),
    ("qwen3_last_turn_reasoning", QWEN3_STYLE, TOOL_CONVERSATION[:-1], {"tools": [WEATHER_TOOL]}),
    ("llama3_tools", LLAMA3_STYLE, TOOL_CONVERSATION, {"tools": [WEATHER_TOOL], "bos_token": "<|begin_of_text|>"}),
    ("llama3_date_string", LLAMA3_STYLE, TOOL_CONVERSATION[:2], {"date_string": "26 Jul 2024"}),
    ("llama3_no_system", LLAMA3_STYLE, TOOL_CONVERSATION[1:2], {"add_generation_prompt": False}),
    ("plain_blocks", PLAIN_BLOCKS, TOOL_CONVERSATION, {}),
    ("gemma", GEMMA_STYLE, [{"role": "system", "content": "S"}, {"role": "user", "content": " Hi "},
                            {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Q"}],
     {"bos_token": "<bos>"}),
]


@pytest.mark.parametrize("name,source,messages,kwargs", CASES, ids=[c[0] for c in CASES])
def test_matches_transformers(name, source, messages, kwargs):
    expected = hf_render(source, messages, **kwargs)
    assert ours(source, messages, **kwargs) == expected
    assert len(expected) > 20


def test_oracle_cases_exercise_the_features():
    # Guards the oracle comparisons above against vacuous templates.
    qwen_tools = ours(QWEN3_STYLE, TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    assert '"description": "Weather in a city, «now»"' in qwen_tools  # tojson keeps non-ASCII
    assert '"arguments": {"city": "Zürich"}' in qwen_tools
    assert "<think>" not in qwen_tools  # reasoning before the last user query is dropped
    assert "<think>\nSummarise.\n</think>" in ours(QWEN3_STYLE, TOOL_CONVERSATION[:-1])
    assert ours(QWEN3_STYLE, TOOL_CONVERSATION[:2], enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    llama = ours(LLAMA3_STYLE, TOOL_CONVERSATION, tools=[WEATHER_TOOL], bos_token="<|begin_of_text|>")
    assert llama.startswith("<|begin_of_text|><|start_header_id|>system")
    assert "Today Date: 07 Mar 2025\n" in llama
    assert '\n    "type": "function",\n' in llama  # tojson(indent=4)
    assert '"parameters": "{\\"city\\": \\"Z\\u00fcrich\\"}"' not in llama


def test_apply_chat_template_oracle_drops_none_fields():
    # The full transformers path (tokenizer.apply_chat_template) drops None-valued keys and aliases
    # reasoning; ChatTemplate.render must do the same.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                        bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        chat_template=QWEN3_STYLE)
    messages = [
        {"role": "user", "content": "Hi", "name": None},
        {"role": "assistant", "content": None, "reasoning": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "done", "tool_calls": None},
        {"role": "assistant", "content": "ok", "tool_calls": None},  # None would break `| default([])`
        {"role": "user", "content": "more"},
    ]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
    got = ChatTemplate(QWEN3_STYLE, bos_token="<s>", eos_token="</s>").render(
        messages, template_kwargs={"enable_thinking": False})
    assert got == expected
    assert "<|im_start|>assistant\nok<|im_end|>" in got
    assert messages[1]["content"] is None and "reasoning_content" not in messages[1]


def test_filters_and_globals_match_transformers():
    source = (
        "{{ messages[0].content | tojson }}|{{ tools | tojson(sort_keys=True) }}|"
        "{{ tools | tojson(separators=(',', ':')) }}|{{ tools | tojson(indent=2) }}|"
        "{{ '<&>' | tojson }}|{{ strftime_now('%Y-%m-%d %H:%M') }}|"
        "{% set d = dict(a=1, b=2) %}{{ d | tojson }}|{{ dict.fromkeys(['x'], 0) | tojson }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% continue %}{% endfor %}{{ ns.n }}|"
        "{% generation %}GEN{{ eos_token }}{% endgeneration %}|{{ bos_token }}|{{ undefined_thing }}|"
        "{{ 'x' if undefined_thing is not defined }}|{{ messages[1].thinking }}/{{ messages[1].reasoning_content }}"
    )
    messages = [{"role": "user", "content": "é \"q\" <b>"}, {"role": "user", "content": "2", "reasoning": "r"}]
    tools = [{"z": 1, "a": ["ü", None, True]}]
    expected = hf_render(source, messages, tools=tools, bos_token="<s>", eos_token="</s>")
    got = ours(source, messages, tools=tools, bos_token="<s>", eos_token="</s>")
    assert got == expected
    assert got.startswith('"é \\"q\\" <b>"|[{"a": ["ü", null, true], "z": 1}]|[{"z":1,"a":["ü",null,true]}]|')
    assert '"<&>"|2025-03-07 14:30|{"a": 1, "b": 2}|{"x": 0}|1|GEN</s>|<s>||x|r/r' in got


_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": _text})


@settings(max_examples=60, deadline=None)
@given(st.lists(_message, min_size=1, max_size=5), st.booleans(), st.sampled_from([SMOLLM2, QWEN3_STYLE]))
def test_random_conversations_match_transformers(messages, add_generation_prompt, source):
    expected = hf_render(source, messages, add_generation_prompt=add_generation_prompt)
    assert ours(source, messages, add_generation_prompt=add_generation_prompt) == expected


def test_raise_exception_message_is_the_templates():
    template = ChatTemplate(QWEN3_STYLE)
    with pytest.raises(TemplateError) as info:
        template.render([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}])
    assert str(info.value) == "System message must be at the beginning."
    assert info.value.message == "System message must be at the beginning."


def test_syntax_error_is_a_template_error_with_line():
    with pytest.raises(TemplateError, match=r"syntax error at line 2"):
        ChatTemplate("{{ messages }}\n{% for m in messages %}")
    with pytest.raises(TemplateError, match="syntax error"):
        ChatTemplate("{% if %}")


@pytest.mark.parametrize("source,pattern", [
    ("{{ messages[0].content + 1 }}", "TypeError"),  # str + int
    ("{{ nothing.attr.deeper }}", "'nothing' is undefined"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ messages.append(1) }}", "chat template error"),  # immutable sandbox
    ("{{ ''.__class__.__mro__ }}", "chat template error"),  # no attribute escapes
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore"),
])
def test_render_errors_are_template_errors(source, pattern):
    with pytest.raises(TemplateError, match=pattern):
        ChatTemplate(source).render([{"role": "user", "content": "a"}])


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                 "raise_exception", "namespace"])
def test_template_kwargs_cannot_override_server_variables(key):
    template = ChatTemplate(SMOLLM2, bos_token="<s>")
    with pytest.raises(TemplateError, match=repr(key)):
        template.render([{"role": "user", "content": "a"}], template_kwargs={key: "x"})


def test_template_kwargs_reach_the_template():
    template = ChatTemplate("{{ reasoning_effort | default('none') }}/{{ enable_thinking }}")
    assert template.render([], template_kwargs={"reasoning_effort": "high", "enable_thinking": False}) == "high/False"
    assert template.render([]) == "none/"


def test_render_does_not_mutate_inputs_and_is_repeatable():
    messages = json.loads(json.dumps(TOOL_CONVERSATION))
    tools = [json.loads(json.dumps(WEATHER_TOOL))]
    kwargs = {"enable_thinking": True}
    template = ChatTemplate(QWEN3_STYLE)
    first = template.render(messages, tools=tools, template_kwargs=kwargs)
    assert template.render(messages, tools=tools, template_kwargs=kwargs) == first
    assert messages == TOOL_CONVERSATION and tools == [WEATHER_TOOL] and kwargs == {"enable_thinking": True}
    assert "thinking" not in messages[2]


def test_introspection():
    template = ChatTemplate("{% if reasoning_effort == 'high' %}H{% endif %}{{ enable_thinking }}{{ messages }}")
    assert {"reasoning_effort", "enable_thinking", "messages"} <= template.variables
    assert "high" in template.string_constants
    assert "minimal" not in template.string_constants
    assert template.source.startswith("{% if")
