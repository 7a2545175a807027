"""Parsing and validation of chat/completions bodies (tensorfold.api.request, fields, messages)."""
import copy
import json
import math

from hypothesis import given, settings, strategies as st
import pytest

from malformed_cases import (ACCEPTED_CHAT_CASES, BASE_CHAT_BODY, BASE_COMPLETION_BODY,
                             MALFORMED_CHAT_CASES, MALFORMED_COMPLETION_CASES)
from tensorfold.api import fields
from tensorfold.api.errors import ApiError
from tensorfold.api.request import (KNOWN, NOT_HONOURED, NOT_YET, GenerationRequest,
                                    ServerDefaults, check_prompt_ids, parse_chat_request,
                                    parse_completion_request)
from tensorfold.sampling.params import SamplingParams

DEFAULTS = ServerDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, max_tokens=4096,
                          model_names=("qwen3-tiny", "tiny"))
VISION = ServerDefaults(vision=True)


def refusal(parse, body, defaults=DEFAULTS) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, defaults)
    return info.value


def case_id(case):
    return json.dumps(case[0])[:60]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", MALFORMED_CHAT_CASES, ids=case_id)
def test_malformed_chat_field_is_refused_naming_it(case, stream):
    extra, param = case
    err = refusal(parse_chat_request, {**BASE_CHAT_BODY, "stream": stream, **extra})
    assert (err.status, err.param, err.type) == (400, param, "invalid_request_error")
    assert err.body()["error"]["param"] == param and err.message


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", MALFORMED_COMPLETION_CASES, ids=case_id)
def test_malformed_completion_field_is_refused_naming_it(case, stream):
    extra, param = case
    err = refusal(parse_completion_request, {**BASE_COMPLETION_BODY, "stream": stream, **extra})
    assert (err.status, err.param) == (400, param)


@pytest.mark.parametrize("case", [c for c in MALFORMED_CHAT_CASES if c[0].get("messages")],
                         ids=case_id)
def test_completions_body_with_messages_is_refused_as_chat(case):
    extra, param = case
    err = refusal(parse_completion_request, {**BASE_CHAT_BODY, **extra})
    assert (err.status, err.param) == (400, param)


def test_the_tables_are_long_and_each_malformed_row_is_distinct():
    assert len(MALFORMED_CHAT_CASES) > 150 and len(MALFORMED_COMPLETION_CASES) > 100
    rows = [json.dumps(c, sort_keys=True) for c in MALFORMED_CHAT_CASES]
    assert len(rows) == len(set(rows))


@pytest.mark.parametrize("case", ACCEPTED_CHAT_CASES, ids=case_id)
def test_accepted_chat_bodies(case):
    extra, expected = case
    req = parse_chat_request({**BASE_CHAT_BODY, **extra}, DEFAULTS)
    for name, value in expected.items():
        assert getattr(req.sampling, name) == value, name
    assert type(req.sampling.top_k) is int and type(req.sampling.temperature) is float


def test_absent_and_null_fields_take_server_defaults():
    for body in ({"messages": BASE_CHAT_BODY["messages"]},
                 {"messages": BASE_CHAT_BODY["messages"], "temperature": None, "top_p": None,
                  "top_k": None, "min_p": None, "seed": None, "max_tokens": None,
                  "stop": None, "ignore_eos": None, "draft": None, "stream": None,
                  "priority": None, "model": None}):
        req = parse_chat_request(body, DEFAULTS)
        assert req.sampling == SamplingParams(temperature=0.6, top_p=0.95, top_k=20,
                                              min_p=0.05, seed=None, max_tokens=None)
        assert (req.kind, req.model, req.stream, req.include_usage, req.priority) == (
            "chat", "qwen3-tiny", False, False, None)  # unset: title detection may apply
        assert req.prompt is None and req.prompt_ids is None and req.ignored_fields == ()


def test_explicit_values_override_defaults():
    req = parse_chat_request({**BASE_CHAT_BODY, "temperature": 0, "top_p": 0.5, "top_k": 5,
                              "min_p": 0.1, "seed": -3, "max_tokens": 100, "stop": ["a", "b"],
                              "ignore_eos": True, "draft": False, "model": "tiny",
                              "stream": True, "stream_options": {"include_usage": True},
                              "priority": "background"}, DEFAULTS)
    assert req.sampling == SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.1,
                                          seed=-3, max_tokens=100, stop=("a", "b"),
                                          ignore_eos=True, draft=False)
    assert req.sampling.greedy
    assert (req.model, req.stream, req.include_usage, req.priority) == (
        "tiny", True, True, "background")


