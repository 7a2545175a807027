"""Causal attention over a paged KV cache, computed so that the order of the sums does not matter.

The cache holds K/V in blocks of `block_size` tokens: [num_blocks, block_size, num_kv_heads, head_dim].
A sequence's block table lists its blocks in order, so block j holds absolute positions
[j * block_size, (j + 1) * block_size). K/V of the new rows are written before attention reads.

The arithmetic (tensorfold/exact has the rule; attention_triton.py does the same steps):
0. `write_kv_ref` stores each k vector on its fixed-point grid (QK_BITS significant bits against
   its largest element) and each v vector likewise (V_BITS), in the cache's own dtype, which may
   differ from the activations' (EngineConfig.kv_dtype): k, v are rounded to it first, and the
   grid of those values fits it. Attention widens the cached values exactly, whatever q's dtype.
1. q is put on its grid per call; the score q.k is then an exact dot product (every product is
   a multiple of one power of two and the total stays below 2^53: exact in float64, or as an
   int64 on MLX), rounded once to float32, times float32(scale) in float32.
   The bound, for heads up to MAX_HEAD_DIM = 512 (Gemma 4's global layers): q_int is q / 2^(e-21)
   rounded, e = exponent(max|q|), so max|q| / 2^(e-21) lies in [2^21, 2^22) and rounds to at
   most 2^22 (a value within half a step of 2^22 rounds up to it): |q_int| <= 2^22. A stored k
   is a fixed point of on_grid: its elements are multiples of 2^(E-21) for E = exponent(max|k|),
   and max|k| < 2^(E+1), so |k_int| <= 2^22 - 1 (a k that rounded up to 2^(E+1) sits on the grid
   of its new exponent, where it is 2^21). Each product is at most 2^22 (2^22 - 1) < 2^44, so
   any partial sum of 512 of them, in any order or split (halves, lanes, even/odd dims), is an
   integer multiple of 2^(e_q + E - 42) of magnitude below 2^53: exactly a float64, and an int64.
   Even at the grid's extremes (every |q_int| = 2^22, every |k_int| = 2^22 - 1) nothing rounds;
   1024 dims could reach 2^54 and would not be exact, so wider heads are refused here. Nothing
   else depends on the width: step 3's sums run per element over keys, rope is elementwise.
2. m = the row's largest visible score (exact); p = exp_neg(score - m), 0 for keys the row does
   not see (past its position, or before its sliding window).
3. With e_j the exponent of v_j and E the largest e_j the row sees, the weight of key j is
   w_j = round(p_j * 2^(e_j - E + W_BITS)), an integer, and v_j * 2^(V_BITS - 1 - e_j) is an
   integer vector: every term of sum_j w_j v_j is on one integer grid. Each chunk of SPLIT_SIZE
   keys sums exactly in float64 (W_BITS + V_BITS + log2(SPLIT_SIZE) <= 53), chunks add as int64;
   the denominator sum_j round(p_j * 2^L_BITS) is exact too.
4. out = float32(num 2^(E - V_BITS - W_BITS + 1)) / (float32(den) 2^-L_BITS), a float32
   division (num is made float64 first, then float32: two roundings, as the int64 num allows),
   then q's dtype. No step after the sums needs float64, so the mlx backend (no float64 on
   Metal) computes the same bits.
Every sum is exact, so a row's result is the same alone or among any rows, sequences, tiles or
KV splits, on any device: the reference and the Triton kernel agree bitwise by construction.
"""
import functools

import torch

from tensorfold.exact.float32 import exp_neg, f32
from tensorfold.exact.grid import exponent, on_grid, pow2, round_even, to_fixed

QK_BITS = 22      # |q_int| <= 2^22, |k_int| < 2^22: a product < 2^44, head_dim <= 512 -> < 2^53
MAX_HEAD_DIM = 512  # the widest head whose q.k stays exact (step 1); every op set's attention takes it
V_BITS = 20       # |v_int| <= 2^20
W_BITS = 24       # |w_int| <= 2^24: w * v <= 2^44, SPLIT_SIZE keys -> <= 2^53
L_BITS = 30       # denominator terms p * 2^30: exact for < 2^23 keys in float64, int64 beyond
SPLIT_SIZE = 512  # keys per exact float64 chunk of the weighted sum
NO_KEY_EXPONENT = -1024
CHUNK_ELEMENTS = 1 << 18  # lanes x keys per step of the reference's key loop


