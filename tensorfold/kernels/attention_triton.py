"""Paged attention in Triton for prefill chunks and decode/verify rows (GQA, causal, sliding window).

Same contract as `paged_attention_ref` (kernels/paged_attention.py): query rows of a sequence at
absolute `positions` attend over the sequence's cached prefix, read through its block table from
a cache [num_blocks, block_size, num_kv_heads, head_dim]. The launcher `paged_attention` has the
reference's signature; `paged_attention_varlen` runs many sequences in one launch.

Layout of the work. A program owns one tile of query rows of one sequence (BLOCK_M lanes: lane i
is row i // GROUP, query head kv_head * GROUP + i % GROUP, so a K/V tile is loaded once for the
whole group), one KV head and one KV split. Splits cover fixed absolute positions
[s * SPLIT_SIZE, (s + 1) * SPLIT_SIZE), walked in BLOCK_N-token steps aligned to absolute
positions, with an online softmax. A second kernel folds a row's splits in split order.

Why a row's bits never depend on its neighbours (the invariant, see ARCHITECTURE.md):
- every constexpr (BLOCK_M, BLOCK_N, SPLIT_SIZE, GROUP, head_dim) is fixed by the model and the
  deployment, never by the batch, and the launcher passes contiguous, 16-byte aligned tensors
  and marks the batch-dependent integers unspecialised, so one compiled kernel serves every call;
- a KV step where a row sees no key (past its position, before its window, or a lane beyond the
  tile's rows) is an exact no-op for that row: its max is unchanged, so alpha == 1 and p == 0
  (before any key: m stays -inf, l and acc stay 0), hence the steps a tile takes for its other
  rows change nothing;
- a row's splits are fixed by its position and window, and are folded sequentially in order.
What differs from the reference: the online softmax rescales per step instead of one global
max, and the sums run in a different order, so kernel vs reference is a float tolerance
(about 1e-6 relative in fp32); invariance is bitwise.
"""
import torch
import triton
import triton.language as tl

from tensorfold.kernels.paged_attention import paged_attention_ref  # noqa: F401  (the reference)

BLOCK_M = 64       # query lanes (rows x group heads) per program
BLOCK_N = 64       # KV positions per step
SPLIT_SIZE = 512   # KV positions per split: fixed, so splits sit at fixed absolute positions
WORKSPACE_BYTES = 256 << 20  # split partials per launch; long prefills run in several launches


