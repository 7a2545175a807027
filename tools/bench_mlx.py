"""The mlx backend beside the cpu backend on one model, in one run: load time, prefill and
one-stream greedy decode speed, whether the two give the same token_sha, and where an mlx decode
round goes (each op timed alone, evaluated as it returns).

    python tools/bench_mlx.py                      # the default model (SmolLM2-135M Q4_1 GGUF)
    python tools/bench_mlx.py --model F.gguf --tokens 16 --prompt-tokens 128
    python tools/bench_mlx.py --model HF_DIR --quantize q8_0
    python tools/bench_mlx.py --peer --prompt-tokens 512   # + mlx_lm on the same weights

--peer adds mlx_lm (pip install mlx-lm; a benchmark peer only) on the same weights: the GGUF's
own blocks as MLX affine groups of 32 (tools/peer_mlx_lm.load_blocks: value for value), and a
bfloat16 copy of the file on both sides. On Apple silicon this is the table that matters (the
mlx backend on Metal against mlx_lm on Metal); run it there as is.

On Linux the mlx backend runs on MLX's CPU device (`pip install -e ".[mlx]"`); on a Mac, Metal.
Decode tokens/s is (new tokens - 1) over the time from the first new token to the last; each
figure is the best of --repeats runs. The same prompt ids, greedy, end tokens ignored.
"""
import argparse
import collections
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools.bench_core import fmt, machine_line, print_table  # noqa: E402


def measure(backend: str, model: str | None, prompt_tokens: int, tokens: int, repeats: int,
            quantize: str | None = None, dtype: str = "auto") -> dict:
    from tensorfold.api.replies import token_sha
    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams

    started = time.perf_counter()
    engine = Engine(model, EngineConfig(backend=backend, context=max(1024, prompt_tokens + tokens + 8),
                                        kv_cache_gib=0.1, drafting=False, max_tokens_per_step=1 << 20,
                                        quantize=quantize, dtype=dtype))
    load_s = time.perf_counter() - started
    words = "the harbor keeps a log of every ship that comes in with the tide ".split()
    ids = engine.tokenizer.encode(" ".join(words[i % len(words)] for i in range(prompt_tokens)))[:prompt_tokens]
    prefill, decode, sha = 0.0, 0.0, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        prefill = max(prefill, len(ids) / (time.perf_counter() - t0))
        stamps = []
        req = engine.requests[engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                      ignore_eos=True))]
        while engine.has_work():
            engine.step()
            stamps.append(time.perf_counter())
        out = req.output_ids
        decode = max(decode, (len(out) - 1) / (stamps[-1] - stamps[0]))
        sha = token_sha(out)
    return dict(load_s=load_s, prefill=prefill, decode=decode, sha=sha, exact=engine.exact,
                weights=engine.info.weights, engine=engine, ids=ids)


def round_profile(engine, ids: list[int]) -> dict[str, float]:
    """ms per decode round in each op of the mlx model (each call evaluated as it returns)."""
    import mlx.core as mx

    from tensorfold.mlx import model as mlx_model
    from tensorfold.mlx import ops
    from tensorfold.sampling.params import SamplingParams

    spent: dict[str, float] = collections.Counter()
    originals = {}
    for name in ("quant_linear", "dense_linear", "attention", "rms_norm", "silu_and_mul", "apply_rope", "write_kv"):
        originals[name] = fn = getattr(ops, name)

        def timed(*args, _fn=fn, _name=name, **kwargs):
            t0 = time.perf_counter()
            out = _fn(*args, **kwargs)
            mx.eval(out) if out is not None else None
            spent[_name] += time.perf_counter() - t0
            return out
        setattr(ops, name, timed)
        setattr(mlx_model.ops, name, timed)
    try:
        rounds = 8
        t0 = time.perf_counter()
        engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        spent.clear()
        t0 = time.perf_counter()
        engine.generate(ids[:8], SamplingParams(temperature=0.0, max_tokens=rounds + 1, ignore_eos=True))
        total = time.perf_counter() - t0
    finally:
        for name, fn in originals.items():
            setattr(ops, name, fn)
    out = {name: 1000 * s / rounds for name, s in sorted(spent.items(), key=lambda kv: -kv[1])}
    out["round (all)"] = 1000 * total / rounds
    return out


