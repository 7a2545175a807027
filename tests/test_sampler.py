"""The keyed sampler against a plain-Python oracle, and sharded draws against one-tensor draws.

The oracle re-derives everything from the rule's text with Python ints, exact fractions and
math.log/exp: the splitmix64 hash, the kept set (sorted by weight, cumulative mass compared as
Fractions) and the Gumbel-max draw.
"""
import dataclasses
import hashlib
import math
import sys
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorfold
from tensorfold.backends import cpu_ops, native_problem
from tensorfold.sampling import bitmask as bits, keyed, sampler
from tensorfold.sampling.params import SamplingParams
from tensorfold.sampling.params import RowSampling as PlainRow


@dataclasses.dataclass(frozen=True)
class RowSampling(PlainRow):
    """A row with its allowed-token mask beside it (bool [vocab] or None), as the oracle reads it;
    the sampler gets the masks as the one batch bitmask the engine builds (sampling/bitmask.py)."""
    allowed: torch.Tensor | None = dataclasses.field(default=None, compare=False, repr=False)


def _bitmask(rows, vocab):
    if all(r.allowed is None for r in rows):
        return None
    return bits.pack(torch.stack([r.allowed if r.allowed is not None else torch.ones(vocab, dtype=torch.bool)
                                  for r in rows]))


def sample(logits, rows, **kwargs):
    return sampler.sample(logits, rows, bitmask=_bitmask(rows, logits.shape[1]), **kwargs)


def sample_sharded(shards, rows, **kwargs):
    vocab = sum(x.shape[1] for x in shards)
    return sampler.sample_sharded(shards, rows, bitmask=_bitmask(rows, vocab), **kwargs)


def kept_mask(logits, rows):
    return sampler.kept_mask(logits, rows, _bitmask(rows, logits.shape[1]))

M64 = (1 << 64) - 1
INF = float("inf")


# ---- the oracle ----

def mix64_ref(x):
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def gumbel_ref(seed, position, v):
    key = mix64_ref((mix64_ref(seed) + (position + 1) * 0xD1B54A32D192ED03) & M64)
    h = mix64_ref((key + (v + 1) * 0x9E3779B97F4A7C15) & M64)
    u = (2 * (h >> 12) + 1) / 2.0 ** 53
    return -math.log(-math.log(u))


def drawable_ref(logits, row):
    return [v for v, x in enumerate(logits)
            if x != -INF and (row.allowed is None or bool(row.allowed[v]))]


def kept_ref(logits, row):
    """The kept set of one row, straight from the rule's text."""
    tokens = drawable_ref(logits, row)
    if row.temperature == 0:
        best = max(logits[v] for v in tokens)
        return {min(v for v in tokens if logits[v] == best)}
    z = {v: logits[v] / row.temperature for v in tokens}
    m = max(z.values())
    q = {v: math.floor(math.exp(z[v] - m) * 2 ** 32) for v in tokens}
    order = sorted(tokens, key=lambda v: (-q[v], v))
    if row.top_k > 0:
        order = order[:row.top_k]
    if row.top_p < 1:
        p = Fraction(math.floor(Fraction(row.top_p) * 2 ** 40), 2 ** 40)
        total = sum(q[v] for v in order)
        kept, mass = [], 0
        for i, v in enumerate(order):
            if i == 0 or Fraction(mass) < total * p:
                kept.append(v)
            mass += q[v]
        order = kept
    floor_q = math.floor(Fraction(row.min_p) * 2 ** 32)
    return {v for v in order if q[v] >= floor_q}


def sample_ref(logits, row):
    kept = kept_ref(logits, row)
    if row.temperature == 0:
        return kept.pop()
    score = {v: logits[v] / row.temperature + gumbel_ref(row.seed, row.position, v) for v in kept}
    return max(kept, key=lambda v: (score[v], -v))


# ---- strategies ----

TIE_VALUES = [-INF, -1e30, -50.0, -3.0, -1.0, -0.0, 0.0, 0.5, 2.0, 2.0, 7.25, 1e30]


