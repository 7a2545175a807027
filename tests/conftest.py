"""Shared fixtures: tiny random checkpoints saved by transformers (made once per session)."""
import os
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


@pytest.fixture
def draw():
    """Fresh random inputs with a printable seed (kernel tests; tests/kernel_inputs.py)."""
    from kernel_inputs import Draw
    return Draw()
