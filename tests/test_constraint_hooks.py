"""The per-row hooks (allowed-token mask, token fix) act identically in serial, drafted,
batched and preempted-then-replayed decoding."""
import random

import pytest
import torch

from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.sampling import bitmask as bits
from tensorfold.sampling.constraint import RowConstraint
from tensorfold.sampling.params import SamplingParams


class EvenTokensForceAtFive(RowConstraint):
    """Only even token ids are allowed; the 5th reply token is forced to the 2nd's id + 2."""

    def __init__(self, vocab):
        even = torch.zeros(1, vocab, dtype=torch.bool)
        even[0, 0::2] = True
        self.row = bits.pack(even)[0]
        self.calls = 0

    def fill_mask(self, reply_ids, bitmask, row):
        self.calls += 1
        bitmask[row, :len(self.row)] &= self.row

    def fix(self, reply_ids, token):
        return reply_ids[1] + 2 if len(reply_ids) == 4 else token


def _run(engine, prompts, params, constraint_factory):
    ids = [engine.add_request(p, sp, constraint=constraint_factory()) for p, sp in zip(prompts, params)]
    reqs = [engine.requests[i] for i in ids]
    while engine.has_work():
        engine.step()
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def case(tiny_llama):
    rng = random.Random(3)
    loop = [rng.randrange(1000, 2000) * 2 for _ in range(6)]
    prompts = [loop * 6, [rng.randrange(49152) for _ in range(40)], loop * 3 + [7, 9]]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=30, ignore_eos=True)
              for t, s in ((0.0, 1), (0.9, 2), (0.6, 3))]
    return tiny_llama, prompts, params


def test_hooks_equal_across_serial_drafted_batched(case):
    path, prompts, params = case
    serial = Engine(path, EngineConfig(drafting=False, max_num_seqs=1, probe=False))
    vocab = serial.tokenizer.vocab_size
    factory = lambda: EvenTokensForceAtFive(vocab)  # noqa: E731
    expected = _run(serial, prompts, params, factory)
    for reply in expected:
        assert all(t % 2 == 0 for t in reply), "mask not applied"
        assert reply[4] == reply[1] + 2, "fix not applied"
    drafted = Engine(path, EngineConfig(drafting=True, max_num_seqs=4, probe=False))
    assert _run(drafted, prompts, params, factory) == expected
    assert drafted.scheduler is not None
    # A pool so small that requests preempt each other and replay.
    tiny = Engine(path, EngineConfig(drafting=True, max_num_seqs=3, context=96, probe=False,
                                     kv_cache_gib=4 * 32 * 2 * 2 * 2 * 16 * 4 / 2**30))
    assert _run(tiny, prompts, params, factory) == expected
    assert tiny.scheduler.num_preemptions > 0