@st.composite
def cases(draw, max_vocab=60):
    vocab = draw(st.integers(2, max_vocab))
    num_rows = draw(st.integers(1, 4))
    pool = st.one_of(st.sampled_from(TIE_VALUES),
                     st.floats(-20, 20, allow_nan=False, width=32))
    logits = torch.tensor(draw(st.lists(st.lists(pool, min_size=vocab, max_size=vocab),
                                        min_size=num_rows, max_size=num_rows)),
                          dtype=torch.float32)
    rows = []
    for i in range(num_rows):
        allowed = None
        if draw(st.booleans()):
            allowed = torch.tensor(draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab)))
        drawable = [v for v in range(vocab) if logits[i, v] != -INF
                    and (allowed is None or allowed[v])]
        if not drawable:  # keep every row drawable; the no-token error is tested apart
            logits[i, 0] = 1.0
            if allowed is not None:
                allowed[0] = True
        rows.append(RowSampling(
            temperature=draw(st.sampled_from([0.0, 1.0, 0.7, 1.9, 1e-3])
                             | st.floats(0.05, 3.0)),
            top_k=draw(st.sampled_from([0, -1, 1, 2, 3]) | st.integers(-2, vocab + 3)),
            top_p=draw(st.sampled_from([1.0, 0.0, 0.5, 0.9, 0.99, 1 - 2 ** -40])
                       | st.floats(0.0, 1.0)),
            min_p=draw(st.sampled_from([0.0, 0.0, 0.05, 0.5, 1.0]) | st.floats(0.0, 1.0)),
            seed=draw(st.integers(0, M64)),
            position=draw(st.integers(0, 1 << 40)),
            allowed=allowed))
    return logits, rows


def splits(vocab, num_shards, data):
    """Cut points of `num_shards` contiguous non-empty shards (as even as a draw makes them)."""
    cuts = sorted(data.draw(st.lists(st.integers(1, vocab - 1), min_size=num_shards - 1,
                                     max_size=num_shards - 1, unique=True)))
    return list(zip([0] + cuts, cuts + [vocab]))


FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- the rule against the oracle ----

@FAST
@given(cases())
def test_kept_set_matches_oracle(case):
    logits, rows = case
    mask = kept_mask(logits, rows)
    for i, row in enumerate(rows):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == kept_ref(logits[i].tolist(), row)


def with_seeds(logits, rows, num_seeds):
    """Each row repeated under `num_seeds` seeds, so a wrong kept set shows in some draw."""
    tiled = logits.repeat_interleave(num_seeds, dim=0)
    return tiled, [dataclasses.replace(r, seed=(r.seed + 7919 * s) & M64)
                   for r in rows for s in range(num_seeds)]


@FAST
@given(cases(), st.sampled_from([1, 2, 3, 8, 1024]))
def test_draw_matches_oracle(case, num_candidates):
    logits, rows = with_seeds(*case, num_seeds=6)
    expected = [sample_ref(logits[i].tolist(), row) for i, row in enumerate(rows)]
    assert sample(logits, rows, num_candidates=num_candidates) == expected


def test_top_k_beyond_candidates_with_top_p():
    # top-k keeps more than the candidates hold, so the top-p mass Z is unknown from them.
    logits = torch.linspace(3, 0, 40).reshape(1, -1)
    rows = [RowSampling(1.0, 20, 0.6, 0.0, seed=s, position=0) for s in range(200)]
    tiled = logits.expand(200, -1)
    expected = [sample_ref(logits[0].tolist(), r) for r in rows]
    assert sample(tiled, rows, num_candidates=4) == expected
    assert sample_sharded([tiled[:, :15], tiled[:, 15:]], rows, num_candidates=4) == expected


# ---- shards ----

