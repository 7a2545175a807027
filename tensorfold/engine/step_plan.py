"""What one engine round runs: the scheduler writes it, the runner executes it, nothing else.

For each scheduled request: the tokens fed this round (from position `start_position`), the
cache blocks they read and write (a table per cache group), and the sampling settings of each
row that needs a draw (the last `len(rows)` fed tokens: the end of a prompt, a decode row, and
drafted rows).
"""
from dataclasses import dataclass, field

from tensorfold.sampling.params import RowSampling


@dataclass
class ScheduledRequest:
    req_id: str
    token_ids: list[int]          # fed tokens, positions start_position ...
    start_position: int
    block_ids: list[int]
    rows: list[RowSampling]       # draws for the last len(rows) fed tokens, in order
    num_drafts: int = 0           # how many of the fed tokens are drafted (the tail)
    rows_prefill: bool = False    # a prompt (or replay) chunk rather than a decode row
    images: tuple = ()            # the request's image spans (vision/placement.ImageSpan): the runner
                                  # puts their embeddings on the fed rows they cover, and M-RoPE positions
    # The further cache groups' block tables (groups 1, 2, ...: sliding windows), where blocks
    # that left the window are block_pool.NULL_BLOCK (never read: attention starts at the window)
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class StepPlan:
    requests: list[ScheduledRequest] = field(default_factory=list)
    # The allowed tokens of every drawing row, in order: sampling/bitmask.py's host int32 tensor
    # [rows, ceil(vocab / 32)] (xgrammar's format; the runner moves it to its device); None: all
    # allowed. The engine writes it after scheduling, from the requests' constraints.
    bitmask: object | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    def __bool__(self) -> bool:
        return bool(self.requests)
