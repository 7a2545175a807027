"""GGUF tensor data: dequantized to float32 torch tensors, or kept in its blocks as a QuantWeight.

One function per block type unpacks the bytes of all blocks at once (no Python loop over blocks)
into GGUF's own values: the codes q and the float16 scales (and the K-quants' sub-block scales
and minimums). From those, `dequantize` computes the float32 weights in the `gguf` package's
order of operations, so the results equal its reference dequantizer bit for bit
(tests/models/test_gguf.py and test_gguf_blocks.py check this), and `quant_weight` builds the
exact integer form of kernels/quant_gemm.py (its dequantize() gives the same floats, up to the
sign of a zero: the integer scales have no -0).

Block layouts (bytes, little-endian; QK = 256 weights per K-quant super-block):
    Q8_0  [d:f16][q:int8 x 32]                         x = q * d
    Q4_0  [d:f16][q:u4 x 32 in 16]                     x = (q - 8) * d
    Q4_1  [d:f16][m:f16][q:u4 x 32 in 16]              x = q * d + m
    Q5_0  [d:f16][qh:u32][q:u4 x 32 in 16]             x = (q - 16) * d
    Q5_1  [d:f16][m:f16][qh:u32][q:u4 x 32 in 16]      x = q * d + m
    Q4_K  [d:f16][dmin:f16][scales:12][q:u4 x 256 in 128]
    Q5_K  [d:f16][dmin:f16][scales:12][qh:32][q:u4 x 256 in 128]
                                                       x = d sc_j q - dmin m_j, j = the 32-weight sub-block
    Q6_K  [ql:128][qh:64][sc:int8 x 16][d:f16]         x = d sc_j (q - 32), j = the 16-weight sub-block
Packing, within a block:
- Q8_0..Q5_1: a packed byte j holds weight j in its low nibble and weight j + 16 in its high one;
  Q5_0/Q5_1's fifth bit of weight i is bit i of qh (llama.cpp's fallbacks for Q4_K and Q5_K where
  a row is not a multiple of 256 weights, as Gemma 4 26B's expert down projections of 704).
- Q4_K/Q5_K: q byte 32 c + i holds weight i of sub-block 2c (low nibble) and of 2c + 1 (high);
  Q5_K's fifth bit of weight i of sub-block j is bit j of qh byte i. The 12 scale bytes hold eight
  6-bit (sc_j, m_j): bytes 0-3 and 4-7 the low 6 bits of sc_0..3 and m_0..3, their top 2 bits the
  bits 4-5 of sc_4..7 and m_4..7, whose low 4 bits are the nibbles of bytes 8-11 (sc low, m high).
- Q6_K: the super-block is two halves of 128; weight h 128 + 64 s + i (i < 64) has its low
  4 bits in nibble s of ql byte 64 h + i, and weight h 128 + 32 t + i (i < 32) its top 2 bits in
  bits 2t..2t+1 of qh byte 32 h + i.
"""
import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from tensorfold.kernels.quant_gemm import QuantWeight, cat, from_legacy, significand
from tensorfold.models.checkpoint import CheckpointError

BLOCK_SIZE = 32
QK = 256  # weights per K-quant super-block


def _blocks(raw: torch.Tensor, type_size: int) -> torch.Tensor:
    return raw.reshape(-1, type_size)  # [num_blocks, type_size]


def _f16(column_bytes: torch.Tensor) -> torch.Tensor:
    return column_bytes.contiguous().view(torch.float16)  # [num_blocks, 1]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[B, n] bytes -> [B, 2n]: all low nibbles, then all high nibbles."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


# --- one unpacker per block type: GGUF's values, q unsigned as stored (int8 for Q8_0) ----------

def _q8_0(raw):
    blocks = _blocks(raw, 2 + BLOCK_SIZE)
    return blocks[:, 2:].contiguous().view(torch.int8), _f16(blocks[:, :2])


def _q4_0(raw):
    blocks = _blocks(raw, 2 + BLOCK_SIZE // 2)
    return _nibbles(blocks[:, 2:]), _f16(blocks[:, :2])


def _q4_1(raw):
    blocks = _blocks(raw, 4 + BLOCK_SIZE // 2)
    return _nibbles(blocks[:, 4:]), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])


