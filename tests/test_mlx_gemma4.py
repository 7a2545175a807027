"""Gemma 4's dense text model (gemma4, gemma4_text) on the mlx backend (tensorfold/mlx/gemma4.py).

- The new ops against kernels/reference.py, bitwise: gelu_tanh_and_mul (float32 and bfloat16),
  tanh32 over both of its ranges and the signs of zero, softcap.
- The tiny checkpoints tests/test_gemma4.py uses (gemma4: window 16 shorter than the prompts,
  global layers with their own head size, one KV head, proportional rope and values that are
  their keys, the last two layers reading earlier layers' K/V with a double-wide MLP, per-layer
  inputs, soft-capped logits; gemma4_text: v_proj everywhere, no sharing, no per-layer inputs):
  greedy 32 tokens == transformers' with the startup probes passing; the q8_0 GGUF
  (llama.cpp's gemma4) and --quantize q8_0 give the cpu backend's logits every draw and its
  token_sha, greedy and sampled; chunked prefill == token by token (logits and every K/V
  array); solo == batched, chunked and drafted; a cached prefix == fresh.
- The sliding layers live behind a block table of their own: a long prompt holds a lane's worth
  of sliding blocks (the engine frees the rest) and draws what the model draws over one table
  that keeps every block.
- The KV-shared layers hold their source's cache (no bytes of their own).
- gemma4_moe (26B-A4B's layout: 8 experts of 32, 2 per token, beside every layer's MLP) is in the
  greedy and --quantize q8_0 checks above, and its q8_0 GGUF gives the cpu backend's logits and
  token_sha; a missing router tensor is a startup error naming it.
"""
import random

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from engine_cases import check_solo_vs_batched  # noqa: E402
from family_cases import check_greedy_32_tokens, hf_model  # noqa: E402
from test_mlx_backend import Recorder, check_quantized_cpu_equals_mlx  # noqa: E402
from test_mlx_hybrids import check_cached_prefix_and_preemption  # noqa: E402
from tensorfold.engine.block_pool import lane_blocks  # noqa: E402
from tensorfold.engine.engine import Engine, EngineConfig  # noqa: E402
from tensorfold.engine.step_plan import ScheduledRequest, StepPlan  # noqa: E402
from tensorfold.kernels import reference as ref  # noqa: E402
from tensorfold.mlx import gemma4, ops  # noqa: E402
from tensorfold.mlx.model import MLXBatch, SequenceSpan  # noqa: E402
from tensorfold.models.cache import SharedKV  # noqa: E402
from tensorfold.models.checkpoint import CheckpointError  # noqa: E402
from tensorfold.sampling.params import SamplingParams  # noqa: E402
from tools.gemma4_gguf import write_gemma4_gguf  # noqa: E402
from tools.tiny_checkpoint import make_tiny_checkpoint, well_separated_seed  # noqa: E402

SMALL = dict(kv_cache_gib=0.01, context=512)
EAGER = dict(experts_implementation="eager")


def _same_bits(got: mx.array, want: torch.Tensor) -> bool:
    got = np.array(got.astype(mx.float32)) if got.dtype == mx.bfloat16 else np.array(got)
    want = want.float().numpy() if want.dtype == torch.bfloat16 else want.numpy()
    return got.dtype == want.dtype and got.shape == want.shape and np.array_equal(
        got.view(np.uint32), want.view(np.uint32))


