"""The Qwen hybrids: Qwen3.5 / Qwen3.8 (qwen3_5, dense), Qwen3.6 (qwen3_5_moe) and Qwen3-Next
(Flash Next). Three layers in four are Gated DeltaNet (models/linear_attention.py), the rest
gated full attention: QK-norm, rope on the first quarter of each head (Qwen's M-RoPE, whose
three position rows are equal for text, so plain rope), and the output times sigmoid of a gate
that q_proj gives per head. The feed-forward is a SwiGLU MLP (qwen3_5) or a mixture of experts
with a gated shared expert (models/moe.py). Every RMSNorm weight is stored as an offset from 1
(the norm multiplies by 1 + w), except the gated norm inside DeltaNet.

The multimodal checkpoints (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration)
keep the text model under model.language_model. and its config under text_config; the vision
tower (model.visual.) is not served yet and is skipped, with a log line, at load. The
multi-token-prediction layer (mtp.*: fc, pre-fc norms, one gated-attention decoder layer with the
model's feed-forward kind, a final norm; models/mtp.py) is kept under its own names and loaded
where the config declares it (mtp_num_hidden_layers) and drafting may use it (--drafter).
"""
import logging

from tensorfold.models.blocks import BLOCKS
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.linear_attention import GatedDeltaNet, LinearAttentionSpec
from tensorfold.models.moe import MoE, MoESpec
from tensorfold.models.mtp import PREFIX as MTP_PREFIX, MTPNames, MTPSpec
from tensorfold.models.spec import AttentionSpec, Family, LayerSpec, MLPSpec

log = logging.getLogger("tensorfold.models")
LAYER_TYPES = ("linear_attention", "full_attention")
SKIPPED = ("model.visual.",)


def layer_specs(args: ModelArgs) -> list[LayerSpec]:
    hf = args.hf
    types = hf.get("layer_types") or _interval_types(args.num_layers, int(hf.get("full_attention_interval", 4)))
    if len(types) != args.num_layers:
        raise CheckpointError(f"config.json: layer_types lists {len(types)} layers, num_hidden_layers is "
                              f"{args.num_layers}")
    specs = []
    for i, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise CheckpointError(f"config.json: layer_types[{i}] is {kind!r}; served: {', '.join(LAYER_TYPES)}")
        mixer = _linear_attention(hf) if kind == "linear_attention" else _gated_attention(args)
        specs.append(LayerSpec(mixer, _ffn(args, i), args.rms_norm_eps))
    return specs


def _interval_types(num_layers: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def _gated_attention(args: ModelArgs) -> AttentionSpec:
    rope_params = args.hf.get("rope_parameters") or {}
    factor = args.hf.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 0.25))
    return AttentionSpec(args.num_heads, args.num_kv_heads, args.head_dim, args.rope, args.max_position,
                         qk_norm=True, rotary_dim=int(args.head_dim * factor), output_gate=True)


def _linear_attention(hf: dict) -> LinearAttentionSpec:
    def need(key):
        if hf.get(key) is None:
            raise CheckpointError(f"config.json: missing required key '{key}' (a linear-attention layer's)")
        return int(hf[key])
    return LinearAttentionSpec(need("linear_num_key_heads"), need("linear_num_value_heads"),
                               need("linear_key_head_dim"), need("linear_value_head_dim"),
                               need("linear_conv_kernel_dim"), grouped=hf.get("model_type") == "qwen3_next")


def _ffn(args: ModelArgs, i: int):
    hf = args.hf
    num_experts = int(hf.get("num_experts") or 0)
    sparse_step = int(hf.get("decoder_sparse_step") or 1)
    if num_experts and i not in (hf.get("mlp_only_layers") or []) and (i + 1) % sparse_step == 0:
        return MoESpec(num_experts, int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"]),
                       int(hf.get("shared_expert_intermediate_size") or 0), bool(hf.get("norm_topk_prob", True)))
    return MLPSpec(args.intermediate_size)


QWEN3_5_MTP = MTPNames(MTP_PREFIX, "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "fc.weight",
                       ("layers.0.",), "norm.weight")


def mtp_layer(args: ModelArgs) -> MTPSpec:
    """The MTP layer: gated full attention and the model's feed-forward kind (MoE for the MoEs)."""
    hf = args.hf
    declared = int(hf.get("mtp_num_hidden_layers") or 0)
    if not declared:
        return MTPSpec(QWEN3_5_MTP, (), 0)
    ffn = (MoESpec(int(hf["num_experts"]), int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"]),
                   int(hf.get("shared_expert_intermediate_size") or 0), bool(hf.get("norm_topk_prob", True)))
           if int(hf.get("num_experts") or 0) else MLPSpec(args.intermediate_size))
    return MTPSpec(QWEN3_5_MTP, (LayerSpec(_gated_attention(args), ffn, args.rms_norm_eps),), declared)


def tensor_name(name: str) -> str | None:
    """The text model's tensors under the decoder's names (MTP's under mtp.); the vision tower skipped."""
    if name.startswith(SKIPPED):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.mtp."):
        return name[len("model."):]
    return name


BLOCKS_HYBRID = {**BLOCKS, LinearAttentionSpec: GatedDeltaNet, MoESpec: MoE}
FAMILY = Family("qwen3_5", layer_specs, BLOCKS_HYBRID, tensor_name=tensor_name, norm_offset=1.0, mtp_layer=mtp_layer)
