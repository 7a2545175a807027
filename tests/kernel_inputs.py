"""What every kernel test module shares: the device, and fresh random inputs with a printable seed
(conftest.py's `draw` fixture hands out a Draw).

Importing this module first sets TRITON_INTERPRET=1 when there is no GPU, which must happen before
anything imports triton (so a kernel test module imports this before any kernel module).
"""
import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if HAS_GPU else "cpu"
NAN = float("nan")
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


class Draw:
    """Random tensors from a fresh seed per test; str(draw) names it in failure messages."""

    def __init__(self):
        self.seed = int.from_bytes(os.urandom(4), "little")
        self.gen = torch.Generator().manual_seed(self.seed)

    def randn(self, *shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=self.gen) * scale).to(dtype).to(DEVICE)

    def rand(self, *shape, dtype=torch.float32):
        return torch.rand(*shape, generator=self.gen, dtype=dtype)

    def randint(self, high, *shape):
        return torch.randint(0, high, shape, generator=self.gen)

    def tiny_bf16(self, *shape):
        return tiny_bf16(self.gen, *shape)

    def __str__(self):
        return f"seed {self.seed}"


def tiny_bf16(gen: torch.Generator, *shape) -> torch.Tensor:
    """bfloat16 values near 2^-64, some subnormal (about 5%), some zero: the products of two fall
    around float32's smallest normal, 2^-126, where the bfloat16 GEMM's steps flush to zero."""
    sign = torch.randint(0, 2, shape, generator=gen) * 2.0 - 1.0
    normal = sign * (1 + torch.randint(0, 128, shape, generator=gen) / 128) * 2.0 ** torch.randint(-75, -52, shape, generator=gen)
    subnormal = sign * torch.randint(1, 128, shape, generator=gen) * 2.0 ** -133
    pick = torch.rand(shape, generator=gen)
    v = torch.where(pick < 0.05, subnormal, torch.where(pick < 0.1, sign * 0.0, normal))
    return v.bfloat16()


# The grid's extremes (kernels/paged_attention.py, step 1): a float32 q element of Q_TOP rounds to
# q_int = 2^22 (the most q_int can be), a stored K element of K_TOP is k_int = 2^22 - 1 exactly
# (the most a stored k_int can be), a V element of V_TOP is v_int = 2^20 - 1; bfloat16 holds
# BF16_TOP, its largest value below 2, whose grid integers are the largest that dtype reaches.
Q_TOP, K_TOP, V_TOP, BF16_TOP = 2 - 2.0 ** -23, 2 - 2.0 ** -21, 2 - 2.0 ** -19, 2 - 2.0 ** -7


def at_the_top(gen: torch.Generator, shape, magnitude: float, dtype=torch.float32) -> torch.Tensor:
    """Every element of magnitude `magnitude` (BF16_TOP in bfloat16), signs drawn, except the first
    vector (along dim 0), all positive: with q and k both at the top its dot products are the
    largest the grid allows (every product the largest, all of one sign)."""
    sign = torch.randint(0, 2, shape, generator=gen) * 2.0 - 1.0
    sign[0] = 1.0
    return (sign * (BF16_TOP if dtype == torch.bfloat16 else magnitude)).to(dtype).to(DEVICE)
