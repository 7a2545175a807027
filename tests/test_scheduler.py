"""Scheduler and BlockPool in plain Python: fake requests, a fake model, no tensors.

The fake model's token at absolute position p of a request is a fixed function of (request, p),
so a reply that is chunked, batched, preempted and replayed must come out identical to the same
request run alone, and every check row of a replay must see the token already sent there.
`Driver.round()` plays the engine's part (engine.py `_accept`): it feeds each plan to the fake
model, keeps drafts that equal the draw, appends the live draws and commits blocks to the cache.
"""
import random

import pytest

from tensorfold.engine.block_pool import BlockPool, chain_hash
from tensorfold.engine.request import Request, Status
from tensorfold.engine.scheduler import Scheduler, SchedulerConfig
from tensorfold.sampling.params import SamplingParams


def model_token(req: Request, position: int) -> int:
    """The fake model: the token a request holds at absolute position `position`."""
    return 1000 + (sum(map(ord, req.req_id)) * 131 + position * 7) % 5000


def make_request(req_id, num_prompt=None, max_tokens=8, priority=0, prompt_ids=None):
    prompt_ids = list(prompt_ids) if prompt_ids is not None else \
        [10 + (sum(map(ord, req_id)) + i * 3) % 900 for i in range(num_prompt)]
    return Request(req_id, prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   seed=0, eos_ids=frozenset(), priority=priority)


def expected_reply(req: Request) -> list[int]:
    n = req.num_prompt_tokens
    return [model_token(req, p) for p in range(n, n + req.max_tokens)]


class Driver:
    """The engine's half of the loop over a real Scheduler and BlockPool."""

    def __init__(self, num_blocks=64, block_size=4, max_cached_blocks=None, **config):
        self.pool = BlockPool(num_blocks, block_size, max_cached_blocks)
        self.sched = Scheduler(SchedulerConfig(**config), self.pool)
        self.reqs: dict[str, Request] = {}
        self.plans = []         # every plan, in order
        self.sent: dict[str, list[int]] = {}    # tokens handed to each client, in order
        self.checked: dict[str, list[int]] = {}  # positions whose draw was a replay check
        self.drafts: dict[str, int] = {}   # req_id -> how many drafts to propose each round
        self.bad_drafts: set[str] = set()  # these propose wrong tokens (all rejected)

    def add(self, req: Request, drafts: int = 0, bad: bool = False) -> Request:
        self.sched.add(req)
        self.reqs[req.req_id] = req
        self.sent[req.req_id], self.checked[req.req_id] = [], []
        self.drafts[req.req_id] = drafts
        if bad:
            self.bad_drafts.add(req.req_id)
        return req

    def round(self, elapsed_s: float = 0.0, prefill_s: float | None = None):
        """One round; it took prefill_s if it prefilled (when given), else elapsed_s."""
        for req in self.sched.running:   # the engine proposes before it schedules
            n = min(self.drafts[req.req_id], req.max_tokens - len(req.output_ids) - 1)
            nxt = req.num_tokens
            req.draft_ids = [model_token(req, nxt + i) + (1 if req.req_id in self.bad_drafts else 0)
                             for i in range(max(0, n))] if req.output_ids else []
        plan = self.sched.schedule()
        self.plans.append(plan)
        self._check_plan(plan)
        for s in plan.requests:
            req = self.reqs[s.req_id]
            assert s.start_position == req.num_computed_tokens
            num_real = len(s.token_ids) - s.num_drafts
            assert s.token_ids[:num_real] == [req.token_at(i) for i in range(s.start_position,
                                                                             s.start_position + num_real)]
            assert [r.position for r in s.rows] == list(range(
                s.start_position + len(s.token_ids) - len(s.rows) + 1, s.start_position + len(s.token_ids) + 1))
            draws = [model_token(req, r.position) for r in s.rows]
            checks = [r.position for r in s.rows if r.position < req.num_tokens]
            for p in checks:
                assert p >= req.num_prompt_tokens, "a check row inside the prompt"
                assert model_token(req, p) == req.token_at(p)
            self.checked[req.req_id] += checks
            live = draws[len(checks):]
            if not live:
                req.num_computed_tokens += len(s.token_ids)
                self.sched.commit(req)
                continue
            drafts = s.token_ids[num_real:]
            accepted = 0
            while accepted < len(drafts) and live[accepted] == drafts[accepted]:
                accepted += 1
            req.num_computed_tokens += num_real + accepted
            for token in live[:accepted + 1]:
                req.output_ids.append(token)
                self.sent[req.req_id].append(token)
                if len(req.output_ids) >= req.max_tokens:
                    break
            if len(req.output_ids) >= req.max_tokens:
                self.sched.finish(req)
            else:
                self.sched.commit(req)
        prefilled = any(s.rows_prefill for s in plan.requests)
        self.sched.round_done(plan, prefill_s if prefilled and prefill_s is not None else elapsed_s)
        self._check_invariants()
        return plan

    def run(self, max_rounds=10_000, elapsed_s=0.0):
        for _ in range(max_rounds):
            if not self.sched.has_work():
                return
            self.round(elapsed_s)
        raise AssertionError("the scheduler made no progress")

    def _check_plan(self, plan):
        ids = [s.req_id for s in plan.requests]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one round"
        assert len(ids) <= self.sched.config.max_num_seqs
        assert plan.num_tokens <= self.sched.config.max_tokens_per_step
        for s in plan.requests:
            req = self.reqs[s.req_id]
            assert req.status is Status.RUNNING and req in self.sched.running
            assert len(req.block_ids) >= self.pool.blocks_for(s.start_position + len(s.token_ids))

    def _check_invariants(self):
        refs = [0] * self.pool.num_blocks
        for req in self.sched.running:
            assert len(set(req.block_ids)) == len(req.block_ids)
            for b in req.block_ids:
                refs[b] += 1
        for req in self.sched.waiting:
            assert req.block_ids == [] and req.status is Status.WAITING
        assert refs == self.pool._refs, "pool ref counts differ from the blocks requests hold"
        assert self.pool.num_free == sum(1 for r in refs if r == 0)

    def shape(self, plan):
        """[(req_id, num fed, num rows, rows_prefill)] of a plan."""
        return [(s.req_id, len(s.token_ids), len(s.rows), s.rows_prefill) for s in plan.requests]


