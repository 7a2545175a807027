"""GLM-5.x (glm_moe_dsa: transformers' GlmMoeDsaForCausalLM).

Every layer is latent attention (MLA) with DeepSeek sparse attention (models/latent_attention.py):
a q_lora path, a compressed KV with one roped key, and a DSA indexer that picks each query's
index_topk keys; layers whose indexer_types entry is "shared" reuse the last "full" layer's
choice. The feed-forward is a SwiGLU MLP on the first first_k_dense_replace layers (or as
mlp_layer_types says), then a mixture of experts (models/moe.py) with sigmoid noaux_tc routing
(e_score_correction_bias, n_group / topk_group, routed_scaling_factor, norm_topk_prob) and
n_shared_experts shared experts added ungated. Norms are plain RMSNorms (x * w).

The next-n (MTP) layer a real checkpoint holds after the last decoder layer (num_nextn_predict_layers
of them, as model.layers.{num_hidden_layers}.) is the family's MTP layer (models/mtp.py, GLM_NEXTN's
names): enorm, hnorm, eh_proj over [enorm(embed), hnorm(h)], one decoder layer as the others (latent
attention with a DSA indexer of its own, the MoE), shared_head.norm; its shared_head.head and
embed_tokens are copies of the model's head and embedding and are not read. It drafts where the
drafter asks for it (--drafter mtp / auto), and is skipped with a log line otherwise.
"""
import math
from dataclasses import replace

from tensorfold.models.blocks import BLOCKS
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs, RopeConfig
from tensorfold.models.latent_attention import IndexerSpec, LatentAttention, LatentAttentionSpec
from tensorfold.models.moe import MoE, MoESpec, SigmoidRouting
from tensorfold.models.mtp import MTPNames, MTPSpec
from tensorfold.models.spec import Family, LayerSpec, MLPSpec

MLP_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")
LAYER_TYPES = ("indexed_attention",)
# transformers' GlmMoeDsaConfig defaults for the keys a config.json may leave out
DEFAULTS = dict(first_k_dense_replace=3, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                n_shared_experts=1, index_topk=2048, index_head_dim=128, index_n_heads=32, hidden_act="silu")


def option(hf: dict, key: str):
    return hf[key] if hf.get(key) is not None else DEFAULTS.get(key)


def need(hf: dict, key: str) -> int:
    if hf.get(key) is None:
        raise CheckpointError(f"config.json: missing required key '{key}' (latent attention's)")
    return int(hf[key])


def layer_specs(args: ModelArgs) -> list[LayerSpec]:
    hf, n = args.hf, args.num_layers
    if option(hf, "hidden_act") != "silu":
        raise CheckpointError(f"config.json: hidden_act {hf['hidden_act']!r} is not served (served: silu)")
    _check_types(hf.get("layer_types") or list(LAYER_TYPES) * n, LAYER_TYPES, "layer_types", n)
    mlp_types = _check_types(_mlp_types(hf, n), MLP_TYPES, "mlp_layer_types", n)
    indexer_types = _check_types(_indexer_types(hf, n), INDEXER_TYPES, "indexer_types", n)
    specs, source = [], None
    for i in range(n):
        full = indexer_types[i] == "full"
        if not full and source is None:
            raise CheckpointError(f"config.json: indexer_types[{i}] is 'shared' and no 'full' layer comes before it")
        source = i if full else source
        specs.append(_layer(args, i, source, sparse=mlp_types[i] == "sparse"))
    return specs


def _layer(args: ModelArgs, i: int, source: int, sparse: bool) -> LayerSpec:
    """Layer i: latent attention with its own indexer (source == i) or source's choice, then the MoE
    (sparse) or the dense MLP."""
    hf = args.hf
    rope, scale = _rope_and_scale(args)
    q_lora = hf.get("q_lora_rank")
    indexer = IndexerSpec(int(option(hf, "index_n_heads")), int(option(hf, "index_head_dim")),
                          int(option(hf, "index_topk")))
    full = source == i
    mixer = LatentAttentionSpec(
        i, args.num_heads, int(q_lora) if q_lora else None, need(hf, "kv_lora_rank"), need(hf, "qk_nope_head_dim"),
        need(hf, "qk_rope_head_dim"), need(hf, "v_head_dim"), rope, args.max_position, scale,
        indexer=indexer if full else None, selection_source=None if full else source)
    return LayerSpec(mixer, _moe(hf) if sparse else MLPSpec(args.intermediate_size), args.rms_norm_eps)


