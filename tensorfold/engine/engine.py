"""The engine: requests in, tokens and text out, one round per step().

    step(): propose drafts -> schedule -> run the model and draw -> accept, append, finish.

Acceptance is the exactness rule (docs/architecture.md): a drafted token is kept iff it equals the
keyed draw at its position; the first mismatch is replaced by that draw, and a fully accepted
run earns the bonus draw. So a drafted reply equals its serial one, token for token.
"""
import itertools
import logging
import time
from dataclasses import dataclass, field

from tensorfold.backends import open_backend
from tensorfold.engine.block_pool import BlockPool
from tensorfold.engine.cache_book import CacheBook
from tensorfold.engine.config import DRAFTERS, EngineConfig  # noqa: F401 (importers take it from here)
from tensorfold.engine.draft_budget import Acceptance, DraftBudget
from tensorfold.engine.drafter import DraftState, PromptLookupDrafter
from tensorfold.engine.mtp_drafter import MTPDrafter
from tensorfold.engine.info import EngineInfo
from tensorfold.engine.reply_text import ReplyText
from tensorfold.engine.request import Request, Status
from tensorfold.engine.scheduler import Scheduler, SchedulerConfig
from tensorfold.engine.window import reply_budget
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.sampling import bitmask as bits
from tensorfold.sampling.constraint import ConstraintError
from tensorfold.sampling.keyed import request_seed
from tensorfold.sampling.params import SamplingParams

log = logging.getLogger("tensorfold.engine")


@dataclass
class RequestOutput:
    req_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    request: Request


@dataclass(frozen=True)
class Load:
    """What the engine holds now, for /health and /metrics."""
    decoding: int            # running requests that have reply tokens
    prefilling: int          # running requests still on their prompt
    waiting: int             # queued for a lane or memory
    running_reply_tokens: int
    kv_used_ratio: float     # share of the KV blocks held by requests (the fullest cache group's)
    max_running: int
    kv_groups: tuple = ()    # per cache group: (window or None, blocks, blocks held by requests)


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str
    request: Request = field(repr=False)


