"""The Qwen3.5 vision tower (model.visual.): flattened patches in, one embedding per merged patch out.

    PatchEmbed   the Conv3d over one (frames x patch x patch) cube, i.e. a linear map of the
                 flattened patch, plus the learned square position table resampled to the
                 image's grid (bilinear, corners aligned; four taps summed in a fixed order)
    VisionBlock  x + proj(attn(LN(x))) with 2D rope (row angles on the first quarter of each
                 head's frequencies, column angles on the second, whole head rotated), then
                 x + fc2(gelu_tanh(fc1(LN(x))))
    PatchMerger  LN per patch, each merge block's 2x2 patches (adjacent in the patch order)
                 concatenated, fc1, GELU (erf form), fc2 -> the text model's width

Images encoded together (encode_many) share the GEMMs: their patches are rows of one batch. An
image's attention is ordinary attention over its own patches only (no mask, no cache), run on
the op set's exact attention (every row sees every key); every other step is per row (the op
set's GEMMs are batch invariant by contract, the norms reduce each row alone with an exact sum),
so an image's embeddings are a function of its pixels only, whatever is encoded beside it.

On every op set: GEMMs are its LinearWeights, rope its apply_rope and attention its
paged_attention (the Triton kernels on the cuda op set, bitwise the references); LayerNorm
(reference.layer_norm: an exact integer sum, then single float32 steps), GELU's tanh form (the
project's exp) and GELU's erf (a float64 series of our own, no libm) are the torch references,
shared by the op sets as cuda_ops shares its elementwise ones: each step one IEEE operation, so
the same bits on any device. The rope angles' cos and sin are taken on the CPU, as rope_table's
are, and moved: the device's libm never decides a bit.
"""
import math
from dataclasses import dataclass

import numpy as np
import torch

from tensorfold.kernels.paged_attention import write_kv_ref
from tensorfold.kernels.reference import gelu_tanh32, layer_norm
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.weights import WeightReader
from tensorfold.vision.image import Preprocess
from tensorfold.vision.placement import VisionInfo

PREFIX = "model.visual."
LN_EPS = 1e-6
ATTENTION_BLOCK = 32   # rows per block of the scratch K/V an image's attention reads
ERF_TERMS = 96         # Taylor terms of erf on [-4, 4]; |erf| rounds to 1 in float32 beyond
ERF_PIECE = 8192       # elements per piece of erf64's series on the CPU (4 float64 buffers: 256 kB)
MAX_ENCODE_PATCHES = 16384  # patches per encode_many call at most (a caller splits larger sets)


