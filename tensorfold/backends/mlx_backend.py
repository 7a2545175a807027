"""The mlx backend: the model on MLX arrays (tensorfold/mlx), behind the same four calls as the
torch backends (load, allocate, runner, describe), so the engine, scheduler, drafter, prefix
cache and API serve it unchanged.

The draw is the keyed sampler on the host (sampling/sampler.py, torch on the CPU): the logits
rows come back from MLX (unified memory on Apple silicon: no copy across a bus), so a row's
token is the one the cpu backend draws from the same logits, grammar masks and all.
"""
import contextlib
import logging
import os
import mlx.core as mx
import numpy as np
import torch

from tensorfold.backends.probes import narrowed
from tensorfold.backends.runner import per_request
from tensorfold.backends.base import Allocation, BlockGroup, Loaded
from tensorfold.backends.torch_backend import DTYPES, kv_cache_dtype, read_checkpoint
from tensorfold.engine.step_plan import StepPlan
from tensorfold.mlx import delta_net, metal, ops
from tensorfold.mlx.glm import LatentCache
from tensorfold.mlx.model import Attention, MLXBatch, MLXModel, mlx_batch, model_class
from tensorfold.mlx.mtp import MLXMTPRunner
from tensorfold.models.cache import LatentKV, ModelCache, SharedKV, group_blocks
from tensorfold.models.config import ModelArgs
from tensorfold.models.loader import mtp_tensors, served_tensors
from tensorfold.models.progress import LoadProgress
from tensorfold.models.registry import model_family
from tensorfold.sampling.sampler import sample

log = logging.getLogger("tensorfold.engine")

PROBE_BATCH_SIZES = (2, 3, 7, 8, 13, 64)


