"""Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence of the
sequence's last n-gram (n from max_ngram down to 1), taken from the prompt and the reply so far.

Depth adapts per request: it grows after a fully accepted run and shrinks after a rejection, so
a reply that drafts badly soon costs almost nothing. Drafting never changes the reply, only how
many rounds it takes: the engine accepts a draft only where it equals the keyed draw.
"""
from dataclasses import dataclass


@dataclass
class DraftState:
    depth: int = 4


class PromptLookupDrafter:
    def __init__(self, max_depth: int = 7, max_ngram: int = 3, min_ngram: int = 1):
        # 7 drafts + 1 real row = 8 rows, what one row costs on the padded GEMM path.
        self.max_depth = max_depth
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, tokens: list[int], state: DraftState, limit: int) -> list[int]:
        depth = min(state.depth, limit)
        if depth <= 0:
            return []
        n_tokens = len(tokens)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            tail = tokens[n_tokens - n:]
            # Latest earlier occurrence whose continuation exists.
            for start in range(n_tokens - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + depth]
                    if follow:
                        return follow
        return []

    def update(self, state: DraftState, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        if num_accepted == num_drafted:
            state.depth = min(self.max_depth, state.depth + 2)
        else:
            state.depth = max(1, num_accepted + 1) if num_accepted else max(1, state.depth // 2)
