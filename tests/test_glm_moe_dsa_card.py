"""The glm_moe_dsa model card and tools/templates/glm_moe_dsa.jinja, the GLM-5.x template of the tiny
glm_moe_dsa checkpoints: the card is chosen for GlmMoeDsaForCausalLM where the template writes GLM's
<arg_key> calls; the template renders the family's format as transformers' apply_chat_template does;
the spec's GLM behaviours: efforts low and high (High), thinking off = no effort line and an empty think
block; a reply in its format parses into reasoning and typed calls, whole and streamed, and the next
turn extends this turn's prompt and reply; the forced-call grammar takes the template's own call after
the think end. Over HTTP on a tiny glm_moe_dsa checkpoint with the family's tokens and template:
forced calls (required, a named function) streamed as whole, a JSON grammar after a thinking budget's
close, and the stop rule (decoding goes on past a stop match; the text ends at it)."""
import json

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from card_cases import ASK, WEATHER, FamilyTemplate, assistant_turn, check_forced_calls, chunks_of, parse as parse_with
from tensorfold.chat.cards import EFFORTS, load_cards, select_card
from tensorfold.engine.engine import EngineConfig
from tensorfold.grammar.compiler import GrammarCompiler
from tensorfold.grammar.constraint import GrammarConstraint
from tensorfold.grammar.tool_call import tool_call_spec
from tensorfold.models.tokenizer import Tokenizer
from tensorfold.server import ServeSettings
from serving import serving
from tools.tiny_checkpoint import GLM_FAMILY_TOKENS, family_tokenizer, make_tiny_checkpoint

FAMILY = FamilyTemplate("glm_moe_dsa", "GlmMoeDsaForCausalLM", GLM_FAMILY_TOKENS + ["<|endoftext|>"], "<|endoftext|>")
TEMPLATE, render, transformers_render, prompt_of = (FAMILY.text, FAMILY.render, FAMILY.transformers_render,
                                                    FAMILY.prompt_of)
CARD = load_cards()["glm_moe_dsa"]
CONVERSATION = [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "\nNeed the tool.\n",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "12 °C, rain"},
    {"role": "tool", "tool_call_id": "c1", "content": "wind"},
    {"role": "assistant", "content": "Rainy, 12 °C.", "reasoning_content": "Summarise."},
    {"role": "user", "content": "Thanks!"},
]


def test_the_card_is_chosen_for_glm_templates():
    card = select_card("GlmMoeDsaForCausalLM", TEMPLATE)
    assert card is CARD or card.name == "glm_moe_dsa"
    assert (card.think.open, card.think.close, card.tool_format) == ("<think>", "</think>", "glm_xml")
    assert (card.tool_call.open, card.tool_call.close, card.tool_call.name_prefix) == ("<tool_call>", "</tool_call>", "")
    assert card.decode_past_stop and card.end_tokens == ("<|user|>", "<|observation|>", "<|endoftext|>")
    assert select_card("GlmMoeDsaForCausalLM", "{{ messages }}") is None  # no GLM calls in it: no card
    assert not load_cards()["nemotron_h"].decode_past_stop


def test_a_conversation_renders_in_the_family_format():
    prompt = render(CONVERSATION, tools=[WEATHER])
    head, rest = prompt.rsplit("</tools>", 1)
    assert head.startswith("[gMASK]<sop><|system|>\n# Tools\n\n") and json.dumps(WEATHER, ensure_ascii=False) in head
    assert rest == ("\n\nFor each function call, output the function name and arguments within the following XML "
                    "format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
                    "</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
                    "<|system|>Be brief. <|user|>Weather in Zürich?"  # texts as written
                    "<|assistant|><think></think>"  # the history's thinking dropped
                    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value>"
                    "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
                    "<|observation|><tool_response>12 °C, rain</tool_response><tool_response>wind</tool_response>"
                    "<|assistant|><think></think>Rainy, 12 °C.<|user|>Thanks!<|assistant|><think>")
    # mid tool loop, the turns after the last user message keep their reasoning
    mid = render(CONVERSATION[:-1])
    assert "<|assistant|><think>Need the tool.</think><tool_call>get_weather" in mid
    assert mid.endswith("<|assistant|><think>Summarise.</think>Rainy, 12 °C.<|assistant|><think>")


