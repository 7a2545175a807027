"""Decides what each round runs; never touches tensors.

One rule: every running request's num_computed_tokens chases its token count (plus drafts).
Each round, in order: decoding requests take 1 + len(drafts) rows each; prefilling requests take
a chunk of their prompt from what is left of the round's token budget; then waiting requests are
admitted while there is a free lane and the pool can reserve their whole window (prompt +
max_tokens), so a running request can never run out of cache.
"""
from collections import deque
from dataclasses import dataclass

from tensorfold.engine.block_pool import BlockPool
from tensorfold.engine.request import Request, Status
from tensorfold.engine.step_plan import ScheduledRequest, StepPlan
from tensorfold.sampling.sampler import RowSampling


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8          # lanes: requests sharing a round
    max_tokens_per_step: int = 512  # the round's token budget, and so the prefill chunk size


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        if self.pool.blocks_for(req.max_total_tokens) > self.pool.num_blocks:
            raise MemoryError(f"request needs {req.max_total_tokens} tokens of KV cache; "
                              f"the pool holds {self.pool.num_blocks * self.pool.block_size}")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        self._admit()
        plan = StepPlan()
        budget = self.config.max_tokens_per_step
        decoding = [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_tokens - 1]
        for req in decoding:
            if budget <= 0:
                break
            drafts = req.draft_ids[:max(0, budget - 1)]
            plan.requests.append(self._rows(req, 1 + len(drafts), drafts))
            budget -= 1 + len(drafts)
        for req in prefilling:
            if budget <= 0:
                break
            chunk = min(req.num_tokens - req.num_computed_tokens, budget)
            plan.requests.append(self._rows(req, chunk, []))
            budget -= chunk
        return plan

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.status = Status.FINISHED

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            needed = self.pool.blocks_for(req.max_total_tokens)
            if needed > self.pool.num_free:
                break  # FIFO: later requests wait behind it rather than starve it
            self.waiting.popleft()
            req.block_ids = self.pool.allocate(needed)
            req.status = Status.RUNNING
            self.running.append(req)

    @staticmethod
    def _rows(req: Request, num_fed: int, drafts: list[int]) -> ScheduledRequest:
        start = req.num_computed_tokens
        fed = [req.token_at(i) for i in range(start, start + num_fed - len(drafts))] + drafts
        end = start + num_fed  # one past the last fed position
        # Rows needing a draw: those at or after the newest real token (position num_tokens - 1).
        first_draw = max(start, req.num_tokens - 1)
        p = req.params
        rows = [RowSampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                            seed=req.seed, position=pos + 1)
                for pos in range(first_draw, end)]
        return ScheduledRequest(req.req_id, fed, start, req.block_ids, rows, len(drafts))
