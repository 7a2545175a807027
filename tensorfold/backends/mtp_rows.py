"""The MTP layer's runner, its backend-neutral half: the engine's asks (engine/draft_plan.py) in,
drafts out, over rows of whatever arrays the backend's model uses (torch tensors for the torch
backends' backends/mtp_runner.MTPRunner, MLX arrays for mlx/mtp.MLXMTPRunner).

The target forward hands over every row's final hidden state (keep()); the runner holds, per
request, the hidden states of one contiguous run of positions (a round from inside the run cuts
it there: drafts rejected, a recurrent rewind; from elsewhere starts a new one: preemption) until
the engine asks for them. catch_up() feeds asked rows to the MTP layer, which writes its K/V at
their positions, and keeps, for a request that drafts, the last row's output hidden state and its
greedy draft; draft() chains from there, one MTP forward per further draft, batched over the
requests that want that many. Drafts are greedy on the MTP logits (argmax, ties to the lower
id). Nothing here decides which tokens a reply keeps: the engine verifies every draft against
the keyed draws.

A backend's runner subclasses MTPRows with its array steps:

    _forward(hidden, pieces, drawing)  the MTP layer over rows hidden [rows, hidden] (h[j] per
                                       row), pieces [(start position, t[j + 1] per row, block
                                       ids)] one per sequence, its caches; returns (the greedy
                                       draft of the last row of each sequence in `drawing`, in
                                       that order; the output hidden states [rows, hidden])
    _cat(rows), _stack(rows)           rows joined along the first axis; single rows stacked
    _copy(rows)                        rows in storage of their own (what a view kept alive is let go)
"""
from tensorfold.engine.draft_plan import CatchUp, ChainDraft


class MTPRows:
    def __init__(self, mtp, caches: list, block_size: int):
        """mtp: the model's MTP layer; caches: its layers' parts of the cache (after the model's)."""
        self.mtp, self.caches, self.block_size = mtp, caches, block_size
        self._held: dict[str, HeldRows] = {}
        self._chain: dict[str, tuple] = {}  # req_id -> (position, h' [hidden], draft)
        self.num_forwards = 0  # MTP layer passes run (catch-ups and chained steps)

    # ---- the backend's array steps ----

    def _forward(self, hidden, pieces: list[tuple[int, list[int], list[int]]], drawing: list[int]):
        raise NotImplementedError

    def _cat(self, rows: list):
        raise NotImplementedError

    def _stack(self, rows: list):
        raise NotImplementedError

    def _copy(self, rows):
        raise NotImplementedError

    # ---- the asks ----

    def keep(self, plan, hidden) -> None:
        """The last target forward's hidden states [num_rows, hidden], per scheduled request."""
        row, held_by_id, alone = 0, self._held, len(plan.requests) == 1
        for req in plan.requests:
            num, start = len(req.token_ids), req.start_position
            rows = hidden if alone else hidden[row:row + num]  # [num, hidden]
            held = held_by_id.get(req.req_id)
            if held is None:
                held = held_by_id[req.req_id] = HeldRows(self._cat, self._copy)
            if start == held.end and held.runs:  # a decode round: the run grows by its rows
                held.runs.append(rows)
                held.end = start + num
            else:
                held.put(start, rows)
            row += num

    def held(self, req_id: str) -> tuple[int, int]:
        """The positions [first, end) whose hidden states are held for req_id."""
        held = self._held.get(req_id)
        return (held.first, held.end) if held is not None else (0, 0)

    def catch_up(self, asks: list[CatchUp]) -> None:
        """Each ask's rows through the MTP layer in one pass; the rows before the last one asked
        are let go (the last stays: a drafting request runs it again for its draft)."""
        if not asks:
            return
        rows = [self._held[ask.req_id].rows(ask.start_position, len(ask.token_ids)) for ask in asks]
        pieces = [(ask.start_position, ask.token_ids, ask.block_ids) for ask in asks]
        drawing = [i for i, ask in enumerate(asks) if ask.want_draft]
        drafts, out = self._forward(self._cat(rows), pieces, drawing)
        self.num_forwards += 1
        for ask in asks:
            self._held[ask.req_id].drop_before(ask.start_position + len(ask.token_ids) - 1)
        ends = last_rows(pieces)
        for i, draft in zip(drawing, drafts):
            ask = asks[i]
            self._chain[ask.req_id] = (ask.start_position + len(ask.token_ids) - 1, out[ends[i]], draft)

    def draft(self, asks: list[ChainDraft]) -> dict[str, list[int]]:
        """Each ask's drafts: the caught-up one, then num_drafts - 1 chained ones (fewer where the
        request has no caught-up state at ask.position)."""
        proposals, live = {}, []
        for ask in asks:
            state = self._chain.pop(ask.req_id, None)
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
            drafts, out = self._forward(self._stack([h for _, h in live]), pieces, list(range(len(live))))
            self.num_forwards += 1
            for i, ((ask, _), draft) in enumerate(zip(live, drafts)):
                proposals[ask.req_id].append(draft)
                live[i] = (ask, out[i])
            step += 1

    def forget(self, req_id: str) -> None:
        self._chain.pop(req_id, None)
        self._held.pop(req_id, None)


def last_rows(pieces) -> list[int]:
    """The batch row of each piece's last token (pieces' rows laid end to end)."""
    ends, total = [], 0
    for _, tokens, _ in pieces:
        total += len(tokens)
        ends.append(total - 1)
    return ends


class HeldRows:
    """One request's target hidden states for a contiguous run of positions [first, end): the
    forward's own rows (views, no copy: a decode round adds one), joined when read. Rows put from
    inside the run (or at its end) replace the run from there on (rejected drafts' rows, a
    recurrent rewind's recomputed ones); rows from elsewhere start a new run (a preempted
    request recomputing). cat, copy: the backend's (MTPRows._cat, _copy)."""

    def __init__(self, cat, copy):
        self.cat, self.copy = cat, copy
        self.runs: list = []  # each [rows, hidden], in position order
        self.first = self.end = 0

    def put(self, position: int, rows) -> None:
        if position != self.end:
            if self.first <= position < self.end:
                self.runs = [self._joined()[:position - self.first]]
            else:
                self.first, self.runs = position, []
        self.runs.append(rows)
        self.end = position + len(rows)

    def rows(self, position: int, num: int):
        assert self.first <= position and position + num <= self.end, (position, num, self.first, self.end)
        return self._joined()[position - self.first:position - self.first + num]  # [num, hidden]

    def drop_before(self, position: int) -> None:
        """Let the rows before `position` go (after the MTP layer read them)."""
        position = min(max(position, self.first), self.end)
        self.runs = [self.copy(self._joined()[position - self.first:])]
        self.first = position

    def _joined(self):
        if len(self.runs) > 1:
            self.runs = [self.cat(self.runs)]
        return self.runs[0]
