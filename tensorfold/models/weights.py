"""WeightReader: a block's view of the checkpoint's tensors while the model is built.

A block asks for its tensors by name under its prefix; dense vectors (norms, biases) arrive in
the activations' dtype on the model's device, GEMM matrices as the op set's LinearWeight (blocks
stay blocks; dense ones are converted to the dtype first). A missing tensor is a CheckpointError
that names it.
"""
import torch

from tensorfold.kernels import quant_gemm
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.gguf_quants import FileBlocks, StoredColumns


class WeightReader:
    def __init__(self, tensors: dict, dtype: torch.dtype, device: torch.device, ops, prefix: str = "",
                 norm_offset: float = 0.0):
        self.tensors, self.dtype, self.device, self.ops, self.prefix = tensors, dtype, device, ops, prefix
        self.norm_offset = norm_offset  # the family's (models/spec.Family.norm_offset)

    def under(self, prefix: str) -> "WeightReader":
        return WeightReader(self.tensors, self.dtype, self.device, self.ops, self.prefix + prefix, self.norm_offset)

    def has(self, name: str) -> bool:
        return self.prefix + name in self.tensors

    def dense(self, name: str) -> torch.Tensor:
        full = self.prefix + name
        if full not in self.tensors:
            raise CheckpointError(f"missing tensor '{full}'")
        return self.tensors[full].to(device=self.device, dtype=self.dtype).contiguous()

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.dense(name) if self.has(name) else None

    def norm(self, name: str) -> torch.Tensor:
        """An RMSNorm weight as the norm multiplies by it: the family's offset added in float32,
        then the dtype."""
        if not self.norm_offset:
            return self.dense(name)
        return (self.float32(name) + self.norm_offset).to(self.dtype).contiguous()

    def maybe_norm(self, name: str) -> torch.Tensor | None:
        return self.norm(name) if self.has(name) else None

    def float32(self, name: str) -> torch.Tensor:
        """A dense tensor as float32, whatever the dtype (parameters kept at full precision)."""
        full = self.prefix + name
        if full not in self.tensors:
            raise CheckpointError(f"missing tensor '{full}'")
        return self.tensors[full].to(device=self.device, dtype=torch.float32).contiguous()

    def matrix(self, name: str):
        """A GEMM matrix as stored for the op set: quantized blocks stay blocks (on the device;
        left in the file for an op set that packs from it), dense ones become the dtype; one kept
        in its file's column order (StoredColumns) stays so around its stored matrix."""
        stored = self.tensors.get(self.prefix + name)
        if isinstance(stored, StoredColumns):
            return stored.map(lambda inner: self._matrix(name, inner))
        return self._matrix(name, stored)

    def _matrix(self, name: str, stored):
        if isinstance(stored, FileBlocks):
            if self.ops.Linear.reads_files and self.device.type == "cpu":
                return stored  # packed from the file's bytes by Linear
            return stored.load().to(self.device)  # read from its file now, and not kept here
        if isinstance(stored, quant_gemm.QuantWeight):
            return stored.to(self.device)
        return self.dense(name)

    def vocab_head(self, matrix, packed=None):
        """The LM head from its matrix (`packed`: the same matrix already a LinearWeight, a tied
        quantized table, kept once)."""
        return packed if packed is not None else self.ops.Linear.of(matrix)

    def linear(self, *names: str, biases: tuple[str, ...] = ()):
        """One LinearWeight from matrices stacked along N (Q/K/V, gate/up), with their biases
        where the checkpoint has every one of them."""
        bias_parts = [self.maybe(b) for b in biases]
        bias = torch.cat(bias_parts) if bias_parts and all(b is not None for b in bias_parts) else None
        return self.ops.Linear.of(*(self.matrix(n) for n in names), bias=bias)
