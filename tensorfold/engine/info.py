"""EngineInfo: what the engine tells the layers above it about itself, fixed at load.

Plain strings and numbers (no tensors, no torch dtypes), so the API, /health, /metrics and the
startup log read one frozen record instead of reaching into the model, the cache or the backend.
"""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineInfo:
    model_path: str                    # the checkpoint served (a HF directory or a .gguf file)
    architecture: str                  # config.json's architectures[0]
    num_layers: int
    vocab_size: int                    # the model's (the tokenizer's may be smaller)
    context_length: int                # the served window, in tokens
    default_max_tokens: int            # a request's reply limit when it sets none (before the window)
    backend: str                       # cpu / cuda
    ops: str                           # the op set serving it: native-avx512, torch, triton, ...
    dtype: str                         # the activations': float32 / bfloat16
    kv_dtype: str                      # the K/V cache's: float32 / bfloat16
    weights: dict[str, int] = field(default_factory=dict)  # GEMM matrices per weight format
    cache: str = ""                    # the cache in words (kinds, blocks, bytes): the log, /health
    cache_bytes: int = 0
    num_blocks: int = 0
    block_size: int = 0
    exact: bool = True                 # the batch-invariance probes passed
    probe_failures: tuple[str, ...] = ()
    load_seconds: float = 0.0
