"""Prompt-lookup drafting: the incremental n-gram index proposes exactly what a full backward
scan of the sequence finds (the latest earlier occurrence of the longest matching tail)."""
import random

from tensorfold.engine.drafter import DraftState, PromptLookupDrafter


def scan(tokens, depth, max_ngram=3):
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        tail = tokens[n_tokens - n:]
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + depth]
    return []


def test_index_matches_a_full_scan_as_the_sequence_grows():
    rng = random.Random(0)
    drafter = PromptLookupDrafter()
    proposals = 0
    for _ in range(100):
        state, tokens = DraftState(depth=5), [rng.randrange(6) for _ in range(rng.randint(1, 5))]
        for _ in range(30):
            got = drafter.propose(tokens, state, limit=99)
            assert got == scan(tokens, 5), tokens
            proposals += bool(got)
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 3))]
    assert proposals > 1000  # the comparison covered real proposals, not just empty ones


def test_depth_follows_acceptance_and_the_limit():
    drafter, state = PromptLookupDrafter(max_depth=7), DraftState(depth=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert drafter.propose(tokens, state, limit=2) == [3, 4]
    drafter.update(state, num_drafted=4, num_accepted=4)
    assert state.depth == 6
    drafter.update(state, num_drafted=6, num_accepted=0)
    assert state.depth == 3
