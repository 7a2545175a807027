"""The model seam: a layer kind the project has never seen, defined here, is served by the engine
as it stands, and the exactness equalities hold through the Backend on both cpu op sets.

The toy kind: a token-shift mixer, out = proj(x_t + x_{t-1}), whose cache keeps each position's
input row in the request's blocks (a cache kind of its own, beside the attention layers' K/V).
It goes in as a block class, a cache spec and a family (a spec parser), registered in the
literal registry for the test; nothing in the engine, scheduler, backend or API changes. If the
engine assumed every layer kept K/V (sizing, the blocks a request holds, a prefix hit, a
rejected draft's rollback), a reply would change between solo, batched, cached and drafted runs.
"""
import ast
import json
import os
import pathlib
import random
import shutil
from dataclasses import dataclass, replace

import pytest
import torch

from tensorfold.api.replies import token_sha
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.engine.request import Status
from tensorfold.models import registry
from tensorfold.models.blocks import BLOCKS
from tensorfold.models.spec import Family, dense_attention_layers
from tensorfold.sampling.params import SamplingParams

from test_quantized_model import cpu_op_set

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIFT_LAYER = 1
BLOCK = 32


@dataclass(frozen=True)
class ShiftSpec:
    hidden_size: int


@dataclass(frozen=True)
class RowCache:
    """Each position's input row, in the request's blocks."""
    rows: torch.Tensor  # [num_blocks, block_size, hidden]

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


@dataclass(frozen=True)
class PagedRows:
    width: int

    def bytes_per_block(self, dtype, block_size, v_exponents=False) -> int:
        return self.width * torch.finfo(dtype).bits // 8 * block_size

    def allocate(self, num_blocks, block_size, dtype, device, v_exponents=False) -> RowCache:
        return RowCache(torch.zeros(num_blocks, block_size, self.width, dtype=dtype, device=device))


class ShiftMixer:
    def __init__(self, spec: ShiftSpec, w, ctx):
        self.spec = spec
        self.proj = w.linear("shift.weight")
        self.cache_spec = PagedRows(spec.hidden_size)

    def gemms(self) -> dict:
        return {"shift": self.proj}

    def forward(self, x, batch, cache: RowCache):
        block = cache.rows.shape[1]
        flat = cache.rows.view(-1, self.spec.hidden_size)
        flat[batch.slot_mapping] = x.to(flat.dtype)
        prev = torch.zeros_like(x)  # [num_rows, hidden]
        for seq in batch.sequences:
            before = batch.positions[seq.start:seq.end] - 1
            at = before.clamp(min=0)
            slots = seq.block_table[at // block] * block + at % block
            prev[seq.start:seq.end] = torch.where((before >= 0)[:, None], flat[slots].to(x.dtype), 0)
        return self.proj(x + prev)


def toy_layers(args):
    specs = dense_attention_layers(args)
    specs[SHIFT_LAYER] = replace(specs[SHIFT_LAYER], mixer=ShiftSpec(args.hidden_size))
    return specs


@pytest.fixture(scope="module")
def toy_checkpoint(tiny_llama, tmp_path_factory):
    from safetensors.torch import load_file, save_file
    path = str(tmp_path_factory.mktemp("toy_shift"))
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    config = json.load(open(os.path.join(path, "config.json")))
    config["architectures"] = ["ToyShiftForCausalLM"]
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    hidden = config["hidden_size"]
    gen = torch.Generator().manual_seed(3)
    tensors[f"model.layers.{SHIFT_LAYER}.shift.weight"] = torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(autouse=True)
def toy_family(monkeypatch):
    monkeypatch.setitem(registry.ARCHITECTURES, "ToyShiftForCausalLM",
                        Family("toy", toy_layers, {**BLOCKS, ShiftSpec: ShiftMixer}))


def _engine(path, op_set: str, **config) -> Engine:
    with cpu_op_set(op_set):
        return Engine(path, EngineConfig(**{**dict(probe=False, kv_cache_gib=0.004, context=256), **config}))


def _together(engine: Engine, prompts, params) -> list[str]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    reqs = [engine.requests[i] for i in ids]
    while any(r.status is not Status.FINISHED for r in reqs):
        engine.step()
    return [token_sha(r.output_ids) for r in reqs]


PROMPT_RNG = random.Random(5)
PASSAGE = [PROMPT_RNG.randrange(2, 500) for _ in range(20)]
PROMPTS = [PASSAGE * 4, [PROMPT_RNG.randrange(2, 500) for _ in range(45)], PASSAGE * 2 + [7, 8, 9]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.7, seed=11, max_tokens=12, ignore_eos=True)]


