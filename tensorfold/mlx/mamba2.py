"""Mamba2 (Nemotron-H's state-space mixer) on MLX arrays: kernels/mamba2.py's steps, bitwise.

The torch reference (kernels/mamba2.py) is the rule; each function here follows its steps in its
order and says which of its functions it equals:

    conv_silu         the causal depthwise conv tap by tap, the bias, then SiLU   = mamba2.conv_silu
    time_steps        dt = clamp(softplus32(dt + dt_bias), lo, hi) (delta_net.softplus32: float64
                      on MLX's CPU stream), decay = exp_neg(-(rate dt))           = mamba2.time_steps
    split_heads       x [rows, H, P], B and C [rows, H, N] (each head its group's) = mamba2.split_heads
    ssm_step          h = h decay + B (x dt)^T, then h^T C as delta_net.grid_dot's exact int64 sum
                                                                                  = mamba2.ssm_step
    mamba2            the layer's mixing over a batch, states per block, + x D   = mamba2.mamba2
    gated_group_norm  rms_norm(y silu(z)) per group, in the dtype, times the weight
                                                                                  = mamba2.gated_group_norm

The recurrence runs position by position for every chunking (the reference's one order: chunked
prefill == token by token by construction). States live per block (models/cache.Mamba2State:
conv [num_blocks, K - 1, C] and ssm [num_blocks, H, N, P], delta_net.LayerState's arrays), read
and written through mlx/recurrent.py as the batch's state slots say.

Mamba2 is the block: in_proj -> [z, xBC, dt] -> mamba2 -> gated norm -> out_proj, its tensors
under the layer's `mixer.` (models/mamba2.Mamba2's names and checks).
"""
import dataclasses

import mlx.core as mx
import torch

from tensorfold.mlx import grid, ops, recurrent
from tensorfold.mlx.delta_net import LayerState, grid_dot, softplus32
from tensorfold.models.cache import Mamba2State
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.mamba2 import Mamba2Spec, read_params
from tensorfold.models.weights import WeightReader


