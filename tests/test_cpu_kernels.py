"""The C++ cpu kernels (csrc/cpu, tensorfold._cpu) against their torch references, bit for bit.

Fresh random inputs every run (the seed is in the failure message), outputs NaN-poisoned
before each call, odd shapes, float32 and bfloat16 (the KV cache's dtype also apart from the
activations'), 1 and 2 threads. The GEMM is also checked for what makes it exact: a row alone
equals the same row among 2..64 others, at any place. The sampler's vocabulary-wide steps
(exp64, log64, Gumbel noise, weights and order keys, the head selection) are checked against
their torch steps too.
"""
import pytest
import torch

from kernel_inputs import K_TOP, NAN, Q_TOP, V_TOP, at_the_top
from tensorfold.backends import native_problem
from tensorfold.exact import float64
from tensorfold.kernels import paged_attention as attention_ref
from tensorfold.kernels import reference
from tensorfold.sampling import keyed

pytestmark = pytest.mark.skipif(native_problem() is not None, reason=str(native_problem()))
if native_problem() is None:
    from tensorfold import _cpu

DTYPES = (torch.float32, torch.bfloat16)
QUANT_KINDS = ["q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q5_1"]  # quant_gemm.TYPES
# (activations, KV cache): the cache's dtype is its own (EngineConfig.kv_dtype)
KV_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
            (torch.bfloat16, torch.float32)]
KV_IDS = ["f32", "bf16", "f32-bf16cache", "bf16-f32cache"]


def randn(draw, *shape, dtype=torch.float32, scale=1.0):
    return draw.randn(*shape, dtype=dtype, scale=scale).cpu()


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, NAN, dtype=like.dtype)


def assert_bitwise(got, want, draw, what=""):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got, want), f"{what} differs from its reference ({draw}); max abs diff " \
                                   f"{(got.float() - want.float()).abs().max().item()}"


# ---- GEMM ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 40, 64), (2, 7, 15), (3, 129, 16), (5, 33, 576),
                                   (13, 100, 200), (64, 9, 33), (17, 300, 1536)])
def test_linear_equals_reference(draw, threads, dtype, m, n, k):
    x, w = randn(draw, m, k, dtype=dtype), randn(draw, n, k, dtype=dtype)
    want = reference.linear(x, w)
    out = poisoned(want)
    _cpu.linear(x, w, out=out)
    assert_bitwise(out, want, draw, "linear")


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_alone_equals_row_among_others(draw, threads, dtype):
    n, k = 200, 576
    w = randn(draw, n, k, dtype=dtype)
    row = randn(draw, 1, k, dtype=dtype, scale=3.0)
    alone = _cpu.linear(row, w)[0]
    for m in (2, 3, 4, 5, 7, 8, 9, 16, 33, 64):
        for place in sorted({0, m // 2, m - 1}):
            batch = randn(draw, m, k, dtype=dtype)
            batch[place] = row[0]
            assert torch.equal(_cpu.linear(batch, w)[place], alone), f"row {place} of {m} ({draw})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_thread_count_changes_no_bit(draw, dtype):
    x, w = randn(draw, 37, 576, dtype=dtype), randn(draw, 1000, 576, dtype=dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _cpu.linear(x, w)
        torch.set_num_threads(2)
        two = _cpu.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two), str(draw)


@pytest.mark.parametrize("m,n,k", [(1, 24, 64), (3, 17, 96), (5, 8, 40)])
def test_bf16_linear_flushes_where_its_reference_does(draw, threads, m, n, k):
    """bfloat16 steps near 2^-126: subnormal inputs, sums flushed to zero (vdpbf16ps's rounding).
    Without the flushes in the reference about a quarter of these cases differ."""
    for _ in range(20):
        x, w = draw.tiny_bf16(m, k), draw.tiny_bf16(n, k)
        assert_bitwise(_cpu.linear(x, w), reference.linear(x, w), draw, "linear of tiny bfloat16 values")


def test_bf16_linear_flush_boundary():
    """A lane at 2^-126 then a product just under it: 2^-126 - 2^-151 rounds (24 bits, unbounded
    exponent) to 2^-126 and is kept; 2^-126 - 2^-150 is below 2^-126 and becomes 0."""
    x, w = torch.zeros(1, 32), torch.zeros(2, 32)
    x[0, 1], w[:, 1] = 2.0 ** -63, 2.0 ** -63  # lane 0's first step: exactly 2^-126
    x[0, 0], w[0, 0], w[1, 0] = 2.0 ** -75, -2.0 ** -76, -2.0 ** -75
    x, w = x.bfloat16(), w.bfloat16()
    want = torch.tensor([[2.0 ** -126, 0.0]]).bfloat16()
    assert torch.equal(reference.linear(x, w), want)
    assert torch.equal(_cpu.linear(x, w), want)


def test_linear_is_a_gemm(draw):
    """The fixed order is still x @ w^T: within float32 rounding of a float64 product."""
    x, w = randn(draw, 9, 300), randn(draw, 50, 300)
    exact = x.double() @ w.double().T
    assert (_cpu.linear(x, w).double() - exact).abs().max() < 1e-4


# ---- row-wise ops ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (3, 576), (7, 1), (40, 1000)])
def test_rms_norm_and_residual_add(draw, threads, dtype, rows, width):
    x, res = randn(draw, rows, width, dtype=dtype, scale=4.0), randn(draw, rows, width, dtype=dtype)
    weight = randn(draw, width, dtype=dtype)
    want = reference.rms_norm(x, weight, 1e-5)
    out = poisoned(want)
    _cpu.rms_norm(x, weight, 1e-5, out=out)
    assert_bitwise(out, want, draw, "rms_norm")
    want_norm, want_h = reference.add_rms_norm(x, res, weight, 1e-6)
    got_norm, got_h = _cpu.add_rms_norm(x, res, weight, 1e-6, out=poisoned(want_norm))
    assert_bitwise(got_h, want_h, draw, "add_rms_norm residual")
    assert_bitwise(got_norm, want_norm, draw, "add_rms_norm")


def test_rms_norm_of_a_zero_row_and_tiny_values(draw):
    x = torch.zeros(3, 64)
    x[1] = randn(draw, 64, scale=1e-30)
    x[2, 5] = 3.0e38
    weight = randn(draw, 64)
    assert_bitwise(_cpu.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), draw, "rms_norm")


def _rope_inputs(draw, tokens, heads, head_dim, dtype):
    inv_freq = [10000.0 ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    cos, sin = reference.rope_table(inv_freq, 1.0, 4096)
    positions = draw.randint(4096, tokens)
    return randn(draw, tokens, heads, head_dim, dtype=dtype, scale=2.0), cos[positions], sin[positions]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 9, 64), (5, 3, 128), (17, 2, 256), (3, 2, 512)])
