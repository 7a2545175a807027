"""The cuda backend's dense GEMM: x [M, K] @ w[N, K]^T in Triton, with rows that never depend on M.

cuBLAS picks its kernel (tile shape, split-K) by the problem's shape, so a row's bits can change
with the number of rows beside it: on an H200 the startup probes saw a row differ at 64 rows with
K = 64 (docs/kernels.md). This kernel has one configuration for every M: fixed tiles, no split-K,
the K loop in order, each output element accumulated in float32 by the same MMA instructions
whatever the batch (rows are independent lanes of an MMA), and one compiled variant (M is not
specialised on). So the row alone and the row among 500 others get the same bits: batch
invariance, the contract the engine's exactness rests on.

What it is not: bitwise any other GEMM. Tensor cores accumulate in an order of their own, so the
cpu backend's GEMM (and torch's) give other bits for dense weights; a checkpoint whose GEMMs must
agree across backends uses the exact quantized GEMM (quant_gemm_triton.py). float32 activations
multiply in IEEE float32 (input_precision "ieee": no TF32), bfloat16 ones on bf16 tensor cores;
the weight is read in its own dtype and converted to x's. Launched without FMA contraction, like
every kernel here (the bias add stays a rounded add); the float32 dot's own steps are fused
multiply-adds, each one IEEE operation in a fixed order.
"""
import torch
import triton
import triton.language as tl

from tensorfold.kernels import exact_triton as ex

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit(do_not_specialize=["M"])
def dense_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(x.dtype)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_BIAS:  # as torch adds a bias to the GEMM's result: in float32, rounded once
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + bias[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out,
             mask=row_ok[:, None] & col_ok[None, :])


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} against weight {tuple(weight.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x is {x.dtype}: float32 or bfloat16")
    m, kdim = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    x, weight = ex.aligned(x), weight.contiguous()  # weights: aligned once, when packed (cuda_ops.Linear)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    dense_gemm_kernel[grid](x, weight, bias if bias is not None else weight, out, m, n, kdim,
                            x.stride(0), weight.stride(0), out.stride(0),
                            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                            num_warps=NUM_WARPS, num_stages=NUM_STAGES, **ex.LAUNCH_EXACT)
    return out
