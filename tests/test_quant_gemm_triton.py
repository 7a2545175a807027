"""The exact quantized GEMM in Triton (kernels/quant_gemm_triton.py) against its torch reference
(kernels/quant_gemm.py's `linear`), bitwise, for every kind, and the cuda op set's wiring.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by kernel_inputs
before anything imports triton) with tests/triton_interpreter.py's GPU semantics (its rounding
fp32 -> bf16 cast; its sequential dot, exact on these int8 blocks); with a GPU the same tests
run compiled on "cuda" and the reference on the CPU copies. Weights are test_quant_gemm's
random_generic fields of each kind (codes in the kind's range, scales within the bounds above
quant_gemm.KINDS, exponents -24..5 as float16 significands give, one E and F per super-block for
the K-quants) with every bound at its edge somewhere, small, zero scales and minima among them.
K is a few blocks of 32 for the 32-column kinds and two super-blocks of 256 for the K-quants
where the grid matters (so their terms have different E and k). Activations have rows and
blocks over many binades (float16 group scales normal, subnormal, zero, saturated at 65504), an
all-zero block, a subnormal block (a zero block: xq = 0, (m, k) = (0, -24)), from K = 512 a zero
and a subnormal super-block, an outlier; bf16 values (fp32 rows rounded to bf16, and bf16
activations) make many exact ties x (127 / amax) = j + 1/2.
Outputs are NaN-filled before each launch, so an element the kernel forgot to write shows.
"""
import torch

from kernel_inputs import DEVICE, NAN  # first: sets TRITON_INTERPRET without a GPU

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tensorfold.kernels import quant_gemm as qg  # noqa: E402
from tensorfold.kernels import quant_gemm_triton as qt  # noqa: E402
from test_quant_gemm import code_range, random_generic  # noqa: E402
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

DTYPES = (torch.float32, torch.bfloat16)
# |S| and |M| as random_generic draws them: a float16 significand (< 2^11), times a 6-bit
# sub-block scale (q4_k, q5_k), or an 8-bit signed one (q6_k)
SCALE_BOUND = {"q4_k": 2047 * 63, "q5_k": 2047 * 63, "q6_k": 2047 * 128}


def k_for(kind: str, k32: int, k256: int = 512) -> int:
    """A test's K: k32 for the 32-column kinds, k256 (a multiple of 256) for the K-quants."""
    return k32 if qg.KINDS[kind].act == qg.BLOCK else k256


def random_weight(gen: torch.Generator, kind: str, n: int, k: int) -> qg.QuantWeight:
    """random_generic's fields of `kind`, with every bound at its edge somewhere (codes, scales,
    minima, exponents: 5 and -24 on a whole super-block for the K-quants), small scales (a
    spread of term sizes) and zero scales and minima."""
    w = random_generic(gen, kind, n, k)
    lo, hi = code_range(kind)
    w.codes[0, :16] = lo                 # the codes' extremes
    w.codes[-1, :16] = hi - 1
    bound = SCALE_BOUND.get(kind, 2047)
    for v in (w.scale, w.min):
        if v is None:
            continue
        small = torch.rand(v.shape, generator=gen) < 0.3
        v.copy_(torch.where(small, v >> torch.randint(0, 16, v.shape, generator=gen, dtype=torch.int32), v))
        v[torch.rand(v.shape, generator=gen) < 0.1] = 0
        v.view(-1)[0] = bound            # the largest allowed
        v.view(-1)[-1] = -bound
    per = qg.KINDS[kind].blocks_per_group
    for e in (w.scale_exp, w.min_exp):
        if e is not None:
            e[0, :per] = 5
            e[-1, -per:] = -24
    return w


