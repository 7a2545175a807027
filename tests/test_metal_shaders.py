"""The Metal shaders of metal/, compiled on Linux as C++ against metal/metal_compat.h
(tensorfold/mlx/metal_cpu.py), against their torch references, bit for bit.

Every body a Mac would hand to mx.fast.metal_kernel runs here unchanged, through the same launch
sequences (tensorfold/mlx/metal.py: paged_attention, quant_matmul, sample_rows, verify_rows), and
its outputs are compared bitwise with the reference that defines them:

- the helpers first, on many random bit patterns: the software float64 (add, sub, mul, div,
  conversions) against the CPU's IEEE float64, exp64/log64 against tensorfold/exact/float64.py;
  div_rn against IEEE float32 division, float32_of_int, half_parts and exp_neg against their
  torch steps;
- quantize_activations and quant_gemm against kernels/quant_gemm.py, every kind;
- the three attention kernels against kernels/paged_attention.py: prefill and decode rows, GQA,
  several sequence lengths, shuffled block tables, a sliding window, float32/bf16/fp16 caches;
- the sampler kernels against sampling/sampler.sample: greedy, free and top-k/top-p/min-p rows,
  bitmasks, several chunks, heads that must grow;
- token_bitmask and verify_accept against verify_triton's references.
Each comparison is shown able to fail: a perturbed input changes the bits the test compares.
Outputs start as 0xFF bytes, so an element a kernel leaves unwritten shows.
"""
import ctypes
import math
import platform

import numpy as np
import pytest
import torch

from tensorfold.mlx import metal_cpu

pytestmark = pytest.mark.skipif(metal_cpu.compiler() is None, reason="needs g++ to compile the shaders")

from tensorfold.exact import float32 as ref32, float64 as ref64  # noqa: E402
from tensorfold.exact.grid import pow2  # noqa: E402
from tensorfold.kernels import paged_attention as pa, quant_gemm as qg, verify_triton  # noqa: E402
from tensorfold.mlx import metal, metal_kernels  # noqa: E402
from tensorfold.sampling import bitmask as bits, sampler  # noqa: E402
from tensorfold.sampling.params import RowSampling  # noqa: E402

ARRAYS = metal_cpu.TorchArrays()


@pytest.fixture(scope="module")
def shaders():
    return metal_cpu.build()


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    diff = a.contiguous().view(ints) != b.contiguous().view(ints)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {a.numel()} differ, first at {diff.nonzero()[:3].tolist()}"


# ---- the helpers, through a probe library of the same headers ----

PROBES = """
extern "C" {
void p_add(const ulong* a, const ulong* b, ulong* o, long n) { for (long i = 0; i < n; ++i) o[i] = f64_add(a[i], b[i]); }
void p_sub(const ulong* a, const ulong* b, ulong* o, long n) { for (long i = 0; i < n; ++i) o[i] = f64_sub(a[i], b[i]); }
void p_mul(const ulong* a, const ulong* b, ulong* o, long n) { for (long i = 0; i < n; ++i) o[i] = f64_mul(a[i], b[i]); }
void p_div(const ulong* a, const ulong* b, ulong* o, long n) { for (long i = 0; i < n; ++i) o[i] = f64_div(a[i], b[i]); }
void p_exp64(const ulong* a, ulong* o, long n) { for (long i = 0; i < n; ++i) o[i] = exp64(a[i]); }
void p_log64(const ulong* a, ulong* o, long n) { for (long i = 0; i < n; ++i) o[i] = log64(a[i]); }
void p_of_f32(const float* a, ulong* o, long n) { for (long i = 0; i < n; ++i) o[i] = f64_of_f32(a[i]); }
void p_of_long(const long* a, ulong* o, long n) { for (long i = 0; i < n; ++i) o[i] = f64_of_long(a[i]); }
void p_div32(const float* a, const float* b, float* o, long n) { for (long i = 0; i < n; ++i) o[i] = div_rn(a[i], b[i]); }
void p_exp_neg(const float* a, float* o, long n) { for (long i = 0; i < n; ++i) o[i] = exp_neg(a[i]); }
void p_f32_of_int(const long* a, const int* g, float* o, long n) { for (long i = 0; i < n; ++i) o[i] = float32_of_int(a[i], g[i]); }
void p_half(const float* a, int* m, int* e, long n) {
  for (long i = 0; i < n; ++i) { Significand s = half_parts(a[i]); m[i] = int(s.m); e[i] = s.e; }
}
}
"""


