"""Rope tables: cos/sin per position for each (rope config, head dim) a model's layers use.

Made on the CPU (kernels/reference.rope_table), then moved to the model's device; layers with the
same rope share one table. A table holds the rows the longest sequence so far needed (FIRST_ROWS at
load, doubled as positions pass its end, up to max_position), not max_position_embeddings' rows
from the start: a 512-wide head's table at 131k positions is 512 MiB. Every step of a row is an
elementwise float32 operation, so a row has the same bits however many rows are made with it
(tests/test_rope_tables.py). A forward gathers each table's rows for its positions once
(ForwardBatch.rope_rows), however many layers read them.
"""
import torch

from tensorfold.kernels import reference
from tensorfold.models.config import RopeConfig, rope_inv_freq


FIRST_ROWS = 4096  # rows a table is made with at load


class RopeTable:
    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int, device):
        self.inv_freq, self.scale = rope_inv_freq(rope, head_dim)
        self.max_position, self.device = max_position, device
        self._make(min(FIRST_ROWS, max_position))
        # M-RoPE (Qwen3.5, interleaved): the axis (0 temporal, 1 height, 2 width) whose position
        # turns each column; text rows have three equal positions, so only images see the axes.
        self.axes = None if rope.mrope_section is None else mrope_axes(rope.mrope_section, head_dim).to(device)

    def _make(self, rows: int) -> None:
        cos, sin = reference.rope_table(self.inv_freq, self.scale, rows)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)  # [rows, head_dim]

    def cover(self, end: int) -> None:
        """Rows for positions [0, end) at least (twice the rows there were, where that is more;
        never past max_position: a position beyond it is refused by indexing)."""
        if end > self.cos.shape[0]:
            self._make(min(max(end, 2 * self.cos.shape[0]), self.max_position))


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
