"""Gemma 4's mixture of experts (the 26B-A4B checkpoints: enable_moe_block), beside each layer's
dense MLP. transformers' Gemma4TextDecoderLayer, with h the residual stream after attention:

    dense  = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))
    experts = post_feedforward_layernorm_2(moe(pre_feedforward_layernorm_2(h), route(h)))
    h = h + post_feedforward_layernorm(dense + experts)

The MoE block here is models/moe.MoE (its routing, grouping and fixed-order sum; the op sets'
fuse_moe runs it as one call) with Gemma's parts:
    router input  rms_norm(h) without a weight, times router.scale (in the dtype), times
                  hidden^-0.5 (a float32 product rounded to the dtype), as transformers' steps round
    route         softmax over every expert's logit, the top k, renormalized over them: softmax is
                  monotone, so its top k are the top k logits (ties to the lower index), and
                  p_j / sum of the chosen p = exp(l_j - l_0) / sum of the chosen exp(l - l_0): exactly
                  kernels/moe.route with normalize (norm_topk_prob)
    weights       times router.per_expert_scale of each chosen expert (float32; MoE.expert_scale)
    experts       GeGLU (the config's hidden_activation, GELU's tanh form), no shared expert

Checkpoint names (under model.layers.N.; the Hub's multimodal checkpoints under
model.language_model.layers.N.): router.proj.weight [E, hidden], router.scale [hidden],
router.per_expert_scale [E], experts.gate_up_proj [E, 2 I, hidden] and experts.down_proj
[E, hidden, I] (split per expert at load: models/loader.split_stacked_experts), and the three norms
above. Batch invariant as MoE is: every step is a row's own (the norms, the elementwise scales, the
row-invariant GEMMs, the route) or an expert's row-invariant GEMM.
"""
import torch

from tensorfold.exact.float32 import f32
from tensorfold.models.moe import MoE, MoESpec, experts_one
from tensorfold.models.weights import WeightReader


class Gemma4MoE(MoE):
    """forward(h): the experts' output for the residual stream h [rows, hidden], normed by
    post_feedforward_layernorm_2 (the layer adds it to its dense MLP's normed output)."""

    def __init__(self, spec: MoESpec, w: WeightReader, ctx):
        self.spec, self.ops, self.eps = spec, w.ops, ctx.norm_eps
        router = w.under("router.")
        self.router = router.linear("proj.weight")  # [E, hidden]
        self.router_scale = router.dense("scale")  # [hidden], the dtype's
        self.expert_scale = router.dense("per_expert_scale").float()  # [E]: the dtype's values, as transformers
        hidden = self.router_scale.shape[0]
        self.unit = torch.ones(hidden, dtype=w.dtype, device=w.device)  # the router's norm has no weight
        self.root = f32(hidden ** -0.5)
        self.pre_norm = w.norm("pre_feedforward_layernorm_2.weight")
        self.post_norm = w.norm("post_feedforward_layernorm_2.weight")
        self.experts = self.read_experts(spec, w)
        self.bias = self.shared = self.shared_gate = None
        self.cache_spec = None
        self._fused = w.ops.fuse_moe(self) if self.fusable else None

    def read_experts(self, spec: MoESpec, w: WeightReader) -> list:
        return [experts_one(spec, w, e) for e in range(spec.num_experts)]  # experts.E. under the layer

    def router_input(self, h: torch.Tensor) -> torch.Tensor:
        """rms_norm(h) * router.scale * hidden^-0.5, rounded as transformers' Gemma4TextRouter rounds."""
        scaled = self.ops.rms_norm(h, self.unit, self.eps) * self.router_scale
        return (scaled.float() * self.root).to(h.dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.ops.rms_norm(h, self.pre_norm, self.eps)
        routed_on = self.router_input(h)
        out = self._fused(x, routed_on) if self._fused is not None else self.compose(x, routed_on)
        return self.ops.rms_norm(out, self.post_norm, self.eps)
