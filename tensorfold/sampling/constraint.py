"""The per-row hooks later features hang on (grammars, forced tool-call openers, thinking
budgets): the allowed tokens after a path, a token fix, and how many drafts a path may keep.
Each is a function of the reply tokens before the row only.

Because they depend on nothing but the path, the engine applies them identically whether the
row is decoded serially, verified as part of a drafted run, or shares a round with other
requests: a constrained reply still equals its "draft": false run and its solo run. An
implementation may keep state between calls (a grammar matcher that follows the path, rolling
back what the verify step rejected) as long as the answers stay functions of the path.
"""
import torch

from tensorfold.sampling import bitmask as bits


class RowConstraint:
    """No restriction; subclasses override what they constrain."""

    def fill_mask(self, reply_ids: list[int], bitmask: torch.Tensor, row: int) -> None:
        """Clear in bitmask[row] (int32, xgrammar's layout, all bits set on entry) the tokens not
        allowed after reply_ids."""

    def fix(self, reply_ids: list[int], token: int) -> int:
        """The token to keep after reply_ids when the draw is `token` (usually `token`)."""
        return token

    def num_valid_drafts(self, reply_ids: list[int], drafts: list[int], vocab_size: int) -> int:
        """How many leading drafts are allowed along reply_ids + drafts (the rest are cut before
        the verify forward). By default each draft is checked against fill_mask's row."""
        row = bits.full(1, vocab_size)
        for j, token in enumerate(drafts):
            row.fill_(bits.ALL)
            self.fill_mask(reply_ids + drafts[:j], row, 0)
            if not (int(row[0, token // 32]) >> (token % 32)) & 1:
                return j
        return len(drafts)


class ConstraintError(RuntimeError):
    """A constraint that cannot go on (a grammar that rejects its own path): the request fails,
    the others continue."""


class Constraints(RowConstraint):
    """Several constraints on one request: a token must pass every mask, fixes apply in order,
    and drafts are cut at the first one any of them rejects."""

    def __init__(self, parts: list[RowConstraint]):
        self.parts = parts

    def fill_mask(self, reply_ids: list[int], bitmask: torch.Tensor, row: int) -> None:
        for part in self.parts:
            part.fill_mask(reply_ids, bitmask, row)

    def fix(self, reply_ids: list[int], token: int) -> int:
        for part in self.parts:
            token = part.fix(reply_ids, token)
        return token

    def num_valid_drafts(self, reply_ids: list[int], drafts: list[int], vocab_size: int) -> int:
        return min((part.num_valid_drafts(reply_ids, drafts, vocab_size) for part in self.parts), default=len(drafts))


def combine(parts: list[RowConstraint | None]) -> RowConstraint | None:
    """None, the one constraint, or all of them together."""
    parts = [p for p in parts if p is not None]
    return None if not parts else parts[0] if len(parts) == 1 else Constraints(parts)
