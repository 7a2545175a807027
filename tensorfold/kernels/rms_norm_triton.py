"""RMSNorm (optionally after a fused residual add, optionally followed by rope) and rope in Triton.

References (reference.py): `rms_norm`, `apply_rope`; `add_rms_norm_ref` and `rms_norm_rope_ref`
below spell out the fused forms as the unfused calls a model makes.

- `rms_norm(x, weight, eps)`: one program per row, the whole row in one tile, computed by
  reference.rms_norm's rule (its docstring): the squares are rounded onto a fixed-point grid set
  by the row's largest exponent and summed as integers in float64 (exact: at most 2^53 for rows
  of at most MAX_NORM_WIDTH = 8,192; wider rows are refused), then var, 1 / sqrt(var + eps) and
  the scaling are single float32 IEEE operations in the reference's order, rounded to x's dtype.
- `add_rms_norm(x, residual, weight, eps)`: h = residual + x rounded to the model dtype (the same
  bits as torch's add), then rms_norm(h); returns (normed, h).
- `apply_rope(x, cos, sin)`: the half-split rotation from gathered tables, elementwise.
- `rms_norm_rope(x, weight, eps, cos, sin)`: qwen3's per-head q/k norm and rope in one pass (it
  pays there: the head row is read once instead of twice); the norm's output is rounded to the
  dtype before rope, as the unfused calls do.

Contract with the reference: bitwise, all four. The only reduction is an exact integer sum, so
neither Triton's reduction tree nor the load layout (alignment, vector width) nor the rows
beside a row can change its bits; everything else is elementwise IEEE arithmetic written in the
reference's order: float32 sqrt and division correctly rounded (tl.math.sqrt_rn and div_rn:
sqrt.rn.f32 and div.rn.f32 on the GPU, numpy's in the interpreter; Triton's plain float32 `/`
is approximate there), eps passed as a float32, and every launch with FMA contraction off
(exact_triton.LAUNCH_EXACT), so `x * cos + r * sin` and the grid rounding (x + M) - M stay
separately rounded, as in torch.
"""
import torch
import triton
import triton.language as tl

from tensorfold.exact.float32 import f32
from tensorfold.kernels import exact_triton as ex
from tensorfold.kernels import reference
from tensorfold.kernels.exact_triton import LAUNCH_EXACT

MAX_NORM_WIDTH = reference.MAX_NORM_WIDTH


add_rms_norm_ref = reference.add_rms_norm  # the fused kernels' references (the unfused calls)
rms_norm_rope_ref = reference.rms_norm_rope


