"""Every Triton kernel compiled for an H100/H200 (sm_90) without a GPU, and its instructions read.

The interpreter runs a kernel's Python, not its compiled code, so it cannot show that a kernel
compiles at all, nor what the compiler made of its arithmetic. Triton ships its own PTX toolchain,
so here each kernel is compiled to PTX at model-like sizes (in a child process: TRITON_INTERPRET
must be unset there) and the floating-point instructions are counted:
- none is an `fma` or `mad` on floats (the launches pass LAUNCH_EXACT, so a * b + c stays a
  rounded product and a rounded sum, as in the torch references);
- none is approximate: no `div.approx`/`div.full`, `sqrt.approx`, `rcp`, `rsqrt`, `ex2`, `lg2`
  (exp and log are the project's own polynomials in tensorfold/exact);
- attention's dot products are float64 tensor-core MMAs (exact on integers, any order).
What compiled PTX cannot show (ptxas/SASS, occupancy, speed) needs a GPU: docs/kernels.md.
"""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tensorfold.kernels import attention_triton as attn, rms_norm_triton as norm
from tensorfold.kernels import quant_gemm as qg, quant_gemm_triton as qt
from tensorfold.kernels import sampling_triton as samp, verify_triton as ver
from tensorfold.kernels.exact_triton import LAUNCH_EXACT
from tensorfold.kernels.reference import NORM_BITS

def ptx(fn, signature, constexprs):
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(LAUNCH_EXACT)).asm["ptx"]

i32, i64 = "i32", "i64"
tiles = dict(tile_seq_ptr="*i32", tile_start_ptr="*i32", tile_end_ptr="*i32")
cache = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", positions_ptr="*i64",
             block_tables_ptr="*i64", **tiles)
strides = dict(scale="fp32", window=i32, row_base=i32, stride_qr=i32, stride_qh=i32, stride_kb=i32,
               stride_ks=i32, stride_kh=i32, stride_vb=i32, stride_vs=i32, stride_vh=i32,
               stride_bt=i32, max_splits=i32)
sizes = dict(GROUP=4, HEAD_DIM=128, HALF=64, PAGE=16, BLOCK_M=attn.BLOCK_M, BLOCK_N=attn.BLOCK_N,
             SPLIT=attn.SPLIT_SIZE, HAS_WINDOW=True)
norm_args = dict(x_ptr="*bf16", residual_ptr="*bf16", h_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16",
                 cos_ptr="*fp32", sin_ptr="*fp32", eps="fp32", rows_per_token=i32)
