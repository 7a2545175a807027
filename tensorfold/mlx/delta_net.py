"""Gated DeltaNet on MLX arrays: kernels/delta_net.py's steps, bitwise, without float64 on Metal.

The torch reference (kernels/delta_net.py) is the rule; each function here follows its steps in
its order and says which of its functions it equals:

    exp64, log64     exact/float64.py's fdlibm sequences in MLX float64     = float64.exp64 / log64
    softplus32       log64(1 + exp64(y)) rounded once to float32           = delta_net.softplus32
    gates            decay = exp_neg(-rate softplus(a + dt_bias)), beta = sigmoid(b)  = delta_net.gates
    conv_silu        the causal depthwise conv tap by tap, then SiLU       = delta_net.conv_silu
    grid_dot         S^T k on the grid: int64 products summed, one rounding = delta_net.grid_dot
    delta_step       decay, delta, rank-one update, S^T q (float32 steps)  = delta_net.delta_step
    delta_net        one layer's mixing over an MLXBatch and its LayerState = delta_net.delta_net

Metal has no float64, but the gates' softplus is a float64 step in the reference (exp64, log64).
MLX runs float64 operations on its CPU device (and on Apple silicon the CPU shares the arrays'
memory), so exp64 and log64 run under `mx.stream(mx.cpu)`: each step one IEEE double +, -, *, /
or an integer operation on the bits, correctly rounded whatever the CPU, no libm. They touch
[rows, heads] values per layer, not the state. Everything else is int64 or float32 and runs on
the default device.

The state lives per block (models/cache.RecurrentState's rule): LayerState holds the conv's last
K - 1 inputs and the state matrices for every block id; the batch names where each sequence
starts (state_in, -1: a zero state) and which rows' states are written (state_out), as
ForwardBatch.state_slots does for the torch op sets (mlx/recurrent.py runs the batch over them).
"""
import mlx.core as mx

from tensorfold.exact import float64 as f64
from tensorfold.exact.float32 import f32
from tensorfold.exact.grid import ROUND_MAGIC
from tensorfold.kernels.delta_net import NORM_EPS, SOFTPLUS_THRESHOLD, STATE_BITS
from tensorfold.mlx import grid, ops, recurrent


# ---- float64 on the CPU stream: exp64, log64, softplus32 ----

def exp64(x: mx.array) -> mx.array:
    """exp of float64 x (x <= 0; 0 < x < 660 right too): float64.exp64's steps, bitwise."""
    with mx.stream(mx.cpu):
        r = mx.maximum(x, f64.EXP64_MIN)
        t = r * f64.INV_LN2 + ROUND_MAGIC                # t = x INV_LN2 + M
        n = t - ROUND_MAGIC                              # round(x / ln2), ties to even
        hi = r - n * f64.LN2_HI64                        # exact
        lo = n * f64.LN2_LO64
        r = hi - lo
        rr = r * r
        c = rr * f64.EXP64_P[4]
        for p in f64.EXP64_P[3::-1]:
            c = (c + p) * rr
        c = r - c
        r = (r * c) / (2.0 - c)
        y = 1.0 - ((lo - r) - hi)
        scale = ((t.view(mx.int64) + f64.SCALE_BIAS) << 52).view(mx.float64)  # 2^(n + 64)
        return y * scale * f64.TWO_M64


def log64(x: mx.array) -> mx.array:
    """log of float64 x: float64.log64's steps, bitwise (subnormals scaled by 2^54; log(0) = -inf,
    log(inf) = inf, negative and NaN give NaN)."""
    with mx.stream(mx.cpu):
        sub = x < f64.TINY64
        scaled = x * mx.where(sub, f64.TWO54, 1.0)
        bits = scaled.view(mx.int64)
        k = ((bits + f64.SQRT_HALF_SHIFT) >> 52) - 1023  # x = 2^k m, m in [sqrt(1/2), sqrt(2))
        f = (bits - (k << 52)).view(mx.float64) - 1.0
        dk = k.astype(mx.float64) - mx.where(sub, 54.0, 0.0).astype(mx.float64)
        lg = f64.LOG64_LG
        hfsq = f * 0.5 * f
        s = f / (f + 2.0)
        z = s * s
        w = z * z
        t1 = ((w * lg[5] + lg[3]) * w + lg[1]) * w
        r = (((w * lg[6] + lg[4]) * w + lg[2]) * w + lg[0]) * z
        r = ((((((r + t1) + hfsq) * s) + dk * f64.LN2_LO64) - hfsq) + f) + dk * f64.LN2_HI64
        r = mx.where(x < mx.inf, r, x)
        return mx.where(x > 0.0, r, mx.where(x == 0.0, -mx.inf, mx.nan))


def softplus32(y: mx.array) -> mx.array:
    """log(1 + exp(y)) of float32 y in float64, rounded once; y itself above the threshold."""
    with mx.stream(mx.cpu):
        y64 = y.astype(mx.float64)
        soft = log64(1.0 + exp64(mx.minimum(y64, SOFTPLUS_THRESHOLD)))
        return mx.where(y > SOFTPLUS_THRESHOLD, y64, soft).astype(mx.float32)


