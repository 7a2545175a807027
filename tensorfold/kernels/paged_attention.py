"""Causal attention over a paged KV cache, split at fixed absolute positions.

The cache holds K/V in blocks of `block_size` tokens: [num_blocks, block_size, num_kv_heads, head_dim].
A sequence's block table lists its blocks in order, so block j always holds absolute positions
[j * block_size, (j + 1) * block_size): the KV split is a function of position, never of how
many rows or sequences share the call.

Why the result of a row is bitwise independent of its batch:
- scores and P @ V are per-block GEMMs of fixed inner size (head_dim, block_size) with the row
  count padded to 8 (row-invariant, see reference.py);
- the row max is exact in any order; blocks past a row's position are masked to exact zeros;
- the per-block partial sums are combined by a pairwise tree over block index, padded with
  zero blocks to a power of two, so extra (masked) blocks add exact zeros and change nothing.
K/V of the new rows are written into the cache before attention reads it.
"""
import torch

from tensorfold.kernels.reference import pad_rows


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] into flat slots (block * block_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


def _tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Pairwise sum over `dim`, zero-padded to a power of two: the same bits for any padding."""
    size = x.shape[dim]
    width = 1
    while width < size:
        width *= 2
    if width != size:
        pad_shape = list(x.shape)
        pad_shape[dim] = width - size
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    while x.shape[dim] > 1:
        x = x.narrow(dim, 0, x.shape[dim] // 2 * 2)
        pairs = x.unflatten(dim, (x.shape[dim] // 2, 2))
        x = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
    return x.squeeze(dim)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        positions: torch.Tensor, block_table: torch.Tensor, scale: float,
                        window: int | None = None) -> torch.Tensor:
    """Attention of one sequence's query rows over its cached prefix.

    q [num_rows, num_heads, head_dim] at absolute `positions` [num_rows]; block_table [>= num_blocks].
    Returns [num_rows, num_heads, head_dim] in q's dtype; math in fp32.
    """
    num_blocks = int(positions.max()) // k_cache.shape[1] + 1
    out = _attend(pad_rows(q.float())[None], pad_rows(positions)[None], block_table[None, :num_blocks],
                  k_cache, v_cache, scale, window)
    return out[0, :q.shape[0]].to(q.dtype)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               positions: torch.Tensor, block_tables: list[torch.Tensor], scale: float,
                               window: int | None = None) -> torch.Tensor:
    """One query row for each of several sequences in one call: q [num_seqs, num_heads, head_dim].

    Bitwise equal to paged_attention_ref on each row alone: every row is padded to the same 8-row
    matrix, each per-block GEMM has the same shape, and the blocks past a sequence's end (its
    table is padded to the longest) are masked to exact zeros.
    """
    block_size = k_cache.shape[1]
    num_blocks = [int(p) // block_size + 1 for p in positions.tolist()]
    width = max(num_blocks)
    tables = torch.stack([torch.cat([t[:n], t.new_zeros(width - n)]) for t, n in zip(block_tables, num_blocks)])
    q_pad = torch.cat([q.float()[:, None], q.new_zeros((q.shape[0], 7, *q.shape[1:]), dtype=torch.float32)], 1)
    pos_pad = torch.cat([positions[:, None], positions.new_zeros((positions.shape[0], 7))], 1)
    return _attend(q_pad, pos_pad, tables, k_cache, v_cache, scale, window)[:, 0].to(q.dtype)


def _attend(q: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q [S, R, H, D] fp32 (R a multiple of 8), positions [S, R], tables [S, NB] -> [S, R, H, D] fp32."""
    num_seqs, rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = tables.shape[1]
    # Row m of a kv head's matrix is query row (m % rows) of head (kv_head * group + m // rows).
    qg = q.view(num_seqs, rows, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(num_seqs, num_kv_heads, 1, group * rows, head_dim)  # [S, KVH, 1, G*R, D]
    k = k_cache[tables].float().permute(0, 3, 1, 4, 2)  # [S, KVH, NB, D, block_size]
    v = v_cache[tables].float().permute(0, 3, 1, 2, 4)  # [S, KVH, NB, block_size, D]

    scores = torch.matmul(qg, k) * scale  # [S, KVH, NB, G*R, block_size]
    key_pos = torch.arange(num_blocks * block_size, device=q.device).view(1, 1, num_blocks, 1, block_size)
    query_pos = positions.repeat(1, group).view(num_seqs, 1, 1, group * rows, 1)
    masked = key_pos > query_pos
    if window is not None:
        masked |= key_pos <= query_pos - window
    scores = scores.masked_fill(masked, float("-inf"))

    row_max = scores.amax(dim=(2, 4), keepdim=True)  # [S, KVH, 1, G*R, 1]
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    probs = torch.exp(scores - row_max)
    denom = _tree_sum(probs.sum(dim=-1), dim=2)  # [S, KVH, G*R]
    out = _tree_sum(torch.matmul(probs, v), dim=2)  # [S, KVH, G*R, D]
    out = out / denom.unsqueeze(-1)
    out = out.view(num_seqs, num_kv_heads, group, rows, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs, rows, num_heads, head_dim)
