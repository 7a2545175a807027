"""Keyed sampling over a vocabulary shard in Triton: the same token as `sampler.sample`, bitwise.

The reference is `tensorfold.sampling.sampler.sample` (the rule is in its docstring; `sample_ref`
below is that function). The kernels do the per-token work of one shard; the launcher folds the
per-chunk results and reuses the reference's `_decide`/`_draw` on the 1,024 candidates, so the
rule itself lives in one place.

Per row, per chunk of CHUNK tokens (one program, the chunk held whole in registers):
- drawable: the token's bit is set in the row's allowed bitmask (xgrammar layout: bit j of int32
  word w is token w * 32 + j, global ids) and its logit is not -inf;
- greedy rows (T = 0): the largest logit, ties to the lowest id;
- sampled rows: z = x / T and q = floor(exp(z - m) * 2^32) in float64 (m: the row's global max of
  z, from `logit_max_kernel`), the order key q << 30 | (2^30 - 1 - id), and the noisy score
  z + gumbel(hash(row key, id)) with keyed.py's splitmix64 counter hash in uint64;
  rows without an order-dependent cut take the kept token with the best score (q >= min_q);
  rows with top-k/top-p offer the chunk's best C keys (C = 1,024 candidates): keys are unique,
  so the C-th largest is found bit by bit (63 counting passes over registers) and exactly C keys
  reach it; they are compacted with a prefix sum, with their scores, the exact integer q-sum and
  the drawable count. The launcher takes the global best C of the offers with torch.topk.
Every per-token value is elementwise and every fold is exact (max, min id, integer sums, a
selection of unique keys), so the result does not depend on CHUNK, the batch or the shard layout;
`offset` gives a shard's first global id, so a rank runs the same kernel on its shard.

Bitwise parity needs the same float64 arithmetic as the reference's. Division is correctly
rounded on both sides (float64 `/` is div.rn.f64 on the GPU). exp and log are not
library calls on either side: both use exact/float64.py's `exp64`/`log64`, fdlibm's algorithms written
as fixed sequences of correctly rounded float64 operations, which exact_triton.py spells out in
the same order, and the kernel is launched without FMA contraction (`LAUNCH_EXACT`). So the
kernel on any GPU, in the interpreter, and the torch reference on any CPU give the same bits,
and no interpreter patch is needed to compare them.
A row whose nucleus may run past the candidates (the reference's "late" rows) is drawn by the
reference on the CPU.
"""

import torch
import triton
import triton.language as tl

from tensorfold.kernels import exact_triton as ex
from tensorfold.sampling import bitmask as bits, keyed, sampler
from tensorfold.sampling.params import RowSampling

NUM_CANDIDATES = sampler.NUM_CANDIDATES
CHUNK = 4096                  # tokens per program, held in registers (8 warps: 16 per thread)
GREEDY, FREE, ORDERED = 0, 1, 2

sample_ref = sampler.sample


@triton.jit
def _mix64(x):
    """keyed.mix64 on uint64 (wrapping multiply, logical shifts)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def gumbel(row_key, ids):
    """keyed.gumbel: -log(-log(u)) in float64 (exact.log64), u from the top 52 bits of
    hash(row key, id)."""
    h = _mix64(row_key.to(tl.uint64, bitcast=True) + (ids.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
    u = ((h >> 12) * 2 + 1).to(tl.float64) * 1.1102230246251565e-16  # 2^-53
    return -ex.log64(-ex.log64(u))


@triton.jit
def allowed_bits(bitmask_row_ptr, ids, ok):
    """Whether each global token id is set in the row's bitmask (bit id % 32 of word id // 32)."""
    words = tl.load(bitmask_row_ptr + (ids >> 5), mask=ok, other=0)
    return ((words >> (ids & 31).to(tl.int32)) & 1) != 0


