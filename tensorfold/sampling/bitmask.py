"""Allowed-token masks as bits, in xgrammar's layout: int32 [rows, ceil(vocab / 32)], bit j of
word w is token 32 w + j (a set bit: allowed). The engine builds one per round for the rows
that carry a constraint, rows without one all ones; every sampler (torch, C++, Triton) reads
this form and no other.
"""
import torch

ALL = -1  # an int32 word with every bit set


def num_words(vocab: int) -> int:
    return -(-vocab // 32)


def full(rows: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A bitmask allowing every token in every row."""
    return torch.full((rows, num_words(vocab)), ALL, dtype=torch.int32, device=device)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, vocab] -> int32 [rows, ceil(vocab / 32)]."""
    num_rows, vocab = allowed.shape
    words = num_words(vocab)
    bits = torch.zeros((num_rows, words * 32), dtype=torch.int64, device=allowed.device)
    bits[:, :vocab] = allowed.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=allowed.device) << torch.arange(32, device=allowed.device)
    packed = (bits.view(num_rows, words, 32) * weights).sum(dim=2)  # [rows, words] in [0, 2^32)
    return (packed - (packed >> 31 << 32)).to(torch.int32)


def unpack(bitmask: torch.Tensor, width: int, offset: int = 0) -> torch.Tensor:
    """int32 [rows, words] -> bool [rows, width]: the bits of tokens offset .. offset + width - 1
    (a vocabulary shard's columns). Tokens past the bitmask's words are not allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    first, last = offset // 32, min(bitmask.shape[1], num_words(offset + width))
    bits = ((bitmask[:, first:last].unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    out = torch.zeros((bitmask.shape[0], width), dtype=torch.bool, device=bitmask.device)
    part = bits[:, offset - first * 32:offset - first * 32 + width]
    out[:, :part.shape[1]] = part
    return out


def check(bitmask: torch.Tensor, rows: int, vocab: int) -> None:
    """Raise ValueError unless bitmask is int32 [rows, >= vocab / 32]."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != rows \
            or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask {bitmask.dtype} {tuple(bitmask.shape)} does not cover {rows} rows of "
                         f"{vocab} tokens")
