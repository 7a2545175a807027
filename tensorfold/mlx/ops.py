"""The mlx backend's op set, in MLX arrays: every sum an exact int64 sum, the rest float32 steps.

The torch references (kernels/reference.py, paged_attention.py, quant_gemm.py) carry their exact
sums in float64 and finish in float32; here the same integers are int64 and the finishes the
same float32 operations in the same order, so every op below but the dense GEMM gives the
references' bits (and the C++ and Triton kernels' bits: a quantized checkpoint's logits are
equal across backends). On MLX's CPU device the exact integers ride in float64 instead
(grid.float64_carrier; _attend_carried, quant_carried.rows): the same integers, the same bits.

    silu_and_mul, sigmoid_and_mul, apply_rope     the reference's float32 steps: bitwise
    (silu32, sigmoid32 their activations)
    write_kv                                      K/V on their grids: bitwise
    rms_norm, l2_norm, gated_rms_norm             the exact sum as int64, float32 finish: bitwise
    attention                                     exact int64 sums, float32 finish: bitwise
    QuantLinear                                   the exact quantized GEMM: bitwise
    dense_linear                                  MLX's matmul (float32 [K, N] on the CPU
                                                  device, rows padded to 8 on the GPU):
                                                  row-invariant where MLX keeps one kernel per
                                                  shape (the startup probes check it)
"""
import functools

import mlx.core as mx
import numpy as np
import torch

from tensorfold.backends.linear_weight import LinearWeight
from tensorfold.kernels import quant_gemm
from tensorfold.kernels.paged_attention import L_BITS, QK_BITS, SPLIT_SIZE, V_BITS, W_BITS
from tensorfold.kernels.reference import MAX_NORM_WIDTH, NORM_BITS, ROW_PAD
from tensorfold.mlx import grid, metal_kernels, quant_carried

DTYPES = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}

# metal/'s shaders (tensorfold.mlx.metal) where the backend found on this Mac that they give these
# ops' bits (MLXBackend.load, shader_problem); None: the MLX ops below.
SHADERS = None


def use_shaders(module) -> None:
    global SHADERS
    SHADERS = module


def from_torch(t: torch.Tensor, dtype=None) -> mx.array:
    """A CPU torch tensor as an MLX array (bfloat16 through float32: exact), in `dtype` if given."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        out = mx.array(t.float().numpy()).astype(mx.bfloat16)
    else:
        out = mx.array(t.numpy())
    return out if dtype is None else out.astype(dtype)


def to_torch(a: mx.array) -> torch.Tensor:
    """An MLX array as a CPU torch tensor (float32 for bfloat16: exact)."""
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.astype(mx.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


# ---- elementwise: the references' float32 steps ----

def silu32(g: mx.array) -> mx.array:
    """silu of float32 g: reference.silu32's steps (t = exp_neg(-|g|); g / (1 + t), or g t / (1 + t))."""
    t = grid.exp_neg(-mx.abs(g))
    return mx.where(g >= 0, g, g * t) / (1.0 + t)


def sigmoid32(x: mx.array) -> mx.array:
    """sigmoid of float32 x: reference.sigmoid32's steps (1 / (1 + t), or t / (1 + t))."""
    t = grid.exp_neg(-mx.abs(x))
    return mx.where(x >= 0, 1.0, t) / (1.0 + t)


@grid.fused
def silu_and_mul(gate: mx.array, up: mx.array) -> mx.array:
    return (silu32(gate.astype(mx.float32)) * up.astype(mx.float32)).astype(gate.dtype)


@grid.fused
def sigmoid_and_mul(gate: mx.array, up: mx.array) -> mx.array:
    return (sigmoid32(gate.astype(mx.float32)) * up.astype(mx.float32)).astype(gate.dtype)


