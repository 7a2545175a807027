"""The cpu backend against llama.cpp on the same weights and precision, in one run (issue 10).

    python tools/bench_native.py                       # fp32 and bf16, 2 threads
    python tools/bench_native.py --dtypes bfloat16 --long 3514
    python tools/bench_native.py --dtypes auto          # the Q4_1 file served in its blocks

For each dtype: TensorFold's engine on the default model (the compiled op set, exact mode)
next to llama.cpp (llama-cpp-python, a peer only; the column is skipped with a message when it
is not installed) on a GGUF of the same weights in the same precision (tools/peer_gguf.py writes
the F32 and BF16 files from the default Q4_1 one; `auto`, the blocks as stored, runs against the
Q4_1 file itself), llama.cpp's KV cache in the dtype of ours (float32 or bfloat16; its own
default, float16, halves what a float32 row's attention reads: --peer-kv default). Best of
--repeats runs each (other processes only ever slow a run down), the two engines' runs
alternating. Columns:
- decode: single-stream greedy tokens/s after a short prompt, drafting off on both sides;
- prefill: a --prefill-token prompt (one 512-row chunk), tokens/s;
- 4 streams: aggregate decode tokens/s of 4 concurrent requests, next to llama.cpp decoding 4
  sequences in one batch per step (its own parallel-sequence API, as llama-server's slots do);
  then each engine's 4 streams over its own one stream;
- Python: the engine's own time per decode round (scheduling, batch building, bookkeeping,
  detokenizing: the round minus the model's forward and the draw), as a share of the round.
--long N adds a prompt of N tokens: its prefill, then decode at that depth.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools import peer_llama_cpp  # noqa: E402
from tools.bench_core import fmt, machine_line, print_table  # noqa: E402


def prompt_ids(n: int, offset: int = 0) -> list[int]:
    return peer_llama_cpp.arbitrary_prompt(n + offset)[offset:]


class RoundClock:
    """Splits the engine's decode rounds into forward + draw and everything else."""

    def __init__(self, engine):
        self.forward_s = self.round_s = 0.0
        model = engine.backend.model
        model.forward = self._timed(model.forward)
        model.ops = _with(model.ops, sample=self._timed(model.ops.sample))

    def _timed(self, fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.forward_s += time.perf_counter() - t
        return run

    def python_share(self) -> float:
        return 1.0 - self.forward_s / self.round_s


def _with(ops, **overrides):
    import types
    names = {n: getattr(ops, n) for n in dir(ops) if not n.startswith("_")}
    return types.SimpleNamespace(**{**names, **overrides})


def tensorfold_bench(dtype: str, args):
    """The engine on the default model in `dtype`; returns (out, once): each once() runs every
    measurement one more time, keeping the best in out."""
    import torch

    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    context = max(2048, args.long + args.tokens + 16)
    engine = Engine(None, EngineConfig(dtype=dtype, kv_dtype=getattr(args, "kv_dtype", "auto"), num_threads=args.threads, prompt_cache_gib=0,
                                       context=context, kv_cache_gib=0.5, max_tokens_per_step=512))
    cache = engine.info.kv_dtype
    out = {"exact": engine.exact, "ops": f"{engine.info.ops}, {cache}", "cache": cache}
    greedy = dict(temperature=0, ignore_eos=True, draft=False)
    engine.generate(prompt_ids(8), SamplingParams(max_tokens=2, **greedy))  # warm-up
    clock = RoundClock(engine)

    def once() -> None:
        clock.forward_s = clock.round_s = 0.0
        rid = engine.add_request(prompt_ids(16), SamplingParams(max_tokens=args.tokens, **greedy))
        req = engine.requests[rid]
        engine.step()  # the prompt
        clock.forward_s = 0.0
        started = time.perf_counter()
        while engine.has_work():
            engine.step()
        clock.round_s = time.perf_counter() - started
        out["decode"] = max(out.get("decode", 0), (args.tokens - 1) / clock.round_s)
        out["python"] = min(out.get("python", 1), clock.python_share())
        assert len(req.output_ids) == args.tokens

        done = engine.generate(prompt_ids(args.prefill_tokens), SamplingParams(max_tokens=1, **greedy))
        out["prefill"] = max(out.get("prefill", 0), args.prefill_tokens / done.request.stats.prefill_s)

        out["four"] = max(out.get("four", 0), streams_decode_tps(engine, 4, args.tokens))

        long_round(engine, args, out)
    return out, once


def long_round(engine, args, out: dict) -> None:
    """With --long N: the engine's prefill of an N-token prompt and its greedy decode at that depth,
    each kept in `out` where it beats the best so far."""
    from tensorfold.sampling.params import SamplingParams

    if not args.long:
        return
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, draft=False)
    s = engine.generate(prompt_ids(args.long), params).request.stats
    out["long_prefill"] = max(out.get("long_prefill", 0), args.long / s.prefill_s)
    out["long_decode"] = max(out.get("long_decode", 0), (args.tokens - 1) / s.decode_s)


def streams_decode_tps(engine, streams: int, tokens: int) -> float:
    """Aggregate greedy decode tokens/s of `streams` requests decoding side by side (drafting off,
    16-token prompts, prefilled first and not timed), `tokens` new tokens each."""
    from tensorfold.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, draft=False)
    ids = [engine.add_request(prompt_ids(16, offset=100 * i), params) for i in range(streams)]
    while any(engine.requests[i].num_computed_tokens < 16 for i in ids if i in engine.requests):
        engine.step()
    started = time.perf_counter()
    while engine.has_work():
        engine.step()
    return streams * (tokens - 1) / (time.perf_counter() - started)


