"""Mamba2's C++ kernels (csrc/cpu/mamba2.cpp: _cpu.mamba2, _cpu.mamba2_gated_norm) against their
torch reference (kernels/mamba2.py), bit for bit.

Fresh random inputs every run (the seed is in the failure message), outputs NaN-poisoned before
each call, the cache blocks a call writes without reading poisoned too; shapes with head dims that
take every lane width (16, 8, 4, 1 columns), grouped B/C (1-4 heads per group), state sizes 16-128,
conv kernels 2-4 with and without a bias, dt clamped or not, block sizes 4 and 16, sequences
starting mid-block, prefill and decode rows in one batch, float32 and bfloat16, 1 and 2 threads.
The written cache states are compared as well; a sequence in chunks of 1, 3 and 16 rows gives the
bits of one pass; the slots the engine chooses (per-row states, a block read by one sequence and
written by another) are honoured.
"""
from dataclasses import dataclass

import pytest
import torch

from kernel_inputs import NAN
from delta_net_cases import poison_written_blocks, random_tables, same_bits
from tensorfold.backends import native_problem
from tensorfold.kernels import mamba2 as ref
from tensorfold.kernels.delta_net import decay_rate
from tensorfold.models.cache import Mamba2State
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
from tensorfold.models.mamba2 import Mamba2Params

pytestmark = pytest.mark.skipif(native_problem() is not None, reason=str(native_problem()))
if native_problem() is None:
    from tensorfold import _cpu
    from tensorfold.backends import native_ops

DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Layer:
    params: Mamba2Params
    spec: Mamba2State

    @property
    def channels(self) -> int:
        return self.spec.conv_dim


def make_layer(draw, heads, head_dim, groups, state_size, kernel=4, bias=True, limit=(0.0, float("inf"))) -> Layer:
    conv_dim = heads * head_dim + 2 * groups * state_size
    params = Mamba2Params(heads, head_dim, groups, state_size,
                          conv_weight=draw.randn(conv_dim, kernel, scale=0.5),
                          conv_bias=draw.randn(conv_dim, scale=0.3) if bias else None,
                          rate=decay_rate(draw.rand(heads) * 2.5 - 1.0),  # A_log in [-1, 1.5]
                          dt_bias=draw.randn(heads), d=draw.randn(heads), dt_min=limit[0], dt_max=limit[1])
    return Layer(params, Mamba2State(conv_dim, kernel, heads, state_size, head_dim))


def make_rows(draw, layer: Layer, rows: int, dtype):
    """xbc [rows, C] and dt [rows, H]: column slices of one projection (after z), as Mamba2.forward
    passes them."""
    p, C = layer.params, layer.channels
    proj = draw.randn(rows, 3 + C + p.num_heads, dtype=dtype, scale=1.5)
    _, xbc, dt = proj.split([3, C, p.num_heads], dim=1)
    return xbc, dt


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


def native_mamba2(xbc, dt, state, batch, params, out=None):
    p = params
    state_in, state_out = batch.state_slots(state.block_size)
    return _cpu.mamba2(xbc, dt, state.conv, state.ssm, state_in, state_out, batch.row_starts_tensor, p.conv_weight,
                       p.conv_bias, p.rate, p.dt_bias, p.d, p.dt_min, p.dt_max, p.num_heads, p.head_dim, p.n_groups,
                       p.state_size, out=out)


