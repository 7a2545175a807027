"""The gemma4 model card and tools/templates/gemma4.jinja (the tiny gemma4 checkpoints' template,
written after Gemma 4's published format): the card is chosen for both Gemma 4 architectures; the
template renders as transformers' apply_chat_template does; Gemma 4's value notation reads back;
replies the template writes (thought channel, text, calls) parse back into reasoning and the
calls' arguments, whole and streamed in any chunking; a forced call's grammar accepts the call the
template writes and starts after the think end <channel|>; over HTTP on a tiny gemma4 checkpoint
with the official openai client, tool_choice required and a named function return valid calls,
streamed equal to whole, and a thinking reply's thought channel is its reasoning."""
import json

import jsonschema
import pytest
import torch

from serving import serving
from tensorfold.chat.cards import load_cards, select_card
from tensorfold.chat.gemma4_values import read_call
from tensorfold.chat.reply_parser import ReplyParser
from tensorfold.chat.template import ChatTemplate
from tensorfold.engine.engine import EngineConfig
from tensorfold.grammar.compiler import GrammarCompiler
from tensorfold.grammar.constraint import GrammarConstraint
from tensorfold.grammar.tool_call import tool_call_spec
from tensorfold.models.tokenizer import Tokenizer
from tensorfold.server import ServeSettings
from tools.tiny_checkpoint import family_tokenizer, make_tiny_checkpoint

CARD = load_cards()["gemma4"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, {now}",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
ARGS = [{"city": "Zürich, {old town}", "days": 2, "metric": True, "hours": [6, 18.5], "note": None,
         "where": {"lat": -1.5, "tags": ["a", "b c"]}},
        {"tz": "Europe/Bern"}]
CONVERSATION = [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS[0]}},
                    {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": ARGS[1]}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "  12 °C, rain  "},
    {"role": "tool", "tool_call_id": "c2", "content": "10:00"},
    {"role": "assistant", "content": "Rainy, 12 °C.", "reasoning_content": "Summarise."},
    {"role": "user", "content": "Thanks!"},
]
ASK = [{"role": "user", "content": "What's the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def hf_tok(smollm2_tokenizer):
    return family_tokenizer("gemma4", smollm2_tokenizer, family=True)


def render(hf_tok, messages, tools=None, **kwargs) -> str:
    return ChatTemplate(hf_tok.chat_template, bos_token=hf_tok.bos_token, eos_token=hf_tok.eos_token).render(
        messages, tools=tools, template_kwargs=kwargs)


def parse(text: str, chunk: int | None = None, tools=TOOLS, thinking=False):
    parser = ReplyParser(CARD, tools, thinking=thinking)
    if chunk is None:
        parser.push(text)
    else:
        for i in range(0, len(text), chunk):
            parser.push(text[i:i + chunk])
    parser.finish()
    return parser.whole


def test_the_card_is_chosen_for_both_architectures(hf_tok):
    for architecture in ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"):
        assert select_card(architecture, hf_tok.chat_template).name == "gemma4"
    assert CARD.think.close == "<channel|>" and CARD.tool_call.open == "<|tool_call>"


@pytest.mark.parametrize("thinking", [False, True])
def test_the_template_renders_as_transformers_does(hf_tok, thinking):
    ours = render(hf_tok, CONVERSATION, TOOLS, enable_thinking=thinking)
    theirs = hf_tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                        enable_thinking=thinking)
    assert ours == theirs
    assert ours.count("<|think|>") == int(thinking)
    assert '<|tool_call>call:get_time{tz:<|"|>Europe/Bern<|"|>}<tool_call|>' in ours
    assert '<|tool_response>response:get_weather{value:<|"|>12 °C, rain<|"|>}<tool_response|>' in ours
    assert "Need the tool." not in ours and ours.endswith("<|turn>user\nThanks!<turn|>\n<|turn>model\n")


def test_gemma_values_read_back_and_others_are_not_calls():
    assert read_call('call:f{a:<|"|>x, {y}: z<|"|>,b:[1,-2.5e3,true,null],c:{d:false}}') == \
        ("f", {"a": "x, {y}: z", "b": [1, -2500.0, True, None], "c": {"d": False}})
    assert read_call(' call:f{ a : 1 , "b":"q" } \n') == ("f", {"a": 1, "b": "q"})
    assert read_call("call:f{}") == ("f", {})
    for bad in ("call:f{a:1", "call:f{a:1} tail", "f{a:1}", "call:f{a 1}", 'call:f{a:<|"|>x}', "call:f[1]",
                "call:f{a:1,}"):
        assert read_call(bad) is None, bad


def reply_of(hf_tok, message) -> str:
    """The model turn the template writes for `message`: what a model trained on it replies."""
    before = render(hf_tok, ASK, TOOLS, enable_thinking=True)
    after = hf_tok.apply_chat_template(ASK + [message], tools=TOOLS, tokenize=False, enable_thinking=True)
    assert after.startswith(before) and after.endswith("<turn|>\n")
    return after[len(before):-len("<turn|>\n")]


@pytest.mark.parametrize("chunk", [None, 1, 2, 5, 13])
def test_replies_the_template_writes_parse_back_whole_and_streamed(hf_tok, chunk):
    message = {"role": "assistant", "content": "Let me look.", "reasoning_content": "Two calls.",
               "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": t["function"]["name"],
                                                                               "arguments": a}}
                              for i, (t, a) in enumerate(zip(TOOLS, ARGS))]}
    text = reply_of(hf_tok, message)
    assert text.startswith("<|channel>thought\nTwo calls.<channel|>Let me look.<|tool_call>call:get_weather{")
    whole = parse(text, chunk)
    assert whole.reasoning == "Two calls." and whole.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == \
        [("get_weather", ARGS[0]), ("get_time", ARGS[1])]


