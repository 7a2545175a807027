"""MTP drafting on --backend mlx (tensorfold/mlx/mtp.py: the MTP layer on MLX arrays and its runner,
backends/mtp_rows.py's asks shared with the torch backends), each family on its tiny checkpoint
with an MTP layer trained by tools/train_mtp.py (it memorises the model's greedy continuations of
its prompts, so acceptance is measurable there). On qwen3_5:
- the MTP layer's logits (and the hidden states it reads) are the cpu backend's, bitwise, on a
  quantized (q8_0) checkpoint;
- drafted == serial bitwise (token_sha), greedy and sampled, solo and four at once, with the first
  drafts accepted on the memorised continuations;
- after a prefix hit the MTP K/V is what a fresh run writes and the reply the fresh one's; a pool
  that preempts replies as serial does; a paused stretch's one-pass catch-up writes what catching
  up every round writes;
- --drafter auto / mtp / ngram load (or not) the layer as on the torch backends, and the engine's
  info reports its weights and cache as theirs.
On qwen3_5_moe, qwen3_next (Flash Next), GLM-5's next-n layer and Nemotron 3's MTP layers: the q8_0 logits are the cpu
backend's; drafted == serial with the first drafts accepted, solo, concurrent, from a cached
prefix and preempted.
"""
import json
import os

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from engine_cases import check_preemption, run  # noqa: E402
from mtp_cases import (BASE, ScriptedBudget, check_drafted_equals_serial, greedy, one_thread, sampled,  # noqa: E402,F401
                       trained_checkpoints)
from tensorfold.api.replies import token_sha  # noqa: E402
from tensorfold.engine.engine import Engine, EngineConfig  # noqa: E402
from tensorfold.mlx.model import mlx_batch  # noqa: E402
from tensorfold.models.checkpoint import CheckpointError  # noqa: E402
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows  # noqa: E402

MLX = dict(backend="mlx", **BASE)
NEW = 24  # new tokens per reply: inside the memorised 40-token continuations


@pytest.fixture(scope="module")
def checkpoints(one_thread, tmp_path_factory, smollm2_tokenizer):
    """(the tiny qwen3_5 without MTP, the same with a trained MTP layer, its training prompts)."""
    return trained_checkpoints(tmp_path_factory, smollm2_tokenizer, "qwen3_5")


def mlx_engine(path: str, **config) -> Engine:
    return Engine(path, EngineConfig(**{**MLX, **config}))


def test_the_mtp_layers_logits_are_the_cpu_backends(checkpoints):
    _, path, prompts = checkpoints
    check_logits_are_the_cpu_backends(path, prompts)


def check_logits_are_the_cpu_backends(path: str, prompts: list, hidden_bitwise: bool = True) -> None:
    """q8_0 on both backends (every GEMM matrix the exact quantized one): over a 32-token sequence
    the final hidden states the MTP layer reads, and its logits, bit for bit. hidden_bitwise
    False: the model's float32 matrices (GLM-5's routers and indexer heads) are MLX's dense
    matmul, so its hidden states may move in their last bits (close, then); the logits, the
    head's activations quantized to q8_0 blocks, are still the cpu backend's."""
    seq = prompts[0] + prompts[1] + prompts[2] + prompts[3]
    n = len(seq) - 1
    cpu = Engine(path, EngineConfig(drafter="mtp", quantize="q8_0", **BASE))
    ours = mlx_engine(path, drafter="mtp", quantize="q8_0")
    assert "q8_0" in ours.info.weights and ours.info.weights == cpu.info.weights

    def rows(ids):
        pos = torch.arange(len(ids))
        return ForwardBatch(torch.tensor(ids), pos, pos, [SequenceRows(0, len(ids), torch.tensor([0, 1, 2]))],
                            torch.arange(len(ids)))
    model, cache = cpu.backend.model, cpu.backend.cache
    _, want_hidden = model.forward(rows(seq), cache, hidden=True)
    want, _ = model.mtp.forward(want_hidden[:n], rows(seq[1:]), cpu.runner.mtp.caches)

    bs = ours.runner.block_size
    mmodel, caches = ours.backend.model, ours.runner.caches
    _, hidden = mmodel.forward(mlx_batch([(0, seq, [0, 1, 2], ())], [len(seq) - 1], bs), caches, hidden=True)
    got, _ = mmodel.mtp.forward(hidden[:n], mlx_batch([(0, seq[1:], [0, 1, 2], ())], list(range(n)), bs),
                                ours.runner.mtp.caches)
    if hidden_bitwise:
        assert np.array_equal(np.array(hidden), want_hidden.numpy())
    else:
        torch.testing.assert_close(torch.from_numpy(np.array(hidden)), want_hidden)
    assert np.array_equal(np.array(got), want.numpy())


