"""The MoE router's choice and weights in Triton, bitwise kernels/moe.route.

`route(logits, top_k, normalize)`: logits [rows, E] float32 -> (experts [rows, k] int64, weights
[rows, k] float32). One program per ROWS rows, the whole row of E logits in one tile:
- the top k by repeated selection: the largest value not yet taken, and among the positions
  holding it the lowest index (what the reference's stable descending sort puts first; -0.0 and
  +0.0 compare equal there and here, and a row of -inf picks its lowest untaken index);
- top_j = exp_neg(l_j - l_0) (float32, exact.float32's steps), kept in a [ROWS, k] register
  tile by selection (no arithmetic, so the bits are the exp's);
- normalize: total = top_0 + top_1 + ... in rank order (float32 adds); else every expert's
  exp_neg(l - l_0) on the 2^-39 grid summed as integers (exact: E <= 2^13), times 2^-39,
  rounded once to float32;
- weights = top / total, an IEEE float32 division (tl.math.div_rn).
Launched with FMA contraction off (exact_triton.LAUNCH_EXACT). Each row is computed alone, so
its bits do not depend on the rows beside it.

`combine(y, y_rows, experts, weights, shared_gate, shared)`: kernels/moe.combine, bitwise. One
program per (row, BLOCK columns): the row's k experts ranked by index (each one's rank: how many
of the row's experts are lower; they are distinct), then for rank 0, 1, ...: acc = acc + y * w in
float32 from 0 (the product rounded first: no contraction), then + sigmoid32(gate) * shared, and
one rounding to the output's dtype.

The cuda op set's `route` and `combine` (models/moe.MoE.forward calls ops.route; the cuda op set's
fuse_moe, combine).
"""
import torch
import triton
import triton.language as tl

from tensorfold.kernels import exact_triton as ex
from tensorfold.kernels.exact_triton import LAUNCH_EXACT
from tensorfold.kernels import moe as ref

MAX_EXPERTS = 1 << 13  # the all-experts sum on the 2^-39 grid stays below 2^53
ROWS = 16


@triton.jit
def route_kernel(logits_ptr, experts_ptr, weights_ptr, num_rows, stride_row,
                 E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                 ROWS: tl.constexpr, NORMALIZE: tl.constexpr, SUM_BITS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    cols = tl.arange(0, E_PAD)
    col_ok = cols < E
    logits = tl.load(logits_ptr + rows[:, None] * stride_row + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=float("-inf"))
    logits = tl.where(row_ok[:, None], logits, 0.0)  # rows past the end: finite (never stored)
    taken = (cols >= E)[None, :] | (rows < 0)[:, None]  # [ROWS, E_PAD]: padding never chosen
    ranks = tl.arange(0, K_PAD)
    chosen = tl.zeros([ROWS, K_PAD], tl.int64)
    top = tl.zeros([ROWS, K_PAD], tl.float32)
    first = tl.zeros([ROWS], tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), logits), 1)
        hit = (logits == best[:, None]) & ~taken
        pick = tl.min(tl.where(hit, cols[None, :], E_PAD), 1)
        # the logit itself (its sign of zero included), picked by its bits
        value = tl.max(tl.where(cols[None, :] == pick[:, None], logits.to(tl.int32, bitcast=True),
                                -2147483648), 1).to(tl.float32, bitcast=True)
        taken = taken | (cols[None, :] == pick[:, None])
        if j == 0:
            first = value
        t = ex.exp_neg(value - first)
        if j == 0:
            total = t
        else:
            total = total + t
        chosen = tl.where(ranks[None, :] == j, pick[:, None].to(tl.int64), chosen)
        top = tl.where(ranks[None, :] == j, t[:, None], top)
    if not NORMALIZE:
        every = ex.exp_neg(logits - first[:, None]).to(tl.float64)  # padding: exp(-inf) = 0
        grid = ex.round_even(every * (2.0 ** (SUM_BITS - 1)))
        total = (tl.sum(grid, 1) * (2.0 ** (1 - SUM_BITS))).to(tl.float32)  # exact sum, one rounding
    weights = tl.math.div_rn(top, total[:, None])
    out = rows[:, None] * TOP_K + ranks[None, :]
    ok = row_ok[:, None] & (ranks < TOP_K)[None, :]
    tl.store(experts_ptr + out, chosen, mask=ok)
    tl.store(weights_ptr + out, weights, mask=ok)