@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_reasoning_splits_off_and_bad_calls_stay_content(chunk):
    whole = parse("<|channel>thought\nI think <b>.<channel|>\n\nThe answer.", chunk)
    assert (whole.reasoning, whole.content, whole.tool_calls) == ("I think <b>.", "The answer.", [])
    bad = 'Hi <|tool_call>call:nope{a:1}<tool_call|> and <|tool_call>call:get_time{tz:<|"|>x}<tool_call|>'
    whole = parse(bad, chunk)
    assert whole.content == bad and not whole.tool_calls
    whole = parse('<|tool_call>call:get_time{tz:<|"|>UTC<|"|>}', chunk)  # cut at the end of the reply
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("get_time", '{"tz": "UTC"}')]


@pytest.fixture(scope="module")
def tokenizer(hf_tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4_tok")
    hf_tok.save_pretrained(str(folder))
    from tokenizers import Tokenizer as HFTokenizer
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    return Tokenizer(tok, bos_token_id=None, eos_token_ids=(tok.token_to_id("<turn|>"),))


def test_the_forced_call_grammar_accepts_the_template_call_after_the_think_end(hf_tok, tokenizer):
    compiled, _ = GrammarCompiler(tokenizer, tokenizer.vocab_size).compile(tool_call_spec(CARD, TOOLS))
    think = (tokenizer.token_to_id("<|channel>"), tokenizer.token_to_id("<channel|>"))
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": {"city": "Paris", "unit": "c", "days": 3}}}]}
    text = reply_of(hf_tok, call)
    thought = tokenizer.encode("<|channel>thought\nhm, <|tool_call> {x}<channel|>", add_special_tokens=False)
    reply = thought + tokenizer.encode(text, add_special_tokens=False) + list(tokenizer.eos_token_ids)
    constraint = GrammarConstraint(compiled, tokenizer.eos_token_ids, think)
    vocab_words = (tokenizer.vocab_size + 31) // 32
    for n in range(len(reply)):  # each reply token is allowed after the ones before it
        mask = torch.full((1, vocab_words), -1, dtype=torch.int32)
        constraint.fill_mask(reply[:n], mask, 0)
        token = reply[n]
        assert mask[0, token // 32].item() >> (token % 32) & 1, (n, tokenizer.decode(reply[:n + 1]))
    assert constraint.num_valid_drafts([], reply, tokenizer.vocab_size) == len(reply)
    # right after the think end the call's opener (its token, or its text spelled out); no prose, no
    # second thought channel; an unoffered tool or a bad value is refused
    mask = torch.full((1, vocab_words), -1, dtype=torch.int32)
    constraint.fill_mask(thought, mask, 0)
    allowed = {t for t in range(tokenizer.vocab_size) if mask[0, t // 32].item() >> (t % 32) & 1}
    assert tokenizer.token_to_id("<|tool_call>") in allowed
    assert all(tokenizer.decode([t]) in ("<", "<|") for t in allowed - {tokenizer.token_to_id("<|tool_call>")})
    for wrong in ('<|tool_call>call:get_date{', '<|tool_call>call:get_weather{unit:<|"|>k',
                  '<|tool_call>call:get_weather{days:1}'):
        ids = tokenizer.encode(wrong, add_special_tokens=False)
        assert constraint.num_valid_drafts(thought, ids + tokenizer.encode("<tool_call|>", add_special_tokens=False),
                                           tokenizer.vocab_size) < len(ids) + 1, wrong


# ---- over HTTP on a tiny gemma4 checkpoint ----------------------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory, smollm2_tokenizer):
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("gemma4_card")), "gemma4", tokenizer=smollm2_tokenizer,
                                family=True)
    with serving(ServeSettings(model=path, port=0, engine=EngineConfig(max_num_seqs=2, kv_cache_gib=0.05,
                                                                       probe=False))) as s:
        yield s


def check_calls(reply, offered):
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    by_name = {t["function"]["name"]: t["function"] for t in offered}
    assert calls and choice.message.content is None
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["parameters"])
    return calls


def test_required_calls_an_offered_tool_over_http(srv):
    """Each draw calls an offered tool with valid arguments, unless the model opened its thought
    channel first (the call comes after <channel|>) and the reply ended inside it."""
    model = srv.client.models.list().data[0].id
    called = 0
    for temperature, seed in [(0.0, None), (1.0, 1), (1.0, 2), (0.7, 3), (1.0, 4)]:
        reply = srv.client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                   max_tokens=60, temperature=temperature, seed=seed)
        message = reply.choices[0].message
        if reply.choices[0].finish_reason == "length" and not message.content and not message.tool_calls:
            assert (message.model_extra or {}).get("reasoning_content")
            continue
        check_calls(reply, TOOLS)
        called += 1
    assert called >= 3


