"""Startup probes: does every op on the model's path keep a row's bits whatever shares its call?

The batch-invariant ops (kernels/reference.py) rest on observed behaviour of torch's CPU
kernels, not on a documented contract, so the engine checks them on the loaded model's real
shapes and dtype before promising exactness. For each op a few random rows are computed alone,
then inside larger batches at several places; any bit that moves is a failure, and the server
then refuses exact mode loudly (logged and reported by /health) instead of serving replies that
could differ between solo and batched runs.
"""
import logging
from dataclasses import replace

import torch

from tensorfold.backends import keeps_v_exponents
from tensorfold.models.cache import LayerKV
from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
from tensorfold.models.latent_attention import LatentAttention
from tensorfold.models.linear_attention import GatedDeltaNet
from tensorfold.models.mamba2 import Mamba2
from tensorfold.models.moe import MoE
from tensorfold.models.nemotron_h import NemotronMoE
from tensorfold.models.spec import AttentionSpec

BATCH_SIZES = (2, 3, 7, 8, 13, 64)
SHARED_FROM = 7  # batches this large take the probe row at all its places at once
log = logging.getLogger("tensorfold.engine")


def narrowed(config, failures: list[str]):
    """The config to serve with after the probes: as it is when they passed; else, without a
    batch-invariant forward (batching, chunking and drafting could change a reply), one request
    at a time, whole prompts, no drafts, said loudly in the log."""
    if not failures:
        return config
    log.error("EXACT MODE REFUSED: batch-invariance probes failed on this machine: %s. "
              "Serving one request at a time without drafts.", "; ".join(failures))
    return replace(config, max_num_seqs=1, drafting=False, max_tokens_per_step=1 << 30)


