"""Exact paged attention: the Triton kernel against the torch reference, bitwise, and what exactness buys.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before any kernel
module is imported) at tiny sizes, with tests/triton_interpreter.py's GPU semantics; with a GPU
the same tests run compiled and the `gpu`-marked one repeats them at model size. Inputs are fresh
random draws (the seed is in every failure message); outputs and split workspaces are NaN-filled
before each launch, so a value the kernel forgot to write shows.

Caches are filled through `write_kv_ref`, as the engine fills them (every vector on its
fixed-point grid), with v scaled per token over several powers of two so that keys carry
different exponents.
"""

import torch

from kernel_inputs import DEVICE, K_TOP, NAN, Q_TOP, V_TOP, at_the_top, gpu  # first: sets TRITON_INTERPRET without a GPU

import pytest  # noqa: E402

from tensorfold.kernels import attention_triton as attention  # noqa: E402
from tensorfold.exact import float32, grid  # noqa: E402
from tensorfold.kernels.paged_attention import (MAX_HEAD_DIM, QK_BITS, paged_attention_ref,  # noqa: E402
                                                paged_decode_attention_ref, write_kv_ref)
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

TILES = dict(block_m=16, block_n=16, split_size=32)  # tiny tiles: rows span 1 to 3 splits



def make_cache(draw, num_blocks=16, page=8, kv_heads=2, head_dim=16, dtype=torch.float32):
    """A cache whose every slot was written by write_kv_ref, pages in shuffled order."""
    k = torch.zeros(num_blocks, page, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.zeros_like(k)
    tokens = num_blocks * page
    spread = torch.pow(2.0, torch.randint(-6, 7, (tokens, kv_heads, 1), generator=draw.gen)).to(DEVICE)
    write_kv_ref(k, v, draw.randn(tokens, kv_heads, head_dim), draw.randn(tokens, kv_heads, head_dim) * spread,
                 torch.arange(tokens, device=DEVICE))
    block_table = torch.randperm(num_blocks, generator=draw.gen).to(DEVICE)
    return k, v, block_table


def attend(q, k, v, positions, block_table, window, **tiles):
    out = torch.full_like(q, NAN)
    return attention.paged_attention(q, k, v, positions, block_table, 0.25, window, out=out,
                                     workspace_fill=NAN, **{**TILES, **tiles})


def attend_ref(q, k, v, positions, block_table, window):
    return paged_attention_ref(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), block_table.cpu(), 0.25,
                               window).to(q.device)


# (q, KV cache): the cache's dtype is its own (EngineConfig.kv_dtype)
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["f32", "bf16", "f32-bf16cache", "bf16-f32cache"])
@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("num_rows,start", [(1, 70), (4, 41), (11, 0)])  # decode, verify, prefill
def test_kernel_equals_reference_bitwise(draw, dtype, kv_dtype, window, num_rows, start):
    k, v, block_table = make_cache(draw, dtype=kv_dtype)
    q = draw.randn(num_rows, 6, 16, dtype=dtype)  # 6 heads over 2 KV heads: GQA group 3
    positions = torch.arange(start, start + num_rows, device=DEVICE)
    got = attend(q, k, v, positions, block_table, window)
    want = attend_ref(q, k, v, positions, block_table, window)
    assert got.dtype == want.dtype == dtype  # the output is q's
    assert torch.equal(got, want), f"{draw}: max diff {(got.float() - want.float()).abs().max()}"


