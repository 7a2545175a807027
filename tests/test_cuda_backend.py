"""The cuda backend wired end to end: the engine with the cuda op set (Triton kernels).

Without a GPU the whole engine runs the cuda op set on CPU tensors in Triton's interpreter
(TRITON_INTERPRET=1, set before anything imports triton; EngineConfig(device="cpu")), patched to
compute what the GPU computes (tests/triton_interpreter.py); with a GPU the same tests run
compiled on "cuda". Tiny random llamas (hidden 64, 2 layers):
- the kernels are on the path: the engine calls cuda_ops' attention, norms, rope and sampler,
  never the cpu references'; weights, rope tables and the KV cache sit on the backend's device;
- against the cpu backend (SmolLM2's 49,152-token vocabulary, so the sampler folds 12 chunks):
  every round's logits bitwise equal (attention and the norm sum exactly, tensorfold/exact), so
  the same tokens and token_sha, greedy and sampled, with drafts;
- within the cuda backend, bitwise by construction (a 512-token vocabulary keeps the interpreter
  fast and makes prompt-lookup drafts hit): every draw's logits row and every reply token equal
  solo serial whole-prompt runs vs batched, chunked and drafted ones, with sampled, top-k/top-p,
  min_p, greedy and masked rows; the startup probes pass on the cuda op set.
Not shown without a GPU: compiled code running (tests/test_compiled_kernels.py reads its PTX),
cuBLAS GEMMs on CUDA tensors (the probes check them at startup), speed.
"""
import os

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before any `import triton` (cuda_ops imports it)

import random  # noqa: E402

import pytest  # noqa: E402

from tensorfold.api.replies import token_sha  # noqa: E402
from tensorfold.backends import backend_ops, cpu_ops, native_problem, select_backend  # noqa: E402
from tensorfold.engine.engine import Engine, EngineConfig  # noqa: E402
from tensorfold.sampling.params import SamplingParams  # noqa: E402
from engine_cases import check_solo_vs_batched, run  # noqa: E402,F401 (run: test_quantized_model)
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

DEVICE = "cuda" if HAS_GPU else "cpu"
OP_NAMES = ("linear", "rms_norm", "add_rms_norm", "rms_norm_rope", "silu_and_mul", "sigmoid_and_mul",
            "apply_rope",
            "rope_table", "pad_rows", "paged_attention", "paged_decode_attention", "attention", "write_kv",
            "sample")
KERNEL_OPS = ("attention", "rms_norm", "add_rms_norm", "apply_rope", "sample")  # Triton in cuda_ops
SMALL = dict(probe=False, kv_cache_gib=0.002, context=256)
# Against the cpu backend, bitwise: on CPU tensors both op sets run the cpu GEMM; on a GPU the
# dense GEMM is the Triton one, whose float sums are not the CPU's, so both engines quantize their
# GEMM weights at load (q8_0) and every GEMM is the exact one (kernels/quant_gemm*.py).
ACROSS = dict(quantize="q8_0") if HAS_GPU else {}


@pytest.fixture(scope="module")
def cuda_ops():
    return backend_ops("cuda")


def cuda_engine(path, **config) -> Engine:
    return Engine(path, EngineConfig(backend="cuda", device=DEVICE, **{**SMALL, **config}))


