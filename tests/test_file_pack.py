"""Packing straight from a GGUF's block bytes (_cpu.pack_quant_file, native_ops.Linear.pack of
FileBlocks) against the reference's route, pack_quant(quant_weight(bytes)): the packed byte
tensors must be equal, for every kept type, odd shapes, stacked parts at odd offsets, scales
whose bytes are not the packer's canonical factoring (gcd > 1, d <= 0, -0, subnormals, zero
sub-block scales) and 1 vs 2 threads."""
import zlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import quants

from tensorfold.kernels.quant_gemm import cat
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.gguf_quants import QK, FileBlocks, FileStack, quant_weight

_cpu = pytest.importorskip("tensorfold._cpu")
native_ops = pytest.importorskip("tensorfold.backends.native_ops")

BLOCK_BYTES = {QType.Q8_0: 34, QType.Q4_0: 18, QType.Q4_1: 20, QType.Q4_K: 144, QType.Q5_K: 176, QType.Q6_K: 210}
LEGACY = (QType.Q8_0, QType.Q4_0, QType.Q4_1)
K_QUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
# float16 bit patterns the scales take besides random ones: +-0, subnormals, the largest finite
SPECIAL_F16 = np.array([0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00], dtype=np.uint16)


def _f16_bits(rng, count: int) -> np.ndarray:
    """Finite float16 bits: mostly ordinary magnitudes, some special."""
    bits = (rng.integers(0x1000, 0x3000, count) | (rng.integers(0, 2, count) << 15)).astype(np.uint16)
    special = rng.random(count) < 0.15
    bits[special] = rng.choice(SPECIAL_F16, int(special.sum()))
    return bits


