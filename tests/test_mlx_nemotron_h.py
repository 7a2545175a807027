"""Nemotron-H (nemotron_h) on the mlx backend (tensorfold/mlx/mamba2.py, mlx/nemotron_h.py, the
single-block layers and rope-less attention in mlx/model.py).

- Mamba2's ops against kernels/mamba2.py, bitwise: the conv with its bias, dt's softplus and clamp
  and the decay, one step of the scan, a whole layer's mixing over a batch of sequences with its
  states per block, the gated group norm (float32 and bfloat16).
- The routing against kernels/moe.route_sigmoid on logits built to tie (groups and experts), and
  the MoE block (latent projections, correction bias, shared expert; dense and q8_0) against
  models/nemotron_h.NemotronMoE, bitwise (dense GEMMs MLX's matmul on both sides), a row alone
  == the row in a batch.
- The tiny checkpoints (MoE: M*EM-E with every option; dense: M*M-M): greedy 32 tokens ==
  transformers' with the startup probes passing; the q8_0 GGUF (llama.cpp's nemotron_h and
  nemotron_h_moe) and --quantize q8_0 give the cpu backend's logits every draw and its token_sha,
  greedy and sampled; chunked prefill == token by token (logits and Mamba2 states); solo ==
  batched, chunked and drafted; a cached prefix == fresh, preempted == uninterrupted.
"""
import os
import random

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from tensorfold.kernels import mamba2 as ref  # noqa: E402
from tensorfold.kernels.delta_net import decay_rate  # noqa: E402
from tensorfold.kernels.moe import route_sigmoid  # noqa: E402
from tensorfold.kernels.reference import relu_squared  # noqa: E402
from tensorfold.mlx import mamba2, nemotron_h, ops  # noqa: E402
from tensorfold.mlx.delta_net import LayerState  # noqa: E402
from tensorfold.mlx.model import _WeightOps  # noqa: E402
from tensorfold.models.cache import Mamba2State  # noqa: E402
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows  # noqa: E402
from tensorfold.models.mamba2 import Mamba2Params  # noqa: E402
from tensorfold.models.nemotron_h import NemotronMoE, NemotronMoESpec  # noqa: E402
from tensorfold.models.quantize import quantize  # noqa: E402
from tensorfold.models.weights import WeightReader  # noqa: E402
from test_mlx_hybrids import _Batch, check_cached_prefix_and_preemption, mxa, same_bits, spread  # noqa: E402
from test_mlx_moe import _oracle, check_block_is_the_reference  # noqa: E402

H, P, G, N, TAPS = 4, 8, 2, 16, 4  # heads, head_dim, groups, state_size, conv taps
CONV_DIM = H * P + 2 * G * N


def _params(gen: torch.Generator, dt_limit=(0.0, float("inf"))) -> Mamba2Params:
    return Mamba2Params(H, P, G, N, torch.randn(CONV_DIM, TAPS, generator=gen) * 0.5,
                        torch.randn(CONV_DIM, generator=gen) * 0.1,
                        decay_rate(torch.randn(H, dtype=torch.float64)).float(), torch.randn(H, generator=gen),
                        torch.randn(H, generator=gen), *dt_limit)


def _mx_params(p: Mamba2Params) -> Mamba2Params:
    return Mamba2Params(p.num_heads, p.head_dim, p.n_groups, p.state_size, mxa(p.conv_weight), mxa(p.conv_bias),
                        mxa(p.rate), mxa(p.dt_bias), mxa(p.d), p.dt_min, p.dt_max)


# ---- Mamba2's ops, bitwise kernels/mamba2.py ----------------------------------------------------

@pytest.mark.parametrize("rows,bias", [(1, True), (9, True), (33, False)])
def test_conv_silu_is_the_reference(rows, bias):
    x, window, weight = spread(rows, 40, seed=rows), spread(TAPS - 1, 40, seed=5), spread(40, TAPS, seed=6, high=2)
    b = spread(40, seed=7, high=2) if bias else None
    got = mamba2.conv_silu(mxa(x), mxa(window), mxa(weight), None if b is None else mxa(b))
    assert same_bits(got, ref.conv_silu(x, window, weight, b))


@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.01, 0.5)])
def test_time_steps_are_the_references(dt_limit):
    gen = torch.Generator().manual_seed(3)
    params = _params(gen, dt_limit)
    dt = torch.cat([spread(300, H, seed=8, low=-6, high=5), torch.tensor([[20.0, 25.0, -100.0, 0.0]])])
    got_step, got_decay = mamba2.time_steps(mxa(dt), _mx_params(params))
    want_step, want_decay = ref.time_steps(dt, params)
    assert same_bits(got_step, want_step) and same_bits(got_decay, want_decay)


