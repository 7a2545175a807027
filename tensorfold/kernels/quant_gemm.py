"""The exact quantized GEMM's torch reference: GGUF weight blocks times int8 activation blocks,
summed so that no order is left to depend on. It defines the bits; the C++ and Triton kernels
that follow it must equal it bitwise (this module is their oracle).

Weights stay in their GGUF blocks of 32 (QuantWeight: Q8_0, Q4_0 or Q4_1 codes and float16
scales). The arithmetic, per output y[m, n] = sum_k x[m, k] w[n, k]:

1. Activations, per row and block of 32 (row-local, deterministic): e = exponent(max |x|) (the
   project's exponent: floor(log2) from the float bits, -127 for zero), xq = round_even(x 2^(6-e))
   clamped to [-127, 127] (int8: |xq| < 2^7), so x ~ xq 2^k with k = e - 6; and xsum = sum xq.
2. A weight scale d (float16) is dm 2^de with dm its integer significand (< 2^11) (zero: dm = 0).
3. Per block b, an integer dot A = sum_i c_i xq_i of the block's codes (Q8_0: q; Q4_0: q - 8;
   Q4_1: q) -- |A| < 2^19 -- and the block's terms, each an integer I times a power of two:
   dm A 2^(de + k), and for Q4_1 also mm xsum 2^(me + k). Every |I| < 2^31.
4. The terms of one output are summed on one integer grid 2^g: mu = max over its terms of
   (exponent + 31), an upper bound of every |term|, and g = mu - 62 + ceil(log2(#terms)), so the
   whole sum stays below 2^62. A term is I shifted to that grid, rounded half to even where the
   shift drops bits (it keeps at least 2^-52 of the largest possible term: far past float32).
   The int64 sum is exact in any order.
5. y = float32(float64(total) 2^g), then the output dtype: two roundings, the same everywhere.

So a row's result does not depend on the other rows, the tiling, split-K, threads or device:
every step is integer arithmetic or a fixed rounding of one value.
"""
import math
from dataclasses import dataclass

import torch

from tensorfold.kernels.exact import exponent, pow2

BLOCK = 32
X_BITS = 7            # |xq| < 2^X_BITS
TERM_BITS = 31        # |I| < 2^TERM_BITS for every block term
TYPES = ("q8_0", "q4_0", "q4_1")


@dataclass
class QuantWeight:
    """A [N, K] matrix kept in GGUF blocks of 32: codes [N, K] (int8 for q8_0, uint8 0..15 for
    q4_0/q4_1, unpacked here; kernels pack them), scales d [N, K / 32] float16, and for q4_1 the
    minimums m [N, K / 32] float16."""
    kind: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights the blocks stand for (what --dtype float32 serves)."""
        n, k = self.shape
        d = self.d.float().repeat_interleave(BLOCK, dim=1)
        codes = self.codes.float() - (8.0 if self.kind == "q4_0" else 0.0)
        w = codes * d
        if self.kind == "q4_1":
            w = w + self.m.float().repeat_interleave(BLOCK, dim=1)
        return w


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> (xq [M, K] int8, k [M, K / 32] int32): x ~ xq 2^k."""
    m, kdim = x.shape
    blocks = x.float().reshape(m, kdim // BLOCK, BLOCK)
    e = exponent(blocks.abs().amax(dim=-1))                                   # [M, B]
    scaled = blocks.double() * pow2(X_BITS - 1 - e).unsqueeze(-1)
    xq = torch.round(scaled).clamp_(-(2 ** X_BITS - 1), 2 ** X_BITS - 1)     # round half to even
    return xq.to(torch.int8).reshape(m, kdim), (e - (X_BITS - 1)).to(torch.int32)


def significand(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 h -> (dm, de) int64 with h == dm 2^de exactly, |dm| < 2^11 (zero: dm = 0)."""
    bits = h.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    sign = torch.where(bits >> 15 == 1, -1, 1)
    exp = (bits >> 10) & 0x1F
    frac = bits & 0x3FF
    normal = exp > 0
    dm = torch.where(normal, frac | 0x400, frac) * sign
    de = torch.where(normal, exp - 25, torch.full_like(exp, -24))  # 2^(exp-15) * 2^-10; subnormal 2^-24
    return dm, de


def linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ w^T -> [M, N] in x's dtype, by the steps of the module docstring."""
    if w.kind not in TYPES:
        raise ValueError(f"unknown quantized type {w.kind!r}")
    n, kdim = w.shape
    if x.dim() != 2 or x.shape[1] != kdim or kdim % BLOCK:
        raise ValueError(f"x {tuple(x.shape)} against weights {w.shape} (K a multiple of {BLOCK})")
    m, nb = x.shape[0], kdim // BLOCK
    xq, k = quantize_activations(x)
    xb = xq.double().reshape(m, nb, BLOCK)
    codes = w.codes.double() - (8.0 if w.kind == "q4_0" else 0.0)
    a = torch.einsum("mbi,nbi->mnb", xb, codes.reshape(n, nb, BLOCK)).to(torch.int64)  # exact: < 2^19
    dm, de = significand(w.d)                                                           # [N, B]
    ints = [dm.unsqueeze(0) * a]                                                        # [M, N, B]
    exps = [de.unsqueeze(0) + k.to(torch.int64).unsqueeze(1)]
    if w.kind == "q4_1":
        mm, me = significand(w.m)
        xsum = xb.sum(dim=-1).to(torch.int64)                                          # [M, B]
        ints.append(mm.unsqueeze(0) * xsum.unsqueeze(1))
        exps.append(me.unsqueeze(0) + k.to(torch.int64).unsqueeze(1))
    ints, exps = torch.cat(ints, dim=-1), torch.cat(exps, dim=-1)                       # [M, N, T]
    terms = ints.shape[-1]
    g = exps.amax(dim=-1, keepdim=True) + TERM_BITS - 62 + math.ceil(math.log2(terms))
    total = _on_grid(ints, exps - g).sum(dim=-1)                                        # exact int64
    y = (total.double() * pow2(g.squeeze(-1))).float()
    return y.to(x.dtype)


def _on_grid(ints: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """ints 2^shift as integers: a left shift, or a right shift rounded half to even."""
    up = shift.clamp(min=0)
    down = (-shift).clamp(min=0, max=TERM_BITS + 1)  # past 2^32 every |int| < 2^31 rounds to 0
    floor = ints >> down
    rem = ints - (floor << down)
    half = torch.where(down > 0, torch.ones_like(down) << (down - 1).clamp(min=0), torch.zeros_like(down))
    round_up = (down > 0) & ((rem > half) | ((rem == half) & (floor & 1 == 1)))
    return torch.where(shift >= 0, ints << up, floor + round_up.to(torch.int64))