def peer_rows(args, mlx: dict) -> None:
    """mlx_lm beside the mlx backend on the same weights, the same prompt ids and machine: the
    file's own blocks (as MLX affine groups, value for value), then a bfloat16 copy of the file
    on both sides."""
    from tools import peer_mlx_lm
    from tensorfold.models.gguf_file import default_model_path

    if not peer_mlx_lm.available():
        print(peer_mlx_lm.SKIP_MESSAGE)
        return
    gguf = args.model or default_model_path()
    if not gguf.endswith(".gguf"):
        print("--peer compares on a GGUF's blocks: pass a .gguf --model")
        return
    dense = peer_mlx_lm.dense_copy(gguf, os.path.join(os.path.expanduser("~/.cache/tensorfold-bench"),
                                                      os.path.basename(gguf).removesuffix(".gguf") + "-bf16"))
    ids, n = mlx["ids"], args.tokens

    def peer(model) -> dict:
        prefill = max(len(ids) / peer_mlx_lm.prefill_seconds(model, ids) for _ in range(args.repeats))
        return dict(prefill=prefill, decode=max(peer_mlx_lm.decode_tps(model, ids, n) for _ in range(args.repeats)))

    ours_dense = measure("mlx", dense, args.prompt_tokens, n, args.repeats, dtype="bfloat16")
    rows = [("the file's blocks", mlx, peer(peer_mlx_lm.load_blocks(dense, gguf))),
            ("bfloat16 copy", ours_dense, peer(peer_mlx_lm.load(dense)))]
    print_table(["weights (same on both)", "tensorfold mlx prefill", "mlx_lm prefill", "tensorfold mlx decode",
                 "mlx_lm decode", "decode ratio", "prefill ratio"],
                [[name, fmt(ours["prefill"], 1), fmt(theirs["prefill"], 1), fmt(ours["decode"], 2),
                  fmt(theirs["decode"], 2), fmt(ours["decode"] / theirs["decode"], 2),
                  fmt(ours["prefill"] / theirs["prefill"], 2)] for name, ours, theirs in rows],
                title=f"mlx_lm {peer_mlx_lm.version()}, tok/s, prefill of {len(ids)} tokens, "
                      f"decode of {n}, same prompt ids")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the default model)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quantize", default=None, help="q8_0 / q4_0: a HF checkpoint's GEMMs quantized at load")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--peer", action="store_true",
                   help="add mlx_lm on the same GGUF blocks and, both sides, on a bfloat16 copy of the file")
    args = p.parse_args(argv)
    print(machine_line())
    results = {b: measure(b, args.model, args.prompt_tokens, args.tokens, args.repeats, args.quantize)
               for b in ("cpu", "mlx")}
    cpu, mlx = results["cpu"], results["mlx"]
    rows = [[b, r["exact"], fmt(r["load_s"]), fmt(r["prefill"], 1), fmt(r["decode"], 2), r["sha"]]
            for b, r in results.items()]
    print_table(["backend", "exact", "load s", f"prefill {args.prompt_tokens} tok/s", "decode tok/s",
                 f"token_sha of {args.tokens}"], rows,
                title=f"weights {mlx['weights']}; same token_sha: {cpu['sha'] == mlx['sha']}; "
                      f"mlx / cpu decode {mlx['decode'] / cpu['decode']:.3f}x")
    if args.peer:
        peer_rows(args, mlx)
    if not args.no_profile:
        profile = round_profile(mlx["engine"], mlx["ids"])
        print_table(["op", "ms per decode round"], [[k, fmt(v, 1)] for k, v in profile.items()],
                    title="where an mlx decode round goes (8-token prompt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
