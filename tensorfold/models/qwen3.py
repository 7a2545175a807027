"""Qwen3 dense: the llama layout plus per-head RMSNorm on Q and K before rope (QK-norm, which
the checkpoint must carry), and an explicit head_dim that need not equal hidden / heads.
"""
from tensorfold.models.blocks import BLOCKS
from tensorfold.models.config import ModelArgs
from tensorfold.models.spec import Family, LayerSpec, dense_attention_layers


def layer_specs(args: ModelArgs) -> list[LayerSpec]:
    return dense_attention_layers(args, qk_norm=True)


FAMILY = Family("qwen3", layer_specs, BLOCKS)
