"""Inputs for the latent-attention kernel tests (test_latent_attention_kernels.py and the Triton one):
a paged latent cache with block tables out of order, a batch of prefill, chunk and decode rows, and
indexer keys with exact ties, for the torch reference ops and the op sets to run on."""
from dataclasses import dataclass

import torch

from tensorfold.models.cache import LayerLatent
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows


@dataclass(frozen=True)
class Shape:
    heads: int
    latent: int
    rope: int
    index_heads: int
    index_dim: int
    block_size: int

    @property
    def dim(self) -> int:
        return self.latent + self.rope


GLM5 = Shape(16, 512, 64, 32, 128, 16)  # GLM-5's kv_lora 512 and rope 64, its indexer's 128-wide keys
GLM5_WIDE = Shape(64, 512, 64, 32, 128, 64)  # GLM-5's 64 heads
TINY = Shape(4, 32, 8, 4, 16, 4)
ODD = Shape(6, 24, 8, 3, 20, 8)  # widths and head counts off every vector step


def batch_of(runs: list[tuple[int, int]], tables: list[torch.Tensor], block_size: int,
             device="cpu") -> ForwardBatch:
    """Sequences of rows at positions [first, first + count) for each (first, count) of `runs`."""
    positions, sequences, slots, start = [], [], [], 0
    for (first, count), table in zip(runs, tables):
        pos = list(range(first, first + count))
        positions += pos
        slots += [int(table[p // block_size]) * block_size + p % block_size for p in pos]
        sequences.append(SequenceRows(start, start + count, table.to(device)))
        start += count
    rows = torch.arange(start, device=device)
    return ForwardBatch(rows, torch.tensor(positions, dtype=torch.int64, device=device),
                        torch.tensor(slots, dtype=torch.int64, device=device), sequences, rows)


def make_case(shape: Shape, runs: list[tuple[int, int]], seed: int, dtype=torch.float32, ties: bool = True,
              device="cpu"):
    """A cache holding every position the runs read, its batch, and the queries: (cache, batch,
    query [rows, heads, dim], index_q [rows, index_heads, index_dim], weights [rows, index_heads])."""
    g = torch.Generator().manual_seed(seed)
    lengths = [first + count for first, count in runs]
    need = [-(-n // shape.block_size) for n in lengths]
    order = torch.randperm(sum(need) + 3, generator=g)  # out of order, some blocks unused
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n].clone())
        at += n
    num_blocks = len(order)
    kv = torch.randn(num_blocks, shape.block_size, shape.dim, generator=g)
    kv[..., shape.latent:] *= 3.0
    index_keys = torch.randn(num_blocks, shape.block_size, shape.index_dim, generator=g)
    if ties:  # copies of earlier keys: equal scores, the lower position wins
        flat = index_keys.view(-1, shape.index_dim)
        for table, n in zip(tables, lengths):
            slot = [int(table[p // shape.block_size]) * shape.block_size + p % shape.block_size for p in range(n)]
            for p in range(3, n, 3):
                flat[slot[p]] = flat[slot[p // 2]]
    kv[0, 0] = 0.0  # a zero vector somewhere (its exponent is the smallest)
    cache = LayerLatent(kv.to(dtype).to(device), index_keys.to(dtype).to(device), shape.latent)
    batch = batch_of(runs, tables, shape.block_size, device)
    rows = batch.positions.shape[0]
    query = (torch.randn(rows, shape.heads, shape.dim, generator=g) * 0.2).to(device)
    index_q = torch.randn(rows, shape.index_heads, shape.index_dim, generator=g).to(device)
    weights = torch.randn(rows, shape.index_heads, generator=g).to(device)
    return cache, batch, query, index_q, weights


def single_rows(batch: ForwardBatch, block_size: int) -> list[tuple[int, ForwardBatch]]:
    """Each row of the batch as a batch of its own (row index, that batch)."""
    alone = []
    for seq in batch.sequences:
        for r in range(seq.start, seq.end):
            pos = int(batch.positions[r])
            alone.append((r, batch_of([(pos, 1)], [seq.block_table.cpu()], block_size, batch.positions.device)))
    return alone