@FAST
@given(cases(), st.sampled_from([1, 2, 3, 1024]), st.data())
def test_sharded_equals_one_tensor(case, num_candidates, data):
    logits, rows = with_seeds(*case, num_seeds=3)
    vocab = logits.shape[1]
    expected = sample(logits, rows, num_candidates=num_candidates)
    for num_shards in (2, 3, 4):
        if num_shards > vocab:
            continue
        shards = [logits[:, a:b] for a, b in splits(vocab, num_shards, data)]
        assert sample_sharded(shards, rows, num_candidates=num_candidates) == expected, num_shards


def test_top_p_fixed_point_boundary():
    # Four equal weights q = 2^32, Z = 2^34. P40 = 2^39 + 1 puts the threshold a hair above
    # 2^33, so the third token (mass before it exactly 2^33) is kept; P40 = 2^39 drops it, and
    # top_p = 0.5 + 2^-41 floors to P40 = 2^39. Two candidates see mass 2^33 = threshold - 1:
    # the third token must still be fetched.
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, -INF, -INF]])
    for top_p, kept in [(0.5 + 2.0 ** -40, {0, 1, 2}), (0.5, {0, 1}), (0.5 + 2.0 ** -41, {0, 1})]:
        rows = [RowSampling(1.0, 0, top_p, 0.0, seed=s, position=0) for s in range(60)]
        tiled = logits.expand(60, -1)
        assert set(torch.nonzero(kept_mask(logits, rows[:1])[0]).flatten().tolist()) == kept
        assert kept_ref(logits[0].tolist(), rows[0]) == kept
        expected = [sample_ref(logits[0].tolist(), r) for r in rows]
        assert set(expected) == kept
        for c in (1, 2, 3, 1024):
            assert sample(tiled, rows, num_candidates=c) == expected
            for cut in ([2], [1, 3], [3, 4, 5]):
                shards = [tiled[:, a:b] for a, b in zip([0] + cut, cut + [6])]
                assert sample_sharded(shards, rows, num_candidates=c) == expected


def test_weights_are_floored():
    # q = floor(exp(z - m) * 2^32): min_p exactly one above the floor drops the token.
    x = math.exp(-1.0) * 2 ** 32
    assert 0.1 < x - math.floor(x) < 0.9
    logits = torch.tensor([[0.0, -1.0]])
    for min_q, kept in [(math.floor(x), {0, 1}), (math.floor(x) + 1, {0})]:
        row = RowSampling(1.0, 0, 1.0, min_q / 2 ** 32, seed=0, position=0)
        assert set(torch.nonzero(kept_mask(logits, [row])[0]).flatten().tolist()) == kept


def test_cut_boundaries_grid():
    # Every top-k around the candidate count, with and without top-p and min-p cuts.
    logits = torch.linspace(1.5, 0, 12).reshape(1, -1)
    num = 30
    tiled = logits.expand(num, -1)
    for c in (1, 2, 3, 4):
        for top_k in range(0, c + 3):
            for top_p in (1.0, 0.7):
                for min_p in (0.0, 0.3):
                    rows = [RowSampling(1.0, top_k, top_p, min_p, seed=s, position=c)
                            for s in range(num)]
                    expected = [sample_ref(logits[0].tolist(), r) for r in rows]
                    assert sample(tiled, rows, num_candidates=c) == expected
                    shards = [tiled[:, :5], tiled[:, 5:7], tiled[:, 7:]]
                    assert sample_sharded(shards, rows, num_candidates=c) == expected


def test_sharded_ties_across_boundaries():
    # Equal logits on both sides of every boundary: ties must go to the lowest global id.
    logits = torch.tensor([[0.0, 5.0, 5.0, 5.0, 5.0, 1.0, 5.0]])
    greedy = [RowSampling(0.0, 0, 1.0, 0.0, seed=1, position=0)]
    for shards in ([logits[:, :2], logits[:, 2:]], [logits[:, :1], logits[:, 1:2], logits[:, 2:]]):
        assert sample_sharded(shards, greedy) == [1]
    for seed in range(50):
        rows = [RowSampling(1.0, 2, 0.5, 0.0, seed=seed, position=seed),
                RowSampling(0.5, 0, 0.9, 0.2, seed=seed, position=3)]
        tiled = torch.cat([logits, logits])
        expected = [sample_ref(logits[0].tolist(), r) for r in rows]
        assert sample(tiled, rows, num_candidates=2) == expected
        for cut in ([2, 4], [1, 3, 5], [3]):
            bounds = list(zip([0] + cut, cut + [7]))
            shards = [tiled[:, a:b] for a, b in bounds]
            assert sample_sharded(shards, rows, num_candidates=2) == expected


