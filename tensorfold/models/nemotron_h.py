"""Nemotron-H (nemotron_h: NVIDIA's Nemotron-H, Nemotron Nano 2, Nemotron 3): a hybrid whose layers
are single blocks, each one norm and one of four kinds, in the config's pattern:

    M  Mamba2 (models/mamba2.py)                                    cache: Mamba2State
    *  attention: GQA with no positional encoding (AttentionSpec with rope None)  cache: PagedKV
    -  MLP: down(relu(up(x))^2), not gated                          cache: none
    E  MoE: relu^2 experts, sigmoid routing with a correction bias and group-limited top k,
       a relu^2 shared expert added unweighted; optional latent projections around the experts

    x -> norm -> block -> + x        (LayerSpec with the other part None: models/blocks.DecoderLayer)

The pattern is `hybrid_override_pattern` (the Hub's configs: "M-M*-E...") or `layers_block_type`
(transformers' configs: mamba / linear_attention, attention / full_attention, mlp, moe); any
other letter or name is a startup error naming it. The Hub's checkpoints name tensors under
`backbone.` with the experts one by one, transformers' under `model.` with them stacked
([E, I, H], split at load); both are read, under the decoder's names (tensor_name).

The multi-token-prediction layers (Nemotron 3's mtp.layers.{0..k-1}.*, num_nextn_predict_layers 1)
are the family's MTP layer (models/mtp.py, NEMOTRON_H_MTP's names): single-block layers in the
config's MTP pattern (mtp_hybrid_override_pattern, e.g. "*E", or mtp_layers_block_type, e.g.
['attention', 'moe']; attention and MoE layers are served, each cache kind per position), the
first with enorm / hnorm / eh_proj, the last with final_layernorm; the model's embedding and head.
They draft where the drafter asks for them, else they are skipped with a log line.

The MoE's routing (kernels/moe.route_sigmoid) and its sum are exact as the Qwen MoE's are: the
choice from the row alone with ties to the lower index, weights summed in rank order, experts'
outputs added in ascending expert index from 0 in float32.
"""
from dataclasses import dataclass

import torch

from tensorfold.models.blocks import BLOCKS
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.mamba2 import Mamba2, Mamba2Spec
from tensorfold.models.moe import float32_linear
from tensorfold.models.mtp import PREFIX as MTP_PREFIX, MTPNames, MTPSpec
from tensorfold.models.spec import AttentionSpec, Family, LayerSpec
from tensorfold.models.weights import WeightReader

MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}  # hybrid_override_pattern's letters
NAMES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION,
         "mlp": MLP, "moe": MOE}  # layers_block_type's names, legacy and transformers 5's
# transformers' NemotronHConfig defaults, and the legacy spellings of its Mamba keys
DEFAULTS = dict(n_groups=8, conv_kernel=4, ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64,
                time_step_limit=(0.0, float("inf")), use_conv_bias=True, mlp_hidden_act="relu2",
                mamba_hidden_act="silu", layer_norm_epsilon=1e-5, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688, n_group=1, topk_group=1,
                norm_topk_prob=True, routed_scaling_factor=1.0, moe_latent_size=None)
LEGACY = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "time_step_limit": "mamba_dt_limit",
          "use_conv_bias": "mamba_conv_bias"}
ATTENTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")
FFN_NAMES = ("up_proj", "down_proj", "gate", "experts", "shared_experts", "fc1_latent_proj", "fc2_latent_proj")


def option(hf: dict, key: str):
    """A config value: its key, its legacy spelling, else transformers' default."""
    if hf.get(key) is not None:
        return hf[key]
    if LEGACY.get(key) in hf:
        return hf[LEGACY[key]]
    return DEFAULTS.get(key)


def layer_kinds(hf: dict) -> list[str]:
    """Each layer's kind (MAMBA, ATTENTION, MLP, MOE) from layers_block_type or hybrid_override_pattern."""
    if hf.get("layers_block_type"):
        names = list(hf["layers_block_type"])
        for i, name in enumerate(names):
            if name not in NAMES:
                raise CheckpointError(f"config.json: layers_block_type[{i}] is {name!r}; served: {', '.join(NAMES)}")
        return [NAMES[name] for name in names]
    pattern = hf.get("hybrid_override_pattern")
    if not pattern:
        raise CheckpointError("config.json: nemotron_h needs hybrid_override_pattern or layers_block_type")
    for i, letter in enumerate(pattern):
        if letter not in PATTERN:
            raise CheckpointError(f"config.json: hybrid_override_pattern[{i}] is {letter!r} (a layer kind not "
                                  f"served; served: {', '.join(PATTERN)})")
    return [PATTERN[letter] for letter in pattern]


