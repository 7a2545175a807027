"""Structured output end to end: the default model behind the real server, the official openai
client over a loopback socket, jsonschema / re.fullmatch / membership as the oracles.

The default model (SmolLM2-135M-Instruct, bf16) writes the values; the grammar decides what it
may write, so every finished reply must validate whatever the seed. Exactness: a constrained
reply's token_sha is the same drafted and not, solo and among other requests. Errors: each 400
comes before any token and leaves a concurrent request's reply unchanged; a grammar that fails
while decoding (injected) ends only its own request, with a 500 or an error event. The SDKs' parse()
helpers return parsed objects on the default model, its numbers within the default bounds.
"""
import enum
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from serving import check_error, post, serving
from tensorfold.api import grammar_pipeline as grammar_module
from tensorfold.engine.engine import EngineConfig
from tensorfold.grammar.constraint import GrammarConstraint
from tensorfold.grammar.spec import MAX_WHITESPACE
from tensorfold.sampling.constraint import ConstraintError
from tensorfold.server import ServeSettings

MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "maxLength": 10},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                           "price": {"type": "number", "minimum": 0, "maximum": 1000}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "paid": {"type": "boolean"},
        "note": {"type": ["string", "null"], "maxLength": 16},
    },
    "required": ["id", "items", "paid"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER}
# (temperature, seed): greedy, then sampled with several seeds
DRAWS = [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)]


@pytest.fixture(scope="module")
def srv():
    with serving(ServeSettings(port=0, engine=EngineConfig(dtype="bfloat16", max_num_seqs=4, kv_cache_gib=0.25))) as s:
        yield s


def chat(s, content, *, max_tokens=160, **kwargs):
    return s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                            max_tokens=max_tokens, **kwargs)


def sha(reply) -> str:
    return reply.model_extra["tensorfold"]["token_sha"]


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("temperature,seed", DRAWS)
def test_json_schema_replies_validate(srv, name, temperature, seed):
    schema = SCHEMAS[name]
    r = chat(srv, f"Write one {name} record as JSON.", temperature=temperature, seed=seed,
             response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)
    assert "grammar_compile_ms" in r.model_extra["tensorfold"]


def test_vllm_spellings_regex_choice_grammar_json(srv):
    for temperature, seed in DRAWS[:3]:
        r = chat(srv, "Give a ticket code.", temperature=temperature, seed=seed,
                 extra_body={"guided_regex": r"[A-Z]{3}-\d{2,4}"})
        assert re.fullmatch(r"[A-Z]{3}-\d{2,4}", r.choices[0].message.content), r.choices[0].message.content
        r = chat(srv, "Which colour is the sky?", temperature=temperature, seed=seed,
                 extra_body={"guided_choice": ["red", "sky blue", "grey \"ish\""]})
        assert r.choices[0].message.content in ("red", "sky blue", "grey \"ish\"")
        r = chat(srv, "Answer.", temperature=temperature, seed=seed,
                 extra_body={"guided_grammar": 'root ::= ("yes" | "no") ", " [0-9] [0-9]?'})
        assert re.fullmatch(r"(yes|no), [0-9]{1,2}", r.choices[0].message.content), r.choices[0].message.content
        r = chat(srv, "A person.", temperature=temperature, seed=seed, extra_body={"guided_json": json.dumps(PERSON)})
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_structured_outputs_field_and_json_object(srv):
    r = chat(srv, "Pick.", extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].message.content in ("alpha", "beta")
    r = chat(srv, "Code?", extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", r.choices[0].message.content)
    r = chat(srv, "A person.", extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    for temperature, seed in DRAWS:
        r = chat(srv, "Describe a book as a JSON object.", temperature=temperature, seed=seed, max_tokens=200,
                 response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # a long object cut by max_tokens is returned as is
            assert r.choices[0].finish_reason == "length"
        assert not re.search(r"\s{%d}" % (MAX_WHITESPACE + 1), r.choices[0].message.content)


def test_completions_take_a_grammar_too(srv):
    r = srv.client.completions.create(model=MODEL, prompt="The answer is", max_tokens=20,
                                      extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


def test_streamed_reply_equals_the_whole_one(srv):
    kwargs = dict(temperature=1.0, seed=7, response_format={"type": "json_schema",
                                                            "json_schema": {"name": "p", "schema": PERSON}})
    whole = chat(srv, "A person.", **kwargs)
    chunks = list(chat(srv, "A person.", stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].model_extra["tensorfold"]["token_sha"] == sha(whole)


def test_a_compile_that_waits_off_thread_then_streams(srv, monkeypatch):
    monkeypatch.setattr(grammar_module, "QUICK_COMPILE_S", 0.0)
    for i, stream in enumerate((False, True)):
        regex = f"(ab|cd){{1,{3 + i}}}"  # uncached: compiled on the worker thread while the request waits
        r = chat(srv, "Go.", stream=stream, extra_body={"guided_regex": regex})
        text = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else r.choices[0].message.content
        assert re.fullmatch(regex, text), text


def test_constrained_replies_equal_drafted_or_not_solo_or_batched(srv):
    bodies = [dict(content="A person.", temperature=t, seed=s,
                   response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
              for t, s in DRAWS]
    bodies += [dict(content="Order record.", temperature=0.8, seed=11,
                    response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER}}),
               dict(content="Phone.", temperature=0.0, extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})]
    solo = [sha(chat(srv, **b)) for b in bodies]
    undrafted = [sha(chat(srv, **{**b, "extra_body": {**b.get("extra_body", {}), "draft": False}})) for b in bodies]
    assert undrafted == solo
    with ThreadPoolExecutor(len(bodies)) as pool:
        batched = list(pool.map(lambda b: sha(chat(srv, **b)), bodies))
    assert batched == solo
    assert srv.health()["drafted_total"] > 0


def test_a_reply_cut_by_max_tokens_is_length(srv):
    r = chat(srv, "A long order.", max_tokens=6,
             response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


BAD = [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format"),                                                       # xgrammar cannot compile it
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": 'root ::= "a" | '}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice[1]"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),        # two at once
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " *", "regex": "a"}}, "structured_outputs.whitespace_pattern"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_regex": "a+", "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("quick", [grammar_module.QUICK_COMPILE_S, 0.0])
def test_every_bad_field_is_400_before_any_token_and_others_go_on(srv, monkeypatch, quick):
    """quick = 0: every compile waits on the worker thread (the held-stream path)."""
    monkeypatch.setattr(grammar_module, "QUICK_COMPILE_S", quick)
    body = dict(content="A person.", temperature=1.0, seed=5,
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    want = sha(chat(srv, **body))
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("sha", sha(chat(srv, **body))))
    runner.start()
    for fields, param in BAD:
        for stream in (False, True):
            r = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                   "stream": stream, **fields})
            check_error(r, 400, param)
    runner.join()
    assert result["sha"] == want
    err = check_error(post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "guided_grammar": "root ::= "}), 400, "guided_grammar")
    assert "could not be compiled" in err["message"] and "EBNF" in err["message"]