def mtp_layer(args: ModelArgs) -> MTPSpec:
    """The next-n layer after the decoder's num_hidden_layers: its own DSA indexer (as DeepSeek-V3.2's),
    the MoE past the dense first layers."""
    hf, n = args.hf, args.num_layers
    declared = int(hf.get("num_nextn_predict_layers") or 0)
    names = MTPNames(f"model.layers.{n}.", "enorm.weight", "hnorm.weight", "eh_proj.weight", ("",),
                     "shared_head.norm.weight", f"next-n (MTP) layers {list(range(n, n + max(declared, 1)))}",
                     ignored=("shared_head.head.weight", "embed_tokens.weight"), chain_before_norm=True)
    if not declared:
        return MTPSpec(names, (), 0)
    types = hf.get("mlp_layer_types")  # as the last decoder layer's, else past first_k_dense_replace
    sparse = types[-1] == "sparse" if types else n >= int(option(hf, "first_k_dense_replace"))
    return MTPSpec(names, (_layer(args, n, n, sparse=sparse),), declared)


def _check_types(types: list, served: tuple, key: str, num_layers: int) -> list:
    if len(types) != num_layers:
        raise CheckpointError(f"config.json: {key} lists {len(types)} layers, num_hidden_layers is {num_layers}")
    for i, kind in enumerate(types):
        if kind not in served:
            raise CheckpointError(f"config.json: {key}[{i}] is {kind!r}; served: {', '.join(served)}")
    return list(types)


def _mlp_types(hf: dict, num_layers: int) -> list:
    if hf.get("mlp_layer_types"):
        return list(hf["mlp_layer_types"])
    dense = min(int(option(hf, "first_k_dense_replace")), num_layers)
    return ["dense"] * dense + ["sparse"] * (num_layers - dense)


def _indexer_types(hf: dict, num_layers: int) -> list:
    """The config's indexer_types, else transformers' derivation: index_topk_pattern ("FSSF...")
    or every index_topk_freq-th layer full from index_skip_topk_offset on."""
    if hf.get("indexer_types"):
        return list(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(hf.get("index_topk_freq", 1)), 1), int(hf.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def _rope_and_scale(args: ModelArgs) -> tuple[RopeConfig, float]:
    """The rope of q_rope / k_rope, and the score scale: (nope + rope)^-0.5, times mscale^2 where a
    yarn rope sets mscale_all_dim (transformers' yarn_apply_mscale); a yarn rope's table factor from
    mscale / mscale_all_dim as transformers derives it."""
    hf, rope = args.hf, args.rope
    scale = (need(hf, "qk_nope_head_dim") + need(hf, "qk_rope_head_dim")) ** -0.5
    params = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    if rope.rope_type == "yarn":
        all_dim = params.get("mscale_all_dim") or 0
        if all_dim:
            scale *= _yarn_mscale(rope.factor, all_dim) ** 2
        if rope.attention_factor is None and params.get("mscale") and all_dim:
            rope = replace(rope, attention_factor=_yarn_mscale(rope.factor, params["mscale"])
                           / _yarn_mscale(rope.factor, all_dim))
    return rope, scale


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _moe(hf: dict) -> MoESpec:
    experts = need(hf, "n_routed_experts") if hf.get("n_routed_experts") is not None else need(hf, "num_local_experts")
    n_group, topk_group = int(option(hf, "n_group")), int(option(hf, "topk_group"))
    if experts % n_group or experts // n_group < 2 or not 1 <= topk_group <= n_group:
        raise CheckpointError(f"config.json: n_group {n_group} / topk_group {topk_group} do not divide "
                              f"{experts} experts into groups of two or more")
    size = need(hf, "moe_intermediate_size")
    return MoESpec(experts, need(hf, "num_experts_per_tok"), size, size * int(option(hf, "n_shared_experts")),
                   bool(option(hf, "norm_topk_prob")),
                   SigmoidRouting(n_group, topk_group, float(option(hf, "routed_scaling_factor"))),
                   shared_gated=False, shared_prefix="shared_experts.")


BLOCKS_GLM = {**BLOCKS, LatentAttentionSpec: LatentAttention, MoESpec: MoE}
FAMILY = Family("glm_moe_dsa", layer_specs, BLOCKS_GLM, mtp_layer=mtp_layer)
