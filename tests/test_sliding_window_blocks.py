"""Sliding-window K/V whose blocks leave the cache (engine/cache_book.py, models/cache.layer_groups).

- the cache book in plain Python: a sliding group keeps exactly the blocks its rows still read,
  through growing, drafts rolled back and recurrent rewinds; the pools' reference counts are the
  tables'; a prefix hit is taken only where the sliding group still holds its window's blocks;
- the grouping and the sizing: Gemma 4's sliding layers (and their KV-shared readers) behind one
  table, the full layers behind another, the budget split between them;
- the tiny gemma4 (window 16) in the engine: a prompt of 600 tokens holds a couple of blocks in its
  sliding layers and all of them in its full layers, and draws the tokens a plain forward over a
  cache that keeps everything draws;
- over HTTP: a server whose KV budget could not hold full-length sliding caches serves that prompt
  with the token_sha of a large-budget server, twice (the second from the prefix cache), and
  /health counts both groups.
"""
import json
import random
import urllib.request

import pytest
import torch

from test_exactness import complete, serving, tiny_engine, user
from tensorfold.engine.block_pool import NULL_BLOCK, BlockPool, lane_blocks
from tensorfold.engine.cache_book import CacheBook
from tensorfold.engine.request import Request
from tensorfold.models.cache import ModelCache, PagedKV, SharedKV, group_blocks, layer_groups
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
from tensorfold.sampling.params import SamplingParams
from tools.tiny_checkpoint import make_tiny_checkpoint

BS, WINDOW = 4, 10


def _book(num_blocks=(64, 64), recompute_last_hit=False, resume_at_blocks=False):
    pools = [BlockPool(n, BS) for n in num_blocks]
    return CacheBook(pools, [None, WINDOW], resume_at_blocks=resume_at_blocks, recompute_last_hit=recompute_last_hit)


def _request(tokens, max_tokens=8):
    return Request("r", list(tokens), SamplingParams(max_tokens=max_tokens), 0, frozenset())


