"""Order-free arithmetic: the rule that makes a kernel and its torch reference agree bit for bit.

A float sum depends on the order of its terms, and a GPU kernel, a CPU BLAS and Triton's
interpreter all add in different orders. So every reduction in attention and RMSNorm is done on
integers instead: each vector is written in fixed point against its own largest power of two,

    x = x_int * 2^(e - bits + 1),   e = exponent of max|x|,   |x_int| <= 2^bits,

the products and sums of those integers are carried in float64 where every partial sum stays
below 2^53 (so any order, any tiling, any GEMM gives the exact integer), or in int64 across
chunks. A result is then rounded once. The remaining steps are single IEEE operations (+, -, *,
/, sqrt, floor, conversions), all correctly rounded on every device, written in the same order
on both sides; the kernels are launched with FMA contraction off. exp is not a libm call
(libm, libdevice and numpy differ in the last bit) but `exp_neg` below: a fixed polynomial in
those operations, spelled out identically in exact_triton.py.

What this costs in precision: a value is kept to `bits` significant bits relative to its
vector's largest element (22 for attention's q and k, 20 for v and for RMSNorm's sum of squares),
which is finer than bf16 and within a few fp32 ulps of the largest term.
"""
import struct

import torch

ROUND_MAGIC = 6755399441055744.0  # 1.5 * 2^52: (x + M) - M rounds |x| < 2^51 to an integer, ties to even


def f32(value: float) -> float:
    """`value` rounded to the nearest float32 (so a constant means the same in torch and Triton)."""
    return struct.unpack("f", struct.pack("f", value))[0]


# exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-7 polynomial (Cephes expf).
EXP_MIN = f32(-87.0)           # below: 0 (2^n would leave the normal range)
LOG2E = f32(1.4426950408889634)
LN2_HI = f32(0.693359375)      # 9 significant bits: n * LN2_HI is exact
LN2_LO = f32(-2.12194440e-4)
EXP_POLY = tuple(f32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                  4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))


def exponent(amax: torch.Tensor) -> torch.Tensor:
    """floor(log2(amax)) of a non-negative float32 tensor as int32 (0 and subnormals: -127)."""
    return ((amax.float().view(torch.int32) >> 23) & 0xFF) - 127


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64 for integer e in [-1022, 1023], built from its bits (exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def round_even(x: torch.Tensor) -> torch.Tensor:
    """float64 x rounded to an integer, ties to even, for |x| < 2^51."""
    out = x + ROUND_MAGIC
    return out.sub_(ROUND_MAGIC)


def to_fixed(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each vector along the last dim as integers (float64) and its exponent (int32, one less dim):
    x == x_int * 2^(e - bits + 1) up to rounding the last bit kept, |x_int| <= 2^bits."""
    x32 = x.float()
    e = exponent(x32.abs().amax(dim=-1))
    return round_even(x32.double() * pow2(bits - 1 - e).unsqueeze(-1)), e


def on_grid(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x with each vector (last dim) rounded to its fixed-point grid, in x's dtype (it fits).

    Rounding can lift the largest element to the next power of two; the second rounding puts the
    vector on the grid of its new exponent, so the result is a fixed point: on_grid(on_grid(x)) ==
    on_grid(x), and every element is a multiple of 2^(exponent(max|x|) - bits + 1)."""
    for _ in range(2):
        x_int, e = to_fixed(x, bits)
        x = (x_int * pow2(e - bits + 1).unsqueeze(-1)).to(x.dtype)
    return x


def exp_neg(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for float32 x <= 0 (-inf gives 0), about 1 ulp, in plain IEEE float32 steps."""
    x = x.clamp_min(EXP_MIN)  # NaN stays NaN
    n = (x * LOG2E).add_(0.5).floor_()
    r = x - n * LN2_HI
    r -= n * LN2_LO
    p = r * EXP_POLY[0]
    for c in EXP_POLY[1:]:  # in place: this runs over every score of a prefill
        p += c
        p *= r
    p *= r
    p += r
    p += 1.0
    p *= ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2^n
    return p.masked_fill_(x <= EXP_MIN, 0.0)