@grid.fused
def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [rows, heads, head_dim], cos/sin [rows, head_dim] (float32): rotate_half rope."""
    x32 = x.astype(mx.float32)
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


# ---- RMSNorm ----

def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, kernels/reference.rms_norm's steps:
    the squares on the row's grid as int64 (from each float32's significand), their exact sum ss,
    then var = float32(ss) 2^(2 (e - NORM_BITS + 1)) / N, inv = 1 / sqrt(var + eps), x inv
    weight, each one float32 operation."""
    if x.shape[-1] > MAX_NORM_WIDTH:
        raise ValueError(f"rms_norm rows are at most {MAX_NORM_WIDTH} wide, got {x.shape[-1]}")
    return _rms_norm(x, weight, mx.array(_f32(eps)))


@grid.fused
def _rms_norm(x: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    return (_normalized(x.astype(mx.float32), eps, x.shape[-1]) * weight.astype(mx.float32)).astype(x.dtype)


def l2_norm(x: mx.array, eps: float) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last dim as float32: reference.l2_norm's steps (rms_norm's,
    the sum not divided, no weight), bitwise."""
    if x.shape[-1] > MAX_NORM_WIDTH:
        raise ValueError(f"l2_norm rows are at most {MAX_NORM_WIDTH} wide, got {x.shape[-1]}")
    return _l2_norm(x, mx.array(_f32(eps)))


@grid.fused
def _l2_norm(x: mx.array, eps: mx.array) -> mx.array:
    return _normalized(x.astype(mx.float32), eps, 1)


def gated_rms_norm(x: mx.array, gate: mx.array, weight: mx.array, eps: float) -> mx.array:
    """rms_norm(x) * weight * silu(gate), rows alone (Gated DeltaNet's output norm):
    kernels/delta_net.gated_rms_norm's steps, bitwise."""
    if x.shape[-1] > MAX_NORM_WIDTH:
        raise ValueError(f"rms_norm rows are at most {MAX_NORM_WIDTH} wide, got {x.shape[-1]}")
    return _gated_rms_norm(x, gate, weight, mx.array(_f32(eps)))


@grid.fused
def _gated_rms_norm(x: mx.array, gate: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    normed = _normalized(x.astype(mx.float32), eps, x.shape[-1]) * weight.astype(mx.float32)
    return (normed * silu32(gate.astype(mx.float32))).astype(x.dtype)


def _normalized(x32: mx.array, eps: mx.array, divisor: int) -> mx.array:
    """float32 x32 / sqrt(float32(ss) 2^(2 (e - NORM_BITS + 1)) / divisor + eps), ss the exact
    int64 sum of the squares on the row's grid (reference._normalized's steps)."""
    e = grid.exponent(mx.abs(x32).max(axis=-1, keepdims=True)).astype(mx.int64)
    if grid.float64_carrier():  # x^2 (48 bits) times a power of two: exact; rint is the shift's rounding
        x64 = x32.astype(mx.float64)
        sq = grid.rint64(x64 * x64 * grid.pow2_64(2 * (NORM_BITS - 1 - e)))  # <= 2^40
    else:
        m, ex = grid.significand(x32)
        sq = grid.shift(m * m, 2 * ex + 2 * (NORM_BITS - 1) - 2 * e)
    ss = sq.sum(axis=-1, keepdims=True)                                  # exact: integers, <= 2^53
    var = grid.scale(ss.astype(mx.float32), 2 * (e - NORM_BITS + 1)) / divisor
    inv = 1.0 / mx.sqrt(var + eps)
    return x32 * inv


# ---- the K/V cache and attention ----

def write_kv(cache: "LayerCache", k: mx.array, v: mx.array, slots: mx.array) -> None:
    """k, v [rows, kv_heads, head_dim] into the layer's flat slots, each vector rounded to the
    cache's dtype and then to its grid (the reference's values, bitwise), with each stored
    vector's exponent beside it."""
    dtype = cache.k.dtype
    k, v, k_exp, v_exp = _kv_on_grid(k.astype(dtype), v.astype(dtype))
    cache.k[slots], cache.v[slots] = k, v
    cache.k_exp[slots], cache.v_exp[slots] = k_exp, v_exp


@grid.fused
def _kv_on_grid(k: mx.array, v: mx.array):
    """k, v on their grids in their dtype (exact: the grid fits it), and the exponent of each
    stored vector's largest element (what to_fixed of the stored vector starts from)."""
    (k_grid, k_exp), (v_grid, v_exp) = grid.on_grid_with_exponent(k, QK_BITS), grid.on_grid_with_exponent(v, V_BITS)
    return k_grid.astype(k.dtype), v_grid.astype(v.dtype), k_exp, v_exp


class LayerCache:
    """One attention layer's K and V, [num_blocks * block_size, kv_heads, head_dim] each, on
    their grids, and each vector's exponent [num_slots, kv_heads] (int32): with it a stored
    vector's grid integers are one exact scaling away (grid.fixed_of_stored), not a max and a
    rounding per key per round."""

    def __init__(self, num_slots: int, num_kv_heads: int, head_dim: int, dtype):
        self.k = mx.zeros((num_slots, num_kv_heads, head_dim), dtype=dtype)
        self.v = mx.zeros((num_slots, num_kv_heads, head_dim), dtype=dtype)
        self.k_exp = mx.zeros((num_slots, num_kv_heads), dtype=mx.int32)
        self.v_exp = mx.zeros((num_slots, num_kv_heads), dtype=mx.int32)

    @property
    def arrays(self) -> tuple[mx.array, ...]:
        return self.k, self.v, self.k_exp, self.v_exp

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


KEY_BUCKET = 64        # a sequence's key slots come padded to a multiple: one trace per 64 key counts
NO_WINDOW = 1 << 30    # the window of full attention (every key a row has passed is seen)


def key_slots(table: np.ndarray, last_position: int, block_size: int) -> mx.array:
    """The cache slots of positions 0..last_position of a sequence with block table `table`,
    padded with slot 0 to a multiple of KEY_BUCKET (past every row's position: never seen)."""
    keys = np.arange(last_position + 1)
    slots = table[keys // block_size] * block_size + keys % block_size
    return mx.array(np.pad(slots, (0, -len(slots) % KEY_BUCKET)))


def attention(q: mx.array, cache: LayerCache, positions: np.ndarray, key_slots: mx.array, scale: float,
              window: int | None) -> mx.array:
    """One sequence's query rows q [R, H, D] at `positions` (host ints, ascending) over its keys:
    key_slots, the cache slots of positions 0.. (at least positions[-1] + 1 of them; slots past a
    row's position are not seen, so padding is free) -> [R, H, D] in q's dtype. _attend has the
    steps."""
    if SHADERS is not None:
        return SHADERS.attention(q, cache, positions, key_slots, scale, window)
    group = q.shape[1] // cache.k.shape[1]
    lane_pos = mx.array(np.tile(np.asarray(positions, dtype=np.int32), group))   # lane m = g R + r
    window = mx.array(NO_WINDOW if window is None else window, dtype=mx.int32)
    if grid.float64_carrier():
        return _attend_carried(q, cache.k, cache.v, cache.v_exp, key_slots, lane_pos, mx.array(_f32(scale)), window)
    return _attend(q, *cache.arrays, key_slots, lane_pos, mx.array(_f32(scale)), window)


@grid.fused
def _attend_carried(q, k_cache, v_cache, v_exp, key_slots, lane_pos, scale, window):
    """_attend's steps with its exact integers carried in float64 (MLX's CPU device), as the torch
    reference carries them: q on its grid as q_int 2^(qe - 21) (rint of an exact scaling), the
    scores one float64 matmul against the stored k (every product a multiple of 2^(qe + ke - 42),
    every partial sum below 2^53 of those units: exact in any order), made float32 once; den and
    the weights w_j rint of exact scalings of p; the weighted sum one float64 matmul of
    w_j 2^(V_BITS - 1 - e_j) against v_j (each product the integer w_j v_int_j < 2^44, summed
    over at most SPLIT_SIZE keys: below 2^53), equal chunks of at most SPLIT_SIZE keys added as int64."""
    rows, heads, dim = q.shape
    k, v = k_cache[key_slots], v_cache[key_slots]                         # [L, KVH, D]
    keys, kv_heads = k.shape[:2]
    group = heads // kv_heads
    lanes = q.astype(mx.float32).reshape(rows, kv_heads, group, dim).transpose(1, 2, 0, 3)
    lanes = lanes.reshape(kv_heads, group * rows, dim)                    # [KVH, M, D]
    q_exp = grid.exponent(mx.abs(lanes).max(axis=-1, keepdims=True)).astype(mx.int64)  # [KVH, M, 1]
    q_grid = grid.rint64(lanes.astype(mx.float64) * grid.pow2_64(QK_BITS - 1 - q_exp)) * grid.pow2_64(q_exp - QK_BITS + 1)
    dots = mx.matmul(q_grid, k.transpose(1, 2, 0).astype(mx.float64))    # [KVH, M, L], exact
    scores = dots.astype(mx.float32) * scale

    key_pos = mx.arange(keys)[None, None, :]
    lane_pos = lane_pos[None, :, None]
    seen = (key_pos <= lane_pos) & (key_pos > lane_pos - window)
    scores = mx.where(seen, scores, -mx.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = mx.where(mx.isinf(row_max), 0.0, row_max)
    p = grid.exp_neg(scores - row_max).astype(mx.float64)                # 0 where unseen

    den = grid.rint64(p * float(2 ** L_BITS)).sum(axis=-1)                   # [KVH, M]: exact
    v_exp = v_exp[key_slots].T.astype(mx.int64)[:, None, :]               # [KVH, 1, L]
    top = mx.where(seen, v_exp, -1024).max(axis=-1, keepdims=True)
    top = mx.where(top == -1024, 0, top)                                  # [KVH, M, 1]
    w = grid.rint64(p * grid.pow2_64(v_exp + W_BITS - top)) * grid.pow2_64(V_BITS - 1 - v_exp)  # [KVH, M, L]
    v = v.transpose(1, 0, 2).astype(mx.float64)                           # [KVH, L, D]
    if keys <= SPLIT_SIZE:
        num = mx.matmul(w, v)                                             # [KVH, M, D], exact
    else:  # equal chunks of at most SPLIT_SIZE keys (zero weights pad the last), added as int64
        chunks, size = key_chunks(keys)
        pad = chunks * size - keys
        w = mx.pad(w, [(0, 0), (0, 0), (0, pad)]).reshape(kv_heads, group * rows, chunks, size)
        v = mx.pad(v, [(0, 0), (0, pad), (0, 0)]).reshape(kv_heads, chunks, size, dim)
        num = mx.matmul(w.transpose(0, 2, 1, 3), v).astype(mx.int64).sum(axis=1).astype(mx.float64)
    total = mx.maximum(den, 1).astype(mx.float32) * _f32(2.0 ** -L_BITS)  # sum of p: exact scaling
    out = (num * grid.pow2_64(top - V_BITS - W_BITS + 1)).astype(mx.float32) / total[..., None]
    out = out.reshape(kv_heads, group, rows, dim).transpose(2, 0, 1, 3).reshape(rows, heads, dim)
    return out.astype(q.dtype)


def key_chunks(keys: int) -> tuple[int, int]:
    """The fewest chunks of at most SPLIT_SIZE keys, all of one size: (count, size). 576 keys are
    2 x 288, not 2 x 512 (the float64 weighted sum's cost is its padded keys)."""
    chunks = -(-keys // SPLIT_SIZE)
    return chunks, -(-keys // chunks)


@grid.fused
def _attend(q, k_cache, v_cache, k_exp, v_exp, key_slots, lane_pos, scale, window):
    """1. q and k as grid integers (22 bits); each score T 2^(qe + ke - 42) is an exact int64 dot
       product T (grid.int_matmul), made float32 once (float32_of_int), times float32(scale).
    2. p = exp_neg(score - row max), 0 for keys a row does not see (the reference's).
    3. den = sum round(p 2^L_BITS) and num = sum w_j v_j with w_j = round(p 2^(e_j - E + W_BITS)):
       the reference's integers, summed exactly in int64.
    4. out = float32(num 2^(E - V_BITS - W_BITS + 1)) / (float32(den) 2^-L_BITS), then q's dtype.
    Every step is the reference's (kernels/paged_attention.py): the same bits."""
    rows, heads, dim = q.shape
    k, v = k_cache[key_slots], v_cache[key_slots]                         # [L, KVH, D]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    lanes = q.reshape(rows, kv_heads, group, dim).transpose(1, 2, 0, 3).reshape(kv_heads, group * rows, dim)
    q_int, q_exp = grid.to_fixed(lanes, QK_BITS)                          # [KVH, M, D], [KVH, M]
    k_exp, v_exp = k_exp[key_slots].T, v_exp[key_slots].T                 # [KVH, L]
    k_int = grid.fixed_of_stored(k.transpose(1, 0, 2), k_exp, QK_BITS)    # [KVH, L, D]
    dots = grid.int_matmul(q_int, k_int.transpose(0, 2, 1), QK_BITS, QK_BITS)  # [KVH, M, L]
    g = q_exp[..., None].astype(mx.int64) + k_exp[:, None, :].astype(mx.int64) - 2 * (QK_BITS - 1)
    scores = grid.float32_of_int(dots, g) * scale

    key_pos = mx.arange(key_slots.shape[0])[None, None, :]
    lane_pos = lane_pos[None, :, None]
    seen = (key_pos <= lane_pos) & (key_pos > lane_pos - window)
    scores = mx.where(seen, scores, -mx.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = mx.where(mx.isinf(row_max), 0.0, row_max)
    p = grid.exp_neg(scores - row_max)                                    # 0 where unseen
    pm, pe = grid.significand(p)

    den = grid.shift(pm, pe + L_BITS).sum(axis=-1)                        # [KVH, M]
    v_int = grid.fixed_of_stored(v.transpose(1, 0, 2), v_exp, V_BITS)     # [KVH, L, D]
    v_exp = v_exp[:, None, :].astype(mx.int64)                            # [KVH, 1, L]
    top = mx.where(seen, v_exp, -1024).max(axis=-1, keepdims=True)
    top = mx.where(top == -1024, 0, top)                                  # [KVH, M, 1]
    w = grid.shift(pm, pe + v_exp + W_BITS - top)                         # <= 2^W_BITS
    num = grid.int_matmul(w, v_int, W_BITS, V_BITS)                       # [KVH, M, D]
    total = mx.maximum(den, 1).astype(mx.float32) * _f32(2.0 ** -L_BITS)     # sum of p: exact scaling
    out = grid.float32_of_int(num, top - V_BITS - W_BITS + 1) / total[..., None]
    out = out.reshape(kv_heads, group, rows, dim).transpose(2, 0, 1, 3).reshape(rows, heads, dim)
    return out.astype(q.dtype)


def _f32(value: float) -> float:
    return float(np.float32(value))


# ---- GEMMs ----

class MLXLinear(LinearWeight):
    """A GEMM weight on MLX arrays: a dense part is a DenseWeight, a quantized one its
    QuantWeight's arrays (QuantParts). Parts of different formats are computed whole and laid
    side by side, as on every backend."""

    def __init__(self, parts: list, bias: torch.Tensor | None = None, shard=None):
        super().__init__(parts, None, shard)
        self.bias = None if bias is None else from_torch(bias)
        self.in_order = None if self.in_order is None else from_torch(self.in_order)  # an mx index array, once

    def pack(self, part):
        if self.quantized(part):
            return QuantParts.of(part)
        return DenseWeight(from_torch(part))

    def __call__(self, x: mx.array) -> mx.array:
        if self.in_order is not None:  # a matrix in its file's column order (LinearWeight.in_order)
            x = mx.take(x, self.in_order, axis=1)
        outs = [self.multiply(x, part) for part in self.parts]
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
        return out if self.bias is None else out + self.bias

    def multiply(self, x: mx.array, part) -> mx.array:
        if isinstance(part, QuantParts):
            return quant_linear(x, part)
        return dense_linear(x, part)

    def rows(self, ids: mx.array) -> mx.array:
        """Rows of a one-part weight as float32 (an embedding lookup)."""
        part = self.single
        if isinstance(part, QuantParts):
            return part.dequantize_rows(ids)
        return part.rows(ids)


class DenseWeight:
    """A dense GEMM matrix [N, K] in the form this device's matmul reads fastest. On MLX's CPU
    device: float32 [K, N] (`columns`). Its matmul computes bfloat16 and float16 in float32
    anyway, and streams a float32 [K, N] operand 2-4x faster than the stored [N, K] in the
    checkpoint's dtype (docs/benchmarks.md). Elsewhere (Metal): the matrix as stored."""

    def __init__(self, matrix: mx.array):
        self.dtype, self.shape = matrix.dtype, tuple(matrix.shape)
        on_cpu = grid.on_cpu()
        self.columns = mx.contiguous(matrix.astype(mx.float32).T) if on_cpu else None
        self.matrix = None if on_cpu else matrix
        mx.eval(self.columns if on_cpu else matrix)  # now, on the loading thread's stream

    def rows(self, ids: mx.array) -> mx.array:
        """Rows `ids` of the matrix, in its dtype (an embedding lookup)."""
        if self.matrix is not None:
            return self.matrix[ids]
        return self.columns[:, ids].T.astype(self.dtype)


def dense_linear(x: mx.array, weight: DenseWeight) -> mx.array:
    """x [M, K] @ weight^T in x's dtype, rows as they come. On MLX's CPU device one float32
    matmul against `columns` (the weight first rounded to x's dtype where x is a 16-bit type
    the weight is not, as a matmul in x's dtype would); its cost is rows times a row's, nothing
    to win by blocking.
    On the GPU, M is padded to a multiple of ROW_PAD so a row meets one matmul kernel per padded
    size (Metal's GEMV and GEMM tile differently). The startup probes check on the loaded
    shapes that MLX keeps a row's bits whatever the batch."""
    if weight.columns is not None:
        columns = weight.columns
        if x.dtype not in (mx.float32, weight.dtype):
            columns = columns.astype(x.dtype).astype(mx.float32)
        return mx.matmul(x.astype(mx.float32), columns).astype(x.dtype)
    rows = x.shape[0]
    pad = -rows % ROW_PAD
    if pad:
        x = mx.concatenate([x, mx.zeros((pad, x.shape[1]), dtype=x.dtype)])
    return mx.matmul(x, weight.matrix.astype(x.dtype).T)[:rows]


class QuantParts:
    """A QuantWeight's arrays as MLX arrays (scales int64), plus the torch QuantWeight for row
    lookups. The codes for step 2's matmuls are made on first use, in the form the device's
    GEMM reads: float32 [S, sub, N] (`codes`, the int64 form's), or on MLX's CPU device the
    float64-carried form's arrays (`carried`: two or three columns' codes to a float64 word)."""

    def __init__(self, weight: quant_gemm.QuantWeight):
        quant_gemm.check_weight(weight)
        n, k = weight.shape
        self.source, self.kind, self.shape = weight, weight.kind, (n, k)
        self.scale = from_torch(weight.scale.T.contiguous()).astype(mx.int64)    # [S, N]
        self.scale_exp = from_torch(weight.scale_exp.T.contiguous()).astype(mx.int64)  # [B, N]
        self.min = None if weight.min is None else from_torch(weight.min.T.contiguous()).astype(mx.int64)
        self.min_exp = None if weight.min_exp is None else from_torch(weight.min_exp.T.contiguous()).astype(mx.int64)
        self.top = from_torch(weight.top()).astype(mx.int64)                     # [N]
        self.grid_offset = metal_kernels.grid_bias(weight.kind, k)  # g = top + kmax + grid_offset (step 3)

    def sub_blocks(self) -> torch.Tensor:
        """The codes as [S, sub, N] (sub-block s, its element i, column n)."""
        n, k = self.shape
        sub = quant_gemm.KINDS[self.kind].sub
        return self.source.codes.reshape(n, k // sub, sub).permute(1, 2, 0)

    @functools.cached_property
    def codes(self) -> mx.array:
        """The codes as float32 [S, sub, N]: exact, and their sub-block dots too (< 2^19)."""
        return from_torch(self.sub_blocks().float().contiguous())

    @property
    def arrays(self) -> tuple[mx.array, ...]:
        """The integer form's arrays (_quant_rows)."""
        return (self.codes, self.scale, self.scale_exp, self.top) + (
            () if self.min is None else (self.min, self.min_exp))

    @functools.cached_property
    def carried(self) -> "quant_carried.CarriedWeight":
        """The arrays of the float64-carried form (MLX's CPU device), made on first use."""
        return quant_carried.CarriedWeight(self)

    @classmethod
    def of(cls, weight: quant_gemm.QuantWeight) -> "QuantParts":
        return cls(weight)

    def dequantize_rows(self, ids: mx.array) -> mx.array:
        rows = self.source.rows(torch.from_numpy(np.array(ids)).long()).dequantize()
        return from_torch(rows)


def _significand16(h: mx.array) -> tuple[mx.array, mx.array]:
    """float16 h -> (dm, de) int64 with h == dm 2^de (quant_gemm.significand's integers)."""
    bits = h.view(mx.uint16).astype(mx.int64)
    frac = bits & 0x3FF
    dm = mx.where(((bits >> 10) & 0x1F) > 0, frac | 0x400, frac)  # the implicit bit of a normal value
    dm = mx.where((bits >> 15) == 1, -dm, dm)
    return dm, quant_carried.exponent16(h)


def quantize_activations(x: mx.array, act: int = quant_gemm.BLOCK):
    """quant_gemm.quantize_activations' float32 steps over groups of `act` columns
    (quant_carried.activations): xq [M, B, 32] float32 integers (blocks of 32), per group (m, k)
    [M, K / act] and, for the 32-column kinds, per block (sm, se) [M, B] (else None), all int64,
    bitwise the reference's."""
    xq, d16, s16 = quant_carried.activations(x, act)                   # group-major
    m, k = _significand16(d16[..., 0].T)
    sm, se = (None, None) if s16 is None else _significand16(s16[..., 0].T)
    return xq.transpose(1, 0, 2).reshape(x.shape[0], x.shape[1] // quant_gemm.BLOCK, quant_gemm.BLOCK), m, k, sm, se


@grid.integer_only
def _terms(a, s, m, e_w, e_x, g):
    """Block terms a s m (a: integer-valued, s, m int64) on the output's grid 2^g: shifted by
    e_w + e_x - g, rounded half to even (quant_gemm's step 3), as int64."""
    return grid.shift(a.astype(mx.int64) * s * m, e_w + e_x - g)


def quant_linear(x: mx.array, w: QuantParts) -> mx.array:
    """x [M, K] @ w^T by quant_gemm.linear's steps 1-4, bitwise: the sub-block dots as float32
    matmuls (exact: < 2^19), one term per activation group (a block of 32; a K-quant's super-block
    of 256, its sub-blocks' S A and its blocks' M sum(xq) summed exactly first) on the output's
    grid as an exact integer (int64, or float64-carried on MLX's CPU device: quant_carried),
    their int64 sum, and step 4's two roundings (without float64 where there is none:
    grid.float32_of_int). Rows go ROW_CHUNK at a time (they are independent; chunks bound the
    scratch and meet one trace)."""
    n, kdim = w.shape
    if x.ndim != 2 or x.shape[1] != kdim:
        raise ValueError(f"x {tuple(x.shape)} against weights {w.shape}")
    if SHADERS is not None:
        return SHADERS.quant_linear(x, w)
    rows, arrays = _rows_and_arrays(w, totals=False)
    step = quant_gemm.ROW_CHUNK
    if x.shape[0] > step:
        return mx.concatenate([rows(x[i:i + step], *arrays) for i in range(0, x.shape[0], step)])
    return rows(x, *arrays)


def quant_totals(x: mx.array, w: QuantParts) -> tuple[mx.array, mx.array]:
    """Step 3's exact int64 sums of x's rows (at most ROW_CHUNK) and their grid exponents g, both
    [M, N], in this device's form (what the tests compare between forms, bit for bit)."""
    rows, arrays = _rows_and_arrays(w, totals=True)
    return rows(x, *arrays)


def _rows_and_arrays(w: QuantParts, totals: bool):
    if grid.float64_carrier():
        return quant_carried.rows(w.kind, totals), w.carried.arrays
    return _quant_rows(w.kind, totals), w.arrays


@functools.cache
def _quant_rows(kind_name: str, totals: bool):
    """quant_linear's rows in integers (Metal, or wherever float64 is missing): per activation
    group the dot term (sum S A) m and the minimum term (M sm per block of 32; per K-quant
    super-block (sum M sum(xq)) m), each shifted onto the output's grid in int64 (_terms), step 4
    by grid.float32_of_int."""
    kind = quant_gemm.KINDS[kind_name]

    @grid.fused
    def rows_times_weights(x, codes, scale, scale_exp, top, *minimum):
        rows, kdim = x.shape
        n, nb, per, bpg = codes.shape[-1], kdim // quant_gemm.BLOCK, quant_gemm.BLOCK // kind.sub, kind.blocks_per_group
        xq, xm, k, sm, se = quantize_activations(x, kind.act)             # xq [M, B, 32], xm, k [M, G]
        xs = xq.reshape(rows, nb * per, kind.sub).transpose(1, 0, 2)      # [S, M, sub]
        a = mx.matmul(xs, codes)                                          # [S, M, N], exact integers
        if per * bpg > 1:  # a group's sub-blocks (q6_k's halves, a super-block's): sum S A first
            a = (a.astype(mx.int64) * scale[:, None, :]).reshape(nb // bpg, bpg * per, rows, n).sum(axis=1)
        g = top[None, :] + k.max(axis=1)[:, None] + metal_kernels.grid_bias(kind_name, kdim)  # [M, N]
        s = scale[:, None, :] if per * bpg == 1 else 1
        x_m, x_k = xm.T[..., None], k.T[..., None]                        # [G, M, 1]
        total = _terms(a, s, x_m, scale_exp[::bpg, None, :], x_k, g[None]).sum(axis=0)  # a group's E: its first block's
        if kind.has_min:
            low, low_exp = minimum
            if bpg == 1:  # M sm 2^(F + se), sm se the float16 of d sum(xq)
                low_terms = _terms(low[:, None, :], sm.T[..., None], 1, low_exp[:, None, :], se.T[..., None], g[None])
            else:  # (sum_b M_b sum(xq of b)) m 2^(F + k) per super-block, exact int64 sums
                sums = xq.sum(axis=-1).astype(mx.int64).T[..., None]      # [B, M, 1]
                lows = (low[:, None, :] * sums).reshape(nb // bpg, bpg, rows, n).sum(axis=1)  # [G, M, N]
                low_terms = _terms(lows, 1, x_m, low_exp[::bpg, None, :], x_k, g[None])
            total = total + low_terms.sum(axis=0)                         # int64: exact in any order
        if totals:
            return total, g
        return grid.float32_of_int(total, g).astype(x.dtype)

    return rows_times_weights
