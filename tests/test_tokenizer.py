"""Tokenizer wrapper and incremental detokenizer, on tokenizers trained here (no downloads).

Three decoder families: byte-level BPE (GPT-2 / SmolLM2 / Qwen), Metaspace SentencePiece BPE, and
Llama-2 style SentencePiece with byte fallback (Replace, ByteFallback, Fuse, Strip). The oracle is
the wrapped tokenizer's own full decode of the same ids.
"""
import functools
import json

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import (AddedToken, SentencePieceBPETokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)
from tokenizers import Tokenizer as HFTokenizer

from tensorfold.models.checkpoint import Checkpoint
from tensorfold.models.tokenizer import Tokenizer

FFFD = "\ufffd"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world! The café served crème brûlée; naïve façade, Ærøskøbing, Ångström.",
    "日本語のテキストです。中文字符和标点符号。한국어 문장도 있습니다.",
    "emoji 😀😀 🎉 👍🏽 👨‍👩‍👧 🇫🇷 ❤️ and more 🚀🚀🚀",
    "def f(x):\n    return x  *  2\n\n\tif (a && b) { return [1, 2, 3]; }\n",
    "    indented\t\ttabs   and    runs of     spaces\n\n\n  trailing  ",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
]
EXOTIC = list("😀🎉👍🏽🚀❤️日本語中文한국어éüßøÆ€𝔘\u200d\u0301 \n\tabc{}()ア")
TEXT = st.one_of(st.text(max_size=40), st.text(alphabet=st.sampled_from(EXOTIC), max_size=40))


@functools.cache
def byte_level() -> Tokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIALS)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_tokens([AddedToken("<tool_call>", special=False)])
    return Tokenizer(tok, bos_token_id=None, eos_token_ids=(tok.token_to_id("<|im_end|>"),))


@functools.cache
def metaspace() -> Tokenizer:
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS * 4, vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    tok = sp._tokenizer
    return Tokenizer(tok, bos_token_id=tok.token_to_id("<s>"), eos_token_ids=(tok.token_to_id("</s>"),))


@functools.cache
def byte_fallback() -> Tokenizer:
    """Llama-2 layout: <unk> <s> </s>, then <0x00>..<0xFF>, then a BPE vocabulary that lacks most
    non-ASCII characters, so they spell out as byte tokens."""
    base = HFTokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    base.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=300, limit_alphabet=60))
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                 fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<unk>", "<s>", "</s>"]])
    return Tokenizer(tok, bos_token_id=1, eos_token_ids=(2,), add_bos_token=True)


FAMILIES = {"byte_level": byte_level, "metaspace": metaspace, "byte_fallback": byte_fallback}


@functools.cache
def partial_ids(name: str) -> list[int]:
    """Ids whose lone decode is a broken character: the pieces of multi-byte characters."""
    tok = FAMILIES[name]()
    return [i for i in range(tok.vocab_size) if FFFD in tok.decode([i])]


def stream(tok: Tokenizer, ids, prompt_ids=()) -> tuple[list[str], str, str]:
    detok = tok.detokenizer(prompt_ids)
    pieces = [detok.push(i) for i in ids]
    tail = detok.flush()
    return pieces, tail, detok.text


def check_stream(tok: Tokenizer, ids: list[int]) -> str:
    """The invariants against the full decode; returns the streamed text."""
    pieces, tail, text = stream(tok, ids)
    full = tok.decode(ids)
    assert "".join(pieces) + tail == full
    assert text == full
    offset = 0
    for k, piece in enumerate(pieces):
        # Final: each piece is the full decode at its place, so it adds no U+FFFD of its own.
        assert full[offset:offset + len(piece)] == piece
        offset += len(piece)
        # Live: once the text so far cannot change, all of it is out.
        so_far = tok.decode(ids[:k + 1])
        settled = not so_far.endswith(FFFD) and not (
            tok.byte_fallback and tok.id_to_token(ids[k]).startswith("<0x"))
        if settled:
            assert "".join(pieces[:k + 1]) == so_far, (k, pieces)
    return text


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=120, deadline=None)
@given(text=TEXT)
def test_stream_of_text_equals_full_decode(name, text):
    tok = FAMILIES[name]()
    ids = tok.encode(text, add_special_tokens=False)
    streamed = check_stream(tok, ids)
    if name == "byte_level":
        assert streamed == text  # byte-level BPE round-trips any text
    if FFFD not in text:
        assert FFFD not in streamed


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_of_random_ids_equals_full_decode(name, data):
    tok = FAMILIES[name]()
    any_id = st.integers(0, tok.vocab_size - 1)
    # Biased toward character pieces so invalid and interrupted UTF-8 sequences are common.
    pieces = st.sampled_from(partial_ids(name)) if partial_ids(name) else any_id
    ids = data.draw(st.lists(st.one_of(any_id, pieces), max_size=30))
    check_stream(tok, ids)