def test_rope_and_qk_norm_rope(draw, threads, dtype, tokens, heads, head_dim):
    x, cos, sin = _rope_inputs(draw, tokens, heads, head_dim, dtype)
    want = reference.apply_rope(x, cos, sin)
    assert_bitwise(_cpu.apply_rope(x, cos, sin, out=poisoned(want)), want, draw, "apply_rope")
    weight = randn(draw, head_dim, dtype=dtype)
    want = reference.rms_norm_rope(x, weight, 1e-6, cos, sin)
    assert_bitwise(_cpu.rms_norm_rope(x, weight, 1e-6, cos, sin, out=poisoned(want)), want, draw, "rms_norm_rope")


@pytest.mark.parametrize("op", ["silu_and_mul", "sigmoid_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1536), (3, 17), (33, 100)])
def test_gate_and_mul_on_split_views(draw, threads, op, dtype, rows, width):
    gate_up = randn(draw, rows, 2 * width, dtype=dtype, scale=6.0)
    gate, up = gate_up.split(width, dim=-1)  # strided rows, as the model passes them
    want = getattr(reference, op)(gate, up)
    assert_bitwise(getattr(_cpu, op)(gate, up, out=poisoned(want)), want, draw, op)


@pytest.mark.parametrize("cap", [30.0, 50.0, 0.3])
def test_softcap_equals_its_reference(draw, threads, cap):
    """Gemma's final logit soft-capping: a vocabulary's logits over many scales (both tanh
    branches and the edge between them), the specials, and a row of 49,152 (the parallel split)."""
    x = randn(draw, 3, 49152, scale=1.0) * (2.0 ** torch.randint(-30, 9, (3, 49152), generator=draw.gen)).float()
    edge = torch.tensor([0.625, -0.625]) * torch.tensor(cap).float()  # |x / cap| at the branch point
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39, 3.0e38, -2.5e38])
    x[0, :2], x[1, 7:16] = edge, specials
    x[2, 100:120] = torch.nextafter(edge[0], torch.tensor(float("inf"))) * torch.linspace(0.999, 1.001, 20)
    want = reference.softcap(x, cap)
    assert same_bits(_cpu.softcap(x, cap).double(), want.double()), str(draw)
    assert same_bits(_cpu.softcap(x[1:2, :69], cap).double(), want[1:2, :69].double()), "a short row alone"


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_squared_equals_its_reference(draw, threads, dtype):
    """Nemotron-H's relu^2: values over many scales (squares that round, overflow to inf and
    underflow), the specials (NaN stays NaN, signed zeros), a short row alone and 3 x 21,504 (the
    parallel split)."""
    x = randn(draw, 3, 21504, scale=1.0) * (2.0 ** torch.randint(-80, 70, (3, 21504), generator=draw.gen)).float()
    x[1, 7:16] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39, 3.0e38, -2.5e38])
    x = x.to(dtype)
    want = reference.relu_squared(x)
    assert same_bits(_cpu.relu_squared(x).double(), want.double()), str(draw)
    assert same_bits(_cpu.relu_squared(x[1:2, :69]).double(), want[1:2, :69].double()), "a short row alone"


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_ops_on_special_values(draw, dtype):
    """NaN, infinities, signed zeros, subnormals and huge values, in the vector body and the tail
    (width 64 + 5): the kernels' results equal the references' (NaN equal to any NaN)."""
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39, 3.0e38, -2.5e38])
    rows = randn(draw, 9, 69, scale=3.0)
    for r in range(1, 9):  # row 0 stays ordinary; each other row gets a special at a random place
        rows[r, draw.randint(69, 1).item()] = specials[r - 1]
    rows[0, 66] = specials[4]
    x, res = rows.to(dtype), randn(draw, 9, 69, dtype=dtype)
    res[3, 67] = float("nan")
    weight = randn(draw, 69, dtype=dtype)
    assert same_bits(_cpu.rms_norm(x, weight, 1e-6).double(), reference.rms_norm(x, weight, 1e-6).double())
    got, got_h = _cpu.add_rms_norm(x, res, weight, 1e-6)
    want, want_h = reference.add_rms_norm(x, res, weight, 1e-6)
    assert same_bits(got_h.double(), want_h.double()) and same_bits(got.double(), want.double()), str(draw)
    assert same_bits(_cpu.silu_and_mul(x, res).double(), reference.silu_and_mul(x, res).double()), str(draw)
    assert same_bits(_cpu.sigmoid_and_mul(x, res).double(), reference.sigmoid_and_mul(x, res).double()), str(draw)
    assert same_bits(_cpu.gelu_tanh_and_mul(x, res).double(), reference.gelu_tanh_and_mul(x, res).double()), str(draw)
    heads = x[:, :64].reshape(9, 1, 64).contiguous()
    cos, sin = _rope_inputs(draw, 9, 1, 64, dtype)[1:]
    want = reference.apply_rope(heads, cos, sin)
    assert same_bits(_cpu.apply_rope(heads, cos, sin).double(), want.double()), str(draw)


def test_silu_reference_is_silu(draw):
    g = randn(draw, 4096, scale=8.0)
    one = torch.ones_like(g)
    assert torch.allclose(reference.silu_and_mul(g, one), torch.nn.functional.silu(g), rtol=1e-6, atol=1e-7)
    assert torch.allclose(reference.sigmoid_and_mul(g, one), torch.sigmoid(g), rtol=1e-6, atol=1e-7)


# ---- cache write and attention ------------------------------------------------------------------

