"""The cpu backend on its compiled op set (csrc/cpu): the same logits and token_sha as the torch
references end to end, and exact mode granted on the default model, fp32 and bf16; with the KV
cache's dtype apart from the activations' too (a bfloat16 cache under float32 activations, the
default engine's, and the reverse).

The exactness suite (test_exactness.py, test_server*.py) runs on whatever op set the cpu backend
picks, which is this one wherever the extension is built; this module pins what the compiled
set must equal. A machine on which the compiled ops were not exact fails here, loudly.
"""
import types

import pytest
import torch

from tensorfold.api.replies import token_sha
from tensorfold.backends import backend_ops, cpu_ops, keeps_v_exponents, native_problem
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.kernels import reference
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
from tensorfold.models.cache import PagedKV
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model

pytestmark = pytest.mark.skipif(native_problem() is not None, reason=str(native_problem()))

BLOCK = 16


def reference_ops():
    """The torch references under the op-set names, the GEMM included (its fixed-order oracle)."""
    ops = {name: getattr(cpu_ops, name) for name in dir(cpu_ops) if not name.startswith("_")}
    ops.update(linear=reference.linear, Linear=cpu_ops.ReferenceLinear, NAME="reference")
    return types.SimpleNamespace(**ops)


def greedy_run(model, prompts: list[list[int]], steps: int, kv_dtype: torch.dtype | None = None):
    """Prefill the prompts together, then decode them together greedily; every forward's logits.
    The cache is of kv_dtype (default: the model's dtype), with the record of V's exponents where
    the op set keeps one, as the engine allocates it."""
    cache = model.allocate_cache(64, BLOCK, kv_dtype, v_exponents=keeps_v_exponents(model.ops))
    tables = [torch.arange(s * 8, s * 8 + 8).flip(0) for s in range(len(prompts))]  # shuffled-ish blocks
    seqs = [list(p) for p in prompts]
    fed = [0] * len(prompts)
    all_logits = []
    for _ in range(steps):
        ids, pos, slots, rows, sequences = [], [], [], [], []
        for s, tokens in enumerate(seqs):
            first = len(ids)
            for p in range(fed[s], len(tokens)):
                ids.append(tokens[p])
                pos.append(p)
                slots.append(int(tables[s][p // BLOCK]) * BLOCK + p % BLOCK)
            sequences.append(SequenceRows(first, len(ids), tables[s]))
            rows.append(len(ids) - 1)
            fed[s] = len(tokens)
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        logits = model.forward(ForwardBatch(t(ids), t(pos), t(slots), sequences, t(rows)), cache)
        all_logits.append(logits)
        for s, row in enumerate(logits.argmax(dim=-1).tolist()):
            seqs[s].append(row)
    return all_logits, [token_sha(s[len(p):]) for s, p in zip(seqs, prompts)]


# (activations, KV cache): the cache's dtype is its own (EngineConfig.kv_dtype)
KV_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
            (torch.bfloat16, torch.float32)]
KV_IDS = ["f32", "bf16", "f32-bf16cache", "bf16-f32cache"]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("dtype,kv_dtype", KV_PAIRS, ids=KV_IDS)
def test_compiled_op_set_equals_references_end_to_end(request, arch, dtype, kv_dtype):
    ckpt_dir = request.getfixturevalue(arch)
    native = backend_ops("cpu")
    assert native.NAME.startswith("native-")
    compiled = build_model(load_hf_dir(ckpt_dir), dtype, native)
    oracle = build_model(load_hf_dir(ckpt_dir), dtype, reference_ops())
    prompts = [[1, 5, 9, 200, 31, 7, 7, 64] * 3, [3, 4], list(range(40, 77))]
    got_logits, got_sha = greedy_run(compiled, prompts, steps=6, kv_dtype=kv_dtype)
    want_logits, want_sha = greedy_run(oracle, prompts, steps=6, kv_dtype=kv_dtype)
    for step, (got, want) in enumerate(zip(got_logits, want_logits)):
        assert torch.equal(got, want), f"{arch} {dtype} {kv_dtype} cache: logits differ at step {step}"
    assert got_sha == want_sha


def test_the_cache_dtype_reaches_the_logits(tiny_llama):
    """Negative control for the pairs above: under float32 activations a bfloat16 cache gives
    other logits than a float32 one, so a path that ignored the cache's dtype would show."""
    model = build_model(load_hf_dir(tiny_llama), torch.float32, backend_ops("cpu"))
    prompts = [list(range(7, 47)), [9, 8, 7]]
    half, _ = greedy_run(model, prompts, steps=2, kv_dtype=torch.bfloat16)
    full, _ = greedy_run(model, prompts, steps=2, kv_dtype=torch.float32)
    assert not torch.equal(half[0], full[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_is_exact_on_the_compiled_op_set(dtype):
    """The startup probes (every GEMM shape of the model at batch 1..64, threads 1 vs 2, norm,
    SiLU, attention) pass on this CPU: if they did not, the server would refuse exact mode."""
    engine = Engine(None, EngineConfig(dtype=dtype, probe=False, context=256, kv_cache_gib=0.01))
    assert engine.info.ops.startswith("native-")
    assert engine.info.kv_dtype == dtype  # --kv-dtype auto: the activations' dtype
    assert engine.backend.probes() == []


def test_default_engine_serves_a_bfloat16_cache_in_exact_mode():
    """EngineConfig() (dtype auto: the default GGUF's blocks, float32 activations) allocates a
    bfloat16 KV cache, half the float32 one, and the startup probes (run on that cache's dtype)
    pass: exact mode is granted."""
    engine = Engine(None, EngineConfig(context=256, kv_cache_gib=0.05))  # probe=True, the default
    assert engine.info.ops.startswith("native-") and engine.info.dtype == "float32"
    cache = engine.backend.cache
    assert all(kv.k.dtype == kv.v.dtype == torch.bfloat16 for kv in cache.layers)
    assert engine.exact, engine.probe_failures
    a = engine.backend.model.args
    layer = PagedKV(a.num_kv_heads, a.head_dim)

    def blocks(kv_dtype):  # what --kv-cache-gib 0.05 buys (above the one-window minimum here)
        per_token = a.num_layers * layer.bytes_per_token(kv_dtype, v_exponents=True)
        return int(0.05 * 2**30) // (per_token * engine.config.block_size)
    assert all(kv.v_exp is not None and kv.v_exp.dtype == torch.int16 for kv in cache.layers)
    assert engine.pool.num_blocks == cache.num_blocks == blocks(torch.bfloat16) > 256 // 32
    per_token = a.num_layers * layer.bytes_per_token(torch.bfloat16, v_exponents=True)
    assert cache.nbytes == engine.info.cache_bytes == cache.num_blocks * engine.config.block_size * per_token
    forced = Engine(None, EngineConfig(kv_dtype="float32", probe=False, context=256, kv_cache_gib=0.05))
    assert forced.info.kv_dtype == "float32" and forced.pool.num_blocks == blocks(torch.float32)
    assert abs(blocks(torch.float32) * 2 - blocks(torch.bfloat16)) <= 2  # (the records: 2 bytes a KV head each)
    with pytest.raises(ValueError, match="kv_dtype"):
        Engine(None, EngineConfig(kv_dtype="float16", probe=False))


@pytest.fixture(scope="module")
def tiny_qwen3_wide(tmp_path_factory, smollm2_tokenizer):
    """qwen3 with heads of 512 (paged_attention.MAX_HEAD_DIM, Gemma 4's global width): the fused
    layer's widest rope, per-head norm, cache write and attention."""
    from tools.tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen3_wide")), "qwen3", tokenizer=smollm2_tokenizer,
                                head_dim=512)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3", "tiny_qwen3_wide"])
@pytest.mark.parametrize("dtype,kv_dtype", KV_PAIRS, ids=KV_IDS)
def test_one_call_per_layer_equals_the_op_by_op_layer(request, arch, dtype, kv_dtype):
    """The fused layer (native_ops.fuse: one _cpu.DecoderLayer call per layer) against the same kernels called op by op by the
    model: the same logits, and the same cache contents."""
    native = backend_ops("cpu")
    fused = build_model(load_hf_dir(request.getfixturevalue(arch)), dtype, native)
    assert all(run != layer.forward for run, layer in zip(fused._run, fused.layers))  # every layer one native call
    unfused = types.SimpleNamespace(**{n: getattr(native, n) for n in dir(native) if not n.startswith("_")})
    unfused.fuse = lambda layer: None
    op_by_op = build_model(load_hf_dir(request.getfixturevalue(arch)), dtype, unfused)
    prompts = [list(range(7, 47)), [9, 8, 7]]
    got, got_sha = greedy_run(fused, prompts, steps=4, kv_dtype=kv_dtype)
    want, want_sha = greedy_run(op_by_op, prompts, steps=4, kv_dtype=kv_dtype)
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and got_sha == want_sha
