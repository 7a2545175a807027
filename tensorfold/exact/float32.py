"""exp without libm in float32: `exp_neg`, the exp of attention's softmax and of SiLU.

x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-7 polynomial (Cephes expf), times 2^n through
the exponent bits: plain IEEE float32 steps, about 1 ulp, with the same bits in torch on any
device and in kernels/exact_triton.exp_neg (and csrc/cpu/exact.h), which take the same steps in
the same order. Constants are float32 values (`f32`), so torch and Triton see the same ones.
"""
import struct

import torch


def f32(value: float) -> float:
    """`value` rounded to the nearest float32 (so a constant means the same in torch and Triton)."""
    return struct.unpack("f", struct.pack("f", value))[0]


EXP_MIN = f32(-87.0)           # below: 0 (2^n would leave the normal range)
LOG2E = f32(1.4426950408889634)
LN2_HI = f32(0.693359375)      # 9 significant bits: n * LN2_HI is exact
LN2_LO = f32(-2.12194440e-4)
EXP_POLY = tuple(f32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                  4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of float32 x (what sqrtss, Triton's sqrt_rn and
    MLX's sqrt give). torch's own float32 sqrt is not always correctly rounded on the CPU (off by
    an ulp on about one input in a few hundred here), so: the float64 root rounded to float32,
    then moved by an ulp where x lies past the midpoint to a neighbour. The midpoints have 25
    significant bits, so their squares are exact in float64 and the comparison decides."""
    s = torch.sqrt(x.double()).float()
    up, down = torch.nextafter(s, torch.full_like(s, float("inf"))), torch.nextafter(s, torch.zeros_like(s))
    x64, s64 = x.double(), s.double()
    above, below = (s64 + up.double()) * 0.5, (s64 + down.double()) * 0.5  # exact midpoints
    return torch.where(x64 > above * above, up, torch.where(x64 < below * below, down, s))


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
