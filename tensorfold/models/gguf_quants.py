"""Dequantizing GGUF tensor data to float32 torch tensors.

One function per storage type, each vectorized over all blocks at once (no Python loop over
blocks). Every block type stores 32 weights; a block's scale `d` (and minimum `m`) are float16
values widened to float32 before use, so the results equal the `gguf` package's reference
dequantizer bit for bit (tests/models/test_gguf.py checks this).

Block layouts (bytes, little-endian):
    Q8_0  [d:f16][q:int8 x 32]                 x = q * d
    Q4_0  [d:f16][q:u4 x 32 packed in 16]      x = (q - 8) * d
    Q4_1  [d:f16][m:f16][q:u4 x 32 in 16]      x = q * d + m
A packed byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
"""
import torch
from gguf import GGMLQuantizationType as QType

BLOCK_SIZE = 32


def _blocks(raw: torch.Tensor, type_size: int) -> torch.Tensor:
    return raw.reshape(-1, type_size)  # [num_blocks, type_size]


def _f16(column_bytes: torch.Tensor) -> torch.Tensor:
    return column_bytes.contiguous().view(torch.float16).to(torch.float32)  # [num_blocks, 1]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)  # [num_blocks, 32] uint8


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, 2 + BLOCK_SIZE)
    d = _f16(blocks[:, :2])
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q * d


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, 2 + BLOCK_SIZE // 2)
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return q.to(torch.float32) * d


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(raw, 4 + BLOCK_SIZE // 2)
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:]).to(torch.float32)
    return q * d + m


DEQUANTIZERS = {
    QType.F32: lambda raw: raw.view(torch.float32),
    QType.F16: lambda raw: raw.view(torch.float16).to(torch.float32),
    QType.BF16: lambda raw: raw.view(torch.bfloat16).to(torch.float32),  # exact: bf16 is f32's top half
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
}


def dequantize(raw: torch.Tensor, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw` is the tensor's bytes (1-D uint8); returns float32 of `shape` (row-major, HF order).

    Raises KeyError for a type not in DEQUANTIZERS; the caller names the file and tensor.
    """
    return DEQUANTIZERS[qtype](raw).reshape(shape)
