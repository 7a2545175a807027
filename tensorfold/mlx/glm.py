"""GLM-5 (glm_moe_dsa) on MLX arrays: models/latent_attention.py's latent attention with the DSA
indexer, and models/moe.py's sigmoid-routed MoE with ungated shared experts, bitwise the torch
references (kernels/latent_attention.py, kernels/moe.py). The dense first layers are mlx/model.MLP.

    LatentCache     the latent cache kind (models/cache.LatentKV) on MLX arrays: per flat slot the
                    key vector [c, k_rope] in the cache's dtype, and the indexer's key beside it
                    (none for a layer that reuses another's choice); sized as the torch backends'
    LatentAttention q_lora -> q; kv_a -> [c, k_rope] (rms_norm, the deinterleaved rope); the
                    absorbed projections per head (q_latent = W_uk^T q_nope, out = W_uv o_latent:
                    kv_b split as absorbed_parts splits it, or a GGUF's attn_k_b / attn_v_b as
                    stored), so every row count runs the one latent form, as the torch model does
    latent_attention  kernels/latent_attention.latent_attention's steps per sequence: the dot
                    products on the dot_bits grid (exact), float32 scores, exp_neg, the weighted
                    sum of c and the sum of p as exact integers, one float32 division
    Indexer         keys layer_norm(wk(x)) roped; per selecting row the scores relu(q_h . k
                    scale) times the head weight, added from head 0 in float32; the top index_topk
                    by a stable descending sort on the host (ties to the lower position); a row
                    that sees index_topk keys or fewer takes them all; a "shared" layer reuses the
                    last full layer's choice (remembered per forward)
    GLMMoE          the router in float32, mlx/nemotron_h.route_sigmoid (noaux_tc: correction
                    bias, groups, routed scale), the chosen SwiGLU experts' outputs times their
                    weights added per row in ascending expert index (float32), the shared experts
                    added ungated, then the dtype                           = models/moe.MoE.compose

The exact integers ride in float64 on MLX's CPU device (grid.float64_carrier, as mlx/ops.py's
attention) and in int64 elsewhere (grid.int_matmul, float32_of_int): both forms give the torch
reference's bits, so a quantized checkpoint's replies are the cpu backend's.
"""
import mlx.core as mx
import numpy as np
import torch
from types import SimpleNamespace

from tensorfold.exact.float32 import f32
from tensorfold.kernels.latent_attention import dot_bits
from tensorfold.kernels.paged_attention import L_BITS, NO_KEY_EXPONENT, V_BITS, W_BITS
from tensorfold.kernels.reference import MAX_NORM_WIDTH, NORM_BITS
from tensorfold.mlx import grid, ops
from tensorfold.mlx.model import MLP, DecoderLayer, MLXBatch, MLXModel, RopeRows
from tensorfold.mlx.moe import Expert
from tensorfold.mlx.nemotron_h import route_sigmoid
from tensorfold.models.cache import LatentKV
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.latent_attention import (INDEX_NORM_EPS, LATENT_NORM_EPS, IndexerSpec, LatentAttentionSpec,
                                                LatentWeights)
from tensorfold.models.moe import MoESpec, block_gemms, float32_linear
from tensorfold.models.spec import LayerSpec, MLPSpec
from tensorfold.models.weights import WeightReader


class LatentCache:
    """One latent layer's cache (models/cache.LayerLatent's contents, flat slots): kv [slots,
    latent + rope] and index_keys [slots, index_dim] (None without an indexer), in the cache dtype."""

    def __init__(self, num_slots: int, spec: LatentKV, dtype):
        self.latent_dim = spec.latent_dim
        self.kv = mx.zeros((num_slots, spec.latent_dim + spec.rope_dim), dtype=dtype)
        self.index_keys = mx.zeros((num_slots, spec.index_dim), dtype=dtype) if spec.index_dim else None

    @property
    def arrays(self) -> tuple[mx.array, ...]:
        return (self.kv,) if self.index_keys is None else (self.kv, self.index_keys)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


# ---- the exact steps (kernels/latent_attention.py) -----------------------------------------------

