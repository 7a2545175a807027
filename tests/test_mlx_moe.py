"""The mixture-of-experts feed-forward on the mlx backend (tensorfold/mlx/moe.py) against the
torch reference (models/moe.MoE.compose, kernels/moe.py), bitwise:
- the routing (choice and weights, both normalizations) on logits built to tie (small integers,
  -0.0 against +0.0, -inf, a row of one value, NaN and +inf chosen first as torch's sort does);
- the whole block on random rows, float32 and bfloat16, dense and q8_0 experts, with and without a
  shared expert; each row alone gives the bits it gives in the batch. Dense GEMMs are MLX's
  matmul on both sides (the oracle op set multiplies its dense parts with ops.dense_linear), so
  everything else (routing, SwiGLU, the fixed-order sum, the shared gate) is checked bit for bit;
  quantized GEMMs are the exact quant_gemm on the torch side;
- the tiny qwen3_5_moe and qwen3_next checkpoints: greedy 32 tokens == transformers; with
  --quantize q8_0 every draw's logits and the token_sha equal the cpu backend's;
- the engine's equalities on them (tests/test_mlx_hybrids.py's checks): chunked prefill == token
  by token, solo == batched, chunked and drafted, cached prefix == fresh, preempted ==
  uninterrupted, every draw's logits or reply bitwise.
"""
import types

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from tensorfold.backends import cpu_ops  # noqa: E402
from tensorfold.kernels import moe as moe_ref  # noqa: E402
from tensorfold.mlx import moe, ops  # noqa: E402
from tensorfold.mlx.model import _WeightOps  # noqa: E402
from tensorfold.models.moe import MoE, MoESpec  # noqa: E402
from tensorfold.models.quantize import quantize  # noqa: E402
from tensorfold.models.weights import WeightReader  # noqa: E402


class _MLXDenseLinear(cpu_ops.ReferenceLinear):
    """The oracle's GEMM: quantized parts by quant_gemm (the exact reference), dense parts by
    MLX's matmul (the backend's dense GEMM, the one thing not a torch reference here)."""

    def multiply(self, x, part):
        if self.quantized(part):
            return super().multiply(x, part)
        return ops.to_torch(ops.dense_linear(ops.from_torch(x), ops.DenseWeight(ops.from_torch(part)))).to(x.dtype)


def _oracle():
    names = {name: getattr(cpu_ops, name) for name in dir(cpu_ops) if not name.startswith("_")}
    names.update(Linear=_MLXDenseLinear, fuse_moe=lambda block: None, NAME="oracle")
    return types.SimpleNamespace(**names)


def _same_bits(got: mx.array, want: torch.Tensor) -> bool:
    got = ops.to_torch(got)
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want) and \
        torch.equal(got.float().view(torch.int32), want.float().view(torch.int32))


@pytest.mark.parametrize("normalize", [True, False], ids=["topk_norm", "softmax_norm"])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (60, 4), (5, 1), (256, 8), (7, 7)])
def test_route_equals_reference(experts, top_k, normalize):
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    logits = torch.randn(40, experts, generator=gen) * 2.0
    logits[1:6] = torch.randint(-2, 3, (5, experts), generator=gen).float()
    logits[6] = 0.0
    logits[6, ::2] = -0.0
    logits[7, ::3] = float("-inf")
    logits[8] = 1.25
    logits[9, experts // 2] = float("nan")
    logits[10, ::2] = float("nan")
    logits[11, ::2] = float("inf")
    want_experts, want_weights = moe_ref.route(logits, top_k, normalize)
    got_experts, got_weights = moe.route(ops.from_torch(logits), top_k, normalize)
    assert np.array_equal(got_experts, want_experts.numpy()), "the chosen experts differ"
    clean = torch.ones(len(logits), dtype=torch.bool)
    clean[9:12] = False  # NaN weights alike there (NaN's sign bit is not compared)
    got_weights = ops.to_torch(got_weights)
    assert torch.equal(got_weights[clean].view(torch.int32), want_weights[clean].view(torch.int32)), "the weights differ"
    assert torch.equal(got_weights[~clean].isnan(), want_weights[~clean].isnan())


def _block_tensors(spec: MoESpec, hidden: int, fmt: str, gen: torch.Generator) -> dict:
    matrices = [("gate.weight", (spec.num_experts, hidden))]
    for e in range(spec.num_experts):
        matrices += [(f"experts.{e}.{p}_proj.weight", (spec.intermediate_size, hidden)) for p in ("gate", "up")]
        matrices += [(f"experts.{e}.down_proj.weight", (hidden, spec.intermediate_size))]
    si = spec.shared_intermediate_size
    if si:
        matrices += [(f"shared_expert.{p}_proj.weight", (si, hidden)) for p in ("gate", "up")]
        matrices += [("shared_expert.down_proj.weight", (hidden, si)), ("shared_expert_gate.weight", (1, hidden))]
    tensors = {}
    for name, shape in matrices:
        w = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
        if name == "gate.weight":
            w = w * 4.0  # clear winners, and some experts chosen by no row
        tensors["mlp." + name] = w if fmt == "dense" else quantize(w, fmt)
    return tensors


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no_shared"])
@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "dense"), (torch.bfloat16, "dense"),
                                       (torch.float32, "q8_0"), (torch.bfloat16, "q8_0")],
                         ids=["f32", "bf16", "q8_0", "bf16-q8_0"])