@pytest.mark.parametrize("op_set", ["native", "torch"])
def test_a_toy_layer_kind_is_served_exactly_without_engine_changes(toy_checkpoint, op_set):
    engine = _engine(toy_checkpoint, op_set)
    assert engine.info.cache == f"{engine.info.num_layers - 1} x PagedKV, 1 x PagedRows"
    assert "layers.1.shift" in engine.backend.model.gemms()
    solo = [_together(engine, [p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]
    assert _together(engine, PROMPTS, PARAMS) == solo                  # concurrent == solo (prefix hits too)
    fresh = _engine(toy_checkpoint, op_set, drafting=False, max_tokens_per_step=16)
    assert _together(fresh, PROMPTS, PARAMS) == solo                   # serial, 16-token chunks, no cache
    assert engine.pool.num_cached > 0                                   # the prompts' blocks were cached
    tiny = _engine(toy_checkpoint, op_set, kv_cache_gib=0.0001, context=128)  # 4 blocks for 7
    assert _together(tiny, PROMPTS, PARAMS) == solo                    # preempted and replayed
    assert tiny.scheduler.num_preemptions > 0


def test_the_op_sets_agree_on_the_toy_model(toy_checkpoint):
    native, torch_ops = (_together(_engine(toy_checkpoint, name), PROMPTS, PARAMS) for name in ("native", "torch"))
    assert native == torch_ops


@pytest.mark.parametrize("op_set", ["native", "torch"])
def test_llama_exactness_equalities_on_each_cpu_op_set(tiny_llama, op_set):
    """Solo, batched, drafted and chunked runs of the tiny llama, through Engine -> Backend."""
    engine = _engine(tiny_llama, op_set)
    assert engine.info.ops.startswith("native-" if op_set == "native" else "torch")
    solo = [_together(engine, [p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]
    assert _together(engine, PROMPTS, PARAMS) == solo
    assert _together(_engine(tiny_llama, op_set, drafting=False, max_tokens_per_step=16), PROMPTS, PARAMS) == solo


def test_torch_op_set_runs_no_compiled_kernel(tiny_llama, monkeypatch):
    """TENSORFOLD_CPU_OPS=torch runs torch end to end: with the extension's every function made to
    fail, the engine still serves (and gives the native op set's tokens)."""
    try:
        from tensorfold import _cpu
    except ImportError:
        pytest.skip("the C++ extension is not built")
    want = _together(_engine(tiny_llama, "native"), PROMPTS, PARAMS)
    engine = _engine(tiny_llama, "torch")
    for name in dir(_cpu):
        if not name.startswith("_"):
            monkeypatch.setattr(_cpu, name, _refuse(name), raising=False)
    assert _together(engine, PROMPTS, PARAMS) == want


def _refuse(name):
    def refused(*args, **kwargs):
        raise AssertionError(f"tensorfold._cpu.{name} called under the torch op set")
    return refused


PLAIN_PYTHON = ["tensorfold/engine", "tensorfold/api"]


def test_engine_and_api_import_no_torch():
    """The engine, scheduler, drafter and API see plain Python data: no module there imports torch
    (the grammar bitmask stays sampling/bitmask.py's host tensor, xgrammar's format)."""
    offenders = []
    for folder in PLAIN_PYTHON:
        for path in sorted((ROOT / folder).glob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if any(n == "torch" or n.startswith("torch.") for n in names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
