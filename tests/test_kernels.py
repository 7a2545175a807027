"""The Triton kernels against their torch references, and attention's batch invariance.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before any
kernel module is imported) at tiny sizes; with one, the same tests run compiled, and the
`gpu`-marked tests repeat them at model sizes. Inputs are fresh random draws on every run (the
seed is in each failure message); outputs are NaN-filled before the launch.

The interpreter is patched to compute what the GPU computes (tl.dot, bf16 casts, fp64 exp/log)
for this module only: tests/triton_interpreter.py says how and why.

Contracts: rope, the residual add, sampling (tokens, candidate keys and scores, q-sums) and
verification (draws, accepted lengths, masks) are bitwise; rms_norm and attention against the
reference are float tolerances stated at each assert; attention's batch invariance is bitwise.
"""
import os

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before any `import triton` of a kernel module

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from tensorfold.kernels import reference  # noqa: E402
from tensorfold.kernels import attention_triton as attention  # noqa: E402
from tensorfold.kernels import rms_norm_triton as norm  # noqa: E402
from tensorfold.kernels import sampling_triton as sampling  # noqa: E402
from tensorfold.kernels import verify_triton as verify  # noqa: E402
from tensorfold.kernels.paged_attention import paged_attention_ref  # noqa: E402
from tensorfold.sampling import sampler  # noqa: E402
from tensorfold.sampling.sampler import RowSampling  # noqa: E402
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

DEVICE = "cuda" if HAS_GPU else "cpu"
NAN = float("nan")
INF = float("inf")
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


class Draw:
    """Fresh random inputs with a printable seed."""

    def __init__(self):
        self.seed = int.from_bytes(os.urandom(4), "little")
        self.gen = torch.Generator().manual_seed(self.seed)

    def randn(self, *shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=self.gen) * scale).to(dtype).to(DEVICE)

    def rand(self, *shape):
        return torch.rand(*shape, generator=self.gen)

    def randint(self, high, *shape):
        return torch.randint(0, high, shape, generator=self.gen)

    def __str__(self):
        return f"seed {self.seed}"


@pytest.fixture
def draw():
    return Draw()


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, NAN)


# ---- attention ----

TILES = dict(block_m=16, block_n=16, split_size=32)  # tiny tiles: 2 KV steps per split


def make_cache(draw, num_blocks=16, page=8, kv_heads=2, head_dim=16, dtype=torch.float32):
    k = draw.randn(num_blocks, page, kv_heads, head_dim, dtype=dtype)
    v = draw.randn(num_blocks, page, kv_heads, head_dim, dtype=dtype)
    block_table = torch.randperm(num_blocks, generator=draw.gen).to(DEVICE)  # pages out of order
    return k, v, block_table


def attend(q, k, v, positions, block_table, window, **tiles):
    out = poisoned(q)
    return attention.paged_attention(q, k, v, positions, block_table, 0.25, window, out=out,
                                     workspace_fill=NAN, **{**TILES, **tiles})


def attend_ref(q, k, v, positions, block_table, window):
    return paged_attention_ref(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), block_table.cpu(), 0.25,
                               window).to(q.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("num_rows,start", [(1, 70), (4, 41), (11, 0)])  # decode, verify, prefill
def test_paged_attention_matches_reference(draw, dtype, window, num_rows, start):
    k, v, block_table = make_cache(draw, dtype=dtype)
    q = draw.randn(num_rows, 6, 16, dtype=dtype)  # 6 heads over 2 KV heads: GQA group 3
    positions = torch.arange(start, start + num_rows, device=DEVICE)
    got = attend(q, k, v, positions, block_table, window)
    want = attend_ref(q, k, v, positions, block_table, window)
    # fp32: the online softmax and Triton's sum order differ from the reference by ~1e-7;
    # bf16: P is rounded to bf16 before P @ V (as flash attention does), plus the output rounding.
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"{draw}: {m}")


