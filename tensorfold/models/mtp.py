"""The multi-token-prediction layer some checkpoints ship beside their decoder (Qwen3.5/3.6's
`mtp.*`): a small model of its own on the same seams, which the MTP drafter runs to propose the
tokens after the next one.

Given the target model's final hidden state at position j (after its final norm, as the model
returns it) and the embedding of the token at j + 1, it predicts the token at j + 2:

    x = fc([norm_e(embed(t[j+1])), norm_h(h[j])])     # [rows, 2 * hidden] -> [rows, hidden]
    x = decoder layer (gated attention + MLP or MoE) at position j, over its own paged K/V
    h' = norm(x);  logits = lm_head(h')                # the target's embedding and head, shared

h' stands in for the target's h[j + 1] when it drafts further (the drafter's chained steps).
Its one attention layer keeps its own paged K/V (cache kind PagedKV, allocated as one more
layer of the model's cache, under the same block ids): slot j holds the row of (h[j], t[j+1]).
The layer runs on the model's op set, so its rows are batch invariant like the target's and
its drafts a pure function of the tokens; drafts never change a reply either way (the engine
keeps only drafts equal to the keyed draws).
"""
import torch

from tensorfold.models.blocks import DecoderLayer
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.forward_batch import ForwardBatch
from tensorfold.models.rope import RopeTables
from tensorfold.models.spec import LayerSpec
from tensorfold.models.weights import WeightReader

PREFIX = "mtp."


def has_mtp(tensors: dict, hf: dict) -> bool:
    """Whether the checkpoint holds MTP weights its config declares."""
    return int(hf.get("mtp_num_hidden_layers") or 0) > 0 and any(n.startswith(PREFIX) for n in tensors)


class MultiTokenPredictor:
    def __init__(self, spec: LayerSpec, w: WeightReader, rope_tables: RopeTables, blocks: dict, embed, lm_head,
                 num_layers: int = 1):
        if num_layers != 1:
            raise CheckpointError(f"mtp_num_hidden_layers is {num_layers}; one MTP layer is served")
        self.spec, self.ops, self.dtype, self.eps = spec, w.ops, w.dtype, spec.norm_eps
        self.norm_embedding = w.norm("pre_fc_norm_embedding.weight")
        self.norm_hidden = w.norm("pre_fc_norm_hidden.weight")
        self.fc = w.linear("fc.weight")  # [hidden, 2 * hidden]: the embedding half first
        self.layer = DecoderLayer(spec, w.under("layers.0."), rope_tables, blocks)
        self.norm = w.norm("norm.weight")
        self.embed, self.lm_head = embed, lm_head
        self._run = self.ops.fuse(self.layer) or self.layer.forward

    @property
    def cache_spec(self):
        return self.layer.cache_spec

    def gemms(self) -> dict:
        return {"mtp.fc": self.fc, **{f"mtp.layers.0.{k}": v for k, v in self.layer.gemms().items()}}

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [rows, hidden]: h[j] per row; batch.input_ids: t[j + 1]; batch.positions: j.
        Returns (logits [len(batch.logits_rows), vocab] fp32, h' [rows, hidden])."""
        ops, eps = self.ops, self.eps
        embedded = ops.rms_norm(self.embed(batch.input_ids).to(self.dtype), self.norm_embedding, eps)
        hidden = ops.rms_norm(hidden.to(self.dtype), self.norm_hidden, eps)
        residual = self.fc(torch.cat([embedded, hidden], dim=-1))  # [rows, hidden]
        x = ops.rms_norm(residual, self.layer.input_norm, eps)
        _, residual = self._run(x, residual, None, batch, kv)
        out = ops.rms_norm(residual, self.norm, eps)  # [rows, hidden]
        logits = self.lm_head(out[batch.logits_rows]).float() if batch.logits_rows.numel() else out.new_zeros(0)
        return logits, out
