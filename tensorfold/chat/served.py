"""ServedModel: the model as the API serves it, fixed at startup: its tokenizer, chat template
and model card, the defaults a request falls back on, and the card's think markers as tokens.

The wiring (tensorfold/server.py) builds it once with served_model() from the checkpoint's
metadata (architecture, chat template, tokenizer_config, generation_config) and the tokenizer,
so the routes read one frozen record and never the engine's checkpoint. Invariants: the
template is the card's when the card brings one, else the checkpoint's, else None (no chat
route); think_ids is set only when both think markers are single tokens, and
think_close_sequence only with it.
"""
import logging
from dataclasses import dataclass
from typing import Any

from tensorfold.chat.cards import ModelCard, select_card
from tensorfold.chat.template import ChatTemplate
from tensorfold.sampling.params import SamplingParams

log = logging.getLogger("tensorfold.chat")


@dataclass(frozen=True)
class ServedModel:
    tokenizer: Any                          # tensorfold's Tokenizer: encode, decode, token_to_id, vocab_size
    template: ChatTemplate | None
    card: ModelCard | None
    sampling: SamplingParams = SamplingParams()  # generation_config's temperature, top_p, top_k, min_p
    reasoning_effort: str | None = None     # of requests that set none: the server's flag, else the card's
    thinking_budget: int = 0                # thinking tokens of requests that set none; 0: none
    think_ids: tuple[int, int] | None = None        # (open, close) markers, when each is one token
    think_close_sequence: tuple[int, ...] | None = None  # what a thinking budget writes at its cut

    @property
    def card_name(self) -> str | None:
        return self.card.name if self.card is not None else None

    def opens_think(self, prompt: str) -> bool:
        """Whether the rendered prompt ends inside a think block (the reply starts thinking)."""
        think = self.card.think if self.card is not None else None
        if think is None:
            return False
        at = prompt.rfind(think.open)
        rest = prompt[at + len(think.open):].strip()
        return at >= 0 and (not rest or rest == think.label.strip())

    def reasoning_tokens(self, output_ids: list[int]) -> int:
        """The reply tokens through the think block's close marker (all of them if it never
        closed), for a reply that opened a think block."""
        if self.think_ids is not None:
            close_id = self.think_ids[1]
            return output_ids.index(close_id) + 1 if close_id in output_ids else len(output_ids)
        close, decode = self.card.think.close, self.tokenizer.decode
        lo, hi = 1, len(output_ids)
        if close not in decode(output_ids):
            return hi
        while lo < hi:  # the shortest prefix whose text holds the close marker
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if close in decode(output_ids[:mid]) else (mid + 1, hi)
        return lo


def served_model(architecture: str, chat_template: str | None, tokenizer_config: dict, generation_config: dict,
                 tokenizer, *, model_card: str | None = None, reasoning_effort: str | None = None,
                 thinking_budget: int = 0) -> ServedModel:
    """The served model of a checkpoint; model_card names a card (CardError if none has that
    name), else one is chosen from the architecture and template (see chat/cards.py)."""
    card = select_card(architecture, chat_template, model_card)
    log.info("model card: %s", card.name if card else "none (no think markers, no tools)")
    source = card.template if card is not None and card.template else chat_template
    template = ChatTemplate(source, bos_token=tokenizer_config.get("bos_token") or "",
                            eos_token=tokenizer_config.get("eos_token") or "") if source else None
    think = card.think if card is not None else None
    ids = (tokenizer.token_to_id(think.open), tokenizer.token_to_id(think.close)) if think else (None, None)
    think_ids = ids if None not in ids else None
    # a newline, the close marker, a blank line
    close_sequence = tuple(tokenizer.encode("\n" + think.close + "\n\n", add_special_tokens=False)) \
        if think_ids else None
    return ServedModel(tokenizer, template, card, _sampling_defaults(generation_config),
                       reasoning_effort or (card.default_effort if card else None), thinking_budget,
                       think_ids, close_sequence)


def _sampling_defaults(gen: dict) -> SamplingParams:
    """What a request that sets no sampling field gets: the checkpoint's generation_config."""
    return SamplingParams(temperature=float(gen.get("temperature", 1.0)) if gen.get("do_sample", True) else 0.0,
                          top_p=float(gen.get("top_p", 1.0)), top_k=int(gen.get("top_k", 0) or 0),
                          min_p=float(gen.get("min_p", 0.0) or 0.0))
