"""Mamba2's mixing and its gated group norm in Triton, bitwise kernels/mamba2.py.

References: `mamba2.mamba2` and `mamba2.gated_group_norm` (their docstrings give the rule: the
read-out h^T C is an exact sum on the fixed-point grid, every other step one IEEE float32 or
float64 operation in the written order, exp and log the project's). The kernels take the same
steps in the same order, launched with FMA contraction off (exact_triton.LAUNCH_EXACT); float32
divisions are tl.math.div_rn. The exact helpers (SiLU, softplus, the grid dot, the padded conv
input) are delta_net_triton's: the two recurrences share them.

`mamba2(xbc, dt, state, batch, params)`: two launches, whatever the batch.
1. `conv_kernel`, one program per (sequence, block of conv channels): the causal depthwise conv
   (taps in order 0..K-1, each product rounded, then the add), + the bias, SiLU, into a float32
   scratch [rows, C]; and for each row the batch names (ForwardBatch.state_slots) the conv's last
   K - 1 inputs into that block of state.conv. The starting window is read into registers before
   any write (delta_net_triton.conv_kernel's rule).
2. `scan_kernel`, one program per (sequence, head, block of head_dim columns), looping over the
   sequence's rows in order: dt = clamp(softplus(dt + dt_bias), lo, hi) (float64 exp64 / log64,
   rounded once; the clamp by wheres, so a NaN stays), decay = exp_neg(-(rate dt)); x_dt = x dt;
   h = h decay; h = h + B x_dt^T; y = grid_dot(h, C) + x D. A column of h never reads another
   column (its grid exponent is its own), so the columns split across programs without changing
   a bit. h sits in registers from its load (block state_in, zero at -1) to the sequence's end
   and is stored after each row the batch names.
As delta_net_triton: each conv channel and each (head, column) of h belongs to one program, which
reads its starting state before it writes any; a sequence must not start from a block another
sequence of the same batch writes (the engine never does that).

`gated_group_norm(y, z, weight, n_groups, eps, dtype)`: one program per (ROWS rows, group): g =
y silu(z), rms_norm's steps over the group's slice, rounded to dtype, times the weight (one
float32 product), stored in torch's promotion of dtype and the weight's dtype.
"""
import torch
import triton
import triton.language as tl

from tensorfold.exact import float32 as ref32
from tensorfold.kernels import delta_net as dn_ref
from tensorfold.kernels import exact_triton as ex
from tensorfold.kernels.delta_net_triton import _grid_dot, _padded, _rows_unit_stride, _silu, _slots, _softplus
from tensorfold.kernels.exact_triton import LAUNCH_EXACT
from tensorfold.kernels.reference import MAX_NORM_WIDTH, NORM_BITS

MAX_STATE_SIZE = 256   # the grid dot's float64 sum stays exact (delta_net.grid_dot)
BLOCK_C = 128          # conv channels per program
BLOCK_P = 32           # columns of h per program (any value gives the same bits)
NORM_ROWS = 16         # rows per program of the gated norm


@triton.jit
def conv_kernel(x_ptr, conv_ptr, weight_ptr, bias_ptr, mixed_ptr, state_in_ptr, state_out_ptr, row_starts_ptr,
                stride_x, channels,
                TAPS: tl.constexpr, WIN_PAD: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One sequence's conv + bias + SiLU over channels [c0, c0 + BLOCK_C), and its conv state writes."""
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
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + ch, mask=ok, other=0.0)
        row = (row0 + t).to(tl.int64)
        tl.store(mixed_ptr + row * channels + ch, _silu(acc), mask=ok)
        dst = tl.load(state_out_ptr + row)
        if dst >= 0:  # the last K - 1 inputs after this row
            for i in tl.static_range(0, TAPS - 1):
                tl.store(conv_ptr + dst * win_stride + i * channels + ch,
                         _padded(t + 1 + i, win_bits, slots, x_ptr, row0, stride_x, ch, ok, TAPS), mask=ok)


