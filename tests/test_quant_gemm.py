"""The exact quantized GEMM's torch reference (kernels/quant_gemm.py), which the C++ and Triton
kernels will have to equal bitwise, checked against:
- a spelled-out oracle in Python integers, step by step from the module docstring (bitwise);
- its own invariances: a row alone equals the row among others, and shuffling the K blocks (the
  same way in x and w) changes no bit, since every sum is an exact integer sum;
- GGUF's meaning of the blocks (QuantWeight.dequantize equals the gguf-package-checked
  dequantizer on the same bytes) and the float64 product of the dequantized weights, within the
  activation quantization's error."""
import math
import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tensorfold.kernels import quant_gemm as qg
from tensorfold.models import gguf_quants

LEGACY = ("q8_0", "q4_0", "q4_1")


def random_blocks(rng: torch.Generator, kind: str, n: int, k: int):
    """GGUF's own values for a q8_0 / q4_0 / q4_1 matrix: q [N, K] and f16 d (and m) [N, K / 32]."""
    if kind == "q8_0":
        q = torch.randint(-127, 128, (n, k), generator=rng, dtype=torch.int8)
    else:
        q = torch.randint(0, 16, (n, k), generator=rng, dtype=torch.uint8)
    # scales over several binades, a zero and a subnormal among them
    d = (torch.rand(n, k // 32, generator=rng) * 2.0 ** torch.randint(-14, 2, (n, k // 32), generator=rng)).half()
    d[0, 0] = 0.0
    d[-1, -1] = 2.0 ** -20
    m = -(torch.rand(n, k // 32, generator=rng) * 0.5).half() if kind == "q4_1" else None
    return q, d, m


def random_weight(rng: torch.Generator, kind: str, n: int, k: int) -> qg.QuantWeight:
    return qg.from_legacy(kind, *random_blocks(rng, kind, n, k))


def random_x(rng: torch.Generator, m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=rng) * 2.0 ** torch.randint(-6, 6, (m, 1), generator=rng)
    x[0, :32] = 0.0                     # an all-zero block
    x[-1, 5] = 1e4                      # an outlier
    return x


def oracle(x: torch.Tensor, kind: str, q: torch.Tensor, d: torch.Tensor, m) -> list[list[float]]:
    """Steps 1-4 of the module docstring in plain Python integers, from GGUF's values."""
    n, kdim = q.shape
    nb = kdim // 32
    offset = 8 if kind == "q4_0" else 0
    out = []
    f32 = np.float32
    for row in x.float().tolist():
        xq, scales, sums = [], [], []
        for b in range(nb):
            block = [f32(v) for v in row[32 * b:32 * (b + 1)]]
            amax = max(abs(v) for v in block)
            if amax < 2.0 ** -120:
                xq += [0] * 32
                scales.append((0, -24))
                sums.append((0, -24))
                continue
            step, inverse = amax / f32(127), f32(127) / amax               # float32 divisions
            block_q = [max(-127, min(127, round(float(v * inverse)))) for v in block]  # round(): half even
            xq += block_q
            scales.append(frexp16(float(np.float16(min(step, f32(65504))))))
            sums.append(frexp16(float(np.float16(max(-65504.0, min(65504.0, step * f32(sum(block_q))))))))
        ks = [k for _, k in scales]
        line = []
        for j in range(n):
            terms, top = [], []
            for b in range(nb):
                c = q[j, 32 * b:32 * (b + 1)].tolist()
                xb = xq[32 * b:32 * (b + 1)]
                a = sum((ci - offset) * qi for ci, qi in zip(c, xb))
                dm, de = frexp16(float(d[j, b]))
                terms.append((dm * a * scales[b][0], de + ks[b]))
                top.append(de)
                if kind == "q4_1":
                    mm, me = frexp16(float(m[j, b]))
                    terms.append((mm * sums[b][0], me + sums[b][1]))
                    top.append(me)
            g = max(top) + max(ks) + 41 - 62 + math.ceil(math.log2(len(terms)))
            total = sum(shift_round(i, s - g) for i, s in terms)
            line.append(float(torch.tensor(float(total) * 2.0 ** g, dtype=torch.float32)))
        out.append(line)
    return out


def frexp16(h: float) -> tuple[int, int]:
    """h (a float16 value) = dm 2^de with dm the 11-bit significand."""
    if h == 0:
        return 0, -24
    e = max(math.floor(math.log2(abs(h))), -14)
    de = e - 10
    return int(h / 2.0 ** de), de


def shift_round(i: int, s: int) -> int:
    if s >= 0:
        return i << s
    q, r = divmod(i, 1 << -s)
    half = 1 << (-s - 1)
    return q + (1 if r > half or (r == half and q & 1) else 0)


@pytest.mark.parametrize("kind", LEGACY)
def test_reference_equals_the_integer_oracle(kind):
    rng = torch.Generator().manual_seed(1)
    raw = random_blocks(rng, kind, 5, 192)
    x = torch.cat([random_x(rng, 3, 192), random_x(rng, 6, 192).bfloat16().float()])  # bf16 values: many ties
    assert qg.linear(x, qg.from_legacy(kind, *raw)).tolist() == oracle(x, kind, *raw)


@pytest.mark.parametrize("kind", LEGACY)
def test_rows_alone_and_block_order_change_no_bit(kind):
    rng = torch.Generator().manual_seed(2)
    order = list(range(256 // 32))
    random.Random(3).shuffle(order)
    check_rows_alone_and_group_order(random_weight(rng, kind, 16, 256), random_x(rng, 9, 256), order)


@pytest.mark.parametrize("kind,qtype", [("q8_0", QType.Q8_0), ("q4_0", QType.Q4_0), ("q4_1", QType.Q4_1)])
def test_blocks_mean_what_gguf_says_and_the_product_is_close(kind, qtype):
    rng = torch.Generator().manual_seed(4)
    raw = random_blocks(rng, kind, 12, 128)
    w = qg.from_legacy(kind, *raw)
    assert torch.equal(w.dequantize(), gguf_quants.dequantize(gguf_bytes(kind, *raw), qtype, w.shape))
    x = torch.randn(4, 128, generator=rng)
    exact = x.double() @ w.dequantize().double().T
    got = qg.linear(x, w).double()
    # int8 activations: each element's error is at most half a step of amax / 127, plus the float16
    # rounding of the block scale (2^-11 of it) over |xq| <= 127
    amax = x.abs().reshape(4, -1, 32).amax(-1).repeat_interleave(32, dim=1).double()
    bound = (w.dequantize().double().abs() @ (amax / 127 * (0.5 + 127 * 2.0 ** -11) * 1.001).T).T
    assert bool(((got - exact).abs() <= bound + 1e-6).all())


def gguf_bytes(kind: str, q: torch.Tensor, d: torch.Tensor, m) -> torch.Tensor:
    """The GGUF encoding of the blocks (a packed byte j holds weight j low, weight j + 16 high)."""
    d = d.reshape(-1, 1).view(torch.uint8)
    if kind == "q8_0":
        return torch.cat([d, q.reshape(-1, 32).view(torch.uint8)], dim=1).reshape(-1)
    codes = q.reshape(-1, 32)
    packed = (codes[:, :16] | (codes[:, 16:] << 4)).to(torch.uint8)
    head = [d] if kind == "q4_0" else [d, m.reshape(-1, 1).view(torch.uint8)]
    return torch.cat([*head, packed], dim=1).reshape(-1)


def code_range(kind: str) -> tuple[int, int]:
    """The signed codes c a kind holds, as [low, high)."""
    return {"q8_0": (-128, 128), "q4_0": (-8, 8), "q6_k": (-32, 32)}.get(kind, (0, 2 ** qg.KINDS[kind].code_bits))


def random_generic(rng: torch.Generator, kind: str, n: int, k: int) -> qg.QuantWeight:
    """Any kind's fields drawn directly within their bounds (KINDS' comment): codes in the kind's
    range, scales up to the largest significand times sub-block scale, exponents as float16's (one
    per super-block for the 256-column kinds), zero scales among them."""
    info = qg.KINDS[kind]
    codes = torch.randint(*code_range(kind), (n, k), generator=rng, dtype=torch.int8)
    bound = {"q4_k": 2047 * 63, "q5_k": 2047 * 63, "q6_k": 2047 * 128}.get(kind, 2047)
    scale = torch.randint(-bound, bound + 1, (n, k // info.sub), generator=rng, dtype=torch.int32)
    scale[0, 0] = 0
    per = info.blocks_per_group  # the 256-column kinds: one E (and F) per super-block
    exps = (lambda: torch.randint(-24, 6, (n, k // info.act), generator=rng, dtype=torch.int32)
            .repeat_interleave(per, dim=1))
    if not info.has_min:
        return qg.QuantWeight(kind, codes, scale, exps())
    mins = torch.randint(-bound, bound + 1, (n, k // 32), generator=rng, dtype=torch.int32)
    return qg.QuantWeight(kind, codes, scale, exps(), mins, exps())


K_FILE_TYPES = {"q4_k": QType.Q4_K, "q6_k": QType.Q6_K}  # the K-quants the native GEMM keeps in their file's form


def random_k_file(rng: torch.Generator, kind: str, n: int, k: int) -> tuple[torch.Tensor, qg.QuantWeight]:
    """A K-quant matrix as a GGUF file holds it, random bytes with finite float16 d (and dmin) over
    many binades, signs, a zero and a subnormal among them, and its QuantWeight (gguf_quants).
    Returns (the file's bytes, the weight)."""
    import gguf

    qtype = K_FILE_TYPES[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (n * k // block, size), generator=rng, dtype=torch.uint8)
    for at in ([208] if kind == "q6_k" else [0, 2]):
        h = (torch.randn(len(blocks), generator=rng) * 2.0 ** torch.randint(-22, 4, (len(blocks),), generator=rng)).half()
        h[0], h[-1] = 0.0, 2.0 ** -20
        blocks[:, at:at + 2] = h.view(torch.uint8).reshape(-1, 2)
    raw = blocks.reshape(-1)
    return raw, gguf_quants.quant_weight(raw, qtype, (n, k))


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k"])
def test_k_quants_rows_alone_and_super_block_order_change_no_bit(kind):
    rng = torch.Generator().manual_seed(5)
    order = [2, 0, 3, 1]  # super-blocks move whole: the groups, their E and their terms with them
    check_rows_alone_and_group_order(random_generic(rng, kind, 16, 1024), random_x(rng, 9, 1024), order)


def check_rows_alone_and_group_order(w: qg.QuantWeight, x: torch.Tensor, order: list) -> None:
    """Each row alone gives its bits among the others, and moving whole activation groups (their
    columns, sub-block scales and exponents) the same way in x and w changes no bit."""
    y = qg.linear(x, w)
    for i in range(x.shape[0]):
        assert torch.equal(qg.linear(x[i:i + 1], w), y[i:i + 1])
    info = qg.KINDS[w.kind]
    moved = (lambda width: torch.cat([torch.arange(width * g, width * (g + 1)) for g in order]))
    cols, subs, blocks = moved(info.act), moved(info.act // info.sub), moved(info.blocks_per_group)
    pick = (lambda t: None if t is None else t[:, blocks])
    shuffled = qg.QuantWeight(w.kind, w.codes[:, cols], w.scale[:, subs], pick(w.scale_exp), pick(w.min),
                              pick(w.min_exp))
    assert torch.equal(qg.linear(x[:, cols], shuffled), y)


def test_a_k_quant_needs_one_exponent_per_super_block():
    rng = torch.Generator().manual_seed(6)
    w = random_generic(rng, "q4_k", 4, 512)
    w.scale_exp[1, 3] += 1
    with pytest.raises(ValueError, match="one scale_exp per super-block"):
        qg.linear(torch.randn(2, 512), w)
    with pytest.raises(ValueError, match="multiple of 256"):
        qg.linear(torch.randn(2, 288), random_generic(rng, "q6_k", 4, 288))


def test_an_infinite_or_nan_scale_is_refused():
    q = torch.zeros(2, 32, dtype=torch.uint8)
    for bad in (float("inf"), float("nan")):
        d = torch.tensor([[1.0], [bad]]).half()
        with pytest.raises(ValueError, match="infinite or NaN"):
            qg.from_legacy("q4_0", q, d)
