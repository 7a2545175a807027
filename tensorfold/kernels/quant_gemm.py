"""The exact quantized GEMM's torch reference: GGUF weight blocks times int8 activation blocks,
summed so that no order is left to depend on. It defines the bits; the C++ and Triton kernels
that follow it must equal it bitwise (this module is their oracle).

Every GGUF block type the project keeps is brought to one form (QuantWeight): per weight a small
signed integer code c, per sub-block of 32 (16 for q6_k) an integer scale S, per block of 32 an
exponent E, and for the types with a minimum an integer M and exponent F per block of 32, so that
a weight is w = S c 2^E (+ M 2^F). Both S 2^E and M 2^F are the file's own float16 scales
(times the K-quants' 6- or 8-bit sub-block scales), exactly. Each kind quantizes its activations
in groups of ACT columns: 32 for the 32-weight types (q8_0, q4_0, q4_1, q5_1), 256 for the
K-quants (q4_k, q5_k, q6_k), whose files keep one d (and dmin) per super-block of 256, so E (and
F) are the same across each group of 8 blocks (a weight where they are not is refused). The
arithmetic, per output y[r, n] = sum_k x[r, k] w[n, k]:

1. Activations, per row and group of ACT (row-local, deterministic), to int8 the way llama.cpp's
   Q8_0/Q8_1 (ACT 32) and Q8_K (ACT 256) blocks do it, in float32 IEEE operations: amax = max |x|,
   d = amax / 127, id = 127 / amax, xq = round_even(x id) clamped to [-127, 127]; the group's
   scale is float16(d) = m 2^k (m its 11-bit significand, as `significand` gives it). A group
   whose amax is below 2^-120 (zero, or tiny: 127 / amax would overflow) is zero: xq = 0, d = 0.
   For the 32-weight types with a minimum also the float16 of d sum(xq) = sm 2^se, as Q8_1 keeps
   it; the K-quants' minimum takes the exact integer sums of xq instead. (llama.cpp's own rounding
   of a group; its sums of the terms are float, ours exact: docs/kernels.md on what that means for
   agreement.)
2. Per sub-block h an integer dot A[h] = sum c xq, and per activation group the terms, each an
   integer I times a power of two. ACT 32 (one block b): (sum_h S[b, h] A[b, h]) m[b] 2^(E[b] + k[b]),
   and with a minimum M[b] sm[b] 2^(F[b] + se[b]). ACT 256 (one super-block s, blocks b in it):
   (sum_b sum_h S[b, h] A[b, h]) m[s] 2^(E[s] + k[s]), and for q4_k / q5_k the minimum
   (sum_b M[b] sum(xq of block b)) m[s] 2^(F[s] + k[s]): one dot term and one minimum term per
   super-block, the sub-block scales folded in by integer sums. Every term is below
   2^(E or F + k + T), T the kind's TERM_BITS (se <= k + 13).
3. The terms of one output are summed on one integer grid 2^g, g = top[n] + kmax[r] + T - 62 +
   ceil(log2(#terms)), where top[n] is the largest E or F of weight row n and kmax[r] the largest
   k of activation row r: every term is below 2^(top + kmax + T), so the whole sum stays below
   2^62. Both maxima are per row of one operand, so a kernel knows g before it sees a block. A
   term is I shifted to that grid, rounded half to even where the shift drops bits (the grid
   keeps ~50 bits below the largest possible term: far past float32). The int64 sum is exact in
   any order.
4. y = float32(float64(total) 2^g), then the output dtype: two roundings, the same everywhere.

So a row's result does not depend on the other rows, the tiling, split-K, threads or device:
every step is integer arithmetic or a fixed rounding of one value.
"""
import math
from dataclasses import dataclass

import torch

from tensorfold.exact.grid import exponent, pow2

BLOCK = 32
X_MAX = 127           # |xq| <= X_MAX
F16_MAX = 65504.0     # float16 scales saturate here (never reached by real activations)
ROW_CHUNK = 8