@pytest.mark.parametrize("dtype,kv_dtype", KV_PAIRS, ids=KV_IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_write_kv_puts_each_vector_on_its_grid(draw, threads, dtype, kv_dtype, head_dim):
    """k, v of the activations' dtype into a cache of its own dtype: rounded to it, then on the grid."""
    blocks, block_size, kv_heads, tokens = 6, 16, 2, 70
    k_ref = torch.full((blocks, block_size, kv_heads, head_dim), NAN, dtype=kv_dtype)
    v_ref = k_ref.clone()
    k_got, v_got = k_ref.clone(), v_ref.clone()
    slots = torch.randperm(blocks * block_size, generator=draw.gen)[:tokens]
    k = randn(draw, tokens, kv_heads, head_dim, dtype=dtype)
    v = randn(draw, tokens, kv_heads, head_dim, dtype=dtype) * draw.rand(tokens, kv_heads, 1).to(dtype) * 64
    k[0, 0] = 0.0                       # a zero vector
    k[1, 0, 0] = 1.99999988079071044921875  # rounds up to 2: the grid's exponent is lifted
    k[2, 1, :2] = torch.tensor([1.00390625, 1.01171875])  # ties in bfloat16: to even, down and up
    v[3, 0, 5] = -1.99609375            # rounds to -2 in bfloat16: the grid's exponent lifted there
    v[4, 1] = 0.0                       # a zero V row: the exponent of 0
    v[5, 0, 3] = NAN                    # a NaN: its exponent field, 128
    attention_ref.write_kv_ref(k_ref, v_ref, k, v, slots)
    _cpu.write_kv(k_got, v_got, k, v, slots)
    assert torch.equal(k_got.nan_to_num(7.0), k_ref.nan_to_num(7.0)), str(draw)
    assert torch.equal(v_got.nan_to_num(7.0), v_ref.nan_to_num(7.0)), str(draw)
    # the record of V's exponents (LayerKV.v_exp): the reference's, slots not written untouched
    record_ref = torch.full((blocks, block_size, kv_heads), -999, dtype=torch.int16)
    record_got = record_ref.clone()
    attention_ref.write_kv_ref(k_ref, v_ref, k, v, slots, v_exp=record_ref)
    _cpu.write_kv(k_got, v_got, k, v, slots, v_exp=record_got)
    assert torch.equal(record_got, record_ref), str(draw)
    stored = v_ref.view(-1, kv_heads, head_dim)[slots]
    assert torch.equal(record_ref.view(-1, kv_heads)[slots].int(), attention_ref.v_exponents(stored)), str(draw)
    assert (record_ref.view(-1, kv_heads)[slots] == 128).any() and (record_got == -999).sum() == \
        (blocks * block_size - tokens) * kv_heads, str(draw)


def test_write_kv_and_attention_reject_a_record_of_another_shape(draw):
    k_cache, v_cache, _ = _filled_cache(draw, torch.float32, 2, 16, 2, 64)
    q = randn(draw, 1, 2, 64)
    assert k_cache.shape[:3] == (4, 16, 2)  # two blocks written and two more in the pool
    for bad in (torch.zeros(3, 16, 2, dtype=torch.int16), torch.zeros(4, 16, 2, dtype=torch.int32),
                torch.zeros(4, 2, 16, dtype=torch.int16).transpose(1, 2)):
        with pytest.raises(RuntimeError, match="v_exp must be"):
            _cpu.write_kv(k_cache, v_cache, q, q, torch.tensor([0]), v_exp=bad)
        with pytest.raises(RuntimeError, match="v_exp must be"):
            _cpu.paged_attention(q, k_cache, v_cache, torch.tensor([3]), torch.tensor([[0, 1]]), torch.tensor([0, 1]),
                                 0.125, 0, v_exp=bad)


def test_write_kv_from_the_fused_qkv_rows_rounds_to_a_bfloat16_cache(draw):
    """The cache write of strided k, v views (the fused layer's qkv rows) into a bfloat16 cache
    from float32: what the reference writes, and the bits differ from the float32 cache's."""
    tokens, kv_heads, head_dim = 9, 2, 64
    qkv = randn(draw, tokens, 3 * kv_heads * head_dim)
    k = qkv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.arange(tokens)
    caches = {}
    for kv_dtype in (torch.bfloat16, torch.float32):
        want = [torch.full((2, 16, kv_heads, head_dim), NAN, dtype=kv_dtype) for _ in range(2)]
        got = [t.clone() for t in want]
        attention_ref.write_kv_ref(*want, k, v, slots)
        _cpu.write_kv(*got, k, v, slots)
        for g, w in zip(got, want):
            assert g.dtype == kv_dtype and torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0)), str(draw)
        caches[kv_dtype] = got
    assert not torch.equal(caches[torch.bfloat16][0][0, :tokens].float(), caches[torch.float32][0][0, :tokens])


def _filled_cache(draw, dtype, blocks, block_size, kv_heads, head_dim, kv_dtype=None):
    """A NaN-poisoned pool (of kv_dtype, default dtype) whose first `blocks` are written through
    write_kv_ref from k, v of `dtype` (as the engine fills it), and the record of its V exponents
    (LayerKV.v_exp; poisoned past the blocks written)."""
    k_cache = torch.full((blocks + 2, block_size, kv_heads, head_dim), NAN, dtype=kv_dtype or dtype)
    v_cache = k_cache.clone()
    record = torch.full(k_cache.shape[:3], 999, dtype=torch.int16)
    slots = torch.arange(blocks * block_size)
    attention_ref.write_kv_ref(k_cache, v_cache, randn(draw, len(slots), kv_heads, head_dim, dtype=dtype, scale=2.0),
                               randn(draw, len(slots), kv_heads, head_dim, dtype=dtype) *
                               draw.rand(len(slots), kv_heads, 1).to(dtype) * 16, slots, v_exp=record)
    return k_cache, v_cache, record


# The attention reads the V exponents from the cache's record, or from the V rows without one.
RECORDS = (False, True)


# (heads, kv_heads, head_dim, window, block_size): GQA, windows, the vector widths' head sizes,
# one (80) that takes the plain loops for part of the work, a block size not a power of two, and
# Gemma 4's global heads of 512 (the widest, paged_attention.MAX_HEAD_DIM)
ATTENTION_SHAPES = [(9, 3, 64, None, 16), (4, 4, 128, None, 16), (2, 1, 256, 7, 16), (6, 2, 64, 40, 16),
                    (4, 2, 80, None, 12), (4, 2, 512, 40, 16)]


