"""Grammar-masked verification of drafted paths in Triton: masked draws and accepted prefix lengths.

A drafted path is the run of rows of one request in a verify step: row j carries the draft d_j
checked at that position (the last row, the bonus, carries none: -1). Each row has its grammar's
allowed-token bitmask in xgrammar's int32 layout (bit j of word w is token w * 32 + j), built
along the drafted path, so row j's mask depends only on the tokens before it. The engine's rule
(engine.py `_accept`): the draw at row j is the keyed draw on the masked logits; the path accepts
its drafts up to the first row whose draw differs from its draft.

`verify_kernel`, one program per row, in one launch:
- the draw of a greedy row (masked argmax, ties to the lowest id) or of a row with no
  order-dependent cut (temperature, min_p: the kept token with the best keyed noisy score),
  with the mask applied as the logits are read (never written back);
- rows with top-k/top-p come in with their draw already made by the sampling kernel (the
  candidate selection lives there) and skip the vocabulary pass;
- then `num_accepted[path] = min(j : row j has no draft or draw_j != draft_j)` by an integer
  atomic min, initialised to the path's length: min is order-free, so the result is exact
  whatever order the programs run in.
`apply_token_bitmask` writes -inf into disallowed logits in place, as xgrammar's does, for code
that needs masked logits. Tokens past the bitmask's coverage are not allowed.

Contract: draws and accepted lengths equal `verify_ref` bitwise (the per-token arithmetic is
sampling_triton's, exp and log included: exact_triton's libm-free exp64/log64, launched without
FMA contraction; the folds are exact).
"""

import torch
import triton
import triton.language as tl

from tensorfold.kernels import exact_triton as ex
from tensorfold.kernels import sampling_triton
from tensorfold.kernels.sampling_triton import allowed_bits, drawable_logits, gumbel
from tensorfold.sampling import bitmask as bits
from tensorfold.sampling import keyed, sampler
from tensorfold.sampling.params import RowSampling

TILE = 2048  # vocabulary tokens per step of a row's pass


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Masked copy of logits [R, vocab]: -inf where the row's bit is clear."""
    return logits.masked_fill(~bits.unpack(bitmask, logits.shape[1]), float("-inf"))


def verify_ref(logits: torch.Tensor, bitmask: torch.Tensor | None, drafts: list[int],
               path_starts: list[int], rows: list[RowSampling]) -> tuple[list[int], list[int]]:
    """(draws [R], num_accepted [P]) by the reference sampler on the masked rows."""
    draws = sampler.sample(logits, rows, bitmask=bitmask)
    accepted = []
    for a, b in zip(path_starts[:-1], path_starts[1:]):
        n = 0
        while a + n < b and drafts[a + n] >= 0 and draws[a + n] == drafts[a + n]:
            n += 1
        accepted.append(n)
    return draws, accepted


@triton.jit
def apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, width, stride_row, stride_mask,
                               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    allowed = allowed_bits(bitmask_ptr + row * stride_mask, cols.to(tl.int64), ok)
    tl.store(logits_ptr + row * stride_row + cols, float("-inf"), mask=ok & ~allowed)


