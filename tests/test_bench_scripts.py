"""The benchmark scripts still run (their numbers live in docs/; here only that they work).

bench_kernels.py --smoke runs every kernel in the interpreter at tiny sizes next to its torch
counterpart and checks attention against its reference bitwise in each row; bench_exact.py runs
each exact CPU op (compiled and as its reference) next to its stock counterpart with one timing
run; bench_native.py decodes a few tokens next to llama.cpp (when installed); bench_quant.py runs
its four sections (speed, memory, agreement, K-quants) at tiny sizes; bench_grammar.py runs each
grammar constrained and free; bench_attention.py times the decode attention over a few hundred
keys; bench_gemm.py the default model's layer GEMMs at two row counts; bench_mlx.py both backends
on a tiny quantized llama; bench_round.py a tiny llama's decode round, layer by layer.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tool(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_bench_kernels_smoke_runs_and_attention_is_bitwise():
    out = run_tool("tools/bench_kernels.py", "--smoke")
    attention = [line for line in out.splitlines() if line.startswith("| attention")]
    assert len(attention) == 6, out
    assert all("bitwise equal" in line for line in attention), "\n".join(attention)
    assert "| verify greedy + grammar" in out
    quant = [line for line in out.splitlines() if line.startswith("| quant_linear")]
    assert len(quant) == 2 and all("bitwise equal" in line for line in quant), out
    assert sum(line.startswith("| dense_linear") for line in out.splitlines()) == 2, out


def test_bench_exact_runs():
    out = run_tool("tools/bench_exact.py", "--runs", "1", "--repeats", "1", "--warmup", "0")
    rows = [line for line in out.splitlines() if re.search(r"\| \d+\.\d\dx +\|$", line)]
    assert len(rows) == 32, out
    try:
        from tensorfold import _cpu  # noqa: F401
    except ImportError:
        return
    assert all(re.match(r"\|[^|]+\|[^|]+\| \d+\.\d{3} ", line) for line in rows), out  # every op timed compiled


def test_bench_native_runs():
    """A tiny run: one dtype, a few tokens; the llama.cpp columns read n/a where it is not installed."""
    out = run_tool("tools/bench_native.py", "--dtypes", "float32", "--tokens", "4", "--prefill-tokens", "16",
                   "--repeats", "1")
    row = [line for line in out.splitlines() if line.startswith("| float32")]
    assert len(row) == 1 and "| True " in row[0], out


def test_bench_perplexity_runs():
    """One short window: the quantized and dense rows (and llama.cpp's where it is installed), each
    a finite perplexity; the quantized path's is the baseline."""
    out = run_tool("tools/bench_perplexity.py", "--windows", "1", "--window", "64")
    rows = [line for line in out.splitlines() if line.startswith("| TensorFold") or line.startswith("| llama.cpp")]
    assert len(rows) in (2, 3) and "| +0.00% |" in rows[0], out
    assert all(1.0 < float(line.split("|")[2]) < 1e5 for line in rows), out


def test_bench_quant_runs():
    """Every section at tiny sizes; without llama.cpp its columns read n/a."""
    out = run_tool("tools/bench_quant.py", "--tokens", "4", "--prefill-tokens", "16", "--repeats", "1",
                   "--rss-context", "256", "--agree-tokens", "4", "--agree-prompts", "1")
    starts = ("| Q4_1 (token_embd Q8_0)", "| TensorFold (dtype auto)", "| Write a short story", "| tiny Q4_K_M")
    rows = {start: [line for line in out.splitlines() if line.startswith(start)] for start in starts}
    assert all(len(found) == 1 for found in rows.values()), out
    assert "| True " in rows["| Q4_1 (token_embd Q8_0)"][0], out
    assert "failed" not in rows["| tiny Q4_K_M"][0].split("|")[3], out  # our decode column


def test_bench_grammar_runs_and_drafting_keeps_the_reply():
    out = run_tool("tools/bench_grammar.py", "--repeats", "1", "--max-tokens", "12")
    rows = [line for line in out.splitlines() if line.startswith(("| json schema", "| regex", "| choice"))]
    assert len(rows) == 6, out  # three in the decode table, three in the compile table
    assert all(line.rstrip().endswith("| True              |") for line in rows[:3]), out


def test_bench_attention_runs():
    """The decode attention alone, tiny: a few hundred keys (split over the threads), two layers."""
    import pytest

    from tensorfold.backends import native_problem
    if native_problem() is not None:
        pytest.skip(f"the C++ kernels are not built: {native_problem()}")
    out = run_tool("tools/bench_attention.py", "--keys", "300", "--layers", "2", "--repeats", "1", "--cache", "float32")
    assert re.search(r"over 300 keys, q float32, cache float32 \(with its record\): \d+\.\d+ ms per call", out), out
    out = run_tool("tools/bench_attention.py", "--keys", "300", "--layers", "2", "--repeats", "1", "--no-record")
    assert re.search(r"over 300 keys, q float32, cache bfloat16: \d+\.\d+ ms per call", out), out


def test_bench_gemm_runs():
    """The layers' GEMMs of the default model at two row counts, one round."""
    import pytest

    from tensorfold.backends import native_problem
    if native_problem() is not None:
        pytest.skip(f"the C++ kernels are not built: {native_problem()}")
    out = run_tool("tools/bench_gemm.py", "--dtypes", "bfloat16", "--rows", "1,3", "--repeats", "1")
    assert re.search(r"\| bfloat16 \| 120 bfloat16 \| \d+ \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d\d \|", out), out


def test_bench_mlx_runs(tiny_llama):
    """Both backends on a tiny llama quantized at load: the same token_sha, and the mlx round's
    profile."""
    out = run_tool("tools/bench_mlx.py", "--model", tiny_llama, "--quantize", "q8_0", "--tokens", "4",
                   "--prompt-tokens", "8", "--repeats", "1")
    assert "same token_sha: True" in out, out
    assert re.search(r"\| quant_linear +\| \d+\.\d +\|", out), out


def test_bench_round_runs(tiny_llama):
    """A tiny llama quantized at load: a row per layer and the head, each with its GEMMs alone, and
    the round's total."""
    out = run_tool("tools/bench_round.py", tiny_llama, "--quantize", "q8_0", "--tokens", "4", "--repeats", "1",
                   "--gemm-passes", "1")
    layers = [line for line in out.splitlines() if re.match(r"\| layer \d+ \| \w+", line)]
    assert len(layers) >= 2 and re.search(r"\| head \| lm_head \| \d+\.\d{3} \| \d+\.\d{3} \|", out), out
    assert re.search(r"\| \*\*the round\*\* \| \| \*\*\d+\.\d{3}\*\* \|", out), out


def test_bench_hybrid_runs(tmp_path):
    out = run_tool("tools/bench_hybrid.py", "--shape", "tiny", "--tokens", "4", "--prefill-tokens", "16",
                   "--repeats", "1", "--block-size", "32", "--cache-gib", "0.05", "--long", "64",
                   "--cache-dir", str(tmp_path))
    assert "DeltaNet layers' share of a round" in out and "round @64 / @100" in out


def test_bench_hybrid_runs_the_mlx_peer_where_it_is_installed(tmp_path):
    out = run_tool("tools/bench_hybrid.py", "--shape", "tiny", "--tokens", "4", "--prefill-tokens", "16",
                   "--repeats", "1", "--block-size", "32", "--cache-gib", "0.05", "--mlx", "--cache-dir", str(tmp_path))
    assert "mlx_lm decode (CPU, once)" in out, out
    from tools import peer_mlx_lm
    assert (peer_mlx_lm.SKIP_MESSAGE in out) != peer_mlx_lm.available()


def test_bench_hybrid_runs_a_gguf_written_by_layer(tmp_path):
    """The moe shape's path (a GGUF written a layer at a time, served as stored by both engines) at
    tiny sizes."""
    out = run_tool("tools/bench_hybrid.py", "--shape", "tiny-gguf", "--quant", "q8_0", "--tokens", "4",
                   "--prefill-tokens", "16", "--repeats", "1", "--block-size", "32", "--cache-gib", "0.05",
                   "--cache-dir", str(tmp_path))
    assert "tiny-gguf-4" in out and "DeltaNet layers' share of a round" in out, out
    assert os.path.exists(tmp_path / "tiny-gguf-4" / "model-q8_0.gguf")


def test_bench_quant_kinds_runs():
    """tools/bench_quant_kinds.py: one-thread GEMM time per kind at a tiny shape, one table row each."""
    import pytest

    from tensorfold.backends import native_problem
    if native_problem() is not None:
        pytest.skip(f"the C++ kernels are not built: {native_problem()}")
    out = run_tool("tools/bench_quant_kinds.py", "--kinds", "q4_0,q4_k,q5_1", "--rows", "1,17", "--n", "48",
                   "--k", "512", "--repeats", "1", "--budget", "0.01")
    for kind in ("q4_0", "q4_k", "q5_1"):
        assert re.search(rf"\| {kind} \| \d+\.\d+ \(\d+\.\d\dx\) \| \d+\.\d+ \(\d+\.\d\dx\) \|", out), out
    # streamed: the GB/s read and its share of torch's own read rate, timed in pairs
    out = run_tool("tools/bench_quant_kinds.py", "--kinds", "q4_0", "--rows", "1", "--n", "48", "--k", "512",
                   "--repeats", "2", "--budget", "0.01", "--streamed", "3")
    assert re.search(r"\| q4_0 \| \d+\.\d+ \(1\.00x, \d+\.\d GB/s, \d+% of read\) \|", out), out
