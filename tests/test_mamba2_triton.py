"""Mamba2's Triton kernels (kernels/mamba2_triton.py) against their torch reference
(kernels/mamba2.py), bit for bit.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by kernel_inputs
before any kernel module is imported), patched to compute what the GPU computes
(tests/triton_interpreter.py); with one, the same tests run compiled on CUDA tensors against the
reference on CPU copies. Fresh random inputs every run (the seed is in the failure message); the
output and the conv's scratch are NaN-filled before each launch, and the cache blocks a call writes
without reading are NaN too. Small shapes (the interpreter is slow): grouped B/C, a head dim that
is not a power of two split over two column programs, conv kernels 4 and 2 with and without a
bias, dt clamped or not, several sequences starting mid-block, at a block's start and at its last
position, block sizes 4 and 16, float32 and bfloat16 projections. The written conv and ssm states
are compared as well, a sequence run in chunks gives the bits of the reference's one pass, and the
kernels compile for sm_90 without FMA or approximate instructions.
"""
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from kernel_inputs import DEVICE, NAN  # first: sets TRITON_INTERPRET without a GPU
from delta_net_cases import poison_written_blocks, random_tables, same_bits  # noqa: E402

import pytest  # noqa: E402

from tensorfold.kernels import mamba2 as ref  # noqa: E402
from tensorfold.kernels import mamba2_triton as tri  # noqa: E402
from tensorfold.kernels.delta_net import decay_rate  # noqa: E402
from tensorfold.models.cache import Mamba2State  # noqa: E402
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows  # noqa: E402
from tensorfold.models.mamba2 import Mamba2Params  # noqa: E402
from test_delta_net_triton import float_ops, quick_device_calls  # noqa: E402,F401 (autouse fixture)
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Layer:
    params: Mamba2Params
    spec: Mamba2State


def make_layer(draw, heads, head_dim, groups, state_size, kernel=4, bias=True, limit=(0.0, float("inf"))) -> Layer:
    conv_dim = heads * head_dim + 2 * groups * state_size
    params = Mamba2Params(heads, head_dim, groups, state_size,
                          conv_weight=draw.randn(conv_dim, kernel, scale=0.5),
                          conv_bias=draw.randn(conv_dim, scale=0.3) if bias else None,
                          rate=decay_rate(draw.rand(heads) * 2.5 - 1.0).to(DEVICE),  # A_log in [-1, 1.5]
                          dt_bias=draw.randn(heads), d=draw.randn(heads), dt_min=limit[0], dt_max=limit[1])
    return Layer(params, Mamba2State(conv_dim, kernel, heads, state_size, head_dim))


def on_cpu(p: Mamba2Params) -> Mamba2Params:
    return Mamba2Params(p.num_heads, p.head_dim, p.n_groups, p.state_size, p.conv_weight.cpu(),
                        None if p.conv_bias is None else p.conv_bias.cpu(), p.rate.cpu(), p.dt_bias.cpu(), p.d.cpu(),
                        p.dt_min, p.dt_max)


def make_rows(draw, layer: Layer, rows: int, dtype):
    """xbc [rows, C] and dt [rows, H]: column slices of one projection after z, as the model passes them."""
    p, channels = layer.params, layer.spec.conv_dim
    proj = draw.randn(rows, 3 + channels + p.num_heads, dtype=dtype, scale=1.5)
    _, xbc, dt = proj.split([3, channels, p.num_heads], dim=1)
    return xbc, dt


def make_state(draw, layer: Layer, num_blocks: int, block_size: int):
    state = layer.spec.allocate(num_blocks, block_size, torch.float32, DEVICE)
    state.conv.copy_(draw.randn(*state.conv.shape))
    state.ssm.copy_(draw.randn(*state.ssm.shape, scale=0.3))
    return state


def clone(state, device=None):
    return type(state)(state.conv.to(device).clone(), state.ssm.to(device).clone(), state.block_size)


def make_batch(spans, tables, device=DEVICE) -> ForwardBatch:
    """spans: (first position, rows) per sequence; tables: each sequence's block table."""
    positions, sequences, start = [], [], 0
    for (p0, n), table in zip(spans, tables):
        positions += range(p0, p0 + n)
        sequences.append(SequenceRows(start, start + n, torch.tensor(table, dtype=torch.int64)))
        start += n
    rows = torch.zeros(start, dtype=torch.int64, device=device)
    return ForwardBatch(rows, torch.tensor(positions, dtype=torch.int64, device=device), rows.clone(), sequences,
                        torch.arange(start, device=device))