class Failing(GrammarConstraint):
    """A grammar whose matcher gives out after two reply tokens (an injected fault)."""

    def fill_mask(self, reply_ids, bitmask, row):
        if len(reply_ids) >= 2:
            raise ConstraintError("injected grammar failure")
        super().fill_mask(reply_ids, bitmask, row)


def test_a_grammar_failing_while_decoding_ends_only_its_request(srv, monkeypatch):
    failing_regex = "[a-z ]+"
    real = grammar_module.GrammarPipeline.constraint

    def constraint(self, prepared, compiled):
        made = real(self, prepared, compiled)
        if prepared.greq.grammar.text == failing_regex:
            made.__class__ = Failing
        return made

    monkeypatch.setattr(grammar_module.GrammarPipeline, "constraint", constraint)
    body = dict(content="A person.", temperature=1.0, seed=9,
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    want = sha(chat(srv, **body))
    failing = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "guided_regex": failing_regex,
               "max_tokens": 30}
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: sha(chat(srv, **body)))
        check_error(post(srv, "/v1/chat/completions", failing), 500, None, type_="server_error")
        r = post(srv, "/v1/chat/completions", {**failing, "stream": True})
        assert r.status_code == 200
        events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"error"' in events[-2] and "injected" in events[-2]
        assert other.result() == want
    assert sha(chat(srv, **body)) == want


class Kind(str, enum.Enum):
    city = "city"
    town = "town"
    village = "village"


class Place(BaseModel):
    """The SDK helpers' model: unbounded int and float (the JSON grammars' default bounds end them);
    the list states its own maxItems: without it the default model repeats items until max_tokens
    (greedy: "Eiffel Tower" forever; seeds 2 and 3 likewise), which no default bound should cut."""
    name: str
    kind: Kind
    population: int
    area_km2: float
    landmarks: list[str] = Field(max_length=3)


PLACE_PROMPT = "Describe Paris as JSON: its name, kind, population, area in km2 and three landmarks."
# the default bounds as a schema (json_bounds.py): the oracle for what the helpers' grammar let through
PLACE_BOUNDED = {**to_strict_json_schema(Place)}
PLACE_BOUNDED["properties"] = {**PLACE_BOUNDED["properties"],
                               "population": {"type": "integer", "minimum": -(10 ** 16 - 1), "maximum": 10 ** 16 - 1}}
NUMBER_TEXT = re.compile(r'"(?:population|area_km2)"\s*:\s*(-?)(\d+)(?:\.(\d+))?(?:[eE][+-]?(\d+))?')


@pytest.mark.parametrize("temperature,seed", DRAWS)
def test_the_sdk_parse_helpers_return_parsed_objects(srv, temperature, seed):
    """client.chat.completions.parse(response_format=Place) and client.responses.parse(text_format=Place)."""
    r = srv.client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": PLACE_PROMPT}],
                                          response_format=Place, max_tokens=200, temperature=temperature, seed=seed)
    place = r.choices[0].message.parsed
    assert r.choices[0].finish_reason == "stop" and isinstance(place, Place)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PLACE_BOUNDED)
    for sign, whole, fraction, exponent in NUMBER_TEXT.findall(text):
        assert len(whole) <= 16 and len(fraction) <= 16 and len(exponent) <= 3
    extra = {"seed": seed} if seed is not None else None
    resp = srv.client.responses.parse(model=MODEL, input=PLACE_PROMPT, text_format=Place, max_output_tokens=200,
                                      temperature=temperature, extra_body=extra)
    assert resp.status == "completed" and isinstance(resp.output_parsed, Place)
    assert resp.output_parsed == place  # the same prompt, sampling and grammar: the same object