@triton.jit(do_not_specialize=["window", "row_base", "max_splits"])
def paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, block_tables_ptr,
        tile_seq_ptr, tile_start_ptr, tile_end_ptr,
        m_ptr, l_ptr, acc_ptr,
        scale, window, row_base,
        stride_qr, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_bt, max_splits,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_SIZE: tl.constexpr,
        HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq = tl.load(tile_seq_ptr + tile)
    row_start = tl.load(tile_start_ptr + tile)
    row_end = tl.load(tile_end_ptr + tile)

    lanes = tl.arange(0, BLOCK_M)
    rows = row_start + lanes // GROUP
    heads = kv_head * GROUP + lanes % GROUP
    lane_ok = (lanes < (BLOCK_M // GROUP) * GROUP) & (rows < row_end)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    pos = tl.load(positions_ptr + rows, mask=lane_ok, other=-1).to(tl.int32)  # -1 sees nothing

    q = tl.load(q_ptr + rows[:, None] * stride_qr + heads[:, None] * stride_qh + dims[None, :],
                mask=lane_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, D_PAD]
    q = q.to(k_cache_ptr.dtype.element_ty)

    # The keys this tile needs inside this split; the bounds only skip steps that are no-ops.
    hi = tl.minimum(tl.max(pos, 0) + 1, (split + 1) * SPLIT_SIZE)
    lo = split * SPLIT_SIZE
    if HAS_WINDOW:
        first = tl.min(tl.where(lane_ok, pos - window + 1, hi), 0)
        lo = tl.maximum(lo, first // BLOCK_N * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # absolute positions
        key_ok = keys < hi
        page = tl.load(block_tables_ptr + seq * stride_bt + keys // PAGE, mask=key_ok, other=0)
        slot = keys % PAGE
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks
                    + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        v = tl.load(v_cache_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        seen = keys[None, :] <= pos[:, None]
        if HAS_WINDOW:
            seen &= keys[None, :] > pos[:, None] - window
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: p = 0
        alpha = tl.exp(m_i - base)
        p = tl.exp(s - base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    # Partials [launch rows, num_heads, max_splits(, D)]; only a row's own splits are ever read.
    part = ((rows - row_base).to(tl.int64) * num_heads + heads) * max_splits + split
    tl.store(m_ptr + part, m_i, mask=lane_ok)
    tl.store(l_ptr + part, l_i, mask=lane_ok)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
             mask=lane_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["window", "row_base", "max_splits"])
def attention_combine_kernel(
        m_ptr, l_ptr, acc_ptr, positions_ptr, out_ptr,
        window, row_base, max_splits, stride_or, stride_oh,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLIT_SIZE: tl.constexpr,
        HAS_WINDOW: tl.constexpr):
    local = tl.program_id(0).to(tl.int64)
    row = row_base + local
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    pos = tl.load(positions_ptr + row).to(tl.int32)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(pos - window + 1, 0) // SPLIT_SIZE
    last = pos // SPLIT_SIZE
    base = (local * num_heads + head) * max_splits
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM

    m = tl.load(m_ptr + base + first)
    for s in range(first + 1, last + 1):
        m = tl.maximum(m, tl.load(m_ptr + base + s))
    l_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for s in range(first, last + 1):  # in split order: the fold is fixed by the position
        w = tl.exp(tl.load(m_ptr + base + s) - m)
        l_sum += tl.load(l_ptr + base + s) * w
        acc += tl.load(acc_ptr + (base + s) * HEAD_DIM + dims, mask=dim_ok, other=0.0) * w
    out = acc / l_sum
    tl.store(out_ptr + row * stride_or + head * stride_oh + dims,
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


def paged_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           positions: torch.Tensor, block_tables: torch.Tensor, row_starts: list[int],
                           scale: float, window: int | None = None, *, block_m: int = BLOCK_M,
                           block_n: int = BLOCK_N, split_size: int = SPLIT_SIZE,
                           out: torch.Tensor | None = None,
                           workspace_fill: float | None = None) -> torch.Tensor:
    """Several sequences in one launch: sequence i owns rows row_starts[i]:row_starts[i + 1] of q
    and row i of block_tables [num_seqs, max_blocks]. block_m, block_n and split_size must be the
    same on every call of a deployment (they fix the reduction order). `out` receives the result;
    `workspace_fill` pre-fills the split partials (tests: NaN, so a read of an unwritten partial
    shows)."""
    num_rows, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if group * num_kv_heads != num_heads or group > block_m:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads with block_m {block_m}")
    if split_size % block_n or block_n < 16 or block_m < 16:
        raise ValueError(f"split_size {split_size} must be a multiple of block_n {block_n} (>= 16)")
    if out is None:
        out = torch.empty_like(q)  # [num_rows, num_heads, head_dim]
    elif out.shape != q.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} tensor")
    if num_rows == 0:
        return out
    q = _aligned(q)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    device = q.device
    positions = positions.to(device=device, dtype=torch.int64).contiguous()
    block_tables = block_tables.to(device=device, dtype=torch.int64).contiguous()
    max_splits = int(positions.max()) // split_size + 1
    # Tiles of rows of one sequence, in row order; launches take consecutive tiles so that the
    # split partials of a launch stay under WORKSPACE_BYTES (tiling never changes a row's bits).
    rows_per_tile = block_m // group
    launch_rows = max(rows_per_tile, WORKSPACE_BYTES // (num_heads * max_splits * (head_dim + 2) * 4))
    launches, tiles = [], []
    for seq, (a, b) in enumerate(zip(row_starts[:-1], row_starts[1:])):
        for start in range(a, b, rows_per_tile):
            tile = (seq, start, min(start + rows_per_tile, b))
            if tiles and tile[2] - tiles[0][1] > launch_rows:
                launches.append(tiles)
                tiles = []
            tiles.append(tile)
    launches.append(tiles)
    d_pad = triton.next_power_of_2(max(head_dim, 16))
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    has_window = window is not None
    target = _aligned(out)
    for tiles in launches:
        row_base, row_end = tiles[0][1], tiles[-1][2]
        m = torch.empty((row_end - row_base, num_heads, max_splits), dtype=torch.float32, device=device)
        l = torch.empty_like(m)  # noqa: E741
        acc = torch.empty((*m.shape, head_dim), dtype=torch.float32, device=device)
        if workspace_fill is not None:
            for t in (m, l, acc):
                t.fill_(workspace_fill)
        tile_seq, tile_start, tile_end = (torch.tensor(col, dtype=torch.int32, device=device)
                                          for col in zip(*tiles))
        paged_attention_kernel[(len(tiles), num_kv_heads, max_splits)](
            q, k_cache, v_cache, positions, block_tables, tile_seq, tile_start, tile_end,
            m, l, acc, scale, window if has_window else 0, row_base,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), max_splits,
            GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
            SPLIT_SIZE=split_size, HAS_WINDOW=has_window, DOT_PRECISION=precision)
        attention_combine_kernel[(row_end - row_base, num_heads)](
            m, l, acc, positions, target, window if has_window else 0, row_base, max_splits,
            target.stride(0), target.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, SPLIT_SIZE=split_size, HAS_WINDOW=has_window)
    if target is not out:
        out.copy_(target)
    return out


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x contiguous at a 16-byte aligned address: Triton specialises kernels on pointer
    alignment, and one compiled variant for every call keeps the reduction order fixed."""
    if x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)
