"""MTP drafting from GLM-5's next-n layer (glm_moe_dsa: model.layers.{L}.{enorm, hnorm, eh_proj,
<a latent-attention + DSA indexer + MoE layer>, shared_head.norm}, its cache the latent cache) and
Nemotron 3's MTP layers (nemotron_h: mtp.layers.{0, 1}, attention then MoE, enorm / hnorm /
eh_proj on the first, final_layernorm on the last), each on its tiny checkpoint with the layer
trained by tools/train_mtp.py (it memorises the model's greedy continuations of its prompts, so
acceptance is measurable there):
- the served layer's logits equal its transformers training form's (the names, the order of
  [enorm(embed), hnorm(h)], the layers' sequence and norms are what the checkpoint means);
- drafted == serial bitwise (token_sha), greedy and sampled, solo and three at once, with the
  first drafts accepted above a measured floor;
- the MTP cache a paused stretch's one-pass catch-up writes (the layer's chunked prefill) is
  bitwise what catching up every round (row by row) writes;
- a missing next-n tensor is a startup error naming it; --drafter auto without next-n weights
  drafts with ngram, --drafter mtp there is an error.
"""
import json
import os

import pytest

torch = pytest.importorskip("torch")

from test_mtp_drafting import ScriptedBudget  # noqa: E402
from tensorfold.api.replies import token_sha  # noqa: E402
from tensorfold.backends import cpu_ops  # noqa: E402
from tensorfold.engine.engine import Engine, EngineConfig  # noqa: E402
from tensorfold.models.cache import LayerLatent  # noqa: E402
from tensorfold.models.checkpoint import CheckpointError  # noqa: E402
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows  # noqa: E402
from tensorfold.models.hf_dir import load_hf_dir  # noqa: E402
from tensorfold.models.loader import build_model  # noqa: E402
from tensorfold.sampling.params import SamplingParams  # noqa: E402
from tools.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402
from tools.train_mtp import text_model, train, trained_layer  # noqa: E402

BASE = dict(context=1024, kv_cache_gib=0.05, block_size=16)
NEW_TOKENS = 40  # tools/train_mtp.py's continuation length: the memorised stretch
# A tensor of each family's MTP layer, by its checkpoint name
MTP_TENSOR = {"glm_moe_dsa": "model.layers.3.eh_proj.weight",
              "nemotron_h": "mtp.layers.1.mixer.gate.weight"}


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["glm_moe_dsa", "nemotron_h"])
def family(request, one_thread, tmp_path_factory, smollm2_tokenizer):
    """(arch, the tiny checkpoint without next-n weights, the same with a trained next-n layer,
    its training prompts)."""
    arch = request.param
    base = make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, seed=0, tokenizer=smollm2_tokenizer,
                                family=True)
    trained = str(tmp_path_factory.mktemp(arch + "_mtp"))
    train(base, trained, num_seqs=8, log=lambda *_: None)
    with open(os.path.join(trained, "mtp_prompts.json")) as f:
        prompts = json.load(f)
    return arch, base, trained, prompts


def run(engine, prompts, params):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    reqs = [engine.requests[i] for i in ids]
    while engine.has_work():
        engine.step()
    return reqs


def greedy(n=NEW_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def sampled(seed, n=NEW_TOKENS):
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=n, ignore_eos=True)


