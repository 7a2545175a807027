"""A request's grammar as engine constraint hooks: one xgrammar matcher that follows the path.

The hooks are functions of the path (sampling/constraint.py); the matcher is a cache of the
grammar state after `path`, the grammar part of the reply it has accepted. Each call first
brings the matcher to the asked path: roll back to the longest common prefix, then accept the
rest. Within a round the rows of a drafted run ask for ever longer paths (accept only); after
the verify step the next round rolls back the rejected drafts. So the masks are the ones a
fresh matcher fed the same path would give, whatever was drafted or batched.

Think blocks (`think` = the card's open and close marker ids, single tokens): when the prompt
opened a block (`thinking`), or the reply's first token opens one, the grammar starts after the
close marker: the tokens up to and including it are free. Otherwise it starts at once, and the
first token may also be the open marker (so a model that thinks on its own still can).
`skip`: tokens right after the close marker that are not the grammar's (the blank line a
thinking budget writes after the marker it forces); the grammar starts after them.
"""
import torch

from tensorfold.sampling.constraint import ConstraintError, RowConstraint


class GrammarConstraint(RowConstraint):
    def __init__(self, compiled, stop_ids: tuple[int, ...], think: tuple[int, int] | None = None,
                 thinking: bool = False, skip: tuple[int, ...] = ()):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._stop_ids = stop_ids
        self._think = think        # (open id, close id), or None: the grammar governs from the start
        self._thinking = thinking  # the prompt opened a think block
        self._skip = list(skip)
        self._path: list[int] = []

    def _grammar_part(self, reply_ids: list[int]) -> list[int] | None:
        """The reply tokens the grammar governs, or None while it has not started. An end token
        the grammar accepted ends its part: what follows it (more end tokens, under ignore_eos)
        is not the grammar's."""
        tokens = reply_ids
        if self._think is not None and (self._thinking or reply_ids[:1] == [self._think[0]]):
            try:
                tokens = reply_ids[reply_ids.index(self._think[1]) + 1:]
            except ValueError:
                return None
            if self._skip and tokens[:len(self._skip)] == self._skip[:len(tokens)]:
                tokens = tokens[len(self._skip):]
        for i, token in enumerate(tokens):
            if token in self._stop_ids:
                return tokens[:i + 1]
        return tokens

    def _follow(self, tokens: list[int]) -> None:
        n = len(self._path)
        if len(tokens) >= n and tokens[:n] == self._path:  # the usual case: the path only grew
            common = n
        else:
            common = 0
            limit = min(len(tokens), n)
            while common < limit and tokens[common] == self._path[common]:
                common += 1
        if common < len(self._path):
            self._matcher.rollback(len(self._path) - common)
            del self._path[common:]
        for token in tokens[common:]:
            if not self._matcher.accept_token(token):
                raise ConstraintError(f"the grammar rejected token {token} at reply position {len(self._path)}")
            self._path.append(token)

    def fill_mask(self, reply_ids: list[int], bitmask: torch.Tensor, row: int) -> None:
        tokens = self._grammar_part(reply_ids)
        if tokens is None:
            return
        self._follow(tokens)
        if self._matcher.is_terminated():  # the value is complete and ended: only an end token
            bitmask[row].zero_()
            for t in self._stop_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._may_open(reply_ids):
            bitmask[row, self._think[0] // 32] |= _bit(self._think[0] % 32)

    def _may_open(self, reply_ids: list[int]) -> bool:
        """The first reply token may open a think block (the prompt did not)."""
        return self._think is not None and not self._thinking and not reply_ids

    def num_valid_drafts(self, reply_ids: list[int], drafts: list[int], vocab_size: int) -> int:
        for j, token in enumerate(drafts):
            tokens = self._grammar_part(reply_ids + drafts[:j])
            if tokens is None or (self._may_open(reply_ids + drafts[:j]) and token == self._think[0]):
                continue
            self._follow(tokens)
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                return j
            self._path.append(token)
        return len(drafts)


def _bit(j: int) -> int:
    """Bit j of an int32 word, as the int32 value torch stores."""
    return (1 << j) - (1 << 32 if j == 31 else 0)
