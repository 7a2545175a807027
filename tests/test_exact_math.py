"""exact/float64.py's exp64 / log64, the sampler's libm-free float64 exp and log.

- Accuracy: within 2 ulp of Python's math.exp / math.log (libm, itself within about half an ulp)
  over wide random ranges and at the edges (measured: at most 1 ulp apart; against a 200-bit
  mpmath reference, under 0.82 ulp for exp and 0.75 ulp for log).
- Exactness: the Triton spelling (exact_triton) gives the same bits as the torch one, here in
  Triton's interpreter (on a GPU, compiled), launched as the sampler launches its kernels; and the
  torch version gives the same bits for an element alone or among others.
Inputs are fresh random draws on every run; the seed is in each failure message.
"""
import math

import torch

from kernel_inputs import DEVICE, NAN  # first: sets TRITON_INTERPRET without a GPU

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tensorfold.exact import float64  # noqa: E402
from tensorfold.kernels import exact_triton as ex  # noqa: E402
from tensorfold.kernels import sampling_triton  # noqa: E402
from tensorfold.sampling import keyed  # noqa: E402
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

INF = float("inf")
TINY = 2.0 ** -1022
SUBNORMAL_MIN = 2.0 ** -1074

EXP_EDGES = [0.0, -0.0, -1e-300, -2.0 ** -1074, -1e-17, -0.5, -math.log(2) / 2, -math.log(2),
             -1.0, -22.18, -87.0, -700.0, -708.0, -708.4, -709.0, -720.0, -744.0, -745.0,
             -745.13, -745.1332191019412, -745.14, -745.2, -746.0, -746.1, -1000.0, -1e300,
             -1.7976931348623157e308, -INF, 1e-300, 0.5, 1.0, 10.0, 100.0, 650.0]
LOG_EDGES = [SUBNORMAL_MIN, 2 * SUBNORMAL_MIN, 1e-320, TINY / 2, TINY - SUBNORMAL_MIN, TINY,
             2.0 ** -53, 1.1102230246251565e-16, 1e-10, 0.5, math.sqrt(0.5), 0.7071067811865476,
             1 - 2.0 ** -53, 1.0, 1 + 2.0 ** -52, math.sqrt(2), 1.4142135623730951, 2.0, math.e,
             36.7368005696771, 40.0, 1e10, 1e300, 1.7976931348623157e308]



