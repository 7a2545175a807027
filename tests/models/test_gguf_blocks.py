"""GGUF blocks kept as blocks (gguf_quants.quant_weight, load_gguf(keep_quantized=True)), the
K-quant dequantizers, and the encoders of models/quantize.py, against oracles:
- the `gguf` package: its dequantizer (bitwise) and its q8_0/q4_0 quantizer (byte for byte);
- a Python-integer oracle of quant_gemm.linear computed from the K-quants' own values (d, dmin,
  sc, m, q), parsed from the bytes here, independent of gguf_quants and QuantWeight;
- the dense load of the same file, and transformers' GGUF loader on a Q4_K_M-style tiny file.

QuantWeight's integer scales carry no sign of zero, so where a block's scale d (or d sc_j) is
-0.0, e.g. gguf's own q4_0 d of an all-zero block, dequantize() gives +0.0 where gguf gives -0.0:
`same_bits` compares bit patterns with that one exception (test_signed_zero_is_the_only_gap).
"""
import functools
import math
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tensorfold.kernels import quant_gemm as qg
from tensorfold.kernels.quant_gemm import QuantWeight
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs, rope_inv_freq
from tensorfold.models.gguf_file import default_model_path, load_gguf
from tensorfold.models.gguf_quants import KEPT_TYPES, KIND_NAMES, FileBlocks, dequantize, quant_weight
from tensorfold.models.quantize import QTYPES, gguf_blocks, quantize
from test_quant_gemm import frexp16, shift_round  # the legacy types' oracle's integer helpers

BLOCK_TYPES = [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q4_K, QType.Q5_K, QType.Q6_K]
K_TYPES = [QType.Q4_K, QType.Q5_K, QType.Q6_K]
F16_AT = {QType.Q8_0: [0], QType.Q4_0: [0], QType.Q4_1: [0, 2], QType.Q5_0: [0], QType.Q5_1: [0, 2], QType.Q4_K: [0, 2], QType.Q5_K: [0, 2],
          QType.Q6_K: [208]}  # byte offsets of a block's float16 scales


def random_bytes(rng: np.random.Generator, qtype: QType, n: int, k: int) -> np.ndarray:
    """Random blocks [N, K / block * bytes] with finite float16 scales over many binades, signs,
    a zero and a subnormal among them; every other byte uniform."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in F16_AT[qtype]:
        h = (rng.standard_normal(len(blocks)) * 2.0 ** rng.integers(-22, 4, len(blocks))).astype(np.float16)
        h[0], h[-1] = 0.0, 2.0 ** -20
        blocks[:, at:at + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw


def as_torch(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))


def same_bits(ours: np.ndarray, theirs: np.ndarray) -> bool:
    """Bitwise equal float32 arrays, a zero of either sign matching a zero of either sign."""
    def bits(a):
        return np.where(a == 0, 0, np.ascontiguousarray(a, dtype=np.float32).view(np.uint32))
    return ours.dtype == theirs.dtype == np.float32 and np.array_equal(bits(ours), bits(theirs))


# --- dequantizers and kept blocks against gguf --------------------------------------------------

@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_dequantizers_match_gguf_bitwise(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_bytes(rng, qtype, 7, 512)
    expected = gguf.quants.dequantize(raw, qtype).reshape(7, 512)
    ours = dequantize(as_torch(raw), qtype, (7, 512)).numpy()
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32))  # signed zeros too


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_quant_weight_dequantizes_like_gguf(qtype):
    assert qtype in KEPT_TYPES
    rng = np.random.default_rng(10 + int(qtype))
    n, k = 5, 768
    raw = random_bytes(rng, qtype, n, k)
    w = quant_weight(as_torch(raw), qtype, (n, k))
    kind = qg.KINDS[w.kind]
    assert w.kind == KIND_NAMES[qtype] and w.shape == (n, k) and w.codes.dtype == torch.int8
    assert w.scale.shape == (n, k // kind.sub) and w.scale_exp.shape == (n, k // 32)
    assert all(t.dtype == torch.int32 for t in (w.scale, w.scale_exp))
    assert (w.min is not None) == kind.has_min == (w.min_exp is not None)
    if kind.has_min:
        assert w.min.shape == w.min_exp.shape == (n, k // 32) and w.min.dtype == w.min_exp.dtype == torch.int32
    assert same_bits(w.dequantize().numpy(), gguf.quants.dequantize(raw, qtype).reshape(n, k))


def test_signed_zero_is_the_only_gap():
    """A Q6_K sub-block with d = -0.5 and sc = 0: gguf's weights are (-0.0) (q - 32), signed
    zeros; QuantWeight's integer scale S = 0 has no sign. Equal as numbers, not as bits."""
    raw = random_bytes(np.random.default_rng(0), QType.Q6_K, 1, 256)
    raw[0, 208:210] = np.array([-0.5], np.float16).view(np.uint8)
    raw[0, 192] = 0
    expected = gguf.quants.dequantize(raw, QType.Q6_K).reshape(1, 256)
    ours = quant_weight(as_torch(raw), QType.Q6_K, (1, 256)).dequantize().numpy()
    assert np.array_equal(ours, expected) and same_bits(ours, expected)
    assert not np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