@pytest.mark.parametrize("a", [1, 3])
def test_ssm_step_is_the_references(a):
    state = spread(a, H, N, P, seed=a, low=-10, high=4)
    state[0, 0, :, 0] = 0.0  # a zero column
    x_dt, b, c = spread(a, H, P, seed=11, low=-4, high=2), spread(a, H, N, seed=12), spread(a, H, N, seed=13)
    decay = torch.rand(a, H)
    new_state, out = mamba2.ssm_step(mxa(state), mxa(x_dt), mxa(b), mxa(c), mxa(decay))
    want_state = state.clone()
    want_out = ref.ssm_step(want_state, x_dt, b, c, decay)
    assert same_bits(new_state, want_state) and same_bits(out, want_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_group_norm_is_the_references(dtype):
    y, z = spread(20, H * P, seed=8), spread(20, H * P, seed=9, low=-4, high=4).to(dtype)
    y[3] = 0.0
    w = torch.randn(H * P).to(dtype)
    got = mamba2.gated_group_norm(mxa(y), mxa(z), mxa(w), G, 1e-5)
    assert same_bits(got.astype(mx.float32), ref.gated_group_norm(y, z, w, G, 1e-5, dtype).float())


def test_a_layers_mixing_over_a_batch_is_the_references():
    """Three sequences (a prefill from a zero state, a chunk resumed from a block's state, one
    decode row), block size 4: the outputs, and every window and state written, bitwise the
    torch op's."""
    bs = 4
    gen = torch.Generator().manual_seed(20)
    params = _params(gen)
    spec = Mamba2State(CONV_DIM, TAPS, H, N, P)
    state = spec.allocate(12, bs, torch.float32, "cpu")
    for block in (5, 9):
        state.conv[block] = torch.randn(TAPS - 1, CONV_DIM, generator=gen)
        state.ssm[block] = torch.randn(H, N, P, generator=gen)
    tables = [[0, 1, 2], [5, 6, 7], [8, 9, 10]]
    pieces = [(0, 0, 10), (1, 4, 7), (2, 7, 1)]  # (seq, first position, rows)
    positions, sequences = [], []
    for s, first, n in pieces:
        sequences.append(SequenceRows(len(positions), len(positions) + n, torch.tensor(tables[s])))
        positions += range(first, first + n)
    batch = ForwardBatch(torch.zeros(len(positions), dtype=torch.int64), torch.tensor(positions),
                         torch.zeros(len(positions), dtype=torch.int64), sequences, torch.tensor([0]))
    state_in, state_out = batch.state_slots(bs)
    xbc, dt = torch.randn(len(positions), CONV_DIM, generator=gen), torch.randn(len(positions), H, generator=gen)
    mstate = LayerState(spec, 12)
    mstate.conv, mstate.ssm = mxa(state.conv), mxa(state.ssm)
    spans = _Batch([(s.start, s.end) for s in sequences], state_in.numpy(), state_out.numpy())
    got = mamba2.mamba2(mxa(xbc), mxa(dt), mstate, spans, _mx_params(params))
    want = ref.mamba2(xbc, dt, state, batch, params)
    assert same_bits(got, want)
    assert same_bits(mstate.conv, state.conv) and same_bits(mstate.ssm, state.ssm)
    assert int((state_out >= 0).sum()) >= 5  # block ends and last rows were written


# ---- the routing and the MoE block, bitwise models/nemotron_h.py ----------------------------------

@pytest.mark.parametrize("experts,top_k,n_group,topk_group,normalize", [
    (8, 2, 1, 1, True), (16, 3, 4, 2, True), (8, 2, 2, 1, True), (12, 4, 3, 2, False), (6, 6, 1, 1, True)])
def test_route_sigmoid_equals_reference(experts, top_k, n_group, topk_group, normalize):
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    logits = torch.randn(40, experts, generator=gen) * 2.0
    logits[1:6] = torch.randint(-2, 3, (5, experts), generator=gen).float()  # ties within and across groups
    logits[6] = 0.0
    logits[6, ::2] = -0.0
    logits[7, ::3] = float("-inf")
    logits[8] = 1.25
    bias = torch.randn(experts, generator=gen) * 0.1
    bias[::3] = 0.0
    spec = NemotronMoESpec(experts, top_k, 32, 32, n_group, topk_group, normalize, 2.5)
    want_experts, want_weights = route_sigmoid(logits, bias, top_k, n_group, topk_group, normalize, 2.5)
    got_experts, got_weights = nemotron_h.route_sigmoid(mxa(logits), mxa(bias), spec)
    assert np.array_equal(got_experts, want_experts.numpy()), "the chosen experts differ"
    assert same_bits(got_weights, want_weights), "the weights differ"


def test_relu_squared_is_the_references():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.cat([spread(500, seed=4), torch.tensor([0.0, -0.0, 1e-30, -3.0])]).to(dtype)
        assert same_bits(nemotron_h.relu_squared(ops.from_torch(x, ops.DTYPES[dtype])).astype(mx.float32),
                         relu_squared(x).float())


def _moe_tensors(spec: NemotronMoESpec, hidden: int, fmt: str, gen: torch.Generator) -> dict:
    width = spec.latent_size or hidden
    matrices = [(f"experts.{e}.up_proj.weight", (spec.intermediate_size, width)) for e in range(spec.num_experts)]
    matrices += [(f"experts.{e}.down_proj.weight", (width, spec.intermediate_size)) for e in range(spec.num_experts)]
    matrices += [("shared_experts.up_proj.weight", (spec.shared_intermediate_size, hidden)),
                 ("shared_experts.down_proj.weight", (hidden, spec.shared_intermediate_size))]
    if spec.latent_size:
        matrices += [("fc1_latent_proj.weight", (width, hidden)), ("fc2_latent_proj.weight", (hidden, width))]
    tensors = {"mlp.gate.weight": torch.randn(spec.num_experts, hidden, generator=gen) * 4.0 / hidden ** 0.5,
               "mlp.gate.e_score_correction_bias": torch.randn(spec.num_experts, generator=gen) * 0.1}
    for name, shape in matrices:
        w = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
        tensors["mlp." + name] = w if fmt == "dense" else quantize(w, fmt)
    return tensors


@pytest.mark.parametrize("latent", [32, None], ids=["latent", "no_latent"])
@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "dense"), (torch.bfloat16, "dense"), (torch.float32, "q8_0")],
                         ids=["f32", "bf16", "q8_0"])