@triton.jit
def scan_kernel(mixed_ptr, dt_ptr, ssm_ptr, out_ptr, state_in_ptr, state_out_ptr, row_starts_ptr,
                rate_ptr, dt_bias_ptr, d_ptr, stride_dt, channels, dt_min: tl.float32, dt_max: tl.float32,
                HEADS: tl.constexpr, PER_GROUP: tl.constexpr, WIDTH: tl.constexpr, GROUP_WIDTH: tl.constexpr,
                N: tl.constexpr, P: tl.constexpr, N_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
                STATE_BITS: tl.constexpr, THRESHOLD: tl.constexpr):
    """One sequence's SSD recurrence for head `head`, columns [p0, p0 + BLOCK_P) of h."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    group = head // PER_GROUP
    n = tl.arange(0, N_PAD)
    n_ok = n < N
    cols = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = cols < P
    tile_ok = n_ok[:, None] & p_ok[None, :]
    tile = (head * N + n[:, None]).to(tl.int64) * P + cols[None, :]  # within one block's [H, N, P]
    row0 = tl.load(row_starts_ptr + seq)
    row1 = tl.load(row_starts_ptr + seq + 1)
    src = tl.load(state_in_ptr + seq)
    h = tl.load(ssm_ptr + src * (HEADS * N * P) + tile, mask=tl.where(src >= 0, tile_ok, False), other=0.0)
    tl.debug_barrier()  # every thread has its state before any thread writes one
    rate = tl.load(rate_ptr + head)
    dt_bias = tl.load(dt_bias_ptr + head)
    skip = tl.load(d_ptr + head)
    for row in range(row0, row1):  # int64 (row_starts are int64)
        base = mixed_ptr + row * channels
        x = tl.load(base + head * P + cols, mask=p_ok, other=0.0)
        b = tl.load(base + WIDTH + group * N + n, mask=n_ok, other=0.0)
        c = tl.load(base + WIDTH + GROUP_WIDTH + group * N + n, mask=n_ok, other=0.0)
        step = _softplus(tl.load(dt_ptr + row * stride_dt + head).to(tl.float32) + dt_bias, THRESHOLD)
        step = tl.where(step < dt_min, dt_min, step)  # torch.clamp: max(., lo), then min(., hi); NaN stays
        step = tl.where(step > dt_max, dt_max, step)
        decay = ex.exp_neg(-(rate * step))
        x_dt = x * step
        h = h * decay
        h = h + b[:, None] * x_dt[None, :]
        y = _grid_dot(h, c, STATE_BITS)
        tl.store(out_ptr + (row * HEADS + head) * P + cols, y + x * skip, mask=p_ok)
        dst = tl.load(state_out_ptr + row)
        if dst >= 0:
            tl.store(ssm_ptr + dst * (HEADS * N * P) + tile, h, mask=tile_ok)


@triton.jit
def gated_norm_kernel(y_ptr, z_ptr, weight_ptr, out_ptr, num_rows, stride_z, eps: tl.float32,
                      WIDTH: tl.constexpr, GW: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                      NORM_BITS: tl.constexpr, ROUND_BF16: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * GW + tl.arange(0, BLOCK)  # group program_id(1)'s slice
    col_ok = tl.arange(0, BLOCK) < GW
    ok = (rows < num_rows)[:, None] & col_ok[None, :]
    y = tl.load(y_ptr + rows[:, None] * WIDTH + cols[None, :], mask=ok, other=0.0)
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    g = y * _silu(z)
    # reference.rms_norm over the slice, step by step (padding lanes are 0: they add nothing)
    e = ex.exponent(tl.max(tl.abs(g), 1))
    g64 = g.to(tl.float64)
    sq = ex.round_even((g64 * g64) * ex.pow2((-e + (NORM_BITS - 1)) * 2)[:, None])
    ss = tl.sum(sq, 1)  # exact
    var = ex.scale32(ss.to(tl.float32), (e - NORM_BITS + 1) * 2)
    inv = ex.inverse_sqrt32(var, eps, GW)
    normed = g * inv[:, None]  # (times rms_norm's weight of ones: the same bits)
    if ROUND_BF16:  # .to(dtype)
        normed = normed.to(tl.bfloat16).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = normed * w[None, :]
    tl.store(out_ptr + rows[:, None] * WIDTH + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def mamba2(xbc, dt, state, batch, params, *, out: torch.Tensor | None = None, block_c: int = BLOCK_C,
           block_p: int = BLOCK_P, scratch_fill: float | None = None) -> torch.Tensor:
    """`mamba2.mamba2`, bitwise: xbc [rows, C], dt [rows, H] (column slices may pass as they are),
    state a models/cache.LayerState (read and written at the batch's state slots). Returns [rows,
    H, head_dim] float32, in `out` if given. block_c and block_p are free (the bits do not depend on
    them); scratch_fill pre-fills the conv's output scratch (tests)."""
    p = params
    rows, channels = xbc.shape
    heads, hd, groups, n = p.num_heads, p.head_dim, p.n_groups, p.state_size
    if heads % groups or channels != heads * hd + 2 * groups * n or dt.shape != (rows, heads):
        raise ValueError(f"xbc has {channels} channels and dt {tuple(dt.shape)}; {heads} heads of {hd} and "
                         f"{groups} groups of {n} need {heads * hd + 2 * groups * n} and ({rows}, {heads})")
    if n > MAX_STATE_SIZE:
        raise ValueError(f"state_size {n} > {MAX_STATE_SIZE}: the grid dot would leave float64's exact range")
    shape = (rows, heads, hd)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=xbc.device)
    elif out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 {shape} tensor")
    if rows == 0:
        return out
    conv, ssm = state.conv, state.ssm
    if not (conv.is_contiguous() and ssm.is_contiguous()) or conv.dtype != torch.float32 or ssm.dtype != torch.float32:
        raise ValueError("the recurrent state must be contiguous float32")
    taps = conv.shape[1] + 1
    state_in, state_out, row_starts = _slots(batch, state.block_size, xbc.device)
    num_seqs = row_starts.numel() - 1
    xbc, dt = _rows_unit_stride(xbc), _rows_unit_stride(dt)
    mixed = torch.empty((rows, channels), dtype=torch.float32, device=xbc.device)
    if scratch_fill is not None:
        mixed.fill_(scratch_fill)
    weight = p.conv_weight.float().contiguous()
    bias = p.conv_bias.float().contiguous() if p.conv_bias is not None else weight  # (not read without a bias)
    block_c = min(block_c, triton.next_power_of_2(channels))
    conv_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        xbc, conv, weight, bias, mixed, state_in, state_out, row_starts, xbc.stride(0), channels,
        TAPS=taps, WIN_PAD=triton.next_power_of_2(max(taps - 1, 1)), BLOCK_C=block_c,
        HAS_BIAS=p.conv_bias is not None, **LAUNCH_EXACT)
    block_p = min(block_p, triton.next_power_of_2(hd))
    scan_kernel[(num_seqs, heads, triton.cdiv(hd, block_p))](
        mixed, dt, ssm, out, state_in, state_out, row_starts,
        p.rate.float().contiguous(), p.dt_bias.float().contiguous(), p.d.float().contiguous(), dt.stride(0),
        channels, ref32.f32(p.dt_min), ref32.f32(p.dt_max),
        HEADS=heads, PER_GROUP=heads // groups, WIDTH=heads * hd, GROUP_WIDTH=groups * n, N=n, P=hd,
        N_PAD=triton.next_power_of_2(n), BLOCK_P=block_p, STATE_BITS=dn_ref.STATE_BITS,
        THRESHOLD=float(dn_ref.SOFTPLUS_THRESHOLD), **LAUNCH_EXACT)
    return out


