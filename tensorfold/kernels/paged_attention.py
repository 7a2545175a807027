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
    num_rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = int(positions.max()) // block_size + 1

    q_pad = pad_rows(q.float())  # [M, num_heads, head_dim]
    pos_pad = pad_rows(positions)  # [M]
    rows = q_pad.shape[0]
    # Row m of a kv head's matrix is query row (m % rows) of head (kv_head * group + m // rows).
    qg = q_pad.view(rows, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, 1, group * rows, head_dim)  # [KVH, 1, M*G, D]
    blocks = block_table[:num_blocks]
    k = k_cache[blocks].float().permute(2, 0, 3, 1)  # [KVH, num_blocks, D, block_size]
    v = v_cache[blocks].float().permute(2, 0, 1, 3)  # [KVH, num_blocks, block_size, D]

    scores = torch.matmul(qg, k) * scale  # [KVH, num_blocks, M*G, block_size]
    key_pos = torch.arange(num_blocks * block_size, device=q.device).view(1, num_blocks, 1, block_size)
    query_pos = pos_pad.repeat(group).view(1, 1, group * rows, 1)
    masked = key_pos > query_pos
    if window is not None:
        masked |= key_pos <= query_pos - window
    scores = scores.masked_fill(masked, float("-inf"))

    row_max = scores.amax(dim=(1, 3), keepdim=True)  # [KVH, 1, M*G, 1]
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    probs = torch.exp(scores - row_max)
    denom = _tree_sum(probs.sum(dim=-1), dim=1)  # [KVH, M*G]
    out = _tree_sum(torch.matmul(probs, v), dim=1)  # [KVH, M*G, D]
    out = out / denom.unsqueeze(-1)
    out = out.view(num_kv_heads, group, rows, head_dim).permute(2, 0, 1, 3)
    return out.reshape(rows, num_heads, head_dim)[:num_rows].to(q.dtype)
