"""The multi-token-prediction layer on MLX arrays (models/mtp.py's layer, the same names and the
same steps), and its runner for the engine's MTP drafter (backends/mtp_rows.py's asks).

    x = fc([norm_e(embed(t[j+1])), norm_h(h[j])])     # [rows, 2 * hidden] -> [rows, hidden]
    x = its decoder layers at position j (the model's own MLX layer kinds), over their own caches
    h' = norm(x);  logits = lm_head(h')                # the model's embedding and head, shared

Its layers are built by the model's layer() (a family's kinds: gated attention with the
model's feed-forward for qwen3_5), and run by MLXModel.run_layers, the model's own loop; their
caches follow the model's in MLXBackend.allocate's list, behind the first block table. Every op
is the mlx op set's, so a row's bits do not depend on what else shares the pass, and where the
main model's logits are the torch backends' (quantized GEMMs: bitwise), the MTP layer's are too.
"""
import mlx.core as mx
import numpy as np

from tensorfold.backends.mtp_rows import MTPRows, last_rows
from tensorfold.mlx import ops
from tensorfold.mlx.model import MLXBatch, mlx_batch
from tensorfold.models.mtp import MTPLayerWeights, MTPSpec
from tensorfold.models.weights import WeightReader


class MLXMultiTokenPredictor(MTPLayerWeights):
    def __init__(self, spec: MTPSpec, w: WeightReader, model):
        """w: a reader over the model's tensors (names under spec.names.prefix are read); model:
        the MLXModel whose layer kinds, embedding and head it uses."""
        super().__init__(spec, w, model.layer, ops.from_torch)
        self.mx_dtype = model.mx_dtype
        self.model = model  # its embed, lm_head, begin() and run_layers()

    def forward(self, hidden: mx.array, batch: MLXBatch, caches: list) -> tuple[mx.array | None, mx.array]:
        """hidden [rows, hidden]: h[j] per row; batch.input_ids: t[j + 1]; batch.positions: j;
        caches: each of its layers' cache. Returns (logits [len(batch.logits_rows), vocab]
        float32, None where no row draws; h' [rows, hidden]: what a chained step reads as h)."""
        model, eps, dtype = self.model, self.eps, self.mx_dtype
        model.begin(batch)
        embedded = ops.rms_norm(model.embed(batch.input_ids).astype(dtype), self.norm_embedding, eps)
        hidden = ops.rms_norm(hidden.astype(dtype), self.norm_hidden, eps)
        residual = self.fc(mx.concatenate([embedded, hidden], axis=-1))  # [rows, hidden]
        residual = model.run_layers(self.layers, residual, batch, caches, [0] * len(self.layers))
        out = ops.rms_norm(residual, self.norm, eps)  # [rows, hidden]
        logits = model.lm_head(out[batch.logits_rows]).astype(mx.float32) if batch.logits_rows.size else None
        return logits, residual if self.names.chain_before_norm else out


class MLXMTPRunner(MTPRows):
    """backends/mtp_rows.MTPRows on MLX arrays: each pass's logits, output rows and cache writes
    evaluated together (no graph left behind); the greedy draft numpy's argmax (the first
    maximum: ties to the lower id)."""

    def __init__(self, model, caches: list, block_size: int):
        """caches: the MTP layer's part of the backend's cache list (after the model's layers')."""
        super().__init__(model.mtp, caches, block_size)

    def _forward(self, hidden: mx.array, pieces, drawing: list[int]):
        ends = last_rows(pieces)
        batch = mlx_batch([(start, tokens, blocks, ()) for start, tokens, blocks in pieces],
                          [ends[i] for i in drawing], self.block_size)
        logits, out = self.mtp.forward(hidden, batch, self.caches)
        mx.eval(*([] if logits is None else [logits]), out, *(a for c in self.caches if c is not None for a in c.arrays))
        return ([] if logits is None else np.argmax(np.array(logits), axis=-1).tolist()), out

    def _cat(self, rows: list[mx.array]) -> mx.array:
        return mx.concatenate(rows)

    def _stack(self, rows: list[mx.array]) -> mx.array:
        return mx.stack(rows)

    def _copy(self, rows: mx.array) -> mx.array:
        copied = mx.contiguous(rows)  # a part of a larger buffer copied out of it, which goes
        mx.eval(copied)
        return copied