@triton.jit
def drawable_logits(logits_row_ptr, bitmask_row_ptr, cols, width, offset, HAS_MASK: tl.constexpr):
    """The logits of columns `cols` with undrawable tokens at -inf, as fp32, and their global ids."""
    ok = cols < width
    x = tl.load(logits_row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
    ids = cols.to(tl.int64) + offset
    if HAS_MASK:
        x = tl.where(allowed_bits(bitmask_row_ptr, ids, ok), x, float("-inf"))
    return x, ids


@triton.jit
def logit_max_kernel(logits_ptr, bitmask_ptr, row_ids_ptr, out_ptr,
                     width, offset, stride_row, stride_mask, num_chunks,
                     CHUNK: tl.constexpr, HAS_MASK: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(row_ids_ptr + i).to(tl.int64)
    x, _ = drawable_logits(logits_ptr + row * stride_row, bitmask_ptr + row * stride_mask,
                           chunk * CHUNK + tl.arange(0, CHUNK), width, offset, HAS_MASK)
    tl.store(out_ptr + i * num_chunks + chunk, tl.max(x, 0))


@triton.jit
def sample_shard_kernel(logits_ptr, bitmask_ptr, row_ids_ptr, temperature_ptr, max_z_ptr,
                        min_q_ptr, row_key_ptr,
                        best_score_ptr, best_id_ptr, q_sum_ptr, count_ptr, keys_ptr, scores_ptr,
                        width, offset, stride_row, stride_mask, num_chunks, num_candidates,
                        MODE: tl.constexpr, CHUNK: tl.constexpr, HAS_MASK: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(row_ids_ptr + i).to(tl.int64)
    logits_row = logits_ptr + row * stride_row
    out = i * num_chunks + chunk
    x, ids = drawable_logits(logits_row, bitmask_ptr + row * stride_mask,
                             chunk * CHUNK + tl.arange(0, CHUNK), width, offset, HAS_MASK)
    drawable = x > float("-inf")
    if MODE == 0:  # greedy: the largest logit, ties to the lowest id
        best = tl.max(x, 0)
        tl.store(best_score_ptr + out, best.to(tl.float64))
        tl.store(best_id_ptr + out, tl.min(tl.where(drawable & (x == best), ids, 1 << 62), 0))
    else:
        temp = tl.load(temperature_ptr + i)
        row_key = tl.load(row_key_ptr + i)
        z = x.to(tl.float64) / temp
        q = tl.floor(ex.exp64(z - tl.load(max_z_ptr + i)) * 4294967296.0).to(tl.int64)
        q = tl.where(drawable, q, 0)
        if MODE == 1:  # no order-dependent cut: the kept token with the best noisy score
            score = tl.where(drawable & (q >= tl.load(min_q_ptr + i)),
                             z + gumbel(row_key, ids), float("-inf"))
            best = tl.max(score, 0)
            tl.store(best_score_ptr + out, best)
            tl.store(best_id_ptr + out, tl.min(tl.where((score == best) & (score > float("-inf")),
                                                        ids, 1 << 62), 0))
        else:
            # The chunk's best `num_candidates` keys: keys are unique, so the threshold (the
            # C-th largest key) is found bit by bit and exactly C keys reach it.
            keys = tl.where(drawable, (q << 30) | (1073741823 - ids), -1)
            threshold = tl.zeros([], tl.int64)
            if tl.sum(drawable.to(tl.int32), 0) > num_candidates:
                for b in range(0, 63):
                    trial = threshold | (tl.full([], 1, tl.int64) << (62 - b))
                    if tl.sum((keys >= trial).to(tl.int32), 0) >= num_candidates:
                        threshold = trial
            chosen = keys >= threshold  # in id order; the launcher sorts the offers
            slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
            score = z + gumbel(row_key, ids)
            tl.store(keys_ptr + out * num_candidates + slot, keys, mask=chosen)
            tl.store(scores_ptr + out * num_candidates + slot, score, mask=chosen)
            tl.store(q_sum_ptr + out, tl.sum(q, 0))
            tl.store(count_ptr + out, tl.sum(drawable.to(tl.int64), 0))


class _Launch:
    """One kernel launch over the rows `where` of the batch (a subset: greedy, free or ordered)."""

    def __init__(self, logits, bitmask, rows, where, num_candidates, chunk):
        self.logits, self.bitmask = logits, bitmask
        self.device = logits.device
        self.row_ids = torch.tensor(where, dtype=torch.int64, device=self.device)
        self.rows = [rows[i] for i in where]
        self.num_candidates, self.chunk = num_candidates, chunk
        self.num_chunks = -(-logits.shape[1] // chunk)
        self.grid = (len(where), self.num_chunks)

    def _common(self):
        has_mask = self.bitmask is not None
        mask = self.bitmask if has_mask else self.row_ids  # a dummy pointer when unmasked
        return (self.logits.shape[1], 0, self.logits.stride(0),
                mask.stride(0) if has_mask else 0, self.num_chunks), has_mask, mask

    def _params(self, sampled: bool):
        """Per-row temperature, max z, min_q and row key (placeholders for greedy rows)."""
        n, dev = len(self.rows), self.device
        if not sampled:
            zeros = torch.zeros(n, dtype=torch.float64, device=dev)
            return zeros, zeros, zeros.long(), zeros.long()
        temperature = torch.tensor([r.temperature for r in self.rows], dtype=torch.float64, device=dev)
        max_logit = torch.empty(self.grid, dtype=torch.float32, device=dev)
        args, has_mask, mask = self._common()
        logit_max_kernel[self.grid](self.logits, mask, self.row_ids, max_logit, *args,
                                    CHUNK=self.chunk, HAS_MASK=has_mask, num_warps=8)
        max_z = max_logit.amax(dim=1).double() / temperature  # max fl(x / T) == fl(max x / T)
        if torch.isneginf(max_z).any():
            raise ValueError("a row has no drawable token")
        if torch.isposinf(max_z).any():
            raise ValueError("a logit divided by its temperature is +inf")
        min_q = sampler._min_q(self.rows).reshape(-1).to(dev)
        row_keys = keyed.row_keys([r.seed for r in self.rows], [r.position for r in self.rows])
        return temperature, max_z, min_q, row_keys.reshape(-1).to(dev)

    def run(self, mode: int):
        num_rows, nc = self.grid
        f64 = dict(dtype=torch.float64, device=self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        best_score, best_id = torch.empty(self.grid, **f64), torch.empty(self.grid, **i64)
        q_sum, count = torch.empty(self.grid, **i64), torch.empty(self.grid, **i64)
        # A chunk fills as many offer slots as it has drawable tokens (up to num_candidates).
        keys = torch.full((num_rows, nc * self.num_candidates), -1, **i64)
        scores = torch.full((num_rows, nc * self.num_candidates), float("-inf"), **f64)
        args, has_mask, mask = self._common()
        sample_shard_kernel[self.grid](
            self.logits, mask, self.row_ids, *self._params(mode != GREEDY),
            best_score, best_id, q_sum, count, keys, scores, *args, self.num_candidates,
            MODE=mode, CHUNK=self.chunk, HAS_MASK=has_mask, num_warps=8, **ex.LAUNCH_EXACT)
        if mode != ORDERED:  # fold the chunks: best score, ties to the lowest id (sampler._pick)
            top = best_score.amax(dim=1, keepdim=True)
            return torch.where(best_score == top, best_id, sampler.NO_TOKEN).amin(dim=1)
        ck, ci = keys.topk(min(self.num_candidates, self.logits.shape[1]), dim=1)  # the global head
        return ck, scores.gather(1, ci), q_sum.sum(dim=1), count.sum(dim=1)


def _prepare(logits: torch.Tensor, rows: list[RowSampling], bitmask: torch.Tensor | None,
             chunk: int):
    """Validated logits and the rows' masks as one int32 bitmask (None: nothing masked)."""
    num_rows, vocab = logits.shape
    if len(rows) != num_rows:
        raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} rows")
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    if vocab > sampler.ID_MASK:
        raise ValueError(f"vocabulary of {vocab} tokens exceeds 2^{sampler.ID_BITS} - 1")
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN")
    if bitmask is not None:
        bits.check(bitmask, num_rows, vocab)
        bitmask = bitmask.to(logits.device).contiguous()
    return (logits if logits.stride(1) == 1 else logits.contiguous()), bitmask


def candidates(logits: torch.Tensor, rows: list[RowSampling], num_candidates: int = NUM_CANDIDATES,
               *, chunk: int = CHUNK, bitmask: torch.Tensor | None = None):
    """The head of each sampled row's key order, as the reference builds it before `_decide`:
    (keys [R, C] descending (-1 pads), noisy scores [R, C], q-sum [R], drawable count [R])."""
    if any(r.temperature == 0.0 for r in rows):
        raise ValueError("candidates are drawn for sampled rows only")
    logits, bitmask = _prepare(logits, rows, bitmask, chunk)
    return _Launch(logits, bitmask, rows, range(len(rows)), num_candidates, chunk).run(ORDERED)


def sample(logits: torch.Tensor, rows: list[RowSampling], num_candidates: int = NUM_CANDIDATES,
           *, chunk: int = CHUNK, bitmask: torch.Tensor | None = None) -> list[int]:
    """`sampler.sample` with the per-token work in Triton: one token per row of logits [R, vocab].
    `chunk` (tokens per program, a power of two) changes the speed, never the token. `bitmask`
    (int32 [R, >= vocab / 32], sampling/bitmask.py) holds each row's allowed tokens."""
    logits, bitmask = _prepare(logits, rows, bitmask, chunk)
    vocab = logits.shape[1]
    out = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.temperature == 0.0]
    free = [i for i, r in enumerate(rows) if r.temperature != 0.0 and not r.ordered(vocab)]
    ordered = [i for i, r in enumerate(rows) if r.temperature != 0.0 and r.ordered(vocab)]
    if greedy:
        tokens = _Launch(logits, bitmask, rows, greedy, num_candidates, chunk).run(GREEDY)
        _assign(out, greedy, sampler._greedy_check(tokens))
    if free:
        _assign(out, free, _Launch(logits, bitmask, rows, free, num_candidates, chunk).run(FREE))
    if not ordered:
        return out
    orows = [rows[i] for i in ordered]
    keys, scores, q_sum, count = _Launch(logits, bitmask, rows, ordered, num_candidates, chunk).run(ORDERED)
    keys = keys.cpu()  # the decision on C candidates per row is the reference's own code
    keep, decided = sampler._decide(keys, q_sum.cpu(), count.cpu(), orows)
    _assign(out, ordered, sampler._draw(keys, scores.cpu(), keep))
    late = [j for j in range(len(ordered)) if not decided[j]]
    if late:  # the nucleus may run past the candidates: the reference sorts whole rows
        lrows = [orows[j] for j in late]
        lmask = bitmask[[ordered[j] for j in late]].cpu() if bitmask is not None else None
        _assign(out, [ordered[j] for j in late],
                sample_ref(logits[[ordered[j] for j in late]].cpu(), lrows, num_candidates, bitmask=lmask))
    return out


def _assign(out: list[int], where: list[int], tokens) -> None:
    for i, t in zip(where, torch.as_tensor(tokens).tolist()):
        out[i] = t
