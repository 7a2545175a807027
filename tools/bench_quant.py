"""The quantized weights served as stored (dtype auto), next to llama.cpp on the same file, in one
run (issue 11).

    python tools/bench_quant.py                          # all four sections, 2 threads
    python tools/bench_quant.py --sections speed,memory --repeats 3
    python tools/bench_quant.py --tokens 8 --repeats 1 --rss-context 512 --agree-tokens 16   # a quick look

llama.cpp is llama-cpp-python, a peer only (tools/peer_llama_cpp.py); without it every llama.cpp
column reads n/a after peer_llama_cpp.SKIP_MESSAGE. Each section prints one markdown table, after
the machine line:

1. speed: the default model's Q4_1 GGUF (token_embd Q8_0), TensorFold's engine with --dtype auto
   (the blocks as stored, float32 activations) and llama.cpp on the same file, measured by
   tools/bench_native.py's functions. decode: single-stream greedy tokens/s after a 16-token
   prompt, drafting off on both sides; prefill: a --prefill-tokens prompt, tokens/s; ratio: ours
   over llama.cpp's (above 1: TensorFold faster). Best of --repeats.
2. memory: resident set size (VmRSS of /proc/self/status, MiB) of the weights plus a cache of
   --rss-context (4096) tokens, each side in a fresh child process (`--rss-child ours|llama`).
   Ours: the engine with dtype auto, context 4096, kv_cache_gib sized to exactly 4096 tokens of
   its cache (bfloat16: --kv-dtype auto under dtype auto), prompt_cache_gib 0; llama.cpp: the
   same Q4_1 file with n_ctx 4096 (its default f16 cache). Both then prefill the same ~4000-token
   prompt and decode a few tokens, so the cache is touched. Columns: runtime (RSS right after the
   child's imports: torch and the engine for ours, llama_cpp for the peer), loaded (after the
   weights and cache are allocated; cache pages not yet written are not resident), after N tok
   (after the prefill and decode), peak (VmHWM), model + cache (after N tok minus runtime: what
   the weights, cache and activations add to the runtime), the KV cache's own size, and the
   ratios ours / llama.cpp of after N tok and of model + cache (target <= 1.2x).
3. agreement: greedy replies on the default model to --agree-prompts chat prompts (the model's
   chat template, rendered as the server does), --agree-tokens (256) new tokens, end tokens
   ignored, drafting off. llama.cpp's reply is argmax of its logits token by token from the
   same prompt ids. Columns: the common prefix of the two replies' token ids, and the fraction of
   positions where they are equal.
4. K-quants: a Q4_K_M-style GGUF (Q4_K matrices, Q6_K attn_v, ffn_down and token_embd) written
   by tools/tiny_checkpoint.py from a tiny random checkpoint, since the PyPI packages installed
   here ship no larger K-quant GGUF. Decode tokens/s of TensorFold (dtype auto) and llama.cpp on
   that file; a failure on either side (a tiny random model may trip a loader) prints its
   message in that side's column. The model is a few MB, so this shows per-token overheads more
   than GEMM speed.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools import peer_llama_cpp  # noqa: E402
from tools.bench_core import (GGUF_NAME, common_prefix, default_model_folder, fmt, machine_line,  # noqa: E402
                              print_table, rss_mib)
from tools.bench_native import measure, prompt_ids, ratio  # noqa: E402

SECTIONS = ("speed", "memory", "agreement", "kquant")
DEFAULT_SHAPE = dict(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M: the KV cache's shape
RSS_DECODE_TOKENS = 8
USER_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "List five tips for learning a new programming language, with one sentence each.",
]
GREEDY = dict(temperature=0, ignore_eos=True, draft=False)


# -- 1. speed: bench_native's runs on the Q4_1 file ------------------------------------------

def speed_section(args) -> None:
    native_args = argparse.Namespace(threads=args.threads, tokens=args.tokens, repeats=args.repeats,
                                     prefill_tokens=args.prefill_tokens, long=0)
    ours, peer = measure("auto", native_args)
    row = ["Q4_1 (token_embd Q8_0)", ours["ops"], ours["exact"],
           fmt(ours["decode"], 1), fmt(peer.get("decode"), 1), ratio(ours["decode"], peer.get("decode")),
           fmt(ours["prefill"], 0), fmt(peer.get("prefill"), 0), ratio(ours["prefill"], peer.get("prefill"))]
    print_table(["file", "ops, KV cache", "exact", "decode tok/s", "llama.cpp", "ratio",
                 f"prefill {args.prefill_tokens} tok/s", "llama.cpp", "ratio"], [row],
                f"1. Speed, default model served as stored (dtype auto): {args.threads} threads, "
                f"{args.tokens} new tokens, best of {args.repeats}")


# -- 2. memory: each side in a fresh child process -------------------------------------------

def kv_cache_gib(tokens: int) -> float:
    """The default model's cache under dtype auto (its dtype: torch_backend.kv_cache_dtype) for
    exactly `tokens` tokens (TorchBackend.allocate's sizing)."""
    from tensorfold.backends.torch_backend import kv_cache_dtype
    from tensorfold.engine.engine import EngineConfig
    from tensorfold.models.cache import PagedKV

    dtype = kv_cache_dtype(EngineConfig(dtype="auto"), quantized=True)
    layer = PagedKV(DEFAULT_SHAPE["num_kv_heads"], DEFAULT_SHAPE["head_dim"])
    return DEFAULT_SHAPE["num_layers"] * layer.bytes_per_token(dtype, v_exponents=True) * tokens / 2**30


def rss_child_ours(context: int, threads: int) -> dict:
    import torch

    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams

    runtime = rss_mib()[0]
    torch.set_num_threads(threads)
    engine = Engine(None, EngineConfig(dtype="auto", num_threads=threads, context=context,
                                       kv_cache_gib=kv_cache_gib(context), prompt_cache_gib=0))
    args = engine.backend.model.args
    assert (args.num_layers, args.num_kv_heads, args.head_dim) == tuple(DEFAULT_SHAPE.values()), args
    cache_tokens = engine.backend.cache.num_blocks * engine.backend.cache.block_size
    assert cache_tokens == context, f"the cache holds {cache_tokens} tokens, not {context}"
    loaded = rss_mib()[0]
    done = engine.generate(prompt_ids(context - 96), SamplingParams(max_tokens=RSS_DECODE_TOKENS, **GREEDY))
    assert len(done.token_ids) == RSS_DECODE_TOKENS
    kv_mib = engine.backend.cache.nbytes / 2**20
    return {"runtime": runtime, "loaded": loaded, "after": rss_mib()[0], "peak": rss_mib()[1], "kv_mib": kv_mib}


GGML_TYPE_BYTES = {0: 4, 1: 2, 30: 2}  # f32, f16, bf16: bytes per cached element


def rss_child_llama(context: int, threads: int) -> dict:
    import llama_cpp  # noqa: F401

    runtime = rss_mib()[0]
    # The file located without tensorfold's modules, which would bring torch into this process.
    llm = peer_llama_cpp.load(os.path.join(default_model_folder(), GGUF_NAME), n_ctx=context, threads=threads)
    loaded = rss_mib()[0]
    llama_greedy(llm, prompt_ids(context - 96), RSS_DECODE_TOKENS)
    layers, kv_heads, head_dim = DEFAULT_SHAPE.values()
    per_element = GGML_TYPE_BYTES.get(llm.context_params.type_k)
    kv_mib = None if per_element is None else 2 * layers * kv_heads * head_dim * per_element * llm.n_ctx() / 2**20
    return {"runtime": runtime, "loaded": loaded, "after": rss_mib()[0], "peak": rss_mib()[1], "kv_mib": kv_mib}


RSS_CHILDREN = {"ours": rss_child_ours, "llama": rss_child_llama}


def run_rss_child(which: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", which, "--threads", str(args.threads),
           "--rss-context", str(args.rss_context)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return {"error": f"child failed (exit {proc.returncode})"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory_row(name: str, r: dict | None, ours: dict | None = None) -> list:
    if r is None:
        return [name, "n/a (skipped)"] + [""] * 7
    if "error" in r:
        return [name, r["error"]] + [""] * 7
    row = [name, f"{r['runtime']:.0f}", f"{r['loaded']:.0f}", f"{r['after']:.0f}", f"{r['peak']:.0f}",
           f"{r['after'] - r['runtime']:.0f}", fmt(r["kv_mib"], 0)]
    if ours is None or "error" in ours:
        return row + ["", ""]
    return row + [ratio(ours["after"], r["after"]), ratio(ours["after"] - ours["runtime"], r["after"] - r["runtime"])]


def memory_section(args) -> None:
    ours = run_rss_child("ours", args)
    peer = None
    if peer_llama_cpp.available():
        peer = run_rss_child("llama", args)
    else:
        print(peer_llama_cpp.SKIP_MESSAGE)
    rows = [memory_row("TensorFold (dtype auto)", ours), memory_row("llama.cpp", peer, ours)]
    prompt = args.rss_context - 96
    after = f"after {prompt + RSS_DECODE_TOKENS} tok MiB"
    title = (f"2. Resident memory, default Q4_1 file, {args.rss_context}-token context: {prompt}-token prompt + "
             f"{RSS_DECODE_TOKENS} tokens, one fresh process each")
    print_table(["engine", "runtime MiB", "loaded MiB", after, "peak MiB", "model + cache MiB", "KV cache MiB",
                 "ours / llama.cpp (after)", "ours / llama.cpp (model + cache)"], rows, title)


# -- 3. agreement: greedy token ids, ours against llama.cpp's --------------------------------

def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids`: argmax of llama.cpp's logits, one eval per token."""
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        out.append(peer_llama_cpp.greedy_token(llm.ctx, llm.n_vocab()))
        llm.eval(out[-1:])
    return out


def agreement_section(args) -> None:
    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.models.gguf_file import default_model_path
    from tensorfold.sampling.params import SamplingParams
    from tools.bench_core import chat_prompt_ids

    engine = Engine(None, EngineConfig(dtype="auto", num_threads=args.threads, drafting=False, prompt_cache_gib=0,
                                       context=1024 + args.agree_tokens, kv_cache_gib=0.25))
    prompts = [chat_prompt_ids(engine, text) for text in USER_PROMPTS[:args.agree_prompts]]
    llm = None
    if peer_llama_cpp.available():
        llm = peer_llama_cpp.load(default_model_path(), n_ctx=max(map(len, prompts)) + args.agree_tokens + 16,
                                  threads=args.threads)
    else:
        print(peer_llama_cpp.SKIP_MESSAGE)
    rows = []
    for text, ids in zip(USER_PROMPTS, prompts):
        ours = engine.generate(ids, SamplingParams(max_tokens=args.agree_tokens, **GREEDY)).token_ids
        if llm is None:
            rows.append([text[:40], len(ids), "n/a", "n/a"])
            continue
        peer = llama_greedy(llm, ids, args.agree_tokens)
        equal = sum(a == b for a, b in zip(ours, peer))
        rows.append([text[:40], len(ids), f"{common_prefix(ours, peer)} of {len(ours)}",
                     f"{equal / len(ours):.3f}"])
    print_table(["user prompt", "prompt tokens", "common prefix", "positions equal"], rows,
                f"3. Greedy agreement with llama.cpp, default Q4_1 file: {args.agree_tokens} new tokens, "
                "end tokens ignored, drafting off")


# -- 4. a Q4_K_M file from a tiny checkpoint -------------------------------------------------

def tiny_q4_k_m_file(folder: str) -> str:
    from tools.tiny_checkpoint import K_QUANT_SIZES, make_tiny_checkpoint, write_tiny_gguf

    hf_dir = make_tiny_checkpoint(os.path.join(folder, "hf"), "llama", **K_QUANT_SIZES)
    return write_tiny_gguf(hf_dir, "q4_k_m", os.path.join(folder, "tiny-q4_k_m.gguf"))


def ours_decode_tps(path: str, args) -> tuple[float, str]:
    """Best-of-repeats greedy decode tokens/s of the engine (dtype auto) on `path`, and its GEMM formats."""
    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams

    # probe=False: the startup probes do not yet take a fused GEMM of mixed formats (Q4_K q, k
    # beside Q6_K v; see tests/test_quantized_model.py).
    engine = Engine(path, EngineConfig(dtype="auto", num_threads=args.threads, context=256, kv_cache_gib=0.01,
                                       prompt_cache_gib=0, probe=False))
    formats = ", ".join(f"{n} {kind}" for kind, n in sorted(engine.backend.model.weight_formats().items()))
    engine.generate(prompt_ids(8), SamplingParams(max_tokens=2, **GREEDY))  # warm-up
    best = 0.0
    for _ in range(args.repeats):
        s = engine.generate(prompt_ids(16), SamplingParams(max_tokens=args.tokens, **GREEDY)).request.stats
        best = max(best, (args.tokens - 1) / s.decode_s)
    return best, formats


def peer_decode_tps(path: str, args) -> float:
    llm = peer_llama_cpp.load(path, n_ctx=256, threads=args.threads)
    return max(peer_llama_cpp.decode_tps(llm, prompt_ids(16), args.tokens) for _ in range(args.repeats))


def failure(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def kquant_section(args) -> None:
    print("\nThe PyPI packages installed here ship no larger K-quant GGUF: section 4 runs on a tiny random "
          "checkpoint written as a Q4_K_M-style file by tools/tiny_checkpoint.py.")
    with tempfile.TemporaryDirectory(prefix="bench_quant_") as folder:
        path = tiny_q4_k_m_file(folder)
        size = os.path.getsize(path) / 2**20
        try:
            ours, formats = ours_decode_tps(path, args)
            ours_cell = fmt(ours, 1)
        except Exception as e:  # noqa: BLE001 (reported in the table)
            ours, formats, ours_cell = None, "", failure(e)
        peer, peer_cell = None, "n/a"
        if not peer_llama_cpp.available():
            print(peer_llama_cpp.SKIP_MESSAGE)
        else:
            try:
                peer = peer_decode_tps(path, args)
                peer_cell = fmt(peer, 1)
            except Exception as e:  # noqa: BLE001
                peer_cell = failure(e)
    row = [f"tiny Q4_K_M ({size:.1f} MiB)", formats, ours_cell, peer_cell, ratio(ours, peer) if ours else "-"]
    print_table(["file", "GEMM weights", "decode tok/s", "llama.cpp", "ratio"], [row],
                f"4. K-quants served as stored (dtype auto): {args.threads} threads, {args.tokens} new tokens, "
                f"best of {args.repeats}")


# -- main ------------------------------------------------------------------------------------

RUNS = {"speed": speed_section, "memory": memory_section, "agreement": agreement_section, "kquant": kquant_section}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per decode run (sections 1 and 4)")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs (sections 1 and 4)")
    p.add_argument("--rss-context", type=int, default=4096, help="the context and cache size of section 2")
    p.add_argument("--agree-tokens", type=int, default=256, help="new tokens per reply in section 3")
    p.add_argument("--agree-prompts", type=int, default=len(USER_PROMPTS), choices=range(1, len(USER_PROMPTS) + 1))
    p.add_argument("--rss-child", choices=list(RSS_CHILDREN), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        print(json.dumps(RSS_CHILDREN[args.rss_child](args.rss_context, args.threads)))
        return 0
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections: {', '.join(sorted(unknown))}")
    print(machine_line())
    started = time.perf_counter()
    for name in sections:
        RUNS[name](args)
    print(f"\ntotal {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
