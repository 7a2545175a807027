"""Rope tables: cos/sin per position for each (rope config, head dim) a model's layers use.

Built once at load on the CPU (kernels/reference.rope_table: float64 angles rounded once), then
moved to the model's device; layers with the same rope share one table. A forward gathers each
table's rows for its positions once (ForwardBatch.rope_rows), however many layers read them.
"""
import torch

from tensorfold.kernels import reference
from tensorfold.models.config import RopeConfig, rope_inv_freq


class RopeTable:
    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int, device):
        inv_freq, scale = rope_inv_freq(rope, head_dim)
        cos, sin = reference.rope_table(inv_freq, scale, max_position)
        self.cos, self.sin = cos.to(device), sin.to(device)  # [max_position, head_dim]


class RopeTables:
    def __init__(self, device):
        self.device = device
        self._tables: dict[tuple, RopeTable] = {}

    def get(self, rope: RopeConfig, head_dim: int, max_position: int) -> RopeTable:
        key = (rope, head_dim, max_position)
        if key not in self._tables:
            self._tables[key] = RopeTable(rope, head_dim, max_position, self.device)
        return self._tables[key]

    def __iter__(self):
        return iter(self._tables.values())