# ---- chunked prefill ----

def test_prompt_prefills_in_chunks_of_the_token_budget():
    d = Driver(max_tokens_per_step=32)
    a = d.add(make_request("a", 100, max_tokens=3))
    shapes = [d.shape(d.round()) for _ in range(6)]
    assert shapes[:4] == [[("a", 32, 0, True)], [("a", 32, 0, True)], [("a", 32, 0, True)],
                          [("a", 4, 1, True)]]
    assert [p.requests[0].start_position for p in d.plans[:4]] == [0, 32, 64, 96]
    assert d.plans[3].requests[0].rows[0].position == 100  # the draw of the first reply token
    assert shapes[4:] == [[("a", 1, 1, False)], [("a", 1, 1, False)]]
    assert a.status is Status.FINISHED and d.sent["a"] == expected_reply(a)
    assert d.pool.num_free == d.pool.num_blocks


def test_blocks_are_allocated_as_rows_need_them():
    d = Driver(num_blocks=64, block_size=4, max_tokens_per_step=8)
    a = d.add(make_request("a", 20, max_tokens=10))
    d.round()  # admission reserves nothing: only the chunk's rows get blocks
    assert len(a.block_ids) == 2 and d.pool.num_free == 62
    d.round()
    assert len(a.block_ids) == 4
    d.round()  # the last 4 prompt tokens
    assert len(a.block_ids) == 5 and a.num_computed_tokens == 20 and len(a.output_ids) == 1
    d.run()
    assert d.sent["a"] == expected_reply(a) and d.pool.num_free == 64


def test_prompts_share_the_budget_in_order_and_decode_rows_come_first_in_order():
    d = Driver(max_tokens_per_step=32)
    d.add(make_request("a", 20, max_tokens=4))
    d.add(make_request("b", 30, max_tokens=4))
    assert d.shape(d.round()) == [("a", 20, 1, True), ("b", 12, 0, True)]
    assert d.shape(d.round()) == [("a", 1, 1, False), ("b", 18, 1, True)]
    assert d.shape(d.round()) == [("a", 1, 1, False), ("b", 1, 1, False)]
    d.run()
    for r in d.reqs.values():
        assert d.sent[r.req_id] == expected_reply(r)


