"""The cpu backend's compiled op set: csrc/cpu's exact kernels (the extension tensorfold._cpu).

Every op is bitwise its torch reference (kernels/reference.py, kernels/paged_attention.py),
including the GEMMs: the dense one's order of summation is fixed by K alone, the quantized one
(kernels/quant_gemm.py) sums integers: no BLAS runs on the token
path, so exactness holds whatever CPU this is. Importing this module fails (ImportError) when
the extension was not built; backends.backend_ops then falls back to cpu_ops.
"""
import torch

from tensorfold import _cpu
from tensorfold.backends.huge_pages import arena
from tensorfold.kernels.quant_gemm import QuantWeight
from tensorfold.kernels.paged_attention import pad_block_tables
from tensorfold.kernels.reference import pad_rows, rope_table  # noqa: F401
from tensorfold.sampling.sampler import sample  # noqa: F401

NAME = f"native-{_cpu.isa()}"
# The KV cache keeps a record of its V rows' exponents (KVCache.v_exp), which write_kv fills and
# the attention reads: its first pass (the maxima) then reads K alone, not K and V.
V_EXPONENT_RECORD = True

rms_norm = _cpu.rms_norm
add_rms_norm = _cpu.add_rms_norm
apply_rope = _cpu.apply_rope
rms_norm_rope = _cpu.rms_norm_rope
silu_and_mul = _cpu.silu_and_mul
write_kv = _cpu.write_kv


class PackedWeight:
    """A GEMM weight [N, K] in the kernel's tile layout (packed once, at load), in huge pages where
    the OS has them (backends/huge_pages.py: a decode step streams every weight)."""

    def __init__(self, weight: torch.Tensor):
        self.data = arena.place(_cpu.pack_weight(weight))
        self.shape = tuple(weight.shape)
        self.format = str(weight.dtype).removeprefix("torch.")


class PackedQuant:
    """A quantized GEMM weight (kernels/quant_gemm.QuantWeight) in the quantized kernel's layout:
    one byte tensor that carries its kind and shape (in huge pages too)."""

    def __init__(self, weight: QuantWeight):
        self.data = arena.place(_cpu.pack_quant(weight.kind, weight.codes, weight.scale, weight.scale_exp, weight.min,
                                                weight.min_exp))
        self.shape = weight.shape
        self.format = weight.kind


def pack_weight(weight):
    return PackedQuant(weight) if isinstance(weight, QuantWeight) else PackedWeight(weight)


def embedding(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows of an embedding table: dense, or a PackedQuant's rows dequantized (float32)."""
    if isinstance(table, PackedQuant):
        return _cpu.quant_rows(table.data, ids, *table.shape)
    return table[ids]


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight^T with a PackedWeight or PackedQuant (or a plain [N, K] tensor, packed
    per call)."""
    if isinstance(weight, PackedQuant):
        out = _cpu.quant_linear(x, weight.data, *weight.shape)
    elif isinstance(weight, PackedWeight):
        out = _cpu.linear_packed(x, weight.data, *weight.shape)
    else:
        out = _cpu.linear(x, weight)
    return out if bias is None else out + bias


def paged_attention(q, k_cache, v_cache, positions, block_table, scale, window=None, v_exp=None):
    """One sequence's rows (paged_attention_ref's signature; v_exp: write_kv's record, optional)."""
    starts = torch.tensor([0, q.shape[0]])
    return _cpu.paged_attention(q, k_cache, v_cache, positions, block_table.view(1, -1), starts, scale, window or 0,
                                v_exp=v_exp)


def paged_decode_attention(q, k_cache, v_cache, positions, block_tables, scale, window=None, v_exp=None):
    """One row of each of several sequences (paged_decode_attention_ref's signature)."""
    return _cpu.paged_attention(q, k_cache, v_cache, positions, pad_block_tables(block_tables),
                                torch.arange(q.shape[0] + 1), scale, window or 0, v_exp=v_exp)


def attention(q, k_cache, v_cache, batch, scale, window, v_exp=None):
    """All rows of a ForwardBatch in one call."""
    return _cpu.paged_attention(q, k_cache, v_cache, batch.positions, batch.block_tables, batch.row_starts_tensor,
                                scale, window or 0, v_exp=v_exp)


def decoder_layer(model, layer, x, residual, next_norm, batch, cos, sin, kv):
    """One llama/qwen3 layer in one native call: the model's op-by-op composition, the same bits
    (tests/test_native_backend.py), on the layer's part of the cache (kv: forward_batch.LayerKV).
    Returns (the next layer's normed input or None, residual). Layers with biases take the
    op-by-op path (llama.Model.forward)."""
    a = model.args
    return _cpu.decoder_layer(
        x, residual, layer.qkv.data, layer.o.data, layer.post_attn_norm, layer.gate_up.data, layer.down.data,
        next_norm, layer.q_norm, layer.k_norm, cos, sin, kv.k, kv.v, batch.slot_mapping, batch.positions,
        batch.block_tables, batch.row_starts_tensor, a.num_heads, a.intermediate_size, a.rms_norm_eps, model.scale,
        layer.window or 0, kv.v_exp)

