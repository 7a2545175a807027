"""Gated DeltaNet's mixing and its gated RMSNorm in Triton, bitwise kernels/delta_net.py.

References: `delta_net.delta_net` and `delta_net.gated_rms_norm` (their docstrings give the
rule: the two dot products of each step are exact sums on the fixed-point grid, every other
step one IEEE float32 or float64 operation in the written order, exp and log the project's).
The kernels take the same steps in the same order, launched with FMA contraction off
(exact_triton.LAUNCH_EXACT); float32 divisions are tl.math.div_rn (a plain float32 `/` compiles
to an approximate division), float64 `/` and sqrt are IEEE (exact_triton.py).

`delta_net(qkv, a, b, state, batch, params)`: two launches, whatever the batch.
1. `conv_kernel`, one program per (sequence, block of conv channels): the causal depthwise
   conv + SiLU of the sequence's rows (taps added in order 0..K-1, each product rounded, then
   the add), into a float32 scratch [rows, C]; and, for each row the batch names
   (ForwardBatch.state_slots), the conv's last K - 1 inputs into that block of state.conv. The
   program reads the starting window (block state_in, zero at -1) into registers before any
   write, so a sequence resuming mid-block, whose rows write the very block they start from,
   reads the old window (as the reference does). A window row is picked from the registers by
   its bits (an int32 sum of one nonzero term), so -0.0 and NaN payloads survive the copy.
2. `recurrence_kernel`, one program per (sequence, value head, block of value columns),
   looping over the sequence's rows in order: the l2 norms of q and k (reference._normalized's
   exact integer sum of squares, divisor 1), q / sqrt(key_dim), the gates (softplus in float64
   with exp64/log64, decay = exp_neg(-rate * softplus), beta = sigmoid), then the delta rule on
   its columns of S [key_dim, value_dim]. The recurrence is separable by columns of S: the grid
   dot's exponent is per column, and S's update and both dot products touch column j alone
   (q, k and the gates are per row and head), so the value columns split across programs
   without changing a bit; each program recomputes its row's norms and gates (a few hundred
   flops). S sits in registers from its load (block state_in, zero at -1) to the sequence's end
   and is stored after each row the batch names.
Each conv channel and each (head, column) of S belongs to one program, and a program reads its
starting state before it writes any (a barrier after the load orders the threads of a program),
so the only hazard left is between sequences: a sequence must not start from a block another
sequence of the same batch writes (the engine never does that: a block is written only by its
owner while it runs, and shared prefix blocks are full and read-only).

The grid dot (reference grid_dot): per column j of S the exponent e_j of max |S[:, j]|, of the
vector its exponent e_v; S and the vector as integers (round to even of x * 2^(21 - e)),
products <= 2^44 summed in float64 (exact for key_dim <= 256, which is checked), scaled by
2^(e_j - 21) * 2^(e_v - 21) and rounded once to float32.

`gated_rms_norm(x, gate, weight, eps)`: one program per ROWS rows: rms_norm's steps
(reference.rms_norm, to float32), times float32 weight, times silu(gate) (float32, silu32's
steps), rounded to x's dtype.
"""
import torch
import triton
import triton.language as tl

from tensorfold.exact import float32 as ref32
from tensorfold.kernels import delta_net as ref
from tensorfold.kernels import exact_triton as ex
from tensorfold.kernels.exact_triton import LAUNCH_EXACT
from tensorfold.kernels.reference import MAX_NORM_WIDTH, NORM_BITS

MAX_KEY_DIM = 256      # the grid dot's float64 sum stays exact (reference grid_dot)
BLOCK_C = 128          # conv channels per program
BLOCK_V = 32           # columns of S per program (any value gives the same bits)
NORM_ROWS = 16         # rows per program of the gated norm


@triton.jit
def _silu(g):
    """reference.silu32: t = exp_neg(-|g|); where(g >= 0, g, g t) / (1 + t), float32."""
    t = ex.exp_neg(-tl.abs(g))
    return tl.math.div_rn(tl.where(g >= 0, g, g * t), 1.0 + t)


@triton.jit
def _sigmoid(x):
    """reference.sigmoid32: t = exp_neg(-|x|); where(x >= 0, 1, t) / (1 + t), float32."""
    t = ex.exp_neg(-tl.abs(x))
    return tl.math.div_rn(tl.where(x >= 0, 1.0, t), 1.0 + t)


