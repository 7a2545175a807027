"""Prompt-lookup drafting: the incremental n-gram index proposes exactly what a full backward
scan of the sequence finds (the latest earlier occurrence of the longest matching tail); the
draft budget picks the depth with the best expected tokens per second of round."""
import random

import pytest

from tensorfold.engine.draft_budget import DECAY, MIN_ROUNDS, Acceptance, DraftBudget, RowCost
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
        state, tokens = DraftState(), [rng.randrange(6) for _ in range(rng.randint(1, 5))]
        for _ in range(30):
            got = drafter.propose(tokens, state, limit=5)
            assert got == scan(tokens, 5), tokens
            proposals += bool(got)
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 3))]
    assert proposals > 1000  # the comparison covered real proposals, not just empty ones


def test_a_proposal_stops_at_the_limit():
    drafter, state = PromptLookupDrafter(), DraftState()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert drafter.propose(tokens, state, limit=2) == [3, 4]
    assert drafter.propose(tokens, state, limit=5) == [3, 4, 5, 6, 7]
    assert drafter.propose(tokens, state, limit=0) == []


# ---- the draft budget (engine/draft_budget.py) -------------------------------------------------


def measured(seconds_by_rows: dict[int, float]) -> DraftBudget:
    """A budget that has seen rounds of one sequence at these row counts."""
    budget = DraftBudget(max_depth=7)
    for rows, seconds in seconds_by_rows.items():
        for _ in range(MIN_ROUNDS):
            budget.cost.observe(1, rows, seconds)
    return budget


def acceptance(p: float) -> Acceptance:
    """A record whose acceptance has settled at p."""
    a = Acceptance()
    for _ in range(200):
        a.accepted, a.rejected = DECAY * a.accepted + p, DECAY * a.rejected + (1 - p)
    return a


def test_row_cost_is_the_fastest_round_of_each_size_read_linearly():
    cost = RowCost()
    assert cost.seconds(1, 4) is None
    for seconds in (0.012, 0.010, 0.011):
        cost.observe(1, 1, seconds)
    cost.observe(1, 8, 0.030)
    assert cost.seconds(1, 4) is None  # one round of 8 rows is not trusted yet
    for seconds in (0.024, 0.050):
        cost.observe(1, 8, seconds)
    assert cost.seconds(1, 1) == 0.010 and cost.seconds(1, 8) == 0.024
    assert abs(cost.seconds(1, 4) - (0.010 + 3 * 0.002)) < 1e-12     # between: interpolated
    assert abs(cost.seconds(1, 15) - (0.024 + 7 * 0.002)) < 1e-12    # past: the last slope
    for seconds in (0.05, 0.05, 0.05):  # rounds of four sequences are a table of their own
        cost.observe(4, 4, seconds)
    assert cost.seconds(4, 6) is None and cost.seconds(1, 4) == 0.016


@pytest.mark.parametrize("p, seconds_by_rows, expected", [
    (0.9, {1: 0.010, 8: 0.011}, 7),        # rows nearly free, drafts accepted: all of them
    (0.1, {1: 0.010, 8: 0.080}, 0),        # every row a full round's cost, drafts rejected: none
    (0.5, {1: 0.010, 8: 0.080}, 0),        # even at one in two: a row costs as much as it yields
    (0.9, {1: 0.010, 8: 0.045}, 3),        # accepted, each row half a round: a few
    (0.05, {1: 0.010, 8: 0.010}, 7),       # free rows: even weak proposals run whole
])
def test_depth_is_the_best_expected_tokens_per_second(p, seconds_by_rows, expected):
    assert measured(seconds_by_rows).depth(acceptance(p), sequences=1, rows=1, available=7) == expected


def test_until_row_costs_are_measured_every_proposal_runs_whole():
    budget = DraftBudget(max_depth=7)
    assert budget.depth(acceptance(0.01), 1, 1, available=5) == 5
    assert budget.depth(acceptance(0.99), 1, 1, available=12) == 7
    assert budget.depth(Acceptance(), 1, 1, available=0) == 0


def test_shadow_proposals_bring_drafting_back():
    """A request that stopped drafting still scores what it would have drafted against the
    tokens its reply takes; when its text turns repetitive, p climbs and drafts run again."""
    budget = measured({1: 0.010, 8: 0.040})
    a = acceptance(0.1)
    assert budget.depth(a, 1, 1, 7) == 0
    for _ in range(12):  # the reply now follows what the drafter proposes, 4 tokens at a time
        a.watch([5, 6, 7, 8])
        a.appended([5])
        a.watch([9, 9])  # ignored: one shadow at a time
        a.appended([6, 7, 8])
    assert a.p > 0.8 and budget.depth(a, 1, 1, 7) > 0
    a.watch([1, 2, 3])
    a.appended([1, 4])  # the second token differs: one accepted, one rejected
    assert a.shadow == []
