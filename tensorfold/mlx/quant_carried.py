"""The exact quantized GEMM on MLX's CPU device: quant_gemm.linear's integers carried in float64.

MLX's CPU device has float64 (Metal has none; there ops._quant_rows keeps the terms in int64).
What a decode round costs there is set less by arithmetic than by two things: the elements its
matmul streams (a reference BLAS, one element at a time, at any width) and the number of
primitives a graph holds (each costs microseconds of scheduling). So this form:

- streams the codes packed, `count` columns' codes in one float64 word (PACKING): one float64
  matmul per sub-block gives `count` sub-block dots at once, exactly;
- takes the words apart, scales the dots, rounds the terms onto the output's grid and splits
  them for summing in one fused elementwise step, on [S, M, count, Nw] (column n = i Nw + w is
  (i, w)): no concatenation, no int64 operation (MLX's CPU kernels run those one element at a
  time);
- sums each output's rounded terms as two exact float64 sums (rounded_parts), whose one rounded
  addition is float64(total): the reference's step 4 follows as two exact scalings and the
  conversion to float32.

The activations' float32 steps (step 1) are `activations`, shared with the int64 form. Each step
below says why it is exact; tests/test_mlx_backend.py compares the totals with the int64 form's,
bit for bit, and the outputs with the torch reference.
"""
import functools

import mlx.core as mx
import numpy as np
import torch

from tensorfold.kernels import quant_gemm
from tensorfold.mlx import grid

BLOCK = quant_gemm.BLOCK
SPLIT_BITS = 11                                # a rounded term's high part: a multiple of 2^11
SPLIT_MAGIC = 1.5 * 2.0 ** (52 + SPLIT_BITS)   # (t + M) - M: t to a multiple of 2^SPLIT_BITS, |t| < 2^62
SCALE_RANGE = (-990, 940)  # top + grid_offset kept here: step 4's two scalings stay exact (column_pow)


HIGH_FIRST = mx.array(np.array([True, False]).reshape(2, 1, 1, 1, 1))  # rounded_parts' two, on one axis


def max_code(kind_name: str) -> int:
    """max |c| of a kind's codes: unsigned for the kinds with a minimum, centred for the rest."""
    kind = quant_gemm.KINDS[kind_name]
    return (1 << kind.code_bits) - 1 if kind.has_min else 1 << (kind.code_bits - 1)


def packing(kind_name: str) -> tuple[int, int]:
    """(count, f) of the packed codes: each sub-block dot |A| <= X_MAX max|c| sub < 2^(f - 1), and
    `count` of them in a word, sum_i A_i 2^(i f), below 2^53 (exact in float64): three where they
    fit, else two (q8_0: 2^19 per dot)."""
    bound = quant_gemm.X_MAX * max_code(kind_name) * quant_gemm.KINDS[kind_name].sub
    f = bound.bit_length() + 1
    count = 3 if bound * (1 + (1 << f) + (1 << 2 * f)) < 1 << 53 else 2
    if bound * (1 + (1 << f)) >= 1 << 53:
        raise AssertionError(f"{kind_name}: two sub-block dots do not fit a float64 word")
    return count, f


PACKING = {name: packing(name) for name in quant_gemm.KINDS}