@pytest.mark.parametrize("window", [None, 13])
def test_attention_row_is_the_same_alone_or_among_others(draw, window):
    """A row's bits do not depend on the rows, sequences, tiles or splits computed beside it."""
    k, v, block_table = make_cache(draw)
    q = draw.randn(30, 6, 16)  # a prefill of positions 41..70 (1, 2 or 3 splits of 32)
    positions = torch.arange(41, 71, device=DEVICE)
    full = attend(q, k, v, positions, block_table, window)
    for row in (0, 13, 29):  # decode rows at positions 41, 54, 70
        alone = attend(q[row:row + 1], k, v, positions[row:row + 1], block_table, window)
        assert torch.equal(alone[0], full[row]), f"{draw}: row {row} alone != in the prefill"
    chunked = torch.cat([attend(q[:7], k, v, positions[:7], block_table, window),  # other tiling
                         attend(q[7:], k, v, positions[7:], block_table, window)])
    assert torch.equal(chunked, full), f"{draw}: chunked prefill != one chunk"
    with pytest.MonkeyPatch.context() as mp:  # a tiny workspace: one launch per tile
        mp.setattr(attention, "WORKSPACE_BYTES", 1)
        assert torch.equal(attend(q[:12], k, v, positions[:12], block_table, window), full[:12]), f"{draw}"

    # Beside another sequence in one launch (its own block table, more splits): unchanged.
    other_q = draw.randn(5, 6, 16)
    other_pos = torch.arange(90, 95, device=DEVICE)  # 3 splits
    other_table = torch.randperm(16, generator=draw.gen).to(DEVICE)
    together = attention.paged_attention_varlen(
        torch.cat([other_q, q]), k, v, torch.cat([other_pos, positions]),
        torch.stack([other_table, block_table]), [0, 5, 35], 0.25, window,
        out=poisoned(torch.cat([other_q, q])), workspace_fill=NAN, **TILES)
    assert torch.equal(together[5:], full), f"{draw}: rows changed beside another sequence"
    assert torch.equal(together[:5], attend(other_q, k, v, other_pos, other_table, window))


def test_attention_invariance_check_can_fail(draw):
    """Negative control: another split size is another reduction order, so the bits move."""
    k, v, block_table = make_cache(draw)
    q = draw.randn(1, 6, 16)
    positions = torch.tensor([70], device=DEVICE)
    a = attend(q, k, v, positions, block_table, None)
    b = attend(q, k, v, positions, block_table, None, split_size=64)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not torch.equal(a, b), f"{draw}: split size 32 and 64 gave the same bits"


# ---- rms_norm, rope ----

