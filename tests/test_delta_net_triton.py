"""Gated DeltaNet's Triton kernels (kernels/delta_net_triton.py) against their torch reference
(kernels/delta_net.py), bit for bit.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by kernel_inputs
before any kernel module is imported), patched to compute what the GPU computes
(tests/triton_interpreter.py); with one, the same tests run compiled on CUDA tensors against the
reference run on CPU copies. Fresh random inputs every run (the seed is in the failure message);
the output and the conv's scratch are NaN-filled before each launch, and the cache blocks a call
writes without reading are NaN too. Shapes are kept small (the interpreter is slow): key dims 16
and 32, value heads 1x and 2x the key heads, a value dim that is not a power of two split over
two column programs, conv kernels 4 and 2, several sequences of different lengths starting
mid-block, at a block's start and at its last position, block sizes 4 and 16, float32 and
bfloat16 projections. The written conv and ssm states are compared as well, a sequence run in
chunks through the kernel gives the bits of the reference's one pass, and the kernels compile
for sm_90 without FMA or approximate instructions.
"""
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import torch

from kernel_inputs import DEVICE, NAN  # first: sets TRITON_INTERPRET without a GPU
from delta_net_cases import poison_written_blocks, random_tables, same_bits  # noqa: E402

import pytest  # noqa: E402

from tensorfold.kernels import delta_net as ref  # noqa: E402
from tensorfold.kernels import delta_net_triton as tri  # noqa: E402
from tensorfold.models.cache import RecurrentState  # noqa: E402
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows  # noqa: E402
from tensorfold.models.linear_attention import DeltaNetParams  # noqa: E402
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def quick_device_calls():
    """The interpreter (triton 3.9) re-patches triton.language on every call of a @triton.jit
    helper (inspect.getmembers over tl, tl.math and tl.tensor: about 2 ms a call, never undone),
    although the kernel's launch has patched the same module for the whole grid already. These
    kernels call exact_triton's helpers some 40 times a row, so that is two thirds of their time
    here: for this module, a helper that sees triton.language only as `tl` (the kernels' own, and
    exact_triton's) skips the repeat, which changes nothing the launch has not set; Triton's own
    helpers (tl.zeros and the like, which see tl.core) are patched as before. Nothing on a GPU."""
    if torch.cuda.is_available():
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter
    sees_core = {}

    def call(self, *args, **kwargs):
        if self.fn not in sees_core:
            sees_core[self.fn] = any(v is tl.core for v in self.fn.__globals__.values())
        if sees_core[self.fn]:
            interpreter._patch_lang(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.InterpretedFunction, "__call__", call)
        yield


@dataclass
class Layer:
    params: DeltaNetParams
    spec: RecurrentState


def make_layer(draw, key_heads, group, key_dim, value_dim, kernel=4) -> Layer:
    heads = key_heads * group
    conv_dim = 2 * key_heads * key_dim + heads * value_dim
    params = DeltaNetParams(key_heads, heads, key_dim, value_dim,
                            conv_weight=draw.randn(conv_dim, kernel, scale=0.5),
                            rate=ref.decay_rate(draw.rand(heads) * 2.5 - 1.0).to(DEVICE),  # A_log in [-1, 1.5]
                            dt_bias=draw.randn(heads))
    return Layer(params, RecurrentState(conv_dim, kernel, heads, key_dim, value_dim))


def on_cpu(params: DeltaNetParams) -> DeltaNetParams:
    return DeltaNetParams(params.num_key_heads, params.num_heads, params.key_dim, params.value_dim,
                          params.conv_weight.cpu(), params.rate.cpu(), params.dt_bias.cpu())


def make_rows(draw, layer: Layer, rows: int, dtype):
    """qkv [rows, C], a, b [rows, H]: column slices of one projection with a z between, as the
    model passes them."""
    p, channels = layer.params, layer.spec.conv_dim
    proj = draw.randn(rows, channels + 3 + 2 * p.num_heads, dtype=dtype, scale=1.5)
    qkv, _, b, a = proj.split([channels, 3, p.num_heads, p.num_heads], dim=1)
    return qkv, a, b


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


def reference(qkv, a, b, state, spans, tables, params):
    """The torch reference on CPU copies: (output, state after)."""
    want_state = clone(state, "cpu")
    want = ref.delta_net(qkv.cpu(), a.cpu(), b.cpu(), want_state, make_batch(spans, tables, "cpu"), on_cpu(params))
    return want, want_state


