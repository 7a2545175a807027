"""Architecture name (config.json "architectures"[0]) -> model family. A literal dict, nothing more."""
from tensorfold.models import gemma4, glm_moe_dsa, llama, nemotron_h, qwen3, qwen3_5
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.spec import Family

ARCHITECTURES = {
    "LlamaForCausalLM": llama.FAMILY,
    "Qwen3ForCausalLM": qwen3.FAMILY,
    "Qwen3_5ForConditionalGeneration": qwen3_5.FAMILY,   # Qwen3.5, Qwen3.8
    "Qwen3_5ForCausalLM": qwen3_5.FAMILY,
    "Qwen3_5MoeForConditionalGeneration": qwen3_5.FAMILY,  # Qwen3.6
    "Qwen3_5MoeForCausalLM": qwen3_5.FAMILY,
    "Qwen3NextForCausalLM": qwen3_5.FAMILY,               # Flash Next
    "Gemma4ForConditionalGeneration": gemma4.FAMILY,      # Gemma 4 (its text model)
    "Gemma4ForCausalLM": gemma4.FAMILY,                   # gemma4_text
    "GlmMoeDsaForCausalLM": glm_moe_dsa.FAMILY,           # GLM-5.x
    "NemotronHForCausalLM": nemotron_h.FAMILY,            # Nemotron-H, Nemotron Nano 2, Nemotron 3
}


def model_family(architecture: str, path: str = "config.json") -> Family:
    if architecture not in ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture '{architecture}' is not supported "
                              f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[architecture]
