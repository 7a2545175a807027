"""Architecture name (config.json "architectures"[0]) -> model class. A literal dict, nothing more."""
from tensorfold.models import llama, qwen3
from tensorfold.models.checkpoint import CheckpointError

ARCHITECTURES = {
    "LlamaForCausalLM": llama.Model,
    "Qwen3ForCausalLM": qwen3.Model,
}


def model_class(architecture: str, path: str = "config.json"):
    if architecture not in ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture '{architecture}' is not supported "
                              f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[architecture]