def gates(a: mx.array, b: mx.array, rate: mx.array, dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """(decay, beta) [rows, heads] float32: decay = exp_neg(-rate softplus(a + dt_bias)), beta = sigmoid(b)."""
    g = -rate * softplus32(a.astype(mx.float32) + dt_bias)
    return grid.exp_neg(g), ops.sigmoid32(b.astype(mx.float32))


# ---- the conv, the grid dot products, one step of the rule ----

def conv_silu(x: mx.array, window: mx.array, weight: mx.array) -> mx.array:
    """One sequence's causal depthwise conv and SiLU: x [n, C], window [K - 1, C] the inputs
    before, weight [C, K] float32; the taps added in order j = 0..K-1 (float32)."""
    padded = mx.concatenate([window, x.astype(mx.float32)])
    n, taps = x.shape[0], weight.shape[1]
    acc = padded[0:n] * weight[:, 0]
    for j in range(1, taps):
        acc = acc + padded[j:j + n] * weight[:, j]
    return ops.silu32(acc)


def grid_dot(state: mx.array, vec: mx.array) -> mx.array:
    """state [..., dk, dv], vec [..., dk] -> [..., dv] float32: each column of state and vec as
    STATE_BITS-bit grid integers, their products (<= 2^44) summed as int64 (exact), and
    float32(float64(total) 2^g) without float64 (grid.float32_of_int): delta_net.grid_dot's bits."""
    s_int, e_s = grid.to_fixed(state.swapaxes(-1, -2), STATE_BITS)    # [..., dv, dk], [..., dv]
    v_int, e_v = grid.to_fixed(vec, STATE_BITS)                        # [..., dk], [...]
    total = (s_int * v_int[..., None, :]).sum(axis=-1)                 # [..., dv]
    g = e_s.astype(mx.int64) + e_v[..., None].astype(mx.int64) - 2 * (STATE_BITS - 1)
    return grid.float32_of_int(total, g)


@grid.fused
def delta_step(state, q, k, v, decay, beta):
    """One position of several sequences: state [A, H, dk, dv], q, k [A, H, dk], v [A, H, dv],
    decay, beta [A, H] -> (the new state, out [A, H, dv]), delta_net.delta_step's order."""
    state = state * decay[..., None, None]
    delta = (v - grid_dot(state, k)) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return state, grid_dot(state, q)


def prepare(mixed: mx.array, a: mx.array, b: mx.array, params) -> tuple:
    """delta_net.prepare: q, k [rows, H, dk] (l2-normed, q scaled, expanded to the value heads),
    v [rows, H, dv], decay and beta [rows, H]."""
    p, rows = params, mixed.shape[0]
    key_width = p.num_key_heads * p.key_dim
    q = mixed[:, :key_width].reshape(rows, p.num_key_heads, p.key_dim)
    k = mixed[:, key_width:2 * key_width].reshape(rows, p.num_key_heads, p.key_dim)
    v = mixed[:, 2 * key_width:].reshape(rows, p.num_heads, p.value_dim)
    q = ops.l2_norm(q, NORM_EPS) / f32(p.key_dim ** 0.5)
    k = ops.l2_norm(k, NORM_EPS)
    group = p.num_heads // p.num_key_heads
    if group > 1:  # key head h serves value heads h * group .. h * group + group - 1
        q, k = mx.repeat(q, group, axis=1), mx.repeat(k, group, axis=1)
    decay, beta = gates(a, b, p.rate, p.dt_bias)
    return q, k, v, decay, beta


# ---- the state per block, and one layer's mixing ----

class LayerState:
    """One linear-attention layer's states, one per block id (float32): conv [num_blocks, K - 1, C]
    and ssm [num_blocks, H, dk, dv] (models/cache.LayerState's layout)."""

    def __init__(self, spec, num_blocks: int):
        self.conv = mx.zeros((num_blocks, spec.conv_kernel - 1, spec.conv_dim), dtype=mx.float32)
        self.ssm = mx.zeros((num_blocks, spec.num_heads, spec.key_dim, spec.value_dim), dtype=mx.float32)

    @property
    def arrays(self) -> tuple[mx.array, ...]:
        return self.conv, self.ssm

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


def delta_net(qkv: mx.array, a: mx.array, b: mx.array, state: LayerState, batch, params) -> mx.array:
    """delta_net.delta_net over an MLXBatch: qkv [rows, C], a, b [rows, H]; each sequence starts
    from block batch.state_in[i] (-1: zero), and the state after row r goes to block
    batch.state_out[r] where that is not -1 (mlx/recurrent.py reads and writes them). Returns
    [rows, H, dv] in qkv's dtype."""
    windows, live = recurrent.starting_states(state, batch)
    mixed, *conv_writes = recurrent.convolve(qkv, windows, batch,
                                             lambda rows, window: conv_silu(rows, window, params.conv_weight))
    q, k, v, decay, beta = prepare(mixed, a, b, params)
    out, *ssm_writes = recurrent.scan(live, batch, lambda sub, at: delta_step(sub, q[at], k[at], v[at], decay[at],
                                                                              beta[at]))
    recurrent.write(state, conv_writes, ssm_writes)
    return out.astype(qkv.dtype)
