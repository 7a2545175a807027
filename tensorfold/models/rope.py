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
        # M-RoPE (Qwen3.5, interleaved): the axis (0 temporal, 1 height, 2 width) whose position
        # turns each column; text rows have three equal positions, so only images see the axes.
        self.axes = None if rope.mrope_section is None else mrope_axes(rope.mrope_section, head_dim).to(device)


def mrope_axes(section: tuple[int, ...], head_dim: int) -> torch.Tensor:
    """[head_dim] int64: frequency j turns with height where j % 3 == 1 and j < 3 * section[1], with
    width where j % 3 == 2 and j < 3 * section[2], else with time (transformers' interleaved layout);
    both halves of the head alike (rotate_half)."""
    axes = []
    for j in range(head_dim // 2):
        axes.append(1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0)
    return torch.tensor(axes + axes, dtype=torch.int64)


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