def check(draw, layer, dtype, spans, block_size, *, block_c=tri.BLOCK_C, block_v=tri.BLOCK_V, edit=None):
    tables, num_blocks = random_tables(draw, spans, block_size)
    batch = make_batch(spans, tables)
    qkv, a, b = make_rows(draw, layer, batch.positions.numel(), dtype)
    if edit is not None:
        edit(qkv, a, b)
    state = make_state(draw, layer, num_blocks, block_size)
    poison_written_blocks(state, spans, tables)
    want, want_state = reference(qkv, a, b, state, spans, tables, layer.params)
    got_state = clone(state)
    p = layer.params
    out = torch.full((qkv.shape[0], p.num_heads, p.value_dim), NAN, dtype=dtype, device=DEVICE)
    got = tri.delta_net(qkv, a, b, got_state, batch, p, out=out, block_c=block_c, block_v=block_v,
                        scratch_fill=NAN)
    assert got.data_ptr() == out.data_ptr()
    assert same_bits(got, want), f"delta_net output differs ({draw}); max abs diff " \
                                 f"{(got.cpu().float() - want.float()).abs().max().item()}"
    assert same_bits(got_state.conv, want_state.conv), f"conv states differ ({draw})"
    assert same_bits(got_state.ssm, want_state.ssm), f"ssm states differ ({draw})"
    assert not want.isnan().any()


