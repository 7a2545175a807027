"""Each architecture against transformers on a tiny random checkpoint it saved.

Logits within float32 tolerance for a whole prefill and for token-by-token decode through the
paged cache with several sequences sharing each forward; greedy tokens exactly equal.
"""
import pytest
import torch

from tensorfold.backends import backend_ops
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model
from tensorfold.sampling.params import SamplingParams

BLOCK = 32
ATOL = 1e-4


@pytest.fixture(params=["tiny_llama", "tiny_qwen3"])
def checkpoint_dir(request):
    return request.getfixturevalue(request.param)


@pytest.fixture
def hf_model(checkpoint_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()


def _cache(model, num_blocks=64):
    return model.allocate_cache(num_blocks, BLOCK, torch.float32)


def _rows(seq_tables, pieces):
    """pieces: list of (seq index, token ids, start position, want logits for all rows)."""
    ids, pos, slots, seqs, logit_rows = [], [], [], [], []
    for s, tokens, start, all_rows in pieces:
        first = len(ids)
        p = list(range(start, start + len(tokens)))
        ids += tokens
        pos += p
        table = seq_tables[s]
        slots += [table[i // BLOCK] * BLOCK + i % BLOCK for i in p]
        seqs.append(SequenceRows(first, len(ids), torch.tensor(table)))
        logit_rows += range(first, len(ids)) if all_rows else [len(ids) - 1]
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(t(ids), t(pos), t(slots), seqs, t(logit_rows))


def test_prefill_logits_match_transformers(checkpoint_dir, hf_model):
    model = build_model(load_hf_dir(checkpoint_dir), torch.float32, backend_ops("cpu"))
    torch.manual_seed(1)
    ids = torch.randint(0, model.args.vocab_size, (75,)).tolist()
    expected = hf_model(torch.tensor([ids])).logits[0]
    got = model.forward(_rows([list(range(3))], [(0, ids, 0, True)]), _cache(model))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_batched_paged_decode_matches_transformers(checkpoint_dir, hf_model):
    """Three sequences with scattered block tables: prefill chunks then decode rows, mixed."""
    model = build_model(load_hf_dir(checkpoint_dir), torch.float32, backend_ops("cpu"))
    cache = _cache(model)
    torch.manual_seed(2)
    lengths = [40, 7, 66]
    seqs = [torch.randint(0, model.args.vocab_size, (n + 6,)).tolist() for n in lengths]
    tables = [[9, 2, 30], [5, 17, 1], [40, 3, 22, 8]]
    # Round 1: seq 0 whole prompt, seq 1 prompt, seq 2 first chunk only (prefill chunking).
    model.forward(_rows(tables, [(0, seqs[0][:40], 0, False), (1, seqs[1][:7], 0, False),
                                 (2, seqs[2][:33], 0, False)]), cache)
    # Round 2: seq 2 finishes its prompt while 0 and 1 decode one token each.
    model.forward(_rows(tables, [(0, seqs[0][40:41], 40, False), (2, seqs[2][33:66], 33, False),
                                 (1, seqs[1][7:8], 7, False)]), cache)
    # Rounds 3..: all three decode, one row each; compare every row's logits with transformers.
    offsets = [41, 8, 66]
    for step in range(5):
        pieces = [(s, seqs[s][offsets[s] + step:offsets[s] + step + 1], offsets[s] + step, True)
                  for s in (2, 0, 1)]
        got = model.forward(_rows(tables, pieces), cache)
        for row, s in enumerate((2, 0, 1)):
            n = offsets[s] + step + 1
            expected = hf_model(torch.tensor([seqs[s][:n]])).logits[0, -1]
            torch.testing.assert_close(got[row], expected, atol=ATOL, rtol=0)


def test_greedy_32_tokens_equal_transformers(checkpoint_dir, hf_model):
    engine = Engine(checkpoint_dir, EngineConfig(drafting=False))
    ids = engine.tokenizer.encode("Once upon a time, in a land far away, there lived")
    got = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                 do_sample=False)[0, len(ids):].tolist()
    assert got.token_ids == expected
    assert got.finish_reason == "length"


def test_bfloat16_forward_is_close(checkpoint_dir, hf_model):
    model = build_model(load_hf_dir(checkpoint_dir), torch.bfloat16, backend_ops("cpu"))
    a = model.args
    cache = model.allocate_cache(8, BLOCK, torch.bfloat16)
    ids = list(range(100, 140))
    got = model.forward(_rows([list(range(2))], [(0, ids, 0, True)]), cache)
    expected = hf_model(torch.tensor([ids])).logits[0]
    assert got.dtype == torch.float32
    # bf16 weights and activations: compare the ranking, not the bits.
    assert (got - expected).abs().max() < 0.5
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_unknown_architecture_lists_supported(tiny_llama, tmp_path):
    import json
    import shutil
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, d)
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        build_model(load_hf_dir(str(d)), torch.float32, backend_ops("cpu"))


@pytest.mark.parametrize("damage", ["no_config", "truncated", "no_tokenizer", "bad_shape"])
def test_broken_checkpoint_names_the_file(tiny_llama, tmp_path, damage):
    import json
    import shutil
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, d)
    if damage == "no_config":
        (d / "config.json").unlink()
        match = "config.json: missing"
    elif damage == "truncated":
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])
        match = "model.safetensors"
    elif damage == "no_tokenizer":
        (d / "tokenizer.json").unlink()
        match = "tokenizer.json: missing"
    else:
        config = json.loads((d / "config.json").read_text())
        config["hidden_size"] = 96
        (d / "config.json").write_text(json.dumps(config))
        match = "embed_tokens"
    with pytest.raises(CheckpointError, match=match):
        build_model(load_hf_dir(str(d)), torch.float32, backend_ops("cpu"))


def test_sliding_window_matches_transformers(tmp_path, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    from tools.tiny_checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path / "sw"), "qwen3", tokenizer=smollm2_tokenizer,
                             sliding_window=24, use_sliding_window=True, max_window_layers=1,
                             layer_types=["full_attention", "sliding_attention"])
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    model = build_model(load_hf_dir(d), torch.float32, backend_ops("cpu"))
    assert model.layers[1].mixer.spec.window == 24 and model.layers[0].mixer.spec.window is None
    ids = list(range(500, 580))
    expected = hf(torch.tensor([ids])).logits[0]
    got = model.forward(_rows([list(range(3))], [(0, ids, 0, True)]), _cache(model))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
