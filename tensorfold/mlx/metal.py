"""The mlx backend's Metal shaders (metal/): paged attention, the quantized GEMM, the keyed
sampler and grammar-masked verification, each its torch reference's bits.

On macOS with a Metal device, `available()` is True and the kernels are built once with
mx.fast.metal_kernel from the bodies in metal/ (names, types and templates: metal_kernels.py);
the entry points take MLX arrays with tensorfold/mlx/ops.py's signatures:

    attention(q, cache, positions, key_slots, scale, window)   ops.attention
    quant_linear(x, w)                                          ops.quant_linear (w: ops.QuantParts)
    sample(logits, rows, bitmask=None)                          sampling/sampler.sample
    verify(logits, bitmask, drafts, path_starts, rows)          verify_triton.verify_ref
    apply_token_bitmask(logits, bitmask)                        verify_triton.apply_token_bitmask_ref

Elsewhere `available()` is False and these raise; the same bodies run on the CPU instead,
compiled as C++ (metal_cpu.py), through the same launch sequences below (`paged_attention`,
`quant_matmul`, `sample_rows`, `verify_rows`, `masked_logits`), which take a runner (`Runner`:
the Metal one here, metal_cpu.CpuShaders on Linux) and an `Arrays` adapter (MLX or torch). So
tests/test_metal_shaders.py checks on Linux, bitwise against the references, every kernel and
every step between them that a Mac runs; what only a Mac can check is listed in docs/kernels.md
("Metal shaders (metal/)").
"""
import functools
import math
import platform
import struct
import weakref
from typing import Protocol

from tensorfold.kernels import quant_gemm as qg
from tensorfold.mlx import metal_kernels as mk
from tensorfold.sampling import keyed, sampler
from tensorfold.sampling.params import RowSampling

GREEDY, FREE, ORDERED = 0, 1, 2


class Runner(Protocol):
    def run(self, name: str, inputs: list, scalars: list, outputs: list[tuple[tuple, object]],
            grid: tuple[int, int, int], templates: dict | None = None) -> list: ...


class Arrays(Protocol):
    """What the launch sequences need of an array library beyond the kernels."""

    def dtype(self, name: str): ...                       # "float32", "int32", "int64", "uint64", "int8"

    def array(self, values: list, name: str): ...         # a new 1-D array

    def tolist(self, a) -> list: ...

    def head(self, keys, scores, size: int): ...          # per row the `size` largest keys (descending), their scores


# ---- the launch sequences (any runner) ----

def paged_attention(run: Runner, arrays: Arrays, q, k_cache, v_cache, positions, row_seq, block_tables,
                    scale: float, window: int | None, num_keys: int):
    """q [R, H, D] float32 at `positions` [R] int32 of sequences row_seq [R] int32, over the paged
    cache [blocks, block_size, KVH, D] through block_tables [S, width] int32; num_keys = max
    position + 1. Returns [R, H, D] float32: paged_attention_ref's bits (cast to q's dtype after)."""
    rows, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    dims = [rows, heads, kv_heads, dim, block_size, block_tables.shape[1], num_keys, window or 0]
    kv = {"KV": k_cache.dtype}
    f32, i32, i64 = arrays.dtype("float32"), arrays.dtype("int32"), arrays.dtype("int64")
    scores, v_exp = run.run("attention_scores", [q, positions, row_seq, block_tables, k_cache, v_cache],
                            dims + [scale], [((rows, heads, num_keys), f32), ((rows, heads, num_keys), i32)],
                            (num_keys, heads, rows), kv)
    weights, top, den = run.run("attention_softmax", [scores, v_exp, positions], [rows, heads, num_keys, window or 0],
                                [((rows, heads, num_keys), i64), ((rows, heads), i32), ((rows, heads), i64)],
                                (heads, rows, 1))
    out, = run.run("attention_output", [weights, top, den, v_exp, positions, row_seq, block_tables, v_cache], dims,
                   [((rows, heads, dim), f32)], (dim, heads, rows), kv)
    return out


