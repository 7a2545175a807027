"""Gated DeltaNet's mixing alone: the C++ kernels (_cpu.delta_net, _cpu.gated_rms_norm) next to their
torch reference (kernels/delta_net.py), which they equal bit for bit.

    python tools/bench_delta_net.py                    # Qwen3.5-0.8B's layer: 16 key and value heads,
                                                       # dk = dv = 128, conv kernel 4; 2 threads
    python tools/bench_delta_net.py --threads 1 --dtype bfloat16 --no-reference
    python tools/bench_delta_net.py --shape tiny       # a few rows at tiny sizes (its test)

One layer's call per row of the table: a --prefill-row prefill of one sequence from position 0,
one decode row at position --context, and --streams decode rows of as many sequences; then the
gated norm over the prefill's and the decode row's heads. Each time is the best of --repeats
calls (the reference's prefill: one call, it runs position by position for tens of seconds at the
real shapes). The state lives in a cache of 16-token blocks, as the engine's.
"""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SHAPES = {"qwen3.5-0.8b": dict(key_heads=16, heads=16, key_dim=128, value_dim=128, kernel=4),
          "tiny": dict(key_heads=2, heads=4, key_dim=16, value_dim=32, kernel=4)}


def layer(shape: dict, gen: torch.Generator):
    from tensorfold.kernels.delta_net import decay_rate
    from tensorfold.models.cache import RecurrentState
    from tensorfold.models.linear_attention import DeltaNetParams

    kh, h, dk, dv, k = (shape[n] for n in ("key_heads", "heads", "key_dim", "value_dim", "kernel"))
    conv_dim = 2 * kh * dk + h * dv
    params = DeltaNetParams(kh, h, dk, dv, torch.randn(conv_dim, k, generator=gen) * 0.5,
                            decay_rate(torch.rand(h, generator=gen) * 2.5 - 1.0), torch.randn(h, generator=gen))
    return params, RecurrentState(conv_dim, k, h, dk, dv)


def batch_of(spans, block_size: int):
    """A ForwardBatch of sequences (p0, n), each with blocks of its own; returns (batch, num_blocks)."""
    from tensorfold.models.forward_batch import ForwardBatch, SequenceRows

    positions, sequences, start, blocks = [], [], 0, 0
    for p0, n in spans:
        count = -(-(p0 + n) // block_size)
        sequences.append(SequenceRows(start, start + n, torch.arange(blocks, blocks + count)))
        positions += range(p0, p0 + n)
        start, blocks = start + n, blocks + count
    rows = torch.zeros(start, dtype=torch.int64)
    return ForwardBatch(rows, torch.tensor(positions), rows.clone(), sequences, torch.arange(start)), blocks


def best_ms(fn, repeats: int, warmup: bool = True) -> float:
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.5-0.8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the activations' dtype")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-rows", type=int, default=512)
    p.add_argument("--context", type=int, default=700, help="the decode rows' position")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--no-reference", action="store_true", help="time the C++ kernels only")
    args = p.parse_args(argv)

    from tensorfold import _cpu
    from tensorfold.backends import native_ops
    from tensorfold.kernels import delta_net as ref
    from tensorfold.kernels.delta_net import NORM_EPS

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    params, spec = layer(SHAPES[args.shape], gen)
    block_size = 16
    cases = [(f"prefill {args.prefill_rows} rows", [(0, args.prefill_rows)]),
             ("decode 1 row", [(args.context, 1)]),
             (f"decode {args.streams} rows", [(args.context + 37 * i, 1) for i in range(args.streams)])]
    print(f"{_cpu.isa()}, {args.threads} threads, {args.dtype}, {args.shape} "
          f"({', '.join(f'{k} {v}' for k, v in SHAPES[args.shape].items())}): ms per layer call")
    print("| call | C++ | reference | reference / C++ |")
    print("|---|---|---|---|")
    for name, spans in cases:
        batch, num_blocks = batch_of(spans, block_size)
        rows = batch.positions.numel()
        proj = (torch.randn(rows, spec.conv_dim + 2 * params.num_heads, generator=gen)).to(dtype)
        qkv, b, a = proj.split([spec.conv_dim, params.num_heads, params.num_heads], dim=1)
        state = spec.allocate(num_blocks, block_size, torch.float32, "cpu")
        state.ssm.copy_(torch.randn(state.ssm.shape, generator=gen) * 0.3)
        state.conv.copy_(torch.randn(state.conv.shape, generator=gen))
        native = best_ms(lambda: native_ops.delta_net(qkv, a, b, state, batch, params), args.repeats)
        cells = [f"{native:.3f}", "", ""]
        if not args.no_reference:
            long = rows > 64  # one call, no warm-up: tens of seconds at the real shapes
            reference = best_ms(lambda: ref.delta_net(qkv, a, b, state, batch, params),
                                1 if long else max(1, args.repeats // 5), warmup=not long)
            cells[1:] = [f"{reference:.1f}", f"{reference / native:.0f}x"]
        print(f"| delta_net, {name} | " + " | ".join(cells) + " |")
    norm_rows = ((f"{args.prefill_rows} rows", args.prefill_rows * params.num_heads), ("1 row", params.num_heads))
    for name, heads in norm_rows:
        x = torch.randn(heads, params.value_dim, generator=gen).to(dtype)
        gate = torch.randn(heads, params.value_dim, generator=gen).to(dtype)
        weight = torch.randn(params.value_dim, generator=gen).to(dtype)
        native = best_ms(lambda: _cpu.gated_rms_norm(x, gate, weight, NORM_EPS), args.repeats)
        cells = [f"{native:.3f}", "", ""]
        if not args.no_reference:
            reference = best_ms(lambda: ref.gated_rms_norm(x, gate, weight, NORM_EPS), max(1, args.repeats // 5))
            cells[1:] = [f"{reference:.1f}", f"{reference / native:.0f}x"]
        print(f"| gated_rms_norm, {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
