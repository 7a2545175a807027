"""Nemotron-H's Mamba2 on the cpu backend: the C++ kernels (_cpu.mamba2, _cpu.mamba2_gated_norm)
next to their torch reference (kernels/mamba2.py), which they equal bit for bit.

    python tools/bench_mamba2.py                       # Nemotron-H 8B's Mamba2 layer, then a scaled-down model
    python tools/bench_mamba2.py --threads 1 --no-model
    python tools/bench_mamba2.py --shape tiny          # tiny sizes (its test)

Kernel table, one layer's call per row: a --prefill-rows prefill of one sequence from position 0,
one decode row, --streams decode rows of as many sequences; then the gated norm over the same rows.
Best of --repeats calls (the reference's prefill: one call). The state lives in a cache of
16-token blocks, as the engine's.

Model table (--shape nemotron-h-8b): a scaled-down Nemotron-H (MODEL below: 8 layers, pattern
M-M-M*M-, Mamba2 with the 8B's head_dim 64, state 128 and 8 groups but 32 heads, hidden 1024,
SmolLM2's 49k vocabulary, random weights, float32) on the native op set, with the Mamba2 ops as
before these kernels (the torch references), as C++ ops called one by one, and as now (one
_cpu.Mamba2Layer call per Mamba2 layer): a --prefill-rows prefill and the decode of 16 tokens
after it, one sequence. The three give the same logits bit for bit (checked).
"""
import argparse
import os
import sys
import tempfile
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools.bench_delta_net import batch_of, best_ms  # noqa: E402

SHAPES = {"nemotron-h-8b": dict(heads=128, head_dim=64, groups=8, state_size=128, kernel=4, hidden=4096),
          "tiny": dict(heads=4, head_dim=16, groups=2, state_size=16, kernel=4, hidden=64)}
MODEL = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
             hybrid_override_pattern="M-M-M*M-", mamba_num_heads=32, mamba_head_dim=64, n_groups=8,
             ssm_state_size=128, conv_kernel=4, max_position_embeddings=4096)


def layer(shape: dict, gen: torch.Generator):
    from tensorfold.kernels.delta_net import decay_rate
    from tensorfold.models.cache import Mamba2State
    from tensorfold.models.mamba2 import Mamba2Params

    h, p, g, n, k = (shape[name] for name in ("heads", "head_dim", "groups", "state_size", "kernel"))
    conv_dim = h * p + 2 * g * n
    params = Mamba2Params(h, p, g, n, torch.randn(conv_dim, k, generator=gen) * 0.5,
                          torch.randn(conv_dim, generator=gen) * 0.1,
                          decay_rate(torch.rand(h, generator=gen) * 2.5 - 1.0), torch.randn(h, generator=gen) - 2.0,
                          torch.randn(h, generator=gen), 0.0, float("inf"))
    return params, Mamba2State(conv_dim, k, h, n, p)