def test_lanes_cap_the_running_requests_and_the_rest_wait_in_order():
    d = Driver(max_num_seqs=2, max_tokens_per_step=64)
    for name in "abcd":
        d.add(make_request(name, 5, max_tokens=3))
    assert [s.req_id for s in d.round().requests] == ["a", "b"]
    assert [r.req_id for r in d.sched.waiting] == ["c", "d"]
    d.run()
    first_round = {name: next(i for i, p in enumerate(d.plans) if any(s.req_id == name for s in p.requests))
                   for name in "abcd"}
    assert first_round["a"] == first_round["b"] < first_round["c"] <= first_round["d"]
    for r in d.reqs.values():
        assert d.sent[r.req_id] == expected_reply(r)


# ---- decode share ----

def _decoding_then_long_prompt(share):
    d = Driver(max_tokens_per_step=16, decode_share=share)
    a = d.add(make_request("a", 4, max_tokens=60))
    d.round()
    assert len(a.output_ids) == 1  # a decodes from here on
    d.add(make_request("b", 64, max_tokens=2))
    return d


def test_decode_share_gives_decode_only_rounds_after_each_prefill_round():
    d = _decoding_then_long_prompt(0.25)
    shapes = []
    while len(d.reqs["b"].output_ids) == 0:
        shapes.append(d.shape(d.round(elapsed_s=0.1, prefill_s=1.0)))
    # A prefill round (1.0 s) earns 0.25 s of decode-only rounds (0.1 s each): three of them
    # (0.25 -> 0.15 -> 0.05 -> 0), then the next chunk, shared with a's decode row.
    kinds = ["P" if any(row[3] for row in s) else "D" for s in shapes]
    assert kinds[:9] == ["P", "D", "D", "D", "P", "D", "D", "D", "P"]
    for s, k in zip(shapes, kinds):
        if k == "D":
            assert s == [("a", 1, 1, False)]
        else:
            assert s[0] == ("a", 1, 1, False) and s[1][0] == "b"
    assert [s[1][1] for s, k in zip(shapes, kinds) if k == "P"] == [15, 15, 15, 15, 4]
    d.run()
    for r in d.reqs.values():
        assert d.sent[r.req_id] == expected_reply(r)


def test_decode_share_zero_prefills_each_prompt_whole_first():
    d = _decoding_then_long_prompt(0.0)
    a, b = d.reqs["a"], d.reqs["b"]
    sent_before = len(a.output_ids)
    shapes = []
    while not b.output_ids:
        shapes.append(d.shape(d.round(elapsed_s=1.0)))
    assert shapes == [[("b", 16, 0, True)]] * 3 + [[("b", 16, 1, True)]]
    assert len(a.output_ids) == sent_before  # no decode rows while b's prompt prefilled
    assert d.shape(d.round()) == [("a", 1, 1, False), ("b", 1, 1, False)]


def test_decode_credit_never_stalls_a_prompt_when_nothing_decodes():
    d = Driver(max_tokens_per_step=16, decode_share=0.25)
    d.add(make_request("b", 64, max_tokens=2))
    shapes = [d.shape(d.round(elapsed_s=1.0)) for _ in range(4)]
    assert shapes == [[("b", 16, 0, True)]] * 3 + [[("b", 16, 1, True)]]


# ---- preemption and checked replay ----

def test_pool_running_dry_preempts_the_last_in_order_and_it_replays_with_check_rows():
    # 8 blocks of 4 tokens; each request may hold up to 8 + 20 = 28 tokens: both fit alone,
    # not together.
    d = Driver(num_blocks=8, block_size=4, max_tokens_per_step=64, max_cached_blocks=0)
    a = d.add(make_request("a", 8, max_tokens=20))
    b = d.add(make_request("b", 8, max_tokens=20))
    while d.sched.num_preemptions == 0:
        d.round()
    assert b.status is Status.WAITING and b in d.sched.waiting and b not in d.sched.running
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert a.status is Status.RUNNING and a.num_preemptions == 0
    assert all(s.req_id != "b" for s in d.plans[-1].requests)
    num_sent = len(b.output_ids)
    assert num_sent > 0
    held = sum(1 for r in d.pool._refs if r)
    assert held == len(a.block_ids)

    d.run()
    # b recomputed its reply like a prompt: one check row for each token it had sent, then
    # the live draws; nothing was sent twice.
    assert d.checked["b"] == list(range(8, 8 + num_sent))
    assert d.checked["a"] == []
    assert d.sent["b"] == expected_reply(b) and d.sent["a"] == expected_reply(a)
    assert d.sched.num_preemptions >= 1 and d.pool.num_free == 8