class CarriedWeight:
    """A QuantParts' arrays in this form's layout: column n = i Nw + w of the weight at (i, w),
    `count` first (a broadcast, not an expand, puts the packed fields there), columns padded to
    count Nw (zero codes and weight sides: their terms are 0):

        packed       [S, sub, Nw] float64       word w: sum_i c[i Nw + w] 2^(i f)
        scale_side   [count, S, 1, Nw]          S 2^(E - top - grid_offset)
        min_side     [count, G, bpg, Nw] | None M 2^(F - top - grid_offset), a group's bpg blocks
        column_pow   [count, 1, 1, Nw] float64  2^(top + grid_offset)
        top, grid_offset                        int64, for the totals (g = top + kmax + grid_offset)

    The sides are exact (S, M < 2^19 times a power of two) and kept as float32 where that holds
    them exactly (the exponents of real files are far inside its range), else float64."""

    def __init__(self, parts):
        kind = quant_gemm.KINDS[parts.kind]
        self.count, f = PACKING[parts.kind]
        self.width = -(-parts.shape[0] // self.count)                      # Nw
        self.packed = _pack(parts.sub_blocks(), self.count, f, self.width, max_code(parts.kind))
        per = BLOCK // kind.sub
        exp = parts.scale_exp if per == 1 else mx.repeat(parts.scale_exp, per, axis=0)
        base = parts.top[None, :] + parts.grid_offset
        scale_side = parts.scale.astype(mx.float64) * grid.pow2_64(exp - base)       # [S, N]
        self.scale_side = self._columns(_narrowed(scale_side))[:, :, None, :]
        self.min_side = None
        if parts.min is not None:
            min_side = self._columns(_narrowed(parts.min.astype(mx.float64) * grid.pow2_64(parts.min_exp - base)))
            self.min_side = min_side.reshape(self.count, -1, kind.blocks_per_group, self.width)
        shift = parts.top + parts.grid_offset
        if mx.any((shift < SCALE_RANGE[0]) | (shift > SCALE_RANGE[1])).item():
            raise ValueError(f"{parts.kind} scale exponents outside {SCALE_RANGE} (no float16 scale gives them)")
        self.column_pow = self._columns(grid.pow2_64(shift)[None, :], pad=1.0)[:, :, None, :]
        self.top, self.grid_offset = parts.top, mx.array(parts.grid_offset, dtype=mx.int64)
        mx.eval(*self.arrays)

    def _columns(self, a: mx.array, pad: float = 0.0) -> mx.array:
        """[R, N] -> [count, R, Nw] (contiguous), columns padded with `pad`."""
        dtype, a = a.dtype, np.array(a)
        a = np.pad(a, ((0, 0), (0, self.count * self.width - a.shape[-1])), constant_values=pad)
        return mx.array(np.ascontiguousarray(a.reshape(a.shape[0], self.count, self.width).transpose(1, 0, 2)), dtype=dtype)

    @property
    def arrays(self) -> tuple[mx.array, ...]:
        """rows()'s arguments after x."""
        return (self.packed, self.scale_side, self.column_pow, self.top, self.grid_offset) + (
            () if self.min_side is None else (self.min_side,))


def _pack(sub_blocks: torch.Tensor, count: int, f: int, width: int, code_max: int) -> mx.array:
    """The codes [S, sub, N] as words [S, sub, width] float64: sum_i c[..., i width + w] 2^(i f),
    exact (integers below 2^53)."""
    c = sub_blocks.double()
    if c.abs().max() > code_max:
        raise ValueError("codes outside the kind's range")
    c = torch.nn.functional.pad(c, (0, count * width - c.shape[-1]))
    words = sum(c[..., i * width:(i + 1) * width] * 2.0 ** (i * f) for i in range(count))
    return mx.array(words.contiguous().numpy(), dtype=mx.float64)


def _narrowed(a: mx.array) -> mx.array:
    """float64 a as float32 where that is exact, else a."""
    narrow = a.astype(mx.float32)
    return narrow if mx.array_equal(narrow.astype(mx.float64), a).item() else a


def activations(x: mx.array, act: int):
    """quant_gemm.quantize_activations' float32 steps over groups of `act` columns, group-major:
    xq [G, M, act] float32 integers, the groups' scales float16(d) [G, M, 1] and, for the
    32-column kinds (act == 32), the blocks' float16(d sum(xq)) [G, M, 1] (else None), bitwise
    the reference's. Group-major and with kept axes, they meet the terms' [.., G, M, Nw] by
    broadcasting: an expand, squeeze or transpose is a primitive of its own on MLX."""
    rows, kdim = x.shape
    groups = x.astype(mx.float32).reshape(rows, kdim // act, act).transpose(1, 0, 2)
    amax = mx.abs(groups).max(axis=-1, keepdims=True)
    zero = amax < 2.0 ** -120  # the reference's exponent(amax) < -120
    safe = mx.where(zero, 1.0, amax)
    d = mx.where(zero, 0.0, safe / quant_gemm.X_MAX)
    xq = mx.clip(mx.round(groups * (quant_gemm.X_MAX / safe)), -quant_gemm.X_MAX, quant_gemm.X_MAX)
    xq = mx.where(zero, 0.0, xq)                                   # a true division, as the reference's
    d16 = mx.minimum(d, quant_gemm.F16_MAX).astype(mx.float16)
    if act != BLOCK:
        return xq, d16, None
    s16 = mx.clip(d * xq.sum(axis=-1, keepdims=True), -quant_gemm.F16_MAX, quant_gemm.F16_MAX).astype(mx.float16)
    return xq, d16, s16


def exponent16(h: mx.array) -> mx.array:
    """k of float16 h = m 2^k, m its integer significand (quant_gemm.significand's k: biased
    exponent - 25, or -24 for subnormals and zeros), as int64; the sign does not enter."""
    biased = (h.view(mx.uint16).astype(mx.int64) >> 10) & 0x1F
    return mx.where(biased > 0, biased - 25, -24)


def unpack_fields(words: mx.array, count: int, f: int) -> mx.array:
    """[S, M, Nw] float64 words sum_j A_j 2^(j f) (integers, |A_j| <= 2^(f - 1) - 1) ->
    [count, S, M, Nw] with A_i at index i, by broadcasting (no concatenation):
    A_i = R_i - 2^f R_(i+1), R_i = rint(word 2^(-i f)) = sum_(j >= i) A_j 2^((j - i) f), since the
    fields below i add less than 1/2 in magnitude (sum_(j < i) |A_j| 2^((j - i) f) <= (2^(f-1) - 1)
    / (2^f - 1)); R_0 is the word itself (it may pass 2^51, where rint's magic number no longer
    rounds), R_count is 0. Every step is an exact scaling, an exact rint of a value below 2^51 or
    an integer difference below 2^53."""
    low_scale, high_scale, low_magic = _field_constants(count, f)
    r_low = (words * low_scale + low_magic) - low_magic
    r_high = grid.rint64(words * high_scale)
    return r_low - float(2 ** f) * r_high


def _field_constants(count: int, f: int) -> tuple[mx.array, ...]:
    """[count, 1, 1, 1] float64 each: 2^(-i f), 2^(-(i + 1) f), and rint's magic number but for i = 0."""
    column = (lambda values: mx.array(np.array(values, dtype=np.float64).reshape(-1, 1, 1, 1)))
    return (column([2.0 ** (-i * f) for i in range(count)]), column([2.0 ** (-(i + 1) * f) for i in range(count)]),
            column([0.0] + [grid.ROUND_MAGIC] * (count - 1)))


def rounded_parts(t: mx.array) -> tuple[mx.array, mx.array]:
    """Carried terms t (exact float64 values, |t| < 2^(62 - L) for 2^L terms per output: below
    the grid's bound) rounded half to even, as two float64 integers high + low. high: t rounded
    to a multiple of 2^SPLIT_BITS by SPLIT_MAGIC (t + M lies in [2^63, 2^64), whose spacing is
    2^SPLIT_BITS; the subtraction is exact); low = rint(t - high), where t - high (|.| <=
    2^(SPLIT_BITS - 1)) is exact. high is even, so rint(t) = high + rint(t - high), ties
    included: quant_gemm._on_grid's integer. Sums of either are exact in any order: the highs
    are multiples of 2^SPLIT_BITS whose magnitudes add up to at most 2^62 (2^L of them, each at
    most 2^(62 - L)), 51 significant bits; the lows add up to below 2^(L + SPLIT_BITS - 1)."""
    high = (t + SPLIT_MAGIC) - SPLIT_MAGIC
    return high, grid.rint64(t - high)


@functools.cache
def rows(kind_name: str, totals: bool):
    """quant_linear's rows (at most ROW_CHUNK) in this form, for rows(x, *CarriedWeight.arrays):

    1. activations: xq, float16(d) = m 2^k per group (and float16(d sum xq) = sm 2^se per block);
       kmax = max k of the row, from the largest float16(d) (k is monotone in the value).
    2. One float64 matmul of xq's sub-blocks against the packed words (every partial sum an
       integer below 2^53: exact), taken apart by unpack_fields: the sub-block dots A (< 2^19).
    3. A times the weight side S 2^(E - top - grid_offset): exact (< 2^30 significant bits). A
       K-quant group's sub-blocks share one E, so their sum (an integer count of one power of
       two, below 2^(T - 11) of it: 2^38 for q6_k's 16 sub-blocks) is exact in any order. Times
       the activation side float16(d) 2^-kmax = m 2^(k - kmax) (m < 2^11): below 2^T <= 2^49
       significant bits, exact; the value is the term on the output's grid, I 2^(E + k - g), and
       rounded_parts rounds it (quant_gemm._on_grid's integer). The minimum: a 32-column kind's
       M 2^(F - top - grid_offset) times float16(d sum xq) 2^-kmax = sm 2^(se - kmax); a
       K-quant's, the float64 matmul of the blocks' xq sums (< 2^12) against M 2^(F - top -
       grid_offset) (< 2^17 each, 8 blocks sharing F: exact), times the activation side.
    4. The high and low parts summed over the groups (exact; side by side on a new axis, so one
       kernel makes both and one reduction sums them), float64(total) = high + low (one
       addition, rounded half to even as int64 to float64 rounds), times 2^(top + grid_offset)
       and 2^kmax: exact scalings (CarriedWeight checks the first's range; kmax is in [-24, 5]),
       so float32 of it is the reference's float32(float64(total) 2^g).
    With totals, step 3's exact sums as int64 and g, [M, N] each (what the tests compare)."""
    kind, (count, f) = quant_gemm.KINDS[kind_name], PACKING[kind_name]
    per, bpg = BLOCK // kind.sub, kind.blocks_per_group

    @grid.fused
    def rows_times_weights(x, packed, scale_side, column_pow, top, grid_offset, *min_side):
        (num_rows, kdim), width, n = x.shape, packed.shape[-1], top.shape[0]
        num_groups = kdim // kind.act
        xq, d16, s16 = activations(x, kind.act)                          # [G, M, act], [G, M, 1] x2
        kmax = exponent16(d16.max(axis=0, keepdims=True))                # [1, M, 1]
        inverse_row = grid.pow2_64(-kmax)                                # 2^-kmax
        terms = unpack_fields(mx.matmul(_sub_blocks(xq, kind.sub), packed), count, f) * scale_side  # [count, S, M, Nw]
        if per * bpg > 1:  # a group's sub-blocks first (q6_k's halves, a super-block's)
            terms = terms.reshape(count, num_groups, per * bpg, num_rows, width).sum(axis=2)  # [count, G, M, Nw]
        x_side = per_group(d16.astype(mx.float64) * inverse_row)         # [G, M, 1]
        parts = rounded_parts(mx.contiguous(terms * x_side))
        if kind.has_min:
            min_parts = rounded_parts(mx.contiguous(_min_terms(xq, s16, inverse_row, x_side, min_side[0])))
            parts = [a + b for a, b in zip(parts, min_parts)]            # partial sums: exact
        high, low = mx.where(HIGH_FIRST, *parts).sum(axis=2, keepdims=True)   # [count, 1, M, Nw] each, exact
        if totals:
            total = _by_column(high.astype(mx.int64) + low.astype(mx.int64), n)
            return total, top[None, :] + kmax[0] + grid_offset
        out = (high + low) * column_pow / inverse_row                    # times 2^kmax: exact
        return _by_column(out.astype(mx.float32), n).astype(x.dtype)

    return rows_times_weights


def per_group(side: mx.array) -> mx.array:
    """A per-group factor made once: without the barrier MLX's fuser folds its steps (float16
    conversions included) into the terms' kernel, once per term."""
    return mx.contiguous(side)


def _sub_blocks(xq: mx.array, sub: int) -> mx.array:
    """xq [G, M, act] -> [S, M, sub] float64, the matmul's rows (a copy only where sub < act)."""
    num_groups, num_rows, act = xq.shape
    if sub != act:
        xq = xq.reshape(num_groups, num_rows, act // sub, sub).transpose(0, 2, 1, 3)
        xq = xq.reshape(num_groups * (act // sub), num_rows, sub)
    return xq.astype(mx.float64)


def _by_column(a: mx.array, n: int) -> mx.array:
    """[count, 1, M, Nw] -> [M, n]: column i Nw + w from (i, w), the padding dropped."""
    count, _, num_rows, width = a.shape
    out = a.transpose(1, 2, 0, 3).reshape(num_rows, count * width)
    return out if out.shape[1] == n else out[:, :n]


def _min_terms(xq, s16, inverse_row, x_side, min_side):
    """The minimum terms on the output's grid, [count, G, M, Nw] (exact: rows' step 3)."""
    count, num_groups, bpg, width = min_side.shape
    if bpg == 1:  # M 2^(F - top - grid_offset) sm 2^(se - kmax) per block
        return min_side.astype(mx.float64) * per_group(s16.astype(mx.float64) * inverse_row)
    sums = xq.reshape(num_groups, xq.shape[1], bpg, BLOCK).sum(axis=-1).astype(mx.float64)  # [G, M, bpg]
    return mx.matmul(sums, min_side.astype(mx.float64)) * x_side      # [count, G, M, Nw]
