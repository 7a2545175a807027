"""What exactness costs on the CPU: each exact op as the compiled kernel (csrc/cpu), as its torch
reference, and next to its stock torch counterpart.

    python tools/bench_exact.py                # SmolLM2-135M shapes (9 heads over 3, head_dim 64), 2 threads
    python tools/bench_exact.py --threads 1

The exact ops (tensorfold/exact's rule: integer sums, own exp/log) are what the cpu backend runs
and what the Triton kernels reproduce bit for bit: the cpu backend runs them compiled (the C++
column, tensorfold._cpu: the reference's bits) and falls back to the torch references (the
reference column) without a compiler. Their stock counterparts compute the same function the
usual way (SDPA over gathered pages, a textbook RMSNorm, libm exp/log, a plain cache write,
F.linear) and are neither batch invariant nor equal to a GPU kernel. Each time is the best of
--repeats medians of --runs calls (a tenth of them for prefill and the reference GEMM) after
--warmup calls; the ratios are C++ / stock and reference / stock. Without the extension the C++
column reads "-".
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tensorfold.exact import float64  # noqa: E402
from tensorfold.kernels import reference  # noqa: E402
from tensorfold.kernels.paged_attention import (paged_attention_ref, paged_decode_attention_ref,  # noqa: E402
                                                write_kv_ref)
from tools.bench_core import cpu_model, loadavg, print_table  # noqa: E402

try:
    from tensorfold import _cpu  # noqa: E402
except ImportError:  # no compiler at install: the references only
    _cpu = None

HEADS, KV_HEADS, HEAD_DIM, PAGE, HIDDEN, INTERMEDIATE = 9, 3, 64, 32, 576, 1536


def best_ms(fn, runs: int, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    medians = []
    for _ in range(repeats):
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        medians.append(statistics.median(times))
    return min(medians) * 1e3


def attention_cases(dtype):
    """(label, reference fn, stock fn, C++ fn or None) for decode, batched decode and prefill chunks."""
    blocks = 160  # 5,120 positions
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(blocks, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    write_kv_ref(k_cache, v_cache, torch.randn(blocks * PAGE, KV_HEADS, HEAD_DIM, generator=gen),
                 torch.randn(blocks * PAGE, KV_HEADS, HEAD_DIM, generator=gen), torch.arange(blocks * PAGE))
    table = torch.randperm(blocks, generator=gen)

    def native(q, pos, tables, starts):
        if _cpu is None:
            return None
        tables, starts = torch.stack(tables), torch.tensor(starts)
        return lambda: _cpu.paged_attention(q, k_cache, v_cache, pos, tables, starts, 0.125, 0)

    def stock(q, ctx, rows):
        k = k_cache[table].flatten(0, 1)[:ctx].transpose(0, 1).float()  # [KVH, ctx, D]
        v = v_cache[table].flatten(0, 1)[:ctx].transpose(0, 1).float()
        mask = torch.ones(rows, ctx, dtype=torch.bool).tril(ctx - rows)
        return F.scaled_dot_product_attention(q.transpose(0, 1).float(), k, v, attn_mask=mask, enable_gqa=True)

    cases = []
    for ctx in (128, 1024, 4096):
        q = torch.randn(1, HEADS, HEAD_DIM, generator=gen).to(dtype)
        pos = torch.tensor([ctx - 1])
        cases.append((f"attention decode, ctx {ctx}",
                      lambda q=q, pos=pos: paged_attention_ref(q, k_cache, v_cache, pos, table, 0.125),
                      lambda q=q, ctx=ctx: stock(q, ctx, 1), native(q, pos, [table], [0, 1])))
    q8 = torch.randn(8, HEADS, HEAD_DIM, generator=gen).to(dtype)
    tables = [table.roll(i) for i in range(8)]
    pos8 = torch.full((8,), 1023)
    cases.append(("attention decode, 8 sequences, ctx 1024",
                  lambda: paged_decode_attention_ref(q8, k_cache, v_cache, pos8, tables, 0.125),
                  lambda: [stock(q8[i:i + 1], 1024, 1) for i in range(8)],
                  native(q8, pos8, tables, list(range(9)))))
    for ctx in (512, 2048):
        q = torch.randn(512, HEADS, HEAD_DIM, generator=gen).to(dtype)
        pos = torch.arange(ctx - 512, ctx)
        cases.append((f"attention prefill chunk 512 rows, ctx {ctx}",
                      lambda q=q, pos=pos: paged_attention_ref(q, k_cache, v_cache, pos, table, 0.125),
                      lambda q=q, ctx=ctx: stock(q, ctx, 512), native(q, pos, [table], [0, 512])))
    return cases


def other_cases(dtype):
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(64, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype)
    cache_v = torch.zeros_like(cache)
    flat_k, flat_v = cache.view(-1, KV_HEADS, HEAD_DIM), cache_v.view(-1, KV_HEADS, HEAD_DIM)
    cases = []
    for n in (1, 512):
        k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
        slots = torch.arange(n)

        def plain(k=k, v=v, slots=slots):
            flat_k[slots] = k.to(dtype)
            flat_v[slots] = v.to(dtype)
        cases.append((f"cache write, {n} token(s)",
                      lambda k=k, v=v, s=slots: write_kv_ref(cache, cache_v, k, v, s), plain,
                      _cpu and (lambda k=k.to(dtype), v=v.to(dtype), s=slots: _cpu.write_kv(cache, cache_v, k, v, s))))
    weight = torch.randn(HIDDEN, generator=gen).to(dtype)
    for n in (1, 512):
        x = torch.randn(n, HIDDEN, generator=gen).to(dtype)

        def textbook(x=x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(dtype)
        cases.append((f"rms_norm, {n} x {HIDDEN}", lambda x=x: reference.rms_norm(x, weight, 1e-5), textbook,
                      _cpu and (lambda x=x: _cpu.rms_norm(x, weight, 1e-5))))
        gate, up = (torch.randn(n, INTERMEDIATE, generator=gen).to(dtype) for _ in range(2))
        cases.append((f"silu_and_mul, {n} x {INTERMEDIATE}", lambda g=gate, u=up: reference.silu_and_mul(g, u),
                      lambda g=gate, u=up: F.silu(g) * u, _cpu and (lambda g=gate, u=up: _cpu.silu_and_mul(g, u))))
    w = torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen).to(dtype)  # gate_up
    packed = _cpu.pack_weight(w) if _cpu else None
    for n in (1, 16):
        x = torch.randn(n, HIDDEN, generator=gen).to(dtype)
        cases.append((f"linear (gate_up), {n} x {HIDDEN} -> {2 * INTERMEDIATE}", lambda x=x: reference.linear(x, w),
                      lambda x=x: F.linear(x, w),
                      _cpu and (lambda x=x: _cpu.linear_packed(x, packed, 2 * INTERMEDIATE, HIDDEN))))
    z = -torch.rand(8, 49152, generator=gen, dtype=torch.float64) * 40
    u = torch.rand(8, 49152, generator=gen, dtype=torch.float64)
    cases.append(("exp64 (sampler weights), 8 x 49,152", lambda: float64.exp64(z), lambda: torch.exp(z),
                  _cpu and (lambda: _cpu.exp64(z))))
    cases.append(("log64 (Gumbel noise, once), 8 x 49,152", lambda: float64.log64(u), lambda: torch.log(u),
                  _cpu and (lambda: _cpu.log64(u))))
    return cases


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=30, help="calls per median")
    p.add_argument("--repeats", type=int, default=3, help="medians per row; the table shows the best")
    p.add_argument("--warmup", type=int, default=3, help="calls before the timed ones")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"bench_exact: {cpu_model()}, torch {torch.__version__}, {args.threads} threads; "
          f"load average {loadavg()}")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for label, reference_fn, stock_fn, native_fn in attention_cases(dtype) + other_cases(dtype):
            runs = max(1, args.runs // 10) if "prefill" in label or "linear" in label else args.runs
            ms_reference = best_ms(reference_fn, runs, args.repeats, args.warmup)
            ms_stock = best_ms(stock_fn, runs, args.repeats, args.warmup)
            ms_native = best_ms(native_fn, args.runs, args.repeats, args.warmup) if native_fn else None
            native = ms_native is not None
            rows.append([label, str(dtype).removeprefix("torch."),
                         f"{ms_native:.3f}" if native else "-", f"{ms_reference:.3f}", f"{ms_stock:.3f}",
                         f"{ms_native / ms_stock:.2f}x" if native else "-", f"{ms_reference / ms_stock:.2f}x"])
    print()
    print_table(["op", "dtype", "C++ ms", "reference ms", "stock ms", "C++ / stock", "reference / stock"], rows)
    print(f"\nload average after the run: {loadavg()}")


if __name__ == "__main__":
    main()
