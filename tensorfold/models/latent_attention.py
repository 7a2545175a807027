"""Multi-head latent attention (MLA, DeepSeek-V3 / GLM-5) with the DSA indexer (GLM-5's sparse
attention): the block class, its spec, its cache kind (models/cache.LatentKV).

    q        q_b(rms_norm(q_a(x))) (q_lora) or q_proj(x): per head [q_nope, q_rope]
    kv       kv_a(x) = [c_raw, k_rope]; c = rms_norm(c_raw); rope on q_rope and k_rope
             (interleaved pairs, as the reference: taken apart into halves, then the half-split rope)
    cache    [c, k_rope] per position, and the indexer's key: nothing per head
    absorb   q_latent_h = W_uk_h^T q_nope_h (kv_b's key rows of head h; the op set's linear_heads:
             one GEMM per head, in one call), so
             score_h(t) = [q_latent_h, q_rope_h] . [c_t, k_rope_t] and the attention runs on the
             latent: o_latent_h = softmax-weighted sum of c_t; out_h = W_uv_h o_latent_h; the
             per-head matrices are llama.cpp's attn_k_b / attn_v_b (absorbed_parts: split from a
             checkpoint's kv_b, or read from a GGUF, in blocks as stored)
    indexer  (a "full" layer) q_i = wq_b(q_lora residual), k_i = layer_norm(wk(x)), rope on the
             first rope_dim dims of each; head weights weights_proj(x) * heads^-0.5; its scores
             choose each row's index_topk keys; a "shared" layer reuses the last full layer's
             choice (ForwardBatch.memo, keyed by that layer). While no row of the batch sees more
             than index_topk keys there is nothing to choose: the keys go to the cache, and q_i and
             the head weights are not computed
    out      o_proj(concat out_h)

One form for every row count (always absorbed, always the latent cache), and every step is
row-invariant: the GEMMs (the op set's), the norms (exact sums), rope, and the attention and the
indexer's scores (kernels/latent_attention.py: exact dot products and sums, ties to the lower
position). So chunked prefill, token-by-token prefill and decode give the same bits, and a row's
result is the one it gets alone. transformers expands the latent into per-head K/V instead; the
two forms agree within float32 rounding.
"""
from dataclasses import dataclass

import torch

from tensorfold.exact.float32 import f32
from tensorfold.kernels import latent_attention as kernels
from tensorfold.models.cache import LatentKV, LayerLatent
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import RopeConfig
from tensorfold.models.forward_batch import ForwardBatch
from tensorfold.models.moe import float32_linear
from tensorfold.models.weights import WeightReader

LATENT_NORM_EPS = 1e-6   # q_a_layernorm and kv_a_layernorm (transformers builds them with its default)
INDEX_NORM_EPS = 1e-6    # the indexer's key LayerNorm


@dataclass(frozen=True)
class IndexerSpec:
    num_heads: int
    head_dim: int
    top_k: int


@dataclass(frozen=True)
class LatentAttentionSpec:
    """layer: this layer's index (the key of the selection a shared layer reuses). indexer: the
    layer's own DSA indexer; None with selection_source set: reuse that layer's selection; both
    None: dense attention over every earlier key."""
    layer: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    rope: RopeConfig
    max_position: int
    scale: float
    indexer: IndexerSpec | None = None
    selection_source: int | None = None


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., 2n] in interleaved pairs (x0, x1), (x2, x3), ... -> [evens, odds], the half-split layout
    whose rope gives the reference's bits (it writes its rotated pairs in this layout too)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def absorbed_parts(kv_b: torch.Tensor, s: LatentAttentionSpec, prefix: str = "") -> dict:
    """kv_b [heads * (nope + v), kv_lora] split per head into the absorbed GEMMs' matrices, as
    llama.cpp's converter splits it (its attn_k_b, attn_v_b): absorb.h.k_b_proj.weight = W_uk_h^T
    [kv_lora, nope] (q_nope -> q_latent) and absorb.h.v_b_proj.weight = W_uv_h [v, kv_lora]
    (o_latent -> out)."""
    if tuple(kv_b.shape) != (s.num_heads * (s.nope_dim + s.v_dim), s.kv_lora_rank):
        raise CheckpointError(f"{prefix}kv_b_proj.weight has shape {tuple(kv_b.shape)}, expected "
                              f"({s.num_heads * (s.nope_dim + s.v_dim)}, {s.kv_lora_rank})")
    per_head = kv_b.view(s.num_heads, s.nope_dim + s.v_dim, s.kv_lora_rank)
    parts = {}
    for h in range(s.num_heads):
        parts[f"absorb.{h}.k_b_proj.weight"] = per_head[h, :s.nope_dim].T.contiguous()
        parts[f"absorb.{h}.v_b_proj.weight"] = per_head[h, s.nope_dim:].contiguous()
    return parts


