"""The multi-token-prediction layer some checkpoints ship beside their decoder: a small model of
its own on the same seams, which the MTP drafter runs to propose the tokens after the next one.

Given the target model's final hidden state at position j (after its final norm, as the model
returns it) and the embedding of the token at j + 1, it predicts the token at j + 2:

    x = fc([norm_e(embed(t[j+1])), norm_h(h[j])])     # [rows, 2 * hidden] -> [rows, hidden]
    x = its decoder layers at position j, over their own caches
    h' = norm(x);  logits = lm_head(h')                # the target's embedding and head, shared

Each family stores it under names of its own (MTPNames), read by this one class:

    qwen3_5      mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, layers.0.*, norm}
                 (Qwen3.5/3.6: one gated-attention decoder layer)
    glm_moe_dsa  model.layers.{L}.{enorm, hnorm, eh_proj, <a decoder layer>, shared_head.norm},
                 L = num_hidden_layers (GLM-5 / DeepSeek-V3's next-n layer: latent attention
                 with its DSA indexer and MoE; shared_head.head and embed_tokens are copies of
                 the model's head and embedding, not read)
    nemotron_h   mtp.layers.{0..k-1}.* single-block layers in the config's MTP pattern (Nemotron
                 3: attention, then MoE), enorm / hnorm / eh_proj on the first, final_layernorm
                 on the last

h' stands in for the target's h[j + 1] when it drafts further (the drafter's chained steps); a
family whose layer was trained chaining the state before its final norm (DeepSeek's form, which
GLM-5's serving follows) chains that instead (MTPNames.chain_before_norm). Each of its layers
keeps its own cache (a per-position kind: paged K/V, the latent cache; a feed-forward-only
layer none), allocated as further layers of the model's cache under the same block ids: slot j
holds the row of (h[j], t[j+1]). The layers run on the model's op set, so their rows are batch
invariant like the target's and the drafts a pure function of the tokens; drafts never change a
reply either way (the engine keeps only drafts equal to the keyed draws).
"""
from dataclasses import dataclass

import torch

from tensorfold.models.blocks import DecoderLayer
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.forward_batch import ForwardBatch
from tensorfold.models.rope import RopeTables
from tensorfold.models.spec import LayerSpec
from tensorfold.models.weights import WeightReader

PREFIX = "mtp."  # Qwen3.5's and Nemotron-H's (the decoder's names: models/qwen3_5.tensor_name, nemotron_h's)


@dataclass(frozen=True)
class MTPNames:
    """Where a family keeps its MTP weights: every name below is under `prefix`. `layers`: each
    decoder layer's own prefix; `ignored`: tensors stored there that are copies of the model's
    own (its embedding, its head), left unread."""
    prefix: str
    norm_embedding: str
    norm_hidden: str
    fc: str
    layers: tuple[str, ...]
    norm: str
    label: str = "multi-token-prediction layers"  # how the log names them
    ignored: tuple[str, ...] = ()
    chain_before_norm: bool = False


@dataclass(frozen=True)
class MTPSpec:
    """A family's MTP layer for a config: its names, and its layers' specs (empty where the
    config declares none: `declared` 0)."""
    names: MTPNames
    layers: tuple[LayerSpec, ...]
    declared: int  # the config's count (mtp_num_hidden_layers, num_nextn_predict_layers)


def has_mtp(spec: MTPSpec | None, tensors) -> bool:
    """Whether the config declares an MTP layer and the checkpoint holds weights under its prefix."""
    return (spec is not None and spec.declared > 0
            and any(n.startswith(spec.names.prefix) for n in tensors))


class MTPLayerWeights:
    """What every backend's MTP layer reads and checks: the norms, fc and decoder layers under the
    family's names (make_layer(spec, reader) builds a layer of the backend's kinds; as_array turns
    a norm's tensor into the backend's array), one declared layer, none recurrent."""

    def __init__(self, spec: MTPSpec, w: WeightReader, make_layer, as_array=lambda t: t):
        names = spec.names
        if spec.declared != 1:
            raise CheckpointError(f"{names.prefix}: {spec.declared} {names.label} declared; one is served")
        w = w.under(names.prefix)
        self.spec, self.names = spec, names
        self.eps = spec.layers[0].norm_eps
        self.norm_embedding = as_array(w.norm(names.norm_embedding))
        self.norm_hidden = as_array(w.norm(names.norm_hidden))
        self.fc = w.linear(names.fc)  # [hidden, 2 * hidden]: the embedding half first
        self.layers = [make_layer(s, w.under(p)) for s, p in zip(spec.layers, names.layers)]
        for layer, prefix in zip(self.layers, names.layers):
            if getattr(layer.cache_spec, "recurrent", False):
                raise CheckpointError(f"{w.prefix}{prefix}: a recurrent layer in the MTP layer is not served "
                                      "(its drafted rows would have to be rewound)")
        self.norm = as_array(w.norm(names.norm))

    @property
    def cache_specs(self) -> list:
        """Each of its layers' cache kind (None: keeps nothing), after the model's layers'."""
        return [layer.cache_spec for layer in self.layers]

    def gemms(self) -> dict:
        named = {"mtp.fc": self.fc}
        for i, layer in enumerate(self.layers):
            named.update({f"mtp.layers.{i}.{k}": v for k, v in layer.gemms().items()})
        return named


class MultiTokenPredictor(MTPLayerWeights):
    def __init__(self, spec: MTPSpec, w: WeightReader, rope_tables: RopeTables, blocks: dict, embed, lm_head):
        """w: the model's reader (names under spec.names.prefix are read)."""
        super().__init__(spec, w, lambda layer_spec, lw: DecoderLayer(layer_spec, lw, rope_tables, blocks))
        self.ops, self.dtype = w.ops, w.dtype
        self.embed, self.lm_head = embed, lm_head
        self._run = [self.ops.fuse(layer) or layer.forward for layer in self.layers]

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, caches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [rows, hidden]: h[j] per row; batch.input_ids: t[j + 1]; batch.positions: j;
        caches: each layer's part of the cache. Returns (logits [len(batch.logits_rows), vocab]
        fp32, h' [rows, hidden]: what a chained step reads as h)."""
        ops, eps = self.ops, self.eps
        embedded = ops.rms_norm(self.embed(batch.input_ids).to(self.dtype), self.norm_embedding, eps)
        hidden = ops.rms_norm(hidden.to(self.dtype), self.norm_hidden, eps)
        residual = self.fc(torch.cat([embedded, hidden], dim=-1))  # [rows, hidden]
        x = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        for i, (run, cache) in enumerate(zip(self._run, caches)):
            next_norm = self.layers[i + 1].input_norm if i < last else None
            x, residual = run(x, residual, next_norm, batch, cache)
        out = ops.rms_norm(residual, self.norm, eps)  # [rows, hidden]
        logits = self.lm_head(out[batch.logits_rows]).float() if batch.logits_rows.numel() else out.new_zeros(0)
        return logits, residual if self.names.chain_before_norm else out