@pytest.mark.parametrize("window", [None, 13])
def test_row_is_the_same_alone_among_others_and_under_any_tiling(draw, window):
    k, v, block_table = make_cache(draw)
    q = draw.randn(30, 6, 16)  # a prefill of positions 41..70
    positions = torch.arange(41, 71, device=DEVICE)
    full = attend(q, k, v, positions, block_table, window)
    for row in (0, 13, 29):  # decode rows at positions 41, 54, 70
        alone = attend(q[row:row + 1], k, v, positions[row:row + 1], block_table, window)
        assert torch.equal(alone[0], full[row]), f"{draw}: row {row} alone != in the prefill"
    chunked = torch.cat([attend(q[:7], k, v, positions[:7], block_table, window),
                         attend(q[7:], k, v, positions[7:], block_table, window)])
    assert torch.equal(chunked, full), f"{draw}: chunked prefill != one chunk"
    for tiles in (dict(block_n=32, split_size=64), dict(block_m=32, split_size=512)):
        assert torch.equal(attend(q, k, v, positions, block_table, window, **tiles), full), f"{draw}: {tiles}"
    with pytest.MonkeyPatch.context() as mp:  # a tiny workspace: one launch per tile
        mp.setattr(attention, "WORKSPACE_BYTES", 1)
        assert torch.equal(attend(q[:12], k, v, positions[:12], block_table, window), full[:12]), f"{draw}"

    other_q = draw.randn(5, 6, 16)  # beside another sequence in one launch: its own table, more splits
    other_pos = torch.arange(90, 95, device=DEVICE)
    other_table = torch.randperm(16, generator=draw.gen).to(DEVICE)
    together = attention.paged_attention_varlen(
        torch.cat([other_q, q]), k, v, torch.cat([other_pos, positions]),
        torch.stack([other_table, block_table]), [0, 5, 35], 0.25, window,
        out=torch.full((35, 6, 16), NAN, device=DEVICE), workspace_fill=NAN, **TILES)
    assert torch.equal(together[5:], full), f"{draw}: rows changed beside another sequence"
    assert torch.equal(together[:5], attend(other_q, k, v, other_pos, other_table, window))


def test_reference_decode_batch_equals_each_sequence_alone(draw):
    k, v, _ = make_cache(draw)
    tables = [torch.randperm(16, generator=draw.gen) for _ in range(3)]
    q = draw.randn(3, 6, 16).cpu()
    positions = torch.tensor([5, 70, 127])
    together = paged_decode_attention_ref(q, k.cpu(), v.cpu(), positions, tables, 0.25, window=None)
    for i in range(3):
        alone = paged_attention_ref(q[i:i + 1], k.cpu(), v.cpu(), positions[i:i + 1], tables[i], 0.25)
        assert torch.equal(together[i], alone[0]), f"{draw}: sequence {i}"


@pytest.mark.parametrize("window", [None, 13])
def test_reference_is_attention_to_float32_precision(draw, window):
    """Exactness costs no accuracy: within float32's error bound for the row's weighted sum
    (n terms: n * 2^-24 * max|v|) of a float64 softmax attention."""
    k, v, block_table = make_cache(draw)
    k, v, block_table = k.cpu(), v.cpu(), block_table.cpu()
    q = draw.randn(20, 6, 16).cpu()
    positions = torch.arange(60, 80)
    got = paged_attention_ref(q, k, v, positions, block_table, 0.25, window)
    keys = k[block_table].flatten(0, 1).double()  # [L, KVH, D] in position order
    values = v[block_table].flatten(0, 1).double()
    for row, pos in enumerate(positions.tolist()):
        first = 0 if window is None else max(0, pos - window + 1)
        kk = keys[first:pos + 1].repeat_interleave(3, dim=1)  # [n, H, D]
        vv = values[first:pos + 1].repeat_interleave(3, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[row].double(), kk) * 0.25, dim=-1)
        want = torch.einsum("hn,nhd->hd", weights, vv)
        bound = len(vv) * 2.0 ** -24 * float(vv.abs().max())  # a float32 sum of the row's terms
        torch.testing.assert_close(got[row].double(), want, rtol=0, atol=bound,
                                   msg=lambda m: f"{draw}: row {row}: {m}")


