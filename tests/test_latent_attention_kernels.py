"""GLM-5's latent attention and DSA indexer as native kernels (csrc/cpu/latent_attention.cpp:
_cpu.latent_attention, _cpu.dsa_select through native_ops) against the torch op set's
(kernels/latent_attention.attention_by_sequence, dsa_select), bit for bit.

GLM-5's widths (kv_lora 512, rope 64, 16 and 64 heads, indexer keys of 128) and tiny and odd ones;
block tables out of order; a batch of a prefill, a chunk continuing a sequence and decode rows;
indexer keys copied so that scores tie (the lower position wins); float32 and bfloat16 caches;
1 and 2 threads; every row alone equals the row in the batch.
"""
import pytest
import torch

from latent_cases import GLM5, GLM5_WIDE, ODD, TINY, make_case, single_rows
from tensorfold.backends import native_problem
from tensorfold.kernels import latent_attention as ref

pytestmark = pytest.mark.skipif(native_problem() is not None, reason=str(native_problem()))
if native_problem() is None:
    from tensorfold.backends import native_ops

SCALE = 0.0721  # the attention's
RUNS = [(0, 37), (90, 1), (20, 6), (5, 1)]  # a prefill, a decode row, a chunk mid-sequence, an early decode row


def _same(a, b):
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