def peer_round(llm, args, out: dict, kv_dtype: str = peer_llama_cpp.DEFAULT_KV) -> None:
    """One more of llama.cpp's decode (16-token prompt), prefill (--prefill-tokens) and four
    streams' aggregate decode, each kept in `out` where it beats the best so far."""
    out["decode"] = max(out.get("decode", 0), peer_llama_cpp.decode_tps(llm, prompt_ids(16), args.tokens))
    out["prefill"] = max(out.get("prefill", 0), args.prefill_tokens /
                         peer_llama_cpp.prefill_seconds(llm, prompt_ids(args.prefill_tokens)))
    out["four"] = max(out.get("four", 0), peer_llama_cpp.streams_decode_tps(
        llm, [prompt_ids(16, offset=100 * i) for i in range(4)], args.tokens, kv_dtype))


def peer_long_round(llm, args, out: dict) -> None:
    """long_round's two numbers for llama.cpp."""
    if not args.long:
        return
    out["long_prefill"] = max(out.get("long_prefill", 0),
                              args.long / peer_llama_cpp.prefill_seconds(llm, prompt_ids(args.long)))
    out["long_decode"] = max(out.get("long_decode", 0),
                             peer_llama_cpp.decode_tps(llm, prompt_ids(args.long), args.tokens))


def llama_cpp_bench(dtype: str, args, kv_dtype: str = peer_llama_cpp.DEFAULT_KV):
    """llama.cpp on the same weights in the same precision, its KV cache in kv_dtype (ours);
    (out, once) as tensorfold_bench, or None when llama-cpp-python is not installed."""
    if not peer_llama_cpp.available():
        print(peer_llama_cpp.SKIP_MESSAGE)
        return None
    from tensorfold.models.gguf_file import default_model_path
    from tools.peer_gguf import peer_gguf

    path = default_model_path() if dtype == "auto" else peer_gguf(dtype)  # auto: the Q4_1 file as it is
    llm = peer_llama_cpp.load(path, n_ctx=max(2048, args.long + args.tokens + 16), threads=args.threads,
                              kv_dtype=kv_dtype)
    out = {"kv": kv_dtype}

    def once() -> None:
        peer_round(llm, args, out, kv_dtype)
        peer_long_round(llm, args, out)
    return out, once


def measure(dtype: str, args) -> tuple[dict, dict]:
    """Both engines, their runs alternating (ours, the peer's, ours, ...): drift on a shared
    machine then weighs on both columns alike instead of on whichever ran later."""
    ours, ours_once = tensorfold_bench(dtype, args)
    match = getattr(args, "peer_kv", "match") == "match"
    peer_bench = llama_cpp_bench(dtype, args, ours["cache"] if match else peer_llama_cpp.DEFAULT_KV)
    peer, peer_once = peer_bench if peer_bench else ({}, lambda: None)
    for _ in range(args.repeats):
        ours_once()
        peer_once()
    return ours, peer


def ratio(ours, peer):
    return f"{ours / peer:.2f}x" if peer else "-"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--long", type=int, default=0, help="also a prompt of this many tokens (0: off)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="TensorFold's KV cache (auto: bfloat16 under dtype auto, else the dtype)")
    p.add_argument("--peer-kv", default="match", choices=["match", "default"],
                   help="llama.cpp's KV cache: match (the dtype of TensorFold's) or default (float16)")
    args = p.parse_args(argv)
    print(machine_line())
    rows = []
    for dtype in args.dtypes.split(","):
        ours, peer = measure(dtype, args)
        row = [dtype, ours["ops"], ours["exact"], peer.get("kv", "-"),
               fmt(ours["decode"], 1), fmt(peer.get("decode"), 1), ratio(ours["decode"], peer.get("decode")),
               fmt(ours["prefill"], 0), fmt(peer.get("prefill"), 0), ratio(ours["prefill"], peer.get("prefill")),
               fmt(ours["four"], 1), fmt(peer.get("four"), 1), ratio(ours["four"], peer.get("four")),
               f"{ours['four'] / ours['decode']:.2f}x", ratio(peer.get("four", 0), peer.get("decode")),
               f"{100 * ours['python']:.1f}%"]
        if args.long:
            row += [fmt(ours["long_prefill"], 0), fmt(peer.get("long_prefill"), 0),
                    ratio(ours["long_prefill"], peer.get("long_prefill")), fmt(ours["long_decode"], 1),
                    fmt(peer.get("long_decode"), 1), ratio(ours["long_decode"], peer.get("long_decode"))]
        rows.append(row)
    headers = ["dtype", "ops, KV cache", "exact", "llama.cpp KV", "decode tok/s", "llama.cpp", "ratio",
               f"prefill {args.prefill_tokens} tok/s", "llama.cpp", "ratio", "4 streams tok/s", "llama.cpp", "ratio",
               "4 streams / 1", "llama.cpp's 4 / 1", "Python per round"]
    if args.long:
        headers += [f"prefill {args.long} tok/s", "llama.cpp", "ratio", f"decode @{args.long}", "llama.cpp", "ratio"]
    print_table(headers, rows, f"{args.threads} threads, {args.tokens} new tokens, best of {args.repeats}")


if __name__ == "__main__":
    main()
