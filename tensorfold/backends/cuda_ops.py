"""The cuda backend's op set: reference.py's names, dispatching to the Triton launchers.

A model takes an `ops` module (models/llama.py); the cpu backend passes cpu_ops.py and the cuda
backend this one (backends.backend_ops). It imports triton, so it is imported only when the cuda
backend is chosen: on a GPU, or in tests on CPU tensors under TRITON_INTERPRET=1.

What runs where, and why:
- rms_norm, apply_rope: Triton (kernels/rms_norm_triton.py), plus the fused forms the model calls
  (add_rms_norm: residual add + the next norm; rms_norm_rope: qwen3's per-head norm + rope), all
  bitwise the references (tensorfold/exact's rule).
- paged_attention / paged_attention_varlen, write_kv: Triton exact attention
  (kernels/attention_triton.py: integer sums, bitwise the cpu reference's result); the cache write
  is the reference's (each vector rounded to its fixed-point grid, then an index_put: elementwise,
  so invariant as it stands).
- the MoE: the router's choice (moe_triton.route) and the sum of a token's experts
  (moe_triton.combine), each expert's GEMMs over its grouped tokens as any linear (fuse_moe).
- sample (the engine's draw; Python ints back), verify, apply_token_bitmask: Triton keyed
  sampling and grammar-masked verification.
- linear with a quantized weight (a QuantWeight from kernels/quant_gemm.py, packed once by
  Linear): the Triton exact quantized GEMM (kernels/quant_gemm_triton.py: int8 activation
  groups of 32, or 256 for the K-quants, integer block dots summed per group, an int64 sum on a
  grid known before any block), bitwise
  quant_gemm.linear for every kind, fixed tiles whatever M, so a row's bits never depend on the
  batch; on CUDA tensors and, in tests, on CPU tensors under the interpreter alike.
- linear with a dense weight on a GPU: the fixed-tile Triton GEMM (kernels/dense_gemm_triton.py:
  no split-K, one configuration whatever M, so batch invariant; not cuBLAS, which changed a row's
  bits with the batch on an H200). Its bits are its own: dense weights agree across backends only
  as closely as two float GEMMs do; quantized ones agree bitwise. On CPU tensors (the tests, in
  the interpreter) dense linear is the cpu backend's GEMM, so the op sets are compared on equal
  GEMMs there.
- GLM-5's latent attention and DSA indexer (latent_attention, dsa_select): Triton
  (kernels/latent_attention_triton.py: one launch for the attention of every row, one for the
  indexer's scores, then a stable sort per row), bitwise kernels/latent_attention.py.
- Nemotron-H's Mamba2 mixing and its gated group norm (mamba2, mamba2_gated_norm): Triton
  (kernels/mamba2_triton.py: the conv, then the scan per (sequence, head, columns), two launches
  a layer), bitwise kernels/mamba2.py.
- silu_and_mul, sigmoid_and_mul, gelu_tanh_and_mul, relu_squared, softcap, layer_norm, pad_rows, rope_table,
  and Nemotron-H's routing (route_sigmoid): the torch reference ops on CUDA tensors, shared by both
  op sets rather than mirrored (elementwise: invariant on a GPU as they are).
- the vision tower (models/vision_tower.py) calls this set's Linear, apply_rope and paged_attention
  (each image's patches over a scratch cache) and, like the DSA indexer, the references'
  layer_norm (an exact integer sum, then single float32 steps), GELU's tanh form and its own
  float64 erf series on CUDA tensors: the same bits on any device; tests/test_vision_triton.py.
"""
import functools

import torch

from tensorfold.backends.linear_weight import LinearWeight, per_head as linear_heads  # noqa: F401
from tensorfold.kernels.delta_net_triton import delta_net, gated_rms_norm  # noqa: F401
from tensorfold.kernels.latent_attention_triton import dsa_select, latent_attention  # noqa: F401
from tensorfold.kernels.mamba2_triton import gated_group_norm as mamba2_gated_norm, mamba2  # noqa: F401
from tensorfold.kernels.moe import group_by_expert, route_sigmoid  # noqa: F401
from tensorfold.kernels.moe_triton import combine, route
from tensorfold.kernels.attention_triton import paged_attention, paged_attention_varlen, tile_plan  # noqa: F401
from tensorfold.kernels.dense_gemm_triton import dense_linear
from tensorfold.kernels.exact_triton import aligned
from tensorfold.kernels.paged_attention import pad_block_tables
from tensorfold.kernels.paged_attention import write_kv_ref
from tensorfold.kernels.quant_gemm import QuantWeight
from tensorfold.kernels.quant_gemm_triton import PackedQuantWeight, pack_quant_weight, quant_linear
from tensorfold.kernels.reference import linear_padded
from tensorfold.kernels.reference import (gelu_tanh_and_mul, layer_norm, pad_rows, relu_squared,  # noqa: F401
                                          rope_table, sigmoid_and_mul, silu_and_mul, softcap)
