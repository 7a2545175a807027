"""The C++ kernels' other instruction sets give the same bits: the extension rebuilt for AVX-512
without AVX512_BF16, for AVX2 and for a baseline x86-64 (the portable scalar path) runs every op
against its torch reference (the bfloat16 GEMM's steps are then FMAs under MXCSR's flush modes,
or written out, instead of vdpbf16ps).

The main build (-march=native) is what serves; these builds prove that the code a user with
another CPU gets computes the same tokens. Only the kernels are recompiled per variant (the
torch bindings, which only call them, once). Skipped off x86-64 (a NEON machine's own build is
the main one there) and without a C++ compiler; a variant this CPU cannot run (AVX-512 on an
AVX2 machine) is skipped and names the flags it lacks, and so is the variant whose code paths
the main build already runs (AVX2 on an AVX2 machine).
"""
import glob
import os
import platform
import runpy
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tensorfold.backends import native_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"x86-64-v4": ("avx512", "fma-mxcsr"), "x86-64-v3": ("avx2", "fma-mxcsr"), "x86-64": ("scalar", "emulated")}
NEEDS = {"x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},  # the ISA levels' CPU flags
         "x86-64-v3": {"avx2", "fma", "bmi2", "f16c", "movbe"}, "x86-64": set()}

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or native_problem() is not None or shutil.which("c++") is None,
    reason="needs x86-64, a C++ compiler and the main build of the extension")