def test_server_default_top_k_below_zero_is_off():
    req = parse_chat_request(BASE_CHAT_BODY, ServerDefaults(top_k=-1))
    assert req.sampling.top_k == 0


def test_server_defaults_refuse_bad_config():
    for bad in ({"top_p": 0}, {"temperature": -1}, {"min_p": 2}, {"max_tokens": 0}):
        with pytest.raises(ValueError):
            ServerDefaults(**bad)


def test_unknown_model_is_404_model_not_found():
    err = refusal(parse_chat_request, {**BASE_CHAT_BODY, "model": "gpt-4o"})
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    err = refusal(parse_completion_request, {**BASE_COMPLETION_BODY, "model": "gpt-4o"})
    assert (err.status, err.code) == (404, "model_not_found")


def test_any_model_name_is_accepted_without_a_served_name_list():
    req = parse_chat_request({**BASE_CHAT_BODY, "model": "anything"}, ServerDefaults())
    assert req.model == "anything"
    assert parse_chat_request(BASE_CHAT_BODY, ServerDefaults()).model == ""
    assert parse_chat_request({**BASE_CHAT_BODY, "model": ""}, DEFAULTS).model == "qwen3-tiny"


@pytest.mark.parametrize("body", [None, [], "{}", 5, True, [BASE_CHAT_BODY]])
def test_body_that_is_not_an_object_is_refused(body):
    for parse in (parse_chat_request, parse_completion_request):
        err = refusal(parse, body)
        assert err.status == 400 and err.param is None


def test_image_parts_need_vision_and_a_user_role():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}]}
    assert "--vision" in refusal(parse_chat_request, body).message
    req = parse_chat_request(body, VISION)
    assert req.messages[0]["content"][1] == image
    for messages, param in [
        ([{"role": "system", "content": [image]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "image_url"}]}],
         "messages[0].content[0].image_url"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "http://x/a.png"}]}],
         "messages[0].content[0].image_url"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}],
         "messages[0].content[0].image_url.url"),
        ([{"role": "user", "content": [{"type": "image_url",
                                        "image_url": {"url": "u", "detail": "max"}}]}],
         "messages[0].content[0].image_url.detail"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
         "messages[0].content[0].type"),
    ]:
        assert refusal(parse_chat_request, {"messages": messages}, VISION).param == param


def test_messages_are_copied_and_the_body_is_not_mutated():
    body = {**ACCEPTED_CHAT_CASES[-1][0], "chat_template_kwargs": {"enable_thinking": True}}
    before = copy.deepcopy(body)
    req = parse_chat_request(body, DEFAULTS)
    assert body == before
    assert list(req.messages) == body["messages"]
    assert req.messages[2] is not body["messages"][2]
    assert req.messages[2]["tool_calls"] is not body["messages"][2]["tool_calls"]
    assert req.chat_template_kwargs == {"enable_thinking": True}
    assert req.chat_template_kwargs is not body["chat_template_kwargs"]


def test_reasoning_effort_top_level_wins_over_chat_template_kwargs():
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "low"}}
    assert parse_chat_request({**BASE_CHAT_BODY, **kwargs}, DEFAULTS).reasoning_effort == "low"
    req = parse_chat_request({**BASE_CHAT_BODY, **kwargs, "reasoning_effort": "high"}, DEFAULTS)
    assert req.reasoning_effort == "high"
    assert req.chat_template_kwargs == {"reasoning_effort": "low"}
    assert parse_chat_request(BASE_CHAT_BODY, DEFAULTS).reasoning_effort is None
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh"):
        req = parse_chat_request({**BASE_CHAT_BODY, "reasoning_effort": effort}, DEFAULTS)
        assert req.reasoning_effort == effort


def test_n_above_one_says_so():
    assert refusal(parse_chat_request, {**BASE_CHAT_BODY, "n": 3}).message == (
        "n > 1 is not supported")


def test_not_yet_features_say_not_available_yet():
    err = refusal(parse_chat_request, {**BASE_CHAT_BODY, "functions": [{"name": "f"}]})
    assert "not available yet" in err.message
    err = refusal(parse_chat_request, {**BASE_CHAT_BODY, "min_tokens": 2})
    assert "not supported" in err.message


def test_unknown_fields_are_ignored_and_reported_harmless_ones_silently():
    req = parse_chat_request({**BASE_CHAT_BODY, "zeta": 1, "alpha": {"x": 1}, "user": "u",
                              "metadata": {}, "store": True, "prompt_cache_key": "k"}, DEFAULTS)
    assert req.ignored_fields == ("alpha", "zeta")


def test_tables_do_not_overlap_parsed_fields():
    assert not (NOT_YET.keys() & NOT_HONOURED.keys())
    assert "temperature" in KNOWN and "stop" not in NOT_HONOURED


