"""The fixed-point grid: a vector as integers against its own largest power of two.

    x = x_int * 2^(e - bits + 1),   e = exponent(max|x|),   |x_int| <= 2^bits

(the rule it serves is in tensorfold/exact/__init__.py). Every step here is exact or one
rounding to an integer, ties to even; kernels/exact_triton.py spells the same steps in Triton.
"""
import torch

ROUND_MAGIC = 6755399441055744.0  # 1.5 * 2^52: (x + M) - M rounds |x| < 2^51 to an integer, ties to even


def exponent(amax: torch.Tensor) -> torch.Tensor:
    """floor(log2(amax)) of a non-negative float32 tensor as int32 (0 and subnormals: -127)."""
    return ((amax.float().view(torch.int32) >> 23) & 0xFF) - 127


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64 for integer e in [-1022, 1023], built from its bits (exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def pow2_32(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e in [-126, 127], built from its bits (exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def scale32(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """float32 x times 2^e for integer e: two multiplies by float32 powers of two, the first
    (2^clamp(e, -126, 127)) exact, so one rounding at most (a subnormal result; an overflow gives
    inf). The exact sums' float32 finishes scale by it (RMSNorm's mean of squares)."""
    first = e.clamp(-126, 127)
    return x * pow2_32(first) * pow2_32((e - first).clamp(-126, 127))


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


def on_grid(x: torch.Tensor, bits) -> torch.Tensor:
    """x with each vector (last dim) rounded to its fixed-point grid, in x's dtype (it fits).

    `bits` is an int or an integer tensor broadcastable to x.shape[:-1] + (1,). The grid step is
    2^(e - bits + 1), e = exponent(max|x|); (x + 1.5 * 2^52 * step) - 1.5 * 2^52 * step rounds to
    it, ties to even. Rounding can lift the largest element to the next power of two; then a
    second rounding puts the vector on the grid of its new exponent, so the result is a fixed
    point: on_grid(on_grid(x)) == on_grid(x), every element a multiple of its vector's step."""
    y = x.double()
    e = exponent(y.abs().amax(dim=-1, keepdim=True))
    for _ in range(2):
        magic = pow2(e - bits + 1) * ROUND_MAGIC
        y = (y + magic).sub_(magic)
        lifted = exponent(y.abs().amax(dim=-1, keepdim=True))
        # A second pass at an unchanged exponent changes nothing; skip it on the CPU, where the
        # check is free, and always run it on a GPU rather than wait for the check.
        if y.device.type == "cpu" and torch.equal(lifted, e):
            break
        e = lifted
    return y.to(x.dtype)