def test_multibyte_characters_wait_for_their_last_byte():
    tok = byte_level()
    ids = tok.encode("a🦊🐙€b", add_special_tokens=False)  # characters the corpus lacks
    assert any(FFFD in tok.decode([i]) for i in ids)  # some token holds only part of a character
    pieces, tail, _ = stream(tok, ids)
    assert pieces[0] == "a" and tail == ""
    assert [p for p in pieces if p] == ["a", "🦊", "🐙", "€", "b"]  # one character at a time
    # A reply cut inside a character shows the replacement character once, at the end.
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD))
    pieces, tail, text = stream(tok, ids[:cut])
    assert not any(FFFD in p for p in pieces) and tail.endswith(FFFD) and text == tok.decode(ids[:cut])


@pytest.mark.parametrize("name", ["metaspace", "byte_fallback"])
def test_sentencepiece_keeps_spaces_a_lone_decode_drops(name):
    tok = FAMILIES[name]()
    ids = tok.encode("return the world", add_special_tokens=False)
    assert all(tok.decode([i]) == tok.decode([i]).lstrip(" ") for i in ids)  # lone decodes lose it
    pieces, tail, text = stream(tok, ids)
    assert text == "return the world" and " " in "".join(pieces[1:])


@pytest.mark.parametrize("name", ["metaspace", "byte_fallback"])
@settings(max_examples=80, deadline=None)
@given(text=TEXT, cut=st.integers(1, 40))
def test_prompt_context_gives_the_text_the_reply_adds(name, text, cut):
    tok = FAMILIES[name]()
    ids = tok.encode(text, add_special_tokens=False)
    prompt, reply = ids[:min(cut, len(ids))], ids[min(cut, len(ids)):]
    pieces, tail, _ = stream(tok, reply, prompt)
    prompt_text, full = tok.decode(prompt), tok.decode(ids)
    if prompt and full.startswith(prompt_text) and not prompt_text.endswith(FFFD) and \
            not tok.id_to_token(prompt[-1]).startswith("<0x"):
        assert "".join(pieces) + tail == full[len(prompt_text):]


def test_prompt_context_keeps_the_reply_leading_space():
    tok = metaspace()
    ids = tok.encode("Hello world", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tok.id_to_token(ids[k]).startswith("▁"))
    assert tok.decode(ids[cut:]) == "world"
    assert stream(tok, ids[cut:], ids[:cut])[2] == " world"
    assert stream(tok, ids[cut:])[2] == "world"  # standing alone it is decode(reply_ids)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_byte_level_prompt_context_changes_nothing(data):
    tok = byte_level()
    any_id = st.integers(0, tok.vocab_size - 1)
    id_list = st.lists(st.one_of(any_id, st.sampled_from(partial_ids("byte_level"))), max_size=12)
    prompt, reply = data.draw(id_list), data.draw(id_list)  # prompts may end inside a character
    assert stream(tok, reply, prompt)[2] == tok.decode(reply)


def test_special_tokens_stream_as_text():
    tok = byte_level()
    ids = tok.encode("hi 😀<|im_end|>", add_special_tokens=False)
    assert ids[-1] == tok.token_to_id("<|im_end|>")
    pieces, _, text = stream(tok, ids)
    assert pieces[-1] == "<|im_end|>" and text == "hi 😀<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "hi 😀"


