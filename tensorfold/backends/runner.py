"""Executes a StepPlan: builds the flattened batch, runs the model, draws each row's token.

It decides nothing: which rows run and which draws are kept is the scheduler's and the
engine's business. The draws are keyed (seed, position, token), so they do not depend on what
else shares the round. The batch tensors go to the model's device; the draw is the model's op
set's `sample` (the torch sampler on cpu, the Triton one on cuda), which returns Python ints.
"""
import torch

from tensorfold.backends.image_cache import ImageCache
from tensorfold.backends.mtp_runner import MTPRunner
from tensorfold.engine.step_plan import StepPlan
from tensorfold.models.cache import ModelCache
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
from tensorfold.vision.placement import rope_positions


def per_request(plan: StepPlan, drawn: list[int]) -> list[list[int]]:
    """The round's drawn tokens (every drawing row, in plan order) cut per scheduled request."""
    out, i = [], 0
    for req in plan.requests:
        out.append(drawn[i:i + len(req.rows)])
        i += len(req.rows)
    return out


class ModelRunner:
    def __init__(self, model, cache: ModelCache, image_cache_bytes: int = 256 * 2**20):
        self.model = model
        self.cache = cache
        # The MTP layer's runner (backends/mtp_runner.py) where the model has one loaded.
        self.mtp = MTPRunner(model, cache) if model.mtp is not None else None
        # Encoded images by content hash (backends/image_cache.py) where a vision tower is loaded.
        self.images = (ImageCache(model.vision, model.vision.preprocess, image_cache_bytes)
                       if model.vision is not None else None)

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """One forward; returns, per scheduled request, the tokens drawn for its rows."""
        batch = self._batch(plan)
        if self.images is not None and any(req.images for req in plan.requests):
            self._place_images(plan, batch)
        if self.mtp is not None:  # every row's hidden state goes to the MTP layer's catch-up
            logits, hidden = self.model.forward(batch, self.cache, hidden=True)
            self.mtp.keep(plan, hidden)
        else:
            logits = self.model.forward(batch, self.cache)  # [num_draw_rows, vocab]
        rows = [row for req in plan.requests for row in req.rows]
        return per_request(plan, self.model.ops.sample(logits, rows, bitmask=plan.bitmask) if rows else [])

    def _batch(self, plan: StepPlan) -> ForwardBatch:
        block_size, device = self.cache.block_size, self.model.device
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        input_ids, positions, slots, sequences, logits_rows = [], [], [], [], []
        groups = [([], []) for _ in self.cache.windows[1:]]  # per further group: slots, tables
        for req in plan.requests:
            start_row = len(input_ids)
            num = len(req.token_ids)
            pos = range(req.start_position, req.start_position + num)
            input_ids += req.token_ids
            positions += pos
            slots += [req.block_ids[p // block_size] * block_size + p % block_size for p in pos]
            sequences.append(SequenceRows(start_row, start_row + num, as_tensor(req.block_ids), list(req.block_ids)))
            for (group_slots, tables), table in zip(groups, req.group_block_ids):
                group_slots += [table[p // block_size] * block_size + p % block_size for p in pos]
                # A freed block (NULL_BLOCK, -1) is before every row's window: never read, any id will do.
                tables.append(as_tensor([max(b, 0) for b in table]))
            logits_rows += range(start_row + num - len(req.rows), start_row + num)
        return ForwardBatch(as_tensor(input_ids), as_tensor(positions), as_tensor(slots),
                            sequences, as_tensor(logits_rows),
                            [(as_tensor(s), t) for s, t in groups] if plan.requests and groups else [],
                            positions_end=max(positions, default=-1) + 1, host_positions=positions)

    def _place_images(self, plan: StepPlan, batch: ForwardBatch) -> None:
        """Every row's M-RoPE positions, and the image embeddings of the pad rows this round
        feeds (vision/placement.py); rows of requests without images keep (p, p, p)."""
        t_pos, h_pos, w_pos, rows, fed = [], [], [], [], []
        start_row = 0
        for req in plan.requests:
            num = len(req.token_ids)
            t, h, w = rope_positions(req.images, req.start_position, num)
            t_pos += t
            h_pos += h
            w_pos += w
            end = req.start_position + num
            for span in req.images:
                first, last = max(span.offset, req.start_position), min(span.end, end)
                if first < last:
                    rows += range(start_row + first - req.start_position, start_row + last - req.start_position)
                    fed.append((span, first - span.offset, last - span.offset))
            start_row += num
        device = self.model.device
        batch.rope_positions = torch.tensor([t_pos, h_pos, w_pos], dtype=torch.int64, device=device)
        if rows:  # the round's images encoded together where not kept (the tower is batch invariant)
            embeddings = self.images.embeddings_of([span.image for span, _, _ in fed])
            parts = [e[a:b] for e, (_, a, b) in zip(embeddings, fed)]
            batch.image_rows = (torch.tensor(rows, dtype=torch.int64, device=device), torch.cat(parts))