def _grid_side(x: mx.array, bits: int):
    """x (float32, vectors along the last dim) on its grid: the carrier form's float64 values
    x_int 2^(e - bits + 1) (exact), or the int64 form's (x_int, e)."""
    x = x.astype(mx.float32)
    if grid.float64_carrier():
        e = grid.exponent(mx.abs(x).max(axis=-1, keepdims=True)).astype(mx.int64)
        ints = grid.rint64(x.astype(mx.float64) * grid.pow2_64(bits - 1 - e))
        return ints * grid.pow2_64(e - bits + 1)
    return grid.to_fixed(x, bits)


def exact_dots(q: mx.array, keys: mx.array) -> mx.array:
    """q [..., M, D] . keys [L, D] -> [..., M, L] float32, each dot product exact and rounded once
    (kernels/latent_attention.exact_dots)."""
    bits = dot_bits(q.shape[-1])
    if grid.float64_carrier():  # every product and partial sum an integer below 2^53 times one power
        return mx.matmul(_grid_side(q, bits), _grid_side(keys, bits).T).astype(mx.float32)
    q_int, q_exp = _grid_side(q, bits)
    k_int, k_exp = _grid_side(keys, bits)
    dots = grid.int_matmul(q_int.reshape(-1, q.shape[-1]), k_int.T, bits, bits).reshape(*q.shape[:-1], -1)
    g = q_exp[..., None].astype(mx.int64) + k_exp.astype(mx.int64) - 2 * (bits - 1)
    return grid.float32_of_int(dots, g)