# --- encoders -----------------------------------------------------------------------------------

def awkward_weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 100.0, (n, 1))).astype(np.float32)
    w[1] = 0.0                                                        # all-zero blocks
    w[2] = rng.integers(-16, 17, k) / 8.0                             # halves: round-half ties
    w[3, :32] = np.tile([1.0, -1.0], 16)                              # |max| tie, sign first seen wins
    w[4] *= np.float32(2.0 ** -28)                                    # subnormal float16 scales
    w[5] *= np.float32(2.0 ** 13)                                     # scales past float16: inf
    return w


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantize_gives_ggufs_bytes(kind):
    w = awkward_weights(np.random.default_rng(3), 9, 256)
    with np.errstate(over="ignore"):
        expected = gguf.quants.quantize(w, QTYPES[kind])
    ours = gguf_blocks(torch.from_numpy(w), kind)
    assert ours.dtype == torch.uint8
    np.testing.assert_array_equal(ours.numpy(), expected)
    bf16 = torch.from_numpy(w).bfloat16()  # as a Hugging Face checkpoint would hold them
    if kind == "q4_0":  # row 5's scales (amax / -8) overflow float16: inf, which a QuantWeight refuses
        with pytest.raises(ValueError, match="infinite or NaN"):
            quantize(bf16, kind)
        bf16 = bf16[[i for i in range(bf16.shape[0]) if i != 5]]
    with np.errstate(over="ignore"):
        blocks = gguf.quants.quantize(bf16.float().numpy(), QTYPES[kind])
    got, want = quantize(bf16, kind), quant_weight(as_torch(blocks), QTYPES[kind], tuple(bf16.shape))
    for field in ("codes", "scale", "scale_exp", "min", "min_exp"):
        assert (getattr(got, field) is None and getattr(want, field) is None) or torch.equal(
            getattr(got, field), getattr(want, field)), field
    assert got.kind == want.kind == kind


