"""exp and log without libm in float64: `exp64` and `log64`, the keyed sampler's weights and noise.

fdlibm's algorithms (e_exp.c; e_log.c in musl's branch-free form), each a fixed sequence of
correctly rounded float64 operations: +, -, *, / and integer operations on the bits. Both are
under 1 ulp from the true value, but the point is that the last bit is the same in torch on any
CPU and in Triton on any device: kernels/exact_triton.py spells the same steps in the same order
(and its kernels run without FMA), and so does csrc/cpu/exact64.h (the native op set's
`tensorfold._cpu.exp64`/`log64`, tested against these). The torch versions work in place where
they can (they run over whole vocabularies); each in-place step is the same single rounding as
its plain form, noted beside it. Constants are given by their bits, so torch and Triton see the
same values.
"""
import struct

import torch

from tensorfold.exact.grid import ROUND_MAGIC


def f64(bits: int) -> float:
    """The float64 whose IEEE-754 bit pattern is `bits`."""
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


LN2_HI64 = f64(0x3FE62E42FEE00000)   # ln 2 to 32 bits: n * LN2_HI64 is exact for |n| < 2^21
LN2_LO64 = f64(0x3DEA39EF35793C76)   # ln 2 - LN2_HI64
INV_LN2 = f64(0x3FF71547652B82FE)    # 1 / ln 2
EXP64_MIN = -746.0                   # exp(x) < 2^-1076 at and below it: the result rounds to 0
EXP64_P = tuple(f64(b) for b in (    # fdlibm's P1..P5: exp(r) = 1 + r + r c / (2 - c),
    0x3FC555555555553E, 0xBF66C16C16BEBD93, 0x3F11566AAF25DE2C,  # c = r - t (P1 + t (P2 + ...)),
    0xBEBBBD41C5D26BF1, 0x3E66376972BEA4D0))                      # t = r^2
TWO_M64 = 2.0 ** -64                 # 2^n is applied as 2^(n + 64) * 2^-64: exact for normal
                                     # results, one rounding for subnormal ones (n < -1022)
# M + n as an int64 (its bits) plus SCALE_BIAS is n + 1023 + 64, the exponent field of 2^(n + 64)
ROUND_MAGIC_BITS = struct.unpack("<q", struct.pack("<d", ROUND_MAGIC))[0]
SCALE_BIAS = 1023 + 64 - ROUND_MAGIC_BITS
LOG64_LG = tuple(f64(b) for b in (   # fdlibm's Lg1..Lg7: log(1 + f) = 2s + s^3 Lg(s^2)
    0x3FE5555555555593, 0x3FD999999997FA04, 0x3FD2492494229359, 0x3FCC71C51D8E78AF,
    0x3FC7466496CB03DE, 0x3FC39A09D078C69F, 0x3FC2F112DF3E5244))
TINY64 = 2.0 ** -1022                # the smallest normal float64; below it, x is scaled by 2^54
TWO54 = 2.0 ** 54
SQRT_HALF_SHIFT = (0x3FF00000 - 0x3FE6A09E) << 32  # moves the exponent's step to sqrt(1/2)


