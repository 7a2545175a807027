"""LinearWeight: a GEMM weight as one object, whatever its format, parts or shard.

A model holds every matrix it multiplies by as a LinearWeight and calls it: `weight(x)` is
x [M, K] @ W^T (+ bias) -> [M, N]. Each op set subclasses it with how it keeps a part (packed
tiles, quantized blocks as stored, a plain tensor) and how it multiplies by one; nothing
outside this file and the op sets asks what type a weight is.

- parts: W [N, K] as parts stacked along N. Parts of one format are fused into one part at load
  (Q/K/V, gate/up); parts of different formats (a Q4_K_M file's Q6_K v beside Q4_K q and k) stay
  apart and their outputs are laid side by side, each computed whole, so the bits are the ones
  each part gives alone.
- format: the part's format (float32, bfloat16, q4_1, q6_k, ...); formats: one per part.
- shard: which slice of a larger weight this object holds, for ranks: None is the whole.
- rows(ids): the weight's rows as float (an embedding table's lookup; a tied head is the same
  object as the table).
- in_order: for a matrix kept with its columns in its file's order (gguf_quants.StoredColumns),
  the input's columns in that order (x[:, in_order] before the GEMM); None for the rest.
"""
from dataclasses import dataclass

import torch

from tensorfold.kernels import quant_gemm
from tensorfold.models.gguf_quants import FileBlocks, FileStack, StoredColumns


@dataclass(frozen=True)
class Shard:
    dim: int        # 0: rows (N) are split; 1: columns (K)
    index: int
    count: int


def format_of(part) -> str:
    """A checkpoint matrix's format: its blocks' kind, or its dtype."""
    if isinstance(part, StoredColumns):
        return format_of(part.stored)
    if quantized(part):
        return part.kind
    return str(part.dtype).removeprefix("torch.")


def quantized(part) -> bool:
    """Whether a checkpoint matrix is in quantized blocks (else a dense tensor): a QuantWeight, or
    blocks still in their GGUF (FileBlocks, FileStack: only an op set that reads_files gets these)."""
    return isinstance(part, (quant_gemm.QuantWeight, FileBlocks, FileStack))


def fuse_parts(parts: list) -> list:
    """Checkpoint matrices to multiply as one: those of one format stacked along N into a single
    part (blocks still in the file as a FileStack); mixed formats stay separate parts (in order)."""
    if len(parts) > 1 and any(isinstance(p, StoredColumns) for p in parts):
        raise ValueError("a matrix with its columns in another order cannot be stacked with others")
    if len(parts) == 1 or len({format_of(p) for p in parts}) > 1:
        return list(parts)
    if all(isinstance(p, (FileBlocks, FileStack)) for p in parts):
        return [FileStack(parts)]
    if quantized(parts[0]):
        return [quant_gemm.cat([p.load() if isinstance(p, (FileBlocks, FileStack)) else p for p in parts])]
    return [torch.cat(parts)]


def named_gemms(layers, lm_head) -> dict:
    """Every LinearWeight of a model by name (layers.{i}.qkv, ..., lm_head), from each layer's
    gemms()."""
    named = {f"layers.{i}.{name}": weight for i, layer in enumerate(layers) for name, weight in layer.gemms().items()}
    named["lm_head"] = lm_head
    return named


def count_formats(weights) -> dict[str, int]:
    """How many GEMM matrices use each weight format (float32, bfloat16, q4_1, ...) among
    `weights` (LinearWeights); a weight of parts in several formats counts each part."""
    formats: dict[str, int] = {}
    for weight in weights:
        for fmt in weight.formats:
            formats[fmt] = formats.get(fmt, 0) + 1
    return formats


def per_head(x: torch.Tensor, weights: list) -> torch.Tensor:
    """x [rows, heads, K] -> [rows, heads, N]: head h times weights[h], one call each (the op sets'
    linear_heads where they have no batched form)."""
    return torch.stack([w(x[:, h].contiguous()) for h, w in enumerate(weights)], dim=1)


class LinearWeight:
    """Base of every op set's weight type; subclasses define pack() and multiply()."""
    quantized = staticmethod(quantized)
    reads_files = False  # whether pack() takes blocks still in their GGUF (else they are loaded first)

    def __init__(self, parts: list, bias: torch.Tensor | None = None, shard: Shard | None = None):
        """parts: checkpoint matrices ([N_i, K] tensors or QuantWeights) stacked along N."""
        self.formats = tuple(format_of(p) for p in parts)
        self.widths = tuple(p.shape[0] for p in parts)
        self.in_features = parts[0].shape[1]
        self.in_order = None
        if isinstance(parts[0], StoredColumns):  # one part (fuse_parts)
            self.in_order, parts = parts[0].inputs, [parts[0].stored]
        self.parts = [self.pack(p) for p in parts]
        self.bias = bias
        self.shard = shard

    @classmethod
    def of(cls, *matrices, bias: torch.Tensor | None = None) -> "LinearWeight":
        """One weight from checkpoint matrices stacked along N (fused where their formats agree)."""
        return cls(fuse_parts(list(matrices)), bias)

    @property
    def format(self) -> str:
        return self.formats[0] if len(set(self.formats)) == 1 else "+".join(self.formats)

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(self.widths), self.in_features)

    @property
    def single(self):
        """The one packed part, or None where the weight has parts of several formats."""
        return self.parts[0] if len(self.parts) == 1 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_order is not None:
            if self.in_order.device != x.device:  # moved once, to where the activations are
                self.in_order = self.in_order.to(x.device)
            x = x.index_select(1, self.in_order)
        if len(self.parts) == 1:
            out = self.multiply(x, self.parts[0])
        else:  # each part whole, outputs side by side
            out = torch.cat([self.multiply(x, part) for part in self.parts], dim=1)
        return out if self.bias is None else out + self.bias

    def pack(self, part):
        """What the op set keeps of a checkpoint matrix (called once per part, at load)."""
        raise NotImplementedError

    def multiply(self, x: torch.Tensor, packed) -> torch.Tensor:
        """x [M, K] @ part^T -> [M, N_part]."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a one-part weight as float (an embedding lookup)."""
        raise NotImplementedError
