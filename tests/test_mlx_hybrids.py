"""The Qwen hybrids on the mlx backend (tensorfold/mlx/delta_net.py, gated attention in mlx/model.py).

- Gated DeltaNet's ops against kernels/delta_net.py, bitwise: exp64 and log64 in MLX float64
  (edge cases, subnormals, specials), softplus and the gates, the conv, the l2 and gated norms,
  the grid dot products, one step of the rule, a whole layer's mixing over a batch of sequences
  with its states per block.
- The tiny qwen3_5 checkpoint: greedy tokens == transformers'; --quantize q8_0 gives the cpu
  backend's logits and token_sha; chunked prefill == token by token; the engine's exactness
  cases (batched == solo, drafted, a cached prefix resumed from a block's state, preemption).
"""
import random

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from tensorfold.exact import float64 as f64  # noqa: E402
from tensorfold.kernels import delta_net as ref, reference  # noqa: E402
from tensorfold.mlx import delta_net, ops  # noqa: E402
from tensorfold.models.cache import RecurrentState  # noqa: E402
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows  # noqa: E402
from tensorfold.models.linear_attention import DeltaNetParams  # noqa: E402


def mxa(t: torch.Tensor) -> mx.array:
    return ops.from_torch(t)


def same_bits(got: mx.array, want: torch.Tensor) -> bool:
    """Bitwise equal, a NaN equal to any NaN (torch's NaNs carry a sign bit MLX's do not)."""
    g, w = np.array(got), want.numpy()
    both_nan = np.isnan(g) & np.isnan(w)
    width = {8: np.int64, 4: np.int32, 2: np.int16}[w.dtype.itemsize]
    return g.dtype == w.dtype and np.array_equal(np.where(both_nan, 0, g.view(width)),
                                                 np.where(both_nan, 0, w.view(width)))


def spread(*shape, seed=0, low=-20, high=20) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(low, high, shape, generator=g).float())


# ---- float64 on the CPU stream, bitwise exact/float64.py ------------------------------------------

def test_exp64_and_log64_are_the_references_bitwise():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([-torch.rand(60000, generator=g, dtype=torch.float64) * 800,
                   torch.randn(60000, generator=g, dtype=torch.float64) * 30,
                   torch.tensor([0.0, -0.0, -745.1, -746.0, -1e-300, -708.4, -709.9, -744.4, float("-inf"), 20.0,
                                 1e-17, -1e-17, float("nan")], dtype=torch.float64)])
    assert same_bits(delta_net.exp64(mx.array(x.numpy(), dtype=mx.float64)), f64.exp64(x))
    y = torch.cat([torch.rand(60000, generator=g, dtype=torch.float64) * 1e3,
                   torch.exp2(torch.rand(60000, generator=g, dtype=torch.float64) * 2098 - 1074),  # subnormals up
                   torch.tensor([0.0, -0.0, 1.0, 4.9e-324, 2.2250738585072014e-308, 2.225073858507201e-308,
                                 float("inf"), -1.0, float("nan"), 1.7976931348623157e308, 0.7071067811865476,
                                 1.4142135623730951, 1.0 + 2.0 ** -52], dtype=torch.float64)])
    assert same_bits(delta_net.log64(mx.array(y.numpy(), dtype=mx.float64)), f64.log64(y))


def test_softplus_and_gates_are_the_references():
    z = torch.cat([spread(20000, seed=1, low=-8, high=6), torch.tensor([20.0, 20.000002, 19.999998, -100.0, 0.0, -0.0,
                                                                        88.0, -88.0, 1e-30, -1e-45])])
    assert same_bits(delta_net.softplus32(mxa(z)), ref.softplus32(z))
    a, b = spread(37, 8, seed=2, low=-6, high=4), spread(37, 8, seed=3, low=-6, high=4)
    rate, dt_bias = ref.decay_rate(torch.randn(8, dtype=torch.float64) * 2).float(), torch.randn(8)
    decay, beta = delta_net.gates(mxa(a), mxa(b), mxa(rate), mxa(dt_bias))
    want_decay, want_beta = ref.gates(a, b, rate, dt_bias)
    assert same_bits(decay, want_decay) and same_bits(beta, want_beta)


# ---- the conv, the norms, the grid dot products, the rule --------------------------------------

