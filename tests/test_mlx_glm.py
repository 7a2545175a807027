"""GLM-5 (glm_moe_dsa) on the mlx backend (tensorfold/mlx/glm.py).

- The exact steps against kernels/latent_attention.py, bitwise, in both of the backend's forms
  (the float64 carrier of MLX's CPU device and the int64 form Metal runs): latent attention over
  a paged latent cache with block tables out of order (prefill, chunk and decode rows, with and
  without a DSA selection), the indexer's choice on keys built to tie, the indexer's layer_norm.
- The sigmoid-routed MoE with shared experts against models/moe.MoE (dense and q8_0), a row alone
  == the row in a batch.
- The tiny checkpoint (test_glm_moe_dsa's: q_lora, an indexer choosing fewer keys than the prompts,
  a shared-choice layer, a dense first layer, grouped noaux_tc routing, a shared expert): greedy 32
  tokens == transformers' with the startup probes passing; llama.cpp's q8_0 glm-dsa GGUF and
  --quantize q8_0 give the cpu backend's logits every draw and its token_sha, greedy and
  sampled; chunked prefill == token by token (logits and the latent cache); solo == batched and
  chunked; a cached prefix == fresh.
"""
import random

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from latent_cases import GLM5, ODD, TINY, make_case  # noqa: E402
from tensorfold.kernels import latent_attention as kernels  # noqa: E402
from tensorfold.kernels.reference import layer_norm as ref_layer_norm  # noqa: E402
from tensorfold.mlx import glm, grid, ops  # noqa: E402
from tensorfold.mlx.model import _WeightOps  # noqa: E402
from tensorfold.models.moe import MoE, MoESpec, SigmoidRouting  # noqa: E402
from tensorfold.models.quantize import quantize  # noqa: E402
from tensorfold.models.weights import WeightReader  # noqa: E402
from test_mlx_hybrids import check_cached_prefix_and_preemption, same_bits, spread  # noqa: E402
from test_mlx_moe import _oracle, check_block_is_the_reference  # noqa: E402


@pytest.fixture(params=[True, False], ids=["float64_carrier", "int64"])
def carrier(request, monkeypatch):
    monkeypatch.setattr(grid, "float64_carrier", lambda: request.param)
    return request.param


RUNS = [(0, 23), (17, 6), (40, 1), (9, 1)]  # prefill, a chunk, decode rows


def _flat(pages: torch.Tensor) -> mx.array:
    return ops.from_torch(pages.reshape(-1, pages.shape[-1]).float())


def _key_slots(batch, seq, block_size):
    last = int(batch.positions[seq.start:seq.end].max())
    return ops.key_slots(seq.block_table.numpy().astype(np.int64), last, block_size)


@pytest.mark.parametrize("shape", [TINY, ODD], ids=["tiny", "odd"])
@pytest.mark.parametrize("top_k", [None, 5, 64], ids=["dense", "select5", "select_all"])
def test_latent_attention_and_selection_are_the_references(shape, top_k, carrier):
    cache, batch, query, index_q, weights = make_case(shape, RUNS, seed=shape.heads + (top_k or 0))
    scale = (shape.dim) ** -0.5
    selection = None if top_k is None else kernels.dsa_select(index_q, weights, cache, batch, 0.25, top_k)
    kv, index_keys = _flat(cache.kv), _flat(cache.index_keys)
    for seq in batch.sequences:
        rows = slice(seq.start, seq.end)
        positions = batch.positions[rows].numpy()
        slots = _key_slots(batch, seq, shape.block_size)
        if top_k is not None:  # the indexer's choice, bitwise the reference's positions
            scores = glm.indexer_scores(ops.from_torch(index_q[rows]), ops.from_torch(weights[rows]),
                                        index_keys[slots], 0.25)
            length = int(positions.max()) + 1
            want_scores = kernels.indexer_scores(index_q[rows], weights[rows],
                                                 kernels.gather(cache.index_keys, seq.block_table, length), 0.25)
            assert same_bits(scores[:, :length], want_scores)
            if selection is not None:
                got = glm.top_positions(np.array(scores), positions, top_k)
                assert np.array_equal(got, selection[rows].numpy())
        sel = None if selection is None else selection[rows].numpy()
        seen = glm._seen(positions, slots.shape[0], sel)
        got = glm.latent_attention(ops.from_torch(query[rows]), kv[slots], seen, scale, shape.latent)
        want = kernels.attention_by_sequence(query, cache, batch, scale, selection)[rows]
        assert same_bits(got, want), f"sequence at rows {rows}"


