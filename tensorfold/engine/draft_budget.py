"""How many drafts a request runs in a round: the depth with the most expected tokens per second
of round, from what the engine measures as it serves. One rule, no tensors.

- Row cost: the seconds of a decode round (no prompt rows; scheduling through acceptance, the
  per-round work a draft saves) by its sequences and rows, the fastest
  of the last COST_WINDOW rounds of each size (the least disturbed by other work on the
  machine), read between row counts by linear interpolation and past them by the last two
  counts' slope.
- Acceptance: per request and per draft position i, p_i = the chance draft i is accepted when
  the drafts before it were, counted with decay from its verified drafts and from proposals it
  did not run ("shadow" proposals, checked against the tokens the reply then took); a position
  without evidence of its own takes the request's pooled rate.
- Drafting's own cost, where a model drafts (MTP): a pass of the MTP layer per draft, the first
  one the catch-up pass that brings its K/V up to the request's computed positions (it lags
  while the request does not draft) and draws the first draft, each further one a chained step;
  the fastest recent pass of as many sequences, each request paying its share. The lagging rows
  themselves are not charged to drafting: they are caught up at the request's end (or its next
  prompt chunk) if not now, so a resume moves their cost, it does not add it.
- Replays: on a model whose recurrent state resumes only at block boundaries, a rejected draft
  sends the request back to the boundary before it, and the next round computes the kept rows
  after it again; their cost is read off the row-cost curve.

A request adding d drafts to a round of R rows at position s expects 1 + p_1 + p_1 p_2 + ... tokens
for t(R + d) + catch-up + (d - 1) draft steps + E[replay] seconds, where serial decoding gets 1
token for t(R); it runs the d with the best ratio, and none unless that ratio beats 1 by MARGIN
(MODEL_MARGIN where a model drafts: its pass time is a second measured cost, as noisy as the
rows' on a busy machine, and a wrong "yes" costs a pass every round).
Until two row counts of its round's sequence count have been seen, rows count as free: every
proposal runs whole (which also measures them; a drafter that pays for its proposals first
times MIN_ROUNDS serial rounds). A choice of none stands for REST rounds while the request's
evidence does not change (choose()).

Exploring when drafts cost something to make (MTP). A request that runs no drafts gives no
evidence, so while nobody drafts the budget probes: every `probe_interval` rounds one request
(the likeliest to accept) makes its first draft as a shadow (a catch-up and no verify row, so a
miss costs no replay); each probe doubles the interval up to PROBE_MAX (a hit that does not
bring drafting back, where the costs say even accepted drafts barely pay, is no reason to probe
more), and accepted drafts that run reset it. New requests start from the drafter-wide record (decayed over every request's evidence) instead of
1/2, so a server whose text the layer does not predict stays at depth 0 from a request's first
round. Drafts never change a token (the engine keeps only drafts equal to the keyed draws):
this decides speed, not replies.
"""
from collections import deque
from dataclasses import dataclass, field

COST_WINDOW = 16      # rounds kept per row count
MIN_ROUNDS = 3        # rounds of a size before its time is trusted
MARGIN = 0.03         # expected gain a draft must promise over serial decoding
MODEL_MARGIN = 0.10   # the same where each draft is a pass of a drafting model (MTP)
DECAY = 0.9           # weight of older acceptance evidence per verified or shadow run
PRIOR = (1.0, 1.0)    # (accepted, rejected) pseudo-counts: p starts at 1/2
PROBE_FIRST = 4       # rounds without drafts before the first probe
PROBE_MAX = 128       # the longest wait between probes (one costs about half a round on the tiny model)
REST = 4              # rounds a "none" stands while no new evidence arrives (choosing costs time too)


class RowCost:
    """Decode-round seconds by (sequences, rows): a sequence's extra rows (its drafts) cost less
    than another sequence's row (no attention call or draw of their own), so rows are compared
    only between rounds of as many sequences."""

    def __init__(self):
        self._rounds: dict[tuple[int, int], deque] = {}
        self._curves: dict[int, object] = {}  # sequences -> curve, until the next observation

    def observe(self, sequences: int, rows: int, seconds: float) -> None:
        times = self._rounds.setdefault((sequences, rows), deque(maxlen=COST_WINDOW))
        fastest = min(times) if len(times) >= MIN_ROUNDS else None
        times.append(seconds)
        if len(times) < MIN_ROUNDS or min(times) != fastest:  # else the curve stands
            self._curves.pop(sequences, None)

    def curve(self, sequences: int):
        """t(rows) for rounds of `sequences` sequences, or None while fewer than two row counts
        of them are known: linear between the known counts, the last two counts' slope past them."""
        if sequences not in self._curves:
            self._curves[sequences] = self._curve(sequences)
        return self._curves[sequences]

    def _curve(self, sequences: int):
        known = sorted((r, min(times)) for (n, r), times in self._rounds.items()
                       if n == sequences and len(times) >= MIN_ROUNDS)
        if len(known) < 2:
            return None

        def seconds(rows: int) -> float:
            for left, right in zip(known, known[1:]):  # the segment reaching `rows`, else the last
                if rows <= right[0]:
                    break
            (r0, t0), (r1, t1) = left, right
            return max(t0 + (t1 - t0) / (r1 - r0) * (rows - r0), 0.0)
        return seconds

    def seconds(self, sequences: int, rows: int) -> float | None:
        curve = self.curve(sequences)
        return None if curve is None else curve(rows)


