"""The torch backends (cpu, cuda): a model on an op set and a device, its cache, its runner;
the four calls of backends/base.py (load, allocate, runner, describe), torch below them."""
import ctypes
import logging
import torch

from tensorfold.backends import keeps_v_exponents
from tensorfold.backends.base import Allocation, BlockGroup, Loaded
from tensorfold.backends.probes import narrowed, probe_ops
from tensorfold.backends.runner import ModelRunner
from tensorfold.kernels.paged_attention import MAX_HEAD_DIM
from tensorfold.models.cache import ModelCache, group_blocks
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.loader import build_model, load_checkpoint, quantize_checkpoint
from tensorfold.models.tokenizer import Tokenizer
from tensorfold.models.vision_tower import vision_info

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


def read_checkpoint(model_path: str | None, config):
    """The checkpoint as config asks (GGUF blocks kept under dtype auto, --quantize applied) and
    its tokenizer; a bad --kv-dtype fails first, before anything is read. Every backend's load
    starts here."""
    kv_cache_dtype(config, quantized=False)
    checkpoint = load_checkpoint(model_path, keep_quantized=config.dtype == "auto")
    if config.quantize:
        quantize_checkpoint(checkpoint, config.quantize)
    return checkpoint, Tokenizer.from_checkpoint(checkpoint)


class TorchBackend:
    def __init__(self, name: str, ops, device: torch.device, num_threads: int | None = None):
        self.name, self.ops, self.device = name, ops, device
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model = None
        self.cache: ModelCache | None = None
        self.kv_dtype: torch.dtype | None = None
        self.config = None

    def load(self, model_path: str | None, config) -> Loaded:
        checkpoint, tokenizer = read_checkpoint(model_path, config)
        dtype = DTYPES[config.dtype]
        # The MTP layer only where drafting may use it.
        self.model = model = self.build(checkpoint, dtype, mtp=config.drafting and config.drafter != "ngram",
                                        vision=config.vision)
        check_head_dims(model, self.ops)
        checkpoint.tensors = {}  # the model holds its own (converted) copies
        _return_freed_heap()     # the loading's scratch (dequantized or unpacked blocks)
        formats = model.weight_formats()
        log.info("GEMM weights: %s", ", ".join(f"{n} {fmt}" for fmt, n in sorted(formats.items())))
        self.kv_dtype = kv_cache_dtype(config, quantized=any(f not in ("float32", "bfloat16") for f in formats))
        failures = self.probes() if config.probe else []
        self.config = config = narrowed(config, failures)
        a = model.args
        return Loaded(checkpoint, tokenizer, config, failures, a.vocab_size, a.max_position, a.num_layers,
                      mtp_layers=1 if model.mtp is not None else 0,
                      vision=vision_info(checkpoint) if model.vision is not None else None)

    def build(self, checkpoint, dtype: torch.dtype, mtp: bool = False, vision: bool = False):
        """The model of `checkpoint` on this backend's op set and device (mtp: with its MTP layer;
        vision: with its vision tower)."""
        return build_model(checkpoint, dtype, self.ops, self.device, mtp=mtp, vision=vision)

    def probes(self) -> list[str]:
        """The batch-invariance probes on the loaded model (empty: exact mode holds)."""
        return probe_ops(self.model, self.ops, kv_dtype=self.kv_dtype)

    def allocate(self, context_length: int) -> Allocation:
        """Every layer's cache (of the K/V dtype, with the record of V's exponents where the op set
        keeps one) within --kv-cache-gib, and at least one full window."""
        config, specs = self.config, self.model.cache_specs()
        record = keeps_v_exponents(self.ops)
        per_block = ModelCache.bytes_per_block(specs, self.kv_dtype, config.block_size, record)
        blocks = group_blocks(specs, int(config.kv_cache_gib * 2**30),
                              lambda spec: spec.bytes_per_block(self.kv_dtype, config.block_size, record),
                              config.block_size, context_length, config.max_num_seqs, config.max_tokens_per_step)
        cached = None if config.prompt_cache_gib is None else int(config.prompt_cache_gib * 2**30 // per_block)
        self.cache = cache = ModelCache(specs, blocks[0], config.block_size, self.kv_dtype, self.device, record, blocks)
        groups = tuple(BlockGroup(w, n, cache.group_of.count(g))
                       for g, (w, n) in enumerate(zip(cache.windows, cache.group_blocks)))
        return Allocation(blocks[0], cached, cache.nbytes, cache.describe(), ModelCache.recurrent(specs), groups)

    def runner(self) -> ModelRunner:
        return ModelRunner(self.model, self.cache, image_cache_bytes=self.config.image_cache_mib * 2**20)

    cache_generation = 0  # the cache is never lost while the process lives

    def status(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        """Plain strings (and the weight-format counts) for EngineInfo, /health and the log."""
        return {"backend": self.name, "ops": self.ops.NAME, "device": str(self.device),
                "dtype": str(self.model.dtype).removeprefix("torch."),
                "kv_dtype": str(self.kv_dtype).removeprefix("torch."), "weights": self.model.weight_formats()}


def check_head_dims(model, ops) -> None:
    """Attention heads wider than the op set's kernels take (ops.MAX_HEAD_DIM where it has one,
    else the exact rule's kernels/paged_attention.MAX_HEAD_DIM = 512, which serves Gemma 4's
    global heads) are a startup error, not a failure in the first round."""
    limit = getattr(ops, "MAX_HEAD_DIM", MAX_HEAD_DIM)
    wide = sorted({spec.mixer.head_dim for spec in model.specs if getattr(spec.mixer, "head_dim", 0) > limit})
    if wide:
        raise CheckpointError(f"attention heads of {', '.join(map(str, wide))} dims: the {ops.NAME} kernels take at "
                              f"most {limit} (q.k is exact in float64 up to {MAX_HEAD_DIM} dims)")


def _return_freed_heap() -> None:
    """Give glibc's freed heap back to the OS (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
