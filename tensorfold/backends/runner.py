"""Executes a StepPlan: builds the flattened batch, runs the model, draws each row's token.

It decides nothing: which rows run and which draws are kept is the scheduler's and the
engine's business. The draws are keyed (seed, position, token), so they do not depend on what
else shares the round. The batch tensors go to the model's device; the draw is the model's op
set's `sample` (the torch sampler on cpu, the Triton one on cuda), which returns Python ints.
"""
import torch

from tensorfold.backends.mtp_runner import MTPRunner
from tensorfold.engine.step_plan import StepPlan
from tensorfold.models.cache import ModelCache
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows


def per_request(plan: StepPlan, drawn: list[int]) -> list[list[int]]:
    """The round's drawn tokens (every drawing row, in plan order) cut per scheduled request."""
    out, i = [], 0
    for req in plan.requests:
        out.append(drawn[i:i + len(req.rows)])
        i += len(req.rows)
    return out


class ModelRunner:
    def __init__(self, model, cache: ModelCache):
        self.model = model
        self.cache = cache
        # The MTP layer's runner (backends/mtp_runner.py) where the model has one loaded.
        self.mtp = MTPRunner(model, cache) if model.mtp is not None else None

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """One forward; returns, per scheduled request, the tokens drawn for its rows."""
        batch = self._batch(plan)
        if self.mtp is not None:  # every row's hidden state goes to the MTP layer's catch-up
            logits, hidden = self.model.forward(batch, self.cache, hidden=True)
            self.mtp.keep(plan, hidden)
        else:
            logits = self.model.forward(batch, self.cache)  # [num_draw_rows, vocab]
        rows = [row for req in plan.requests for row in req.rows]
        return per_request(plan, self.model.ops.sample(logits, rows, bitmask=plan.bitmask) if rows else [])

    def _batch(self, plan: StepPlan) -> ForwardBatch:
        block_size, device = self.cache.block_size, self.model.device
        input_ids, positions, slots, sequences, logits_rows = [], [], [], [], []
        for req in plan.requests:
            start_row = len(input_ids)
            num = len(req.token_ids)
            pos = range(req.start_position, req.start_position + num)
            input_ids += req.token_ids
            positions += pos
            slots += [req.block_ids[p // block_size] * block_size + p % block_size for p in pos]
            sequences.append(SequenceRows(start_row, start_row + num,
                                          torch.tensor(req.block_ids, dtype=torch.int64, device=device)))
            logits_rows += range(start_row + num - len(req.rows), start_row + num)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return ForwardBatch(as_tensor(input_ids), as_tensor(positions), as_tensor(slots),
                            sequences, as_tensor(logits_rows))