def test_the_served_layer_equals_its_training_form(family):
    """The served MTP layer's logits, fed the served model's hidden states, against the
    transformers-built layer tools/train_mtp.py trained, over one of its sequences."""
    _, _, path, prompts = family
    engine = Engine(path, EngineConfig(drafter="mtp", **BASE))
    model, cache = engine.backend.model, engine.backend.cache
    seq = prompts[0] + engine.generate(prompts[0], greedy(24)).token_ids
    hf, layer = trained_layer(path)
    n = len(seq) - 1
    with torch.no_grad():
        base = text_model(hf)
        ids = torch.tensor([seq])
        hidden = base(input_ids=ids).last_hidden_state
        context = layer.form.context(base, hidden[:, :n], n)
        expected = hf.get_output_embeddings()(layer(hf.get_input_embeddings()(ids)[:, 1:], hidden[:, :n], context))[0]

    def rows(ids):
        pos = torch.arange(len(ids))
        return ForwardBatch(torch.tensor(ids), pos, pos, [SequenceRows(0, len(ids), torch.tensor([0, 1, 2]))],
                            torch.arange(len(ids)))
    _, ours_hidden = model.forward(rows(seq), cache, hidden=True)
    torch.testing.assert_close(ours_hidden, hidden[0], atol=1e-3, rtol=0)
    got, _ = model.mtp.forward(ours_hidden[:n], rows(seq[1:]), engine.runner.mtp.caches)
    torch.testing.assert_close(got, expected, atol=5e-3, rtol=0)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_drafted_equals_serial_solo_and_concurrent(family):
    """Greedy and sampled, one at a time and three at once, every draft verified (draft_budget
    off): the serial replies bitwise, and the greedy first drafts accepted."""
    _, _, path, prompts = family
    prompts = prompts[:3]
    params = [greedy(), greedy(), sampled(1)]
    expected = [token_sha(r.output_ids) for r in run(Engine(path, EngineConfig(drafting=False, **BASE)),
                                                      prompts, params)]
    drafted = Engine(path, EngineConfig(drafter="mtp", draft_budget=False, **BASE))
    assert drafted.drafter_name == "mtp"
    solo = [run(drafted, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [token_sha(r.output_ids) for r in solo] == expected
    concurrent = run(drafted, prompts, params)
    assert [token_sha(r.output_ids) for r in concurrent] == expected
    for reqs in (solo, concurrent):
        for r in reqs[:2]:
            drafted_first, accepted_first = r.stats.drafted_by_position[0], r.stats.accepted_by_position[0]
            # Measured: every first draft accepted on the memorised continuations (11-17 of
            # 11-17); the second position 4-6, the third 0-1 (chained drafts read the layer's
            # own hidden state).
            assert accepted_first >= 0.5 * drafted_first > 0, r.stats
        assert reqs[2].stats.drafted > 0  # the sampled one ran drafts too


def mtp_rows(engine, req):
    """The MTP layer's cache rows at the positions the drafter counts as written (the latent
    cache: the compressed KV with its roped key, and the indexer's key; paged K/V: K and V)."""
    bs = engine.pool.block_size
    slots = [req.block_ids[p // bs] * bs + p % bs for p in range(engine.mtp_drafter.num_written(req))]
    parts = []
    for part in engine.runner.mtp.caches:
        if part is None:
            continue
        tensors = (part.kv, part.index_keys) if isinstance(part, LayerLatent) else (part.k, part.v)
        parts += [t.flatten(0, 1)[slots].clone() for t in tensors if t is not None]
    return parts


def test_a_one_pass_catch_up_writes_what_row_by_row_does(family):
    """Twelve rounds without drafts leave the MTP cache twelve rows behind; the resume pass writes
    them at once (the layer's chunked prefill), bitwise what an engine catching up every round
    wrote."""
    _, _, path, prompts = family
    paused = Engine(path, EngineConfig(drafter="mtp", **BASE))
    paused.budget = paused.mtp_drafter.budget = ScriptedBudget(paused.max_draft, lambda n: 0 if n < 12 else 3,
                                                               probes=False)
    req = paused.requests[paused.add_request(prompts[1], greedy())]
    lags = []
    while req.stats.drafted == 0 and paused.has_work():
        paused.step()
        lags.append(paused.mtp_drafter.lag(req))
    assert max(lags) >= 12 and paused.mtp_drafter.lag(req) <= 4
    for _ in range(3):
        paused.step()
    fresh = Engine(path, EngineConfig(drafter="mtp", draft_budget=False, **BASE))
    always = fresh.requests[fresh.add_request(prompts[1], greedy())]
    while fresh.mtp_drafter.num_written(always) < paused.mtp_drafter.num_written(req) and fresh.has_work():
        fresh.step()
    ours, theirs = mtp_rows(paused, req), mtp_rows(fresh, always)
    assert always.status.value == "running" and len(ours[0]) > 20
    assert all(torch.equal(a, b[:len(a)]) for a, b in zip(ours, theirs))


def test_a_missing_next_n_tensor_is_a_startup_error_naming_it(family):
    arch, _, path, _ = family
    ckpt = load_hf_dir(path)
    del ckpt.tensors[MTP_TENSOR[arch]]
    with pytest.raises(CheckpointError, match="eh_proj.weight" if arch == "glm_moe_dsa" else "mtp.layers.1.mlp.gate"):
        build_model(ckpt, torch.float32, cpu_ops, mtp=True)
    build_model(ckpt, torch.float32, cpu_ops)  # not asked for: skipped


def test_the_drafter_choice(family):
    """auto: mtp where the next-n weights are, ngram where not; --drafter mtp without them is an
    error; ngram does not load them."""
    _, base, trained, _ = family
    assert Engine(trained, EngineConfig(**BASE)).drafter_name == "mtp"
    assert Engine(base, EngineConfig(**BASE)).drafter_name == "ngram"
    assert Engine(trained, EngineConfig(drafter="ngram", **BASE)).backend.model.mtp is None
    with pytest.raises(CheckpointError, match="--drafter mtp needs a multi-token-prediction layer"):
        Engine(base, EngineConfig(drafter="mtp", **BASE))


def test_a_glm_gguf_with_its_next_n_block_drafts(tmp_path, one_thread, smollm2_tokenizer):
    """A glm-dsa GGUF (q8_0) written with its next-n block (blk.L.nextn.eh_proj, enorm, hnorm,
    shared_head_norm, shared_head_head, embed_tokens and the block's decoder layer;
    nextn_predict_layers 1) serves it as the MTP layer: drafted == serial, drafts accepted."""
    from tensorfold.models.gguf_file import _Reader
    from tools.glm_gguf import GLM_GGUF_SIZES, write_glm_gguf

    base = make_tiny_checkpoint(str(tmp_path / "glm"), "glm_moe_dsa", tokenizer=smollm2_tokenizer, **GLM_GGUF_SIZES)
    trained = str(tmp_path / "glm_mtp")
    train(base, trained, num_seqs=4, log=lambda *_: None)
    path = write_glm_gguf(trained, "q8_0")
    layers = json.load(open(os.path.join(base, "config.json")))["num_hidden_layers"]
    names = {t.name for t in _Reader(path).tensors}
    assert {f"blk.{layers}.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= names
    with open(os.path.join(trained, "mtp_prompts.json")) as f:
        prompts = json.load(f)[:2]
    params = [greedy(24), sampled(5, 24)]
    expected = [token_sha(r.output_ids) for r in run(Engine(path, EngineConfig(drafting=False, **BASE)),
                                                      prompts, params)]
    engine = Engine(path, EngineConfig(draft_budget=False, **BASE))
    assert engine.drafter_name == "mtp"
    reqs = run(engine, prompts, params)
    assert [token_sha(r.output_ids) for r in reqs] == expected
    assert reqs[0].stats.accepted_by_position[0] > 0