@dataclass(frozen=True)
class VisionSpec:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    in_channels: int = 3

    @classmethod
    def from_hf(cls, vision: dict) -> "VisionSpec":
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise CheckpointError(f"config.json: vision_config.hidden_act {act!r} is not served (gelu_pytorch_tanh)")
        rope = vision.get("rope_parameters") or {}
        return cls(int(vision.get("depth", 27)), int(vision.get("hidden_size", 1152)),
                   int(vision.get("num_heads", 16)), int(vision.get("intermediate_size", 4304)),
                   int(vision.get("patch_size", 16)), int(vision.get("temporal_patch_size", 2)),
                   int(vision.get("spatial_merge_size", 2)), int(vision.get("out_hidden_size", 3584)),
                   int(vision.get("num_position_embeddings", 2304)), float(rope.get("rope_theta", 10000.0)),
                   int(vision.get("in_channels", 3)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def erf64(x: torch.Tensor) -> torch.Tensor:
    """erf of x (any float dtype) as float64: the Maclaurin series on [-4, 4] in a fixed number of
    float64 steps (the largest term near 3e4, so the sum keeps ~12 digits), +-1 beyond. Elementwise,
    so taken in pieces of ERF_PIECE elements on the CPU (the series' 96 passes stay in cache; the
    same bits), whole on a GPU."""
    flat = x.reshape(-1)
    piece = ERF_PIECE if x.device.type == "cpu" else max(flat.numel(), 1)
    out = torch.empty(flat.shape, dtype=torch.float64, device=x.device)
    for a in range(0, flat.numel(), piece):
        out[a:a + piece] = _erf_series(flat[a:a + piece])
    return out.view(x.shape)


def _erf_series(x: torch.Tensor) -> torch.Tensor:
    x64 = x.double().clamp(-4.0, 4.0)
    z = -(x64 * x64)
    term, total, part = x64.clone(), x64.clone(), torch.empty_like(x64)
    for n in range(1, ERF_TERMS):  # in place, one buffer: fresh temporaries cost more than the sums
        term.mul_(z).div_(n)
        total.add_(torch.div(term, 2 * n + 1, out=part))
    total.mul_(2.0 / math.sqrt(math.pi))
    return torch.where(x.double().abs() >= 4.0, torch.sign(x.double()), total)


def gelu_erf32(x: torch.Tensor) -> torch.Tensor:
    """GELU's exact form x * 0.5 * (1 + erf(x / sqrt 2)) of float32 x, erf rounded once to float32."""
    e = erf64(x * np.float32(1 / math.sqrt(2))).float()
    return x * 0.5 * (1.0 + e)


class VisionBlock:
    def __init__(self, spec: VisionSpec, w: WeightReader):
        self.spec, self.ops = spec, w.ops
        self.norm1 = (w.dense("norm1.weight"), w.dense("norm1.bias"))
        self.norm2 = (w.dense("norm2.weight"), w.dense("norm2.bias"))
        self.qkv = w.linear("attn.qkv.weight", biases=("attn.qkv.bias",))
        self.proj = w.linear("attn.proj.weight", biases=("attn.proj.bias",))
        self.fc1 = w.linear("mlp.linear_fc1.weight", biases=("mlp.linear_fc1.bias",))
        self.fc2 = w.linear("mlp.linear_fc2.weight", biases=("mlp.linear_fc2.bias",))

    def gemms(self) -> dict:
        return {"qkv": self.qkv, "proj": self.proj, "fc1": self.fc1, "fc2": self.fc2}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """x [n, hidden]: the patches of one or more images, image i's rows starts[i]:starts[i + 1]."""
        s, ops = self.spec, self.ops
        n = x.shape[0]
        qkv = self.qkv(layer_norm(x, *self.norm1, LN_EPS)).view(n, 3, s.num_heads, s.head_dim)
        q, k = ops.apply_rope(qkv[:, 0].contiguous(), cos, sin), ops.apply_rope(qkv[:, 1].contiguous(), cos, sin)
        v = qkv[:, 2].contiguous()
        attn = torch.cat([_attention(ops, q[a:b], k[a:b], v[a:b]) for a, b in zip(starts, starts[1:])])
        x = x + self.proj(attn.reshape(n, -1))
        h = self.fc1(layer_norm(x, *self.norm2, LN_EPS))
        return x + self.fc2(gelu_tanh32(h.float()).to(h.dtype))


def _attention(ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Every patch attends to every patch of its image: the op set's exact paged attention over a
    scratch cache of the image's K/V, each row placed at the last position so it sees all keys."""
    n, heads, dim = q.shape
    num_blocks = -(-n // ATTENTION_BLOCK)
    k_cache = torch.zeros((num_blocks, ATTENTION_BLOCK, heads, dim), dtype=q.dtype, device=q.device)
    v_cache = torch.zeros_like(k_cache)
    write_kv_ref(k_cache, v_cache, k, v, torch.arange(n, device=q.device))
    positions = torch.full((n,), n - 1, dtype=torch.int64, device=q.device)
    table = torch.arange(num_blocks, dtype=torch.int64, device=q.device)
    return ops.paged_attention(q, k_cache, v_cache, positions, table, dim ** -0.5)  # [n, heads, dim]


class VisionTower:
    preprocess = None  # the checkpoint's vision/image.Preprocess (set at load): the image cache's misses

    def __init__(self, spec: VisionSpec, w: WeightReader):
        self.spec, self.ops, self.dtype, self.device = spec, w.ops, w.dtype, w.device
        proj = w.dense("patch_embed.proj.weight")
        self.patch_embed = w.ops.Linear.of(proj.reshape(proj.shape[0], -1).contiguous(),
                                           bias=w.dense("patch_embed.proj.bias"))
        self.pos_embed = w.dense("pos_embed.weight")  # [side * side, hidden]
        self.side = int(spec.num_position_embeddings ** 0.5)
        self.blocks = [VisionBlock(spec, w.under(f"blocks.{i}.")) for i in range(spec.depth)]
        m = w.under("merger.")
        self.merger_norm = (m.dense("norm.weight"), m.dense("norm.bias"))
        self.merger_fc1 = m.linear("linear_fc1.weight", biases=("linear_fc1.bias",))
        self.merger_fc2 = m.linear("linear_fc2.weight", biases=("linear_fc2.bias",))
        quarter = spec.head_dim // 4  # frequencies per axis
        inv = [1.0 / (spec.rope_theta ** (2 * i / (spec.head_dim // 2))) for i in range(quarter)]
        self.inv_freq = torch.tensor(inv, dtype=torch.float64).float()  # [head_dim // 4]

    def gemms(self) -> dict:
        out = {"visual.patch_embed": self.patch_embed, "visual.merger.fc1": self.merger_fc1,
               "visual.merger.fc2": self.merger_fc2}
        for i, block in enumerate(self.blocks):
            out.update({f"visual.blocks.{i}.{k}": v for k, v in block.gemms().items()})
        return out

    def encode(self, pixels: np.ndarray, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t * h * w, 3 * T * P * P] (vision/image.patches) -> its merged
        patch embeddings [t * h * w / merge^2, out_hidden]."""
        return self.encode_many([(pixels, grid)])[0]

    @torch.inference_mode()
    def encode_many(self, images: list[tuple[np.ndarray, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Several images' (patches, grid) -> each one's merged patch embeddings, the bits
        encode() gives it alone: the patches are rows of one batch, attention is per image."""
        s = self.spec
        starts, pos, cos, sin = [0], [], [], []
        for pixels, (t, h, w) in images:
            if t != 1:
                raise ValueError("one frame per image")
            rows, cols = _patch_coordinates(h, w, s.merge_size)
            pos.append(self._position_embeddings(rows, cols, h, w))
            c, si = self._rope(rows, cols)
            cos.append(c)
            sin.append(si)
            starts.append(starts[-1] + h * w)
        x = torch.from_numpy(np.concatenate([px for px, _ in images])).to(device=self.device, dtype=self.dtype)
        x = self.patch_embed(x) + torch.cat(pos)  # [n, hidden]
        cos, sin = torch.cat(cos), torch.cat(sin)  # [n, head_dim]
        for block in self.blocks:
            x = block.forward(x, cos, sin, starts)
        # merge groups are whole and in order inside each image: the rows' reshape keeps them apart
        x = layer_norm(x, *self.merger_norm, LN_EPS).reshape(-1, s.hidden_size * s.merge_size ** 2)
        y = self.merger_fc1(x)
        out = self.merger_fc2(gelu_erf32(y.float()).to(y.dtype))  # [n / merge^2, out_hidden]
        merge = s.merge_size ** 2
        return list(out.split([(b - a) // merge for a, b in zip(starts, starts[1:])]))

    def _position_embeddings(self, rows: torch.Tensor, cols: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """The learned side x side table resampled bilinearly (align_corners) to the h x w grid at
        each patch: four taps, weights in float32, summed in the order (r0c0, r0c1, r1c0, r1c1)."""
        side = self.side
        r_taps, r_weights = _axis_taps(rows, h, side)
        c_taps, c_weights = _axis_taps(cols, w, side)
        table = self.pos_embed.float()
        out = None
        for i in range(2):
            for j in range(2):
                tap = table[(r_taps[:, i] * side + c_taps[:, j]).to(self.device)]
                weight = (r_weights[:, i] * c_weights[:, j]).to(self.device)
                term = tap * weight[:, None]
                out = term if out is None else out + term
        return out.to(self.dtype)

    def _rope(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, head_dim]: per patch (row angles, column angles) twice (rotate_half's halves),
        taken on the CPU (as rope_table's: the same bits whatever the device), then moved."""
        r = torch.outer(rows.float(), self.inv_freq)
        c = torch.outer(cols.float(), self.inv_freq)
        angles = torch.cat([r, c, r, c], dim=-1)
        return angles.cos().to(self.device), angles.sin().to(self.device)


def _patch_coordinates(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) in the image's patch order: merge blocks row-major, the patches
    of a block row-major inside it."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    return rows.permute(0, 2, 1, 3).flatten(), cols.permute(0, 2, 1, 3).flatten()


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table rows an axis position reads and their weights, corners aligned: position i of
    `size` sits at i (side - 1) / (size - 1) on the table (float32, as F.interpolate)."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def build_vision_tower(ckpt, dtype: torch.dtype, ops, device) -> VisionTower:
    """The tower from the checkpoint's model.visual. tensors (original names); a CheckpointError
    where the checkpoint has none."""
    vision = ckpt.config.get("vision_config")
    if not isinstance(vision, dict) or not any(n.startswith(PREFIX) for n in ckpt.tensors):
        raise CheckpointError(f"--vision: {ckpt.path} has no vision tower (vision_config and {PREFIX} tensors)")
    return VisionTower(VisionSpec.from_hf(vision), WeightReader(ckpt.tensors, dtype, device, ops, prefix=PREFIX))


def vision_info(ckpt) -> VisionInfo:
    """The prompt-side facts of the checkpoint's image input: its special tokens and preprocessing."""
    config = ckpt.config

    def need(key):
        if config.get(key) is None:
            raise CheckpointError(f"--vision: config.json lacks {key}")
        return int(config[key])
    return VisionInfo(need("image_token_id"), need("vision_start_token_id"), need("vision_end_token_id"),
                      Preprocess.from_checkpoint(ckpt.path, config["vision_config"]))
