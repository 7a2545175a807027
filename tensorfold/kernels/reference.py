"""Batch-invariant torch ops: the reference every kernel is checked against, bit for bit.

Invariant: row i of every op's output is bitwise the same whatever other rows share the call,
how many there are, and where row i sits:
- `linear` sums every output in one order fixed by K alone (16 lanes of fused multiply-adds over
  K, then a halving tree), which the C++ GEMM (csrc/cpu/gemm.cpp) follows instruction for
  instruction; it is the oracle, written for clarity, not speed. `linear_padded` is torch's GEMM with the rows padded to 8: the
  op set of a build without the C++ kernels and of the cuda backend uses it, and the engine's
  startup probes decide whether it holds on the machine (it does on AMD EPYC, not on Intel Xeon
  with AMX: shared measurements in docs/kernels.md).
- RMSNorm reduces each row alone, and exactly: its sum of squares is an integer sum (see
  `rms_norm`), so it has no order to depend on; SiLU uses the project's exp (exact.float32.exp_neg), not
  libm's; rope reads a precomputed table.
The engine re-checks these at startup on the loaded model's shapes (engine/probes.py).
"""
import torch
import torch.nn.functional as F

from tensorfold.exact import float32, grid

ROW_PAD = 8
NORM_BITS = 20                 # each square kept to 2 * NORM_BITS bits below the row's largest one
MAX_NORM_WIDTH = 1 << 13       # 2^13 squares of at most 2^40 sum to at most 2^53: exact in float64
TANH_SMALL = float32.f32(0.625)  # tanh32: the polynomial below, exp_neg above
TANH_POLY = tuple(float32.f32(c) for c in (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2,
                                           1.33314422036e-1, -3.33332819422e-1))