def test_victim_is_the_last_in_order_not_the_one_growing():
    d = Driver(num_blocks=12, block_size=4, max_tokens_per_step=64, max_cached_blocks=0)
    reqs = [d.add(make_request(n, 4, max_tokens=30)) for n in "abc"]
    while d.sched.num_preemptions == 0:
        d.round()
    assert [r.num_preemptions for r in reqs] == [0, 0, 1]
    d.run()
    for r in reqs:
        assert d.sent[r.req_id] == expected_reply(r)


def test_replay_after_preemption_resumes_from_its_cached_blocks():
    # One lane: a background request decoding yields it to a foreground one; its full blocks
    # stay in the prefix cache, so it recomputes only its last partial block, with checks.
    d = Driver(num_blocks=32, block_size=4, max_num_seqs=1, max_tokens_per_step=64)
    bg = d.add(make_request("bg", 6, max_tokens=30, priority=1))
    for _ in range(9):
        d.round()
    num_sent = len(bg.output_ids)
    assert num_sent == 9  # 6 prompt + 9 reply = 15 tokens; 14 computed: 3 full blocks
    fg = d.add(make_request("fg", 5, max_tokens=3))
    plan = d.round()
    assert [s.req_id for s in plan.requests] == ["fg"]
    assert bg.status is Status.WAITING and bg.num_preemptions == 1
    d.run()
    replay = next(s for p in d.plans for s in p.requests if s.req_id == "bg" and s.rows_prefill and
                  s.start_position > 0)
    assert replay.start_position == 12  # 3 cached blocks of 4
    assert d.checked["bg"] == [13, 14]
    assert d.sent["bg"] == expected_reply(bg) and d.sent["fg"] == expected_reply(fg)


def test_replay_with_drafts_and_partial_chunks():
    # Replays cut into several chunks by a small budget; drafted decoding before and after.
    d = Driver(num_blocks=10, block_size=4, max_tokens_per_step=5, max_cached_blocks=0)
    a = d.add(make_request("a", 6, max_tokens=30), drafts=3)
    b = d.add(make_request("b", 6, max_tokens=30), drafts=3, bad=True)
    d.run()
    assert d.sched.num_preemptions > 0
    assert b.num_preemptions > 0
    for r in (a, b):
        assert d.sent[r.req_id] == expected_reply(r)
        assert set(d.checked[r.req_id]) <= set(range(6, 6 + r.max_tokens))
    assert d.checked["b"], "b's replay checked nothing"
    assert any(s.num_drafts for p in d.plans for s in p.requests)
    # replays were cut into chunks: some replay chunk held only check rows
    assert any(s.rows_prefill and s.rows and s.rows[-1].position < d.reqs[s.req_id].num_prompt_tokens + 30
               and not s.num_drafts for p in d.plans for s in p.requests)


# ---- priorities ----

def test_foreground_takes_a_background_requests_lane():
    d = Driver(max_num_seqs=1, max_tokens_per_step=64, max_cached_blocks=0)
    bg = d.add(make_request("bg", 6, max_tokens=20, priority=1))
    for _ in range(4):
        d.round()
    assert len(bg.output_ids) == 4
    fg = d.add(make_request("fg", 6, max_tokens=5))
    plan = d.round()
    assert [s.req_id for s in plan.requests] == ["fg"]
    assert bg.status is Status.WAITING and bg.num_preemptions == 1 and bg.block_ids == []
    while fg.status is not Status.FINISHED:
        assert all(s.req_id == "fg" for s in d.round().requests)
    d.run()
    assert d.checked["bg"] == [6, 7, 8, 9]
    assert d.sent["bg"] == expected_reply(bg) and d.sent["fg"] == expected_reply(fg)


