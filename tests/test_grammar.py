"""The grammar constraint against fresh xgrammar matchers: its masks are functions of the path.

GrammarConstraint keeps one matcher and moves it along whatever path it is asked about (forward
for a drafted run, back after a rejection); the oracle is a fresh xgrammar matcher fed the same
path. Also: drafts cut at the first token the grammar rejects, the start after a think marker,
the end token only once the value is complete, the whitespace cap and default number bounds of JSON
grammars (json_bounds.py: 16 digits, the schema's own range ruling), the compile
cache and its error messages. The tokenizer is SmolLM2's (the default model's).
"""
import random

import pytest
import torch
import xgrammar as xgr

from tensorfold.grammar.compiler import GrammarCompileError, GrammarCompiler
from tensorfold.grammar.constraint import GrammarConstraint
from tensorfold.grammar.json_bounds import bound_schema
from tensorfold.grammar.spec import MAX_WHITESPACE, GrammarSpec
from tensorfold.models.loader import load_checkpoint
from tensorfold.models.tokenizer import Tokenizer
from tensorfold.sampling import bitmask as bits
from tensorfold.sampling.constraint import ConstraintError, RowConstraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_checkpoint(load_checkpoint(None))


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, tok.vocab_size)


def mask_of(constraint, path, vocab):
    row = bits.full(1, vocab)
    constraint.fill_mask(path, row, 0)
    return row[0]


def fresh_mask(compiled, path, vocab):
    matcher = xgr.GrammarMatcher(compiled)
    for t in path:
        assert matcher.accept_token(t)
    row = bits.full(1, vocab)
    matcher.fill_next_token_bitmask(row, 0)
    return row[0]


def allowed(row, token):
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def test_masks_follow_any_path_forward_and_back(tok, compiler):
    compiled, _ = compiler.compile(GrammarSpec.json_schema(SCHEMA, "t"))
    vocab = tok.vocab_size
    path = tok.encode('{"a": 123, "b": "yz"}', add_special_tokens=False)
    constraint = GrammarConstraint(compiled, tok.eos_token_ids)
    rng = random.Random(0)
    # prefixes in a shuffled order: the matcher rolls back and forward between them
    for n in rng.sample(range(len(path) + 1), len(path) + 1) + [3, 2, len(path), 0]:
        assert torch.equal(mask_of(constraint, path[:n], vocab), fresh_mask(compiled, path[:n], vocab)), n
    end = mask_of(constraint, path, vocab)
    assert allowed(end, tok.eos_token_ids[0])  # complete: the end token is allowed ...
    assert not allowed(mask_of(constraint, path[:-1], vocab), tok.eos_token_ids[0])  # ... only then


def test_after_the_end_token_only_end_tokens(tok, compiler):
    compiled, _ = compiler.compile(GrammarSpec("regex", "ab", "t"))
    path = tok.encode("ab", add_special_tokens=False) + [tok.eos_token_ids[0]]
    row = mask_of(GrammarConstraint(compiled, tok.eos_token_ids), path + [tok.eos_token_ids[0]], tok.vocab_size)
    assert [t for t in range(tok.vocab_size) if allowed(row, t)] == sorted(tok.eos_token_ids)


def test_drafts_are_cut_at_the_first_rejected_token(tok, compiler):
    compiled, _ = compiler.compile(GrammarSpec.choice(["hello world", "help"], "t"))
    good = tok.encode("hello world", add_special_tokens=False)
    constraint = GrammarConstraint(compiled, tok.eos_token_ids)
    assert constraint.num_valid_drafts([], good + [tok.eos_token_ids[0]], tok.vocab_size) == len(good) + 1
    bad = good[:1] + tok.encode(" there", add_special_tokens=False)
    assert constraint.num_valid_drafts([], bad, tok.vocab_size) == 1
    assert constraint.num_valid_drafts(good[:1], bad[1:], tok.vocab_size) == 0
    # the matcher is where the path says, whatever the drafts did
    assert torch.equal(mask_of(constraint, good[:1], tok.vocab_size), fresh_mask(compiled, good[:1], tok.vocab_size))
    # the generic check of RowConstraint gives the same cut through fill_mask
    assert RowConstraint.num_valid_drafts(constraint, [], bad, tok.vocab_size) == 1