def test_large_vocab_uneven_shards_with_default_candidates():
    # 1024 candidates per shard: a peaked row decides on them, a flat nucleus falls back.
    gen = torch.Generator().manual_seed(7)
    vocab = 5003
    logits = torch.randn(4, vocab, generator=gen) * torch.tensor([[6.0], [0.3], [2.0], [1.0]])
    logits[2, 100:140] = logits[2, 99]          # a block of ties
    logits[3, 1000:3000] = -INF
    rows = [RowSampling(1.0, 0, 0.9, 0.0, seed=11, position=5),
            RowSampling(1.0, 0, 0.95, 0.0, seed=12, position=5),
            RowSampling(0.8, 2000, 0.97, 0.01, seed=13, position=9),
            RowSampling(1.3, 0, 1.0, 0.02, seed=14, position=9)]
    expected = [sample_ref(logits[i].tolist(), r) for i, r in enumerate(rows)]
    assert sample(logits, rows) == expected
    for cut in ([2500], [1000, 1001], [1, 2000, 4000]):
        bounds = list(zip([0] + cut, cut + [vocab]))
        assert sample_sharded([logits[:, a:b] for a, b in bounds], rows) == expected


def test_fallback_path_is_taken_and_agrees(monkeypatch):
    # A flat row whose nucleus runs far past 4 candidates must be decided on whole rows.
    seen = []
    decide = sampler._decide

    def spy(*args):
        keep, decided = decide(*args)
        seen.extend(decided.tolist())
        return keep, decided

    monkeypatch.setattr(sampler, "_decide", spy)
    logits = torch.linspace(0, 1, 300).reshape(1, -1)
    rows = [RowSampling(1.0, 0, 0.9, 0.0, seed=3, position=1)]
    expected = [sample_ref(logits[0].tolist(), rows[0])]
    assert sample(logits, rows, num_candidates=4) == expected
    assert sample_sharded([logits[:, :100], logits[:, 100:]], rows, num_candidates=4) == expected
    assert False in seen and True in seen


# ---- keyed noise and seeds ----

def test_hash_and_uniform_match_python_ints():
    gen = torch.Generator().manual_seed(0)
    seeds = [0, 1, M64, 1 << 63, 12345678901234567890]
    positions = [0, 1, 7, 1 << 40, 99]
    ids = torch.cat([torch.arange(50), torch.randint(0, 1 << 30, (50,), generator=gen)])
    keys = keyed.row_keys(seeds, positions)
    words = keyed.token_hash(keys, ids.reshape(1, -1))
    g = keyed.gumbel(keys, ids.reshape(1, -1))
    for r, (s, p) in enumerate(zip(seeds, positions)):
        for c, v in enumerate(ids.tolist()):
            key = mix64_ref((mix64_ref(s) + (p + 1) * 0xD1B54A32D192ED03) & M64)
            assert words[r, c].item() & M64 == mix64_ref((key + (v + 1) * 0x9E3779B97F4A7C15) & M64)
            # the sampler's log (exact.float64.log64) and libm's may differ in the last ulp: the bits
            # are checked for layout independence by the shard tests, the value here
            assert g[r, c].item() == pytest.approx(gumbel_ref(s, p, v), rel=1e-14, abs=1e-15)
    u = keyed.uniform(torch.tensor([0, -1, 1 << 62, -(1 << 63)]))
    assert 0 < u.min() and u.max() < 1 and u.max() == 1 - 2.0 ** -53 and u.min() == 2.0 ** -53