def ulp_close(got, want, dtype, msg):
    # fp32: Triton sums the squares in another order than torch (a few ulps);
    # bf16: at most 1 ulp of the output (relative 2^-7) from an fp32 difference at a rounding edge.
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.0, rtol=2 ** -7)
    torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m: f"{msg}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(draw, dtype):
    x, w = draw.randn(9, 96, dtype=dtype, scale=3.0), draw.randn(96, dtype=dtype)
    got = norm.rms_norm(x, w, 1e-6, out=poisoned(x))
    ulp_close(got, reference.rms_norm(x, w, 1e-6), dtype, draw)
    for row in (0, 4, 8):  # alone: the same bits
        assert torch.equal(norm.rms_norm(x[row:row + 1], w, 1e-6)[0], got[row]), f"{draw}: row {row}"
    unaligned = torch.cat([x.new_zeros(1), x[4]])[1:].view(1, 96)  # 2 or 4 bytes past alignment
    assert torch.equal(norm.rms_norm(unaligned, w, 1e-6)[0], got[4]), f"{draw}: unaligned view"
    residual = draw.randn(9, 96, dtype=dtype)
    normed, h = norm.add_rms_norm(x, residual, w, 1e-6)
    want_normed, want_h = norm.add_rms_norm_ref(x, residual, w, 1e-6)
    assert torch.equal(h, want_h), f"{draw}: the fused residual add is not torch's add"
    assert torch.equal(normed, norm.rms_norm(want_h, w, 1e-6)), f"{draw}: fused != unfused"
    ulp_close(normed, want_normed, dtype, draw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_fused_qk_norm_rope(draw, dtype):
    cos, sin = reference.rope_table([10000.0 ** (-i / 8) for i in range(8)], 1.0, 128)
    positions = draw.randint(128, 5)
    cos, sin = cos[positions].to(DEVICE), sin[positions].to(DEVICE)  # [5, 16]
    x = draw.randn(5, 4, 16, dtype=dtype)
    got = norm.apply_rope(x, cos, sin, out=poisoned(x))
    assert torch.equal(got, reference.apply_rope(x, cos, sin)), f"{draw}: rope is not bitwise"
    w = draw.randn(16, dtype=dtype)
    fused = norm.rms_norm_rope(x, w, 1e-6, cos, sin)
    assert torch.equal(fused, norm.apply_rope(norm.rms_norm(x, w, 1e-6), cos, sin)), f"{draw}"
    # the norm inside is a tolerance; rope may amplify its 1 ulp by |cos| + |sin| <= sqrt(2)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.0, rtol=2 ** -6)
    torch.testing.assert_close(fused.float(), norm.rms_norm_rope_ref(x, w, 1e-6, cos, sin).float(),
                               **tol, msg=lambda m: f"{draw}: {m}")


# ---- keyed sampling ----

SMALL = dict(num_candidates=16, chunk=64)  # 4 chunks over a 200-token vocabulary


def mixed_rows(draw, vocab, allowed):
    seed = lambda: int.from_bytes(os.urandom(8), "little")  # noqa: E731
    pos = lambda: int(draw.randint(1 << 30))  # noqa: E731
    return [
        RowSampling(0.0, 0, 1.0, 0.0, seed(), pos()),                     # greedy (ties below)
        RowSampling(0.0, 0, 1.0, 0.0, seed(), pos(), allowed),            # greedy, grammar mask
        RowSampling(0.7, 0, 1.0, 0.0, seed(), pos()),                     # temperature only
        RowSampling(1.0, 0, 1.0, 0.1, seed(), pos(), allowed),            # min_p, masked
        RowSampling(1.0, 5, 1.0, 0.0, seed(), pos()),                     # top-k
        RowSampling(1.3, 0, 0.8, 0.0, seed(), pos()),                     # top-p
        RowSampling(0.5, 40, 0.9, 0.05, seed(), pos(), allowed),          # all cuts, masked
        RowSampling(3.0, 0, 0.995, 0.0, seed(), pos()),                   # nucleus past 16
        RowSampling(1e-3, 3, 0.5, 0.0, seed(), pos()),                    # tiny temperature
    ]


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
    rows = mixed_rows(draw, vocab, allowed)
    logits = sampling_logits(draw, len(rows), vocab)
    want = sampler.sample(logits, rows, SMALL["num_candidates"])
    got = sampling.sample(logits.to(DEVICE), rows, **SMALL)
    assert got == want, f"{draw}: kernel {got} != reference {want}"


def test_candidates_match_reference_bitwise(draw):
    vocab, c = 200, SMALL["num_candidates"]
    allowed = draw.rand(vocab) > 0.4
    rows = [r for r in mixed_rows(draw, vocab, allowed) if r.temperature > 0]
    logits = sampling_logits(draw, len(rows), vocab)
    keys, scores, q_sum, count = sampling.candidates(logits.to(DEVICE), rows, **SMALL)
    x = sampler._masked(logits, rows, 0)
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
        sampling.sample(logits.to(DEVICE), [dataclasses.replace(row, allowed=torch.zeros(40, dtype=torch.bool))],
                        **SMALL)


# ---- grammar-masked verification ----

def test_bitmask_layout_is_xgrammar_s():
    allowed = torch.zeros(2, 70, dtype=torch.bool)
    allowed[0, 37] = True  # word 1, bit 5
    allowed[1, 31] = True  # word 0, bit 31: the sign bit of an int32
    packed = sampling.pack_bitmask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (2, 3)
    assert packed.tolist() == [[0, 32, 0], [-(1 << 31), 0, 0]]
    assert torch.equal(sampling.unpack_bitmask(packed, 70), allowed)


def test_apply_token_bitmask(draw):
    logits = draw.randn(3, 100)  # 100 tokens: the last word is partial
    bitmask = sampling.pack_bitmask(draw.rand(3, 100) > 0.5).to(DEVICE)
    want = verify.apply_token_bitmask_ref(logits, bitmask)
    assert torch.equal(verify.apply_token_bitmask(logits.clone(), bitmask), want), f"{draw}"


def test_verify_matches_reference_bitwise(draw):
    vocab = 160
    path_starts = [0, 3, 6, 8]  # three drafted paths: 2, 2 and 1 drafts, each with a bonus row
    seed = int.from_bytes(os.urandom(8), "little")
    settings = [(0.0, 0, 1.0, 0.0)] * 3 + [(0.8, 0, 1.0, 0.05)] * 3 + [(1.0, 8, 0.9, 0.0)] * 2
    rows = [RowSampling(t, k, p, mp, seed, 100 + i) for i, (t, k, p, mp) in enumerate(settings)]
    logits = draw.randn(8, vocab, scale=2.0).cpu()
    bitmask = sampling.pack_bitmask(draw.rand(8, vocab) > 0.3)
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
    draws, accepted = verify.verify(logits.to(DEVICE), sampling.pack_bitmask(allowed).to(DEVICE),
                                    [9, -1], [0, 2], rows, tile=64)
    assert draws.tolist()[0] == 0 and accepted.tolist() == [0]


# ---- the same checks at model sizes, on a GPU ----

@gpu
@pytest.mark.gpu
def test_gpu_attention_model_size(draw):
    k, v, block_table = make_cache(draw, num_blocks=256, page=16, kv_heads=8, head_dim=128,
                                   dtype=torch.bfloat16)
    q = draw.randn(300, 32, 128, dtype=torch.bfloat16)
    positions = torch.arange(3700, 4000, device=DEVICE)
    full = attention.paged_attention(q, k, v, positions, block_table, 128 ** -0.5, None)
    want = paged_attention_ref(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), block_table.cpu(),
                               128 ** -0.5, None)
    torch.testing.assert_close(full.cpu().float(), want.float(), atol=1.6e-2, rtol=1.6e-2)
    for row in (0, 150, 299):
        alone = attention.paged_attention(q[row:row + 1], k, v, positions[row:row + 1], block_table,
                                          128 ** -0.5, None)
        assert torch.equal(alone[0], full[row]), f"{draw}: row {row}"


