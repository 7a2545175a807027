"""The per-row hooks later features hang on (grammars, forced tool-call openers, thinking
budgets): an allowed-token mask and a token fix, each a function of the reply tokens before the
row only.

Because both depend on nothing but the path, the engine applies them identically whether the
row is decoded serially, verified as part of a drafted run, or shares a round with other
requests: a constrained reply still equals its "draft": false run and its solo run.
"""
from typing import Protocol

import torch


class RowConstraint(Protocol):
    def allowed(self, reply_ids: list[int]) -> torch.Tensor | None:
        """Bool mask [vocab] of tokens allowed after reply_ids, or None for no restriction."""

    def fix(self, reply_ids: list[int], token: int) -> int:
        """The token to keep after reply_ids when the draw is `token` (usually `token`)."""