def test_completion_prompts():
    def parse(prompt):
        req = parse_completion_request({"prompt": prompt}, DEFAULTS)
        assert req.kind == "completion" and req.messages is None
        return req.prompt, req.prompt_ids
    assert parse("Hello") == ("Hello", None)
    assert parse(["Hello"]) == ("Hello", None)
    assert parse([1, 2, 3]) == (None, (1, 2, 3))
    assert parse([[1, 2.0]]) == (None, (1, 2))
    assert parse([0]) == (None, (0,))


def test_completions_body_with_messages_is_chat_and_empty_messages_are_absent():
    req = parse_completion_request({**BASE_CHAT_BODY, "top_k": 3}, DEFAULTS)
    assert req.kind == "chat" and req.sampling.top_k == 3 and req.messages
    req = parse_completion_request({**BASE_COMPLETION_BODY, "messages": []}, DEFAULTS)
    assert req.kind == "completion" and req.prompt == "Once upon a time"
    err = refusal(parse_completion_request, {**BASE_CHAT_BODY, "prompt": "x"})
    assert err.param == "prompt"


def test_check_prompt_ids_names_the_index():
    check_prompt_ids((0, 5, 9), 10)
    check_prompt_ids((), 10)
    for ids, param in [((0, 10), "prompt[1]"), ((3, 4, 5, 100), "prompt[3]"),
                       ((2**40,), "prompt[0]")]:
        with pytest.raises(ApiError) as info:
            check_prompt_ids(ids, 10)
        assert (info.value.status, info.value.param) == (400, param)
        assert str(ids[int(param[7:-1])]) in info.value.message


def test_field_readers():
    assert fields.number(1, "x") == 1.0 and type(fields.number(1, "x")) is float
    assert fields.integer(3.0, "x") == 3 and type(fields.integer(3.0, "x")) is int
    assert fields.integer(None, "x") is None and fields.boolean(None, "x") is None
    assert fields.same_value(1, 1.0) and not fields.same_value(0, False)
    assert not fields.same_value(True, 1) and fields.same_value([], [])
    with pytest.raises(ApiError):
        fields.string(None, "x", required=True)
    with pytest.raises(ApiError):
        fields.number(float("-inf"), "x")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=8)
FIELD_NAMES = sorted(KNOWN | {"unknown"})


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(FIELD_NAMES), value=JSON, completion=st.booleans())
def test_any_json_value_in_one_field_is_accepted_or_refused_naming_that_field(
        field, value, completion):
    base = BASE_COMPLETION_BODY if completion else BASE_CHAT_BODY
    body = {**base, field: value}
    before = copy.deepcopy(body)
    parse = parse_completion_request if completion else parse_chat_request
    try:
        req = parse(body, DEFAULTS)
    except ApiError as err:
        if field == "messages" and completion and isinstance(value, list) and value:
            assert err.param == "prompt"     # messages make it chat, which has no prompt
            return
        if field == "max_tokens" or field == "max_completion_tokens":
            assert err.param in ("max_tokens", "max_completion_tokens")
        else:
            assert err.param == field or err.param.startswith((field + "[", field + ".")), (
                err.param, field)
        assert err.status in (400, 404)
    else:
        assert isinstance(req, GenerationRequest)
        s = req.sampling
        assert s.temperature >= 0 and 0 < s.top_p <= 1 and 0 <= s.min_p <= 1 and s.top_k >= 0
        assert all(isinstance(x, str) and x for x in s.stop)
        assert all(math.isfinite(x) for x in (s.temperature, s.top_p, s.min_p))
    assert json.dumps(body, sort_keys=True) == json.dumps(before, sort_keys=True)


# ---- session-title requests run as background work ----

from tensorfold.api.priority import BACKGROUND, FOREGROUND, request_priority  # noqa: E402

TITLE_CASES = [
    ([{"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
      {"role": "user", "content": "fix the bug in main.py"}], BACKGROUND),
    ([{"role": "user", "content": "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history."}],
     BACKGROUND),
    ([{"role": "system", "content": [{"type": "text", "text": "Please write a short title for this conversation"}]},
      {"role": "user", "content": "hi"}], BACKGROUND),
    ([{"role": "user", "content": "What is the title of the first Harry Potter book?"}], FOREGROUND),
    ([{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "Write a poem. Then explain it."}], FOREGROUND),
]


@pytest.mark.parametrize("messages,expected", TITLE_CASES)
def test_session_title_requests_are_background(messages, expected):
    assert request_priority(None, messages) == expected
    assert request_priority("foreground", messages) == FOREGROUND  # an explicit priority wins
    assert request_priority("background", messages) == BACKGROUND