def kernel_table(args, dtype) -> None:
    from tensorfold import _cpu
    from tensorfold.backends import native_ops
    from tensorfold.kernels import mamba2 as ref

    gen = torch.Generator().manual_seed(0)
    params, spec = layer(SHAPES[args.shape], gen)
    cases = [(f"prefill {args.prefill_rows} rows", [(0, args.prefill_rows)]), ("decode 1 row", [(700, 1)]),
             (f"decode {args.streams} rows", [(700 + 37 * i, 1) for i in range(args.streams)])]
    print(f"{_cpu.isa()}, {args.threads} threads, {args.dtype}, {args.shape} Mamba2 layer "
          f"({', '.join(f'{k} {v}' for k, v in SHAPES[args.shape].items())}): ms per call")
    print("| call | C++ | reference | reference / C++ |")
    print("|---|---|---|---|")
    width = params.num_heads * params.head_dim
    for name, spans in cases:
        batch, num_blocks = batch_of(spans, 16)
        rows = batch.positions.numel()
        proj = torch.randn(rows, width + spec.conv_dim + params.num_heads, generator=gen).to(dtype)
        z, xbc, dt = proj.split([width, spec.conv_dim, params.num_heads], dim=1)
        state = spec.allocate(num_blocks, 16, torch.float32, "cpu")
        state.ssm.copy_(torch.randn(state.ssm.shape, generator=gen) * 0.3)
        state.conv.copy_(torch.randn(state.conv.shape, generator=gen))
        native = best_ms(lambda: native_ops.mamba2(xbc, dt, state, batch, params), args.repeats)
        cells = [f"{native:.3f}", "", ""]
        if not args.no_reference:
            long = rows > 64  # one call, no warm-up
            reference = best_ms(lambda: ref.mamba2(xbc, dt, state, batch, params),
                                1 if long else max(1, args.repeats // 5), warmup=not long)
            cells[1:] = [f"{reference:.1f}", f"{reference / native:.0f}x"]
        print(f"| mamba2, {name} | " + " | ".join(cells) + " |")
        y = torch.randn(rows, width, generator=gen)
        weight = torch.randn(width, generator=gen).to(dtype)
        native = best_ms(lambda: _cpu.mamba2_gated_norm(y, z, weight, params.n_groups, 1e-5, dtype), args.repeats)
        cells = [f"{native:.3f}", "", ""]
        if not args.no_reference:
            reference = best_ms(lambda: ref.gated_group_norm(y, z, weight, params.n_groups, 1e-5, dtype),
                                max(1, args.repeats // 5))
            cells[1:] = [f"{reference:.1f}", f"{reference / native:.0f}x"]
        print(f"| gated norm, {name} | " + " | ".join(cells) + " |")


def model_table(args) -> None:
    from tensorfold.backends import backend_ops
    from tensorfold.kernels import mamba2 as ref
    from tensorfold.models.forward_batch import ForwardBatch, SequenceRows
    from tensorfold.models.hf_dir import load_hf_dir
    from tensorfold.models.loader import build_model
    from tensorfold.models.mamba2 import Mamba2
    from tools.tiny_checkpoint import make_tiny_checkpoint, smollm2_tokenizer

    path = os.path.join(args.cache_dir, "nemotron_h_scaled")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_checkpoint(path, "nemotron_h", tokenizer=smollm2_tokenizer(), **MODEL)
    native = backend_ops("cpu")

    def op_set(mamba2, gated_norm):  # the native op set with these Mamba2 ops, its Mamba2 layers unfused
        ops = types.SimpleNamespace(**{n: getattr(native, n) for n in dir(native) if not n.startswith("__")})
        ops.mamba2, ops.mamba2_gated_norm = mamba2, gated_norm
        ops.fuse = lambda layer: None if isinstance(layer.mixer, Mamba2) else native.fuse(layer)
        return ops
    block, prompt = 16, torch.randint(0, 49152, (args.prefill_rows + 16,), generator=torch.Generator().manual_seed(1))
    blocks = -(-(args.prefill_rows + 16) // block)

    def rows(p0, n):
        ids = prompt[p0:p0 + n]
        pos = torch.arange(p0, p0 + n)
        return ForwardBatch(ids, pos, pos.clone(), [SequenceRows(0, n, torch.arange(blocks))],
                            torch.tensor([n - 1]))

    results = {}
    runs = (("before: torch mamba2 and gated norm", op_set(ref.mamba2, ref.gated_group_norm)),
            ("C++ mamba2 and gated norm, op by op", op_set(native.mamba2, native.mamba2_gated_norm)),
            ("now: one Mamba2Layer call per layer", native))
    for name, ops in runs:
        model = build_model(load_hf_dir(path), torch.float32, ops)
        times = {"prefill": [], "decode": []}
        for _ in range(args.model_repeats):
            cache = model.allocate_cache(blocks, block, torch.float32)
            started = time.perf_counter()
            logits = model.forward(rows(0, args.prefill_rows), cache)
            times["prefill"].append(time.perf_counter() - started)
            outs = [logits[-1]]
            started = time.perf_counter()
            for t in range(args.prefill_rows, args.prefill_rows + 16):
                outs.append(model.forward(rows(t, 1), cache)[-1])
            times["decode"].append(time.perf_counter() - started)
        results[name] = (min(times["prefill"]), min(times["decode"]), torch.stack(outs))
    logits = [r[2].view(torch.int32) for r in results.values()]
    same = all(torch.equal(logits[0], other) for other in logits[1:])
    print(f"\nscaled-down Nemotron-H ({', '.join(f'{k} {v}' for k, v in MODEL.items())}), float32, "
          f"{args.threads} threads; the three runs' logits bitwise equal: {same}")
    print(f"| Mamba2 ops | prefill {args.prefill_rows} tok/s | decode tok/s (16 tokens) |")
    print("|---|---|---|")
    for name, (prefill, decode, _) in results.items():
        print(f"| {name} | {args.prefill_rows / prefill:.1f} | {16 / decode:.1f} |")
    if not same:
        raise SystemExit("the runs' logits differ")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="nemotron-h-8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the activations' dtype")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-rows", type=int, default=512)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--model-repeats", type=int, default=2)
    p.add_argument("--no-reference", action="store_true", help="time the C++ kernels only")
    p.add_argument("--no-model", action="store_true", help="the kernel table only")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "tensorfold-bench"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel_table(args, getattr(torch, args.dtype))
    if not args.no_model and args.shape != "tiny":
        model_table(args)


if __name__ == "__main__":
    main()