def latent_attention(q: mx.array, keys: mx.array, seen: mx.array, scale: float, latent_dim: int) -> mx.array:
    """One sequence's rows q [R, H, latent + rope] over its keys [L, latent + rope], each row over
    the keys `seen` [R, L] marks -> [R, H, latent] float32: kernels/latent_attention.latent_attention's
    steps and bits."""
    rows, heads, _ = q.shape
    num_keys = keys.shape[0]
    keys = keys.astype(mx.float32)
    scores = exact_dots(q, keys) * f32(scale)                               # [R, H, L]
    seen3 = seen[:, None, :]
    scores = mx.where(seen3, scores, -mx.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = mx.where(mx.isinf(row_max), 0.0, row_max)
    p = grid.exp_neg(scores - row_max)                                     # 0 where unseen
    values = keys[:, :latent_dim]
    v_exp = grid.vector_exponent(values).astype(mx.int64)                  # [L]
    top = mx.where(seen, v_exp[None, :], NO_KEY_EXPONENT).max(axis=-1)      # [R]
    top = mx.where(top == NO_KEY_EXPONENT, 0, top)[:, None, None]          # [R, 1, 1]
    chunks, size = ops.key_chunks(num_keys)
    pad = chunks * size - num_keys
    if grid.float64_carrier():
        p64 = p.astype(mx.float64)
        den = grid.rint64(p64 * float(2 ** L_BITS)).sum(axis=-1)           # exact integers
        w = grid.rint64(p64 * grid.pow2_64(v_exp[None, None, :] - top + W_BITS))  # <= 2^W_BITS
        v = _grid_side(values, V_BITS) * grid.pow2_64(V_BITS - 1 - v_exp[:, None])  # v_int, exact
        if chunks == 1:
            num = mx.matmul(w, v).astype(mx.int64)                         # below 2^53: exact
        else:  # equal chunks of at most SPLIT_SIZE keys (each exact in float64), added as int64
            w = mx.pad(w, [(0, 0), (0, 0), (0, pad)]).reshape(rows, heads, chunks, size)
            v = mx.pad(v, [(0, pad), (0, 0)]).reshape(chunks, size, latent_dim)
            num = mx.matmul(w.transpose(2, 0, 1, 3).reshape(chunks, rows * heads, size), v)
            num = num.astype(mx.int64).sum(axis=0).reshape(rows, heads, latent_dim)
        weighted = (num.astype(mx.float64) * grid.pow2_64(top - V_BITS - W_BITS + 1)).astype(mx.float32)
    else:
        pm, pe = grid.significand(p)
        den = grid.shift(pm, pe + L_BITS).sum(axis=-1)
        w = grid.shift(pm, pe + v_exp[None, None, :] + W_BITS - top)
        v_int, _ = grid.to_fixed(values, V_BITS)
        num = grid.int_matmul(w.reshape(rows * heads, num_keys), v_int, W_BITS, V_BITS).reshape(rows, heads, -1)
        weighted = grid.float32_of_int(num, top - V_BITS - W_BITS + 1)
    total = mx.maximum(den, 1).astype(mx.float32) * f32(2.0 ** -L_BITS)
    return weighted / total[..., None]


def indexer_scores(q: mx.array, weights: mx.array, keys: mx.array, scale: float) -> mx.array:
    """The indexer's scores [R, L] float32 for q [R, H, D], head weights [R, H] float32, keys [L, D]:
    relu(exact dot * scale) times the head weight, added over heads from head 0 in float32."""
    per_head = mx.maximum(exact_dots(q, keys.astype(mx.float32)) * f32(scale), 0.0)   # [R, H, L]
    total = per_head[:, 0] * weights[:, :1]
    for h in range(1, q.shape[1]):
        total = total + per_head[:, h] * weights[:, h:h + 1]
    return total


def top_positions(scores: np.ndarray, positions: np.ndarray, top_k: int) -> np.ndarray:
    """int32 [R, top_k]: each row's top_k keys by score among those at or before its position, by a
    stable descending sort (ties to the lower position), ascending, -1 pads; every key it sees where
    the sequence's keys are top_k or fewer (kernels/latent_attention.select_top_keys,
    chosen_positions)."""
    num_keys = int(positions.max()) + 1
    seen = np.arange(num_keys)[None, :] <= positions[:, None]
    if num_keys <= top_k:
        chosen = seen
    else:
        masked = np.where(seen, scores[:, :num_keys], np.float32(-np.inf))
        order = np.lexsort((-masked, ~np.isnan(masked)), axis=-1)[:, :top_k]
        chosen = np.zeros_like(seen)
        np.put_along_axis(chosen, order, True, axis=1)
        chosen &= seen
    out = np.full((len(positions), top_k), -1, dtype=np.int32)
    for r, row in enumerate(chosen):
        picked = np.flatnonzero(row)[:top_k]
        out[r, :len(picked)] = picked
    return out


def layer_norm(x: mx.array, weight: mx.array, bias: mx.array, eps: float) -> mx.array:
    """kernels/reference.layer_norm's steps: the mean from an exact sum on the row's grid (2 NORM_BITS
    bits below its largest), float32 scaled and divided by N; rms_norm's steps on x - mean; weight and
    bias in float32; x's dtype."""
    n = x.shape[-1]
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"layer_norm rows are at most {MAX_NORM_WIDTH} wide, got {n}")
    x32 = x.astype(mx.float32)
    e = grid.exponent(mx.abs(x32).max(axis=-1, keepdims=True)).astype(mx.int64)
    if grid.float64_carrier():
        ints = grid.rint64(x32.astype(mx.float64) * grid.pow2_64(2 * NORM_BITS - 1 - e))
    else:
        m, ex = grid.significand(x32)
        ints = grid.shift(m, ex + 2 * NORM_BITS - 1 - e)
    mean = grid.scale(ints.sum(axis=-1, keepdims=True).astype(mx.float32), e - 2 * NORM_BITS + 1) / n
    out = ops._normalized(x32 - mean, mx.array(f32(eps)), n)
    return (out * weight.astype(mx.float32) + bias.astype(mx.float32)).astype(x.dtype)


def deinterleave(x: mx.array) -> mx.array:
    """models/latent_attention.deinterleave: interleaved pairs -> [evens, odds]."""
    return mx.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def linear_heads(x: mx.array, weights: list) -> mx.array:
    """x [rows, heads, K] -> [rows, heads, N], head h times weights[h] (linear_weight.per_head)."""
    return mx.stack([w(x[:, h]) for h, w in enumerate(weights)], axis=1)


# ---- the blocks --------------------------------------------------------------------------------

def _mx(t: torch.Tensor) -> mx.array:
    return ops.from_torch(t)