def spy(monkeypatch, module, names) -> dict[str, int]:
    """Count the calls made to module.<name> (the model looks its ops up on every call)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        def counted(*args, _fn=getattr(module, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


class Recorder:
    """What an engine's runner sees: each round's logits and number of requests, and the logits
    row of each draw by (request seed, position); a later draw of a position replaces an earlier
    one (a row after a rejected draft is redrawn on the accepted path in a later round)."""

    def __init__(self, engine: Engine):
        self.logits, self.round_sizes, self.draws = [], [], {}
        forward, execute = engine.backend.model.forward, engine.runner.execute

        def record_forward(batch, cache):
            logits = forward(batch, cache)
            self.logits.append(logits.detach().cpu().clone())
            return logits

        def record_execute(plan):
            drawn = execute(plan)
            self.round_sizes.append(len(plan.requests))
            rows = [row for req in plan.requests for row in req.rows]
            for row, logits in zip(rows, self.logits[-1]):
                self.draws[row.seed, row.position] = logits
            return drawn
        engine.backend.model.forward, engine.runner.execute = record_forward, record_execute


# ---- backend choice ----

def test_select_backend(monkeypatch, cuda_ops):
    assert select_backend("cpu") == "cpu"
    assert select_backend("auto") == DEVICE
    with pytest.raises(RuntimeError, match="unknown backend"):
        select_backend("rocm")
    if not HAS_GPU:
        with pytest.raises(RuntimeError, match="--backend cuda: no CUDA GPU"):
            select_backend("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # triton imports here
    assert select_backend("auto") == "cuda"
    assert select_backend("cuda") == "cuda"
    compiled = backend_ops("cpu")  # the C++ kernels where built, else the torch ops
    assert compiled is cpu_ops if native_problem() else compiled.NAME.startswith("native-")
    for name in OP_NAMES:  # one set of names, so a model runs on any
        for ops in (cpu_ops, cuda_ops, compiled):
            assert callable(getattr(ops, name)), (ops.NAME, name)
    assert cpu_ops.paged_attention is not cuda_ops.paged_attention
    assert cpu_ops.sample is not cuda_ops.sample


# ---- against the cpu backend ----

def test_either_path_gives_the_same_logits_and_token_sha(tiny_llama, monkeypatch, cuda_ops):
    """The issue's rule, kernel choice never changes a token: the cuda op set (Triton kernels) and
    the cpu op set (torch references) give bitwise the same logits every round, so the same
    tokens and token_sha, greedy and sampled (top-p, top-k, min_p), with drafts."""
    rng = random.Random(1)
    prompts = [[rng.randrange(49152) for _ in range(21)], [rng.randrange(49152) for _ in range(9)] * 2]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.8, top_k=50, min_p=0.01, seed=7, max_tokens=8,
                             ignore_eos=True)]
    config = dict(drafting=True, max_tokens_per_step=16, **ACROSS)  # 16-token chunks, then decode
    cpu = Engine(tiny_llama, EngineConfig(**SMALL, **config))
    want = Recorder(cpu)
    expected = [token_sha(r.output_ids) for r in run(cpu, prompts, params)]

    kernel_calls = spy(monkeypatch, cuda_ops, KERNEL_OPS)
    reference_calls = spy(monkeypatch, cpu_ops, OP_NAMES)
    gpu = cuda_engine(tiny_llama, **config)
    assert gpu.backend.model.ops is cuda_ops
    model = gpu.backend.model
    qkv = model.layers[1].mixer.qkv.parts[0]
    for t in (model.norm, getattr(qkv, "codes", qkv), next(iter(model.rope_tables)).cos,
              gpu.backend.cache.layer(1).k):
        assert t.device.type == DEVICE
    got = Recorder(gpu)
    assert [token_sha(r.output_ids) for r in run(gpu, prompts, params)] == expected
    assert all(n > 0 for n in kernel_calls.values()), kernel_calls
    assert not any(reference_calls.values()), reference_calls

    assert len(want.draws) >= 16 and want.draws.keys() == got.draws.keys()
    for key, logits in want.draws.items():  # every draw's logits row, by (seed, position)
        assert torch.equal(got.draws[key], logits), f"draw {key}: max diff {(got.draws[key] - logits).abs().max()}"


def test_qwen3_fused_norm_and_rope_match_cpu_backend(tiny_qwen3, monkeypatch, cuda_ops):
    """qwen3's per-head q/k norm runs as the fused norm + rope kernel; the logits stay the cpu
    backend's bits."""
    prompt = [random.Random(3).randrange(49152) for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)]
    cpu = Engine(tiny_qwen3, EngineConfig(**SMALL, drafting=False, **ACROSS))
    want = Recorder(cpu)
    expected = run(cpu, [prompt], params)[0].output_ids
    fused = spy(monkeypatch, cuda_ops, ("rms_norm_rope",))
    gpu = cuda_engine(tiny_qwen3, drafting=False, **ACROSS)
    got = Recorder(gpu)
    assert run(gpu, [prompt], params)[0].output_ids == expected
    assert fused["rms_norm_rope"] > 0
    assert want.draws.keys() == got.draws.keys()
    for key, logits in want.draws.items():
        assert torch.equal(got.draws[key], logits), f"draw {key}"


