"""Per-request sampling settings, parsed once from the API body into a frozen dataclass.

`None` in an API field means "keep the server default"; by the time a SamplingParams exists every
field holds a concrete value. top_k <= 0 disables top-k; min_p 0 is off; temperature 0 is greedy.
"""
from dataclasses import dataclass


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
