"""Decides what each round runs; never touches tensors.

One rule: every running request's num_computed_tokens chases its token count (plus drafts).
A round is built in scheduling order (foreground before background, then arrival):
- decoding requests take 1 + len(drafts) rows each;
- prefilling requests (new prompts, and preempted requests recomputing their reply) take chunks
  of what is left of the round's token budget;
- decode share: after a round that prefilled for T seconds, decoding requests get decode-only
  rounds for decode_share * T before the next chunk, so they keep streaming while a long prompt
  arrives; decode_share 0 runs prompts' chunks back to back with no decode rows until they end.
Cache blocks are allocated as rows need them, in every cache group (engine/cache_book.py: a
sliding-window group lets go of the blocks behind its window before each round). When a group's
pool runs dry, the request last in scheduling order is preempted: its blocks go back (full ones
stay in the prefix cache) and it waits to recompute. A waiting foreground request likewise
takes a running background request's lane or memory. Admission reuses the longest cached prefix
of the request's tokens.
"""
import itertools
import time
from dataclasses import dataclass

from tensorfold.engine.block_pool import BlockPool
from tensorfold.engine.cache_book import CacheBook
from tensorfold.engine.request import Request, Status
from tensorfold.engine.step_plan import ScheduledRequest, StepPlan
from tensorfold.sampling.params import RowSampling


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8            # lanes: requests sharing a round
    max_tokens_per_step: int = 512   # the round's token budget, and so the prefill chunk size
    decode_share: float = 0.25
    admit_headroom: int = 16         # reply tokens a request must have room for to be admitted


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, book: CacheBook | None = None):
        self.config = config
        self.pool = pool
        self.book = book or CacheBook(pool)  # what admission, preemption and the end do to the cache
        self.waiting: list[Request] = []   # kept in scheduling order
        self.running: list[Request] = []
        self._arrivals = itertools.count()
        self._decode_credit_s = 0.0
        self.num_preemptions = 0

    # -- queue ------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        if not self.book.fits(req.max_total_tokens, self.config.max_tokens_per_step):
            raise MemoryError(f"the request needs up to {req.max_total_tokens} tokens of KV cache "
                              f"({req.num_prompt_tokens} prompt + {req.max_tokens} reply) but the whole "
                              f"pool holds {self.pool.num_blocks * self.pool.block_size}; lower max_tokens "
                              "or shorten the prompt")
        req.arrival = next(self._arrivals)
        self._enqueue(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.finish_reason != "error":
            # The last round's blocks too; accepted drafts past a stop are not reply tokens.
            self.book.register(req, req.cache_tokens(),
                               min(req.num_computed_tokens, req.num_tokens))
        self.book.release(req)
        req.status = Status.FINISHED

    def commit(self, req: Request) -> None:
        """After a round: hash the request's newly completed blocks into the prefix cache."""
        self.book.register(req, req.cache_tokens(), req.num_computed_tokens)

    def round_done(self, plan: StepPlan, elapsed_s: float) -> None:
        prefilled = any(r.rows_prefill for r in plan.requests)
        if prefilled and self.config.decode_share > 0:
            self._decode_credit_s = self.config.decode_share * elapsed_s
        elif not prefilled:
            self._decode_credit_s = max(0.0, self._decode_credit_s - elapsed_s)

    # -- the round --------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        self._yield_lanes_to_foreground()
        self._admit()
        self.running.sort(key=lambda r: r.order)
        decoding = [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_tokens - 1]
        decode_only = bool(decoding) and self._decode_credit_s > 0
        prefill_only = bool(prefilling) and self.config.decode_share == 0
        budget = self.config.max_tokens_per_step
        foreground_prefilled = False
        plan = StepPlan()
        for req in list(self.running):
            if budget <= 0 or req.status is not Status.RUNNING:
                continue
            if req in decoding and not prefill_only:
                drafts = req.draft_ids[:max(0, budget - 1)]
                num = 1 + len(drafts)
            elif req in prefilling and not decode_only:
                if req.priority > 0 and foreground_prefilled:
                    continue  # a background chunk would stretch a foreground prompt's round
                drafts, num = [], min(req.num_tokens - req.num_computed_tokens, budget)
                foreground_prefilled |= req.priority == 0
            else:
                continue
            if not self._grow(req, req.num_computed_tokens + num):
                continue  # req itself was preempted
            plan.requests.append(self._rows(req, num, drafts))
            budget -= num
        return plan

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give req blocks for num_tokens positions, preempting from the back of the line."""
        self.book.slide(req)
        while not self.book.can_grow(req, num_tokens):
            victim = max(self.running, key=lambda r: r.order)
            self.preempt(victim)
            if victim is req:
                return False
        self.book.grow(req, num_tokens)
        return True

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.book.release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    def _yield_lanes_to_foreground(self) -> None:
        while (self.waiting and self.waiting[0].priority == 0 and len(self.running) >= self.config.max_num_seqs):
            background = [r for r in self.running if r.priority > 0]
            if not background:
                return
            self.preempt(max(background, key=lambda r: r.order))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            tokens = req.cache_tokens()
            hit = self.book.lookup(tokens, (len(tokens) - 1) // self.pool.block_size)
            room = min(req.max_total_tokens, len(tokens) + self.config.admit_headroom)
            if self.book.short(hit, room, self.config.max_tokens_per_step):
                background = [r for r in self.running if r.priority > req.priority]
                self.book.drop(hit)
                if not background:
                    return  # first in line waits for memory; later ones wait behind it
                self.preempt(max(background, key=lambda r: r.order))
                continue
            self.waiting.pop(0)
            self.book.resume(req, hit)
            if not req.output_ids:  # what this admission found is what the prompt reuses
                req.stats.cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
            if req.stats.scheduled_s is None:
                req.stats.scheduled_s = time.perf_counter()
            req.status = Status.RUNNING
            self.running.append(req)

    def _enqueue(self, req: Request) -> None:
        req.status = Status.WAITING
        i = 0
        while i < len(self.waiting) and self.waiting[i].order <= req.order:
            i += 1
        self.waiting.insert(i, req)

    @staticmethod
    def _rows(req: Request, num_fed: int, drafts: list[int]) -> ScheduledRequest:
        start = req.num_computed_tokens
        fed = [req.token_at(i) for i in range(start, start + num_fed - len(drafts))] + drafts
        end = start + num_fed  # one past the last fed position
        # Draws: from the newest token on (the next token, then drafts); a request recomputing
        # its reply after a preemption also draws at each reply position, to check it.
        first_draw = max(start, (req.num_prompt_tokens if req.num_preemptions else req.num_tokens) - 1)
        p = req.params
        rows = [RowSampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                            seed=req.seed, position=pos + 1)
                for pos in range(first_draw, end)]
        # Prefill time: any round that computes prompt (or replayed) tokens, or draws the first token.
        prefill = start < req.num_tokens - 1 or not req.output_ids
        return ScheduledRequest(req.req_id, fed, start, req.block_ids, rows, len(drafts), rows_prefill=prefill,
                                group_block_ids=[list(t) for t in req.group_block_ids],
                                images=req.images)
