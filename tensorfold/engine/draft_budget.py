"""How many drafts a request runs in a round: the depth with the most expected tokens per second
of round, from two things the engine measures as it serves. One rule, no tensors.

- Row cost: the seconds of a decode round (no prompt rows) by its sequences and rows, the fastest
  of the last COST_WINDOW rounds of each size (the least disturbed by other work on the
  machine), read between row counts by linear interpolation and past them by the last two
  counts' slope.
- Acceptance: per request, p = the chance a draft is accepted when the drafts before it were,
  counted with decay from its verified drafts and from proposals it did not run ("shadow"
  proposals, checked against the tokens the reply then took: free evidence, so a request that
  stopped drafting starts again when its text turns repetitive).

A request adding d drafts to a round of R rows expects 1 + p + ... + p^d tokens for t(R + d)
seconds (plus (d - 1) draft steps where drafting itself runs a model: the MTP layer's first draft
comes with its catch-up, each further one is a forward of its own, timed as the server runs and
shared by the sequences drafting in it) where serial decoding gets 1 token for t(R); it runs the
d with the best ratio, and none
unless that ratio beats 1 by MARGIN. Until two row counts of its round's sequence count have
been seen, rows count as free: every proposal runs whole (which also measures them). Drafts never change a
token (the engine keeps only drafts equal to the keyed draws): this decides speed, not replies.
"""
from collections import deque
from dataclasses import dataclass, field

COST_WINDOW = 16      # rounds kept per row count
MIN_ROUNDS = 3        # rounds of a size before its time is trusted
MARGIN = 0.03         # expected gain a draft must promise over serial decoding
DECAY = 0.9           # weight of older acceptance evidence per verified or shadow run
PRIOR = (1.0, 1.0)    # (accepted, rejected) pseudo-counts: p starts at 1/2


class RowCost:
    """Decode-round seconds by (sequences, rows): a sequence's extra rows (its drafts) cost less
    than another sequence's row (no attention call or draw of their own), so rows are compared
    only between rounds of as many sequences."""

    def __init__(self):
        self._rounds: dict[tuple[int, int], deque] = {}

    def observe(self, sequences: int, rows: int, seconds: float) -> None:
        self._rounds.setdefault((sequences, rows), deque(maxlen=COST_WINDOW)).append(seconds)

    def curve(self, sequences: int):
        """t(rows) for rounds of `sequences` sequences, or None while fewer than two row counts
        of them are known: linear between the known counts, the last two counts' slope past them."""
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
    """One request's draft record: decayed counts of accepted and rejected draft positions, and
    a shadow proposal waiting for the reply's next tokens."""
    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]
    shadow: list[int] = field(default_factory=list)
    shadow_matched: int = 0

    @property
    def p(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def record(self, drafted: int, accepted: int) -> None:
        """A run of `drafted` drafts of which the first `accepted` held."""
        if drafted == 0:
            return
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if accepted < drafted else 0.0)

    def watch(self, proposal: list[int]) -> None:
        """Keep a proposal that did not run, to score against the reply's next tokens."""
        if proposal and not self.shadow:
            self.shadow, self.shadow_matched = list(proposal), 0

    def appended(self, tokens: list[int]) -> None:
        """The reply took `tokens`: score the shadow proposal as far as they reach."""
        for token in tokens:
            if not self.shadow:
                return
            if token != self.shadow[self.shadow_matched]:
                self.record(len(self.shadow), self.shadow_matched)
                self.shadow = []
                return
            self.shadow_matched += 1
            if self.shadow_matched == len(self.shadow):
                self.record(len(self.shadow), self.shadow_matched)
                self.shadow = []


class DraftBudget:
    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.cost = RowCost()
        self._draft_steps: dict[int, deque] = {}  # sequences drafting -> seconds of one chained step

    def observe_drafting(self, sequences: int, seconds_per_step: float) -> None:
        self._draft_steps.setdefault(sequences, deque(maxlen=COST_WINDOW)).append(seconds_per_step)

    def drafting_seconds(self, sequences: int) -> float:
        """One request's share of a chained draft step among `sequences` drafting sequences (the
        fastest recent step of that many, else of any count; 0 until one is timed)."""
        times = self._draft_steps.get(sequences) or min(self._draft_steps.values(), key=min, default=None)
        return min(times) / max(sequences, 1) if times else 0.0

    def depth(self, acceptance: Acceptance, sequences: int, rows: int, available: int,
              draft_step_seconds: float = 0.0, explore: bool = False) -> int:
        """Drafts to run, out of `available` proposed, for a request in a round of `sequences`
        decoding sequences that holds `rows` rows without its drafts; draft_step_seconds: what
        each draft past the first costs to make (0 for prompt lookup). explore: a drafter whose
        proposals are always full length (MTP) runs none until rounds without drafts are timed,
        so two row counts get measured."""
        top = min(self.max_depth, available)
        curve = self.cost.curve(sequences) if top > 0 else None
        if curve is None:
            serial_rounds = len(self.cost._rounds.get((sequences, rows), ()))
            return 0 if explore and serial_rounds < MIN_ROUNDS else top
        serial = curve(rows)
        p, expected, term = acceptance.p, 1.0, 1.0
        best_depth, best = 0, 1.0 + MARGIN
        for d in range(1, top + 1):
            term *= p
            expected += term
            seconds = curve(rows + d) + (d - 1) * draft_step_seconds
            ratio = expected * serial / seconds if seconds > 0 else float("inf")
            if ratio > best:
                best_depth, best = d, ratio
        return best_depth
