"""Qwen3 dense decoder: the llama block plus per-head RMSNorm on Q and K before rope (QK-norm),
and an explicit head_dim that need not equal hidden / heads. The llama file reads q_norm/k_norm
when the checkpoint has them; this file names the architecture and insists on them.
"""
import torch

from tensorfold.models import llama
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs


class Model(llama.Model):
    def __init__(self, args: ModelArgs, tensors: dict, dtype: torch.dtype, ops, device: torch.device | str = "cpu"):
        super().__init__(args, tensors, dtype, ops, device)
        if any(layer.q_norm is None or layer.k_norm is None for layer in self.layers):
            raise CheckpointError("qwen3 checkpoint lacks self_attn.q_norm / k_norm weights")