@pytest.mark.parametrize("shape", [TINY, GLM5], ids=["tiny", "glm5"])
def test_past_one_split_of_keys_is_the_references(shape, carrier):
    """Rows that see more than SPLIT_SIZE keys (the weighted sum in chunks, added as integers), at
    GLM-5's widths too (576-wide keys, 16 heads), dense and selecting 300."""
    cache, batch, query, index_q, weights = make_case(shape, [(530, 2), (0, 1)], seed=9, ties=False)
    scale = shape.dim ** -0.5
    kv = _flat(cache.kv)
    for selection in (None, kernels.dsa_select(index_q, weights, cache, batch, 0.1, 300)):
        want = kernels.attention_by_sequence(query, cache, batch, scale, selection)
        for seq in batch.sequences:
            rows = slice(seq.start, seq.end)
            positions = batch.positions[rows].numpy()
            slots = _key_slots(batch, seq, shape.block_size)
            seen = glm._seen(positions, slots.shape[0], None if selection is None else selection[rows].numpy())
            got = glm.latent_attention(ops.from_torch(query[rows]), kv[slots], seen, scale, shape.latent)
            assert same_bits(got, want[rows])


def test_selection_ties_go_to_the_lower_position():
    scores = np.array([[1.0, 2.0, 2.0, 0.0, 2.0, 1.0]], dtype=np.float32)
    assert glm.top_positions(scores, np.array([5]), 3).tolist() == [[1, 2, 4]]
    assert glm.top_positions(scores, np.array([5]), 2).tolist() == [[1, 2]]
    assert glm.top_positions(scores[:, :3], np.array([2]), 4).tolist() == [[0, 1, 2, -1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_is_the_references(dtype, carrier):
    x = torch.cat([spread(40, 20, seed=3), torch.zeros(1, 20), torch.full((1, 20), 3.0)]).to(dtype)
    w, b = torch.randn(20).to(dtype), torch.randn(20).to(dtype)
    got = glm.layer_norm(ops.from_torch(x), ops.from_torch(w), ops.from_torch(b), 1e-6)
    assert same_bits(got.astype(mx.float32), ref_layer_norm(x, w, b, 1e-6).float())


def _moe_tensors(spec: MoESpec, hidden: int, fmt: str, gen: torch.Generator) -> dict:
    tensors = {"mlp.gate.weight": torch.randn(spec.num_experts, hidden, generator=gen) * 4.0 / hidden ** 0.5,
               "mlp.gate.e_score_correction_bias": torch.randn(spec.num_experts, generator=gen) * 0.1}
    shapes = {}
    for e in range(spec.num_experts):
        shapes.update({f"experts.{e}.gate_proj.weight": (spec.intermediate_size, hidden),
                       f"experts.{e}.up_proj.weight": (spec.intermediate_size, hidden),
                       f"experts.{e}.down_proj.weight": (hidden, spec.intermediate_size)})
    shapes.update({"shared_experts.gate_proj.weight": (spec.shared_intermediate_size, hidden),
                   "shared_experts.up_proj.weight": (spec.shared_intermediate_size, hidden),
                   "shared_experts.down_proj.weight": (hidden, spec.shared_intermediate_size)})
    for name, shape in shapes.items():
        w = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
        tensors["mlp." + name] = w if fmt == "dense" else quantize(w, fmt)
    return tensors


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "dense"), (torch.bfloat16, "dense"), (torch.float32, "q8_0")],
                         ids=["f32", "bf16", "q8_0"])
def test_moe_block_is_the_references(dtype, fmt):
    gen = torch.Generator().manual_seed(5)
    hidden = 64
    spec = MoESpec(8, 2, 32, 64, True, SigmoidRouting(4, 2, 2.5), shared_gated=False, shared_prefix="shared_experts.")
    tensors = _moe_tensors(spec, hidden, fmt, gen)
    reference = MoE(spec, WeightReader(tensors, dtype, torch.device("cpu"), _oracle()), None)
    block = glm.GLMMoE(spec, WeightReader(tensors, dtype, torch.device("cpu"), _WeightOps))
    check_block_is_the_reference(block, reference.forward, hidden, dtype, gen)


# ---- the tiny checkpoint on --backend mlx ---------------------------------------------------------

from engine_cases import run  # noqa: E402
from family_cases import check_greedy_32_tokens, hf_model  # noqa: E402
from test_glm_moe_dsa import _separated_checkpoint  # noqa: E402
from test_mlx_backend import Recorder, check_quantized_cpu_equals_mlx, prefill_in_chunks  # noqa: E402
from tensorfold.engine.engine import Engine, EngineConfig  # noqa: E402
from tensorfold.sampling.params import SamplingParams  # noqa: E402
from tools.glm_gguf import GLM_GGUF_SIZES, write_glm_gguf  # noqa: E402
from tools.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

SMALL = dict(kv_cache_gib=0.01, context=512)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory, smollm2_tokenizer):
    return _separated_checkpoint(str(tmp_path_factory.mktemp("mlx_glm")), smollm2_tokenizer)