def test_window_stays_short():
    tok = byte_level()
    sizes = []
    decode = tok.decode
    spy = Tokenizer(tok.hf_tokenizer, bos_token_id=None, eos_token_ids=())
    spy.decode = lambda ids, **kw: sizes.append(len(ids)) or decode(ids, **kw)
    ids = tok.encode(" ".join(CORPUS) * 12, add_special_tokens=False)
    assert len(ids) > 1000
    detok = spy.detokenizer(ids[:50])
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == decode(ids)
    assert max(sizes) <= 8  # the longest character here is four byte tokens


def test_push_after_flush_is_an_error():
    detok = byte_level().detokenizer()
    assert detok.push(byte_level().token_to_id("#")) == "#"
    assert detok.push(partial_ids("byte_level")[0]) == ""
    assert detok.flush() == FFFD
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.push(5)


def test_encode_turns_special_strings_into_ids():
    tok = byte_level()
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<tool_call>")
    start, end, call = (tok.token_to_id(s) for s in ("<|im_start|>", "<|im_end|>", "<tool_call>"))
    assert ids[0] == start and end in ids and ids[-1] == call
    assert ids.count(start) == 1 and tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<tool_call>"
    assert tok.id_to_token(start) == "<|im_start|>" and tok.token_to_id("<|no such|>") is None


def test_encode_adds_bos_once():
    tok = byte_fallback()  # add_bos_token, no post-processor
    assert tok.encode("hi")[0] == 1 and tok.encode("hi")[1] != 1
    assert tok.encode("hi", add_special_tokens=False)[0] != 1
    assert tok.encode("") == [1]
    hf = HFTokenizer.from_str(tok.hf_tokenizer.to_str())
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    both = Tokenizer(hf, bos_token_id=1, eos_token_ids=(2,), add_bos_token=True)
    assert both.encode("hi") == tok.encode("hi")  # post-processor's bos, not a second one
    assert Tokenizer(hf, bos_token_id=1, eos_token_ids=(2,)).encode("hi") == tok.encode("hi")


def test_vocab_size_counts_added_tokens():
    tok = byte_level()
    assert tok.vocab_size == tok.hf_tokenizer.get_vocab_size(with_added_tokens=True)
    assert tok.id_to_token(tok.vocab_size - 1) == "<tool_call>"
    assert tok.id_to_token(tok.vocab_size) is None
    assert not tok.byte_fallback and byte_fallback().byte_fallback and not metaspace().byte_fallback


def checkpoint(tokenizer_config, generation_config, config=None) -> Checkpoint:
    return Checkpoint(path="dummy", config=config or {"architectures": ["Qwen2ForCausalLM"]}, tensors={},
                      tokenizer=byte_level().hf_tokenizer, tokenizer_config=tokenizer_config,
                      generation_config=generation_config)


def test_from_checkpoint_eos_ids_are_the_union_in_order():
    eot, start, end = (byte_level().token_to_id(s) for s in SPECIALS)
    tok = Tokenizer.from_checkpoint(checkpoint(
        {"bos_token": None, "eos_token": "<|im_end|>"}, {"eos_token_id": [end, eot], "bos_token_id": eot}))
    assert tok.eos_token_ids == (end, eot) and tok.bos_token_id == eot and not tok.add_bos_token
    tok = Tokenizer.from_checkpoint(checkpoint(
        {"eos_token": {"__type": "AddedToken", "content": "<|im_end|>"}, "bos_token": "<|im_start|>",
         "add_bos_token": True}, {"eos_token_id": eot}))
    assert tok.eos_token_ids == (eot, end) and tok.bos_token_id == start and tok.add_bos_token
    assert tok.encode("x")[0] == start
    # No generation_config: config.json's eos_token_id stands in, as in Hugging Face.
    tok = Tokenizer.from_checkpoint(checkpoint(
        {}, {}, {"architectures": ["Qwen2ForCausalLM"], "eos_token_id": start}))
    assert tok.eos_token_ids == (start,) and tok.bos_token_id is None
