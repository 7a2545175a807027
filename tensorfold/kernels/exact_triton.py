"""tensorfold/exact's steps as Triton device functions: the same IEEE steps in the same order.

Kernels that use them are launched with `enable_fp_fusion=False` (LAUNCH_EXACT), so `a * b + c`
stays a rounded product and a rounded sum, as in torch, instead of becoming one FMA.
"""
import torch
import triton
import triton.language as tl

from tensorfold.exact import float32 as ref32, float64 as ref64, grid

LAUNCH_EXACT = {"enable_fp_fusion": False}


def aligned(x: torch.Tensor) -> torch.Tensor:
    """x contiguous at a 16-byte aligned address: Triton specialises kernels on pointer
    alignment, and one compiled variant for every call keeps the reduction order fixed."""
    if x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)

ROUND_MAGIC: tl.constexpr = tl.constexpr(grid.ROUND_MAGIC)
EXP_MIN: tl.constexpr = tl.constexpr(ref32.EXP_MIN)
LOG2E: tl.constexpr = tl.constexpr(ref32.LOG2E)
LN2_HI: tl.constexpr = tl.constexpr(ref32.LN2_HI)
LN2_LO: tl.constexpr = tl.constexpr(ref32.LN2_LO)
P0, P1, P2, P3, P4, P5 = (tl.constexpr(c) for c in ref32.EXP_POLY)


@triton.jit
def exponent(amax):
    """floor(log2(amax)) of non-negative float32 values as int32 (0 and subnormals: -127)."""
    return ((amax.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def pow2(e):
    """2^e as float64 for integer e in [-1022, 1023] (exact). Callers write e's expression tensor
    first (`-e + BITS`, not `BITS - e`): in the interpreter a constexpr on the left wraps the
    result in a constexpr, which has no `.to`."""
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def pow2_32(e):
    """2^e as float32 for int32 e in [-126, 127] (exact; exact.grid.pow2_32)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def scale32(x, e):
    """float32 x times 2^e (int32 e): two multiplies by powers of two, the first exact
    (exact.grid.scale32)."""
    first = tl.minimum(tl.maximum(e, -126), 127)
    return x * pow2_32(first) * pow2_32(tl.minimum(tl.maximum(e - first, -126), 127))


@triton.jit
def inverse_sqrt32(var, eps, DIVISOR: tl.constexpr):
    """1 / sqrt(var / DIVISOR + eps) in float32 steps, each correctly rounded (div.rn.f32,
    sqrt.rn.f32: Triton's plain `/` and sqrt on float32 are approximate on a GPU)."""
    var = tl.math.div_rn(var, tl.full(var.shape, DIVISOR, tl.float32))
    root = tl.math.sqrt_rn(var + eps)
    return tl.math.div_rn(tl.full(root.shape, 1.0, tl.float32), root)


@triton.jit
def round_even(x):
    """float64 x rounded to an integer, ties to even, for |x| < 2^51."""
    return (x + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def to_fixed(x, e, BITS: tl.constexpr):
    """x (float32, [rows, cols]) in fixed point against its row exponent e ([rows]), as float64."""
    return round_even(x.to(tl.float64) * pow2(-e + (BITS - 1))[:, None])  # tensor first: see pow2


@triton.jit
def exp_neg(x):
    """exact.float32.exp_neg: exp of float32 x <= 0 in the same IEEE steps."""
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


# ---- float64 exp and log without libm or libdevice (exact.float64.exp64, log64) ----
# Same steps, same order as the torch versions; kernels calling them launch with LAUNCH_EXACT.
# Float64 `/` and tl.sqrt are IEEE here and in every kernel: Triton lowers them to div.rn.f64 and
# sqrt.rn.f64 on NVIDIA GPUs (only the float32 forms are approximate; tl.math.div_rn/sqrt_rn take
# float32 only) and to numpy's correctly rounded ones in the interpreter. tests/test_compiled_kernels.py
# reads the PTX of every kernel and fails on any approximate instruction.

LN2_HI64: tl.constexpr = tl.constexpr(ref64.LN2_HI64)
LN2_LO64: tl.constexpr = tl.constexpr(ref64.LN2_LO64)
INV_LN2: tl.constexpr = tl.constexpr(ref64.INV_LN2)
EXP64_MIN: tl.constexpr = tl.constexpr(ref64.EXP64_MIN)
E1, E2, E3, E4, E5 = (tl.constexpr(c) for c in ref64.EXP64_P)
SCALE_BIAS: tl.constexpr = tl.constexpr(ref64.SCALE_BIAS)
TWO_M64: tl.constexpr = tl.constexpr(ref64.TWO_M64)
LG1, LG2, LG3, LG4, LG5, LG6, LG7 = (tl.constexpr(c) for c in ref64.LOG64_LG)
TINY64: tl.constexpr = tl.constexpr(ref64.TINY64)
TWO54: tl.constexpr = tl.constexpr(ref64.TWO54)
SQRT_HALF_SHIFT: tl.constexpr = tl.constexpr(ref64.SQRT_HALF_SHIFT)


@triton.jit
def exp64(x):
    """exact.float64.exp64: exp of float64 x <= 0 in the same IEEE steps."""
    x = tl.where(x < EXP64_MIN, EXP64_MIN, x)
    t = x * INV_LN2 + ROUND_MAGIC
    n = t - ROUND_MAGIC
    hi = x - n * LN2_HI64
    lo = n * LN2_LO64
    r = hi - lo
    rr = r * r
    c = rr * E5 + E4
    c = c * rr + E3
    c = c * rr + E2
    c = c * rr + E1
    c = r - c * rr
    y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi)  # float64 `/`: IEEE (see above)
    scale = ((t.to(tl.int64, bitcast=True) + SCALE_BIAS) << 52).to(tl.float64, bitcast=True)
    return (y * scale) * TWO_M64


@triton.jit
def log64(x):
    """exact.float64.log64: log of float64 x in the same IEEE steps (specials as there)."""
    sub = x < TINY64
    bits = (x * tl.where(sub, TWO54, 1.0)).to(tl.int64, bitcast=True)
    k = ((bits + SQRT_HALF_SHIFT) >> 52) - 1023
    f = (bits - (k << 52)).to(tl.float64, bitcast=True) - 1.0
    hfsq = (f * 0.5) * f
    s = f / (f + 2.0)  # float64 `/`: IEEE (see above)
    z = s * s
    w = z * z
    t1 = ((w * LG6 + LG4) * w + LG2) * w
    t2 = (((w * LG7 + LG5) * w + LG3) * w + LG1) * z
    dk = k.to(tl.float64) - tl.where(sub, 54.0, 0.0)  # exact (torch converts k by ROUND_MAGIC)
    out = ((((t2 + t1) + hfsq) * s + dk * LN2_LO64) - hfsq + f) + dk * LN2_HI64
    out = tl.where(x < float("inf"), out, x)
    return tl.where(x > 0.0, out, tl.where(x == 0.0, float("-inf"), float("nan")))