def _q5(raw, with_min: bool):
    """Q5_0 (with_min False) / Q5_1: the 5-bit q (0..31) [B, 32] and the float16 scales."""
    head = 4 if with_min else 2
    blocks = _blocks(raw, head + 4 + BLOCK_SIZE // 2)
    qh = blocks[:, head:head + 4].reshape(-1, 4, 1) >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8)
    q = _nibbles(blocks[:, head + 4:]) | ((qh & 1) << 4).reshape(-1, BLOCK_SIZE)
    return (q, _f16(blocks[:, :2]), _f16(blocks[:, 2:4])) if with_min else (q, _f16(blocks[:, :2]))


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes [B, 12] -> (sc, m) [B, 8], 6-bit each."""
    low_sc, low_m, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([low_sc & 0x3F, (rest & 0x0F) | ((low_sc >> 2) & 0x30)], dim=1)
    m = torch.cat([low_m & 0x3F, (rest >> 4) | ((low_m >> 2) & 0x30)], dim=1)
    return sc, m


def _k_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[B, 128] -> [B, 256]: per 32-byte chunk c, sub-block 2c (low nibbles) then 2c + 1 (high)."""
    chunks = packed.reshape(-1, 4, 1, 32)
    return ((chunks >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, QK)


def _q4_k(raw):
    blocks = _blocks(raw, 4 + 12 + QK // 2)
    sc, m = _k_scales(blocks[:, 4:16])
    return _k_nibbles(blocks[:, 16:]), _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), sc, m


def _q5_k(raw):
    blocks = _blocks(raw, 4 + 12 + QK // 8 + QK // 2)
    sc, m = _k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    q = _k_nibbles(blocks[:, 48:]) | ((qh & 1) << 4).reshape(-1, QK)
    return q, _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), sc, m


def _q6_k(raw):
    blocks = _blocks(raw, QK // 2 + QK // 4 + QK // 16 + 2)
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    q = (ql & 0x0F).reshape(-1, QK) | ((qh & 0x03) << 4).reshape(-1, QK)
    return q, _f16(blocks[:, 208:210]), blocks[:, 192:208].contiguous().view(torch.int8)


# --- float32 weights, in gguf's order of operations ---------------------------------------------

def _deq_with_min(q, d, dmin, sc, m):
    """Q4_K/Q5_K: (d sc_j) q - (dmin m_j); both products are exact in float32."""
    scale = (d.float() * sc.float()).unsqueeze(-1)  # [B, 8, 1]
    low = (dmin.float() * m.float()).unsqueeze(-1)
    return (scale * q.float().reshape(-1, 8, 32) - low).reshape(-1, QK)


def _deq_q6_k(q, d, sc):
    scale = (d.float() * sc.float()).unsqueeze(-1)  # [B, 16, 1]
    return (scale * (q.to(torch.int8) - 32).float().reshape(-1, 16, 16)).reshape(-1, QK)


DEQUANTIZERS = {
    QType.F32: lambda raw: raw.view(torch.float32),
    QType.F16: lambda raw: raw.view(torch.float16).to(torch.float32),
    QType.BF16: lambda raw: raw.view(torch.bfloat16).to(torch.float32),  # exact: bf16 is f32's top half
    QType.Q8_0: lambda raw: (lambda q, d: q.float() * d.float())(*_q8_0(raw)),
    QType.Q4_0: lambda raw: (lambda q, d: (q.to(torch.int8) - 8).float() * d.float())(*_q4_0(raw)),
    QType.Q4_1: lambda raw: (lambda q, d, m: q.float() * d.float() + m.float())(*_q4_1(raw)),
    QType.Q5_0: lambda raw: (lambda q, d: (q.to(torch.int8) - 16).float() * d.float())(*_q5(raw, False)),
    QType.Q5_1: lambda raw: (lambda q, d, m: q.float() * d.float() + m.float())(*_q5(raw, True)),
    QType.Q4_K: lambda raw: _deq_with_min(*_q4_k(raw)),
    QType.Q5_K: lambda raw: _deq_with_min(*_q5_k(raw)),
    QType.Q6_K: lambda raw: _deq_q6_k(*_q6_k(raw)),
}


def dequantize(raw: torch.Tensor, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw` is the tensor's bytes (1-D uint8); returns float32 of `shape` (row-major, HF order).

    Raises KeyError for a type not in DEQUANTIZERS; the caller names the file and tensor.
    """
    return DEQUANTIZERS[qtype](raw).reshape(shape)


# --- kept in blocks ------------------------------------------------------------------------------

# quant_gemm's kinds. Q5_0 has none of its own: its weights are exactly q8_0's with codes q - 16
# (-16..15), so it is served as q8_0, the GEMM's reference unchanged, and packs at a byte per code
# (34 bytes per 32 weights, against the file's 22), the price of the fallback type's few tensors.
# Q5_1 is its own kind: a 5-bit code with S 2^E = d and M 2^F = m per block of 32.
KIND_NAMES = {QType.Q8_0: "q8_0", QType.Q4_0: "q4_0", QType.Q4_1: "q4_1", QType.Q5_0: "q8_0", QType.Q5_1: "q5_1",
              QType.Q4_K: "q4_k", QType.Q5_K: "q5_k", QType.Q6_K: "q6_k"}
KEPT_TYPES = frozenset(KIND_NAMES)
_UNPACK = {QType.Q8_0: _q8_0, QType.Q4_0: _q4_0, QType.Q4_1: _q4_1,
           QType.Q5_0: functools.partial(_q5, with_min=False), QType.Q5_1: functools.partial(_q5, with_min=True),
           QType.Q4_K: _q4_k, QType.Q5_K: _q5_k, QType.Q6_K: _q6_k}


def quant_weight(raw: torch.Tensor, qtype: QType, shape: tuple[int, int]) -> QuantWeight:
    """A 2-D tensor's bytes (1-D uint8, rows of blocks) as quant_gemm's QuantWeight [N, K].

    K-quants: per 32 weights S = dm sc_j and E = de from d = dm 2^de, and M = -(dminm m_j),
    F = dmine from dmin; Q6_K: S = dm sc_j per 16 weights, E = de per 32.
    """
    if qtype not in KEPT_TYPES:
        raise ValueError(f"{getattr(qtype, 'name', qtype)} tensors are not kept in blocks")
    n, k = shape
    kind = KIND_NAMES[qtype]
    fields = _UNPACK[qtype](raw)
    per_block = (lambda t: t.reshape(n, k // BLOCK_SIZE))
    if qtype == QType.Q5_0:
        q, d = fields
        return from_legacy("q8_0", (q.to(torch.int8) - 16).reshape(n, k), per_block(d))
    if qtype == QType.Q5_1:
        q, d, m = fields
        (dm, de), (mm, me) = significand(per_block(d)), significand(per_block(m))
        return QuantWeight(kind, q.to(torch.int8).reshape(n, k), dm, de, mm, me)
    if kind in ("q8_0", "q4_0", "q4_1"):
        q, *scales = fields
        return from_legacy(kind, q.reshape(n, k), *(s.reshape(n, k // BLOCK_SIZE) for s in scales))
    per_32 = (lambda t: t.expand(-1, QK // BLOCK_SIZE).reshape(n, k // BLOCK_SIZE))  # [B, 1] -> [N, K / 32]
    dm, de = significand(fields[1])
    if kind == "q6_k":
        q, _, sc = fields
        return QuantWeight(kind, (q.to(torch.int8) - 32).reshape(n, k),
                           (dm * sc.to(torch.int32)).reshape(n, k // 16), per_32(de))
    q, _, dmin, sc, m = fields
    mm, me = significand(dmin)
    return QuantWeight(kind, q.to(torch.int8).reshape(n, k), (dm * sc.to(torch.int32)).reshape(n, k // BLOCK_SIZE),
                       per_32(de), (-(mm * m.to(torch.int32))).reshape(n, k // BLOCK_SIZE), per_32(me))


class FileBlocks:
    """A matrix in blocks, left in its file until load(): a checkpoint of these holds no weight
    bytes, so a model built from it unpacks, packs and drops one matrix at a time, and the load
    never holds the model twice (the file's bytes are read, not mapped, so its pages do not stay
    resident either). The readers' rearrangements wait for the load too: `rows(range)` narrows
    the bytes read (an expert's rows of a stacked tensor), another row order before any step is
    kept as `row_ids` (the stored rows picked: Q and K's rope order, which packing from the
    file's bytes reads row by row), and `then(step)` (a column permutation) and row orders after
    one are applied to the loaded blocks in order."""

    def __init__(self, path: str, offset: int, nbytes: int, qtype: QType, shape: tuple[int, int], name: str,
                 steps: tuple = (), stored: tuple[int, int] | None = None, row_ids: torch.Tensor | None = None):
        """nbytes at offset hold the `stored` [rows, K] blocks (default: `shape`); `shape` is
        the matrix's after row_ids (int64, rows of `stored`) and then the steps."""
        if qtype not in KEPT_TYPES:
            raise ValueError(f"{getattr(qtype, 'name', qtype)} tensors are not kept in blocks")
        self.path, self.offset, self.nbytes, self.qtype, self.name = path, offset, nbytes, qtype, name
        self.shape, self.steps, self.stored, self.row_ids = tuple(shape), steps, tuple(stored or shape), row_ids
        self.kind = KIND_NAMES[qtype]

    def rows(self, ids: torch.Tensor | slice) -> "FileBlocks":
        """Rows `ids` (indices, or a slice of consecutive rows: read alone from the file)."""
        if isinstance(ids, slice) and not self.steps and self.row_ids is None and ids.step in (None, 1):
            start, stop, _ = ids.indices(self.shape[0])
            row_bytes = self.nbytes // self.shape[0]
            return FileBlocks(self.path, self.offset + start * row_bytes, (stop - start) * row_bytes, self.qtype,
                              (stop - start, self.shape[1]), self.name)
        if not self.steps:
            picked = torch.arange(self.shape[0])[ids] if isinstance(ids, slice) else torch.as_tensor(ids).long()
            if self.row_ids is not None:
                picked = self.row_ids[picked]
            return FileBlocks(self.path, self.offset, self.nbytes, self.qtype, (len(picked), self.shape[1]),
                              self.name, (), self.stored, picked)
        count = len(range(*ids.indices(self.shape[0]))) if isinstance(ids, slice) else len(ids)
        return self.then(lambda w: w.rows(ids), (count, self.shape[1]))

    def then(self, step, shape: tuple[int, int]) -> "FileBlocks":
        """These blocks with step(QuantWeight) -> QuantWeight of `shape` applied after the load."""
        return FileBlocks(self.path, self.offset, self.nbytes, self.qtype, shape, self.name, (*self.steps, step),
                          self.stored, self.row_ids)

    def load(self) -> QuantWeight:
        """The blocks as a QuantWeight, read from the file now; a bad block (an infinite scale)
        is a CheckpointError naming the file and the tensor."""
        raw = torch.from_numpy(np.fromfile(self.path, dtype=np.uint8, count=self.nbytes, offset=self.offset))
        if raw.numel() != self.nbytes:
            raise CheckpointError(f"{self.path}: tensor {self.name} is cut short ({raw.numel()} of {self.nbytes} bytes)")
        try:
            weight = quant_weight(raw, self.qtype, self.stored)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: tensor {self.name} ({self.qtype.name}): {e}") from e
        if self.row_ids is not None:
            weight = weight.rows(self.row_ids)
        for step in self.steps:
            weight = step(weight)
        return weight

    def dequantize(self) -> torch.Tensor:
        return self.load().dequantize()


class FileStack:
    """FileBlocks of one type stacked along N (a fused Q/K/V or gate/up), still in the file: what
    an op set that packs from the file's bytes (native_ops) takes whole; load() for the others."""

    def __init__(self, parts: list):
        flat = [q for p in parts for q in (p.parts if isinstance(p, FileStack) else (p,))]
        if len({p.kind for p in flat}) != 1 or len({p.shape[1] for p in flat}) != 1:
            raise ValueError("stacked blocks must share their type and width")
        self.parts = tuple(flat)
        self.kind, self.qtype, self.name = flat[0].kind, flat[0].qtype, "+".join(p.name for p in flat)
        self.shape = (sum(p.shape[0] for p in flat), flat[0].shape[1])

    def load(self) -> QuantWeight:
        return cat([p.load() for p in self.parts])

    def dequantize(self) -> torch.Tensor:
        return self.load().dequantize()


class StoredColumns:
    """A matrix kept with its columns in the file's order where the model's differs: the model's
    matrix is stored[:, model_columns], and a GEMM by it runs on `stored` as it is, with the
    input's columns put in the file's order first (x[:, inputs], inputs = the inverse
    permutation). A qwen35 GGUF's ssm_out is one: llama.cpp keeps its value heads tiled. Moving
    quantized columns instead would split blocks and super-blocks, whose activations are grouped
    by the stored order (kernels/quant_gemm.py)."""

    def __init__(self, stored, model_columns: torch.Tensor):
        self.stored = stored
        self.inputs = torch.argsort(model_columns)  # stored column j is the model's column inputs[j]
        self.shape = tuple(stored.shape)

    def map(self, fn) -> "StoredColumns":
        """The same order around fn(stored) (a load, a move to a device)."""
        out = StoredColumns.__new__(StoredColumns)
        out.stored, out.inputs = fn(self.stored), self.inputs
        out.shape = tuple(out.stored.shape)
        return out

    def dequantize(self) -> torch.Tensor:
        """The model's matrix, dense."""
        dense = self.stored.dequantize() if hasattr(self.stored, "dequantize") else self.stored
        return dense[:, torch.argsort(self.inputs)]


# the types whose bytes _cpu.pack_quant_file reads (Q5_0 / Q5_1, kept in other kinds' forms, are not)
FILE_PACKED = frozenset({QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q5_K, QType.Q6_K})


def file_rows(blocks) -> tuple[str, torch.Tensor] | None:
    """(path, the file offset of each row, int64 [N]) of FileBlocks or a FileStack, what
    _cpu.pack_quant_file reads; None where a part rearranges its blocks after reading (steps), the
    parts lie in different files or are of a type it does not read."""
    parts = blocks.parts if isinstance(blocks, FileStack) else (blocks,)
    if any(p.steps for p in parts) or len({p.path for p in parts}) != 1 or len({p.qtype for p in parts}) != 1 \
            or parts[0].qtype not in FILE_PACKED:
        return None
    offsets = []
    for p in parts:
        rows = torch.arange(p.stored[0]) if p.row_ids is None else p.row_ids
        offsets.append(p.offset + rows * (p.nbytes // p.stored[0]))
    return parts[0].path, torch.cat(offsets).to(torch.int64)