def conv_silu(x: mx.array, window: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """One sequence's causal depthwise conv, bias and SiLU: x [n, C], window [K - 1, C] the inputs
    before, weight [C, K], bias [C] or None; the taps added in order j = 0..K-1, then the bias
    (float32)."""
    padded = mx.concatenate([window, x.astype(mx.float32)])
    n, taps = x.shape[0], weight.shape[1]
    acc = padded[0:n] * weight[:, 0]
    for j in range(1, taps):
        acc = acc + padded[j:j + n] * weight[:, j]
    if bias is not None:
        acc = acc + bias
    return ops.silu32(acc)


def time_steps(dt: mx.array, params) -> tuple[mx.array, mx.array]:
    """(dt, decay) [rows, H] float32 from the projection's dt."""
    step = mx.clip(softplus32(dt.astype(mx.float32) + params.dt_bias), params.dt_min, params.dt_max)
    return step, grid.exp_neg(-(params.rate * step))


def split_heads(mixed: mx.array, params) -> tuple[mx.array, mx.array, mx.array]:
    """The conv's output [rows, C] as x [rows, H, P] and B, C [rows, H, N]."""
    p, rows = params, mixed.shape[0]
    width, group_width = p.num_heads * p.head_dim, p.n_groups * p.state_size
    x = mixed[:, :width].reshape(rows, p.num_heads, p.head_dim)
    b = mixed[:, width:width + group_width].reshape(rows, p.n_groups, p.state_size)
    c = mixed[:, width + group_width:].reshape(rows, p.n_groups, p.state_size)
    per_group = p.num_heads // p.n_groups
    if per_group > 1:  # group g serves heads g * per_group .. g * per_group + per_group - 1
        b, c = mx.repeat(b, per_group, axis=1), mx.repeat(c, per_group, axis=1)
    return x, b, c


@grid.fused
def ssm_step(state, x_dt, b, c, decay):
    """One position of several sequences: state [A, H, N, P], x_dt [A, H, P], b and c [A, H, N],
    decay [A, H] -> (the new state, h^T C [A, H, P] before the D skip)."""
    state = state * decay[..., None, None]
    state = state + b[..., :, None] * x_dt[..., None, :]
    return state, grid_dot(state, c)


def mamba2(xbc: mx.array, dt: mx.array, state: LayerState, batch, params) -> mx.array:
    """One layer's mixing over an MLXBatch: xbc [rows, C] (before the conv), dt [rows, H]; each
    sequence from block batch.state_in[i] (-1: zero), the state after row r to block
    batch.state_out[r] where that is not -1. Returns y [rows, H, P] float32 (with the D skip)."""
    windows, live = recurrent.starting_states(state, batch)
    mixed, *conv_writes = recurrent.convolve(
        xbc, windows, batch, lambda rows, window: conv_silu(rows, window, params.conv_weight, params.conv_bias))
    x, b, c = split_heads(mixed, params)
    step, decay = time_steps(dt, params)
    x_dt = x * step[..., None]
    out, *ssm_writes = recurrent.scan(live, batch, lambda sub, at: ssm_step(sub, x_dt[at], b[at], c[at], decay[at]))
    recurrent.write(state, conv_writes, ssm_writes)
    return out + x * params.d[:, None]


def gated_group_norm(y: mx.array, z: mx.array, weight: mx.array, n_groups: int, eps: float) -> mx.array:
    """y * silu(z) in float32 (y [rows, I] float32), RMS-normed over each of n_groups equal slices
    of a row (ops.rms_norm with a weight of ones, as the reference), rounded to weight's dtype,
    times weight [I]."""
    rows, width = y.shape
    g = y * ops.silu32(z.astype(mx.float32))
    ones = mx.ones((width // n_groups,), dtype=mx.float32)
    normed = ops.rms_norm(g.reshape(rows * n_groups, width // n_groups), ones, eps).reshape(rows, width)
    return normed.astype(weight.dtype) * weight


class Mamba2:
    """models/mamba2.Mamba2 on MLX arrays: the same weights and checks, this module's mixing over
    the layer's LayerState."""

    def __init__(self, spec: Mamba2Spec, w: WeightReader, eps: float):
        self.spec, self.eps = spec, eps
        m = w.under("mixer.")
        self.in_proj = m.linear("in_proj.weight", biases=("in_proj.bias",))
        self.out_proj = m.linear("out_proj.weight", biases=("out_proj.bias",))
        rows = 2 * spec.intermediate_size + 2 * spec.n_groups * spec.state_size + spec.num_heads
        if self.in_proj.shape[0] != rows:
            raise CheckpointError(f"{m.prefix}in_proj.weight has {self.in_proj.shape[0]} rows, the config says {rows}")
        params = read_params(spec, m)
        self.params = dataclasses.replace(params, **{name: _mx(getattr(params, name)) for name in (
            "conv_weight", "conv_bias", "rate", "dt_bias", "d")})
        self.norm = _mx(m.dense("norm.weight").reshape(-1))  # the gated norm's weight: a plain multiplier
        self.cache_spec = Mamba2State(spec.conv_dim, spec.conv_kernel, spec.num_heads, spec.state_size, spec.head_dim)

    def gemms(self) -> dict:
        return {"in_proj": self.in_proj, "out_proj": self.out_proj}

    def __call__(self, x: mx.array, batch, state: LayerState, rope_rows) -> mx.array:
        s, rows = self.spec, x.shape[0]
        width = s.intermediate_size
        proj = self.in_proj(x)  # [rows, I + C + H]: z, xBC, dt
        z, xbc, dt = proj[:, :width], proj[:, width:width + s.conv_dim], proj[:, width + s.conv_dim:]
        y = mamba2(xbc, dt, state, batch, self.params)  # [rows, H, P] float32
        return self.out_proj(gated_group_norm(y.reshape(rows, width), z, self.norm, s.n_groups, self.eps))


def _mx(t: torch.Tensor | None) -> mx.array | None:
    return None if t is None else ops.from_torch(t)