def reference(xbc, dt, state, spans, tables, params):
    """The torch reference on CPU copies: (output, state after)."""
    want_state = clone(state, "cpu")
    want = ref.mamba2(xbc.cpu(), dt.cpu(), want_state, make_batch(spans, tables, "cpu"), on_cpu(params))
    return want, want_state


def check(draw, layer, dtype, spans, block_size, *, block_c=tri.BLOCK_C, block_p=tri.BLOCK_P, edit=None):
    tables, num_blocks = random_tables(draw, spans, block_size)
    batch = make_batch(spans, tables)
    xbc, dt = make_rows(draw, layer, batch.positions.numel(), dtype)
    if edit is not None:
        edit(xbc, dt)
    state = make_state(draw, layer, num_blocks, block_size)
    poison_written_blocks(state, spans, tables)
    want, want_state = reference(xbc, dt, state, spans, tables, layer.params)
    got_state = clone(state)
    p = layer.params
    out = torch.full((xbc.shape[0], p.num_heads, p.head_dim), NAN, device=DEVICE)
    got = tri.mamba2(xbc, dt, got_state, batch, p, out=out, block_c=block_c, block_p=block_p, scratch_fill=NAN)
    assert got.data_ptr() == out.data_ptr()
    assert same_bits(got, want), f"mamba2 output differs ({draw}); max abs diff " \
                                 f"{(got.cpu() - want).abs().max().item()}"
    assert same_bits(got_state.conv, want_state.conv), f"conv states differ ({draw})"
    assert same_bits(got_state.ssm, want_state.ssm), f"ssm states differ ({draw})"
    assert not want.isnan().any()


