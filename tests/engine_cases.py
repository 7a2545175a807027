"""Engine-level exactness cases shared by the backends' tests (test_cuda_backend.py,
test_mlx_backend.py): how a batch of requests is run, and the mixed batch whose replies must
equal their solo, serial runs."""
import random

import torch

from tensorfold.sampling import bitmask as bits
from tensorfold.sampling.constraint import RowConstraint
from tensorfold.sampling.params import SamplingParams


def run(engine, prompts, params, constraints=None) -> list:
    """Submit all at once, step to the end; the finished requests (output_ids, stats)."""
    constraints = constraints or [None] * len(prompts)
    ids = [engine.add_request(p, sp, constraint=c) for p, sp, c in zip(prompts, params, constraints)]
    reqs = [engine.requests[i] for i in ids]
    while engine.has_work():
        engine.step()
    return reqs


class EvenTokens(RowConstraint):
    """Only even token ids are allowed (the mask reaches the sampler as a bitmask)."""

    def __init__(self, vocab):
        even = torch.zeros(1, vocab, dtype=torch.bool)
        even[0, 0::2] = True
        self.row = bits.pack(even)[0]

    def fill_mask(self, reply_ids, bitmask, row):
        bitmask[row, :len(self.row)] &= self.row


def check_preemption(tight, prompts, params, solo) -> list:
    """The requests together on `tight`, an engine whose pool holds too few blocks for all of
    them, so that some are preempted and replayed: each replies as it did alone (`solo`: their
    replies, token ids). Returns the requests."""
    got = run(tight, prompts, params)
    assert [r.output_ids for r in got] == solo
    assert tight.scheduler.num_preemptions > 0
    return got


def check_solo_vs_batched(solo, batched, recorder, same) -> None:
    """mixed_batch() run one request at a time on `solo` (no drafts) and all together on `batched`
    (drafts verified whole, draft_budget=False, so the verify path runs whatever the rows cost;
    chunks): the same replies, rounds really shared, drafts both accepted and rejected,
    and every solo draw's logits row `same` as the batched one (recorder: the backend's test
    Recorder, draws by (seed, position))."""
    prompts, params, masks = mixed_batch()
    want = recorder(solo)
    expected = [run(solo, [p], [sp], [c])[0].output_ids for p, sp, c in zip(prompts, params, masks)]
    assert all(t % 2 == 0 for t in expected[3]), "mask not applied"
    got = recorder(batched)
    reqs = run(batched, prompts, params, masks)
    assert [r.output_ids for r in reqs] == expected
    assert max(got.round_sizes) > 1, "the requests never shared a round"
    drafted, accepted = sum(r.stats.drafted for r in reqs), sum(r.stats.accepted for r in reqs)
    assert 0 < accepted < drafted, f"drafts must be both accepted and rejected ({accepted}/{drafted})"
    assert want.draws.keys() <= got.draws.keys()
    for key, logits in want.draws.items():
        assert same(got.draws[key], logits), f"logits of the draw at {key} differ"


def mixed_batch(vocab: int = 512):
    """(prompts, params, constraints) for a 512-token vocabulary: sampled with top-p, min-p and
    top-k, greedy, and a masked row. The 2nd prompt holds 96 distinct tokens: its random reply
    keeps finding its last token there, so prompt lookup drafts (and mostly misses); the 3rd
    loops greedily (drafts hit)."""
    rng = random.Random(5)
    loop = [rng.randrange(2, 500) for _ in range(5)]
    prompts = [loop * 4, rng.sample(range(2, vocab), 96), loop * 2 + [7, 9], loop * 3]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, min_p=0.05, seed=2, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=40, seed=3, max_tokens=8, ignore_eos=True)]
    return prompts, params, [None, None, None, EvenTokens(vocab)]
