"""mlx_lm (Apple's MLX language-model package) as a benchmark peer, on MLX's CPU device where it
installs (Linux: `pip install "mlx[cpu]" mlx-lm`): greedy decode tokens/s and prompt prefill
seconds, one stream, on a Hugging Face directory.

mlx_lm is a benchmark peer only, never a dependency of tensorfold; `available()` is False where
it is missing, and callers skip with a message. Weights are MLX's: `bits` quantizes every linear
layer to MLX's affine blocks of 32 (a scale and a bias per block: the nearest thing to GGUF's
Q4_0/Q8_0 that MLX has), None keeps the directory's dtype.

Decode tokens/s counts the steps after the first token (the prompt's prefill and first token
are not timed); prefill is the time to the first token of a fresh prompt.
"""
import time

SKIP_MESSAGE = "mlx_lm is not installed (pip install \"mlx[cpu]\" mlx-lm); skipping the mlx_lm peer"


def available() -> bool:
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError:
        return False
    return True


def load(path: str, bits: int | None = None):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load as mlx_load

    model, _ = mlx_load(path)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def _steps(model, prompt_ids: list[int], n_tokens: int):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return zip(generate_step(mx.array(prompt_ids), model, max_tokens=n_tokens), range(n_tokens))


def decode_tps(model, prompt_ids: list[int], n_tokens: int) -> float:
    first = None
    for _, i in _steps(model, prompt_ids, n_tokens):
        if i == 0:
            first = time.perf_counter()
    return (n_tokens - 1) / (time.perf_counter() - first)


def prefill_seconds(model, prompt_ids: list[int]) -> float:
    started = time.perf_counter()
    for _ in _steps(model, prompt_ids, 1):
        pass
    return time.perf_counter() - started


# The legacy 32-weight kinds map onto MLX's affine groups of 32 exactly: a weight S c 2^E (+ M 2^F)
# is scale q + bias with q = c - LOWEST[kind] (unsigned), scale = S 2^E, bias = M 2^F + LOWEST
# scale: float32 values, exact (S < 2^11, float16 exponents).
LOWEST = {"q8_0": -128, "q4_0": -8, "q4_1": 0}
BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4}


def affine_groups(w):
    """A QuantWeight of a legacy kind as MLX's (packed uint32 weight, scales, biases), float32."""
    import mlx.core as mx
    import numpy as np
    import torch

    from tensorfold.exact.grid import pow2

    lowest, bits = LOWEST[w.kind], BITS[w.kind]
    q = (w.codes.to(torch.int64) - lowest).numpy().astype(np.uint32)           # [N, K]
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    packed = (q.reshape(q.shape[0], -1, per_word) << shifts).sum(axis=-1, dtype=np.uint32)
    scale = (w.scale.double() * pow2(w.scale_exp)).float()                       # [N, K / 32], exact
    bias = lowest * scale if w.min is None else (w.min.double() * pow2(w.min_exp)).float() + lowest * scale
    return mx.array(packed), mx.array(scale.numpy()), mx.array(bias.numpy())


def load_blocks(hf_dir: str, gguf_path: str):
    """mlx_lm's model (its architecture from `hf_dir`, a dense copy of the same file) with the
    GGUF's own blocks as MLX affine groups of 32 (the legacy kinds; see LOWEST), float32
    activations and norms: the weights tensorfold serves from that file, value for value."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from tensorfold.models.gguf_file import load_gguf

    checkpoint = load_gguf(gguf_path, keep_quantized=True)
    model = load(hf_dir)
    model.set_dtype(mx.float32)
    weights, bits = {}, {}
    for name, tensor in checkpoint.tensors.items():
        if hasattr(tensor, "load"):
            blocks = tensor.load()
            if blocks.kind not in LOWEST:
                raise ValueError(f"{name}: {blocks.kind} has no exact MLX affine form here")
            base = name.removesuffix(".weight")
            bits[base] = BITS[blocks.kind]
            weights[name], weights[base + ".scales"], weights[base + ".biases"] = affine_groups(blocks)
        else:
            weights[name] = mx.array(tensor.float().numpy().astype(np.float32))
    nn.quantize(model, class_predicate=lambda path, module: {"group_size": 32, "bits": bits[path]}
                if path in bits else False)
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    return model


def dense_copy(gguf_path: str, out_dir: str) -> str:
    """A Hugging Face directory of the GGUF's weights in bfloat16 (transformers dequantizes the
    blocks), written once: mlx_lm reads only such directories, so both sides of the dense rows
    load this one copy."""
    import json
    import os

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    tied = model.config.tie_word_embeddings
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=[type(model).__name__], torch_dtype="bfloat16")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir


def version() -> str:
    from importlib.metadata import version as package_version
    return package_version("mlx-lm")