SHAPES = [  # key_heads, group, key_dim, value_dim
    (2, 1, 16, 16), (1, 2, 32, 24)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kh{}g{}dk{}dv{}".format(*s))
@pytest.mark.parametrize("block_size", [4, 16])
def test_delta_net_equals_reference(draw, dtype, shape, block_size):
    """A prefill from 0, a chunk resuming mid-block, decode rows at a block's last position and
    at its first, a chunk starting at a block boundary; channels and value columns split over
    several programs (value dim 24 over two column programs of 16)."""
    layer = make_layer(draw, *shape)
    spans = [(0, 6), (block_size + 2, 5), (2 * block_size - 1, 1), (3 * block_size, 1), (block_size, 3)]
    check(draw, layer, dtype, spans, block_size, block_c=32, block_v=16)


def test_delta_net_conv_kernel_two_one_row(draw):
    """A two-tap conv (a one-row window), single rows from position 0 and mid-block."""
    layer = make_layer(draw, 1, 1, 16, 16, kernel=2)
    check(draw, layer, torch.float32, [(5, 1), (0, 1)], 4)


def test_delta_net_extreme_gates(draw):
    """a far above softplus's threshold and far below (decay 1 and decay 0: S's columns go to
    zero, exponent -127 on the grid, and back), b saturating the sigmoid."""
    layer = make_layer(draw, 1, 2, 16, 16)

    def edit(qkv, a, b):
        a[:, 0] = torch.tensor([30.0, -30.0, 100.0, 25.0, 19.5, 20.0, -100.0] * 2)
        a[:, 1] = torch.tensor([1e4, -1e4] * 7)
        b[::3] *= 100.0
    check(draw, layer, torch.float32, [(0, 9), (6, 5)], 4, edit=edit)


@pytest.mark.parametrize("chunk", [1, 3])
def test_delta_net_chunks_give_the_bits_of_one_pass(draw, chunk):
    """A sequence fed to the kernel in chunks (each resuming from the state the last one wrote)
    gives the reference's one-pass output and final states."""
    layer, bs, n = make_layer(draw, 1, 2, 16, 16), 4, 10
    tables, num_blocks = random_tables(draw, [(0, n)], bs)
    qkv, a, b = make_rows(draw, layer, n, torch.float32)
    state = make_state(draw, layer, num_blocks, bs)
    poison_written_blocks(state, [(0, n)], tables)
    want, want_state = reference(qkv, a, b, state, [(0, n)], tables, layer.params)
    got_state = clone(state)
    got = torch.cat([tri.delta_net(qkv[t:t + chunk], a[t:t + chunk], b[t:t + chunk], got_state,
                                   make_batch([(t, min(chunk, n - t))], tables), layer.params)
                     for t in range(0, n, chunk)])
    assert same_bits(got, want), str(draw)
    last = tables[0][(n - 1) // bs]  # the final state; earlier blocks' ends match as well
    assert same_bits(got_state.ssm[last], want_state.ssm[last]), str(draw)
    assert same_bits(got_state.conv, want_state.conv) and same_bits(got_state.ssm, want_state.ssm), str(draw)


def test_delta_net_refuses_what_it_cannot_do_exactly(draw):
    layer = make_layer(draw, 1, 1, 16, 16)
    wide = DeltaNetParams(1, 1, 512, 16, layer.params.conv_weight, layer.params.rate, layer.params.dt_bias)
    with pytest.raises(ValueError, match="key_dim 512"):
        tri.delta_net(torch.zeros(1, 2 * 512 + 16), torch.zeros(1, 1), torch.zeros(1, 1), None,
                      make_batch([(0, 1)], [[0]]), wide)
    with pytest.raises(ValueError, match="channels"):
        tri.delta_net(torch.zeros(1, 7), torch.zeros(1, 1), torch.zeros(1, 1), None,
                      make_batch([(0, 1)], [[0]]), layer.params)



def word_tokenizer(size: int = 256):
    """A word-level tokenizer of `size` entries, made in milliseconds (the model only needs a vocabulary)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, size)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_in_a_model_every_call_equals_the_reference(tmp_path, monkeypatch):
    """A tiny Qwen3.5 hybrid (3 DeltaNet layers: 4 key heads, 8 value heads of 16) on the cuda op
    set: every delta_net and gated_rms_norm call the model makes (its in_proj's column slices, z
    reshaped) over a two-sequence prefill and a round mixing a decode row with a chunk resuming
    mid-block equals the reference on the same inputs, outputs and written states."""
    from tensorfold.backends import backend_ops
    from tensorfold.models.hf_dir import load_hf_dir
    from tensorfold.models.loader import build_model
    from tools.tiny_checkpoint import make_tiny_checkpoint

    ops, calls = backend_ops("cuda"), {"delta_net": 0, "gated_rms_norm": 0}

    def shadow_delta_net(qkv, a, b, state, batch, params):
        before = clone(state, "cpu")
        spans = [(int(batch.positions[s.start]), s.end - s.start) for s in batch.sequences]
        tables = [s.block_table.tolist() for s in batch.sequences]
        want, want_state = reference(qkv, a, b, before, spans, tables, params)
        got = tri.delta_net(qkv, a, b, state, batch, params)
        assert same_bits(got, want), "delta_net differs in the model"
        assert same_bits(state.conv, want_state.conv) and same_bits(state.ssm, want_state.ssm)
        calls["delta_net"] += 1
        return got

    def shadow_norm(x, gate, weight, eps):
        got = tri.gated_rms_norm(x, gate, weight, eps)
        assert same_bits(got, ref.gated_rms_norm(x.cpu(), gate.cpu(), weight.cpu(), eps)), "gated norm differs"
        calls["gated_rms_norm"] += 1
        return got

    monkeypatch.setattr(ops, "delta_net", shadow_delta_net)
    monkeypatch.setattr(ops, "gated_rms_norm", shadow_norm)
    path = make_tiny_checkpoint(str(tmp_path), "qwen3_5", tokenizer=word_tokenizer())
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
    assert calls == {"delta_net": 6, "gated_rms_norm": 6}

# ---- the gated norm ----

@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("width", [24, 128])
def test_gated_rms_norm_equals_reference(draw, dtype, width):
    """x as delta_net returns it ([rows * heads, dv], contiguous), the gate a column slice of a
    projection (row stride wider than the row); a zero row, a tiny and a huge one; weights bf16."""
    rows = 37  # not a multiple of the rows per program
    x = draw.randn(rows, width, scale=2.0)
    x[3] = 0.0
    x[5] *= 1e-30
    x[6] *= 1e25
    x = x.to(dtype)
    gate = draw.randn(rows, width + 5, dtype=dtype, scale=3.0)[:, 2:2 + width]
    weight = draw.randn(width).bfloat16()
    want = ref.gated_rms_norm(x.cpu(), gate.cpu(), weight.cpu(), 1e-6)
    out = torch.full_like(x, NAN)
    got = tri.gated_rms_norm(x, gate, weight, 1e-6, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert same_bits(got, want), f"gated_rms_norm differs ({draw})"


def test_gated_rms_norm_refuses_wide_rows():
    with pytest.raises(ValueError, match="at most 8192"):
        tri.gated_rms_norm(torch.zeros(1, 8193), torch.zeros(1, 8193), torch.zeros(8193), 1e-6)


def test_cuda_ops_binds_the_kernels():
    from tensorfold.backends import backend_ops
    ops = backend_ops("cuda")
    assert ops.delta_net is tri.delta_net
    assert ops.gated_rms_norm is tri.gated_rms_norm


# ---- compiled for sm_90: no FMA, nothing approximate ----

COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tensorfold.kernels import delta_net_triton as dn, moe_triton
from tensorfold.kernels.exact_triton import LAUNCH_EXACT

def ptx(fn, signature, constexprs):
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(LAUNCH_EXACT)).asm["ptx"]

slots = dict(state_in_ptr="*i64", state_out_ptr="*i64", row_starts_ptr="*i64")
kernels = {
    "conv": (dn.conv_kernel, dict(x_ptr="*bf16", conv_ptr="*fp32", weight_ptr="*fp32", mixed_ptr="*fp32",
                                  **slots, stride_x="i32", channels="i32"),
             dict(TAPS=4, WIN_PAD=4, BLOCK_C=dn.BLOCK_C)),
    "recurrence": (dn.recurrence_kernel,
                   dict(mixed_ptr="*fp32", a_ptr="*bf16", b_ptr="*bf16", ssm_ptr="*fp32", out_ptr="*bf16",
                        **slots, rate_ptr="*fp32", dt_bias_ptr="*fp32", stride_a="i32", stride_b="i32",
                        channels="i32", q_scale="fp32", eps="fp32"),
                   dict(HEADS=32, GROUP=2, KEY_WIDTH=2048, DK=128, DV=128, DK_PAD=128, BLOCK_V=dn.BLOCK_V,
                        STATE_BITS=22, NORM_BITS=20, THRESHOLD=20.0)),
    "gated_rms_norm": (dn.gated_rms_norm_kernel,
                       dict(x_ptr="*bf16", gate_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16",
                            num_rows="i32", stride_x="i32", stride_g="i32", eps="fp32"),
                       dict(N=128, BLOCK=128, ROWS=dn.NORM_ROWS, NORM_BITS=20)),
    "route": (moe_triton.route_kernel,
              dict(logits_ptr="*fp32", experts_ptr="*i64", weights_ptr="*fp32", num_rows="i32", stride_row="i32"),
              dict(E=128, E_PAD=128, TOP_K=8, K_PAD=8, ROWS=moe_triton.ROWS, NORMALIZE=False, SUM_BITS=40)),
    "combine": (moe_triton.combine_kernel,
                dict(y_ptr="*bf16", y_rows_ptr="*i64", experts_ptr="*i64", weights_ptr="*fp32", gate_ptr="*bf16",
                     shared_ptr="*bf16", out_ptr="*bf16", hidden="i32"),
                dict(TOP_K=8, K_PAD=8, BLOCK=128, SHARED=True)),
}
out = {}
for name, (fn, sig, const) in kernels.items():
    try:
        out[name] = ptx(fn, sig, const)
    except Exception as e:  # reported per kernel
        out[name] = "ERROR " + repr(e)
print(json.dumps(out))
"""
FLOAT_OP = re.compile(r"^\s*((?:fma|mad|div|sqrt|rcp|rsqrt|ex2|lg2|sin|cos|tanh|add|mul|sub|cvt)\.[\w.]+)", re.M)


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


def float_ops(code: str) -> dict[str, int]:
    names = [n for n in FLOAT_OP.findall(code) if re.search(r"\.(f16|bf16|f32|f64)\b", n)]
    return {n: names.count(n) for n in sorted(set(names))}


@pytest.mark.parametrize("name", ["conv", "recurrence", "gated_rms_norm", "route", "combine"])
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


# ---- the MoE router (kernels/moe_triton.py) ----

@pytest.mark.parametrize("normalize", [True, False], ids=["topk_norm", "softmax_norm"])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (60, 4), (5, 1)])
def test_route_equals_reference(draw, experts, top_k, normalize):
    """Fresh logits, and rows built to tie: small integers (many equal logits, ties to the lower
    index), -0.0 against +0.0, -inf entries, a row of one value; rows not a multiple of the
    program's 16."""
    from tensorfold.kernels import moe_triton
    from tensorfold.kernels import moe
    rows = 21
    logits = draw.randn(rows, experts, scale=2.0)
    logits[1:6] = torch.randint(-2, 3, (5, experts), generator=draw.gen).float().to(DEVICE)
    logits[6] = 0.0
    logits[6, ::2] = -0.0
    logits[7, ::3] = float("-inf")
    logits[8] = 1.25
    want = moe.route(logits.cpu(), top_k, normalize)
    got = moe_triton.route(logits, top_k, normalize)
    assert torch.equal(got[0].cpu(), want[0]), f"experts differ ({draw})"
    assert same_bits(got[1], want[1]), f"weights differ ({draw})"


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no_shared"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_combine_equals_reference(draw, dtype, shared):
    """The sum of each row's experts (kernels/moe.combine) from route's choice over 9 experts, 3 a
    row, the pairs grouped by expert; 150 columns over two column programs; the output NaN first."""
    from tensorfold.kernels import moe, moe_triton
    rows, top_k, hidden = 13, 3, 150
    experts, weights = moe.route(draw.randn(rows, 9, scale=2.0).cpu(), top_k, True)
    _, y_rows = moe.group_by_expert(experts)
    y = draw.randn(rows * top_k, hidden, dtype=dtype, scale=3.0)
    gate = draw.randn(rows, 1, dtype=dtype, scale=2.0) if shared else None
    shared_out = draw.randn(rows, hidden, dtype=dtype) if shared else None
    want = moe.combine(y.cpu(), y_rows, experts, weights, *((gate.cpu(), shared_out.cpu()) if shared else ()))
    out = torch.full((rows, hidden), NAN, dtype=dtype, device=DEVICE)
    got = moe_triton.combine(y, y_rows.to(DEVICE), experts.to(DEVICE), weights.to(DEVICE), gate, shared_out,
                             out=out)
    assert got.data_ptr() == out.data_ptr()
    assert same_bits(got, want), f"combine differs ({draw})"