from tensorfold.kernels.rms_norm_triton import add_rms_norm, apply_rope, rms_norm, rms_norm_rope  # noqa: F401
from tensorfold.kernels.sampling_triton import sample  # noqa: F401
from tensorfold.kernels.verify_triton import apply_token_bitmask, verify  # noqa: F401

NAME = "triton"
V_EXPONENT_RECORD = False  # the attention reads V's exponents from the V rows


class Linear(LinearWeight):
    """Quantized parts packed once for the Triton quantized GEMM (PackedQuantWeight); dense parts
    as they are, [N, K]: the Triton dense GEMM takes them on a GPU; on CPU tensors (the tests,
    under the Triton interpreter) the cpu backend's GEMM, so the two op sets are compared on
    equal GEMMs."""

    def pack(self, part):
        return pack_quant_weight(part) if self.quantized(part) else aligned(part)

    def multiply(self, x, part):
        if isinstance(part, PackedQuantWeight):
            return quant_linear(x, part)
        return linear(x, part)

    def rows(self, ids):
        """Rows of a quantized table, dequantized (float32): the embedding lookup."""
        t = self.single
        return QuantWeight(t.kind, t.codes, t.scale, t.scale_exp, t.min, t.min_exp).rows(ids).dequantize()


def linear(x, weight, bias=None):
    """x [M, K] @ weight^T (+ bias) for a plain dense [N, K] tensor: on a GPU the fixed-tile Triton
    GEMM (batch invariant); on CPU tensors (tests, in the interpreter) the cpu backend's GEMM."""
    if x.device.type != "cpu":
        return dense_linear(x, weight, bias)
    from tensorfold.backends import native_problem
    if native_problem() is None:
        from tensorfold.backends import native_ops
        return native_ops.linear(x, weight, bias)
    return linear_padded(x, weight, bias)


def attention(q, kv, batch, scale, window=None):
    """All rows of a ForwardBatch over one layer's cache (kv: models/cache.LayerKV) in one launch
    (the kernel reads V's exponents from V: no record). The launch's tile plan is made once per
    forward and head shape, so the layers after the first neither wait for the GPU (the largest
    position) nor copy tiles to it."""
    num_heads, head_dim, group = q.shape[1], q.shape[2], q.shape[1] // kv.k.shape[2]
    plan = batch.memo(("attention tiles", num_heads, group, head_dim),
                      lambda: tile_plan(batch.positions, batch.row_starts, num_heads, group, head_dim))
    return paged_attention_varlen(q, kv.k, kv.v, batch.positions, batch.block_tables, batch.row_starts, scale,
                                  window, plan=plan)


def write_kv(kv, k, v, slots):
    """k, v [num_rows, num_kv_heads, head_dim] into the layer's cache (the reference's write:
    elementwise, invariant as it stands)."""
    write_kv_ref(kv.k, kv.v, k, v, slots)


def paged_decode_attention(q, k_cache, v_cache, positions, block_tables, scale, window=None):
    """One query row per sequence, all in one launch; the kernel's fixed absolute splits make each
    row's result the one paged_attention gives it alone."""
    return paged_attention_varlen(q, k_cache, v_cache, positions, pad_block_tables(block_tables),
                                  list(range(q.shape[0] + 1)), scale, window)


def fuse(layer):
    """No fused layers here: every layer runs its blocks' composition (models/blocks.py)."""
    return None


def fuse_moe(moe):
    """The MoE block with its tokens grouped by expert once (kernels/moe.group_by_expert) and the
    sum in one launch (moe_triton.combine) instead of an indexed add per expert: MoE.compose's
    kernels and order (Gemma 4's router input and per-expert scale included), so its bits. None
    (MoE.compose) for sigmoid routing or an ungated shared expert (GLM-5's block)."""
    if moe.spec.sigmoid_routing is not None or (moe.shared is not None and moe.shared_gate is None):
        return None
    return functools.partial(_moe_block, moe)


def _moe_block(moe, x, router_x=None):
    spec, hidden = moe.spec, x.shape[1]
    experts, weights = route(moe.router(x if router_x is None else router_x).float(), spec.top_k, spec.norm_topk_prob)
    if moe.expert_scale is not None:  # Gemma 4's per-expert scale
        weights = weights * moe.expert_scale[experts]
    order, y_rows = group_by_expert(experts)
    xs = x[order // spec.top_k]
    y = torch.empty((order.numel(), hidden), dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(torch.bincount(experts.flatten(), minlength=spec.num_experts).tolist()):
        if n:
            y[start:start + n] = moe.experts[e](xs[start:start + n])
            start += n
    gate = shared = None
    if moe.shared is not None:
        gate, shared = moe.shared_gate(x), moe.shared(x)
    return combine(y, y_rows, experts, weights, gate, shared)
