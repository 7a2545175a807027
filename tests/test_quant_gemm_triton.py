"""The exact quantized GEMM in Triton (kernels/quant_gemm_triton.py) against its torch reference
(kernels/quant_gemm.py's `linear`), bitwise, for every kind, and the cuda op set's wiring.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by kernel_inputs
before anything imports triton) with tests/triton_interpreter.py's GPU semantics (its rounding
fp32 -> bf16 cast; its sequential dot, exact on these int8 blocks); with a GPU the same tests
run compiled on "cuda" and the reference on the CPU copies. Weights are random valid fields of
each kind built directly (codes in the kind's stored range made signed, scales within the bounds
above quant_gemm.KINDS, exponents -24..5 as float16 significands give, zero scales and minima
among them); activations have rows and blocks over many binades (float16 block scales normal,
subnormal, zero, saturated at 65504), an all-zero block, a subnormal block (a zero block: xq = 0,
(m, k) = (0, -24)), an outlier; bf16 values (fp32 rows rounded to bf16, and bf16 activations)
make many exact ties x (127 / amax) = j + 1/2.
Outputs are NaN-filled before each launch, so an element the kernel forgot to write shows.
"""
import torch

from kernel_inputs import DEVICE, NAN  # first: sets TRITON_INTERPRET without a GPU

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tensorfold.kernels import quant_gemm as qg  # noqa: E402
from tensorfold.kernels import quant_gemm_triton as qt  # noqa: E402
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

DTYPES = (torch.float32, torch.bfloat16)
# signed codes as QuantWeight holds them: q8_0 int8 (-128 kept: the bound above KINDS allows it),
# q4_0 q - 8, q4_1 / q4_k 0..15, q5_k 0..31, q6_k q - 32
CODES = {"q8_0": (-128, 127), "q4_0": (-8, 7), "q4_1": (0, 15), "q4_k": (0, 15), "q5_k": (0, 31), "q6_k": (-32, 31)}
# |S| bounds: a float16 significand (< 2^11), times a 6-bit sub-block scale (K-quants), or an
# 8-bit signed one (q6_k)
SCALE_BOUND = {"q8_0": 2 ** 11, "q4_0": 2 ** 11, "q4_1": 2 ** 11, "q4_k": 2 ** 11 * 63, "q5_k": 2 ** 11 * 63,
               "q6_k": 2 ** 11 * 128}