def test_the_cuda_op_sets_moe_block_equals_its_composition(draw):
    """cuda_ops.fuse_moe (tokens grouped once, moe_triton.combine) against MoE.compose (an indexed
    add per expert) on the same op set: the same bits, rows alone as in the batch."""
    from tensorfold.backends import backend_ops
    from tensorfold.models.moe import MoE, MoESpec
    from tensorfold.models.weights import WeightReader
    ops = backend_ops("cuda")
    spec = MoESpec(num_experts=8, top_k=2, intermediate_size=16, shared_intermediate_size=24)
    hidden = 32
    shapes = {"gate.weight": (8, hidden), "shared_expert.gate_proj.weight": (24, hidden),
              "shared_expert.up_proj.weight": (24, hidden), "shared_expert.down_proj.weight": (hidden, 24),
              "shared_expert_gate.weight": (1, hidden)}
    for e in range(8):
        shapes.update({f"experts.{e}.gate_proj.weight": (16, hidden), f"experts.{e}.up_proj.weight": (16, hidden),
                       f"experts.{e}.down_proj.weight": (hidden, 16)})
    tensors = {"mlp." + name: draw.randn(*shape, scale=0.3) for name, shape in shapes.items()}
    block = MoE(spec, WeightReader(tensors, torch.float32, torch.device(DEVICE), ops), None)
    assert block._fused is not None
    x = draw.randn(11, hidden)
    got = block.forward(x)
    assert same_bits(got, block.compose(x)), f"the fused block differs from its composition ({draw})"
    assert same_bits(torch.cat([block.forward(x[i:i + 1]) for i in range(11)]), got)