class MLXBackend:
    name = "mlx"

    def __init__(self, config):
        self.config = config
        self.model: MLXModel | None = None
        self.caches: list[ops.LayerCache] = []
        self.kv_dtype: torch.dtype | None = None
        self.block_size = config.block_size

    def load(self, model_path: str | None, config) -> Loaded:
        checkpoint, tokenizer = read_checkpoint(model_path, config)
        args = ModelArgs.from_hf(checkpoint.config, os.path.join(checkpoint.path, "config.json"))
        family = model_family(checkpoint.architecture, checkpoint.path)
        # The MTP layer only where drafting may use it (the torch backends' rule: models/loader.mtp_tensors).
        served, mtp_spec = mtp_tensors(served_tensors(checkpoint.tensors, family), family, args,
                                       config.drafting and config.drafter != "ngram")
        tensors = LoadProgress(served)
        self.model = model = model_class(family)(args, family.layer_specs(args), tensors, DTYPES[config.dtype],
                                                 family.norm_offset)
        if mtp_spec is not None:
            model.add_mtp(mtp_spec, tensors)
        tensors.finish()
        checkpoint.tensors = {}
        formats = model.weight_formats()
        log.info("GEMM weights: %s", ", ".join(f"{n} {fmt}" for fmt, n in sorted(formats.items())))
        self.kv_dtype = kv_cache_dtype(config, quantized=any(f not in ("float32", "bfloat16") for f in formats))
        failures = probe_rows(model) if config.probe else []
        if config.probe and (problem := ieee_problem()):
            log.warning("mlx on %s: %s; replies stay exact within this backend, but a quantized model's "
                        "logits will not be the cpu and cuda backends' bits", mx.default_device(), problem)
        if metal.available():
            if problem := shader_problem(model):
                log.warning("metal/ shaders not used: %s; the MLX ops run instead", problem)
            else:
                ops.use_shaders(metal)
                log.info("metal/ shaders: attention and the quantized GEMM give the MLX ops' bits here")
        self.config = config = narrowed(config, failures)
        return Loaded(checkpoint, tokenizer, config, failures, args.vocab_size, args.max_position, args.num_layers,
                      mtp_layers=1 if model.mtp is not None else 0)

    def allocate(self, context_length: int) -> Allocation:
        """Every layer's cache within --kv-cache-gib, and at least one full window: attention's
        K/V (PagedKV: blocks of block_size tokens, each vector's exponent beside it) and Gated
        DeltaNet's and Mamba2's states per block (RecurrentState: float32, the torch backends'
        layout, so the engine resumes such a model at block boundaries), GLM-5's latent cache
        (LatentKV: mlx/glm.LatentCache, its bytes counted as the torch backends'); a feed-forward layer
        (spec None) keeps nothing, a KV-shared layer (SharedKV) gets its source's LayerCache.
        Sliding-window layers live behind block tables of their own, one per window
        (models/cache.layer_groups, sized by group_blocks as on the torch backends), so the
        engine frees the blocks their window has left."""
        config, specs, model = self.config, self.model.cache_specs(), self.model
        itemsize = torch.finfo(self.kv_dtype).bits // 8

        def block_bytes(spec) -> int:  # this backend's layout of one block of a layer's cache
            if spec.recurrent:
                return spec.bytes_per_block(torch.float32, config.block_size)
            if isinstance(spec, LatentKV):
                return spec.bytes_per_block(self.kv_dtype, config.block_size)
            if isinstance(spec, SharedKV):
                return 0
            return 2 * spec.num_kv_heads * (spec.head_dim * itemsize + 4) * config.block_size  # K, V and their exponents
        per_block = sum(block_bytes(spec) for spec in specs if spec is not None)
        num_blocks = max(int(config.kv_cache_gib * 2**30) // per_block, -(-context_length // config.block_size))
        blocks = [num_blocks]
        if len(model.windows) > 1:  # the torch backends' split, on this layout's bytes
            blocks = group_blocks(specs, int(config.kv_cache_gib * 2**30), block_bytes, config.block_size,
                                  context_length, config.max_num_seqs, config.max_tokens_per_step)
        cached = None if config.prompt_cache_gib is None else int(config.prompt_cache_gib * 2**30 // per_block)
        dtype = ops.DTYPES[self.kv_dtype]
        self.caches = []
        for spec, g in zip(specs, model.group_of):
            count = None if g is None else blocks[g]
            self.caches.append(None if spec is None else self.caches[spec.source] if isinstance(spec, SharedKV)
                               else delta_net.LayerState(spec, count) if spec.recurrent
                               else LatentCache(count * config.block_size, spec, dtype) if isinstance(spec, LatentKV)
                               else ops.LayerCache(count * config.block_size, spec.num_kv_heads, spec.head_dim, dtype))
        mx.eval(*cache_arrays(self.caches))
        nbytes = sum(c.nbytes for c in {id(c): c for c in self.caches if c is not None}.values())  # shared once
        kinds: dict[str, int] = {}
        for spec in filter(None, specs):
            kinds[type(spec).__name__] = kinds.get(type(spec).__name__, 0) + 1
        text = ", ".join(f"{n} x {name}" for name, n in kinds.items())
        groups = ()
        if len(model.windows) > 1:
            groups = tuple(BlockGroup(w, n, model.group_of.count(g))
                           for g, (w, n) in enumerate(zip(model.windows, blocks)))
            text += "; " + ", ".join(f"{'full' if g.window is None else f'window {g.window}'}: {g.num_layers} layers, "
                                     f"{g.num_blocks} blocks" for g in groups)
        return Allocation(blocks[0], cached, nbytes, text, ModelCache.recurrent(specs), groups)

    def runner(self) -> "MLXRunner":
        return MLXRunner(self.model, self.caches, self.config.block_size)

    cache_generation = 0  # the cache is never lost while the process lives

    def status(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"backend": "mlx", "ops": "mlx", "device": str(mx.default_device()),
                "dtype": str(self.model.dtype).removeprefix("torch."),
                "kv_dtype": str(self.kv_dtype).removeprefix("torch."), "weights": self.model.weight_formats()}


class MLXRunner:
    """Executes a StepPlan on the MLX model: one forward, the caches and logits evaluated
    together, the draws on the host. Where an MTP layer is loaded, `mtp` (mlx/mtp.MLXMTPRunner)
    holds every row's final hidden state for the engine's MTP drafter and runs the layer."""

    def __init__(self, model: MLXModel, caches: list[ops.LayerCache], block_size: int):
        self.model, self.caches, self.block_size = model, caches, block_size
        self.mtp = MLXMTPRunner(model, caches[len(model.layers):], block_size) if model.mtp is not None else None

    def execute(self, plan: StepPlan) -> list[list[int]]:
        with one_torch_thread():
            return self._execute(plan)

    def _execute(self, plan: StepPlan) -> list[list[int]]:
        batch = self._batch(plan)
        if self.mtp is not None:  # every row's hidden state goes to the MTP layer's catch-up
            logits, hidden = self.model.forward(batch, self.caches, hidden=True)
            mx.eval(logits, hidden, *cache_arrays(self.caches))
            self.mtp.keep(plan, hidden)
        else:
            logits = self.model.forward(batch, self.caches)
            mx.eval(logits, *cache_arrays(self.caches))
        rows = [row for req in plan.requests for row in req.rows]
        return per_request(plan, sample(ops.to_torch(logits), rows, bitmask=plan.bitmask) if rows else [])

    def _batch(self, plan: StepPlan) -> MLXBatch:
        groups = len(self.model.windows) - 1  # the further cache groups (sliding windows)
        pieces, logits_rows, end = [], [], 0
        for req in plan.requests:
            if len(req.group_block_ids) != groups:
                raise ValueError(f"{req.req_id}: {len(req.group_block_ids)} further block tables, the cache has "
                                 f"{groups} sliding groups")
            pieces.append((req.start_position, req.token_ids, req.block_ids, req.group_block_ids))
            end += len(req.token_ids)
            logits_rows += range(end - len(req.rows), end)
        return mlx_batch(pieces, logits_rows, self.block_size, groups)


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread for a round's host work (the sampler, embedding rows): after a
    parallel region OpenMP's workers spin, taking the cores MLX's stream thread computes on (on
    a 2-core machine, a tenth of a decode round). Nothing torch computes here depends on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def cache_arrays(caches: list) -> list[mx.array]:
    """Every array of the layers' caches (a feed-forward layer's None has none)."""
    return [a for c in caches if c is not None for a in c.arrays]


def ieee_problem() -> str | None:
    """Whether this device's float32 division and square root are correctly rounded (the
    references' float32 finishes assume it: exact on any CPU; on Metal, fast math would break
    it), checked against numpy's on 4,096 values; None when they are."""
    rng = np.random.default_rng(7)
    a = (rng.standard_normal(4096) * np.exp2(rng.integers(-30, 30, 4096))).astype(np.float32)
    b = (np.abs(rng.standard_normal(4096)) * np.exp2(rng.integers(-30, 30, 4096))).astype(np.float32)
    checks = {"division": (mx.array(a) / mx.array(b), a / b), "sqrt": (mx.sqrt(mx.array(b)), np.sqrt(b))}
    wrong = [name for name, (got, want) in checks.items() if not np.array_equal(np.array(got), want)]
    return f"float32 {' and '.join(wrong)} not correctly rounded" if wrong else None


def shader_problem(model: MLXModel) -> str | None:
    """Whether metal/'s attention and quantized GEMM give the MLX ops' bits on this device, on
    random rows over a random cache and on the model's first quantized weight; None when they do
    (the Metal compiler's math mode, contraction and subnormals are what this catches)."""
    rng = np.random.default_rng(99)
    checks = {}
    spec = next((layer.mixer.spec for layer in model.layers if isinstance(layer.mixer, Attention)), None)
    if spec is not None:  # (latent attention, GLM-5's, has no shader: it runs as MLX ops)
        cache = ops.LayerCache(256, spec.num_kv_heads, spec.head_dim, ops.DTYPES[torch.bfloat16])
        kv = [mx.array(rng.standard_normal((70, spec.num_kv_heads, spec.head_dim)).astype(np.float32))
              for _ in range(2)]
        ops.write_kv(cache, *kv, mx.arange(70))
        q = mx.array(rng.standard_normal((3, spec.num_heads, spec.head_dim)).astype(np.float32))
        positions = np.arange(67, 70)
        slots = ops.key_slots(np.arange(8), 69, 32)
        checks["attention"] = lambda kernels: kernels.attention(q, cache, positions, slots, spec.scale, spec.window)
    quantized = [w.parts[0] for w in model.gemms().values() if isinstance(w.parts[0], ops.QuantParts)]
    if quantized:
        x = mx.array(rng.standard_normal((3, quantized[0].shape[1])).astype(np.float32))
        checks["quantized GEMM"] = lambda kernels: kernels.quant_linear(x, quantized[0])
    wrong = [name for name, run in checks.items() if not np.array_equal(np.array(run(metal)), np.array(run(ops)))]
    return f"{' and '.join(wrong)} differ from the MLX ops" if wrong else None


def probe_rows(model: MLXModel) -> list[str]:
    """The startup probes: each GEMM of the first layer and the head, and the norm, on random
    rows alone and inside batches of several sizes at several places; a moved bit is a failure
    (attention and the norm's sum are exact sums, so only the float steps can move). GEMMs of
    one shape and format meet the same kernels, so one of each is probed (a MoE layer's experts
    are one probe, not hundreds)."""
    rng = np.random.default_rng(1234)
    failures: list[str] = []

    def randn(m, k):
        return mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(model.mx_dtype)

    layer = model.layers[0]
    checks, kinds = {}, set()
    for name, weight in model.gemms().items():
        kind = (tuple(weight.shape), tuple(getattr(part, "kind", None) or str(part.dtype) for part in weight.parts))
        if (name.startswith("layers.0.") or name == "lm_head") and kind not in kinds:
            checks[f"linear {name}"] = weight
            kinds.add(kind)
    checks["rms_norm"] = lambda x: ops.rms_norm(x, layer.input_norm, layer.eps)
    for name, fn in checks.items():
        width = fn.shape[1] if hasattr(fn, "shape") else layer.input_norm.shape[0]
        probe = randn(1, width)
        alone = np.array(fn(probe).astype(mx.float32))
        for m in PROBE_BATCH_SIZES:
            rows = randn(m, width)
            place = m // 2
            rows[place] = probe[0]
            got = np.array(fn(rows).astype(mx.float32))[place]
            if not np.array_equal(got, alone[0]):
                failures.append(f"{name}: row differs at batch {m}, place {place}")
                break
    return failures
