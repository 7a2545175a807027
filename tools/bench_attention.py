"""The cpu backend's exact decode attention alone: one query row over a long cached prefix.

    python tools/bench_attention.py                    # 3,514 keys, the default model's shapes
    python tools/bench_attention.py --keys 8192 --cache float32 --threads 1

Times `_cpu.paged_attention` for one decode row (--heads query heads over --kv-heads KV heads,
--head-dim), one call per layer with --layers separate caches cycled, so each call reads its
cache from memory as a decode step does (a step's other layers pass in between). Each cache's
blocks are laid out in order, as a fresh pool hands them out, and each has the record of its V
rows' exponents that the engine's cache keeps (LayerKV.v_exp; --no-record: without it, the V rows
are read twice). Prints ms per call, the best of --repeats rounds over all layers, and the bytes
of K and V each call reads. Set PYTHONPATH to another checkout's root to time its build the same
way.
"""
import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=3514)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--q", default="float32", choices=["float32", "bfloat16"], help="the activations' dtype")
    p.add_argument("--cache", default="bfloat16", choices=["float32", "bfloat16"], help="the KV cache's dtype")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--no-record", action="store_true", help="caches without the record of V's exponents")
    args = p.parse_args()

    from tensorfold import _cpu
    from tensorfold.kernels.paged_attention import write_kv_ref

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    q_dtype, cache_dtype = getattr(torch, args.q), getattr(torch, args.cache)
    blocks = -(-args.keys // args.block_size)
    shape = (blocks, args.block_size, args.kv_heads, args.head_dim)
    slots = torch.arange(blocks * args.block_size)
    caches = []
    for _ in range(args.layers):
        k, v = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
        record = None if args.no_record else torch.zeros(shape[:3], dtype=torch.int16)
        kv = [torch.randn(len(slots), args.kv_heads, args.head_dim, generator=gen).to(q_dtype) for _ in range(2)]
        write_kv_ref(k, v, *kv, slots, v_exp=record)
        caches.append((k, v, record))
    q = torch.randn(1, args.heads, args.head_dim, generator=gen).to(q_dtype)
    positions, table, starts = torch.tensor([args.keys - 1]), torch.arange(blocks).view(1, -1), torch.tensor([0, 1])

    def round_s() -> float:
        started = time.perf_counter()
        for k, v, record in caches:
            _cpu.paged_attention(q, k, v, positions, table, starts, args.head_dim ** -0.5, 0, v_exp=record)
        return time.perf_counter() - started

    round_s()
    best = min(round_s() for _ in range(args.repeats))
    read = 2 * args.keys * args.kv_heads * args.head_dim * torch.finfo(cache_dtype).bits // 8
    print(f"{_cpu.isa()}, {args.threads} threads: one row of {args.heads}/{args.kv_heads} heads x {args.head_dim} "
          f"over {args.keys} keys, q {args.q}, cache {args.cache}{'' if args.no_record else ' (with its record)'}: "
          f"{best / args.layers * 1e3:.3f} ms per call "
          f"(best of {args.repeats} rounds over {args.layers} layers; K and V {read / 2**20:.2f} MiB per call)")


if __name__ == "__main__":
    main()
