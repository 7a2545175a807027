"""Gated DeltaNet's C++ kernels (csrc/cpu/delta_net.cpp: _cpu.delta_net, _cpu.gated_rms_norm) against
their torch reference (kernels/delta_net.py), bit for bit.

Fresh random inputs every run (the seed is in the failure message), outputs NaN-poisoned before
each call, the cache blocks a call writes without reading poisoned too, odd shapes (key dims 16-128,
value heads 1-4x the key heads, block sizes 4 and 16, sequences starting mid-block, prefill and
decode rows in one batch), float32 and bfloat16, 1 and 2 threads. The written cache states are
compared as well, and a sequence run in chunks of 1, 3 and 16 rows gives the bits of one pass.
"""
import math
from dataclasses import dataclass

import pytest
import torch

from kernel_inputs import NAN
from delta_net_cases import poison_written_blocks, random_tables, same_bits
from tensorfold.backends import native_problem
from tensorfold.exact import float32
from tensorfold.kernels import delta_net as ref
from tensorfold.models.cache import RecurrentState
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
from tensorfold.models.linear_attention import DeltaNetParams

pytestmark = pytest.mark.skipif(native_problem() is not None, reason=str(native_problem()))
if native_problem() is None:
    from tensorfold import _cpu
    from tensorfold.backends import native_ops

DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Layer:
    params: DeltaNetParams
    spec: RecurrentState
    extra: int  # columns of the projection beside qkv, a and b (qkv, a, b are views into it)

    @property
    def channels(self) -> int:
        return self.spec.conv_dim


def make_layer(draw, key_heads, group, key_dim, value_dim, kernel=4) -> Layer:
    heads = key_heads * group
    conv_dim = 2 * key_heads * key_dim + heads * value_dim
    params = DeltaNetParams(key_heads, heads, key_dim, value_dim,
                            conv_weight=draw.randn(conv_dim, kernel, scale=0.5),
                            rate=ref.decay_rate(draw.rand(heads) * 2.5 - 1.0),  # A_log in [-1, 1.5]
                            dt_bias=draw.randn(heads))
    return Layer(params, RecurrentState(conv_dim, kernel, heads, key_dim, value_dim), extra=5)


def make_rows(draw, layer: Layer, rows: int, dtype):
    """qkv [rows, C], a, b [rows, H]: column slices of one projection, as the model passes them."""
    p, C = layer.params, layer.channels
    proj = draw.randn(rows, C + layer.extra + 2 * p.num_heads, dtype=dtype, scale=1.5)
    qkv, _, b, a = proj.split([C, layer.extra, p.num_heads, p.num_heads], dim=1)
    return qkv, a, b


def make_state(draw, layer: Layer, num_blocks: int, block_size: int):
    state = layer.spec.allocate(num_blocks, block_size, torch.float32, "cpu")
    state.conv.copy_(draw.randn(*state.conv.shape))
    state.ssm.copy_(draw.randn(*state.ssm.shape, scale=0.3))
    return state


def clone(state):
    return type(state)(state.conv.clone(), state.ssm.clone(), state.block_size)


def make_batch(spans, tables) -> ForwardBatch:
    """spans: (p0, n) per sequence; tables: each sequence's block table."""
    positions, sequences, start = [], [], 0
    for (p0, n), table in zip(spans, tables):
        positions += range(p0, p0 + n)
        sequences.append(SequenceRows(start, start + n, torch.tensor(table, dtype=torch.int64)))
        start += n
    rows = torch.zeros(start, dtype=torch.int64)
    return ForwardBatch(rows, torch.tensor(positions, dtype=torch.int64), rows.clone(), sequences,
                        torch.arange(start))


def native_delta_net(qkv, a, b, state, batch, params, out=None):
    p = params
    state_in, state_out = batch.state_slots(state.block_size)
    return _cpu.delta_net(qkv, a, b, state.conv, state.ssm, state_in, state_out, batch.row_starts_tensor,
                          p.conv_weight, p.rate, p.dt_bias, p.num_key_heads, p.num_heads, p.key_dim, p.value_dim,
                          out=out)


