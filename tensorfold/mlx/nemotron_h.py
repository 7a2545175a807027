"""Nemotron-H's feed-forward blocks on MLX arrays: models/nemotron_h.py's ReluSquaredMLP and
NemotronMoE, bitwise (the Mamba2 mixer is mlx/mamba2.py; its attention is mlx/model.Attention
with no rope).

    relu_squared   relu(x)^2 in x's dtype                                = reference.relu_squared
    route_sigmoid  scores = sigmoid32(logits), the choice on scores + bias, group-limited (the
                   topk_group groups whose two best sum highest), the top k by a stable sort on
                   the host (ties, groups and experts, to the lower index); weights the chosen
                   scores over their sum added in rank order (+ 1e-20), times the scale
                                                                         = kernels/moe.route_sigmoid
    NemotronMoE    the router in float32 (as transformers keeps it) -> [fc1 latent] -> each chosen
                   expert's relu^2 over its rows, times its weight, added per row from 0 in
                   float32 in ascending expert index -> the dtype -> [fc2 latent] -> + the
                   shared expert (in the dtype)                           = NemotronMoE.forward

A row's choice, weights and sum come from that row alone, so the block is batch invariant as the
reference is; the choice needs the router's logits on the host (one evaluation per MoE layer).
"""
import mlx.core as mx
import numpy as np

from tensorfold.exact.float32 import f32
from tensorfold.mlx import ops
from tensorfold.models.moe import float32_linear
from tensorfold.models.nemotron_h import NemotronMoESpec, ReluSquaredMLPSpec, moe_gemms
from tensorfold.models.weights import WeightReader


def relu_squared(x: mx.array) -> mx.array:
    r = mx.maximum(x, mx.array(0, dtype=x.dtype))
    return r * r


class ReluSquared:
    """up, relu^2, down (an expert, the shared expert, an MLP layer)."""

    def __init__(self, up: ops.MLXLinear, down: ops.MLXLinear):
        self.up, self.down = up, down

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(relu_squared(self.up(x)))


class ReluSquaredMLP:
    def __init__(self, spec: ReluSquaredMLPSpec, w: WeightReader):
        mlp = w.under("mlp.")
        self.mlp = ReluSquared(mlp.linear("up_proj.weight", biases=("up_proj.bias",)),
                               mlp.linear("down_proj.weight", biases=("down_proj.bias",)))

    def gemms(self) -> dict:
        return {"up": self.mlp.up, "down": self.mlp.down}

    def __call__(self, x: mx.array) -> mx.array:
        return self.mlp(x)


def _descending(values: np.ndarray, count: int) -> np.ndarray:
    """The first `count` indices of each row by torch's stable descending sort: NaN first, ties
    (-0.0 and 0.0 included) to the lower index."""
    return np.lexsort((-values, ~np.isnan(values)), axis=-1)[:, :count]


def route_sigmoid(logits: mx.array, bias: mx.array, spec: NemotronMoESpec) -> tuple[np.ndarray, mx.array]:
    """(experts [rows, k] int64 on the host, weights [rows, k] float32) from router logits [rows, E]
    float32 and the correction bias [E]."""
    scores = ops.sigmoid32(logits)
    choice = np.array(scores + bias)                                   # [rows, E] float32
    rows, num_experts = choice.shape
    if spec.n_group > 1:
        grouped = choice.reshape(rows, spec.n_group, -1)
        best = np.take_along_axis(grouped, _descending(grouped.reshape(-1, grouped.shape[-1]), 2).reshape(
            rows, spec.n_group, 2), axis=-1)
        group_scores = best[..., 0] + best[..., 1]                     # [rows, n_group], float32 adds
        kept = np.zeros((rows, spec.n_group), dtype=bool)
        np.put_along_axis(kept, _descending(group_scores, spec.topk_group), True, axis=1)
        choice = np.where(np.repeat(kept, num_experts // spec.n_group, axis=1), choice, np.float32(-np.inf))
    index = _descending(choice, spec.top_k)
    weights = mx.take_along_axis(scores, mx.array(index), axis=1)
    if spec.norm_topk_prob:
        total = weights[:, 0]
        for j in range(1, spec.top_k):                                 # rank order
            total = total + weights[:, j]
        weights = weights / (total + f32(1e-20))[:, None]
    return index.astype(np.int64), weights * f32(spec.routed_scaling_factor)


class NemotronMoE:
    """models/nemotron_h.NemotronMoE on MLX arrays."""

    def __init__(self, spec: NemotronMoESpec, w: WeightReader):
        self.spec = spec
        mlp = w.under("mlp.")
        self.router = float32_linear(mlp, "gate.weight")
        self.bias = ops.from_torch(mlp.float32("gate.e_score_correction_bias")) if mlp.has(
            "gate.e_score_correction_bias") else mx.zeros((spec.num_experts,), dtype=mx.float32)
        self.experts = [ReluSquared(mlp.linear(f"experts.{e}.up_proj.weight"),
                                    mlp.linear(f"experts.{e}.down_proj.weight")) for e in range(spec.num_experts)]
        shared = mlp.under("shared_experts.")
        self.shared = ReluSquared(shared.linear("up_proj.weight"), shared.linear("down_proj.weight"))
        self.fc1 = self.fc2 = None
        if spec.latent_size:
            self.fc1, self.fc2 = mlp.linear("fc1_latent_proj.weight"), mlp.linear("fc2_latent_proj.weight")

    def gemms(self) -> dict:
        return moe_gemms(self)

    def __call__(self, x: mx.array) -> mx.array:
        if x.shape[0] == 0:
            return x
        logits = self.router(x.astype(mx.float32)).astype(mx.float32)  # [rows, E]
        chosen, weights = route_sigmoid(logits, self.bias, self.spec)   # [rows, k] each
        inner = self.fc1(x) if self.fc1 is not None else x
        out = mx.zeros(inner.shape, dtype=mx.float32)                   # [rows, width]
        for e in np.unique(chosen).tolist():  # ascending: each row's terms in expert order
            rows, slot = (mx.array(i.astype(np.int32)) for i in np.nonzero(chosen == e))
            term = self.experts[e](inner[rows]).astype(mx.float32) * weights[rows, slot][:, None]
            out = out.at[rows].add(term)                                # a row once per expert: one add
        routed = out.astype(x.dtype)
        if self.fc2 is not None:
            routed = self.fc2(routed)
        return routed + self.shared(x)
