"""The MoE router's choice and weights, the torch reference (models/moe.py's `route` step).

Batch invariant by construction: each row's choice and weights come from that row alone; the
top k by a stable sort (ties to the lower expert index); exp is exact.float32's; the sum over
the chosen experts is added in rank order, the sum over every expert exactly on a grid.
"""
import torch

from tensorfold.exact import float32, grid

SUM_BITS = 40  # the all-experts sum: each exp(l - max) <= 1 on a 2^-39 grid, 2^13 experts stay below 2^53


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [rows, k] int64, weights [rows, k] float32) from router logits [rows, E] float32:
    the k largest logits, ties to the lower index (a stable sort), weights exp(l - max) over the
    chosen ones' sum added in rank order, or over every expert's sum, exact on the grid."""
    ordered, index = torch.sort(logits, dim=-1, descending=True, stable=True)
    top = float32.exp_neg(ordered[:, :top_k] - ordered[:, :1])  # [rows, k], the first is 1
    if normalize:
        total = top[:, 0].clone()
        for j in range(1, top_k):
            total += top[:, j]
    else:
        every = float32.exp_neg(logits - ordered[:, :1]).double()
        total = (grid.round_even(every * 2.0 ** (SUM_BITS - 1)).sum(dim=-1) * 2.0 ** (1 - SUM_BITS)).float()
    return index[:, :top_k], top / total[:, None]
