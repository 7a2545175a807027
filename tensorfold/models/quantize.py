"""Float matrices into GGUF blocks: what `--quantize q8_0|q4_0` does to a Hugging Face
checkpoint's weights, and a simple K-quant encoder for writing test files.

- `quantize(w, "q8_0" | "q4_0")` gives the QuantWeight of exactly the blocks llama.cpp (and the
  `gguf` package's quantizer, its bit-exact Python port) writes for these weights: the same
  float32 arithmetic, the same roundings (q8_0 rounds half away from zero, q4_0 truncates
  x (1 / d) + 8.5, d rounds to float16 nearest-even), so the result does not depend on the machine.
- `gguf_blocks(w, kind)` gives those blocks' bytes, Q5_0 and Q5_1 blocks by the `gguf` package's
  quantizer (llama.cpp's fallback types for rows that are no multiple of 256), and encodes Q4_K, Q5_K and Q6_K: valid
  blocks (per sub-block the scale and minimum of its range, rounded to the 6-bit or 8-bit grid of
  the super-block's float16 scales) that decode close to w, without llama.cpp's search for the
  best scales. Enough for test files; not a replacement for llama.cpp's quantizer.
Every encoder works on all blocks at once (torch, no loop over blocks) and is deterministic.
"""
import gguf
import torch
from gguf import GGMLQuantizationType as QType

from tensorfold.kernels.quant_gemm import QuantWeight
from tensorfold.models.gguf_quants import BLOCK_SIZE, QK, quant_weight

QTYPES = {"q8_0": QType.Q8_0, "q4_0": QType.Q4_0, "q5_0": QType.Q5_0, "q5_1": QType.Q5_1, "q4_k": QType.Q4_K,
          "q5_k": QType.Q5_K, "q6_k": QType.Q6_K}
EXACT_KINDS = ("q8_0", "q4_0")  # quantize(): llama.cpp's own blocks


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [B] -> float16 bytes [B, 2] (round to nearest even, as numpy's astype)."""
    return v.half().reshape(-1, 1).view(torch.uint8)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    a = v.abs()
    whole = a.floor()
    return torch.sign(v) * (whole + (a - whole >= 0.5).float())  # a - whole is exact


def _pack_halves(q: torch.Tensor) -> torch.Tensor:
    """[B, 32] values 0..15 -> [B, 16]: byte j holds weight j (low nibble) and j + 16 (high)."""
    return q[:, :16] | (q[:, 16:] << 4)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=1) / 127
    q = _round_half_away(x * _inverse(d).unsqueeze(1)).to(torch.int8)
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=1)


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    extreme = x.gather(1, x.abs().argmax(dim=1, keepdim=True)).squeeze(1)  # first largest |x|, signed
    d = extreme / -8
    q = torch.trunc(x * _inverse(d).unsqueeze(1) + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _pack_halves(q)], dim=1)


def _on_grid(value: torch.Tensor, unit: torch.Tensor, low: int, high: int, up: bool = False) -> torch.Tensor:
    """value / unit rounded (up: to the next integer, so that a scale never shrinks; else to
    nearest), clamped to [low, high]; 0 where unit is 0."""
    ratio = value / torch.where(unit == 0, torch.ones_like(unit), unit)
    return torch.where(unit == 0, torch.zeros_like(ratio), ratio.ceil() if up else ratio.round()).clamp(low, high)


