"""Prompt-lookup drafting: the incremental n-gram index proposes exactly what a full backward
scan of the sequence finds (the latest earlier occurrence of the longest matching tail); the
draft budget picks the depth with the best expected tokens per second of round."""
import random

import pytest

from tensorfold.engine.draft_budget import (DECAY, MIN_ROUNDS, PROBE_FIRST, PROBE_MAX, Acceptance, DraftBudget,
                                            RowCost)
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


def by_position(*ps: float) -> Acceptance:
    """A record whose draft i has settled at acceptance ps[i] (given the ones before it held)."""
    a = acceptance(sum(ps) / len(ps))
    a.by_position = [[1000 * p, 1000 * (1 - p)] for p in ps]
    return a


def test_the_first_drafts_cost_counts_where_it_is_paid():
    """A drafter that makes its drafts with a model pays a catch-up pass for the first one (more
    after a long pause) and a step for each further one: drafts run only where they still pay."""
    budget = measured({1: 0.010, 8: 0.017})  # a verify row costs a tenth of a round
    a = acceptance(0.9)
    assert budget.depth(a, 1, 1, 3) == 3
    assert budget.depth(a, 1, 1, 3, draft_step_seconds=0.008, first_draft_seconds=0.002) == 1
    assert budget.depth(a, 1, 1, 3, draft_step_seconds=0.008, first_draft_seconds=0.02) == 0
    budget.observe_drafting(2, 0.010)  # a pass over two requests: 5 ms each
    budget.observe_drafting(2, 0.004)  # the fastest recent one counts
    assert budget.drafting_seconds(2) == 0.002 and budget.drafting_seconds(1) == 0.004  # else any count's


def test_acceptance_by_position_picks_the_depth_that_holds():
    """Draft 1 always right, draft 2 never: one draft a round, not three."""
    budget = measured({1: 0.010, 8: 0.024})
    assert budget.depth(by_position(1.0, 0.0, 0.0), 1, 1, 3) == 1
    assert budget.depth(by_position(1.0, 1.0, 1.0), 1, 1, 3) == 3
    a = Acceptance()
    a.record(3, 1)  # draft 1 held, draft 2 missed, draft 3 never verified
    assert [round(c, 6) for c in a.by_position[0]] == [1.0, 0.0] and a.by_position[1] == [0.0, 1.0]
    assert len(a.by_position) == 2 and a.p_at(2) == a.p


def test_a_miss_that_replays_rows_costs_them():
    """On a model that rewinds to a block boundary, a rejected draft makes the next round compute
    the kept rows past the boundary again: deep in a block, drafts at even odds do not pay."""
    budget = measured({1: 0.010, 8: 0.017})
    a = acceptance(0.6)
    assert budget.depth(a, 1, 1, 3) > 0
    assert budget.depth(a, 1, 1, 3, replay=(31, 32)) > 0   # a miss at the boundary replays nothing
    assert budget.depth(a, 1, 1, 3, replay=(20, 32)) == 0  # 21+ rows again after a miss


def test_probes_back_off_and_new_requests_start_from_the_record():
    budget = DraftBudget(max_depth=3, shared_prior=True)
    assert budget.acceptance().p == 0.5
    waits = []
    for _ in range(8):
        rounds = 1
        while not budget.probe_due():
            rounds += 1
        waits.append(rounds)
        budget.probed()
        a = budget.acceptance()
        a.watch([5], probing=True)
        budget.appended(a, [6])  # the probe's draft missed
    assert waits == [min(PROBE_FIRST * 2 ** i, PROBE_MAX) for i in range(8)] and waits[-1] == PROBE_MAX
    assert budget.acceptance().p < 0.2  # eight misses: a new request starts expecting none
    a = budget.acceptance()
    a.watch([5], probing=True)
    budget.appended(a, [5])  # a hit raises the request's p; the wait stands until drafts run again
    assert budget.probe_interval == PROBE_MAX and a.p > budget.history.p - 1e-9
    budget.record(a, 2, 0)
    assert budget.idle_rounds == 0 and budget.probe_interval == PROBE_MAX
    budget.record(a, 2, 1)  # accepted drafts ran: probe soon once they stop
    assert budget.probe_interval == PROBE_FIRST
