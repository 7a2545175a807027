"""One entry point for every checkpoint format: a HF directory, a .gguf file, or the default model."""
import functools
import logging
import os

import torch

from tensorfold.models.checkpoint import Checkpoint, CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.progress import LoadProgress
from tensorfold.models.decoder import Model
from tensorfold.models.mtp import has_mtp
from tensorfold.models.registry import model_family
from tensorfold.models.vision_tower import build_vision_tower, vision_info
from tensorfold.models.weights import WeightReader


def load_checkpoint(path: str | None = None, keep_quantized: bool = False) -> Checkpoint:
    """keep_quantized: a GGUF's block-quantized matrices stay QuantWeights (else dequantized)."""
    from tensorfold.models import gguf_file
    from tensorfold.models.hf_dir import load_hf_dir

    if path is None:
        path = gguf_file.default_model_path()
    if os.path.isdir(path):
        return load_hf_dir(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if path.endswith(".gguf"):
        return gguf_file.load_gguf(path, keep_quantized=keep_quantized)
    raise CheckpointError(f"{path}: expected a Hugging Face directory or a .gguf file")


# The GEMM matrices (and the tied head): what llama.cpp's quantizer puts in blocks. The hybrids'
# linear-attention input projections too (in_proj_qkv, _z, _b, _a; Qwen3-Next's in_proj_qkvz, _ba);
# not the routers (mlp.gate, shared_expert_gate) nor conv1d, which llama.cpp keeps float.
QUANTIZABLE = ("_proj.weight", "lm_head.weight", "embed_tokens.weight", "in_proj_qkv.weight", "in_proj_z.weight",
               "in_proj_b.weight", "in_proj_a.weight", "in_proj_qkvz.weight", "in_proj_ba.weight",
               ".embeddings.weight")  # the last: Nemotron-H's embedding table
STACKED_EXPERTS = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",),
                   "experts.up_proj": ("up_proj",)}  # the last: Nemotron-H's non-gated experts


def quantize_checkpoint(ckpt: Checkpoint, kind: str) -> None:
    """--quantize: every dense GEMM matrix of `ckpt` to `kind` blocks, in place (deterministic:
    gguf's quantizer, byte for byte). A checkpoint already in blocks is refused."""
    from tensorfold.kernels.quant_gemm import QuantWeight
    from tensorfold.models.gguf_quants import FileBlocks
    from tensorfold.models.quantize import quantize

    if any(isinstance(t, (QuantWeight, FileBlocks)) for t in ckpt.tensors.values()):
        raise CheckpointError(f"{ckpt.path}: --quantize is for dense checkpoints; this one is already in blocks "
                              "(served as stored)")
    split_stacked_experts(ckpt.tensors)
    if ckpt.config.get("kv_lora_rank"):  # latent attention: kv_b in blocks as llama.cpp's attn_k_b / attn_v_b
        from tensorfold.models.latent_attention import split_kv_b
        split_kv_b(ckpt.tensors, ckpt.config)
    for name, tensor in list(ckpt.tensors.items()):
        if name.endswith(QUANTIZABLE) and tensor.dim() == 2:
            if tensor.shape[1] % 32:
                raise CheckpointError(f"{ckpt.path}: --quantize {kind}: {name} has {tensor.shape[1]} columns, "
                                      "not a multiple of 32")
            ckpt.tensors[name] = quantize(tensor, kind)


def split_stacked_experts(tensors: dict) -> None:
    """Stacked expert tensors (Qwen3.5-MoE's experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]; Nemotron-H's experts.up_proj [E, I, H]) as one matrix per expert and projection (experts.E.gate_proj.weight, ...), in
    place: the one layout the MoE block reads, and whose matrices are quantized one by one, as a
    GGUF's expert rows are. Views, no copies."""
    for name in [n for n in tensors if n.endswith(tuple(STACKED_EXPERTS))]:
        prefix, stacked_name = name.rsplit("experts.", 1)
        projs = STACKED_EXPERTS["experts." + stacked_name]
        for e, expert in enumerate(tensors.pop(name)):
            for proj, part in zip(projs, expert.chunk(len(projs))):
                tensors[f"{prefix}experts.{e}.{proj}.weight"] = part