ORACLE_CASES = [
    ("conversation_tools", CONVERSATION, [WEATHER], {}),
    ("thinking_off", CONVERSATION, None, {"enable_thinking": False}),
    ("effort_high", CONVERSATION[:2], [WEATHER], {"reasoning_effort": "high"}),
    ("effort_thinking_off", CONVERSATION[:2], None, {"reasoning_effort": "low", "enable_thinking": False}),
    ("mid_tool_loop", CONVERSATION[:-1], [WEATHER], {}),
    ("inline_think", [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>x</think>A"},
                      {"role": "tool", "tool_call_id": "c", "content": "r"}], None, {}),
]


@pytest.mark.parametrize("name,messages,tools,kwargs", ORACLE_CASES, ids=[c[0] for c in ORACLE_CASES])
def test_matches_transformers_apply_chat_template(name, messages, tools, kwargs):
    assert render(messages, tools, **kwargs) == transformers_render(messages, tools, **kwargs)


def test_efforts_low_and_high_and_thinking_off():
    ask = {"messages": [{"role": "user", "content": "Hi"}]}
    prompts = {effort: prompt_of({**ask, "reasoning_effort": effort}) for effort in EFFORTS}
    low, high = ("[gMASK]<sop><|system|>Reasoning Effort: " + name + "<|user|>Hi<|assistant|><think>"
                 for name in ("Low", "High"))
    assert prompts["low"] == prompts["minimal"] == low
    assert prompts["high"] == prompts["xhigh"] == high  # high is the template's own name: not mapped to xhigh
    assert prompts["medium"] == prompt_of(ask) == "[gMASK]<sop><|user|>Hi<|assistant|><think>"  # no line
    # thinking off: no effort line and an empty think block, however it was asked for
    off = "[gMASK]<sop><|user|>Hi<|assistant|><think></think>"
    assert prompts["none"] == off
    assert prompt_of({**ask, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}) == off
    assert prompt_of({**ask, "chat_template_kwargs": {"reasoning_effort": "high"}}) == high


REPLY = ("The user wants Paris weather.</think>Let me check."
         "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
         "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>false</arg_value>"
         "<arg_key>hours</arg_key><arg_value>[9, 21]</arg_value></tool_call>")


def parse(text, chunks=None, tools=(WEATHER,), thinking=True):
    return parse_with(CARD, text, chunks, tools, thinking)


@pytest.mark.parametrize("size", [0, 1, 3, 7])
def test_a_reply_parses_into_reasoning_content_and_typed_calls_whole_and_streamed(size):
    assert parse(REPLY, chunks_of(REPLY, size)) == ("The user wants Paris weather.", "Let me check.",
                                    [("get_weather", {"city": "Paris", "days": 3, "metric": False,
                                                      "hours": [9, 21]})])
    # a string parameter keeps its text (a number-looking city stays a string); a call with no
    # arguments; blanks between pairs (GLM-4.5's newlines) are allowed
    two = ("</think><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> 42 </arg_value>\n</tool_call>"
           "<tool_call>get_weather</tool_call>")
    assert parse(two, chunks_of(two, size)) == ("", "", [("get_weather", {"city": " 42 "}), ("get_weather", {})])


def test_malformed_or_unoffered_calls_stay_content_and_an_unclosed_think_call_is_the_reply():
    for bad in ("<tool_call>get_time<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>",
                "<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>",
                "<tool_call>get_weather<arg_value>Paris</arg_value></tool_call>",
                "<tool_call>get_weather<arg_key>city</arg_key><arg_value>P</arg_value> and </tool_call>"):
        assert parse(bad, thinking=False) == ("", bad, [])
    # a call inside a think block that never closes is the reply's call; one that closes after stays reasoning
    assert parse("hm <tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>") == \
        ("hm ", "", [("get_weather", {"city": "Oslo"})])
    assert parse("hm <tool_call>get_weather</tool_call> no</think>ok") == \
        ("hm <tool_call>get_weather</tool_call> no", "ok", [])