def split_kv_b(tensors: dict, config: dict) -> None:
    """Every layer's self_attn.kv_b_proj.weight as absorbed_parts, in place (--quantize: the
    matrices then go into blocks as a GGUF's attn_k_b / attn_v_b do, so the two serve the same bits)."""
    for name in [n for n in tensors if n.endswith("self_attn.kv_b_proj.weight")]:
        spec = LatentAttentionSpec(0, int(config["num_attention_heads"]), None, int(config["kv_lora_rank"]),
                                   int(config["qk_nope_head_dim"]), 0, int(config["v_head_dim"]), None, 0, 0.0)
        prefix = name[:-len("kv_b_proj.weight")]
        kv_b = tensors.pop(name)
        tensors.update({prefix + part: t for part, t in absorbed_parts(kv_b, spec, prefix).items()})


class LatentWeights:
    """A latent-attention layer's weights and GEMMs, read once for the torch layer below and the
    mlx one (mlx/glm.py): the query path (q_lora or not), kv_a and its norm, o, the absorbed
    per-head projections (a Hugging Face kv_b split here; llama.cpp's attn_k_b / attn_v_b, or
    --quantize's split, as stored), the indexer and the cache kind. `norm` turns a norm weight
    into the backend's array, `indexer` builds the backend's indexer."""

    def read_weights(self, spec: LatentAttentionSpec, w: WeightReader, indexer, norm=lambda t: t) -> None:
        s = spec
        attn = w.under("self_attn.")
        if s.q_lora_rank:
            self.q_a = attn.linear("q_a_proj.weight", biases=("q_a_proj.bias",))
            self.q_a_norm = norm(attn.norm("q_a_layernorm.weight"))
            self.q_b = attn.linear("q_b_proj.weight")
        else:
            self.q_a = self.q_a_norm = None
            self.q_b = attn.linear("q_proj.weight")
        self.kv_a = attn.linear("kv_a_proj_with_mqa.weight", biases=("kv_a_proj_with_mqa.bias",))
        self.kv_a_norm = norm(attn.norm("kv_a_layernorm.weight"))
        self.o = attn.linear("o_proj.weight", biases=("o_proj.bias",))
        if attn.has("kv_b_proj.weight"):  # a Hugging Face checkpoint's kv_b (dense): split here
            absorb = WeightReader(absorbed_parts(attn.dense("kv_b_proj.weight"), s, attn.prefix), w.dtype, w.device,
                                  w.ops)
        else:  # llama.cpp's split (a GGUF's attn_k_b / attn_v_b, or --quantize's): per head, as stored
            absorb = attn
        self.absorb_k = [absorb.linear(f"absorb.{h}.k_b_proj.weight") for h in range(s.num_heads)]
        self.absorb_v = [absorb.linear(f"absorb.{h}.v_b_proj.weight") for h in range(s.num_heads)]
        self.indexer = None
        if s.indexer is not None:
            if not s.q_lora_rank:
                raise CheckpointError(f"{attn.prefix}: the DSA indexer reads the q_lora residual; q_lora_rank is unset")
            self.indexer = indexer(s.indexer, attn.under("indexer."), s.rope_dim)
        self.cache_spec = LatentKV(s.kv_lora_rank, s.rope_dim, s.indexer.head_dim if s.indexer else 0)

    def gemms(self) -> dict:
        named = {"q_b": self.q_b, "kv_a": self.kv_a, "o_proj": self.o}
        if self.q_a is not None:
            named["q_a"] = self.q_a
        for h, (k, v) in enumerate(zip(self.absorb_k, self.absorb_v)):
            named[f"absorb_k.{h}"], named[f"absorb_v.{h}"] = k, v
        if self.indexer is not None:
            named.update({f"indexer.{n}": g for n, g in self.indexer.gemms().items()})
        return named