def build_model(ckpt: Checkpoint, dtype: torch.dtype, ops, device: torch.device | str = "cpu",
                group=None, mtp: bool = False, vision: bool = False) -> Model:
    """The checkpoint's family's layers over `ops`, the backend's op set (backends.backend_ops);
    group: a tensor-parallel rank's (parallel/group.RankGroup), which reads only its shard; mtp: also
    the multi-token-prediction layer, where the family and the checkpoint have one (one rank only)."""
    args = ModelArgs.from_hf(ckpt.config, os.path.join(ckpt.path, "config.json"))
    family = model_family(ckpt.architecture, ckpt.path)
    served, mtp_spec = mtp_tensors(served_tensors(ckpt.tensors, family), family, args, mtp, group is not None)
    tensors = LoadProgress(served)
    reader, blocks = WeightReader, family.blocks
    if group is not None:
        from tensorfold.parallel.shard import ShardReader, sharded_blocks
        reader, blocks = functools.partial(ShardReader, group=group), sharded_blocks(blocks, group, args)
    model = (family.model or Model)(args, family.layer_specs(args), tensors, dtype, ops, device, blocks,
                                    family.norm_offset, reader)
    if mtp_spec is not None:
        model.add_mtp(mtp_spec, tensors, family.blocks, family.norm_offset)
    if vision:  # the tower reads the checkpoint's own names (the text model's served set skips them)
        model.vision = build_vision_tower(ckpt, dtype, ops, device)
        model.vision.preprocess = vision_info(ckpt).preprocess  # the image cache preprocesses on a miss
    tensors.finish()
    return model


def mtp_tensors(served: dict, family, args: ModelArgs, mtp: bool, sharded: bool = False):
    """(the served tensors, the MTP layer's spec where it is to be built, else None): the layer
    is built where `mtp` asks for it (drafting may use it), the model runs on one rank (not
    `sharded`), the family has one, the config declares it and the checkpoint holds its weights;
    its tensors are left out otherwise (said in the log). Either backend's load calls it."""
    spec = family.mtp_layer(args) if family.mtp_layer is not None else None
    if spec is None:
        return served, None
    with_mtp = mtp and not sharded and has_mtp(spec, served)
    served = _mtp_tensors(served, spec, with_mtp, "loaded" if with_mtp else "not asked for" if not mtp else
                          "tensor parallel" if sharded else
                          "the config declares none" if not spec.declared else "none in the checkpoint")
    return served, spec if with_mtp else None


def _mtp_tensors(served: dict, spec, keep: bool, why: str) -> dict:
    """The served tensors without the MTP layer's (unless `keep`), and without the copies of the
    model's own it stores (MTPNames.ignored); said in the log."""
    names = spec.names
    ignored = {names.prefix + n for n in names.ignored}
    dropped = {n for n in served if n.startswith(names.prefix) and (not keep or n in ignored)}
    log = logging.getLogger("tensorfold.models")
    if not keep and dropped:
        log.info("skipped %d tensors under %s (%s: %s)", len(dropped), names.prefix, names.label, why)
    elif dropped:
        log.info("%s: the model's own embedding and head serve it (%s not read)", names.label, ", ".join(sorted(dropped)))
    return {n: t for n, t in served.items() if n not in dropped}


def served_tensors(tensors: dict, family) -> dict:
    """The checkpoint's tensors under the names the decoder reads (family.tensor_name, stacked
    experts split); those the family does not serve (a vision tower, MTP heads) are left out,
    said once in the log."""
    served, skipped = {}, {}
    for name, tensor in tensors.items():
        new = family.tensor_name(name)
        if new is None:
            prefix = name.split(".")[0] if not name.startswith("model.") else ".".join(name.split(".")[:2])
            skipped[prefix] = skipped.get(prefix, 0) + 1
        else:
            served[new] = tensor
    split_stacked_experts(served)
    for prefix, count in skipped.items():
        logging.getLogger("tensorfold.models").info("skipped %d tensors under %s. (not served yet)", count, prefix)
    return served
