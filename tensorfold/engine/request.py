"""One request's state as the engine sees it: tokens, how many are in the cache, its blocks.

The scheduling rule (as in vLLM v1): `num_computed_tokens` chases `num_tokens` (+ drafts).
A prefill chunk, a decode row, a prefix-cache hit and a drafted run are all just counts.
Invariant: num_computed_tokens <= num_tokens - 1 while running (the newest token is always fed
again as the input of the next row), and the cache holds valid K/V for positions
[0, num_computed_tokens). A preempted request keeps its reply tokens and drops its cache: when
it runs again it recomputes them like a prompt, and each recomputed reply token is checked
against a fresh keyed draw (num_checked_tokens says how far), so nothing is sent twice and the
reply stays equal to its uninterrupted run. A sliding-window cache group's table holds only the
blocks its window still reads (engine/cache_book.py).
"""
import enum
import time
from dataclasses import dataclass, field

from tensorfold.sampling.constraint import RowConstraint
from tensorfold.sampling.params import SamplingParams
from tensorfold.vision.placement import ImageSpan, cache_keys


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestStats:
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    scheduled_s: float | None = None  # first admitted to a round (queue wait ends)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    drafted_by_position: list[int] = field(default_factory=list)   # [i]: drafts verified at depth i + 1
    accepted_by_position: list[int] = field(default_factory=list)  # [i]: of those, accepted
    cached_tokens: int = 0
    grammar_compile_s: float | None = None  # structured output: seconds compiling (0.0: cached)
    reasoning_tokens: int = 0     # reply tokens through the think block's close (set by the API)

    def count_positions(self, drafted: int, accepted: int) -> None:
        """A verified run of `drafted` drafts whose first `accepted` held, counted per depth."""
        for counts, n in ((self.drafted_by_position, drafted), (self.accepted_by_position, accepted)):
            counts += [0] * max(0, drafted - len(counts))
            for i in range(n):
                counts[i] += 1


@dataclass
class Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams        # max_tokens is concrete here
    seed: int
    eos_ids: frozenset[int]
    priority: int = 0             # 0 foreground, 1 background: lower runs first
    arrival: int = 0              # admission order among equal priorities
    output_ids: list[int] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)        # cache group 0's block table
    group_block_ids: list[list[int]] = field(default_factory=list)  # groups 1, 2, ... (sliding windows)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache chain of full final blocks
    num_preemptions: int = 0
    constraint: RowConstraint | None = None   # per-row mask and token fix (sampling/constraint.py)
    error: str | None = None      # why a constraint failed: the request ends with "error"
    stop_string: str | None = None  # the stop string that ended the reply, if one did
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    images: tuple[ImageSpan, ...] = ()  # the prompt's images (vision/placement.py), in order
    # The prefix cache hashes no block past this many positions (None: every computed one): the MTP
    # drafter's K/V lags behind while the request does not draft (engine/mtp_drafter.py).
    num_hashable_tokens: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def order(self) -> tuple[int, int]:
        """Scheduling order: foreground before background, then first come first served."""
        return (self.priority, self.arrival)

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold in the cache (prompt + reply)."""
        return len(self.prompt_ids) + self.params.max_tokens

    def cache_tokens(self) -> list:
        """Prompt + reply as the prefix cache keys them: an image's first pad by its content hash."""
        tokens = self.prompt_ids + self.output_ids
        return cache_keys(tokens, self.images) if self.images else tokens

    def token_at(self, index: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]