@pytest.mark.parametrize("rows,taps", [(1, 4), (9, 4), (33, 2)])
def test_conv_silu_is_the_reference(rows, taps):
    x, window, weight = spread(rows, 40, seed=rows), spread(taps - 1, 40, seed=5), spread(40, taps, seed=6, high=2)
    assert same_bits(delta_net.conv_silu(mxa(x), mxa(window), mxa(weight)), ref.conv_silu(x, window, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_and_gated_norms_are_the_references(dtype):
    x = spread(12, 3, 64, seed=7).to(dtype)
    x[2] = 0.0
    assert same_bits(ops.l2_norm(mxa(x), ref.NORM_EPS), reference.l2_norm(x, ref.NORM_EPS))
    core, gate = spread(20, 32, seed=8).to(dtype), spread(20, 32, seed=9, low=-4, high=4).to(dtype)
    w = torch.randn(32).to(dtype)
    got = ops.gated_rms_norm(mxa(core), mxa(gate), mxa(w), 1e-6)
    assert same_bits(got.astype(mx.float32), ref.gated_rms_norm(core, gate, w, 1e-6).float())


@pytest.mark.parametrize("shape", [(1, 2, 16, 16), (3, 4, 32, 8), (2, 1, 128, 64)])
def test_grid_dot_and_delta_step_are_the_references(shape):
    a, h, dk, dv = shape
    state = spread(*shape, seed=dk, low=-10, high=4)
    state[0, 0, :, 0] = 0.0                                       # a zero column
    q, k = reference.l2_norm(spread(a, h, dk, seed=11), 1e-6), reference.l2_norm(spread(a, h, dk, seed=12), 1e-6)
    v = spread(a, h, dv, seed=13, low=-3, high=3)
    decay, beta = torch.rand(a, h), torch.rand(a, h)
    assert same_bits(delta_net.grid_dot(mxa(state), mxa(k)), ref.grid_dot(state, k))
    new_state, out = delta_net.delta_step(mxa(state), mxa(q), mxa(k), mxa(v), mxa(decay), mxa(beta))
    want_state = state.clone()
    want_out = ref.delta_step(want_state, q, k, v, decay, beta)
    assert same_bits(new_state, want_state) and same_bits(out, want_out)


class _Seq:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _Batch:
    """What delta_net reads of an MLXBatch: the sequences' row spans and the state slots."""

    def __init__(self, spans, state_in, state_out):
        self.sequences = [_Seq(s, e) for s, e in spans]
        self.state_in, self.state_out = np.asarray(state_in), np.asarray(state_out)


def test_a_layers_mixing_over_a_batch_is_the_references():
    """Three sequences (a prefill from a zero state, a chunk resumed from a block's state, one
    decode row), block size 4: the outputs, and every state written, bitwise the torch op's."""
    kh, h, dk, dv, taps, bs = 2, 4, 16, 8, 4, 4
    g = torch.Generator().manual_seed(20)
    params = DeltaNetParams(kh, h, dk, dv, torch.randn(2 * kh * dk + h * dv, taps, generator=g) * 0.5,
                            ref.decay_rate(torch.randn(h, dtype=torch.float64)).float(), torch.randn(h, generator=g))
    spec = RecurrentState(2 * kh * dk + h * dv, taps, h, dk, dv)
    state = spec.allocate(12, bs, torch.float32, "cpu")
    state.conv[5], state.ssm[5] = torch.randn(taps - 1, spec.conv_dim, generator=g), torch.randn(h, dk, dv, generator=g)
    state.conv[9], state.ssm[9] = torch.randn(taps - 1, spec.conv_dim, generator=g), torch.randn(h, dk, dv, generator=g)
    tables = [[0, 1, 2], [5, 6, 7], [8, 9, 10]]
    pieces = [(0, 0, 10), (1, 4, 7), (2, 7, 1)]  # (seq, first position, rows)
    input_ids, positions, sequences = [], [], []
    for s, first, n in pieces:
        sequences.append(SequenceRows(len(positions), len(positions) + n, torch.tensor(tables[s])))
        positions += range(first, first + n)
    batch = ForwardBatch(torch.zeros(len(positions), dtype=torch.int64), torch.tensor(positions),
                         torch.zeros(len(positions), dtype=torch.int64), sequences, torch.tensor([0]))
    state_in, state_out = batch.state_slots(bs)
    rows = len(positions)
    qkv = torch.randn(rows, spec.conv_dim, generator=g)
    a, b = torch.randn(rows, h, generator=g), torch.randn(rows, h, generator=g)
    mstate = delta_net.LayerState(spec, 12)
    mstate.conv, mstate.ssm = mxa(state.conv), mxa(state.ssm)
    mparams = DeltaNetParams(kh, h, dk, dv, mxa(params.conv_weight), mxa(params.rate), mxa(params.dt_bias))
    spans = _Batch([(s.start, s.end) for s in sequences], state_in.numpy(), state_out.numpy())
    got = delta_net.delta_net(mxa(qkv), mxa(a), mxa(b), mstate, spans, mparams)
    want = ref.delta_net(qkv, a, b, state, batch, params)
    assert same_bits(got, want)
    assert same_bits(mstate.conv, state.conv) and same_bits(mstate.ssm, state.ssm)
    assert int((state_out >= 0).sum()) >= 5  # block ends and last rows were written


# ---- the tiny qwen3_5 checkpoint on --backend mlx -------------------------------------------------

from engine_cases import check_preemption, check_solo_vs_batched, run  # noqa: E402
from test_mlx_backend import Recorder, check_quantized_cpu_equals_mlx, prefill_in_chunks  # noqa: E402
from tensorfold.api.replies import token_sha  # noqa: E402
from tensorfold.engine.engine import Engine, EngineConfig  # noqa: E402
from tensorfold.sampling.params import SamplingParams  # noqa: E402
from tools.tiny_checkpoint import make_tiny_checkpoint, well_separated_seed  # noqa: E402

SMALL = dict(kv_cache_gib=0.01, context=512)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory, smollm2_tokenizer):
    seed = well_separated_seed("qwen3_5", smollm2_tokenizer, family=True)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_qwen3_5")), "qwen3_5", seed=seed,
                                tokenizer=smollm2_tokenizer, family=True)