def _values(seed: int) -> torch.Tensor:
    """Values over many magnitudes and both signs, with the edges: zeros of both signs, the
    polynomial's boundary, saturating arguments, tiny and subnormal ones."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.randn(20_000, generator=gen) * torch.exp2(torch.randint(-30, 6, (20_000,), generator=gen).float())
    edges = torch.tensor([0.0, -0.0, 0.625, -0.625, 0.62499994, -0.62500006, 9.0, -9.0, 44.0, -44.0, 100.0, -100.0,
                          1e-30, -1e-30, 1e-40, -1e-40, 3.0, -3.0, 1.0, -1.0])
    return torch.cat([spread, torch.linspace(-12, 12, 10_001), edges])


# ---- the new ops, bitwise kernels/reference.py -------------------------------------------------

def test_tanh32_is_the_references():
    x = _values(1)
    assert _same_bits(gemma4.tanh32(ops.from_torch(x)), ref.tanh32(x))


@pytest.mark.parametrize("cap", [30.0, 15.0])
def test_softcap_is_the_references(cap):
    logits = _values(2)[:30_000].reshape(300, 100) * 4.0  # past the cap too
    assert _same_bits(gemma4.softcap(ops.from_torch(logits), cap), ref.softcap(logits, cap))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_is_the_references(dtype):
    gate = _values(3).to(dtype)
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    mdt = ops.DTYPES[dtype]
    got = gemma4.gelu_tanh_and_mul(ops.from_torch(gate, mdt), ops.from_torch(up, mdt))
    assert got.dtype == mdt and _same_bits(got, ref.gelu_tanh_and_mul(gate, up))


# ---- the tiny checkpoints on --backend mlx -----------------------------------------------------

@pytest.fixture(scope="module", params=["gemma4", "gemma4_text", "gemma4_moe"])
def gemma(request, tmp_path_factory, smollm2_tokenizer):
    seed = well_separated_seed(request.param, smollm2_tokenizer)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_" + request.param)), request.param, seed=seed,
                                tokenizer=smollm2_tokenizer)


@pytest.fixture(scope="module")
def full_gemma(tmp_path_factory, smollm2_tokenizer):
    """gemma4, every option on."""
    seed = well_separated_seed("gemma4", smollm2_tokenizer)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_gemma4_full")), "gemma4", seed=seed,
                                tokenizer=smollm2_tokenizer)


def test_greedy_32_tokens_equal_transformers(gemma):
    check_greedy_32_tokens(gemma, hf_model(gemma, torch.float32, **EAGER), "mlx", **SMALL)


def test_the_shared_layers_read_their_sources_cache(full_gemma):
    engine = Engine(full_gemma, EngineConfig(backend="mlx", probe=False, drafting=False, **SMALL))
    caches, model = engine.runner.caches, engine.runner.model
    assert [layer.mixer.spec.kv_source for layer in model.layers[-2:]] == [3, 2]
    assert caches[4] is caches[3] and caches[5] is caches[2]
    assert len({id(c) for c in caches}) == 4
    assert "2 x SharedKV" in engine.info.cache and "4 x PagedKV" in engine.info.cache
    assert {layer.mixer.spec.window for layer in model.layers} == {16, None}
    assert model.windows == [None, 16] and model.group_of == [1, 1, 0, 1, 1, 0]  # shared: the source's group
    assert "window 16: 4 layers" in engine.info.cache


@pytest.fixture(scope="module")
def gguf_gemma(full_gemma):
    return write_gemma4_gguf(full_gemma, "q8_0")


def test_q8_0_gguf_gives_the_cpu_backends_logits_and_token_sha(gguf_gemma):
    """llama.cpp's q8_0 gemma4 file served as stored on both backends: every draw's logits row
    bitwise equal (batched, chunked, greedy and sampled: prompts past the window), so the same
    token_sha."""
    check_quantized_cpu_equals_mlx(gguf_gemma, first_prompt=37, quantize=None, **SMALL)


def test_quantized_at_load_gives_the_cpu_backends_logits_and_token_sha(gemma):
    check_quantized_cpu_equals_mlx(gemma, first_prompt=37, **SMALL)


def _forward(engine: Engine, pieces, tables, sliding_tables) -> np.ndarray:
    """One forward of the engine's MLX model; pieces: (seq, token ids, start) with the full and
    the sliding group's block tables of each seq. Returns each piece's last logits row."""
    runner = engine.runner
    plan = StepPlan([ScheduledRequest(f"s{s}", ids, start, tables[s], [None], group_block_ids=[sliding_tables[s]])
                     for s, ids, start in pieces])
    return np.array(runner.model.forward(runner._batch(plan), runner.caches))


def test_chunked_prefill_is_bitwise_token_by_token(full_gemma):
    """A 70-token prompt (past the window of 16) prefilled whole, in chunks of 16 and 7, and token
    by token (beside another sequence's decode rows): the same last logits and the same K/V
    in every slot the prompt wrote, full and sliding (each behind its own block table)."""
    engine = Engine(full_gemma, EngineConfig(backend="mlx", probe=False, **SMALL))
    runner = engine.runner
    rng = random.Random(3)
    ids, other = [rng.randrange(49152) for _ in range(70)], [rng.randrange(49152) for _ in range(80)]
    tables, sliding = [[7, 2, 9, 11, 12], [4, 5, 6, 13, 14]], [[1, 3, 8, 10, 15], [0, 16, 17, 18, 19]]
    bs = runner.block_size
    slots = [mx.array(np.array([t[0][p // bs] * bs + p % bs for p in range(len(ids))])) for t in (tables, sliding)]
    results = []
    for chunk in (70, 16, 7, 1):
        _forward(engine, [(1, other[:3], 0)], tables, sliding)
        start, other_at, logits = 0, 3, None
        while start < len(ids):
            piece = ids[start:start + chunk]
            logits = _forward(engine, [(1, other[other_at:other_at + 1], other_at), (0, piece, start)], tables,
                              sliding)[-1]
            start, other_at = start + len(piece), other_at + 1
        kv = [np.array(a[slots[g]]) for c, g in zip(runner.caches, runner.model.group_of) for a in c.arrays]
        results.append((logits, kv))
    for logits, kv in results[1:]:
        assert np.array_equal(logits, results[0][0])
        assert all(np.array_equal(a, b) for a, b in zip(kv, results[0][1]))


def _one_table_greedy(engine: Engine, ids: list[int], steps: int) -> list[int]:
    """Greedy tokens of the engine's MLX model over caches of its own where every layer keeps
    every block (one table for all groups): a whole-prompt prefill, then token by token."""
    model, bs = engine.runner.model, engine.runner.block_size
    blocks, dtype = -(-(len(ids) + steps) // bs), ops.DTYPES[engine.backend.kv_dtype]
    caches = []
    for spec in model.cache_specs():
        caches.append(caches[spec.source] if isinstance(spec, SharedKV)
                      else ops.LayerCache(blocks * bs, spec.num_kv_heads, spec.head_dim, dtype))
    table, tokens = np.arange(blocks), list(ids)
    for _ in range(steps):
        start = 0 if len(tokens) == len(ids) else len(tokens) - 1
        pos = np.arange(start, len(tokens))
        batch = MLXBatch(mx.array(np.asarray(tokens[start:], dtype=np.int32)), pos, mx.array(pos),
                         [SequenceSpan(0, len(pos), pos, ops.key_slots(table, int(pos[-1]), bs))],
                         mx.array([len(pos) - 1]), np.full(1, -1), np.full(len(pos), -1))
        batch.groups = [batch] * (len(model.windows) - 1)
        tokens.append(int(np.array(model.forward(batch, caches))[-1].argmax()))
    return tokens[len(ids):]


def test_a_long_prompt_holds_a_window_of_sliding_blocks_and_draws_what_one_table_draws(full_gemma):
    engine = Engine(full_gemma, EngineConfig(backend="mlx", probe=False, drafting=False, context=1024,
                                             max_tokens_per_step=64, kv_cache_gib=0.05))
    assert engine.book.windows == [None, 16]
    bs, length = engine.runner.block_size, 300
    ids = [100 + (7 * i) % 900 for i in range(length)]
    req_id = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    req, held = engine.requests[req_id], []
    while req.finish_reason is None:
        engine.step()
        held.append(engine.book.num_held(req))
    full, sliding = held[-2]  # the last round still running
    assert full == -(-(length + 10) // bs) and sliding <= lane_blocks(16, bs, 64) and sliding < full
    assert all(pool.num_free == pool.num_blocks for pool in engine.pools)
    assert req.output_ids == _one_table_greedy(engine, ids, 12)


def test_the_sliding_groups_sizing_counts_this_backends_bytes(full_gemma):
    """With a budget past every floor, the mlx caches (K and V with an exponent each, the sliding
    layers behind their own tables) fit --kv-cache-gib: the groups are sized on this backend's
    bytes per block, not the torch layout's."""
    budget = 0.05
    engine = Engine(full_gemma, EngineConfig(backend="mlx", probe=False, drafting=False, context=256,
                                             max_num_seqs=2, max_tokens_per_step=32, kv_cache_gib=budget))
    assert engine.book.windows == [None, 16]
    assert budget * 2**30 * 0.98 < engine.info.cache_bytes <= budget * 2**30


@pytest.fixture(scope="module")
def small_vocab_gemma(tmp_path_factory, small_vocab_llama):
    """gemma4 over small_vocab_llama's 512-token tokenizer, with its head tied to the embedding
    and each block's output scaled down: a token's own logit leads, so greedy replies repeat
    their last token and prompt-lookup drafts get accepted."""
    import os

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_small_gemma4")), "gemma4",
                                tokenizer=AutoTokenizer.from_pretrained(small_vocab_llama), max_position_embeddings=256)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight", "per_layer_projection.weight")):
            tensors[name] = tensors[name] * 0.2
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_replies_equal_solo_serial_vs_batched_chunked_drafted(small_vocab_gemma):
    config = dict(backend="mlx", kv_cache_gib=0.01, context=256)
    solo = Engine(small_vocab_gemma, EngineConfig(drafting=False, max_num_seqs=1, **config))
    assert solo.exact, solo.probe_failures
    batched = Engine(small_vocab_gemma, EngineConfig(drafting=True, draft_budget=False, max_num_seqs=4,
                                                     max_tokens_per_step=16, probe=False, **config))
    check_solo_vs_batched(solo, batched, Recorder, np.array_equal)