def layer_specs(args: ModelArgs) -> list[LayerSpec]:
    hf = args.hf
    kinds = layer_kinds(hf)
    if hf.get("num_hidden_layers") not in (None, len(kinds)):
        raise CheckpointError(f"config.json: the layer pattern lists {len(kinds)} layers, num_hidden_layers is "
                              f"{hf['num_hidden_layers']}")
    for key, served in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if option(hf, key) != served:
            raise CheckpointError(f"config.json: {key} {option(hf, key)!r} is not served (served: {served})")
    eps = float(option(hf, "layer_norm_epsilon"))
    made = {MAMBA: lambda: LayerSpec(_mamba(hf), None, eps),
            ATTENTION: lambda: LayerSpec(_attention(args), None, eps),
            MLP: lambda: LayerSpec(None, ReluSquaredMLPSpec(args.intermediate_size), eps),
            MOE: lambda: LayerSpec(None, _moe(hf), eps)}
    return [made[kind]() for kind in kinds]


def mtp_layer(args: ModelArgs) -> MTPSpec:
    """The MTP layer's single-block layers in the config's MTP pattern (attention or MoE each)."""
    hf = args.hf
    declared = int(hf.get("num_nextn_predict_layers") or 0)
    kinds = _mtp_kinds(hf) if declared else []
    names = MTPNames(MTP_PREFIX, "layers.0.enorm.weight", "layers.0.hnorm.weight", "layers.0.eh_proj.weight",
                     tuple(f"layers.{i}." for i in range(len(kinds))), f"layers.{len(kinds) - 1}.final_layernorm.weight")
    if not declared:
        return MTPSpec(names, (), 0)
    eps = float(option(hf, "layer_norm_epsilon"))
    made = {ATTENTION: lambda: LayerSpec(_attention(args), None, eps), MOE: lambda: LayerSpec(None, _moe(hf), eps),
            MLP: lambda: LayerSpec(None, ReluSquaredMLPSpec(args.intermediate_size), eps)}
    return MTPSpec(names, tuple(made[kind]() for kind in kinds), declared)


def _mtp_kinds(hf: dict) -> list[str]:
    """The MTP layers' kinds: mtp_layers_block_type (transformers') or mtp_hybrid_override_pattern
    (the Hub's), else transformers' default (attention, then MoE)."""
    if hf.get("mtp_layers_block_type"):
        names = list(hf["mtp_layers_block_type"])
        where = "mtp_layers_block_type"
    else:
        pattern = hf.get("mtp_hybrid_override_pattern") or "*E"
        names = [PATTERN.get(letter, letter) for letter in pattern]
        where = "mtp_hybrid_override_pattern"
    kinds = [NAMES.get(name, name) for name in names]
    for i, kind in enumerate(kinds):
        if kind not in (ATTENTION, MOE, MLP):
            raise CheckpointError(f"config.json: {where}[{i}] is {names[i]!r}; an MTP layer serves attention, "
                                  "moe and mlp blocks")
    return kinds


def _mamba(hf: dict) -> Mamba2Spec:
    heads, groups = int(option(hf, "mamba_num_heads")), int(option(hf, "n_groups"))
    if heads % groups:
        raise CheckpointError(f"config.json: mamba_num_heads {heads} is not a multiple of n_groups {groups}")
    lo, hi = (_number(v) for v in option(hf, "time_step_limit"))
    return Mamba2Spec(heads, int(option(hf, "mamba_head_dim")), groups, int(option(hf, "ssm_state_size")),
                      int(option(hf, "conv_kernel")), (lo, hi))