def cpu_flags() -> set[str]:
    """The host CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def missing_flags(arch: str) -> set[str]:
    """The CPU flags `arch` needs that this CPU lacks."""
    return NEEDS[arch] - cpu_flags()


def compile_jobs(out: str, archs: list[str]) -> tuple[list[list[str]], dict[str, list[str]]]:
    """The compiler runs that build `archs`: the torch bindings once, for the baseline x86-64 (they
    only call the kernels), and the kernels once per arch. Returns (commands, {arch: objects})."""
    import torch
    from torch.utils import cpp_extension

    build = runpy.run_path(os.path.join(ROOT, "csrc", "cpu", "build_flags.py"))
    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    defines = ["-DTORCH_EXTENSION_NAME=_cpu", "-DTORCH_API_INCLUDE_EXTENSION_H",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    # The bindings first: they take the longest (torch's headers), so the pool starts them first.
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")),
                     key=lambda src: (os.path.basename(src) not in build["BINDINGS"], src))
    commands, objects = [], {arch: [] for arch in archs}
    for src in sources:
        name = os.path.basename(src)
        for arch in (["x86-64"] if name in build["BINDINGS"] else archs):
            obj = os.path.join(out, f"{arch}-{name}.o")
            commands.append(["c++", *build["FLAGS"], *build["arch_flags"](arch), "-fPIC", *includes, *defines,
                             "-c", src, "-o", obj])
            for target in (archs if name in build["BINDINGS"] else [arch]):
                objects[target].append(obj)
    return commands, objects


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, str]:
    """Every variant this CPU can run and the main build is not, compiled by one compiler per core:
    {arch: path of its .so}."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    archs = [arch for arch in sorted(VARIANTS) if skip_reason(arch) is None]
    out = str(tmp_path_factory.mktemp("variants"))
    commands, objects = compile_jobs(out, archs)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for cmd, done in zip(commands, pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), commands)):
            assert done.returncode == 0, f"{' '.join(cmd[-3:])}: {done.stderr[-2000:]}"
    paths, torch_lib = {}, os.path.join(os.path.dirname(torch.__file__), "lib")
    for arch in archs:
        path = os.path.join(out, arch, "_cpu" + sysconfig.get_config_var("EXT_SUFFIX"))
        os.makedirs(os.path.dirname(path))
        done = subprocess.run(["c++", "-shared", "-fopenmp", *objects[arch], f"-L{torch_lib}", "-lc10", "-ltorch",
                               "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{torch_lib}", "-o", path],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"linking {arch}: {done.stderr[-2000:]}"
        paths[arch] = path
    return paths


def skip_reason(arch: str) -> str | None:
    """Why `arch` is not built and run here, or None: a CPU that cannot run it, or a main build
    that already runs its code paths (the kernel tests cover those)."""
    from tensorfold import _cpu

    missing = missing_flags(arch)
    if missing:
        return f"this CPU cannot run {arch}: it lacks {', '.join(sorted(missing))}"
    if VARIANTS[arch] == (_cpu.isa(), _cpu.pair_steps()):
        return f"the main build runs {arch}'s code paths ({', '.join(VARIANTS[arch])}): the kernel tests cover it"
    return None


CHECK = """
import importlib.util, sys, torch
from tensorfold.kernels import paged_attention as attention_ref, reference
spec = importlib.util.spec_from_file_location("_cpu", sys.argv[1])
cpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu)
print(cpu.isa(), cpu.pair_steps())
g = torch.Generator().manual_seed(int(sys.argv[2]))
sys.path.insert(0, "tests")
from kernel_inputs import tiny_bf16
for m, n, k in [(1, 24, 64), (3, 17, 96)]:  # bfloat16 steps near 2^-126: the flushes
    for _ in range(10):
        x, w = tiny_bf16(g, m, k), tiny_bf16(g, n, k)
        assert torch.equal(cpu.linear(x, w), reference.linear(x, w)), "linear, tiny bfloat16 values"
x, w = torch.zeros(1, 32), torch.zeros(2, 32)  # a lane at 2^-126, then 2^-151 (kept) or 2^-150 (flushed) below
x[0, 1], w[:, 1], x[0, 0], w[0, 0], w[1, 0] = 2.0 ** -63, 2.0 ** -63, 2.0 ** -75, -2.0 ** -76, -2.0 ** -75
assert cpu.linear(x.bfloat16(), w.bfloat16()).float().tolist() == [[2.0 ** -126, 0.0]], "linear, flush boundary"
for dtype in (torch.float32, torch.bfloat16):
    for m, n, k in [(1, 40, 64), (5, 33, 576), (13, 100, 200), (3, 9, 17)]:
        x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
        assert torch.equal(cpu.linear(x, w), reference.linear(x, w)), "linear"
    w, row = torch.randn(40, 96, generator=g).to(dtype), torch.randn(1, 96, generator=g).to(dtype)
    alone = cpu.linear(row, w)
    for m in (2, 5, 6, 7, 13):  # the register tiles' row groups and their remainders
        for place in {0, m // 2, m - 1}:
            batch = torch.randn(m, 96, generator=g).to(dtype)
            batch[place] = row[0]
            assert torch.equal(cpu.linear(batch, w)[place:place + 1], alone), f"linear, row {place} of {m}"
    x, weight = torch.randn(7, 576, generator=g).to(dtype), torch.randn(576, generator=g).to(dtype)
    assert torch.equal(cpu.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5)), "rms_norm"
    gate, up = (torch.randn(5, 300, generator=g) * 4).to(dtype), torch.randn(5, 300, generator=g).to(dtype)
    assert torch.equal(cpu.silu_and_mul(gate, up), reference.silu_and_mul(gate, up)), "silu_and_mul"
    assert torch.equal(cpu.sigmoid_and_mul(gate, up), reference.sigmoid_and_mul(gate, up)), "sigmoid_and_mul"
    assert torch.equal(cpu.gelu_tanh_and_mul(gate, up), reference.gelu_tanh_and_mul(gate, up)), "gelu_tanh_and_mul"
    logits = torch.randn(2, 3000, generator=g) * 40
    assert torch.equal(cpu.softcap(logits, 30.0), reference.softcap(logits, 30.0)), "softcap"
    assert torch.equal(cpu.relu_squared(gate), reference.relu_squared(gate)), "relu_squared"
    k_cache = torch.zeros(8, 16, 3, 64, dtype=dtype)
    v_cache = k_cache.clone()
    attention_ref.write_kv_ref(k_cache, v_cache, torch.randn(128, 3, 64, generator=g).to(dtype),
                               torch.randn(128, 3, 64, generator=g).to(dtype), torch.arange(128))
    q, table = torch.randn(100, 9, 64, generator=g).to(dtype), torch.randperm(8, generator=g)
    got = cpu.paged_attention(q, k_cache, v_cache, torch.arange(100), table[None], torch.tensor([0, 100]), 0.125, 0)
    want = attention_ref.paged_attention_ref(q, k_cache, v_cache, torch.arange(100), table, 0.125)
    assert torch.equal(got, want), "attention"
    k_long = torch.zeros(40, 16, 3, 64, dtype=dtype)  # decode and verify rows over 600 keys: split, direct
    v_long = k_long.clone()
    attention_ref.write_kv_ref(k_long, v_long, torch.randn(640, 3, 64, generator=g).to(dtype),
                               torch.randn(640, 3, 64, generator=g).to(dtype), torch.arange(640))
    table = torch.randperm(40, generator=g)
    for rows in (torch.tensor([600]), torch.arange(590, 594)):
        q = torch.randn(len(rows), 9, 64, generator=g).to(dtype)
        got = cpu.paged_attention(q, k_long, v_long, rows, table[None], torch.tensor([0, len(rows)]), 0.125, 0)
        want = attention_ref.paged_attention_ref(q, k_long, v_long, rows, table, 0.125)
        assert torch.equal(got, want), "attention, split rows"
    from tensorfold.kernels import quant_gemm
    from test_quant_gemm import code_range
    for kind, info in quant_gemm.KINDS.items():  # every kind's fields drawn within their bounds
        low, high = code_range(kind)
        k = 3 * info.act  # 96, or three super-blocks of 256 (the K-quants: one E, F per super-block)
        for lo_exp, hi_exp in ((-24, 6), (-3, 1)):  # the second: no negative shift (AVX2's unchecked tiles)
            codes = torch.randint(low, high, (24, k), generator=g, dtype=torch.int8)
            ints = (lambda cols: torch.randint(-2047, 2048, (24, cols), generator=g, dtype=torch.int32))
            exps = (lambda: torch.randint(lo_exp, hi_exp, (24, 3), generator=g, dtype=torch.int32)
                    .repeat_interleave(info.blocks_per_group, dim=1))
            mins = (ints(k // 32), exps()) if info.has_min else (None, None)
            w = quant_gemm.QuantWeight(kind, codes, ints(k // info.sub), exps(), *mins)
            x = torch.randn(7, k, generator=g).to(dtype)
            x[6, 40:] = 0.0  # zero groups
            packed = cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
            want = quant_gemm.linear(x, w)
            assert torch.equal(cpu.quant_linear(x, packed, 24, k), want), kind
            assert torch.equal(cpu.quant_linear(x[5:6], packed, 24, k), want[5:6]), kind + " (a row alone)"
    for kind in ("q8_0", "q4_0", "q4_1"):  # as GGUF stores them: float16 scales, packed as their bits
        q = torch.randint(-127, 128, (24, 96), generator=g) if kind == "q8_0" else torch.randint(0, 16, (24, 96), generator=g)
        d = (torch.randn(24, 3, generator=g) * 0.05).half()
        w = quant_gemm.from_legacy(kind, q, d, (-torch.rand(24, 3, generator=g)).half() if kind == "q4_1" else None)
        x = torch.randn(3, 96, generator=g).to(dtype)
        packed = cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
        assert torch.equal(cpu.quant_linear(x, packed, 24, 96), quant_gemm.linear(x, w)), kind + " (float16 scales)"
    from test_quant_gemm import random_k_file
    from gguf import GGMLQuantizationType
    from tensorfold.models import gguf_quants
    def k_file(kind):  # random_k_file's blocks, and Q5_K's drawn the same way
        if kind != "q5_k":
            return random_k_file(g, kind, 32, 512)
        blocks = torch.randint(0, 256, (64, 176), generator=g, dtype=torch.uint8)
        for at in (0, 2):
            h = (torch.randn(64, generator=g) * 2.0 ** torch.randint(-22, 4, (64,), generator=g)).half()
            blocks[:, at:at + 2] = h.view(torch.uint8).reshape(-1, 2)
        raw = blocks.reshape(-1)
        return raw, gguf_quants.quant_weight(raw, GGMLQuantizationType.Q5_K, (32, 512))
    for kind in ("q4_k", "q5_k", "q6_k"):  # as GGUF stores them: packed in the file's form
        raw, w = k_file(kind)
        packed = cpu.pack_quant(kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
        assert packed.numel() < 1.05 * raw.numel(), kind + " not in the file's form"
        x = torch.randn(5, 512, generator=g) * 2.0 ** torch.randint(-30, 6, (5, 1), generator=g)
        x = x.to(dtype)
        assert torch.equal(cpu.quant_linear(x, packed, 32, 512), quant_gemm.linear(x, w)), kind + " (file form)"
        assert torch.equal(cpu.quant_rows(packed, torch.arange(32), 32, 512), w.dequantize()), kind + " rows"
from tensorfold.kernels import mamba2 as mamba2_ref  # Mamba2's scan and gated norm: every lane width
from tensorfold.models.cache import Mamba2State
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
from tensorfold.models.mamba2 import Mamba2Params
heads, p_dim, groups, n = 4, 29, 2, 32
C = heads * p_dim + 2 * groups * n
params = Mamba2Params(heads, p_dim, groups, n, torch.randn(C, 4, generator=g) * 0.5, torch.randn(C, generator=g) * 0.3,
                      torch.rand(heads, generator=g) + 0.5, torch.randn(heads, generator=g), torch.randn(heads, generator=g),
                      0.0, float("inf"))
state = Mamba2State(C, 4, heads, n, p_dim).allocate(6, 4, torch.float32, "cpu")
state.conv.copy_(torch.randn(state.conv.shape, generator=g))
state.ssm.copy_(torch.randn(state.ssm.shape, generator=g) * 0.3)
for dtype in (torch.float32, torch.bfloat16):
    rows = torch.zeros(10, dtype=torch.int64)
    batch = ForwardBatch(rows, torch.tensor([*range(9), 6]), rows.clone(),
                         [SequenceRows(0, 9, torch.tensor([0, 1, 2])), SequenceRows(9, 10, torch.tensor([3, 4]))],
                         torch.arange(10))
    xbc, dt = torch.randn(10, C, generator=g).to(dtype), torch.randn(10, heads, generator=g).to(dtype)
    want_state = type(state)(state.conv.clone(), state.ssm.clone(), 4)
    got_state = type(state)(state.conv.clone(), state.ssm.clone(), 4)
    state_in, state_out = batch.state_slots(4)
    got = cpu.mamba2(xbc, dt, got_state.conv, got_state.ssm, state_in, state_out, batch.row_starts_tensor,
                     params.conv_weight, params.conv_bias, params.rate, params.dt_bias, params.d, 0.0, float("inf"),
                     heads, p_dim, groups, n)
    assert torch.equal(got, mamba2_ref.mamba2(xbc, dt, want_state, batch, params)), "mamba2"
    assert torch.equal(got_state.ssm, want_state.ssm) and torch.equal(got_state.conv, want_state.conv), "mamba2 state"
    y, z, w = torch.randn(5, 116, generator=g), torch.randn(5, 116, generator=g).to(dtype), torch.randn(116, generator=g)
    assert torch.equal(cpu.mamba2_gated_norm(y, z, w.to(dtype), 4, 1e-5, dtype),
                       mamba2_ref.gated_group_norm(y, z, w.to(dtype), 4, 1e-5, dtype)), "mamba2_gated_norm"
from latent_cases import ODD, make_case  # GLM-5's latent attention and the indexer's choice
from tensorfold.kernels import latent_attention as latent_ref
for dtype in (torch.float32, torch.bfloat16):
    cache, batch, query, index_q, weights = make_case(ODD, [(0, 21), (40, 1)], seed=3, dtype=dtype)
    where = (batch.positions, batch.block_tables, batch.row_starts_tensor)
    sel = latent_ref.dsa_select(index_q, weights, cache, batch, 0.2, 5)
    assert torch.equal(cpu.dsa_select(index_q, weights, cache.index_keys, *where, 0.2, 5), sel), "dsa_select"
    for chosen in (None, sel):
        assert torch.equal(cpu.latent_attention(query, cache.kv, *where, 0.07, ODD.latent, chosen),
                           latent_ref.attention_by_sequence(query, cache, batch, 0.07, chosen)), "latent_attention"
print("bitwise")
"""


@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_variant_equals_the_references(arch, builds, draw):
    reason = skip_reason(arch)
    if reason is not None:
        pytest.skip(reason)
    path = builds[arch]
    done = subprocess.run([sys.executable, "-c", CHECK, path, str(draw.seed)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # a process of its own: one _cpu per process
    assert done.returncode == 0, f"{arch} ({draw}): {done.stderr[-2000:]}"
    assert done.stdout.split() == [*VARIANTS[arch], "bitwise"], done.stdout
