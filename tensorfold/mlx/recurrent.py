"""How the mlx backend's recurrent mixers (delta_net.py, mamba2.py) run a batch over state slots:
kernels/recurrent.py's rule on MLX arrays.

A batch's sequences each start from the state in block batch.state_in[i] (zeros at -1): a conv
window (the last K - 1 inputs) and a state array. After each row whose batch.state_out is not
-1, the window and the state after that row go to that block. Every starting state is read
before anything is written (MLX arrays: a read keeps the value it saw), and the writes land in
one scatter per array at the end.

    starting_states  the windows and states the sequences start from
    convolve         each sequence's rows through the conv from its window; the windows after
                     each written row kept for the write
    scan             position t of every sequence that has one, at once, in order of t; the
                     state after each written row kept for the write
    write            the kept windows and states into their blocks
"""
from collections.abc import Callable

import mlx.core as mx
import numpy as np


def starting_states(state, batch) -> tuple[list[mx.array], mx.array]:
    """(windows, live): each sequence's starting conv window [K - 1, C] and its states stacked
    [num_seqs, ...]."""
    starts = [int(src) for src in batch.state_in]
    windows = [state.conv[src] if src >= 0 else mx.zeros(state.conv.shape[1:], dtype=mx.float32) for src in starts]
    live = [state.ssm[src] if src >= 0 else mx.zeros(state.ssm.shape[1:], dtype=mx.float32) for src in starts]
    return windows, mx.stack(live)


def convolve(x: mx.array, windows: list[mx.array], batch, conv: Callable) -> tuple[mx.array, list, list]:
    """(conv(rows, window) of each sequence's rows of x, concatenated [rows, C] float32; the blocks
    and windows to write: after row t, the padded inputs' rows t + 1 .. t + K - 1)."""
    taps = windows[0].shape[0] if windows else 0
    mixed, dst, val = [], [], []
    for seq, window in zip(batch.sequences, windows):
        rows = x[seq.start:seq.end]
        mixed.append(conv(rows, window))
        padded = mx.concatenate([window, rows.astype(mx.float32)])
        for t in range(seq.end - seq.start):
            if (block := int(batch.state_out[seq.start + t])) >= 0:
                dst.append(block)
                val.append(padded[t + 1:t + 1 + taps])
    return (mixed[0] if len(mixed) == 1 else mx.concatenate(mixed)), dst, val


def scan(live: mx.array, batch, step: Callable) -> tuple[mx.array, list, list]:
    """For t = 0, 1, ...: (states, out) = step(states, rows) over the sequences that have a
    position t (rows: an int32 mx.array of their row indices). Returns (out in row order, the
    blocks and states to write)."""
    lengths = [seq.end - seq.start for seq in batch.sequences]
    outs, order, dst, val = [], [], [], []
    for t in range(max(lengths, default=0)):
        active = [i for i, n in enumerate(lengths) if n > t]
        at = [batch.sequences[i].start + t for i in active]
        every = len(active) == len(lengths)
        chosen = None if every else mx.array(np.asarray(active, dtype=np.int32))
        sub, out = step(live if every else live[chosen], mx.array(np.asarray(at, dtype=np.int32)))
        if every:
            live = sub
        else:
            live[chosen] = sub
        outs.append(out)
        order += at
        for j, row in enumerate(at):
            if (block := int(batch.state_out[row])) >= 0:
                dst.append(block)
                val.append(sub[j])
    out = mx.concatenate(outs)[mx.array(np.argsort(np.asarray(order)).astype(np.int32))]
    return out, dst, val


def write(state, conv_writes: tuple[list, list], ssm_writes: tuple[list, list]) -> None:
    """The kept windows and states into their blocks (one scatter each)."""
    for array, (dst, val) in (("conv", conv_writes), ("ssm", ssm_writes)):
        if dst:
            getattr(state, array)[mx.array(np.asarray(dst, dtype=np.int32))] = mx.stack(val)
