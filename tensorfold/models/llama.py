"""Llama family (SmolLM2, Llama 2/3): every layer GQA attention with rope and a SwiGLU MLP,
RMSNorm, optional tied head. Layer specs only: the blocks are models/blocks.py's, composed by
models/decoder.py.
"""
from tensorfold.models.blocks import BLOCKS
from tensorfold.models.config import ModelArgs
from tensorfold.models.spec import Family, LayerSpec, dense_attention_layers


def layer_specs(args: ModelArgs) -> list[LayerSpec]:
    return dense_attention_layers(args)


FAMILY = Family("llama", layer_specs, BLOCKS)
