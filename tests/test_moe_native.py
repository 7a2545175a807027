"""The cpu backend's MoE kernels (csrc/cpu/moe.cpp, layer.cpp's MoEBlock) against their torch
references, bitwise:
- _cpu.moe_route == kernels/moe.route on logits built to tie (small integers, -0.0 against +0.0,
  -inf, a row of one value, NaN), both normalizations, up to 256 experts of which 8 are chosen;
- _cpu.moe_route_sigmoid == kernels/moe.route_sigmoid (GLM-5's and Nemotron-H's noaux_tc) on
  the same kinds of logits, with biases that reorder the choice, one group or several;
- _cpu.MoEBlock (the whole block in one call) == models/moe.MoE.compose on the torch reference op
  set (cpu_ops with the fixed-order dense GEMM) and on the native op set op by op, in float32 and bfloat16, dense and quantized
  experts (and both in one block), with and without a shared expert; each row alone gives the bits
  it gives in the batch (experts chosen by other rows or by none change nothing); the same for
  GLM-5's block (sigmoid routing with a correction bias and groups, a float32 router, the shared
  experts added without a gate).
"""
import pytest
import torch

from test_native_backend import reference_ops
from tensorfold.backends import backend_ops
from tensorfold.kernels import moe as moe_ref
from tensorfold.models.moe import MoE, MoESpec, SigmoidRouting
from tensorfold.models.quantize import quantize
from tensorfold.models.weights import WeightReader