def pad_rows(x: torch.Tensor, multiple: int = ROW_PAD) -> torch.Tensor:
    num_rows = x.shape[0]
    padded = -(-num_rows // multiple) * multiple
    if padded == num_rows:
        return x
    return torch.cat([x, x.new_zeros((padded - num_rows, *x.shape[1:]))])


GEMM_LANES = 16           # partial sums per output: lane l takes k = l (mod 16)
GEMM_COLUMN_BLOCK = 4096  # columns per step of the reference (bounds its [M, N, 16] scratch)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N] in x's dtype, every sum in one fixed order.

    For each output, 16 lanes accumulate the products from +0, each step one fused multiply-add
    (acc + x w rounded once to float32); then the lanes fold by halves: l + (l + 8), then + 4,
    + 2, + 1 (plain float32 additions). The result is rounded to x's dtype; a bias is added
    after, in that dtype. Which lane takes which k:
    - float32: lane l takes k = l, l + 16, ... in increasing k (K padded with zeros to a
      multiple of 16; adding +0 changes no sum);
    - bfloat16 (x and weight): the order of AVX512_BF16's pair instruction (vdpbf16ps). K is
      padded to a multiple of 32; in each chunk of 32, lane l takes k = 2l + 1, then k = 2l. These
      steps flush as that instruction does (fma32_flushed): a subnormal x or w counts as zero of
      its sign, and a step whose result is below 2^-126 in magnitude gives zero of its sign.
    The C++ kernel (csrc/cpu/gemm.cpp) does exactly this, with the rows and columns tiled any way
    it likes.
    """
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        return _linear_pairs(x, weight, bias)
    num_rows, k = x.shape
    chunks = -(-k // GEMM_LANES)
    pad = chunks * GEMM_LANES - k
    xs = F.pad(x.double(), (0, pad)).view(num_rows, 1, chunks, GEMM_LANES)
    out = torch.empty((num_rows, weight.shape[0]), dtype=torch.float32, device=x.device)
    for n0 in range(0, weight.shape[0], GEMM_COLUMN_BLOCK):
        ws = F.pad(weight[n0:n0 + GEMM_COLUMN_BLOCK].double(), (0, pad)).view(1, -1, chunks, GEMM_LANES)
        acc = torch.zeros((num_rows, ws.shape[1], GEMM_LANES), dtype=torch.float32, device=x.device)
        for c in range(chunks):
            acc = fma32(acc, xs[:, :, c], ws[:, :, c])
        out[:, n0:n0 + ws.shape[1]] = _fold_lanes(acc)
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def _linear_pairs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """linear for bfloat16 x and weight: chunks of 32, lane l taking k = 2l + 1 then 2l (see linear)."""
    num_rows, k = x.shape
    chunks = -(-k // (2 * GEMM_LANES))
    pad = chunks * 2 * GEMM_LANES - k
    xs = F.pad(_flush_subnormal(x).double(), (0, pad)).view(num_rows, 1, chunks, GEMM_LANES, 2)
    out = torch.empty((num_rows, weight.shape[0]), dtype=torch.float32, device=x.device)
    for n0 in range(0, weight.shape[0], GEMM_COLUMN_BLOCK):
        w = _flush_subnormal(weight[n0:n0 + GEMM_COLUMN_BLOCK])
        ws = F.pad(w.double(), (0, pad)).view(1, -1, chunks, GEMM_LANES, 2)
        acc = torch.zeros((num_rows, ws.shape[1], GEMM_LANES), dtype=torch.float32, device=x.device)
        for c in range(chunks):
            acc = fma32_flushed(acc, xs[:, :, c, :, 1], ws[:, :, c, :, 1])
            acc = fma32_flushed(acc, xs[:, :, c, :, 0], ws[:, :, c, :, 0])
        out[:, n0:n0 + ws.shape[1]] = _fold_lanes(acc)
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def _fold_lanes(acc: torch.Tensor) -> torch.Tensor:
    """The 16 lanes of [..., 16] folded by halves: l + (l + 8), + 4, + 2, + 1 (float32 additions)."""
    acc = acc[..., :8] + acc[..., 8:]
    acc = acc[..., :4] + acc[..., 4:]
    acc = acc[..., :2] + acc[..., 2:]
    return acc[..., 0] + acc[..., 1]


def fma32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, acc): acc + a b rounded once, for float32 acc and float64 a, b that hold
    float32 (or bfloat16) values."""
    return _sum_to_odd(acc, a, b).float()


TINY32 = 2.0 ** -126  # the smallest normal float32


def fma32_flushed(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fma32 as vdpbf16ps rounds each of its steps: acc + a b rounded to float32's 24 bits with an
    unbounded exponent, and zero of its sign when that is below 2^-126 (flush to zero, tininess
    seen after rounding). acc is never subnormal here (every step flushes). Where the rounded
    value is normal it is fma32's; to see whether it is, the sum is scaled by 2^64 first, so that
    its rounding to float32 meets no subnormal range."""
    s = _sum_to_odd(acc, a, b)
    scaled = (s * 2.0 ** 64).float()
    return torch.where(scaled.abs() < TINY32 * 2.0 ** 64, scaled * 0.0, s.float())


def _sum_to_odd(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a b in float64 rounded to odd: the product is exact in float64, and the sum's exact
    error (by TwoSum) nudges an inexact even result one ulp toward the true sum. A value rounded
    to odd with 2+ spare bits rounds to float32 as the exact sum would (Boldo and Melquiond,
    2008)."""
    c = acc.double()
    p = a * b
    s = c + p
    bp = s - c
    err = (c - (s - bp)) + (p - bp)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, float("inf"), float("-inf")).double()
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s)


def _flush_subnormal(x: torch.Tensor) -> torch.Tensor:
    """x with its subnormal values replaced by zero of their sign (a bfloat16 or float32 tensor)."""
    return torch.where(x.abs() < TINY32, x * 0.0, x)