def test_foreground_waits_for_a_foreground_lane():
    d = Driver(max_num_seqs=1, max_tokens_per_step=64)
    a = d.add(make_request("a", 6, max_tokens=6))
    d.round()
    d.add(make_request("b", 6, max_tokens=3))
    d.round()
    assert a.num_preemptions == 0 and [r.req_id for r in d.sched.waiting] == ["b"]


def test_foreground_takes_a_background_requests_memory():
    d = Driver(num_blocks=8, block_size=4, max_num_seqs=4, max_tokens_per_step=64, max_cached_blocks=0)
    bg = d.add(make_request("bg", 20, max_tokens=8, priority=1))
    d.round()
    d.round()
    assert len(bg.block_ids) == 6 and d.pool.num_free == 2
    fg = d.add(make_request("fg", 16, max_tokens=4))
    plan = d.round()
    # (admission does not count blocks promised to requests admitted earlier in the round, so bg
    # may be readmitted and preempted again before it computes anything: >= 1)
    assert bg.num_preemptions >= 1 and [s.req_id for s in plan.requests] == ["fg"]
    d.run()
    assert d.sent["bg"] == expected_reply(bg) and d.sent["fg"] == expected_reply(fg)


def test_foreground_prompt_prefills_before_an_earlier_background_one():
    d = Driver(max_tokens_per_step=16)
    d.add(make_request("bg", 40, max_tokens=2, priority=1))
    d.add(make_request("fg", 40, max_tokens=2))
    assert [r.req_id for r in d.sched.waiting] == ["fg", "bg"]
    assert d.shape(d.round()) == [("fg", 16, 0, True)]
    assert d.shape(d.round()) == [("fg", 16, 0, True)]
    # The background prompt does not share a round in which a foreground prompt prefills (its
    # chunk would stretch that round); it starts once the foreground request decodes.
    assert d.shape(d.round()) == [("fg", 8, 1, True)]
    assert [name for name, *_ in d.shape(d.round())] == ["fg", "bg"]


# ---- prefix cache ----

def _filled(pool, token_ids):
    """Allocate blocks for token_ids, hash all their full blocks, free them: a finished request."""
    blocks = pool.allocate(pool.blocks_for(len(token_ids)))
    hashes = []
    pool.register(blocks, token_ids, len(token_ids), hashes)
    pool.free(blocks)
    return blocks, hashes


def test_lookup_finds_the_longest_cached_chain_of_full_blocks():
    pool = BlockPool(16, 4)
    tokens = list(range(100, 114))  # 3 full blocks + 2 tokens
    blocks, hashes = _filled(pool, tokens)
    assert len(hashes) == 3 and pool.num_cached == 3
    hit, hit_hashes = pool.lookup(tokens, 10)
    assert hit == blocks[:3] and hit_hashes == hashes
    assert [pool._refs[b] for b in hit] == [1, 1, 1] and pool.num_free == 13
    pool.free(hit)
    # max_blocks caps the hit; a change in block 1 keeps only block 0
    assert pool.lookup(tokens, 2)[0] == blocks[:2]
    pool.free(blocks[:2])
    changed = tokens[:5] + [7] + tokens[6:]
    assert pool.lookup(changed, 10)[0] == blocks[:1]
    pool.free(blocks[:1])
    # chained: the same block contents after a different first block are not a hit
    assert pool.lookup([1, 2, 3, 4] + tokens[4:], 10)[0] == []
    assert chain_hash(b"", tokens[:4]) == hashes[0]
    assert chain_hash(hashes[0], tokens[4:8]) == hashes[1]


def test_only_full_final_blocks_are_hashed():
    pool = BlockPool(8, 4)
    blocks = pool.allocate(3)
    hashes = []
    pool.register(blocks, list(range(12)), 10, hashes)  # 10 final tokens: 2 full blocks
    assert len(hashes) == 2 and pool.num_cached == 2
    pool.register(blocks, list(range(12)), 12, hashes)  # extends the chain in place
    assert len(hashes) == 3 and pool.num_cached == 3