def check_against_reference(draw, layer, dtype, spans, block_size):
    tables, num_blocks = random_tables(draw, spans, block_size, spare=3)
    batch = make_batch(spans, tables)
    qkv, a, b = make_rows(draw, layer, batch.positions.numel(), dtype)
    state = make_state(draw, layer, num_blocks, block_size)
    poison_written_blocks(state, spans, tables)
    want_state, got_state = clone(state), clone(state)
    want = ref.delta_net(qkv, a, b, want_state, batch, layer.params)
    p = layer.params
    out = torch.full((qkv.shape[0], p.num_heads, p.value_dim), NAN, dtype=dtype)
    got = native_delta_net(qkv, a, b, got_state, batch, layer.params, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert same_bits(got, want), f"delta_net output differs ({draw}); max abs diff " \
                                 f"{(got.float() - want.float()).abs().max().item()}"
    assert same_bits(got_state.conv, want_state.conv), f"conv states differ ({draw})"
    assert same_bits(got_state.ssm, want_state.ssm), f"ssm states differ ({draw})"
    assert not want.isnan().any()


SHAPES = [  # key_heads, group, key_dim, value_dim
    (1, 1, 16, 16), (2, 2, 32, 24), (1, 4, 16, 40), (2, 3, 128, 16), (3, 1, 32, 128),
    (1, 2, 16, 84)]  # a head of 84 columns: work items of 16 to 64 (1 or 2 threads), runs of 16, then 4


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kh{}g{}dk{}dv{}".format(*s))
@pytest.mark.parametrize("block_size", [4, 16])
def test_delta_net_equals_reference(draw, threads, dtype, shape, block_size):
    layer = make_layer(draw, *shape)
    # prefill from 0, a chunk resuming mid-block, decode rows (one mid-block, one at a block's
    # first position, one at its last), a chunk starting at a block boundary
    spans = [(0, 11), (block_size + 2, 7), (37, 1), (2 * block_size, 1), (3 * block_size - 1, 1),
             (block_size, 5)]
    check_against_reference(draw, layer, dtype, spans, block_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_delta_net_many_rows_equals_reference(draw, threads, dtype):
    """Enough rows for the per-row phase to run on every thread."""
    layer = make_layer(draw, 2, 2, 32, 32)  # 256 channels: 128 rows and more split over the threads
    check_against_reference(draw, layer, dtype, [(3, 110), (0, 1), (9, 30)], 16)


def test_delta_net_conv_kernel_two_and_one_sequence_one_row(draw, threads):
    layer = make_layer(draw, 2, 1, 16, 16, kernel=2)
    check_against_reference(draw, layer, torch.float32, [(5, 1)], 4)
    check_against_reference(draw, layer, torch.bfloat16, [(0, 1)], 4)


def test_delta_net_extreme_gates(draw, threads):
    """a far above softplus's threshold and far below (decay 1 and decay 0), b saturating: the
    state's columns go to zero and back (exponent -127 on the grid)."""
    layer = make_layer(draw, 1, 2, 16, 16)
    spans, bs = [(0, 9), (6, 5)], 4
    tables, num_blocks = random_tables(draw, spans, bs, spare=3)
    batch = make_batch(spans, tables)
    qkv, a, b = make_rows(draw, layer, 14, torch.float32)
    a[:, 0] = torch.tensor([30.0, -30.0, 100.0, 25.0, 19.5, 20.0, -100.0] * 2)
    a[:, 1] = torch.tensor([1e4, -1e4] * 7)
    b[::3] *= 100.0
    state = make_state(draw, layer, num_blocks, bs)
    want_state, got_state = clone(state), clone(state)
    want = ref.delta_net(qkv, a, b, want_state, batch, layer.params)
    got = native_delta_net(qkv, a, b, got_state, batch, layer.params)
    assert same_bits(got, want), str(draw)
    assert same_bits(got_state.ssm, want_state.ssm) and same_bits(got_state.conv, want_state.conv), str(draw)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_delta_net_chunks_give_the_bits_of_one_pass(draw, threads, dtype, chunk):
    """One sequence of 37 rows in one call, and in calls of `chunk` rows (each resuming from the
    state the last left in the cache): the same outputs and the same cache."""
    layer = make_layer(draw, 2, 2, 16, 32)
    bs, length = 4, 37
    tables, num_blocks = random_tables(draw, [(0, length)], bs, spare=3)
    qkv, a, b = make_rows(draw, layer, length, dtype)
    state = make_state(draw, layer, num_blocks, bs)
    whole_state, chunked_state = clone(state), clone(state)
    whole = native_delta_net(qkv, a, b, whole_state, make_batch([(0, length)], tables), layer.params)
    parts = []
    for p0 in range(0, length, chunk):
        n = min(chunk, length - p0)
        batch = make_batch([(p0, n)], tables)
        parts.append(native_delta_net(qkv[p0:p0 + n], a[p0:p0 + n], b[p0:p0 + n], chunked_state, batch,
                                      layer.params))
    assert same_bits(torch.cat(parts), whole), str(draw)
    assert same_bits(chunked_state.conv, whole_state.conv), str(draw)
    assert same_bits(chunked_state.ssm, whole_state.ssm), str(draw)
    # and the reference agrees with both
    ref_state = clone(state)
    want = ref.delta_net(qkv, a, b, ref_state, make_batch([(0, length)], tables), layer.params)
    assert same_bits(whole, want) and same_bits(ref_state.ssm, whole_state.ssm), str(draw)


def test_delta_net_alone_equals_among_others(draw, threads):
    """A sequence's rows give the same bits alone and beside other sequences (any place)."""
    layer = make_layer(draw, 1, 2, 32, 16)
    bs = 16
    spans = [(5, 9), (20, 1), (0, 13)]
    tables, num_blocks = random_tables(draw, spans, bs, spare=3)
    qkv, a, b = make_rows(draw, layer, 23, torch.bfloat16)
    state = make_state(draw, layer, num_blocks, bs)
    together = native_delta_net(qkv, a, b, clone(state), make_batch(spans, tables), layer.params)
    start = 0
    for span, table in zip(spans, tables):
        rows = slice(start, start + span[1])
        alone = native_delta_net(qkv[rows], a[rows], b[rows], clone(state), make_batch([span], [table]), layer.params)
        assert same_bits(alone, together[rows]), str(draw)
        start += span[1]


def check_custom_slots(draw, layer, dtype, spans, tables, num_blocks, state_in, state_out):
    """The C++ op and the reference given the same batch with state_slots patched to (state_in,
    state_out): the same outputs and the same cache, bit for bit (NaN in every block written)."""
    batch = make_batch(spans, tables)
    slots = (torch.tensor(state_in, dtype=torch.int64), torch.tensor(state_out, dtype=torch.int64))
    batch.state_slots = lambda block_size: slots
    qkv, a, b = make_rows(draw, layer, len(state_out), dtype)
    state = make_state(draw, layer, num_blocks, 4)
    for block in set(state_out) - set(state_in) - {-1}:
        state.conv[block] = NAN
        state.ssm[block] = NAN
    want_state, got_state = clone(state), clone(state)
    want = ref.delta_net(qkv, a, b, want_state, batch, layer.params)
    got = native_ops.delta_net(qkv, a, b, got_state, batch, layer.params)
    assert same_bits(got, want), f"delta_net output differs ({draw})"
    assert same_bits(got_state.conv, want_state.conv), f"conv states differ ({draw})"
    assert same_bits(got_state.ssm, want_state.ssm), f"ssm states differ ({draw})"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_delta_net_custom_slots(draw, threads, dtype):
    """Slots the engine chooses, not the block tables': a sequence whose every row's state goes to
    a slot of its own (a verify round's per-row states), one that writes no state at all, one that
    starts from zeros mid-sequence, one that writes only a middle row's state, and one that writes
    its own starting block (read before written)."""
    layer = make_layer(draw, 2, 2, 32, 24)
    spans = [(9, 6), (3, 2), (40, 3), (0, 4), (17, 3)]
    tables = [[0]] * len(spans)  # not read: the slots below are the op's whole contract
    state_in = [2, 5, -1, -1, 8]
    state_out = [10, 11, 12, 13, 14, 15,   # every row to a distinct slot
                 -1, -1,                   # nothing written
                 -1, 16, 17,               # from zeros, two rows written
                 -1, 18, -1, -1,           # one middle row
                 -1, -1, 8]                # its last row into its own starting block
    check_custom_slots(draw, layer, dtype, spans, tables, 20, state_in, state_out)


def test_delta_net_slot_read_by_one_sequence_written_by_another(draw, threads):
    """A block one sequence starts from and another writes: the reader sees the state from
    before the call (every starting state is read before any is written), whatever the order the
    threads run the sequences in; and the same slot written twice by one sequence keeps its last."""
    layer = make_layer(draw, 1, 2, 16, 40)
    spans = [(5, 7), (2, 3), (8, 1)]
    tables = [[0]] * len(spans)
    state_in = [3, 4, 3]
    state_out = [-1, 4, -1, 9, -1, 9, 1,   # writes the block sequence 1 starts from, then 9 twice
                 3, -1, 6,                 # writes the block sequences 0 and 2 start from
                 -1]
    check_custom_slots(draw, layer, torch.float32, spans, tables, 10, state_in, state_out)


def test_native_ops_binds_the_kernels(draw):
    """native_ops.delta_net keeps the reference's signature."""
    layer = make_layer(draw, 1, 1, 16, 16)
    spans = [(2, 3)]
    tables, num_blocks = random_tables(draw, spans, 4, spare=3)
    batch = make_batch(spans, tables)
    qkv, a, b = make_rows(draw, layer, 3, torch.float32)
    state = make_state(draw, layer, num_blocks, 4)
    want_state, got_state = clone(state), clone(state)
    assert same_bits(native_ops.delta_net(qkv, a, b, got_state, batch, layer.params),
                     ref.delta_net(qkv, a, b, want_state, batch, layer.params))
    assert same_bits(got_state.ssm, want_state.ssm)
    assert native_ops.gated_rms_norm is _cpu.gated_rms_norm


def test_q_scale_is_the_references():
    """The kernel scales q by float32(sqrt(key_dim)); the reference by f32(key_dim ** 0.5)."""
    assert all(float32.f32(d ** 0.5) == float32.f32(math.sqrt(d)) for d in range(1, 257))


def test_delta_net_refuses_bad_shapes(draw):
    layer = make_layer(draw, 1, 1, 16, 16)
    batch = make_batch([(0, 2)], [[0]])
    qkv, a, b = make_rows(draw, layer, 2, torch.float32)
    state = make_state(draw, layer, 1, 4)
    with pytest.raises(RuntimeError, match="qkv"):
        native_delta_net(qkv[:, 1:], a, b, state, batch, layer.params)
    p = layer.params

    def call(state_in, state_out, row_starts=(0, 2)):
        return _cpu.delta_net(qkv, a, b, state.conv, state.ssm, torch.tensor(state_in), torch.tensor(state_out),
                              torch.tensor(row_starts), p.conv_weight, p.rate, p.dt_bias, p.num_key_heads,
                              p.num_heads, p.key_dim, p.value_dim)
    with pytest.raises(RuntimeError, match="state_in block"):
        call([1], [-1, 0])
    with pytest.raises(RuntimeError, match="state_out block"):
        call([-1], [-2, 0])
    with pytest.raises(RuntimeError, match="one state_out per row"):
        call([-1], [0])
    with pytest.raises(RuntimeError, match="one state_in per sequence"):
        call([-1, -1], [-1, 0])
    with pytest.raises(RuntimeError, match="written by two sequences"):
        call([-1, -1], [0, 0], row_starts=(0, 1, 2))
    big = DeltaNetParams(1, 1, 512, 1, torch.zeros(1025, 4), layer.params.rate, layer.params.dt_bias)
    with pytest.raises(RuntimeError, match="key_dim"):
        native_delta_net(torch.zeros(2, 1025), a, b, state, batch, big)


def test_bench_tool_runs():
    """tools/bench_delta_net.py at tiny sizes: both kernels and their references timed."""
    import os
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "tools/bench_delta_net.py", "--shape", "tiny", "--prefill-rows", "20",
                           "--repeats", "2", "--threads", "1"], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("delta_net, prefill 20 rows", "delta_net, decode 1 row", "delta_net, decode 4 rows",
                 "gated_rms_norm, 20 rows", "gated_rms_norm, 1 row"):
        assert re.search(rf"\| {name} \| \d+\.\d+ \| \d+\.\d+ \| \d+x \|", done.stdout), done.stdout


# ---- the gated norm --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("weight_dtype", DTYPES, ids=["w-f32", "w-bf16"])
@pytest.mark.parametrize("rows,width", [(1, 16), (7, 128), (300, 40), (33, 1)])
def test_gated_rms_norm_equals_reference(draw, threads, dtype, weight_dtype, rows, width):
    x = draw.randn(rows, width, dtype=dtype, scale=3.0)
    gate = draw.randn(rows, 2 * width, dtype=dtype, scale=2.0)[:, width // 2:width // 2 + width]  # a strided view
    weight = draw.randn(width, dtype=weight_dtype)
    want = ref.gated_rms_norm(x, gate, weight, 1e-6)
    out = torch.full(want.shape, NAN, dtype=dtype)
    got = _cpu.gated_rms_norm(x, gate, weight, 1e-6, out=out)
    assert same_bits(got, want), f"gated_rms_norm differs ({draw})"


def test_gated_rms_norm_zero_and_tiny_rows(draw):
    x = torch.zeros(3, 32)
    x[1] = draw.randn(32, scale=1e-30)
    x[2, 5] = 1e-40  # a subnormal alone
    gate = draw.randn(3, 32)
    weight = draw.randn(32)
    assert same_bits(_cpu.gated_rms_norm(x, gate, weight, 1e-6), ref.gated_rms_norm(x, gate, weight, 1e-6))
