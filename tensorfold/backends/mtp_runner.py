"""Runs a model's MTP layer (models/mtp.py) for the engine's MTP drafter: the runner's half of
engine/draft_plan.py.

The target forward hands over every row's final hidden state (keep()); catch_up() feeds the kept
rows of the last round to the MTP layer, which writes its K/V at their positions, and keeps, for a
decoding request, the last row's output hidden state and its greedy draft; draft() chains from
there, one MTP forward per further draft, batched over the requests that want that many. Drafts
are greedy on the MTP logits (argmax, ties to the lower id). Nothing here decides which tokens a
reply keeps: the engine verifies every draft against the keyed draws.
"""
import torch

from tensorfold.engine.draft_plan import CatchUp, ChainDraft
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows


class MTPRunner:
    def __init__(self, model, cache):
        self.mtp, self.device = model.mtp, model.device
        self.kv = cache.layer(len(model.layers))  # the MTP layer's part: the cache's last layer
        self.block_size = cache.block_size
        self._hidden: dict[str, tuple[int, torch.Tensor]] = {}      # req_id -> (first position, [rows, hidden])
        self._chain: dict[str, tuple[int, torch.Tensor, int]] = {}  # req_id -> (position, h' [hidden], draft)

    def keep(self, plan, hidden: torch.Tensor) -> None:
        """The last target forward's hidden states [num_rows, hidden], per scheduled request."""
        self._hidden, row = {}, 0
        for req in plan.requests:
            self._hidden[req.req_id] = (req.start_position, hidden[row:row + len(req.token_ids)])
            row += len(req.token_ids)

    def catch_up(self, asks: list[CatchUp]) -> None:
        if not asks:
            return
        rows = []
        for ask in asks:
            first, hidden = self._hidden[ask.req_id]
            offset = ask.start_position - first
            rows.append(hidden[offset:offset + len(ask.token_ids)])
        pieces = [(ask.start_position, ask.token_ids, ask.block_ids) for ask in asks]
        batch = self._batch(pieces, [i for i, ask in enumerate(asks) if ask.want_draft])
        logits, out = self.mtp.forward(torch.cat(rows), batch, self.kv)
        drafts = logits.argmax(dim=-1).tolist() if logits.numel() else []
        ends = batch.logits_rows.tolist()
        for ask, draft, end in zip([a for a in asks if a.want_draft], drafts, ends):
            self._chain[ask.req_id] = (ask.start_position + len(ask.token_ids) - 1, out[end], draft)
        self._hidden = {}

    def draft(self, asks: list[ChainDraft]) -> dict[str, list[int]]:
        """Each ask's drafts: the caught-up one, then num_drafts - 1 chained ones (fewer where the
        request has no caught-up state at ask.position)."""
        proposals, live = {}, []
        for ask in asks:
            state = self._chain.get(ask.req_id)
            if state is None or state[0] != ask.position or ask.num_drafts < 1:
                proposals[ask.req_id] = []
                continue
            proposals[ask.req_id] = [state[2]]
            live.append((ask, state[1]))
        step = 1
        while True:
            live = [(ask, h) for ask, h in live if ask.num_drafts > step]
            if not live:
                return proposals
            # Step s's row sits at position p + s: h' from position p + s - 1 and the draft of
            # the token at p + s + 1; it drafts the token at p + s + 2.
            pieces = [(ask.position + step, [proposals[ask.req_id][-1]], ask.block_ids) for ask, _ in live]
            batch = self._batch(pieces, list(range(len(live))))
            logits, out = self.mtp.forward(torch.stack([h for _, h in live]), batch, self.kv)
            for i, ((ask, _), draft) in enumerate(zip(live, logits.argmax(dim=-1).tolist())):
                proposals[ask.req_id].append(draft)
                live[i] = (ask, out[i])
            step += 1

    def forget(self, req_id: str) -> None:
        self._chain.pop(req_id, None)

    def _batch(self, pieces, drawing: list[int]) -> ForwardBatch:
        """Rows (start position, tokens, block ids) per sequence; logits of the last row of each
        sequence in `drawing`."""
        bs, device = self.block_size, self.device
        ids, positions, slots, sequences, ends = [], [], [], [], []
        for start, tokens, blocks in pieces:
            first = len(ids)
            pos = range(start, start + len(tokens))
            ids += tokens
            positions += pos
            slots += [blocks[p // bs] * bs + p % bs for p in pos]
            sequences.append(SequenceRows(first, len(ids), torch.tensor(blocks, dtype=torch.int64, device=device)))
            ends.append(len(ids) - 1)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return ForwardBatch(as_tensor(ids), as_tensor(positions), as_tensor(slots), sequences,
                            as_tensor([ends[i] for i in drawing]))