def test_cached_prefix_and_preemption_equal_fresh_runs(full_gemma):
    """test_mlx_hybrids' check on Gemma 4 (a 70-token prefix, past the sliding window): a cached
    prefix resumes from the window's blocks, preempted requests replay (their sliding and shared
    layers' caches written again)."""
    check_cached_prefix_and_preemption(full_gemma)


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory, smollm2_tokenizer):
    seed = well_separated_seed("gemma4_moe", smollm2_tokenizer)
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_gemma4_moe_gguf")), "gemma4_moe", seed=seed,
                                tokenizer=smollm2_tokenizer)
    return write_gemma4_gguf(path, "q8_0")


def test_moe_q8_0_gguf_gives_the_cpu_backends_logits_and_token_sha(moe_gguf):
    """llama.cpp's gemma4 file with the experts stacked (ffn_gate_up_exps, ffn_down_exps, the
    router's scales): every draw's logits row bitwise the cpu backend's (its native MoE block)."""
    check_quantized_cpu_equals_mlx(moe_gguf, first_prompt=37, quantize=None, **SMALL)


def test_a_missing_expert_is_a_startup_error_naming_it(tmp_path, smollm2_tokenizer):
    from safetensors.torch import load_file, save_file
    path = make_tiny_checkpoint(str(tmp_path / "gemma4_moe"), "gemma4_moe", tokenizer=smollm2_tokenizer)
    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    name = next(n for n in tensors if n.endswith("layers.1.router.per_expert_scale"))
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="layers.1.router.per_expert_scale"):
        Engine(path, EngineConfig(backend="mlx", **SMALL))