@pytest.fixture(scope="module")
def probe():
    text = (metal_kernels.SHADER_DIR / "metal_compat.h").read_text() + metal_kernels.header_source() + PROBES
    return metal_cpu.compile_library(text)


def call(lib, name, *tensors):
    """Run a probe over equal-length 1-D tensors (the last ones are outputs)."""
    getattr(lib, name)(*[ctypes.c_void_p(t.data_ptr()) for t in tensors], ctypes.c_long(tensors[0].numel()))


def random_f64(gen: torch.Generator, n: int) -> torch.Tensor:
    """float64 bit patterns: random ones, exponents near each other (cancellation), subnormals,
    zeros of both signs, infinities, the largest finite values."""
    words = torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), generator=gen, dtype=torch.int64)
    narrow = (words & ~(0x7FF << 52)) | ((1023 + torch.randint(-3, 4, (n,), generator=gen)) << 52)
    sub = words & 0x800FFFFFFFFFFFFF
    pick = torch.randint(0, 4, (n,), generator=gen)
    x = torch.where(pick == 0, words, torch.where(pick == 1, narrow, torch.where(pick == 2, sub, words >> 8)))
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1.0, -1.0, 2.0 ** -1074, 1.7976931348623157e308,
                             2.0 ** -1022, 0.5], dtype=torch.float64).view(torch.int64)
    x[:len(specials)] = specials
    return x.view(torch.float64)


def test_soft_float64_is_ieee(probe):
    """f64_add, f64_sub, f64_mul, f64_div give the CPU's IEEE float64 bits (round half to even,
    subnormals, overflow, signed zeros), on random patterns and every pair of the specials."""
    gen = torch.Generator().manual_seed(1)
    n = 200_000
    a, b = random_f64(gen, n), random_f64(gen, n)
    b[:100] = a[:100].neg()          # exact cancellation: +0
    b[100:200] = a[100:200] * 2 ** -53 * 3
    sp = a[:10].repeat_interleave(10)
    a[200:300], b[200:300] = sp, a[:10].repeat(10)
    ua, ub = a.view(torch.uint64), b.view(torch.uint64)
    with np.errstate(all="ignore"):
        for name, op in (("p_add", np.add), ("p_sub", np.subtract), ("p_mul", np.multiply), ("p_div", np.divide)):
            out = torch.empty(n, dtype=torch.uint64)
            call(probe, name, ua, ub, out)
            want = torch.from_numpy(op(a.numpy(), b.numpy()))
            got = out.view(torch.float64)
            nan = want.isnan()
            assert torch.equal(got.isnan(), nan), name
            same_bits(got[~nan], want[~nan], name)


