"""The keyed sampler: one token per row from logits, by a cut rule in integers that gives the
same token whether the vocabulary sits in one tensor or in contiguous shards.

The rule for one row (RowSampling), exactly:
- Tokens whose bit is clear in the row's allowed-token bitmask (sampling/bitmask.py, xgrammar's
  layout; none given: all allowed), and tokens whose logit is -inf, are not drawable.
- temperature 0: the argmax of the logits, ties to the lowest id; no noise.
- Otherwise z = logits.double() / T, m = max z (the exact global max), and each drawable token gets
  the weight q_v = floor(exp(z_v - m) * 2^32), an int64 (the likeliest token has q = 2^32).
  Tokens are ordered by the unique key (q desc, id asc), packed into one int64:
  key = q << 30 | (2^30 - 1 - id).
  top-k (k <= 0 off): keep the first k.  top-p (1 is off): Z = the exact integer sum of q over the
  tokens top-k kept, P40 = floor(top_p * 2^40); keep token i (in key order) iff i == 0 or
  mass_before_i * 2^40 < Z * P40, i.e. mass_before_i < ceil(Z * P40 / 2^40); Z * P40 reaches 2^89,
  so that threshold is taken with Python ints per row.  min_p (0 off): keep q_v >= floor(min_p *
  2^32), relative to the likeliest token, on what top-p kept (SGLang's order).
  Draw: the kept token with the largest z_v + gumbel(seed, position, v) in float64, ties to the
  lowest id.
- Each cut keeps a prefix of the key order, so the kept set is the first L tokens for some L, and
  every quantity above (max, integer sums, keys, per-token noise) is independent of the layout.
- exp here (and log in the noise, keyed.py) is not libm's: it is `exact.float64.exp64`, fdlibm's
  algorithm written as a fixed sequence of correctly rounded float64 operations (within 1 ulp of
  the true exp). So the draw calls no libm at all, and given the same logits it picks the same
  token on any CPU kind and in the Triton sampler on any device, bit for bit, even where
  exp(z_v - m) * 2^32 lies next to an integer at a cut edge.

Finding L: `_decide` applies the rule to the first C tokens of the key order (a "head") and
says whether L provably fits in it (all drawable tokens are there, or a cut drops token C).
`sample` tries heads of 1024 and 8192 tokens, then the sorted row. Rows with no order-dependent
cut (top-k and top-p off; min-p is a threshold on q) skip all that: a masked argmax.

Sharding (`sample_sharded`): the exchange is a max all-reduce of m, integer sum all-reduces of
the q-sums and drawable counts, and all-gathers of offers. Each shard offers its best
min(1024, width) keys with their noisy scores; the union holds the global first 1024 (each of
them is in its own shard's first 1024), so `_decide` runs on the same head as in one tensor.
Rows whose nucleus may run past it gather whole shards. Greedy and order-free rows gather each
shard's local winner. `LocalExchange` simulates the collectives in one process; a
torch.distributed version passes its one shard to `_sample_shards` with an `Exchange` that calls
all_reduce / all_gather, and nothing else changes.

Everything here is torch operations. The native op set (backends/native_ops.py) passes its C++
spellings of the vocabulary-wide steps as `sample(..., native=...)` (`NativeSteps`: the same bits,
tested in tests/test_sampler.py and tests/test_cpu_kernels.py); without it, nothing calls them.
"""
from dataclasses import dataclass
from typing import Protocol

import torch

from tensorfold.exact.float64 import exp64
from tensorfold.sampling import bitmask as bits, keyed
from tensorfold.sampling.params import RowSampling

NUM_CANDIDATES = 1024
ID_BITS = 30                      # vocabularies up to 2^30 tokens
ID_MASK = (1 << ID_BITS) - 1
Q_ONE = 1 << 32                   # the weight of the likeliest token
P_BITS = 40                       # top-p fixed point
OFF = 1 << 62                     # "no limit" for top_k and the top-p threshold
NO_TOKEN = 1 << 62                # id of "no winner here" in a shard's offer