class Engine:
    def __init__(self, model_path: str | None = None, config: EngineConfig = EngineConfig()):
        started = time.perf_counter()
        self.backend = backend = open_backend(config)
        loaded = backend.load(model_path, config)
        self.config = config = loaded.config  # one request at a time if the probes failed
        self.checkpoint, self.tokenizer = loaded.checkpoint, loaded.tokenizer
        self.context_length = min(config.context or loaded.max_position, loaded.max_position)
        memory = backend.allocate(self.context_length)
        self.drafter_name = _drafter_name(config, loaded)
        self.max_draft = config.drafts_for(self.drafter_name)
        # One block pool per cache group (engine/cache_book.py); self.pool is group 0's.
        groups = memory.block_groups
        self.pools = [BlockPool(g.num_blocks, config.block_size, max_cached_blocks=memory.max_cached_blocks)
                      for g in groups]
        self.pool = self.pools[0]
        self.book = CacheBook(self.pools, [g.window for g in groups], resume_at_blocks=memory.resume_at_blocks,
                              recompute_last_hit=self.drafter_name == "mtp")
        self.runner = backend.runner()
        self._cache_generation = backend.cache_generation
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_tokens_per_step,
                                                   config.decode_share), self.pool, self.book)
        self.drafter = PromptLookupDrafter()
        # The MTP layer's drafter (engine/mtp_drafter.py); None: prompt lookup drafts.
        # The draft budget: a drafter that pays for its proposals (MTP) starts new requests from
        # the drafter-wide record and probes while nobody drafts (engine/draft_budget.py).
        self.budget = DraftBudget(self.max_draft, shared_prior=self.drafter_name == "mtp")
        self.mtp_drafter = (MTPDrafter(self.runner.mtp, self.book, self.budget) if self.drafter_name == "mtp"
                            else None)
        self.requests: dict[str, Request] = {}
        self._texts: dict[str, ReplyText] = {}
        self._drafts: dict[str, DraftState] = {}
        self._acceptance: dict[str, Acceptance] = {}
        self._ids = itertools.count()
        self.info = EngineInfo.of(loaded, memory, backend.describe(), config, self.context_length,
                                  time.perf_counter() - started)
        log.info("%s", self.info.summary(config.dtype))

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def probe_failures(self) -> tuple[str, ...]:
        return self.info.probe_failures

    @property
    def load_seconds(self) -> float:
        return self.info.load_seconds

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, req_id: str | None = None,
                    priority: int = 0, constraint=None, grammar_compile_s: float | None = None,
                    images: tuple = ()) -> str:
        """images: the prompt's image spans (vision/placement.expand), where the engine loaded a tower."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if images and not self.info.vision:
            raise ValueError("image input needs the vision tower (--vision)")
        max_tokens = reply_budget(self.context_length, len(prompt_ids), params.max_tokens,
                                  self.config.default_max_tokens)
        req_id = req_id or f"req-{next(self._ids)}"
        params = SamplingParams(**{**params.__dict__, "max_tokens": max_tokens})
        req = Request(req_id, list(prompt_ids), params, request_seed(params.seed, prompt_ids),
                      frozenset(self.tokenizer.eos_token_ids), priority, constraint=constraint, images=tuple(images))
        req.stats.grammar_compile_s = grammar_compile_s
        self.scheduler.add(req)
        self.requests[req_id] = req
        self._texts[req_id] = ReplyText(self.tokenizer.detokenizer(prompt_ids), params.stop)
        self._drafts[req_id] = DraftState()
        self._acceptance[req_id] = self.budget.acceptance()
        return req_id

    def abort(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is not None and req.status is not Status.FINISHED:
            self._finish(req, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def load(self) -> Load:
        running = self.scheduler.running
        decoding = sum(1 for r in running if r.output_ids)
        return Load(decoding, len(running) - decoding, len(self.scheduler.waiting),
                    sum(len(r.output_ids) for r in running),
                    max(1.0 - pool.num_free / pool.num_blocks for pool in self.pools), self.config.max_num_seqs,
                    tuple((window, pool.num_blocks, pool.num_blocks - pool.num_free)
                          for window, pool in zip(self.book.windows, self.pools)))

    def running_ids(self) -> list[str]:
        return [r.req_id for r in self.scheduler.running]

    @property
    def exact(self) -> bool:
        """Whether the batch-invariance probes passed (replies equal solo, serial, fresh runs)."""
        return not self.probe_failures

    # -- the round --------------------------------------------------------------------------

    def close(self) -> None:
        """Release the backend's processes and devices (a rank group's ranks exit)."""
        self.backend.close()

    def unavailable(self) -> str | None:
        """Why the backend cannot serve now (a rank group failed), or None."""
        return self.backend.status().get("unavailable")

    def step(self) -> list[RequestOutput]:
        if self.backend.cache_generation != self._cache_generation:  # its contents are gone
            self._cache_generation = self.backend.cache_generation
            self.book.forget_cached()
        self._propose_drafts()
        round_started = time.perf_counter()  # the draft budget's round: scheduling through acceptance
        plan = self.scheduler.schedule()
        if not plan:
            return []
        self._attach_masks(plan)
        started = time.perf_counter()
        drawn = self.runner.execute(plan)
        elapsed = time.perf_counter() - started
        if self.mtp_drafter is not None:
            self.mtp_drafter.round_started(plan, self.requests)
        self.scheduler.round_done(plan, elapsed)
        outputs, scheduled_reqs = [], {}
        for scheduled, draws in zip(plan.requests, drawn):
            req = scheduled_reqs[scheduled.req_id] = self.requests[scheduled.req_id]
            if scheduled.rows_prefill:
                req.stats.prefill_s += elapsed
            else:
                req.stats.decode_s += elapsed
            out = self._accept(req, scheduled, draws)
            if req.status is not Status.FINISHED:
                self.scheduler.commit(req)
            if out is not None:
                outputs.append(out)
        if not any(s.rows_prefill for s in plan.requests):  # a round's own work, a draft row's or not
            self.budget.cost.observe(len(plan.requests), plan.num_tokens, time.perf_counter() - round_started)
        if self.mtp_drafter is not None:
            self.mtp_drafter.round_done(plan, scheduled_reqs)
        return outputs

    def _propose_drafts(self) -> None:
        """Each decoding request's drafts: the drafter's proposal, cut to what its constraint
        allows and to the depth the draft budget finds worth the round's extra rows."""
        decoding = []
        for req in self.scheduler.running:
            req.draft_ids = []
            if req.num_computed_tokens == req.num_tokens - 1:
                decoding.append(req)
        rows = len(decoding)  # one row each, before drafts
        mtp_wanted, mtp_idle = [], []  # (request, depth >= 1); requests running none
        for req in decoding:
            if not (self.config.drafting and req.params.draft and req.output_ids):
                continue
            # Leave room for the correction/bonus draw inside max_tokens.
            limit = min(self.max_draft, req.max_tokens - len(req.output_ids) - 1)
            if self.mtp_drafter is not None:  # the MTP layer drafts once the depths are chosen
                depth = self._depth(req, len(decoding), rows, limit)
                if depth:
                    mtp_wanted.append((req, depth))
                elif limit > 0:
                    mtp_idle.append(req)
                rows += depth
                continue
            tokens = req.prompt_ids + req.output_ids
            drafts = self._allowed(req, self.drafter.propose(tokens, self._drafts[req.req_id], limit))
            depth = self._depth(req, len(decoding), rows, len(drafts))
            if depth == 0:
                self._acceptance[req.req_id].watch(drafts)
            req.draft_ids = drafts[:depth]
            rows += len(req.draft_ids)
        if self.mtp_drafter is not None:
            self._draft_mtp(mtp_wanted, mtp_idle, len(decoding), rows)

    def _draft_mtp(self, wanted: list[tuple[Request, int]], idle: list[Request], sequences: int, rows: int) -> None:
        """The MTP layer's drafts for the requests that run some; while none does, a probe now
        and then (the draft budget's): one request's first draft, drawn but not run, scored as
        a shadow against the token its reply takes."""
        probe = None
        if not wanted and idle and self.config.draft_budget and self.budget.probe_due():
            idle = [r for r in idle if not self._acceptance[r.req_id].shadow]
            probe = max(idle, key=lambda r: self._acceptance[r.req_id].p_at(0), default=None)
            step = self.budget.drafting_seconds(sequences)
            self.budget.probed()  # due again after the wait, whether or not this one runs
            if probe is not None and self.budget.worth_probing(sequences, rows, step, step):
                wanted = [(probe, 1)]
        if not wanted:
            return
        proposals = self.mtp_drafter.propose(wanted)
        for req, depth in wanted:
            drafts = self._allowed(req, proposals.get(req.req_id, []))
            if req is probe:
                self._acceptance[req.req_id].watch(drafts, probing=True)
            else:
                req.draft_ids = drafts[:depth]

    def _allowed(self, req: Request, drafts: list[int]) -> list[int]:
        """Drafts cut where the request's constraint rejects them (those never run)."""
        if drafts and req.constraint is not None:
            drafts = drafts[:self._guarded(req, req.constraint.num_valid_drafts, req.output_ids, drafts,
                                           self.vocab_size)]
        return drafts

    def _depth(self, req: Request, sequences: int, rows: int, available: int) -> int:
        """How many of `available` drafts the request runs: the draft budget's choice, else all."""
        if not self.config.draft_budget:
            return available
        replay = (req.num_computed_tokens, self.pool.block_size) if self.book.resume_at_blocks else None
        return self.budget.choose(self._acceptance[req.req_id], sequences, rows, available,
                                  model_drafts=self.mtp_drafter is not None, replay=replay)

    def _attach_masks(self, plan) -> None:
        """The round's allowed-token bitmask (sampling/bitmask.py): each drawing row of a
        constrained request gets the mask of its own path, every other row all ones."""
        constrained = {s.req_id for s in plan.requests if s.rows and self.requests[s.req_id].constraint is not None}
        if not constrained:
            plan.bitmask = None
            return
        plan.bitmask = bits.full(sum(len(s.rows) for s in plan.requests), self.vocab_size)
        first = 0
        for scheduled in plan.requests:
            req = self.requests[scheduled.req_id]
            if scheduled.req_id in constrained:
                drafts = scheduled.token_ids[len(scheduled.token_ids) - scheduled.num_drafts:]
                for i, row in enumerate(scheduled.rows):
                    # Row drawing position p sees the reply before p: real tokens, then drafts.
                    reply = (req.output_ids + drafts)[:row.position - req.num_prompt_tokens]
                    self._guarded(req, req.constraint.fill_mask, reply, plan.bitmask, first + i)
            first += len(scheduled.rows)

    def _guarded(self, req: Request, hook, *args):
        """A constraint hook's answer; a constraint that fails ends its request with "error"
        after this round (its rows keep drawing unmasked meanwhile), the others go on."""
        try:
            return hook(*args)
        except ConstraintError as e:
            log.error("%s: constraint failed: %s", req.req_id, e)
            req.error = str(e)
            return 0

    def _fixed(self, req: Request, drafts: list[int], draws: list[int]) -> list[int]:
        """Apply the request's token fix along the drafted path."""
        if req.constraint is None:
            return draws
        path = req.output_ids + drafts
        base = len(req.output_ids)
        return [req.constraint.fix(path[:base + j], d) for j, d in enumerate(draws)]

    def _accept(self, req: Request, scheduled, draws: list[int]) -> RequestOutput | None:
        """A request's draws of this round: replayed positions checked, fixes applied, drafts
        accepted up to the first mismatch, the new tokens appended."""
        fed = scheduled.token_ids
        drafts = fed[len(fed) - scheduled.num_drafts:]
        first_pos = scheduled.start_position + len(fed) - len(draws)  # the first row with a draw
        num_checks = max(0, min(len(draws), req.num_tokens - 1 - first_pos))
        if req.error is not None or not self._replay_holds(req, first_pos, draws[:num_checks]):
            self._finish(req, "error")
            return RequestOutput(req.req_id, [], "", True, "error", req)
        live = self._fixed(req, drafts, draws[num_checks:])
        if not live:  # a prompt (or replay) chunk short of the end
            req.num_computed_tokens += len(fed)
            return None
        accepted = 0
        while accepted < len(drafts) and live[accepted] == drafts[accepted]:
            accepted += 1
        req.num_computed_tokens += len(fed)
        self.book.rollback(req, len(drafts) - accepted)  # the rejected drafts' positions
        req.stats.drafted += len(drafts)
        req.stats.accepted += accepted
        req.stats.count_positions(len(drafts), accepted)
        acceptance = self._acceptance[req.req_id]
        self.budget.record(acceptance, len(drafts), accepted)
        self.budget.appended(acceptance, live[:accepted + 1])
        if req.stats.first_token_s is None:
            req.stats.first_token_s = time.perf_counter()
        return self._append(req, live[:accepted + 1])

    def _replay_holds(self, req: Request, first_pos: int, draws: list[int]) -> bool:
        """Rows drawing a token the request already holds (recomputing after a preemption): each
        fresh draw must equal what was sent, or the exactness promise is broken."""
        for j, draw in enumerate(draws):
            pos = first_pos + 1 + j
            if req.constraint is not None:
                draw = req.constraint.fix(req.output_ids[:pos - req.num_prompt_tokens], draw)
            if draw != req.token_at(pos):
                log.error("%s: replayed token at position %d differs (%d, sent %d): exactness violated",
                          req.req_id, pos, draw, req.token_at(pos))
                return False
        return True

    def _append(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        """The accepted tokens onto the reply, token by token: text, stop strings, end tokens and
        the limit are checked on each, so a drafted reply ends where the serial one does. With
        decode_past_stop (GLM's engine), a stop match ends the text only: decoding goes on to an
        end token or the limit, and the reply's finish reason is still the match's "stop"."""
        text, appended, pieces, reason = self._texts[req.req_id], [], [], None
        for token in new_tokens:
            req.output_ids.append(token)
            appended.append(token)
            is_eos = token in req.eos_ids and not req.params.ignore_eos
            if not is_eos:
                pieces.append(text.push(token))
            if text.stopped and req.stop_string is None:
                req.stop_string = text.matched
            if is_eos or (text.stopped and not req.params.decode_past_stop):
                reason = "stop"
            elif len(req.output_ids) >= req.max_tokens:
                reason = "stop" if text.stopped else "length"
            if reason:
                break
        if reason:
            pieces.append(text.finish())
            self._finish(req, reason)
        return RequestOutput(req.req_id, appended, "".join(pieces), reason is not None, reason, req)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if self.mtp_drafter is not None:  # its blocks go to the prefix cache with the MTP K/V written
            self.mtp_drafter.finishing(req)
        self.scheduler.finish(req)
        self._texts.pop(req.req_id, None)
        self._drafts.pop(req.req_id, None)
        self._acceptance.pop(req.req_id, None)
        self.requests.pop(req.req_id, None)
        if self.mtp_drafter is not None:
            self.mtp_drafter.forget(req.req_id)

    # -- convenience ------------------------------------------------------------------------

    def generate(self, prompt_ids: list[int], params: SamplingParams = SamplingParams()) -> Completion:
        """Run one request to the end (other queued requests advance too)."""
        req_id = self.add_request(prompt_ids, params)
        req = self.requests[req_id]
        pieces = []
        while req.status is not Status.FINISHED:
            for out in self.step():
                if out.req_id == req_id:
                    pieces.append(out.new_text)
        return Completion(list(req.output_ids), "".join(pieces), req.finish_reason, req)


def _drafter_name(config: EngineConfig, loaded) -> str:
    """The drafter config.drafter asks for: "mtp" or "ngram" (auto: mtp where an MTP layer loaded)."""
    if config.drafter not in DRAFTERS:
        raise ValueError(f"drafter {config.drafter!r}: expected one of {', '.join(DRAFTERS)}")
    has_mtp = loaded.mtp_layers > 0
    if config.drafter == "mtp" and config.drafting and not has_mtp:
        raise CheckpointError(f"{loaded.checkpoint.path}: --drafter mtp needs a multi-token-prediction layer (Qwen3.5's "
                              "mtp.*, GLM-5's next-n layer, Nemotron 3's mtp.layers.*, with its count in config.json) "
                              "that this backend runs; this checkpoint or backend has none (use --drafter ngram or auto)")
    return "mtp" if config.drafting and config.drafter != "ngram" and has_mtp else "ngram"
