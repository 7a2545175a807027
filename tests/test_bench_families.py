"""tools/bench_families.py runs end to end on the tiny shapes: the checkpoint, its GGUF, both engines
on the file, the layer-kind shares (issue 35's measurements)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(tmp_path, families: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "tools/bench_families.py", "--shape", "tiny", "--families", families,
                           "--threads", "1", "--tokens", "4", "--prefill-tokens", "16", "--repeats", "1",
                           "--cache-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def peer_installed() -> bool:
    from tools import peer_llama_cpp
    return peer_llama_cpp.available()


def check(out: str, family: str) -> None:
    rows = [line for line in out.splitlines() if line.startswith(f"| {family} ")]
    speeds, shares = rows[0], rows[1:]
    assert "worker exit" not in speeds, out
    cells = [c.strip() for c in speeds.strip("|").split("|")]
    assert float(cells[4]) > 0 and float(cells[7]) > 0 and float(cells[10]) > 0, speeds  # ours
    if peer_installed():  # llama.cpp loaded the same file and ran every measurement
        assert cells[-1] == "" and float(cells[5]) > 0 and float(cells[8]) > 0, speeds
    kinds = [c for line in shares for c in [line.strip("|").split("|")[2].strip()]]
    assert any(k.startswith("rest") for k in kinds) and len(kinds) >= 3, kinds
    for line in shares:
        share = float(line.strip("|").split("|")[3].strip().rstrip("%"))
        assert -5 <= share <= 100, line


def test_bench_families_runs_nemotron_h_against_llama_cpp(tmp_path):
    out = run_bench(tmp_path, "nemotron_h")
    check(out, "nemotron_h")
    assert "Mamba2 (x2)" in out and "Attention (x1)" in out, out


@pytest.mark.slow
def test_bench_families_runs_gemma4_and_glm(tmp_path):
    out = run_bench(tmp_path, "gemma4,glm_moe_dsa")
    check(out, "gemma4")
    check(out, "glm_moe_dsa")
    assert "sliding, KV-shared" in out and "DSA indexer" in out, out
