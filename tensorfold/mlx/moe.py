"""The mixture-of-experts feed-forward on MLX arrays (Qwen3.6, Qwen3-Next): models/moe.MoE.compose's
steps, bitwise.

    route    router logits (ops.MLXLinear: dense or quantized as the checkpoint's), made float32;
             the top k by a stable sort on the host (ties to the lower expert index), weights
             grid.exp_neg(l - max) over the chosen ones' sum added in rank order, or over every
             expert's sum as an exact int64 sum on the 2^-39 grid (kernels/moe.route's steps)
    experts  each chosen expert's SwiGLU (MLXLinear GEMMs, ops.silu_and_mul) over the rows that
             chose it
    combine  per row, from 0 in float32 and in ascending expert index, each output times its
             weight (the product rounded first), then sigmoid32(shared_gate(x)) * shared(x)
             added last; the result in x's dtype (kernels/moe.combine)

The choice needs the logits on the host: a forward evaluates each MoE layer's router once
(rows grouped by expert there), the rest stays one graph. Batch invariant as the reference is:
a row's choice and weights come from that row alone, and an expert's GEMM gives a row the bits
it gives it alone (the startup probes check the dense GEMM; the quantized one is exact).
"""
import mlx.core as mx
import numpy as np

from tensorfold.kernels.moe import SUM_BITS
from tensorfold.mlx import grid, ops
from tensorfold.models.moe import MoESpec, block_gemms
from tensorfold.models.weights import WeightReader


class Expert:
    """One SwiGLU expert: gate_up (fused) and down as MLXLinears."""

    def __init__(self, w: WeightReader, size: int):
        self.gate_up = w.linear("gate_proj.weight", "up_proj.weight")
        self.down = w.linear("down_proj.weight")
        self.size = size

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = self.gate_up(x)
        return self.down(ops.silu_and_mul(gate_up[:, :self.size], gate_up[:, self.size:]))


def route(logits: mx.array, top_k: int, normalize: bool) -> tuple[np.ndarray, mx.array]:
    """(experts [rows, k] int64 on the host, weights [rows, k] float32) from router logits
    [rows, E] float32: kernels/moe.route's choice and float32 steps, bitwise."""
    host = np.array(logits)
    # descending as torch's stable sort: NaN first, ties to the lower index (lexsort is stable)
    index = np.lexsort((-host, ~np.isnan(host)), axis=-1)[:, :top_k]
    ordered = mx.take_along_axis(logits, mx.array(index), axis=1)
    first = ordered[:, :1]
    top = grid.exp_neg(ordered - first)                              # [rows, k], the first is 1
    if normalize:
        total = top[:, 0]
        for j in range(1, top_k):                                    # rank order
            total = total + top[:, j]
    else:
        every = grid.exp_neg(logits - first)                         # [rows, E], each <= 1 (or NaN)
        m, ex = grid.significand(every)
        ints = grid.shift(m, ex + (SUM_BITS - 1))                     # round_even(p 2^39): exact sum
        total = grid.float32_of_int(ints.sum(axis=-1), mx.array(1 - SUM_BITS, dtype=mx.int64))
        total = mx.where(mx.isnan(every).any(axis=-1), mx.nan, total)  # a NaN's bits are no integer
    return index.astype(np.int64), top / total[:, None]


class MoE:
    """models/moe.MoE on MLX arrays: the router, the routed experts and the gated shared expert."""

    def __init__(self, spec: MoESpec, w: WeightReader):
        self.spec = spec
        mlp = w.under("mlp.")
        self.router = mlp.linear("gate.weight")
        self.experts = [Expert(mlp.under(f"experts.{e}."), spec.intermediate_size) for e in range(spec.num_experts)]
        self.shared = self.shared_gate = None
        if spec.shared_intermediate_size:
            self.shared = Expert(mlp.under("shared_expert."), spec.shared_intermediate_size)
            self.shared_gate = mlp.linear("shared_expert_gate.weight")

    def gemms(self) -> dict:
        return block_gemms(self)

    def __call__(self, x: mx.array) -> mx.array:
        if x.shape[0] == 0:
            return x
        logits = self.router(x).astype(mx.float32)                        # [rows, num_experts]
        chosen, weights = route(logits, self.spec.top_k, self.spec.norm_topk_prob)  # [rows, k] each
        # the (row, choice) pairs grouped by expert, rows ascending within one (kernels/moe.group_by_expert)
        order = np.argsort(chosen.reshape(-1), kind="stable")
        y_rows = np.empty_like(order)
        y_rows[order] = np.arange(order.size)
        y_rows = y_rows.reshape(chosen.shape)
        pair_rows = order // self.spec.top_k
        pair_experts = chosen.reshape(-1)[order]
        bounds = np.flatnonzero(np.diff(pair_experts)) + 1
        ys = [self.experts[int(e[0])](x[mx.array(r)])
              for e, r in zip(np.split(pair_experts, bounds), np.split(pair_rows, bounds))]
        y = ys[0] if len(ys) == 1 else mx.concatenate(ys)                 # [rows * k, hidden], pairs grouped
        # each row's terms in ascending expert index (a row's experts are distinct)
        rank = np.argsort(chosen, axis=1, kind="stable")
        out = mx.zeros(x.shape, dtype=mx.float32)                         # [rows, hidden]
        for i in range(chosen.shape[1]):
            j = rank[:, i:i + 1]
            picked = np.take_along_axis(y_rows, j, axis=1)[:, 0]
            out = out + y[mx.array(picked)].astype(mx.float32) * mx.take_along_axis(weights, mx.array(j), axis=1)
        if self.shared is not None:
            out = out + ops.sigmoid32(self.shared_gate(x).astype(mx.float32)) * self.shared(x).astype(mx.float32)
        return out.astype(x.dtype)