def _k_scale_bytes(rng, count: int) -> np.ndarray:
    """[count, 12] packed 6-bit (sc, m): random, all zero, or all multiples of 2 / 3 / 7."""
    sc, m = rng.integers(0, 64, (count, 8)), rng.integers(0, 64, (count, 8))
    for values in (sc, m):
        kind = rng.integers(0, 6, count)
        values[kind == 1] = 0
        for mult, k in ((2, 2), (3, 3), (7, 4)):
            values[kind == k] = values[kind == k] // mult * mult
    out = np.zeros((count, 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def random_blocks(qtype: QType, n: int, k: int, rng) -> np.ndarray:
    """[n, row bytes] uint8 GGUF blocks: gguf's own quantizer for the 32-weight types (then some
    scales replaced), random bytes with chosen scales for the K-quants."""
    if qtype in LEGACY:
        raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype).reshape(-1, BLOCK_BYTES[qtype])
        raw = raw.copy()
        some = rng.random(len(raw)) < 0.2
        raw[some, 0:2] = _f16_bits(rng, int(some.sum())).view(np.uint8).reshape(-1, 2)
        if qtype == QType.Q4_1:
            raw[some, 2:4] = _f16_bits(rng, int(some.sum())).view(np.uint8).reshape(-1, 2)
        return raw.reshape(n, -1)
    count = n * k // QK
    raw = rng.integers(0, 256, (count, BLOCK_BYTES[qtype]), dtype=np.uint8)
    if qtype == QType.Q6_K:
        sc = rng.integers(-128, 128, (count, 16))
        kind = rng.integers(0, 5, count)
        sc[kind == 1] = 0
        sc[kind == 2] = sc[kind == 2] // 4 * 4
        sc[kind == 3, 0] = -128
        raw[:, 192:208] = sc.astype(np.int8).view(np.uint8)
        raw[:, 208:210] = _f16_bits(rng, count).view(np.uint8).reshape(-1, 2)
    else:
        raw[:, 0:4] = _f16_bits(rng, 2 * count).view(np.uint8).reshape(-1, 4)
        raw[:, 4:16] = _k_scale_bytes(rng, count)
    return raw.reshape(n, -1)


def _file(tmp_path, chunks: list[np.ndarray], lead: int = 7) -> tuple[str, list[int]]:
    """The chunks' bytes written after `lead` bytes of padding; their offsets."""
    path = tmp_path / "blocks.bin"
    offsets, data = [], bytearray(b"\xAB" * lead)
    for chunk in chunks:
        offsets.append(len(data))
        data += chunk.tobytes()
        data += b"\xCD" * 3
    path.write_bytes(bytes(data))
    return str(path), offsets


def _reference_weight(chunks: list[np.ndarray], qtype: QType, k: int):
    return cat([quant_weight(torch.from_numpy(c.reshape(-1).copy()), qtype, (c.shape[0], k)) for c in chunks])


def _reference(chunks: list[np.ndarray], qtype: QType, k: int) -> torch.Tensor:
    w = _reference_weight(chunks, qtype, k)
    return _cpu.pack_quant(w.kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)


def _from_file(path: str, offsets: list[int], chunks: list[np.ndarray], qtype: QType, k: int,
               order: torch.Tensor | None = None) -> torch.Tensor:
    """The chunks stacked, packed from the file (their rows in `order` where given)."""
    rows = torch.cat([off + torch.arange(c.shape[0]) * (c.nbytes // c.shape[0]) for off, c in zip(offsets, chunks)])
    rows = rows if order is None else rows[order]
    kind = {QType.Q8_0: "q8_0", QType.Q4_0: "q4_0", QType.Q4_1: "q4_1", QType.Q4_K: "q4_k", QType.Q5_K: "q5_k",
            QType.Q6_K: "q6_k"}[qtype]
    out = torch.full((_cpu.quant_file_bytes(kind, len(rows), k),), 0x5A, dtype=torch.uint8)  # every byte written
    _cpu.pack_quant_file(out, kind, path, rows, k)
    return out


CASES = [(QType.Q8_0, 96), (QType.Q4_0, 32), (QType.Q4_0, 160), (QType.Q4_1, 288), (QType.Q8_0, 512),
         (QType.Q4_K, 256), (QType.Q4_K, 768), (QType.Q5_K, 512), (QType.Q6_K, 256), (QType.Q6_K, 512)]


@pytest.mark.parametrize("qtype,k", CASES, ids=[f"{q.name}-{k}" for q, k in CASES])
@pytest.mark.parametrize("heights", [(1,), (37,), (16, 5, 27)], ids=["one-row", "37", "stacked"])
def test_file_pack_equals_reference(tmp_path, qtype, k, heights):
    rng = np.random.default_rng(zlib.crc32(f"{qtype.name} {k} {heights}".encode()))
    chunks = [random_blocks(qtype, n, k, rng) for n in heights]
    path, offsets = _file(tmp_path, chunks)
    expected = _reference(chunks, qtype, k)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(_from_file(path, offsets, chunks, qtype, k), expected), f"{t} thread(s)"
    finally:
        torch.set_num_threads(threads)
    order = torch.from_numpy(rng.permutation(sum(heights)))  # rows in any order (Q and K's rope order)
    w = _reference_weight(chunks, qtype, k).rows(order)
    assert torch.equal(_from_file(path, offsets, chunks, qtype, k, order),
                       _cpu.pack_quant(w.kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp))


def test_canonical_factoring_differs_from_file_bytes(tmp_path):
    """The cases above reach the factoring path: a q4_k super-block whose sub-block scales share a
    factor packs with pack_quant's d and sc, not the file's (products equal, bytes not)."""
    rng = np.random.default_rng(3)
    raw = random_blocks(QType.Q4_K, 16, 256, rng)
    raw[:, 0:2] = np.array([0x3C00], dtype=np.uint16).view(np.uint8)  # d = 1.0, dm = 1024
    scales = np.zeros((16, 12), dtype=np.uint8)
    scales[:, 0:4] = 3  # sc_0..3 = 3, the rest 0: gcd 3, so dm 1536 sc 2 would also do
    raw[:, 4:16] = scales
    path, offsets = _file(tmp_path, [raw])
    got = _from_file(path, offsets, [raw], QType.Q4_K, 256)
    assert torch.equal(got, _reference([raw], QType.Q4_K, 256))
    head = got[64:64 + 2 * 16].view(torch.int16)  # group 0's d bits, 16 columns
    assert int(head[0]) & 0xFFFF != 0x3C00


def test_linear_packs_file_blocks(tmp_path):
    """native_ops.Linear from FileBlocks (one, stacked, and with a step that forces the fallback)
    gives the bytes and the GEMM of Linear from the loaded QuantWeights."""
    rng = np.random.default_rng(5)
    chunks = [random_blocks(QType.Q4_K, n, 512, rng) for n in (48, 16)]
    path, offsets = _file(tmp_path, chunks)
    blocks = [FileBlocks(path, off, c.nbytes, QType.Q4_K, (c.shape[0], 512), f"t{i}")
              for i, (off, c) in enumerate(zip(offsets, chunks))]
    from_file = native_ops.Linear.of(*blocks)
    assert isinstance(from_file.parts[0], native_ops.Packed)
    loaded = native_ops.Linear.of(*(b.load() for b in blocks))
    assert torch.equal(from_file.parts[0].data, loaded.parts[0].data)
    x = torch.randn(3, 512)
    assert torch.equal(from_file(x), loaded(x))
    flipped = blocks[0].rows(torch.arange(47, -1, -1))  # a row order: read row by row from the file
    assert flipped.row_ids is not None and not flipped.steps
    assert torch.equal(native_ops.Linear.of(flipped, blocks[1]).parts[0].data,
                       native_ops.Linear.of(blocks[0].load().rows(torch.arange(47, -1, -1)), blocks[1].load())
                       .parts[0].data)
    stepped = blocks[0].then(lambda w: w.rows(slice(0, 40)), (40, 512))  # a step: packed through load()
    assert torch.equal(native_ops.Linear.of(stepped).parts[0].data,
                       native_ops.Linear.of(blocks[0].load().rows(slice(0, 40))).parts[0].data)
    assert FileStack(blocks).shape == (64, 512)


def test_types_kept_in_other_forms_fall_back(tmp_path):
    """Q5_0 is kept in q8_0's form (gguf_quants): its bytes are not q8_0's, so it packs through load()."""
    data = quants.quantize(np.random.default_rng(9).standard_normal((20, 64)).astype(np.float32), QType.Q5_0)
    path, offsets = _file(tmp_path, [data.reshape(20, -1)])
    blocks = FileBlocks(path, offsets[0], data.nbytes, QType.Q5_0, (20, 64), "q5_0")
    assert torch.equal(native_ops.Linear.of(blocks).parts[0].data, native_ops.Linear.of(blocks.load()).parts[0].data)


def test_bad_bytes_name_the_tensor(tmp_path):
    rng = np.random.default_rng(7)
    raw = random_blocks(QType.Q6_K, 16, 256, rng)
    raw[3, 208:210] = np.array([0x7C00], dtype=np.uint16).view(np.uint8)  # d = inf
    path, offsets = _file(tmp_path, [raw])
    bad = FileBlocks(path, offsets[0], raw.nbytes, QType.Q6_K, (16, 256), "blk.0.attn_v.weight")
    with pytest.raises(CheckpointError, match="blk.0.attn_v.weight.*infinite or NaN"):
        native_ops.Linear.of(bad)
    short = FileBlocks(path, offsets[0] + 210, raw.nbytes, QType.Q6_K, (16, 256), "blk.1.ffn_down.weight")
    short.offset = len(open(path, "rb").read()) - 2 * 210  # only two rows' worth left
    with pytest.raises(CheckpointError, match="blk.1.ffn_down.weight.*cut short"):
        native_ops.Linear.of(short)


def test_q5_1_is_not_packed_from_the_file():
    """Q5_1 (its own kind, q5_1: the per-32 arithmetic) goes the reference's route, pack_quant of
    its QuantWeight in the wide form; pack_quant_file does not read its blocks, and says so."""
    from tensorfold.models.gguf_quants import FILE_PACKED

    assert QType.Q5_1 not in FILE_PACKED
    with pytest.raises(RuntimeError, match="not packed from the file"):
        _cpu.pack_quant_file(torch.empty(0, dtype=torch.uint8), "q5_1", "/nonexistent", torch.zeros(1, dtype=torch.int64), 32)
    rng = np.random.default_rng(5)
    raw = quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), QType.Q5_1)
    w = quant_weight(torch.from_numpy(raw).reshape(-1), QType.Q5_1, (8, 64))
    assert w.kind == "q5_1"
    packed = _cpu.pack_quant(w.kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    from tensorfold.kernels import quant_gemm
    assert torch.equal(_cpu.quant_linear(x, packed, 8, 64), quant_gemm.linear(x, w))