def _check_invariants(book, requests, slid):
    """Every position a row from num_computed_tokens on reads is held; nothing before it is once
    the request `slid` (the others let go at their next round); the pools' references are exactly
    the tables' entries."""
    refs = [[0] * pool.num_blocks for pool in book.pools]
    for req in requests:
        for g, table in enumerate(book.tables(req)):
            for block in table:
                if block != NULL_BLOCK:
                    refs[g][block] += 1
        full, sliding = book.tables(req)
        assert NULL_BLOCK not in full
        first = max(0, req.num_computed_tokens - req.num_computed_tokens % BS - WINDOW + 1)
        if req is slid:
            assert all(b == NULL_BLOCK for b in sliding[:first // BS]), "a block behind the window is still held"
        assert all(b != NULL_BLOCK for b in sliding[first // BS:]), "a block in the window was freed"
    for g, pool in enumerate(book.pools):
        assert refs[g] == [r for r in pool._refs], f"group {g}: references differ from the tables"


@pytest.mark.parametrize("resume_at_blocks", [False, True])
def test_a_sliding_group_holds_exactly_the_blocks_its_rows_read(resume_at_blocks):
    rng = random.Random(7)
    book = _book((160, 64), resume_at_blocks=resume_at_blocks)
    reqs = [_request(range(i, i + 200)) for i in range(3)]
    for _ in range(300):
        req = rng.choice(reqs)
        book.slide(req)
        _check_invariants(book, reqs, req)
        start, rows = req.num_computed_tokens, rng.choice([1, 1, 3, 9, 17])
        if start + rows > 190:
            book.release(req)
            req.num_computed_tokens = 0
            continue
        assert book.can_grow(req, start + rows)
        book.grow(req, start + rows)
        req.num_computed_tokens += rows
        book.rollback(req, rng.choice([0, 0, min(rows - 1, 2)]))  # rejected drafts, a recurrent rewind
    for req in reqs:
        book.release(req)
    assert [pool.num_free for pool in book.pools] == [160, 64]


def test_the_sliding_group_holds_a_lanes_worth_however_long_the_prompt():
    book, req = _book(), _request(range(240))
    held = []
    while req.num_computed_tokens < 230:
        book.slide(req)
        book.grow(req, req.num_computed_tokens + 7)
        held.append(book.num_held(req))
        req.num_computed_tokens += 7
    assert held[-1][0] == -(-req.num_computed_tokens // BS)
    assert max(h[1] for h in held) <= lane_blocks(WINDOW, BS, 7) < held[-1][0]
    assert book.blocks_to_hold(1, 10_000, 7) == lane_blocks(WINDOW, BS, 7)


def _finished(book, tokens):
    """A request run over `tokens` and finished: its full blocks cached in both groups."""
    req = _request(tokens)
    for end in [*range(3, len(tokens), 3), len(tokens)]:
        book.slide(req)
        book.grow(req, end)
        req.num_computed_tokens = end
        book.register(req, tokens, end)
    book.release(req)
    return req


@pytest.mark.parametrize("recompute_last_hit", [False, True])
def test_a_prefix_hit_needs_the_windows_blocks(recompute_last_hit):
    book = _book(recompute_last_hit=recompute_last_hit)
    tokens = list(range(100, 141))  # 10 full blocks and one token
    _finished(book, tokens)
    hit = book.lookup(tokens, 10)
    n = 9 if recompute_last_hit else 10
    assert len(hit.hashes) == n and NULL_BLOCK not in hit.tables[0] and len(hit.tables[0]) == n
    first = (n * BS - WINDOW + 1) // BS  # the block holding the first key a row at n * BS reads
    assert hit.tables[1][:first] == [NULL_BLOCK] * first and NULL_BLOCK not in hit.tables[1][first:]
    book.drop(hit)
    # The sliding group lost the blocks near the end: the hit shrinks to where its window is cached.
    sliding = book.pools[1]
    sliding.forget_cached()
    head = tokens[:5 * BS + 1]
    _finished(book, head)  # caches blocks 0..4 in both groups again
    hit = book.lookup(tokens, 10)
    assert len(hit.hashes) == 5  # (the MTP rule recomputes a sixth block the full group holds)
    book.drop(hit)
    sliding.forget_cached()
    hit = book.lookup(tokens, 10)  # the full group holds all ten; without a window there is no hit
    assert hit.hashes == [] and hit.tables == [[], []]
    assert [pool.num_free for pool in book.pools] == [64, 64]


# ---- grouping and sizing -----------------------------------------------------------------------

def test_layers_are_grouped_by_window_shared_layers_with_their_source():
    specs = [PagedKV(1, 16, 16), PagedKV(1, 16, 16), PagedKV(2, 32), None, PagedKV(1, 16, 8), SharedKV(1), SharedKV(2)]
    assert layer_groups(specs) == ([2, 2, 0, None, 1, 2, 0], [None, 8, 16])
    assert layer_groups([PagedKV(1, 16, 16)]) == ([0], [16])  # only sliding layers: one sliding group
    assert layer_groups([PagedKV(1, 16)] * 2) == ([0, 0], [None])


def test_the_budget_goes_to_the_full_group_past_what_the_lanes_windows_need():
    specs = [PagedKV(1, 16, 16)] * 4 + [PagedKV(1, 32)]
    full, sliding = 2 * 32 * 4 * 32, 4 * 2 * 16 * 4 * 32  # bytes per block of each group
    lanes, chunk = 4, 64
    want = lanes * (lane_blocks(16, 32, chunk) + 1)
    f32 = lambda spec: spec.bytes_per_block(torch.float32, 32)  # noqa: E731
    blocks = group_blocks(specs, 1000 * full + want * sliding, f32, 32, 1024, lanes, chunk)
    assert blocks == [1000, want]
    # a small budget: at least one window of context in the full group, one lane in the sliding one
    assert group_blocks(specs, 1, f32, 32, 1024, lanes, chunk) == [32, lane_blocks(16, 32, chunk)]
    # no sliding layers: one group, the budget's blocks (as before groups)
    assert group_blocks([PagedKV(1, 32)] * 2, 100 * 2 * full, f32, 32, 1024, lanes, chunk) == [100]
    # the backend's own bytes per block (mlx's K and V exponents beside its K/V): the same budget holds
    # fewer blocks of a dearer layout
    dearer = lambda spec: 2 * f32(spec)  # noqa: E731
    assert group_blocks(specs, 2 * (1000 * full + want * sliding), dearer, 32, 1024, lanes, chunk) == [1000, want]
    assert group_blocks(specs, 1000 * full + want * sliding, dearer, 32, 1024, lanes, chunk)[0] < 1000


def test_a_layer_reads_its_groups_slots_and_tables():
    specs = [PagedKV(1, 8, 4), PagedKV(1, 8), SharedKV(0)]
    cache = ModelCache(specs, 6, 4, torch.float32, blocks=[6, 3])
    assert [cache.layer(i).k.shape[0] for i in range(3)] == [3, 6, 3] and cache.layer(2) is cache.layer(0)
    ids = torch.zeros(2, dtype=torch.int64)
    rows = [SequenceRows(0, 2, torch.tensor([4, 1, 5]))]
    batch = ForwardBatch(ids, torch.tensor([8, 9]), torch.tensor([20, 21]), rows, torch.tensor([1]),
                         [(torch.tensor([8, 9]), [torch.tensor([0, 0, 2])])])
    sliding = cache.batch(0, batch)
    assert cache.batch(1, batch) is batch and cache.batch(2, batch) is sliding
    assert sliding.slot_mapping.tolist() == [8, 9] and sliding.block_tables.tolist() == [[0, 0, 2]]


# ---- the tiny gemma4 in the engine and over HTTP -----------------------------------------------

PROMPT_LEN = 600


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, smollm2_tokenizer):
    """The tiny gemma4 (every option on); any seed: the oracles here are the model's own exact runs."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("gemma4_window")), "gemma4", tokenizer=smollm2_tokenizer)


def test_a_long_prompt_holds_a_window_of_sliding_blocks_and_draws_what_a_full_cache_draws(gemma):
    engine = tiny_engine(gemma, context=1024, max_tokens_per_step=64, drafting=False)
    assert engine.book.windows == [None, 16]
    ids = [100 + (7 * i) % 900 for i in range(PROMPT_LEN)]
    req_id = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    req, held = engine.requests[req_id], []
    while req.finish_reason is None:
        engine.step()
        held.append(engine.book.num_held(req))
    full, sliding = held[-2]  # the last round still running
    assert full == -(-(PROMPT_LEN + 10) // 32) and sliding <= lane_blocks(16, 32, 64) and sliding < full
    assert all(s <= lane_blocks(16, 32, 64) for _, s in held[:-1])
    assert all(pool.num_free == pool.num_blocks for pool in engine.pools)
    # The oracle: the same model over one table that keeps every block, token by token after a
    # whole-prompt prefill (batch- and chunk-invariance make the draws bitwise those of the engine).
    model = engine.backend.model
    cache = model.allocate_cache(-(-(PROMPT_LEN + 12) // 32), 32, torch.float32)
    table = torch.arange(cache.num_blocks)
    tokens = list(ids)
    for _ in range(12):
        start = 0 if len(tokens) == PROMPT_LEN else len(tokens) - 1
        fed = tokens[start:]
        batch = ForwardBatch(torch.tensor(fed), torch.arange(start, len(tokens)), torch.arange(start, len(tokens)),
                             [SequenceRows(0, len(fed), table)], torch.tensor([len(fed) - 1]))
        tokens.append(int(model.forward(batch, cache)[-1].argmax()))
    assert req.output_ids == tokens[PROMPT_LEN:]


def test_a_budget_too_small_for_full_sliding_caches_serves_a_long_prompt_exactly(gemma):
    big = tiny_engine(gemma, context=1024, max_tokens_per_step=64, kv_cache_gib=0.05)
    specs = big.backend.model.cache_specs()
    one_table = ModelCache.bytes_per_block(specs, torch.float32, 32) * (1024 // 32)  # every layer, whole window
    budget = one_table * 3 // 4
    small = tiny_engine(gemma, context=1024, max_tokens_per_step=64, max_num_seqs=2, kv_cache_gib=budget / 2**30)
    assert small.info.cache_bytes <= budget < one_table
    body = dict(messages=[user("tide logbook entry " * 150)], max_tokens=24, temperature=0.9, seed=8, ignore_eos=True)
    with serving(big) as s:
        want = complete(s.client, body)
    with serving(small) as s:
        got = complete(s.client, body)
        again = complete(s.client, body)
        with urllib.request.urlopen("http://%s:%d/health" % s.server.address) as r:
            health = json.load(r)
    assert got.prompt_tokens > 500 and want.cached == got.cached == 0
    assert got.sha == want.sha and got.text == want.text
    assert again.cached > 0 and again.sha == want.sha  # a prefix hit with the window's blocks cached
    groups = health["kv_cache"]["groups"]
    assert [(g["window"], g["blocks"]) for g in groups] == [(None, small.pools[0].num_blocks),
                                                              (16, small.pools[1].num_blocks)]
    assert small.pools[1].num_blocks < small.pools[0].num_blocks and "window 16: 4 layers" in small.info.cache
