"""The torch op set: the batch-invariant torch references under the names a model calls.

The cpu backend runs it where the C++ kernels (native_ops.py) are not built; the startup
probes then decide exact mode, because its GEMM is torch's (padded to 8 rows), row-invariant on
some CPUs only. Quantized weights (kernels/quant_gemm.QuantWeight) run the quantized GEMM's
torch reference, exact by construction but slow. `sample` is the engine's draw (the keyed sampler, in
torch operations: nothing here calls tensorfold._cpu); its tokens come back as Python ints.
"""
import functools

from tensorfold.kernels.mamba2 import gated_group_norm as mamba2_gated_norm, mamba2  # noqa: F401
from tensorfold.kernels.moe import route, route_sigmoid  # noqa: F401
from tensorfold.kernels.paged_attention import attention_by_sequence
from tensorfold.kernels.paged_attention import paged_attention_ref as paged_attention  # noqa: F401
from tensorfold.kernels.paged_attention import paged_decode_attention_ref as paged_decode_attention  # noqa: F401
from tensorfold.kernels.paged_attention import write_kv_ref
from tensorfold.backends.linear_weight import LinearWeight, per_head as linear_heads  # noqa: F401
from tensorfold.kernels.delta_net import delta_net, gated_rms_norm  # noqa: F401
from tensorfold.kernels.latent_attention import attention_by_sequence as latent_attention, dsa_select  # noqa: F401
from tensorfold.kernels import quant_gemm, reference
from tensorfold.kernels.reference import linear_padded
from tensorfold.kernels.reference import (add_rms_norm, apply_rope, gelu_tanh_and_mul, layer_norm,  # noqa: F401
                                          pad_rows, relu_squared, rms_norm, rms_norm_rope, rope_table, sigmoid_and_mul,
                                          silu_and_mul, softcap)
from tensorfold.sampling.sampler import sample  # noqa: F401

NAME = "torch"
V_EXPONENT_RECORD = False  # the attention reads V's exponents from the V rows


attention = functools.partial(attention_by_sequence, paged_attention, paged_decode_attention)


def write_kv(kv, k, v, slots):
    """k, v [num_rows, num_kv_heads, head_dim] into the layer's cache (kv: models/cache.LayerKV)."""
    write_kv_ref(kv.k, kv.v, k, v, slots, v_exp=kv.v_exp)


class Linear(LinearWeight):
    """Parts as they are: torch's GEMM takes a dense part [N, K] (rows padded to 8), a quantized
    one (kernels/quant_gemm.QuantWeight) runs the quantized GEMM's torch reference."""

    def pack(self, part):
        return part

    def multiply(self, x, part):
        return quant_gemm.linear(x, part) if self.quantized(part) else linear_padded(x, part)

    def rows(self, ids):
        """Rows of a quantized table, dequantized (float32): the embedding lookup."""
        return self.single.rows(ids).dequantize()


class ReferenceLinear(Linear):
    """The fixed-order reference GEMM (kernels/reference.linear) for dense parts: what the native
    GEMM must equal bitwise (the tests' oracle op set; slow)."""

    def multiply(self, x, part):
        return quant_gemm.linear(x, part) if self.quantized(part) else reference.linear(x, part)


def linear(x, weight, bias=None):
    """x [M, K] @ weight^T (+ bias) for a plain [N, K] tensor: torch's GEMM padded to 8 rows."""
    return linear_padded(x, weight, bias)


def fuse(layer):
    """No fused layers here: every layer runs its blocks' composition (models/blocks.py)."""
    return None


def fuse_moe(moe):
    """No fused MoE blocks here: an MoE runs its composition (models/moe.MoE.compose)."""
    return None
