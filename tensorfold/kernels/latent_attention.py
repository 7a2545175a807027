"""Latent attention (MLA) over the latent cache, and the DSA indexer's choice of keys: the torch
references, exact, so a row's result does not depend on what shares its call.

The cache (models/cache.LayerLatent) keeps per position the key vector [c, k_rope]: the normalized
compressed KV c (latent_dim) and the roped key. Queries arrive absorbed (models/latent_attention.py):
per head [q_latent, q_rope], q_latent = W_uk^T q_nope, so a score is one dot product with the whole
cached vector and the values are the c part: multi-query attention on the latent, whatever the row
count, so prefill, chunks and decode share one form.

The arithmetic (the rules of tensorfold/exact; paged_attention.py's steps, with a selection):
1. Dot products on a fixed-point grid: q and each key as integers against their own largest
   power of two, dot_bits(width) bits each, so every product and every partial sum is an integer
   below 2^53: exact in float64 in any order (a matmul's blocking cannot matter), scaled by a power
   of two, rounded once to float32 (`exact_dots`).
2. Attention: score = float32(dot) * float32(scale); keys past the row's position or outside its
   selection get -inf; p = exp_neg(score - max) (the project's exp); the weighted sum of c and the
   sum of p on integer grids (W_BITS, V_BITS, L_BITS as paged_attention's), exact; one float32
   division at the end.
3. The indexer: per head h, relu(float32(q_h . k) * float32(scale)), times the row's head weight,
   added over heads in ascending order from head 0, all float32 steps: a score's bits depend on its
   query and key alone. The top index_topk keys among those the row sees, by a stable descending
   sort, so ties go to the lower position; a row that sees index_topk keys or fewer takes them all
   (as transformers' top-k over a causal mask does).
"""
import math

import torch

from tensorfold.exact.float32 import exp_neg, f32
from tensorfold.exact.grid import pow2, round_even, to_fixed
from tensorfold.kernels.paged_attention import L_BITS, NO_KEY_EXPONENT, SPLIT_SIZE, V_BITS, W_BITS


def dot_bits(width: int) -> int:
    """Bits per element of a grid dot product of `width` terms: 2 bits + log2(width) <= 53."""
    return (53 - math.ceil(math.log2(max(width, 2)))) // 2


