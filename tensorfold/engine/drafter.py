"""Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence of the
sequence's last n-gram (n from max_ngram down to 1), taken from the prompt and the reply so far.

How many of a proposal's tokens run is the draft budget's choice (engine/draft_budget.py).
Drafting never changes the reply, only how many rounds it takes: the engine accepts a draft only
where it equals the keyed draw.
"""
from dataclasses import dataclass, field


@dataclass
class DraftState:
    # n-gram -> start of its latest occurrence that has a following token; covers every n-gram
    # ending before position num_indexed. Grows with the sequence: O(new tokens) per round.
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0


class PromptLookupDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, tokens: list[int], state: DraftState, limit: int) -> list[int]:
        """Up to `limit` tokens: the continuation of the latest earlier occurrence of the longest
        matching tail n-gram."""
        self._index(tokens, state)
        if limit <= 0:
            return []
        n_tokens = len(tokens)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            start = state.latest.get(tuple(tokens[n_tokens - n:]))
            if start is not None:
                return tokens[start + n:start + n + limit]
        return []

    def _index(self, tokens: list[int], state: DraftState) -> None:
        # An n-gram ending at `end` (exclusive) has a follower once end < len(tokens); later
        # occurrences overwrite earlier ones, so each entry is the latest.
        for end in range(max(state.num_indexed, 1), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                state.latest[tuple(tokens[end - n:end])] = end - n
        state.num_indexed = max(state.num_indexed, len(tokens))