def test_moe_block_is_the_references(dtype, fmt, latent):
    gen = torch.Generator().manual_seed(11 + bool(latent))
    hidden = 64
    spec = NemotronMoESpec(8, 2, 32, 64, n_group=2, topk_group=1, routed_scaling_factor=2.5, latent_size=latent)
    tensors = _moe_tensors(spec, hidden, fmt, gen)
    reference = NemotronMoE(spec, WeightReader(tensors, dtype, torch.device("cpu"), _oracle()), None)
    block = nemotron_h.NemotronMoE(spec, WeightReader(tensors, dtype, torch.device("cpu"), _WeightOps))
    check_block_is_the_reference(block, reference.forward, hidden, dtype, gen)


# ---- the tiny checkpoints on --backend mlx ---------------------------------------------------------

from engine_cases import check_solo_vs_batched  # noqa: E402
from family_cases import check_greedy_32_tokens, hf_model  # noqa: E402
from test_mlx_backend import Recorder, check_quantized_cpu_equals_mlx, prefill_in_chunks  # noqa: E402
from tensorfold.engine.engine import Engine, EngineConfig  # noqa: E402
from tools.tiny_checkpoint import (NEMOTRON_H_GGUF_SIZES, make_tiny_checkpoint, well_separated_seed,  # noqa: E402
                                   write_tiny_gguf)

SMALL = dict(kv_cache_gib=0.01, context=512)
EAGER = dict(experts_implementation="eager")
DENSE = dict(NEMOTRON_H_GGUF_SIZES, hybrid_override_pattern="M*M-M")  # llama.cpp's nemotron_h (no MoE)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory, smollm2_tokenizer):
    """Every layer kind and option (M*EM-E, latent projections, groups, a correction bias)."""
    seed = well_separated_seed("nemotron_h", smollm2_tokenizer)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_nemotron_h")), "nemotron_h", seed=seed,
                                tokenizer=smollm2_tokenizer)


@pytest.fixture(scope="module", params=["nemotron_h", "nemotron_h_moe"])
def quantizable(request, tmp_path_factory, smollm2_tokenizer):
    """The GGUF sizes (rows multiples of 32), dense (M*M-M) or MoE (M*EM*E): (directory, its q8_0 GGUF)."""
    sizes = DENSE if request.param == "nemotron_h" else NEMOTRON_H_GGUF_SIZES
    seed = well_separated_seed("nemotron_h", smollm2_tokenizer, **sizes)
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_" + request.param)), "nemotron_h", seed=seed,
                                tokenizer=smollm2_tokenizer, **sizes)
    return path, write_tiny_gguf(path, "q8_0")


