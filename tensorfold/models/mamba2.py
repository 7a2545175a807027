"""Mamba2, the state-space mixer of Nemotron-H.

    in_proj     x -> [z (the gate, I), xBC (the conv's channels: x I, B and C G*N each), dt (H)]
    mamba2      conv + SiLU, dt's softplus, the SSD recurrence over the state, the D skip
                                                                          ops.mamba2
    gated norm  rms_norm(y * silu(z)) per group of I / G channels, times w  ops.mamba2_gated_norm
    out_proj

I = heads * head_dim, G = n_groups, N = ssm_state_size. The recurrence and its exact arithmetic
are kernels/mamba2.py's; the state lives in the cache per block (models/cache.Mamba2State).
Tensors are read under the layer's `mixer.` (Nemotron-H's own names).
"""
from dataclasses import dataclass

import torch

from tensorfold.kernels.delta_net import decay_rate
from tensorfold.models.cache import Mamba2State
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.weights import WeightReader


@dataclass(frozen=True)
class Mamba2Spec:
    """A Mamba2 mixer: num_heads heads of head_dim, n_groups groups of B and C of state_size, a
    causal conv of conv_kernel taps; dt clamped to time_step_limit."""
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class Mamba2Params:
    """What ops.mamba2 reads besides the rows and the state (float32): shapes, the conv's taps
    [C, K] and bias [C] (or None), the decay rate exp(A_log) [H], dt_bias [H], D [H] and dt's
    clamp."""
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    rate: torch.Tensor
    dt_bias: torch.Tensor
    d: torch.Tensor
    dt_min: float
    dt_max: float


class Mamba2:
    def __init__(self, spec: Mamba2Spec, w: WeightReader, ctx):
        self.spec, self.ops, self.eps = spec, w.ops, ctx.norm_eps
        m = w.under("mixer.")
        self.in_proj = m.linear("in_proj.weight", biases=("in_proj.bias",))
        self.out_proj = m.linear("out_proj.weight", biases=("out_proj.bias",))
        self.params = read_params(spec, m)
        self.norm = m.dense("norm.weight")  # the gated norm's weight: a plain multiplier
        if self.in_proj.shape[0] != 2 * spec.intermediate_size + 2 * spec.n_groups * spec.state_size + spec.num_heads:
            raise CheckpointError(f"{m.prefix}in_proj.weight has {self.in_proj.shape[0]} rows, the config says "
                                  f"{2 * spec.intermediate_size + 2 * spec.n_groups * spec.state_size + spec.num_heads}")
        self.cache_spec = Mamba2State(spec.conv_dim, spec.conv_kernel, spec.num_heads, spec.state_size, spec.head_dim)

    def gemms(self) -> dict:
        return {"in_proj": self.in_proj, "out_proj": self.out_proj}

    def forward(self, x: torch.Tensor, batch, state) -> torch.Tensor:
        s, ops = self.spec, self.ops
        num_rows, width = x.shape[0], s.intermediate_size
        z, xbc, dt = self.in_proj(x).split([width, s.conv_dim, s.num_heads], dim=1)
        y = ops.mamba2(xbc, dt, state, batch, self.params)  # [rows, heads, head_dim] float32
        normed = ops.mamba2_gated_norm(y.reshape(num_rows, width), z, self.norm, s.n_groups, self.eps, x.dtype)
        return self.out_proj(normed)


def read_params(spec: Mamba2Spec, m: WeightReader) -> Mamba2Params:
    """The layer's conv taps and bias (checked against the config), decay rate, dt_bias and D."""
    conv = m.float32("conv1d.weight")
    if tuple(conv.shape) not in ((spec.conv_dim, 1, spec.conv_kernel), (spec.conv_dim, spec.conv_kernel)):
        raise CheckpointError(f"{m.prefix}conv1d.weight has shape {tuple(conv.shape)}, the config says "
                              f"({spec.conv_dim}, 1, {spec.conv_kernel})")
    rate = -m.float32("A") if m.has("A") else decay_rate(m.float32("A_log"))  # a GGUF's ssm_a is A = -exp(A_log)
    lo, hi = spec.time_step_limit
    return Mamba2Params(spec.num_heads, spec.head_dim, spec.n_groups, spec.state_size,
                        conv.reshape(spec.conv_dim, spec.conv_kernel).contiguous(),
                        m.float32("conv1d.bias") if m.has("conv1d.bias") else None, rate, m.float32("dt_bias"),
                        m.float32("D"), float(lo), float(hi))
