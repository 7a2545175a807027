"""Mamba2's selective scan (SSD), exact: the torch reference of one Mamba2 layer's mixing.

A Mamba2 layer (Nemotron-H) keeps, per sequence, the last inputs of a causal depthwise conv and
one state h [state_size, head_dim] per head. The input projection gives xBC (the conv's channels:
x, then B and C of each of n_groups groups) and dt (one per head); each position:

    xBC    = silu(conv(window of xBC) + conv_bias)          the taps in order, then the bias
    x, B, C = split(xBC): x [heads, head_dim], B and C [groups, state_size]; head h reads group
             h // (heads / groups)
    dt     = clamp(softplus(dt + dt_bias), lo, hi)           float64 exp / log, rounded once
    decay  = exp(-rate * dt),  rate = exp(A_log)              A = -rate (a GGUF stores A)
    h      = h * decay + B (x * dt)^T                         h[n, p] = h[n, p] decay + B[n] (x[p] dt)
    y      = h^T C + x * D                                    the dot over state_size exact

The rule (tensorfold/exact): the one reduction, y = h^T C, is delta_net.grid_dot, an exact sum
on the fixed-point grid (state columns and C as integers, summed in float64 below 2^53, rounded
once); every other step is one IEEE float32 operation in the order written here (no FMA), exp
is exact.float32.exp_neg and softplus exact.float64's. A position's state and output then
depend on the sequence's tokens alone: the same bits whatever the batch, the chunking of a
prefill and the threads.

Prefill runs the recurrence position by position, as decode does. The SSD "chunked" form
(intra-chunk matrices, inter-chunk state passing: transformers' torch_chunk_scan, mamba_ssm's
kernels) sums the same terms in another order that depends on where chunks fall, which the
exact rule forbids; the sequential form is the one order every chunking shares, so chunked
prefill == token by token holds by construction. The conv, the gates and the output's gated
norm are computed for all rows at once.

States live in the cache per block (models/cache.Mamba2State, RecurrentState's rule): the op
reads and writes the slots the batch names (ForwardBatch.state_slots), as kernels/delta_net does.
"""
import torch

from tensorfold.exact import float32
from tensorfold.kernels import recurrent
from tensorfold.kernels.delta_net import grid_dot, softplus32
from tensorfold.kernels.reference import rms_norm, silu32


def conv_silu(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One sequence's causal depthwise conv, bias and SiLU: x [n, C] new inputs, window [K - 1, C]
    the inputs before them, weight [C, K], bias [C] or None. Row t = silu(sum_j weight[:, j] *
    in[t + j] + bias), in = window ++ x, the taps added in order j = 0..K-1, then the bias
    (float32)."""
    padded = torch.cat([window, x.float()])
    n, taps = x.shape[0], weight.shape[1]
    acc = padded[0:n] * weight[:, 0]
    for j in range(1, taps):
        acc = acc + padded[j:j + n] * weight[:, j]
    if bias is not None:
        acc = acc + bias
    return silu32(acc)


def time_steps(dt: torch.Tensor, params) -> tuple[torch.Tensor, torch.Tensor]:
    """(dt, decay) [rows, heads] float32 from the projection's dt: dt = clamp(softplus(dt +
    dt_bias), lo, hi), decay = exp(-rate * dt)."""
    step = softplus32(dt.float() + params.dt_bias).clamp(params.dt_min, params.dt_max)
    return step, float32.exp_neg(-(params.rate * step))


def split_heads(mixed: torch.Tensor, params):
    """The conv's output [rows, C] as x [rows, H, P] and B, C [rows, H, N] (each head its group's)."""
    p, rows = params, mixed.shape[0]
    width, group_width = p.num_heads * p.head_dim, p.n_groups * p.state_size
    x = mixed[:, :width].reshape(rows, p.num_heads, p.head_dim)
    b = mixed[:, width:width + group_width].reshape(rows, p.n_groups, p.state_size)
    c = mixed[:, width + group_width:].reshape(rows, p.n_groups, p.state_size)
    per_group = p.num_heads // p.n_groups
    if per_group > 1:  # group g serves heads g * per_group .. g * per_group + per_group - 1
        b, c = b.repeat_interleave(per_group, dim=1), c.repeat_interleave(per_group, dim=1)
    return x, b, c


def ssm_step(state, x_dt, b, c, decay) -> torch.Tensor:
    """One position of several sequences at once, in place on state [A, H, N, P]; x_dt [A, H, P]
    (x * dt), b and c [A, H, N], decay [A, H]. Returns h^T C [A, H, P] (before the D skip)."""
    state *= decay[..., None, None]
    state += b[..., :, None] * x_dt[..., None, :]
    return grid_dot(state, c)


def mamba2(xbc: torch.Tensor, dt: torch.Tensor, state, batch, params) -> torch.Tensor:
    """One Mamba2 layer's mixing over a ForwardBatch: xbc [rows, C] (the input projection's conv
    channels, before the conv), dt [rows, H]; state: the layer's models/cache.LayerState. Each
    sequence starts from the state in block state_in (zero at -1), and the state after a row is
    written to block state_out[row] where that is not -1 (ForwardBatch.state_slots). Returns y
    [rows, H, P] float32 (with the D skip, before the gated norm)."""
    state_in, state_out = batch.state_slots(state.block_size)
    windows, live = recurrent.starting_states(state, state_in, len(batch.sequences))
    mixed = recurrent.convolve(xbc, windows, batch, state, state_out,
                               lambda rows, window: conv_silu(rows, window, params.conv_weight, params.conv_bias))
    x, b, c = split_heads(mixed, params)
    step, decay = time_steps(dt, params)
    x_dt = x * step[..., None]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    recurrent.scan(live, batch, state, state_out, out, lambda sub, at: ssm_step(sub, x_dt[at], b[at], c[at], decay[at]))
    return out + x * params.d[:, None]


def gated_group_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, n_groups: int, eps: float,
                     dtype: torch.dtype) -> torch.Tensor:
    """Mamba2's output norm (norm_before_gate off): g = y * silu(z) in float32, RMS-normed over
    each of n_groups equal slices of a row (rms_norm's exact steps), rounded to `dtype`, times
    weight. y [rows, I] float32, z [rows, I], weight [I]; returns [rows, I] in dtype."""
    rows, width = y.shape
    g = y * silu32(z.float())
    ones = torch.ones(width // n_groups, dtype=torch.float32, device=y.device)
    normed = rms_norm(g.reshape(rows * n_groups, width // n_groups), ones, eps).reshape(rows, width)
    return normed.to(dtype) * weight