@pytest.mark.parametrize("dtype,kv_dtype", KV_PAIRS, ids=KV_IDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,window,block_size", ATTENTION_SHAPES)
def test_attention_prefill_chunks_decode_and_verify_rows(draw, threads, dtype, kv_dtype, heads, kv_heads, head_dim,
                                                         window, block_size):
    blocks = 12 * 16 // block_size
    k_cache, v_cache, record = _filled_cache(draw, dtype, blocks, block_size, kv_heads, head_dim, kv_dtype)
    table = torch.randperm(blocks, generator=draw.gen)  # blocks shuffled in the pool
    num_rows = blocks * block_size
    q = randn(draw, num_rows, heads, head_dim, dtype=dtype, scale=3.0)
    positions = torch.arange(num_rows)
    scale = head_dim ** -0.5
    for start, end in ((0, num_rows), (13, 40), (150, 151), (100, 107)):  # prefill, chunk, decode, verify
        want = attention_ref.paged_attention_ref(q[start:end], k_cache, v_cache, positions[start:end], table,
                                                 scale, window)
        for recorded in RECORDS:
            got = _cpu.paged_attention(q[start:end], k_cache, v_cache, positions[start:end], table.view(1, -1),
                                       torch.tensor([0, end - start]), scale, window or 0,
                                       v_exp=record if recorded else None, out=poisoned(want))
            assert_bitwise(got, want, draw, f"attention rows [{start}, {end}), record {recorded}")


@pytest.mark.parametrize("dtype,kv_dtype", KV_PAIRS, ids=KV_IDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,window,block_size", ATTENTION_SHAPES)
def test_attention_many_sequences_in_one_call(draw, threads, dtype, kv_dtype, heads, kv_heads, head_dim, window,
                                              block_size):
    """Decode rows, a verify run and a prefill chunk of four sequences at once: each row equals the
    reference of its own sequence."""
    blocks = 10 * 16 // block_size + 1
    k_cache, v_cache, record = _filled_cache(draw, dtype, blocks, block_size, kv_heads, head_dim, kv_dtype)
    tables = [torch.randperm(blocks, generator=draw.gen) for _ in range(4)]
    runs = [(37, 38), (120, 128), (5, 6), (60, 95)]  # [first, last + 1) positions per sequence
    q = randn(draw, sum(e - s for s, e in runs), heads, head_dim, dtype=dtype, scale=3.0)
    positions = torch.cat([torch.arange(s, e) for s, e in runs])
    starts = [0]
    for s, e in runs:
        starts.append(starts[-1] + e - s)
    scale = head_dim ** -0.5
    got = [_cpu.paged_attention(q, k_cache, v_cache, positions, torch.stack(tables), torch.tensor(starts), scale,
                                window or 0, v_exp=record if recorded else None, out=poisoned(q))
           for recorded in RECORDS]
    for i, table in enumerate(tables):
        rows = slice(starts[i], starts[i + 1])
        want = attention_ref.paged_attention_ref(q[rows], k_cache, v_cache, positions[rows], table, scale, window)
        for recorded, out in zip(RECORDS, got):
            assert_bitwise(out[rows], want, draw, f"sequence {i}, record {recorded}")


def test_attention_and_cache_write_reject_caches_of_two_dtypes(draw):
    k_cache, v_cache, _ = _filled_cache(draw, torch.float32, 2, 16, 1, 64)
    q = randn(draw, 1, 1, 64)
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        _cpu.paged_attention(q, k_cache, v_cache.bfloat16(), torch.tensor([3]), torch.tensor([[0, 1]]),
                             torch.tensor([0, 1]), 0.125, 0)
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        _cpu.write_kv(k_cache, v_cache.bfloat16(), q, q, torch.tensor([0]))


def test_attention_rejects_a_position_past_its_table(draw):
    k_cache, v_cache, _ = _filled_cache(draw, torch.float32, 2, 16, 1, 64)
    q = randn(draw, 1, 1, 64)
    with pytest.raises(RuntimeError, match="past its table"):
        _cpu.paged_attention(q, k_cache, v_cache, torch.tensor([40]), torch.tensor([[0, 1]]), torch.tensor([0, 1]),
                             0.125, 0)


@pytest.mark.parametrize("dtype,kv_dtype", KV_PAIRS, ids=KV_IDS)
def test_heads_of_512_at_the_grid_extremes(draw, threads, dtype, kv_dtype):
    """Gemma 4's global heads (512, paged_attention.MAX_HEAD_DIM) with every q.k product the
    largest the grid allows (|q_int| = 2^22, |k_int| = 2^22 - 1: where q's and a key's signs agree,
    every partial sum climbs to 2^53 - 2^31) and V at its top too: the cache write, a prefill
    chunk, a verify run and decode rows long enough to be split over their keys all equal the
    references bitwise."""
    head_dim, heads, kv_heads, block_size, blocks = attention_ref.MAX_HEAD_DIM, 4, 2, 16, 24
    tokens = blocks * block_size  # 384 keys: a decode row past SPLIT_KEYS (256) is split
    k = at_the_top(draw.gen, (tokens, kv_heads, head_dim), K_TOP, dtype)
    v = at_the_top(draw.gen, (tokens, kv_heads, head_dim), V_TOP, dtype)
    k[::5] = k[::5].abs()  # every fifth key all positive: the largest score, many times
    slots = torch.randperm(tokens, generator=draw.gen)  # token t in slot slots[t]
    want_k = torch.full((blocks, block_size, kv_heads, head_dim), NAN, dtype=kv_dtype)
    want_v, got_k, got_v = want_k.clone(), want_k.clone(), want_k.clone()
    record = torch.full((blocks, block_size, kv_heads), 999, dtype=torch.int16)
    attention_ref.write_kv_ref(want_k, want_v, k, v, slots)
    _cpu.write_kv(got_k, got_v, k, v, slots, v_exp=record)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), str(draw)
    if kv_dtype == torch.float32 and dtype == torch.float32:  # the stored k_int: 2^22 - 1, unrounded
        assert float(want_k.abs().max()) == K_TOP
    q = at_the_top(draw.gen, (tokens, heads, head_dim), Q_TOP, dtype)
    q[::2] = q[::2].abs()
    table = torch.arange(blocks)  # position p reads slot p (token t sits at slots[t])
    for start, end in ((0, 40), (200, 204), (383, 384), (300, 301)):  # prefill, verify, decode (split)
        rows = q[start:end]
        positions = torch.arange(start, end)
        want = attention_ref.paged_attention_ref(rows, want_k, want_v, positions, table, head_dim ** -0.5)
        for recorded in RECORDS:
            got = _cpu.paged_attention(rows, got_k, got_v, positions, table.view(1, -1), torch.tensor([0, end - start]),
                                       head_dim ** -0.5, 0, v_exp=record if recorded else None, out=poisoned(want))
            assert_bitwise(got, want, draw, f"rows [{start}, {end}), record {recorded}")


# ---- the keyed sampler's vocabulary-wide steps -------------------------------------------------

def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, any NaN equal to any NaN (torch's neg_ flips a NaN's sign bit, C++'s 1 - x not)."""
    both_nan = a.isnan() & b.isnan()
    return torch.equal(torch.where(both_nan, 0.0, a).view(torch.int64), torch.where(both_nan, 0.0, b).view(torch.int64))


def test_exp64_and_log64_equal_their_torch_steps(draw):
    g = draw.gen
    x = torch.cat([-torch.rand(200_000, generator=g, dtype=torch.float64) * 800,
                   -torch.rand(10_000, generator=g, dtype=torch.float64) * 1e-6,
                   torch.tensor([0.0, -0.0, -708.4, -709.1, -745.9, -746.0, -746.1, float("-inf"), float("nan")],
                                dtype=torch.float64)])
    assert same_bits(_cpu.exp64(x), float64.exp64(x)), str(draw)
    y = torch.cat([torch.rand(200_000, generator=g, dtype=torch.float64) * 40,
                   torch.exp2(torch.rand(10_000, generator=g, dtype=torch.float64) * 2000 - 1070),
                   torch.tensor([0.0, -0.0, -1.0, 1.0, float("inf"), float("nan"), 5e-324, 2.0 ** -1022, 2.0 ** -1023],
                                dtype=torch.float64)])
    assert same_bits(_cpu.log64(y), float64.log64(y)), str(draw)


def test_gumbel_equals_its_torch_steps(draw):
    seeds = [int(s) for s in torch.randint(0, 2 ** 62, (3,), generator=draw.gen)] + [2 ** 64 - 1]
    keys = keyed.row_keys(seeds, [0, 5, 999_999, 3])
    ids = torch.arange(49_152).reshape(1, -1)
    assert torch.equal(_cpu.gumbel(keys, ids), keyed.gumbel(keys, ids)), str(draw)
    some = torch.randint(0, 2 ** 30, (4, 100), generator=draw.gen)
    assert torch.equal(_cpu.gumbel(keys, some), keyed.gumbel(keys, some)), str(draw)


def test_sample_keys_and_top_keys_equal_the_torch_steps(draw, threads):
    z = torch.randn(3, 5000, generator=draw.gen, dtype=torch.float64) * 4
    z[0, ::7] = float("-inf")  # not drawable
    m = z.amax(dim=1, keepdim=True)
    ids = (torch.arange(5000) + 17).reshape(1, -1)  # a shard's global ids
    valid = z > float("-inf")
    q = float64.exp64(z - m).mul_(float(2 ** 32)).floor_().to(torch.int64)
    want_keys = torch.where(valid, (q << 30) | ((2 ** 30 - 1) - ids), -1)
    got_q, got_keys = _cpu.sample_keys(z, m, ids)
    assert torch.equal(got_q, torch.where(valid, q, 0)) and torch.equal(got_keys, want_keys), str(draw)
    for k in (1, 1024, 5000):
        values, index = _cpu.top_keys(want_keys, k)
        want_values, want_index = want_keys.topk(k, dim=1)
        assert torch.equal(values, want_values), (k, str(draw))
        drawable = want_values >= 0  # distinct keys: the same indices (the -1 tail may be ordered otherwise)
        assert torch.equal(index[drawable], want_index[drawable]), (k, str(draw))


# (heads, kv_heads, head_dim, window) of the split rows: the query heads of a KV head go through
# the direct kernels four at a time (groups of 3, 1, 8 and 5 lanes per row; a 4-row verify run
# has 4x as many), bfloat16 rows of 64, 128 and 512 in 32-element blocks, 80 in 16-element ones
SPLIT_SHAPES = [(9, 3, 64, None), (9, 3, 64, 700), (9, 3, 80, None), (4, 4, 128, None), (8, 1, 128, 300),
                (10, 2, 64, None), (4, 1, 512, None)]


@pytest.mark.parametrize("dtype,kv_dtype", KV_PAIRS, ids=KV_IDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", SPLIT_SHAPES)
def test_attention_long_decode_and_verify_rows_split_over_keys(draw, threads, dtype, kv_dtype, heads, kv_heads,
                                                               head_dim, window):
    """Rows of a few queries over thousands of keys are split over the keys (two passes: maxima,
    then exact sums) and read the cache rows directly: each row still equals its reference."""
    block_size, blocks = 32, 100
    k_cache, v_cache, record = _filled_cache(draw, dtype, blocks, block_size, kv_heads, head_dim, kv_dtype)
    tables = [torch.randperm(blocks, generator=draw.gen) for _ in range(3)]
    runs = [(3100, 3101), (1500, 1504), (1030, 1031)]  # decode, a 4-row verify run, decode
    q = randn(draw, sum(e - s for s, e in runs), heads, head_dim, dtype=dtype, scale=3.0)
    positions = torch.cat([torch.arange(s, e) for s, e in runs])
    starts = [0, 1, 5, 6]
    got = [_cpu.paged_attention(q, k_cache, v_cache, positions, torch.stack(tables), torch.tensor(starts), 0.125,
                                window or 0, v_exp=record if recorded else None, out=poisoned(q))
           for recorded in RECORDS]
    for i, table in enumerate(tables):
        rows = slice(starts[i], starts[i + 1])
        want = attention_ref.paged_attention_ref(q[rows], k_cache, v_cache, positions[rows], table, 0.125, window)
        for recorded, out in zip(RECORDS, got):
            assert_bitwise(out[rows], want, draw, f"sequence {i}, record {recorded}")


# ---- the exact quantized GEMM (kernels/quant_gemm.py) ------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", QUANT_KINDS)
@pytest.mark.parametrize("rows,n,k", [(1, 37, 256), (5, 16, 32), (19, 45, 576), (4, 3, 64)])
def test_quant_linear_equals_its_reference(draw, threads, dtype, kind, rows, n, k):
    """Every kind against the reference; the K-quants (activations per 256, one term per
    super-block) with K rounded up to whole super-blocks."""
    from test_quant_gemm import random_generic, random_x

    from tensorfold.kernels import quant_gemm

    act = quant_gemm.KINDS[kind].act
    k = (k + act - 1) // act * act
    w = random_generic(draw.gen, kind, n, k)
    x = random_x(draw.gen, rows, k)
    b = act * min(1, k // act - 1)  # a group of ties: 127 / amax is 1, so x * 127 / amax is k + 1/2
    x[-1, b:b + act] = torch.arange(act) % 32 - 15.5
    x[-1, b] = 127.0
    if rows > 1:
        x[0, :act] = 0.0  # a zero activation group
    x = x.to(dtype)
    packed = _cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
    want = quant_gemm.linear(x, w)
    got = _cpu.quant_linear(x, packed, n, k, out=poisoned(want))
    assert_bitwise(got, want, draw, f"{kind} x [{rows}, {k}]")
    assert_bitwise(_cpu.quant_linear(x[-1:], packed, n, k), want[-1:], draw, "the last row alone")


def k_file(gen: torch.Generator, kind: str, n: int, k: int):
    """A K-quant matrix as a GGUF file holds it and its QuantWeight: test_quant_gemm.random_k_file's
    Q4_K and Q6_K, and Q5_K drawn the same way (random bytes, d and dmin over many binades, a zero
    and a subnormal among them)."""
    from test_quant_gemm import random_k_file

    if kind != "q5_k":
        return random_k_file(gen, kind, n, k)
    import gguf
    from gguf import GGMLQuantizationType as QType

    from tensorfold.models import gguf_quants

    size = gguf.GGML_QUANT_SIZES[QType.Q5_K][1]
    blocks = torch.randint(0, 256, (n * k // 256, size), generator=gen, dtype=torch.uint8)
    for at in (0, 2):
        h = (torch.randn(len(blocks), generator=gen) * 2.0 ** torch.randint(-22, 4, (len(blocks),), generator=gen)).half()
        h[0], h[-1] = 0.0, 2.0 ** -20
        blocks[:, at:at + 2] = h.view(torch.uint8).reshape(-1, 2)
    raw = blocks.reshape(-1)
    return raw, gguf_quants.quant_weight(raw, QType.Q5_K, (n, k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("rows,n,k", [(1, 37, 256), (7, 16, 512), (19, 45, 768)])
def test_quant_linear_with_k_quant_file_blocks_equals_its_reference(draw, threads, dtype, kind, rows, n, k):
    """Q4_K, Q5_K and Q6_K as a GGUF file stores them, packed in the file's own form (d, dmin and
    the sub-block scales decoded in registers; q6_k's codes as nibbles and two-bit planes, q5_k's
    as nibbles and a plane of fifth bits): every row,
    a row alone and the rows' order, bitwise the reference; the weight's rows as floats too."""
    from test_quant_gemm import random_x

    from tensorfold.kernels import quant_gemm

    raw, w = k_file(draw.gen, kind, n, k)
    x = random_x(draw.gen, rows, k).to(dtype)
    packed = _cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
    groups = (n + 15) // 16  # columns go in groups of 16; then a header, the column tops and lows
    assert packed.numel() <= raw.numel() // n * 16 * groups + 128 + 64 * groups + 64 * (groups // 8 + 1), "not in the file's form"
    want = quant_gemm.linear(x, w)
    assert_bitwise(_cpu.quant_linear(x, packed, n, k, out=poisoned(want)), want, draw, f"{kind} x [{rows}, {k}]")
    assert_bitwise(_cpu.quant_linear(x[-1:], packed, n, k), want[-1:], draw, "the last row alone")
    order = torch.randperm(rows, generator=draw.gen)
    assert_bitwise(_cpu.quant_linear(x[order], packed, n, k), want[order], draw, "the rows reordered")
    ids = torch.randperm(n, generator=draw.gen)[:5]
    assert torch.equal(_cpu.quant_rows(packed, ids, n, k), w.dequantize()[ids]), "rows as floats"


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k"])
def test_quant_linear_with_k_quant_file_blocks_at_their_bounds(draw, threads, kind):
    """The file form's integer sums at their largest: every code and sub-block scale at its bound
    (q4_k: codes 15, sc and m 63; q6_k: codes -32, sc -128) against activations at +-127, so a
    super-block's sum of sc A (and of m sum(xq)) is as large as int32 sums get, on VNNI (1-4 rows)
    and AMX tiles (16 and more)."""
    from gguf import GGMLQuantizationType as QType

    from tensorfold.kernels import quant_gemm
    from tensorfold.models.gguf_quants import quant_weight

    n, k = 24, 512
    raw = k_file(draw.gen, kind, n, k)[0].reshape(n * k // 256, -1).clone()
    if kind in ("q4_k", "q5_k"):
        raw[:, 4:] = 0xFF  # sc = m = 63, every code 15 (q5_k: 31)
        raw[:, 4] = raw[:, 8] = 0xFE  # sc_0 = m_0 = 62: gcd 1, so the packer keeps the file's factoring
        qtype = QType.Q4_K if kind == "q4_k" else QType.Q5_K
    else:
        raw[:, 0:192] = 0  # codes u = 0: c = -32
        raw[:, 192:208] = 0x80  # sc = -128
        raw[:, 193] = 0x7F  # and one 127: gcd 1, the file's factoring kept
        qtype = QType.Q6_K
    w = quant_weight(raw.reshape(-1), qtype, (n, k))
    packed = _cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
    x = torch.ones(20, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, 256:] = -1.0
    want = quant_gemm.linear(x, w)
    for rows in (slice(0, 1), slice(0, 4), slice(0, 20)):
        assert_bitwise(_cpu.quant_linear(x[rows], packed, n, k), want[rows], draw, f"{kind}, rows {rows}")


def test_k_quant_file_form_is_the_files_size():
    """A Q4_K / Q5_K / Q6_K matrix kept packed takes the file's bytes (1.00x, plus a small header
    and the column tops), where the wide form of other K-quant scales takes more."""
    from test_quant_gemm import random_generic

    g = torch.Generator().manual_seed(5)
    for kind in ("q4_k", "q5_k", "q6_k"):
        raw, w = k_file(g, kind, 256, 2048)
        packed = _cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
        assert packed.numel() <= 1.01 * raw.numel(), (kind, packed.numel() / raw.numel())
        other = random_generic(g, kind, 256, 2048)  # scales that do not factor as a file's: the wide form
        wide = _cpu.pack_quant(kind, other.codes, other.scale, other.scale_exp, other.min, other.min_exp)
        assert wide.numel() > 1.2 * raw.numel()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("rows,n,k", [(1, 37, 256), (6, 16, 576)])
def test_quant_linear_with_gguf_scales_equals_its_reference(draw, threads, dtype, kind, rows, n, k):
    """The 32-weight types as GGUF stores them (float16 scales: packed as their bits and decoded
    in registers), zero, subnormal and negative scales among them."""
    from test_quant_gemm import random_blocks, random_x

    from tensorfold.kernels import quant_gemm

    q, d, m = random_blocks(draw.gen, kind, n, k)
    d[1::3] = -d[1::3]
    w = quant_gemm.from_legacy(kind, q, d, m)
    x = random_x(draw.gen, rows, k).to(dtype)
    packed = _cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
    want = quant_gemm.linear(x, w)
    assert_bitwise(_cpu.quant_linear(x, packed, n, k, out=poisoned(want)), want, draw, f"{kind} x [{rows}, {k}]")
    wide = not_float16(w)  # the same values, not in float16 form: the other packing
    assert_bitwise(_cpu.quant_linear(x, _cpu.pack_quant(kind, *wide), n, k),
                   quant_gemm.linear(x, quant_gemm.QuantWeight(kind, *wide)), draw, "wide packing")


@pytest.mark.parametrize("qtype_name", ["Q5_0", "Q5_1"])
def test_quant_linear_with_q5_fallback_blocks_equals_its_reference(draw, threads, qtype_name):
    """llama.cpp's fallback types where a row is no multiple of 256 (Q4_K -> Q5_0, Q5_K -> Q5_1;
    Gemma 4 26B's expert down projections have K = 704), kept as q8_0 and as q5_1 (the per-32
    arithmetic with a 5-bit code, packed wide): gguf's weights, and prompt rows (AMX or VNNI) and
    one row bitwise the reference."""
    import gguf
    from gguf import GGMLQuantizationType as QType
    from test_quant_gemm import random_x

    from tensorfold.kernels import quant_gemm
    from tensorfold.models.gguf_quants import quant_weight

    qtype, n, k = QType[qtype_name], 40, 704
    w = torch.randn(n, k, generator=draw.gen) * 2.0 ** torch.randint(-8, 2, (n, 1), generator=draw.gen)
    w[:, 1::7] += 0.5  # Q5_1's minimum away from -max
    raw = gguf.quants.quantize(w.numpy(), qtype)
    weight = quant_weight(torch.from_numpy(raw).reshape(-1), qtype, (n, k))
    assert weight.kind == {"Q5_0": "q8_0", "Q5_1": "q5_1"}[qtype_name]
    assert torch.equal(weight.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, qtype)).reshape(n, k))
    x = random_x(draw.gen, 20, k)
    packed = _cpu.pack_quant(weight.kind, weight.codes, weight.scale, weight.scale_exp, weight.min, weight.min_exp)
    want = quant_gemm.linear(x, weight)
    assert_bitwise(_cpu.quant_linear(x, packed, n, k, out=poisoned(want)), want, draw, f"{qtype_name} x [20, {k}]")
    assert_bitwise(_cpu.quant_linear(x[-1:], packed, n, k), want[-1:], draw, "the last row alone")


def not_float16(w):
    """w's fields with every scale written as (2 S, E - 1): equal values, no float16 form."""
    pair = (lambda s, e: (None, None) if s is None else (s * 2, e - 1))
    return (w.codes, *pair(w.scale, w.scale_exp), *pair(w.min, w.min_exp))


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_quant_linear_at_the_codes_and_activations_bounds(draw, kind):
    """Every code at its kind's bound against activations quantized to +-127 (a block of equal
    magnitudes): the largest block dots, where a 16-bit pair sum (AVX2's vpmaddubsw) would saturate."""
    from test_quant_gemm import code_range, random_generic

    from tensorfold.kernels import quant_gemm

    low, high = code_range(kind)
    for code in (low, high - 1):
        w = random_generic(draw.gen, kind, 24, 256)
        w.codes.fill_(code)
        w.codes[1::2, ::3] = low if code == high - 1 else high - 1  # mixed bounds in some columns
        x = torch.ones(4, 256)
        x[1] = -1.0
        x[2, ::2] = -1.0
        x[3, ::5] = -1.0
        packed = _cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
        assert_bitwise(_cpu.quant_linear(x, packed, 24, 256), quant_gemm.linear(x, w), draw, f"codes at {code}")


@pytest.mark.parametrize("kind", [*QUANT_KINDS, "q4_k file", "q5_k file", "q6_k file"])
def test_quant_linear_row_alone_equals_row_among_others(draw, threads, kind):
    """A row's outputs are the same alone and among 2..64 others (every kind; "file": the K-quants
    as a GGUF file stores them, packed in its form)."""
    from test_quant_gemm import random_generic, random_x

    kind, _, form = kind.partition(" ")
    w = k_file(draw.gen, kind, 40, 512)[1] if form else random_generic(draw.gen, kind, 40, 512)
    packed = _cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
    probe = random_x(draw.gen, 1, 512)
    alone = _cpu.quant_linear(probe, packed, 40, 512)
    for m in (2, 3, 4, 5, 8, 16, 17, 33, 64):
        batch = random_x(draw.gen, m, 512)
        place = int(torch.randint(0, m, (1,), generator=draw.gen))
        batch[place] = probe[0]
        assert_bitwise(_cpu.quant_linear(batch, packed, 40, 512)[place], alone[0], draw, f"row {place} of {m}")


@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_quant_linear_tiles_without_negative_shifts_equal_their_reference(draw, threads, kind):
    """Scales within a few binades and ordinary activations: no term can have a negative shift,
    so the row tiles take the unchecked kernel (quant_gemm_avx2.h: group_unchecked). Among them, rows
    with an outlier or a zero block (far below the row's largest: checked tiles), zero scales
    and minimums, and every tile height (1-4 rows) alone and beside the others."""
    from test_quant_gemm import random_generic

    from tensorfold.kernels import quant_gemm

    n, k = 53, 512
    w = random_generic(draw.gen, kind, n, k)
    per = quant_gemm.KINDS[kind].blocks_per_group  # the K-quants: one E and F per super-block
    near = (lambda e: torch.randint(-3, 1, (n, k // 32 // per), generator=draw.gen, dtype=torch.int32)
            .repeat_interleave(per, dim=1))
    w.scale_exp.copy_(near(w.scale_exp))
    if w.min is not None:
        w.min_exp.copy_(near(w.min_exp))
        w.min[2, 3] = 0
    w.scale[5, :] = 0
    packed = _cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
    x = torch.randn(11, k, generator=draw.gen)
    x[6, 100] = 3e4      # a block far above the rest of its row
    x[9, 64:96] = 0.0    # a zero block (its terms are 0 at any shift)
    x[10, 256:512] = 0.0  # a zero group of 256
    want = quant_gemm.linear(x, w)
    assert_bitwise(_cpu.quant_linear(x, packed, n, k, out=poisoned(want)), want, draw, f"{kind}, 11 rows")
    for rows in (slice(0, 1), slice(0, 2), slice(3, 6), slice(2, 6), slice(5, 8), slice(9, 10)):
        assert_bitwise(_cpu.quant_linear(x[rows], packed, n, k), want[rows], draw, f"{kind}, rows {rows}")


def _blocks_of_activations(k: int, plan: dict[int, tuple[float, int, int, bool]]) -> torch.Tensor:
    """One row of K activations whose block b (of 32) is plan[b] = (sign, m, e, first_only): the
    block's scale d = m 2^e exactly and xq = sign 127 at every element, or at the first only
    (the rest 0); the blocks not in the plan are zero."""
    x = torch.zeros(k)
    for b, (sign, m, e, first_only) in plan.items():
        a = sign * 127.0 * m * 2.0 ** e  # amax / 127 = m 2^e in float32, exactly
        if first_only:
            x[32 * b] = a
        else:
            x[32 * b:32 * b + 32] = a
    return x


@pytest.mark.parametrize("kind,wide", [("q8_0", False), ("q8_0", True), ("q4_0", False)])
def test_quant_linear_sums_in_float64_only_as_far_as_they_are_exact(draw, kind, wide):
    """Where no term can have a negative shift the VNNI path sums a chunk of blocks' terms in
    float64 before one conversion (quant_gemm.cpp: float_chunk): the chunk is as long as the
    largest terms allow and no longer. Blocks 0..J hold J + 1 terms at the largest magnitude the
    kind allows, then one odd term whose scale is `spread` binades below theirs, then J + 1 equal
    terms of the other sign: a chunk of 2J blocks would round the odd term off when it joins the
    J + 1 large ones; the reference keeps it, and it is all that is left of the sum."""
    from tensorfold.kernels import quant_gemm

    n, k, chunk = 16, 1024, 8
    info = quant_gemm.KINDS[kind]
    c_big = -128 if kind == "q8_0" else -8
    dot_bits = 19 if kind == "q8_0" else 15  # |A| < 2^bits: 32 |c_big| 127
    bits = info.term_bits if wide else dot_bits + 22
    spread = 53 - bits - 3  # the largest spread that still leaves a chunk of 8 = 2^3 blocks
    e = 30 if wide else spread - 24  # 2047 2^30 is no float16 (the wide packing); 2^-24 is one
    odd = chunk + 1
    codes = torch.zeros(n, k, dtype=torch.int8)
    codes[:, :32 * (2 * chunk + 3)] = c_big
    codes[:, 32 * odd:32 * odd + 32] = 1  # A = 127: only the block's first activation is not 0
    scale = torch.full((n, k // 32), 2047, dtype=torch.int32)
    exps = torch.full((n, k // 32), e, dtype=torch.int32)
    scale[:, odd], exps[:, odd] = 1, e - spread  # float16's smallest subnormal where not wide
    w = quant_gemm.QuantWeight(kind, codes, scale, exps)
    plan = {b: (-1.0, 2047, 0, False) for b in range(odd)}                 # A = 32 c_big (-127) > 0
    plan[odd] = (1.0, 1025, 0, True)                                      # I = 127 1 1025: odd
    plan.update({b: (1.0, 2047, 0, False) for b in range(odd + 1, 2 * chunk + 3)})
    x = _blocks_of_activations(k, plan).repeat(5, 1)
    x[4] *= -1.0
    packed = _cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, None, None)
    as_wide = _cpu.pack_quant(kind, *not_float16(w))
    assert (packed.numel() == as_wide.numel()) == wide, "the packing the test means"
    want = quant_gemm.linear(x, w)
    left = torch.tensor(127.0 * 1025 * 2.0 ** (e - spread), dtype=torch.float64).float()
    assert want[0, 0] == left and want[4, 0] == -left, "the odd term is what is left"
    assert_bitwise(_cpu.quant_linear(x, packed, n, k), want, draw, f"{kind}, wide {wide}, four rows and one")
    assert_bitwise(_cpu.quant_linear(x[:1], packed, n, k), want[:1], draw, f"{kind}, wide {wide}, a row alone")


def test_quant_linear_rounds_each_term_where_a_shift_is_negative(draw):
    """Two terms of odd I one binade below the grid (their shift -1): the reference rounds each
    half to even, so together they lose 1 where their float64 sum would keep it. The group's
    scales reach 14 binades below its top, one past shift0 = 13 at K = 8,192, which the float64
    chunks must leave to the term-by-term path even though their bound alone would allow them."""
    from tensorfold.kernels import quant_gemm

    n, k = 16, 8192
    codes = torch.zeros(n, k, dtype=torch.int8)
    codes[:, 32] = codes[:, 64] = 1
    scale = torch.ones(n, k // 32, dtype=torch.int32)
    exps = torch.full((n, k // 32), -24, dtype=torch.int32)  # 2^-24: a float16 subnormal
    scale[:, 0], exps[:, 0] = 1024, -10  # the top, 14 binades up; its codes are 0
    w = quant_gemm.QuantWeight("q4_0", codes, scale, exps)
    x = _blocks_of_activations(k, {b: (1.0, 1025, 0, True) for b in range(3)}).repeat(4, 1)
    want = quant_gemm.linear(x, w)
    assert want[0, 0] != 0
    packed = _cpu.pack_quant("q4_0", w.codes, w.scale, w.scale_exp, None, None)
    assert_bitwise(_cpu.quant_linear(x, packed, n, k), want, draw, "four rows")
    assert_bitwise(_cpu.quant_linear(x[:1], packed, n, k), want[:1], draw, "a row alone")


@pytest.fixture
def amx_tiles():
    """The AMX-INT8 path of the quantized GEMM, where this build and CPU have it (else a skip that
    says why); the VNNI path is restored after."""
    path = _cpu.quant_amx_path()
    if path != "amx":
        pytest.skip(f"no AMX-INT8 path to compare with VNNI here: {path}")
    yield
    _cpu.set_quant_amx(True)


@pytest.mark.parametrize("kind,file_blocks", [(kind, False) for kind in QUANT_KINDS] +
                         [("q4_k", True), ("q5_k", True), ("q6_k", True)])  # the K-quants also in their file's own form
def test_quant_linear_on_amx_tiles_equals_vnni_and_its_reference(draw, threads, amx_tiles, kind, file_blocks):
    """Passes of 16 rows or more take AMX tiles of 16 rows, a run of 8 blocks at a time; fewer rows,
    and every row with set_quant_amx(False), take the VNNI registers. Both are the reference's
    integers: every row bitwise the same on either path, last tiles of 1..15 rows and a last run of
    fewer blocks among them, a row alone (VNNI) as among 70 (AMX)."""
    from test_quant_gemm import random_generic, random_x

    from tensorfold.kernels import quant_gemm

    n, k = 45, 768  # 24 blocks: runs of 8, 8, 8; a last column group of 13
    w = k_file(draw.gen, kind, n, k)[1] if file_blocks else random_generic(draw.gen, kind, n, k)
    packed = _cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
    for rows in (16, 17, 33, 70):
        x = random_x(draw.gen, rows, k)
        x[rows // 2, 256:512] = 0.0  # a zero group
        want = quant_gemm.linear(x, w)
        assert_bitwise(_cpu.quant_linear(x, packed, n, k, out=poisoned(want)), want, draw, f"{kind}, {rows} rows, AMX")
        _cpu.set_quant_amx(False)
        assert_bitwise(_cpu.quant_linear(x, packed, n, k, out=poisoned(want)), want, draw, f"{kind}, {rows} rows, VNNI")
        _cpu.set_quant_amx(True)
    assert_bitwise(_cpu.quant_linear(x[-1:], packed, n, k), want[-1:], draw, "the last row alone")


def test_quant_linear_rejects_what_is_not_its_packed_weight():
    from test_quant_gemm import random_generic

    w = random_generic(torch.Generator().manual_seed(0), "q4_1", 8, 64)
    packed = _cpu.pack_quant("q4_1", w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
    with pytest.raises(RuntimeError, match="not a packed quantized weight"):
        _cpu.quant_linear(torch.randn(2, 96), packed, 8, 96)
    with pytest.raises(RuntimeError, match="min and min_exp"):
        _cpu.pack_quant("q4_1", w.codes, w.scale, w.scale_exp)
    with pytest.raises(RuntimeError, match=r"q4_0 codes must lie in \[-8, 7\]"):
        _cpu.pack_quant("q4_0", w.codes, w.scale, w.scale_exp)
    with pytest.raises(RuntimeError, match="unknown kind"):
        _cpu.pack_quant("iq2_xs", w.codes, w.scale, w.scale_exp)
    g = torch.Generator().manual_seed(1)
    for kind in ("q4_k", "q5_k", "q6_k"):  # one E (and F) per super-block of 256, K whole super-blocks
        k_w = random_generic(g, kind, 8, 512)
        k_w.scale_exp[3, 9] += 1
        with pytest.raises(RuntimeError, match="one scale_exp per super-block of 256"):
            _cpu.pack_quant(kind, k_w.codes, k_w.scale, k_w.scale_exp, k_w.min, k_w.min_exp)
        if k_w.min is not None:
            k_w.scale_exp[3, 9] -= 1
            k_w.min_exp[7, 15] -= 1
            with pytest.raises(RuntimeError, match="one min_exp per super-block of 256"):
                _cpu.pack_quant(kind, k_w.codes, k_w.scale, k_w.scale_exp, k_w.min, k_w.min_exp)
        ints = (lambda cols: torch.zeros(8, cols, dtype=torch.int32))
        mins = (ints(9), ints(9)) if k_w.min is not None else (None, None)
        with pytest.raises(RuntimeError, match="multiple of 256"):
            _cpu.pack_quant(kind, torch.zeros(8, 288, dtype=torch.int8), ints(288 // (16 if kind == "q6_k" else 32)),
                            ints(9), *mins)
    with pytest.raises(RuntimeError, match="not packed from the file"):
        _cpu.pack_quant_file(torch.empty(0, dtype=torch.uint8), "q5_1", "/nonexistent", torch.zeros(0, dtype=torch.int64), 32)


@pytest.mark.parametrize("kind", ["q8_0", "q4_1", "q6_k", "q5_1"])
def test_quant_rows_equal_the_reference_dequantization(draw, kind):
    """An embedding lookup from a packed weight: QuantWeight.rows(ids).dequantize(), bitwise."""
    from test_quant_gemm import random_blocks, random_generic

    from tensorfold.kernels import quant_gemm

    k = 256 if kind in ("q6_k", "q5_1") else 96
    w = quant_gemm.from_legacy(kind, *random_blocks(draw.gen, kind, 37, k)) if kind not in ("q6_k", "q5_1") else \
        random_generic(draw.gen, kind, 37, k)
    packed = _cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
    ids = torch.tensor([0, 36, 5, 5, 17])
    assert_bitwise(_cpu.quant_rows(packed, ids, 37, k), w.rows(ids).dequantize(), draw, f"{kind} rows")
    with pytest.raises(RuntimeError, match="outside"):
        _cpu.quant_rows(packed, torch.tensor([37]), 37, k)
