"""A mixture of experts feed-forward: a router, top-k routed SwiGLU experts and a gated shared
expert (Qwen3.6, Qwen3-Next), or, with sigmoid routing, GLM-5's (DeepSeek-V3's) block: the
noaux_tc choice and shared experts added ungated.

    route    logits = router(x); the top k experts by logit (ties: the lower index first);
             weights p_i = exp(l_i - max) over the top k, divided by their sum (norm_topk_prob)
             or by the sum over every expert (softmax's own): ops.route (kernels/moe.py)
    experts  tokens grouped by expert, each expert's GEMMs over its tokens; a token's outputs
             times their weights, added in ascending expert index (float32)
    shared   sigmoid(shared_gate(x)) * shared_expert(x), added last
    Gemma 4  (models/gemma4_moe.py) GeGLU experts (activation "gelu_tanh"), the router on an input
             of its own (router_x: Gemma's norm and scale of the residual), the weights times the
             chosen experts' per-expert scale (expert_scale), no shared expert
    sigmoid  (SigmoidRouting: GLM-5) the router in float32 (as transformers keeps it); scores
             sigmoid(l_i), chosen by score + e_score_correction_bias within the best groups, weights
             the chosen scores over their sum, times routed_scaling_factor: ops.route_sigmoid
             (kernels/moe.py); the shared experts (shared_experts.) added without a gate

A backend may run the block as one call (`ops.fuse_moe`: the cpu backend's _cpu.MoEBlock, with
either routing), the same steps in the same order, called as fused(x) or fused(x, router_x);
`compose` is the block op by op.

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
class SigmoidRouting:
    """noaux_tc routing (GLM-5, DeepSeek-V3): the best topk_group of n_group expert groups (by
    their two best biased scores), weights times scale (routed_scaling_factor)."""
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int           # each routed expert's
    shared_intermediate_size: int    # the shared expert's (0: none)
    norm_topk_prob: bool = True
    sigmoid_routing: SigmoidRouting | None = None  # None: softmax over the router's logits
    shared_gated: bool = True        # the shared expert times sigmoid(shared_expert_gate(x)) (Qwen)
    shared_prefix: str = "shared_expert."  # GLM-5: shared_experts.
    activation: str = "silu"         # the experts' gate: silu (SwiGLU) or gelu_tanh (GeGLU: Gemma 4)


class Expert:
    """One gated expert, SwiGLU or GeGLU: gate_up and down as LinearWeights."""

    def __init__(self, gate_up, down, intermediate_size: int, ops, activation: str = "silu"):
        self.gate_up, self.down, self.intermediate_size, self.ops = gate_up, down, intermediate_size, ops
        self.act_and_mul = ops.gelu_tanh_and_mul if activation == "gelu_tanh" else ops.silu_and_mul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)
        return self.down(self.act_and_mul(gate, up))


class MoE:
    def __init__(self, spec: MoESpec, w: WeightReader, ctx):
        self.spec, self.ops = spec, w.ops
        mlp = w.under("mlp.")
        sigmoid = spec.sigmoid_routing is not None
        self.router = float32_linear(mlp, "gate.weight") if sigmoid else mlp.linear("gate.weight")
        self.bias = mlp.float32("gate.e_score_correction_bias") if sigmoid else None  # [E]
        self.experts = self.read_experts(spec, mlp)
        self.expert_scale = None  # float32 [E] the chosen weights are multiplied by (Gemma 4's; None: none)
        self.shared = self.shared_gate = None
        if spec.shared_intermediate_size:
            shared = mlp.under(spec.shared_prefix)
            self.shared = Expert(shared.linear("gate_proj.weight", "up_proj.weight"), shared.linear("down_proj.weight"),
                                 spec.shared_intermediate_size, w.ops)
            if spec.shared_gated:
                self.shared_gate = mlp.linear("shared_expert_gate.weight")
        self.cache_spec = None
        # the whole block as one native call where the op set has one for it (fuse_moe: None where not)
        self._fused = w.ops.fuse_moe(self) if self.fusable else None

    fusable = True  # whether a backend may run the block as one call (a rank's share of the experts may not)

    def read_experts(self, spec: MoESpec, mlp: WeightReader) -> list:
        """The routed experts, indexed by expert id (a tensor-parallel rank's: None where another
        rank keeps it)."""
        return _experts(spec, mlp)

    def gemms(self) -> dict:
        return block_gemms(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._fused(x)
        return self.compose(x)

    def compose(self, x: torch.Tensor, router_x: torch.Tensor | None = None) -> torch.Tensor:
        """The block op by op (what a backend's fuse_moe must equal bitwise). router_x: the router's
        input where it is not x (Gemma 4's)."""
        s, r = self.spec, self.spec.sigmoid_routing
        routed_on = x if router_x is None else router_x
        if r is None:
            chosen, weights = self.ops.route(self.router(routed_on).float(), s.top_k, s.norm_topk_prob)
        else:
            chosen, weights = self.ops.route_sigmoid(self.router(routed_on.float()).float(), self.bias, s.top_k,
                                                     r.n_group, r.topk_group, s.norm_topk_prob, r.scale)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[chosen]  # one float32 product each
        out = self.routed(x, chosen, weights)
        if self.shared is not None:
            shared = self.shared(x).float()
            out += shared if self.shared_gate is None else sigmoid32(self.shared_gate(x).float()) * shared
        return out.to(x.dtype)

    def routed(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The chosen experts' outputs times their weights, each row's terms added in ascending
        expert index, float32 [rows, hidden]."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(chosen).tolist():  # ascending: each row's terms in expert order
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            out[rows] += self.experts[e](x[rows]).float() * weights[rows, slot, None]
        return out


def float32_linear(w: WeightReader, name: str):
    """A matrix transformers keeps in float32 whatever the model's dtype (GLM-5's router, the
    DSA indexer's head weights): float32 where stored dense (its input then float32 too), else as
    stored (quantized blocks)."""
    if isinstance(w.tensors.get(w.prefix + name), torch.Tensor):
        return w.ops.Linear.of(w.float32(name))
    return w.linear(name)


def _experts(spec: MoESpec, mlp: WeightReader) -> list[Expert]:
    """Each expert's gate/up (fused) and down: experts.E.{gate,up,down}_proj.weight (a stacked
    checkpoint is split into these at load: models/loader.split_stacked_experts)."""
    return [experts_one(spec, mlp, e) for e in range(spec.num_experts)]


def experts_one(spec: MoESpec, mlp: WeightReader, e: int) -> Expert:
    """Expert e's gate/up and down."""
    one = mlp.under(f"experts.{e}.")
    return Expert(one.linear("gate_proj.weight", "up_proj.weight"), one.linear("down_proj.weight"),
                  spec.intermediate_size, mlp.ops, spec.activation)


def block_gemms(block) -> dict:
    """A MoE block's GEMMs by name (router, each expert's gate_up and down, the shared expert and
    its gate): any backend's block with those attributes."""
    named = {"router": block.router}
    for e, expert in enumerate(block.experts):
        if expert is not None:  # None: another rank's
            named[f"experts.{e}.gate_up"], named[f"experts.{e}.down"] = expert.gate_up, expert.down
    if block.shared is not None:
        named.update({"shared.gate_up": block.shared.gate_up, "shared.down": block.shared.down})
    if block.shared_gate is not None:
        named["shared_gate"] = block.shared_gate
    return named
