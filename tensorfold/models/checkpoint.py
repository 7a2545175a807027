"""What a loaded checkpoint is, whatever file format it came from.

Both loaders (Hugging Face directories in hf_dir.py, single-file GGUF in gguf_file.py) produce a
Checkpoint whose `config` uses Hugging Face config.json keys and whose `tensors` use Hugging Face
parameter names, so the model files never see the file format.
"""
from dataclasses import dataclass, field
from typing import Any


class CheckpointError(Exception):
    """A checkpoint file is missing, truncated or inconsistent; the message names the file."""


@dataclass
class Checkpoint:
    path: str
    config: dict[str, Any]                 # HF config.json keys ("architectures", "hidden_size", ...)
    tensors: dict[str, Any]                # HF parameter name -> torch.Tensor
    tokenizer: Any                         # tokenizers.Tokenizer
    tokenizer_config: dict[str, Any] = field(default_factory=dict)  # bos_token, eos_token, add_bos_token
    chat_template: str | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)  # eos_token_id, temperature, top_p, top_k

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        if not archs:
            raise CheckpointError(f"{self.path}: config has no 'architectures' entry")
        return archs[0]