def test_grammar_starts_after_a_think_block(tok, compiler):
    compiled, _ = compiler.compile(GrammarSpec("regex", "[0-9]+", "t"))
    # two tokens stand in for <think> and </think> (SmolLM2 has none)
    think = (tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>"))
    words = tok.encode("Let me think", add_special_tokens=False)
    digits = tok.encode("42", add_special_tokens=False)
    vocab = tok.vocab_size
    # the prompt opened the block: free until the close, the grammar after it
    opened = GrammarConstraint(compiled, tok.eos_token_ids, think, thinking=True)
    assert bool((mask_of(opened, words, vocab) == bits.ALL).all())
    assert torch.equal(mask_of(opened, words + [think[1]] + digits, vocab), fresh_mask(compiled, digits, vocab))
    assert opened.num_valid_drafts(words, [think[1]] + digits + words, vocab) == 1 + len(digits)
    # the prompt did not: the first token may open a block, else the grammar governs at once
    maybe = GrammarConstraint(compiled, tok.eos_token_ids, think)
    first = mask_of(maybe, [], vocab)
    assert allowed(first, think[0]) and not allowed(first, think[1])
    assert torch.equal(first & ~bits.pack(torch.arange(vocab)[None] == think[0])[0], fresh_mask(compiled, [], vocab))
    assert bool((mask_of(maybe, [think[0]] + words, vocab) == bits.ALL).all())
    assert torch.equal(mask_of(maybe, digits, vocab), fresh_mask(compiled, digits, vocab))
    assert maybe.num_valid_drafts([], [think[0]] + words + [think[1]] + digits, vocab) == 2 + len(words) + len(digits)
    assert maybe.num_valid_drafts([], words, vocab) == 0


def test_a_path_the_grammar_rejects_is_a_constraint_error(tok, compiler):
    compiled, _ = compiler.compile(GrammarSpec("regex", "[0-9]+", "t"))
    with pytest.raises(ConstraintError):
        mask_of(GrammarConstraint(compiled, tok.eos_token_ids), tok.encode("abc", add_special_tokens=False),
                tok.vocab_size)


def test_json_allows_at_most_the_whitespace_cap(tok, compiler):
    compiled, _ = compiler.compile(GrammarSpec("json_object", "", "t"))
    space = tok.token_to_id("Ġ")  # one blank
    brace = tok.encode("{", add_special_tokens=False)
    constraint = GrammarConstraint(compiled, tok.eos_token_ids)
    assert allowed(mask_of(constraint, brace + [space] * (MAX_WHITESPACE - 1), tok.vocab_size), space)
    assert not allowed(mask_of(constraint, brace + [space] * MAX_WHITESPACE, tok.vocab_size), space)


def test_compile_cache_and_errors(tok):
    compiler = GrammarCompiler(tok, tok.vocab_size)
    spec = GrammarSpec.json_schema(SCHEMA, "t")
    first, seconds = compiler.compile(spec)
    assert seconds > 0 and compiler.cached(spec) is first
    again, seconds = compiler.compile_async(GrammarSpec.json_schema(SCHEMA, "other field")).result()
    assert again is first and seconds == 0.0  # the key is (kind, text), not the field
    with pytest.raises(GrammarCompileError, match=r"^EBNF parser error at line 1"):
        compiler.compile(GrammarSpec("ebnf", 'root ::= "a" | ', "t"))
    with pytest.raises(GrammarCompileError, match="nonsense"):
        compiler.compile(GrammarSpec("json_schema", '{"type": "nonsense"}', "t"))


def test_choice_literals_are_escaped():
    spec = GrammarSpec.choice(['say "hi"', "back\\slash", "tab\tnew\nline"], "t")
    assert spec.choice_ebnf() == 'root ::= "say \\"hi\\"" | "back\\\\slash" | "tab\\tnew\\nline"'


def matches(tok, compiler, schema, text) -> bool:
    """Whether a fresh matcher of the schema's grammar takes the whole text and then the end token."""
    spec = GrammarSpec("json_object", "", "t") if schema is None else GrammarSpec.json_schema(schema, "t")
    matcher = xgr.GrammarMatcher(compiler.compile(spec)[0])
    return (all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
            and matcher.accept_token(tok.eos_token_ids[0]))


def test_an_unbounded_integer_has_at_most_16_digits(tok, compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert matches(tok, compiler, schema, '{"n": 1234567890123456}')
    assert matches(tok, compiler, schema, '{"n": -9999999999999999}')
    assert not matches(tok, compiler, schema, '{"n": 12345678901234567}')
    assert not matches(tok, compiler, schema, '{"n": -12345678901234567}')
    assert not matches(tok, compiler, schema, '{"n": 01}')
    assert matches(tok, compiler, {"type": "integer"}, "0")


def test_an_unbounded_number_has_bounded_parts(tok, compiler):
    schema = {"type": "array", "items": {"type": "number"}}
    assert matches(tok, compiler, schema, "[1234567890123456.1234567890123456, -0.5e-308, 7E+100, 3]")
    assert not matches(tok, compiler, schema, "[12345678901234567]")        # 17 integer digits
    assert not matches(tok, compiler, schema, "[0.12345678901234567]")      # 17 fraction digits
    assert not matches(tok, compiler, schema, "[1e1234]")                   # 4 exponent digits
    # json_object and untyped values take the same bounds
    assert matches(tok, compiler, None, '{"a": [1234567890123456, 0.5]}')
    assert not matches(tok, compiler, None, '{"a": 12345678901234567}')
    assert not matches(tok, compiler, {"type": "object"}, '{"a": {"b": 0.12345678901234567}}')


def test_a_schemas_own_limits_rule(tok, compiler):
    wide = {"type": "integer", "minimum": 0, "maximum": 10 ** 18}
    assert matches(tok, compiler, wide, str(10 ** 18))                       # 19 digits: its own range
    assert not matches(tok, compiler, wide, str(10 ** 18 + 1))
    small = {"type": "integer", "minimum": 0, "maximum": 100}
    assert matches(tok, compiler, small, "100") and not matches(tok, compiler, small, "101")
    at_least = {"type": "integer", "minimum": 0}                            # one side: the other is the default
    assert matches(tok, compiler, at_least, "9999999999999999")
    assert not matches(tok, compiler, at_least, "10000000000000000")
    assert not matches(tok, compiler, at_least, "-1")
    above = {"type": "integer", "exclusiveMinimum": 10 ** 17}               # its side beyond the default: kept
    assert matches(tok, compiler, above, str(10 ** 17 + 5))
    assert not matches(tok, compiler, above, str(10 ** 17))
    at_most = {"type": "number", "exclusiveMaximum": 0}
    assert matches(tok, compiler, at_most, "-1.5") and not matches(tok, compiler, at_most, "0")
    assert not matches(tok, compiler, at_most, "-12345678901234567")


def test_bound_schema_closes_only_one_sided_ranges():
    schema = {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 1},
        "b": {"type": ["number", "null"], "maximum": 5},
        "c": {"type": "integer", "minimum": 1, "maximum": 2},
        "d": {"anyOf": [{"type": "integer", "exclusiveMaximum": 0}, {"type": "string"}]},
        "e": {"type": "array", "items": {"$ref": "#/$defs/X"}}},
        "$defs": {"X": {"type": "integer", "minimum": 0}}}
    out = bound_schema(schema)
    props = out["properties"]
    assert props["a"] == {"type": "integer", "minimum": 1, "maximum": 10 ** 16 - 1}
    assert props["b"] == {"type": ["number", "null"], "maximum": 5, "minimum": -1e16}
    assert props["c"] == schema["properties"]["c"]
    assert props["d"]["anyOf"][0] == {"type": "integer", "exclusiveMaximum": 0, "minimum": -(10 ** 16 - 1)}
    assert out["$defs"]["X"]["maximum"] == 10 ** 16 - 1
    assert schema["properties"]["a"] == {"type": "integer", "minimum": 1}  # the request's own schema untouched
