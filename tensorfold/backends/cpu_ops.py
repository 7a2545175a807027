"""The torch op set: the batch-invariant torch references under the names a model calls.

The cpu backend runs it where the C++ kernels (native_ops.py) are not built; the startup
probes then decide exact mode, because its GEMM is torch's (padded to 8 rows), row-invariant on
some CPUs only. Quantized weights (kernels/quant_gemm.QuantWeight) run the quantized GEMM's
torch reference, exact by construction but slow. `sample` is the engine's draw (the keyed sampler); its tokens come back as
Python ints.
"""
import functools

from tensorfold.kernels.paged_attention import attention_by_sequence
from tensorfold.kernels.paged_attention import paged_attention_ref as paged_attention  # noqa: F401
from tensorfold.kernels.paged_attention import paged_decode_attention_ref as paged_decode_attention  # noqa: F401
from tensorfold.kernels.paged_attention import write_kv_ref as write_kv  # noqa: F401
from tensorfold.kernels import quant_gemm
from tensorfold.kernels.reference import linear_padded
from tensorfold.kernels.reference import (add_rms_norm, apply_rope, pad_rows, rms_norm,  # noqa: F401
                                          rms_norm_rope, rope_table, silu_and_mul)
from tensorfold.sampling.sampler import sample  # noqa: F401

NAME = "torch"


attention = functools.partial(attention_by_sequence, paged_attention, paged_decode_attention)


def pack_weight(weight):
    """GEMM weights stay as they are: torch's GEMM takes them [N, K], the quantized reference
    its QuantWeight."""
    return weight


def embedding(table, ids):
    """Rows of an embedding table: dense, or blocks dequantized (float32)."""
    if isinstance(table, quant_gemm.QuantWeight):
        return table.rows(ids).dequantize()
    return table[ids]


def linear(x, weight, bias=None):
    """torch's GEMM padded to 8 rows, or for blocks the exact quantized GEMM's reference."""
    if isinstance(weight, quant_gemm.QuantWeight):
        out = quant_gemm.linear(x, weight)
        return out if bias is None else out + bias
    return linear_padded(x, weight, bias)
