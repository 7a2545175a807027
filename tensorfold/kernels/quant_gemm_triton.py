"""The exact quantized GEMM in Triton: bitwise kernels/quant_gemm.py's `linear`, every kind.

Two launches per call, both exact integer arithmetic up to one final rounding (quant_gemm.py's
docstring, steps 1-4):

- `quantize_kernel`, one program per activation row: per block of 32, from the float32 bits of
  amax = max |x|: e = exponent(amax), sig = its 24-bit significand, m = ceil(sig / (127 2^9)) in
  int32 arithmetic, k = e - 14; xq = round_even(float64(x 2^-k) / m) (an exact product, one
  IEEE float64 division, then the 1.5 2^52 trick, ties to even) clamped to [-127, 127] as int8,
  xsum = sum xq; a block with amax < 2^-126 is zero (xq = 0, m = 0, k = -141); and the row's
  kmax. The float64 `/` is the correctly rounded division everywhere: Triton lowers a float64
  arith.divf to PTX `div.rn.f64` on NVIDIA GPUs (tl.math.div_rn takes float32 only, and a float32
  `/` would be `div.full.f32`, approximate), and the interpreter to numpy's IEEE divide.
- `quant_gemm_kernel`, one program per [BLOCK_M, BLOCK_N] output tile, the same tile whatever M
  (1 row or 512: no switch by row count, and none could change a bit). The grid exponent
  g = top[n] + kmax[r] + T - 62 + ceil(log2(#terms)) is known before the first block. Per block
  of 32 along K: the integer dot A = xq . c as an int8 tl.dot with int32 accumulation (exact:
  |A| < 2^19), once for sub = 32, and for sub = 16 (q6_k) twice, with the other half of xq
  zeroed; A m in int32 (|A| < 2^19, m < 2^9), the term I = sum_h S_h A_h m in int64, at exponent
  E + k; with a minimum also M xsum m (|xsum m| < 2^21) at exponent F + k (a zero block's m = 0
  makes its terms 0). Each term is brought onto the grid 2^g (`on_grid`: a left shift, or a
  right shift clamped at T + 1 and rounded half to even) and added to an int64 accumulator: every
  term is below 2^(62 - ceil(log2 #terms)), so the sum stays below 2^62 and is exact in any order.
  At the end y = float32(float64(total) 2^g), then x's dtype. g lies within about [-190, 130]
  for any float32 activations and float16-derived scales (E in [-24, 5], k in [-141, 114]), so
  2^g is one exact float64 built from its bits (exact_triton.pow2) and the product is exact.
  One kernel serves all kinds: SUB (32 or 16), HAS_MIN and TERM_BITS are constexprs.

The packed weight (`pack_quant_weight`, once at load) is the QuantWeight's fields made
contiguous int8/int32 on the device, plus top[n]; kinds without a minimum carry none.
Launched without FMA contraction (LAUNCH_EXACT), as every exact kernel of the project; the only
float products here are exact anyway (x 2^-k, total 2^g); the one division is IEEE.
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
ZERO_K: tl.constexpr = tl.constexpr(qg.ZERO_K)   # k of a zero block (m = 0)
M_STEP: tl.constexpr = tl.constexpr(qg.X_MAX * 512)  # m = ceil(sig / M_STEP)
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
def quantize_kernel(x_ptr, xq_ptr, m_ptr, k_ptr, xsum_ptr, kmax_ptr, K, NB, BLOCKS: tl.constexpr):
    """Step 1 for one row: xq [K] int8, m, k and xsum [K / 32] int32, kmax [1] int32."""
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, 32)
    kmax = tl.full([], -2147483647, tl.int32)
    for b0 in range(0, NB, BLOCKS):
        blocks = b0 + tl.arange(0, BLOCKS)
        ok = blocks < NB
        offs = row * K + blocks[:, None] * 32 + lane[None, :]
        x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        bits = tl.max(tl.abs(x), 1).to(tl.int32, bitcast=True)                 # amax [BLOCKS], >= 0
        e = ((bits >> 23) & 0xFF) - 127                                         # ex.exponent
        zero = e == -127                                                        # amax < 2^-126
        sig = (bits & 0x7FFFFF) | 0x800000                                      # 24-bit significand
        m = tl.where(zero, 0, (sig + (M_STEP - 1)) // M_STEP)                   # ceil, in [130, 259]
        k = tl.where(zero, ZERO_K, e - 14)
        scaled = x.to(tl.float64) * ex.pow2(-k)[:, None]                        # exact
        q = scaled / tl.where(zero, 1, m).to(tl.float64)[:, None]               # float64 `/`: div.rn.f64
        xq = tl.minimum(tl.maximum(ex.round_even(q), -X_MAX), X_MAX).to(tl.int32)
        xq = tl.where(zero[:, None], 0, xq)
        tl.store(xq_ptr + offs, xq.to(tl.int8), mask=ok[:, None])
        tl.store(m_ptr + row * NB + blocks, m, mask=ok)
        tl.store(k_ptr + row * NB + blocks, k, mask=ok)
        tl.store(xsum_ptr + row * NB + blocks, tl.sum(xq, 1), mask=ok)
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
def quant_gemm_kernel(xq_ptr, m_ptr, k_ptr, xsum_ptr, kmax_ptr, codes_ptr, scale_ptr, scale_exp_ptr, min_ptr,
                      min_exp_ptr, top_ptr, out_ptr, M, N, K, NB, G_BIAS,
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
            a = (a * mb[:, None]).to(tl.int64)                                    # A m < 2^28
            s = tl.load(scale_ptr + cols * NB + b, mask=col_ok, other=0).to(tl.int64)
            ints = a * s[None, :]
        else:  # two sub-blocks of 16, each with its own scale
            zero = tl.zeros_like(xq)
            a0 = tl.dot(tl.where(first_half[None, :], xq, zero), codes, out_dtype=tl.int32)
            a1 = tl.dot(tl.where(first_half[None, :], zero, xq), codes, out_dtype=tl.int32)
            a0 = (a0 * mb[:, None]).to(tl.int64)                                  # A m < 2^28
            a1 = (a1 * mb[:, None]).to(tl.int64)
            s0 = tl.load(scale_ptr + cols * (2 * NB) + 2 * b, mask=col_ok, other=0).to(tl.int64)
            s1 = tl.load(scale_ptr + cols * (2 * NB) + 2 * b + 1, mask=col_ok, other=0).to(tl.int64)
            ints = a0 * s0[None, :] + a1 * s1[None, :]
        total += on_grid(ints, (kb[:, None] + e[None, :]).to(tl.int64) - g, TERM_BITS)
        if HAS_MIN:
            xsum = (tl.load(xsum_ptr + rows * NB + b, mask=row_ok, other=0) * mb).to(tl.int64)  # < 2^21
            mins = tl.load(min_ptr + cols * NB + b, mask=col_ok, other=0).to(tl.int64)
            f = tl.load(min_exp_ptr + cols * NB + b, mask=col_ok, other=0)
            total += on_grid(xsum[:, None] * mins[None, :], (kb[:, None] + f[None, :]).to(tl.int64) - g, TERM_BITS)
    y = (total.to(tl.float64) * ex.pow2(g)).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def quantize_activations(x: torch.Tensor):
    """Step 1 in Triton: (xq [M, K] int8, m, k and xsum [M, K / 32] int32, kmax [M] int32)."""
    m, kdim = x.shape
    nb = kdim // BLOCK
    x = x.contiguous()
    xq = torch.empty(m, kdim, dtype=torch.int8, device=x.device)
    xm = torch.empty(m, nb, dtype=torch.int32, device=x.device)
    k = torch.empty(m, nb, dtype=torch.int32, device=x.device)
    xsum = torch.empty(m, nb, dtype=torch.int32, device=x.device)
    kmax = torch.empty(m, dtype=torch.int32, device=x.device)
    if m:
        quantize_kernel[(m,)](x, xq, xm, k, xsum, kmax, kdim, nb, BLOCKS=QUANT_BLOCKS, **ex.LAUNCH_EXACT)
    return xq, xm, k, xsum, kmax


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
    xq, xm, k, xsum, kmax = quantize_activations(x)
    terms = nb * (2 if kind.has_min else 1)
    g_bias = kind.term_bits - 62 + math.ceil(math.log2(terms))  # quant_gemm.linear's expression
    dummy = w.scale_exp  # HAS_MIN off: never read
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    quant_gemm_kernel[grid](xq, xm, k, xsum, kmax, w.codes, w.scale, w.scale_exp,
                            dummy if w.min is None else w.min, dummy if w.min_exp is None else w.min_exp,
                            w.top, out, m, n, kdim, nb, g_bias,
                            SUB=kind.sub, HAS_MIN=kind.has_min, TERM_BITS=kind.term_bits,
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, **ex.LAUNCH_EXACT)
    return out