def test_soft_float64_exp_log_conversions(probe):
    """exp64 and log64 in software float64 give exact/float64.py's bits (whose own tests tie them
    to fdlibm's); float32 -> float64 and int64 -> float64 are the exact conversions."""
    gen = torch.Generator().manual_seed(2)
    x = -torch.rand(100_000, generator=gen, dtype=torch.float64) * 800
    x[:6] = torch.tensor([0.0, -0.0, -745.1, -746.0, -math.inf, -1e-300], dtype=torch.float64)
    out = torch.empty_like(x).view(torch.uint64)
    call(probe, "p_exp64", x.view(torch.uint64), out)
    same_bits(out.view(torch.float64), ref64.exp64(x), "exp64")
    y = torch.cat([torch.rand(50_000, generator=gen, dtype=torch.float64) * 40,
                   (torch.rand(50_000, generator=gen, dtype=torch.float64) * 2 ** -1000),
                   torch.tensor([2.0 ** -53, 0.0, math.inf, -1.0, 2.0 ** -1074, 1.0], dtype=torch.float64)])
    out = torch.empty_like(y).view(torch.uint64)
    call(probe, "p_log64", y.view(torch.uint64), out)
    want = ref64.log64(y)
    assert torch.equal(out.view(torch.float64).isnan(), want.isnan())
    same_bits(out.view(torch.float64)[~want.isnan()], want[~want.isnan()], "log64")
    f = torch.randn(10_000, generator=gen) * 2.0 ** torch.randint(-160, 120, (10_000,), generator=gen).float()
    f[:4] = torch.tensor([math.inf, -math.inf, -0.0, 2.0 ** -149])
    out = torch.empty(f.numel(), dtype=torch.uint64)
    call(probe, "p_of_f32", f, out)
    same_bits(out.view(torch.float64), f.double(), "float32 -> float64")
    i = torch.randint(-2 ** 62, 2 ** 62, (10_000,), generator=gen) >> torch.randint(0, 62, (10_000,), generator=gen)
    out = torch.empty(i.numel(), dtype=torch.uint64)
    call(probe, "p_of_long", i, out)
    same_bits(out.view(torch.float64), i.double(), "int64 -> float64")


def test_float32_helpers(probe):
    """div_rn is IEEE float32 division (numpy's); float32_of_int is float32(float64(t) 2^g) and
    exp_neg exact/float32.exp_neg, bitwise; half_parts is quant_gemm.significand(float16(v))."""
    gen = torch.Generator().manual_seed(3)
    n = 200_000
    a = (random_f64(gen, n).view(torch.int64) >> 32).to(torch.int32).view(torch.float32)
    b = (random_f64(gen, n).view(torch.int64) >> 32).to(torch.int32).view(torch.float32)
    b[:1000] = a[:1000] * torch.randint(1, 9, (1000,), generator=gen).float()  # exact quotients
    out = torch.empty(n)
    call(probe, "p_div32", a, b, out)
    with np.errstate(all="ignore"):
        want = torch.from_numpy(a.numpy() / b.numpy())
    assert torch.equal(out.isnan(), want.isnan())
    same_bits(out[~want.isnan()], want[~want.isnan()], "div_rn")

    t = torch.randint(-2 ** 61, 2 ** 61, (n,), generator=gen) >> torch.randint(0, 61, (n,), generator=gen)
    g = torch.randint(-220, 80, (n,), generator=gen, dtype=torch.int32)
    out = torch.empty(n)
    call(probe, "p_f32_of_int", t, g, out)
    same_bits(out, (t.double() * pow2(g)).float(), "float32_of_int")

    x = -torch.rand(n, generator=gen) * 100
    x[:3] = torch.tensor([-math.inf, -87.0, 0.0])
    out = torch.empty(n)
    call(probe, "p_exp_neg", x, out)
    same_bits(out, ref32.exp_neg(x), "exp_neg")

    v = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-30, 16, (n,), generator=gen).float()
    v = v.clamp(-qg.F16_MAX, qg.F16_MAX)
    m, e = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
    call(probe, "p_half", v, m, e)
    want_m, want_e = qg.significand(v.half())
    same_bits(m, want_m, "half_parts m")
    same_bits(e, want_e, "half_parts e")


# ---- the quantized GEMM ----

CODES = {"q8_0": (-128, 127), "q4_0": (-8, 7), "q4_1": (0, 15), "q4_k": (0, 15), "q5_k": (0, 31), "q6_k": (-32, 31),
         "q5_1": (0, 31)}
SCALE_BOUND = {"q8_0": 2 ** 11, "q4_0": 2 ** 11, "q4_1": 2 ** 11, "q4_k": 2 ** 11 * 63, "q5_k": 2 ** 11 * 63,
               "q6_k": 2 ** 11 * 128, "q5_1": 2 ** 11}


