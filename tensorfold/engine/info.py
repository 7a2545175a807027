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
    device: str = ""                   # where the weights live (the log)
    vision: object | None = None       # vision/placement.VisionInfo where --vision loaded a tower

    @classmethod
    def of(cls, loaded, memory, described: dict, config, context_length: int, load_seconds: float) -> "EngineInfo":
        """From the backend's answers: load()'s Loaded, allocate()'s Allocation, describe()."""
        checkpoint = loaded.checkpoint
        return cls(
            model_path=checkpoint.path, architecture=checkpoint.architecture, num_layers=loaded.num_layers,
            vocab_size=loaded.vocab_size, context_length=context_length,
            default_max_tokens=config.default_max_tokens, backend=described["backend"], ops=described["ops"],
            dtype=described["dtype"], kv_dtype=described["kv_dtype"], weights=described["weights"],
            cache=memory.kinds, cache_bytes=memory.nbytes, num_blocks=memory.num_blocks,
            block_size=config.block_size, exact=not loaded.probe_failures,
            probe_failures=tuple(loaded.probe_failures), load_seconds=load_seconds, device=described["device"],
            vision=loaded.vision)

    def summary(self, dtype_setting: str) -> str:
        """The startup log's line."""
        return (f"loaded {self.model_path} ({self.architecture}, {self.num_layers} layers, {dtype_setting}) in "
                f"{self.load_seconds:.2f}s on {self.device} ({self.ops} ops); window {self.context_length} tokens, "
                f"cache {self.num_blocks} blocks x {self.block_size} ({self.cache}; {self.kv_dtype}, "
                f"{self.cache_bytes / 2**20:.1f} MiB)")