kernels = {
    "attention_stats": (attn.attention_stats_kernel,
                        {**cache, "max_ptr": "*fp32", "top_ptr": "*i32", **strides}, sizes),
    "attention_sums": (attn.attention_sums_kernel,
                       {**cache, "max_ptr": "*fp32", "top_ptr": "*i32", "num_ptr": "*fp64",
                        "den_ptr": "*fp64", **strides}, sizes),
    "attention_finish": (attn.attention_finish_kernel,
                         dict(num_ptr="*fp64", den_ptr="*fp64", top_ptr="*i32", out_ptr="*bf16",
                              row_base=i32, max_splits=i32, stride_or=i32, stride_oh=i32),
                         dict(HEAD_DIM=128, D_PAD=128)),
    "rms_norm": (norm.rms_norm_kernel, norm_args,
                 dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True, HAS_ROPE=False, NORM_BITS=NORM_BITS)),
    "rms_norm_rope": (norm.rms_norm_kernel, norm_args,
                      dict(N=128, BLOCK=128, HAS_RESIDUAL=False, HAS_ROPE=True, NORM_BITS=NORM_BITS)),
    "rope": (norm.rope_kernel, dict(x_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", out_ptr="*bf16",
                                    num_heads=i32), dict(HALF=64, HALF_PAD=64)),
    "logit_max": (samp.logit_max_kernel,
                  dict(logits_ptr="*fp32", bitmask_ptr="*i32", row_ids_ptr="*i64", out_ptr="*fp32",
                       width=i32, offset=i32, stride_row=i32, stride_mask=i32, num_chunks=i32),
                  dict(CHUNK=samp.CHUNK, HAS_MASK=True)),
    "sample_shard": (samp.sample_shard_kernel,
                     dict(logits_ptr="*fp32", bitmask_ptr="*i32", row_ids_ptr="*i64",
                          temperature_ptr="*fp64", max_z_ptr="*fp64", min_q_ptr="*i64",
                          row_key_ptr="*i64", best_score_ptr="*fp64", best_id_ptr="*i64",
                          q_sum_ptr="*i64", count_ptr="*i64", keys_ptr="*i64", scores_ptr="*fp64",
                          width=i32, offset=i32, stride_row=i32, stride_mask=i32, num_chunks=i32,
                          num_candidates=i32),
                     dict(MODE=samp.ORDERED, CHUNK=samp.CHUNK, HAS_MASK=True)),
    "verify": (ver.verify_kernel,
               dict(logits_ptr="*fp32", bitmask_ptr="*i32", draft_ptr="*i64", draw_in_ptr="*i64",
                    row_path_ptr="*i64", path_start_ptr="*i64", temperature_ptr="*fp64",
                    min_q_ptr="*i64", row_key_ptr="*i64", draw_ptr="*i64", accepted_ptr="*i64",
                    width=i32, stride_row=i32, stride_mask=i32),
               dict(TILE=ver.TILE, HAS_MASK=True)),
    "apply_token_bitmask": (ver.apply_token_bitmask_kernel,
                            dict(logits_ptr="*fp32", bitmask_ptr="*i32", width=i32, stride_row=i32,
                                 stride_mask=i32), dict(BLOCK=1024)),
}
for act in (qg.BLOCK, qg.SUPER):  # the quantized GEMM: step 1 per group of 32 and of 256, then every kind
    kernels[f"quantize_{act}"] = (qt.quantize_kernel,
                                  dict(x_ptr="*bf16", xq_ptr="*i8", m_ptr="*i32", k_ptr="*i32", sm_ptr="*i32",
                                       se_ptr="*i32", NUM_GROUPS=i32),
                                  dict(GROUPS=qt.QUANT_COLUMNS // act, ACT=act))
for name, kind in qg.KINDS.items():
    kernels[f"quant_gemm_{name}"] = (
        qt.quant_gemm_kernel,
        dict(xq_ptr="*i8", m_ptr="*i32", k_ptr="*i32", sm_ptr="*i32", se_ptr="*i32", kmax_ptr="*i32",
             codes_ptr="*i8", scale_ptr="*i32", scale_exp_ptr="*i32", min_ptr="*i32", min_exp_ptr="*i32",
             top_ptr="*i32", out_ptr="*bf16", M=i32, N=i32, K=i32, NG=i32, G_BIAS=i32),
        dict(SUB=kind.sub, BPG=kind.blocks_per_group, MIN_TERM=qt.min_term(kind), TERM_BITS=kind.term_bits,
             BLOCK_M=qt.BLOCK_M, BLOCK_N=qt.BLOCK_N))
found = {}
for name, (fn, signature, constexprs) in kernels.items():
    try:
        found[name] = ptx(fn, signature, constexprs)
    except Exception as e:  # reported per kernel, so one failure does not hide the others
        found[name] = "ERROR " + repr(e)[:2000]
json.dump(found, sys.stdout)
"""

FLOAT_OP = re.compile(r"^\s*((?:fma|mad|div|sqrt|rcp|rsqrt|ex2|lg2|sin|cos|tanh|mma|wgmma)\.[\w.]+)", re.M)


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
    """Floating-point instructions that round or approximate, with their counts (integer mad and
    the like excluded: their names end in an integer type)."""
    names = [n for n in FLOAT_OP.findall(code) if re.search(r"\.(f16|bf16|f32|f64)\b", n)]
    return {n: names.count(n) for n in sorted(set(names))}


QUANT_KINDS = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q5_1")  # quant_gemm.KINDS
KERNELS = ["attention_stats", "attention_sums", "attention_finish", "rms_norm", "rms_norm_rope",
           "rope", "logit_max", "sample_shard", "verify", "apply_token_bitmask", "quantize_32", "quantize_256",
           *(f"quant_gemm_{kind}" for kind in QUANT_KINDS)]


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_compiles_without_fma_or_approximations(ptx, name):
    code = ptx[name]
    assert not code.startswith("ERROR"), code
    ops = float_ops(code)
    fused = {n: c for n, c in ops.items() if n.startswith(("fma.", "mad."))}
    assert not fused, f"{name}: contracted products {fused}"
    approximate = {n: c for n, c in ops.items()
                   if ".approx" in n or ".full" in n or n.startswith(("rcp.", "rsqrt.", "ex2.", "lg2.",
                                                                     "sin.", "cos.", "tanh."))}
    assert not approximate, f"{name}: approximate instructions {approximate}"


def test_attention_dots_are_float64_mma_and_its_only_division_is_ieee(ptx):
    for name in ("attention_stats", "attention_sums"):
        ops = float_ops(ptx[name])
        assert any(n.startswith("mma.") and n.endswith(".f64.f64.f64.f64") for n in ops), ops
        assert not any(n.startswith("div.") for n in ops), ops
    assert float_ops(ptx["attention_finish"]) == {"div.rn.f32": 1}


def test_quantized_gemm_is_integer_mma_and_its_quantizer_divides_ieee(ptx):
    """Every kind's GEMM: its block dots are int8 tensor-core MMAs with int32 accumulation and no
    float instruction rounds (the terms are integers; the one rounding is a conversion); step 1's
    divisions are IEEE."""
    int8_mma = re.compile(r"^\s*mma\.[\w.]*\.s32\.s8\.s8\.s32\b", re.M)
    for kind in QUANT_KINDS:
        code = ptx[f"quant_gemm_{kind}"]
        assert int8_mma.search(code) and not float_ops(code), (kind, float_ops(code))
    for act in (32, 256):
        assert set(float_ops(ptx[f"quantize_{act}"])) == {"div.rn.f32"}, act


def test_norm_has_exactly_the_rules_ieee_sqrt_and_divisions(ptx):
    import inspect

    import triton.language as tl

    from tensorfold.kernels import rms_norm_triton
    eps = inspect.signature(rms_norm_triton.rms_norm_kernel.fn).parameters["eps"]
    assert eps.annotation == tl.float32
    for name in ("rms_norm", "rms_norm_rope"):
        assert float_ops(ptx[name]) == {"div.rn.f32": 2, "sqrt.rn.f32": 1}, name
