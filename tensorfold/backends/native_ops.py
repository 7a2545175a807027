"""The cpu backend's compiled op set: csrc/cpu's exact kernels (the extension tensorfold._cpu).

Every op is bitwise its torch reference (kernels/reference.py, kernels/paged_attention.py),
including the GEMMs: the dense one's order of summation is fixed by K alone, the quantized one
(kernels/quant_gemm.py) sums integers: no BLAS runs on the token
path, so exactness holds whatever CPU this is. Importing this module fails (ImportError) when
the extension was not built; backends.backend_ops then falls back to cpu_ops.
"""
import functools
from dataclasses import dataclass

import torch

from tensorfold import _cpu
from tensorfold.backends.huge_pages import arena
from tensorfold.backends.linear_weight import LinearWeight, per_head
from tensorfold.kernels import paged_attention
from tensorfold.kernels.paged_attention import pad_block_tables
# the references' own: padding rows, and the rope tables (made once, read by every op set)
from tensorfold.kernels.reference import pad_rows, rope_table  # noqa: F401
from tensorfold.kernels.reference import layer_norm as reference_layer_norm
from tensorfold.models.blocks import MLP, Attention, DecoderLayer
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.gguf_quants import FileBlocks, FileStack, file_rows
from tensorfold.models.linear_attention import GatedDeltaNet
from tensorfold.models.mamba2 import Mamba2
from tensorfold.models.moe import MoE
from tensorfold.sampling import sampler

# the ISA the kernels were built for, and "+amx" where the quantized GEMM takes prompt rows on AMX tiles
NAME = f"native-{_cpu.isa()}" + ("+amx" if _cpu.quant_amx_path() == "amx" else "")
# The KV cache keeps a record of its V rows' exponents (LayerKV.v_exp), which write_kv fills and
# the attention reads: its first pass (the maxima) then reads K alone, not K and V.
V_EXPONENT_RECORD = True
MAX_HEAD_DIM = paged_attention.MAX_HEAD_DIM  # the C++ rope, K/V write and attention take heads up to this width


@dataclass(frozen=True)
class Packed:
    data: torch.Tensor          # the kernel's layout
    n: int
    k: int
    quantized: bool


rms_norm = _cpu.rms_norm
add_rms_norm = _cpu.add_rms_norm
apply_rope = _cpu.apply_rope
rms_norm_rope = _cpu.rms_norm_rope
silu_and_mul = _cpu.silu_and_mul
sigmoid_and_mul = _cpu.sigmoid_and_mul
gelu_tanh_and_mul = _cpu.gelu_tanh_and_mul  # Gemma's GeGLU
gated_rms_norm = _cpu.gated_rms_norm


def layer_norm(x, weight, bias, eps):
    """reference.layer_norm (the DSA indexer's key norm) in C++; the reference where weight or bias
    is not in x's dtype."""
    if weight.dtype != x.dtype or bias.dtype != x.dtype:
        return reference_layer_norm(x, weight, bias, eps)
    return _cpu.layer_norm(x, weight, bias, eps)


def delta_net(qkv, a, b, state, batch, params):
    """Gated DeltaNet's mixing of a ForwardBatch's rows in one call (kernels/delta_net.delta_net's
    signature and bits): state is the layer's models/cache.LayerState, written in place."""
    p = params
    state_in, state_out = batch.state_slots(state.block_size)
    return _cpu.delta_net(qkv, a, b, state.conv, state.ssm, state_in, state_out, batch.row_starts_tensor,
                          p.conv_weight, p.rate, p.dt_bias, p.num_key_heads, p.num_heads, p.key_dim, p.value_dim)


def mamba2(xbc, dt, state, batch, params):
    """Mamba2's mixing of a ForwardBatch's rows in one call (kernels/mamba2.mamba2's signature and
    bits): state is the layer's models/cache.LayerState, written in place."""
    p = params
    state_in, state_out = batch.state_slots(state.block_size)
    return _cpu.mamba2(xbc, dt, state.conv, state.ssm, state_in, state_out, batch.row_starts_tensor, p.conv_weight,
                       p.conv_bias, p.rate, p.dt_bias, p.d, p.dt_min, p.dt_max, p.num_heads, p.head_dim, p.n_groups,
                       p.state_size)


mamba2_gated_norm = _cpu.mamba2_gated_norm  # kernels/mamba2.gated_group_norm's signature and bits

