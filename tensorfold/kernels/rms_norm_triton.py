"""RMSNorm (optionally after a fused residual add, optionally followed by rope) and rope in Triton.

References (reference.py): `rms_norm`, `apply_rope`; `add_rms_norm_ref` and `rms_norm_rope_ref`
below spell out the fused forms as the unfused calls a model makes.

- `rms_norm(x, weight, eps)`: one program per row, the whole row in one tile, reduced in fp32:
  x / sqrt(mean(x^2) + eps) * weight, rounded to x's dtype.
- `add_rms_norm(x, residual, weight, eps)`: h = residual + x rounded to the model dtype (the same
  bits as torch's add), then rms_norm(h); returns (normed, h).
- `apply_rope(x, cos, sin)`: the half-split rotation from gathered tables, elementwise.
- `rms_norm_rope(x, weight, eps, cos, sin)`: qwen3's per-head q/k norm and rope in one pass (it
  pays there: the head row is read once instead of twice); the norm's output is rounded to the
  dtype before rope, as the unfused calls do.

Invariance: a program reads only its own row, the tile size is fixed by the row length, and the
launcher hands the kernel contiguous 16-byte aligned rows (Triton picks the load layout, hence
the order of the row's sum, from the pointer's alignment), so a row's bits do not depend on the
rows beside it or on where its tensor sits. Contract with the reference: rope is bitwise
(the same fp32 products and sum, FMA contraction off); the norm's sum of squares runs in
Triton's order, not torch's, so the norm is within float tolerance (about 1 ulp of the output
dtype), and the residual add is bitwise.
"""
import torch
import triton
import triton.language as tl

from tensorfold.kernels import reference


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    h = residual + x
    return reference.rms_norm(h, weight, eps), h


def rms_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    return reference.apply_rope(reference.rms_norm(x, weight, eps), cos, sin)


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
                    eps, rows_per_token,
                    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    HAS_ROPE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (tl.load(residual_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
             + x.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * N + cols, x, mask=ok)
    x = x.to(tl.float32)
    var = tl.sum(x * x, 0) / N
    y = tl.div_rn(x, tl.sqrt_rn(var + eps)) * tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = y.to(out_ptr.dtype.element_ty)
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


# FMA contraction would fuse x * cos + r * sin into one rounding and break the bitwise contract.
_NO_FMA = {"enable_fp_fusion": False}


def _aligned(x: torch.Tensor) -> torch.Tensor:
    if x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _launch_norm(x, weight, eps, residual=None, cos=None, sin=None, out=None):
    n = x.shape[-1]
    x = _aligned(x)
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
        x, _aligned(residual) if residual is not None else x, h, weight.contiguous(), out,
        cos.contiguous() if cos is not None else weight, sin.contiguous() if sin is not None else weight,
        eps, rows_per_token, N=n, BLOCK=block, HAS_RESIDUAL=residual is not None,
        HAS_ROPE=cos is not None, **_NO_FMA)
    return out, h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.rms_norm`: each row (last dimension) normalised alone."""
    return _launch_norm(x, weight, eps, out=out)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(residual + x), residual + x): the add rounded to the dtype, as a model does."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError("residual must match x in shape and dtype")
    return _launch_norm(x, weight, eps, residual=residual)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(rms_norm(x)) for x [num_tokens, num_heads, head_dim], cos/sin [num_tokens, head_dim]."""
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
            HALF=half, HALF_PAD=triton.next_power_of_2(half), **_NO_FMA)
    return out
