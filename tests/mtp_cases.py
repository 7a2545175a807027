"""What the MTP drafting tests share (test_mtp_drafting.py: Qwen3.5's mtp.*; test_nextn_drafting.py:
GLM-5's next-n layer and Nemotron 3's MTP layers): a tiny checkpoint beside the same with a
trained MTP layer, the served layer against its transformers training form, and drafted ==
serial with the first drafts accepted."""
import json
import os

import pytest
import torch

from engine_cases import run
from tensorfold.api.replies import token_sha
from tensorfold.engine.draft_budget import DraftBudget
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.models.cache import LayerLatent
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
from tensorfold.sampling.params import SamplingParams
from tools.tiny_checkpoint import make_tiny_checkpoint
from tools.train_mtp import text_model, train, trained_layer

BASE = dict(context=1024, kv_cache_gib=0.05, block_size=16)
NEW_TOKENS = 40  # tools/train_mtp.py's continuation length: the memorised stretch


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trained_checkpoints(tmp_path_factory, tokenizer, arch: str, **train_args) -> tuple[str, str, list]:
    """(the tiny checkpoint without MTP weights, the same with a trained MTP layer, its training prompts)."""
    base = make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, seed=0, tokenizer=tokenizer, family=True)
    trained = str(tmp_path_factory.mktemp(arch + "_mtp"))
    train(base, trained, log=lambda *_: None, **train_args)
    with open(os.path.join(trained, "mtp_prompts.json")) as f:
        return base, trained, json.load(f)


def greedy(n=NEW_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def sampled(seed, n=NEW_TOKENS):
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=n, ignore_eos=True)


def check_served_layer_equals_training_form(path: str, prompts: list) -> None:
    """The served MTP layer's logits, fed the served model's hidden states, against the
    transformers-built layer tools/train_mtp.py trained, over one of its sequences: close, and the
    same argmax at every position."""
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


def check_drafted_equals_serial(path: str, prompts: list, params: list, **config) -> Engine:
    """The requests one at a time and all at once, every draft verified (draft_budget off): the
    serial replies bitwise; the greedy ones (the first two) had their first drafts mostly
    accepted (measured: every first draft on the memorised continuations; later positions fewer,
    chained drafts reading the layer's own hidden state), the sampled ones ran drafts too.
    `config`: the engines' other settings (a backend). Returns the drafting engine."""
    config = {**BASE, **config}
    expected = [token_sha(r.output_ids) for r in run(Engine(path, EngineConfig(drafting=False, **config)),
                                                      prompts, params)]
    drafted = Engine(path, EngineConfig(drafter="mtp", draft_budget=False, **config))
    assert drafted.drafter_name == "mtp" and drafted.max_draft == 3
    solo = [run(drafted, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [token_sha(r.output_ids) for r in solo] == expected
    together = run(drafted, prompts, params)
    assert [token_sha(r.output_ids) for r in together] == expected
    for reqs in (solo, together):
        for r in reqs[:2]:
            drafted_first, accepted_first = r.stats.drafted_by_position[0], r.stats.accepted_by_position[0]
            assert accepted_first >= 0.5 * drafted_first > 0, r.stats
        assert sum(r.stats.drafted for r in reqs[2:]) > 0
    return drafted


class ScriptedBudget(DraftBudget):
    """A draft budget whose n-th choice is script(n) (capped at what is available), probing
    whenever due: the budget only decides speed, so every script must leave the replies, and the
    MTP cache, what serial and always-drafting runs give. The scripts pause drafting for
    stretches of rounds and resume it."""

    def __init__(self, max_depth: int, script, probes: bool = True):
        super().__init__(max_depth, shared_prior=True)
        self.script, self.calls, self.probes = script, 0, probes

    def depth(self, acceptance, sequences, rows, available, *args, **kwargs):
        self.calls += 1
        return min(self.script(self.calls - 1), available)

    def worth_probing(self, *args) -> bool:
        return self.probes


def scripted(path: str, script, probes: bool = True) -> Engine:
    engine = Engine(path, EngineConfig(drafter="mtp", **BASE))
    engine.budget = engine.mtp_drafter.budget = ScriptedBudget(engine.max_draft, script, probes)
    return engine


def mtp_rows(engine, req) -> list[torch.Tensor]:
    """The MTP layers' cache rows at the positions the drafter counts as written (a latent cache:
    the compressed KV with its roped key, and the indexer's key; paged K/V: K and V)."""
    bs = engine.pool.block_size
    slots = [req.block_ids[p // bs] * bs + p % bs for p in range(engine.mtp_drafter.num_written(req))]
    parts = []
    for part in engine.runner.mtp.caches:
        if part is None:
            continue
        tensors = (part.kv, part.index_keys) if isinstance(part, LayerLatent) else (part.k, part.v)
        parts += [t.flatten(0, 1)[slots].clone() for t in tensors if t is not None]
    return parts


def check_paused_stretch_catches_up(path: str, prompt: list) -> None:
    """Twelve rounds without drafts leave the MTP cache twelve rows behind; the resume pass writes
    them at once (the layer's chunked prefill), bitwise what an engine catching up every round
    wrote."""
    paused = scripted(path, lambda n: 0 if n < 12 else 3, probes=False)
    req = paused.requests[paused.add_request(prompt, greedy())]
    lags = []
    while req.stats.drafted == 0 and paused.has_work():
        paused.step()
        lags.append(paused.mtp_drafter.lag(req))
    assert max(lags) >= 12 and paused.mtp_drafter.lag(req) <= 4  # the resume caught the stretch up
    for _ in range(3):
        paused.step()
    fresh = Engine(path, EngineConfig(drafter="mtp", draft_budget=False, **BASE))
    always = fresh.requests[fresh.add_request(prompt, greedy())]
    while fresh.mtp_drafter.num_written(always) < paused.mtp_drafter.num_written(req) and fresh.has_work():
        fresh.step()
    ours, theirs = mtp_rows(paused, req), mtp_rows(fresh, always)
    assert always.status.value == "running" and len(ours[0]) > 20
    assert all(torch.equal(a, b[:len(a)]) for a, b in zip(ours, theirs))