def test_ref_counts_share_blocks_and_catch_double_frees():
    pool = BlockPool(8, 4)
    blocks, _ = _filled(pool, list(range(8)))
    first, _ = pool.lookup(list(range(9)), 10)
    second, _ = pool.lookup(list(range(9)), 10)
    assert first == second == blocks and [pool._refs[b] for b in blocks] == [2, 2]
    pool.free(first)
    assert pool.num_free == 6 and [pool._refs[b] for b in blocks] == [1, 1]
    pool.free(second)
    assert pool.num_free == 8 and pool.num_cached == 2
    with pytest.raises(AssertionError):
        pool.free(blocks)


def test_allocation_takes_uncached_blocks_first_then_evicts_least_recently_used():
    pool = BlockPool(6, 4)
    old, _ = _filled(pool, list(range(8)))        # 2 cached blocks, freed first
    new, _ = _filled(pool, list(range(50, 58)))   # 2 cached blocks, freed later
    assert pool.num_cached == 4
    got = pool.allocate(2)
    assert set(got).isdisjoint(old + new)         # the 2 never-cached blocks go first
    got += pool.allocate(1)
    assert got[2] == old[1]                       # then the LRU: the older request's last block
    assert pool.num_cached == 3
    assert pool.lookup(list(range(9)), 10)[0] == old[:1]  # its first block still hits
    assert pool.lookup(list(range(50, 59)), 10)[0] == new


def test_cache_budget_keeps_the_most_recent_prefix_blocks():
    pool = BlockPool(16, 4, max_cached_blocks=2)
    a, _ = _filled(pool, list(range(12)))          # 3 blocks; the budget keeps 2: its prefix
    assert pool.num_cached == 2
    assert pool.lookup(list(range(13)), 10)[0] == a[:2]
    pool.free(a[:2])
    b, _ = _filled(pool, list(range(40, 48)))     # 2 newer blocks push a's out
    assert pool.num_cached == 2
    assert pool.lookup(list(range(13)), 10)[0] == []
    assert pool.lookup(list(range(40, 49)), 10)[0] == b


def test_zero_cache_budget_still_shares_blocks_in_use():
    pool = BlockPool(8, 4, max_cached_blocks=0)
    blocks = pool.allocate(2)
    hashes = []
    pool.register(blocks, list(range(8)), 8, hashes)
    assert pool.lookup(list(range(9)), 10)[0] == blocks  # the owner still holds them
    pool.free(blocks)
    pool.free(blocks)
    assert pool.num_cached == 0 and pool.lookup(list(range(9)), 10)[0] == []


def test_admission_reuses_a_cached_prompt_prefix():
    d = Driver(num_blocks=32, block_size=4, max_tokens_per_step=64)
    system = [500 + i for i in range(10)]
    a = d.add(make_request("a", prompt_ids=system + [1, 2, 3], max_tokens=3))
    d.run()
    assert a.stats.cached_tokens == 0
    b = d.add(make_request("b", prompt_ids=system + [9, 9, 9, 9], max_tokens=3))
    plan = d.round()
    assert plan.requests[0].start_position == 8 and b.stats.cached_tokens == 8
    d.run()
    assert d.sent["b"] == expected_reply(b)
    # The whole prompt cached: the last token is still fed, to draw the first reply token.
    c = d.add(make_request("c", prompt_ids=system + [9, 9, 9, 9], max_tokens=3))
    plan = d.round()
    assert plan.requests[0].start_position == 12
    assert plan.requests[0].token_ids == [9, 9] and c.stats.cached_tokens == 12
    d.run()
    assert d.sent["c"] == expected_reply(c)
    # An earlier change loses reuse from that block on.
    e = d.add(make_request("e", prompt_ids=system[:5] + [0] + system[6:] + [1, 2, 3], max_tokens=3))
    d.round()
    assert e.stats.cached_tokens == 4


def test_running_requests_share_a_prefix_computed_by_another():
    d = Driver(num_blocks=32, block_size=4, max_tokens_per_step=64)
    system = [500 + i for i in range(16)]
    a = d.add(make_request("a", prompt_ids=system + [1], max_tokens=10))
    d.round()
    b = d.add(make_request("b", prompt_ids=system + [2], max_tokens=10))
    d.round()
    assert b.block_ids[:4] == a.block_ids[:4] and b.stats.cached_tokens == 16
    assert all(d.pool._refs[x] == 2 for x in a.block_ids[:4])
    d.run()
    assert d.sent["a"] == expected_reply(a) and d.sent["b"] == expected_reply(b)
    assert d.pool.num_free == 32


