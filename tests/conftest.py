"""Shared fixtures: tiny random checkpoints saved by transformers (made once per session)."""
import os
import random
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from tools.tiny_checkpoint import smollm2_tokenizer
    return smollm2_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_tokenizer):
    from tools.tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")), "llama", tokenizer=smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, smollm2_tokenizer):
    from tools.tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3", tokenizer=smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_family(tmp_path_factory, smollm2_tokenizer):
    """A tiny qwen3 with a Qwen3-style template (tools, think blocks) and its marker tokens."""
    from tools.tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen3_family")), "qwen3",
                                tokenizer=smollm2_tokenizer, family=True)


@pytest.fixture(scope="session")
def small_vocab_llama(tmp_path_factory):
    """A tiny llama over a 512-token byte-level BPE trained here. The weights depend only on the
    seed and the sizes; small weights (0.02) make greedy replies loop, so drafts get accepted."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tools.tiny_checkpoint import make_tiny_checkpoint

    rng = random.Random(0)
    corpus = [" ".join("".join(rng.choice("etaoinshrdlu") for _ in range(rng.randrange(2, 9)))
                       for _ in range(2000))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    assert len(hf) == 512
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("small_vocab_llama")), "llama", tokenizer=hf,
                                max_position_embeddings=256, initializer_range=0.02)


@pytest.fixture
def draw():
    """Fresh random inputs with a printable seed (kernel tests; tests/kernel_inputs.py)."""
    from kernel_inputs import Draw
    return Draw()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Kernel tests run at one and at two torch threads (a native op's bits must not depend on them)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