@gpu
@pytest.mark.gpu
def test_gpu_rms_norm_and_rope_model_size(draw):
    x, w = draw.randn(257, 4096, dtype=torch.bfloat16), draw.randn(4096, dtype=torch.bfloat16)
    got = norm.rms_norm(x, w, 1e-6)
    ulp_close(got, reference.rms_norm(x, w, 1e-6), torch.bfloat16, draw)
    assert torch.equal(norm.rms_norm(x[100:101], w, 1e-6)[0], got[100])
    cos, sin = reference.rope_table([10000.0 ** (-i / 64) for i in range(64)], 1.0, 4096)
    positions = draw.randint(4096, 257)
    cos, sin = cos[positions].to(DEVICE), sin[positions].to(DEVICE)
    q = draw.randn(257, 32, 128, dtype=torch.bfloat16)
    assert torch.equal(norm.apply_rope(q, cos, sin), reference.apply_rope(q, cos, sin))


@gpu
@pytest.mark.gpu
def test_gpu_sample_and_verify_model_size(draw):
    vocab = 151936
    allowed = draw.rand(vocab) > 0.5
    rows = mixed_rows(draw, vocab, allowed) * 2
    logits = sampling_logits(draw, len(rows), vocab)
    want = sampler.sample(logits, rows)
    assert sampling.sample(logits.to(DEVICE), rows) == want, f"{draw}"
    bitmask = sampling.pack_bitmask(torch.stack([r.allowed if r.allowed is not None else
                                                 torch.ones(vocab, dtype=torch.bool) for r in rows]))
    plain = [dataclasses.replace(r, allowed=None) for r in rows]
    drafts = [t if i % 3 else -1 for i, t in enumerate(want)]
    want_draws, want_accepted = verify.verify_ref(logits, bitmask, drafts, [0, 9, 18], plain)
    got_draws, got_accepted = verify.verify(logits.to(DEVICE), bitmask.to(DEVICE), drafts, [0, 9, 18], plain)
    assert got_draws.tolist() == want_draws and got_accepted.tolist() == want_accepted