def quant_matmul(run: Runner, arrays: Arrays, x, w: qg.QuantWeight, fields: dict):
    """x [M, K] float32 @ w^T -> [M, N] float32: quant_gemm.linear's bits (cast to x's dtype
    after). `fields`: w's arrays as the kernel reads them (`quant_fields`). Activations are
    quantized per group of the kind's `act` columns (32, or a K-quant's super-block of 256)."""
    rows, kdim = x.shape
    n = w.shape[0]
    kind = qg.check_weight(w)
    blocks, groups = kdim // qg.BLOCK, kdim // kind.act
    i32 = arrays.dtype("int32")
    quantized = run.run("quantize_activations", [x], [rows, groups],
                        [((rows, kdim), arrays.dtype("int8")), ((rows, groups), i32), ((rows, groups), i32)]
                        + [((rows, blocks), i32)] * 3, (groups, rows, 1), {"ACT": kind.act})
    inputs = list(quantized) + [fields[f] for f in ("codes", "scale", "scale_exp", "min", "min_exp", "top")]
    y, = run.run("quant_gemm", inputs, [rows, n, blocks, mk.grid_bias(w.kind, kdim)],
                 [((rows, n), arrays.dtype("float32"))], (n, rows, 1),
                 {"SUB": kind.sub, "HAS_MIN": kind.has_min, "ACT": kind.act})
    return y