def linear_padded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) through torch's GEMM, M padded to a multiple of 8: row-
    invariant where the BLAS keeps one kernel per padded shape (checked by the startup probes)."""
    num_rows = x.shape[0]
    out = F.linear(pad_rows(x), weight)  # [M_pad, N]
    out = out[:num_rows]
    if bias is not None:
        out = out + bias
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, each row (last dim) alone; the Triton kernel's bits.

    The rule: the one reduction is an exact integer sum, so its order cannot matter, and every
    other step is a single correctly rounded float32 IEEE operation, done in this order here, in
    the C++ and Triton kernels (launched without FMA contraction) and in the mlx backend (which
    has no float64: the sum is an int64 sum there):
      1. e = exponent(max|x|) of the row (floor(log2), from the float32 bits). Each square,
         exact in float64 (a float32 has 24 significant bits), is put on the row's grid and
         rounded once: sq = round_even(x^2 2^(2 (NORM_BITS - 1 - e))). Since |x| < 2^(e + 1),
         sq <= 2^40, so a row of at most MAX_NORM_WIDTH = 2^13 squares sums to at most 2^53;
      2. ss = sum(sq): every partial sum is an integer <= 2^53, exact in any order, tiling or
         reduction tree (float64 here, int64 on MLX);
      3. var = float32(ss) 2^(2 (e - NORM_BITS + 1)) (exact.grid.scale32) / float32(N);
         inv = 1 / sqrt(var + float32(eps)): float32 steps;
      4. out = float32(x) inv, times float32(weight), rounded to x's dtype.
    Wider rows are refused (ValueError). Precision: a square is off by at most half a grid step,
    at most 2^-39 of the row's largest square; the float32 steps add about 2 ulp, so the result
    is within ~3 float32 ulp (1 bf16 ulp) of a float64 textbook RMSNorm. A mean of squares
    beyond float32's range (|x| ~ 2^64) overflows to inf and gives zeros. (Rounding x itself to
    NORM_BITS bits and squaring that would be as exact but far less precise: an error of
    2 x dx per element, hundreds of float32 ulps on an adversarial row.)
    """
    out = _normalized(x, eps, x.shape[-1])
    out *= weight.float()
    return out.to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps), each row (last dim) alone, as float32: rms_norm's steps 1-4
    with the sum not divided by the width (var = ss * 2^(2 (e - NORM_BITS + 1)), exact) and no
    weight. Gated DeltaNet normalises its queries and keys with it."""
    return _normalized(x, eps, 1)


def _normalized(x: torch.Tensor, eps: float, divisor: int) -> torch.Tensor:
    """Steps 1-4 of rms_norm up to the weight: float32(x) / sqrt(float32(ss) 2^(...) / divisor + eps)
    in float32 steps."""
    n = x.shape[-1]
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"rms_norm rows are at most {MAX_NORM_WIDTH} wide (an exact float64 sum), got {n}")
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.float32, device=x.device)
    # The squares in one float64 buffer, each in-place step the same single rounding as its plain
    # form. Fresh row-sized float64 temporaries cost more than the arithmetic: glibc gave them
    # back to the OS on every call (2-3 ms at 512 x 576, not 0.4).
    x32 = x.float() if x.dtype == torch.float64 else x  # float32 values (fp32/bf16/fp16 as they are)
    amax = torch.maximum(x32.amax(dim=-1, keepdim=True), x32.amin(dim=-1, keepdim=True).neg_())
    e = grid.exponent(amax)  # [..., 1] int32
    buf = x32.double()
    buf *= buf  # the squares, exact
    buf *= grid.pow2(2 * (NORM_BITS - 1 - e))
    buf += grid.ROUND_MAGIC  # grid.round_even, in place: sq, integers <= 2^40
    buf -= grid.ROUND_MAGIC
    ss = buf.sum(dim=-1, keepdim=True)  # exact: every partial sum is an integer <= 2^53
    var = grid.scale32(ss.float(), 2 * (e - NORM_BITS + 1)) / float(divisor)
    root = float32.sqrt_rn(var + float32.f32(eps))
    inv = torch.ones_like(root) / root  # IEEE float32 division
    return x32.float() * inv


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias, each row alone (the DSA indexer's key norm):
    the mean from an exact sum (each x on the row's grid of 2 NORM_BITS bits below its largest,
    an integer sum below 2^53), float32(sum) scaled and divided by N in float32; then rms_norm's
    steps 1-4 on the float32 differences; weight and bias in float32 steps; rounded to x's dtype."""
    n = x.shape[-1]
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"layer_norm rows are at most {MAX_NORM_WIDTH} wide (an exact float64 sum), got {n}")
    x32 = x.float()
    e = grid.exponent(x32.abs().amax(dim=-1, keepdim=True))
    ints = grid.round_even(x32.double() * grid.pow2(2 * NORM_BITS - 1 - e))  # |.| <= 2^40
    mean = grid.scale32(ints.sum(dim=-1, keepdim=True).float(), e - 2 * NORM_BITS + 1) / float(n)
    out = _normalized(x32 - mean, eps, n)
    return (out * weight.float() + bias.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add rounded to the dtype, then the norm: (rms_norm(residual + x), residual + x).
    The cuda backend fuses the two (one pass over the row); the bits are these."""
    h = residual + x
    return rms_norm(h, weight, eps), h


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """qwen3's per-head q/k norm, rounded to the dtype, then rope (fused on the cuda backend)."""
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float32, rounded to gate's dtype, with the project's exp (no libm):
    t = exp_neg(-|g|); silu(g) = g / (1 + t) for g >= 0 and (g t) / (1 + t) below (g e^g / (1 + e^g))."""
    return (silu32(gate.float()) * up.float()).to(gate.dtype)


def sigmoid_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """sigmoid(gate) * up in float32, rounded once to gate's dtype (an attention's output gate)."""
    return (sigmoid32(gate.float()) * up.float()).to(gate.dtype)


def silu32(g: torch.Tensor) -> torch.Tensor:
    """silu of float32 g, in float32 (silu_and_mul's steps)."""
    t = float32.exp_neg(-g.abs())
    return torch.where(g >= 0, g, g * t) / (1.0 + t)


def sigmoid32(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of float32 x, in float32, with the project's exp: t = exp_neg(-|x|);
    1 / (1 + t) for x >= 0 and t / (1 + t) below."""
    t = float32.exp_neg(-x.abs())
    return torch.where(x >= 0, 1.0, t) / (1.0 + t)


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up with GELU's tanh form (transformers' gelu_pytorch_tanh, Gemma's MLP) in
    float32, rounded once to gate's dtype, with the project's exp (gelu_tanh32)."""
    return (gelu_tanh32(gate.float()) * up.float()).to(gate.dtype)


def gelu_tanh32(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), of float32 x in float32 steps. As
    0.5 (1 + tanh(u)) = sigmoid(2u), it is x * sigmoid32(2u): no libm tanh, and no cancellation in
    1 + tanh(u) where u is very negative."""
    u = x * x
    u *= float32.f32(0.044715)
    u *= x
    u += x
    u *= float32.f32(2 * 0.7978845608028654)  # 2 sqrt(2/pi)
    return x * sigmoid32(u)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 in x's dtype (Nemotron-H's MLPs and experts): two elementwise roundings."""
    r = torch.relu(x)
    return r * r


def tanh32(x: torch.Tensor) -> torch.Tensor:
    """tanh of float32 x in float32 steps, no libm (Cephes tanhf's two ranges): below |x| = 0.625
    the odd polynomial x + x z P(z), z = x^2; above, with t = exp_neg(-2|x|), (1 - t) / (1 + t)
    with the sign put back (1 - t is exact there, t < 0.29). About 2 ulp."""
    z = x * x
    p = z * TANH_POLY[0]
    for c in TANH_POLY[1:]:
        p += c
        p *= z
    small = x + x * p
    t = float32.exp_neg(x.abs() * -2.0)
    large = torch.copysign((1.0 - t) / (1.0 + t), x)
    return torch.where(x.abs() < TANH_SMALL, small, large)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma's final logit soft-capping), float32, elementwise: a row's
    bits are its own whatever shares the call."""
    c = float32.f32(cap)
    return tanh32(logits.float() / c) * c


def rope_table(inv_freq: list[float], scale: float, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_position, head_dim] (fp32), half-split (rotate_half) layout."""
    inv = torch.tensor(inv_freq, dtype=torch.float64).float()  # [head_dim // 2]
    pos = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(pos, inv)  # [max_position, head_dim // 2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_position, head_dim]
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim]; cos/sin [num_tokens, head_dim] already gathered by position."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    out = x32 * cos[:, None, :] + rotated * sin[:, None, :]
    return out.to(x.dtype)