def test_a_bfloat16_cache_under_float32_activations_matches_cpu_backend(tiny_llama):
    """--dtype float32 --kv-dtype bfloat16: both backends allocate a bfloat16 cache, round K/V to
    it before their grid (the cuda op set's write_kv is the reference) and attend over it in the
    activations' dtype; every draw's logits row stays the cpu backend's bits."""
    rng = random.Random(4)
    prompts = [[rng.randrange(49152) for _ in range(19)], [rng.randrange(49152) for _ in range(6)]]
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=3, ignore_eos=True)]
    config = dict(dtype="float32", kv_dtype="bfloat16", drafting=False, max_tokens_per_step=16, **ACROSS)
    cpu = Engine(tiny_llama, EngineConfig(**SMALL, **config))
    want = Recorder(cpu)
    expected = [r.output_ids for r in run(cpu, prompts, params)]
    gpu = cuda_engine(tiny_llama, **config)
    assert gpu.backend.cache.dtype == cpu.backend.cache.dtype == torch.bfloat16 and gpu.backend.model.dtype == torch.float32
    got = Recorder(gpu)
    assert [r.output_ids for r in run(gpu, prompts, params)] == expected
    assert len(want.draws) == 6 and want.draws.keys() == got.draws.keys()
    for key, logits in want.draws.items():
        assert torch.equal(got.draws[key], logits), f"draw {key}: max diff {(got.draws[key] - logits).abs().max()}"


# ---- invariance within the cuda backend ----

def test_a_grammar_on_the_cuda_op_set_alone_batched_and_drafted(small_vocab_llama):
    """Structured output on the cuda op set: the bitmask reaches the Triton sampler, and the
    constrained replies match the regex and equal their solo, serial runs."""
    import re

    from tensorfold.grammar.compiler import GrammarCompiler
    from tensorfold.grammar.constraint import GrammarConstraint
    from tensorfold.grammar.spec import GrammarSpec

    regex = "[a-z]{2,6}( [a-z]{2,6}){1,4}\\."
    solo = cuda_engine(small_vocab_llama, drafting=False, max_num_seqs=1)
    compiled, _ = GrammarCompiler(solo.tokenizer, solo.info.vocab_size).compile(GrammarSpec("regex", regex, "t"))
    grammar = lambda: GrammarConstraint(compiled, solo.tokenizer.eos_token_ids)  # noqa: E731
    loop = [11, 12, 13, 14] * 6
    prompts = [loop, loop[:10] + [40, 41], loop[3:]]
    params = [SamplingParams(temperature=0.0, max_tokens=40), SamplingParams(temperature=0.9, seed=4, max_tokens=40),
              SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=40)]
    expected = [run(solo, [p], [sp], [grammar()])[0] for p, sp in zip(prompts, params)]
    for req in expected:
        text = solo.tokenizer.decode([t for t in req.output_ids if t not in solo.tokenizer.eos_token_ids])
        assert re.fullmatch(regex, text) or req.finish_reason == "length", text
    batched = cuda_engine(small_vocab_llama, drafting=True, max_num_seqs=3)
    reqs = run(batched, prompts, params, [grammar() for _ in prompts])
    assert [r.output_ids for r in reqs] == [r.output_ids for r in expected]


def test_replies_equal_solo_serial_vs_batched_chunked_drafted(small_vocab_llama):
    # Solo, serial, whole prompts; this engine also runs the startup probes on the cuda op set.
    solo = cuda_engine(small_vocab_llama, drafting=False, max_num_seqs=1, probe=True)
    assert solo.exact, solo.probe_failures
    batched = cuda_engine(small_vocab_llama, drafting=True, draft_budget=False, max_num_seqs=4, max_tokens_per_step=16)
    check_solo_vs_batched(solo, batched, Recorder, torch.equal)