def random_x(gen: torch.Generator, m: int, k: int, dtype) -> torch.Tensor:
    """Rows over ~35 binades, blocks within a row over ~16 (so some terms round onto the grid, and
    float16 group scales run from zero through subnormal to saturated), an all-zero block, a
    subnormal block (K >= 96), from K = 512 an all-zero super-block (first row) and a subnormal
    one (last row), an outlier, and (from 3 rows) an all-zero row."""
    row_scale = 2.0 ** torch.randint(-12, 23, (m, 1), generator=gen).double()
    block_scale = 2.0 ** torch.randint(-8, 9, (m, k // 32), generator=gen).double().repeat_interleave(32, dim=1)
    x = (torch.randn(m, k, generator=gen, dtype=torch.float64) * row_scale * block_scale).float()
    x[0, :32] = 0.0
    if k >= 96:                                  # a subnormal block: zero (m = 0) however large its row
        x[-1, 64:96] = torch.randn(32, generator=gen, dtype=torch.float64).float() * 2.0 ** -135
    if k >= 512:                                 # a zero group of 256, and a subnormal one (also zero)
        x[0, 256:512] = 0.0
        x[-1, 256:512] = torch.randn(256, generator=gen, dtype=torch.float64).float() * 2.0 ** -135
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


def step1_edges(act: int) -> torch.Tensor:
    """Groups at the edges of step 1, each of 32 values then zeros up to `act`: amax = 127
    (d = 1 = 1024 2^-10, inverse 1: exact ties j + 1/2, j odd and even, both signs: half to even);
    amax = 1e7 (d past 65504: the scale saturates, and so does d sum xq, both signs); amax =
    127 2^-20 (d = 2^-20, a float16 subnormal: m = 16, k = -24); amax = 2^-126, the least normal,
    below 2^-120 (127 / amax would overflow): a zero group; and a zero group whose amax is just
    below 2^-126 (subnormal). Returns [1, 6 act]."""
    ties = [2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5, 125.5, -125.5]
    rows = [
        [127.0] + ties + [0.25 * j - 3.0 for j in range(20)],
        [1e7, -1e7] + [1e7 / 127 * j for j in range(30)],
        [-1e7] * 32,
        [127 * 2.0 ** -20] + [-(2.0 ** -20) * j for j in range(31)],
        [2.0 ** -126] + [-(2.0 ** -127), 2.0 ** -149, 2.0 ** -126, -(2.0 ** -149)] * 7 + [2.0 ** -140] * 3,
        [2.0 ** -126 - 2.0 ** -149] + [-(2.0 ** -128), 2.0 ** -149, 0.0, -(2.0 ** -140)] * 7 + [0.0] * 3,
    ]
    groups = torch.zeros(6, act, dtype=torch.float64)
    groups[:, :32] = torch.tensor(rows, dtype=torch.float64)
    return groups.float().reshape(1, 6 * act)


@pytest.mark.filterwarnings("ignore:overflow encountered in divide")  # the interpreter's numpy: 127 / 2^-126
@pytest.mark.parametrize("act", (qg.BLOCK, qg.SUPER))
def test_quantize_activations_kernel(act, draw):
    """Step 1 alone, in groups of 32 and of 256: xq, (m, k) per group and for groups of 32 Q8_1's
    (sm, se) as the reference's (zero and subnormal groups, float16 scales saturated and
    subnormal, exact ties of x inverse, bf16-rounded rows full of ties), kmax as their maximum."""
    k = 6 * act
    x = random_x(draw.gen, 5, k, torch.float32)
    x[2, 40] = 2.0 ** -140                  # a subnormal element in a normal group
    x[3, act:2 * act] = 1.5 * 2.0 ** -127   # a subnormal group: zero
    x = torch.cat([x, random_x(draw.gen, 4, k, torch.float32).bfloat16().float(), step1_edges(act)])
    got = [None if t is None else t.cpu() for t in qt.quantize_activations(x.to(DEVICE), act)]
    ref = qg.quantize_activations(x, act)
    names = ("xq", "m", "k", "sm", "se") if act == qg.BLOCK else ("xq", "m", "k")
    for name, a, b in zip(names, got, ref):
        assert torch.equal(a, b), f"{name} differs at {(a != b).nonzero()[:4].tolist()} {draw}"
    xq, xm, k, sm, se, kmax = got
    assert torch.equal(kmax, ref[2].amax(dim=1)), str(draw)
    assert xq[-1, :12].tolist() == [127, 2, 4, -2, -4, 0, 0, 2, 126, -126, 126, -126], xq[-1, :12].tolist()
    assert xm[-1].tolist() == [1024, 2047, 2047, 16, 0, 0] and k[-1].tolist() == [-10, 5, 5, -24, -24, -24]
    if act == qg.BLOCK:
        assert sm[-1, 1:].tolist() == [2047, -2047, sm[-1, 3], 0, 0] and se[-1, 2] == 5, sm[-1].tolist()
    else:
        assert sm is None and se is None    # the K-quants' minimum takes exact code sums
    assert not xq[-1, 4 * act:].any()
    assert xm[3, 1] == 0 and k[3, 1] == -24


@pytest.mark.filterwarnings("ignore:overflow encountered in divide", "ignore:invalid value encountered in multiply")
@pytest.mark.parametrize("kind", ("q4_1", "q4_k", "q6_k"))
def test_inverse_overflow_block(kind, draw):
    """A group with amax below 2^-120 (where 127 / amax would overflow to inf, and 0 inf is NaN)
    and exact zeros in it is a zero group: codes 0, scales 0, and the product is the reference's,
    also on the same x with the zeros replaced by the least subnormal."""
    act = qg.KINDS[kind].act
    x = random_x(draw.gen, 3, 512, torch.float32)
    x[1, 256:512] = torch.randn(256, generator=draw.gen) * 2.0 ** -124
    x[1, 256:512:3] = 0.0
    xq, xm, k, sm, se, kmax = (None if t is None else t.cpu() for t in qt.quantize_activations(x.to(DEVICE), act))
    group = 256 // act
    assert xq[1, 256::3].eq(0).all() and xm[1, group] == 0 and k[1, group] == -24
    assert sm is None or sm[1, 8] == 0
    filled = x.clone()
    filled[1, 256:512:3] = 2.0 ** -149
    w = random_weight(draw.gen, kind, 19, 512)
    same(run(x, w), qg.linear(filled, w), f"{kind} {draw}")


@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
@pytest.mark.parametrize("kind", qg.TYPES)
@pytest.mark.parametrize("m", (1, 3, 17, 64))
def test_bitwise_reference(kind, dtype, m, draw):
    """Every kind, fp32 and bf16, M from 1 to 64 (one to four row tiles), N odd over two column
    tiles, K = 192 (six blocks of 32) or 512 (two super-blocks): bitwise quant_gemm.linear."""
    n, k = 67, k_for(kind, 192)
    w = random_weight(draw.gen, kind, n, k)
    x = random_x(draw.gen, m, k, dtype)
    same(run(x, w), qg.linear(x, w), f"{kind} {dtype} M={m} {draw}")


@pytest.mark.parametrize("kind", qg.TYPES)
def test_row_alone_equals_row_among_others(kind, draw):
    """A row's bits do not depend on how many rows share the call or where it sits among them."""
    n, k = 37, k_for(kind, 96)
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
    activations (group scales below float16's least step: 0); huge activations against the
    largest scales (the group scales saturate at 65504, so the results stay finite); a row with one
    huge block and tiny ones after it (a tiny group's terms round to zero on the grid)."""
    n, k = 33, k_for(kind, 128)
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
    x[3, :32] *= 2.0 ** 100                           # one huge block, the groups after it far below the grid
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
    k_quant = random_weight(torch.Generator().manual_seed(1), "q4_k", 3, 512)
    k_quant.min_exp[1, 9] += 1               # a super-block's blocks must share F (and E)
    with pytest.raises(ValueError, match="one min_exp per super-block"):
        qt.pack_quant_weight(k_quant)
    short = random_weight(torch.Generator().manual_seed(2), "q6_k", 3, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        qt.pack_quant_weight(qg.QuantWeight("q6_k", short.codes[:, :224], short.scale[:, :14], short.scale_exp[:, :7]))


def test_cuda_ops_wiring(draw):
    """cuda_ops.Linear takes a QuantWeight to the Triton kernel (bias added in x's dtype, as for
    dense weights); dense weights still take the dense path."""
    from tensorfold.backends import cuda_ops
    w = random_weight(draw.gen, "q6_k", 21, 256)
    packed = cuda_ops.Linear.of(_to(w, DEVICE))
    assert packed.shape == (21, 256) and packed.single.kind == "q6_k" and packed.format == "q6_k"
    x = random_x(draw.gen, 3, 256, torch.bfloat16)
    bias = torch.randn(21, generator=draw.gen).bfloat16()
    same(packed(x.to(DEVICE)).cpu(), qg.linear(x, w), f"no bias {draw}")
    with_bias = cuda_ops.Linear.of(_to(w, DEVICE), bias=bias.to(DEVICE))
    same(with_bias(x.to(DEVICE)).cpu(), qg.linear(x, w) + bias, f"bias {draw}")
    dense = torch.randn(21, 256, generator=draw.gen).to(DEVICE)
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
