"""The sampling and grammar-masked verification kernels against their torch references, bitwise.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before any
kernel module is imported) at tiny sizes, with tests/triton_interpreter.py's GPU semantics; with
a GPU the same tests run compiled, and the `gpu`-marked test repeats them at model size. Inputs
are fresh random draws on every run (the seed is in each failure message); outputs are NaN-filled
before the launch. The other kernels have their own modules: test_attention_kernel.py,
test_norm_kernels.py, test_exact_math.py (exp64/log64), test_compiled_kernels.py (PTX).

Contracts, all bitwise: sampling (tokens, candidate keys and scores, q-sums, drawable counts) and
verification (draws, accepted lengths, masked logits).
"""
import os

import torch

from kernel_inputs import DEVICE, NAN, gpu  # first: sets TRITON_INTERPRET without a GPU

import pytest  # noqa: E402

from tensorfold.kernels import sampling_triton as sampling  # noqa: E402
from tensorfold.kernels import verify_triton as verify  # noqa: E402
from tensorfold.sampling import bitmask as bits, sampler  # noqa: E402
from tensorfold.sampling.params import RowSampling  # noqa: E402
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

INF = float("inf")



def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, NAN)


# ---- keyed sampling ----

SMALL = dict(num_candidates=16, chunk=64)  # 4 chunks over a 200-token vocabulary


def mixed_rows(draw, vocab, allowed):
    """Rows of every kind, and their bitmask: `allowed` (bool [vocab]) on the masked ones."""
    seed = lambda: int.from_bytes(os.urandom(8), "little")  # noqa: E731
    pos = lambda: int(draw.randint(1 << 30))  # noqa: E731
    rows = [
        (RowSampling(0.0, 0, 1.0, 0.0, seed(), pos()), False),            # greedy (ties below)
        (RowSampling(0.0, 0, 1.0, 0.0, seed(), pos()), True),             # greedy, grammar mask
        (RowSampling(0.7, 0, 1.0, 0.0, seed(), pos()), False),            # temperature only
        (RowSampling(1.0, 0, 1.0, 0.1, seed(), pos()), True),             # min_p, masked
        (RowSampling(1.0, 5, 1.0, 0.0, seed(), pos()), False),            # top-k
        (RowSampling(1.3, 0, 0.8, 0.0, seed(), pos()), False),            # top-p
        (RowSampling(0.5, 40, 0.9, 0.05, seed(), pos()), True),           # all cuts, masked
        (RowSampling(3.0, 0, 0.995, 0.0, seed(), pos()), False),          # nucleus past 16
        (RowSampling(1e-3, 3, 0.5, 0.0, seed(), pos()), False),           # tiny temperature
    ]
    everything = torch.ones(vocab, dtype=torch.bool)
    bitmask = bits.pack(torch.stack([allowed if masked else everything for _, masked in rows]))
    return [r for r, _ in rows], bitmask


def sampling_logits(draw, num_rows, vocab):
    logits = draw.randn(num_rows, vocab, scale=3.0).cpu()
    logits[:, 17] = logits[:, 150] = logits.amax(dim=1) + 1.0  # exact ties: lowest id wins
    logits[:, draw.randint(vocab, 20)] = -INF
    logits[:, 3] = 1e30  # one huge logit in every row...
    logits[2:, 3] = -1e30  # ...but only the greedy rows keep it
    return logits


def test_sample_matches_reference_bitwise(draw):
    vocab = 200
    allowed = draw.rand(vocab) > 0.4
    rows, bitmask = mixed_rows(draw, vocab, allowed)
    logits = sampling_logits(draw, len(rows), vocab)
    want = sampler.sample(logits, rows, SMALL["num_candidates"], bitmask=bitmask)
    got = sampling.sample(logits.to(DEVICE), rows, **SMALL, bitmask=bitmask.to(DEVICE))
    assert got == want, f"{draw}: kernel {got} != reference {want}"


def test_candidates_match_reference_bitwise(draw):
    vocab, c = 200, SMALL["num_candidates"]
    allowed = draw.rand(vocab) > 0.4
    rows, bitmask = mixed_rows(draw, vocab, allowed)
    sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
    rows, bitmask = [rows[i] for i in sampled], bitmask[sampled]
    logits = sampling_logits(draw, len(rows), vocab)
    keys, scores, q_sum, count = sampling.candidates(logits.to(DEVICE), rows, **SMALL, bitmask=bitmask.to(DEVICE))
    x = sampler._masked(logits, bitmask, 0)
    z = sampler._scaled(x, rows)
    q, want_keys = sampler._keys(z, z.amax(dim=1, keepdim=True), torch.arange(vocab))
    ck, ci = want_keys.topk(c, dim=1)
    want_scores = sampler._scores(z.gather(1, ci), rows, ci)
    valid = ck >= 0
    assert torch.equal(keys.cpu(), ck), f"{draw}: candidate keys differ"
    assert torch.equal(scores.cpu()[valid], want_scores[valid]), f"{draw}: candidate scores differ"
    assert torch.equal(q_sum.cpu(), q.sum(dim=1)), f"{draw}: q-sums differ"
    assert torch.equal(count.cpu(), (want_keys >= 0).sum(dim=1)), f"{draw}: drawable counts differ"


