"""Gated DeltaNet, the linear-attention mixer of Qwen3.5, Qwen3.6 and Qwen3-Next.

    in_proj      x -> [q k v (the conv's channels), z (the output gate), b, a]   one GEMM
    delta_net    conv + SiLU, l2-normed q/k, gates, the delta rule over the state  ops.delta_net
    gated norm   rms_norm(out) * w * silu(z) per value head                     ops.gated_rms_norm
    out_proj

The checkpoints spell the input projection two ways: Qwen3.5 as four matrices (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a), Qwen3-Next as two whose rows are grouped by key head
(in_proj_qkvz: per key head [q, k, v of its value heads, z of its value heads]; in_proj_ba:
per key head [b, a of its value heads]). The grouped rows are put in the plain order once, at
load, so both run one fused GEMM and the same step. The recurrence and its exact arithmetic
are kernels/delta_net.py's; the state lives in the cache per block (models/cache.RecurrentState).
"""
from dataclasses import dataclass

import torch

from tensorfold.kernels.delta_net import decay_rate
from tensorfold.kernels.quant_gemm import take_rows
from tensorfold.models.cache import RecurrentState
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.weights import WeightReader


@dataclass(frozen=True)
class LinearAttentionSpec:
    """A Gated DeltaNet mixer: num_key_heads query/key heads of key_dim, num_heads value heads
    of value_dim (each key head serves num_heads // num_key_heads of them), a causal conv of
    conv_kernel taps. grouped: the Qwen3-Next spelling of the input projection."""
    num_key_heads: int
    num_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    grouped: bool = False

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_dim + self.num_heads * self.value_dim


@dataclass(frozen=True)
class DeltaNetParams:
    """What ops.delta_net reads besides the rows and the state: shapes, the conv's taps [C, K],
    the decay rate exp(A_log) (a GGUF's -ssm_a) and dt_bias [heads] (float32)."""
    num_key_heads: int
    num_heads: int
    key_dim: int
    value_dim: int
    conv_weight: torch.Tensor
    rate: torch.Tensor
    dt_bias: torch.Tensor


class GatedDeltaNet:
    def __init__(self, spec: LinearAttentionSpec, w: WeightReader, ctx):
        self.spec, self.ops, self.eps = spec, w.ops, ctx.norm_eps
        la = w.under("linear_attn.")
        self.in_proj = w.ops.Linear.of(*input_matrices(spec, la))
        self.out_proj = la.linear("out_proj.weight")
        self.params = read_params(spec, la)
        self.norm = la.dense("norm.weight")  # the gated norm's weight: a plain multiplier
        self.cache_spec = RecurrentState(spec.conv_dim, spec.conv_kernel, spec.num_heads, spec.key_dim,
                                         spec.value_dim)

    def gemms(self) -> dict:
        return {"in_proj": self.in_proj, "out_proj": self.out_proj}

    def forward(self, x: torch.Tensor, batch, state) -> torch.Tensor:
        s, ops = self.spec, self.ops
        num_rows, width = x.shape[0], s.num_heads * s.value_dim
        qkv, z, b, a = self.in_proj(x).split([s.conv_dim, width, s.num_heads, s.num_heads], dim=1)
        core = ops.delta_net(qkv, a, b, state, batch, self.params)  # [rows, heads, value_dim]
        normed = ops.gated_rms_norm(core.reshape(-1, s.value_dim), z.reshape(-1, s.value_dim), self.norm, self.eps)
        return self.out_proj(normed.reshape(num_rows, width))


def read_params(spec: LinearAttentionSpec, la: WeightReader) -> DeltaNetParams:
    """The layer's conv taps (checked against the config), decay rate and dt_bias, as torch
    tensors (every backend reads them here; the mlx one converts them)."""
    conv = la.float32("conv1d.weight")
    if tuple(conv.shape) != (spec.conv_dim, 1, spec.conv_kernel):
        raise CheckpointError(f"{la.prefix}conv1d.weight has shape {tuple(conv.shape)}, the config says "
                              f"({spec.conv_dim}, 1, {spec.conv_kernel})")
    return DeltaNetParams(spec.num_key_heads, spec.num_heads, spec.key_dim, spec.value_dim,
                          conv.reshape(spec.conv_dim, spec.conv_kernel).contiguous(), _rate(la),
                          la.float32("dt_bias"))


def _rate(la: WeightReader) -> torch.Tensor:
    """exp(A_log), or -A where the checkpoint holds A = -exp(A_log) as llama.cpp's GGUFs store it
    (ssm_a, models/gguf_file.py): the file's own values, not a log and exp back."""
    return -la.float32("A") if la.has("A") else decay_rate(la.float32("A_log"))


def input_matrices(spec: LinearAttentionSpec, la: WeightReader) -> list:
    """[qkv, z, b, a] as checkpoint matrices, in the plain order (a Qwen3-Next GGUF's come plain)."""
    if not spec.grouped or la.has("in_proj_qkv.weight"):
        return [la.matrix(n) for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                       "in_proj_a.weight")]
    qkvz, ba = la.matrix("in_proj_qkvz.weight"), la.matrix("in_proj_ba.weight")
    return [take_rows(qkvz, _qkvz_order(spec)), take_rows(ba, _ba_order(spec))]


def _qkvz_order(spec: LinearAttentionSpec) -> torch.Tensor:
    """Rows of in_proj_qkvz in the order [all q, all k, all v, all z]."""
    g, dk, dv = spec.num_heads // spec.num_key_heads, spec.key_dim, spec.value_dim
    per_head = 2 * dk + 2 * g * dv
    heads = torch.arange(spec.num_key_heads)[:, None] * per_head
    parts = [(0, dk), (dk, dk), (2 * dk, g * dv), (2 * dk + g * dv, g * dv)]
    return torch.cat([(heads + start + torch.arange(n)).reshape(-1) for start, n in parts])


def _ba_order(spec: LinearAttentionSpec) -> torch.Tensor:
    """Rows of in_proj_ba in the order [all b, all a]."""
    g = spec.num_heads // spec.num_key_heads
    heads = torch.arange(spec.num_key_heads)[:, None] * 2 * g
    return torch.cat([(heads + start + torch.arange(g)).reshape(-1) for start in (0, g)])