@dataclass
class Acceptance:
    """One request's draft record: decayed counts of accepted and rejected drafts (pooled, and
    per draft position), and a shadow proposal waiting for the reply's next tokens."""
    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]
    by_position: list[list[float]] = field(default_factory=list)  # [i]: [accepted, rejected] at depth i + 1
    shadow: list[int] = field(default_factory=list)
    shadow_matched: int = 0
    probing: bool = False  # the shadow is the budget's probe
    version: int = 0       # evidence recorded so far
    resting: tuple[int, int] = (0, -1)  # (rounds a "none" still stands, at which version)

    @property
    def p(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def p_at(self, i: int) -> float:
        """The chance draft i (0-based) is accepted given the ones before it were: its own counts
        with the pooled rate as one pseudo-count."""
        if i >= len(self.by_position):
            return self.p
        accepted, rejected = self.by_position[i]
        return (accepted + self.p) / (accepted + rejected + 1.0)

    def seeded(self, weight: float = sum(PRIOR)) -> "Acceptance":
        """A new request's record from this (drafter-wide) one, its evidence scaled to `weight`
        pseudo-counts in all and one per position."""
        p = self.p
        positions = [[a / (a + r), r / (a + r)] for a, r in self.by_position if a + r > 0]
        return Acceptance(weight * p, weight * (1.0 - p), positions)

    def record(self, drafted: int, accepted: int) -> None:
        """A run of `drafted` drafts of which the first `accepted` held."""
        if drafted == 0:
            return
        self.version += 1
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if accepted < drafted else 0.0)
        seen = min(drafted, accepted + 1)  # positions reached: the accepted ones and the first miss
        self.by_position += [[0.0, 0.0] for _ in range(seen - len(self.by_position))]
        for i in range(seen):
            counts = self.by_position[i]
            counts[0], counts[1] = DECAY * counts[0] + (i < accepted), DECAY * counts[1] + (i >= accepted)

    def watch(self, proposal: list[int], probing: bool = False) -> None:
        """Keep a proposal that did not run, to score against the reply's next tokens."""
        if proposal and not self.shadow:
            self.shadow, self.shadow_matched, self.probing = list(proposal), 0, probing

    def appended(self, tokens: list[int]) -> tuple[int, int] | None:
        """The reply took `tokens`: score the shadow proposal as far as they reach; returns
        (drafted, accepted) when it settled."""
        for token in tokens:
            if not self.shadow:
                return None
            if token != self.shadow[self.shadow_matched]:
                return self._settle()
            self.shadow_matched += 1
            if self.shadow_matched == len(self.shadow):
                return self._settle()
        return None

    def _settle(self) -> tuple[int, int]:
        run = (len(self.shadow), self.shadow_matched)
        self.record(*run)
        self.shadow = []
        return run