def test_moe_block_is_the_references(dtype, fmt, shared):
    gen = torch.Generator().manual_seed(7 + shared)
    hidden = 64
    for normalize in (True, False):
        spec = MoESpec(num_experts=16, top_k=4, intermediate_size=32, shared_intermediate_size=96 if shared else 0,
                       norm_topk_prob=normalize)
        tensors = _block_tensors(spec, hidden, fmt, gen)
        reference = MoE(spec, WeightReader(tensors, dtype, torch.device("cpu"), _oracle()), None)
        block = moe.MoE(spec, WeightReader(tensors, dtype, torch.device("cpu"), _WeightOps))
        check_block_is_the_reference(block, reference.compose, hidden, dtype, gen)


def check_block_is_the_reference(block, reference, hidden: int, dtype, gen: torch.Generator) -> None:
    """An mlx block on 1, 3 and 37 random rows: the torch reference's bits (`reference`: rows ->
    output), and each row alone the bits it has among the others."""
    for rows in (1, 3, 37):
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        got = block(ops.from_torch(x, ops.DTYPES[dtype]))
        assert _same_bits(got, reference(x)), f"{rows} rows: not the torch reference's bits"
        alone = mx.concatenate([block(ops.from_torch(x[i:i + 1], ops.DTYPES[dtype])) for i in range(rows)])
        assert np.array_equal(np.array(alone.astype(mx.float32)), np.array(got.astype(mx.float32)))


# ---- the tiny MoE checkpoints on --backend mlx ----------------------------------------------------

from test_mlx_backend import check_quantized_cpu_equals_mlx  # noqa: E402
from test_mlx_hybrids import (check_cached_prefix_and_preemption, check_chunked_prefill,  # noqa: E402
                              check_solo_serial_vs_batched)
from tools.tiny_checkpoint import make_tiny_checkpoint, well_separated_seed  # noqa: E402

SMALL = dict(kv_cache_gib=0.01, context=512)


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def moe_hybrid(request, tmp_path_factory, smollm2_tokenizer):
    arch = request.param
    seed = well_separated_seed(arch, smollm2_tokenizer, family=True)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_" + arch)), arch, seed=seed,
                                tokenizer=smollm2_tokenizer, family=True)


def test_greedy_32_tokens_equal_transformers(moe_hybrid):
    from family_cases import check_greedy_32_tokens, hf_model
    hf = hf_model(moe_hybrid, torch.float32, experts_implementation="eager")
    check_greedy_32_tokens(moe_hybrid, hf, "mlx", **SMALL)


def test_quantized_moe_gives_the_cpu_backends_logits_and_token_sha(moe_hybrid):
    """--quantize q8_0 on both backends: every draw's logits row bitwise equal (batched, chunked,
    drafted, greedy and sampled; MoE layers beside gated attention and Gated DeltaNet), so the
    same token_sha."""
    check_quantized_cpu_equals_mlx(moe_hybrid, first_prompt=37, **SMALL)


# ---- exactness within the backend: the engine's equalities on the MoE hybrids ---------------------

def test_chunked_prefill_is_bitwise_token_by_token(moe_hybrid):
    """Whole, chunks of 16 and 7, token by token beside another sequence's decode rows: the same
    last logits and DeltaNet states (the MoE layers route each row alone)."""
    check_chunked_prefill(moe_hybrid)


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def small_vocab_moe(request, tmp_path_factory, small_vocab_llama):
    """A MoE hybrid over small_vocab_llama's 512-token tokenizer, small weights: greedy replies
    loop, so drafts get accepted and rejected."""
    from transformers import AutoTokenizer
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("mlx_small_" + request.param)), request.param,
                                tokenizer=AutoTokenizer.from_pretrained(small_vocab_llama),
                                max_position_embeddings=256, initializer_range=0.02)


def test_replies_equal_solo_serial_vs_batched_chunked_drafted(small_vocab_moe):
    check_solo_serial_vs_batched(small_vocab_moe)


def test_cached_prefix_and_preemption_equal_fresh_runs(moe_hybrid):
    check_cached_prefix_and_preemption(moe_hybrid)
