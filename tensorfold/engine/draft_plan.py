"""What the MTP drafter asks the runner for, in plain data (engine/mtp_drafter.py writes it, a
runner with an MTP layer executes it; no tensors here).

    CatchUp      run the MTP layer over a request's lagging rows (the target's hidden states
                 the runner holds), so its K/V covers them: before a round the request drafts in
                 (then it draws the first draft from the last row), after a prompt chunk, and
                 before its blocks go to the prefix cache at its end
    ChainDraft   before a round: draft further, feeding the MTP layer its own last hidden state
                 and draft (its K/V past the computed positions is scratch, rewritten by the
                 next catch-up)
"""
from dataclasses import dataclass


@dataclass
class CatchUp:
    req_id: str
    start_position: int     # position j of the first row (its hidden state held since its round)
    token_ids: list[int]    # t[j + 1] for each row j = start_position, start_position + 1, ...
    block_ids: list[int]
    want_draft: bool        # a decoding request: keep the last row's draft and hidden state


@dataclass
class ChainDraft:
    req_id: str
    position: int           # the last caught-up position (num_computed_tokens - 1): a check
    block_ids: list[int]    # covering positions up to position + num_drafts - 1
    num_drafts: int         # drafts wanted, the caught-up first one included