@triton.jit
def _softplus(y, THRESHOLD: tl.constexpr):
    """delta_net.softplus32: log64(1 + exp64(min(y, T))) in float64, rounded once; y above T is y.
    (A where, not tl.minimum: torch's clamp_max keeps a NaN.)"""
    y64 = y.to(tl.float64)
    soft = ex.log64(1.0 + ex.exp64(tl.where(y64 > THRESHOLD, THRESHOLD, y64)))
    return tl.where(y > THRESHOLD, y64, soft).to(tl.float32)


@triton.jit
def _l2_norm(x, eps, NORM_BITS: tl.constexpr):
    """reference.l2_norm of one float32 vector (reference._normalized with divisor 1): the squares
    on the vector's grid summed as integers (exact), then 1 / sqrt(var + eps) in float32 steps."""
    e = ex.exponent(tl.max(tl.abs(x), 0))
    x64 = x.to(tl.float64)
    sq = ex.round_even((x64 * x64) * ex.pow2((-e + (NORM_BITS - 1)) * 2))  # integers <= 2^40
    ss = tl.sum(sq, 0)  # <= 2^53: exact in any order
    var = ex.scale32(ss.to(tl.float32), (e - NORM_BITS + 1) * 2)
    inv = ex.inverse_sqrt32(var, eps, 1)
    return x * inv


@triton.jit
def _grid_dot(s, vec, STATE_BITS: tl.constexpr):
    """delta_net.grid_dot for one program's columns: s [DK, BV], vec [DK] -> [BV] float32."""
    e_s = ex.exponent(tl.max(tl.abs(s), 0))  # [BV]
    e_v = ex.exponent(tl.max(tl.abs(vec), 0))
    s_int = ex.round_even(s.to(tl.float64) * ex.pow2(-e_s + (STATE_BITS - 1))[None, :])
    v_int = ex.round_even(vec.to(tl.float64) * ex.pow2(-e_v + (STATE_BITS - 1)))
    total = tl.sum(s_int * v_int[:, None], 0)  # integers, partial sums < 2^53: exact in any order
    steps = ex.pow2(e_s + (1 - STATE_BITS)) * ex.pow2(e_v + (1 - STATE_BITS))
    return (total * steps).to(tl.float32)


@triton.jit
def _padded(p, win_bits, slots, x_ptr, row0, stride_x, ch, ok, TAPS: tl.constexpr):
    """Input p of a sequence's padded conv input (window ++ rows) for channels ch, float32: the
    window's row p (from the registers, by its bits) below TAPS - 1, else row p - (TAPS - 1)."""
    inside = p >= TAPS - 1
    x = tl.load(x_ptr + (row0 + p - (TAPS - 1)).to(tl.int64) * stride_x + ch, mask=tl.where(inside, ok, False),
                other=0.0)  # where, not &: the interpreter's scalar & tensor mask is int32
    w = tl.sum(tl.where(slots[:, None] == p, win_bits, 0), 0).to(tl.float32, bitcast=True)
    return tl.where(inside, x.to(tl.float32), w)