native = backend_ops("cpu")
pytestmark = pytest.mark.skipif(not native.NAME.startswith("native-"), reason="the compiled op set is not built")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _tied_logits(rows: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Router logits built to tie (small integers, -0.0 against +0.0, -inf, one value per row) with
    NaN in rows 9 and 10."""
    logits = torch.randn(rows, experts, generator=gen) * 2.0
    logits[1:6] = torch.randint(-2, 3, (5, experts), generator=gen).float()
    logits[6] = 0.0
    logits[6, ::2] = -0.0
    logits[7, ::3] = float("-inf")
    logits[8] = 1.25
    logits[9, experts // 2] = float("nan")
    logits[10, ::2] = float("nan")
    return logits


@pytest.mark.parametrize("normalize", [True, False], ids=["topk_norm", "softmax_norm"])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (60, 4), (5, 1), (256, 8), (7, 7)])
def test_route_equals_reference(experts, top_k, normalize):
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    logits = _tied_logits(70, experts, gen)
    want = moe_ref.route(logits, top_k, normalize)
    got = native.route(logits, top_k, normalize)
    assert torch.equal(got[0], want[0]), "the chosen experts differ"
    ok = slice(0, 9)  # rows without NaN; the NaN rows' choice is checked above, their weights are NaN alike
    assert _same_bits(got[1][ok], want[1][ok]), "the weights differ"
    assert torch.equal(got[1][9:11].isnan(), want[1][9:11].isnan())
    assert _same_bits(got[1][11:], want[1][11:])


@pytest.mark.parametrize("normalize", [True, False], ids=["topk_norm", "unnormalized"])
@pytest.mark.parametrize("experts,top_k,n_group,topk_group", [
    (32, 8, 1, 1), (256, 8, 8, 4), (16, 4, 4, 2), (8, 8, 4, 4), (12, 6, 3, 1), (6, 1, 1, 1)])
def test_route_sigmoid_equals_reference(experts, top_k, n_group, topk_group, normalize):
    gen = torch.Generator().manual_seed(experts * 10 + top_k + n_group)
    rows = 70
    logits = _tied_logits(rows, experts, gen)
    for bias in (torch.zeros(experts), torch.randn(experts, generator=gen) * 0.3,
                 torch.randint(-1, 2, (experts,), generator=gen).float() * 0.25):
        want = moe_ref.route_sigmoid(logits, bias, top_k, n_group, topk_group, normalize, 2.5)
        got = native.route_sigmoid(logits, bias, top_k, n_group, topk_group, normalize, 2.5)
        assert torch.equal(got[0], want[0]), "the chosen experts differ"
        assert torch.equal(got[1].isnan(), want[1].isnan())
        ok = ~want[1].isnan()
        assert _same_bits(torch.where(ok, got[1], 0.0), torch.where(ok, want[1], 0.0)), "the weights differ"


def _block_tensors(spec: MoESpec, hidden: int, formats: list[str], gen: torch.Generator) -> dict:
    """An MoE block's checkpoint tensors under "mlp.": expert e's matrices in formats[e % len],
    the router in the first format, the shared expert in the last ("dense", "q4_0", "q8_0")."""
    matrices = [("gate.weight", (spec.num_experts, hidden), formats[0])]
    for e in range(spec.num_experts):
        fmt = formats[e % len(formats)]
        matrices += [(f"experts.{e}.gate_proj.weight", (spec.intermediate_size, hidden), fmt),
                     (f"experts.{e}.up_proj.weight", (spec.intermediate_size, hidden), fmt),
                     (f"experts.{e}.down_proj.weight", (hidden, spec.intermediate_size), fmt)]
    si, prefix = spec.shared_intermediate_size, spec.shared_prefix
    if si:
        matrices += [(f"{prefix}{p}_proj.weight", (si, hidden), formats[-1]) for p in ("gate", "up")]
        matrices += [(f"{prefix}down_proj.weight", (hidden, si), formats[-1])]
        if spec.shared_gated:
            matrices += [("shared_expert_gate.weight", (1, hidden), formats[-1])]
    tensors = {}
    if spec.sigmoid_routing is not None:  # a bias that reorders some rows' choice
        tensors["mlp.gate.e_score_correction_bias"] = torch.randn(spec.num_experts, generator=gen) * 0.05
    for name, shape, fmt in matrices:
        w = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
        if name == "gate.weight":
            w = w * 4.0  # routes with clear winners, and some experts chosen by no row
        tensors["mlp." + name] = w if fmt == "dense" else _quantized(w, fmt)
    return tensors


def _quantized(w: torch.Tensor, fmt: str):
    """w in fmt's blocks: quantize's q8_0 / q4_0, or (q5_1, the K-quants) gguf's blocks read back."""
    from tensorfold.models.gguf_quants import quant_weight
    from tensorfold.models.quantize import QTYPES, gguf_blocks

    return quantize(w, fmt) if fmt in ("q8_0", "q4_0") else \
        quant_weight(gguf_blocks(w, fmt).reshape(-1), QTYPES[fmt], tuple(w.shape))


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no_shared"])
@pytest.mark.parametrize("dtype,formats", [
    (torch.float32, ["dense"]), (torch.bfloat16, ["dense"]), (torch.float32, ["q4_0"]),
    (torch.bfloat16, ["q8_0"]), (torch.float32, ["q4_0", "dense", "q8_0"])], ids=["f32", "bf16", "q4_0", "bf16-q8_0",
                                                                                "mixed"])
def test_moe_block_equals_its_composition(dtype, formats, shared):
    gen = torch.Generator().manual_seed(len(formats) * 7 + shared)
    oracle = reference_ops()  # cpu_ops with the fixed-order reference GEMM for dense weights
    hidden = 64
    for normalize in (True, False):
        spec = MoESpec(num_experts=16, top_k=4, intermediate_size=32, shared_intermediate_size=96 if shared else 0,
                       norm_topk_prob=normalize)
        tensors = _block_tensors(spec, hidden, formats, gen)
        fused = MoE(spec, WeightReader(tensors, dtype, torch.device("cpu"), native), None)
        reference = MoE(spec, WeightReader(tensors, dtype, torch.device("cpu"), oracle), None)
        assert fused._fused is not None and reference._fused is None
        for rows in (1, 3, 37):
            x = torch.randn(rows, hidden, generator=gen).to(dtype)
            got = fused.forward(x)
            assert got.dtype == dtype and got.shape == x.shape
            assert torch.equal(got, reference.forward(x)), f"{rows} rows: the fused block != the torch reference"
            assert torch.equal(got, fused.compose(x)), f"{rows} rows: the fused block != the native op by op"
            alone = torch.cat([fused.forward(x[i:i + 1]) for i in range(rows)])
            assert torch.equal(got, alone), f"{rows} rows: a row alone differs from the batch"
        assert fused.forward(x[:0]).shape == (0, hidden)


@pytest.mark.parametrize("dtype,formats", [
    (torch.float32, ["dense"]), (torch.bfloat16, ["dense"]), (torch.float32, ["q4_0"]), (torch.float32, ["q8_0"]),
    (torch.bfloat16, ["q8_0"]), (torch.float32, ["q4_0", "dense", "q8_0"])],
    ids=["f32", "bf16", "q4_0", "q8_0", "bf16-q8_0", "mixed"])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)], ids=["one_group", "groups"])
