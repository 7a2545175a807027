"""Paged attention in Triton for prefill chunks and decode/verify rows (GQA, causal, sliding window).

The contract is bitwise: the same bits as `paged_attention_ref` (kernels/paged_attention.py),
whose docstring lists the steps. Both compute every sum exactly on integers (tensorfold/exact):
q on its fixed-point grid against a cache whose vectors `write_kv_ref` put on theirs, so q.k is
an exact float64 dot product; softmax weights and v on one integer grid per row, so the weighted
sum is exact too; exp is exact.exp_neg's polynomial, not libdevice's. Exact sums have no order,
so no tiling, split or batch can change a row's bits, and the reference needs no knowledge of
how the kernel walks the cache.

Layout of the work. A program owns one tile of query rows of one sequence (BLOCK_M lanes: lane i
is row i // GROUP, query head kv_head * GROUP + i % GROUP, so a K/V tile is loaded once for the
whole group), one KV head and one KV split of SPLIT_SIZE positions, walked in BLOCK_N steps.
Three launches:
1. `attention_stats_kernel`: per split, each lane's largest visible score and largest visible v
   exponent (the launcher takes the max over splits: exact);
2. `attention_sums_kernel`: per split, the integer weighted sum (float64 tl.dot of integers:
   exact while a split holds <= 512 keys) and the integer denominator;
3. `attention_finish_kernel`: per row and head, the splits added as int64, num scaled by a power
   of two and rounded to float32 (through float64), den to float32, one float32 division
   (div.rn.f32), the rounding to the output dtype.
Kernels are launched with FMA contraction off (exact_triton.LAUNCH_EXACT). The price of
exactness on a GPU: K is read twice (stats, then sums), V twice for its exponents, and the dots
run in float64 (tensor cores do float64 on sm80+ at a fraction of their bf16 rate); nothing here
has been timed on a GPU yet (docs/kernels.md).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tensorfold.kernels import exact_triton as ex
from tensorfold.kernels import paged_attention as ref
from tensorfold.kernels.paged_attention import SPLIT_SIZE, paged_attention_ref  # noqa: F401

# The reference's fixed-point widths, as constants a compiled kernel may read.
QK_BITS = tl.constexpr(ref.QK_BITS)
V_BITS = tl.constexpr(ref.V_BITS)
W_BITS = tl.constexpr(ref.W_BITS)
L_BITS = tl.constexpr(ref.L_BITS)
NO_KEY_EXPONENT = tl.constexpr(ref.NO_KEY_EXPONENT)

BLOCK_M = 16       # query lanes (rows x group heads) per program
BLOCK_N = 32       # KV positions per step
WORKSPACE_BYTES = 256 << 20  # split partials per launch; long prefills run in several launches


@triton.jit
def _tile(q_ptr, positions_ptr, tile_seq_ptr, tile_start_ptr, tile_end_ptr, window, stride_qr, stride_qh,
          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """What a program of the stats and sums kernels works on: its tile's sequence, its lanes' rows,
    query heads, validity and positions, their q on its grid (even dims, odd dims), and the keys [lo, hi) of its split
    that any lane may see (steps outside would only add exact zeros)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    row_start = tl.load(tile_start_ptr + tile)
    row_end = tl.load(tile_end_ptr + tile)
    lanes = tl.arange(0, BLOCK_M)
    rows = row_start + lanes // GROUP
    heads = kv_head * GROUP + lanes % GROUP
    lane_ok = (lanes < (BLOCK_M // GROUP) * GROUP) & (rows < row_end)
    pos = tl.load(positions_ptr + rows, mask=lane_ok, other=-1).to(tl.int32)  # -1 sees nothing
    q_even, q_odd = _q_on_grid(q_ptr, rows, heads, lane_ok, stride_qr, stride_qh, HEAD_DIM, HALF)
    lo = split * SPLIT
    hi = tl.minimum(tl.max(pos, 0) + 1, lo + SPLIT)
    if HAS_WINDOW:
        first = tl.min(tl.where(lane_ok, pos - window + 1, hi), 0)
        lo = tl.maximum(lo, first // BLOCK_N * BLOCK_N)
    return kv_head, split, seq, rows, heads, lane_ok, pos, q_even, q_odd, lo, hi


@triton.jit
def _load_pairs(ptr, base, ok, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """Elements 2j and 2j + 1 (j < HALF) of the vectors at element offsets `base` [R] (rows masked
    by `ok`), as two float32 [R, HALF] tensors: the even and the odd dims. A dot product is exact
    here, so it may run over the dims in any order: even dims, then odd ones. bfloat16 vectors are
    read as 32-bit words, a pair per word, because a float64 tl.dot whose operands come from
    loads narrower than 32 bits does not compile on sm_80+ (Triton picks an operand layout for
    the narrow type that float64 MMA lacks; seen with Triton 3.6 on an H200)."""
    j = tl.arange(0, HALF)
    mask = ok[:, None] & (2 * j < HEAD_DIM)[None, :]
    if ptr.dtype.element_ty == tl.bfloat16:
        words = tl.load(ptr.to(tl.pointer_type(tl.int32)) + (base // 2)[:, None] + j[None, :], mask=mask, other=0)
        even = (words << 16).to(tl.float32, bitcast=True)
        odd = (words & -65536).to(tl.float32, bitcast=True)
    else:
        even = tl.load(ptr + base[:, None] + 2 * j[None, :], mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(ptr + base[:, None] + 2 * j[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    return even, odd


@triton.jit
def _q_on_grid(q_ptr, rows, heads, lane_ok, stride_qr, stride_qh, HEAD_DIM: tl.constexpr,
               HALF: tl.constexpr):
    """The lanes' q rows on their fixed-point grid, float64 [BLOCK_M, HALF] twice: even and odd dims."""
    even, odd = _load_pairs(q_ptr, rows * stride_qr + heads * stride_qh, lane_ok, HEAD_DIM, HALF)
    e = ex.exponent(tl.maximum(tl.max(tl.abs(even), 1), tl.max(tl.abs(odd), 1)))
    unit = ex.pow2(e - QK_BITS + 1)[:, None]
    return ex.to_fixed(even, e, QK_BITS) * unit, ex.to_fixed(odd, e, QK_BITS) * unit


@triton.jit
def _kv_step(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, start, hi, q_even, q_odd, pos, scale,
             window, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
             HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
             HAS_WINDOW: tl.constexpr):
    """One BLOCK_N step of keys: scores [BLOCK_M, BLOCK_N] (float32, -inf where unseen), which keys
    each lane sees, v as float32 [BLOCK_N, HALF] (even dims, odd dims) and v's exponents [BLOCK_N]."""
    keys = start + tl.arange(0, BLOCK_N)  # absolute positions
    key_ok = keys < hi
    page = tl.load(block_tables_ptr + seq * stride_bt + keys // PAGE, mask=key_ok, other=0)
    slot = keys % PAGE
    k_even, k_odd = _load_pairs(k_cache_ptr, page * stride_kb + slot * stride_ks + kv_head * stride_kh,
                                key_ok, HEAD_DIM, HALF)
    v_even, v_odd = _load_pairs(v_cache_ptr, page * stride_vb + slot * stride_vs + kv_head * stride_vh,
                                key_ok, HEAD_DIM, HALF)
    # exact: integers on one grid; each half's dot < 2^52 and their sum < 2^53 for HEAD_DIM <= 512
    dots = tl.dot(q_even, tl.trans(k_even.to(tl.float64)))
    dots += tl.dot(q_odd, tl.trans(k_odd.to(tl.float64)))
    scores = dots.to(tl.float32) * tl.cast(scale, tl.float32)  # the exact dot rounded once, times f32 scale
    seen = keys[None, :] <= pos[:, None]
    if HAS_WINDOW:
        seen &= keys[None, :] > pos[:, None] - window
    scores = tl.where(seen, scores, float("-inf"))
    v_exp = ex.exponent(tl.maximum(tl.max(tl.abs(v_even), 1), tl.max(tl.abs(v_odd), 1)))
    return scores, seen, v_even, v_odd, v_exp


@triton.jit(do_not_specialize=["window", "row_base", "max_splits"])
def attention_stats_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, block_tables_ptr,
        tile_seq_ptr, tile_start_ptr, tile_end_ptr, max_ptr, top_ptr,
        scale, window, row_base,
        stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_bt, max_splits,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Per lane and split: the largest visible score and the largest visible v exponent."""
    kv_head, split, seq, rows, heads, lane_ok, pos, q_even, q_odd, lo, hi = _tile(
        q_ptr, positions_ptr, tile_seq_ptr, tile_start_ptr, tile_end_ptr, window, stride_qr, stride_qh,
        GROUP, HEAD_DIM, HALF, BLOCK_M, BLOCK_N, SPLIT, HAS_WINDOW)

    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    top = tl.full([BLOCK_M], NO_KEY_EXPONENT, tl.int32)
    for start in range(lo, hi, BLOCK_N):
        scores, seen, v_even, v_odd, v_exp = _kv_step(
            k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, start, hi, q_even, q_odd, pos, scale,
            window, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
            HEAD_DIM, HALF, PAGE, BLOCK_N, HAS_WINDOW)
        best = tl.maximum(best, tl.max(scores, 1))
        top = tl.maximum(top, tl.max(tl.where(seen, v_exp[None, :], NO_KEY_EXPONENT), 1))
    part = ((rows - row_base).to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * max_splits + split
    tl.store(max_ptr + part, best, mask=lane_ok)
    tl.store(top_ptr + part, top, mask=lane_ok)


@triton.jit(do_not_specialize=["window", "row_base", "max_splits"])
def attention_sums_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, block_tables_ptr,
        tile_seq_ptr, tile_start_ptr, tile_end_ptr, max_ptr, top_ptr, num_ptr, den_ptr,
        scale, window, row_base,
        stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_bt, max_splits,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Per lane and split: sum_j w_j v_j on the row's integer grid, and sum_j round(p_j 2^L_BITS)."""
    kv_head, split, seq, rows, heads, lane_ok, pos, q_even, q_odd, lo, hi = _tile(
        q_ptr, positions_ptr, tile_seq_ptr, tile_start_ptr, tile_end_ptr, window, stride_qr, stride_qh,
        GROUP, HEAD_DIM, HALF, BLOCK_M, BLOCK_N, SPLIT, HAS_WINDOW)
    lane = (rows - row_base).to(tl.int64) * (tl.num_programs(1) * GROUP) + heads  # [launch rows, heads]
    row_max = tl.load(max_ptr + lane, mask=lane_ok, other=0.0)
    lane_scale = ex.pow2(-tl.load(top_ptr + lane, mask=lane_ok, other=0) + W_BITS)

    num_even = tl.zeros([BLOCK_M, HALF], tl.float64)
    num_odd = tl.zeros([BLOCK_M, HALF], tl.float64)
    den = tl.zeros([BLOCK_M], tl.float64)
    for start in range(lo, hi, BLOCK_N):
        scores, seen, v_even, v_odd, v_exp = _kv_step(
            k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, start, hi, q_even, q_odd, pos, scale,
            window, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
            HEAD_DIM, HALF, PAGE, BLOCK_N, HAS_WINDOW)
        p = ex.exp_neg(scores - row_max[:, None]).to(tl.float64)  # 0 where unseen
        den += tl.sum(ex.round_even(p * (2.0 ** L_BITS)), 1)
        w = ex.round_even((p * ex.pow2(v_exp)[None, :]) * lane_scale[:, None])
        v_unit = ex.pow2(-v_exp + (V_BITS - 1))[:, None]
        num_even += tl.dot(w, v_even.to(tl.float64) * v_unit)  # exact: integer terms, a split sums to < 2^53
        num_odd += tl.dot(w, v_odd.to(tl.float64) * v_unit)
    j = tl.arange(0, HALF)
    part = lane * max_splits + split
    tl.store(den_ptr + part, den, mask=lane_ok)
    mask = lane_ok[:, None] & (2 * j < HEAD_DIM)[None, :]
    tl.store(num_ptr + part[:, None] * HEAD_DIM + 2 * j[None, :], num_even, mask=mask)
    tl.store(num_ptr + part[:, None] * HEAD_DIM + 2 * j[None, :] + 1, num_odd, mask=mask)


@triton.jit(do_not_specialize=["row_base", "max_splits"])
def attention_finish_kernel(
        num_ptr, den_ptr, top_ptr, out_ptr, row_base, max_splits, stride_or, stride_oh,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """out = float32(sum of the splits' integer sums, scaled) / (float32(sum of their
    denominators) 2^-L_BITS): the reference's step 4."""
    local = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    lane = local * tl.num_programs(1) + head
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    num = tl.zeros([D_PAD], tl.int64)
    den = tl.zeros([1], tl.float64)
    for s in range(0, max_splits):  # integers: the order is immaterial
        num += tl.load(num_ptr + (lane * max_splits + s) * HEAD_DIM + dims, mask=dim_ok, other=0.0).to(tl.int64)
        den += tl.load(den_ptr + lane * max_splits + s)
    den = tl.where(den == 0.0, 1.0, den)
    top = tl.load(top_ptr + lane)
    weighted = (num.to(tl.float64) * ex.pow2(top - V_BITS - W_BITS + 1)).to(tl.float32)
    total = den.to(tl.float32) * (2.0 ** -L_BITS)  # exact: a power of two
    out = tl.math.div_rn(weighted, tl.broadcast_to(total, weighted.shape))  # IEEE float32 division
    tl.store(out_ptr + (row_base + local) * stride_or + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    positions: torch.Tensor, block_table: torch.Tensor, scale: float,
                    window: int | None = None, *, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                    split_size: int = SPLIT_SIZE, out: torch.Tensor | None = None,
                    workspace_fill: float | None = None) -> torch.Tensor:
    """`paged_attention_ref`'s contract for one sequence: q [num_rows, num_heads, head_dim] at
    `positions` [num_rows]; returns [num_rows, num_heads, head_dim] in q's dtype."""
    return paged_attention_varlen(q, k_cache, v_cache, positions, block_table.reshape(1, -1),
                                  [0, q.shape[0]], scale, window, block_m=block_m, block_n=block_n,
                                  split_size=split_size, out=out, workspace_fill=workspace_fill)


@dataclass(frozen=True)
class TilePlan:
    """How a varlen call walks its rows, the same for every layer of a forward with the same heads:
    the tiling it was made for (block_m, split_size), the number of KV splits (from the largest
    position) and the launches, each (row_base, row_end, tile_seq, tile_start, tile_end) with the
    tile columns on the device. Making it reads the largest position back from the device and
    copies the tiles there once: a model builds it once per forward (ForwardBatch.memo), not once
    per layer."""
    block_m: int
    split_size: int
    max_splits: int
    launches: list


def tile_plan(positions: torch.Tensor, row_starts: list[int], num_heads: int, group: int, head_dim: int,
              block_m: int = BLOCK_M, split_size: int = SPLIT_SIZE) -> TilePlan:
    """Tiles of block_m // group rows of one sequence, in row order; a launch takes consecutive
    tiles while the split partials of its rows stay under WORKSPACE_BYTES."""
    max_splits = int(positions.max()) // split_size + 1
    rows_per_tile = block_m // group
    launch_rows = max(rows_per_tile, WORKSPACE_BYTES // (num_heads * max_splits * (head_dim + 3) * 8))
    tiles, runs = [], [0]  # runs: where each launch's tiles start in `tiles`
    for seq, (a, b) in enumerate(zip(row_starts[:-1], row_starts[1:])):
        for start in range(a, b, rows_per_tile):
            if len(tiles) > runs[-1] and min(start + rows_per_tile, b) - tiles[runs[-1]][1] > launch_rows:
                runs.append(len(tiles))
            tiles.append((seq, start, min(start + rows_per_tile, b)))
    runs.append(len(tiles))
    columns = torch.tensor(tiles, dtype=torch.int32).T.contiguous().to(positions.device)  # one copy
    launches = [(tiles[i][1], tiles[j - 1][2], *columns[:, i:j].unbind(0)) for i, j in zip(runs[:-1], runs[1:])]
    return TilePlan(block_m, split_size, max_splits, launches)


def paged_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           positions: torch.Tensor, block_tables: torch.Tensor, row_starts: list[int],
                           scale: float, window: int | None = None, *, block_m: int = BLOCK_M,
                           block_n: int = BLOCK_N, split_size: int = SPLIT_SIZE,
                           out: torch.Tensor | None = None, workspace_fill: float | None = None,
                           plan: "TilePlan | None" = None) -> torch.Tensor:
    """Several sequences in one launch: sequence i owns rows row_starts[i]:row_starts[i + 1] of q
    and row i of block_tables [num_seqs, max_blocks]. Tile and split sizes are free (the result
    does not depend on them); split_size must be <= 512 (exactness of a split's float64 sum) and a
    multiple of block_n. `out` receives the result; `workspace_fill` pre-fills the split partials
    (tests: NaN, so a read of an unwritten partial shows). `plan`: tile_plan's result for these
    rows, made once per forward by a caller that runs many layers (else made here)."""
    num_rows, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if group * num_kv_heads != num_heads or group > block_m:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads with block_m {block_m}")
    if split_size % block_n or block_n < 16 or block_m < 16 or split_size > SPLIT_SIZE:
        raise ValueError(f"split_size {split_size} must be a multiple of block_n {block_n} (>= 16) "
                         f"and at most {SPLIT_SIZE}")
    if head_dim > ref.MAX_HEAD_DIM or head_dim % 2:
        raise ValueError(f"head_dim {head_dim}: must be even and at most {ref.MAX_HEAD_DIM} "
                         "(q.k in float64's exact range)")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{name} is {t.dtype}: the kernel reads float32 or bfloat16")
    if out is None:
        out = torch.empty_like(q)  # [num_rows, num_heads, head_dim]
    elif out.shape != q.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} tensor")
    if num_rows == 0:
        return out
    q = ex.aligned(q)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    device = q.device
    positions = positions.to(device=device, dtype=torch.int64).contiguous()
    block_tables = block_tables.to(device=device, dtype=torch.int64).contiguous()
    if plan is None:
        plan = tile_plan(positions, row_starts, num_heads, group, head_dim, block_m, split_size)
    elif (plan.block_m, plan.split_size) != (block_m, split_size):
        raise ValueError(f"a plan for block_m {plan.block_m}, split_size {plan.split_size} given to a call with "
                         f"{block_m}, {split_size}")
    max_splits = plan.max_splits
    d_pad = triton.next_power_of_2(max(head_dim, 16))
    half = triton.next_power_of_2(max(head_dim, 32)) // 2  # even and odd dims; tl.dot wants K >= 16
    has_window = window is not None
    target = ex.aligned(out)
    for row_base, row_end, tile_seq, tile_start, tile_end in plan.launches:
        parts = (row_end - row_base, num_heads, max_splits)
        best = torch.empty(parts, dtype=torch.float32, device=device)
        top = torch.empty(parts, dtype=torch.int32, device=device)
        den = torch.empty(parts, dtype=torch.float64, device=device)
        num = torch.empty((*parts, head_dim), dtype=torch.float64, device=device)
        if workspace_fill is not None:
            for t in (best, den, num):
                t.fill_(workspace_fill)
            top.fill_(2 ** 30)
        grid = (len(tile_seq), num_kv_heads, max_splits)
        common = (scale, window if has_window else 0, row_base,
                  q.stride(0), q.stride(1),
                  k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                  block_tables.stride(0), max_splits)
        sizes = dict(GROUP=group, HEAD_DIM=head_dim, HALF=half, PAGE=page, BLOCK_M=block_m,
                     BLOCK_N=block_n, SPLIT=split_size, HAS_WINDOW=has_window, **ex.LAUNCH_EXACT)
        attention_stats_kernel[grid](q, k_cache, v_cache, positions, block_tables, tile_seq, tile_start,
                                     tile_end, best, top, *common, **sizes)
        row_max = best.amax(dim=-1)  # max is exact: the order of the splits is immaterial
        row_max = row_max.masked_fill_(torch.isinf(row_max), 0.0).contiguous()  # a lane that sees nothing
        row_top = top.amax(dim=-1)
        row_top = row_top.masked_fill_(row_top == ref.NO_KEY_EXPONENT, 0).contiguous()
        attention_sums_kernel[grid](q, k_cache, v_cache, positions, block_tables, tile_seq, tile_start,
                                    tile_end, row_max, row_top, num, den, *common, **sizes)
        attention_finish_kernel[(row_end - row_base, num_heads)](
            num, den, row_top, target, row_base, max_splits, target.stride(0), target.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, **ex.LAUNCH_EXACT)
    if target is not out:
        out.copy_(target)
    return out

