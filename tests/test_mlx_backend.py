"""The mlx backend (tensorfold/mlx, backends/mlx_backend.py) on MLX's CPU device.

- Its exact steps against the torch references, bitwise (the grid integers, K/V on their grids,
  the quantized GEMM of every block type, RMSNorm, attention, exp, SwiGLU, rope); a row's result
  alone == among other rows.
- Across backends: a quantized checkpoint's logits are the cpu backend's, bit for bit, so the
  same token_sha.
- The model against transformers (tiny llama and qwen3): prefill logits, batched paged decode,
  greedy tokens; a Q4_K_M GGUF served as stored.
- Exactness within the backend, through the engine and over HTTP with the openai client:
  concurrent == solo, chunked == whole, drafted == serial, cached prefix == fresh, preempted ==
  uninterrupted; greedy, sampled and grammar-masked rows.
"""
import random

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from engine_cases import check_solo_vs_batched, run  # noqa: E402
from test_quant_gemm import random_generic  # noqa: E402
from tensorfold.api.replies import token_sha  # noqa: E402
from tensorfold.backends import select_backend  # noqa: E402
from tensorfold.engine.engine import Engine, EngineConfig  # noqa: E402
from tensorfold.engine.step_plan import ScheduledRequest, StepPlan  # noqa: E402
from tensorfold.exact import float32 as exact32, grid as tgrid  # noqa: E402
from tensorfold.kernels import paged_attention as pa, quant_gemm, reference  # noqa: E402
from tensorfold.mlx import grid, ops, quant_carried  # noqa: E402
from tensorfold.models.checkpoint import CheckpointError  # noqa: E402
from tensorfold.models.loader import load_checkpoint  # noqa: E402
from tensorfold.models.gguf_quants import quant_weight  # noqa: E402
from tensorfold.models.quantize import QTYPES, gguf_blocks, quantize  # noqa: E402
from tensorfold.sampling.params import SamplingParams  # noqa: E402

SMALL = dict(kv_cache_gib=0.004, context=256)


def mxa(t: torch.Tensor) -> mx.array:
    return ops.from_torch(t)


def back(a: mx.array) -> torch.Tensor:
    return ops.to_torch(a)


def spread(*shape, seed=0) -> torch.Tensor:
    """Random floats over many binades (the grid's rounding and shifts all get exercised)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    return torch.randn(*shape, generator=g) * scale


@pytest.fixture(params=[True, False], ids=["float64-carried", "int64"])
def carrier(request, monkeypatch):
    """Both forms of the exact integers: carried in float64 (MLX's CPU device) and int64 (Metal)."""
    monkeypatch.setattr(grid, "float64_carrier", lambda: request.param)
    return request.param


# ---- the grid, bitwise -----------------------------------------------------------------------

def test_fixed_point_grid_is_the_references(carrier):
    x = spread(9, 64)
    x[0] = 0.0                                     # an all-zero vector
    x[1, :5] = torch.tensor([1e-40, -3e-39, 2.0 ** -149, 0.0, 1.0])  # subnormals beside a normal
    ints, e = tgrid.to_fixed(x, 22)
    got_ints, got_e = grid.to_fixed(mxa(x), 22)
    assert torch.equal(back(got_ints), ints.long()) and torch.equal(back(got_e), e)
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        for bits in (20, 22):
            assert torch.equal(back(grid.on_grid(mxa(y), bits).astype(ops.DTYPES[dtype])), tgrid.on_grid(y, bits))
    lifted = torch.tensor([[1.0 - 2.0 ** -24, 0.25]])  # rounds up to 2^0: the reference's second pass
    assert torch.equal(back(grid.on_grid(mxa(lifted), 20)), tgrid.on_grid(lifted, 20))


def test_float32_of_int_rounds_twice_as_float64_then_float32():
    g = torch.Generator().manual_seed(1)
    t = torch.randint(-(1 << 61), 1 << 61, (4000,), generator=g) >> torch.randint(0, 62, (4000,), generator=g)
    t[:4] = torch.tensor([0, 1, -1, (1 << 61) + (1 << 8) + 1])  # a tie broken by the first rounding
    e = torch.randint(-220, 100, (4000,), generator=g)          # subnormal, normal and overflowing results
    want = (t.double() * tgrid.pow2(e)).float()
    assert torch.equal(back(grid.float32_of_int(mxa(t), mxa(e))), want)


@pytest.mark.parametrize("products", [0, 1 << 18], ids=["limb-matmul", "int64-products"])
def test_int_matmul_is_exact_past_the_limb_chunk(monkeypatch, products):
    """Both forms (limbs in float32 matmuls, K cut into chunks of 1,024; int64 products summed)
    give the exact product, at the operands' full widths."""
    monkeypatch.setattr(grid, "PRODUCT_ELEMENTS", products)
    g = torch.Generator().manual_seed(2)
    a = torch.randint(-(1 << 24), (1 << 24) + 1, (2, 3, 2100), generator=g)
    b = torch.randint(-(1 << 20), (1 << 20) + 1, (2, 2100, 5), generator=g)
    a[0, 0], b[0, :, 0] = 1 << 24, -(1 << 20)
    assert torch.equal(back(grid.int_matmul(mxa(a), mxa(b), 24, 20)), a @ b)


def test_elementwise_steps_are_the_references():
    x = -torch.rand(20000) * 100
    x[:3] = torch.tensor([0.0, -87.0, -float("inf")])
    assert torch.equal(back(grid.exp_neg(mxa(x))), exact32.exp_neg(x.clone()))
    gate, up = spread(300, seed=3), torch.randn(300)
    for dtype in (torch.float32, torch.bfloat16):
        gd, ud = gate.to(dtype), up.to(dtype)
        assert torch.equal(back(ops.silu_and_mul(mxa(gd), mxa(ud))), reference.silu_and_mul(gd, ud))
        assert torch.equal(back(ops.sigmoid_and_mul(mxa(gd), mxa(ud))), reference.sigmoid_and_mul(gd, ud))
    q = torch.randn(7, 4, 32)
    cos, sin = torch.randn(7, 32), torch.randn(7, 32)
    assert torch.equal(back(ops.apply_rope(mxa(q), mxa(cos), mxa(sin))), reference.apply_rope(q, cos, sin))


# ---- the quantized GEMM, bitwise, every block type ---------------------------------------------

@pytest.fixture(scope="module")
def tiny_q4_k_m_gguf(tmp_path_factory, smollm2_tokenizer):
    from tools.tiny_checkpoint import K_QUANT_SIZES, make_tiny_checkpoint, write_tiny_gguf
    hf_dir = make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_tiny_k")), "llama", tokenizer=smollm2_tokenizer,
                                  **K_QUANT_SIZES)
    return write_tiny_gguf(hf_dir, "q4_k_m", str(tmp_path_factory.mktemp("mlx_k_gguf") / "tiny-q4_k_m.gguf"))