def route(logits: torch.Tensor, top_k: int, normalize: bool, *, rows_per_program: int = ROWS):
    """`kernels.moe.route`, bitwise: (experts [rows, k] int64, weights [rows, k] float32)."""
    num_rows, num_experts = logits.shape
    if num_experts > MAX_EXPERTS or not 1 <= top_k <= num_experts:
        raise ValueError(f"top {top_k} of {num_experts} experts (at most {MAX_EXPERTS})")
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    experts = torch.empty((num_rows, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((num_rows, top_k), dtype=torch.float32, device=logits.device)
    if num_rows:
        route_kernel[(triton.cdiv(num_rows, rows_per_program),)](
            logits, experts, weights, num_rows, logits.stride(0),
            E=num_experts, E_PAD=triton.next_power_of_2(num_experts), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), ROWS=rows_per_program, NORMALIZE=bool(normalize),
            SUM_BITS=ref.SUM_BITS, **LAUNCH_EXACT)
    return experts, weights


@triton.jit
def combine_kernel(y_ptr, y_rows_ptr, experts_ptr, weights_ptr, gate_ptr, shared_ptr, out_ptr, hidden,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr, SHARED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    slots = tl.arange(0, K_PAD)
    slot_ok = slots < TOP_K
    experts = tl.load(experts_ptr + row * TOP_K + slots, mask=slot_ok, other=0)
    # each slot's rank among the row's experts (ascending index; padding ranks past TOP_K)
    lower = (experts[None, :] < experts[:, None]) & slot_ok[None, :]
    rank = tl.where(slot_ok, tl.sum(lower.to(tl.int32), 1), K_PAD)
    y_rows = tl.load(y_rows_ptr + row * TOP_K + slots, mask=slot_ok, other=0)
    weights = tl.load(weights_ptr + row * TOP_K + slots, mask=slot_ok, other=0.0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(TOP_K):
        y_row = tl.sum(tl.where(rank == i, y_rows, 0), 0)
        w = tl.max(tl.where(rank == i, weights.to(tl.int32, bitcast=True), -2147483648), 0).to(tl.float32,
                                                                                                  bitcast=True)
        y = tl.load(y_ptr + y_row * hidden + cols, mask=ok, other=0.0).to(tl.float32)
        acc = acc + y * w
    if SHARED:
        g = tl.load(gate_ptr + row).to(tl.float32)
        t = ex.exp_neg(-tl.abs(g))
        sig = tl.math.div_rn(tl.where(g >= 0, 1.0, t), 1.0 + t)
        acc = acc + sig * tl.load(shared_ptr + row * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine(y: torch.Tensor, y_rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
            shared_gate: torch.Tensor | None = None, shared: torch.Tensor | None = None, *,
            out: torch.Tensor | None = None, block: int = 128) -> torch.Tensor:
    """`kernels.moe.combine`, bitwise: out [rows, hidden] in y's dtype."""
    rows, top_k = experts.shape
    hidden = y.shape[1]
    y, y_rows, experts, weights = y.contiguous(), y_rows.contiguous(), experts.contiguous(), weights.contiguous()
    if out is None:
        out = torch.empty((rows, hidden), dtype=y.dtype, device=y.device)
    has_shared = shared is not None
    if rows:
        gate = shared_gate.contiguous() if has_shared else y
        combine_kernel[(rows, triton.cdiv(hidden, block))](
            y, y_rows, experts, weights, gate, shared.contiguous() if has_shared else y, out, hidden,
            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK=block, SHARED=has_shared, **LAUNCH_EXACT)
    return out