@dataclass(frozen=True)
class Kind:
    sub: int          # weights per scale S: 32, or 16 (q6_k)
    term_bits: int    # T: every term's |I| < 2^T
    has_min: bool     # w = S c 2^E + M 2^F
    code_bits: int    # codes as stored: q8_0 8 (signed), q4_* 4, q5_* 5, q6_k 6
    act: int = BLOCK  # activations quantized per group of `act` columns (step 1): 32, or 256

    @property
    def blocks_per_group(self) -> int:
        return self.act // BLOCK


# Term bounds: |S| < 2^11 (a float16 significand) times the K-quants' sub-block scale (6 bits, or
# 8 signed for q6_k); |A| <= sub max|c| 127; m < 2^11. ACT 32: q8_0 2^11 * 128*127*32 * 2^11 <
# 2^41; q5_1 2^11 * 31*127*32 * 2^11 < 2^39; minimum terms |M sm| < 2^11 2^11 at se <= k + 13:
# below 2^35. ACT 256, a super-block's
# sum of 8 blocks: q4_k 2^3 * 2^17 * 15*127*32 * 2^11 < 2^47; q5_k 2^3 * 2^17 * 31*127*32 * 2^11 <
# 2^48; q6_k 16 sub-blocks of 2^18 * 32*127*16 * 2^11 < 2^49; the minimum 2^3 * 2^17 * 127*32 *
# 2^11 < 2^43.
SUPER = 256
KINDS = {
    "q8_0": Kind(32, 41, False, 8),
    "q4_0": Kind(32, 41, False, 4),
    "q4_1": Kind(32, 41, True, 4),
    "q4_k": Kind(32, 47, True, 4, SUPER),
    "q5_k": Kind(32, 48, True, 5, SUPER),
    "q6_k": Kind(16, 49, False, 6, SUPER),
    "q5_1": Kind(32, 41, True, 5),
}
TYPES = tuple(KINDS)


@dataclass
class QuantWeight:
    """A [N, K] matrix in blocks: codes [N, K] int8 (the signed c: q4_0's q - 8, q6_k's q - 32),
    scale [N, K / sub] int32 (S), scale_exp [N, K / 32] int32 (E), and for the types with a
    minimum min [N, K / 32] int32 (M) and min_exp [N, K / 32] int32 (F)."""
    kind: str
    codes: torch.Tensor
    scale: torch.Tensor
    scale_exp: torch.Tensor
    min: torch.Tensor | None = None
    min_exp: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights the blocks stand for, as gguf computes them: S c 2^E (exact in
        float32), plus M 2^F (exact) in one float32 add."""
        sub = KINDS[self.kind].sub
        w = self.codes.double() * self.scale.double().repeat_interleave(sub, dim=1)
        w = (w * pow2(self.scale_exp.repeat_interleave(BLOCK, dim=1))).float()
        if self.min is not None:
            w = w + (self.min.double() * pow2(self.min_exp)).float().repeat_interleave(BLOCK, dim=1)
        return w

    def to(self, device) -> "QuantWeight":
        move = (lambda t: None if t is None else t.to(device))
        return QuantWeight(self.kind, *(move(getattr(self, f)) for f in ("codes", "scale", "scale_exp", "min", "min_exp")))

    def rows(self, ids: torch.Tensor | slice) -> "QuantWeight":
        """The weight rows `ids`, indices or a slice (an embedding lookup: rows(ids).dequantize();
        a slice gives views)."""
        pick = (lambda t: None if t is None else t[ids])
        return QuantWeight(self.kind, self.codes[ids], self.scale[ids], self.scale_exp[ids], pick(self.min),
                           pick(self.min_exp))

    def top(self) -> torch.Tensor:
        """top[n]: the largest exponent of weight row n's terms (step 3)."""
        t = self.scale_exp.amax(dim=1)
        return t if self.min_exp is None else torch.maximum(t, self.min_exp.amax(dim=1))


def take_rows(matrix, ids: torch.Tensor):
    """Rows `ids` of a checkpoint matrix, dense or in quantized blocks (whose rows move whole)."""
    if isinstance(matrix, QuantWeight):
        return matrix.rows(ids.to(matrix.codes.device))
    return matrix[ids]


