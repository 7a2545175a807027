"""The fixed-point grid in MLX, without float64: integers for every sum, float32 bits for the rest.

The torch references (tensorfold/exact) hold grid integers in float64; here they are int64 and a
float32 value is taken apart into its integer significand and exponent. Every function below is
exact or rounds once, ties to even, and each says whether it gives the torch reference's bits:

    exponent(a)            floor(log2 |a|) from float32 bits             = exact.grid.exponent
    significand(x)         x = m 2^ex, m an integer (|m| < 2^24)         exact
    shift_round(i, down)   i / 2^down rounded half to even (int64)       exact.grid.round_even's rule
    to_fixed(x, bits)      x on its vector's grid as int64               = exact.grid.to_fixed
    on_grid(x, bits)       x rounded to its grid, as float32             = exact.grid.on_grid
    scale(x, e)            float32 x 2^e, one rounding at most           (float32 multiplies)
    int_matmul(a, b)       exact int64 a @ b of grid integers            exact (any order)
    float32_of_int(t, g)   float32(float64(t) 2^g), two roundings        = the quantized GEMM's step 4
    exp_neg(x)             float32 exp of x <= 0                          = exact.float32.exp_neg

int_matmul is the one place a matmul runs: its operands are split into signed 8-bit limbs, and
each limb product summed over at most 1,024 terms stays below 2^24, so a float32 matmul returns
it exactly whatever kernel, tiling or row count MLX picks; the limbs' partial sums are added as
int64. No float64 in these, so the same code runs on Metal.

On MLX's CPU device, where float64 exists, the hot exact steps carry their integers in float64
instead (`float64_carrier`): MLX builds its compiled CPU kernels without -march, so every int64
multiply, variable shift and select is a scalar instruction, where a float64 multiply of
integers below 2^53 by powers of two is exact and vectorizes. Each such step says why no
operation rounds but the one the reference rounds at (rint: half to even, on_grid's rule), and
tests/test_mlx_backend.py runs it against both the integer form and the torch reference. The
C++ kernels carry the quantized GEMM's terms the same way (docs/kernels.md).

    float64_carrier()      whether the default device has float64 (MLX's CPU device)
    pow2_64(e)             2^e as float64 from its bits, e int in [-1022, 1023]
    rint64(x)              float64 |x| < 2^51 to an integer, ties to even

The integer-only steps (significand, shift_round, shift, float32_of_int) run fused: mx.compile,
shapeless, so one kernel per step whatever the shapes (on the CPU device MLX builds it once with
the host compiler and keeps it on disk). They hold no float arithmetic (only conversions and bit
views), so fusing cannot contract or reorder anything a bit depends on. Whole ops that mix float32
steps in (attention, the norm, the quantized GEMM) are `fused`: compiled per shape where
`fusion_exact` proves on the device that compiled float kernels keep op-by-op bits, else run op
by op.
"""
import functools
import math

import mlx.core as mx
import numpy as np

from tensorfold.exact.float32 import EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2E

LIMB = 8                 # bits per limb of int_matmul
LIMB_TERMS = 1 << 10     # terms per exact float32 limb sum: 2^7 * 2^7 * 2^10 = 2^24
PRODUCT_ELEMENTS = 1 << 18  # int_matmul's int64-product form up to this many products (2 MiB)

integer_only = functools.partial(mx.compile, shapeless=True)


class fused:
    """fn compiled by mx.compile for each set of input shapes it meets (its elementwise chains
    become one kernel, its Python overhead goes), or fn itself where `fusion_exact` finds that
    this device's compiled float kernels do not give op-by-op bits. MLX's compiled CPU kernels
    write each op as its own statement, built without FMA flags: fusing neither contracts nor
    reorders, and the check proves it on the device at hand. Arguments are arrays only. At
    most MAX_SHAPES traces are kept; past that the cache starts over (a long-running server
    meets many key counts)."""

    MAX_SHAPES = 256

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn, self.compiled, self.shapes = fn, {}, set()

    def __call__(self, *args):
        if not fusion_exact():
            return self.fn(*args)
        carrier = float64_carrier()  # a trace holds one form: one compiled function per form
        key = (carrier, tuple((a.shape, a.dtype) for a in args))
        if key not in self.shapes and len(self.shapes) >= self.MAX_SHAPES:
            self.compiled, self.shapes = {}, set()
        if carrier not in self.compiled:
            self.compiled[carrier] = mx.compile(lambda *a: self.fn(*a))  # its own function: its own traces
        self.shapes.add(key)
        return self.compiled[carrier](*args)


_FUSION_EXACT: dict[str, bool] = {}


