"""Gated DeltaNet's recurrence, exact: the torch reference of one linear-attention layer's mixing.

A Gated DeltaNet layer (Qwen3.5, Qwen3.6, Qwen3-Next) keeps, per sequence, the last inputs of a
causal depthwise conv and one state matrix S [key_dim, value_dim] per value head. Each position:

    x      = silu(conv(window of the projected q, k, v))          the conv, tap by tap
    q, k   = l2_norm(q), l2_norm(k); q = q / sqrt(key_dim)         (each key head serves
                                                                    heads // key_heads value heads)
    beta   = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias);  decay = exp(g)
    S      = S * decay
    delta  = (v - S^T k) * beta
    S      = S + k delta^T
    out    = S^T q

The rule (tensorfold/exact): the two dot products S^T k and S^T q are exact sums on the
fixed-point grid (each column of S and the vector k or q as integers against their own largest
power of two, STATE_BITS bits; products and sums exact in float64, rounded once); every other
step is one IEEE float32 operation in the order written here (no FMA), with the project's exp
and log (exact.float32.exp_neg; exact.float64 for softplus and exp(A_log)). So a position's
state and output depend on the sequence's tokens alone: the same bits whatever the batch, the
chunking of a prefill and the threads, and on every op set that follows these steps.

Prefill runs the recurrence position by position (the chunked WY form reorders the sums, which
the exact rule forbids); the conv, the norms and the gates are computed for all rows at once.

States live in the cache per block (models/cache.RecurrentState). The op reads and writes the
slots the batch names (ForwardBatch.state_slots): each sequence's starting state, and for each
row the block (if any) its state is written to; it knows nothing of block sizes or tables
(kernels/recurrent.py, shared with Mamba2).
"""
import torch

from tensorfold.exact import float32, float64, grid
from tensorfold.kernels import recurrent
from tensorfold.kernels.reference import l2_norm, rms_norm, sigmoid32, silu32

STATE_BITS = 22           # each column of S, and k and q, kept to 22 bits below their largest element
NORM_EPS = 1e-6           # the l2 norm's eps (the reference implementations' constant)
SOFTPLUS_THRESHOLD = 20.0  # softplus(y) = y above it (torch's default)


def decay_rate(a_log: torch.Tensor) -> torch.Tensor:
    """exp(A_log) as float32 (computed once at load, with exp64: no libm)."""
    return float64.exp64(a_log.double()).float()


def softplus32(y: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(y)) of float32 y: in float64 with exp64 / log64, rounded once; y above the
    threshold is itself."""
    y64 = y.double()
    soft = float64.log64(1.0 + float64.exp64(y64.clamp_max(SOFTPLUS_THRESHOLD)))
    return torch.where(y > SOFTPLUS_THRESHOLD, y64, soft).float()


def gates(a: torch.Tensor, b: torch.Tensor, rate: torch.Tensor, dt_bias: torch.Tensor):
    """(decay, beta) [rows, heads] float32 from the projections a, b: decay = exp(-rate *
    softplus(a + dt_bias)), beta = sigmoid(b)."""
    g = -rate * softplus32(a.float() + dt_bias.float())
    return float32.exp_neg(g), sigmoid32(b.float())


def conv_silu(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One sequence's causal depthwise conv and SiLU: x [n, C] new inputs, window [K - 1, C] the
    inputs before them, weight [C, K]. Output row t = silu(sum_j weight[:, j] * in[t + j]) over
    in = window ++ x, the taps added in order j = 0..K-1 (float32)."""
    padded = torch.cat([window, x.float()])
    n, taps = x.shape[0], weight.shape[1]
    acc = padded[0:n] * weight[:, 0]
    for j in range(1, taps):
        acc = acc + padded[j:j + n] * weight[:, j]
    return silu32(acc)