@pytest.fixture(scope="module")
def glm_q8(tmp_path_factory, smollm2_tokenizer):
    """The GGUF sizes (rows multiples of 32): (the directory, its q8_0 glm-dsa GGUF)."""
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_glm_gguf")), "glm_moe_dsa",
                                tokenizer=smollm2_tokenizer, **GLM_GGUF_SIZES)
    return path, write_glm_gguf(path, "q8_0")


def test_greedy_32_tokens_equal_transformers(glm_dir):
    check_greedy_32_tokens(glm_dir, hf_model(glm_dir, torch.float32, experts_implementation="eager"), "mlx", **SMALL)


def test_q8_0_gguf_gives_the_cpu_backends_logits_and_token_sha(glm_q8):
    """llama.cpp's glm-dsa q8_0 file served as stored on both backends (the indexer selecting: 37
    tokens > index_topk): every draw's logits row bitwise equal, greedy and sampled; the latent
    cache gets as many blocks from --kv-cache-gib on both."""
    cpu, mlx = check_quantized_cpu_equals_mlx(glm_q8[1], first_prompt=37, quantize=None, **SMALL)
    assert (cpu.info.cache, cpu.pool.num_blocks) == (mlx.info.cache, mlx.pool.num_blocks)
    assert "3 x LatentKV" in cpu.info.cache


def test_chunked_prefill_is_bitwise_token_by_token(glm_dir):
    """A 40-token prompt (past index_topk: the indexer selects) prefilled whole, in chunks of 16
    and 3, and token by token, beside another sequence's decode rows: the same last logits and
    the same latent cache (compressed KV, rope key, indexer key) at every position."""
    engine = Engine(glm_dir, EngineConfig(backend="mlx", probe=False, **SMALL))
    runner = engine.runner
    rng = random.Random(3)
    ids, other = [rng.randrange(49152) for _ in range(40)], [rng.randrange(49152) for _ in range(60)]
    tables = [[7, 2, 9], [4, 5, 6]]
    bs = runner.block_size
    slots = [tables[0][p // bs] * bs + p % bs for p in range(len(ids))]
    results = []
    for chunk in (40, 16, 3, 1):
        logits = prefill_in_chunks(engine, ids, other, tables, chunk)
        caches = [np.array(a[mx.array(slots)]) for c in runner.caches for a in c.arrays]
        results.append((logits, caches))
    assert len(results[0][1]) == 5  # three layers' kv, two indexers' keys (layer 1 reuses layer 0's choice)
    for logits, caches in results[1:]:
        assert np.array_equal(logits, results[0][0])
        assert all(np.array_equal(a, b) for a, b in zip(caches, results[0][1]))


def test_replies_equal_solo_serial_vs_batched_chunked(glm_dir):
    """Four requests (prompts past index_topk and under it, greedy and sampled) one at a time and
    together in chunked rounds of 16 tokens: the same replies, every draw's logits row bitwise."""
    rng = random.Random(5)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (37, 5, 20, 13)]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=10, ignore_eos=True)
              for i, t in enumerate((0.0, 0.8, 1.0, 0.0))]
    config = dict(backend="mlx", drafting=False, **SMALL)
    solo = Engine(glm_dir, EngineConfig(max_num_seqs=1, **config))
    assert solo.exact, solo.probe_failures
    want = Recorder(solo)
    expected = [run(solo, [p], [sp])[0].output_ids for p, sp in zip(prompts, params)]
    batched = Engine(glm_dir, EngineConfig(max_num_seqs=4, max_tokens_per_step=16, probe=False, **config))
    got = Recorder(batched)
    assert [r.output_ids for r in run(batched, prompts, params)] == expected
    assert max(got.round_sizes) > 1, "the requests never shared a round"
    assert want.draws.keys() == got.draws.keys()
    for key, logits in want.draws.items():
        assert np.array_equal(got.draws[key], logits), f"draw {key}"


def test_cached_prefix_and_preemption_equal_fresh_runs(glm_dir):
    """test_mlx_hybrids' check on GLM-5 (prompts past index_topk): a cached prefix resumes from the
    latent cache's blocks, preempted requests replay (latent cache and indexer keys written again)."""
    check_cached_prefix_and_preemption(glm_dir)


def test_the_cache_is_latent(glm_dir):
    engine = Engine(glm_dir, EngineConfig(backend="mlx", probe=False, drafting=False, **SMALL))
    assert "3 x LatentKV" in engine.info.cache
    assert [type(c).__name__ for c in engine.runner.caches] == ["LatentCache"] * 3


def test_quantized_at_load_gives_the_cpu_backends_logits_and_token_sha(glm_q8):
    """--quantize q8_0 of the directory (kv_b split per head as llama.cpp splits it) on both backends."""
    check_quantized_cpu_equals_mlx(glm_q8[0], first_prompt=37, **SMALL)
