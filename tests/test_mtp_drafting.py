"""MTP drafting (models/mtp.py, engine/mtp_drafter.py, backends/mtp_runner.py) on the tiny qwen3_5
hybrid with an MTP layer trained by tools/train_mtp.py: the layer equals its torch/transformers
training form, drafted == serial bitwise (greedy and sampled, solo and four at once, every draft
run or drafting paused and resumed), the MTP K/V after a paused stretch's catch-up and after a
prefix hit is what an always-caught-up fresh run writes, on text the layer does not predict the
MTP layer stops running, acceptance is above a measured floor, and --drafter's errors are clear."""
import pytest

torch = pytest.importorskip("torch")

from tensorfold.__main__ import parse_args, settings_from  # noqa: E402
from tensorfold.api.counters import Counters, metrics_text  # noqa: E402
from tensorfold.api.metrics import Latencies  # noqa: E402
from tensorfold.api.replies import token_sha  # noqa: E402
from tensorfold.engine.engine import Engine, EngineConfig, Load  # noqa: E402
from tensorfold.models.checkpoint import CheckpointError  # noqa: E402
from tensorfold.sampling.params import SamplingParams  # noqa: E402
import mtp_cases as mtp  # noqa: E402
from engine_cases import run  # noqa: E402
from mtp_cases import BASE, greedy, one_thread, sampled, scripted, trained_checkpoints  # noqa: E402,F401 (one_thread: a fixture)


@pytest.fixture(scope="module")
def checkpoints(one_thread, tmp_path_factory, smollm2_tokenizer):
    """(the tiny qwen3_5 without MTP, the same with a trained MTP layer, its training prompts)."""
    return trained_checkpoints(tmp_path_factory, smollm2_tokenizer, "qwen3_5")


def test_mtp_layer_equals_its_training_form(checkpoints):
    _, path, prompts = checkpoints
    mtp.check_served_layer_equals_training_form(path, prompts)


def test_drafted_equals_serial_solo_and_batched(checkpoints):
    """Greedy and sampled, one at a time and four at once (measured: 11-12 of 11-12 first drafts
    accepted on the memorised continuations, later positions 0-5 of 11)."""
    _, path, prompts = checkpoints
    drafted = mtp.check_drafted_equals_serial(path, prompts[:4], [greedy(), greedy(), sampled(1), sampled(2)])
    assert drafted.max_draft == 3


def mtp_keys(engine, prompt, params, num_steps: int):
    """The MTP layer's K at each written position of a request after num_steps rounds, and the request."""
    req = engine.requests[engine.add_request(prompt, params)]
    for _ in range(num_steps):
        engine.step()
    return written_keys(engine, req), req


