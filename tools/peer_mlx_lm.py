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
