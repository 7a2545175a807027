"""The exact quantized GEMM in Triton: bitwise kernels/quant_gemm.py's `linear`, every kind.

Two launches per call, both exact integer arithmetic up to one final rounding (quant_gemm.py's
docstring, steps 1-4), and one exact torch max between them. A kind's activation group ACT
(quant_gemm.Kind.act) is 32 columns for q8_0, q4_0, q4_1 and q5_1, and a super-block of 256 for
the K-quants q4_k, q5_k and q6_k.

- `quantize_kernel`: x [M, K] contiguous is M K / ACT groups back to back, so a program takes
  1024 columns' worth of them (32 groups of 32, or 4 of 256), whichever rows they belong to; each
  group is quantized alone, so no group's bits depend on the others. Per group, as llama.cpp's
  Q8_0/Q8_1 (32) and Q8_K (256) blocks, in float32 IEEE operations: amax = max |x|;
  d = amax / 127 and inverse = 127 / amax, both with tl.math.div_rn (a correctly rounded
  division: a plain float32 `/` compiles to `div.full.f32`, approximate; the interpreter's div_rn
  is numpy's IEEE float32 divide); xq = round_even(x inverse) (one float32 product, then the
  float64 1.5 2^52 trick, ties to even) clamped to [-127, 127] as int8; the group's scale
  float16(min(d, 65504)) as its 11-bit significand and exponent (m, k) (quant_gemm.significand:
  zero -> (0, -24)); for ACT 32 also Q8_1's float16(clamp(d sum xq, +-65504)) as (sm, se)
  (float32 -> float16 casts round to nearest even, "rtne", on the GPU and in the interpreter;
  the K-quants' minimum takes exact code sums instead, so ACT 256 makes none). A group with
  amax < 2^-120 is zero (xq = 0, d = 0). (Where 127 / amax overflows, amax < ~2^-121, x inverse
  is +-inf -> +-127, and 0 inf, NaN, is taken as 0: the group's d is far below float16's least
  step, so m = sm = 0 and its codes never count. The torch reference has no value for such a
  NaN.) Then kmax[r], row r's largest k: torch's amax over integers, exact in any order.
- `quant_gemm_kernel`, one program per [BLOCK_M, BLOCK_N] output tile, the same tile whatever M
  (1 row or 512: no switch by row count, and none could change a bit). The grid exponent
  g = top[n] + kmax[r] + T - 62 + ceil(log2(#terms)) is known before the first block. Per
  activation group, over its blocks of 32 (one, or a super-block's eight): the integer dot
  A = xq . c as an int8 tl.dot with int32 accumulation (exact: |A| < 2^19), once for sub = 32,
  and for sub = 16 (q6_k) twice, with the other half of xq zeroed; the sub-blocks' S A summed in
  int64 over the group, times the group's m: the dot term I at exponent E + k (E of the group's
  first block: one per super-block, pack_quant_weight checks). The minimum term, where the kind
  has one: for ACT 32 (q4_1, q5_1) Q8_1's M sm at exponent F + se; for ACT 256 (q4_k, q5_k)
  (sum over the 8 blocks of M times the block's exact integer sum of xq) m at exponent F + k.
  A zero group's m = sm = 0 makes its terms 0. Each term is brought onto the grid 2^g
  (`on_grid`: a left shift, or a right shift clamped at T + 1 and rounded half to even) and added
  to an int64 accumulator: every term is below 2^(62 - ceil(log2 #terms)), so the sum stays
  below 2^62 and is exact in any order. At the end y = float32(float64(total) 2^g), then x's
  dtype. g lies within about [-80, 30] (E, F, k, se all float16 exponents in [-24, 5]), so 2^g is
  one exact float64 built from its bits (exact_triton.pow2) and the product is exact.
  One kernel serves all kinds: SUB (32 or 16), BPG (blocks of 32 per group: 1 or 8), MIN_TERM
  (none, Q8_1's, or the exact code sums') and TERM_BITS are constexprs.

The packed weight (`pack_quant_weight`, once at load) is the QuantWeight's fields made
contiguous int8/int32 on the device, plus top[n]; kinds without a minimum carry none. E and F
stay per block of 32 (the K-quants' are equal over a super-block; the kernel reads the first).
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
QUANT_COLUMNS = 1024      # activation columns per program of quantize_kernel: 32 groups of 32, or 4 of 256
# quant_gemm_kernel's MIN_TERM: no minimum (q8_0, q4_0, q6_k), Q8_1's float16(d sum xq) (q4_1,
# q5_1), or the exact code sums of a super-block (q4_k, q5_k)
NO_MIN: tl.constexpr = tl.constexpr(0)
Q8_1_MIN: tl.constexpr = tl.constexpr(1)
SUM_MIN: tl.constexpr = tl.constexpr(2)


def min_term(kind: qg.Kind) -> int:
    """The MIN_TERM of a kind."""
    return (NO_MIN if not kind.has_min else Q8_1_MIN if kind.act == BLOCK else SUM_MIN).value


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
    """The kernel's layout of w (on w's device), checked against its kind: the fields' shapes,
    then quant_gemm.check_weight (K a multiple of the activation group, one E and F per
    super-block for the K-quants)."""
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
    if kind.has_min and (tuple(w.min.shape) != (n, kdim // BLOCK) or tuple(w.min_exp.shape) != (n, kdim // BLOCK)):
        raise ValueError(f"{w.kind} minimum {tuple(w.min.shape)}, {tuple(w.min_exp.shape)} for weights {(n, kdim)}")
    qg.check_weight(w)
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
def quantize_kernel(x_ptr, xq_ptr, m_ptr, k_ptr, sm_ptr, se_ptr, NUM_GROUPS,
                    GROUPS: tl.constexpr, ACT: tl.constexpr):
    """Step 1 for GROUPS activation groups of ACT columns: x [M, K] contiguous is M K / ACT groups
    back to back, a row's in order. Per group xq [ACT] int8 and (m, k) int32, and for ACT 32 Q8_1's
    (sm, se) int32."""
    groups = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    ok = groups < NUM_GROUPS
    offs = groups[:, None] * ACT + tl.arange(0, ACT)[None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)   # [GROUPS, ACT]
    amax = tl.max(tl.abs(x), 1)                                             # [GROUPS] float32
    zero = ex.exponent(amax) < -120                                         # amax < 2^-120
    safe = tl.where(zero, 1.0, amax)
    # correctly rounded float32 divisions (div.rn.f32), as the reference's and llama.cpp's `/`;
    # a plain `/` would compile to the approximate div.full.f32
    x_max = tl.full([GROUPS], X_MAX, tl.float32)
    d = tl.where(zero, 0.0, tl.math.div_rn(safe, x_max))
    inverse = tl.math.div_rn(x_max, safe)
    p = x * inverse[:, None]                                                # float32 product
    p = tl.where(p == p, p, 0.0)                         # 0 inf (127 / amax overflowed): 0, see above
    xq = tl.minimum(tl.maximum(ex.round_even(p.to(tl.float64)), -X_MAX), X_MAX).to(tl.int32)
    xq = tl.where(zero[:, None], 0, xq)
    tl.store(xq_ptr + offs, xq.to(tl.int8), mask=ok[:, None])
    m, k = significand16(tl.minimum(d, F16_MAX).to(tl.float16, fp_downcast_rounding="rtne"))
    tl.store(m_ptr + groups, m, mask=ok)
    tl.store(k_ptr + groups, k, mask=ok)
    if ACT == 32:  # Q8_1's minimum scale; the K-quants' minimum takes exact code sums instead
        s = d * tl.sum(xq, 1).to(tl.float32)                                # float32
        s = tl.minimum(tl.maximum(s, -F16_MAX), F16_MAX)
        sm, se = significand16(s.to(tl.float16, fp_downcast_rounding="rtne"))
        tl.store(sm_ptr + groups, sm, mask=ok)
        tl.store(se_ptr + groups, se, mask=ok)


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
                      min_ptr, min_exp_ptr, top_ptr, out_ptr, M, N, K, NG, G_BIAS,
                      SUB: tl.constexpr, BPG: tl.constexpr, MIN_TERM: tl.constexpr, TERM_BITS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Steps 2-4 for one [BLOCK_M, BLOCK_N] tile of y, over NG activation groups of BPG blocks;
    G_BIAS = T - 62 + ceil(log2 #terms)."""
    NB = NG * BPG
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
    for grp in range(0, NG):
        kg = tl.load(k_ptr + rows * NG + grp, mask=row_ok, other=0)
        mg = tl.load(m_ptr + rows * NG + grp, mask=row_ok, other=0).to(tl.int64)   # 0 on a zero group
        e = tl.load(scale_exp_ptr + cols * NB + grp * BPG, mask=col_ok, other=0)  # one E per group
        dots = tl.zeros([BLOCK_M, BLOCK_N], tl.int64)      # sum over the group's sub-blocks of S A
        mins = tl.zeros([BLOCK_M, BLOCK_N], tl.int64)      # SUM_MIN: sum over its blocks of M sum(xq)
        for j in range(0, BPG):
            b = grp * BPG + j
            xq = tl.load(xq_ptr + rows[:, None] * K + b * 32 + lane[None, :], mask=row_ok[:, None], other=0)
            codes = tl.load(codes_ptr + cols[None, :] * K + b * 32 + lane[:, None], mask=col_ok[None, :], other=0)
            if SUB == 32:
                a = tl.dot(xq, codes, out_dtype=tl.int32)                         # exact: |A| < 2^19
                s = tl.load(scale_ptr + cols * NB + b, mask=col_ok, other=0).to(tl.int64)
                dots += a.to(tl.int64) * s[None, :]                               # |S A| < 2^37
            else:  # two sub-blocks of 16, each with its own scale
                zero = tl.zeros_like(xq)
                a0 = tl.dot(tl.where(first_half[None, :], xq, zero), codes, out_dtype=tl.int32)
                a1 = tl.dot(tl.where(first_half[None, :], zero, xq), codes, out_dtype=tl.int32)
                s0 = tl.load(scale_ptr + cols * (2 * NB) + 2 * b, mask=col_ok, other=0).to(tl.int64)
                s1 = tl.load(scale_ptr + cols * (2 * NB) + 2 * b + 1, mask=col_ok, other=0).to(tl.int64)
                dots += a0.to(tl.int64) * s0[None, :] + a1.to(tl.int64) * s1[None, :]
            if MIN_TERM == SUM_MIN:  # the block's exact code sum (|sum| <= 32 127) times its M
                sums = tl.sum(xq.to(tl.int32), 1).to(tl.int64)
                mb = tl.load(min_ptr + cols * NB + b, mask=col_ok, other=0).to(tl.int64)
                mins += sums[:, None] * mb[None, :]
        total += on_grid(dots * mg[:, None], (kg[:, None] + e[None, :]).to(tl.int64) - g, TERM_BITS)
        if MIN_TERM == Q8_1_MIN:  # one block per group: Q8_1's float16(d sum xq) = sm 2^se
            smb = tl.load(sm_ptr + rows * NB + grp, mask=row_ok, other=0).to(tl.int64)   # |sm| < 2^11
            seb = tl.load(se_ptr + rows * NB + grp, mask=row_ok, other=0)
            mb = tl.load(min_ptr + cols * NB + grp, mask=col_ok, other=0).to(tl.int64)
            f = tl.load(min_exp_ptr + cols * NB + grp, mask=col_ok, other=0)
            total += on_grid(smb[:, None] * mb[None, :], (seb[:, None] + f[None, :]).to(tl.int64) - g, TERM_BITS)
        if MIN_TERM == SUM_MIN:
            f = tl.load(min_exp_ptr + cols * NB + grp * BPG, mask=col_ok, other=0)
            total += on_grid(mins * mg[:, None], (kg[:, None] + f[None, :]).to(tl.int64) - g, TERM_BITS)
    y = (total.to(tl.float64) * ex.pow2(g)).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def quantize_activations(x: torch.Tensor, act: int = BLOCK):
    """Step 1 in Triton, per group of `act` columns (32 or 256; K a multiple of it): (xq [M, K]
    int8, m and k [M, K / act] int32, sm and se [M, K / 32] int32 for act 32 (None for 256: the
    K-quants do not use them), kmax [M] int32: each row's largest k, an exact maximum)."""
    m, kdim = x.shape
    if act not in (BLOCK, qg.SUPER) or kdim % act:
        raise ValueError(f"activations of {kdim} columns in groups of {act}")
    ng = kdim // act
    x = x.contiguous()
    xq = torch.empty(m, kdim, dtype=torch.int8, device=x.device)
    xm, k = (torch.empty(m, ng, dtype=torch.int32, device=x.device) for _ in range(2))
    sm, se = (None, None)
    if act == BLOCK:
        sm, se = (torch.empty(m, ng, dtype=torch.int32, device=x.device) for _ in range(2))
    if m * ng:
        groups = QUANT_COLUMNS // act
        quantize_kernel[(triton.cdiv(m * ng, groups),)](x, xq, xm, k, xm if sm is None else sm,
                                                        k if se is None else se, m * ng,
                                                        GROUPS=groups, ACT=act, **ex.LAUNCH_EXACT)
    kmax = k.amax(dim=1) if ng else torch.full((m,), -24, dtype=torch.int32, device=x.device)
    return xq, xm, k, sm, se, kmax


