"""A file at a real model's size and type: Llama-3.2-1B's shapes in Q4_K_M as llama.cpp's own
quantizer writes it (tools/real_shapes.py: random weights, SmolLM2's tokenizer), served by the
native op set and by the torch references with the same token_sha, greedy and sampled.

The C++ kernels read the K-quants in their file's form (super-block heads of float16 d / dmin and
6-bit sub-block scales, Q6_K's split code planes), the references the widened integers; equal
replies over 16 layers of 2048 x 8192 matrices and a 49,152-token head say the two agree at a
size no unit test reaches. Making the file needs llama-cpp-python's quantizer (a benchmark peer,
not a dependency). The file is kept in tools/real_shapes.py's folder (~/.cache/tensorfold-bench/real);
the test runs where it exists, or makes it when TENSORFOLD_MAKE_REAL_SHAPES=1 (a minute or two, and
2.7 GB of disk with its F16 source), and is skipped otherwise, saying how to make it.
"""
import os

import pytest

from tensorfold.api.replies import token_sha
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.sampling.params import SamplingParams
from test_quantized_model import cpu_op_set

pytestmark = pytest.mark.slow
CONFIG = dict(probe=False, prompt_cache_gib=0, context=256, kv_cache_gib=0.05, drafting=False)


@pytest.fixture(scope="module")
def q4_k_m_1b():
    from tools.real_shapes import path_of, real_shape_gguf
    if not os.path.isfile(path_of("llama-1b", "q4_k_m")) and not os.environ.get("TENSORFOLD_MAKE_REAL_SHAPES"):
        pytest.skip("the 1B Q4_K_M file is not made (2.7 GB written once): python tools/real_shapes.py llama-1b "
                    "--types q4_k_m, or TENSORFOLD_MAKE_REAL_SHAPES=1")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python makes the Q4_K_M file (tools/real_shapes.py)")
    return real_shape_gguf("llama-1b", "q4_k_m")


def test_1b_q4_k_m_native_equals_the_torch_references(q4_k_m_1b):
    prompt = [1000 + (i * 7919) % 48000 for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=4, ignore_eos=True)]
    native = Engine(q4_k_m_1b, EngineConfig(**CONFIG))
    assert native.backend.model.ops.NAME.startswith("native-")
    assert native.backend.model.weight_formats() == {"q4_k": 64, "q6_k": 17}  # as the engine reports them
    got = [native.generate(prompt, p).token_ids for p in params]
    del native
    with cpu_op_set("torch") as ops:
        reference = Engine(q4_k_m_1b, EngineConfig(**CONFIG))
        assert reference.backend.model.ops is ops
        want = [reference.generate(prompt, p).token_ids for p in params]
    assert [token_sha(t) for t in got] == [token_sha(t) for t in want], (got, want)
    assert all(len(t) == 4 for t in got)