def latent_attention(query, cache, batch, scale, selection):
    """Latent attention (MLA) of all rows of a ForwardBatch over one layer's latent cache
    (models/cache.LayerLatent) in one call: kernels/latent_attention.attention_by_sequence's
    signature and bits; selection: dsa_select's (None: every earlier key)."""
    return _cpu.latent_attention(query, cache.kv, batch.positions, batch.block_tables, batch.row_starts_tensor,
                                 scale, cache.latent_dim, selection)


def dsa_select(q, weights, cache, batch, scale, top_k):
    """The DSA indexer's choice for all rows of a ForwardBatch in one call (kernels/latent_attention.
    dsa_select's signature and bits): int32 [rows, top_k], or None where no row sees more than top_k keys."""
    positions = batch.positions
    if positions.numel() == 0 or int(positions.max()) < top_k:
        return None
    return _cpu.dsa_select(q, weights, cache.index_keys, positions, batch.block_tables, batch.row_starts_tensor, scale,
                           top_k)


def route(logits, top_k, normalize):
    """kernels/moe.route's choice and weights (C++)."""
    return _cpu.moe_route(logits, top_k, normalize)


def route_sigmoid(logits, bias, top_k, n_group, topk_group, normalize, scale):
    """kernels/moe.route_sigmoid's choice and weights (C++): GLM-5's and Nemotron-H's routing."""
    return _cpu.moe_route_sigmoid(logits, bias, top_k, n_group, topk_group, normalize, scale)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """reference.relu_squared (Nemotron-H's MLPs and experts) in C++: one pass, the same bits."""
    return _cpu.relu_squared(x)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """reference.softcap (Gemma's final logit soft-capping) in C++: the same float32 steps."""
    return _cpu.softcap(logits.float(), cap)


# the keyed draw with the C++ steps (draw_rows, sample_keys, top_keys, gumbel): sampler.sample's bits
sample = functools.partial(sampler.sample, native=_cpu)


