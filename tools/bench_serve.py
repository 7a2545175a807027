"""Server benchmark (issues 3 and 5): a load generator on the official openai client.

    python tools/bench_serve.py                        # starts its own servers (default model)
    python tools/bench_serve.py --url http://127.0.0.1:8080/v1 --only load
    python tools/bench_serve.py --tokens 64 --concurrency 1,2,4,8,16 --dtype bfloat16

Without --url it starts `python -m tensorfold` as a subprocess for each configuration on a free
loopback port and waits for GET /health: --parallel 1 and 4 for the load table, then two servers
side by side for the scenarios (--parallel 4 with the default decode share 0.25, and with 0).
Every measurement runs --repeats times: the load table shows each level's fastest sweep (other
processes on a shared machine only slow a run down); the scenario tables show every run, the
configurations alternating, so the run-to-run spread stays visible.

Tables:
1. Load: N concurrent streamed chat requests (distinct prompts, `ignore_eos` so every reply has
   --tokens tokens, seeded sampling) for N in --concurrency. TTFT is send to the first content
   chunk; inter-token latency (ITL) is the gap between consecutive content chunks (a drafted
   round can carry several tokens in one chunk); aggregate tokens/s is all completion tokens over
   the wall time from the first send to the last [DONE]. Target: 4 streams >= 2.5x one stream.
2. Long prefill: a stream is decoding when a long prompt (--long-tokens) arrives, and a short
   request follows it; with decode share 0.25 vs 0: the short request's TTFT, and the longest
   pause of the decoding stream while the long prompt prefills.
3. Priority: a long prompt is prefilling when a short foreground request arrives; the short
   one's wait (TTFT) with the long one sent as `"priority": "background"` and without, the short
   one sent on a new connection (as every other request here) or on a keep-alive connection
   opened beforehand (the server reads a new connection's first request one round after
   accepting it, which here costs a whole prefill chunk).
4. Added latency: one streamed request alone; tokens/s seen by the client (first to last content
   chunk) over the engine's own `tensorfold.decode_tps` for the same reply.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_core import ROOT, fmt, loadavg, machine_line, print_table  # noqa: E402

TOPICS = ["a lighthouse keeper", "a fox who plays the violin", "the first train to the coast",
          "a garden on a rooftop", "a clockmaker's apprentice", "a storm over the harbour",
          "a lost library card", "the last day of summer", "a robot learning to paint",
          "a village bakery at dawn", "an old map in an attic", "a chess game in the park",
          "a bridge made of rope", "a cat that rides the bus", "a winter market", "a kite festival"]

FILLER = ("The committee met on Tuesday to review the quarterly figures for the northern region, "
          "where sales of garden tools, seeds and irrigation equipment had risen for the third "
          "quarter in a row despite a wet spring. ")


# -- the server --------------------------------------------------------------------------------

class Server:
    """`python -m tensorfold` in a subprocess on a free loopback port; a context manager."""

    def __init__(self, flags: list[str], log_dir: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.flags = flags
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = os.path.join(log_dir, f"server-{self.port}.log")

    def __enter__(self):
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "tensorfold", "--port", str(self.port), "--log-level", "warning", *self.flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        started = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server {' '.join(self.flags)} exited:\n" + open(self.log_path).read()[-3000:])
            try:
                health(self.url)
                break
            except OSError:
                if time.perf_counter() - started > 300:
                    raise SystemExit(f"server {' '.join(self.flags)} did not answer /health in 300s")
                time.sleep(0.25)
        self.startup_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def health(url: str) -> dict:
    base = url[:-3] if url.endswith("/v1") else url
    with urllib.request.urlopen(base + "/health", timeout=5) as r:
        return json.loads(r.read())


def served_model(url: str, _names={}) -> str:  # noqa: B006  (a cache per url)
    if url not in _names:
        with urllib.request.urlopen(url + "/models", timeout=5) as r:
            _names[url] = json.loads(r.read())["data"][0]["id"]
    return _names[url]


# -- one streamed request ------------------------------------------------------------------------

def client_for(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)


def stream_chat(url: str, content: str, max_tokens: int, extra: dict, seed: int = 0,
                on_first=None, stop: threading.Event | None = None, client=None) -> dict:
    """Send one streamed chat request; returns its timings, token count and tensorfold block.
    A new client (so a new connection) unless `client` is given. Setting `stop` hangs up after
    the next chunk (the server cancels the request)."""
    client = client or client_for(url)
    sent = time.perf_counter()
    stream = client.chat.completions.create(
        model=served_model(url), messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        temperature=0.7, seed=seed, stream=True, extra_body={"ignore_eos": True, **extra})
    times, usage, block = [], None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            if len(times) == 1 and on_first is not None:
                on_first()
        if chunk.usage is not None:
            usage = chunk.usage
            block = (chunk.model_extra or {}).get("tensorfold")
        if stop is not None and stop.is_set():
            stream.close()
            break
    done = time.perf_counter()
    return {"sent": sent, "done": done, "times": times, "ttft": times[0] - sent if times else None,
            "gaps": [b - a for a, b in zip(times, times[1:])],
            "tokens": usage.completion_tokens if usage else 0,
            "prompt_tokens": usage.prompt_tokens if usage else 0, "tensorfold": block or {}}


def in_thread(fn, *args, **kwargs):
    box = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except Exception as e:  # reported by the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def result_of(thread, box) -> dict:
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def ms(x) -> str:
    return "n/a" if x is None else f"{x * 1e3:.0f}"


# -- 1. load -----------------------------------------------------------------------------------

def load_level(url: str, n: int, args) -> dict:
    """n streams sent at once; their latencies and the aggregate rate."""
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        return stream_chat(url, f"Write a short story about {TOPICS[i % len(TOPICS)]}.", args.tokens, {}, seed=i)
    before = health(url)
    results = [result_of(*run) for run in [in_thread(one, i) for i in range(n)]]
    after = health(url)
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    total = sum(r["tokens"] for r in results)
    return {"n": n, "wall": wall, "total": total, "tps": total / wall,
            "ttfts": [r["ttft"] for r in results if r["ttft"] is not None],
            "gaps": [g for r in results for g in r["gaps"]],
            "drafted": after["drafted_total"] - before["drafted_total"],
            "accepted": after["accepted_total"] - before["accepted_total"]}


def load_rows(url: str, label: str, args) -> list[list]:
    """Each level --repeats times (sweeps one after another); the row shows its fastest sweep."""
    levels = [int(c) for c in args.concurrency.split(",")]
    best = {}
    for _ in range(args.repeats):
        for n in levels:
            run = load_level(url, n, args)
            if n not in best or run["tps"] > best[n]["tps"]:
                best[n] = run
            print(f"  {label} x{n}: {run['tps']:.1f} tok/s", flush=True)
    single = best[levels[0]]["tps"]
    rows = []
    for n in levels:
        r = best[n]
        target = (">= 2.5x " + ("met" if r["tps"] / single >= 2.5 else "MISSED")) if n == 4 else ""
        rows.append([label, n, ms(percentile(r["ttfts"], 0.5)), ms(percentile(r["ttfts"], 0.99)),
                     ms(percentile(r["gaps"], 0.5)), ms(percentile(r["gaps"], 0.99)), r["total"],
                     fmt(r["wall"], 1), fmt(r["tps"], 1), f"{r['tps'] / single:.2f}x", target,
                     f"{r['accepted']}/{r['drafted']}"])
    return rows


# -- 2. a long prompt arriving while a stream decodes ----------------------------------------------

_long_prompts = iter(range(1, 1 << 30))
_short_prompts = iter(range(1, 1 << 30))


def short_prompt() -> str:
    """A fresh short prompt each call. A repeated one would be found in the prefix cache whole
    but its last token, and a request with nothing left to prefill decodes at once."""
    return f"Say hello to visitor number {next(_short_prompts)}."


def long_prompt(num_tokens: int) -> str:
    """A fresh long prompt each call: its own first line keeps the prefix cache out of it.
    FILLER is about 40 tokens; the chat template adds a few more."""
    return (f"Report number {next(_long_prompts)}. Summarise it in one sentence.\n\n"
            + FILLER * max(1, num_tokens // 40))


def long_prefill_row(url: str, label: str, run: int, args) -> list:
    """One run: returns the table row."""
    decoding, hang_up = threading.Event(), threading.Event()

    def decoder():
        return stream_chat(url, "Write a long story about a ship at sea.", args.decoder_tokens, {"draft": False},
                           on_first=decoding.set, stop=hang_up)
    t_dec = in_thread(decoder)
    decoding.wait(timeout=300)
    time.sleep(0.5)
    t_long = in_thread(stream_chat, url, long_prompt(args.long_tokens), 4, {})
    time.sleep(args.arrival_delay)
    short = stream_chat(url, short_prompt(), 4, {})
    long_run = result_of(*t_long)
    time.sleep(1.0)  # a few decode rounds after the long prompt's first token
    hang_up.set()
    dec = result_of(*t_dec)
    # The decoding stream's pauses while the long prompt was being prefilled.
    window = [b - a for a, b in zip(dec["times"], dec["times"][1:])
              if b > long_run["sent"] and a < long_run["sent"] + long_run["ttft"]]
    return [label, run, long_run["prompt_tokens"], ms(long_run["ttft"]), ms(short["ttft"]),
            ms(max(window) if window else None), ms(percentile(dec["gaps"], 0.5)), len(dec["times"])]


# -- 3. priority -----------------------------------------------------------------------------------

def priority_row(url: str, background: bool, reuse: bool, run: int, args) -> list:
    client = None
    if reuse:  # the short request goes out on a keep-alive connection opened beforehand
        client = client_for(url)
        client.models.list()
    extra = {"priority": "background"} if background else {}
    t_long = in_thread(stream_chat, url, long_prompt(args.long_tokens), 4, extra)
    time.sleep(args.arrival_delay)
    short = stream_chat(url, short_prompt(), 4, {}, client=client)
    long_run = result_of(*t_long)
    return ["background" if background else "foreground (none)", "reused" if reuse else "new", run,
            long_run["prompt_tokens"], ms(short["ttft"]), ms(long_run["ttft"]),
            order(short["times"][0] - long_run["times"][0])]


def order(short_minus_long_s: float) -> str:
    if abs(short_minus_long_s) < 0.05:  # the same round's tokens go out together
        return "same round"
    return "short first" if short_minus_long_s < 0 else "long first"


# -- 4. the server's added latency ------------------------------------------------------------------

def added_latency_rows(url: str, args) -> list[list]:
    rows = []
    for run in range(1, args.repeats + 1):
        for draft in (False, True):
            r = stream_chat(url, "Write a short story about a lighthouse keeper.", args.latency_tokens,
                            {"draft": draft})
            client_tps = (r["tokens"] - 1) / (r["times"][-1] - r["times"][0])
            engine_tps = r["tensorfold"].get("decode_tps")
            rows.append(["on" if draft else "off", run, r["tokens"], len(r["times"]), fmt(client_tps, 2),
                         fmt(engine_tps, 2), f"{client_tps / engine_tps:.3f}" if engine_tps else "n/a",
                         ms(r["ttft"]), ms(r["tensorfold"].get("ttft_s"))])
    return rows


# -- main ------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="benchmark this running server (load and latency tables only) instead of starting servers")
    p.add_argument("--only", default="load,prefill,priority,latency", help="tables to run")
    p.add_argument("--parallel", default="1,4", help="--parallel values for the load table")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--tokens", type=int, default=24, help="reply tokens per stream in the load table")
    p.add_argument("--long-tokens", type=int, default=1200, help="size of the long prompt")
    p.add_argument("--decoder-tokens", type=int, default=1000,
                   help="reply limit of the stream decoding during the long prefill (it hangs up once measured)")
    p.add_argument("--arrival-delay", type=float, default=0.5, help="seconds after the long prompt the short one is sent")
    p.add_argument("--latency-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each measurement (load: best sweep shown; scenarios: every run shown)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--server-flags", default="", help="extra flags for every started server")
    args = p.parse_args(argv)
    tables = set(args.only.split(","))
    common = ["--dtype", args.dtype, "--threads", str(args.threads), *args.server_flags.split()]
    print(machine_line())
    print(f"bench_serve: default model, {args.dtype}, {args.threads} threads"
          + (f", server {args.url}" if args.url else ", servers started here"), flush=True)
    started = time.perf_counter()
    log_dir = tempfile.mkdtemp(prefix="bench_serve-")
    load, prefill, priority, latency = [], [], [], []

    if args.url:
        if "load" in tables:
            load += load_rows(args.url, "given", args)
        if "latency" in tables:
            latency = added_latency_rows(args.url, args)
    else:
        for parallel in args.parallel.split(","):
            if "load" in tables:
                with Server(common + ["--parallel", parallel], log_dir) as server:
                    print(f"  server --parallel {parallel} up in {server.startup_s:.1f}s", flush=True)
                    load += load_rows(server.url, f"--parallel {parallel}", args)
        if tables & {"prefill", "priority", "latency"}:
            # Both scenario servers stay up, so runs alternate between them (an idle server only polls).
            with Server(common + ["--parallel", "4"], log_dir) as default, \
                    Server(common + ["--parallel", "4", "--decode-share", "0"], log_dir) as no_share:
                print(f"  scenario servers up in {default.startup_s:.1f}s and {no_share.startup_s:.1f}s", flush=True)
                for run in range(1, args.repeats + 1):
                    if "prefill" in tables:
                        prefill.append(long_prefill_row(default.url, "0.25 (default)", run, args))
                        prefill.append(long_prefill_row(no_share.url, "0", run, args))
                    if "priority" in tables:
                        priority += [priority_row(default.url, bg, reuse, run, args)
                                     for reuse in (False, True) for bg in (False, True)]
                    print(f"  scenarios, run {run}: done ({time.perf_counter() - started:.0f}s)", flush=True)
                if "latency" in tables:
                    latency = added_latency_rows(default.url, args)

    if load:
        print_table(["server", "streams", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                     "tokens", "wall s", "aggregate tok/s", "vs 1 stream", "target", "accepted/drafted"],
                    load, title=f"1. Concurrent streams ({args.tokens} tokens each, temperature 0.7, ignore_eos; "
                                f"fastest of {args.repeats} sweeps)")
    if prefill:
        print_table(["decode share", "run", "long prompt tok", "long TTFT ms", "short TTFT ms",
                     "decoder's longest pause ms", "decoder ITL p50 ms", "decoder chunks"], prefill,
                    title=f"2. A long prompt arriving while a stream decodes; a short request {args.arrival_delay}s "
                          "after it (--parallel 4)")
    if priority:
        print_table(["long request's priority", "short's connection", "run", "long prompt tok", "short (foreground) TTFT ms",
                     "long TTFT ms", "first token"], priority,
                    title=f"3. A short foreground request {args.arrival_delay}s after a long prompt (--parallel 4)")
    if latency:
        print_table(["drafts", "run", "tokens", "chunks", "client tok/s", "engine decode_tps", "client / engine",
                     "client TTFT ms", "engine ttft_s ms"], latency,
                    title="4. The server's added latency: one stream alone, streamed through HTTP")
    print(f"\nload average after the run: {loadavg()}; total {time.perf_counter() - started:.0f}s; "
          f"server logs in {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
