"""How the recurrent mixers' references (delta_net.py, mamba2.py) run a batch over state slots.

A batch's sequences each start from the state in block state_in[i] (zeros at -1): a conv window
(the last K - 1 inputs) and a state tensor. After each row whose state_out is not -1, the
window and the state after that row are written to that block (ForwardBatch.state_slots). Every
starting state is read before any is written: a block one sequence writes may be another's start
only across calls, never within one, and kernels may run sequences at once.

    starting_states  the windows and states the sequences start from (copies)
    convolve         each sequence's rows through the conv from its window; the windows after
                     each written row saved
    scan             position t of every sequence that has one, at once, in order of t; the state
                     after each written row saved
"""
from collections.abc import Callable

import torch


def starting_states(state, state_in: torch.Tensor, count: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """(windows, states): each sequence's starting conv window [K - 1, C] and its state stacked
    [count, ...] (None for no sequences), copied out of the cache."""
    windows, states = [], []
    for i in range(count):
        src = int(state_in[i])
        windows.append(state.conv[src].clone() if src >= 0 else state.conv.new_zeros(state.conv.shape[1:]))
        states.append(state.ssm[src].clone() if src >= 0 else state.ssm.new_zeros(state.ssm.shape[1:]))
    return windows, (torch.stack(states) if states else None)


def convolve(x: torch.Tensor, windows: list[torch.Tensor], batch, state, state_out: torch.Tensor,
             conv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """conv(rows, window) of each sequence's rows of x into float32 [rows, C]; the window after
    each row state_out names (the padded inputs' rows t + 1 .. t + K - 1) written to its block."""
    taps = state.conv.shape[1]
    mixed = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for seq, window in zip(batch.sequences, windows):
        padded = torch.cat([window, x[seq.start:seq.end].float()])
        mixed[seq.start:seq.end] = conv(x[seq.start:seq.end], window)
        for t in range(seq.end - seq.start):
            dst = int(state_out[seq.start + t])
            if dst >= 0:
                state.conv[dst] = padded[t + 1:t + 1 + taps]
    return mixed


def scan(live: torch.Tensor | None, batch, state, state_out: torch.Tensor, out: torch.Tensor,
         step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """For t = 0, 1, ...: out[rows] = step(states, rows) over the sequences that have a position t
    (rows: their row indices; step updates the states in place); the state after each row
    state_out names written to its block. live: the starting states (starting_states); returns out."""
    lengths = [seq.end - seq.start for seq in batch.sequences]
    for t in range(max(lengths, default=0)):
        active = [i for i, n in enumerate(lengths) if n > t]
        at = torch.tensor([batch.sequences[i].start + t for i in active], dtype=torch.int64, device=out.device)
        every = len(active) == len(lengths)
        sub = live if every else live[active]
        out[at] = step(sub, at)
        if not every:
            live[active] = sub
        for j, row in enumerate(at.tolist()):
            if int(state_out[row]) >= 0:
                state.ssm[int(state_out[row])] = sub[j]
    return out
