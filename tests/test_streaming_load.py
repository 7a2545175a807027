"""The streaming load: a GGUF's block matrices stay in the file (gguf_quants.FileBlocks) until the
model packs them, one at a time, so loading never holds the model twice. A ~190 MB Q8_0 file of
random blocks is loaded by a fresh process, which reports its peak RSS (getrusage's ru_maxrss, in
tools/bench_real.load_child) next to what it must hold anyway: the runtime (torch, the tokenizer,
the kernels), the packed matrices and the KV cache. Before the streaming load the unpacked blocks
of the whole model sat beside the packed ones (1B shape: 1657 MiB over those three)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWANCE_MIB = 150  # one matrix's unpacked blocks and its packing, the probes' scratch (70 measured; the eager load added ~250 more here)


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    from tools.real_shapes import write_random_gguf
    path = str(tmp_path_factory.mktemp("stream") / "model-q8_0.gguf")
    write_random_gguf(path, "llama", hidden=1024, layers=8, heads=16, kv_heads=4, head_dim=64, ffn=4096,
                      qtype="q8_0")
    return path


def test_loading_holds_the_packed_model_once(q8_file):
    from tools.bench_real import tensor_bytes
    assert os.path.getsize(q8_file) > 150 * 2**20
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_real.py"), "--load-child", q8_file,
                           "--threads", "2"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    load = json.loads(done.stdout.strip().splitlines()[-1])
    packed = load["packed"] / 2**20
    assert load["packed"] <= 1.02 * tensor_bytes(q8_file)  # Q8_0 kept in the file's bytes
    extra = load["peak"] - load["runtime"] - packed - load["cache"]
    assert extra <= ALLOWANCE_MIB, (f"peak RSS {load['peak']:.0f} MiB: runtime {load['runtime']:.0f} + packed "
                                    f"{packed:.0f} + cache {load['cache']:.0f} + {extra:.0f} MiB")


def test_a_file_blocks_row_range_reads_only_its_rows(q8_file):
    """An expert of a stacked tensor is a row range: only its bytes are read, and they are the rows
    the whole matrix has there."""
    import torch

    from tensorfold.models.gguf_file import load_gguf
    from tensorfold.models.gguf_quants import FileBlocks

    ckpt = load_gguf(q8_file, keep_quantized=True)
    down = ckpt.tensors["model.layers.3.mlp.down_proj.weight"]
    assert isinstance(down, FileBlocks) and down.shape == (1024, 4096)
    part = down.rows(slice(100, 164))
    assert part.nbytes == down.nbytes * 64 // 1024 and part.shape == (64, 4096)
    whole = down.load()
    assert torch.equal(part.load().dequantize(), whole.dequantize()[100:164])
    ids = torch.tensor([5, 3, 900])
    assert torch.equal(down.rows(ids).load().dequantize(), whole.dequantize()[ids])