class LatentAttention(LatentWeights):
    def __init__(self, spec: LatentAttentionSpec, w: WeightReader, ctx):
        self.spec, self.ops = spec, w.ops
        self.rope = ctx.rope_tables.get(spec.rope, spec.rope_dim, spec.max_position)
        self.read_weights(spec, w, Indexer)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerLatent) -> torch.Tensor:
        s, ops = self.spec, self.ops
        num_rows = x.shape[0]
        cos, sin = batch.rope_rows(self.rope)  # [num_rows, rope_dim] each
        q_resid = ops.rms_norm(self.q_a(x), self.q_a_norm, LATENT_NORM_EPS) if self.q_a is not None else x
        q = self.q_b(q_resid).view(num_rows, s.num_heads, s.nope_dim + s.rope_dim)
        kv = self.kv_a(x)  # [num_rows, kv_lora + rope]
        latent = ops.rms_norm(kv[:, :s.kv_lora_rank].contiguous(), self.kv_a_norm, LATENT_NORM_EPS)
        k_rope = ops.apply_rope(deinterleave(kv[:, None, s.kv_lora_rank:]).contiguous(), cos, sin)[:, 0]
        q_rope = ops.apply_rope(deinterleave(q[..., s.nope_dim:]).contiguous(), cos, sin)
        q_latent = ops.linear_heads(q[..., :s.nope_dim], self.absorb_k)  # [num_rows, heads, kv_lora]
        query = torch.cat([q_latent, q_rope], dim=-1)  # [num_rows, heads, kv_lora + rope]
        index_keys = self.indexer.keys(x, cos, sin) if self.indexer is not None else None
        kernels.write_latent(cache, torch.cat([latent, k_rope], dim=-1), index_keys, batch.slot_mapping)
        selections = self._selections(x, q_resid, cos, sin, batch, cache)
        out = ops.latent_attention(query, cache, batch, s.scale, selections)  # [num_rows, heads, kv_lora] float32
        out = out.to(x.dtype)
        heads = ops.linear_heads(out, self.absorb_v)  # [num_rows, heads, v]
        return self.o(heads.reshape(num_rows, -1))

    def _selections(self, x, q_resid, cos, sin, batch: ForwardBatch, cache: LayerLatent):
        """The rows' selection (kernels/latent_attention.dsa_select's form; None: every earlier key):
        this layer's indexer's, remembered for the shared layers after it, or the source layer's."""
        s = self.spec
        if self.indexer is not None:
            found = self.indexer.select(x, q_resid, cos, sin, batch, cache)
            batch.memo(("dsa selection", s.layer), lambda: found)
            return found
        if s.selection_source is not None:
            return batch.memo(("dsa selection", s.selection_source), lambda: None)
        return None


class Indexer:
    """The DSA indexer (the module docstring): its keys go to the cache beside the latent; its
    scores choose each row's keys (the op set's dsa_select: kernels/latent_attention.indexer_scores,
    select_top_keys, or their native and Triton forms)."""

    def __init__(self, spec: IndexerSpec, w: WeightReader, rope_dim: int):
        self.spec, self.ops, self.rope_dim = spec, w.ops, rope_dim
        self.wq_b = w.linear("wq_b.weight")
        self.wk = w.linear("wk.weight")
        self.k_norm, self.k_norm_bias = w.dense("k_norm.weight"), w.dense("k_norm.bias")
        self.weights_proj = float32_linear(w, "weights_proj.weight")  # float32, as transformers keeps it
        self.scale = spec.head_dim ** -0.5
        self.head_weight = spec.num_heads ** -0.5

    def gemms(self) -> dict:
        return {"wq_b": self.wq_b, "wk": self.wk, "weights_proj": self.weights_proj}

    def _rope(self, x, cos, sin):
        """Rope on the first rope_dim dims of each head of x [rows, heads, dim] (interleaved pairs)."""
        turned = self.ops.apply_rope(deinterleave(x[..., :self.rope_dim]).contiguous(), cos, sin)
        return torch.cat([turned, x[..., self.rope_dim:]], dim=-1)

    def keys(self, x, cos, sin) -> torch.Tensor:
        """The indexer's key per row [rows, head_dim]."""
        k = self.ops.layer_norm(self.wk(x), self.k_norm, self.k_norm_bias, INDEX_NORM_EPS)
        return self._rope(k[:, None], cos, sin)[:, 0]

    def select(self, x, q_resid, cos, sin, batch: ForwardBatch, cache: LayerLatent):
        s = self.spec
        positions = batch.positions
        if positions.numel() == 0 or int(positions.max()) < s.top_k:
            return None  # no row sees more than top_k keys: every op set's dsa_select chooses none (all of them)
        num_rows = x.shape[0]
        q = self._rope(self.wq_b(q_resid).view(num_rows, s.num_heads, s.head_dim), cos, sin)
        weights = self.weights_proj(x.float()).float() * f32(self.head_weight)  # [rows, heads]
        return self.ops.dsa_select(q, weights, cache, batch, self.scale, s.top_k)
