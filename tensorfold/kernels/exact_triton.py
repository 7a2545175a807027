"""exact.py's helpers as Triton device functions: the same IEEE steps in the same order.

Kernels that use them are launched with `enable_fp_fusion=False` (LAUNCH_EXACT), so `a * b + c`
stays a rounded product and a rounded sum, as in torch, instead of becoming one FMA.
"""
import triton
import triton.language as tl

from tensorfold.kernels import exact

LAUNCH_EXACT = {"enable_fp_fusion": False}

ROUND_MAGIC: tl.constexpr = tl.constexpr(exact.ROUND_MAGIC)
EXP_MIN: tl.constexpr = tl.constexpr(exact.EXP_MIN)
LOG2E: tl.constexpr = tl.constexpr(exact.LOG2E)
LN2_HI: tl.constexpr = tl.constexpr(exact.LN2_HI)
LN2_LO: tl.constexpr = tl.constexpr(exact.LN2_LO)
P0: tl.constexpr = tl.constexpr(exact.EXP_POLY[0])
P1: tl.constexpr = tl.constexpr(exact.EXP_POLY[1])
P2: tl.constexpr = tl.constexpr(exact.EXP_POLY[2])
P3: tl.constexpr = tl.constexpr(exact.EXP_POLY[3])
P4: tl.constexpr = tl.constexpr(exact.EXP_POLY[4])
P5: tl.constexpr = tl.constexpr(exact.EXP_POLY[5])


@triton.jit
def exponent(amax):
    """floor(log2(amax)) of non-negative float32 values as int32 (0 and subnormals: -127)."""
    return ((amax.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def pow2(e):
    """2^e as float64 for integer e in [-1022, 1023] (exact)."""
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def round_even(x):
    """float64 x rounded to an integer, ties to even, for |x| < 2^51."""
    return (x + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def to_fixed(x, e, BITS: tl.constexpr):
    """x (float32, [rows, cols]) in fixed point against its row exponent e ([rows]), as float64."""
    return round_even(x.to(tl.float64) * pow2(BITS - 1 - e)[:, None])


@triton.jit
def exp_neg(x):
    """exact.exp_neg: exp of float32 x <= 0 in the same IEEE steps."""
    x = tl.where(x < EXP_MIN, EXP_MIN, x)
    n = tl.floor(x * LOG2E + 0.5)
    r = x - n * LN2_HI
    r = r - n * LN2_LO
    p = P0 * r + P1
    p = p * r + P2
    p = p * r + P3
    p = p * r + P4
    p = p * r + P5
    p = ((p * r) * r + r) + 1.0
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(x <= EXP_MIN, 0.0, p * scale)
