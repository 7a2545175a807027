"""RMSNorm (+ residual add, + rope) and rope in Triton against their torch references: bitwise.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before any
kernel module is imported), patched to compute what the GPU computes (tests/triton_interpreter.py,
for this module only); with one, the same tests run compiled, and the `gpu`-marked test repeats
them at model sizes against the reference run on the CPU. Inputs are fresh random draws on every
run (the seed is in each failure message); outputs are NaN-filled before the launch.

Contract (reference.rms_norm's rule: an exact integer sum of squares, then single IEEE steps in a
fixed order): rms_norm, add_rms_norm (normed and residual), rms_norm_rope and apply_rope equal the
references bit for bit, fp32 and bf16, widths 96 (not a power of two), 576 and 128 (a qwen3
head), a row alone, in a batch or from an unaligned view, and the fused kernels equal the
unfused ones. Rows wider than 8,192 are refused. The reference itself is within 2 ulp (fp32) /
1 ulp (bf16) of a float64 textbook RMSNorm, including rows built against fixed-point sums; two
negative controls show that the bitwise and the ulp checks can fail.
"""

import torch

from kernel_inputs import DEVICE, NAN, gpu  # first: sets TRITON_INTERPRET without a GPU

import pytest  # noqa: E402

from tensorfold.exact import grid  # noqa: E402
from tensorfold.exact.float32 import f32  # noqa: E402
from tensorfold.kernels import reference  # noqa: E402
from tensorfold.kernels import rms_norm_triton as norm  # noqa: E402
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

EPS = 1e-6
WIDTHS = [96, 576, 128]  # not a power of two; a small model's hidden size; a qwen3 head
DTYPES = [torch.float32, torch.bfloat16]



def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, NAN)