def spread_q4_1(n: int, k: int, seed: int) -> quant_gemm.QuantWeight:
    """q4_1 blocks whose scales and minimums span 2^-14..2^14 within a row (negative term shifts)."""
    g = torch.Generator().manual_seed(seed)
    scales = [(torch.rand(n, k // 32, generator=g) + 0.5) * torch.exp2(torch.randint(-14, 14, (n, k // 32), generator=g))
              * torch.where(torch.rand(n, k // 32, generator=g) < 0.5, -1.0, 1.0) for _ in range(2)]
    q = torch.randint(0, 16, (n, k), generator=g)
    return quant_gemm.from_legacy("q4_1", q, scales[0].half(), scales[1].half())


def file_blocks(w: torch.Tensor, kind: str) -> quant_gemm.QuantWeight:
    """w as a GGUF file of `kind` holds it, read back (models/quantize.gguf_blocks, gguf_quants)."""
    return quant_weight(gguf_blocks(w, kind).reshape(-1), QTYPES[kind], tuple(w.shape))


def test_quantized_gemm_is_the_references_for_every_block_type(tiny_q4_k_m_gguf, monkeypatch, carrier):
    """Both forms of the terms (float64-carried on MLX's CPU device, int64 on Metal), every kind:
    the 32-column ones and the K-quants' super-blocks, as files hold them and drawn to their
    bounds (several super-blocks, E and F apart)."""
    g = torch.Generator().manual_seed(4)
    weights = [quantize(torch.randn(40, 96, generator=g), kind) for kind in ("q8_0", "q4_0")]
    weights.append(spread_q4_1(40, 128, seed=5))
    weights += [file_blocks(torch.randn(24, 512, generator=g), kind) for kind in ("q5_1", "q5_k")]
    weights += [random_generic(g, kind, 24, 768) for kind in ("q4_k", "q5_k", "q6_k", "q5_1")]
    stored = load_checkpoint(tiny_q4_k_m_gguf, keep_quantized=True).tensors
    weights += [t.load() if hasattr(t, "load") else t for t in stored.values()]
    kinds = set()
    for w in weights:
        if not isinstance(w, quant_gemm.QuantWeight):
            continue
        kinds.add(w.kind)
        x = spread(11, w.shape[1], seed=len(kinds))
        x[3] = 0.0                                    # a zero row: zero blocks
        want = quant_gemm.linear(x, w)
        parts = ops.QuantParts(w)
        got = ops.quant_linear(mxa(x), parts)
        assert torch.equal(back(got), want), w.kind
        if carrier:  # the exact sums themselves (step 3), which float32 hides: the int64 form's
            rows = mxa(x[:quant_gemm.ROW_CHUNK])
            carried = ops.quant_totals(rows, parts)
            monkeypatch.setattr(grid, "float64_carrier", lambda: False)
            integer = ops.quant_totals(rows, parts)
            monkeypatch.setattr(grid, "float64_carrier", lambda: True)
            assert all(np.array_equal(np.array(c), np.array(i)) for c, i in zip(carried, integer)), w.kind
    assert kinds == set(quant_gemm.KINDS), kinds
    moved = random_generic(g, "q6_k", 4, 512)
    moved.scale_exp[2, 9] -= 1  # E apart within a super-block: refused, not computed per block
    with pytest.raises(ValueError, match="one scale_exp per super-block"):
        ops.QuantParts(moved)


@pytest.mark.parametrize("log_terms", [0, 1, 5, 12])
def test_carried_terms_sum_exactly_in_float64_up_to_the_grids_bound(log_terms):
    """quant_carried.rounded_parts: 2^L terms below the grid's 2^(62 - L) (the largest float64
    below it, ties of both parities, small fractions, either sign) rounded half to even as
    high + low, whose float64 sums are exact (their int64 sum is the exact sum of the rounded
    terms) and whose one rounded addition is the int64 total's float64."""
    from fractions import Fraction
    rng = np.random.default_rng(log_terms)
    n, bound = 1 << log_terms, 2.0 ** (62 - log_terms)
    top = np.nextafter(bound, 0.0)
    cases = [np.full(n, top), np.full(n, -top), np.resize([top, -top, 2.5, -3.5, 0.5], n)]
    spread = rng.uniform(-1, 1, n) * np.exp2(rng.integers(-4, 62 - log_terms, n))   # fractions at every scale
    cases += [spread, np.trunc(spread * 2) / 2, np.where(rng.random(n) < 0.5, top, np.trunc(spread * 2) / 2)]
    for t in cases:
        want = [round(Fraction(v)) for v in t]                        # half to even
        high, low = quant_carried.rounded_parts(mx.array(t, dtype=mx.float64))
        assert [int(h) + int(lo) for h, lo in zip(np.array(high), np.array(low))] == want
        high_sum, low_sum = high.sum(), low.sum()
        assert int(np.array(high_sum)) + int(np.array(low_sum)) == sum(want)
        assert np.array(high_sum + low_sum).item() == float(sum(want))  # int64 to float64: half to even


@pytest.mark.parametrize("kind", list(quant_gemm.KINDS))
def test_packed_sub_block_dots_come_apart_exactly(kind):
    """quant_carried.unpack_fields on words of `count` dots at the kind's bound (and at the
    largest field the packing admits): every dot back, exactly."""
    count, f = quant_carried.PACKING[kind]
    bound = quant_gemm.X_MAX * quant_carried.max_code(kind) * quant_gemm.KINDS[kind].sub
    assert bound < 1 << (f - 1) and bound * sum(1 << (f * i) for i in range(count)) < 1 << 53
    rng = np.random.default_rng(7)
    widest = (1 << (f - 1)) - 1
    fields = rng.integers(-bound, bound + 1, (count, 3, 2, 64))
    fields[..., :8] = np.array([bound, -bound, widest, -widest, 0, 1, -1, bound])[None, None, None, :]
    fields[:, 0, 0, 8:16] = np.array([[bound], [-bound], [bound]][:count])  # alternating signs down a word
    words = sum(fields[i].astype(object) << (f * i) for i in range(count))
    exact = np.array([[[float(w) == w for w in row] for row in s] for s in words])
    fields = np.where(exact[None], fields, 0)                      # words beyond 2^53 (the widest fields) left out
    words = sum(fields[i].astype(np.float64) * 2.0 ** (f * i) for i in range(count))
    got = quant_carried.unpack_fields(mx.array(words, dtype=mx.float64), count, f)
    assert np.array_equal(np.array(got), fields.astype(np.float64))


# ---- the dense GEMM: MLX's matmul in the form the device reads fastest ------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_gemm_rows_keep_their_bits_in_any_batch(dtype):
    """dense_linear's rows alone equal the same rows inside batches of other sizes (what the
    startup probes check on the loaded shapes), its values are the float64 product's to float32
    accuracy rounded to the dtype, and the DenseWeight's rows (an embedding lookup) are the
    matrix's own."""
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(200, 96, generator=gen).to(dtype), torch.randn(64, 96, generator=gen).to(dtype)
    weight = ops.DenseWeight(mxa(w))
    got = back(ops.dense_linear(mxa(x), weight))
    assert got.dtype == dtype and got.shape == (64, 200)
    want = (x.double() @ w.double().T).to(dtype)
    assert torch.allclose(got.double(), want.double(), rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-3)
    for rows in (1, 2, 7, 13, 64):
        assert torch.equal(back(ops.dense_linear(mxa(x[:rows]), weight)), got[:rows])
    assert torch.equal(back(weight.rows(mx.array([3, 0, 199]))), w[[3, 0, 199]])


# ---- RMSNorm and attention: exact int64 sums, the references' float32 finishes -----------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_reference_and_row_invariant(dtype, carrier):
    x, w = spread(16, 256, seed=5).to(dtype), torch.randn(256).to(dtype)
    x[3] = 0.0
    want, got = reference.rms_norm(x, w, 1e-6), back(ops.rms_norm(mxa(x), mxa(w), 1e-6))
    assert torch.equal(got, want)
    for i in (0, 7, 15):
        assert torch.equal(back(ops.rms_norm(mxa(x[i:i + 1]), mxa(w), 1e-6))[0], got[i])


def test_float32_sqrt_is_correctly_rounded_on_both_sides():
    """The norm's root: MLX's float32 sqrt and the reference's sqrt_rn (torch's own float32
    sqrt is not correctly rounded) equal numpy's IEEE square root."""
    x = torch.cat([torch.rand(200000) * 100, torch.rand(1000) * 1e-38, torch.tensor([0.0, 4.0, 3.0e38])])
    want = np.sqrt(x.numpy())
    assert np.array_equal(np.array(mx.sqrt(mxa(x))), want)
    assert np.array_equal(exact32.sqrt_rn(x).numpy(), want)


def _cache_of(k: torch.Tensor, v: torch.Tensor, dtype=torch.float32):
    """An MLX LayerCache holding k, v [L, KVH, D] at slots 0..L-1 (written on their grids) and the
    reference's paged form of the same values."""
    cache = ops.LayerCache(k.shape[0], k.shape[1], k.shape[2], ops.DTYPES[dtype])
    ops.write_kv(cache, mxa(k), mxa(v), mx.arange(k.shape[0]))
    kc = torch.zeros(k.shape[0], 1, *k.shape[1:], dtype=dtype)
    vc = torch.zeros_like(kc)
    pa.write_kv_ref(kc, vc, k, v, torch.arange(k.shape[0]))
    return cache, kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_is_the_references(dtype, carrier):
    k, v = spread(40, 2, 32, seed=6), spread(40, 2, 32, seed=7)
    k[3], v[4, 1] = 0.0, 0.0                                      # zero vectors; one lifted to 2^0:
    v[4, 1, :3] = torch.tensor([1.0 - 2.0 ** -24, 0.25, -1e-40])
    cache, kc, vc = _cache_of(k, v, dtype)
    assert torch.equal(back(cache.k), kc[:, 0]) and torch.equal(back(cache.v), vc[:, 0])
    for stored, exps in ((cache.k, cache.k_exp), (cache.v, cache.v_exp)):  # what attention starts from
        assert torch.equal(back(exps), back(grid.vector_exponent(stored)))


@pytest.mark.parametrize("head_dim", [32, 48])  # scale 2^-2.5 and 1/sqrt(48): not a power of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_the_reference_and_a_row_alone_equals_its_chunk(head_dim, dtype, carrier):
    keys, heads, kv_heads = 70, 4, 2
    g = torch.Generator().manual_seed(head_dim)
    k, v = torch.randn(keys, kv_heads, head_dim, generator=g), torch.randn(keys, kv_heads, head_dim, generator=g)
    q = (torch.randn(20, heads, head_dim, generator=g) * 3).to(dtype)
    positions = np.arange(50, 70)
    cache, kc, vc = _cache_of(k, v, dtype)
    slots = mx.arange(keys)
    scale = head_dim ** -0.5
    got = back(ops.attention(mxa(q), cache, positions, slots, scale, None))
    want = pa.paged_attention_ref(q, kc, vc, torch.from_numpy(positions), torch.arange(keys), scale)
    assert torch.equal(got, want)
    for r in (0, 9, 19):  # one row alone, over the keys it sees
        alone = ops.attention(mxa(q[r:r + 1]), cache, positions[r:r + 1], slots[:positions[r] + 1], scale, None)
        assert torch.equal(back(alone)[0], got[r])
    windowed = back(ops.attention(mxa(q), cache, positions, slots, scale, 16))
    want = pa.paged_attention_ref(q, kc, vc, torch.from_numpy(positions), torch.arange(keys), scale, window=16)
    assert torch.equal(windowed, want)


@pytest.mark.parametrize("keys", [520, 1100])
@pytest.mark.parametrize("window", [None, 700])
def test_attention_past_one_split_of_keys_is_the_reference(carrier, window, keys):
    """More keys than SPLIT_SIZE: the weighted sum in equal chunks (float64-carried: 2 x 260 and
    3 x 367 keys) or limbs (int64), over keys spread across many binades (the weights' shifts and
    the grid's rounding)."""
    heads, kv_heads, head_dim = 4, 2, 32
    k, v = spread(keys, kv_heads, head_dim, seed=11), spread(keys, kv_heads, head_dim, seed=12)
    q = spread(3, heads, head_dim, seed=13) * 1e-5
    positions = np.array([keys // 2, keys - 100, keys - 1])
    cache, kc, vc = _cache_of(k, v)
    got = back(ops.attention(mxa(q), cache, positions, mx.arange(keys), 0.125, window))
    want = pa.paged_attention_ref(q, kc, vc, torch.from_numpy(positions), torch.arange(keys), 0.125, window=window)
    assert torch.equal(got, want)


def test_key_chunks_hold_at_most_a_split_and_pad_less_than_one_key_each():
    """The float64-carried weighted sum is exact only over at most SPLIT_SIZE keys a chunk
    (w v < 2^44 each, the sum below 2^53): a chunk past that could round where the output's
    float32 would rarely show it, so the rule is checked on the sizes themselves."""
    for keys in range(ops.SPLIT_SIZE + 1, 20 * ops.SPLIT_SIZE, 7):
        chunks, size = ops.key_chunks(keys)
        assert size <= ops.SPLIT_SIZE and chunks == -(-keys // ops.SPLIT_SIZE)
        assert 0 <= chunks * size - keys < chunks


# ---- the model against transformers ------------------------------------------------------------

def forward_rows(engine: Engine, pieces, tables) -> np.ndarray:
    """One forward of the engine's MLX model; pieces: (seq, token ids, start, all rows?) as in
    tests/test_models.py. Returns the logits rows (every row of an `all rows` piece, else its last)."""
    runner = engine.runner
    plan = StepPlan([ScheduledRequest(f"s{s}", ids, start, tables[s], [None] * (len(ids) if every else 1))
                     for s, ids, start, every in pieces])
    logits = runner.model.forward(runner._batch(plan), runner.caches)
    return np.array(logits)


def prefill_in_chunks(engine, ids: list, other: list, tables: list, chunk: int):
    """Sequence 0's prompt `ids` prefilled in chunks of `chunk` (table 0), each chunk beside one
    decode row of sequence 1 (`other`, table 1, three tokens of it prefilled first); returns the
    last chunk's last logits row."""
    forward_rows(engine, [(1, other[:3], 0, False)], tables)
    start, other_at, logits = 0, 3, None
    while start < len(ids):
        piece = ids[start:start + chunk]
        logits = forward_rows(engine, [(1, other[other_at:other_at + 1], other_at, False),
                                       (0, piece, start, False)], tables)[-1]
        start, other_at = start + len(piece), other_at + 1
    return logits


@pytest.fixture(params=["tiny_llama", "tiny_qwen3"])
def checkpoint_dir(request):
    return request.getfixturevalue(request.param)


def test_prefill_and_batched_decode_logits_match_transformers(checkpoint_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    engine = Engine(checkpoint_dir, EngineConfig(backend="mlx", probe=False, **SMALL))
    torch.manual_seed(1)
    ids = torch.randint(0, engine.vocab_size, (75,)).tolist()
    got = forward_rows(engine, [(0, ids, 0, True)], [[0, 1, 2]])
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), hf(torch.tensor([ids])).logits[0], atol=1e-4, rtol=0)
    seqs = [torch.randint(0, engine.vocab_size, (n + 4,)).tolist() for n in (40, 7)]
    tables = [[9, 4, 30], [5, 17]]
    forward_rows(engine, [(0, seqs[0][:40], 0, False), (1, seqs[1][:7], 0, False)], tables)
    for step in range(4):
        got = forward_rows(engine, [(1, seqs[1][7 + step:8 + step], 7 + step, True),
                                    (0, seqs[0][40 + step:41 + step], 40 + step, True)], tables)
        for row, (s, n) in enumerate(((1, 8 + step), (0, 41 + step))):
            with torch.no_grad():
                want = hf(torch.tensor([seqs[s][:n]])).logits[0, -1]
            torch.testing.assert_close(torch.from_numpy(got[row]), want, atol=1e-4, rtol=0)


def test_greedy_32_tokens_equal_transformers(checkpoint_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    engine = Engine(checkpoint_dir, EngineConfig(backend="mlx", drafting=False, **SMALL))
    assert engine.exact, engine.probe_failures
    assert engine.info.backend == "mlx" and engine.info.ops == "mlx"
    ids = engine.tokenizer.encode("Once upon a time, in a land far away, there lived")
    got = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert got.token_ids == expected[0, len(ids):].tolist()


def test_q4_k_m_gguf_served_as_stored_gives_the_cpu_backends_logits(tiny_q4_k_m_gguf):
    """GGUF blocks served as stored (Q4_K beside Q6_K parts, a quantized tied head): the same
    weight formats as the cpu backend and, every op following the same references, its logits
    bit for bit: a prefill and decode rows."""
    mlx_engine = Engine(tiny_q4_k_m_gguf, EngineConfig(backend="mlx", drafting=False, **SMALL))
    cpu_engine = Engine(tiny_q4_k_m_gguf, EngineConfig(drafting=False, **SMALL))
    assert mlx_engine.info.weights == cpu_engine.info.weights == {"q4_k": 8, "q6_k": 5}
    assert mlx_engine.exact, mlx_engine.probe_failures
    want, got = Recorder(cpu_engine), Recorder(mlx_engine)
    ids = mlx_engine.tokenizer.encode("The tide came in over the harbor wall")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert mlx_engine.generate(ids, params).token_ids == cpu_engine.generate(ids, params).token_ids
    assert len(want.draws) == 16 and want.draws.keys() == got.draws.keys()
    for key, logits in want.draws.items():
        assert np.array_equal(got.draws[key], logits), f"draw {key}"


def check_quantized_cpu_equals_mlx(path: str, first_prompt: int, quantize: str | None = "q8_0", **config) -> list:
    """`path` quantized at load to `quantize` (or with quantize None a q8_0 GGUF's blocks as
    stored) on both backends: every draw's logits row bitwise equal (batched, chunked, drafted,
    greedy and sampled), so the same token_sha. config: the window and cache (SMALL). Returns the
    engines (cpu, mlx)."""
    config = config or SMALL
    rng = random.Random(1)
    prompts = [[rng.randrange(49152) for _ in range(first_prompt)], [rng.randrange(49152) for _ in range(9)] * 2]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.8, top_k=50, seed=7, max_tokens=8, ignore_eos=True)]
    shas, recorders, engines = [], [], []
    for backend in ("cpu", "mlx"):
        engine = Engine(path, EngineConfig(backend=backend, quantize=quantize, max_tokens_per_step=16, **config))
        assert engine.exact, engine.probe_failures
        assert "q8_0" in engine.backend.describe()["weights"]
        engines.append(engine)
        recorders.append(Recorder(engine))
        shas.append([token_sha(r.output_ids) for r in run(engine, prompts, params)])
    assert shas[0] == shas[1]
    want, got = recorders
    assert len(want.draws) >= 16 and want.draws.keys() == got.draws.keys()
    for key, logits in want.draws.items():
        assert np.array_equal(got.draws[key], logits), f"draw {key}"
    return engines


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_quantized_checkpoints_give_the_cpu_backends_token_sha(request, arch):
    check_quantized_cpu_equals_mlx(request.getfixturevalue(arch), first_prompt=21)


def test_unserved_layer_kinds_are_a_startup_error(tmp_path, smollm2_tokenizer, monkeypatch):
    """The generic MLX decoder names the layer kinds it does not run (GLM-5's latent attention,
    served by its own model class, mlx/glm.py, stands in for a kind no class serves)."""
    from tensorfold.backends import mlx_backend
    from tools.tiny_checkpoint import make_tiny_checkpoint
    monkeypatch.setattr(mlx_backend, "model_class", lambda family: mlx_backend.MLXModel)
    path = make_tiny_checkpoint(str(tmp_path / "glm_moe_dsa"), "glm_moe_dsa", tokenizer=smollm2_tokenizer)
    with pytest.raises(CheckpointError, match=r"mlx backend.*LatentAttentionSpec \+ MLPSpec layers: use --backend cpu"):
        Engine(path, EngineConfig(backend="mlx", **SMALL))


def test_the_devices_float32_check_passes_here_and_can_fail(monkeypatch):
    """The startup check behind the cross-backend claim: MLX's float32 division and sqrt are
    correctly rounded on this device; a sqrt that is not (exp(log(x) / 2)) is caught."""
    from tensorfold.backends import mlx_backend
    assert mlx_backend.ieee_problem() is None
    monkeypatch.setattr(mlx_backend.mx, "sqrt", lambda x: mx.exp(mx.log(x) * 0.5))
    assert mlx_backend.ieee_problem() == "float32 sqrt not correctly rounded"


def test_fused_ops_run_compiled_only_where_compiled_floats_keep_their_bits(monkeypatch):
    """grid.fused compiles an op per shape where fusion_exact holds (it does here: MLX's CPU
    kernels are built without FMA); a device whose compiled a * b + c rounds once (an FMA) fails
    the check, and the op then runs op by op, with the same bits as before."""
    assert grid.fusion_exact()
    x = mxa(spread(5, 64, seed=3))
    w = mxa(spread(64, seed=4))
    fused = np.array(ops.rms_norm(x, w, 1e-6))
    monkeypatch.setattr(grid, "_FUSION_EXACT", {})
    real_compile = mx.compile

    def contracting(fn):  # a compiled a * b + c that rounds once, as an FMA would
        def run(*args):
            if fn.__code__.co_code == (lambda a, b, c: a * b + c).__code__.co_code:
                a, b, c = (np.array(t, dtype=np.float64) for t in args)
                return mx.array((a * b + c).astype(np.float32))
            return real_compile(fn)(*args)
        return run
    monkeypatch.setattr(grid.mx, "compile", contracting)
    assert not grid.fusion_exact()
    calls = []
    monkeypatch.setattr(ops._rms_norm, "fn", lambda *a: calls.append(1) or ops._rms_norm.__wrapped__(*a))
    assert np.array_equal(np.array(ops.rms_norm(x, w, 1e-6)), fused) and calls


def test_metal_shaders_serve_only_where_they_give_the_ops_bits(monkeypatch, tiny_llama):
    """On a Mac the backend checks metal/'s attention and quantized GEMM against the MLX ops at
    load and uses them only if every bit agrees. Here (no Metal) with stand-ins: kernels that
    agree are taken (ops dispatch to them), a kernel one ulp off is refused."""
    from tensorfold.mlx import metal
    plain = {"attention": ops.attention, "quant_linear": ops.quant_linear}
    calls = []

    def as_ops(name, nudge=False):
        def kernel(*args):
            saved, ops.SHADERS = ops.SHADERS, None
            try:
                out = plain[name](*args)
            finally:
                ops.SHADERS = saved
            calls.append(name)
            if nudge:  # one ulp on the first element
                flat = np.array(out.astype(mx.float32)).reshape(-1)
                flat[0] = np.nextafter(flat[0], np.float32(np.inf))
                out = mx.array(flat.reshape(out.shape)).astype(out.dtype)
            return out
        return kernel

    monkeypatch.setattr(ops, "SHADERS", None)
    monkeypatch.setattr(metal, "available", lambda: True)
    for nudged, used in ((True, False), (False, True)):
        monkeypatch.setattr(metal, "attention", as_ops("attention", nudge=nudged))
        monkeypatch.setattr(metal, "quant_linear", as_ops("quant_linear"))
        ops.use_shaders(None)
        engine = Engine(tiny_llama, EngineConfig(backend="mlx", quantize="q8_0", **SMALL))
        assert (ops.SHADERS is metal) == used
        assert {"attention", "quant_linear"} <= set(calls)
        calls.clear()
        run(engine, [[5, 6, 7, 8]], [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)])
        assert bool(calls) == used


def test_backend_choice():
    assert select_backend("mlx") == "mlx"
    assert select_backend("auto") in ("cpu", "cuda")  # not Apple silicon here


# ---- exactness within the backend --------------------------------------------------------------

class Recorder:
    """Each draw's logits row by (request seed, position), as the runner produced it (either
    backend: the model's forward returns an mx.array or a torch tensor)."""

    def __init__(self, engine: Engine):
        self.draws, self.round_sizes = {}, []
        runner = engine.runner
        forward, execute, last = runner.model.forward, runner.execute, {}

        def record_forward(batch, caches):
            last["logits"] = out = forward(batch, caches)
            return out

        def record_execute(plan):
            drawn = execute(plan)
            self.round_sizes.append(len(plan.requests))
            rows = [row for req in plan.requests for row in req.rows]
            logits_rows = last["logits"]
            logits_rows = logits_rows.numpy() if isinstance(logits_rows, torch.Tensor) else np.array(logits_rows)
            for row, logits in zip(rows, logits_rows):
                self.draws[row.seed, row.position] = logits
            return drawn
        runner.model.forward, runner.execute = record_forward, record_execute


def test_replies_equal_solo_serial_vs_batched_chunked_drafted(small_vocab_llama):
    solo = Engine(small_vocab_llama, EngineConfig(backend="mlx", drafting=False, max_num_seqs=1, **SMALL))
    assert solo.exact, solo.probe_failures
    batched = Engine(small_vocab_llama, EngineConfig(backend="mlx", drafting=True, draft_budget=False, max_num_seqs=4,
                                                     max_tokens_per_step=16, probe=False, **SMALL))
    check_solo_vs_batched(solo, batched, Recorder, np.array_equal)


def test_over_http_concurrent_cached_drafted_preempted_equal_solo(tiny_llama):
    """The openai client on a real socket: replies (token_sha, text) equal their solo runs when
    sent together with drafts, when their system prompt is cached (cached_tokens > 0), and when
    a KV pool too small for all of them preempts and replays some."""
    from test_exactness import at_once, complete, serving, user

    system = {"role": "system", "content": "You keep the harbor's logbooks and answer from them. " * 6}
    bodies = [dict(messages=[system, user(f"Question {i}: which ship came in?")], max_tokens=24,
                   temperature=0.8, seed=i, ignore_eos=True) for i in range(4)]
    bodies.append(dict(messages=[user("Count: 1 2 3 4 5 6 7 8 9 10")], max_tokens=32, temperature=0.0))

    def engine(**config):
        return Engine(tiny_llama, EngineConfig(backend="mlx", probe=False, **{**SMALL, **config}))

    with serving(engine(max_num_seqs=1, drafting=False)) as s:
        solo = [complete(s.client, dict(b, draft=False)) for b in bodies]
    # Drafts verified whole (no draft budget): this test is about the verify path's exactness,
    # which must run here whatever a round's rows cost on MLX's CPU device.
    with serving(engine(max_num_seqs=4, max_tokens_per_step=32, draft_budget=False)) as s:
        first = complete(s.client, bodies[0])
        assert (first.sha, first.text) == (solo[0].sha, solo[0].text)
        s.pause()
        calls = at_once([lambda b=b: complete(s.client, b) for b in bodies[1:]])
        s.wait_queued(len(bodies) - 1)
        s.resume()
        got = [c.result() for c in calls]
        assert [(g.sha, g.text) for g in got] == [(r.sha, r.text) for r in solo[1:]]
        assert all(g.cached > 0 for g in got[:3]), "the shared system prompt was not served from the cache"
        assert sum(g.drafted for g in got) > 0
    # One window of blocks (context 192, the pool's floor) for four ~100-token requests: some are
    # preempted and replayed.
    with serving(engine(max_num_seqs=4, max_tokens_per_step=64, kv_cache_gib=1e-6, context=192)) as s:
        assert s.engine.pool.num_blocks == 6
        s.pause()
        calls = at_once([lambda b=b: complete(s.client, b) for b in bodies[:4]])
        s.wait_queued(4)
        s.resume()
        got = [c.result() for c in calls]
        assert [(g.sha, g.text) for g in got] == [(r.sha, r.text) for r in solo[:4]]
        assert s.engine.scheduler.num_preemptions > 0


def test_the_spec_mlx_behaviours_over_http(tiny_llama):
    """The API's MLX rules on --backend mlx: /v1/models lists the aliases and each is accepted;
    completions take token ids (flat or nested), refuse out-of-vocabulary ids with a 400 naming
    the index (streamed or not), and handle a body with messages as chat; a reply limit past the
    window is a 400 with the counts before any token; --parallel's default shares rounds."""
    import re

    from serving import check_error, post, serving
    from tensorfold.server import ServeSettings

    settings = ServeSettings(model=tiny_llama, port=0, served_model_name="tiny", aliases=("mac-alias",),
                             engine=EngineConfig(backend="mlx", probe=False, kv_cache_gib=0.004, context=128))
    with serving(settings) as s:
        assert s.engine.info.backend == "mlx" and s.engine.config.max_num_seqs > 1
        assert {m.id for m in s.client.models.list().data} == {"tiny", "mac-alias"}
        vocab = s.engine.tokenizer.vocab_size
        reply = s.client.completions.create(model="mac-alias", prompt=[1, 2, vocab - 1], max_tokens=2)
        assert reply.usage.prompt_tokens == 3
        nested = post(s, "/v1/completions", {"prompt": [[5, 6, 7, 8]], "max_tokens": 2})
        assert nested.json()["usage"]["prompt_tokens"] == 4
        for stream in (False, True):
            check_error(post(s, "/v1/completions", {"prompt": [5, vocab, 7], "max_tokens": 2, "stream": stream}),
                        400, "prompt[1]")
        chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "seed": 9}
        as_chat = post(s, "/v1/chat/completions", chat).json()
        via_completions = post(s, "/v1/completions", chat).json()
        assert via_completions["object"] == "chat.completion"
        assert via_completions["tensorfold"]["token_sha"] == as_chat["tensorfold"]["token_sha"]
        for stream in (False, True):
            r = post(s, "/v1/completions", {"prompt": list(range(100, 140)), "max_tokens": 100, "stream": stream})
            err = check_error(r, 400, "max_tokens")
            assert err["code"] == "context_length_exceeded"
            assert all(re.search(rf"\b{n}\b", err["message"]) for n in ("128", "140", "40", "100")), err["message"]