def test_glm_moe_block_equals_its_composition(dtype, formats, groups):
    """GLM-5's block (sigmoid routing with a correction bias, the router in float32, shared experts
    added without a gate) as one _cpu.MoEBlock call == MoE.compose, on both op sets."""
    gen = torch.Generator().manual_seed(len(formats) * 11 + groups[0])
    oracle, hidden = reference_ops(), 64
    for normalize, shared in ((True, 96), (False, 0)):
        spec = MoESpec(num_experts=16, top_k=4, intermediate_size=32, shared_intermediate_size=shared,
                       norm_topk_prob=normalize, sigmoid_routing=SigmoidRouting(*groups, scale=2.5),
                       shared_gated=False, shared_prefix="shared_experts.")
        tensors = _block_tensors(spec, hidden, formats, gen)
        fused = MoE(spec, WeightReader(tensors, dtype, torch.device("cpu"), native), None)
        reference = MoE(spec, WeightReader(tensors, dtype, torch.device("cpu"), oracle), None)
        assert fused._fused is not None and reference._fused is None
        for rows in (1, 3, 37):
            x = torch.randn(rows, hidden, generator=gen).to(dtype)
            got = fused.forward(x)
            assert got.dtype == dtype and got.shape == x.shape
            assert torch.equal(got, reference.forward(x)), f"{rows} rows: the fused block != the torch reference"
            assert torch.equal(got, fused.compose(x)), f"{rows} rows: the fused block != the native op by op"
            alone = torch.cat([fused.forward(x[i:i + 1]) for i in range(rows)])
            assert torch.equal(got, alone), f"{rows} rows: a row alone differs from the batch"
        assert fused.forward(x[:0]).shape == (0, hidden)