def written_keys(engine, req):
    """The MTP layer's K at the positions the drafter counts as written (bitwise a fresh run's)."""
    kv, bs = engine.backend.cache.layer(len(engine.backend.model.layers)), engine.pool.block_size
    slots = [req.block_ids[p // bs] * bs + p % bs for p in range(engine.mtp_drafter.num_written(req))]
    return kv.k.flatten(0, 1)[slots].clone()


def pause_then_draft(n):  # 10 rounds' choices without drafts, then 5 with, and so on
    return 3 if n % 15 >= 10 else 0


def test_a_prefix_hit_keeps_the_mtp_cache_a_fresh_run_writes(checkpoints):
    """The MTP layer's K/V at every computed position, after a prefix hit, bitwise what a fresh
    run writes (a block's last slot holds the row of the next block's first token: the cache book
    recomputes the hit's last block), and the drafts and reply are the fresh run's."""
    _, path, prompts = checkpoints
    serial = Engine(path, EngineConfig(drafting=False, **BASE))
    prompt = prompts[5] + serial.generate(prompts[5], greedy(44)).token_ids  # 52 tokens
    config = EngineConfig(drafter="mtp", draft_budget=False, **BASE)
    fresh_k, fresh = mtp_keys(Engine(path, config), prompt, greedy(24), 6)
    engine = Engine(path, config)
    # Blocks 0-1 go to the prefix cache, the MTP row at slot 31 made with token 7 after them.
    run(engine, [prompt[:32] + [7, 8, 9]], [greedy(4)])
    cached_k, cached = mtp_keys(engine, prompt, greedy(24), 6)
    assert cached.stats.cached_tokens == 16  # two blocks matched, the last one recomputed
    assert cached.num_computed_tokens == fresh.num_computed_tokens > 32
    assert torch.equal(cached_k, fresh_k)
    while engine.has_work():
        engine.step()
    assert cached.output_ids == run(Engine(path, config), [prompt], [greedy(24)])[0].output_ids


def test_drafter_choice_and_errors(checkpoints):
    base, trained, _ = checkpoints
    assert Engine(trained, EngineConfig(**BASE)).drafter_name == "mtp"             # auto, weights present
    assert Engine(base, EngineConfig(**BASE)).drafter_name == "ngram"              # auto, none
    assert Engine(trained, EngineConfig(drafter="ngram", **BASE)).backend.model.mtp is None  # not even loaded
    with pytest.raises(CheckpointError, match="--drafter mtp needs a multi-token-prediction layer"):
        Engine(base, EngineConfig(drafter="mtp", **BASE))
    with pytest.raises(ValueError, match="drafter 'medusa'"):
        Engine(trained, EngineConfig(drafter="medusa", **BASE))
    with pytest.raises(SystemExit):
        parse_args(["--drafter", "medusa"])
    with pytest.raises(SystemExit, match="--num-draft-tokens must be at least 1"):
        settings_from(parse_args(["--num-draft-tokens", "0"]))
    engine = settings_from(parse_args(["--drafter", "mtp", "--num-draft-tokens", "2"])).engine
    assert (engine.drafter, engine.max_draft) == ("mtp", 2)


def test_counts_by_position_reach_the_reply_and_metrics(checkpoints):
    _, path, prompts = checkpoints
    engine = Engine(path, EngineConfig(drafter="mtp", draft_budget=False, **BASE))
    req = run(engine, prompts[:1], [greedy(16)])[0]
    s = req.stats
    assert len(s.drafted_by_position) == 3 and sum(s.drafted_by_position) == s.drafted
    assert sum(s.accepted_by_position) == s.accepted
    counters = Counters()
    counters.add_finished(req)
    counters.add_finished(req)
    text = metrics_text(counters, Load(0, 0, 0, 0, 0.0, 1), Latencies())
    assert f'tensorfold_draft_position_accepted_tokens_total{{position="1"}} {2.0 * s.accepted_by_position[0]!r}' in text
    assert f'tensorfold_draft_position_tokens_total{{position="3"}} {2.0 * s.drafted_by_position[2]!r}' in text


def test_paused_and_resumed_drafting_equals_serial(checkpoints):
    """Drafting paused for stretches and resumed (each resume a catch-up over the stretch), and
    the real budget: greedy and sampled, solo and four at once, the serial token_sha."""
    _, path, prompts = checkpoints
    prompts = prompts[:4]
    params = [greedy(), sampled(3), greedy(), sampled(4)]
    expected = [token_sha(r.output_ids) for r in run(Engine(path, EngineConfig(drafting=False, **BASE)),
                                                      prompts, params)]
    for engine in (scripted(path, pause_then_draft), Engine(path, EngineConfig(drafter="mtp", **BASE))):
        solo = [run(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]
        assert [token_sha(r.output_ids) for r in solo] == expected
        assert [token_sha(r.output_ids) for r in run(engine, prompts, params)] == expected
    assert solo[0].stats.drafted > 0 or solo[2].stats.drafted > 0  # the real budget drafted on its own text


def test_a_paused_stretch_catches_up_to_what_a_fresh_run_writes(checkpoints):
    _, path, prompts = checkpoints
    mtp.check_paused_stretch_catches_up(path, prompts[1])


@pytest.mark.parametrize("why", ["budget", "draft false"])
def test_a_request_that_never_drafts_leaves_the_prefix_cache_right(checkpoints, why):
    """A request that runs no drafts (the budget keeps it at depth 0, or it asked for "draft":
    false) hashes no block past its written MTP K/V while it runs, and catches up at its end; a
    later request's prefix hit on those blocks then holds the MTP K/V a fresh run writes."""
    _, path, prompts = checkpoints
    serial = Engine(path, EngineConfig(drafting=False, **BASE))
    prompt = prompts[5] + serial.generate(prompts[5], greedy(44)).token_ids  # 52 tokens, greedy from token 8 on
    engine = scripted(path, lambda n: 0, probes=False) if why == "budget" else Engine(path, EngineConfig(**BASE))
    params = greedy(30) if why == "budget" else SamplingParams(temperature=0.0, max_tokens=30, draft=False)
    first = engine.requests[engine.add_request(prompt[:10], params)]  # decodes prompt[10:40]
    while engine.has_work():
        engine.step()
        if first.status.value == "running":
            assert len(first.block_hashes) * engine.pool.block_size <= engine.mtp_drafter.num_written(first)
            assert engine.mtp_drafter.lag(first) > 0 or first.num_computed_tokens < 10
    assert first.output_ids == prompt[10:40] and first.stats.drafted == 0
    cached_k, cached = mtp_keys(engine, prompt, greedy(24), 6)
    assert cached.stats.cached_tokens == 16  # blocks 0-1 came from the first request's decode
    fresh_k, _ = mtp_keys(scripted(path, lambda n: 0, probes=False), prompt, greedy(24), 6)
    n = min(len(cached_k), len(fresh_k))  # the written positions (the real budget may draft the second)
    assert n >= 48 and torch.equal(cached_k[:n], fresh_k[:n])


def test_on_text_it_does_not_predict_the_mtp_layer_goes_quiet(checkpoints):
    """Fresh random prompts (the tiny layer accepts nothing there): after the first requests the
    draft budget stops drafting, and the MTP layer runs only for probes and the end-of-request
    catch-up, not every round; the replies are the serial ones."""
    _, path, prompts = checkpoints
    import random
    rng = random.Random(7)
    unseen = [[rng.randrange(100, 40000) for _ in range(8)] for _ in range(6)]
    engine = Engine(path, EngineConfig(drafter="mtp", **BASE))
    serial = Engine(path, EngineConfig(drafting=False, **BASE))
    for i, prompt in enumerate(unseen):
        before, rounds = engine.runner.mtp.num_forwards, 0
        req = engine.requests[engine.add_request(prompt, greedy())]
        while engine.has_work():
            engine.step()
            rounds += 1
        assert req.output_ids == serial.generate(prompt, greedy()).token_ids
        if i >= 3:  # measured: 1-3 passes (a probe or two, the end's catch-up) in 41 rounds
            assert engine.runner.mtp.num_forwards - before <= 6 and req.stats.drafted <= 3, (i, rounds)


def test_a_long_lag_is_caught_up_anyway(checkpoints, monkeypatch):
    """The held hidden states stay bounded: a request lagging past MAX_LAG rows is caught up
    after the round (here MAX_LAG 5), and what that writes is what a fresh run writes."""
    from tensorfold.engine import mtp_drafter
    _, path, prompts = checkpoints
    monkeypatch.setattr(mtp_drafter, "MAX_LAG", 5)
    engine = scripted(path, lambda n: 0, probes=False)
    req = engine.requests[engine.add_request(prompts[2], greedy())]
    lags = []
    for _ in range(20):
        engine.step()
        lags.append(engine.mtp_drafter.lag(req))
    assert max(lags) <= 6 and engine.runner.mtp.held(req.req_id)[0] >= req.num_computed_tokens - 7
    fresh = Engine(path, EngineConfig(drafter="mtp", draft_budget=False, **BASE))
    always = fresh.requests[fresh.add_request(prompts[2], greedy())]
    while fresh.mtp_drafter.num_written(always) < engine.mtp_drafter.num_written(req) and fresh.has_work():
        fresh.step()
    keys = written_keys(engine, req)
    assert always.status.value == "running" and len(keys) >= 20 and torch.equal(keys, written_keys(fresh, always)[:len(keys)])
