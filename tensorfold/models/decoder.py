"""The decoder every family is built into: embedding, a stack of DecoderLayers, norm, LM head.

A family file gives the layer specs (its `layer_specs(args)`) and, where it has layer kinds of
its own, the block classes they name; this file composes them. Weights arrive as a dict of
Hugging Face parameter names; every op comes from `ops` (the backend's batch-invariant set) and
every matrix is the op set's LinearWeight, so the same model runs the cpu reference, the
native kernels and the cuda kernels. A backend that runs a whole layer natively offers
`ops.fuse(layer)`; where it returns None the layer runs its Python composition.
"""
import torch

from tensorfold.backends.linear_weight import count_formats, named_gemms
from tensorfold.models.blocks import BLOCKS, DecoderLayer
from tensorfold.models.cache import ModelCache
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.forward_batch import ForwardBatch
from tensorfold.models.mtp import MTPSpec, MultiTokenPredictor
from tensorfold.models.rope import RopeTables
from tensorfold.models.spec import LayerSpec
from tensorfold.models.weights import WeightReader


class Model:
    """forward(batch, cache) -> logits [num_logits, vocab] (fp32) for batch.logits_rows. A family
    with model-level parts of its own subclasses it (Family.model), `layer` its layer class."""
    layer = DecoderLayer
    mtp = None  # the multi-token-prediction layer (models/mtp.py), where one is loaded
    vision = None  # the vision tower (models/vision_tower.py), where --vision loaded one

    def __init__(self, args: ModelArgs, specs: list[LayerSpec], tensors: dict, dtype: torch.dtype, ops,
                 device: torch.device | str = "cpu", blocks: dict = BLOCKS, norm_offset: float = 0.0,
                 reader=WeightReader):
        """reader: the WeightReader class (a tensor-parallel rank's ShardReader reads its shard)."""
        self.args, self.specs, self.dtype, self.ops = args, list(specs), dtype, ops
        self.device = device = torch.device(device)
        w = reader(tensors, dtype, device, ops, norm_offset=norm_offset)
        embed = w.matrix("model.embed_tokens.weight")
        if tuple(embed.shape) != (args.vocab_size, args.hidden_size):
            raise CheckpointError(f"model.embed_tokens.weight has shape {tuple(embed.shape)}, "
                                  f"config says ({args.vocab_size}, {args.hidden_size})")
        self.rope_tables = RopeTables(device)
        self.layers = [self.layer(spec, w.under(f"model.layers.{i}."), self.rope_tables, blocks)
                       for i, spec in enumerate(self.specs)]
        self.norm = w.norm("model.norm.weight")
        self.embed, self.lm_head = _embedding_and_head(w, embed, args)
        self._run = [ops.fuse(layer) or layer.forward for layer in self.layers]

    def add_mtp(self, spec: MTPSpec, tensors: dict, blocks: dict, norm_offset: float) -> None:
        """Build the checkpoint's MTP layer (models/mtp.py, under its family's names) on this
        model's embedding, head and rope tables; its layers' caches follow the model's."""
        w = WeightReader(tensors, self.dtype, self.device, self.ops, norm_offset=norm_offset)
        self.mtp = MultiTokenPredictor(spec, w, self.rope_tables, blocks, self.embed, self.lm_head)

    def cache_specs(self) -> list:
        """Each layer's cache kind (models/cache.py), in layer order; the MTP layer's last."""
        return [layer.cache_spec for layer in self.layers] + (self.mtp.cache_specs if self.mtp else [])

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                       v_exponents: bool = False) -> ModelCache:
        return ModelCache(self.cache_specs(), num_blocks, block_size, dtype or self.dtype, self.device, v_exponents)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: ModelCache, hidden: bool = False):
        """hidden: also return every row's final hidden state (after the final norm, what the MTP
        layer reads) as (logits, hidden [num_rows, hidden])."""
        ops, eps = self.ops, self.specs[0].norm_eps
        residual = self.embed(batch.input_ids).to(self.dtype)  # [num_rows, hidden]
        if batch.image_rows is not None:  # image pads take their image's embeddings
            rows, embeddings = batch.image_rows
            residual[rows] = embeddings.to(self.dtype)
        x = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        for i, run in enumerate(self._run):
            next_norm = self.layers[i + 1].input_norm if i < last else None
            x, residual = run(x, residual, next_norm, cache.batch(i, batch), cache.layer(i))
        if hidden:  # the norm is per row: the logits rows' bits are those of the branch below
            out = ops.rms_norm(residual, self.norm, self.specs[-1].norm_eps)  # [num_rows, hidden]
            return self.lm_head(out[batch.logits_rows]).float(), out
        out = ops.rms_norm(residual[batch.logits_rows], self.norm, self.specs[-1].norm_eps)
        return self.lm_head(out).float()  # [num_logits, vocab]

    def gemms(self) -> dict:
        """Every LinearWeight by name (layers.{i}.qkv, ..., lm_head; mtp.* where loaded)."""
        return {**named_gemms(self.layers, self.lm_head), **(self.mtp.gemms() if self.mtp else {})}

    def weight_formats(self) -> dict[str, int]:
        """How many GEMM matrices use each weight format (float32, bfloat16, q4_1, ...); a weight
        of parts in several formats counts each part."""
        return count_formats(self.gemms().values())


def _embedding_and_head(w: WeightReader, embed, args: ModelArgs):
    """The embedding lookup and the LM head. A quantized table is kept once, as a LinearWeight
    whose rows() are the lookup, and a tied head is the same object; a dense table is looked up
    as a tensor, and a tied head packs its own copy where the op set packs."""
    linear = w.ops.Linear
    table = linear.of(embed) if linear.quantized(embed) else None
    lookup = table.rows if table is not None else embed.__getitem__
    if w.has("lm_head.weight"):
        head = w.vocab_head(w.matrix("lm_head.weight"))
    elif args.tie_word_embeddings:
        head = w.vocab_head(embed, table)
    else:
        raise CheckpointError("lm_head.weight is missing and the config does not tie embeddings")
    return lookup, head