def f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between finite float64s of the same sign (or 0)."""
    return (got.view(torch.int64) - want.view(torch.int64)).abs()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, any NaN equal to any NaN (payloads are not part of the contract)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int64),
                                                            b[~nan].view(torch.int64))


def exp_inputs(draw, n=40_000):
    """x <= 0 over the whole range, dense near 0 (where the sampler's weights live), a few x > 0."""
    u = lambda m: draw.rand(m, dtype=torch.float64)  # noqa: E731
    return torch.cat([-u(n) * 746.5, -u(n) * 30, -u(n), -torch.exp2(-u(n) * 60), u(n // 4) * 650, f64(EXP_EDGES)])


def log_inputs(draw, n=40_000):
    """Positive x over the whole range (log-uniform from 2^-1074 up), (0, 1) and (0, 40] for the
    Gumbel noise, and near 1."""
    u = lambda m: draw.rand(m, dtype=torch.float64)  # noqa: E731
    return torch.cat([torch.exp2(u(n) * 2098 - 1074), u(n), u(n) * 40, 1 + (u(n) - 0.5) * 2.0 ** -20, f64(LOG_EDGES)])


# ---- accuracy against libm ----

def test_exp64_within_2_ulp_of_libm(draw):
    x = exp_inputs(draw)
    got = float64.exp64(x)
    want = f64([math.exp(v) for v in x.tolist()])
    err = ulps(got, want)
    worst = int(err.argmax())
    assert err.max() <= 2, f"{draw}: exp64({x[worst].item()!r}) = {got[worst].item()!r}, " \
                           f"libm {want[worst].item()!r}"


def test_log64_within_2_ulp_of_libm(draw):
    x = log_inputs(draw)
    got = float64.log64(x)
    want = f64([math.log(v) for v in x.tolist()])
    err = ulps(got, want)
    worst = int(err.argmax())
    assert err.max() <= 2, f"{draw}: log64({x[worst].item()!r}) = {got[worst].item()!r}, " \
                           f"libm {want[worst].item()!r}"


def test_exact_values_and_specials():
    assert float64.exp64(f64([0.0, -0.0])).tolist() == [1.0, 1.0]
    assert float64.exp64(f64([-746.0, -1e300, -INF])).tolist() == [0.0, 0.0, 0.0]
    assert float64.exp64(f64([-745.0])).item() == SUBNORMAL_MIN == math.exp(-745.0)
    assert math.isnan(float64.exp64(f64([NAN])).item())
    # -log(u) for the extreme uniforms (2k + 1) / 2^53 of keyed.uniform
    assert float64.log64(f64([1.0])).item() == 0.0
    assert float64.log64(f64([1 - 2.0 ** -53])).item() == -2.0 ** -53
    assert float64.log64(f64([2.0 ** -53])).item() == math.log(2.0 ** -53)
    assert float64.log64(f64([SUBNORMAL_MIN])).item() == math.log(SUBNORMAL_MIN)
    out = float64.log64(f64([0.0, -0.0, INF, -1.0, -INF, NAN, 2.0]))
    assert out[:3].tolist() == [-INF, -INF, INF]
    assert torch.isnan(out[3:6]).all() and out[6].item() == math.log(2.0)
    with pytest.raises(TypeError):
        float64.exp64(torch.zeros(3))
    with pytest.raises(TypeError):
        float64.log64(torch.ones(3))
    assert float64.exp64(f64([])).shape == (0,) and float64.log64(f64([])).shape == (0,)


def test_torch_versions_are_elementwise(draw):
    """The same bits for an element alone, in a slice, in a strided view or a 2-D tensor (vector
    and scalar loops of torch's kernels agree), and the input is left untouched."""
    for fn, x in ((float64.exp64, exp_inputs(draw, 1000)), (float64.log64, log_inputs(draw, 1000))):
        x = torch.cat([x, f64([0.0, INF, -1.0, SUBNORMAL_MIN])])
        before = x.clone()
        whole = fn(x)
        assert torch.equal(x.view(torch.int64), before.view(torch.int64)), f"{draw}: input modified"
        assert same_bits(fn(x[1::3]), whole[1::3]), f"{draw}: strided"
        assert same_bits(fn(x[5:-7].reshape(-1)), whole[5:-7]), f"{draw}: slice"
        n = x.numel() // 4 * 4
        assert same_bits(fn(x[:n].reshape(4, -1).t()).t().reshape(-1), whole[:n]), f"{draw}: 2-D"
        for i in torch.randint(0, x.numel(), (20,), generator=draw.gen).tolist():
            assert same_bits(fn(x[i:i + 1]), whole[i:i + 1]), f"{draw}: element {i} alone"


# ---- the Triton spelling, bit for bit ----

@triton.jit
def _math_kernel(x_ptr, out_ptr, n, LOG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=1.0)
    if LOG:
        tl.store(out_ptr + offs, ex.log64(x), mask=ok)
    else:
        tl.store(out_ptr + offs, ex.exp64(x), mask=ok)


@triton.jit
def _gumbel_kernel(key_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, sampling_triton.gumbel(tl.load(key_ptr), offs.to(tl.int64)), mask=offs < n)


def launch(kernel, n, *args, **kwargs):
    """Launched as the sampler launches its kernels: no FMA contraction."""
    kernel[(triton.cdiv(n, 1024),)](*args, n, **kwargs, BLOCK=1024, **ex.LAUNCH_EXACT)


def triton_math(x: torch.Tensor, log: bool) -> torch.Tensor:
    out = torch.full_like(x, NAN, device=DEVICE)
    launch(_math_kernel, x.numel(), x.to(DEVICE), out, LOG=log)
    return out.cpu()


def assert_same_bits(got, want, x, what, draw):
    diff = ~((got.view(torch.int64) == want.view(torch.int64)) | (got.isnan() & want.isnan()))
    assert not diff.any(), f"{draw}: Triton {what} differs from torch's at x = {x[diff][:5].tolist()}"


def test_triton_exp64_equals_torch_bitwise(draw):
    x = exp_inputs(draw, 4000)
    assert_same_bits(triton_math(x, log=False), float64.exp64(x), x, "exp64", draw)


def test_triton_log64_equals_torch_bitwise(draw):
    x = log_inputs(draw, 4000)
    assert_same_bits(triton_math(x, log=True), float64.log64(x), x, "log64", draw)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the discarded lanes of specials
def test_triton_specials_equal_torch():
    x = f64([NAN, 0.0, -0.0, INF, -INF, -1.0, SUBNORMAL_MIN, 1.0])
    assert_same_bits(triton_math(x, log=False)[:2], float64.exp64(x[:2]), x[:2], "exp64", "fixed")
    assert_same_bits(triton_math(x, log=True), float64.log64(x), x, "log64", "fixed")


def test_triton_gumbel_equals_keyed_bitwise(draw):
    """The sampler's noise, -log(-log(u)), through sampling_triton.gumbel and keyed.gumbel."""
    seed = int(torch.randint(0, 1 << 62, (1,), generator=draw.gen))
    key = keyed.row_keys([seed], [int(torch.randint(0, 1 << 30, (1,), generator=draw.gen))])
    n = 5000
    got = torch.full((n,), NAN, dtype=torch.float64, device=DEVICE)
    launch(_gumbel_kernel, n, key.reshape(-1).to(DEVICE), got)
    want = keyed.gumbel(key, torch.arange(n).reshape(1, -1)).reshape(-1)
    assert torch.equal(got.cpu().view(torch.int64), want.view(torch.int64)), f"{draw}"
