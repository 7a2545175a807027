"""A mixture of experts feed-forward: a router, top-k routed SwiGLU experts and a gated shared
expert (Qwen3.6, Qwen3-Next).

    route    logits = router(x); the top k experts by logit (ties: the lower index first);
             weights p_i = exp(l_i - max) over the top k, divided by their sum (norm_topk_prob)
             or by the sum over every expert (softmax's own): ops.route (kernels/moe.py)
    experts  tokens grouped by expert, each expert's GEMMs over its tokens; a token's outputs
             times their weights, added in ascending expert index (float32)
    shared   sigmoid(shared_gate(x)) * shared_expert(x), added last

A backend may run the block as one call (`ops.fuse_moe`: the cpu backend's _cpu.MoEBlock), the
same steps in the same order; `compose` is the block op by op.

Batch invariant by construction: the router's logits come from the row-invariant GEMM, the
choice and the weights from that row alone (exp is exact.float32's, the sums fixed in order or
exact on the grid), an expert's GEMM gives each row the bits it gives it alone, whatever other
tokens chose the expert, and nothing is dropped for capacity.

Experts are read one by one (experts.E.gate_proj.weight, ...); Qwen3.5-MoE's stacked tensors
(experts.gate_up_proj [E, 2I, H], experts.down_proj) are split into that form at load.
"""
from dataclasses import dataclass

import torch

from tensorfold.kernels.reference import sigmoid32
from tensorfold.models.weights import WeightReader

@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int           # each routed expert's
    shared_intermediate_size: int    # the shared expert's (0: none)
    norm_topk_prob: bool = True


class Expert:
    """One SwiGLU expert: gate_up and down as LinearWeights."""

    def __init__(self, gate_up, down, intermediate_size: int, ops):
        self.gate_up, self.down, self.intermediate_size, self.ops = gate_up, down, intermediate_size, ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)
        return self.down(self.ops.silu_and_mul(gate, up))


class MoE:
    def __init__(self, spec: MoESpec, w: WeightReader, ctx):
        self.spec, self.ops = spec, w.ops
        mlp = w.under("mlp.")
        self.router = mlp.linear("gate.weight")
        self.experts = _experts(spec, mlp)
        self.shared = self.shared_gate = None
        if spec.shared_intermediate_size:
            shared = mlp.under("shared_expert.")
            self.shared = Expert(shared.linear("gate_proj.weight", "up_proj.weight"), shared.linear("down_proj.weight"),
                                 spec.shared_intermediate_size, w.ops)
            self.shared_gate = mlp.linear("shared_expert_gate.weight")
        self.cache_spec = None
        self._fused = w.ops.fuse_moe(self)  # the whole block as one native call, or None


    def gemms(self) -> dict:
        return block_gemms(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._fused(x)
        return self.compose(x)

    def compose(self, x: torch.Tensor) -> torch.Tensor:
        """The block op by op (what a backend's fuse_moe must equal bitwise)."""
        chosen, weights = self.ops.route(self.router(x).float(), self.spec.top_k, self.spec.norm_topk_prob)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(chosen).tolist():  # ascending: each row's terms in expert order
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            out[rows] += self.experts[e](x[rows]).float() * weights[rows, slot, None]
        if self.shared is not None:
            out += sigmoid32(self.shared_gate(x).float()) * self.shared(x).float()
        return out.to(x.dtype)


def _experts(spec: MoESpec, mlp: WeightReader) -> list[Expert]:
    """Each expert's gate/up (fused) and down: experts.E.{gate,up,down}_proj.weight (a stacked
    checkpoint is split into these at load: models/loader.split_stacked_experts)."""
    experts = []
    for e in range(spec.num_experts):
        one = mlp.under(f"experts.{e}.")
        experts.append(Expert(one.linear("gate_proj.weight", "up_proj.weight"), one.linear("down_proj.weight"),
                              spec.intermediate_size, mlp.ops))
    return experts


def block_gemms(block) -> dict:
    """A MoE block's GEMMs by name (router, each expert's gate_up and down, the shared expert and
    its gate): any backend's block with those attributes."""
    named = {"router": block.router}
    for e, expert in enumerate(block.experts):
        named[f"experts.{e}.gate_up"], named[f"experts.{e}.down"] = expert.gate_up, expert.down
    if block.shared is not None:
        named.update({"shared.gate_up": block.shared.gate_up, "shared.down": block.shared.down,
                      "shared_gate": block.shared_gate})
    return named