def test_sample_edge_values(draw):
    """Signed zeros, +-1e30, -inf and tiny temperatures, as test_sampler's strategies use them."""
    pool = torch.tensor([-INF, -1e30, -50.0, -1.0, -0.0, 0.0, 0.5, 2.0, 7.25, 1e30])
    logits = pool[draw.randint(len(pool), 6, 40)]
    logits[:, 0] = 1.0  # every row drawable
    rows = [RowSampling(t, k, p, mp, int.from_bytes(os.urandom(8), "little"), int(draw.randint(99)))
            for t, k, p, mp in [(0.0, 0, 1.0, 0.0), (1e-3, 0, 1.0, 0.0), (1.0, 2, 1.0, 0.0),
                                (0.7, 0, 0.5, 0.0), (1.9, 0, 1.0, 0.5), (1.0, 0, 0.0, 0.0)]]
    want = sampler.sample(logits, rows, 16)
    assert sampling.sample(logits.to(DEVICE), rows, num_candidates=16, chunk=16) == want, f"{draw}"


def test_sample_rejects_what_the_reference_rejects():
    logits = torch.zeros(1, 40)
    row = RowSampling(1.0, 0, 1.0, 0.0, 1, 0)
    with pytest.raises(ValueError, match="NaN"):
        sampling.sample(torch.full((1, 40), NAN, device=DEVICE), [row], **SMALL)
    with pytest.raises(ValueError, match="no drawable"):
        sampling.sample(logits.to(DEVICE), [row], **SMALL,
                        bitmask=bits.pack(torch.zeros(1, 40, dtype=torch.bool)).to(DEVICE))


# ---- grammar-masked verification ----

def test_bitmask_layout_is_xgrammar_s():
    allowed = torch.zeros(2, 70, dtype=torch.bool)
    allowed[0, 37] = True  # word 1, bit 5
    allowed[1, 31] = True  # word 0, bit 31: the sign bit of an int32
    packed = bits.pack(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (2, 3)
    assert packed.tolist() == [[0, 32, 0], [-(1 << 31), 0, 0]]
    assert torch.equal(bits.unpack(packed, 70), allowed)
    assert torch.equal(bits.unpack(packed, 40, offset=30), allowed[:, 30:70])  # a shard's columns
    assert not bits.unpack(packed, 30, offset=70).any()  # past the words: not allowed


def test_apply_token_bitmask(draw):
    logits = draw.randn(3, 100)  # 100 tokens: the last word is partial
    bitmask = bits.pack(draw.rand(3, 100) > 0.5).to(DEVICE)
    want = verify.apply_token_bitmask_ref(logits, bitmask)
    assert torch.equal(verify.apply_token_bitmask(logits.clone(), bitmask), want), f"{draw}"


def test_verify_matches_reference_bitwise(draw):
    vocab = 160
    path_starts = [0, 3, 6, 8]  # three drafted paths: 2, 2 and 1 drafts, each with a bonus row
    seed = int.from_bytes(os.urandom(8), "little")
    settings = [(0.0, 0, 1.0, 0.0)] * 3 + [(0.8, 0, 1.0, 0.05)] * 3 + [(1.0, 8, 0.9, 0.0)] * 2
    rows = [RowSampling(t, k, p, mp, seed, 100 + i) for i, (t, k, p, mp) in enumerate(settings)]
    logits = draw.randn(8, vocab, scale=2.0).cpu()
    bitmask = bits.pack(draw.rand(8, vocab) > 0.3)
    draws, _ = verify.verify_ref(logits, bitmask, [-1] * 8, path_starts, rows)
    drafts = [draws[0], (draws[1] + 1) % vocab, -1,    # rejected at j = 1
              draws[3], draws[4], -1,                  # all accepted
              (draws[6] + 7) % vocab, -1]              # rejected at j = 0
    want_draws, want_accepted = verify.verify_ref(logits, bitmask, drafts, path_starts, rows)
    got_draws, got_accepted = verify.verify(logits.to(DEVICE), bitmask.to(DEVICE), drafts,
                                            path_starts, rows, tile=64)
    assert got_draws.tolist() == want_draws, f"{draw}"
    assert got_accepted.tolist() == want_accepted == [1, 2, 0], f"{draw}"


def test_verify_rejects_a_draft_the_grammar_forbids(draw):
    logits = torch.zeros(2, 64)
    logits[0, 9] = 5.0  # the unmasked argmax would be 9...
    allowed = torch.ones(2, 64, dtype=torch.bool)
    allowed[0, 9] = False  # ...but the grammar forbids it at row 0
    rows = [RowSampling(0.0, 0, 1.0, 0.0, 1, i) for i in range(2)]
    draws, accepted = verify.verify(logits.to(DEVICE), bits.pack(allowed).to(DEVICE),
                                    [9, -1], [0, 2], rows, tile=64)
    assert draws.tolist()[0] == 0 and accepted.tolist() == [0]


# ---- the same checks at model sizes, on a GPU ----

@gpu
@pytest.mark.gpu
def test_gpu_sample_and_verify_model_size(draw):
    vocab = 151936
    allowed = draw.rand(vocab) > 0.5
    rows, bitmask = mixed_rows(draw, vocab, allowed)
    rows, bitmask = rows * 2, torch.cat([bitmask, bitmask])
    logits = sampling_logits(draw, len(rows), vocab)
    want = sampler.sample(logits, rows, bitmask=bitmask)
    assert sampling.sample(logits.to(DEVICE), rows, bitmask=bitmask.to(DEVICE)) == want, f"{draw}"
    drafts = [t if i % 3 else -1 for i, t in enumerate(want)]
    want_draws, want_accepted = verify.verify_ref(logits, bitmask, drafts, [0, 9, 18], rows)
    got_draws, got_accepted = verify.verify(logits.to(DEVICE), bitmask.to(DEVICE), drafts, [0, 9, 18], rows)
    assert got_draws.tolist() == want_draws and got_accepted.tolist() == want_accepted