@pytest.mark.parametrize("formats", [["q5_1"], ["q4_k", "q5_1", "q6_k", "q5_k"]], ids=["q5_1", "k_quants"])
def test_moe_block_with_q5_1_and_k_quants_equals_its_composition(formats):
    """The MoE block's expert GEMMs (one parallel region of small GEMMs) in q5_1 and the K-quants
    (activations per 256, one term per super-block): the fused block == the torch reference == the
    native op by op, a row alone == among others, 1..37 rows."""
    gen = torch.Generator().manual_seed(len(formats))
    oracle, hidden = reference_ops(), 256
    spec = MoESpec(num_experts=8, top_k=3, intermediate_size=256, shared_intermediate_size=256, norm_topk_prob=True)
    tensors = _block_tensors(spec, hidden, formats, gen)
    fused = MoE(spec, WeightReader(tensors, torch.float32, torch.device("cpu"), native), None)
    reference = MoE(spec, WeightReader(tensors, torch.float32, torch.device("cpu"), oracle), None)
    assert fused._fused is not None and reference._fused is None
    for rows in (1, 5, 37):
        x = torch.randn(rows, hidden, generator=gen)
        got = fused.forward(x)
        assert torch.equal(got, reference.forward(x)), f"{rows} rows: the fused block != the torch reference"
        assert torch.equal(got, fused.compose(x)), f"{rows} rows: the fused block != the native op by op"
        alone = torch.cat([fused.forward(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(got, alone), f"{rows} rows: a row alone differs from the batch"


def test_moe_block_refuses_misshapen_weights():
    from tensorfold import _cpu
    spec = MoESpec(num_experts=4, top_k=2, intermediate_size=32, shared_intermediate_size=0)
    gen = torch.Generator().manual_seed(0)
    block = MoE(spec, WeightReader(_block_tensors(spec, 64, ["q4_0"], gen), torch.float32, torch.device("cpu"),
                                   native), None)
    router = block.router.single.data
    gate_ups = [e.gate_up.single.data for e in block.experts]
    downs = [e.down.single.data for e in block.experts]
    with pytest.raises(RuntimeError, match="one gate_up and one down per expert"):
        _cpu.MoEBlock(router, gate_ups, downs[:3], hidden=64, top_k=2, intermediate=32)
    with pytest.raises(RuntimeError, match="gate_up is not a packed quantized weight"):
        _cpu.MoEBlock(router, downs, gate_ups, hidden=64, top_k=2, intermediate=32)
    with pytest.raises(RuntimeError, match="top_k <= experts"):
        _cpu.MoEBlock(router, gate_ups, downs, hidden=64, top_k=5, intermediate=32)
    ok = _cpu.MoEBlock(router, gate_ups, downs, hidden=64, top_k=2, intermediate=32)
    with pytest.raises(RuntimeError, match=r"contiguous x \[tokens, 64\]"):
        ok.forward(torch.zeros(3, 65))


def test_a_fused_layer_takes_an_moe_block_or_an_mlp_not_both():
    from tensorfold import _cpu
    spec = MoESpec(num_experts=4, top_k=2, intermediate_size=32, shared_intermediate_size=0)
    gen = torch.Generator().manual_seed(1)
    block = MoE(spec, WeightReader(_block_tensors(spec, 64, ["q4_0"], gen), torch.float32, torch.device("cpu"),
                                   native), None)._fused

    def packed(n, k):
        return native.Linear.of(quantize(torch.randn(n, k, generator=gen), "q4_0")).single.data

    def layer(**ffn):
        return _cpu.DecoderLayer(packed(128, 64), packed(64, 64), post_norm=torch.ones(64), q_norm=None, k_norm=None,
                                 num_heads=2, num_kv_heads=1, head_dim=32, hidden=64, eps=1e-6, scale=0.17, window=0,
                                 **ffn)

    layer(gate_up=None, down=None, intermediate=0, moe=block)
    layer(gate_up=packed(64, 64), down=packed(64, 32), intermediate=32)
    with pytest.raises(RuntimeError, match="an MoE feed-forward or gate_up and down, not both"):
        layer(gate_up=packed(64, 64), down=packed(64, 32), intermediate=32, moe=block)
    with pytest.raises(RuntimeError, match="gate_up and down with intermediate > 0 expected"):
        layer(gate_up=None, down=None, intermediate=0)


def test_the_sums_reference_is_the_blocks_sum():
    """kernels/moe.combine over the pairs grouped by expert (group_by_expert) gives MoE.compose's
    bits: the reference the C++ and Triton sums are held to is the model's own."""
    gen = torch.Generator().manual_seed(3)
    for normalize in (True, False):
        spec = MoESpec(num_experts=16, top_k=4, intermediate_size=32, shared_intermediate_size=64,
                       norm_topk_prob=normalize)
        block = MoE(spec, WeightReader(_block_tensors(spec, 64, ["q8_0"], gen), torch.float32, torch.device("cpu"),
                                       reference_ops()), None)
        x = torch.randn(9, 64, generator=gen)
        experts, weights = moe_ref.route(block.router(x).float(), spec.top_k, normalize)
        order, y_rows = moe_ref.group_by_expert(experts)
        grouped = experts.flatten()[order].tolist()
        y = torch.cat([block.experts[e](x[p // spec.top_k][None]) for e, p in zip(grouped, order.tolist())])
        got = moe_ref.combine(y, y_rows, experts, weights, block.shared_gate(x), block.shared(x))
        assert torch.equal(got, block.compose(x))