def exact_dots(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [R, H, D] . keys [L, D] -> [R, H, L] float32: each dot product exact (step 1), rounded once.

    Each side is scaled back by its own power of two before the matmul, not the [R, H, L] result
    after it: a term is then q_int k_int 2^(e_q + e_k - 2 bits + 2) and a partial sum an integer
    below 2^53 times that same power, every one a normal float64 (float32 exponents keep it
    within 2^-310 .. 2^310), so the matmul is exact in any order and equals the integer dot
    scaled once, bit for bit, without building the [R, H, L] powers."""
    bits = dot_bits(q.shape[-1])
    q_int, q_exp = to_fixed(q, bits)  # [R, H, D], [R, H]
    k_int, k_exp = to_fixed(keys, bits)  # [L, D], [L]
    q_grid = q_int.mul_(pow2(q_exp - bits + 1).unsqueeze(-1))  # exact: q on its grid
    k_grid = k_int.mul_(pow2(k_exp - bits + 1).unsqueeze(-1))
    return torch.matmul(q_grid, k_grid.T).float()  # [R, H, L]


def write_latent(cache, kv: torch.Tensor, index_keys: torch.Tensor | None, slots: torch.Tensor) -> None:
    """kv [num_rows, latent + rope] and the indexer's keys [num_rows, index_dim] (or None) into
    their flat slots of the layer's cache (models/cache.LayerLatent), in the cache's dtype."""
    cache.kv.view(-1, cache.kv.shape[-1])[slots] = kv.to(cache.kv.dtype)
    if index_keys is not None:
        cache.index_keys.view(-1, cache.index_keys.shape[-1])[slots] = index_keys.to(cache.index_keys.dtype)


def gather(pages: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first `length` cached vectors [length, D] float32 from pages [NB, block_size, D].
    index_select, not pages[table]: the same copy, but advanced indexing runs a parallel region for
    a block's worth of rows, which costs milliseconds a call where the threads wait on a busy CPU."""
    num_blocks = -(-length // pages.shape[1])
    blocks = pages.index_select(0, block_table[:num_blocks].to(device=pages.device, dtype=torch.long))
    return blocks.reshape(-1, pages.shape[-1])[:length].float()


def latent_attention(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scale: float,
                     latent_dim: int, selected: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's rows: q [R, H, latent + rope] at positions [R] over its keys [L, latent + rope]
    (position order) -> [R, H, latent] float32, each row over the keys at or before its position
    and, where `selected` [R, L] bool is given, among those it selects (step 2)."""
    num_rows, num_keys = q.shape[0], keys.shape[0]
    key_pos = torch.arange(num_keys, device=q.device)
    seen = key_pos[None, :] <= positions[:, None]  # [R, L]
    if selected is not None:
        seen &= selected
    scores = exact_dots(q, keys).mul_(f32(scale))  # [R, H, L]
    scores.masked_fill_(~seen[:, None, :], float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max.masked_fill_(torch.isinf(row_max), 0.0)  # a row that sees nothing

    v_int, v_exp = to_fixed(keys[:, :latent_dim], V_BITS)  # [L, latent] integers, [L]
    top = torch.where(seen, v_exp, NO_KEY_EXPONENT).amax(dim=-1)  # [R]
    top.masked_fill_(top == NO_KEY_EXPONENT, 0)
    lane_scale = pow2(v_exp[None, :] - top[:, None] + W_BITS)[:, None, :]  # [R, 1, L]
    num = torch.zeros((num_rows, q.shape[1], latent_dim), dtype=torch.int64, device=q.device)
    den = torch.zeros((num_rows, q.shape[1]), dtype=torch.float64, device=q.device)
    for start in range(0, num_keys, SPLIT_SIZE):
        end = start + SPLIT_SIZE
        p = exp_neg(scores[..., start:end] - row_max).double()  # 0 where unseen
        den += round_even(p * float(2 ** L_BITS)).sum(dim=-1)  # exact
        w = round_even(p * lane_scale[..., start:end])  # integers <= 2^W_BITS
        num += torch.matmul(w, v_int[start:end]).to(torch.int64)  # exact in float64
    weighted = (num.double() * pow2(top - V_BITS - W_BITS + 1)[:, None, None]).float()
    total = den.masked_fill_(den == 0, 1.0).float().mul_(f32(2.0 ** -L_BITS))
    return weighted / total[..., None]


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The indexer's scores [R, L] float32 for queries q [R, H, D] with head weights [R, H] float32
    over keys [L, D] (step 3)."""
    per_head = exact_dots(q, keys).mul_(f32(scale)).relu_()  # [R, H, L]
    total = per_head[:, 0] * weights[:, :1]
    for h in range(1, q.shape[1]):
        total += per_head[:, h] * weights[:, h:h + 1]
    return total


def select_top_keys(scores: torch.Tensor, positions: torch.Tensor, top_k: int) -> torch.Tensor:
    """[R, L] bool: each row's top_k keys by score among those at or before its position, ties to
    the lower position (step 3)."""
    num_keys = scores.shape[-1]
    seen = torch.arange(num_keys, device=scores.device)[None, :] <= positions[:, None]
    if num_keys <= top_k:
        return seen
    order = torch.sort(scores.masked_fill(~seen, float("-inf")), dim=-1, descending=True, stable=True).indices
    chosen = torch.zeros_like(seen).scatter_(1, order[:, :top_k], True)
    return chosen & seen


# ---- the op set's calls: every row of a ForwardBatch over one layer's latent cache ------------------
# A selection is each row's chosen positions, int32 [rows, top_k] ascending with -1 pads (a row that
# sees top_k keys or fewer lists them all), or None where every row sees top_k keys or fewer: what
# dsa_select gives and latent_attention takes, the same in every op set.

def dsa_select(q: torch.Tensor, weights: torch.Tensor, cache, batch, scale: float, top_k: int) -> torch.Tensor | None:
    """The indexer's choice for a batch's rows: q [rows, heads, dim], weights [rows, heads] float32,
    over cache.index_keys (models/cache.LayerLatent); per sequence, indexer_scores then
    select_top_keys (the torch op set's form)."""
    positions = batch.positions
    if positions.numel() == 0 or int(positions.max()) < top_k:
        return None
    out = torch.full((positions.shape[0], top_k), -1, dtype=torch.int32, device=positions.device)
    for seq in batch.sequences:
        if seq.end == seq.start:
            continue
        rows = slice(seq.start, seq.end)
        length = int(positions[rows].max()) + 1
        keys = gather(cache.index_keys, seq.block_table, length)
        chosen = select_top_keys(indexer_scores(q[rows], weights[rows], keys, scale), positions[rows], top_k)
        out[rows] = chosen_positions(chosen, top_k)
    return out


def chosen_positions(chosen: torch.Tensor, top_k: int) -> torch.Tensor:
    """[R, L] bool (at most top_k set a row) -> int32 [R, top_k]: the set positions ascending, -1 pads."""
    num_keys = chosen.shape[-1]
    key_pos = torch.arange(num_keys, device=chosen.device).expand_as(chosen)
    ordered = torch.where(chosen, key_pos, num_keys).sort(dim=-1).values[:, :top_k]
    ordered = torch.nn.functional.pad(ordered, (0, top_k - ordered.shape[1]), value=num_keys)
    return ordered.masked_fill_(ordered == num_keys, -1).to(torch.int32)


def selection_mask(selection: torch.Tensor, positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """A selection's rows as [R, num_keys] bool (entries past a row's position ignored)."""
    sel = selection.long()
    valid = (sel >= 0) & (sel <= positions[:, None])
    mask = torch.zeros((sel.shape[0], num_keys + 1), dtype=torch.bool, device=sel.device)
    mask.scatter_(1, torch.where(valid, sel, num_keys), True)
    return mask[:, :num_keys]


def attention_by_sequence(query: torch.Tensor, cache, batch, scale: float,
                          selection: torch.Tensor | None) -> torch.Tensor:
    """A batch's rows: query [rows, heads, latent + rope] over cache.kv (models/cache.LayerLatent) ->
    [rows, heads, latent] float32, one latent_attention per sequence (the torch op set's form)."""
    out = torch.empty((query.shape[0], query.shape[1], cache.latent_dim), dtype=torch.float32, device=query.device)
    for seq in batch.sequences:
        if seq.end == seq.start:
            continue
        rows = slice(seq.start, seq.end)
        positions = batch.positions[rows]
        length = int(positions.max()) + 1
        keys = gather(cache.kv, seq.block_table, length)
        selected = None if selection is None else selection_mask(selection[rows], positions, length)
        out[rows] = latent_attention(query[rows], keys, positions, scale, cache.latent_dim, selected)
    return out
