"""Sampling settings: per request (SamplingParams, parsed once from the API body) and per drawn
row (RowSampling: the request's settings with its seed and the row's position). Plain data.

`None` in an API field means "keep the server default"; by the time a SamplingParams exists every
field holds a concrete value. top_k <= 0 disables top-k; min_p 0 is off; temperature 0 is greedy.
"""
from dataclasses import dataclass

MASK64 = (1 << 64) - 1  # seeds and keys are 64-bit


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None          # None: derived from the prompt tokens (SHA-256)
    max_tokens: int | None = None    # None: the server default, capped to the remaining window
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    draft: bool = True
    decode_past_stop: bool = False   # a stop match ends the text; decoding goes on to an end token or the limit

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class RowSampling:
    """The settings of one row's draw. `seed` is the request's key in [0, 2^64) (see
    keyed.request_seed); `position` the absolute reply position of the drawn token."""
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    position: int

    def __post_init__(self):
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0 or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"top_p and min_p must lie in [0, 1], got {self.top_p}, {self.min_p}")
        if not 0 <= self.seed <= MASK64 or self.position < 0:
            raise ValueError(f"need 0 <= seed < 2^64, position >= 0: {self.seed}, {self.position}")

    @classmethod
    def of(cls, params: SamplingParams, seed: int, position: int) -> "RowSampling":
        return cls(params.temperature, params.top_k, params.top_p, params.min_p, seed, position)

    def ordered(self, vocab_size: int) -> bool:
        """Whether a cut depends on the key order (top-k or top-p on), needing candidates."""
        return 0 < self.top_k < vocab_size or self.top_p < 1.0