def test_seed_derivation():
    ids = [1, 22, 333]
    assert keyed.derive_seed(ids) == int.from_bytes(hashlib.sha256(b"1,22,333").digest()[:8], "big")
    assert keyed.derive_seed(ids) != keyed.derive_seed([1, 22, 334])
    assert keyed.request_seed(None, ids) == keyed.derive_seed(ids)
    assert keyed.request_seed(5, ids) == 5
    assert keyed.request_seed(-1, ids) == M64
    assert keyed.request_seed(1 << 64, ids) == 0
    with pytest.raises(TypeError):
        keyed.request_seed(True, ids)


def test_same_key_same_token_regardless_of_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 1000, generator=gen) * 2
    rows = [RowSampling(1.0, 40, 0.9, 0.0, seed=100 + i, position=i) for i in range(6)]
    solo = [sample(logits[i:i + 1], [rows[i]])[0] for i in range(6)]
    assert sample(logits, rows) == solo
    perm = [4, 1, 5, 0, 3, 2]
    assert sample(logits[perm], [rows[i] for i in perm]) == [solo[i] for i in perm]
    assert sample(logits, rows) == sample(logits, rows)


def test_different_seeds_and_positions_draw_differently():
    logits = torch.zeros(1, 1000)
    by_seed = {sample(logits, [RowSampling(1.0, 0, 1.0, 0.0, seed=s, position=0)])[0]
               for s in range(200)}
    by_pos = {sample(logits, [RowSampling(1.0, 0, 1.0, 0.0, seed=0, position=p)])[0]
              for p in range(200)}
    assert len(by_seed) > 150 and len(by_pos) > 150


def chi_square(counts, probs):
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("top_k", [0, 3])
def test_draws_follow_softmax(top_k):
    # Gumbel-max over many keys reproduces softmax (renormalised over the top-k).
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    num = 20000
    rows = [RowSampling(1.0, top_k, 1.0, 0.0, seed=s, position=s % 97) for s in range(num)]
    tokens = sample(base.expand(num, -1), rows)
    p = torch.softmax(base.double(), 0)
    if top_k:
        p[top_k:] = 0
        p /= p.sum()
    counts = [tokens.count(v) for v in range(6)]
    support = [v for v in range(6) if p[v] > 0]
    assert all(counts[v] == 0 for v in range(6) if p[v] == 0)
    # 5 or 2 degrees of freedom: 30 is far in the tail (p < 1e-4); a wrong sign or a missing log
    # moves it by thousands.
    assert chi_square([counts[v] for v in support], [p[v].item() for v in support]) < 30


# ---- greedy, masks, errors ----

def test_greedy_ties_to_lowest_id_and_signed_zero():
    rows = [RowSampling(0.0, 0, 1.0, 0.0, seed=0, position=0)] * 3
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [-0.0, 0.0, -1.0, -INF], [-INF, -INF, 3.0, 3.0]])
    assert sample(logits, rows) == [1, 0, 2]
    assert sample_sharded([logits[:, :1], logits[:, 1:3], logits[:, 3:]], rows) == [1, 0, 2]


def test_mask_excludes_tokens():
    logits = torch.tensor([[9.0, 8.0, 1.0, 7.0, 0.0]])
    allowed = torch.tensor([False, True, True, False, True])
    greedy = RowSampling(0.0, 0, 1.0, 0.0, seed=0, position=0, allowed=allowed)
    assert sample(logits, [greedy]) == [1]
    drawn = {sample(logits, [RowSampling(3.0, 0, 1.0, 0.0, seed=s, position=0, allowed=allowed)])[0]
             for s in range(300)}
    assert drawn == {1, 2, 4}
    # a 2-shard layout slices the same global mask
    rows = [RowSampling(3.0, 2, 1.0, 0.0, seed=s, position=0, allowed=allowed) for s in range(50)]
    tiled = logits.expand(50, -1)
    assert sample_sharded([tiled[:, :2], tiled[:, 2:]], rows) == sample(tiled, rows)


