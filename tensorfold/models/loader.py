"""One entry point for every checkpoint format: a HF directory, a .gguf file, or the default model."""
import os

import torch

from tensorfold.models.checkpoint import Checkpoint, CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.progress import LoadProgress
from tensorfold.models.registry import model_class


def load_checkpoint(path: str | None = None) -> Checkpoint:
    from tensorfold.models import gguf_file
    from tensorfold.models.hf_dir import load_hf_dir

    if path is None:
        path = gguf_file.default_model_path()
    if os.path.isdir(path):
        return load_hf_dir(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if path.endswith(".gguf"):
        return gguf_file.load_gguf(path)
    raise CheckpointError(f"{path}: expected a Hugging Face directory or a .gguf file")


def build_model(ckpt: Checkpoint, dtype: torch.dtype, ops, device: torch.device | str = "cpu"):
    """The checkpoint's model class over `ops`, the backend's op set (backends.backend_ops)."""
    args = ModelArgs.from_hf(ckpt.config, os.path.join(ckpt.path, "config.json"))
    cls = model_class(ckpt.architecture, ckpt.path)
    tensors = LoadProgress(ckpt.tensors)
    model = cls(args, tensors, dtype, ops, device=device)
    tensors.finish()
    return model