class Indexer:
    """models/latent_attention.Indexer on MLX arrays."""

    def __init__(self, spec: IndexerSpec, w: WeightReader, rope_dim: int):
        self.spec, self.rope_dim = spec, rope_dim
        self.wq_b = w.linear("wq_b.weight")
        self.wk = w.linear("wk.weight")
        self.k_norm, self.k_norm_bias = _mx(w.dense("k_norm.weight")), _mx(w.dense("k_norm.bias"))
        self.weights_proj = float32_linear(w, "weights_proj.weight")
        self.scale = spec.head_dim ** -0.5
        self.head_weight = spec.num_heads ** -0.5

    def gemms(self) -> dict:
        return {"wq_b": self.wq_b, "wk": self.wk, "weights_proj": self.weights_proj}

    def _rope(self, x, cos, sin):
        turned = ops.apply_rope(deinterleave(x[..., :self.rope_dim]), cos, sin)
        return mx.concatenate([turned, x[..., self.rope_dim:]], axis=-1)

    def keys(self, x, cos, sin) -> mx.array:
        k = layer_norm(self.wk(x), self.k_norm, self.k_norm_bias, INDEX_NORM_EPS)
        return self._rope(k[:, None], cos, sin)[:, 0]

    def select(self, x, q_resid, cos, sin, batch: MLXBatch, cache: LatentCache) -> np.ndarray | None:
        """int32 [rows, top_k] (kernels/latent_attention.dsa_select's form), or None where no row
        sees more than top_k keys (every key then)."""
        s = self.spec
        if batch.positions.size == 0 or int(batch.positions.max()) < s.top_k:
            return None
        rows = x.shape[0]
        q = self._rope(self.wq_b(q_resid).reshape(rows, s.num_heads, s.head_dim), cos, sin)
        weights = self.weights_proj(x.astype(mx.float32)).astype(mx.float32) * f32(self.head_weight)
        out = np.full((rows, s.top_k), -1, dtype=np.int32)
        for seq in batch.sequences:
            if seq.end == seq.start:
                continue
            keys = cache.index_keys[seq.key_slots]
            scores = indexer_scores(q[seq.start:seq.end], weights[seq.start:seq.end], keys, self.scale)
            out[seq.start:seq.end] = top_positions(np.array(scores), seq.positions, s.top_k)
        return out


class LatentAttention(LatentWeights):
    """models/latent_attention.LatentAttention on MLX arrays (the module docstring); its weights
    read as the torch layer reads them (LatentWeights)."""

    def __init__(self, spec: LatentAttentionSpec, w: WeightReader, eps: float):
        self.spec = spec
        self.rope = RopeRows(spec)
        self.read_weights(spec, w, Indexer, norm=_mx)

    def __call__(self, x: mx.array, batch: MLXBatch, cache: LatentCache, rope_rows) -> mx.array:
        s, rows = self.spec, x.shape[0]
        cos, sin = rope_rows(self.rope)
        q_resid = ops.rms_norm(self.q_a(x), self.q_a_norm, LATENT_NORM_EPS) if self.q_a is not None else x
        q = self.q_b(q_resid).reshape(rows, s.num_heads, s.nope_dim + s.rope_dim)
        kv = self.kv_a(x)
        latent = ops.rms_norm(kv[:, :s.kv_lora_rank], self.kv_a_norm, LATENT_NORM_EPS)
        k_rope = ops.apply_rope(deinterleave(kv[:, None, s.kv_lora_rank:]), cos, sin)[:, 0]
        q_rope = ops.apply_rope(deinterleave(q[..., s.nope_dim:]), cos, sin)
        q_latent = linear_heads(q[..., :s.nope_dim], self.absorb_k)       # [rows, heads, kv_lora]
        query = mx.concatenate([q_latent, q_rope], axis=-1)
        cache.kv[batch.slots] = mx.concatenate([latent, k_rope], axis=-1).astype(cache.kv.dtype)
        if self.indexer is not None:
            cache.index_keys[batch.slots] = self.indexer.keys(x, cos, sin).astype(cache.index_keys.dtype)
        selection = self._selection(x, q_resid, cos, sin, batch, cache)
        out = []
        for seq in batch.sequences:
            keys = cache.kv[seq.key_slots]                                  # [L (padded), latent + rope]
            seen = _seen(seq.positions, keys.shape[0],
                         None if selection is None else selection[seq.start:seq.end])
            out.append(latent_attention(query[seq.start:seq.end], keys, seen, s.scale, s.kv_lora_rank))
        out = (out[0] if len(out) == 1 else mx.concatenate(out)).astype(x.dtype)
        heads = linear_heads(out, self.absorb_v)                            # [rows, heads, v]
        return self.o(heads.reshape(rows, -1))

    def _selection(self, x, q_resid, cos, sin, batch: MLXBatch, cache: LatentCache):
        """This layer's indexer's choice, remembered for the shared layers after it, or the source's."""
        s, memo = self.spec, batch.dsa_selections
        if self.indexer is not None:
            memo[s.layer] = self.indexer.select(x, q_resid, cos, sin, batch, cache)
            return memo[s.layer]
        return memo.get(s.selection_source) if s.selection_source is not None else None