def test_rejects_bad_input():
    row = RowSampling(1.0, 0, 1.0, 0.0, seed=0, position=0)
    with pytest.raises(ValueError):
        sample(torch.tensor([[0.0, float("nan")]]), [row])
    with pytest.raises(ValueError):
        sample(torch.tensor([[-INF, -INF]]), [row])
    none = RowSampling(0.0, 0, 1.0, 0.0, seed=0, position=0, allowed=torch.tensor([False, False]))
    with pytest.raises(ValueError):
        sample(torch.tensor([[1.0, 2.0]]), [none])
    with pytest.raises(ValueError):
        sample_sharded([torch.tensor([[-INF]]), torch.tensor([[-INF]])], [row])
    with pytest.raises(ValueError):
        RowSampling(1.0, 0, 1.5, 0.0, seed=0, position=0)
    with pytest.raises(ValueError):
        RowSampling(-1.0, 0, 1.0, 0.0, seed=0, position=0)


def test_row_from_params():
    params = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, min_p=0.1, seed=None)
    row = RowSampling.of(params, seed=keyed.request_seed(params.seed, [1, 2]), position=4)
    assert (row.temperature, row.top_k, row.top_p, row.min_p) == (0.7, 20, 0.8, 0.1)
    assert row.position == 4
    assert row.seed == keyed.derive_seed([1, 2])


# ---- the native draw (csrc/cpu/draw.cpp) against the torch steps ----

native_only = pytest.mark.skipif(native_problem() is not None, reason=str(native_problem()))
if native_problem() is None:
    from tensorfold import _cpu


def _random_rows(gen, count, temps, min_ps):
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    return [PlainRow(pick(temps), 0, 1.0, pick(min_ps), int(torch.randint(2 ** 62, (1,), generator=gen)),
                     int(torch.randint(5000, (1,), generator=gen))) for _ in range(count)]


@native_only
@pytest.mark.parametrize("scale", [0.3, 4.0, 40.0, 1e12])
def test_native_draw_equals_the_torch_steps(draw, scale):
    """Greedy and order-free sampled rows (min-p on and off, masks, -inf columns), flat to very
    peaked logits and logits past 2^40 (where the kernel computes every token's noise): the one
    C++ call draws the torch steps' tokens. Order-dependent rows never reach it."""
    gen = draw.gen
    for trial in range(40):
        num_rows, vocab = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 9000, (1,), generator=gen))
        logits = torch.randn(num_rows, vocab, generator=gen) * scale
        if trial % 3 == 0:
            logits[:, ::4] = -INF
        rows = _random_rows(gen, num_rows, [0.0, 0.05, 0.7, 1.0, 3.0], [0.0, 0.0, 0.1, 1.0])
        mask = None
        if trial % 4 == 1:
            allowed = torch.rand(num_rows, vocab, generator=gen) < 0.5
            allowed[:, 0] = True
            logits[:, 0] = logits[:, 0].clamp(min=-1e30)
            mask = bits.pack(allowed)
        assert sampler.sample(logits, rows, bitmask=mask, native=_cpu) == sampler.sample(logits, rows, bitmask=mask), \
            f"{draw} trial {trial}"


@native_only
def test_native_draw_raises_what_the_torch_steps_raise():
    greedy, hot = PlainRow(0.0, 0, 1.0, 0.0, 1, 0), PlainRow(1e-310, 0, 1.0, 0.0, 1, 0)
    plain = PlainRow(1.0, 0, 1.0, 0.0, 1, 0)
    cases = [
        (torch.tensor([[0.0, float("nan")], [1.0, 2.0]]), [plain, greedy], None, "NaN"),
        (torch.tensor([[1.0, 2.0], [0.0, float("nan")]]), [greedy, greedy], None, "NaN"),
        (torch.tensor([[1.0, 3.0]]), [hot], None, "+inf"),
        (torch.tensor([[float("inf"), 3.0]]), [plain], None, "+inf"),
        (torch.tensor([[-INF, -INF]]), [plain], None, "no drawable"),
        (torch.tensor([[-INF, -INF]]), [greedy], None, "no drawable"),
        (torch.tensor([[1.0, 2.0]]), [greedy], bits.pack(torch.tensor([[False, False]])), "no drawable"),
        (torch.tensor([[float("nan"), 2.0]]), [plain], bits.pack(torch.tensor([[False, True]])), "NaN"),
    ]
    for logits, rows, mask, words in cases:
        for native in (_cpu, None):
            with pytest.raises(ValueError, match=words.replace("+", r"\+")):
                sampler.sample(logits, rows, bitmask=mask, native=native)