def fusion_exact() -> bool:
    """Whether compiled float32 kernels on the default device give the op-by-op bits: a * b + c
    (contraction into an FMA would move about half of them), exp_neg's polynomial and a
    division (fast math's reciprocal would move some), on 65,536 random values each."""
    device = str(mx.default_device())
    if device not in _FUSION_EXACT:
        key = mx.random.key(5)
        a, b, c = (mx.random.normal((1 << 16,), key=k) * 100 for k in mx.random.split(key, 3))
        cases = [(lambda a, b, c: a * b + c, (a, b, c)), (lambda a, b, c: a / b, (a, b, c)),
                 (lambda a, b, c: exp_neg(-mx.abs(a)) * b - c, (a, b, c))]
        _FUSION_EXACT[device] = all(mx.array_equal(mx.compile(fn)(*args), fn(*args)).item() for fn, args in cases)
    return _FUSION_EXACT[device]


def on_cpu() -> bool:
    """Whether MLX's default device is its CPU device (else Metal's GPU)."""
    return mx.default_device().type == mx.DeviceType.cpu


def float64_carrier() -> bool:
    """Whether exact integers may ride in float64 on the default device: MLX's CPU device has
    float64 (and builds int64 ops as scalar loops); Metal has none."""
    return on_cpu()


def pow2_64(e: mx.array) -> mx.array:
    """2^e as float64 for int e in [-1022, 1023], from its bits (exact)."""
    return ((e.astype(mx.int64) + 1023) << 52).view(mx.float64)


ROUND_MAGIC = 1.5 * 2.0 ** 52  # exact/grid.py's: (x + M) - M rounds float64 |x| < 2^51 to an integer, ties to even


def rint64(x: mx.array) -> mx.array:
    """float64 x rounded to an integer, ties to even, for |x| < 2^51 (exact.grid.round_even's two
    adds; MLX's round is a libm call per element in its CPU kernels)."""
    return (x + ROUND_MAGIC) - ROUND_MAGIC


def exponent(a: mx.array) -> mx.array:
    """floor(log2(a)) of non-negative float32 a as int32 (0 and subnormals: -127)."""
    return ((a.astype(mx.float32).view(mx.int32) >> 23) & 0xFF) - 127


def significand(x: mx.array) -> tuple[mx.array, mx.array]:
    """float32 x (finite) as (m, ex) int64 with x == m 2^ex exactly, |m| < 2^24."""
    return _significand_of_bits(x.astype(mx.float32).view(mx.int32))


@integer_only
def _significand_of_bits(bits: mx.array) -> tuple[mx.array, mx.array]:
    bits = bits.astype(mx.int64)
    biased = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    m = mx.where(biased > 0, frac | 0x800000, frac)
    m = mx.where(bits < 0, -m, m)
    return m, mx.where(biased > 0, biased - 150, -149)


@integer_only
def shift_round(ints: mx.array, down: mx.array) -> mx.array:
    """int64 ints / 2^down, rounded half to even, for down >= 0 (a shift of 62 or more gives 0
    for every |ints| < 2^61)."""
    down = mx.minimum(down.astype(mx.int64), 62)
    floor = ints >> down
    rem = ints - (floor << down)
    half = mx.where(down > 0, mx.array(1, mx.int64) << mx.maximum(down - 1, 0), 0)
    up = (down > 0) & ((rem > half) | ((rem == half) & ((floor & 1) == 1)))
    return floor + up.astype(mx.int64)


@integer_only
def shift(ints: mx.array, by: mx.array) -> mx.array:
    """ints 2^by for an int64 `by` of either sign: a left shift, or shift_round."""
    return mx.where(by >= 0, ints << mx.maximum(by, 0), shift_round(ints, mx.maximum(-by, 0)))