@functools.cache
def _kv_bits(device: torch.device) -> torch.Tensor:
    """The grid widths of K and V, [2, 1, 1, 1], made once per device (no copy per call)."""
    return torch.tensor([QK_BITS, V_BITS], device=device).view(2, 1, 1, 1)


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, v_exp: torch.Tensor | None = None) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] into flat slots (block * block_size + offset),
    each vector on its fixed-point grid (step 0 above). v_exp, when given (int16 [num_blocks,
    block_size, num_kv_heads]), records each stored v vector's exponent e_j (step 3): an op set
    whose attention reads that record instead of the V rows keeps one beside the cache (models/cache.LayerKV)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    kv = on_grid(torch.stack([k, v]).to(k_cache.dtype), _kv_bits(k.device))  # one call: decode is many small ones
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = kv[0]
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = kv[1]
    if v_exp is not None:
        v_exp.view(-1, num_kv_heads)[slot_mapping] = v_exponents(kv[1]).to(torch.int16)


def v_exponents(v: torch.Tensor) -> torch.Tensor:
    """e_j of step 3 for v vectors [..., head_dim] as stored: the exponent of the largest |v| (int32)."""
    return exponent(v.float().abs().amax(dim=-1))


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        positions: torch.Tensor, block_table: torch.Tensor, scale: float,
                        window: int | None = None) -> torch.Tensor:
    """Attention of one sequence's query rows over its cached prefix.

    q [num_rows, num_heads, head_dim] at absolute `positions` [num_rows]; block_table [>= num_blocks].
    Returns [num_rows, num_heads, head_dim] in q's dtype.
    """
    num_blocks = int(positions.max()) // k_cache.shape[1] + 1
    return _attend(q[None], positions[None], block_table[None, :num_blocks].to(q.device),
                   k_cache, v_cache, scale, window)[0]


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               positions: torch.Tensor, block_tables: list[torch.Tensor], scale: float,
                               window: int | None = None) -> torch.Tensor:
    """One query row for each of several sequences in one call: q [num_seqs, num_heads, head_dim].
    Tables are padded to the longest; the padding is past every row's position, so unseen."""
    block_size = k_cache.shape[1]
    num_blocks = [int(p) // block_size + 1 for p in positions.tolist()]
    width = max(num_blocks)
    tables = torch.stack([torch.cat([t[:n], t.new_zeros(width - n)]) for t, n in zip(block_tables, num_blocks)])
    return _attend(q[:, None], positions[:, None], tables.to(q.device), k_cache, v_cache, scale, window)[:, 0]


def _attend(q: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q [S, R, H, D] at positions [S, R] over tables [S, NB] -> [S, R, H, D] in q's dtype."""
    num_seqs, rows, num_heads, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim}: at most {MAX_HEAD_DIM} (q.k in float64's exact range)")
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = tables.shape[1] * k_cache.shape[1]
    # Lane (kv head h, m) is query row m % R of head h * group + m // R.
    lanes = q.view(num_seqs, rows, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    lanes = lanes.reshape(num_seqs, num_kv_heads, group * rows, head_dim)  # [S, KVH, M, D]
    lane_pos = positions.to(q.device).repeat(1, group).view(num_seqs, 1, group * rows, 1)
    key_pos = torch.arange(keys, device=q.device).view(1, 1, 1, keys)
    seen = key_pos <= lane_pos  # [S, 1, M, L]
    if window is not None:
        seen = seen & (key_pos > lane_pos - window)

    k = _gather(k_cache, tables)  # [S, KVH, L, D] float64, on grid (write_kv_ref)
    v = _gather(v_cache, tables)
    last = positions.amax(dim=1).to(q.device).view(-1, 1, 1, 1)
    v.masked_fill_(key_pos.view(1, 1, keys, 1) > last, 0.0)  # slots past every row: unwritten

    q_int, q_exp = to_fixed(lanes, QK_BITS)  # [S, KVH, M, D], [S, KVH, M]
    q_grid = q_int * pow2(q_exp - QK_BITS + 1).unsqueeze(-1)
    k_grid = k.transpose(-1, -2)  # [S, KVH, D, L]
    # Key chunks keep a prefill's [lanes, keys] intermediates cache-sized; any chunking gives the
    # same bits (the sums are exact), only the float64 weighted sum needs <= SPLIT_SIZE keys.
    chunk = max(64, min(SPLIT_SIZE, CHUNK_ELEMENTS // lanes.shape[:3].numel()))
    scores = torch.empty((num_seqs, num_kv_heads, group * rows, keys), dtype=torch.float32, device=q.device)
    for start in range(0, keys, chunk):
        part = torch.matmul(q_grid, k_grid[..., start:start + chunk])  # exact dot products
        scores[..., start:start + chunk] = part.float().mul_(f32(scale))  # float32 times float32(scale)
    scores.masked_fill_(~seen, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max.masked_fill_(torch.isinf(row_max), 0.0)  # a lane that sees nothing

    v_exp = v_exponents(v)  # [S, KVH, L]
    v_int = v.mul_(pow2(V_BITS - 1 - v_exp).unsqueeze(-1))  # exact integers, in place
    top = torch.where(seen, v_exp.unsqueeze(-2), NO_KEY_EXPONENT).amax(dim=-1, keepdim=True)
    top.masked_fill_(top == NO_KEY_EXPONENT, 0)  # [S, KVH, M, 1]
    key_scale = pow2(v_exp).unsqueeze(-2)  # [S, KVH, 1, L]
    lane_scale = pow2(W_BITS - top)  # [S, KVH, M, 1]

    num = torch.zeros((*top.shape[:-1], head_dim), dtype=torch.int64, device=q.device)
    den = torch.zeros(top.shape[:-1], dtype=torch.float64, device=q.device)
    for start in range(0, keys, chunk):
        end = start + chunk
        p = exp_neg(scores[..., start:end].sub_(row_max)).double()  # 0 where unseen
        den += round_even(p * float(2 ** L_BITS)).sum(dim=-1)  # exact
        w = round_even(p.mul_(key_scale[..., start:end]).mul_(lane_scale))  # integers <= 2^W_BITS
        num += torch.matmul(w, v_int[..., start:end, :]).to(torch.int64)  # exact in float64
    weighted = (num.double() * pow2(top - V_BITS - W_BITS + 1)).float()
    total = den.masked_fill_(den == 0, 1.0).float().mul_(f32(2.0 ** -L_BITS))  # sum of p, exact scaling
    out = weighted / total.unsqueeze(-1)

    out = out.view(num_seqs, num_kv_heads, group, rows, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs, rows, num_heads, head_dim).to(q.dtype)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The sequences' cached vectors in position order, [S, KVH, L, D] float64 (one copy)."""
    pages = cache[tables]  # [S, NB, block_size, KVH, D]
    num_seqs, num_blocks, block_size, num_kv_heads, head_dim = pages.shape
    out = torch.empty((num_seqs, num_kv_heads, num_blocks, block_size, head_dim), dtype=torch.float64,
                      device=cache.device)
    out.copy_(pages.permute(0, 3, 1, 2, 4))
    return out.view(num_seqs, num_kv_heads, num_blocks * block_size, head_dim)


def pad_block_tables(tables: list[torch.Tensor]) -> torch.Tensor:
    """Block tables stacked into [len(tables), the longest] int64, each zero-padded: the padding
    lies past every row's position, so attention never reads it."""
    if not tables:
        return torch.zeros((0, 0), dtype=torch.int64)
    width = max(len(t) for t in tables)
    return torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])


def attention_by_sequence(paged_attention, paged_decode_attention, q: torch.Tensor, kv, batch, scale: float,
                          window: int | None) -> torch.Tensor:
    """A batch's attention over one layer's cache (kv: its K and V blocks, models/cache.LayerKV)
    through per-sequence calls (op sets without a varlen kernel): the decode rows of all
    sequences share one call, every other sequence has its own. Each row's result is the one it
    gets alone, so the grouping changes the speed, not the bits. (A record of the V exponents is
    not needed: these kernels read the V rows.)"""
    k_cache, v_cache = kv.k, kv.v
    out = torch.empty_like(q)  # [num_rows, num_heads, head_dim]
    decode = [seq for seq in batch.sequences if seq.end - seq.start == 1]
    if len(decode) > 1:
        rows = torch.tensor([seq.start for seq in decode], device=q.device)
        out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, batch.positions[rows],
                                           [seq.block_table for seq in decode], scale, window)
    for seq in batch.sequences:
        if len(decode) > 1 and seq.end - seq.start == 1:
            continue
        rows = slice(seq.start, seq.end)
        out[rows] = paged_attention(q[rows], k_cache, v_cache, batch.positions[rows], seq.block_table, scale,
                                    window)
    return out