@triton.jit
def _rope_halves(x1, x2, cos_ptr, sin_ptr, token, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """The rotated halves of one head row: x * cos + rotate_half(x) * sin, in fp32."""
    d = tl.arange(0, HALF_PAD)
    ok = d < HALF
    c1 = tl.load(cos_ptr + token * 2 * HALF + d, mask=ok, other=0.0)
    c2 = tl.load(cos_ptr + token * 2 * HALF + HALF + d, mask=ok, other=0.0)
    s1 = tl.load(sin_ptr + token * 2 * HALF + d, mask=ok, other=0.0)
    s2 = tl.load(sin_ptr + token * 2 * HALF + HALF + d, mask=ok, other=0.0)
    return x1 * c1 + (-x2) * s1, x2 * c2 + x1 * s2


@triton.jit
def rms_norm_kernel(x_ptr, residual_ptr, h_ptr, weight_ptr, out_ptr, cos_ptr, sin_ptr,
                    eps: tl.float32, rows_per_token,
                    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    HAS_ROPE: tl.constexpr, NORM_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (tl.load(residual_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
             + x.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * N + cols, x, mask=ok)
    # reference.rms_norm, step by step (padding lanes are 0: they add nothing).
    x = x.to(tl.float32)
    e = ex.exponent(tl.max(tl.abs(x), 0))
    x64 = x.to(tl.float64)
    sq = ex.round_even((x64 * x64) * ex.pow2(2 * (NORM_BITS - 1 - e)))  # integers <= 2^40
    ss = tl.sum(sq, 0)  # <= 2^53: exact in any order
    var = ex.scale32(ss.to(tl.float32), 2 * (e - NORM_BITS + 1))
    inv = ex.inverse_sqrt32(var, eps, N)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = ((x * inv) * w).to(out_ptr.dtype.element_ty)
    if HAS_ROPE:  # the row is one head of one token
        half: tl.constexpr = N // 2
        halves = tl.reshape(y.to(tl.float32), [2, BLOCK // 2])
        x1, x2 = tl.split(tl.permute(halves, [1, 0]))
        o1, o2 = _rope_halves(x1, x2, cos_ptr, sin_ptr, row // rows_per_token, half, BLOCK // 2)
        y = tl.reshape(tl.permute(tl.join(o1, o2), [1, 0]), [BLOCK]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, y, mask=ok)


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads,
                HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one head of one token
    d = tl.arange(0, HALF_PAD)
    ok = d < HALF
    x1 = tl.load(x_ptr + row * 2 * HALF + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + row * 2 * HALF + HALF + d, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = _rope_halves(x1, x2, cos_ptr, sin_ptr, row // num_heads, HALF, HALF_PAD)
    tl.store(out_ptr + row * 2 * HALF + d, o1.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + row * 2 * HALF + HALF + d, o2.to(out_ptr.dtype.element_ty), mask=ok)


def _launch_norm(x, weight, eps, residual=None, cos=None, sin=None, out=None):
    n = x.shape[-1]
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"rms_norm rows are at most {MAX_NORM_WIDTH} wide (an exact float64 sum), got {n}")
    x = x.contiguous()  # any alignment: the exact sum has no order to lose
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} {tuple(x.shape)} tensor")
    h = torch.empty_like(x) if residual is not None else out
    num_rows = x.numel() // n
    if num_rows == 0:
        return out, h
    block = triton.next_power_of_2(n)
    if cos is not None and (n % 2 or block != n):
        raise ValueError(f"fused rope needs a power-of-two head_dim, got {n}")
    rows_per_token = x.shape[1] if x.dim() == 3 else 1
    rms_norm_kernel[(num_rows,)](
        x, residual.contiguous() if residual is not None else x, h, weight.contiguous(), out,
        cos.contiguous() if cos is not None else weight, sin.contiguous() if sin is not None else weight,
        f32(eps), rows_per_token, N=n, BLOCK=block, HAS_RESIDUAL=residual is not None,
        HAS_ROPE=cos is not None, NORM_BITS=reference.NORM_BITS,
        **LAUNCH_EXACT)
    return out, h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.rms_norm`, bitwise: each row (last dimension, at most 8,192 wide) alone."""
    return _launch_norm(x, weight, eps, out=out)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(residual + x), residual + x), bitwise `add_rms_norm_ref`: the add rounded to the
    dtype, as a model does."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError("residual must match x in shape and dtype")
    return _launch_norm(x, weight, eps, residual=residual)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(rms_norm(x)) for x [num_tokens, num_heads, head_dim], cos/sin [num_tokens, head_dim]:
    bitwise `rms_norm_rope_ref` (the norm rounded to x's dtype before rope)."""
    return _launch_norm(x, weight, eps, cos=cos.float(), sin=sin.float())[0]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.apply_rope`, bitwise: x [num_tokens, num_heads, head_dim]."""
    num_tokens, num_heads, head_dim = x.shape
    x = x.contiguous()
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} {tuple(x.shape)} tensor")
    if x.numel():
        half = head_dim // 2
        rope_kernel[(num_tokens * num_heads,)](
            x, cos.float().contiguous(), sin.float().contiguous(), out, num_heads,
            HALF=half, HALF_PAD=triton.next_power_of_2(half), **LAUNCH_EXACT)
    return out
