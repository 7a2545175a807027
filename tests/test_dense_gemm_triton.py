"""The cuda backend's dense GEMM (kernels/dense_gemm_triton.py): a row's bits never depend on the
rows beside it, and the product is the GEMM it claims to be.

Its contract is batch invariance, not a reference's bits (tensor cores accumulate in an order of
their own): every row of a batch equals the same row computed alone, bitwise, for M across the
tile edges (1, 2, 63, 64, 65, 200), float32 and bfloat16, odd N and K, with and without a bias;
and the result is within a float GEMM's error of the float64 product. Without a GPU the kernel
runs in Triton's interpreter (tests/triton_interpreter.py's sequential dot); with one, compiled
on "cuda", where cuBLAS's choice of kernel by shape is what this kernel replaces.
"""
import torch

from kernel_inputs import DEVICE, HAS_GPU, gpu  # first: sets TRITON_INTERPRET without a GPU

import pytest  # noqa: E402

from tensorfold.kernels.dense_gemm_triton import dense_linear  # noqa: E402
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_do_not_depend_on_the_batch(draw, dtype, with_bias):
    n, k = 100, 72  # neither a multiple of the tiles
    weight = draw.randn(n, k, dtype=dtype, scale=0.1)
    bias = draw.randn(n, dtype=dtype) if with_bias else None
    x = draw.randn(200, k, dtype=dtype)
    alone = torch.cat([dense_linear(x[i:i + 1], weight, bias) for i in (0, 1, 62, 63, 64, 199)])
    for m in (2, 63, 64, 65, 200):
        together = dense_linear(x[:m], weight, bias)
        assert together.dtype == dtype and together.shape == (m, n)
        for j, i in enumerate((0, 1, 62, 63, 64, 199)):
            if i < m:
                assert torch.equal(together[i], alone[j]), f"row {i} among {m}: {draw}"
    # at another place in the batch, the row keeps its bits too
    shuffled = dense_linear(torch.cat([x[5:70], x[:1]]), weight, bias)
    assert torch.equal(shuffled[-1], alone[0]), f"{draw}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_is_the_gemm(draw, dtype):
    n, k = 130, 200
    weight, bias = draw.randn(n, k, dtype=dtype, scale=0.1), draw.randn(n, dtype=dtype)
    x = draw.randn(33, k, dtype=dtype)
    got = dense_linear(x, weight, bias).double()
    want = x.double() @ weight.double().T + bias.double()
    err = (got - want).abs().max() / want.abs().max()
    assert float(err) < TOLERANCE[dtype], f"relative error {float(err)}: {draw}"
    assert dense_linear(x[:0], weight).shape == (0, n)


def test_bad_operands_are_refused(draw):
    with pytest.raises(ValueError, match="against weight"):
        dense_linear(draw.randn(2, 8), draw.randn(4, 9))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        dense_linear(draw.randn(2, 8).half(), draw.randn(4, 8).half())


@gpu
def test_the_cuda_op_set_takes_it_for_dense_weights(draw):
    from tensorfold.backends import backend_ops
    ops = backend_ops("cuda")
    x, weight = draw.randn(3, 64, dtype=torch.bfloat16), draw.randn(48, 64, dtype=torch.bfloat16)
    assert HAS_GPU and x.device.type == DEVICE == "cuda"
    assert torch.equal(ops.linear(x, weight), dense_linear(x, weight))