def cat(parts: list[QuantWeight]) -> QuantWeight:
    """Weights stacked along N (fused Q/K/V, gate/up); all parts of one type."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot stack blocks of different types {sorted(kinds)}")
    both = (lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts]))
    return QuantWeight(parts[0].kind, *(both(f) for f in ("codes", "scale", "scale_exp", "min", "min_exp")))


def significand(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 h -> (dm, de) int32 with h == dm 2^de exactly, |dm| < 2^11 (zero: dm = 0, de = -24).
    An infinite or NaN scale has no such form: ValueError."""
    bits = h.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    if bool(((bits >> 10) & 0x1F).eq(0x1F).any()):
        raise ValueError("a block scale is infinite or NaN")
    sign = torch.where(bits >> 15 == 1, -1, 1)
    exp = (bits >> 10) & 0x1F
    frac = bits & 0x3FF
    normal = exp > 0
    dm = torch.where(normal, frac | 0x400, frac) * sign
    de = torch.where(normal, exp - 25, torch.full_like(exp, -24))  # 2^(exp-15) * 2^-10; subnormal 2^-24
    return dm.to(torch.int32), de.to(torch.int32)


def from_legacy(kind: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> QuantWeight:
    """q8_0 / q4_0 / q4_1 blocks as GGUF stores them: q [N, K] (int8, or the 4-bit values 0..15),
    d (and q4_1's m) [N, K / 32] float16."""
    if kind not in ("q8_0", "q4_0", "q4_1"):
        raise ValueError(f"not a 32-weight block type: {kind!r}")
    codes = q.to(torch.int8) - (8 if kind == "q4_0" else 0)
    dm, de = significand(d)
    mm, me = significand(m) if kind == "q4_1" else (None, None)
    return QuantWeight(kind, codes.to(torch.int8), dm, de, mm, me)


def quantize_activations(x: torch.Tensor, act: int = BLOCK):
    """x [M, K] (K a multiple of act) -> xq [M, K] int8, per group of `act` [M, K / act] the
    scale's (m, k), and for the 32-column groups, per block [M, K / 32], the minimum term's
    (sm, se) (float16(d sum xq); None for the K-quants' groups of 256, whose minimum terms take
    the exact code sums instead), all int32 (step 1): x ~ xq m 2^k."""
    rows, kdim = x.shape
    groups = x.float().reshape(rows, kdim // act, act)
    amax = groups.abs().amax(dim=-1)                                          # [M, G] float32
    zero = exponent(amax) < -120  # below: 127 / amax overflows float32 (and d is 0 in float16)
    safe = torch.where(zero, 1.0, amax)
    d = torch.where(zero, 0.0, safe / X_MAX)                                  # float32 IEEE divisions
    inverse = torch.full_like(safe, X_MAX) / safe  # (not X_MAX / safe: torch takes a reciprocal there)
    xq = torch.round(groups * inverse.unsqueeze(-1)).clamp_(-X_MAX, X_MAX)    # round half to even
    xq = xq.masked_fill_(zero.unsqueeze(-1), 0)
    m, k = significand(d.clamp(max=F16_MAX).half())
    if act != BLOCK:
        return xq.to(torch.int8).reshape(rows, kdim), m, k, None, None
    s = (d * xq.sum(dim=-1)).clamp(-F16_MAX, F16_MAX)
    sm, se = significand(s.half())                                            # float32 d sum(xq), to float16
    return xq.to(torch.int8).reshape(rows, kdim), m, k, sm, se


def check_weight(w: QuantWeight) -> Kind:
    """w's kind, after checking what the arithmetic assumes of it: a known kind, and for the
    256-column kinds K a multiple of 256 and one E (and F) per super-block."""
    if w.kind not in KINDS:
        raise ValueError(f"unknown quantized type {w.kind!r}")
    kind = KINDS[w.kind]
    if w.shape[1] % kind.act:
        raise ValueError(f"{w.kind} weights need K a multiple of {kind.act}, not {w.shape[1]}")
    if kind.act != BLOCK:
        for name in ("scale_exp", "min_exp"):
            e = getattr(w, name)
            if e is not None and not bool((e.reshape(e.shape[0], -1, kind.blocks_per_group).diff(dim=-1) == 0).all()):
                raise ValueError(f"{w.kind} weights need one {name} per super-block of {kind.act}")
    return kind


def linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ w^T -> [M, N] in x's dtype, by the steps of the module docstring."""
    kind = check_weight(w)
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} against weights {w.shape}")
    # rows are independent: chunks only bound the scratch memory
    return torch.cat([_linear_rows(part, w, kind) for part in (x.split(ROW_CHUNK) or (x,))])


def _linear_rows(x: torch.Tensor, w: QuantWeight, kind: Kind) -> torch.Tensor:
    """linear() on at most ROW_CHUNK rows of a checked weight."""
    n, kdim = w.shape
    m, nb, per, bpg = x.shape[0], kdim // BLOCK, BLOCK // kind.sub, kind.blocks_per_group
    xq, xm, k, sm, se = quantize_activations(x, kind.act)
    xm, k = xm.to(torch.int64).unsqueeze(1), k.to(torch.int64)                               # [M, 1, G]
    xs = xq.double().reshape(m, nb * per, kind.sub)
    a = torch.einsum("msi,nsi->mns", xs, w.codes.double().reshape(n, nb * per, kind.sub))      # exact: < 2^19
    # per group: sum over its blocks' sub-blocks of S A (exact int64)
    scaled = (a.to(torch.int64) * w.scale.to(torch.int64).unsqueeze(0)).reshape(m, n, nb // bpg, bpg * per).sum(-1)
    first = (lambda e: e[:, ::bpg].to(torch.int64).unsqueeze(0))  # a group's E (or F): its first block's
    ints = [scaled * xm]                                                                      # [M, N, G]
    exps = [first(w.scale_exp) + k.unsqueeze(1)]
    if kind.has_min and bpg == 1:
        ints.append(w.min.to(torch.int64).unsqueeze(0) * sm.to(torch.int64).unsqueeze(1))
        exps.append(first(w.min_exp) + se.to(torch.int64).unsqueeze(1))
    elif kind.has_min:  # the exact sums of the codes per block, times M, summed per super-block
        sums = xq.to(torch.int64).reshape(m, 1, nb, BLOCK).sum(-1)
        mins = (w.min.to(torch.int64).unsqueeze(0) * sums).reshape(m, n, nb // bpg, bpg).sum(-1)
        ints.append(mins * xm)
        exps.append(first(w.min_exp) + k.unsqueeze(1))
    ints, exps = torch.cat(ints, dim=-1), torch.cat(exps, dim=-1)                             # [M, N, T]
    top = w.top().to(torch.int64).unsqueeze(0) + k.amax(dim=1).unsqueeze(1)                  # [M, N]
    g = top + kind.term_bits - 62 + math.ceil(math.log2(ints.shape[-1]))
    total = _on_grid(ints, exps - g.unsqueeze(-1), kind.term_bits).sum(dim=-1)               # exact int64
    y = (total.double() * pow2(g)).float()
    return y.to(x.dtype)


def _on_grid(ints: torch.Tensor, shift: torch.Tensor, term_bits: int) -> torch.Tensor:
    """ints 2^shift as integers: a left shift, or a right shift rounded half to even."""
    up = shift.clamp(min=0)
    down = (-shift).clamp(min=0, max=term_bits + 1)  # past 2^(T+1) every |int| < 2^T rounds to 0
    floor = ints >> down
    rem = ints - (floor << down)
    half = torch.where(down > 0, torch.ones_like(down) << (down - 1).clamp(min=0), torch.zeros_like(down))
    round_up = (down > 0) & ((rem > half) | ((rem == half) & (floor & 1 == 1)))
    return torch.where(shift >= 0, ints << up, floor + round_up.to(torch.int64))