@triton.jit
def conv_kernel(x_ptr, conv_ptr, weight_ptr, mixed_ptr, state_in_ptr, state_out_ptr, row_starts_ptr,
                stride_x, channels,
                TAPS: tl.constexpr, WIN_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    """One sequence's conv + SiLU over channels [c0, c0 + BLOCK_C), and its conv state writes."""
    seq = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = ch < channels
    row0 = tl.load(row_starts_ptr + seq)
    row1 = tl.load(row_starts_ptr + seq + 1)
    src = tl.load(state_in_ptr + seq)
    slots = tl.arange(0, WIN_PAD)
    win_stride = (TAPS - 1) * channels
    window = tl.load(conv_ptr + src * win_stride + slots[:, None] * channels + ch[None, :],
                     mask=tl.where(src >= 0, (slots < TAPS - 1)[:, None] & ok[None, :], False), other=0.0)
    win_bits = window.to(tl.int32, bitcast=True)
    tl.debug_barrier()  # every thread has its window before any thread writes a state
    for t in range(0, row1 - row0):
        w0 = tl.load(weight_ptr + ch * TAPS, mask=ok, other=0.0)
        acc = _padded(t, win_bits, slots, x_ptr, row0, stride_x, ch, ok, TAPS) * w0
        for j in tl.static_range(1, TAPS):
            wj = tl.load(weight_ptr + ch * TAPS + j, mask=ok, other=0.0)
            acc = acc + _padded(t + j, win_bits, slots, x_ptr, row0, stride_x, ch, ok, TAPS) * wj
        row = (row0 + t).to(tl.int64)
        tl.store(mixed_ptr + row * channels + ch, _silu(acc), mask=ok)
        dst = tl.load(state_out_ptr + row)
        if dst >= 0:  # the last K - 1 inputs after this row
            for i in tl.static_range(0, TAPS - 1):
                tl.store(conv_ptr + dst * win_stride + i * channels + ch,
                         _padded(t + 1 + i, win_bits, slots, x_ptr, row0, stride_x, ch, ok, TAPS), mask=ok)


@triton.jit
def recurrence_kernel(mixed_ptr, a_ptr, b_ptr, ssm_ptr, out_ptr, state_in_ptr, state_out_ptr, row_starts_ptr,
                      rate_ptr, dt_bias_ptr, stride_a, stride_b, channels, q_scale, eps: tl.float32,
                      HEADS: tl.constexpr, GROUP: tl.constexpr, KEY_WIDTH: tl.constexpr,
                      DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
                      STATE_BITS: tl.constexpr, NORM_BITS: tl.constexpr, THRESHOLD: tl.constexpr):
    """One sequence's delta rule for value head `head`, columns [v0, v0 + BLOCK_V) of S."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP
    dk = tl.arange(0, DK_PAD)
    dk_ok = dk < DK
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = cols < DV
    tile_ok = dk_ok[:, None] & v_ok[None, :]
    tile = (head * DK + dk[:, None]).to(tl.int64) * DV + cols[None, :]  # within one block's [H, DK, DV]
    row0 = tl.load(row_starts_ptr + seq)
    row1 = tl.load(row_starts_ptr + seq + 1)
    src = tl.load(state_in_ptr + seq)
    s = tl.load(ssm_ptr + src * (HEADS * DK * DV) + tile, mask=tl.where(src >= 0, tile_ok, False), other=0.0)
    tl.debug_barrier()  # every thread has its state before any thread writes one
    rate = tl.load(rate_ptr + head)
    dt_bias = tl.load(dt_bias_ptr + head)
    for row in range(row0, row1):  # int64 (row_starts are int64)
        base = mixed_ptr + row * channels
        q = tl.load(base + key_head * DK + dk, mask=dk_ok, other=0.0)
        k = tl.load(base + KEY_WIDTH + key_head * DK + dk, mask=dk_ok, other=0.0)
        v = tl.load(base + 2 * KEY_WIDTH + head * DV + cols, mask=v_ok, other=0.0)
        q = tl.math.div_rn(_l2_norm(q, eps, NORM_BITS), q_scale)
        k = _l2_norm(k, eps, NORM_BITS)
        a = tl.load(a_ptr + row * stride_a + head).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + head).to(tl.float32)
        decay = ex.exp_neg(-rate * _softplus(a + dt_bias, THRESHOLD))
        beta = _sigmoid(b)
        s = s * decay
        delta = (v - _grid_dot(s, k, STATE_BITS)) * beta
        s = s + k[:, None] * delta[None, :]
        out = _grid_dot(s, q, STATE_BITS)
        tl.store(out_ptr + (row * HEADS + head) * DV + cols, out.to(out_ptr.dtype.element_ty),
                 mask=v_ok)
        dst = tl.load(state_out_ptr + row)
        if dst >= 0:
            tl.store(ssm_ptr + dst * (HEADS * DK * DV) + tile, s, mask=tile_ok)


@triton.jit
def gated_rms_norm_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, num_rows, stride_x, stride_g, eps: tl.float32,
                          N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, NORM_BITS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (rows < num_rows)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    # reference.rms_norm, step by step (padding lanes are 0: they add nothing)
    e = ex.exponent(tl.max(tl.abs(x), 1))
    x64 = x.to(tl.float64)
    sq = ex.round_even((x64 * x64) * ex.pow2((-e + (NORM_BITS - 1)) * 2)[:, None])
    ss = tl.sum(sq, 1)  # exact
    var = ex.scale32(ss.to(tl.float32), (e - NORM_BITS + 1) * 2)
    inv = ex.inverse_sqrt32(var, eps, N)
    w = tl.load(weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    normed = (x * inv[:, None]) * w[None, :]
    g = tl.load(gate_ptr + rows[:, None] * stride_g + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    y = normed * _silu(g)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def _rows_unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t [rows, cols] with unit column stride (a column slice of a projection passes as it is)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _slots(batch, block_size: int, device):
    """(state_in, state_out, row_starts) as int64 tensors on `device`, once per forward."""
    def make():
        state_in, state_out = batch.state_slots(block_size)
        return tuple(t.to(device=device, dtype=torch.int64).contiguous()
                     for t in (state_in, state_out, batch.row_starts_tensor))
    return batch.memo(("state_slots_on", block_size, str(device)), make)


def delta_net(qkv, a, b, state, batch, params, *, out: torch.Tensor | None = None, block_c: int = BLOCK_C,
              block_v: int = BLOCK_V, scratch_fill: float | None = None) -> torch.Tensor:
    """`delta_net.delta_net`, bitwise: qkv [rows, C], a, b [rows, H] (column slices may pass as
    they are), state a models/cache.LayerState (read and written at the batch's state slots).
    Returns [rows, H, value_dim] in qkv's dtype, in `out` if given. block_c and block_v are free
    (the bits do not depend on them); scratch_fill pre-fills the conv's output scratch (tests)."""
    p = params
    rows, channels = qkv.shape
    heads, dk, dv = p.num_heads, p.key_dim, p.value_dim
    group = heads // p.num_key_heads
    if group * p.num_key_heads != heads or channels != 2 * p.num_key_heads * dk + heads * dv:
        raise ValueError(f"qkv has {channels} channels; {p.num_key_heads} key heads of {dk} and {heads} value "
                         f"heads of {dv} need {2 * p.num_key_heads * dk + heads * dv}")
    if dk > MAX_KEY_DIM:
        raise ValueError(f"key_dim {dk} > {MAX_KEY_DIM}: the grid dot would leave float64's exact range")
    shape = (rows, heads, dv)
    if out is None:
        out = torch.empty(shape, dtype=qkv.dtype, device=qkv.device)
    elif out.shape != shape or out.dtype != qkv.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {qkv.dtype} {shape} tensor")
    if rows == 0:
        return out
    conv, ssm = state.conv, state.ssm
    if not (conv.is_contiguous() and ssm.is_contiguous()) or conv.dtype != torch.float32 or ssm.dtype != torch.float32:
        raise ValueError("the recurrent state must be contiguous float32")
    taps = conv.shape[1] + 1
    state_in, state_out, row_starts = _slots(batch, state.block_size, qkv.device)
    num_seqs = row_starts.numel() - 1
    qkv, a, b = _rows_unit_stride(qkv), _rows_unit_stride(a), _rows_unit_stride(b)
    mixed = torch.empty((rows, channels), dtype=torch.float32, device=qkv.device)
    if scratch_fill is not None:
        mixed.fill_(scratch_fill)
    block_c = min(block_c, triton.next_power_of_2(channels))
    conv_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        qkv, conv, p.conv_weight.float().contiguous(), mixed, state_in, state_out, row_starts,
        qkv.stride(0), channels,
        TAPS=taps, WIN_PAD=triton.next_power_of_2(max(taps - 1, 1)), BLOCK_C=block_c, **LAUNCH_EXACT)
    block_v = min(block_v, triton.next_power_of_2(dv))
    recurrence_kernel[(num_seqs, heads, triton.cdiv(dv, block_v))](
        mixed, a, b, ssm, out, state_in, state_out, row_starts,
        p.rate.float().contiguous(), p.dt_bias.float().contiguous(), a.stride(0), b.stride(0), channels,
        ref32.f32(dk ** 0.5), ref32.f32(ref.NORM_EPS),
        HEADS=heads, GROUP=group, KEY_WIDTH=p.num_key_heads * dk, DK=dk, DV=dv,
        DK_PAD=triton.next_power_of_2(dk), BLOCK_V=block_v, STATE_BITS=ref.STATE_BITS, NORM_BITS=NORM_BITS,
        THRESHOLD=float(ref.SOFTPLUS_THRESHOLD), **LAUNCH_EXACT)
    return out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   out: torch.Tensor | None = None, rows_per_program: int = NORM_ROWS) -> torch.Tensor:
    """`delta_net.gated_rms_norm`, bitwise: x, gate [rows, N] (N <= 8,192), weight [N]; returns
    [rows, N] in x's dtype."""
    num_rows, n = x.shape
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"rms_norm rows are at most {MAX_NORM_WIDTH} wide (an exact float64 sum), got {n}")
    if gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must match x {tuple(x.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} {tuple(x.shape)} tensor")
    if num_rows == 0:
        return out
    x, gate = _rows_unit_stride(x), _rows_unit_stride(gate)
    gated_rms_norm_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        x, gate, weight.contiguous(), out, num_rows, x.stride(0), gate.stride(0), ref32.f32(eps),
        N=n, BLOCK=triton.next_power_of_2(n), ROWS=rows_per_program, NORM_BITS=NORM_BITS, **LAUNCH_EXACT)
    return out