def test_bitwise_checks_can_fail(draw):
    """Negative controls: a float32 softmax attention in torch's order is not bitwise the reference,
    and a change of 2^-12 in the newest cached value vector moves the output."""
    k, v, block_table = make_cache(draw)
    k, v, block_table = k.cpu(), v.cpu(), block_table.cpu()
    q = draw.randn(8, 6, 16).cpu()
    positions = torch.arange(100, 108)
    want = paged_attention_ref(q, k, v, positions, block_table, 0.25)
    keys = k[block_table].flatten(0, 1)[:108].transpose(0, 1).repeat_interleave(3, dim=0)  # [H, L, D]
    values = v[block_table].flatten(0, 1)[:108].transpose(0, 1).repeat_interleave(3, dim=0)
    mask = torch.arange(108)[None, :] <= positions[:, None]
    stock = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), keys, values,
                                                             attn_mask=mask, scale=0.25).transpose(0, 1)
    torch.testing.assert_close(stock, want, rtol=2e-5, atol=2e-6 * float(want.abs().max()))  # the same attention...
    assert not torch.equal(stock, want), f"{draw}"  # ...but not the same bits
    nudged = v.clone()
    newest = nudged[block_table[107 // 8], 107 % 8]
    newest += grid.on_grid(newest * 2.0 ** -12, 20)
    assert not torch.equal(paged_attention_ref(q, k, nudged, positions, block_table, 0.25), want)


def test_cache_vectors_sit_on_their_grid(draw):
    """write_kv_ref's rounding is a fixed point, and the kernel refuses what it cannot sum exactly."""
    for dtype, bits in ((torch.float32, 22), (torch.bfloat16, 22), (torch.float32, 20)):
        x = (draw.randn(64, 2, 128).cpu() * torch.pow(2.0, torch.randint(-30, 30, (64, 2, 1), generator=draw.gen))).to(dtype)
        once = grid.on_grid(x, bits)
        assert torch.equal(grid.on_grid(once, bits), once)
        ints, e = grid.to_fixed(once, bits)
        assert torch.equal(ints, once.double() * grid.pow2(bits - 1 - e).unsqueeze(-1)), "not on the grid"
        assert float(ints.abs().max()) <= 2 ** bits
        assert (once.float() - x.float()).abs().le(x.float().abs().amax(-1, keepdim=True) * 2.0 ** (1 - bits)).all()
    k, v, block_table = make_cache(draw)
    q = draw.randn(1, 6, 16)
    with pytest.raises(ValueError, match="at most 512"):
        attention.paged_attention(q, k, v, torch.tensor([5]), block_table, 0.25, split_size=1024)


# ---- heads of 512 (Gemma 4's global layers): the widest whose q.k is exact ----

WIDEST = MAX_HEAD_DIM


def test_qk_sum_is_exact_at_512_at_the_grid_extremes():
    """The reference's q.k (float64 matmul of q on its grid and the stored k) equals the exact
    integer dot at 512 dims with every product at the grid's largest (|q_int| = 2^22 where the
    largest element rounds up to it, 2^22 - 1 elsewhere; every stored |k_int| = 2^22 - 1, the
    most a stored k can be): 2^53 - 2^31 at most. At 1024 dims the same inputs leave float64's
    exact range, which is why wider heads are refused."""
    for dims, exact in ((WIDEST, True), (2 * WIDEST, False)):
        q = torch.full((1, 1, dims), K_TOP)
        q[..., 0] = Q_TOP  # rounds up to 2^22 on q's grid
        k = torch.full((1, 1, 1, dims), torch.nan)
        v = k.clone()
        write_kv_ref(k, v, torch.full((1, 1, dims), K_TOP), torch.ones(1, 1, dims), torch.tensor([0]))
        q_int, q_exp = grid.to_fixed(q, QK_BITS)
        k_int, k_exp = grid.to_fixed(k[0, 0], QK_BITS)
        assert float(q_int.max()) == 2 ** 22 and float(k_int.abs().max()) == 2 ** 22 - 1 and int(k_exp) == 0
        want = int((q_int.to(torch.int64) * k_int.to(torch.int64)).sum())  # exact in int64
        got = torch.matmul(q_int * grid.pow2(q_exp - QK_BITS + 1).unsqueeze(-1), k[0, 0].double().T)
        got_int = int(got * 2.0 ** (2 * (QK_BITS - 1)))  # the products' unit, 2^-42 here
        assert (got_int == want) == exact, (dims, got_int, want)
    assert want > 2 ** 53 > 2 ** 53 - 2 ** 31 >= (2 ** 22) * (2 ** 22 - 1) * WIDEST


@pytest.mark.parametrize("extremes", [False, True], ids=["random", "grid-extremes"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32cache", "bf16cache"])
def test_kernel_equals_reference_at_512(draw, kv_dtype, extremes):
    """Heads of 512: decode, verify and prefill rows, sliding and not, bitwise the reference; at
    the grid's extremes every q.k product is the largest (signs agreeing on every other key)."""
    k, v, block_table = make_cache(draw, num_blocks=4, page=8, head_dim=WIDEST, dtype=kv_dtype)
    q = draw.randn(8, 6, WIDEST)
    if extremes:  # every slot rewritten: K and V at their top, every other key all positive as q is
        top_k = at_the_top(draw.gen, (32, 2, WIDEST), K_TOP, kv_dtype)
        top_k[::2] = top_k[::2].abs()
        write_kv_ref(k, v, top_k, at_the_top(draw.gen, (32, 2, WIDEST), V_TOP, kv_dtype),
                     torch.arange(32, device=DEVICE))
        q = at_the_top(draw.gen, (8, 6, WIDEST), Q_TOP).abs()
    for rows, start, window in ((1, 31, None), (3, 20, 13), (8, 0, None)):
        positions = torch.arange(start, start + rows, device=DEVICE)
        got = attend(q[:rows], k, v, positions, block_table, window)
        want = attend_ref(q[:rows], k, v, positions, block_table, window)
        assert torch.equal(got, want), f"{draw}: rows {rows} at {start}: max diff {(got - want).abs().max()}"
    wide = torch.zeros(1, 8, 2, WIDEST + 2, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 514: must be even and at most 512"):
        attention.paged_attention(draw.randn(1, 6, WIDEST + 2), wide, wide, torch.tensor([0], device=DEVICE),
                                  block_table[:1], 0.25)


def test_exp_polynomial_is_accurate():
    x = torch.cat([-torch.logspace(-30, 2, 20000), torch.tensor([0.0, -0.0, -87.0, -86.99, -float("inf")])])
    got = float32.exp_neg(x.float())
    want = torch.exp(x.float().double())
    close = x > -80
    rel = ((got[close].double() - want[close]) / want[close]).abs()
    assert float(rel.max()) < 2 * 2.0 ** -24
    assert got[-1] == 0 and got[-3] == 0 and 0 < got[-2] < 2 ** -125 and got[-4] == 1 and got[-5] == 1


# ---- the same check at model size, on a GPU ----

@gpu
@pytest.mark.gpu
def test_gpu_attention_model_size(draw):
    k, v, block_table = make_cache(draw, num_blocks=256, page=16, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    q = draw.randn(300, 32, 128, dtype=torch.bfloat16)
    positions = torch.arange(3700, 4000, device=DEVICE)
    full = attention.paged_attention(q, k, v, positions, block_table, 128 ** -0.5, None)
    want = paged_attention_ref(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), block_table.cpu(), 128 ** -0.5, None)
    assert torch.equal(full.cpu(), want), f"{draw}"
    for row in (0, 150, 299):
        alone = attention.paged_attention(q[row:row + 1], k, v, positions[row:row + 1], block_table, 128 ** -0.5)
        assert torch.equal(alone[0], full[row]), f"{draw}: row {row}"


@gpu
@pytest.mark.gpu
def test_gpu_attention_heads_of_512(draw):
    """Gemma 4 E2B's global layers (8 heads over 1 KV head of 512), compiled: the kernel's wide
    tiles (q's and the sums' halves [16, 256] float64) keep the reference's bits."""
    k, v, block_table = make_cache(draw, num_blocks=64, page=16, kv_heads=1, head_dim=WIDEST, dtype=torch.bfloat16)
    q = draw.randn(40, 8, WIDEST, dtype=torch.bfloat16)
    positions = torch.arange(960, 1000, device=DEVICE)
    full = attention.paged_attention(q, k, v, positions, block_table, 1.0, None)
    want = paged_attention_ref(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), block_table.cpu(), 1.0, None)
    assert torch.equal(full.cpu(), want), f"{draw}"
    alone = attention.paged_attention(q[-1:], k, v, positions[-1:], block_table, 1.0)
    assert torch.equal(alone[0], full[-1]), f"{draw}"
