"""Microbenchmarks of the Triton kernels at model-like sizes, next to torch.

    python tools/bench_kernels.py            # on a CUDA GPU: a markdown table
    python tools/bench_kernels.py --smoke    # anywhere: tiny sizes in Triton's interpreter, to
                                             # check this script runs (the times mean nothing)

Each row: the median of many runs timed with CUDA events (the launcher's host work included, as
the engine pays it), the bytes or FLOPs the op must move or do, the achieved GB/s or TFLOP/s and
that rate as a fraction of the device's measured ceiling (a large device-to-device copy for
bandwidth, a large bf16 matmul for compute), then the same for the torch counterpart: the
reference op on CUDA tensors (attention, rms_norm, rope: the same bits as the kernel), stock SDPA
over gathered pages for attention as well (not exact: what a plain port would pay), and the
reference sampler on the CPU.
Without a GPU (and without --smoke) it says so and exits 0.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class Timer:
    """Median milliseconds of `fn` over `runs` calls after `warmup`: CUDA events on a GPU,
    wall clock in smoke mode."""

    def __init__(self, torch, device: str, runs: int, warmup: int):
        self.torch, self.device, self.runs, self.warmup = torch, device, runs, warmup

    def __call__(self, fn) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.runs):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)


def ceilings(torch, timer: Timer, device: str, smoke: bool) -> tuple[float, float]:
    """(bytes/s of a large copy, FLOP/s of a large bf16 matmul) measured on this device."""
    n = (1 << 20) if smoke else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    m = 256 if smoke else 8192
    a = torch.randn(m, m, device=device).to(torch.bfloat16)
    b = torch.randn(m, m, device=device).to(torch.bfloat16)
    mm_ms = timer(lambda: a @ b)
    return 2 * n / (copy_ms * 1e-3), 2 * m ** 3 / (mm_ms * 1e-3)


def rate(amount: float, ms: float, ceiling: float, unit: str) -> str:
    per_s = amount / (ms * 1e-3)
    scale = 1e9 if unit == "GB/s" else 1e12
    return f"{per_s / scale:.1f} {unit} ({per_s / ceiling:.0%})"


def benchmarks(torch, device: str, smoke: bool):
    """(name, kernel fn, torch name, torch fn, amount, unit) for each kernel at its sizes."""
    import torch.nn.functional as F

    from tensorfold.kernels import attention_triton, reference, rms_norm_triton, sampling_triton, verify_triton
    from tensorfold.kernels.paged_attention import paged_attention_ref, write_kv_ref
    from tensorfold.sampling import bitmask as bits, sampler
    from tensorfold.sampling.params import RowSampling

    s = (lambda big, small: small) if smoke else (lambda big, small: big)  # noqa: E731
    bf16 = torch.bfloat16
    out = []

    # Attention: Llama-3-8B-like heads (32 query, 8 KV, head_dim 128), bf16 cache in 16-token pages.
    heads, kv_heads, d, page = s(32, 4), s(8, 2), s(128, 16), 16
    for label, num_seqs, rows_per_seq, ctx in [("decode", s(32, 2), 1, s(4096, 64)),
                                               ("verify 5 rows", s(32, 2), 5, s(4096, 64)),
                                               ("prefill chunk", 1, s(2048, 32), s(2048, 32))]:
        blocks_per_seq = -(-ctx // page)
        k = torch.zeros(num_seqs * blocks_per_seq, page, kv_heads, d, device=device).to(bf16)
        v = torch.zeros_like(k)
        slots = torch.arange(k.shape[0] * page, device=device)  # every vector on its grid, as served
        write_kv_ref(k, v, torch.randn(len(slots), kv_heads, d, device=device),
                     torch.randn(len(slots), kv_heads, d, device=device), slots)
        tables = torch.arange(num_seqs * blocks_per_seq, device=device).view(num_seqs, -1)
        q = torch.randn(num_seqs * rows_per_seq, heads, d, device=device).to(bf16)
        positions = torch.cat([torch.arange(ctx - rows_per_seq, ctx)] * num_seqs).to(device)
        starts = [i * rows_per_seq for i in range(num_seqs + 1)]
        kwargs = {} if not smoke else dict(block_m=16, block_n=16, split_size=32)

        def kernel(q=q, k=k, v=v, positions=positions, tables=tables, starts=starts, kwargs=kwargs):
            return attention_triton.paged_attention_varlen(q, k, v, positions, tables, starts, d ** -0.5,
                                                           **kwargs)

        def stock(q=q, k=k, v=v, tables=tables, num_seqs=num_seqs, rows=rows_per_seq, ctx=ctx):
            kk = k[tables].flatten(1, 2)[:, :ctx].transpose(1, 2)  # [seqs, kv_heads, ctx, d]
            vv = v[tables].flatten(1, 2)[:, :ctx].transpose(1, 2)
            qq = q.view(num_seqs, rows, heads, d).transpose(1, 2)
            mask = torch.ones(rows, ctx, dtype=torch.bool, device=q.device).tril(ctx - rows)
            F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)

        if label == "prefill chunk":
            amount, unit = 4 * heads * d * rows_per_seq * (ctx - rows_per_seq / 2) * num_seqs, "TFLOP/s"
        else:
            amount, unit = 2 * k.element_size() * num_seqs * ctx * kv_heads * d, "GB/s"
        def ref(q=q, k=k, v=v, positions=positions, tables=tables, rows=rows_per_seq):
            return torch.cat([paged_attention_ref(q[i * rows:(i + 1) * rows], k, v,
                                                  positions[i * rows:(i + 1) * rows], tables[i], d ** -0.5)
                              for i in range(len(tables))])

        same = "bitwise equal" if torch.equal(kernel(), ref()) else "DIFFERENT BITS"
        name = f"attention {label} ({num_seqs}x{rows_per_seq} rows, ctx {ctx}; {same})"
        out.append((name, kernel, "paged_attention_ref (same bits)", ref, amount, unit))
        out.append((name, kernel, "SDPA, gathered pages (not exact)", stock, amount, unit))

    # RMSNorm (+ residual) and rope on 8B-like rows.
    rows, hidden = s(4096, 8), s(4096, 64)
    x = torch.randn(rows, hidden, device=device).to(bf16)
    res, w = torch.randn_like(x), torch.randn(hidden, device=device).to(bf16)
    nbytes = 2 * x.numel() * x.element_size()
    out.append((f"rms_norm ({rows}x{hidden} bf16)", lambda: rms_norm_triton.rms_norm(x, w, 1e-6),
                "reference.rms_norm", lambda: reference.rms_norm(x, w, 1e-6), nbytes, "GB/s"))
    out.append((f"add_rms_norm ({rows}x{hidden} bf16)", lambda: rms_norm_triton.add_rms_norm(x, res, w, 1e-6),
                "add + reference.rms_norm", lambda: reference.rms_norm(res + x, w, 1e-6),
                2 * nbytes, "GB/s"))
    qh = torch.randn(rows, heads, d, device=device).to(bf16)
    cos, sin = reference.rope_table([10000.0 ** (-2 * i / d) for i in range(d // 2)], 1.0, rows)
    cos, sin = cos.to(device), sin.to(device)
    out.append((f"apply_rope ({rows}x{heads}x{d} bf16)", lambda: rms_norm_triton.apply_rope(qh, cos, sin),
                "reference.apply_rope", lambda: reference.apply_rope(qh, cos, sin),
                2 * qh.numel() * qh.element_size() + 2 * cos.numel() * 4, "GB/s"))

    # The exact quantized GEMM on q8_0 blocks of an 8B-like matrix: one decode row (bound by the
    # weights' bytes) and a prefill chunk, against cuBLAS on the same matrix in bf16.
    from tensorfold.kernels import quant_gemm as qg, quant_gemm_triton as qt
    n, kdim = s(4096, 64), s(4096, 64)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (n, kdim), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, kdim // 32, generator=gen) * 2e-4 + 1e-4).half()
    qw = qg.from_legacy("q8_0", codes, scales)
    packed = qt.pack_quant_weight(qw.to(device))
    dense = (codes.float() * scales.float().repeat_interleave(32, dim=1)).to(bf16).to(device)
    for rows_ in (1, s(512, 8)):
        xq = torch.randn(rows_, kdim, device=device)
        same = "bitwise equal" if torch.equal(qt.quant_linear(xq, packed).cpu(), qg.linear(xq.cpu(), qw)) else "DIFFERENT BITS"
        amount, unit = ((n * kdim * 34 / 32, "GB/s") if rows_ == 1 else (2 * rows_ * n * kdim, "TFLOP/s"))
        out.append((f"quant_linear q8_0 ({rows_}x{kdim} @ {n}x{kdim}; {same} to quant_gemm.linear)",
                    lambda xq=xq: qt.quant_linear(xq, packed), "F.linear bf16 (cuBLAS, not exact)",
                    lambda xq=xq: F.linear(xq.to(bf16), dense), amount, unit))

    # The dense GEMM (Triton, fixed tiles: batch invariant) on the same matrix in bf16, against cuBLAS.
    from tensorfold.kernels.dense_gemm_triton import dense_linear
    for rows_ in (1, s(512, 8)):
        xb = torch.randn(rows_, kdim, device=device).to(bf16)
        amount, unit = ((n * kdim * 2, "GB/s") if rows_ == 1 else (2 * rows_ * n * kdim, "TFLOP/s"))
        out.append((f"dense_linear bf16 ({rows_}x{kdim} @ {n}x{kdim}; batch invariant)",
                    lambda xb=xb: dense_linear(xb, dense), "F.linear bf16 (cuBLAS, not invariant)",
                    lambda xb=xb: F.linear(xb, dense), amount, unit))

    # Sampling and verification over a Qwen-sized vocabulary.
    vocab = s(151936, 300)
    num_rows = s(64, 4)
    logits = torch.randn(num_rows, vocab, device=device) * 3
    logits_cpu = logits.cpu()
    small = {} if not smoke else dict(num_candidates=16, chunk=64)
    for label, settings in [("greedy", (0.0, 0, 1.0, 0.0)), ("temperature + min_p", (0.8, 0, 1.0, 0.05)),
                            ("top-k 50 + top-p 0.9", (0.8, 50, 0.9, 0.0))]:
        rows_ = [RowSampling(*settings, seed=7, position=i) for i in range(num_rows)]
        out.append((f"sample {label} ({num_rows}x{vocab})",
                    lambda rows_=rows_: sampling_triton.sample(logits, rows_, **small),
                    "sampler.sample on the CPU",
                    lambda rows_=rows_: sampler.sample(logits_cpu, rows_, small.get("num_candidates", 1024)),
                    logits.numel() * 4, "GB/s"))
    bitmask = bits.pack(torch.rand(num_rows, vocab, device=device) > 0.5)
    paths = list(range(0, num_rows + 1, 4 if smoke else 8))
    vrows = [RowSampling(0.0, 0, 1.0, 0.0, seed=7, position=i) for i in range(num_rows)]
    drafts = [-1] * num_rows
    out.append((f"verify greedy + grammar ({num_rows} rows in {len(paths) - 1} paths)",
                lambda: verify_triton.verify(logits, bitmask, drafts, paths, vrows),
                "verify_ref on the CPU",
                lambda: verify_triton.verify_ref(logits_cpu, bitmask.cpu(), drafts, paths, vrows),
                logits.numel() * 4 + bitmask.numel() * 4, "GB/s"))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes in the interpreter, on the CPU")
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU here; nothing to time (try --smoke to check the script).")
        return 0
    device = "cpu" if args.smoke else "cuda"
    runs = 3 if args.smoke else args.runs
    timer = Timer(torch, device, runs, warmup=1 if args.smoke else 5)
    bandwidth, compute = ceilings(torch, timer, device, args.smoke)
    name = "CPU (smoke run: interpreter, times meaningless)" if args.smoke else torch.cuda.get_device_name()
    print(f"{name}: measured ceilings {bandwidth / 1e9:.0f} GB/s (copy), "
          f"{compute / 1e12:.0f} TFLOP/s (bf16 matmul); median of {runs} runs\n")
    print("| kernel | ms | achieved | torch counterpart | ms | achieved |")
    print("|---|---|---|---|---|---|")
    slow_timer = Timer(torch, device, max(1, runs // 10), warmup=1)
    with gpu_semantics(args.smoke):
        for label, kernel, ref_label, ref, amount, unit in benchmarks(torch, device, args.smoke):
            ceiling = bandwidth if unit == "GB/s" else compute
            ms = timer(kernel)
            ref_ms = (slow_timer if "CPU" in ref_label else timer)(ref)
            print(f"| {label} | {ms:.3f} | {rate(amount, ms, ceiling, unit)} | {ref_label} | {ref_ms:.3f} | "
                  f"{rate(amount, ref_ms, ceiling, unit)} |", flush=True)
    return 0


def gpu_semantics(smoke: bool):
    """In a smoke run, the test suite's interpreter patches (its bf16 casts truncate, where a GPU
    rounds), so the bitwise check in the attention rows means what it means on a GPU."""
    import contextlib
    if not smoke:
        return contextlib.nullcontext()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from triton_interpreter import gpu_semantics as patched
    return patched()


if __name__ == "__main__":
    sys.exit(main())
