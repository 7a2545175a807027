"""CPU time per one-stream decode round, TensorFold and llama.cpp, one thread each, on one GGUF.

    python tools/bench_round_cpu.py GGUF [--engine tensorfold|llama.cpp|both] [--repeats 3]

bench_families.py's decode (a 16-token prompt, then --tokens greedy tokens, drafting off), timed
with time.process_time() instead of the wall clock: on a machine shared with other work a
one-thread process's CPU time barely moves with the load, where two threads' wall clock waits on
descheduled threads in every parallel region. Each engine runs in a child process of its own;
every repeat prints ms of CPU per round (and the wall clock beside it), TensorFold's also a hash of
its tokens (the same before and after a change that keeps the bits). --profile: cProfile's top
functions of TensorFold's last repeat.
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def tensorfold_rounds(path: str, tokens: int, repeats: int, profile: bool) -> None:
    import cProfile
    import hashlib
    import pstats

    import torch

    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams
    from tools.bench_native import prompt_ids

    torch.set_num_threads(1)
    engine = Engine(path, EngineConfig(num_threads=1, prompt_cache_gib=0, context=1024, kv_cache_gib=1.0,
                                       block_size=256, max_tokens_per_step=512))
    greedy = dict(temperature=0, ignore_eos=True, draft=False)
    engine.generate(prompt_ids(8), SamplingParams(max_tokens=2, **greedy))  # warm-up
    for rep in range(repeats):
        rid = engine.add_request(prompt_ids(16), SamplingParams(max_tokens=tokens + 1, **greedy))
        req = engine.requests[rid]
        while req.num_computed_tokens < 16:
            engine.step()  # the prompt and the first token
        prof = cProfile.Profile() if profile and rep == repeats - 1 else None
        cpu, wall = time.process_time(), time.perf_counter()
        if prof:
            prof.enable()
        while engine.has_work():
            engine.step()
        if prof:
            prof.disable()
        n = len(req.output_ids) - 1
        sha = hashlib.sha256(",".join(map(str, req.output_ids)).encode()).hexdigest()[:12]
        print(f"tensorfold: {(time.process_time() - cpu) / n * 1e3:.2f} ms CPU / round "
              f"(wall {(time.perf_counter() - wall) / n * 1e3:.2f}), tokens {sha}", flush=True)
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def llama_cpp_rounds(path: str, tokens: int, repeats: int) -> None:
    from tools import peer_llama_cpp
    from tools.bench_native import prompt_ids

    llm = peer_llama_cpp.load(path, n_ctx=1024, threads=1)
    for _ in range(repeats):
        llm.reset()
        llm.eval(prompt_ids(16))
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(tokens):
            llm.eval([peer_llama_cpp.greedy_token(llm.ctx, llm.n_vocab())])
        print(f"llama.cpp: {(time.process_time() - cpu) / tokens * 1e3:.2f} ms CPU / round "
              f"(wall {(time.perf_counter() - wall) / tokens * 1e3:.2f})", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf")
    p.add_argument("--engine", default="both", choices=["tensorfold", "llama.cpp", "both"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile of TensorFold's last repeat")
    args = p.parse_args(argv)
    if args.engine == "tensorfold":
        return tensorfold_rounds(args.gguf, args.tokens, args.repeats, args.profile)
    if args.engine == "llama.cpp":
        return llama_cpp_rounds(args.gguf, args.tokens, args.repeats)
    for engine in ("tensorfold", "llama.cpp"):  # each in a process of its own
        cmd = [sys.executable, os.path.abspath(__file__), args.gguf, "--engine", engine, "--tokens", str(args.tokens),
               "--repeats", str(args.repeats)] + ["--profile"] * args.profile
        subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