def to_fixed(x: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """Each vector along the last dim as int64 integers and its exponent e (int32, one less dim):
    round_even(x 2^(bits - 1 - e)), e = exponent(max |x|): the torch reference's integers."""
    x = x.astype(mx.float32)
    e = exponent(mx.abs(x).max(axis=-1))
    m, ex = significand(x)
    return shift(m, ex + (bits - 1) - e[..., None].astype(mx.int64)), e


def vector_exponent(x: mx.array) -> mx.array:
    """exponent(max |x|) along the last dim (int32): the largest of the elements' biased
    exponents, read from their bits."""
    return exponent(mx.abs(x.astype(mx.float32)).max(axis=-1))


def fixed_of_stored(x: mx.array, e: mx.array, bits: int) -> mx.array:
    """to_fixed(x, bits)'s integers for vectors x already on their grid, given e =
    vector_exponent(x) (int, one less dim): x 2^(bits - 1 - e), an exact scaling of an integer
    value."""
    shift = bits - 1 - e[..., None].astype(mx.int32)
    return scale(x.astype(mx.float32), shift).astype(mx.int64)


def scale(x: mx.array, e: mx.array) -> mx.array:
    """float32 x 2^e for int e: two float32 multiplies by powers of two, the first exact, so at
    most one rounding (where the result is subnormal)."""
    e = e.astype(mx.int32)
    first = mx.clip(e, -126, 127)
    return x * _pow2(first) * _pow2(mx.clip(e - first, -126, 127))


def _pow2(e: mx.array) -> mx.array:
    """2^e as float32 for int e in [-126, 127], from its bits."""
    return ((e.astype(mx.int32) + 127) << 23).view(mx.float32)


def on_grid(x: mx.array, bits: int) -> mx.array:
    """x with each vector (last dim) rounded to its grid, as float32: the torch reference's
    values (exact.grid.on_grid), including its second pass where rounding lifts the largest
    element to the next power of two."""
    if float64_carrier():
        return _on_grid_carried(x, bits)[0]
    ints, e = to_fixed(x, bits)
    e = e[..., None].astype(mx.int64)
    lifted = (mx.abs(ints).max(axis=-1, keepdims=True) >= (1 << bits))
    ints = mx.where(lifted, shift_round(ints, mx.array(1, mx.int64)), ints)
    e = e + lifted.astype(mx.int64)
    return scale(ints.astype(mx.float32), e - bits + 1)


def on_grid_with_exponent(x: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """on_grid(x, bits) and vector_exponent of it (int32, one less dim). Carried in float64, the
    exponent is the rounding's own e + lifted, with no second pass over the values: the largest
    element of x lies in [2^e, 2^(e + 1)) (or below 2^-126 with e = -127) and stays there on the
    grid unless it is lifted to 2^(e + 1); its grid (spacing 2^(e - bits + 1) >= 2^-149 for
    bits <= 23) holds every value exactly in float32, so the conversion moves nothing."""
    if float64_carrier() and bits <= 23:
        y, e = _on_grid_carried(x, bits)
        return y, e[..., 0].astype(mx.int32)
    y = on_grid(x, bits)
    return y, vector_exponent(y)


def _on_grid_carried(x: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """on_grid's integers in float64: x 2^(bits - 1 - e) is exact, rint rounds it; the values and
    their grid's top exponent e + lifted (int64, keepdims)."""
    x = x.astype(mx.float32)
    e = exponent(mx.abs(x).max(axis=-1, keepdims=True)).astype(mx.int64)
    ints = rint64(x.astype(mx.float64) * pow2_64(bits - 1 - e))   # <= 2^bits
    lifted = mx.abs(ints).max(axis=-1, keepdims=True) >= (1 << bits)
    ints = mx.where(lifted, rint64(ints * 0.5), ints)           # shift_round(ints, 1)
    top = e + lifted.astype(mx.int64)
    return (ints * pow2_64(top - bits + 1)).astype(mx.float32), top  # one rounding, as scale's


def _limb_stack(ints: mx.array, count: int, axis: int) -> mx.array:
    """int64 ints as `count` signed limbs l_i in [-128, 128), ints = sum l_i 2^(8 i), stacked as
    float32 on a new axis after `axis` (limb i at index i)."""
    out = []
    for _ in range(count):
        low = ((ints + 128) & 255) - 128
        out.append(low.astype(mx.float32))
        ints = (ints - low) >> LIMB
    return mx.stack(out, axis=axis % ints.ndim + 1)


def limb_count(bits: int) -> int:
    """Limbs that hold every |int| <= 2^bits."""
    return bits // LIMB + 1


def int_matmul(a: mx.array, b: mx.array, a_bits: int, b_bits: int) -> mx.array:
    """Exact a @ b for int64 a [..., M, K], b [..., K, N] with |a| <= 2^a_bits, |b| <= 2^b_bits
    (the caller keeps the total below 2^63). Up to PRODUCT_ELEMENTS products (a decode row's
    attention), int64 multiplies and an int64 sum: a few kernels, where a matmul of a few rows
    costs more to launch than to run. Past that, in one float32 matmul: a's limbs stacked as rows
    [M x ca], b's as columns [N x cb], K cut into chunks of LIMB_TERMS on a batch axis. Every
    entry of that matmul is a sum of at most LIMB_TERMS limb products below 2^14: below 2^24,
    so exact in whatever order MLX adds. The entries are then weighted by 2^(8 (i + j)) and
    summed as int64 (exact in any order)."""
    *batch, m, k = a.shape
    n = b.shape[-1]
    if math.prod(batch) * m * k * n <= PRODUCT_ELEMENTS:  # small (decode): int64 products, summed
        return (a[..., :, :, None] * b[..., None, :, :]).sum(axis=-2)
    ca, cb = limb_count(a_bits), limb_count(b_bits)
    chunks = -(-k // LIMB_TERMS)
    if chunks > 1:  # K as [chunks, LIMB_TERMS] on a new batch axis (zero padding adds nothing)
        pad = chunks * LIMB_TERMS - k
        if pad:
            a = mx.concatenate([a, mx.zeros((*batch, m, pad), dtype=a.dtype)], axis=-1)
            b = mx.concatenate([b, mx.zeros((*batch, pad, n), dtype=b.dtype)], axis=-2)
        a = a.reshape(*batch, m, chunks, LIMB_TERMS).swapaxes(-3, -2)          # [..., C, M, T]
        b = b.reshape(*batch, chunks, LIMB_TERMS, n)                            # [..., C, T, N]
    la = _limb_stack(a, ca, -2).reshape(*a.shape[:-2], m * ca, a.shape[-1])   # rows (m, i)
    lb = _limb_stack(b, cb, -1).reshape(*b.shape[:-1], n * cb)                # columns (n, j)
    parts = mx.matmul(la, lb).reshape(*la.shape[:-2], m, ca, n, cb).astype(mx.int64)
    weights = _limb_weights(ca, cb)
    total = (parts * weights).sum(axis=(-3, -1))
    return total.sum(axis=-3) if chunks > 1 else total


@functools.cache
def _limb_weights(ca: int, cb: int) -> mx.array:
    """2^(8 (i + j)) as int64 [ca, 1, cb]: limb i of a times limb j of b."""
    i, j = np.arange(ca)[:, None, None], np.arange(cb)[None, None, :]
    return mx.array(np.left_shift(1, LIMB * (i + j), dtype=np.int64))  # data, not a graph: any thread may use it


def float32_of_int(total: mx.array, g: mx.array) -> mx.array:
    """float32(float64(total) 2^g) for int64 |total| < 2^62 and int g, without float64: total
    rounded to 53 significant bits (half to even), then to float32's 24 (or to its subnormal
    quantum 2^-149), as the two conversions round. The quantized GEMM's step 4, bitwise."""
    return _float32_bits_of_int(total, g).view(mx.float32)


@integer_only
def _float32_bits_of_int(total: mx.array, g: mx.array) -> mx.array:
    sign = total < 0
    a = mx.abs(total)
    top = _bit_length(a)                                           # a < 2^top
    r53 = mx.maximum(top - 53, 0)
    a = shift_round(a, r53) << r53                                 # float64(total)
    top = _bit_length(a)                                           # the rounding may carry
    g = g.astype(mx.int64)
    e32 = top - 1 + g                                              # the result's exponent
    drop = mx.where(e32 < -126, -149 - g, top - 24)                # bits below float32's quantum
    m = shift(a, -drop)                                            # the significand, rounded
    e = drop + g                                                   # value = m 2^e, m <= 2^24
    # Normalise m (< 2^24, or == 2^24 after a carry) into float32 bits.
    carry = m >= (1 << 24)
    m = mx.where(carry, m >> 1, m)
    e = e + carry.astype(mx.int64)
    normal = m >= (1 << 23)
    biased = e + 23 + 127
    bits = mx.where(normal, (biased << 23) | (m & 0x7FFFFF), m)   # subnormal: e == -149
    bits = mx.where(normal & (biased >= 255), 0x7F800000, bits)   # overflow: inf
    bits = mx.where(a == 0, 0, bits) | mx.where(sign, 1 << 31, 0)
    return bits.astype(mx.uint32)


def _bit_length(a: mx.array) -> mx.array:
    """The bit length of non-negative int64 a (0 for 0), by halving shifts: integer steps only."""
    n = mx.zeros_like(a)
    for step in (32, 16, 8, 4, 2, 1):
        high = a >> step
        wide = high != 0
        a = mx.where(wide, high, a)
        n = n + mx.where(wide, step, 0)
    return n + (a != 0).astype(mx.int64)


def exp_neg(x: mx.array) -> mx.array:
    """exp(x) for float32 x <= 0: exact.float32.exp_neg's steps and constants, bitwise."""
    x = mx.maximum(x, EXP_MIN)
    n = mx.floor(x * LOG2E + 0.5)
    r = x - n * LN2_HI
    r = r - n * LN2_LO
    p = r * EXP_POLY[0]
    for c in EXP_POLY[1:]:
        p = (p + c) * r
    p = p * r + r + 1.0
    p = p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)
    return mx.where(x <= EXP_MIN, 0.0, p)