def quant_linear(x: torch.Tensor, w: PackedQuantWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) @ w^T -> [M, N] in x's dtype, bitwise quant_gemm.linear."""
    kind = qg.KINDS[w.kind]
    n, kdim = w.shape
    if x.dim() != 2 or x.shape[1] != kdim or kdim % kind.act:
        raise ValueError(f"x {tuple(x.shape)} against weights {w.shape} (K a multiple of {kind.act})")
    m, ng = x.shape[0], kdim // kind.act
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    xq, xm, k, sm, se, kmax = quantize_activations(x, kind.act)
    terms = ng * (2 if kind.has_min else 1)
    g_bias = kind.term_bits - 62 + math.ceil(math.log2(terms))  # quant_gemm.linear's expression
    dummy = w.scale_exp  # never read: the minimum's fields without a minimum, (sm, se) for ACT 256
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    quant_gemm_kernel[grid](xq, xm, k, dummy if sm is None else sm, dummy if se is None else se, kmax,
                            w.codes, w.scale, w.scale_exp,
                            dummy if w.min is None else w.min, dummy if w.min_exp is None else w.min_exp,
                            w.top, out, m, n, kdim, ng, g_bias,
                            SUB=kind.sub, BPG=kind.blocks_per_group, MIN_TERM=min_term(kind),
                            TERM_BITS=kind.term_bits, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, **ex.LAUNCH_EXACT)
    return out
