"""The forward's logits for a token are bitwise the same whatever shares the forward.

Checked on a tiny random llama: a sequence alone vs inside batches of 2-16 rows mixing other
sequences' prefill chunks, decode rows and drafted (verify) runs at random places; vs random
prefill chunkings; vs 1 and 2 threads. The negative control: stock torch ops are caught by the
same harness and by the startup probes.
"""
import functools
import random
import types

import pytest
import torch
import torch.nn.functional as F

from tensorfold.backends.probes import probe_ops
from tensorfold.backends import backend_ops, cpu_ops
from tensorfold.kernels.paged_attention import attention_by_sequence
from tensorfold.backends.linear_weight import LinearWeight
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
from tensorfold.models.hf_dir import load_hf_dir
from tensorfold.models.loader import build_model

BLOCK = 32
def _stock_rms_norm(x, w, eps):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w


class StockLinear(LinearWeight):
    """torch's GEMM as it is, no padding: its kernel may change with the row count."""

    def pack(self, part):
        return part

    def multiply(self, x, part):
        return F.linear(x, part)


STOCK_OPS = types.SimpleNamespace(
    linear=lambda x, w, b=None: F.linear(x, w, b),
    rms_norm=_stock_rms_norm,
    add_rms_norm=lambda x, residual, w, eps: (_stock_rms_norm(residual + x, w, eps), residual + x),
    rms_norm_rope=lambda x, w, eps, cos, sin: cpu_ops.apply_rope(_stock_rms_norm(x, w, eps), cos, sin),
    silu_and_mul=lambda g, u: F.silu(g) * u,
    apply_rope=cpu_ops.apply_rope,
    paged_attention=cpu_ops.paged_attention,
    paged_decode_attention=cpu_ops.paged_decode_attention,
    write_kv=cpu_ops.write_kv,
    NAME="stock",
    Linear=StockLinear,
    fuse=lambda layer: None,
    V_EXPONENT_RECORD=False,
)
STOCK_OPS.attention = functools.partial(attention_by_sequence, STOCK_OPS.paged_attention,
                                        STOCK_OPS.paged_decode_attention)


class Harness:
    """Feeds pieces of several sequences through one forward each, with fixed block tables."""

    def __init__(self, model):
        self.model = model
        self.cache = model.allocate_cache(128, BLOCK)
        self.tables = {s: list(range(s * 8, s * 8 + 8))[::-1] for s in range(16)}

    def run(self, pieces):
        """pieces: (seq, tokens, start) -> list of logits [len(tokens), vocab] per piece."""
        ids, pos, slots, seqs, rows = [], [], [], [], []
        for s, tokens, start in pieces:
            first = len(ids)
            p = list(range(start, start + len(tokens)))
            ids += tokens
            pos += p
            slots += [self.tables[s][i // BLOCK] * BLOCK + i % BLOCK for i in p]
            seqs.append(SequenceRows(first, len(ids), torch.tensor(self.tables[s])))
            rows += range(first, len(ids))
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        logits = self.model.forward(ForwardBatch(t(ids), t(pos), t(slots), seqs, t(rows)), self.cache)
        out, i = [], 0
        for _, tokens, _ in pieces:
            out.append(logits[i:i + len(tokens)])
            i += len(tokens)
        return out


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, tiny_llama):
    return build_model(load_hf_dir(tiny_llama), getattr(torch, request.param), backend_ops("cpu"))


def _tokens(rng, n, vocab):
    return [rng.randrange(vocab) for _ in range(n)]


def test_alone_vs_mixed_batches(model):
    rng = random.Random(5)
    vocab = model.args.vocab_size
    target = _tokens(rng, 90, vocab)
    h = Harness(model)
    solo = h.run([(0, target, 0)])[0]
    for trial in range(6):
        # Sequence 1 replays `target` in random chunks while 2-16 rows of other sequences
        # (prefill chunks, decode rows, verify runs) share each forward at random places.
        got, start = [], 0
        others = {s: _tokens(rng, 120, vocab) for s in range(2, 8)}
        progress = {s: 0 for s in others}
        while start < len(target):
            n = rng.choice([1, 1, 3, 5, 8, 17, 40])
            n = min(n, len(target) - start)
            pieces = []
            for s in rng.sample(list(others), rng.randint(1, 4)):
                k = min(rng.choice([1, 2, 5, 8]), len(others[s]) - progress[s])
                if k > 0:
                    pieces.append((s, others[s][progress[s]:progress[s] + k], progress[s]))
                    progress[s] += k
            place = rng.randint(0, len(pieces))
            pieces.insert(place, (1, target[start:start + n], start))
            got.append(h.run(pieces)[place])
            start += n
        assert torch.equal(torch.cat(got), solo), f"trial {trial}: logits moved"


def test_thread_count_does_not_change_bits(model):
    rng = random.Random(6)
    target = _tokens(rng, 40, model.args.vocab_size)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = Harness(model).run([(0, target, 0)])[0]
        torch.set_num_threads(2)
        two = Harness(model).run([(0, target, 0)])[0]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_startup_probes_pass_on_the_cpu_op_set(model):
    assert probe_ops(model, model.ops) == []


def test_negative_control_stock_ops_are_caught(tiny_llama):
    """Stock F.linear in fp32 changes a row's bits with the batch: probes and harness see it."""
    model = build_model(load_hf_dir(tiny_llama), torch.float32, STOCK_OPS)
    assert probe_ops(model, STOCK_OPS), "probes must catch stock ops"
    rng = random.Random(7)
    vocab = model.args.vocab_size
    target = _tokens(rng, 30, vocab)
    solo = Harness(model).run([(0, target, 0)])[0]
    h = Harness(model)
    stepwise = torch.cat([h.run([(1, target[i:i + 1], i)])[0] for i in range(len(target))])
    assert not torch.equal(stepwise, solo), "stock ops unexpectedly invariant: the harness could not fail"