class DraftBudget:
    def __init__(self, max_depth: int, shared_prior: bool = False):
        """shared_prior: new requests start from the drafter-wide record (a drafter that pays
        for its proposals, which then also probes); else from PRIOR."""
        self.max_depth = max_depth
        self.shared_prior = shared_prior
        self.cost = RowCost()
        self.history = Acceptance()     # every request's evidence, decayed
        self.probe_interval = PROBE_FIRST
        self.idle_rounds = 0            # rounds since anyone ran or probed a draft
        self._draft_steps: dict[int, deque] = {}  # sequences drafting -> seconds of one drafting pass

    # -- acceptance -------------------------------------------------------------------------

    def acceptance(self) -> Acceptance:
        """A new request's record."""
        return self.history.seeded() if self.shared_prior else Acceptance()

    def record(self, acceptance: Acceptance, drafted: int, accepted: int) -> None:
        """A verified run of a request's drafts (accepted ones: probing starts over)."""
        if drafted:
            acceptance.record(drafted, accepted)
            self.history.record(drafted, accepted)
            self.idle_rounds = 0
            if accepted:
                self.probe_interval = PROBE_FIRST

    def appended(self, acceptance: Acceptance, tokens: list[int]) -> None:
        """The reply took `tokens`: a shadow proposal that settles counts as evidence (a settled
        probe doubles the next one's wait)."""
        probing = acceptance.probing
        run = acceptance.appended(tokens)
        if run is None:
            return
        self.history.record(*run)
        if probing:  # a hit that brings drafting back resets the wait (record()); else it grows
            self.probe_interval = min(2 * self.probe_interval, PROBE_MAX)

    # -- what drafting costs ----------------------------------------------------------------

    def observe_drafting(self, sequences: int, seconds_per_step: float) -> None:
        """A drafting pass (a catch-up that draws, or a chained step) over `sequences` requests."""
        self._draft_steps.setdefault(sequences, deque(maxlen=COST_WINDOW)).append(seconds_per_step)

    def drafting_seconds(self, sequences: int) -> float:
        """One request's share of a drafting pass among `sequences` drafting sequences (the
        fastest recent pass of that many, else of any count; 0 until one is timed)."""
        times = self._draft_steps.get(sequences) or min(self._draft_steps.values(), key=min, default=None)
        return min(times) / max(sequences, 1) if times else 0.0

    # -- the choice -------------------------------------------------------------------------

    def choose(self, acceptance: Acceptance, sequences: int, rows: int, available: int, model_drafts: bool = False,
               replay: tuple[int, int] | None = None) -> int:
        """depth() for the engine (model_drafts: each draft is a pass of a drafting model, MTP,
        as timed), except that a choice of none stands for REST rounds unless the request's
        evidence changes (the costs move slowly; the choice itself is not free on a fast round)."""
        rounds, version = acceptance.resting
        if rounds > 0 and version == acceptance.version:
            acceptance.resting = (rounds - 1, version)
            return 0
        step = self.drafting_seconds(sequences) if model_drafts else 0.0  # the first draft's pass too
        depth = self.depth(acceptance, sequences, rows, available, step, explore=model_drafts,
                           first_draft_seconds=step, replay=replay, margin=MODEL_MARGIN if model_drafts else MARGIN)
        acceptance.resting = (REST if depth == 0 and self.cost.curve(sequences) is not None else 0, acceptance.version)
        return depth

    def depth(self, acceptance: Acceptance, sequences: int, rows: int, available: int,
              draft_step_seconds: float = 0.0, explore: bool = False, first_draft_seconds: float = 0.0,
              replay: tuple[int, int] | None = None, margin: float = MARGIN) -> int:
        """Drafts to run, out of `available` proposed, for a request in a round of `sequences`
        decoding sequences that holds `rows` rows without its drafts. first_draft_seconds /
        draft_step_seconds: what the first draft and each further one cost to make (0 for prompt
        lookup). replay: (the request's decode position, block size) where a rejected draft
        rewinds to a block boundary. explore: a drafter whose proposals are always full length
        (MTP) runs none until rounds without drafts are timed, so two row counts get measured."""
        top = min(self.max_depth, available)
        curve = self.cost.curve(sequences) if top > 0 else None
        if curve is None:
            serial_rounds = len(self.cost._rounds.get((sequences, rows), ()))
            return 0 if explore and serial_rounds < MIN_ROUNDS else top
        serial = curve(rows)
        expected = reach = 1.0  # tokens expected; the chance every draft so far is accepted
        replays = 0.0           # expected seconds of rows computed again after a miss
        best_depth, best = 0, 1.0 + margin
        for d in range(1, top + 1):
            p = acceptance.p_at(d - 1)
            if replay is not None:
                position, block_size = replay
                again = (position + d) % block_size  # kept rows past the boundary when draft d misses
                replays += reach * (1.0 - p) * (curve(rows + again) - serial)
            reach *= p
            expected += reach
            seconds = curve(rows + d) + first_draft_seconds + (d - 1) * draft_step_seconds + replays
            ratio = expected * serial / seconds if seconds > 0 else float("inf")
            if ratio > best:
                best_depth, best = d, ratio
        return best_depth

    def worth_probing(self, sequences: int, rows: int, first_draft_seconds: float,
                      draft_step_seconds: float) -> bool:
        """Whether drafts could pay at all here (were every one accepted): probing is useless
        where even that loses."""
        return self.depth(Acceptance(1.0, 0.0), sequences, rows, self.max_depth, draft_step_seconds,
                          first_draft_seconds=first_draft_seconds, margin=MODEL_MARGIN) > 0

    def probe_due(self) -> bool:
        """Count a round without drafts; whether this one should probe."""
        self.idle_rounds += 1
        return self.idle_rounds >= self.probe_interval

    def probed(self) -> None:
        self.idle_rounds = 0