def _seen(positions: np.ndarray, num_keys: int, selection: np.ndarray | None) -> mx.array:
    """[R, num_keys] bool: the keys at or before each row's position, and among its selection where
    one is given (kernels/latent_attention.selection_mask)."""
    seen = np.arange(num_keys)[None, :] <= positions[:, None]
    if selection is not None:
        chosen = np.zeros((len(positions), num_keys + 1), dtype=bool)
        valid = (selection >= 0) & (selection <= positions[:, None])
        np.put_along_axis(chosen, np.where(valid, selection, num_keys).astype(np.int64), True, axis=1)
        seen &= chosen[:, :num_keys]
    return mx.array(seen)


class GLMMoE:
    """models/moe.MoE with sigmoid routing (GLM-5's block) on MLX arrays."""

    def __init__(self, spec: MoESpec, w: WeightReader):
        r = spec.sigmoid_routing
        if r is None or spec.shared_gated:
            raise CheckpointError("the mlx backend's GLM MoE routes by sigmoid with ungated shared experts")
        self.spec = spec
        self.route = SimpleNamespace(top_k=spec.top_k, n_group=r.n_group, topk_group=r.topk_group,
                                     norm_topk_prob=spec.norm_topk_prob, routed_scaling_factor=r.scale)
        mlp = w.under("mlp.")
        self.router = float32_linear(mlp, "gate.weight")
        self.bias = ops.from_torch(mlp.float32("gate.e_score_correction_bias"))
        self.experts = [Expert(mlp.under(f"experts.{e}."), spec.intermediate_size) for e in range(spec.num_experts)]
        self.shared = Expert(mlp.under(spec.shared_prefix), spec.shared_intermediate_size) \
            if spec.shared_intermediate_size else None
        self.shared_gate = None

    def gemms(self) -> dict:
        return block_gemms(self)

    def __call__(self, x: mx.array) -> mx.array:
        if x.shape[0] == 0:
            return x
        logits = self.router(x.astype(mx.float32)).astype(mx.float32)
        chosen, weights = route_sigmoid(logits, self.bias, self.route)     # [rows, k] each
        out = mx.zeros(x.shape, dtype=mx.float32)
        for e in np.unique(chosen).tolist():  # ascending: each row's terms in expert order
            rows, slot = (mx.array(i.astype(np.int32)) for i in np.nonzero(chosen == e))
            out = out.at[rows].add(self.experts[e](x[rows]).astype(mx.float32) * weights[rows, slot][:, None])
        if self.shared is not None:
            out = out + self.shared(x).astype(mx.float32)
        return out.astype(x.dtype)


class GLMDecoderLayer(DecoderLayer):
    """norm -> latent attention -> add & norm -> the dense MLP or the MoE -> add."""

    def __init__(self, spec: LayerSpec, w: WeightReader):
        if not isinstance(spec.mixer, LatentAttentionSpec) or type(spec.ffn) not in (MLPSpec, MoESpec):
            raise CheckpointError(f"glm_moe_dsa on the mlx backend: a {type(spec.mixer).__name__} + "
                                  f"{type(spec.ffn).__name__} layer is not served")
        self.spec, self.eps = spec, spec.norm_eps
        self.input_norm = _mx(w.norm("input_layernorm.weight"))
        self.post_mixer_norm = _mx(w.norm("post_attention_layernorm.weight"))
        self.mixer = LatentAttention(spec.mixer, w, spec.norm_eps)
        self.ffn = GLMMoE(spec.ffn, w) if isinstance(spec.ffn, MoESpec) else MLP(spec.ffn, w)


class GLMModel(MLXModel):
    """glm_moe_dsa: every layer latent attention; the DSA choice of a forward remembered per
    source layer for the shared layers after it."""

    def layer(self, spec: LayerSpec, w: WeightReader):
        return GLMDecoderLayer(spec, w)

    def begin(self, batch: MLXBatch) -> None:
        batch.dsa_selections = {}