@pytest.mark.parametrize("kind,step", [("q4_k", 15), ("q5_k", 31), ("q6_k", 31)])
def test_k_encoders_give_valid_blocks_close_to_the_weights(kind, step):
    w = awkward_weights(np.random.default_rng(4), 7, 512)[[0, 1, 2, 3, 5]]  # float16 scales, not subnormal
    w[0, :256] += 3.0                                                 # a range that excludes 0
    blocks = gguf_blocks(torch.from_numpy(w), kind)
    decoded = gguf.quants.dequantize(blocks.numpy(), QTYPES[kind]).reshape(w.shape)
    assert np.all(np.isfinite(decoded))
    assert np.array_equal(decoded[1], w[1])                           # zeros stay exact
    # half a step of the sub-block's own grid, plus the 6/8-bit rounding of its scale (and
    # minimum) up to the super-block's: at most a step of the super-block's largest sub-block
    sub = 16 if kind == "q6_k" else 32
    width = np.abs(w).reshape(5, -1, sub).max(-1) * (1 if kind == "q6_k" else 2)   # >= the range
    own = width.repeat(sub, axis=1) / step / 2
    widest = width.reshape(5, -1, 256 // sub).max(-1).repeat(256, axis=1) / step
    assert np.all(np.abs(decoded - w) <= own + widest * 1.01)
    kept = quant_weight(blocks.reshape(-1), QTYPES[kind], w.shape).dequantize().numpy()
    assert same_bits(kept, decoded)


def test_encoder_and_quantize_errors():
    w = torch.randn(4, 256)
    for call, bad in ((quantize, "q4_k"), (quantize, "q4_1"), (gguf_blocks, "iq2_xs"), (gguf_blocks, "q4_1")):
        with pytest.raises(ValueError, match=repr(bad)):
            call(w, bad)
    with pytest.raises(ValueError, match="q8_0.*multiple of 32"):
        quantize(torch.randn(4, 48), "q8_0")
    with pytest.raises(ValueError, match="q6_k.*multiple of 256"):
        gguf_blocks(torch.randn(4, 224), "q6_k")
    with pytest.raises(ValueError, match="q4_0"):
        quantize(torch.randn(256), "q4_0")


# --- quant_gemm.linear on K-quants against Python integers --------------------------------------

def f16(lo: int, hi: int) -> float:
    return float(np.array([lo | hi << 8], np.uint16).view(np.float16)[0])


def k_values(qtype: QType, b: list[int]):
    """One super-block's bytes -> (q [256] unsigned, d, dmin, sc [8 or 16], m [8]), bit by bit
    from the layout (gguf_quants' docstring); Q6_K has no dmin and m (None)."""
    q = [0] * 256
    if qtype == QType.Q6_K:
        ql, qh = b[0:128], b[128:192]
        for h in range(2):
            for i in range(64):
                q[128 * h + i] = ql[64 * h + i] & 15
                q[128 * h + 64 + i] = ql[64 * h + i] >> 4
            for t in range(4):
                for i in range(32):
                    q[128 * h + 32 * t + i] |= ((qh[32 * h + i] >> (2 * t)) & 3) << 4
        sc = [v - 256 if v > 127 else v for v in b[192:208]]
        return q, f16(b[208], b[209]), None, sc, None
    s = b[4:16]
    sc = [s[j] & 63 for j in range(4)] + [(s[j + 8] & 15) | (s[j] >> 6) << 4 for j in range(4)]
    m = [s[j + 4] & 63 for j in range(4)] + [(s[j + 8] >> 4) | (s[j + 4] >> 6) << 4 for j in range(4)]
    qs = b[48:176] if qtype == QType.Q5_K else b[16:144]
    for c in range(4):
        for i in range(32):
            q[64 * c + i], q[64 * c + 32 + i] = qs[32 * c + i] & 15, qs[32 * c + i] >> 4
    if qtype == QType.Q5_K:
        for j in range(8):
            for i in range(32):
                q[32 * j + i] |= ((b[16 + i] >> j) & 1) << 4
    return q, f16(b[0], b[1]), f16(b[2], b[3]), sc, m


def k_oracle(x: torch.Tensor, qtype: QType, raw: np.ndarray) -> list[list[float]]:
    """quant_gemm's steps 1-4 in Python integers from the super-blocks' own values: per group of
    256 activations (one super-block s), in numpy float32 (IEEE) arithmetic as llama.cpp's Q8_K:
    amax = max |x|, d_s = amax / 127, inverse = 127 / amax, xq = round(x inverse) (half to even)
    clamped to [-127, 127] (a group with amax < 2^-120: xq = 0, d_s = 0); the scale
    float16(min(d_s, 65504)) = mu_s 2^k_s (frexp16). Per super-block s of row n one dot term
    (sum over its sub-blocks j of dm sc_j A_j) mu_s 2^(de + k_s) and, with a minimum, one minimum
    term (sum over its 32-blocks j of -(dminm m_j) sum(xq of j)) mu_s 2^(dmine + k_s); grid
    g = top + kmax + T - 62 + ceil(log2 #terms), T the kind's term bound (8 blocks of
    |A| <= 32 max|c| 127 times |dm sc| < 2^17 (2^18 for q6_k's signed sc) times mu_s < 2^11:
    47, 48, 49)."""
    n, kdim = raw.shape[0], x.shape[1]
    term_bits = {QType.Q4_K: 47, QType.Q5_K: 48, QType.Q6_K: 49}[qtype]
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    rows = []
    for r in range(n):
        weights = [k_values(qtype, raw[r, size * s:size * (s + 1)].tolist()) for s in range(kdim // 256)]
        rows.append(weights)
    out = []
    f32 = np.float32
    for line in x.float().tolist():
        xq, scales = [], []
        for s in range(kdim // 256):
            group = [f32(v) for v in line[256 * s:256 * (s + 1)]]
            amax = max(abs(v) for v in group)
            if amax < 2.0 ** -120:                                   # a zero group
                xq += [0] * 256
                scales.append((0, -24))
                continue
            step, inverse = amax / f32(127), f32(127) / amax          # float32 divisions
            xq += [max(-127, min(127, round(float(v * inverse)))) for v in group]  # half to even
            scales.append(frexp16(float(np.float16(min(step, f32(65504))))))
        ks = [k for _, k in scales]
        result = []
        for weights in rows:
            terms, top = [], []
            for s, (q, d, dmin, sc, m) in enumerate(weights):
                dm, de = frexp16(d)
                mu, k = scales[s]
                top.append(de)
                dot = low = 0
                for j in range(8):                                   # 32-blocks of this super-block
                    xb, c = xq[256 * s + 32 * j:256 * s + 32 * (j + 1)], q[32 * j:32 * (j + 1)]
                    if qtype == QType.Q6_K:
                        dot += sum(dm * sc[2 * j + h] * sum((ci - 32) * xi for ci, xi in
                                                           zip(c[16 * h:16 * (h + 1)], xb[16 * h:16 * (h + 1)]))
                                   for h in range(2))
                    else:
                        dot += dm * sc[j] * sum(ci * xi for ci, xi in zip(c, xb))
                        mm, _ = frexp16(dmin)
                        low += -(mm * m[j]) * sum(xb)
                terms.append((dot * mu, de + k))
                if qtype != QType.Q6_K:
                    mm, me = frexp16(dmin)
                    terms.append((low * mu, me + k))
                    top.append(me)
            g = max(top) + max(ks) + term_bits - 62 + math.ceil(math.log2(len(terms)))
            total = sum(shift_round(i, s - g) for i, s in terms)
            result.append(float(torch.tensor(float(total) * 2.0 ** g, dtype=torch.float32)))
        out.append(result)
    return out


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_quant_linear_equals_the_integer_oracle(qtype):
    rng = np.random.default_rng(20 + int(qtype))
    raw = random_bytes(rng, qtype, 3, 512)
    # the parse is gguf's meaning of the bytes (exact products; one float32 rounding at most)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    values = [k_values(qtype, raw.reshape(-1, size)[s].tolist()) for s in range(6)]
    parsed = [d * sc[i // (16 if dmin is None else 32)] * (qi - (32 if dmin is None else 0))
              - (0 if dmin is None else dmin * m[i // 32]) for q, d, dmin, sc, m in values for i, qi in enumerate(q)]
    np.testing.assert_allclose(parsed, gguf.quants.dequantize(raw, qtype).reshape(-1), rtol=1e-6, atol=1e-30)
    g = torch.Generator().manual_seed(int(qtype))
    x = torch.randn(3, 512, generator=g) * 2.0 ** torch.randint(-6, 6, (3, 1), generator=g)
    x[0, :32] = 0.0
    x[1, 64:96] = torch.randn(32, generator=g) * 2.0 ** -135      # subnormal: a zero block
    x[1, 96:128] *= 2.0 ** -120                                   # tiny but normal
    x[-1, 5] = 1e4
    x = torch.cat([x, x.bfloat16().float()])                      # bf16 values: many exact ties
    got = qg.linear(x, quant_weight(as_torch(raw), qtype, (3, 512)))
    assert got.tolist() == k_oracle(x, qtype, raw)


# --- loading: the default model and a Q4_K_M-style tiny file ------------------------------------

def assert_kept_equals_dense(kept: dict, dense: dict, expect_kinds: dict[str, str]):
    assert set(kept) == set(dense)
    for name, weight in kept.items():
        if isinstance(weight, FileBlocks):  # left in the file until asked for
            weight = weight.load()
        assert (weight.kind if isinstance(weight, QuantWeight) else None) == expect_kinds.get(name), name
        floats = weight.dequantize() if isinstance(weight, QuantWeight) else weight
        np.testing.assert_array_equal(floats.numpy().view(np.uint32), dense[name].numpy().view(np.uint32),
                                      err_msg=name)


@pytest.mark.slow
def test_default_model_kept_in_blocks_equals_the_dense_load():
    path = default_model_path()
    dense, kept = load_gguf(path), load_gguf(path, keep_quantized=True)
    kinds = {name: "q4_1" for name, w in dense.tensors.items() if w.dim() == 2}
    kinds["model.embed_tokens.weight"] = "q8_0"
    assert_kept_equals_dense(kept.tensors, dense.tensors, kinds)  # Q/K rows un-permuted alike
    assert kept.config == dense.config


TINY_KINDS = {"q_proj": "q4_k", "k_proj": "q4_k", "o_proj": "q4_k", "gate_proj": "q4_k", "up_proj": "q4_k",
              "v_proj": "q6_k", "down_proj": "q6_k", "embed_tokens": "q6_k"}


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory, smollm2_tokenizer):
    from tools.tiny_checkpoint import K_QUANT_SIZES, make_tiny_checkpoint, write_tiny_gguf
    hf_dir = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_k")), "llama", tokenizer=smollm2_tokenizer,
                                  **K_QUANT_SIZES)
    gguf_dir = tmp_path_factory.mktemp("tiny_k_gguf")
    return hf_dir, write_tiny_gguf(hf_dir, "q4_k_m", str(gguf_dir / "tiny.gguf"))


def test_tiny_q4_k_m_file_loads_both_ways(tiny_q4_k_m):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    hf_dir, path = tiny_q4_k_m
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == QType.Q4_K and types["blk.1.ffn_down.weight"] == QType.Q6_K
    assert types["blk.0.attn_v.weight"] == QType.Q6_K and types["token_embd.weight"] == QType.Q6_K
    assert types["blk.0.attn_norm.weight"] == QType.F32
    dense, kept = load_gguf(path), load_gguf(path, keep_quantized=True)
    kinds = {name: TINY_KINDS[name.split(".")[-2]] for name, w in dense.tensors.items() if w.dim() == 2}
    assert_kept_equals_dense(kept.tensors, dense.tensors, kinds)
    # transformers dequantizes with gguf and un-permutes Q/K its own way: the same floats
    folder, name = os.path.split(path)
    state = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).state_dict()
    state.pop("lm_head.weight")
    assert set(state) == set(dense.tensors)
    for key, weight in dense.tensors.items():
        assert torch.equal(weight, state[key]), key
    # and the file holds the checkpoint's weights, rows in place, to within the 4/6-bit grids
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    for key, weight in dense.tensors.items():
        err = (weight - original[key]).abs().amax() / original[key].abs().amax()
        assert err < (0.08 if kinds.get(key) == "q4_k" else 0.025 if key in kinds else 1e-30), (key, err)
    assert dense.config["hidden_size"] == 256 and dense.config["head_dim"] == 64


@functools.lru_cache(maxsize=1)
def gguf_reader(path: str) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def rewrite(src: str, dst: str, extra: dict[str, tuple[np.ndarray, QType]]) -> str:
    """A copy of the GGUF src with tensors replaced or added: name -> (data, stored type)."""
    reader = gguf_reader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    tensors = {t.name: (t.data, t.tensor_type) for t in reader.tensors}
    for name, (data, qtype) in {**tensors, **extra}.items():
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_unsupported_block_type_names_file_tensor_and_type(tiny_q4_k_m, tmp_path):
    _, path = tiny_q4_k_m
    size = gguf.GGML_QUANT_SIZES[QType.IQ2_XS][1]
    junk = np.zeros((256, 256 // 256 * size), np.uint8)
    bad = rewrite(path, str(tmp_path / "iq.gguf"), {"blk.0.attn_q.weight": (junk, QType.IQ2_XS)})
    for keep in (False, True):
        with pytest.raises(CheckpointError) as info:
            load_gguf(bad, keep_quantized=keep)
        message = str(info.value)
        assert message.startswith(bad) and "blk.0.attn_q.weight" in message and "IQ2_XS" in message
        assert "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K" in message


def llama3_divisors(theta: float, head_dim: int, factor: float, low: float, high: float, old: int = 8192):
    """What llama.cpp's converter writes as rope_freqs.weight for HF's llama3 rope_scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            s = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, np.float32)


@pytest.mark.parametrize("factor,low,high", [(8.0, 1.0, 4.0), (32.0, 2.0, 8.0)])
def test_rope_freqs_become_llama3_rope_scaling(tiny_q4_k_m, tmp_path, factor, low, high):
    _, path = tiny_q4_k_m
    divisors = llama3_divisors(100000.0, 64, factor, low, high)
    assert 1.0 < divisors[17] < factor and 1.0 < divisors[18] < factor   # a smooth blend to fit
    ck = load_gguf(rewrite(path, str(tmp_path / "r.gguf"), {"rope_freqs.weight": (divisors, QType.F32)}))
    assert ck.config["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                         "high_freq_factor": high, "original_max_position_embeddings": 8192}
    inv_freq, _ = rope_inv_freq(ModelArgs.from_hf(ck.config).rope, 64)
    base = 1.0 / 100000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(inv_freq, base / divisors, rtol=1e-6)
    assert "rope_freqs" not in " ".join(ck.tensors)


def test_rope_freqs_that_are_not_llama3_scaling(tiny_q4_k_m, tmp_path):
    _, path = tiny_q4_k_m
    ones = np.ones(32, np.float32)
    ck = load_gguf(rewrite(path, str(tmp_path / "one.gguf"), {"rope_freqs.weight": (ones, QType.F32)}))
    assert "rope_scaling" not in ck.config
    noise = np.random.default_rng(0).uniform(1, 8, 32).astype(np.float32)
    bad = rewrite(path, str(tmp_path / "bad.gguf"), {"rope_freqs.weight": (noise, QType.F32)})
    with pytest.raises(CheckpointError, match="rope_freqs.weight does not follow Llama 3's rope scaling"):
        load_gguf(bad)
