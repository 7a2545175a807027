"""The exact quantized GEMM in Triton: bitwise kernels/quant_gemm.py's `linear`, every kind.

Two launches per call, both exact integer arithmetic up to one final rounding (quant_gemm.py's
docstring, steps 1-4):

- `quantize_kernel`, one program per activation row: per block of 32, as llama.cpp's Q8_0/Q8_1
  blocks, in float32 IEEE operations: amax = max |x|; d = amax / 127 and inverse = 127 / amax,
  both with tl.math.div_rn (a correctly rounded division: a plain float32 `/` compiles to
  `div.full.f32`, approximate; the interpreter's div_rn is numpy's IEEE float32 divide);
  xq = round_even(x inverse) (one float32 product, then the float64 1.5 2^52 trick, ties to even)
  clamped to [-127, 127] as int8; the scale float16(min(d, 65504)) and the minimum's
  float16(clamp(d sum xq, +-65504)) (float32 -> float16 casts round to nearest even, "rtne", on
  the GPU and in the interpreter) as their 11-bit significands and exponents (m, k) and (sm, se)
  (quant_gemm.significand: zero -> (0, -24)); a block with amax < 2^-120 is zero (xq = 0, d = 0);
  and the row's kmax. (Where 127 / amax overflows, amax < ~2^-121, x inverse is +-inf -> +-127,
  and 0 inf, NaN, is taken as 0: the block's d is far below float16's least step, so m = sm = 0
  and its codes never count. The torch reference has no value for such a NaN.)
- `quant_gemm_kernel`, one program per [BLOCK_M, BLOCK_N] output tile, the same tile whatever M
  (1 row or 512: no switch by row count, and none could change a bit). The grid exponent
  g = top[n] + kmax[r] + T - 62 + ceil(log2(#terms)) is known before the first block. Per block
  of 32 along K: the integer dot A = xq . c as an int8 tl.dot with int32 accumulation (exact:
  |A| < 2^19), once for sub = 32, and for sub = 16 (q6_k) twice, with the other half of xq
  zeroed; A m in int32 (|A| < 2^19, m < 2^11), the term I = sum_h S_h A_h m in int64, at
  exponent E + k; with a minimum also M sm (|M| < 2^17, |sm| < 2^11) at exponent F + se (a zero
  block's m = sm = 0 makes its terms 0). Each term is brought onto the grid 2^g (`on_grid`: a
  left shift, or a right shift clamped at T + 1 and rounded half to even) and added to an int64
  accumulator: every term is below 2^(62 - ceil(log2 #terms)), so the sum stays below 2^62 and
  is exact in any order. At the end y = float32(float64(total) 2^g), then x's dtype. g lies
  within about [-80, 30] (E, F, k, se all float16 exponents in [-24, 5]), so 2^g is one exact
  float64 built from its bits (exact_triton.pow2) and the product is exact.
  One kernel serves all kinds: SUB (32 or 16), HAS_MIN and TERM_BITS are constexprs.

The packed weight (`pack_quant_weight`, once at load) is the QuantWeight's fields made
contiguous int8/int32 on the device, plus top[n]; kinds without a minimum carry none.
Launched without FMA contraction (LAUNCH_EXACT), as every exact kernel of the project: x inverse
and d sum xq stay single rounded float32 products; the divisions are IEEE (div_rn).
"""
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tensorfold.kernels import exact_triton as ex
from tensorfold.kernels import quant_gemm as qg

BLOCK = qg.BLOCK          # 32 weights per exponent E (and per minimum)
X_MAX: tl.constexpr = tl.constexpr(qg.X_MAX)     # |xq| <= 127
F16_MAX: tl.constexpr = tl.constexpr(qg.F16_MAX)  # float16 scales saturate here
BLOCK_M = 16              # tl.dot's smallest tile; the GEMM's tile for every M
BLOCK_N = 64
QUANT_BLOCKS = 8          # activation blocks of 32 per step of quantize_kernel


@dataclass
class PackedQuantWeight:
    """A QuantWeight laid out for quant_gemm_kernel: codes [N, K] int8, scale [N, K / sub] int32,
    scale_exp [N, K / 32] int32, min and min_exp [N, K / 32] int32 (None without a minimum) and
    top [N] int32, the largest exponent (E or F) of each row."""
    kind: str
    codes: torch.Tensor
    scale: torch.Tensor
    scale_exp: torch.Tensor
    min: torch.Tensor | None
    min_exp: torch.Tensor | None
    top: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)