@triton.jit
def verify_kernel(logits_ptr, bitmask_ptr, draft_ptr, draw_in_ptr, row_path_ptr, path_start_ptr,
                  temperature_ptr, min_q_ptr, row_key_ptr, draw_ptr, accepted_ptr,
                  width, stride_row, stride_mask,
                  TILE: tl.constexpr, HAS_MASK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_row
    mask_row = bitmask_ptr + row * stride_mask
    draw = tl.load(draw_in_ptr + row)
    if draw < 0:
        # Pass 1: the masked max and the lowest id holding it (the greedy draw).
        best = tl.full([], float("-inf"), tl.float32)
        best_id = tl.full([], 1 << 62, tl.int64)
        for start in range(0, width, TILE):
            x, ids = drawable_logits(logits_row, mask_row, start + tl.arange(0, TILE), width, 0, HAS_MASK)
            tile_best = tl.max(x, 0)
            tile_id = tl.min(tl.where((x == tile_best) & (x > float("-inf")), ids, 1 << 62), 0)
            best_id = tl.where(tile_best > best, tile_id, best_id)
            best = tl.maximum(best, tile_best)
        draw = best_id
        temp = tl.load(temperature_ptr + row)
        if temp != 0.0:
            # Pass 2: the keyed draw among tokens with q >= min_q (sampler's rule without cuts).
            m = best.to(tl.float64) / temp
            min_q = tl.load(min_q_ptr + row)
            row_key = tl.load(row_key_ptr + row)
            top = tl.full([], float("-inf"), tl.float64)
            top_id = tl.full([], 1 << 62, tl.int64)
            for start in range(0, width, TILE):
                x, ids = drawable_logits(logits_row, mask_row, start + tl.arange(0, TILE), width, 0,
                                         HAS_MASK)
                z = x.to(tl.float64) / temp
                q = tl.floor(ex.exp64(z - m) * 4294967296.0).to(tl.int64)
                keep = (x > float("-inf")) & (q >= min_q)
                score = tl.where(keep, z + gumbel(row_key, ids), float("-inf"))
                tile_top = tl.max(score, 0)
                tile_id = tl.min(tl.where((score == tile_top) & keep, ids, 1 << 62), 0)
                top_id = tl.where(tile_top > top, tile_id, top_id)
                top = tl.maximum(top, tile_top)
            draw = top_id
    tl.store(draw_ptr + row, draw)
    draft = tl.load(draft_ptr + row)
    path = tl.load(row_path_ptr + row)
    if (draft < 0) | (draft != draw):  # a row without a draft (the bonus) ends the path too
        tl.atomic_min(accepted_ptr + path, (row - tl.load(path_start_ptr + path)).to(tl.int32))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: logits [R, vocab] get -inf where the row's bit is clear; returns logits."""
    num_rows, vocab = logits.shape
    bits.check(bitmask, num_rows, vocab)
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous in the vocabulary")
    block = 1024
    apply_token_bitmask_kernel[(num_rows, triton.cdiv(vocab, block))](
        logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=block)
    return logits


def verify(logits: torch.Tensor, bitmask: torch.Tensor | None, drafts: list[int],
           path_starts: list[int], rows: list[RowSampling], *, tile: int = TILE):
    """`verify_ref`'s contract: logits [R, vocab]; bitmask int32 [R, >= vocab / 32] or None;
    drafts [R] (-1: no draft); path p owns rows path_starts[p]:path_starts[p + 1].
    Returns (draws [R] int64, num_accepted [P] int32) as tensors on logits' device."""
    num_rows, vocab = logits.shape
    device = logits.device
    if len(rows) != num_rows or len(drafts) != num_rows or path_starts[-1] != num_rows:
        raise ValueError(f"{len(rows)} rows, {len(drafts)} drafts, paths up to {path_starts[-1]} "
                         f"for logits {tuple(logits.shape)}")
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    if bitmask is not None:
        bits.check(bitmask, num_rows, vocab)
        bitmask = bitmask.to(device=device).contiguous()
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731

    # Rows whose cut depends on the key order are drawn by the sampling kernel first.
    draw_in = [-1] * num_rows
    ordered = [i for i, r in enumerate(rows) if r.temperature != 0.0 and r.ordered(vocab)]
    if ordered:
        sub_mask = bitmask[ordered] if bitmask is not None else None
        for i, t in zip(ordered, sampling_triton.sample(logits[ordered], [rows[i] for i in ordered],
                                                        bitmask=sub_mask)):
            draw_in[i] = t
    num_paths = len(path_starts) - 1
    row_path = [p for p in range(num_paths) for _ in range(path_starts[p], path_starts[p + 1])]
    path_lengths = [b - a for a, b in zip(path_starts[:-1], path_starts[1:])]
    accepted = torch.tensor(path_lengths, dtype=torch.int32, device=device)
    draws = torch.empty(num_rows, dtype=torch.int64, device=device)
    row_keys = keyed.row_keys([r.seed for r in rows], [r.position for r in rows]).reshape(-1)
    verify_kernel[(num_rows,)](
        logits, bitmask if bitmask is not None else accepted, as_long(drafts), as_long(draw_in),
        as_long(row_path), as_long(path_starts),
        torch.tensor([r.temperature for r in rows], dtype=torch.float64, device=device),
        sampler._min_q(rows).reshape(-1).to(device), row_keys.to(device), draws, accepted,
        vocab, logits.stride(0), bitmask.stride(0) if bitmask is not None else 0,
        TILE=tile, HAS_MASK=bitmask is not None, **ex.LAUNCH_EXACT)
    if (draws == sampler.NO_TOKEN).any():
        raise ValueError("a row has no drawable token")
    return draws, accepted