def norm_rows(draw, num_rows, n, dtype):
    """Random rows (scale 3), and rows 1-4 at the edges: tiny (1e-30: the mean of squares
    underflows float32), huge (1e15: squares of 1e31, summed below float32's top; the rule's
    float32 finish overflows where the sum of squares passes 3.4e38, |x| ~ 2^57 at 8,192
    columns), all zero, a single nonzero element."""
    x = draw.randn(num_rows, n, scale=3.0)
    x[1] *= 1e-30
    x[2] *= 1e15
    x[3] = 0.0
    x[4] = 0.0
    x[4, n // 3] = -2.5
    return x.to(dtype)


def adversarial_rows(n, dtype):
    """Rows that defeat a fixed-point sum that rounds x itself before squaring: every element's
    rounding error points the same way (one element at 1.0, the rest at t + 0.49 grid steps with
    t ~ 2^19 / sqrt(n)), and a constant row just off the grid; then the largest sum the rule can
    make: every |x| the largest float32 below 2, each square 2^40 - 2^17 on the grid (8,192 of
    them: 2^53 - 2^30)."""
    t = round(2 ** 19 / n ** 0.5)
    skewed = torch.full((n,), (t + 0.49) / 2 ** 19)
    skewed[0] = 1.0
    constant = torch.full((n,), 1.0 + 2 ** -21 + 2 ** -22)
    signs = torch.where(torch.arange(n) % 3 == 0, -1.0, 1.0)
    top = signs * (2.0 - 2.0 ** -23)  # x^2 * 2^38 = 2^40 - 2^17 + 2^-8
    return torch.stack([skewed, constant, top]).to(dtype).to(DEVICE)


def textbook(x, w, eps=EPS):
    """RMSNorm in float64, rounded once to x's dtype."""
    x64 = x.double()
    return (x64 / torch.sqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps) * w.double()).to(x.dtype)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest number of representable values between a and b (same dtype, finite)."""
    int_type, magnitude = {torch.float32: (torch.int32, 0x7FFFFFFF),
                           torch.bfloat16: (torch.int16, 0x7FFF)}[a.dtype]

    def ordered(t):
        bits = t.contiguous().view(int_type).long()
        return torch.where(bits < 0, -(bits & magnitude), bits)
    return int((ordered(a) - ordered(b)).abs().max())


def assert_bitwise(draw, what, got, want):
    assert torch.equal(got, want), (
        f"{draw}: {what}: {int((got != want).sum())} of {got.numel()} differ, "
        f"max |diff| {(got.float() - want.float()).abs().max().item():.3g}")


# ---- the kernels against the references, bitwise ----

@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_bitwise(draw, dtype, n):
    x, w = norm_rows(draw, 9, n, dtype), draw.randn(n, dtype=dtype)
    want = reference.rms_norm(x, w, EPS)
    assert_bitwise(draw, "kernel vs reference", norm.rms_norm(x, w, EPS, out=poisoned(x)), want)
    for row in (0, 2, 4, 8):  # alone: the same bits, in the kernel and in the reference
        assert_bitwise(draw, f"row {row} alone", norm.rms_norm(x[row:row + 1], w, EPS)[0], want[row])
        assert_bitwise(draw, f"reference row {row} alone", reference.rms_norm(x[row:row + 1], w, EPS)[0],
                       want[row])
    unaligned = torch.cat([x.new_zeros(1), x[5]])[1:].view(1, n)  # 2 or 4 bytes past alignment
    assert unaligned.data_ptr() % 16 != 0
    assert_bitwise(draw, "unaligned view", norm.rms_norm(unaligned, w, EPS)[0], want[5])
    as_heads = x[:8].view(2, 4, n)  # [tokens, heads, head_dim], as qwen3's q/k norm calls it
    assert_bitwise(draw, "3-d input", norm.rms_norm(as_heads, w, EPS), want[:8].view(2, 4, n))


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_bitwise(draw, dtype, n):
    x, w = norm_rows(draw, 9, n, dtype), draw.randn(n, dtype=dtype)
    residual = draw.randn(9, n, dtype=dtype)
    normed, h = norm.add_rms_norm(x, residual, w, EPS)
    want_normed, want_h = norm.add_rms_norm_ref(x, residual, w, EPS)
    assert_bitwise(draw, "the fused residual add vs torch's add", h, want_h)
    assert_bitwise(draw, "fused add + norm vs the reference", normed, want_normed)
    assert_bitwise(draw, "fused vs unfused kernels", normed, norm.rms_norm(want_h, w, EPS))


@pytest.mark.parametrize("head_dim", [16, 128, 512])  # 512: Gemma 4's global heads
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_fused_qk_norm_rope_bitwise(draw, dtype, head_dim):
    half = head_dim // 2
    cos, sin = reference.rope_table([1e6 ** (-i / half) for i in range(half)], 1.0, 128)
    positions = draw.randint(128, 5)
    cos, sin = cos[positions].to(DEVICE), sin[positions].to(DEVICE)  # [5, head_dim]
    x = draw.randn(5, 4, head_dim, dtype=dtype, scale=3.0)
    rotated = norm.apply_rope(x, cos, sin, out=poisoned(x))
    assert_bitwise(draw, "rope vs reference", rotated, reference.apply_rope(x, cos, sin))
    w = draw.randn(head_dim, dtype=dtype)
    fused = norm.rms_norm_rope(x, w, EPS, cos, sin)
    assert_bitwise(draw, "fused q/k norm + rope vs reference", fused,
                   norm.rms_norm_rope_ref(x, w, EPS, cos, sin))
    assert_bitwise(draw, "fused vs the two kernels", fused,
                   norm.apply_rope(norm.rms_norm(x, w, EPS), cos, sin))


def test_widest_rows_sum_exactly(draw):
    """8,192 columns of the largest squares the grid holds: the sum is 2^53 - 2^30, still exact."""
    x = torch.cat([adversarial_rows(8192, torch.float32), draw.randn(2, 8192, scale=3.0)])
    w = draw.randn(8192)
    want = reference.rms_norm(x, w, EPS)
    assert_bitwise(draw, "kernel vs reference at 8,192", norm.rms_norm(x, w, EPS), want)
    assert ulp_distance(want, textbook(x, w)) <= 3, f"{draw}"


def test_rows_wider_than_8192_are_refused():
    x, w = torch.ones(2, 8193, device=DEVICE), torch.ones(8193, device=DEVICE)
    for call in (lambda: reference.rms_norm(x, w, EPS), lambda: norm.rms_norm(x, w, EPS),
                 lambda: norm.add_rms_norm(x, x, w, EPS)):
        with pytest.raises(ValueError, match="8192"):
            call()


# ---- what the interpreter cannot show: launch options (the PTX: test_compiled_kernels.py) ----

def test_every_launch_is_exact(monkeypatch):
    """Every launch passes LAUNCH_EXACT (no FMA contraction) and eps as a Python float (the
    kernel declares it float64)."""
    launches = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.kernel, args, kwargs))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("rms_norm_kernel", "rope_kernel"):
        monkeypatch.setattr(norm, name, Spy(getattr(norm, name)))
    x, w = torch.randn(2, 3, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    cos, sin = torch.ones(2, 16, device=DEVICE), torch.zeros(2, 16, device=DEVICE)
    norm.rms_norm(x, w, EPS)
    norm.add_rms_norm(x, x, w, EPS)
    norm.rms_norm_rope(x, w, EPS, cos, sin)
    norm.apply_rope(x, cos, sin)
    assert len(launches) == 4
    for _, args, kwargs in launches:
        assert kwargs["enable_fp_fusion"] is False
    for _, args, _ in launches[:3]:
        assert type(args[7]) is float and args[7] == f32(EPS)  # eps as the float32 the steps add


# ---- the reference: precise, and the checks have teeth ----

@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_within_2_ulp_of_float64(draw, dtype):
    """fp32: within 3 ulp of the float64 textbook norm rounded once; bf16: within 1 ulp (a
    rounding edge). The sum is exact up to half a grid step per square, 2^-39 of the largest
    square, so var is within 2^-26 of the exact mean; then float32 steps (var, its root and
    reciprocal, x inv, times w) round about five times, each half an ulp."""
    for n in WIDTHS + [4096, 8192]:
        x = torch.cat([norm_rows(draw, 16, n, dtype), adversarial_rows(n, dtype)])
        w = draw.randn(n, dtype=dtype)
        got = reference.rms_norm(x, w, EPS)
        limit = 3 if dtype == torch.float32 else 1
        assert ulp_distance(got, textbook(x, w)) <= limit, f"{draw}: width {n}"


def test_precision_check_can_fail():
    """Negative control for the ulp check: the same exact sum over x rounded to NORM_BITS bits
    (grid.to_fixed) before squaring is order-free too, but its error is 2 * x * dx per element,
    all the same sign on the skewed row: hundreds of float32 ulps."""
    n = 576
    x = adversarial_rows(n, torch.float32).cpu()
    w = torch.ones(n)
    x_int, e = grid.to_fixed(x, reference.NORM_BITS)
    var = (x_int * x_int).sum(dim=-1) * grid.pow2(2 * (e - reference.NORM_BITS + 1)) / n
    inv = 1.0 / torch.sqrt(var + EPS)
    rounded_first = (x.double() * inv[:, None]).float() * w
    assert ulp_distance(rounded_first, textbook(x, w)) > 100
    assert ulp_distance(reference.rms_norm(x, w, EPS), textbook(x, w)) <= 3


def test_bitwise_check_can_fail(draw):
    """Negative control for the bitwise checks: a plain float32 norm (torch's order of the sum,
    rsqrt) is within float tolerance of the reference but not bit-identical to it."""
    x, w = draw.randn(64, 576, scale=3.0).cpu(), draw.randn(576).cpu()
    plain = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * w
    want = reference.rms_norm(x, w, EPS)
    torch.testing.assert_close(plain, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(plain, want), f"{draw}: a plain norm gave the exact reference's bits"


# ---- the same checks at model sizes, on a GPU ----

@gpu
@pytest.mark.gpu
def test_gpu_rms_norm_and_rope_model_size(draw):
    """Compiled kernels on CUDA == the references on the CPU, bitwise (llama-8B hidden size,
    qwen3's 32 heads of 128)."""
    x, w = draw.randn(257, 4096, dtype=torch.bfloat16), draw.randn(4096, dtype=torch.bfloat16)
    got = norm.rms_norm(x, w, 1e-6)
    assert_bitwise(draw, "rms_norm", got.cpu(), reference.rms_norm(x.cpu(), w.cpu(), 1e-6))
    assert_bitwise(draw, "row alone", norm.rms_norm(x[100:101], w, 1e-6)[0], got[100])
    residual = draw.randn(257, 4096, dtype=torch.bfloat16)
    normed, h = norm.add_rms_norm(x, residual, w, 1e-6)
    want_normed, want_h = norm.add_rms_norm_ref(x.cpu(), residual.cpu(), w.cpu(), 1e-6)
    assert_bitwise(draw, "residual", h.cpu(), want_h)
    assert_bitwise(draw, "add_rms_norm", normed.cpu(), want_normed)
    cos, sin = reference.rope_table([1e6 ** (-i / 64) for i in range(64)], 1.0, 4096)
    positions = draw.randint(4096, 257)
    cos, sin = cos[positions], sin[positions]
    q = draw.randn(257, 32, 128, dtype=torch.bfloat16)
    qw = draw.randn(128, dtype=torch.bfloat16)
    cos_d, sin_d = cos.to(DEVICE), sin.to(DEVICE)
    assert_bitwise(draw, "rope", norm.apply_rope(q, cos_d, sin_d).cpu(),
                   reference.apply_rope(q.cpu(), cos, sin))
    assert_bitwise(draw, "rms_norm_rope", norm.rms_norm_rope(q, qw, 1e-6, cos_d, sin_d).cpu(),
                   norm.rms_norm_rope_ref(q.cpu(), qw.cpu(), 1e-6, cos, sin))