def test_the_cuda_op_sets_gemma4_moe_block_equals_its_composition(draw):
    """Gemma 4's experts (models/gemma4_moe.py: the router on its own input, per-expert scales,
    GeGLU experts) through cuda_ops.fuse_moe against their composition on the same op set."""
    from tensorfold.backends import backend_ops
    from tensorfold.models.gemma4_moe import Gemma4MoE
    from tensorfold.models.moe import MoESpec
    from tensorfold.models.weights import WeightReader
    ops = backend_ops("cuda")
    spec = MoESpec(num_experts=8, top_k=2, intermediate_size=16, shared_intermediate_size=0, activation="gelu_tanh")
    hidden = 32
    tensors = {"router.proj.weight": draw.randn(8, hidden, scale=2.0),
               "router.scale": 1 + draw.randn(hidden, scale=0.2),
               "router.per_expert_scale": 1 + draw.randn(8, scale=0.3),
               "pre_feedforward_layernorm_2.weight": 1 + draw.randn(hidden, scale=0.2),
               "post_feedforward_layernorm_2.weight": 1 + draw.randn(hidden, scale=0.2)}
    for e in range(8):
        tensors.update({f"experts.{e}.gate_proj.weight": draw.randn(16, hidden, scale=0.3),
                        f"experts.{e}.up_proj.weight": draw.randn(16, hidden, scale=0.3),
                        f"experts.{e}.down_proj.weight": draw.randn(hidden, 16, scale=0.3)})
    ctx = type("Context", (), {"norm_eps": 1e-6})
    block = Gemma4MoE(spec, WeightReader(tensors, torch.float32, torch.device(DEVICE), ops), ctx)
    assert block._fused is not None
    h = draw.randn(11, hidden, scale=3.0)
    x, routed_on = ops.rms_norm(h, block.pre_norm, 1e-6), block.router_input(h)
    assert same_bits(block._fused(x, routed_on), block.compose(x, routed_on)), f"fused != composition ({draw})"
    got = block.forward(h)
    assert same_bits(torch.cat([block.forward(h[i:i + 1]) for i in range(11)]), got)
