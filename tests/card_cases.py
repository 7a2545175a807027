"""What the model-card tests of the families share (tests/test_*_card.py).

    FamilyTemplate   a family's template (tools/templates/NAME.jinja) over a word-level tokenizer of
                     its special tokens: rendered by transformers' apply_chat_template (the oracle)
                     and by ChatTemplate, and the prompt a chat request renders to as served
    parse            a reply in the card's format through ReplyParser, whole or in chunks:
                     (reasoning, content, [(name, arguments)])
    assistant_turn   the assistant message a parsed reply becomes in the next request
    check_forced_calls
                     over HTTP: tool_choice required and a named function, sampled at several seeds,
                     give calls of the one function asked for, streamed as whole
"""
import json
import os

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from tensorfold.api.prompt import Prompts
from tensorfold.api.request import ServerDefaults, parse_chat_request
from tensorfold.chat.reply_parser import ReplyParser
from tensorfold.chat.served import served_model
from tensorfold.chat.template import ChatTemplate
from tensorfold.models.tokenizer import Tokenizer

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "templates")
# the special tokens tools/tiny_checkpoint.py adds to SmolLM2's vocabulary for the ChatML families
CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]


def weather_tool(city_description: str | None = None) -> dict:
    city = {"type": "string", **({"description": city_description} if city_description else {})}
    return {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city, «now»",
        "parameters": {"type": "object", "properties": {"city": city, "days": {"type": "integer"},
                                                        "metric": {"type": "boolean"}, "hours": {"type": "array"}},
                       "required": ["city"]}}}


WEATHER = weather_tool()
# bounded values (a string value is any text up to a "<", which a random model need not write)
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "The forecast for some days",
    "parameters": {"type": "object", "properties": {"days": {"type": "integer"}, "metric": {"type": "boolean"}},
                   "required": ["days"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class FamilyTemplate:
    def __init__(self, name: str, architecture: str, specials: list[str], eos_token: str):
        with open(os.path.join(TEMPLATES, f"{name}.jinja"), encoding="utf-8") as f:
            self.text = f.read()
        self.architecture, self.specials, self.eos_token = architecture, specials, eos_token

    def hf_tokenizer(self) -> HFTokenizer:
        tok = HFTokenizer(WordLevel({"<unk>": 0, **{t: i + 1 for i, t in enumerate(self.specials)}},
                                    unk_token="<unk>"))
        tok.pre_tokenizer = Whitespace()
        tok.add_special_tokens(self.specials)
        return tok

    def transformers_render(self, messages, tools=None, **kwargs) -> str:
        """The oracle: transformers' apply_chat_template, as tools/tiny_checkpoint.py's tokenizers use it."""
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=self.hf_tokenizer(), unk_token="<unk>",
                                            eos_token=self.eos_token, chat_template=self.text)
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             **kwargs)

    def render(self, messages, tools=None, **kwargs) -> str:
        return ChatTemplate(self.text, eos_token=self.eos_token).render(messages, tools=tools, template_kwargs=kwargs)

    def serving(self, architecture: str | None = None, reasoning_effort: str | None = None):
        """The served model and the prompt builder of a tiny checkpoint of the family."""
        tok = self.hf_tokenizer()
        tokenizer = Tokenizer(tok, bos_token_id=None, eos_token_ids=(tok.token_to_id(self.eos_token),))
        served = served_model(architecture or self.architecture, self.text, {"eos_token": self.eos_token}, {},
                              tokenizer, reasoning_effort=reasoning_effort)
        return served, Prompts(served, None, ("tiny",), default_max_tokens=1)  # render() reads no engine info

    def prompt_of(self, body: dict, architecture: str | None = None, reasoning_effort: str | None = None) -> str:
        _, prompts = self.serving(architecture, reasoning_effort)
        greq = parse_chat_request({"model": "tiny", **body}, ServerDefaults())
        return prompts.render(greq, greq.tools.shown() if greq.tools is not None else None)


def chunks_of(text: str, size: int) -> list[str] | None:
    """text in pieces of `size` characters; None (whole) for size 0."""
    return [text[i:i + size] for i in range(0, len(text), size)] if size else None


def parse(card, text: str, chunks=None, tools=(WEATHER,), thinking: bool = True):
    parser = ReplyParser(card, list(tools), thinking=thinking)
    deltas = [parser.push(piece) for piece in chunks or [text]] + [parser.finish()]
    return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
            [(c.name, json.loads(c.arguments)) for d in deltas for c in d.tool_calls])


def assistant_turn(parsed) -> dict:
    reasoning, content, calls = parsed
    return {"role": "assistant", "content": content, "reasoning_content": reasoning,
            "tool_calls": [{"id": f"c{i}", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments)}}
                           for i, (name, arguments) in enumerate(calls)]}


def streamed_calls(client, body) -> dict:
    pieces = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = pieces.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    return pieces


def check_forced_calls(client, max_tokens: int, no_content: bool = False) -> None:
    """Thinking off. For tool_choice required (FORECAST alone) and the named function (beside WEATHER),
    sampled at seeds 1-6: a draw whose reply ran out of tokens before its call ended is skipped; the
    others call get_forecast with keys of its schema only (the XML call grammars fix the names, not
    the values' types), streamed as whole; at least two per choice."""
    model = client.models.list().data[0].id
    for choice in ("required", {"type": "function", "function": {"name": "get_forecast"}}):
        called = 0
        for seed in range(1, 7):
            tools = [FORECAST] if choice == "required" else [WEATHER, FORECAST]
            body = dict(model=model, messages=ASK, tools=tools, tool_choice=choice, max_tokens=max_tokens,
                        temperature=1.0, seed=seed, reasoning_effort="none")
            whole = client.chat.completions.create(**body)
            message = whole.choices[0].message
            if whole.choices[0].finish_reason == "length" and not message.tool_calls:
                continue
            assert whole.choices[0].finish_reason == "tool_calls", whole.choices[0]
            (call,) = message.tool_calls
            assert call.function.name == "get_forecast"
            assert not no_content or message.content is None, message.content
            assert set(json.loads(call.function.arguments)) <= {"days", "metric"}
            assert streamed_calls(client, body) == {0: {"name": "get_forecast", "arguments": call.function.arguments}}
            called += 1
        assert called >= 2, choice