SHAPES = [  # heads, head_dim, groups, state_size
    (2, 16, 1, 16), (4, 24, 2, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}p{}g{}n{}".format(*s))
@pytest.mark.parametrize("block_size", [4, 16])
def test_mamba2_equals_reference(draw, dtype, shape, block_size):
    """A prefill from 0, a chunk resuming mid-block, decode rows at a block's last position and
    at its first, a chunk starting at a block boundary; channels and head columns split over
    several programs (head dim 24 over two column programs of 16)."""
    layer = make_layer(draw, *shape)
    spans = [(0, 6), (block_size + 2, 5), (2 * block_size - 1, 1), (3 * block_size, 1), (block_size, 3)]
    check(draw, layer, dtype, spans, block_size, block_c=32, block_p=16)


def test_mamba2_two_tap_conv_without_bias(draw):
    layer = make_layer(draw, 2, 8, 2, 16, kernel=2, bias=False)
    check(draw, layer, torch.float32, [(5, 1), (0, 3)], 4)


def test_mamba2_clamped_steps_and_extreme_gates(draw):
    """dt clamped to a window, dt far above softplus's threshold and far below (decay near 0 and
    1: columns of h go to zero, exponent -127 on the grid, and back), large x."""
    layer = make_layer(draw, 2, 16, 1, 16, limit=(0.001, 0.1))

    def edit(xbc, dt):
        dt[:, 0] = torch.tensor([30.0, -30.0, 100.0, 25.0, 19.5, 20.0, -100.0] * 2)
        dt[:, 1] = torch.tensor([-1e4, 1e4] * 7)  # the first rows from zeros: h stays 0 (exponent -127)
        xbc[::3] *= 100.0
        xbc[4] = 0.0
    check(draw, layer, torch.float32, [(0, 9), (6, 5)], 4, edit=edit)
    check(draw, make_layer(draw, 2, 16, 1, 16), torch.float32, [(0, 9), (6, 5)], 4, edit=edit)


@pytest.mark.parametrize("chunk", [1, 3])
def test_mamba2_chunks_give_the_bits_of_one_pass(draw, chunk):
    """A sequence fed to the kernels in chunks (each resuming from the state the last one wrote)
    gives the reference's one-pass output and final states."""
    layer, bs, n = make_layer(draw, 2, 8, 1, 16), 4, 10
    tables, num_blocks = random_tables(draw, [(0, n)], bs)
    xbc, dt = make_rows(draw, layer, n, torch.float32)
    state = make_state(draw, layer, num_blocks, bs)
    poison_written_blocks(state, [(0, n)], tables)
    want, want_state = reference(xbc, dt, state, [(0, n)], tables, layer.params)
    got_state = clone(state)
    got = torch.cat([tri.mamba2(xbc[t:t + chunk], dt[t:t + chunk], got_state,
                                make_batch([(t, min(chunk, n - t))], tables), layer.params)
                     for t in range(0, n, chunk)])
    assert same_bits(got, want), str(draw)
    assert same_bits(got_state.conv, want_state.conv) and same_bits(got_state.ssm, want_state.ssm), str(draw)


def test_mamba2_refuses_what_it_cannot_do_exactly(draw):
    layer = make_layer(draw, 2, 8, 1, 16)
    p = layer.params
    wide = Mamba2Params(2, 8, 1, 512, p.conv_weight, p.conv_bias, p.rate, p.dt_bias, p.d, 0.0, 1.0)
    with pytest.raises(ValueError, match="state_size 512"):
        tri.mamba2(torch.zeros(1, 16 + 1024), torch.zeros(1, 2), None, make_batch([(0, 1)], [[0]]), wide)
    with pytest.raises(ValueError, match="channels"):
        tri.mamba2(torch.zeros(1, 7), torch.zeros(1, 2), None, make_batch([(0, 1)], [[0]]), p)


# ---- the gated norm ----

@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("weight_dtype", DTYPES, ids=["w-f32", "w-bf16"])
@pytest.mark.parametrize("width,groups", [(48, 2), (24, 1)])
def test_gated_norm_equals_reference(draw, dtype, weight_dtype, width, groups):
    """y as mamba2 returns it (reshaped, contiguous float32), z a column slice of a projection;
    a zero group, a tiny and a huge row."""
    rows = 19  # not a multiple of the rows per program
    y = draw.randn(rows, width, scale=2.0)
    y[3, :width // groups] = 0.0
    y[5] *= 1e-30
    y[6] *= 1e25
    z = draw.randn(rows, width + 5, dtype=dtype, scale=3.0)[:, 2:2 + width]
    weight = draw.randn(width).to(weight_dtype)
    want = ref.gated_group_norm(y.cpu(), z.cpu(), weight.cpu(), groups, 1e-5, dtype)
    out = torch.full(want.shape, NAN, dtype=want.dtype, device=DEVICE)
    got = tri.gated_group_norm(y, z, weight, groups, 1e-5, dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert same_bits(got, want), f"gated norm differs ({draw})"


def test_cuda_ops_binds_the_kernels():
    from tensorfold.backends import backend_ops
    ops = backend_ops("cuda")
    assert ops.mamba2 is tri.mamba2
    assert ops.mamba2_gated_norm is tri.gated_group_norm


# ---- compiled for sm_90: no FMA, nothing approximate ----

COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tensorfold.kernels import mamba2_triton as m
from tensorfold.kernels.exact_triton import LAUNCH_EXACT

def ptx(fn, signature, constexprs):
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(LAUNCH_EXACT)).asm["ptx"]

slots = dict(state_in_ptr="*i64", state_out_ptr="*i64", row_starts_ptr="*i64")
kernels = {
    "conv": (m.conv_kernel, dict(x_ptr="*bf16", conv_ptr="*fp32", weight_ptr="*fp32", bias_ptr="*fp32",
                                 mixed_ptr="*fp32", **slots, stride_x="i32", channels="i32"),
             dict(TAPS=4, WIN_PAD=4, BLOCK_C=m.BLOCK_C, HAS_BIAS=True)),
    "scan": (m.scan_kernel,
             dict(mixed_ptr="*fp32", dt_ptr="*bf16", ssm_ptr="*fp32", out_ptr="*fp32", **slots, rate_ptr="*fp32",
                  dt_bias_ptr="*fp32", d_ptr="*fp32", stride_dt="i32", channels="i32", dt_min="fp32", dt_max="fp32"),
             dict(HEADS=128, PER_GROUP=16, WIDTH=8192, GROUP_WIDTH=1024, N=128, P=64, N_PAD=128, BLOCK_P=m.BLOCK_P,
                  STATE_BITS=22, THRESHOLD=20.0)),
    "gated_norm": (m.gated_norm_kernel,
                   dict(y_ptr="*fp32", z_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16", num_rows="i32",
                        stride_z="i32", eps="fp32"),
                   dict(WIDTH=8192, GW=1024, BLOCK=1024, ROWS=m.NORM_ROWS, NORM_BITS=20, ROUND_BF16=True)),
}
out = {}
for name, (fn, sig, const) in kernels.items():
    try:
        out[name] = ptx(fn, sig, const)
    except Exception as e:  # reported per kernel
        out[name] = "ERROR " + repr(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx():
    import triton.backends
    if "nvidia" not in triton.backends.backends:
        pytest.skip("Triton's nvidia backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("name", ["conv", "scan", "gated_norm"])
def test_kernel_compiles_without_fma_flushes_or_approximations(ptx, name):
    code = ptx[name]
    assert not code.startswith("ERROR"), code
    ops = float_ops(code)
    assert not {n for n in ops if n.startswith(("fma.", "mad."))}, f"{name}: contracted products {ops}"
    # The one flushing instruction allowed: exp_neg's floor (cvt.rmi.ftz), whose argument
    # x * log2(e) + 0.5 is 0 or at least 2^-25 in magnitude, never subnormal.
    assert not {n for n in ops if ".approx" in n or ".full" in n or (".ftz" in n and n != "cvt.rmi.ftz.f32.f32")
                or n.startswith(("rcp.", "rsqrt.", "ex2.", "lg2.", "sin.", "cos.", "tanh."))}, \
        f"{name}: approximate or flushing instructions {ops}"
    divisions = {n for n in ops if n.startswith(("div.", "sqrt."))}
    assert divisions <= {"div.rn.f32", "div.rn.f64", "sqrt.rn.f32"}, divisions


def test_in_a_model_every_call_equals_the_reference(tmp_path, monkeypatch):
    """The tiny nemotron_h (two Mamba2 layers, grouped B/C, a conv bias) on the cuda op set: every
    mamba2 and mamba2_gated_norm call the model makes (its in_proj's column slices) over a
    two-sequence prefill and a round mixing a decode row with a chunk resuming mid-block equals the
    reference on the same inputs, outputs and written states."""
    from tensorfold.backends import backend_ops
    from tensorfold.models.hf_dir import load_hf_dir
    from tensorfold.models.loader import build_model
    from test_delta_net_triton import word_tokenizer
    from tools.tiny_checkpoint import make_tiny_checkpoint

    ops, calls = backend_ops("cuda"), {"mamba2": 0, "gated_norm": 0}

    def shadow_mamba2(xbc, dt, state, batch, params):
        spans = [(int(batch.positions[s.start]), s.end - s.start) for s in batch.sequences]
        tables = [s.block_table.tolist() for s in batch.sequences]
        want, want_state = reference(xbc, dt, clone(state, "cpu"), spans, tables, params)
        got = tri.mamba2(xbc, dt, state, batch, params)
        assert same_bits(got, want), "mamba2 differs in the model"
        assert same_bits(state.conv, want_state.conv) and same_bits(state.ssm, want_state.ssm)
        calls["mamba2"] += 1
        return got

    def shadow_norm(y, z, weight, n_groups, eps, dtype):
        got = tri.gated_group_norm(y, z, weight, n_groups, eps, dtype)
        assert same_bits(got, ref.gated_group_norm(y.cpu(), z.cpu(), weight.cpu(), n_groups, eps, dtype))
        calls["gated_norm"] += 1
        return got

    monkeypatch.setattr(ops, "mamba2", shadow_mamba2)
    monkeypatch.setattr(ops, "mamba2_gated_norm", shadow_norm)
    path = make_tiny_checkpoint(str(tmp_path), "nemotron_h", tokenizer=word_tokenizer())
    model = build_model(load_hf_dir(path), torch.float32, ops, DEVICE)
    bs, tables = 4, [[3, 0, 5], [1, 4, 2]]
    cache = model.allocate_cache(6, bs, torch.float32)

    def rows(pieces):  # (sequence, first position, rows)
        ids, pos, slots, seqs = [], [], [], []
        for s, p0, n in pieces:
            seqs.append(SequenceRows(len(ids), len(ids) + n, torch.tensor(tables[s])))
            ids += draw_ids[s][p0:p0 + n]
            pos += range(p0, p0 + n)
            slots += [tables[s][p // bs] * bs + p % bs for p in range(p0, p0 + n)]
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
        return ForwardBatch(t(ids), t(pos), t(slots), seqs, t([len(ids) - 1]))

    gen = torch.Generator().manual_seed(0)
    draw_ids = [torch.randint(0, 256, (8,), generator=gen).tolist() for _ in range(2)]
    model.forward(rows([(0, 0, 3), (1, 0, 2)]), cache)
    model.forward(rows([(0, 3, 1), (1, 2, 3)]), cache)  # a decode row at a block's last position
    mamba_layers = sum(type(layer.mixer).__name__ == "Mamba2" for layer in model.layers)
    assert mamba_layers >= 2 and calls == {"mamba2": 2 * mamba_layers, "gated_norm": 2 * mamba_layers}
