"""Drafting with the checkpoint's multi-token-prediction layer (models/mtp.py), the engine's half:
which rows the MTP layer runs, in plain data (engine/draft_plan.py); the runner's `mtp`
(backends/mtp_runner.py) runs them.

The MTP layer keeps its own K/V, one more layer of the cache under the request's block ids. The
rule that keeps it right, whatever drafts were accepted, rejected, cached or preempted: after
every round, its K/V covers exactly the target's computed positions [0, num_computed_tokens).

- After a round (round_done): the rows the target kept, positions [start, computed) of the
  round's rows, go through the MTP layer with the token after each (now known: a prompt token,
  an accepted draft or the round's draw), the target's hidden state of that row beside it. A
  rejected draft's row is not kept (rollback already moved num_computed_tokens back), nor are
  rows past a recurrent model's rewind, which the target computes again later and the MTP layer
  then catches up. A request that finished this round is caught up too (its blocks go to the
  prefix cache), up to its last token with a successor.
- A preempted request recomputes from 0 and the MTP layer with it. A prefix hit reuses the MTP
  K/V in the hit blocks, which is what a fresh run writes provided each block's last slot (the
  row of the next block's first token) belongs to a matched token: the cache book recomputes the
  hit's last block (CacheBook.recompute_last_hit).
- Before a round (propose): a decoding request's first draft came out of its catch-up; each
  further one is an MTP forward fed its own last hidden state and draft, whose K/V lands past
  the computed positions (scratch, overwritten by the next catch-up) in blocks reserved without
  preempting anyone (fewer drafts where none are free).
"""
from tensorfold.engine.cache_book import CacheBook
from tensorfold.engine.draft_plan import CatchUp, ChainDraft
from tensorfold.engine.request import Request, Status


class MTPDrafter:
    def __init__(self, runner_mtp, book: CacheBook):
        self.mtp, self.book = runner_mtp, book

    def round_done(self, plan, requests: dict[str, Request]) -> None:
        """The round's kept rows into the MTP layer's K/V (`requests`: every scheduled request,
        finished ones included)."""
        asks = []
        for scheduled in plan.requests:
            req = requests[scheduled.req_id]
            if not req.params.draft or req.finish_reason == "error":
                continue
            end = min(req.num_computed_tokens, req.num_tokens - 1)  # rows whose next token is known
            start = scheduled.start_position
            if end <= start:
                continue
            decoding = req.status is not Status.FINISHED and req.num_computed_tokens == req.num_tokens - 1
            asks.append(CatchUp(req.req_id, start, [req.token_at(j + 1) for j in range(start, end)],
                                list(scheduled.block_ids), want_draft=decoding))
        self.mtp.catch_up(asks)

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to `depth` drafts for each (decoding request, depth); a depth of 0 still gives the
        first draft (free: the catch-up drew it), for the draft budget's shadow scoring."""
        asks = []
        for req, depth in wanted:
            position = req.num_computed_tokens - 1
            if depth > 1:  # chained rows write positions position + 1 ... position + depth - 1
                depth = max(1, self.book.reserve(req, position + depth) - position)
            asks.append(ChainDraft(req.req_id, position, list(req.block_ids), max(depth, 1)))
        return self.mtp.draft(asks)

    def forget(self, req_id: str) -> None:
        self.mtp.forget(req_id)