class NativeSteps(Protocol):
    """Compiled spellings of the draw's vocabulary-wide steps (tensorfold._cpu: csrc/cpu/draw.cpp,
    module.cpp), each with the bits of the torch step named beside it."""

    def draw_rows(self, logits, temps, keys, min_q, offset): ...  # sample, order-free rows (host lists in and out)

    def sample_keys(self, z, m, ids): ...  # _keys

    def top_keys(self, keys, k): ...  # _top

    def gumbel(self, keys, ids): ...  # keyed.gumbel


# ---- per-shard arithmetic (elementwise in the token, so identical on any layout) ----

def _masked(logits: torch.Tensor, bitmask: torch.Tensor | None, offset: int) -> torch.Tensor:
    """Logits (global ids offset ..) with the tokens the bitmask clears at -inf; rejects NaN."""
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN")
    if bitmask is None:
        return logits
    allowed = bits.unpack(bitmask.to(logits.device), logits.shape[1], offset)
    return logits.masked_fill(~allowed, float("-inf"))


def _scaled(x: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    temps = torch.tensor([r.temperature for r in rows], dtype=torch.float64).reshape(-1, 1)
    z = x.double() / temps  # [R, width]
    if torch.isposinf(z).any():
        raise ValueError("a logit divided by its temperature is +inf")
    return z


def _keys(z: torch.Tensor, m: torch.Tensor, ids: torch.Tensor, native: NativeSteps | None = None):
    """Weights q and order keys of each token; key -1 marks a token that is not drawable.
    (One pass in C++ on CPU tensors with `native`, with these bits.)"""
    if native is not None and z.device.type == "cpu" and ids.shape[0] == 1:
        return native.sample_keys(z, m, ids)
    valid = z > float("-inf")
    q = exp64(z - m).mul_(float(Q_ONE)).floor_().to(torch.int64)  # [R, width]
    keys = torch.where(valid, (q << ID_BITS) | (ID_MASK - ids), -1)
    return torch.where(valid, q, 0), keys


def _scores(z: torch.Tensor, rows: list[RowSampling], ids: torch.Tensor,
            native: NativeSteps | None = None) -> torch.Tensor:
    """z_v + Gumbel(seed, position, v) for the tokens `ids` ([R|1, N] global ids) of each row."""
    rk = keyed.row_keys([r.seed for r in rows], [r.position for r in rows])
    if native is not None and ids.device.type == "cpu" and ids.dim() == 2:
        return z + native.gumbel(rk, ids)
    return z + keyed.gumbel(rk, ids)


def _pick(scores: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor):
    """Per row, the kept entry with the largest score, ties to the lowest id: (score, id);
    (-inf, NO_TOKEN) where nothing is kept."""
    s = torch.where(keep, scores, float("-inf"))
    best = s.amax(dim=1, keepdim=True)
    tok = torch.where(keep & (s == best), ids, NO_TOKEN).amin(dim=1)
    return best.squeeze(1), tok


def _min_q_of(row: RowSampling) -> int:
    # min_p * 2^32 is exact in float64, so its floor is the exact fixed-point threshold.
    return int(row.min_p * Q_ONE)


def _min_q(rows: list[RowSampling]) -> torch.Tensor:
    return torch.tensor([_min_q_of(r) for r in rows], dtype=torch.int64).reshape(-1, 1)


# ---- the decision on the global head of the key order ----

def _decide(keys: torch.Tensor, total: torch.Tensor, num_drawable: torch.Tensor,
            rows: list[RowSampling]):
    """Apply the cut rule to the first C tokens of each row's key order.

    keys [R, C] sorted descending (padded with -1); total [R] the q-sum and num_drawable [R] the
    count over the whole row. Returns (keep [R, C], decided [R]): a row is decided when the C
    tokens are all its drawable tokens or a cut provably drops token C, so `keep` is its kept set.
    """
    num_rows, c = keys.shape
    valid = keys >= 0
    q = torch.where(valid, keys >> ID_BITS, 0)                                  # [R, C]
    idx = torch.arange(c).reshape(1, -1)
    top_k = torch.tensor([r.top_k if r.top_k > 0 else OFF for r in rows]).reshape(-1, 1)
    keep = valid & (idx < top_k)

    # Z: the q-sum over what top-k kept; known when top-k keeps all or at most C tokens.
    all_k = top_k.squeeze(1) >= num_drawable
    z_sum = torch.where(all_k, total, torch.where(idx < top_k, q, 0).sum(dim=1))
    z_known = all_k | (top_k.squeeze(1) <= c)
    thresholds = []
    for r, z in zip(rows, z_sum.tolist()):
        if r.top_p >= 1.0:
            thresholds.append(OFF)
        else:  # ceil(Z * P40 / 2^40): mass_before * 2^40 < Z * P40 <=> mass_before < this
            thresholds.append(-((-z * int(r.top_p * 2 ** P_BITS)) >> P_BITS))
    threshold = torch.tensor(thresholds, dtype=torch.int64).reshape(-1, 1)
    mass_before = torch.cumsum(q, dim=1) - q
    keep &= (idx == 0) | (mass_before < threshold)
    keep &= q >= _min_q(rows)

    p_on = torch.tensor([r.top_p < 1.0 for r in rows])
    decided = ((num_drawable <= c) | ~keep[:, -1] | (top_k.squeeze(1) <= c)
               | (q.sum(dim=1) >= threshold.squeeze(1)))
    decided &= ~p_on | z_known
    return keep, decided


def _draw(keys: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return _pick(scores, ID_MASK - (keys & ID_MASK), keep)[1]


# ---- one shard ----

def sample(logits: torch.Tensor, rows: list[RowSampling], num_candidates: int = NUM_CANDIDATES, *,
           bitmask: torch.Tensor | None = None, native: NativeSteps | None = None) -> list[int]:
    """One token per row of `logits` [num_rows, vocab] (the whole vocabulary in one tensor);
    `bitmask` (int32 [num_rows, >= vocab / 32]) the allowed tokens of each row.

    In torch operations, unless `native` is given (the native op set's draw): then, where no row
    has an order-dependent cut (greedy rows; sampled rows with top-k and top-p off, the OpenAI
    default), float32 CPU logits are drawn by one call, native.draw_rows (csrc/cpu/draw.cpp), and
    otherwise the steps below run with native's keys, head selection and noise: the same tokens."""
    if (native is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and not any(r.temperature != 0.0 and r.ordered(logits.shape[1]) for r in rows)):
        return _sample_native(native, logits, rows, bitmask)
    return _sample_steps(logits, rows, num_candidates, bitmask, native)


# draw_rows' status codes, in the order _sample_steps meets them
_DRAW_ERRORS = {1: "logits contain NaN", 2: "a logit divided by its temperature is +inf",
                3: "a row has no drawable token"}


def _sample_native(native: NativeSteps, logits: torch.Tensor, rows: list[RowSampling],
                   bitmask: torch.Tensor | None) -> list[int]:
    """sample() for rows without an order-dependent cut, in one native call; errors as
    _sample_steps raises them. (A bitmask is applied by `_masked`, which also rejects a NaN under
    a cleared bit; without one the call itself reports NaN.)"""
    _check(logits, rows, 0, bitmask)
    x = logits if bitmask is None else _masked(logits, bitmask, 0)
    keys = keyed.row_key_words([r.seed for r in rows], [r.position for r in rows])
    tokens, status = native.draw_rows(x, [r.temperature for r in rows], keys, [_min_q_of(r) for r in rows], 0)
    for code, message in _DRAW_ERRORS.items():
        if code in status:
            raise ValueError(message)
    return tokens


def _sample_steps(logits: torch.Tensor, rows: list[RowSampling], num_candidates: int,
                  bitmask: torch.Tensor | None, native: NativeSteps | None) -> list[int]:
    """sample() in tensor operations (any device, any cut): the steps the native draw equals;
    `native` (CPU tensors) computes keys, heads and noise with the same bits."""
    x, greedy, sampled = _split(logits, rows, 0, bitmask)
    vocab = x.shape[1]
    ids = torch.arange(vocab).reshape(1, -1)
    out = [0] * len(rows)
    if greedy:  # fast path: no weights, no noise; argmax returns the first maximal index
        g = _take(x, greedy)
        tokens = g.argmax(dim=1)
        if torch.isneginf(g.gather(1, tokens.reshape(-1, 1))).any():
            raise ValueError("a row has no drawable token")
        _assign(out, greedy, tokens)
    if not sampled:
        return out
    srows = [rows[i] for i in sampled]
    z = _scaled(_take(x, sampled), srows)
    m = _global_max([z.amax(dim=1, keepdim=True)])

    free = [j for j, r in enumerate(srows) if not r.ordered(vocab)]
    if free:  # no order-dependent cut: a masked argmax over the whole row
        frows = [srows[j] for j in free]
        zf = _take(z, free)
        keep = zf > float("-inf")
        if any(r.min_p > 0.0 for r in frows):
            keep &= _keys(zf, m[free], ids, native)[0] >= _min_q(frows)
        _assign(out, [sampled[j] for j in free], _pick(_scores(zf, frows, ids, native), ids, keep)[1])
    ordered = [j for j, r in enumerate(srows) if r.ordered(vocab)]
    if not ordered:
        return out
    z = _take(z, ordered)
    q, keys = _keys(z, m[ordered], ids, native)
    total, num_drawable = q.sum(dim=1), (keys >= 0).sum(dim=1)
    # Heads of growing size until every row's kept set lies inside its head; the last is the
    # whole row (topk of everything is a sort).
    pending = list(range(len(ordered)))
    for size in (num_candidates, 8 * num_candidates, vocab):
        head_keys, head_ids = _top(_take(keys, pending), min(size, vocab), native)   # sorted
        prows = [rows[sampled[ordered[j]]] for j in pending]
        keep, decided = _decide(head_keys, total[pending], num_drawable[pending], prows)
        scores = _scores(_take(z, pending).gather(1, head_ids), prows, head_ids, native)
        tokens = _draw(head_keys, scores, keep).tolist()
        for j, d, t in zip(pending, decided.tolist(), tokens):
            if d:
                out[sampled[ordered[j]]] = t
        pending = [j for j, d in zip(pending, decided.tolist()) if not d]
        if not pending:
            break
    return out


def _top(keys: torch.Tensor, k: int, native: NativeSteps | None = None):
    """The k largest keys of each row, descending, and their indices (torch.topk; with `native`, a
    partial sort in C++ on CPU tensors: the drawable keys are distinct, so both agree on them, and
    the not-drawable ones (-1) are never kept)."""
    if native is not None and keys.device.type == "cpu":
        return native.top_keys(keys, k)
    return keys.topk(k, dim=1)


def _take(t: torch.Tensor, index: list[int]) -> torch.Tensor:
    """Rows `index` of t, without a copy when that is every row in order."""
    return t if index == list(range(t.shape[0])) else t[index]


def kept_mask(logits: torch.Tensor, rows: list[RowSampling], bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's kept set as a [num_rows, vocab] bool mask (a greedy row keeps its argmax), by a
    full sort: for inspection and tests; the draw never builds it."""
    x, greedy, sampled = _split(logits, rows, 0, bitmask)
    mask = torch.zeros(x.shape, dtype=torch.bool)                              # [R, vocab]
    for i, t in zip(greedy, sample(x[greedy], [rows[i] for i in greedy])):
        mask[i, t] = True
    if sampled:
        srows = [rows[i] for i in sampled]
        z = _scaled(x[sampled], srows)
        q, keys = _keys(z, _global_max([z.amax(dim=1, keepdim=True)]), torch.arange(x.shape[1]))
        sk, si = keys.sort(dim=1, descending=True)
        keep, _ = _decide(sk, q.sum(dim=1), (sk >= 0).sum(dim=1), srows)
        mask[sampled] = torch.zeros_like(keep).scatter(1, si, keep)
    return mask


def _check(logits: torch.Tensor, rows: list[RowSampling], offset: int, bitmask: torch.Tensor | None) -> None:
    """Raise ValueError unless logits are [len(rows), width] within the id range and the bitmask
    covers them."""
    if logits.dim() != 2 or len(rows) != logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} rows")
    if offset + logits.shape[1] > ID_MASK:
        raise ValueError(f"vocabulary of {offset + logits.shape[1]} tokens exceeds 2^{ID_BITS} - 1")
    if bitmask is not None:
        bits.check(bitmask, len(rows), offset + logits.shape[1])


def _split(logits: torch.Tensor, rows: list[RowSampling], offset: int, bitmask: torch.Tensor | None):
    """Masked logits (the columns from global id `offset` on), and the indices of the greedy and
    the sampled rows."""
    _check(logits, rows, offset, bitmask)
    greedy = [i for i, r in enumerate(rows) if r.temperature == 0.0]
    sampled = [i for i, r in enumerate(rows) if r.temperature != 0.0]
    return _masked(logits, bitmask, offset), greedy, sampled


def _global_max(parts: list[torch.Tensor], ex: "Exchange | None" = None) -> torch.Tensor:
    m = parts[0] if ex is None else ex.all_max(parts)
    if torch.isneginf(m).any():
        raise ValueError("a row has no drawable token")
    return m


def _greedy_check(tokens: torch.Tensor) -> torch.Tensor:
    if (tokens == NO_TOKEN).any():
        raise ValueError("a row has no drawable token")
    return tokens


def _assign(out: list[int], where: list[int], tokens: torch.Tensor) -> None:
    for i, t in zip(where, tokens.tolist()):
        out[i] = t


# ---- vocabulary shards ----

class Exchange(Protocol):
    """The collectives of a vocabulary-sharded draw. Each takes the parts of the shards this
    process holds, in shard order, and returns the all-reduced or all-gathered tensor."""

    def all_max(self, parts: list[torch.Tensor]) -> torch.Tensor: ...

    def all_sum(self, parts: list[torch.Tensor]) -> torch.Tensor: ...

    def all_gather(self, parts: list[torch.Tensor]) -> torch.Tensor: ...


class LocalExchange:
    """The collectives of a vocabulary-sharded draw, for shards that all live in this process:
    each call gets every shard's part, in shard order. A torch.distributed exchange gets a
    one-element list (its rank's part) and returns the same reduced or gathered tensor."""

    def all_max(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts).amax(dim=0)

    def all_sum(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts).sum(dim=0)

    def all_gather(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Concatenate equal-shaped parts along the last dimension, in shard order."""
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class Shard:
    logits: torch.Tensor  # [num_rows, width]: global ids offset .. offset + width - 1
    offset: int


def sample_sharded(shard_logits: list[torch.Tensor], rows: list[RowSampling],
                   num_candidates: int = NUM_CANDIDATES, *, bitmask: torch.Tensor | None = None) -> list[int]:
    """`sample` on a vocabulary split into contiguous shards (possibly uneven), through the
    exchange a multi-rank draw does; returns the same tokens as `sample` on the concatenation."""
    offsets = [0]
    for x in shard_logits:
        offsets.append(offsets[-1] + x.shape[1])
    shards = [Shard(x, off) for x, off in zip(shard_logits, offsets)]
    max_width = max(x.shape[1] for x in shard_logits)
    return _sample_shards(shards, rows, offsets[-1], max_width, LocalExchange(), num_candidates, bitmask)


def sample_rank(logits: torch.Tensor, offset: int, vocab: int, num_shards: int, rows: list[RowSampling],
                exchange: Exchange, num_candidates: int = NUM_CANDIDATES, *,
                bitmask: torch.Tensor | None = None) -> list[int]:
    """One rank's part of a vocabulary-sharded draw: `logits` [num_rows, width] are global ids
    offset .. offset + width - 1 of `vocab` split in `num_shards` contiguous shards (none wider
    than ceil(vocab / num_shards)), and `exchange` the group's collectives. Every rank returns
    the tokens `sample` draws on the whole vocabulary."""
    max_width = -(-vocab // num_shards)
    return _sample_shards([Shard(logits, offset)], rows, vocab, max_width, exchange, num_candidates, bitmask)


def _sample_shards(shards: list[Shard], rows: list[RowSampling], vocab: int, max_width: int,
                   ex: Exchange, num_candidates: int, bitmask: torch.Tensor | None = None) -> list[int]:
    """Per-rank code: `shards` are the shards this process holds; every value that crosses
    shards goes through `ex`, so all holders reach the same decision. Each rank holds the whole
    bitmask (it is small) and masks its own columns."""
    splits = [_split(s.logits, rows, s.offset, bitmask) for s in shards]
    xs = [x for x, _, _ in splits]
    _, greedy, sampled = splits[0]
    ids = [torch.arange(s.offset, s.offset + x.shape[1]).reshape(1, -1) for s, x in zip(shards, xs)]
    out = [0] * len(rows)
    if greedy:  # each shard offers its best logit and the lowest id holding it
        offers = [_pick(x[greedy].double(), i, x[greedy] > float("-inf")) for x, i in zip(xs, ids)]
        _assign(out, greedy, _greedy_check(_best_offer(offers, ex)))
    if not sampled:
        return out
    srows = [rows[i] for i in sampled]
    zs = [_scaled(x[sampled], srows) for x in xs]
    m = _global_max([z.amax(dim=1, keepdim=True) for z in zs], ex)            # [R, 1]

    free = [j for j, r in enumerate(srows) if not r.ordered(vocab)]
    if free:  # each shard offers its local winner
        frows = [srows[j] for j in free]
        offers = []
        for z, i in zip(zs, ids):
            zf = z[free]
            keep = zf > float("-inf")
            if any(r.min_p > 0.0 for r in frows):
                keep &= _keys(zf, m[free], i)[0] >= _min_q(frows)
            offers.append(_pick(_scores(zf, frows, i), i, keep))
        _assign(out, [sampled[j] for j in free], _best_offer(offers, ex))
    ordered = [j for j, r in enumerate(srows) if r.ordered(vocab)]
    if not ordered:
        return out
    orows = [srows[j] for j in ordered]
    zs = [z[ordered] for z in zs]
    qk = [_keys(z, m[ordered], i) for z, i in zip(zs, ids)]
    total = ex.all_sum([q.sum(dim=1) for q, _ in qk])                         # [R]
    num_drawable = ex.all_sum([(k >= 0).sum(dim=1) for _, k in qk])           # [R]
    width = min(num_candidates, max_width)
    offer_keys, offer_scores = [], []
    for s, z, (_, k) in zip(shards, zs, qk):  # each shard: its best `width` keys, padded
        ck, ci = k.topk(min(width, k.shape[1]), dim=1)
        offer_keys.append(_pad(ck, width, -1))
        cs = _scores(z.gather(1, ci), orows, ci + s.offset)
        offer_scores.append(_pad(cs, width, float("-inf")))
    keys = ex.all_gather(offer_keys)                                            # [R, S * width]
    scores = ex.all_gather(offer_scores)
    ck, ci = keys.topk(min(num_candidates, vocab), dim=1)                       # the global head
    keep, decided = _decide(ck, total, num_drawable, orows)
    _assign(out, [sampled[j] for j in ordered], _draw(ck, scores.gather(1, ci), keep))

    late = [j for j in range(len(ordered)) if not decided[j]]
    if late:  # the nucleus may run past the candidates: exchange whole shards
        lrows = [orows[j] for j in late]
        keys = ex.all_gather([_pad(k[late], max_width, -1) for _, k in qk])    # [R', S * max_width]
        scores = ex.all_gather([_pad(_scores(z[late], lrows, i), max_width, float("-inf"))
                                for z, i in zip(zs, ids)])
        sk, si = keys.sort(dim=1, descending=True)
        keep, _ = _decide(sk, total[late], num_drawable[late], lrows)
        _assign(out, [sampled[ordered[j]] for j in late], _draw(sk, scores.gather(1, si), keep))
    return out


def _best_offer(offers: list[tuple[torch.Tensor, torch.Tensor]], ex: Exchange) -> torch.Tensor:
    """The winner among the shards' (score [R], id [R]) offers: max score, ties to the lowest id."""
    best = ex.all_gather([b.reshape(-1, 1) for b, _ in offers])               # [R, S]
    tok = ex.all_gather([t.reshape(-1, 1) for _, t in offers])
    return _pick(best, tok, tok < NO_TOKEN)[1]


def _pad(x: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)