def check_against_reference(draw, layer, dtype, spans, block_size):
    tables, num_blocks = random_tables(draw, spans, block_size, spare=3)
    batch = make_batch(spans, tables)
    xbc, dt = make_rows(draw, layer, batch.positions.numel(), dtype)
    state = make_state(draw, layer, num_blocks, block_size)
    poison_written_blocks(state, spans, tables)
    want_state, got_state = clone(state), clone(state)
    want = ref.mamba2(xbc, dt, want_state, batch, layer.params)
    p = layer.params
    out = torch.full((xbc.shape[0], p.num_heads, p.head_dim), NAN)
    got = native_mamba2(xbc, dt, got_state, batch, layer.params, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert same_bits(got, want), f"mamba2 output differs ({draw}); max abs diff {(got - want).abs().max().item()}"
    assert same_bits(got_state.conv, want_state.conv), f"conv states differ ({draw})"
    assert same_bits(got_state.ssm, want_state.ssm), f"ssm states differ ({draw})"
    assert not want.isnan().any()


SHAPES = [  # heads, head_dim, groups, state_size
    (1, 16, 1, 16), (4, 8, 2, 16), (3, 29, 1, 32), (4, 16, 4, 128), (2, 36, 1, 64),
    (2, 84, 1, 16),  # a head of 84 columns: work items of 16 to 64 (1 or 2 threads), runs of 16, then 4
    (8, 64, 2, 32)]  # whole 64-column rows per item: four runs of 16 in one pass


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}p{}g{}n{}".format(*s))
@pytest.mark.parametrize("block_size", [4, 16])
def test_mamba2_equals_reference(draw, threads, dtype, shape, block_size):
    layer = make_layer(draw, *shape)
    # prefill from 0, a chunk resuming mid-block, decode rows (one mid-block, one at a block's
    # first position, one at its last), a chunk starting at a block boundary
    spans = [(0, 11), (block_size + 2, 7), (37, 1), (2 * block_size, 1), (3 * block_size - 1, 1),
             (block_size, 5)]
    check_against_reference(draw, layer, dtype, spans, block_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_mamba2_many_rows_equals_reference(draw, threads, dtype):
    """Enough rows for the per-row phase to run on every thread."""
    layer = make_layer(draw, 4, 32, 2, 32)  # 256 channels: 128 rows and more split over the threads
    check_against_reference(draw, layer, dtype, [(3, 110), (0, 1), (9, 30)], 16)


@pytest.mark.parametrize("kernel,bias", [(2, False), (3, True), (1, True)])
def test_mamba2_conv_kernels_and_no_bias(draw, threads, kernel, bias):
    layer = make_layer(draw, 2, 8, 1, 16, kernel=kernel, bias=bias)
    check_against_reference(draw, layer, torch.float32, [(5, 1), (0, 6)], 4)
    check_against_reference(draw, layer, torch.bfloat16, [(0, 1)], 4)


def test_mamba2_clamped_time_steps_and_extreme_gates(draw, threads):
    """dt clamped to a window (Nemotron's time_step_limit), dt far above softplus's threshold and
    far below (decay near 0 and 1), x saturating: state columns go to zero and back (exponent
    -127 on the grid)."""
    layer = make_layer(draw, 2, 16, 1, 16, limit=(0.001, 0.1))
    free = make_layer(draw, 2, 16, 1, 16)
    for lay in (layer, free):
        spans, bs = [(0, 9), (6, 5)], 4
        tables, num_blocks = random_tables(draw, spans, bs, spare=3)
        batch = make_batch(spans, tables)
        xbc, dt = make_rows(draw, lay, 14, torch.float32)
        dt[:, 0] = torch.tensor([30.0, -30.0, 100.0, 25.0, 19.5, 20.0, -100.0] * 2)
        dt[:, 1] = torch.tensor([-1e4, 1e4] * 7)  # the first rows from zeros: h stays 0 (exponent -127)
        xbc[::3] *= 100.0
        xbc[4] = 0.0
        state = make_state(draw, lay, num_blocks, bs)
        want_state, got_state = clone(state), clone(state)
        want = ref.mamba2(xbc, dt, want_state, batch, lay.params)
        got = native_mamba2(xbc, dt, got_state, batch, lay.params)
        assert same_bits(got, want), str(draw)
        assert same_bits(got_state.ssm, want_state.ssm) and same_bits(got_state.conv, want_state.conv), str(draw)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_mamba2_chunks_give_the_bits_of_one_pass(draw, threads, dtype, chunk):
    """One sequence of 37 rows in one call, and in calls of `chunk` rows (each resuming from the
    state the last left in the cache): the same outputs and the same cache, and the reference's."""
    layer = make_layer(draw, 4, 12, 2, 16)
    bs, length = 4, 37
    tables, num_blocks = random_tables(draw, [(0, length)], bs, spare=3)
    xbc, dt = make_rows(draw, layer, length, dtype)
    state = make_state(draw, layer, num_blocks, bs)
    whole_state, chunked_state = clone(state), clone(state)
    whole = native_mamba2(xbc, dt, whole_state, make_batch([(0, length)], tables), layer.params)
    parts = []
    for p0 in range(0, length, chunk):
        n = min(chunk, length - p0)
        parts.append(native_mamba2(xbc[p0:p0 + n], dt[p0:p0 + n], chunked_state, make_batch([(p0, n)], tables),
                                   layer.params))
    assert same_bits(torch.cat(parts), whole), str(draw)
    assert same_bits(chunked_state.conv, whole_state.conv), str(draw)
    assert same_bits(chunked_state.ssm, whole_state.ssm), str(draw)
    ref_state = clone(state)
    want = ref.mamba2(xbc, dt, ref_state, make_batch([(0, length)], tables), layer.params)
    assert same_bits(whole, want) and same_bits(ref_state.ssm, whole_state.ssm), str(draw)


def test_mamba2_alone_equals_among_others(draw, threads):
    """A sequence's rows give the same bits alone and beside other sequences (any place)."""
    layer = make_layer(draw, 2, 16, 1, 32)
    bs = 16
    spans = [(5, 9), (20, 1), (0, 13)]
    tables, num_blocks = random_tables(draw, spans, bs, spare=3)
    xbc, dt = make_rows(draw, layer, 23, torch.bfloat16)
    state = make_state(draw, layer, num_blocks, bs)
    together = native_mamba2(xbc, dt, clone(state), make_batch(spans, tables), layer.params)
    start = 0
    for span, table in zip(spans, tables):
        rows = slice(start, start + span[1])
        alone = native_mamba2(xbc[rows], dt[rows], clone(state), make_batch([span], [table]), layer.params)
        assert same_bits(alone, together[rows]), str(draw)
        start += span[1]


def check_custom_slots(draw, layer, dtype, spans, tables, num_blocks, state_in, state_out):
    """The C++ op (through native_ops) and the reference given the same batch with state_slots
    patched to (state_in, state_out): the same outputs and the same cache (NaN in every block written)."""
    batch = make_batch(spans, tables)
    slots = (torch.tensor(state_in, dtype=torch.int64), torch.tensor(state_out, dtype=torch.int64))
    batch.state_slots = lambda block_size: slots
    xbc, dt = make_rows(draw, layer, len(state_out), dtype)
    state = make_state(draw, layer, num_blocks, 4)
    for block in set(state_out) - set(state_in) - {-1}:
        state.conv[block] = NAN
        state.ssm[block] = NAN
    want_state, got_state = clone(state), clone(state)
    want = ref.mamba2(xbc, dt, want_state, batch, layer.params)
    got = native_ops.mamba2(xbc, dt, got_state, batch, layer.params)
    assert same_bits(got, want), f"mamba2 output differs ({draw})"
    assert same_bits(got_state.conv, want_state.conv), f"conv states differ ({draw})"
    assert same_bits(got_state.ssm, want_state.ssm), f"ssm states differ ({draw})"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_mamba2_custom_slots(draw, threads, dtype):
    """Slots the engine chooses: every row's state to a slot of its own (a verify round), none
    written, from zeros mid-sequence, only a middle row's, and a sequence's own starting block."""
    layer = make_layer(draw, 4, 12, 2, 16)
    spans = [(9, 6), (3, 2), (40, 3), (0, 4), (17, 3)]
    tables = [[0]] * len(spans)  # not read: the slots below are the op's whole contract
    state_in = [2, 5, -1, -1, 8]
    state_out = [10, 11, 12, 13, 14, 15, -1, -1, -1, 16, 17, -1, 18, -1, -1, -1, -1, 8]
    check_custom_slots(draw, layer, dtype, spans, tables, 20, state_in, state_out)


def test_mamba2_slot_read_by_one_sequence_written_by_another(draw, threads):
    """A block one sequence starts from and another writes: the reader sees the state from before
    the call; the same slot written twice by one sequence keeps its last."""
    layer = make_layer(draw, 2, 20, 1, 16)
    spans = [(5, 7), (2, 3), (8, 1)]
    tables = [[0]] * len(spans)
    state_in = [3, 4, 3]
    state_out = [-1, 4, -1, 9, -1, 9, 1, 3, -1, 6, -1]
    check_custom_slots(draw, layer, torch.float32, spans, tables, 10, state_in, state_out)


def test_mamba2_refuses_bad_shapes(draw):
    layer = make_layer(draw, 2, 8, 1, 16)
    batch = make_batch([(0, 2)], [[0]])
    xbc, dt = make_rows(draw, layer, 2, torch.float32)
    state = make_state(draw, layer, 1, 4)
    with pytest.raises(RuntimeError, match="xbc"):
        native_mamba2(xbc[:, 1:], dt, state, batch, layer.params)
    with pytest.raises(RuntimeError, match="dt"):
        native_mamba2(xbc, dt[:, 1:], state, batch, layer.params)
    p = layer.params

    def call(state_in, state_out, row_starts=(0, 2), groups=1, state_size=16):
        return _cpu.mamba2(xbc, dt, state.conv, state.ssm, torch.tensor(state_in), torch.tensor(state_out),
                           torch.tensor(row_starts), p.conv_weight, p.conv_bias, p.rate, p.dt_bias, p.d, p.dt_min,
                           p.dt_max, p.num_heads, p.head_dim, groups, state_size)
    with pytest.raises(RuntimeError, match="state_in block"):
        call([1], [-1, 0])
    with pytest.raises(RuntimeError, match="one state_out per row"):
        call([-1], [0])
    with pytest.raises(RuntimeError, match="written by two sequences"):
        call([-1, -1], [0, 0], row_starts=(0, 1, 2))
    with pytest.raises(RuntimeError, match="multiple of n_groups"):
        call([-1], [-1, 0], groups=3)
    with pytest.raises(RuntimeError, match="state_size"):
        call([-1], [-1, 0], state_size=512)


# ---- the gated norm --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("weight_dtype", DTYPES, ids=["w-f32", "w-bf16"])
@pytest.mark.parametrize("rows,width,groups", [(1, 16, 1), (7, 128, 4), (300, 40, 2), (33, 3, 3)])
def test_gated_norm_equals_reference(draw, threads, dtype, weight_dtype, rows, width, groups):
    y = draw.randn(rows, width, scale=3.0)
    z = draw.randn(rows, 2 * width, dtype=dtype, scale=2.0)[:, width // 2:width // 2 + width]  # a strided view
    weight = draw.randn(width, dtype=weight_dtype)
    want = ref.gated_group_norm(y, z, weight, groups, 1e-5, dtype)
    out = torch.full(want.shape, NAN, dtype=want.dtype)
    got = _cpu.mamba2_gated_norm(y, z, weight, groups, 1e-5, dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert same_bits(got, want), f"gated norm differs ({draw})"


def test_gated_norm_zero_and_tiny_groups(draw):
    y = draw.randn(3, 32)
    y[0, :16] = 0.0
    y[1] *= 1e-30
    y[2, 16:] = 0.0
    y[2, 20] = 1e-40  # a subnormal alone in its group
    z = draw.randn(3, 32)
    weight = draw.randn(32)
    assert same_bits(_cpu.mamba2_gated_norm(y, z, weight, 2, 1e-6, torch.float32),
                     ref.gated_group_norm(y, z, weight, 2, 1e-6, torch.float32))


def test_native_ops_binds_the_kernels(draw):
    """The native op set runs the C++ kernels under the reference's names and signatures."""
    layer = make_layer(draw, 2, 8, 2, 16)
    spans = [(2, 3)]
    tables, num_blocks = random_tables(draw, spans, 4, spare=3)
    batch = make_batch(spans, tables)
    xbc, dt = make_rows(draw, layer, 3, torch.float32)
    state = make_state(draw, layer, num_blocks, 4)
    want_state, got_state = clone(state), clone(state)
    assert same_bits(native_ops.mamba2(xbc, dt, got_state, batch, layer.params),
                     ref.mamba2(xbc, dt, want_state, batch, layer.params))
    assert same_bits(got_state.ssm, want_state.ssm)
    assert native_ops.mamba2 is not ref.mamba2 and native_ops.mamba2_gated_norm is not ref.gated_group_norm
    y, z, w = draw.randn(3, 16), draw.randn(3, 16), draw.randn(16)
    assert same_bits(native_ops.mamba2_gated_norm(y, z, w, 2, 1e-5, torch.float32),
                     ref.gated_group_norm(y, z, w, 2, 1e-5, torch.float32))


def test_bench_tool_runs():
    """tools/bench_mamba2.py at tiny sizes: both kernels and their references timed."""
    import os
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "tools/bench_mamba2.py", "--shape", "tiny", "--prefill-rows", "20",
                           "--repeats", "2", "--threads", "1"], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("mamba2, prefill 20 rows", "mamba2, decode 1 row", "mamba2, decode 4 rows",
                 "gated norm, prefill 20 rows", "gated norm, decode 1 row"):
        assert re.search(rf"\| {name} \| \d+\.\d+ \| \d+\.\d+ \| \d+x \|", done.stdout), done.stdout


# ---- the fused layer -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_fused_layer_equals_the_composition(tmp_path, smollm2_tokenizer, dtype):
    """A tiny nemotron_h whose Mamba2 layers come first, in the middle and last (the last one's
    residual add without a next norm) on the native op set: each Mamba2 layer as one
    _cpu.Mamba2Layer call, and as its Python composition (fuse off): the same logits and the same
    conv and ssm states, bit for bit, over a two-sequence prefill and a round mixing a decode row
    with a chunk resuming mid-block."""
    import types

    from test_models import BLOCK, _rows
    from tensorfold.backends import backend_ops
    from tensorfold.models.hf_dir import load_hf_dir
    from tensorfold.models.loader import build_model
    from tools.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path), "nemotron_h", tokenizer=smollm2_tokenizer,
                                hybrid_override_pattern="M*EM-M", num_hidden_layers=6)
    native = backend_ops("cpu")
    composed = types.SimpleNamespace(**{n: getattr(native, n) for n in dir(native) if not n.startswith("__")})
    composed.fuse = lambda layer: None if type(layer.mixer).__name__ == "Mamba2" else native.fuse(layer)
    fused_model = build_model(load_hf_dir(path), dtype, native)
    plain_model = build_model(load_hf_dir(path), dtype, composed)
    kinds = [type(layer.mixer).__name__ for layer in fused_model.layers]
    assert kinds[0] == kinds[-1] == "Mamba2"
    fused = [not hasattr(run, "__self__") for run in fused_model._run]  # a closure, not layer.forward
    assert [f for f, kind in zip(fused, kinds) if kind == "Mamba2"] == [True] * 3
    tables = [list(range(0, 40 // BLOCK + 1)), list(range(40 // BLOCK + 1, 2 * (40 // BLOCK + 1)))]
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 1000, (40,), generator=gen).tolist() for _ in range(2)]
    rounds = [[(0, ids[0][:21], 0, True), (1, ids[1][:9], 0, True)],
              [(0, ids[0][21:22], 21, True), (1, ids[1][9:30], 9, True)]]
    caches = [model.allocate_cache(2 * len(tables[0]), BLOCK, torch.float32) for model in (fused_model, plain_model)]
    for pieces in rounds:
        got = fused_model.forward(_rows(tables, pieces), caches[0])
        want = plain_model.forward(_rows(tables, pieces), caches[1])
        assert same_bits(got, want)
    for got, want, kind in zip(caches[0].layers, caches[1].layers, kinds):
        if kind == "Mamba2":
            assert same_bits(got.conv, want.conv) and same_bits(got.ssm, want.ssm)
