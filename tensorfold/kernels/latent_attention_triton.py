"""GLM-5's latent attention and the DSA indexer's scores in Triton: the cuda op set's
`latent_attention` and `dsa_select`, bitwise kernels/latent_attention.py (whose docstring has the
steps; the same grids, the same IEEE float32 steps, integer sums).

latent_attention_kernel: a program owns one row, BLOCK_H of its heads and LAT_CHUNK of the latent
dims, and walks the row's keys (every key at or before its position, or its selection's positions)
BLOCK_N at a time through the block table, twice: the first pass finds each head's largest score
and the largest value exponent, the second sums exp_neg(score - max) onto the integer denominator
and the weighted latent sum (float64 tl.dot of integers, exact over at most SPLIT_SIZE keys, int64
across them). Scores are float64 tl.dots of q and the key on their grids, exact, rounded once. The
program's keys and arithmetic depend on its row alone, so a row's bits do not depend on the batch.

indexer_scores_kernel: a program owns one row and BLOCK_N keys; per head (ascending from head 0)
relu(float32(exact dot) * scale) * weight added in float32. The top index_topk keys are then a
stable descending torch.sort per row (ties to the lower position), as the reference's.

Launched with FMA contraction off (exact_triton.LAUNCH_EXACT). Tested in Triton's interpreter
(tests/test_latent_attention_kernels.py); not yet timed on a GPU.
"""
import torch
import triton
import triton.language as tl

from tensorfold.exact.float32 import f32
from tensorfold.kernels import exact_triton as ex
from tensorfold.kernels import latent_attention as ref
from tensorfold.kernels import paged_attention as paged

V_BITS = tl.constexpr(paged.V_BITS)
W_BITS = tl.constexpr(paged.W_BITS)
L_BITS = tl.constexpr(paged.L_BITS)
NO_KEY_EXPONENT = tl.constexpr(paged.NO_KEY_EXPONENT)
SPLIT_SIZE = tl.constexpr(paged.SPLIT_SIZE)

BLOCK_H = 16    # heads per program (tl.dot's M)
BLOCK_N = 16    # keys per step
D_CHUNK = 64    # dims per step of a dot
LAT_CHUNK = 64  # latent dims per program


@triton.jit
def _row_keys(table_ptr, sel_ptr, row, pos, start, top_k, PAGE: tl.constexpr, DIM: tl.constexpr,
              BLOCK_N: tl.constexpr, HAS_SEL: tl.constexpr):
    """Keys [start, start + BLOCK_N) of the row's list: their cache offsets (int64) and validity."""
    i = start + tl.arange(0, BLOCK_N)
    if HAS_SEL:
        j = tl.load(sel_ptr + row * top_k + i, mask=i < top_k, other=-1)
        ok = (j >= 0) & (j <= pos)
    else:
        j = i
        ok = i <= pos
    j = tl.where(ok, j, 0)
    page = tl.load(table_ptr + j // PAGE, mask=ok, other=0).to(tl.int64)
    return (page * PAGE + j % PAGE) * DIM, ok


@triton.jit
def _exponents(ptr, base, ok, WIDTH: tl.constexpr, D_CHUNK: tl.constexpr):
    """exponent(max |x|) of each vector's first WIDTH elements (ptr + base[i] + d)."""
    amax = tl.zeros(base.shape, tl.float32)
    for d0 in tl.static_range(0, WIDTH, D_CHUNK):
        dims = d0 + tl.arange(0, D_CHUNK)
        x = tl.load(ptr + base[:, None] + dims[None, :], mask=ok[:, None] & (dims < WIDTH)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 1))
    return ex.exponent(amax)


@triton.jit
def _dots(q_ptr, q_base, q_ok, q_exp, cache_ptr, k_base, k_ok, k_exp, DIM: tl.constexpr, BITS: tl.constexpr,
          D_CHUNK: tl.constexpr):
    """float32(q . k) [heads, keys] with both on their grids of BITS: exact float64 dots, rounded once."""
    dots = tl.zeros([q_base.shape[0], k_base.shape[0]], tl.float64)
    for d0 in tl.static_range(0, DIM, D_CHUNK):
        dims = d0 + tl.arange(0, D_CHUNK)
        in_dim = (dims < DIM)[None, :]
        q = tl.load(q_ptr + q_base[:, None] + dims[None, :], mask=q_ok[:, None] & in_dim, other=0.0)
        k = tl.load(cache_ptr + k_base[:, None] + dims[None, :], mask=k_ok[:, None] & in_dim, other=0.0)
        dots += tl.dot(ex.to_fixed(q.to(tl.float32), q_exp, BITS), tl.trans(ex.to_fixed(k.to(tl.float32), k_exp, BITS)))
    return (dots * ex.pow2(q_exp[:, None] + k_exp[None, :] + (2 - 2 * BITS))).to(tl.float32)