@pytest.mark.parametrize("shape,top_k", [(TINY, 8), (ODD, 5), (GLM5, 16)], ids=["tiny", "odd", "glm5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_dsa_select_and_latent_attention_are_the_references_bits(shape, top_k, dtype, threads):
    cache, batch, query, index_q, weights = make_case(shape, RUNS, seed=top_k + shape.heads, dtype=dtype)
    index_scale = shape.index_dim ** -0.5
    want_sel = ref.dsa_select(index_q, weights, cache, batch, index_scale, top_k)
    got_sel = native_ops.dsa_select(index_q, weights, cache, batch, index_scale, top_k)
    assert want_sel is not None and got_sel.dtype == torch.int32 and torch.equal(got_sel, want_sel)
    for selection in (None, want_sel):
        want = ref.attention_by_sequence(query, cache, batch, SCALE, selection)
        got = native_ops.latent_attention(query, cache, batch, SCALE, selection)
        assert torch.equal(got, want)


def test_ties_go_to_the_lower_position():
    cache, batch, _, index_q, weights = make_case(TINY, [(0, 30)], seed=3)
    flat = cache.index_keys.view(-1, TINY.index_dim)
    table = batch.sequences[0].block_table
    slot = [int(table[p // TINY.block_size]) * TINY.block_size + p % TINY.block_size for p in range(30)]
    for p in range(30):  # every key the same: every score ties
        flat[slot[p]] = flat[slot[0]]
    got = native_ops.dsa_select(index_q, weights, cache, batch, 0.25, 6)
    assert got[-1].tolist() == list(range(6)) and torch.equal(got, ref.dsa_select(index_q, weights, cache, batch, 0.25, 6))
    assert got[3].tolist() == [0, 1, 2, 3, -1, -1]  # a row that sees 6 keys or fewer takes them all


@pytest.mark.parametrize("shape,top_k", [(ODD, 5), (GLM5, 16)], ids=["odd", "glm5"])
def test_a_row_alone_gets_its_bits_in_the_batch(shape, top_k):
    cache, batch, query, index_q, weights = make_case(shape, RUNS, seed=7)
    selection = native_ops.dsa_select(index_q, weights, cache, batch, 0.1, top_k)
    whole = native_ops.latent_attention(query, cache, batch, SCALE, selection)
    for r, alone in single_rows(batch, shape.block_size):
        sel = native_ops.dsa_select(index_q[r:r + 1], weights[r:r + 1], cache, alone, 0.1, top_k)
        if sel is not None:
            assert torch.equal(sel[0], selection[r])
        assert torch.equal(native_ops.latent_attention(query[r:r + 1], cache, alone, SCALE, sel)[0], whole[r])


def test_glm5_64_heads_at_decode():
    cache, batch, query, index_q, weights = make_case(GLM5_WIDE, [(300, 1), (70, 2)], seed=11, ties=False)
    selection = ref.dsa_select(index_q, weights, cache, batch, 0.0884, 64)
    assert torch.equal(native_ops.dsa_select(index_q, weights, cache, batch, 0.0884, 64), selection)
    assert torch.equal(native_ops.latent_attention(query, cache, batch, SCALE, selection),
                       ref.attention_by_sequence(query, cache, batch, SCALE, selection))


def test_no_selection_below_top_k():
    cache, batch, _, index_q, weights = make_case(TINY, [(0, 5), (2, 3)], seed=5)
    assert native_ops.dsa_select(index_q, weights, cache, batch, 0.25, 8) is None
    assert ref.dsa_select(index_q, weights, cache, batch, 0.25, 8) is None


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q8_0"])
def test_linear_heads_is_each_heads_own_gemm(kind, threads):
    """native_ops.linear_heads (one call) == each head's LinearWeight called alone, bitwise."""
    from tensorfold.kernels.quant_gemm import from_legacy

    g = torch.Generator().manual_seed(4)
    heads, rows, n, k = 5, 7, 48, 64
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    if kind == "q8_0":
        mats = [from_legacy("q8_0", torch.randint(-127, 128, (n, k), generator=g),
                            (torch.rand(n, k // 32, generator=g) * 0.01).half()) for _ in range(heads)]
    else:
        mats = [torch.randn(n, k, generator=g).to(dtype) for _ in range(heads)]
    weights = [native_ops.Linear.of(m) for m in mats]
    x = torch.randn(rows, heads, k + 3, generator=g).to(dtype)[..., 3:]  # a strided view, as the model's
    got = native_ops.linear_heads(x, weights)
    assert got.shape == (rows, heads, n)
    for h, w in enumerate(weights):
        assert torch.equal(got[:, h], w(x[:, h].contiguous()))


def test_extreme_exponents_keep_the_references_bits():
    """Queries near float32's smallest normals, keys near its largest, a subnormal and a zero key:
    the grids' powers of two stay exact in float64, as the reference's."""
    cache, batch, query, index_q, weights = make_case(TINY, [(0, 12), (20, 1)], seed=8)
    kv = cache.kv.view(-1, TINY.dim)
    kv[:8] *= 1e30
    kv[9] = 1e-44
    kv[10] = 0.0
    query[:6] *= 1e-30
    index_q[3] *= 1e-35
    cache.index_keys.view(-1, TINY.index_dim)[:5] *= 1e35
    selection = ref.dsa_select(index_q, weights, cache, batch, 0.25, 6)
    assert torch.equal(native_ops.dsa_select(index_q, weights, cache, batch, 0.25, 6), selection)
    for chosen in (None, selection):
        assert torch.equal(native_ops.latent_attention(query, cache, batch, SCALE, chosen),
                           ref.attention_by_sequence(query, cache, batch, SCALE, chosen))


@pytest.mark.parametrize("width", [128, 7, 1152], ids=["indexer", "odd", "wide"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_layer_norm_is_the_references_bits(width, dtype, threads):
    """_cpu.layer_norm (the indexer's key norm, native_ops.layer_norm) == reference.layer_norm: rows of
    spread magnitudes, a constant row, a zero row, rows whose mean cancels, a tiny row; each row
    alone gives its bits in the batch."""
    from tensorfold.kernels.reference import layer_norm
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(40, width, generator=gen) * torch.logspace(-6, 6, 40)[:, None]
    x[1] = 3.25
    x[2] = 0.0
    x[3, ::2], x[3, 1::2] = 1e4, -1e4
    x[4] = torch.randn(width, generator=gen) * 1e-30
    x[5] = x[5] + 1e3  # a large mean beside small differences
    x = x.to(dtype)
    weight = (torch.randn(width, generator=gen) * 0.5 + 1).to(dtype)
    bias = (torch.randn(width, generator=gen) * 0.1).to(dtype)
    want = layer_norm(x, weight, bias, 1e-6)
    got = native_ops.layer_norm(x, weight, bias, 1e-6)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(torch.cat([native_ops.layer_norm(x[i:i + 1], weight, bias, 1e-6) for i in range(40)]), got)
    assert torch.equal(native_ops.layer_norm(x.view(4, 10, width), weight, bias, 1e-6), got.view(4, 10, width))