def _rows_invariant(fn, make_rows, name: str, failures: list[str]) -> None:
    """The probe row alone, then at the first, middle and last place of batches of BATCH_SIZES
    random rows. From batches of SHARED_FROM rows on, one batch holds it at all three places (each
    compared with the row alone; at least four other rows between them), which checks the same
    places in a third of the calls: the startup GEMMs over a large vocabulary's head were most of
    the probes' time."""
    probe = make_rows(1)
    alone = fn(probe)
    for m in BATCH_SIZES:
        places = sorted({0, m // 2, m - 1})
        for together in ([places] if m >= SHARED_FROM else [[p] for p in places]):
            batch = make_rows(m)
            batch[together] = probe[0]
            got = fn(batch)
            for place in together:
                if not torch.equal(got[place], alone[0]):
                    failures.append(f"{name}: row differs at batch {m}, place {place}")
                    return


def probe_ops(model, ops, threads=(1, 2), kv_dtype: torch.dtype | None = None) -> list[str]:
    """Run every probe; returns the failures (empty when the path is batch-invariant). The GEMMs
    are the first layer's and the head (the model's LinearWeights, parts of mixed formats
    included), one of each shape and formats; kv_dtype: the KV cache's dtype the engine serves with (default: the model's)."""
    dtype, device = model.dtype, model.device
    gen = torch.Generator().manual_seed(1234)  # drawn on the CPU, the same inputs on every device
    failures: list[str] = []

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    layer = model.layers[0]
    gemms = {name.removeprefix("layers.0."): w for name, w in model.gemms().items()
             if name.startswith("layers.0.") or name == "lm_head"}
    probed = set()
    for name, weight in gemms.items():  # each LinearWeight whole: parts of mixed formats included
        signature = (weight.formats, weight.widths, weight.in_features, weight.bias is not None)
        if signature in probed:  # the same kernels on the same shape (an MoE's experts): one speaks for all
            continue
        probed.add(signature)
        k = weight.shape[1]
        _rows_invariant(lambda x, w=weight: w(x), lambda m, k=k: randn(m, k), f"linear {name} (K {k})", failures)
    hidden, eps = layer.input_norm.shape[0], layer.eps
    _rows_invariant(lambda x: ops.rms_norm(x, layer.input_norm, eps), lambda m: randn(m, hidden), "rms_norm",
                    failures)
    width = gemms["down"].shape[1] if "down" in gemms else hidden
    _rows_invariant(lambda x: ops.silu_and_mul(x, x), lambda m: randn(m, width), "silu_and_mul", failures)
    if any(getattr(spec.ffn, "activation", None) == "gelu_tanh" for spec in model.specs):  # Gemma's GeGLU
        _rows_invariant(lambda x: ops.gelu_tanh_and_mul(x, x), lambda m: randn(m, width), "gelu_tanh_and_mul",
                        failures)
    attention = next((spec.mixer for spec in model.specs if isinstance(spec.mixer, AttentionSpec)), None)
    if attention is not None:
        _probe_attention(attention, device, ops, randn, kv_dtype or dtype, failures)
    if attention is not None and attention.output_gate:
        width = attention.num_heads * attention.head_dim
        _rows_invariant(lambda x: ops.sigmoid_and_mul(x, x), lambda m: randn(m, width), "sigmoid_and_mul", failures)
    latent = next((layer.mixer for layer in model.layers if isinstance(layer.mixer, LatentAttention)), None)
    if latent is not None:
        _probe_latent_attention(latent, device, randn, failures)
    delta_net = next((layer.mixer for layer in model.layers if isinstance(layer.mixer, GatedDeltaNet)), None)
    if delta_net is not None:
        s = delta_net.spec
        _probe_recurrent("delta net", delta_net, (s.conv_dim, s.num_heads, s.num_heads),
                         lambda qkv, a, b, state, batch: ops.delta_net(qkv, a, b, state, batch, delta_net.params),
                         device, randn, failures)
    mamba = next((layer.mixer for layer in model.layers if isinstance(layer.mixer, Mamba2)), None)
    if mamba is not None:
        _probe_recurrent("mamba2", mamba, (mamba.spec.conv_dim, mamba.spec.num_heads),
                         lambda xbc, dt, state, batch: ops.mamba2(xbc, dt, state, batch, mamba.params),
                         device, randn, failures)
    # the first MoE block: a layer's feed-forward, or the experts beside Gemma 4's MLP (layer.moe)
    moe = next((block for layer in model.layers for block in (layer.ffn, getattr(layer, "moe", None))
                if isinstance(block, (MoE, NemotronMoE))), None)
    if moe is not None:
        _rows_invariant(moe.forward, lambda m: randn(m, hidden), "moe (router, experts, shared expert)", failures)
    gate_up = gemms.get("gate_up", gemms["lm_head"])
    before = torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(7)).to(device, dtype)
            if n == threads[0]:
                reference = gate_up(x)
            elif not torch.equal(gate_up(x), reference):
                failures.append(f"linear gate_up: result depends on the thread count ({threads})")
    finally:
        torch.set_num_threads(before)
    return failures


def _probe_latent_attention(layer: LatentAttention, device, randn, failures: list[str]) -> None:
    """The first latent-attention layer whole (its GEMMs, norms, rope, indexer and attention over the
    latent cache): a prompt longer than its indexer's top k in one pass vs in chunks of 1, 3 and 16,
    and beside another sequence; outputs and the cache it wrote must be bitwise equal."""
    block_size = 16
    length = (layer.indexer.spec.top_k if layer.indexer is not None else 0) + 8  # past top k and a block
    num_blocks = -(-length // block_size)
    rows, other = randn(length, layer.kv_a.shape[1]), randn(9, layer.kv_a.shape[1])
    table = torch.arange(1, num_blocks + 1, device=device)  # block 0 holds the other sequence

    def run(chunks, beside):
        cache = layer.cache_spec.allocate(num_blocks + 1, block_size, torch.float32, device)
        outs, start = [], 0
        for n in chunks:
            pieces = [(rows[start:start + n], start, table)]
            if beside:
                pieces.insert(0, (other, 0, torch.zeros(1, dtype=torch.int64, device=device)))
            x = torch.cat([p[0] for p in pieces])
            positions = torch.cat([torch.arange(at, at + len(p), device=device) for p, at, _ in pieces])
            slots = torch.cat([t[torch.arange(at, at + len(p), device=device) // block_size] * block_size
                               + torch.arange(at, at + len(p), device=device) % block_size for p, at, t in pieces])
            bounds = [0]
            for p, _, _ in pieces:
                bounds.append(bounds[-1] + len(p))
            seqs = [SequenceRows(a, b, t) for (a, b), (_, _, t) in zip(zip(bounds, bounds[1:]), pieces)]
            outs.append(layer.forward(x, ForwardBatch(positions, positions, slots, seqs, positions[-1:]), cache)[-n:])
            start += n
        return [torch.cat(outs), cache.kv[table].clone()] + \
            ([] if cache.index_keys is None else [cache.index_keys[table].clone()])

    whole = run([length], False)
    for chunks, beside in (([1] * length, False), ([3] * (length // 3) + [length % 3], False),
                           ([16] * (length // 16) + [length % 16], False), ([length], True)):
        chunks = [n for n in chunks if n]
        if not all(torch.equal(a, b) for a, b in zip(run(chunks, beside), whole)):
            failures.append(f"latent attention: chunks {sorted(set(chunks))}"
                            f"{' beside another sequence' if beside else ''} differ from one pass")
            return


def _probe_attention(a: AttentionSpec, device, ops, randn, kv_dtype: torch.dtype, failures: list[str]) -> None:
    """A query row alone vs inside a prefill chunk of other rows of the same sequence, over a
    cache of the engine's KV dtype (the shape of the model's first attention layer)."""
    block_size = 32
    num_blocks = 6
    k_cache = randn(num_blocks, block_size, a.num_kv_heads, a.head_dim).to(kv_dtype)
    v_cache = torch.empty_like(k_cache)
    slots = torch.arange(num_blocks * block_size, device=device)
    # the engine's cache: with the record of V's exponents where the op set keeps one (models/cache.PagedKV)
    record = {"v_exp": torch.zeros(k_cache.shape[:3], dtype=torch.int16, device=device)} \
        if keeps_v_exponents(ops) else {}
    ops.write_kv(LayerKV(k_cache, v_cache, record.get("v_exp")), randn(len(slots), a.num_kv_heads, a.head_dim),
                 randn(len(slots), a.num_kv_heads, a.head_dim), slots)  # as the engine fills it
    table = torch.tensor([4, 1, 5, 0, 2, 3], device=device)
    q = randn(150, a.num_heads, a.head_dim)
    positions = torch.arange(150, device=device)
    scale = a.head_dim ** -0.5
    whole = ops.paged_attention(q, k_cache, v_cache, positions, table, scale, **record)
    for row in (0, 31, 32, 77, 149):
        alone = ops.paged_attention(q[row:row + 1], k_cache, v_cache, positions[row:row + 1], table, scale, **record)
        if not torch.equal(alone[0], whole[row]):
            failures.append(f"paged attention: row at position {row} differs alone vs in a 150-row chunk")
            return
    rows = torch.tensor([5, 77, 149, 31], device=device)
    tables = [table, table.flip(0), table, table.roll(2)]
    together = ops.paged_decode_attention(q[rows], k_cache, v_cache, positions[rows], tables, scale, **record)
    for i, row in enumerate(rows.tolist()):
        alone = ops.paged_attention(q[row:row + 1], k_cache, v_cache, positions[row:row + 1], tables[i], scale,
                                    **record)
        if not torch.equal(alone[0], together[i]):
            failures.append(f"paged attention: decode row {i} differs alone vs batched with other sequences")
            return
    for start, end in ((13, 40), (100, 150), (64, 65)):
        part = ops.paged_attention(q[start:end], k_cache, v_cache, positions[start:end], table, scale, **record)
        if not torch.equal(part, whole[start:end]):
            failures.append(f"paged attention: chunk [{start}, {end}) differs from the whole prefill")
            return


def _probe_recurrent(name: str, layer, widths: tuple[int, ...], op, device, randn, failures: list[str]) -> None:
    """The first recurrent layer of a kind (Gated DeltaNet, Mamba2), its recurrence with its own
    conv taps and gates: `op(*inputs, state, batch)` over inputs of `widths` columns, a 40-token
    prompt in one pass vs in chunks of 1, 3 and 16, and beside another sequence; outputs and the
    states left in the cache must be bitwise equal."""
    block_size, length = 16, 40
    rows = [randn(length, width) for width in widths]
    other = [randn(9, width) for width in widths]

    def run(chunks, beside=False):
        state = layer.cache_spec.allocate(8, block_size, torch.float32, device)
        outs, start = [], 0
        for n in chunks:
            seqs = [(range(start, start + n), torch.tensor([1, 3, 5]), rows)]
            if beside:
                seqs.insert(0, (range(0, 9), torch.tensor([6]), other))
            outs.append(_recurrent_rows(op, state, seqs, device)[-n:])
            start += n
        return torch.cat(outs), state.ssm[5].clone(), state.conv[5].clone()

    whole = run([length])
    for chunks, beside in (([1] * length, False), ([3] * 13 + [1], False), ([16, 16, 8], False), ([length], True)):
        got = run(chunks, beside)
        if not all(torch.equal(a, b) for a, b in zip(got, whole)):
            failures.append(f"{name}: chunks {sorted(set(chunks))}{' beside another sequence' if beside else ''} "
                            "differ from one pass")
            return


def _recurrent_rows(op, state, seqs, device) -> torch.Tensor:
    """op over sequences given as (positions, block table, the inputs of all its rows)."""
    inputs, positions, sequences = None, [], []
    for span, table, tensors in seqs:
        first = sum(len(p) for p in positions)
        inputs = inputs or [[] for _ in tensors]
        for parts, t in zip(inputs, tensors):
            parts.append(t[span.start:span.stop])
        positions.append(torch.arange(span.start, span.stop))
        sequences.append(SequenceRows(first, first + len(span), table.to(device)))
    pos = torch.cat(positions).to(device)
    batch = ForwardBatch(pos, pos, pos, sequences, pos[-1:])
    return op(*(torch.cat(parts) for parts in inputs), state, batch)
