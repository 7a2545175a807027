"""One-thread time of the native quantized GEMM per kind (tensorfold._cpu.quant_linear), at a few
row counts on one weight shape: what a K-quant costs next to Q4_0 on the CPU.

    python tools/bench_quant_kinds.py                                  # q4_0, q4_k, q6_k; 1 and 512 rows
    python tools/bench_quant_kinds.py --kinds q4_0,q4_k --rows 1,4,512 --n 8192 --k 3072 --repeats 7
    PYTHONPATH=/tmp/wt_old python tools/bench_quant_kinds.py           # another checkout's build
    python tools/bench_quant_kinds.py --rows 1 --threads 2 --streamed 24   # from memory, as decode reads

The weights are GGUF blocks of a random matrix (tensorfold.models.quantize.gguf_blocks, read back
by gguf_quants.quant_weight, packed by _cpu.pack_quant: the K-quants in their file's form), the
activations random float32 rows. Each cell is the best of --repeats timings, each the mean of
enough calls to take about --budget seconds (AMX where the build and CPU allow it, and the packed
weights in huge pages, as served).
To compare two builds, run each in its own process (a checkout's extension per PYTHONPATH) on a
quiet machine, and take the best of several runs. Prints one markdown table: ms per call and
the ratio to the first kind's time at the same rows.

With --streamed N each call takes the next of N packed copies of the weight in turn, so that the
weights come from memory rather than the caches (N copies must be well beyond the L3), as one-row
decode of a real-size model reads them; the table then adds the GB/s read and "of read": that
over the machine's read bandwidth (bench_core.ReadRate, torch's int64 sum on the same threads)
timed right after each of the GEMM's timings, the median of those paired ratios (a shared host's
bandwidth moves from minute to minute; a pair sees the same neighbours).
"""
import argparse
import os
import statistics
import sys
import time

if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tools.bench_core import ReadRate  # noqa: E402


def weight(kind: str, n: int, k: int, gen: torch.Generator):
    from tensorfold.models.gguf_quants import quant_weight
    from tensorfold.models.quantize import QTYPES, gguf_blocks

    w = torch.randn(n, k, generator=gen) / k ** 0.5
    return quant_weight(gguf_blocks(w, kind).reshape(-1), QTYPES[kind], (n, k))


def timed(fn, budget: float) -> float:
    fn()
    start, calls = time.perf_counter(), 0
    while True:
        fn()
        calls += 1
        spent = time.perf_counter() - start
        if spent >= budget:
            return spent / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="q4_0,q4_k,q6_k")
    parser.add_argument("--rows", default="1,512")
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=3072)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.4, help="seconds per timing")
    parser.add_argument("--streamed", type=int, default=1, help="cycle over this many copies of the weight")
    args = parser.parse_args()
    from tensorfold import _cpu
    from tensorfold.backends.huge_pages import Arena

    arena = Arena()  # the packed weights in huge pages, as the cpu backend places them

    torch.set_num_threads(args.threads)
    kinds, rows = args.kinds.split(","), [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    xs = {m: torch.randn(m, args.k, generator=gen) for m in rows}
    read = ReadRate(args.threads) if args.streamed > 1 else None
    times, nbytes, shares = {}, {}, {}
    for kind in kinds:
        w = weight(kind, args.n, args.k, gen)
        copies = [arena.place(_cpu.pack_quant(w.kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp))
                  for _ in range(args.streamed)]
        nbytes[kind] = copies[0].numel() * copies[0].element_size()
        turn = iter(range(1 << 62))
        for m in rows:
            x, out = xs[m], torch.empty(m, args.n)

            def call() -> None:
                _cpu.quant_linear(x, copies[next(turn) % len(copies)], args.n, args.k, out=out)
            timings, pairs = [], []
            for _ in range(args.repeats):
                timings.append(timed(call, args.budget))
                if read:
                    pairs.append(nbytes[kind] / timings[-1] / 1e9 / read.best(2))
            times[kind, m] = min(timings)
            shares[kind, m] = statistics.median(pairs) if pairs else None
        del copies
    import tensorfold
    print(f"{os.path.dirname(tensorfold.__file__)}: {args.n} x {args.k}, {args.threads} thread(s), "
          f"AMX {_cpu.quant_amx_path()}, best of {args.repeats}"
          + (f", cycling over {args.streamed} copies" if args.streamed > 1 else ""))
    print("| kind | " + " | ".join(f"{m} rows ms (x {kinds[0]})" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for kind in kinds:
        rate = ((lambda m: f", {nbytes[kind] / times[kind, m] / 1e9:.1f} GB/s, {100 * shares[kind, m]:.0f}% of read")
                if read else (lambda m: ""))
        cells = [f"{times[kind, m] * 1e3:.3f} ({times[kind, m] / times[kinds[0], m]:.2f}x{rate(m)})" for m in rows]
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