@triton.jit
def latent_attention_kernel(q_ptr, cache_ptr, positions_ptr, row_seq_ptr, tables_ptr, sel_ptr, out_ptr,
                            table_width, top_k, scale, HEADS: tl.constexpr, DIM: tl.constexpr,
                            LATENT: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr, HAS_SEL: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D_CHUNK: tl.constexpr,
                            LAT_CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    lat = tl.program_id(2) * LAT_CHUNK + tl.arange(0, LAT_CHUNK)
    pos = tl.load(positions_ptr + row)
    table_ptr = tables_ptr + tl.load(row_seq_ptr + row).to(tl.int64) * table_width
    if HAS_SEL:
        n = top_k.to(tl.int64)
    else:
        n = pos + 1
    h_ok = heads < HEADS
    q_base = (row * HEADS + heads) * DIM
    q_exp = _exponents(q_ptr, q_base, h_ok, DIM, D_CHUNK)
    # pass 1: each head's largest score, the largest value exponent among the row's keys
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    top = tl.full([1], NO_KEY_EXPONENT, tl.int32)
    for start in range(0, n, BLOCK_N):
        k_base, k_ok = _row_keys(table_ptr, sel_ptr, row, pos, start, top_k, PAGE, DIM, BLOCK_N, HAS_SEL)
        k_exp = _exponents(cache_ptr, k_base, k_ok, DIM, D_CHUNK)
        scores = _dots(q_ptr, q_base, h_ok, q_exp, cache_ptr, k_base, k_ok, k_exp, DIM, BITS, D_CHUNK) * scale
        m = tl.maximum(m, tl.max(tl.where(k_ok[None, :], scores, float("-inf")), 1))
        v_exp = _exponents(cache_ptr, k_base, k_ok, LATENT, D_CHUNK)
        top = tl.maximum(top, tl.max(tl.where(k_ok, v_exp, NO_KEY_EXPONENT), 0))
    m = tl.where(m == float("-inf"), 0.0, m)
    top = tl.where(top == NO_KEY_EXPONENT, 0, top)
    # pass 2: the integer denominator and weighted latent sum
    den = tl.zeros([BLOCK_H], tl.float64)
    num = tl.zeros([BLOCK_H, LAT_CHUNK], tl.int64)
    lat_ok = lat < LATENT
    for chunk in range(0, n, SPLIT_SIZE):
        part = tl.zeros([BLOCK_H, LAT_CHUNK], tl.float64)
        for start in range(chunk, tl.minimum(chunk + SPLIT_SIZE, n), BLOCK_N):
            k_base, k_ok = _row_keys(table_ptr, sel_ptr, row, pos, start, top_k, PAGE, DIM, BLOCK_N, HAS_SEL)
            k_exp = _exponents(cache_ptr, k_base, k_ok, DIM, D_CHUNK)
            scores = _dots(q_ptr, q_base, h_ok, q_exp, cache_ptr, k_base, k_ok, k_exp, DIM, BITS, D_CHUNK) * scale
            p = tl.where(k_ok[None, :], ex.exp_neg(scores - m[:, None]), 0.0).to(tl.float64)
            den += tl.sum(ex.round_even(p * (2.0 ** L_BITS)), 1)
            v_exp = _exponents(cache_ptr, k_base, k_ok, LATENT, D_CHUNK)
            w = ex.round_even(p * ex.pow2(v_exp - top + W_BITS)[None, :])
            v = tl.load(cache_ptr + k_base[:, None] + lat[None, :], mask=k_ok[:, None] & lat_ok[None, :], other=0.0)
            part += tl.dot(w, ex.to_fixed(v.to(tl.float32), v_exp, V_BITS))  # exact: integers, < 2^53
        num += part.to(tl.int64)
    weighted = (num.to(tl.float64) * ex.pow2(top - V_BITS - W_BITS + 1)[:, None]).to(tl.float32)
    total = tl.where(den == 0.0, 1.0, den).to(tl.float32) * (2.0 ** -L_BITS)
    out = tl.math.div_rn(weighted, tl.broadcast_to(total[:, None], weighted.shape))
    tl.store(out_ptr + (row * HEADS + heads)[:, None] * LATENT + lat[None, :], out,
             mask=h_ok[:, None] & lat_ok[None, :])


@triton.jit
def indexer_scores_kernel(q_ptr, weights_ptr, keys_ptr, positions_ptr, row_seq_ptr, tables_ptr, out_ptr,
                          table_width, out_width, scale, HEADS: tl.constexpr, DIM: tl.constexpr,
                          D_PAD: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK_N
    pos = tl.load(positions_ptr + row)
    table_ptr = tables_ptr + tl.load(row_seq_ptr + row).to(tl.int64) * table_width
    j = start + tl.arange(0, BLOCK_N)
    ok = j <= pos
    page = tl.load(table_ptr + tl.where(ok, j, 0) // PAGE, mask=ok, other=0).to(tl.int64)
    dims = tl.arange(0, D_PAD)
    d_ok = dims < DIM
    k = tl.load(keys_ptr + ((page * PAGE + j % PAGE) * DIM)[:, None] + dims[None, :],
                mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    k_exp = ex.exponent(tl.max(tl.abs(k), 1))
    k_int = ex.to_fixed(k, k_exp, BITS)
    q_row = q_ptr + row * HEADS * DIM
    total = tl.zeros([BLOCK_N], tl.float32)
    for h in range(0, HEADS):
        q = tl.load(q_row + h * DIM + dims, mask=d_ok, other=0.0).to(tl.float32)
        q_exp = ex.exponent(tl.max(tl.abs(q), 0))
        q_int = ex.round_even(q.to(tl.float64) * ex.pow2(-q_exp + (BITS - 1)))
        dot = tl.sum(k_int * q_int[None, :], 1)  # exact: integers, < 2^53
        s = (dot * ex.pow2(k_exp + q_exp + (2 - 2 * BITS))).to(tl.float32) * scale
        s = tl.where(s < 0.0, 0.0, s)  # relu (NaN stays)
        term = s * tl.load(weights_ptr + row * HEADS + h)
        total = tl.where(h == 0, term, total + term)
    tl.store(out_ptr + row * out_width + j, tl.where(ok, total, float("-inf")), mask=j < out_width)


def _rows(batch, device):
    """Each row's sequence index (int32, on device), made once per forward."""
    def make():
        counts = torch.tensor([seq.end - seq.start for seq in batch.sequences], dtype=torch.int64)
        return torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts).to(device)
    return batch.memo(("latent rows", str(device)), make)


def latent_attention(query: torch.Tensor, cache, batch, scale: float, selection: torch.Tensor | None) -> torch.Tensor:
    """kernels/latent_attention.attention_by_sequence's signature and bits, in one launch."""
    rows, heads, dim = query.shape
    latent = cache.latent_dim
    out = torch.empty((rows, heads, latent), dtype=torch.float32, device=query.device)
    if rows == 0:
        return out
    kv = ex.aligned(cache.kv)
    q = ex.aligned(query.float())
    tables = ex.aligned(batch.block_tables.to(device=query.device, dtype=torch.int64))
    sel = ex.aligned(selection) if selection is not None else torch.empty((rows, 1), dtype=torch.int32,
                                                                          device=query.device)
    grid = (rows, triton.cdiv(heads, BLOCK_H), triton.cdiv(latent, LAT_CHUNK))
    latent_attention_kernel[grid](
        q, kv, batch.positions, _rows(batch, query.device), tables, sel, out, tables.shape[1], sel.shape[1],
        f32(scale), HEADS=heads, DIM=dim, LATENT=latent, PAGE=kv.shape[1], BITS=ref.dot_bits(dim),
        HAS_SEL=selection is not None, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, D_CHUNK=D_CHUNK, LAT_CHUNK=LAT_CHUNK,
        **ex.LAUNCH_EXACT)
    return out


def dsa_select(q: torch.Tensor, weights: torch.Tensor, cache, batch, scale: float, top_k: int) -> torch.Tensor | None:
    """kernels/latent_attention.dsa_select's signature and bits: the scores in one launch, then a
    stable descending sort per row."""
    positions = batch.positions
    if positions.numel() == 0 or int(positions.max()) < top_k:
        return None
    rows, heads, dim = q.shape
    length = int(positions.max()) + 1
    keys = ex.aligned(cache.index_keys)
    tables = ex.aligned(batch.block_tables.to(device=q.device, dtype=torch.int64))
    scores = torch.empty((rows, length), dtype=torch.float32, device=q.device)
    indexer_scores_kernel[(rows, triton.cdiv(length, BLOCK_N))](
        ex.aligned(q.float()), ex.aligned(weights.float()), keys, positions, _rows(batch, q.device), tables, scores,
        tables.shape[1], length, f32(scale), HEADS=heads, DIM=dim, D_PAD=triton.next_power_of_2(dim),
        PAGE=keys.shape[1], BITS=ref.dot_bits(dim), BLOCK_N=BLOCK_N, **ex.LAUNCH_EXACT)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    chosen = order.sort(dim=-1).values
    lanes = torch.arange(top_k, device=q.device)
    every = torch.where(lanes[None, :] <= positions[:, None], lanes[None, :], -1)  # rows seeing <= top_k keys
    return torch.where((positions < top_k)[:, None], every, chosen).to(torch.int32)