def random_weight(gen: torch.Generator, kind: str, n: int, k: int) -> qg.QuantWeight:
    """Random valid fields of `kind`: every bound at its edge somewhere, zero scales and minima."""
    spec = qg.KINDS[kind]
    lo, hi = CODES[kind]
    codes = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int8)
    codes[0, :16] = lo                   # the codes' extremes
    codes[-1, :16] = hi
    bound = SCALE_BOUND[kind]

    def ints(shape):
        v = torch.randint(-bound + 1, bound, shape, generator=gen, dtype=torch.int32)
        small = torch.rand(shape, generator=gen) < 0.3      # also small ones: a spread of term sizes
        v = torch.where(small, v >> torch.randint(0, 16, shape, generator=gen, dtype=torch.int32), v)
        v[torch.rand(shape, generator=gen) < 0.1] = 0        # zero scales
        v.view(-1)[0] = bound - 1                            # the largest allowed
        v.view(-1)[-1] = -(bound - 1)
        return v

    def exps(shape):
        e = torch.randint(-24, 6, shape, generator=gen, dtype=torch.int32)
        e.view(-1)[0] = 5
        e.view(-1)[-1] = -24
        return e

    nb = k // 32
    scale, scale_exp = ints((n, k // spec.sub)), exps((n, nb))
    if not spec.has_min:
        return qg.QuantWeight(kind, codes, scale, scale_exp)
    return qg.QuantWeight(kind, codes, scale, scale_exp, ints((n, nb)), exps((n, nb)))


def random_x(gen: torch.Generator, m: int, k: int, dtype) -> torch.Tensor:
    """Rows over ~35 binades, blocks within a row over ~16 (so some terms round onto the grid, and
    float16 block scales run from zero through subnormal to saturated), an all-zero block, a
    subnormal block (K >= 96), an outlier, and (from 3 rows) an all-zero row."""
    row_scale = 2.0 ** torch.randint(-12, 23, (m, 1), generator=gen).double()
    block_scale = 2.0 ** torch.randint(-8, 9, (m, k // 32), generator=gen).double().repeat_interleave(32, dim=1)
    x = (torch.randn(m, k, generator=gen, dtype=torch.float64) * row_scale * block_scale).float()
    x[0, :32] = 0.0
    if k >= 96:                                  # a subnormal block: zero (m = 0) however large its row
        x[-1, 64:96] = torch.randn(32, generator=gen, dtype=torch.float64).float() * 2.0 ** -135
    x[-1, 5] = 1e4 * x[-1].abs().max()
    if m >= 3:
        x[1] = 0.0
    return x.to(dtype)


def run(x: torch.Tensor, w: qg.QuantWeight) -> torch.Tensor:
    """The Triton kernel on DEVICE into a NaN-filled output, back on the CPU."""
    packed = qt.pack_quant_weight(_to(w, DEVICE))
    out = torch.full((x.shape[0], w.shape[0]), NAN, dtype=x.dtype, device=DEVICE)
    y = qt.quant_linear(x.to(DEVICE), packed, out=out)
    assert y is out
    return y.cpu()


def _to(w: qg.QuantWeight, device) -> qg.QuantWeight:
    move = (lambda t: None if t is None else t.to(device))
    return qg.QuantWeight(w.kind, *(move(getattr(w, f)) for f in ("codes", "scale", "scale_exp", "min", "min_exp")))


def same(y: torch.Tensor, ref: torch.Tensor, what: str):
    assert y.dtype == ref.dtype and y.shape == ref.shape, what
    diff = (y.float() != ref.float()) & ~(y.isnan() & ref.isnan())
    assert torch.equal(y.view(torch.int16) if y.dtype == torch.bfloat16 else y.view(torch.int32),
                       ref.view(torch.int16) if ref.dtype == torch.bfloat16 else ref.view(torch.int32)), \
        f"{what}: {int(diff.sum())} of {y.numel()} differ, first at {diff.nonzero()[:3].tolist()}"


def step1_edges() -> torch.Tensor:
    """Blocks at the edges of step 1: amax = 127 (d = 1 = 1024 2^-10, inverse 1: exact ties
    j + 1/2, j odd and even, both signs: half to even); amax = 1e7 (d past 65504: the scale
    saturates, and so does d sum xq, both signs); amax = 127 2^-20 (d = 2^-20, a float16
    subnormal: m = 16, k = -24); amax = 2^-126, the least normal, below 2^-120 (127 / amax would
    overflow): a zero block; and a zero block whose amax is just below 2^-126 (subnormal)."""
    ties = [2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5, 125.5, -125.5]
    rows = [
        [127.0] + ties + [0.25 * j - 3.0 for j in range(20)],
        [1e7, -1e7] + [1e7 / 127 * j for j in range(30)],
        [-1e7] * 32,
        [127 * 2.0 ** -20] + [-(2.0 ** -20) * j for j in range(31)],
        [2.0 ** -126] + [-(2.0 ** -127), 2.0 ** -149, 2.0 ** -126, -(2.0 ** -149)] * 7 + [2.0 ** -140] * 3,
        [2.0 ** -126 - 2.0 ** -149] + [-(2.0 ** -128), 2.0 ** -149, 0.0, -(2.0 ** -140)] * 7 + [0.0] * 3,
    ]
    return torch.tensor(rows, dtype=torch.float64).float().reshape(1, 192)


@pytest.mark.filterwarnings("ignore:overflow encountered in divide")  # the interpreter's numpy: 127 / 2^-126
@pytest.mark.parametrize("kind", qg.TYPES)
def test_quantize_activations_kernel(kind, draw):
    """Step 1 alone: xq, (m, k) and (sm, se) as the reference's (zero and subnormal blocks, float16
    scales saturated and subnormal, exact ties of x inverse, bf16-rounded rows full of ties), kmax
    as their maximum."""
    x = random_x(draw.gen, 5, 192, torch.float32)
    x[2, 40] = 2.0 ** -140                  # a subnormal element in a normal block
    x[3, 64:96] = 1.5 * 2.0 ** -127         # a subnormal block: zero
    x = torch.cat([x, random_x(draw.gen, 4, 192, torch.float32).bfloat16().float(), step1_edges()])
    got = [t.cpu() for t in qt.quantize_activations(x.to(DEVICE))]
    ref = qg.quantize_activations(x)
    for name, a, b in zip(("xq", "m", "k", "sm", "se"), got, ref):
        assert torch.equal(a, b), f"{name} differs at {(a != b).nonzero()[:4].tolist()} {draw}"
    xq, xm, k, sm, se, kmax = got
    assert torch.equal(kmax, ref[2].amax(dim=1)), str(draw)
    assert xq[-1, :12].tolist() == [127, 2, 4, -2, -4, 0, 0, 2, 126, -126, 126, -126], xq[-1, :12].tolist()
    assert xm[-1].tolist() == [1024, 2047, 2047, 16, 0, 0] and k[-1].tolist() == [-10, 5, 5, -24, -24, -24]
    assert sm[-1, 1:].tolist() == [2047, -2047, sm[-1, 3], 0, 0] and se[-1, 2] == 5, sm[-1].tolist()
    assert not xq[-1, 128:].any()
    assert xm[3, 2] == 0 and k[3, 2] == -24


@pytest.mark.filterwarnings("ignore:overflow encountered in divide", "ignore:invalid value encountered in multiply")
def test_inverse_overflow_block(draw):
    """A block with amax below 2^-120 (where 127 / amax would overflow to inf, and 0 inf is NaN)
    and exact zeros in it is a zero block: codes 0, scales 0, and the product is the reference's,
    also on the same x with the zeros replaced by the least subnormal."""
    x = random_x(draw.gen, 3, 96, torch.float32)
    x[1, 32:64] = torch.randn(32, generator=draw.gen) * 2.0 ** -124
    x[1, 32:64:3] = 0.0
    xq, xm, k, sm, se, kmax = (t.cpu() for t in qt.quantize_activations(x.to(DEVICE)))
    assert xq[1, 32:64:3].eq(0).all() and xm[1, 1] == 0 and sm[1, 1] == 0 and k[1, 1] == -24
    filled = x.clone()
    filled[1, 32:64:3] = 2.0 ** -149
    for kind in ("q4_1", "q6_k"):
        w = random_weight(draw.gen, kind, 19, 96)
        same(run(x, w), qg.linear(filled, w), f"{kind} {draw}")


@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
@pytest.mark.parametrize("kind", qg.TYPES)
@pytest.mark.parametrize("m", (1, 3, 17, 64))
def test_bitwise_reference(kind, dtype, m, draw):
    """Every kind, fp32 and bf16, M from 1 to 64 (one to four row tiles), N odd over two column
    tiles, K = 192 (six blocks of 32): bitwise quant_gemm.linear."""
    n, k = 67, 192
    w = random_weight(draw.gen, kind, n, k)
    x = random_x(draw.gen, m, k, dtype)
    same(run(x, w), qg.linear(x, w), f"{kind} {dtype} M={m} {draw}")


@pytest.mark.parametrize("kind", qg.TYPES)
def test_row_alone_equals_row_among_others(kind, draw):
    """A row's bits do not depend on how many rows share the call or where it sits among them."""
    n, k = 37, 96
    w = random_weight(draw.gen, kind, n, k)
    row = random_x(draw.gen, 1, k, torch.bfloat16)
    alone = run(row, w)
    same(alone, qg.linear(row, w), f"{kind} alone {draw}")
    for size in (2, 19, 64):
        others = random_x(draw.gen, size, k, torch.bfloat16)
        place = int(torch.randint(0, size, (1,), generator=draw.gen))
        others[place] = row[0]
        same(run(others, w)[place:place + 1], alone, f"{kind} row {place} of {size} {draw}")


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's numpy: 127 / tiny amax
@pytest.mark.parametrize("kind", qg.TYPES)
def test_extremes(kind, draw):
    """All-zero activations; the tiniest scales (2^-24) against float32 subnormal and tiny
    activations (block scales below float16's least step: 0); huge activations against the
    largest scales (the block scales saturate at 65504, so the results stay finite); a row with one
    tiny block beside a huge one (its terms round to zero on the grid)."""
    n, k = 33, 128
    w = random_weight(draw.gen, kind, n, k)
    zero = torch.zeros(2, k)
    same(run(zero, w), qg.linear(zero, w), f"{kind} zeros {draw}")

    tiny_w = random_weight(draw.gen, kind, n, k)
    tiny_w.scale_exp.fill_(-24)
    tiny_w.scale.clamp_(-3, 3)
    if tiny_w.min is not None:
        tiny_w.min_exp.fill_(-24)
        tiny_w.min.clamp_(-3, 3)
    x = torch.randn(4, k, generator=draw.gen)
    x[0] *= 2.0 ** -140                               # subnormal float32
    x[1] *= 2.0 ** -120
    x[2] *= 2.0 ** 120
    x[3, :32] *= 2.0 ** 100                           # one huge block, the rest far below the grid
    x[3, 32:] *= 2.0 ** -100
    for weight in (w, tiny_w):
        y = run(x, weight)
        same(y, qg.linear(x, weight), f"{kind} extremes {draw}")
    big = random_weight(draw.gen, kind, n, k)
    big.scale_exp.fill_(5)
    huge = torch.randn(2, k, generator=draw.gen).clamp(-3.9, 3.9) * 2.0 ** 126  # finite, bf16 too
    y = run(huge, big)
    assert y.isfinite().all() and y.abs().max() > 2.0 ** 40, "float16 scales saturate: large but finite"
    same(y, qg.linear(huge, big), f"{kind} overflow {draw}")
    same(run(huge.bfloat16(), big), qg.linear(huge.bfloat16(), big), f"{kind} overflow bf16 {draw}")


def test_pack_refuses_malformed():
    w = random_weight(torch.Generator().manual_seed(0), "q4_1", 3, 64)
    with pytest.raises(ValueError, match="minimum"):
        qt.pack_quant_weight(qg.QuantWeight("q4_1", w.codes, w.scale, w.scale_exp))
    with pytest.raises(ValueError, match="unknown"):
        qt.pack_quant_weight(qg.QuantWeight("q2_k", w.codes, w.scale, w.scale_exp))
    with pytest.raises(ValueError, match="scales"):
        qt.pack_quant_weight(qg.QuantWeight("q6_k", w.codes, w.scale, w.scale_exp))
    with pytest.raises(ValueError, match="against"):
        qt.quant_linear(torch.zeros(2, 32), qt.pack_quant_weight(w))


def test_cuda_ops_wiring(draw):
    """cuda_ops.Linear takes a QuantWeight to the Triton kernel (bias added in x's dtype, as for
    dense weights); dense weights still take the dense path."""
    from tensorfold.backends import cuda_ops
    w = random_weight(draw.gen, "q6_k", 21, 64)
    packed = cuda_ops.Linear.of(_to(w, DEVICE))
    assert packed.shape == (21, 64) and packed.single.kind == "q6_k" and packed.format == "q6_k"
    x = random_x(draw.gen, 3, 64, torch.bfloat16)
    bias = torch.randn(21, generator=draw.gen).bfloat16()
    same(packed(x.to(DEVICE)).cpu(), qg.linear(x, w), f"no bias {draw}")
    with_bias = cuda_ops.Linear.of(_to(w, DEVICE), bias=bias.to(DEVICE))
    same(with_bias(x.to(DEVICE)).cpu(), qg.linear(x, w) + bias, f"bias {draw}")
    dense = torch.randn(21, 64, generator=draw.gen).to(DEVICE)
    assert cuda_ops.Linear.of(dense).single is dense
    assert cuda_ops.Linear.of(dense)(x.float().to(DEVICE)).shape == (3, 21)


@triton.jit
def _on_grid_kernel(ints_ptr, shift_ptr, out_ptr, COUNT: tl.constexpr, TERM_BITS: tl.constexpr):
    i = tl.arange(0, COUNT)
    tl.store(out_ptr + i, qt.on_grid(tl.load(ints_ptr + i), tl.load(shift_ptr + i), TERM_BITS))


@pytest.mark.parametrize("term_bits", sorted({kind.term_bits for kind in qg.KINDS.values()}))
def test_on_grid(term_bits, draw):
    """Step 3's shift onto the grid, the kernel's device function against quant_gemm._on_grid:
    every shift from far below the clamp at T + 1 to the largest left shift, ties (odd and even
    floors, both signs), the largest |I| < 2^T, zeros."""
    shifts = torch.arange(-(term_bits + 6), 62 - term_bits + 1)
    top = 2 ** term_bits - 1
    ints = [0, 1, -1, 2, -2, 3, -3, top, -top, top - 1, -(top - 1), 2 ** (term_bits - 1), -2 ** (term_bits - 1)]
    pairs = [(i, s) for s in shifts.tolist() for i in ints]
    for s in range(1, term_bits + 1):  # ties at every right shift: (2j + 1) 2^(s-1), j odd and even
        pairs += [(v, -s) for v in (2 ** (s - 1), 3 * 2 ** (s - 1), 5 * 2 ** (s - 1), -(2 ** (s - 1)),
                                    -3 * 2 ** (s - 1), -5 * 2 ** (s - 1)) if abs(v) < 2 ** term_bits]
    pairs += [(int(v), int(s)) for v, s in zip(torch.randint(-top, top + 1, (512,), generator=draw.gen),
                                                torch.randint(-(term_bits + 3), 63 - term_bits, (512,),
                                                              generator=draw.gen))]
    count = triton.next_power_of_2(len(pairs))
    pairs += [(0, 0)] * (count - len(pairs))
    ints_t = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    shift_t = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    out = torch.full((count,), -12345, dtype=torch.int64, device=DEVICE)
    _on_grid_kernel[(1,)](ints_t.to(DEVICE), shift_t.to(DEVICE), out, COUNT=count, TERM_BITS=term_bits)
    ref = qg._on_grid(ints_t, shift_t, term_bits)
    bad = (out.cpu() != ref).nonzero().flatten()[:5].tolist()
    assert not bad, [(pairs[i], int(out[i]), int(ref[i])) for i in bad]