@native_only
def test_top_k_or_top_p_rows_take_the_torch_steps():
    """A batch with an order-dependent row is drawn by the tensor steps (the heads and cuts);
    the native draw is not called for it."""
    called = []

    class Spy:
        def __getattr__(self, name):
            if name == "draw_rows":
                called.append(name)
            return getattr(_cpu, name)

    logits = torch.randn(2, 500)
    sampler.sample(logits, [PlainRow(0.0, 0, 1.0, 0.0, 1, 0), PlainRow(1.0, 40, 1.0, 0.0, 1, 0)], native=Spy())
    assert called == []
    sampler.sample(logits, [PlainRow(0.0, 0, 1.0, 0.0, 1, 0), PlainRow(1.0, 0, 1.0, 0.2, 1, 0)], native=Spy())
    assert called == ["draw_rows"]


def _untouchable(name):
    def called(*args, **kwargs):
        raise AssertionError(f"tensorfold._cpu.{name} was used")
    return called


class _Untouchable:
    """Stands in for tensorfold._cpu: any use of it fails."""

    def __getattr__(self, name):
        _untouchable(name)()


def test_torch_op_set_draws_without_the_extension(monkeypatch):
    """The torch op set (TENSORFOLD_CPU_OPS=torch) draws greedy, order-free, min-p, top-k and top-p
    rows, masked or not, without touching tensorfold._cpu, and draws the native op set's tokens
    where the extension is built."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 3000, generator=gen) * 3
    logits[:, ::5] = -INF
    rows = [PlainRow(0.0, 0, 1.0, 0.0, 1, 3), PlainRow(0.8, 0, 1.0, 0.0, 2, 4), PlainRow(1.0, 0, 1.0, 0.1, 3, 5),
            PlainRow(1.0, 40, 1.0, 0.0, 4, 6), PlainRow(0.7, 0, 0.9, 0.0, 5, 7), PlainRow(1.2, 100, 0.95, 0.05, 6, 8)]
    allowed = torch.rand(6, 3000, generator=gen) < 0.7
    allowed[:, 1] = True
    # with order-dependent rows (the torch steps), and without (natively one draw_rows call)
    batches = [(rows, None), (rows, bits.pack(allowed)), (rows[:3], None), (rows[:3], bits.pack(allowed[:3]))]
    want = None
    if native_problem() is None:
        from tensorfold.backends import native_ops
        want = [native_ops.sample(logits[:len(r)], r, bitmask=m) for r, m in batches]
        for name in ("draw_rows", "sample_keys", "top_keys", "gumbel", "exp64", "log64"):  # held references
            monkeypatch.setattr(_cpu, name, _untouchable(name))
    monkeypatch.setitem(sys.modules, "tensorfold._cpu", _Untouchable())  # and imports from now on
    monkeypatch.setattr(tensorfold, "_cpu", _Untouchable(), raising=False)
    with pytest.raises(AssertionError, match="_cpu.draw_rows"):  # the stand-in does catch a use
        sampler.sample(logits[:3], rows[:3], native=sys.modules["tensorfold._cpu"])
    got = [cpu_ops.sample(logits[:len(r)], r, bitmask=m) for r, m in batches]
    assert len(set(t for draw in got for t in draw)) > 6  # not all one token
    if want is not None:
        assert got == want
