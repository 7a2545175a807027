"""thinking_budget: the reply's budget-th token, while it is still thinking, becomes the start of
a close sequence (a newline, the think close marker, a blank line), then the answer continues.

A token fix (sampling/constraint.py), so it depends only on the tokens before it: serial,
drafted and batched decoding cut at the same place. The reply is thinking at position p when the
prompt opened a think block (or the reply's first token opens one) and no close marker came
before p. A model that closes the block before the budget is left alone.
"""
from tensorfold.sampling.constraint import RowConstraint


class ThinkingBudget(RowConstraint):
    def __init__(self, budget: int, open_id: int, close_id: int, close_sequence: list[int], thinking: bool):
        if budget < 1 or close_id not in close_sequence:
            raise ValueError("a budget of at least one token and a close sequence holding the close marker")
        self.budget = budget
        self.open_id, self.close_id = open_id, close_id
        self.sequence = close_sequence
        self.thinking = thinking  # the prompt opened the block

    def fix(self, reply_ids: list[int], token: int) -> int:
        start = self.budget - 1                 # the budget-th token's position
        k = len(reply_ids) - start              # how far into the close sequence this position is
        if not 0 <= k < len(self.sequence) or reply_ids[start:] != self.sequence[:k]:
            return token
        before = reply_ids[:start]
        opened = self.thinking or before[:1] == [self.open_id]
        return self.sequence[k] if opened and self.close_id not in before else token
