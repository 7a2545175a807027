"""What an engine runs on, built from a checkpoint and an EngineConfig: the model on its
backend's op set and device (checked by the batch-invariance probes), and the memory it decodes
into (the KV cache and its block pool). Engine.__init__ composes the two; a backend with a
runner of its own would provide its own load_model.
"""
import ctypes
import logging
from dataclasses import dataclass, replace

import torch

from tensorfold.backends import backend_ops
from tensorfold.engine.block_pool import BlockPool
from tensorfold.engine.probes import probe_ops
from tensorfold.models.forward_batch import KVCache
from tensorfold.models.loader import build_model, load_checkpoint, quantize_checkpoint
from tensorfold.models.tokenizer import Tokenizer

log = logging.getLogger("tensorfold.engine")

DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}  # activations


def kv_cache_dtype(config, quantized: bool) -> torch.dtype:
    """The KV cache's dtype: config.kv_dtype, where "auto" is bfloat16 for a model whose matrices
    are served in blocks (`quantized`: a GGUF under dtype auto, or --quantize; half a float32
    cache, as llama.cpp's f16 one) and the activations' dtype otherwise (a dense model computes as
    it always did). Exact either way: write_kv rounds K/V to the cache's dtype before their grid,
    and attention widens the cache's values exactly."""
    if config.kv_dtype == "auto":
        return torch.bfloat16 if quantized else DTYPES[config.dtype]
    if config.kv_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"kv_dtype {config.kv_dtype!r}: expected auto, float32 or bfloat16")
    return DTYPES[config.kv_dtype]


@dataclass
class LoadedModel:
    checkpoint: object
    tokenizer: Tokenizer
    model: object
    device: torch.device
    config: object                # the EngineConfig to serve with (narrowed if the probes failed)
    probe_failures: list[str]
    kv_dtype: torch.dtype         # the cache's (kv_cache_dtype)


@dataclass
class Memory:
    context_length: int           # the served window
    pool: BlockPool
    cache: KVCache


def load_model(model_path: str | None, config) -> LoadedModel:
    kv_cache_dtype(config, quantized=False)  # a bad value fails before the load
    checkpoint = load_checkpoint(model_path, keep_quantized=config.dtype == "auto")
    if config.quantize:
        quantize_checkpoint(checkpoint, config.quantize)
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    device = torch.device(config.device or config.backend)
    model = build_model(checkpoint, DTYPES[config.dtype], backend_ops(config.backend), device)
    checkpoint.tensors = {}  # the model holds its own (converted) copies
    _return_freed_heap()     # the loading's scratch (dequantized or unpacked blocks)
    formats = model.weight_formats()
    log.info("GEMM weights: %s", ", ".join(f"{n} {fmt}" for fmt, n in sorted(formats.items())))
    kv_dtype = kv_cache_dtype(config, quantized=any(f not in ("float32", "bfloat16") for f in formats))
    failures = probe_ops(model, model.ops, kv_dtype=kv_dtype) if config.probe else []
    if failures:
        # Without a batch-invariant forward, batching, chunking and drafting could change a
        # reply: serve one request at a time, whole prompts, no drafts.
        log.error("EXACT MODE REFUSED: batch-invariance probes failed on this machine: %s. "
                  "Serving one request at a time without drafts.", "; ".join(failures))
        config = replace(config, max_num_seqs=1, drafting=False, max_tokens_per_step=1 << 30)
    return LoadedModel(checkpoint, tokenizer, model, device, config, failures, kv_dtype)


def allocate_memory(config, args, device: torch.device, kv_dtype: torch.dtype, v_exponents: bool = False) -> Memory:
    """The KV cache (of kv_dtype, with the record of V's exponents if the op set keeps one) within
    --kv-cache-gib (at least one full window), and its block pool."""
    context_length = min(config.context or args.max_position, args.max_position)
    per_token = KVCache.bytes_per_token(args.num_layers, args.num_kv_heads, args.head_dim, kv_dtype, v_exponents)
    budget = int(config.kv_cache_gib * 2**30) // (per_token * config.block_size)
    num_blocks = max(budget, -(-context_length // config.block_size))
    cached = None if config.prompt_cache_gib is None else int(
        config.prompt_cache_gib * 2**30 // (per_token * config.block_size))
    pool = BlockPool(num_blocks, config.block_size, max_cached_blocks=cached)
    cache = KVCache.allocate(args.num_layers, num_blocks, config.block_size, args.num_kv_heads, args.head_dim,
                             kv_dtype, device, v_exponents)
    return Memory(context_length, pool, cache)


def _return_freed_heap() -> None:
    """Give glibc's freed heap back to the OS (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
