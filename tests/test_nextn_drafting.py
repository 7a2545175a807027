"""MTP drafting from GLM-5's next-n layer (glm_moe_dsa: model.layers.{L}.{enorm, hnorm, eh_proj,
<a latent-attention + DSA indexer + MoE layer>, shared_head.norm}, its cache the latent cache),
Nemotron 3's MTP layers (nemotron_h: mtp.layers.{0, 1}, attention then MoE, enorm / hnorm /
eh_proj on the first, final_layernorm on the last) and Qwen3-Next's (qwen3_next: mtp.fc, the
pre-fc norms, mtp.layers.0 a gated full-attention layer with the MoE, mtp.norm; Flash Next's
layout, as Qwen3.6's), each on its tiny checkpoint with the layer
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

import mtp_cases as mtp  # noqa: E402
from engine_cases import run  # noqa: E402
from mtp_cases import BASE, greedy, one_thread, sampled, trained_checkpoints  # noqa: E402,F401 (one_thread: a fixture)
from tensorfold.api.replies import token_sha  # noqa: E402
from tensorfold.backends import cpu_ops  # noqa: E402
from tensorfold.engine.engine import Engine, EngineConfig  # noqa: E402
from tensorfold.models.checkpoint import CheckpointError  # noqa: E402
from tensorfold.models.hf_dir import load_hf_dir  # noqa: E402
from tensorfold.models.loader import build_model  # noqa: E402
from tools.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402
from tools.train_mtp import train  # noqa: E402

# A tensor of each family's MTP layer, by its checkpoint name, and what the error says of it
MTP_TENSOR = {"glm_moe_dsa": ("model.layers.3.eh_proj.weight", "eh_proj.weight"),
              "nemotron_h": ("mtp.layers.1.mixer.gate.weight", "mtp.layers.1.mlp.gate"),
              "qwen3_next": ("mtp.layers.0.mlp.gate.weight", "mtp.layers.0.mlp.gate")}


@pytest.fixture(scope="module", params=["glm_moe_dsa", "nemotron_h", "qwen3_next"])
def family(request, one_thread, tmp_path_factory, smollm2_tokenizer):
    """(arch, the tiny checkpoint without next-n weights, the same with a trained next-n layer,
    its training prompts)."""
    arch = request.param
    base, trained, prompts = trained_checkpoints(tmp_path_factory, smollm2_tokenizer, arch, num_seqs=8)
    return arch, base, trained, prompts


def test_the_served_layer_equals_its_training_form(family):
    _, _, path, prompts = family
    mtp.check_served_layer_equals_training_form(path, prompts)


def test_drafted_equals_serial_solo_and_concurrent(family):
    """Greedy and sampled, one at a time and three at once (measured: every first draft
    accepted on the memorised continuations, 11-17 of 11-17; the second position 4-6, the third 0-1)."""
    _, _, path, prompts = family
    mtp.check_drafted_equals_serial(path, prompts[:3], [greedy(), greedy(), sampled(1)])


def test_a_one_pass_catch_up_writes_what_row_by_row_does(family):
    _, _, path, prompts = family
    mtp.check_paused_stretch_catches_up(path, prompts[1])


def test_a_missing_next_n_tensor_is_a_startup_error_naming_it(family):
    arch, _, path, _ = family
    ckpt = load_hf_dir(path)
    name, said = MTP_TENSOR[arch]
    del ckpt.tensors[name]
    with pytest.raises(CheckpointError, match=said):
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