def test_a_named_function_streamed_equals_whole(srv):
    model = srv.client.models.list().data[0].id
    body = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=60, temperature=1.0, seed=3,
                tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = srv.client.chat.completions.create(**body)
    (call,) = check_calls(whole, [TIME])
    assert call.function.name == "get_time"
    pieces = {}
    for chunk in srv.client.chat.completions.create(**body, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = pieces.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert pieces == {0: {"name": "get_time", "arguments": call.function.arguments}}


def test_a_thinking_reply_streams_its_thought_channel_as_reasoning(srv):
    """Thinking on (<|think|> in the system turn): a reply that opens its thought channel returns
    its text as reasoning, without the channel's markers, streamed as whole. A forced call (its
    grammar starts after the think end) leaves the tiny model few first tokens, <|channel> one."""
    model = srv.client.models.list().data[0].id
    thought = 0
    for seed in (1, 2, 3, 4):
        body = dict(model=model, messages=ASK, max_tokens=30, temperature=1.0, seed=seed, reasoning_effort="high",
                    tools=TOOLS, tool_choice="required")
        message = srv.client.chat.completions.create(**body).choices[0].message
        reasoning = (message.model_extra or {}).get("reasoning_content") or ""
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in srv.client.chat.completions.create(**body, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            for key in streamed if delta is not None else ():
                streamed[key] += (delta.model_extra or {}).get(key) or getattr(delta, key, None) or ""
        assert streamed == {"reasoning_content": reasoning, "content": message.content or ""}
        assert not any(m in reasoning + (message.content or "") for m in ("<|channel>", "<channel|>", "<turn|>"))
        thought += bool(reasoning)
    assert thought