@pytest.fixture(scope="module")
def small_vocab_qwen3_5(tmp_path_factory, small_vocab_llama):
    """qwen3_5 over small_vocab_llama's 512-token tokenizer, small weights: greedy replies loop."""
    from transformers import AutoTokenizer
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_small_qwen3_5")), "qwen3_5",
                                tokenizer=AutoTokenizer.from_pretrained(small_vocab_llama),
                                max_position_embeddings=256, initializer_range=0.02)


def test_greedy_32_tokens_equal_transformers(qwen3_5):
    from family_cases import check_greedy_32_tokens, hf_model
    check_greedy_32_tokens(qwen3_5, hf_model(qwen3_5, torch.float32, experts_implementation="eager"), "mlx", **SMALL)


def test_quantized_qwen3_5_gives_the_cpu_backends_logits_and_token_sha(qwen3_5):
    """--quantize q8_0 on both backends: every draw's logits row bitwise equal (batched, chunked,
    drafted, greedy and sampled; gated attention and Gated DeltaNet layers), so the same token_sha."""
    check_quantized_cpu_equals_mlx(qwen3_5, first_prompt=37, **SMALL)


def test_chunked_prefill_is_bitwise_token_by_token(qwen3_5):
    check_chunked_prefill(qwen3_5)


def check_chunked_prefill(checkpoint: str) -> None:
    """A 70-token prompt prefilled whole, in chunks of 16 and 7, and token by token (beside
    another sequence's decode rows): the same last logits and the same state in its last block."""
    engine = Engine(checkpoint, EngineConfig(backend="mlx", probe=False, **SMALL))
    runner = engine.runner
    rng = random.Random(3)
    ids, other = [rng.randrange(49152) for _ in range(70)], [rng.randrange(49152) for _ in range(80)]
    tables = [[7, 2, 9], [4, 5, 6]]
    bs = runner.block_size
    results = []
    for chunk in (70, 16, 7, 1):
        logits = prefill_in_chunks(engine, ids, other, tables, chunk)
        last = tables[0][(len(ids) - 1) // bs]
        states = [np.array(c.ssm[last]) for c in runner.caches if hasattr(c, "ssm")]
        results.append((logits, states))
    assert results[0][1], "no Gated DeltaNet state to compare"
    for logits, states in results[1:]:
        assert np.array_equal(logits, results[0][0])
        assert all(np.array_equal(a, b) for a, b in zip(states, results[0][1]))


def test_replies_equal_solo_serial_vs_batched_chunked_drafted(small_vocab_qwen3_5):
    check_solo_serial_vs_batched(small_vocab_qwen3_5)


def check_solo_serial_vs_batched(checkpoint: str) -> None:
    """engine_cases' mixed batch: batched, chunked and drafted (rejected drafts rewind the state
    to a block boundary) == one at a time, every draw's logits bitwise."""
    config = dict(backend="mlx", kv_cache_gib=0.01, context=256)
    solo = Engine(checkpoint, EngineConfig(drafting=False, max_num_seqs=1, **config))
    assert solo.exact, solo.probe_failures
    batched = Engine(checkpoint, EngineConfig(drafting=True, draft_budget=False, max_num_seqs=4, max_tokens_per_step=16,
                                              probe=False, **config))
    check_solo_vs_batched(solo, batched, Recorder, np.array_equal)


def test_cached_prefix_and_preemption_equal_fresh_runs(qwen3_5):
    check_cached_prefix_and_preemption(qwen3_5)


def check_cached_prefix_and_preemption(checkpoint: str) -> None:
    """A prompt sharing a 70-token prefix resumes from a block's state (cached tokens a multiple
    of the block) with the reply of a fresh engine; requests preempted by a pool of one window's
    blocks reply as they do alone."""
    rng = random.Random(4)
    prefix = [rng.randrange(49152) for _ in range(70)]
    prompts = [prefix + [rng.randrange(49152) for _ in range(n)] for n in (5, 9, 3, 6)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)]
    config = dict(backend="mlx", probe=False, drafting=False)
    solo = [run(Engine(checkpoint, EngineConfig(**config, **SMALL)), [p], [sp])[0].output_ids
            for p, sp in zip(prompts, params)]
    engine = Engine(checkpoint, EngineConfig(**config, **SMALL))
    first = run(engine, [prompts[0]], [params[0]])[0]
    second = run(engine, [prompts[1]], [params[1]])[0]
    assert [first.output_ids, second.output_ids] == solo[:2]
    bs = engine.config.block_size
    assert second.stats.cached_tokens > 0 and second.stats.cached_tokens % bs == 0
    check_preemption(Engine(checkpoint, EngineConfig(**config, max_num_seqs=4, kv_cache_gib=1e-6, context=128)),
                     prompts, params, solo)