def pack_quant_weight(w: qg.QuantWeight) -> PackedQuantWeight:
    """The kernel's layout of w (on w's device), checked against its kind."""
    if w.kind not in qg.KINDS:
        raise ValueError(f"unknown quantized type {w.kind!r}")
    kind = qg.KINDS[w.kind]
    n, kdim = w.shape
    if kdim % BLOCK:
        raise ValueError(f"K = {kdim} is not a multiple of {BLOCK}")
    if tuple(w.scale.shape) != (n, kdim // kind.sub) or tuple(w.scale_exp.shape) != (n, kdim // BLOCK):
        raise ValueError(f"{w.kind} scales {tuple(w.scale.shape)}, {tuple(w.scale_exp.shape)} for weights {(n, kdim)}")
    if kind.has_min != (w.min is not None and w.min_exp is not None):
        raise ValueError(f"{w.kind} {'needs' if kind.has_min else 'has no'} minimum")
    i32 = (lambda t: None if t is None else t.to(torch.int32).contiguous())
    return PackedQuantWeight(w.kind, w.codes.to(torch.int8).contiguous(), i32(w.scale), i32(w.scale_exp),
                             i32(w.min) if kind.has_min else None, i32(w.min_exp) if kind.has_min else None,
                             i32(w.top()))


@triton.jit
def significand16(h):
    """quant_gemm.significand of float16 h (finite): (dm, de) int32, h == dm 2^de, |dm| < 2^11,
    zero -> (0, -24)."""
    bits = h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    exp = (bits >> 10) & 0x1F
    frac = bits & 0x3FF
    normal = exp > 0
    dm = tl.where(normal, frac | 0x400, frac)
    dm = tl.where((bits >> 15) == 1, -dm, dm)
    de = tl.where(normal, exp - 25, -24)
    return dm, de


@triton.jit
def quantize_kernel(x_ptr, xq_ptr, m_ptr, k_ptr, sm_ptr, se_ptr, kmax_ptr, K, NB, BLOCKS: tl.constexpr):
    """Step 1 for one row: xq [K] int8, (m, k) and (sm, se) [K / 32] int32, kmax [1] int32."""
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, 32)
    kmax = tl.full([], -2147483647, tl.int32)
    x_max = tl.full([BLOCKS], X_MAX, tl.float32)
    for b0 in range(0, NB, BLOCKS):
        blocks = b0 + tl.arange(0, BLOCKS)
        ok = blocks < NB
        offs = row * K + blocks[:, None] * 32 + lane[None, :]
        x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 1)                                             # [BLOCKS] float32
        zero = ex.exponent(amax) < -120                                         # amax < 2^-120
        safe = tl.where(zero, 1.0, amax)
        # correctly rounded float32 divisions (div.rn.f32), as the reference's and llama.cpp's `/`;
        # a plain `/` would compile to the approximate div.full.f32
        d = tl.where(zero, 0.0, tl.math.div_rn(safe, x_max))
        inverse = tl.math.div_rn(x_max, safe)
        p = x * inverse[:, None]                                                # float32 product
        p = tl.where(p == p, p, 0.0)                     # 0 inf (127 / amax overflowed): 0, see above
        xq = tl.minimum(tl.maximum(ex.round_even(p.to(tl.float64)), -X_MAX), X_MAX).to(tl.int32)
        xq = tl.where(zero[:, None], 0, xq)
        tl.store(xq_ptr + offs, xq.to(tl.int8), mask=ok[:, None])
        m, k = significand16(tl.minimum(d, F16_MAX).to(tl.float16, fp_downcast_rounding="rtne"))
        s = d * tl.sum(xq, 1).to(tl.float32)                                    # float32
        s = tl.minimum(tl.maximum(s, -F16_MAX), F16_MAX)
        sm, se = significand16(s.to(tl.float16, fp_downcast_rounding="rtne"))
        tl.store(m_ptr + row * NB + blocks, m, mask=ok)
        tl.store(k_ptr + row * NB + blocks, k, mask=ok)
        tl.store(sm_ptr + row * NB + blocks, sm, mask=ok)
        tl.store(se_ptr + row * NB + blocks, se, mask=ok)
        kmax = tl.maximum(kmax, tl.max(tl.where(ok, k, -2147483647), 0))
    tl.store(kmax_ptr + row, kmax)


@triton.jit
def on_grid(ints, shift, TERM_BITS: tl.constexpr):
    """quant_gemm._on_grid: int64 ints times 2^shift as integers, a left shift or a right shift
    (clamped at TERM_BITS + 1) rounded half to even."""
    up = tl.maximum(shift, 0)
    down = tl.minimum(tl.maximum(-shift, 0), TERM_BITS + 1)
    floor = ints >> down
    rem = ints - (floor << down)
    half = tl.where(down > 0, tl.full(down.shape, 1, tl.int64) << tl.maximum(down - 1, 0), 0)
    round_up = (down > 0) & ((rem > half) | ((rem == half) & ((floor & 1) == 1)))
    return tl.where(shift >= 0, ints << up, floor + round_up.to(tl.int64))


