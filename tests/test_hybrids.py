"""The Qwen hybrids (qwen3_5, qwen3_5_moe, qwen3_next) against transformers, and exact.

Tiny random checkpoints laid out as the Hub's (tools/tiny_checkpoint.py), each with a seed whose
greedy tokens and expert routes no float rounding can flip (well_separated_seed):
- prefill logits and batched paged decode (sequences starting mid-block, chunks mixed with decode
  rows) within float32 tolerance of transformers, greedy 32 tokens equal;
- a prompt prefilled in chunks of 1, 3, 16, 64 and 512 gives bitwise the logits, the recurrent
  states and the K/V of a token-by-token run, beside another sequence, at 1 and 2 threads;
- over a real loopback server: drafted == serial (rejected drafts rewind the state to a block
  boundary), concurrent == solo, a cached prefix == fresh (resumed from a block's state), a
  preempted reply == its uninterrupted run; greedy and sampled.
"""
import pytest
import torch

import family_cases as cases
from test_models import _rows
from tensorfold.backends import backend_ops
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model
from tools.tiny_checkpoint import HYBRID_ARCHS, make_tiny_checkpoint, well_separated_seed

ATOL = 2e-3  # logits up to ~10: both transformers in float32 and this forward are within ~1e-3 of float64


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def hybrid(request, tmp_path_factory, smollm2_tokenizer):
    arch = request.param
    seed = well_separated_seed(arch, smollm2_tokenizer, family=True)
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, seed=seed, tokenizer=smollm2_tokenizer,
                                family=True)


@pytest.fixture(scope="module")
def hf_model(hybrid):
    return cases.hf_model(hybrid, torch.float32, experts_implementation="eager")


@pytest.fixture(scope="module")
def hf_model64(hybrid):
    """The logits oracle: transformers in float64 (its float32 chunked DeltaNet is itself ~1e-3 off)."""
    return cases.hf_model(hybrid, torch.float64, experts_implementation="eager")


def _model(path, ops="cpu"):
    return build_model(load_hf_dir(path), torch.float32, backend_ops(ops))


def test_prefill_logits_match_transformers(hybrid, hf_model64):
    cases.check_prefill_logits(_model(hybrid), hf_model64, ATOL)


def test_batched_paged_decode_matches_transformers(hybrid, hf_model64):
    cases.check_batched_paged_decode(_model(hybrid), hf_model64, ATOL, steps=4)


def test_greedy_32_tokens_equal_transformers(hybrid, hf_model):
    cases.check_greedy_32_tokens(hybrid, hf_model)  # the startup probes pass: DeltaNet chunks, MoE rows


# ---- chunked prefill == token by token, bitwise ------------------------------------------------

PROMPT_LEN = 530


@pytest.mark.parametrize("threads", [1, 2])
def test_chunked_prefill_is_bitwise_token_by_token(hybrid, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cases.check_chunked_prefill(_model(hybrid), PROMPT_LEN, chunks=(3, 16, 64, 512))
    finally:
        torch.set_num_threads(before)


def test_one_call_per_layer_equals_the_op_by_op_layer(hybrid):
    """The fused layers (native_ops.fuse: one _cpu.DeltaNetLayer or _cpu.DecoderLayer call per
    layer, the latter with the output gate and partial rope; native_ops.fuse_moe: one
    _cpu.MoEBlock call per MoE feed-forward) against the same kernels called op by op: the same
    logits, recurrent states and K/V through a chunked prefill beside a decoding sequence, float32
    and bfloat16, quantized and dense."""
    import types

    from tensorfold.models.loader import quantize_checkpoint
    from tensorfold.models.moe import MoE

    native = backend_ops("cpu")
    if not native.NAME.startswith("native-"):
        pytest.skip("the compiled op set is not built")
    unfused = types.SimpleNamespace(**{n: getattr(native, n) for n in dir(native) if not n.startswith("_")})
    unfused.fuse = unfused.fuse_moe = lambda block: None
    torch.manual_seed(5)
    for dtype, quant in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, "q4_0")):
        def build(ops):
            ckpt = load_hf_dir(hybrid)
            if quant:
                quantize_checkpoint(ckpt, quant)
            return build_model(ckpt, dtype, ops)
        fused, op_by_op = build(native), build(unfused)
        one_call = [getattr(run, "__self__", None) is not layer for run, layer in zip(fused._run, fused.layers)]
        assert all(one_call), "every layer (DeltaNet and gated attention, MLP and MoE alike) is one call"
        assert all(layer.ffn._fused is not None for layer in fused.layers if type(layer.ffn) is MoE)
        ids = torch.randint(0, fused.args.vocab_size, (70,)).tolist()
        other = torch.randint(0, fused.args.vocab_size, (70,)).tolist()
        got_logits, got = cases.prefill_in_chunks(fused, ids, 16, other, blocks=4)
        want_logits, want = cases.prefill_in_chunks(op_by_op, ids, 16, other, blocks=4)
        assert torch.equal(got_logits, want_logits), f"{dtype} {quant}: logits differ"
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{dtype} {quant}: cache differs"


# ---- over HTTP ---------------------------------------------------------------------------------

def test_drafted_equals_serial(hybrid):
    """Verify rounds run drafts through the recurrence; a rejected draft rewinds the state to
    its block's start, and the reply equals the serial one, greedy and sampled."""
    cases.check_drafted_equals_serial(hybrid, [dict(temperature=0.0), dict(temperature=0.8, seed=3),
                                               dict(temperature=1.1, seed=4, top_p=0.9)], max_tokens=70)


@pytest.fixture(scope="module")
def solo(hybrid):
    yield from cases.solo_replies(hybrid)


def test_concurrent_replies_equal_their_solo_runs(hybrid, solo):
    cases.check_concurrent_equals_solo(hybrid, solo)


def test_cached_prefix_reply_equals_the_fresh_one(hybrid, solo):
    cases.check_cached_equals_fresh(hybrid, solo, whole_blocks=True)  # resumed from a block's state


def test_preempted_reply_equals_its_uninterrupted_run(hybrid, solo):
    cases.check_preempted_equals_uninterrupted(hybrid, solo, reasoning_effort="none")  # no think block