class Linear(LinearWeight):
    """A GEMM weight in the kernels' layouts (packed once, at load, in huge pages where the OS has
    them: backends/huge_pages.py; a decode step streams every weight): dense parts in the dense
    GEMM's tile layout, quantized parts (kernels/quant_gemm.QuantWeight) in the quantized GEMM's
    one byte tensor that carries its kind and shape."""

    reads_files = True

    def pack(self, part) -> Packed:
        if isinstance(part, (FileBlocks, FileStack)):
            rows = file_rows(part)
            if rows is None:  # rearranged after reading (a hybrid's permutations): the reference's form first
                part = part.load()
            else:  # straight from the file's bytes into huge pages: the bytes pack_quant gives
                path, offsets = rows
                n, k = part.shape
                data = arena.empty(_cpu.quant_file_bytes(part.kind, n, k))
                try:
                    _cpu.pack_quant_file(data, part.kind, path, offsets, k)
                except ValueError as e:
                    raise CheckpointError(f"{path}: tensor {part.name} ({part.qtype.name}) {e}") from e
                return Packed(data, n, k, quantized=True)
        if self.quantized(part):
            data = _cpu.pack_quant(part.kind, part.codes, part.scale, part.scale_exp, part.min, part.min_exp)
            return Packed(arena.place(data), *part.shape, quantized=True)
        return Packed(arena.place(_cpu.pack_weight(part)), *part.shape, quantized=False)

    def multiply(self, x: torch.Tensor, packed: Packed) -> torch.Tensor:
        if packed.quantized:
            return _cpu.quant_linear(x, packed.data, packed.n, packed.k)
        return _cpu.linear_packed(x, packed.data, packed.n, packed.k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of a quantized table, dequantized (float32): the embedding lookup."""
        packed = self.single
        if packed is None or not packed.quantized:
            raise TypeError("rows() reads a one-part quantized weight (dense tables are looked up as tensors)")
        return _cpu.quant_rows(packed.data, ids, packed.n, packed.k)


def linear_heads(x: torch.Tensor, weights: list) -> torch.Tensor:
    """x [rows, heads, K] -> [rows, heads, N], head h times weights[h] (latent attention's absorbed
    projections) in one call where every weight is one packed part of one format and shape without a
    bias (the quantized ones in one parallel region); each head's bits are its own GEMM's."""
    parts = [w.single for w in weights]
    if any(p is None for p in parts) or any(w.bias is not None for w in weights) or \
            len({(p.n, p.k, p.quantized) for p in parts}) != 1:
        return per_head(x, weights)
    return _cpu.linear_heads(x, [p.data for p in parts], parts[0].quantized, parts[0].n, parts[0].k)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight^T (+ bias) for a plain [N, K] tensor, packed per call."""
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


def attention(q, kv, batch, scale, window):
    """All rows of a ForwardBatch over one layer's cache (kv: models/cache.LayerKV, its record of
    V's exponents included) in one call."""
    return _cpu.paged_attention(q, kv.k, kv.v, batch.positions, batch.block_tables, batch.row_starts_tensor, scale,
                                window or 0, v_exp=kv.v_exp)


def write_kv(kv, k, v, slots):
    """k, v [num_rows, num_kv_heads, head_dim] into the layer's cache, recording V's exponents."""
    _cpu.write_kv(kv.k, kv.v, k, v, slots, v_exp=kv.v_exp)


def fuse(layer):
    """A DecoderLayer (models/blocks.py) as one native call, or None where the native layers do
    not cover it (biases, an o_proj or MLP of mixed formats, other block kinds; a qkv of several
    parts, such as Q4_K_M's Q4_K q and k beside a Q6_K v, is covered): the block's Python
    composition, the same bits (tests/test_native_backend.py, tests/test_hybrids.py), with one
    Python-to-C++ crossing per layer instead of eleven. The C++ layer (_cpu.DecoderLayer for
    attention, _cpu.DeltaNetLayer for Gated DeltaNet, each with a SwiGLU MLP or the MoE block
    fuse_moe built; _cpu.Mamba2Layer for Nemotron-H's single-block Mamba2 layers) is built once
    here, its weights checked once; the callable has DecoderLayer.forward's signature."""
    if type(layer) is not DecoderLayer:  # a family's own layer (Gemma 4's) runs its composition
        return None
    mixer, ffn = layer.mixer, layer.ffn
    if ffn is None and type(mixer) is Mamba2:  # Nemotron-H's single-block Mamba2 layer
        return _fuse_mamba2(layer)
    ffn_args = _ffn_args(ffn)
    if ffn_args is None:
        return None
    if type(mixer) is GatedDeltaNet:
        return _fuse_delta_net(layer, ffn_args)
    if type(mixer) is not Attention or not _single_parts((mixer.o,)) or mixer.qkv.bias is not None:
        return None
    s = mixer.spec
    native = _cpu.DecoderLayer(
        [part.data for part in mixer.qkv.parts], mixer.o.single.data, qkv_widths=list(mixer.qkv.widths),
        post_norm=layer.post_mixer_norm, q_norm=mixer.q_norm,
        k_norm=mixer.k_norm,
        num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, hidden=layer.input_norm.shape[0],
        eps=layer.eps, scale=s.scale, window=s.window or 0, rope_dim=s.rope_dim, output_gate=s.output_gate,
        **ffn_args)

    def run(x, residual, next_norm, batch, kv):
        cos, sin = batch.rope_rows(mixer.rope)
        return native.forward(x, residual, next_norm, cos, sin, kv.k, kv.v, kv.v_exp, batch.slot_mapping,
                              batch.positions, batch.block_tables, batch.row_starts_tensor)
    return run


def _ffn_args(ffn) -> dict | None:
    """The native layers' feed-forward arguments: a SwiGLU MLP's packed gate_up and down, or the
    MoE block fuse_moe built; None where neither applies."""
    if type(ffn) is MLP and ffn.spec.activation == "silu" and _single_parts((ffn.gate_up, ffn.down)):
        return dict(gate_up=ffn.gate_up.single.data, down=ffn.down.single.data,
                    intermediate=ffn.spec.intermediate_size)
    if type(ffn) is MoE and ffn._fused is not None:
        return dict(gate_up=None, down=None, intermediate=0, moe=ffn._fused)
    return None


def _single_parts(weights) -> bool:
    """Whether each weight is one packed part without a bias or input order (what the native
    layers take)."""
    return all(w.single is not None and w.bias is None and w.in_order is None for w in weights)


def _fuse_delta_net(layer, ffn_args: dict):
    """A Gated DeltaNet layer with its feed-forward as one _cpu.DeltaNetLayer call
    (GatedDeltaNet.forward and DecoderLayer's add, norm and MLP or MoE, the same kernels in the
    same order)."""
    mixer = layer.mixer
    out = mixer.out_proj  # its input may be taken in the file's column order (in_order): the layer does it
    if not _single_parts((mixer.in_proj,)) or out.single is None or out.bias is not None or mixer.eps != layer.eps:
        return None
    s, p = mixer.spec, mixer.params
    native = _cpu.DeltaNetLayer(
        mixer.in_proj.single.data, out.single.data, post_norm=layer.post_mixer_norm,
        gated_norm=mixer.norm.contiguous(), conv_weight=p.conv_weight, rate=p.rate, dt_bias=p.dt_bias,
        num_key_heads=s.num_key_heads, num_heads=s.num_heads, key_dim=s.key_dim, value_dim=s.value_dim,
        hidden=layer.input_norm.shape[0], eps=layer.eps, out_order=out.in_order, **ffn_args)

    def run(x, residual, next_norm, batch, state):
        state_in, state_out = batch.state_slots(state.block_size)
        return native.forward(x, residual, next_norm, state.conv, state.ssm, state_in, state_out,
                              batch.row_starts_tensor)
    return run


def _fuse_mamba2(layer):
    """A single-block Mamba2 layer (Nemotron-H) as one _cpu.Mamba2Layer call: Mamba2.forward and
    DecoderLayer's add and next norm, the same kernels in the same order."""
    mixer = layer.mixer
    if not _single_parts((mixer.in_proj, mixer.out_proj)) or mixer.eps != layer.eps:
        return None
    s, p = mixer.spec, mixer.params
    native = _cpu.Mamba2Layer(
        mixer.in_proj.single.data, mixer.out_proj.single.data, norm=mixer.norm.contiguous(),
        conv_weight=p.conv_weight, conv_bias=p.conv_bias, rate=p.rate, dt_bias=p.dt_bias, d=p.d,
        num_heads=s.num_heads, head_dim=s.head_dim, n_groups=s.n_groups, state_size=s.state_size,
        hidden=layer.input_norm.shape[0], eps=layer.eps, dt_min=p.dt_min, dt_max=p.dt_max)

    def run(x, residual, next_norm, batch, state):
        state_in, state_out = batch.state_slots(state.block_size)
        return native.forward(x, residual, next_norm, state.conv, state.ssm, state_in, state_out,
                              batch.row_starts_tensor)
    return run


def fuse_moe(moe):
    """An MoE block (models/moe.py) as one _cpu.MoEBlock call: the router (on router_x where given),
    the route (softmax, or GLM-5's sigmoid routing with its correction bias and groups, the router
    in float32), the per-expert scale (Gemma 4's), the chosen SwiGLU or GeGLU experts over their
    tokens and the shared expert (gated, or added as it is: GLM-5), MoE.compose's kernels in its
    order; None where a weight is not one packed part without a bias, or a sigmoid router is dense
    in another dtype than float32."""
    weights = [moe.router, *(w for e in moe.experts for w in (e.gate_up, e.down))]
    if moe.shared is not None:
        weights += [moe.shared.gate_up, moe.shared.down] + ([moe.shared_gate] if moe.shared_gate is not None else [])
    if not _single_parts(weights):
        return None
    s, shared, r = moe.spec, moe.shared, moe.spec.sigmoid_routing
    routing = {}
    if r is not None:
        router = moe.router.single
        if not router.quantized and router.data.dtype != torch.float32:
            return None
        routing = dict(route_bias=moe.bias, n_group=r.n_group, topk_group=r.topk_group, route_scale=r.scale)
    native = _cpu.MoEBlock(
        moe.router.single.data, [e.gate_up.single.data for e in moe.experts],
        [e.down.single.data for e in moe.experts],
        shared_gate_up=shared.gate_up.single.data if shared else None,
        shared_down=shared.down.single.data if shared else None,
        shared_gate=moe.shared_gate.single.data if moe.shared_gate is not None else None,
        hidden=moe.router.single.k, top_k=s.top_k, intermediate=s.intermediate_size,
        shared_intermediate=s.shared_intermediate_size if shared else 0, normalize=s.norm_topk_prob,
        activation=s.activation, expert_scale=moe.expert_scale, shared_gated=moe.shared_gate is not None, **routing)
    return native  # callable: native(x[, router_x]) is its forward; the fused layers take it as their feed-forward