def test_cached_tokens_report_what_the_admission_that_ran_found():
    d = Driver(num_blocks=8, block_size=4, max_tokens_per_step=64)
    prefix = [500 + i for i in range(8)]
    d.add(make_request("p", prompt_ids=prefix + [1], max_tokens=2))
    d.run()
    a = d.add(make_request("a", 24, max_tokens=8))
    x = d.add(make_request("x", prompt_ids=prefix + [1, 2, 3, 4], max_tokens=4))
    d.round()
    assert x.num_preemptions == 1 and x.status is Status.WAITING  # admitted, then turned back
    d.run()
    first_chunk = next(s for p in d.plans for s in p.requests if s.req_id == "x")
    assert first_chunk.start_position == 0  # its hit blocks went to a: nothing was reused
    assert d.sent["x"] == expected_reply(x) and d.sent["a"] == expected_reply(a)
    assert x.stats.cached_tokens == 0


# ---- capacity ----

def test_a_request_that_can_never_fit_is_refused_with_the_numbers():
    d = Driver(num_blocks=8, block_size=4)
    with pytest.raises(MemoryError, match=r"33 tokens.*20 prompt \+ 13 reply.*holds 32"):
        d.add(make_request("big", 20, max_tokens=13))
    assert not d.sched.has_work()
    d.add(make_request("fits", 20, max_tokens=12))  # exactly the whole pool
    d.run()
    assert d.sent["fits"] == expected_reply(d.reqs["fits"])


def test_a_request_that_fits_later_waits_and_holds_its_place_in_line():
    d = Driver(num_blocks=8, block_size=4, max_tokens_per_step=64)
    a = d.add(make_request("a", 20, max_tokens=8))
    d.round()
    d.round()
    assert d.pool.num_free == 2
    b = d.add(make_request("b", 10, max_tokens=4))   # needs 4 blocks: waits
    c = d.add(make_request("c", 2, max_tokens=2))    # would fit now, but waits behind b
    d.round()
    assert [r.req_id for r in d.sched.waiting] == ["b", "c"] and a.num_preemptions == 0
    d.run()
    for r in (a, b, c):
        assert d.sent[r.req_id] == expected_reply(r)


@pytest.mark.parametrize("seed", range(10))
def test_random_flood_beyond_the_pool_completes_exactly(seed):
    """Random arrivals, priorities, shared prefixes, drafts and a small pool: every reply equals
    its solo run, replays check each resent token, and every block comes back."""
    rng = random.Random(seed)
    d = Driver(num_blocks=rng.choice([10, 16, 24]), block_size=4,
               max_num_seqs=rng.choice([1, 2, 4]), max_tokens_per_step=rng.choice([6, 16, 64]),
               decode_share=rng.choice([0.0, 0.25]), max_cached_blocks=rng.choice([None, 0, 3]))
    capacity = d.pool.num_blocks * 4
    shared = [700 + i for i in range(12)]
    pending = []
    for i in range(12):
        n = rng.randint(1, 14)
        prompt = (shared[:rng.choice([0, 4, 8, 12])] + [rng.randrange(1, 900) for _ in range(n)])
        max_tokens = rng.randint(1, min(24, capacity - len(prompt)))
        pending.append((make_request(f"r{i}", prompt_ids=prompt, max_tokens=max_tokens,
                                     priority=rng.choice([0, 0, 1])),
                        rng.choice([0, 0, 2, 5]), rng.random() < 0.3))
    rounds = 0
    while pending or d.sched.has_work():
        while pending and rng.random() < 0.4:
            req, drafts, bad = pending.pop(0)
            d.add(req, drafts=drafts, bad=bad)
        d.round(elapsed_s=rng.choice([0.01, 0.1, 1.0]))
        rounds += 1
        assert rounds < 5000
    for r in d.reqs.values():
        assert r.status is Status.FINISHED
        assert d.sent[r.req_id] == expected_reply(r)
    assert d.pool.num_free == d.pool.num_blocks
