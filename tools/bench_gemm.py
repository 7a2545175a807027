"""The compiled GEMMs alone, on the default model's own packed weights: every layer's qkv, o,
gate_up and down (and, with --head, the output projection) for a few row counts (issue 10).

    python tools/bench_gemm.py                                  # bf16, 1/4/8/16 rows
    python tools/bench_gemm.py --dtypes float32,bfloat16,auto --rows 1,4
    python tools/bench_gemm.py --dtypes auto --rows 1,4,64 --head

One round calls each LinearWeight once, layer after layer, as a decode step does, so every
weight is read from memory (the whole set is larger than the caches, unless it is not: the
default model's Q4_1 layers are 66 MB, and a CPU with a large L3 may keep part of them). Best of
--repeats rounds, in milliseconds; the "per row" column divides by the rows. The weights are
what the engine packs at load (PackedWeight, PackedQuant), in the dtype asked for.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402


def round_ms(weights, xs) -> float:
    started = time.perf_counter()
    for w, x in zip(weights, xs):
        w(x)
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16", help="comma-separated: float32, bfloat16, auto")
    p.add_argument("--rows", default="1,4,8,16", help="comma-separated row counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--head", action="store_true", help="include the output projection")
    args = p.parse_args()

    from tensorfold.backends import native_problem
    from tensorfold.engine.engine import Engine, EngineConfig

    if native_problem() is not None:
        print(f"the C++ kernels are not built: {native_problem()}")
        return
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{args.threads} threads, best of {args.repeats} rounds over the layers' GEMMs{' and the head' if args.head else ''}\n")
    print("| dtype | weights | MB | " + " | ".join(f"{m} row(s) ms | per row" for m in rows) + " |")
    print("|---|---|---|" + "---|---|" * len(rows))
    for dtype in args.dtypes.split(","):
        engine = Engine(None, EngineConfig(dtype=dtype, num_threads=args.threads, prompt_cache_gib=0, context=256,
                                           kv_cache_gib=0.01))
        model = engine.backend.model
        weights = [w for name, w in model.gemms().items() if name != "lm_head"]  # in layer order
        weights += [model.lm_head] if args.head else []
        act = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        megabytes = sum(p.data.numel() * p.data.element_size() for w in weights for p in w.parts) / 1e6
        cells = []
        for m in rows:
            xs = [torch.randn(m, w.shape[1]).to(act) for w in weights]
            round_ms(weights, xs)
            best = min(round_ms(weights, xs) for _ in range(args.repeats))
            cells.append(f"{best:.2f} | {best / m:.2f}")
        formats = ", ".join(sorted({str(w.format) for w in weights}))
        print(f"| {dtype} | {len(weights)} {formats} | {megabytes:.0f} | " + " | ".join(cells) + " |")
        del engine, model, weights


if __name__ == "__main__":
    main()