def _f64_word(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def sample_rows(run: Runner, arrays: Arrays, logits, rows: list[RowSampling], bitmask=None,
                num_candidates: int = sampler.NUM_CANDIDATES) -> list[int]:
    """sampler.sample's tokens for logits [R, vocab] float32 (bitmask int32 [R, words] or None),
    by the sampler kernels; the rule's errors as the reference raises them."""
    num_rows, vocab = logits.shape
    if len(rows) != num_rows:
        raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} rows")
    if vocab > sampler.ID_MASK:
        raise ValueError(f"vocabulary of {vocab} tokens exceeds 2^{sampler.ID_BITS} - 1")
    num_chunks = -(-vocab // mk.SAMPLER_CHUNK)
    words = bitmask.shape[1] if bitmask is not None else 0
    mask = bitmask if bitmask is not None else arrays.array([0], "int32")
    dims = [num_rows, vocab, words, num_chunks]
    has_mask = {"HAS_MASK": bitmask is not None}
    modes = [GREEDY if r.temperature == 0.0 else ORDERED if r.ordered(vocab) else FREE for r in rows]
    f32, i64, u64 = arrays.dtype("float32"), arrays.dtype("int64"), arrays.dtype("uint64")

    chunk_max, = run.run("sampler_chunk_max", [logits, mask], dims, [((num_rows, num_chunks), f32)],
                         (num_chunks, num_rows, 1), has_mask)
    for r, m, row_max in zip(rows, modes, arrays.tolist(chunk_max)):
        if max(row_max) == -math.inf:
            raise ValueError("a row has no drawable token")
        if m != GREEDY and max(row_max) / r.temperature == math.inf:
            raise ValueError("a logit divided by its temperature is +inf")
    temps = arrays.array([_f64_word(r.temperature or 1.0) for r in rows], "uint64")
    row_keys = arrays.array([keyed.row_key(r.seed, r.position) for r in rows], "uint64")
    mode = arrays.array(modes, "int32")
    min_q = arrays.array([int(r.min_p * sampler.Q_ONE) for r in rows], "int64")
    keys, scores = run.run("sampler_tokens", [logits, mask, chunk_max, temps, row_keys, mode], dims,
                           [((num_rows, vocab), i64), ((num_rows, vocab), u64)], (vocab, num_rows, 1), has_mask)
    folds = run.run("sampler_chunk_fold", [logits, mask, keys, scores, min_q, mode], dims,
                    [((num_rows, num_chunks), u64)] + [((num_rows, num_chunks), i64)] * 3,
                    (num_chunks, num_rows, 1), has_mask)
    top_k = arrays.array([r.top_k for r in rows], "int64")
    top_p40 = arrays.array([int(r.top_p * 2 ** sampler.P_BITS) if r.top_p < 1.0 else -1 for r in rows], "int64")
    tokens: list[int | None] = [None] * num_rows
    for size in (num_candidates, 8 * num_candidates, vocab):  # heads of growing size, as the reference
        size = min(size, vocab)
        head_keys, head_scores = arrays.head(keys, scores, size)
        token, decided = run.run("sampler_draw", [mode, *folds, head_keys, head_scores, top_k, top_p40, min_q],
                                 [num_rows, num_chunks, size],
                                 [((num_rows,), i64), ((num_rows,), arrays.dtype("int32"))], (num_rows, 1, 1))
        for i, (t, d) in enumerate(zip(arrays.tolist(token), arrays.tolist(decided))):
            if tokens[i] is None and d:
                tokens[i] = t
        if all(t is not None for t in tokens) or size == vocab:
            break
    if any(t is None or t == sampler.NO_TOKEN for t in tokens):
        raise ValueError("a row has no drawable token")
    return tokens


def verify_rows(run: Runner, arrays: Arrays, logits, bitmask, drafts: list[int], path_starts: list[int],
                rows: list[RowSampling]) -> tuple[list[int], list[int]]:
    """verify_ref's (draws [R], num_accepted [P]): the keyed draws on the masked rows, then each
    path's accepted drafts (verify_accept)."""
    if len(drafts) != len(rows) or path_starts[-1] != len(rows):
        raise ValueError(f"{len(rows)} rows, {len(drafts)} drafts, paths up to {path_starts[-1]}")
    draws = sample_rows(run, arrays, logits, rows, bitmask)
    num_paths = len(path_starts) - 1
    accepted, = run.run("verify_accept", [arrays.array(draws, "int64"), arrays.array(drafts, "int64"),
                                          arrays.array(path_starts, "int32")], [num_paths],
                        [((num_paths,), arrays.dtype("int32"))], (num_paths, 1, 1))
    return draws, arrays.tolist(accepted)


def masked_logits(run: Runner, arrays: Arrays, logits, bitmask):
    """apply_token_bitmask_ref's values: -inf where the row's bit is clear."""
    num_rows, vocab = logits.shape
    out, = run.run("token_bitmask", [logits, bitmask], [num_rows, vocab, bitmask.shape[1]],
                   [((num_rows, vocab), arrays.dtype("float32"))], (vocab, num_rows, 1))
    return out


# ---- Metal (macOS): the kernels through mx.fast.metal_kernel ----

@functools.cache
def available() -> bool:
    """Whether this process can build and run Metal kernels (macOS, MLX with a Metal device)."""
    if platform.system() != "Darwin":
        return False
    try:
        import mlx.core as mx
        return bool(mx.metal.is_available())
    except Exception:  # noqa: BLE001 (an MLX without Metal: not available)
        return False


class MetalRunner:
    """The shaders as mx.fast.metal_kernel objects, built once each (MLX JIT-compiles a library
    per kernel and template set, with fast math off)."""

    def __init__(self):
        import mlx.core as mx
        self.mx = mx
        header = mk.header_source()
        self.kernels = {name: mx.fast.metal_kernel(name=f"tf_{name}", input_names=k.input_names,
                                                   output_names=k.output_names, source=k.body(), header=header)
                        for name, k in mk.KERNELS.items()}

    def run(self, name, inputs, scalars, outputs, grid, templates=None):
        mx = self.mx
        kernel = mk.KERNELS[name]
        values = list(inputs) + [mx.array(v, dtype=mx.float32 if t == "float" else mx.int32)
                                 for v, t in zip(scalars, mk.types(kernel.scalars))]
        template = [(k, v) for k, v in (templates or {}).items()]
        group = (min(256, max(1, grid[0])), 1, 1)
        return self.kernels[name](inputs=values, template=template, grid=grid, threadgroup=group,
                                  output_shapes=[s for s, _ in outputs], output_dtypes=[d for _, d in outputs])


class MLXArrays:
    def __init__(self):
        import mlx.core as mx
        self.mx = mx

    def dtype(self, name):
        return getattr(self.mx, name)

    def array(self, values, name):
        return self.mx.array(values, dtype=self.dtype(name))

    def tolist(self, a):
        return a.tolist()

    def head(self, keys, scores, size):
        order = self.mx.argsort(-keys, axis=1)[:, :size]  # keys are unique where drawable
        return self.mx.take_along_axis(keys, order, axis=1), self.mx.take_along_axis(scores, order, axis=1)


@functools.cache
@functools.cache
def _metal():
    """The Metal runner (every kernel built once) and the MLX adapter."""
    if not available():
        raise RuntimeError("Metal is not available here (macOS with MLX's Metal device only)")
    return MetalRunner(), MLXArrays()


def attention(q, cache, positions, key_slots, scale: float, window: int | None):
    """ops.attention on Metal: one sequence's rows over its key slots (a block table of
    block_size 1)."""
    run, arrays = _metal()
    mx = arrays.mx
    rows, heads, dim = q.shape
    slots, kv_heads = cache.k.shape[0], cache.k.shape[1]
    k = cache.k.reshape(slots, 1, kv_heads, dim)
    v = cache.v.reshape(slots, 1, kv_heads, dim)
    table = key_slots.astype(mx.int32).reshape(1, -1)
    pos = mx.array([int(p) for p in positions], dtype=mx.int32)
    out = paged_attention(run, arrays, q.astype(mx.float32), k, v, pos, mx.zeros((rows,), dtype=mx.int32), table,
                          scale, window, int(positions[-1]) + 1)
    return out.astype(q.dtype)


def quant_fields(arrays: Arrays, w: qg.QuantWeight, convert) -> dict:
    """w's arrays as quant_gemm reads them (`convert`: a torch tensor -> the library's array);
    kinds without a minimum get one-element placeholders."""
    import torch
    fields = {"codes": w.codes, "scale": w.scale, "scale_exp": w.scale_exp, "top": w.top().to(torch.int32),
              "min": w.min if w.min is not None else torch.zeros(1, dtype=torch.int32),
              "min_exp": w.min_exp if w.min_exp is not None else torch.zeros(1, dtype=torch.int32)}
    return {k: convert(v.contiguous()) for k, v in fields.items()}


_PACKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # QuantParts -> its kernel fields


def quant_linear(x, w):
    """ops.quant_linear on Metal (w: ops.QuantParts; its fields are converted once)."""
    from tensorfold.mlx.ops import from_torch
    run, arrays = _metal()
    mx = arrays.mx
    fields = _PACKED.get(w)
    if fields is None:
        fields = _PACKED[w] = quant_fields(arrays, w.source, from_torch)
    return quant_matmul(run, arrays, x.astype(mx.float32), w.source, fields).astype(x.dtype)


def _mx_bitmask(bitmask):
    """A bitmask as an MLX int32 array (the engine builds torch ones), or None."""
    if bitmask is None or not hasattr(bitmask, "numpy"):
        return bitmask
    from tensorfold.mlx.ops import from_torch
    return from_torch(bitmask.contiguous())


def sample(logits, rows: list[RowSampling], bitmask=None) -> list[int]:
    """sampler.sample on Metal: logits [R, vocab] (any float dtype; widened exactly)."""
    run, arrays = _metal()
    return sample_rows(run, arrays, logits.astype(arrays.mx.float32), rows, _mx_bitmask(bitmask))


def verify(logits, bitmask, drafts: list[int], path_starts: list[int], rows: list[RowSampling]):
    """verify_ref on Metal: (draws, num_accepted) as lists."""
    run, arrays = _metal()
    return verify_rows(run, arrays, logits.astype(arrays.mx.float32), _mx_bitmask(bitmask), drafts, path_starts, rows)


def apply_token_bitmask(logits, bitmask):
    """apply_token_bitmask_ref on Metal: a masked float32 copy of logits."""
    run, arrays = _metal()
    return masked_logits(run, arrays, logits.astype(arrays.mx.float32), _mx_bitmask(bitmask))
