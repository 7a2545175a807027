"""Triton's CPU interpreter made to compute what the GPU computes: a context manager for tests.

Two faults of the interpreter (triton 3.9) are patched while `gpu_semantics()` is active
(shared/research/exactness-on-cpu.md):
- tl.dot goes through numpy, whose result for a row depends on its place in the tile, and
  multiplies bf16 as integers: replaced by a sequential-K loop (row-independent; fp32, or fp64
  for float64 dots);
- fp32 -> bf16 casts truncate: replaced by round-to-nearest-even, as on the GPU.
The interpreter's exp and log (numpy's, which differ from torch's and libdevice's in the last
bit) need no patch: no kernel of the project calls them. The sampler's float64 exp and log are
exact_triton's exp64/log64, plain IEEE operations that numpy computes as the GPU does.
Set TRITON_INTERPRET=1 before anything imports a kernel module; on a GPU, do not enter this.
"""
import contextlib

import numpy as np
import pytest
import torch


@contextlib.contextmanager
def gpu_semantics():
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.interpreter import TensorHandle

    def as_f32(h):
        if h.dtype.scalar == tl.bfloat16:
            return (h.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return h.data.astype(np.float32)

    def sequential_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        wide = d.dtype.scalar == tl.float64  # float64 dots: kept in float64 (exact attention)
        lhs, rhs = (a.data, b.data) if wide else (as_f32(a), as_f32(b))
        out = d.data.astype(np.float64 if wide else np.float32).copy()
        for k in range(lhs.shape[-1]):  # one fp32 rounding per step, the same for every row
            out = out + lhs[..., :, k:k + 1] * rhs[..., k:k + 1, :]
        return TensorHandle(out, d.dtype.scalar)

    cast = interpreter.InterpreterBuilder.cast_impl

    def rounding_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return TensorHandle(bits.numpy().view(np.uint16), dst_type.scalar)
        return cast(self, src, dst_type)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.InterpreterBuilder, "create_dot", sequential_dot)
        mp.setattr(interpreter.InterpreterBuilder, "cast_impl", rounding_cast)
        yield


@pytest.fixture(scope="module", autouse=True)
def interpreter_as_gpu():
    """Import this into a kernel test module: GPU semantics in the interpreter, nothing on a GPU."""
    if torch.cuda.is_available():
        yield
        return
    with gpu_semantics():
        yield
