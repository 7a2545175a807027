"""Real model sizes: TensorFold against llama.cpp on the same GGUF, weights far beyond the CPU's
caches (issue 33), in one run.

    python tools/bench_real.py                                   # llama-1b in q4_k_m and q4_0
    python tools/bench_real.py --shape llama-3b --types q4_k_m,q4_0,q8_0 --repeats 3

The files are tools/real_shapes.py's (random weights at the real shapes, SmolLM2's tokenizer;
quantized by llama.cpp's own quantizer), made once and kept. Per file:
- load (a child process each, so nothing is warm but the disk cache): the engine's load seconds,
  the runtime's RSS before it (torch, the tokenizer), the peak RSS (VmHWM) during and after it,
  and the packed matrices' bytes over the file's tensor bytes ("resident / file");
- speed, the engines alternating, best of --repeats: one-stream greedy decode after a 16-token
  prompt (drafting off), a --prefill-tokens prefill, four streams' aggregate decode, with the
  ratios ours / llama.cpp; "GB/s" is the decode's weight bytes per token (the packed matrices)
  times its tokens/s, the read bandwidth it reaches, and "of read" that over the machine's read
  bandwidth (bench_core.ReadRate: a 1 GiB int64 sum by torch on the same threads), measured
  again beside each repeat, as the engines are, and the best reading kept: on a shared host the
  rate moves with the neighbours' traffic, so a reading taken once at the start may be another
  machine's than the one the engines ran on. "llama.cpp of read" is the same for the peer, its
  bytes per token the file's matrices.
TensorFold serves the blocks as stored (dtype auto); llama.cpp runs the same file with its f16 KV
cache. The peer's columns read "-" without llama-cpp-python. --long N adds a prompt of N tokens
(both engines' context sized to hold it): its prefill tokens/s, then decode at that depth.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools import peer_llama_cpp  # noqa: E402
from tools.bench_core import ReadRate, fmt, machine_line, print_table, rss_mib  # noqa: E402
from tools.bench_native import (long_round, peer_long_round, peer_round, prompt_ids, ratio,  # noqa: E402
                                streams_decode_tps)
from tools.real_shapes import SHAPES, real_shape_gguf  # noqa: E402


def packed_bytes() -> int:
    """Bytes of every packed GEMM weight alive in this process (the op sets' LinearWeight parts)."""
    from tensorfold.backends.linear_weight import LinearWeight

    total = 0
    with warnings.catch_warnings():  # isinstance on every object trips torch's deprecated aliases
        warnings.simplefilter("ignore")
        weights = [obj for obj in gc.get_objects() if isinstance(obj, LinearWeight)]
    for weight in weights:
        for part in weight.parts:
            data = getattr(part, "data", part)
            total += data.numel() * data.element_size()
    return total


def tensor_bytes(path: str) -> int:
    """The file's 2-D tensors' bytes (the matrices; norms are a rounding error)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1)


def load_child(path: str, threads: int) -> dict:
    """Run in a child: the engine loaded on `path`, what it took."""
    import torch

    from tensorfold.engine.engine import Engine, EngineConfig

    torch.set_num_threads(threads)
    runtime = rss_mib()[0]
    started = time.perf_counter()
    engine = Engine(path, EngineConfig(num_threads=threads, prompt_cache_gib=0, context=2048, kv_cache_gib=0.25))
    seconds = time.perf_counter() - started
    after, peak = rss_mib()
    return {"runtime": runtime, "load_s": seconds, "engine_load_s": engine.info.load_seconds, "peak": peak,
            "after": after, "packed": packed_bytes(), "cache": engine.info.cache_bytes / 2**20}


def measure_load(path: str, threads: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--load-child", path, "--threads", str(threads)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def tensorfold_bench(path: str, args):
    import torch

    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = Engine(path, EngineConfig(num_threads=args.threads, prompt_cache_gib=0, context=context(args),
                                       kv_cache_gib=0.5, max_tokens_per_step=512))
    out = {"exact": engine.exact, "ops": engine.info.ops, "packed": packed_bytes()}
    greedy = dict(temperature=0, ignore_eos=True, draft=False)
    engine.generate(prompt_ids(8), SamplingParams(max_tokens=2, **greedy))  # warm-up

    def once() -> None:
        done = engine.generate(prompt_ids(16), SamplingParams(max_tokens=args.tokens, **greedy))
        out["decode"] = max(out.get("decode", 0), (args.tokens - 1) / done.request.stats.decode_s)
        done = engine.generate(prompt_ids(args.prefill_tokens), SamplingParams(max_tokens=1, **greedy))
        out["prefill"] = max(out.get("prefill", 0), args.prefill_tokens / done.request.stats.prefill_s)
        out["four"] = max(out.get("four", 0), streams_decode_tps(engine, 4, args.tokens))
        long_round(engine, args, out)
    return out, once, engine


def context(args) -> int:
    return max(2048, args.long + args.tokens + 16)


def llama_cpp_bench(path: str, args):
    if not peer_llama_cpp.available():
        print(peer_llama_cpp.SKIP_MESSAGE)
        return {}, (lambda: None)
    llm = peer_llama_cpp.load(path, n_ctx=context(args), threads=args.threads)
    out = {}

    def once() -> None:
        peer_round(llm, args, out)
        peer_long_round(llm, args, out)
    return out, once


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-1b", choices=list(SHAPES))
    p.add_argument("--types", default="q4_k_m,q4_0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--long", type=int, default=0, help="also a prompt of this many tokens (0: off)")
    p.add_argument("--no-load", action="store_true", help="skip the load table (speed only)")
    p.add_argument("--load-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.load_child:
        print(json.dumps(load_child(args.load_child, args.threads)))
        return
    print(machine_line())
    read = ReadRate(args.threads)
    bandwidth = read.best()
    print(f"read bandwidth at the start: {bandwidth:.1f} GB/s ({args.threads} threads)")
    load_rows, speeds = [], []  # speeds: a file's cells before and after its two "of read" cells
    for qtype in args.types.split(","):
        path = real_shape_gguf(args.shape, qtype)
        name = os.path.basename(path)
        file_mib, matrix_bytes = os.path.getsize(path) / 2**20, tensor_bytes(path)
        ld = None if args.no_load else measure_load(path, args.threads)
        if ld:
            load_rows.append([name, fmt(file_mib, 0), fmt(ld["load_s"], 1), fmt(ld["runtime"], 0), fmt(ld["peak"], 0),
                              fmt(ld["packed"] / 2**20, 0), fmt(ld["cache"], 0),
                              fmt(ld["peak"] - ld["packed"] / 2**20 - ld["cache"] - ld["runtime"], 0),
                              f"{ld['packed'] / matrix_bytes:.3f}x"])
        ours, ours_once, engine = tensorfold_bench(path, args)
        peer, peer_once = llama_cpp_bench(path, args)
        for _ in range(args.repeats):
            ours_once()
            peer_once()
            bandwidth = max(bandwidth, read.best(3))
        gbs = ours["packed"] * ours["decode"] / 1e9
        peer_gbs = matrix_bytes * peer["decode"] / 1e9 if peer.get("decode") else None
        head = [name, ours["ops"], ours["exact"], fmt(ours["decode"], 1), fmt(peer.get("decode"), 1),
                ratio(ours["decode"], peer.get("decode")), fmt(gbs, 1)]
        tail = [fmt(ours["prefill"], 0), fmt(peer.get("prefill"), 0), ratio(ours["prefill"], peer.get("prefill")),
                fmt(ours["four"], 1), fmt(peer.get("four"), 1), ratio(ours["four"], peer.get("four")),
                f"{ours['four'] / ours['decode']:.2f}x"]
        if args.long:
            tail += [fmt(ours["long_prefill"], 0), fmt(peer.get("long_prefill"), 0),
                     ratio(ours["long_prefill"], peer.get("long_prefill")), fmt(ours["long_decode"], 1),
                     fmt(peer.get("long_decode"), 1), ratio(ours["long_decode"], peer.get("long_decode"))]
        speeds.append((head, gbs, peer_gbs, tail))
        del engine, ours_once, peer_once
        gc.collect()
    if load_rows:
        print_table(["file", "MiB", "load s", "runtime RSS MiB", "peak RSS MiB", "packed MiB", "cache MiB",
                     "peak - packed - cache - runtime", "resident / file"], load_rows,
                    f"load, a fresh process each, {args.threads} threads")
    print(f"read bandwidth, the best reading beside the repeats: {bandwidth:.1f} GB/s")
    share = (lambda gbs: f"{100 * gbs / bandwidth:.0f}%" if gbs else "-")  # of the run's best reading
    speed_rows = [head + [share(gbs), share(peer_gbs)] + tail for head, gbs, peer_gbs, tail in speeds]
    print_table(["file", "ops", "exact", "decode tok/s", "llama.cpp", "ratio", "decode GB/s", "of read", "llama.cpp of read",
                 f"prefill {args.prefill_tokens} tok/s", "llama.cpp", "ratio", "4 streams tok/s", "llama.cpp", "ratio",
                 "4 / 1 streams"] + ([f"prefill {args.long} tok/s", "llama.cpp", "ratio", f"decode @{args.long}",
                                      "llama.cpp", "ratio"] if args.long else []), speed_rows,
                f"{args.threads} threads, {args.tokens} new tokens, best of {args.repeats}, engines alternating")


if __name__ == "__main__":
    main()