@triton.jit
def quant_gemm_kernel(xq_ptr, m_ptr, k_ptr, sm_ptr, se_ptr, kmax_ptr, codes_ptr, scale_ptr, scale_exp_ptr,
                      min_ptr, min_exp_ptr, top_ptr, out_ptr, M, N, K, NB, G_BIAS,
                      SUB: tl.constexpr, HAS_MIN: tl.constexpr, TERM_BITS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Steps 2-4 for one [BLOCK_M, BLOCK_N] tile of y; G_BIAS = T - 62 + ceil(log2 #terms)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    lane = tl.arange(0, 32)
    kmax = tl.load(kmax_ptr + rows, mask=row_ok, other=0)
    top = tl.load(top_ptr + cols, mask=col_ok, other=0)
    g = (kmax[:, None] + top[None, :] + G_BIAS).to(tl.int64)                  # [BLOCK_M, BLOCK_N]
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.int64)
    first_half = lane < 16
    for b in range(0, NB):
        xq = tl.load(xq_ptr + rows[:, None] * K + b * 32 + lane[None, :], mask=row_ok[:, None], other=0)
        codes = tl.load(codes_ptr + cols[None, :] * K + b * 32 + lane[:, None], mask=col_ok[None, :], other=0)
        kb = tl.load(k_ptr + rows * NB + b, mask=row_ok, other=0)
        mb = tl.load(m_ptr + rows * NB + b, mask=row_ok, other=0)                # 0 on a zero block
        e = tl.load(scale_exp_ptr + cols * NB + b, mask=col_ok, other=0)
        if SUB == 32:
            a = tl.dot(xq, codes, out_dtype=tl.int32)                             # exact: |A| < 2^19
            a = (a * mb[:, None]).to(tl.int64)                                    # A m < 2^30
            s = tl.load(scale_ptr + cols * NB + b, mask=col_ok, other=0).to(tl.int64)
            ints = a * s[None, :]
        else:  # two sub-blocks of 16, each with its own scale
            zero = tl.zeros_like(xq)
            a0 = tl.dot(tl.where(first_half[None, :], xq, zero), codes, out_dtype=tl.int32)
            a1 = tl.dot(tl.where(first_half[None, :], zero, xq), codes, out_dtype=tl.int32)
            a0 = (a0 * mb[:, None]).to(tl.int64)                                  # A m < 2^30
            a1 = (a1 * mb[:, None]).to(tl.int64)
            s0 = tl.load(scale_ptr + cols * (2 * NB) + 2 * b, mask=col_ok, other=0).to(tl.int64)
            s1 = tl.load(scale_ptr + cols * (2 * NB) + 2 * b + 1, mask=col_ok, other=0).to(tl.int64)
            ints = a0 * s0[None, :] + a1 * s1[None, :]
        total += on_grid(ints, (kb[:, None] + e[None, :]).to(tl.int64) - g, TERM_BITS)
        if HAS_MIN:
            smb = tl.load(sm_ptr + rows * NB + b, mask=row_ok, other=0).to(tl.int64)   # |sm| < 2^11
            seb = tl.load(se_ptr + rows * NB + b, mask=row_ok, other=0)
            mins = tl.load(min_ptr + cols * NB + b, mask=col_ok, other=0).to(tl.int64)
            f = tl.load(min_exp_ptr + cols * NB + b, mask=col_ok, other=0)
            total += on_grid(smb[:, None] * mins[None, :], (seb[:, None] + f[None, :]).to(tl.int64) - g, TERM_BITS)
    y = (total.to(tl.float64) * ex.pow2(g)).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def quantize_activations(x: torch.Tensor):
    """Step 1 in Triton: (xq [M, K] int8, m, k, sm and se [M, K / 32] int32, kmax [M] int32)."""
    m, kdim = x.shape
    nb = kdim // BLOCK
    x = x.contiguous()
    xq = torch.empty(m, kdim, dtype=torch.int8, device=x.device)
    xm, k, sm, se = (torch.empty(m, nb, dtype=torch.int32, device=x.device) for _ in range(4))
    kmax = torch.empty(m, dtype=torch.int32, device=x.device)
    if m:
        quantize_kernel[(m,)](x, xq, xm, k, sm, se, kmax, kdim, nb, BLOCKS=QUANT_BLOCKS, **ex.LAUNCH_EXACT)
    return xq, xm, k, sm, se, kmax


def quant_linear(x: torch.Tensor, w: PackedQuantWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) @ w^T -> [M, N] in x's dtype, bitwise quant_gemm.linear."""
    kind = qg.KINDS[w.kind]
    n, kdim = w.shape
    if x.dim() != 2 or x.shape[1] != kdim or kdim % BLOCK:
        raise ValueError(f"x {tuple(x.shape)} against weights {w.shape} (K a multiple of {BLOCK})")
    m, nb = x.shape[0], kdim // BLOCK
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    xq, xm, k, sm, se, kmax = quantize_activations(x)
    terms = nb * (2 if kind.has_min else 1)
    g_bias = kind.term_bits - 62 + math.ceil(math.log2(terms))  # quant_gemm.linear's expression
    dummy = w.scale_exp  # HAS_MIN off: never read
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    quant_gemm_kernel[grid](xq, xm, k, sm, se, kmax, w.codes, w.scale, w.scale_exp,
                            dummy if w.min is None else w.min, dummy if w.min_exp is None else w.min_exp,
                            w.top, out, m, n, kdim, nb, g_bias,
                            SUB=kind.sub, HAS_MIN=kind.has_min, TERM_BITS=kind.term_bits,
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, **ex.LAUNCH_EXACT)
    return out