def random_weight(gen: torch.Generator, kind: str, n: int, k: int) -> qg.QuantWeight:
    """Valid random fields of `kind`: codes at their extremes somewhere, scales up to their bound
    and small ones, zero scales and minima, exponents over float16's range (-24..5), one per
    activation group (the K-quants' super-blocks: as their files keep them)."""
    spec = qg.KINDS[kind]
    lo, hi = CODES[kind]
    codes = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int8)
    codes[0, :16], codes[-1, :16] = lo, hi

    def ints(shape):
        bound = SCALE_BOUND[kind]
        v = torch.randint(-bound + 1, bound, shape, generator=gen, dtype=torch.int32)
        v = torch.where(torch.rand(shape, generator=gen) < 0.3, v >> torch.randint(0, 16, shape, generator=gen,
                                                                                  dtype=torch.int32), v)
        v[torch.rand(shape, generator=gen) < 0.1] = 0
        v.view(-1)[0] = bound - 1
        return v

    def exps(shape):
        e = torch.randint(-24, 6, (shape[0], shape[1] // spec.blocks_per_group), generator=gen, dtype=torch.int32)
        e.view(-1)[0], e.view(-1)[-1] = 5, -24
        return e.repeat_interleave(spec.blocks_per_group, dim=1)

    nb = k // 32
    if not spec.has_min:
        return qg.QuantWeight(kind, codes, ints((n, k // spec.sub)), exps((n, nb)))
    return qg.QuantWeight(kind, codes, ints((n, k // spec.sub)), exps((n, nb)), ints((n, nb)), exps((n, nb)))


def random_x(gen: torch.Generator, m: int, k: int) -> torch.Tensor:
    """Rows over ~35 binades and blocks within a row over ~16; a zero block, a subnormal block
    (zero: m = 0), an outlier, exact ties of x 127 / amax, a saturated and a float16-subnormal scale."""
    row_scale = 2.0 ** torch.randint(-12, 23, (m, 1), generator=gen).double()
    block_scale = 2.0 ** torch.randint(-8, 9, (m, k // 32), generator=gen).double().repeat_interleave(32, dim=1)
    x = (torch.randn(m, k, generator=gen, dtype=torch.float64) * row_scale * block_scale).float()
    x[0, :32] = 0.0
    x[-1, 64:96] = torch.randn(32, generator=gen) * 2.0 ** -135
    x[-1, 5] = 1e4 * x[-1].abs().max()
    x[1, :32] = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 126.5] + [0.25 * j for j in range(24)])
    x[1, 32:64] = 1e7
    x[1, 96:128] = 127 * 2.0 ** -20 * torch.linspace(-1, 1, 32)
    return x


def run_quant(shaders, x: torch.Tensor, w: qg.QuantWeight) -> torch.Tensor:
    fields = metal.quant_fields(ARRAYS, w, lambda t: t)
    return metal.quant_matmul(shaders, ARRAYS, x.float(), w, fields).to(x.dtype)


@pytest.mark.parametrize("act", [32, 256])
def test_quantize_activations(shaders, act):
    """Step 1 alone, per group of 32 and of 256: xq, (m, k), (sm, se) where the reference has them equal
    quant_gemm.quantize_activations' and xsum the exact sums of its xq per block (zero and
    subnormal groups, ties, saturated and subnormal float16 scales, a tiny non-zero group)."""
    gen = torch.Generator().manual_seed(4)
    x = random_x(gen, 5, 512)
    x[2, :256] = torch.tensor([2.0 ** -126] + [2.0 ** -149] * 255)  # below 2^-120: a zero group
    x[3, :256] = 2.0 ** -119 * torch.linspace(-1, 1, 256)           # just above it
    x[4, :256] = torch.arange(-128, 128) * 0.5                      # exact ties of x 127 / amax...
    x[4, 0] = 127.0                                                 # ...with amax 127 in both groupings
    groups = 512 // act
    out = shaders.run("quantize_activations", [x], [5, groups],
                      [((5, 512), torch.int8)] + [((5, groups), torch.int32)] * 2 + [((5, 16), torch.int32)] * 3,
                      (groups, 5, 1), {"ACT": act})
    want = qg.quantize_activations(x, act)
    want += (want[0].to(torch.int32).reshape(5, 16, 32).sum(dim=-1, dtype=torch.int32),)
    for got, ref, name in zip(out, want, ("xq", "m", "k", "sm", "se", "xsum")):
        if ref is not None:  # (sm, se): the 32-column groups' only; the K-quants' minimum takes xsum
            same_bits(got, ref, f"{name} (act {act})")


@pytest.mark.parametrize("kind", qg.TYPES)
def test_quant_gemm(shaders, kind):
    """x @ w^T equals quant_gemm.linear bitwise for every kind (fp32 and bf16 activations, one row
    and several, all-zero rows), and a changed code changes it."""
    gen = torch.Generator().manual_seed(5 + qg.TYPES.index(kind))
    n, k = 24, 256
    w = random_weight(gen, kind, n, k)
    for m in (1, 7):
        x = random_x(gen, max(m, 2), k)[:m]
        same_bits(run_quant(shaders, x, w), qg.linear(x, w), f"{kind} m={m}")
    xb = random_x(gen, 3, k).bfloat16()
    same_bits(run_quant(shaders, xb, w), qg.linear(xb, w), f"{kind} bf16")
    zero = torch.zeros(2, k)
    same_bits(run_quant(shaders, zero, w), qg.linear(zero, w), f"{kind} zeros")
    x = random_x(gen, 4, k)
    moved = qg.QuantWeight(kind, w.codes.clone(), w.scale, w.scale_exp, w.min, w.min_exp)
    lo, hi = CODES[kind]
    moved.codes[3] = torch.where(moved.codes[3] == hi, lo, hi)  # weight row 3's codes flipped
    assert not torch.equal(run_quant(shaders, x, moved)[:, 3], qg.linear(x, w)[:, 3]), "the codes must count"


def test_quant_gemm_refuses_a_k_quant_whose_exponent_moves_within_a_super_block(shaders):
    """One E per super-block is what lets its terms add before rounding: the launch refuses others."""
    w = random_weight(torch.Generator().manual_seed(12), "q4_k", 4, 512)
    w.scale_exp[1, 3] += 1
    with pytest.raises(ValueError, match="one scale_exp per super-block"):
        run_quant(shaders, torch.randn(2, 512), w)


def test_quant_gemm_extremes(shaders):
    """Huge activations against the largest scales (saturated float16 block scales), subnormal
    activations against the smallest scales, one huge block beside tiny ones (terms off the grid)."""
    gen = torch.Generator().manual_seed(11)
    for kind in ("q4_1", "q6_k", "q4_k"):
        w = random_weight(gen, kind, 16, 512)
        x = torch.randn(4, 512, generator=gen)
        x[0] *= 2.0 ** -140
        x[1] *= 2.0 ** 120
        x[2, :256] *= 2.0 ** 100  # a whole group (of 32 or 256) huge, the next ones tiny
        x[2, 256:] *= 2.0 ** -100
        same_bits(run_quant(shaders, x, w), qg.linear(x, w), f"{kind} extremes")
        big = random_weight(gen, kind, 16, 256)
        big.scale_exp.fill_(5)
        huge = torch.randn(2, 256, generator=gen).clamp(-3.9, 3.9) * 2.0 ** 126
        y = run_quant(shaders, huge, big)
        assert y.isfinite().all()
        same_bits(y, qg.linear(huge, big), f"{kind} huge")


# ---- paged attention ----

def paged_cache(gen: torch.Generator, lengths: list[int], kv_heads: int, dim: int, dtype, block_size: int = 4,
                scale: float = 1.0):
    """K/V of sequences of `lengths` written by write_kv_ref into shuffled blocks of a paged cache;
    returns (k_cache, v_cache, tables). Some vectors tiny (subnormal range), one all zero."""
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n].clone())
        at += n
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))  # unwritten slots: never read
    for n, table in zip(lengths, tables):
        k = torch.randn(n, kv_heads, dim, generator=gen) * scale * 2.0 ** torch.randint(-4, 5, (n, kv_heads, 1),
                                                                                       generator=gen)
        v = torch.randn(n, kv_heads, dim, generator=gen) * 2.0 ** torch.randint(-6, 7, (n, kv_heads, 1), generator=gen)
        if n > 2:
            k[1] *= 2.0 ** -130
            v[2] = 0.0
        slots = table[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        pa.write_kv_ref(k_cache, v_cache, k.to(dtype), v.to(dtype), slots)
    return k_cache, v_cache, tables


def run_attention(shaders, q, k_cache, v_cache, positions, row_seq, tables, scale, window):
    table = pa.pad_block_tables(tables).to(torch.int32)
    num_keys = int(positions.max()) + 1
    out = metal.paged_attention(shaders, ARRAYS, q.float(), k_cache, v_cache, positions.to(torch.int32),
                                row_seq.to(torch.int32), table, scale, window, num_keys)
    return out.to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_prefill(shaders, dtype, window):
    """Prefill rows of one sequence (a whole prompt, and a chunk after a cached prefix) equal
    paged_attention_ref bitwise: GQA (6 heads on 2), shuffled blocks, tiny and zero vectors."""
    gen = torch.Generator().manual_seed(20)
    heads, kv_heads, dim = 6, 2, 16
    k_cache, v_cache, tables = paged_cache(gen, [23], kv_heads, dim, dtype)
    scale = dim ** -0.5
    for positions in (torch.arange(23), torch.arange(17, 23), torch.tensor([0])):
        q = (torch.randn(len(positions), heads, dim, generator=gen) * 4).to(dtype)
        got = run_attention(shaders, q, k_cache, v_cache, positions, torch.zeros(len(positions)), tables, scale, window)
        want = pa.paged_attention_ref(q, k_cache, v_cache, positions, tables[0], scale, window)
        same_bits(got, want, f"prefill {dtype} window={window} rows={len(positions)}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_decode(shaders, dtype):
    """One decode row per sequence over sequences of several lengths (1 to 41 keys, head_dim 64)
    equals paged_decode_attention_ref bitwise; a changed v in one sequence changes only its row."""
    gen = torch.Generator().manual_seed(21)
    heads, kv_heads, dim = 8, 2, 64
    lengths = [1, 5, 17, 41]
    k_cache, v_cache, tables = paged_cache(gen, lengths, kv_heads, dim, dtype, scale=8.0)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    positions = torch.tensor(lengths) - 1
    rows = torch.arange(len(lengths))
    got = run_attention(shaders, q, k_cache, v_cache, positions, rows, tables, 0.125, None)
    want = pa.paged_decode_attention_ref(q, k_cache, v_cache, positions, tables, 0.125)
    same_bits(got, want, f"decode {dtype}")
    block = int(tables[2][1])
    v_cache[block, 0] = v_cache[block, 0] * 2  # a key of sequence 2
    moved = run_attention(shaders, q, k_cache, v_cache, positions, rows, tables, 0.125, None)
    assert not torch.equal(moved[2], got[2]), "sequence 2's keys must count"
    same_bits(moved[[0, 1, 3]], got[[0, 1, 3]], "other sequences untouched")


def test_paged_attention_kernels_alone(shaders):
    """attention_scores alone: q.k (exact) times scale, -inf past each row, and the v exponents,
    as the reference computes them."""
    gen = torch.Generator().manual_seed(22)
    k_cache, v_cache, tables = paged_cache(gen, [9], 1, 8, torch.float32)
    q = torch.randn(3, 2, 8, generator=gen)
    positions = torch.tensor([2, 5, 8], dtype=torch.int32)
    table = tables[0].to(torch.int32).view(1, -1)
    dims = [3, 2, 1, 8, 4, table.shape[1], 9, 0]
    scores, v_exp = shaders.run("attention_scores", [q, positions, torch.zeros(3, dtype=torch.int32), table, k_cache,
                                                     v_cache], dims + [0.25],
                                [((3, 2, 9), torch.float32), ((3, 2, 9), torch.int32)], (9, 2, 3),
                                {"KV": torch.float32})
    keys = pa._gather(k_cache, table.long())[0, 0, :9]              # [9, 8] float64, on grid
    q_int, q_exp = pa.to_fixed(q, pa.QK_BITS)
    q_grid = q_int * pow2(q_exp - pa.QK_BITS + 1).unsqueeze(-1)     # the reference's q grid
    want = (q_grid @ keys.T).float() * ref32.f32(0.25)              # exact dots, one rounding
    want = want.masked_fill(torch.arange(9).view(1, 1, 9) > positions.view(3, 1, 1), -math.inf)
    same_bits(scores, want, "scores")
    same_bits(v_exp[0, 0, :3], pa.v_exponents(pa._gather(v_cache, table.long())[0, 0, :3]), "v exponents")


# ---- the keyed sampler and grammar-masked verification ----

VOCAB = 5000  # two chunks of metal_kernels.SAMPLER_CHUNK


def sampler_rows(seed: int) -> list[RowSampling]:
    """Greedy, free (temperature, min_p) and ordered (top-k, top-p, both, with min_p) rows."""
    settings = [(0.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 0, 1.0, 0.05), (0.8, 40, 1.0, 0.0),
                (1.0, 0, 0.9, 0.0), (0.9, 200, 0.95, 0.02), (1.0, 0, 0.0, 0.0), (2.0, 3000, 0.999, 0.0),
                (0.0, 0, 1.0, 0.0)]
    return [RowSampling(t, k, p, mp, seed + i, 7 + i) for i, (t, k, p, mp) in enumerate(settings)]


def sampler_logits(gen: torch.Generator, num_rows: int) -> torch.Tensor:
    """Logits with -inf tokens, a flat row (its nucleus runs past small heads) and tied maxima in
    both chunks (greedy: the lower id)."""
    x = torch.randn(num_rows, VOCAB, generator=gen) * 3
    x[torch.rand(num_rows, VOCAB, generator=gen) < 0.02] = -math.inf
    if num_rows > 8:
        x[7] = torch.randn(VOCAB, generator=gen) * 0.01
        x[8, 4500] = x[8, 120] = x[8].max() + 1.0
    return x


@pytest.mark.parametrize("masked", [False, True])
def test_keyed_sampler(shaders, masked):
    """Tokens equal sampler.sample's, with heads of 16 candidates (so rows must grow them to 128
    and the whole row, as the reference does) and of 1,024; with and without a grammar bitmask."""
    gen = torch.Generator().manual_seed(30 + masked)
    rows = sampler_rows(100)
    logits = sampler_logits(gen, len(rows))
    bitmask = None
    if masked:
        allowed = torch.rand(len(rows), VOCAB, generator=gen) < 0.6
        allowed[8, [120, 4500]] = True
        bitmask = bits.pack(allowed)
    for num_candidates in (16, sampler.NUM_CANDIDATES):
        got = metal.sample_rows(shaders, ARRAYS, logits, rows, bitmask, num_candidates)
        assert got == sampler.sample(logits, rows, num_candidates, bitmask=bitmask), f"{num_candidates} candidates"
    assert got[8] == 120 or masked, "greedy ties go to the lower id"
    moved = [RowSampling(r.temperature, r.top_k, r.top_p, r.min_p, r.seed + 1000, r.position) for r in rows]
    assert metal.sample_rows(shaders, ARRAYS, logits, moved, bitmask) != got, "the seed must count"


def test_sampler_token_arithmetic(shaders):
    """sampler_tokens alone: every token's key (q = floor(exp64(z - m) 2^32) and id) and noisy
    score z + gumbel are the reference's float64 bits (sampler._keys, _scores)."""
    gen = torch.Generator().manual_seed(32)
    rows = sampler_rows(200)[1:6]
    logits = sampler_logits(gen, len(rows))
    num_chunks = 2
    dims = [len(rows), VOCAB, 0, num_chunks]
    mask = torch.zeros(1, dtype=torch.int32)
    chunk_max, = shaders.run("sampler_chunk_max", [logits, mask], dims, [((len(rows), num_chunks), torch.float32)],
                             (num_chunks, len(rows), 1), {"HAS_MASK": False})
    temps = torch.tensor([metal._f64_word(r.temperature) for r in rows], dtype=torch.uint64)
    keys_in = torch.tensor([metal.keyed.row_key(r.seed, r.position) for r in rows], dtype=torch.uint64)
    mode = torch.ones(len(rows), dtype=torch.int32)
    keys, scores = shaders.run("sampler_tokens", [logits, mask, chunk_max, temps, keys_in, mode], dims,
                               [((len(rows), VOCAB), torch.int64), ((len(rows), VOCAB), torch.uint64)],
                               (VOCAB, len(rows), 1), {"HAS_MASK": False})
    z = sampler._scaled(logits, rows)
    ids = torch.arange(VOCAB).view(1, -1)
    _, want_keys = sampler._keys(z, z.amax(dim=1, keepdim=True), ids)
    same_bits(keys, want_keys, "keys")
    want_scores = sampler._scores(z, rows, ids)
    drawable = want_keys >= 0
    same_bits(scores.view(torch.float64)[drawable], want_scores[drawable], "scores")


def test_sampler_errors(shaders):
    """A row with nothing drawable and a logit / temperature that overflows are refused, as the
    reference refuses them."""
    rows = sampler_rows(0)[:2]
    logits = torch.randn(2, 64)
    logits[1] = -math.inf
    with pytest.raises(ValueError, match="no drawable"):
        metal.sample_rows(shaders, ARRAYS, logits, rows)
    logits[1, 3] = 3e38
    tiny = [rows[0], RowSampling(1e-300, 0, 1.0, 0.0, 1, 1)]
    with pytest.raises(ValueError, match="temperature"):
        metal.sample_rows(shaders, ARRAYS, logits, tiny)


def test_grammar_masked_verification(shaders):
    """Draws and accepted lengths equal verify_ref's on grammar-masked rows (paths accepted whole,
    cut at a wrong draft, and ending at a bonus row without a draft); the masked logits equal
    apply_token_bitmask_ref's."""
    gen = torch.Generator().manual_seed(33)
    rows = sampler_rows(300)[:8]
    logits = sampler_logits(gen, len(rows))
    allowed = torch.rand(len(rows), VOCAB, generator=gen) < 0.7
    bitmask = bits.pack(allowed)
    same_bits(metal.masked_logits(shaders, ARRAYS, logits, bitmask),
              verify_triton.apply_token_bitmask_ref(logits, bitmask), "masked logits")
    draws = sampler.sample(logits, rows, bitmask=bitmask)
    drafts = list(draws)
    drafts[2] = -1                          # path 0 (rows 0-2): accepted whole, row 2 the bonus
    drafts[4] = (draws[4] + 1) % VOCAB      # path 1 (rows 3-5): cut at its second row
    drafts[7] = -1                          # path 2 (rows 6-7)
    path_starts = [0, 3, 6, 8]
    got = metal.verify_rows(shaders, ARRAYS, logits, bitmask, drafts, path_starts, rows)
    want = verify_triton.verify_ref(logits, bitmask, drafts, path_starts, rows)
    assert got == (list(want[0]), want[1]) and got[1] == [2, 1, 1]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="contracts with x86's -mfma")
def test_contraction_would_change_bits():
    """Why the shaders forbid contraction (metal/exact32.metal.h; -ffp-contract=off here): the same
    exp_neg compiled with a * b + c fused into FMAs gives other bits than the reference, and this
    comparison sees it."""
    text = (metal_kernels.SHADER_DIR / "metal_compat.h").read_text() + metal_kernels.header_source() + PROBES
    fused = tuple(f for f in metal_cpu.FLAGS if f != "-ffp-contract=off") + ("-ffp-contract=fast", "-mfma")
    lib = metal_cpu.compile_library(text, fused)
    x = -torch.rand(200_000, generator=torch.Generator().manual_seed(6)) * 80
    out = torch.empty_like(x)
    call(lib, "p_exp_neg", x, out)
    assert not torch.equal(out, ref32.exp_neg(x)), "fused multiply-adds round once where the reference rounds twice"


@pytest.mark.skipif(platform.system() == "Darwin", reason="off macOS only")
def test_metal_entry_points_are_macos_only():
    """Off macOS the Metal entry points say so instead of running anything."""
    assert metal.available() is False
    with pytest.raises(RuntimeError, match="Metal is not available"):
        metal.sample(None, [])