@pytest.fixture(scope="module")
def small_vocab_nemotron(tmp_path_factory, small_vocab_llama):
    """nemotron_h over small_vocab_llama's 512-token tokenizer, small weights, with its head the
    embedding table and each block's output projection scaled by 0.2: a token's own logit leads,
    so greedy replies repeat their last token and prompt-lookup drafts get accepted."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_small_nemotron_h")), "nemotron_h",
                                tokenizer=AutoTokenizer.from_pretrained(small_vocab_llama), initializer_range=0.02,
                                max_position_embeddings=256)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["backbone.embeddings.weight"].clone()
    for name in tensors:
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * 0.2
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_greedy_32_tokens_equal_transformers(nemotron):
    check_greedy_32_tokens(nemotron, hf_model(nemotron, torch.float32, **EAGER), "mlx", **SMALL)


def test_dense_and_moe_greedy_32_tokens_equal_transformers(quantizable):
    path, _ = quantizable
    check_greedy_32_tokens(path, hf_model(path, torch.float32, **EAGER), "mlx", **SMALL)


def test_q8_0_gguf_gives_the_cpu_backends_logits_and_token_sha(quantizable):
    """llama.cpp's q8_0 file served as stored on both backends: every draw's logits row bitwise
    equal (batched, chunked, greedy and sampled), so the same token_sha."""
    check_quantized_cpu_equals_mlx(quantizable[1], first_prompt=37, quantize=None, **SMALL)


def test_quantized_at_load_gives_the_cpu_backends_logits_and_token_sha(quantizable):
    check_quantized_cpu_equals_mlx(quantizable[0], first_prompt=37, **SMALL)


def test_chunked_prefill_is_bitwise_token_by_token(nemotron):
    """A 70-token prompt prefilled whole, in chunks of 16 and 7, and token by token (beside
    another sequence's decode rows): the same last logits and the same Mamba2 states (conv window
    and SSM state) in its last block."""
    engine = Engine(nemotron, EngineConfig(backend="mlx", probe=False, **SMALL))
    runner = engine.runner
    rng = random.Random(3)
    ids, other = [rng.randrange(49152) for _ in range(70)], [rng.randrange(49152) for _ in range(80)]
    tables = [[7, 2, 9], [4, 5, 6]]
    bs = runner.block_size
    results = []
    for chunk in (70, 16, 7, 1):
        logits = prefill_in_chunks(engine, ids, other, tables, chunk)
        last = tables[0][(len(ids) - 1) // bs]
        states = [np.array(a[last]) for c in runner.caches if isinstance(c, LayerState) for a in c.arrays]
        results.append((logits, states))
    assert len(results[0][1]) == 4  # two Mamba2 layers, conv and ssm each
    for logits, states in results[1:]:
        assert np.array_equal(logits, results[0][0])
        assert all(np.array_equal(a, b) for a, b in zip(states, results[0][1]))


def test_replies_equal_solo_serial_vs_batched_chunked_drafted(small_vocab_nemotron):
    """engine_cases' mixed batch: batched, chunked and drafted (rejected drafts rewind the Mamba2
    state to a block boundary) == one at a time, every draw's logits bitwise."""
    config = dict(backend="mlx", kv_cache_gib=0.01, context=256)
    solo = Engine(small_vocab_nemotron, EngineConfig(drafting=False, max_num_seqs=1, **config))
    assert solo.exact, solo.probe_failures
    batched = Engine(small_vocab_nemotron, EngineConfig(drafting=True, draft_budget=False, max_num_seqs=4,
                                                        max_tokens_per_step=16, probe=False, **config))
    check_solo_vs_batched(solo, batched, Recorder, np.array_equal)


def test_cached_prefix_and_preemption_equal_fresh_runs(nemotron):
    """test_mlx_hybrids' check on Nemotron-H: a cached prefix resumes from a block's Mamba2 state,
    preempted requests replay it."""
    check_cached_prefix_and_preemption(nemotron)


def test_the_engine_counts_the_mamba2_states(nemotron):
    """The cache line and the resume rule see the Mamba2 states; feed-forward layers keep none."""
    engine = Engine(nemotron, EngineConfig(backend="mlx", probe=False, drafting=False, **SMALL))
    assert "2 x Mamba2State" in engine.info.cache and "1 x PagedKV" in engine.info.cache
    assert engine.book.resume_at_blocks
    assert [type(c).__name__ for c in engine.runner.caches] == ["LayerState", "LayerCache", "NoneType",
                                                                "LayerState", "NoneType", "NoneType"]