CHUNK64 = 1 << 16  # elements per step of exp64/log64 (scratch of a few hundred KB, still threaded)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """exp(x) of a float64 tensor x <= 0, under 1 ulp: x <= -746 (and -inf) give 0, results
    below 2^-1022 are subnormal, NaN stays NaN. (0 < x < 660 is right too; the sampler's x is
    z - max z.)

    x = n ln2 + r with n = round(x / ln2) and |r| <= ln2 / 2, ln2 = LN2_HI64 + LN2_LO64 (Cody-Waite:
    hi = x - n LN2_HI64 is exact); exp(r) by fdlibm's rational form; times 2^n through the
    exponent bits. n is rounded with ROUND_MAGIC: t = x / ln2 + M holds n in its low bits."""
    _check_f64(x)
    return _by_chunks(_exp64_step, 5, x)


def _exp64_step(y, r, t, lo, hi, c, x):
    """exp64 of one chunk x into y, through scratch r, t, lo, hi, c (the same IEEE steps as
    exact_triton.exp64, written in place: each step is the single rounding in its comment)."""
    torch.clamp_min(x, EXP64_MIN, out=r)      # x = max(x, EXP64_MIN)
    torch.mul(r, INV_LN2, out=t)
    t += ROUND_MAGIC                          # t = x INV_LN2 + M
    torch.sub(t, ROUND_MAGIC, out=lo)         # n = t - M = round(x / ln2), ties to even
    torch.mul(lo, LN2_HI64, out=hi)
    torch.sub(r, hi, out=hi)                  # hi = x - n LN2_HI64 (exact)
    lo *= LN2_LO64                            # lo = n LN2_LO64
    torch.sub(hi, lo, out=r)                  # r = hi - lo
    rr = torch.mul(r, r, out=y)               # rr = r r
    torch.mul(rr, EXP64_P[4], out=c)
    for p in EXP64_P[3::-1]:                  # c = rr (P1 + rr (P2 + rr (P3 + rr (P4 + rr P5))))
        c += p
        c *= rr
    torch.sub(r, c, out=c)                    # c = r - c
    r *= c                                    # r c
    r /= c.neg_().add_(2.0)                   # r c / (2 - c)  (-c + 2 is 2 - c, bitwise)
    torch.sub(lo, r, out=y)
    y -= hi
    y.neg_().add_(1.0)                        # y = 1 - ((lo - r c / (2 - c)) - hi)
    scale = t.view(torch.int64)               # the bits of M + n, an integer
    scale += SCALE_BIAS                       # n + 1023 + 64, in [10, 2046]
    scale <<= 52                              # the bits of 2^(n + 64)
    y *= t                                    # y 2^(n + 64)
    y *= TWO_M64                              # ... 2^-64


def log64(x: torch.Tensor) -> torch.Tensor:
    """log(x) of a float64 tensor, under 1 ulp for every positive x, subnormals included;
    log(0) = -inf, log(+inf) = +inf, negative x and NaN give NaN.

    x = 2^k m with m in [sqrt(1/2), sqrt(2)) through the exponent bits; f = m - 1,
    s = f / (2 + f), log(m) = f - f^2/2 + s (f^2/2 + R(s^2)) (fdlibm's series); plus k ln2 in
    two parts."""
    _check_f64(x)
    if x.numel():
        low, high = x.aminmax()
        if low >= TINY64 and high < float("inf"):  # the usual case: positive, normal, finite
            return _by_chunks(_log64_step, 7, x, None)
    sub = x < TINY64  # subnormals: log(x 2^54) - 54 ln2
    out = _by_chunks(_log64_step, 7, x * torch.where(sub, TWO54, 1.0).double(),
                     torch.where(sub, 54.0, 0.0).double())
    out = torch.where(x < float("inf"), out, x)                                   # +inf, NaN
    return torch.where(x > 0.0, out, torch.where(x == 0.0, float("-inf"), float("nan")))


def _log64_step(r, f, dk, hfsq, s, z, w, t1, x, k_bias):
    """log64 of one chunk x (normal, positive) into r, through scratch f, dk, hfsq, s, z, w, t1
    (the same IEEE steps as exact_triton.log64, in place); k_bias: None or 54 where x was a
    subnormal scaled by 2^54."""
    bits = x.view(torch.int64)
    k = dk.view(torch.int64)
    torch.add(bits, SQRT_HALF_SHIFT, out=k)
    k >>= 52
    k -= 1023                                 # x = 2^k m, m in [sqrt(1/2), sqrt(2))
    m = f.view(torch.int64)
    torch.bitwise_left_shift(k, 52, out=m)
    torch.sub(bits, m, out=m)                 # m's bits: x's with k taken off the exponent
    f -= 1.0                                  # f = m - 1
    k += ROUND_MAGIC_BITS                     # dk = k as a float64, exactly: the bits of M + k,
    dk -= ROUND_MAGIC                         # minus M (int -> float conversion is slow in torch)
    if k_bias is not None:
        dk -= k_bias
    torch.mul(f, 0.5, out=hfsq)
    hfsq *= f                                 # hfsq = 0.5 f f
    torch.add(f, 2.0, out=s)
    torch.div(f, s, out=s)                    # s = f / (2 + f)
    torch.mul(s, s, out=z)                    # z = s s
    torch.mul(z, z, out=w)                    # w = z z
    torch.mul(w, LOG64_LG[5], out=t1)         # t1 = w (Lg2 + w (Lg4 + w Lg6))
    t1 += LOG64_LG[3]
    t1 *= w
    t1 += LOG64_LG[1]
    t1 *= w
    torch.mul(w, LOG64_LG[6], out=r)          # t2 = z (Lg1 + w (Lg3 + w (Lg5 + w Lg7)))
    r += LOG64_LG[4]
    r *= w
    r += LOG64_LG[2]
    r *= w
    r += LOG64_LG[0]
    r *= z
    r += t1                                   # R = t2 + t1
    r += hfsq
    r *= s                                    # s (hfsq + R)
    r += torch.mul(dk, LN2_LO64, out=t1)      # + dk LN2_LO64
    r -= hfsq                                 # - hfsq
    r += f                                    # + f
    r += dk.mul_(LN2_HI64)                    # + dk LN2_HI64


def _by_chunks(step, num_scratch: int, x: torch.Tensor, *more) -> torch.Tensor:
    """`step(out, *scratch, x, *more)` over chunks of CHUNK64 elements of x (flattened; `more`:
    tensors of x's shape, or None), into a new tensor of x's shape. The steps are elementwise,
    so the chunking changes the speed (no fresh memory per operation), never a bit."""
    flat = x.reshape(-1)
    more = [t.reshape(-1) if t is not None else None for t in more]
    n = flat.numel()
    out = torch.empty_like(flat)
    scratch = torch.empty((num_scratch, min(n, CHUNK64)), dtype=torch.float64, device=x.device)
    for a in range(0, n, CHUNK64):
        b = min(n, a + CHUNK64)
        step(out[a:b], *(buf[:b - a] for buf in scratch), flat[a:b],
             *(t[a:b] if t is not None else None for t in more))
    return out.view(x.shape)


def _check_f64(x: torch.Tensor) -> None:
    if x.dtype != torch.float64:
        raise TypeError(f"expected a float64 tensor, got {x.dtype}")
