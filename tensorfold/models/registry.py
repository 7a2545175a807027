"""Architecture name (config.json "architectures"[0]) -> model family. A literal dict, nothing more."""
from tensorfold.models import llama, qwen3
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.spec import Family

ARCHITECTURES = {
    "LlamaForCausalLM": llama.FAMILY,
    "Qwen3ForCausalLM": qwen3.FAMILY,
}


def model_family(architecture: str, path: str = "config.json") -> Family:
    if architecture not in ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture '{architecture}' is not supported "
                              f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[architecture]