def gated_group_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, n_groups: int, eps: float,
                     dtype: torch.dtype, *, out: torch.Tensor | None = None,
                     rows_per_program: int = NORM_ROWS) -> torch.Tensor:
    """`mamba2.gated_group_norm`, bitwise: y [rows, I] float32, z [rows, I] (a column slice passes
    as it is), weight [I]; returns [rows, I] in torch's promotion of dtype and weight's dtype."""
    num_rows, width = y.shape
    if n_groups <= 0 or width % n_groups or width // n_groups > MAX_NORM_WIDTH:
        raise ValueError(f"a row of {width} must split into {n_groups} groups of at most {MAX_NORM_WIDTH} "
                         "(an exact float64 sum)")
    if z.shape != y.shape or y.dtype != torch.float32 or dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"y float32 and z of one shape, dtype float32 or bfloat16 expected, got {y.dtype} "
                         f"{tuple(y.shape)}, {tuple(z.shape)}, {dtype}")
    out_dtype = torch.promote_types(dtype, weight.dtype)
    if out is None:
        out = torch.empty(y.shape, dtype=out_dtype, device=y.device)
    elif out.shape != y.shape or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {out_dtype} {tuple(y.shape)} tensor")
    if num_rows == 0:
        return out
    y, z = y.contiguous(), _rows_unit_stride(z)
    gw = width // n_groups
    gated_norm_kernel[(triton.cdiv(num_rows, rows_per_program), n_groups)](
        y, z, weight.contiguous(), out, num_rows, z.stride(0), ref32.f32(eps),
        WIDTH=width, GW=gw, BLOCK=triton.next_power_of_2(gw), ROWS=rows_per_program, NORM_BITS=NORM_BITS,
        ROUND_BF16=dtype == torch.bfloat16, **LAUNCH_EXACT)
    return out
