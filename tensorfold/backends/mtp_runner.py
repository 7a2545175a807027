"""Runs a model's MTP layer (models/mtp.py) for the engine's MTP drafter: the runner's half of
engine/draft_plan.py, on the torch backends. What it holds and when it runs the layer is
backends/mtp_rows.py's (shared with the mlx backend's runner); here are the torch steps: the
layer's ForwardBatch, its forward over the cache's layers after the model's, the greedy argmax
(ties to the lower id).
"""
import torch

from tensorfold.backends.mtp_rows import MTPRows, last_rows
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows


class MTPRunner(MTPRows):
    def __init__(self, model, cache):
        # the MTP layer's parts: the cache's layers after the model's
        super().__init__(model.mtp, [cache.layer(len(model.layers) + i) for i in range(len(model.mtp.layers))],
                         cache.block_size)
        self.device = model.device

    def _forward(self, hidden: torch.Tensor, pieces, drawing: list[int]):
        logits, out = self.mtp.forward(hidden, self._batch(pieces, drawing), self.caches)
        return (logits.argmax(dim=-1).tolist() if logits.numel() else []), out

    def _cat(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(rows)

    def _stack(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(rows)

    def _copy(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.clone()

    def _batch(self, pieces, drawing: list[int]) -> ForwardBatch:
        """Rows (start position, tokens, block ids) per sequence; logits of the last row of each
        sequence in `drawing`."""
        bs, device = self.block_size, self.device
        ids, positions, slots, sequences = [], [], [], []
        for start, tokens, blocks in pieces:
            first = len(ids)
            pos = range(start, start + len(tokens))
            ids += tokens
            positions += pos
            slots += [blocks[p // bs] * bs + p % bs for p in pos]
            sequences.append(SequenceRows(first, len(ids), torch.tensor(blocks, dtype=torch.int64, device=device),
                                          list(blocks)))
        ends = last_rows(pieces)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return ForwardBatch(as_tensor(ids), as_tensor(positions), as_tensor(slots), sequences,
                            as_tensor([ends[i] for i in drawing]), positions_end=max(positions, default=-1) + 1,
                            host_positions=positions)