def _k_with_min(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Q4_K (bits 4) / Q5_K (bits 5): per sub-block of 32 the range [lo, hi] (lo <= 0), so
    w = d sc_j q - dmin m_j with d sc_j >= (hi - lo) / (2^bits - 1) and dmin m_j >= -lo, each the
    next step up on the 6-bit grid of d or dmin."""
    top = 2 ** bits - 1
    xs = x.reshape(-1, 8, 32)
    lo, hi = xs.amin(dim=-1).clamp(max=0), xs.amax(dim=-1)
    scale = (hi - lo) / top
    d, dmin = (scale.amax(dim=1) / 63).half(), (-lo).amax(dim=1).div(63).half()
    sc = _on_grid(scale, d.float().unsqueeze(1), 0, 63, up=True)
    m = _on_grid(-lo, dmin.float().unsqueeze(1), 0, 63, up=True)
    step = (d.float().unsqueeze(1) * sc).unsqueeze(-1)
    offset = (dmin.float().unsqueeze(1) * m).unsqueeze(-1)
    q = _on_grid(xs + offset, step, 0, top).to(torch.uint8)          # [B, 8, 32]
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    scales = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], dim=1)
    low4 = q & 0x0F
    packed = (low4[:, 0::2] | (low4[:, 1::2] << 4)).reshape(-1, QK // 2)  # chunk c: sub-blocks 2c, 2c + 1
    head = [_f16_bytes(d.float()), _f16_bytes(dmin.float()), scales]
    if bits == 5:
        fifth = ((q >> 4) & 1) << torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
        head.append(fifth.sum(dim=1, dtype=torch.uint8))               # qh byte i: bit j of sub-block j
    return torch.cat([*head, packed], dim=1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    """Per sub-block of 16 a step of at least max|x| / 31 (the next one up on the int8 grid of d):
    q - 32 in [-31, 31]."""
    xs = x.reshape(-1, 16, 16)
    scale = xs.abs().amax(dim=-1) / 31
    d = (scale.amax(dim=1) / 127).half()
    sc = _on_grid(scale, d.float().unsqueeze(1), -128, 127, up=True)
    step = (d.float().unsqueeze(1) * sc).unsqueeze(-1)
    q = (_on_grid(xs, step, -32, 31) + 32).to(torch.uint8).reshape(-1, 2, 2, 64)  # weight 128 h + 64 s + i
    ql = (q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)               # [B, 2, 64]
    top2 = (q.reshape(-1, 2, 4, 32) >> 4) << (2 * torch.arange(4, dtype=torch.uint8)).reshape(1, 1, 4, 1)
    qh = top2.sum(dim=2, dtype=torch.uint8)                             # [B, 2, 32]: weight 128 h + 32 t + i
    return torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.to(torch.int8).view(torch.uint8),
                      _f16_bytes(d.float())], dim=1)


def _by_gguf(qtype: QType):
    return lambda x: torch.from_numpy(gguf.quants.quantize(x.numpy(), qtype))


_ENCODERS = {"q8_0": (BLOCK_SIZE, _q8_0), "q4_0": (BLOCK_SIZE, _q4_0), "q5_0": (BLOCK_SIZE, _by_gguf(QType.Q5_0)),
             "q5_1": (BLOCK_SIZE, _by_gguf(QType.Q5_1)), "q4_k": (QK, lambda x: _k_with_min(x, 4)),
             "q5_k": (QK, lambda x: _k_with_min(x, 5)), "q6_k": (QK, _q6_k)}


def gguf_blocks(w: torch.Tensor, kind: str) -> torch.Tensor:
    """w [N, K] float -> its GGUF blocks, uint8 [N, K / block * block bytes] (rows of blocks)."""
    if kind not in _ENCODERS:
        raise ValueError(f"cannot encode {kind!r} blocks (supported: {', '.join(_ENCODERS)})")
    block, encode = _ENCODERS[kind]
    if w.dim() != 2 or w.shape[1] % block:
        raise ValueError(f"{kind}: weights {tuple(w.shape)} are not [N, K] with K a multiple of {block}")
    return encode(w.float().reshape(-1, block)).reshape(w.shape[0], -1)


def quantize(w: torch.Tensor, kind: str) -> QuantWeight:
    """w [N, K] float -> the QuantWeight of llama.cpp's q8_0 or q4_0 blocks for it."""
    if kind not in EXACT_KINDS:
        raise ValueError(f"cannot quantize to {kind!r} (supported: {', '.join(EXACT_KINDS)})")
    return quant_weight(gguf_blocks(w, kind).reshape(-1), QTYPES[kind], tuple(w.shape))
