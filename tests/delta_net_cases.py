"""Shared pieces of the Gated DeltaNet kernel tests (C++: test_delta_net_kernels.py, Triton:
test_delta_net_triton.py): random block tables, poisoning the blocks a call writes, bitwise
comparison with NaNs."""
import torch

from kernel_inputs import NAN


def random_tables(draw, spans, block_size, spare: int = 2):
    """Distinct blocks for every sequence, in a random order, and `spare` more; returns
    (tables, num_blocks)."""
    lengths = [(p0 + n + block_size - 1) // block_size for p0, n in spans]
    num_blocks = sum(lengths) + spare
    order = torch.randperm(num_blocks, generator=draw.gen).tolist()
    tables, at = [], 0
    for length in lengths:
        tables.append(order[at:at + length])
        at += length
    return tables, num_blocks


def poison_written_blocks(state, spans, tables):
    """NaN into the blocks a call writes without reading them first (both sides get the same)."""
    bs = state.block_size
    for (p0, n), table in zip(spans, tables):
        read = table[(p0 - 1) // bs] if p0 > 0 else None
        for pos in range(p0, p0 + n):
            block = table[pos // bs]
            if block != read:
                state.conv[block] = NAN
                state.ssm[block] = NAN


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equality, NaNs included (poisoned blocks that nobody writes stay NaN on both sides)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[x.dtype]
    return torch.equal(x.cpu().contiguous().view(view), y.cpu().contiguous().view(view))
