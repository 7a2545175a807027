"""The MoE's own steps, the torch references (models/moe.py): the router's choice and weights
(`route`; `route_sigmoid`, Nemotron-H's sigmoid routing with a bias and groups), the pairs grouped by expert (`group_by_expert`) and the sum of a token's expert
outputs (`combine`).

Batch invariant by construction: each row's choice and weights come from that row alone; the
top k by a stable sort (ties to the lower expert index); exp is exact.float32's; the sum over
the chosen experts is added in rank order, the sum over every expert exactly on a grid.
"""
import torch

from tensorfold.exact import float32, grid
from tensorfold.kernels.reference import sigmoid32

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


def group_by_expert(experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, choice) pairs of experts [rows, k] grouped by expert: (order [rows * k]: the
    pairs' flat indices in that order, rows ascending within an expert; y_rows [rows, k]: each
    pair's place in it), what a block runs each expert's GEMMs over and what combine reads back."""
    order = torch.argsort(experts.flatten(), stable=True)
    y_rows = torch.empty_like(order)
    y_rows[order] = torch.arange(order.numel(), device=order.device)
    return order, y_rows.view(experts.shape)


def combine(y: torch.Tensor, y_rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
            shared_gate: torch.Tensor | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE's sum (models/moe.MoE.compose's): out [rows, hidden] in y's dtype, where each row adds,
    from 0 in float32 and in ascending expert index, its experts' outputs y[y_rows[r, j]] times
    weights[r, j] (the product rounded first), then sigmoid32(shared_gate [rows, 1]) * shared."""
    order = torch.argsort(experts, dim=1, stable=True)  # a row's experts are distinct
    out = torch.zeros((experts.shape[0], y.shape[1]), dtype=torch.float32, device=y.device)
    for i in range(experts.shape[1]):
        j = order[:, i:i + 1]
        out += y[y_rows.gather(1, j).squeeze(1)].float() * weights.gather(1, j)
    if shared is not None:
        out += sigmoid32(shared_gate.float()) * shared.float()
    return out.to(y.dtype)


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing with a correction bias and group-limited choice (Nemotron-H, DeepSeek-V3's
    noaux_tc): (experts [rows, k] int64, weights [rows, k] float32) from router logits [rows, E]
    float32 and bias [E]. scores = sigmoid(logits) (sigmoid32); the choice ranks scores + bias;
    with n_group > 1 only the topk_group groups whose two best (score + bias) sum highest are
    ranked (the others -inf); the top k by a stable sort, ties (groups and experts) to the lower
    index. Weights are the chosen experts' scores (not the biased ones), over their sum added in
    rank order plus 1e-20 where normalize, times scale: float32 steps in that order."""
    scores = sigmoid32(logits)
    choice = scores + bias.float()
    rows, num_experts = choice.shape
    if n_group > 1:
        grouped = torch.sort(choice.view(rows, n_group, -1), dim=-1, descending=True, stable=True)[0]
        group_scores = grouped[..., 0] + grouped[..., 1]  # [rows, n_group]
        kept = torch.sort(group_scores, dim=-1, descending=True, stable=True)[1][:, :topk_group]
        mask = torch.zeros((rows, n_group), dtype=torch.bool, device=choice.device).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(num_experts // n_group, dim=1), float("-inf"))
    index = torch.sort(choice, dim=-1, descending=True, stable=True)[1][:, :top_k]
    weights = scores.gather(1, index)
    if normalize:
        total = weights[:, 0].clone()
        for j in range(1, top_k):
            total += weights[:, j]
        weights = weights / (total + float32.f32(1e-20))[:, None]
    return index, weights * float32.f32(scale)
