"""Drafting with the checkpoint's multi-token-prediction layer (models/mtp.py), the engine's half:
which rows the MTP layer runs and when, in plain data (engine/draft_plan.py); the runner's `mtp`
(backends/mtp_rows.py: the torch backends' mtp_runner.py, the mlx backend's mlx/mtp.py) runs them
and holds the target's hidden states meanwhile.

The MTP layer keeps its own K/V, one more layer of the cache under the request's block ids; slot
j holds the row of (h[j], t[j + 1]), so it can be written once t[j + 1] is known. Per request
`written` counts the positions [0, written) whose slots hold what a fresh run writes there; the
rows after it lag, their hidden states held by the runner, until one of these catches them up
in one batched pass (like a prefill chunk over the MTP layer; the op set is batch invariant, so
the K/V equals, bitwise, what a pass per round would have written):

- propose: the request drafts this round (the draft budget chose a depth, or probes it): the
  pass runs the lagging rows up to the last computed one and draws the first draft from that
  row; each further draft is an MTP forward fed its own last hidden state and draft, whose K/V
  lands past the computed positions (scratch, rewritten by the next catch-up) in blocks
  reserved without preempting anyone (fewer drafts where none are free). A round without
  drafts runs nothing of the MTP layer.
- round_done: after a prompt (or replay) chunk, its rows at once (cheap: no head; the prompt's
  blocks go to the prefix cache), and any request lagging more than MAX_LAG rows (so the held
  hidden states stay bounded).
- finishing: before a request's blocks go to the prefix cache at its end (and on abort).

A block enters the prefix cache only once the MTP K/V in it is written: req.num_hashable_tokens
= written while the request runs (engine/cache_book.py stops there). A prefix hit reuses the MTP
K/V in the hit blocks, which is what a fresh run writes provided each block's last slot (the row
of the next block's first token) belongs to a matched token: the cache book recomputes the hit's
last block (CacheBook.recompute_last_hit). A preempted request recomputes from its hit, and
`written` starts again there. A rejected draft's row is never caught up (rollback moved
num_computed_tokens back first); rows past a recurrent model's rewind are computed again by the
target and held again.
"""
import time

from tensorfold.engine.cache_book import CacheBook
from tensorfold.engine.draft_budget import DraftBudget
from tensorfold.engine.draft_plan import CatchUp, ChainDraft
from tensorfold.engine.request import Request, Status

MAX_LAG = 512  # rows a request's MTP K/V may lag before it is caught up anyway


class MTPDrafter:
    def __init__(self, runner_mtp, book: CacheBook, budget: DraftBudget):
        self.mtp, self.book, self.budget = runner_mtp, book, budget
        self._written: dict[str, tuple[int, int]] = {}  # req_id -> (written, num_preemptions then)

    def num_written(self, req: Request) -> int:
        """Positions [0, n) whose MTP K/V is written."""
        return self._written.get(req.req_id, (0, 0))[0]

    def lag(self, req: Request) -> int:
        """Rows the request's MTP K/V lags behind its computed positions."""
        return max(0, req.num_computed_tokens - self.num_written(req))

    def round_started(self, plan, requests: dict[str, Request]) -> None:
        """After the forward, before acceptance: a new request (or one recomputing after a
        preemption) has its MTP K/V written up to where its round started (its prefix hit), and
        the prefix cache takes none of its blocks past what is written. (A request that never
        drafts, "draft": false, is caught up all the same: its blocks may serve others' hits.)"""
        for scheduled in plan.requests:
            req = requests[scheduled.req_id]
            written, preemptions = self._written.get(req.req_id, (None, req.num_preemptions))
            if written is None or preemptions != req.num_preemptions:
                self._written[req.req_id] = (scheduled.start_position, req.num_preemptions)
            req.num_hashable_tokens = self._written[req.req_id][0]

    def round_done(self, plan, requests: dict[str, Request]) -> None:
        """After the round's acceptance (`requests`: every scheduled request, finished ones
        included): prompt (and replay) chunks and long lags are caught up."""
        asks = []
        for scheduled in plan.requests:
            req = requests[scheduled.req_id]
            if req.status is Status.FINISHED or req.req_id not in self._written:
                continue
            if self.lag(req) > MAX_LAG:
                asks += self._ask(req, want_draft=False)
            elif scheduled.rows_prefill:  # the blocks the chunk filled, for the prefix cache
                asks += self._ask(req, want_draft=False, whole_blocks=True)
        self._catch_up(asks)
        for ask in asks:
            requests[ask.req_id].num_hashable_tokens = self._written[ask.req_id][0]

    def finishing(self, req: Request) -> None:
        """Before the request's blocks go to the prefix cache: every row with a known successor."""
        if req.req_id in self._written and req.finish_reason != "error":
            self._catch_up(self._ask(req, want_draft=False, whole_blocks=True))
            req.num_hashable_tokens = self._written[req.req_id][0]

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to `depth` drafts for each (decoding request, depth >= 1): the catch-up pass, then
        the chained steps; each part timed for the draft budget."""
        asks, chains = [], []
        for req, depth in wanted:
            position = req.num_computed_tokens - 1
            if depth > 1:  # chained rows write positions position + 1 ... position + depth - 1
                depth = max(1, self.book.reserve(req, position + depth) - position)
            asks += self._ask(req, want_draft=True)
            chains.append(ChainDraft(req.req_id, position, list(req.block_ids), depth))
        started = time.perf_counter()
        self._catch_up(asks)
        if asks:
            self.budget.observe_drafting(len(asks), time.perf_counter() - started)
        started = time.perf_counter()
        proposals = self.mtp.draft(chains)
        chained = max((c.num_drafts for c in chains), default=1) - 1  # MTP forwards past the catch-up's
        if chained > 0:
            self.budget.observe_drafting(len(chains), (time.perf_counter() - started) / chained)
        return proposals

    def forget(self, req_id: str) -> None:
        self._written.pop(req_id, None)
        self.mtp.forget(req_id)

    def _ask(self, req: Request, want_draft: bool, whole_blocks: bool = False) -> list[CatchUp]:
        """The catch-up of req's lagging rows, those whose next token is known (a drafting request
        runs its last computed row again if it was written: its draft comes from that row);
        whole_blocks: only as far as the last full block (what the prefix cache can take)."""
        written = self._written.get(req.req_id, (0, 0))[0]
        end = min(req.num_computed_tokens, req.num_tokens - 1)
        if whole_blocks:
            bs = self.book.block_size
            end = min(end, min(req.num_computed_tokens, req.num_tokens) // bs * bs)
        start = min(written, end - 1) if want_draft else written
        first, held_end = self.mtp.held(req.req_id)
        end = min(end, held_end)
        if end <= start:
            return []
        return [CatchUp(req.req_id, start, [req.token_at(j + 1) for j in range(start, end)], list(req.block_ids),
                        want_draft)]

    def _catch_up(self, asks: list[CatchUp]) -> None:
        self.mtp.catch_up(asks)
        for ask in asks:
            written, preemptions = self._written[ask.req_id]
            self._written[ask.req_id] = (max(written, ask.start_position + len(ask.token_ids)), preemptions)
