"""The tokenizer the engine sees, and the incremental detokenizer that streams reply text.

`Tokenizer` wraps a `tokenizers.Tokenizer` with the ids the engine needs: the bos id, the set of
end-of-sequence ids, the vocabulary size. Special-token strings written in a prompt
(`<|im_start|>`) become their ids, as Hugging Face does for rendered chat templates, and decoding
keeps special tokens as text unless asked otherwise (the server shows end tokens under ignore_eos).

`IncrementalDetokenizer` turns reply token ids into text pieces as they arrive. Invariants:

1. Exact: with no prompt context, the pieces from `push` joined with `flush()` equal
   `Tokenizer.decode(reply_ids)`, character for character. With prompt context they equal the
   text the reply adds after the prompt (see `IncrementalDetokenizer`).
2. Final: a piece is never revised, so no piece carries a U+FFFD or a broken UTF-8 sequence that the
   full decode does not have at that place. A character spread over several tokens (byte-level
   BPE, SentencePiece byte fallback) is held back until its last byte arrives.
3. Live: text is held back only while it may still change: while the decode ends in U+FFFD (an
   incomplete character), while the newest token is a byte-fallback `<0xNN>` token, or while the
   newest tokens add no text yet.
4. O(1) per token: each push decodes a window holding only the last emitted chunk and the tokens
   not yet emitted, never the whole reply.
"""
import json
from collections.abc import Iterable, Sequence

import tokenizers

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the reply's first window; one would do for the leading-space
# rule, a few leave room to trim back to a character boundary.
NUM_PROMPT_CONTEXT = 4


def _token_content(value) -> str | None:
    # tokenizer_config.json writes a special token either as a string or as an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _decoder_types(node) -> set[str]:
    """Every decoder type named in a serialised decoder (Sequence nests its children)."""
    if isinstance(node, dict):
        return {node.get("type")} | set().union(*map(_decoder_types, node.values()))
    if isinstance(node, list):
        return set().union(*map(_decoder_types, node))
    return set()


def _has_byte_fallback(tok: tokenizers.Tokenizer) -> bool:
    if tok.decoder is None:
        return False
    return "ByteFallback" in _decoder_types(json.loads(tok.decoder.__getstate__()))


def _is_byte_token(token: str | None) -> bool:
    # The ByteFallback decoder's own test: exactly "<0xNN>" with NN hexadecimal.
    if token is None or len(token) != 6 or not token.startswith("<0x") or not token.endswith(">"):
        return False
    try:
        int(token[3:5], 16)
    except ValueError:
        return False
    return True


class Tokenizer:
    """Wraps tokenizers.Tokenizer with the ids the engine needs."""

    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], add_bos_token: bool = False):
        self.hf_tokenizer = tok  # the wrapped tokenizers.Tokenizer (grammar compilers need it)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        # One past the largest id the tokenizer knows, added tokens included, so a mask of this
        # size covers every id even when added tokens leave holes.
        added_ids = tok.get_added_tokens_decoder().keys()
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(added_ids, default=-1) + 1)
        # Byte-fallback tokens decode as one run, so the run's text is final only once it ends.
        self.byte_fallback = _has_byte_fallback(tok)

    @classmethod
    def from_checkpoint(cls, ckpt) -> "Tokenizer":
        """eos ids: generation_config's (else config.json's), then tokenizer_config's eos_token."""
        tok = ckpt.tokenizer
        tc = ckpt.tokenizer_config
        gen = ckpt.generation_config
        eos_ids = _as_ids(gen.get("eos_token_id"))
        if not eos_ids:
            eos_ids = _as_ids(ckpt.config.get("eos_token_id"))
        eos_text = _token_content(tc.get("eos_token"))
        eos_id = tok.token_to_id(eos_text) if eos_text is not None else None
        if eos_id is not None:
            eos_ids.append(eos_id)
        bos_text = _token_content(tc.get("bos_token"))
        bos_token_id = tok.token_to_id(bos_text) if bos_text is not None else None
        if bos_token_id is None and isinstance(gen.get("bos_token_id"), int):
            bos_token_id = gen["bos_token_id"]
        return cls(tok, bos_token_id=bos_token_id, eos_token_ids=tuple(dict.fromkeys(eos_ids)),
                   add_bos_token=bool(tc.get("add_bos_token", False)))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids.

        add_special_tokens runs the tokenizer's post-processor and, with add_bos_token, puts bos in
        front unless the post-processor already did (never two bos).
        """
        ids = self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and ids[:1] != [self.bos_token_id]):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self.hf_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.hf_tokenizer.id_to_token(int(i))

    def token_to_id(self, s: str) -> int | None:
        return self.hf_tokenizer.token_to_id(s)

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """Streams the text of one reply, token by token (invariants in the module docstring).

    prompt_ids: give them when the reply continues the prompt's text (completions); leave them out
    when the reply stands alone (a chat message). Decoders that drop the leading space of a
    decode's first token (SentencePiece's "▁Paris") keep it when a prompt comes first, so with
    prompt_ids the pieces equal decode(tail + reply_ids) less decode(tail), where tail is the last
    few prompt tokens cut back to a character boundary. For byte-level BPE that is decode(reply_ids).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        context = [int(i) for i in list(prompt_ids)[-NUM_PROMPT_CONTEXT:]]
        # A prompt that ends inside a character gives no context: the reply then decodes alone.
        while context and self._held(context, tokenizer.decode(context)):
            context.pop()
        # Design: window[:num_prefix] is text already out (or prompt context) and decodes to
        # prefix_text; window[num_prefix:] is pending. A push decodes the whole window and, once the
        # result is final, emits what it adds to prefix_text; the emitted chunk then becomes the next
        # prefix. Decoding the prefix with the new tokens (not the new tokens alone) keeps the
        # leading spaces and multi-token characters that a lone decode would lose.
        self._window = context
        self._num_prefix = len(context)
        self._prefix_text = tokenizer.decode(context)
        self._pieces: list[str] = []
        self._text = ""
        self._num_joined = 0
        self._finished = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if self._num_joined != len(self._pieces):
            self._text = "".join(self._pieces)
            self._num_joined = len(self._pieces)
        return self._text

    def _held(self, window: list[int], text: str) -> bool:
        """Whether the window's text may still change as more tokens arrive."""
        if text.endswith(REPLACEMENT_CHAR):
            return True  # an incomplete UTF-8 sequence decodes to U+FFFD until it completes
        return self._tokenizer.byte_fallback and _is_byte_token(self._tokenizer.id_to_token(window[-1]))

    def push(self, token_id: int) -> str:
        """Adds one reply token; returns the text it made final ("" while that text may change)."""
        if self._finished:
            raise RuntimeError("push after flush: the reply has ended")
        self._window.append(int(token_id))
        text = self._tokenizer.decode(self._window)
        if (len(text) <= len(self._prefix_text) or not text.startswith(self._prefix_text)
                or self._held(self._window, text)):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Ends the reply; returns the text still held back (an incomplete character decodes to U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        if self._num_prefix == len(self._window):
            return ""
        return self._emit(self._tokenizer.decode(self._window))

    def _emit(self, text: str) -> str:
        piece = text[len(self._prefix_text):]
        self._pieces.append(piece)
        del self._window[:self._num_prefix]
        self._num_prefix = len(self._window)
        self._prefix_text = self._tokenizer.decode(self._window)
        return piece