def _number(value) -> float:
    """A config float, in the Hub's JSON (Infinity) or transformers' ({"__float__": "Infinity"})."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def _attention(args: ModelArgs) -> AttentionSpec:
    hf = args.hf
    head_dim = int(hf.get("head_dim") or hf.get("attention_head_dim") or args.hidden_size // args.num_heads)
    return AttentionSpec(args.num_heads, args.num_kv_heads, head_dim, None, args.max_position)


def _moe(hf: dict) -> "NemotronMoESpec":
    experts, n_group = int(option(hf, "n_routed_experts")), int(option(hf, "n_group"))
    if experts % n_group or (n_group > 1 and experts // n_group < 2):
        raise CheckpointError(f"config.json: {experts} experts do not split into {n_group} groups of two or more")
    latent = option(hf, "moe_latent_size")
    return NemotronMoESpec(experts, int(option(hf, "num_experts_per_tok")), int(option(hf, "moe_intermediate_size")),
                           int(option(hf, "moe_shared_expert_intermediate_size")), n_group,
                           int(option(hf, "topk_group")), bool(option(hf, "norm_topk_prob")),
                           float(option(hf, "routed_scaling_factor")), int(latent) if latent else None)


# ---- the feed-forward blocks -------------------------------------------------------------------

@dataclass(frozen=True)
class ReluSquaredMLPSpec:
    """A non-gated MLP: down(relu(up(x))^2)."""
    intermediate_size: int


class ReluSquared:
    """up, relu^2, down (an expert, the shared expert, an MLP layer), its weights as LinearWeights."""

    def __init__(self, up, down, ops):
        self.up, self.down, self.ops = up, down, ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.ops.relu_squared(self.up(x)))


class ReluSquaredMLP:
    def __init__(self, spec: ReluSquaredMLPSpec, w: WeightReader, ctx):
        mlp = w.under("mlp.")
        self.spec, self.cache_spec = spec, None
        self.mlp = ReluSquared(mlp.linear("up_proj.weight", biases=("up_proj.bias",)),
                               mlp.linear("down_proj.weight", biases=("down_proj.bias",)), w.ops)

    def gemms(self) -> dict:
        return {"up": self.mlp.up, "down": self.mlp.down}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def moe_gemms(block) -> dict:
    """A Nemotron-H MoE block's GEMMs by name (router, experts, shared expert, latent projections):
    the torch and the mlx block alike (both keep these attributes)."""
    named = {"router": block.router}
    for e, expert in enumerate(block.experts):
        named[f"experts.{e}.up"], named[f"experts.{e}.down"] = expert.up, expert.down
    named.update({"shared.up": block.shared.up, "shared.down": block.shared.down})
    if block.fc1 is not None:
        named.update({"fc1_latent": block.fc1, "fc2_latent": block.fc2})
    return named


@dataclass(frozen=True)
class NemotronMoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int             # each routed expert's
    shared_intermediate_size: int      # the shared expert's
    n_group: int = 1                   # experts in n_group groups; the best topk_group groups
    topk_group: int = 1                #   (by their two best scores) are the ones chosen from
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    latent_size: int | None = None     # experts run at this width between fc1/fc2 latent projections


class NemotronMoE:
    """route (ops.route_sigmoid, the router in float32 on float32 inputs) -> [fc1] -> each chosen expert over its rows, times its weight,
    added in ascending expert index (float32) -> [fc2] -> + the shared expert."""

    def __init__(self, spec: NemotronMoESpec, w: WeightReader, ctx):
        self.spec, self.ops, self.cache_spec = spec, w.ops, None
        mlp = w.under("mlp.")
        self.router = float32_linear(mlp, "gate.weight")  # float32, as transformers keeps it
        self.bias = (mlp.float32("gate.e_score_correction_bias") if mlp.has("gate.e_score_correction_bias")
                     else torch.zeros(spec.num_experts, device=w.device))
        self.experts = [ReluSquared(mlp.linear(f"experts.{e}.up_proj.weight"), mlp.linear(f"experts.{e}.down_proj.weight"),
                                    w.ops) for e in range(spec.num_experts)]
        shared = mlp.under("shared_experts.")
        self.shared = ReluSquared(shared.linear("up_proj.weight"), shared.linear("down_proj.weight"), w.ops)
        self.fc1 = self.fc2 = None
        if spec.latent_size:
            self.fc1, self.fc2 = mlp.linear("fc1_latent_proj.weight"), mlp.linear("fc2_latent_proj.weight")

    def gemms(self) -> dict:
        return moe_gemms(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        chosen, weights = self.ops.route_sigmoid(self.router(x.float()).float(), self.bias, s.top_k, s.n_group, s.topk_group,
                                                 s.norm_topk_prob, s.routed_scaling_factor)
        inner = self.fc1(x) if self.fc1 is not None else x
        out = torch.zeros(inner.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(chosen).tolist():  # ascending: each row's terms in expert order
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            out[rows] += self.experts[e](inner[rows]).float() * weights[rows, slot, None]
        routed = out.to(x.dtype)
        if self.fc2 is not None:
            routed = self.fc2(routed)
        return routed + self.shared(x)


# ---- tensor names ------------------------------------------------------------------------------

def tensor_name(name: str) -> str | None:
    """A checkpoint tensor under the decoder's names: backbone. as model., the embedding and final
    norm as embed_tokens and norm, a layer's one norm as its input norm, and its mixer's tensors
    under self_attn. (attention), mlp. (MLP, MoE) or mixer. (Mamba2); the MTP layers' the same way
    under mtp.layers.N. (their enorm, hnorm, eh_proj and final_layernorm as they are)."""
    for prefix in ("model.mtp.", "backbone.mtp."):
        if name.startswith(prefix):
            name = name[len(prefix) - len("mtp."):]
    if name.startswith("mtp.layers."):
        return _block_name("mtp.layers.", name[len("mtp.layers."):])
    if name.startswith("backbone."):
        name = "model." + name[len("backbone."):]
    if name == "model.embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "model.norm_f.weight":
        return "model.norm.weight"
    if not name.startswith("model.layers."):
        return name
    return _block_name("model.layers.", name[len("model.layers."):])


def _block_name(layers: str, rest: str) -> str:
    """A block's tensor `layers` + "N.<rest>" under the decoder's names."""
    layer, rest = rest.split(".", 1)
    prefix = f"{layers}{layer}."
    if rest == "norm.weight":
        return prefix + "input_layernorm.weight"
    if rest.startswith("mixer."):
        inner = rest[len("mixer."):]
        first = inner.split(".", 1)[0]
        if first in ATTENTION_NAMES:
            return prefix + "self_attn." + inner
        if first in FFN_NAMES:
            return prefix + "mlp." + inner
    return prefix + rest


BLOCKS_NEMOTRON_H = {**BLOCKS, Mamba2Spec: Mamba2, ReluSquaredMLPSpec: ReluSquaredMLP, NemotronMoESpec: NemotronMoE}
FAMILY = Family("nemotron_h", layer_specs, BLOCKS_NEMOTRON_H, tensor_name=tensor_name, mtp_layer=mtp_layer)