def grid_dot(state: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """state [..., dk, dv], vec [..., dk] -> [..., dv] float32: sum over dk of state * vec, exact.

    Each column state[..., :, j] and vec as integers on their grids (exponent e of the largest
    magnitude, STATE_BITS bits: |int| <= 2^22), the products (<= 2^44) summed in float64 (a key
    dim up to 256 keeps every partial sum below 2^53, so exact in any order), scaled by the two
    grid steps (a power of two, exact) and rounded once to float32."""
    e_s = grid.exponent(state.abs().amax(dim=-2))       # [..., dv]
    e_v = grid.exponent(vec.abs().amax(dim=-1))          # [...]
    s_int = grid.round_even(state.double() * grid.pow2(STATE_BITS - 1 - e_s).unsqueeze(-2))
    v_int = grid.round_even(vec.double() * grid.pow2(STATE_BITS - 1 - e_v).unsqueeze(-1))
    total = (s_int * v_int.unsqueeze(-1)).sum(dim=-2)  # exact integers
    steps = grid.pow2(e_s - STATE_BITS + 1) * grid.pow2(e_v - STATE_BITS + 1).unsqueeze(-1)
    return (total * steps).float()


def delta_step(state, q, k, v, decay, beta):
    """One position of several sequences at once, in place on state [A, H, dk, dv]; q, k [A, H, dk]
    (normalised, q scaled), v [A, H, dv], decay and beta [A, H]. Returns out [A, H, dv]."""
    state *= decay[..., None, None]
    delta = (v - grid_dot(state, k)) * beta[..., None]
    state += k[..., :, None] * delta[..., None, :]
    return grid_dot(state, q)


def prepare(mixed, a, b, params):
    """What every row needs before the recurrence: (conv inputs split, gates). `mixed` is the
    conv's output [rows, C]; returns q, k [rows, H, dk] (expanded to the value heads), v
    [rows, H, dv], decay and beta [rows, H]."""
    p = params
    rows = mixed.shape[0]
    key_width = p.num_key_heads * p.key_dim
    q = mixed[:, :key_width].reshape(rows, p.num_key_heads, p.key_dim)
    k = mixed[:, key_width:2 * key_width].reshape(rows, p.num_key_heads, p.key_dim)
    v = mixed[:, 2 * key_width:].reshape(rows, p.num_heads, p.value_dim)
    q = l2_norm(q, NORM_EPS) / float32.f32(p.key_dim ** 0.5)
    k = l2_norm(k, NORM_EPS)
    group = p.num_heads // p.num_key_heads
    if group > 1:  # key head h serves value heads h * group .. h * group + group - 1
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    decay, beta = gates(a, b, p.rate, p.dt_bias)
    return q, k, v, decay, beta


def delta_net(qkv, a, b, state, batch, params) -> torch.Tensor:
    """One Gated DeltaNet layer's mixing over a ForwardBatch: qkv [rows, C] (the input projection
    before the conv), a and b [rows, H]; state: the layer's models/cache.LayerState. Each
    sequence starts from the state in block state_in (zero at -1), and the state after a row is
    written to block state_out[row] where that is not -1 (ForwardBatch.state_slots). Returns
    [rows, H, dv] in qkv's dtype (before the gated norm)."""
    state_in, state_out = batch.state_slots(state.block_size)
    windows, live = recurrent.starting_states(state, state_in, len(batch.sequences))
    mixed = recurrent.convolve(qkv, windows, batch, state, state_out,
                               lambda rows, window: conv_silu(rows, window, params.conv_weight))
    q, k, v, decay, beta = prepare(mixed, a, b, params)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    recurrent.scan(live, batch, state, state_out, out,
                   lambda sub, at: delta_step(sub, q[at], k[at], v[at], decay[at], beta[at]))
    return out.to(qkv.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight * silu(gate), rows alone: the norm rounded to float32, times silu of
    the float32 gate, rounded to x's dtype."""
    normed = rms_norm(x.float(), weight, eps)
    return (normed * silu32(gate.float())).to(x.dtype)