def test_the_next_turn_extends_this_turns_prompt_and_reply():
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    prompt = prompt_of(body)
    assistant = assistant_turn(parse(REPLY))
    follow = {**body, "messages": body["messages"] + [assistant, {"role": "tool", "tool_call_id": "c0",
                                                                  "content": "sun"}]}
    assert prompt_of(follow) == prompt + REPLY + "<|observation|><tool_response>sun</tool_response><|assistant|><think>"


# ---- the grammar of a forced call, on the family tokenizer ------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, smollm2_tokenizer):
    folder = tmp_path_factory.mktemp("glm_tokenizer")
    family_tokenizer("glm_moe_dsa", smollm2_tokenizer, family=True).save_pretrained(str(folder))
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    return Tokenizer(tok, bos_token_id=None,
                     eos_token_ids=tuple(tok.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")))


def test_the_forced_call_grammar_takes_the_template_call_after_the_think_end(tokenizer):
    forecast = {"type": "function", "function": {"name": "get_forecast", "parameters": {
        "type": "object", "properties": {"days": {"type": "integer"}, "city": {"type": "string"}}}}}
    tools = [WEATHER, forecast]
    compiled, _ = GrammarCompiler(tokenizer, tokenizer.vocab_size).compile(tool_call_spec(CARD, tools))
    think = (tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>"))
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_forecast", "arguments": {"days": 3, "city": "Oslo"}}}]}
    rendered = render([{"role": "user", "content": "Q"}, call, {"role": "tool", "tool_call_id": "c", "content": "r"}])
    text = rendered[rendered.index("<tool_call>"):rendered.index("<|observation|>")]
    assert text == "<tool_call>get_forecast<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>city</arg_key>" \
                   "<arg_value>Oslo</arg_value></tool_call>"
    thought = tokenizer.encode("hm, <tool_call> x</think>", add_special_tokens=False)
    reply = thought + tokenizer.encode(text, add_special_tokens=False) + [tokenizer.token_to_id("<|user|>")]
    constraint = GrammarConstraint(compiled, tokenizer.eos_token_ids, think, thinking=True)
    words = (tokenizer.vocab_size + 31) // 32
    for n in range(len(reply)):  # each reply token is allowed after the ones before it
        mask = torch.full((1, words), -1, dtype=torch.int32)
        constraint.fill_mask(reply[:n], mask, 0)
        assert mask[0, reply[n] // 32].item() >> (reply[n] % 32) & 1, (n, tokenizer.decode(reply[:n + 1]))
    # right after the think end only the opener; an unoffered tool, keys out of order, a key twice are refused
    mask = torch.full((1, words), -1, dtype=torch.int32)
    constraint.fill_mask(thought, mask, 0)
    allowed = {t for t in range(tokenizer.vocab_size) if mask[0, t // 32].item() >> (t % 32) & 1}
    assert tokenizer.token_to_id("<tool_call>") in allowed and tokenizer.token_to_id("<think>") not in allowed
    assert all(tokenizer.decode([t]) == "<" for t in allowed - {tokenizer.token_to_id("<tool_call>")})
    for wrong in ("<tool_call>get_time", "<tool_call>get_forecast<arg_key>city</arg_key><arg_value>x</arg_value>"
                  "<arg_key>days", "<tool_call>get_forecast<arg_key>days</arg_key><arg_value>1</arg_value><arg_key>days"):
        ids = tokenizer.encode(wrong, add_special_tokens=False)
        assert constraint.num_valid_drafts(thought, ids, tokenizer.vocab_size) < len(ids), wrong


# ---- over HTTP on a tiny glm_moe_dsa checkpoint ----------------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory, smollm2_tokenizer):
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("glm_card")), "glm_moe_dsa", tokenizer=smollm2_tokenizer,
                                family=True)
    with serving(ServeSettings(model=path, port=0, engine=EngineConfig(max_num_seqs=2, kv_cache_gib=0.05,
                                                                       probe=False))) as s:
        yield s


def test_the_served_card_and_end_tokens(srv):
    assert srv.server.service.served.card.name == "glm_moe_dsa"
    tok = srv.engine.tokenizer
    assert {tok.token_to_id(t) for t in CARD.end_tokens} <= set(tok.eos_token_ids)


def test_forced_calls_over_http_stream_as_whole(srv):
    """A forced call comes with no content beside it."""
    check_forced_calls(srv.client, max_tokens=40, no_content=True)


def test_a_json_grammar_starts_after_a_thinking_budgets_close(srv):
    """Thinking on: the budget closes the think block at its 3rd token, then the reply is JSON of the
    schema (or cut at the limit); drafted == serial."""
    model = srv.client.models.list().data[0].id
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    done = 0
    for seed in (1, 2, 3):
        body = dict(model=model, messages=ASK, max_tokens=40, temperature=1.0, seed=seed, reasoning_effort="high",
                    response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                    extra_body={"thinking_budget": 3})
        reply = srv.client.chat.completions.create(**body)
        message = reply.choices[0].message
        assert (message.model_extra or {}).get("reasoning_content") and "</think>" not in (message.content or "")
        serial = srv.client.chat.completions.create(**{**body, "extra_body": {"thinking_budget": 3, "draft": False}})
        assert serial.model_extra["tensorfold"]["token_sha"] == reply.model_extra["tensorfold"]["token_sha"]
        if reply.choices[0].finish_reason == "length":
            continue
        jsonschema.validate(json.loads(message.content), schema)
        done += 1
    assert done >= 1


def test_decoding_goes_on_past_a_stop_match_and_the_text_ends_at_it(srv):
    """GLM's stop rule: the reply with a stop string decodes the same tokens as the one without
    (token_sha, usage: on to the end token or the limit), and its text is the other's cut at the
    first match; finish_reason stop; streamed as whole; completions and chat alike."""
    model = srv.client.models.list().data[0].id
    plain = srv.client.completions.create(model=model, prompt="The weather in Paris is", max_tokens=24,
                                          temperature=0)
    text = plain.choices[0].text
    stop = text[len(text) // 3:len(text) // 3 + 3]
    assert stop.strip() and text.find(stop) + len(stop) < len(text)  # text follows the match
    cut = srv.client.completions.create(model=model, prompt="The weather in Paris is", max_tokens=24,
                                        temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.model_extra["tensorfold"]["token_sha"] == plain.model_extra["tensorfold"]["token_sha"]
    assert cut.usage.completion_tokens == plain.usage.completion_tokens
    pieces, last = [], None
    for chunk in srv.client.completions.create(model=model, prompt="The weather in Paris is", max_tokens=24,
                                               temperature=0, stop=[stop], stream=True):
        pieces += [c.text for c in chunk.choices]
        last = chunk
    assert "".join(pieces) == cut.choices[0].text
    assert last.model_extra["tensorfold"]["token_sha"] == plain.model_extra["tensorfold"]["token_sha"]

    body = dict(model=model, messages=ASK, max_tokens=24, temperature=0, reasoning_effort="none")
    chat = srv.client.chat.completions.create(**body)
    content = chat.choices[0].message.content
    stop = content[len(content) // 2:len(content) // 2 + 2]
    cut = srv.client.chat.completions.create(**body, stop=stop)
    assert cut.choices[0].message.content == content[:content.find(stop)]
    assert cut.model_extra["tensorfold"]["token_sha"] == chat.model_extra["tensorfold"]["token_sha"]
    assert cut.choices[0].finish_reason == "stop"