def test_drafted_equals_serial_solo_and_batched(checkpoints):
    """Greedy and sampled, one at a time and four at once, every draft verified (draft_budget off):
    the serial token_sha; the greedy replies' first drafts mostly accepted (measured: 12 of 12 and
    11 of 11 solo and batched, the torch backends' counts), the sampled ones ran drafts too."""
    _, path, prompts = checkpoints
    check_drafted_equals_serial(path, prompts[:4], [greedy(NEW), greedy(NEW), sampled(1, NEW), sampled(2, NEW)],
                                backend="mlx")


def written_rows(engine, req) -> list[np.ndarray]:
    """The MTP layer's K and V at the positions the drafter counts as written."""
    bs = engine.pool.block_size
    slots = mx.array([req.block_ids[p // bs] * bs + p % bs for p in range(engine.mtp_drafter.num_written(req))])
    return [np.array(part[slots]) for cache in engine.runner.mtp.caches for part in (cache.k, cache.v)]


def mtp_rows_after(engine, prompt, params, num_steps: int):
    req = engine.requests[engine.add_request(prompt, params)]
    for _ in range(num_steps):
        engine.step()
    return written_rows(engine, req), req


def test_a_prefix_hit_keeps_the_mtp_cache_a_fresh_run_writes_and_preemption_replies_as_serial(checkpoints):
    """The MTP K/V at every written position after a prefix hit (the hit's last block recomputed)
    is bitwise a fresh run's, and so is the reply; requests drafting in a pool too small for all
    of them are preempted and replay with the serial replies."""
    _, path, prompts = checkpoints
    serial = mlx_engine(path, drafting=False)
    prompt = prompts[5] + serial.generate(prompts[5], greedy(44)).token_ids  # 52 tokens
    fresh_rows, fresh = mtp_rows_after(mlx_engine(path, drafter="mtp", draft_budget=False), prompt, greedy(NEW), 6)
    engine = mlx_engine(path, drafter="mtp", draft_budget=False)
    run(engine, [prompt[:32] + [7, 8, 9]], [greedy(4)])  # blocks 0-1 to the prefix cache
    cached_rows, cached = mtp_rows_after(engine, prompt, greedy(NEW), 6)
    assert cached.stats.cached_tokens == 16  # two blocks matched, the last one recomputed
    assert cached.num_computed_tokens == fresh.num_computed_tokens > 32
    assert all(np.array_equal(a, b) for a, b in zip(cached_rows, fresh_rows))
    while engine.has_work():
        engine.step()
    assert cached.output_ids == serial.generate(prompt, greedy(NEW)).token_ids

    check_drafted_preemption(serial, path, prompts[:3], [greedy(NEW), sampled(5, NEW), greedy(NEW)], context=64)


def check_drafted_preemption(serial, path: str, prompts: list, params: list, context: int) -> None:
    """The requests drafting with the MTP layer on a pool of one window's blocks (`context`): the
    preempted ones replay with `serial`'s replies, and drafts were accepted."""
    tight = mlx_engine(path, drafter="mtp", draft_budget=False, kv_cache_gib=1e-6, context=context,
                       max_num_seqs=len(prompts))
    got = check_preemption(tight, prompts, params, [r.output_ids for r in run(serial, prompts, params)])
    assert sum(r.stats.accepted for r in got) > 0


def test_a_paused_stretch_catches_up_to_what_row_by_row_writes(checkpoints):
    """Twelve rounds without drafts leave the MTP cache twelve rows behind; the resume pass writes
    them at once, bitwise what an engine catching up every round wrote."""
    _, path, prompts = checkpoints
    paused = mlx_engine(path, drafter="mtp")
    paused.budget = paused.mtp_drafter.budget = ScriptedBudget(paused.max_draft, lambda n: 0 if n < 12 else 3, False)
    req = paused.requests[paused.add_request(prompts[1], greedy(NEW))]
    lags = []
    while req.stats.drafted == 0 and paused.has_work():
        paused.step()
        lags.append(paused.mtp_drafter.lag(req))
    assert max(lags) >= 12 and paused.mtp_drafter.lag(req) <= 4
    for _ in range(2):
        paused.step()
    fresh = mlx_engine(path, drafter="mtp", draft_budget=False)
    always = fresh.requests[fresh.add_request(prompts[1], greedy(NEW))]
    while fresh.mtp_drafter.num_written(always) < paused.mtp_drafter.num_written(req) and fresh.has_work():
        fresh.step()
    ours, theirs = written_rows(paused, req), written_rows(fresh, always)
    assert len(ours[0]) > 20
    assert all(np.array_equal(a, b[:len(a)]) for a, b in zip(ours, theirs))


def test_the_drafter_choice_and_what_the_backend_reports(checkpoints):
    """auto drafts with the MTP layer where its weights are, ngram where not; ngram does not load
    it; --drafter mtp without it is an error; the engine's info counts its GEMMs and its cache
    layer as the cpu backend's does."""
    base, trained, _ = checkpoints
    auto = mlx_engine(trained)
    assert auto.drafter_name == "mtp" and auto.runner.mtp is not None
    cpu = Engine(trained, EngineConfig(**BASE))
    assert auto.info.weights == cpu.info.weights and auto.info.cache.startswith(cpu.info.cache.split(";")[0])
    assert "2 x PagedKV" in auto.info.cache  # the model's full-attention layer and the MTP layer's
    plain = mlx_engine(trained, drafter="ngram")
    assert plain.backend.model.mtp is None and plain.runner.mtp is None and "1 x PagedKV" in plain.info.cache
    assert sum(plain.info.weights.values()) < sum(auto.info.weights.values())
    assert mlx_engine(base).drafter_name == "ngram"
    with pytest.raises(CheckpointError, match="--drafter mtp needs a multi-token-prediction layer"):
        mlx_engine(base, drafter="mtp")


# ---- Qwen3.5/3.6-MoE's and Qwen3-Next's MTP layer (gated attention, the MoE), GLM-5's next-n layer (latent
# attention, its own DSA indexer, MoE) and Nemotron 3's MTP layers (attention, then MoE) ----

@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next", "glm_moe_dsa", "nemotron_h"])
def nextn(request, one_thread, tmp_path_factory, smollm2_tokenizer):
    """(the tiny checkpoint, at sizes whose rows --quantize q8_0 takes (GLM's and Nemotron's GGUF
    tests'), with a trained MTP layer; its training prompts)."""
    from tools.glm_gguf import GLM_GGUF_SIZES
    from tools.tiny_checkpoint import NEMOTRON_H_GGUF_SIZES, make_tiny_checkpoint
    from tools.train_mtp import train
    arch = request.param
    sizes = {"glm_moe_dsa": GLM_GGUF_SIZES, "nemotron_h": NEMOTRON_H_GGUF_SIZES}.get(arch, {})
    base = make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, seed=0, tokenizer=smollm2_tokenizer,
                                family=True, **sizes)
    trained = str(tmp_path_factory.mktemp(arch + "_mtp"))
    train(base, trained, log=lambda *_: None, num_seqs=8)
    with open(os.path.join(trained, "mtp_prompts.json")) as f:
        return trained, json.load(f)


def test_the_next_n_layers_logits_are_the_cpu_backends(nextn):
    """Nemotron 3's: hidden states and logits bitwise; Qwen3.5-MoE's, Qwen3-Next's and GLM-5's:
    the logits (measured: the hidden states of the first and last differ in last bits, in 31 and
    23 of 32 rows: their routers' (and GLM's indexer heads') dense float32 GEMMs are MLX's matmul)."""
    path, prompts = nextn
    check_logits_are_the_cpu_backends(path, prompts, hidden_bitwise="nemotron" in path)


def test_next_n_drafted_equals_serial_solo_and_concurrent(nextn):
    """Greedy and sampled, one at a time and three at once (measured: every first draft accepted
    on the memorised continuations, 5-9 of 5-9, as on the torch backends)."""
    path, prompts = nextn
    check_drafted_equals_serial(path, prompts[:3], [greedy(16), greedy(16), sampled(1, 16)], backend="mlx")


def test_next_n_cached_prefix_and_preemption_equal_serial(nextn):
    """With MTP drafts: a prompt extending a finished request's text resumes from the prefix cache
    (its MTP K/V included) with the serial reply; three requests on a pool of one window's blocks
    are preempted and replay with the serial replies."""
    path, prompts = nextn
    serial = mlx_engine(path, drafting=False)
    first = serial.generate(prompts[0], greedy(32)).token_ids
    # two full blocks of the first request's text (the hit's last block is recomputed with MTP)
    extended = prompts[0] + first[:24] + prompts[1]
    engine = mlx_engine(path, drafter="mtp", draft_budget=False)
    run(engine, [prompts[0]], [greedy(32)])
    cached = run(engine, [extended], [sampled(3, 8)])[0]
    assert cached.stats.cached_tokens >= 16 and cached.stats.drafted > 0
    assert cached.output_ids == serial.generate(extended, sampled(3, 8)).token_ids
    check_drafted_preemption(serial, path, prompts[:3], [greedy(16), sampled(4, 16), greedy(16)], context=48)
