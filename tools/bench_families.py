"""Gemma 4, GLM-5.x and Nemotron-H at real layer shapes against llama.cpp on the same GGUF (issue 35).

    python tools/bench_families.py                          # the three families, q8_0, 2 threads
    python tools/bench_families.py --families gemma4 --mixes q8_0,q4_0 --repeats 3
    python tools/bench_families.py --profile                # also the top torch ops of a decode round

Random weights (transformers' init, std 0.02; norms, scalars and routers' biases as
tools/tiny_checkpoint.py sets them), SmolLM2's 49,152-token vocabulary in place of the real ones
(262k, 155k, 131k: the embedding and the head are smaller, every layer is at its stated size),
max_position_embeddings 8192. Each shape is made once with transformers in --cache-dir, then
written as a GGUF per block type (--mixes) by the family's writer (tools/gemma4_gguf.py,
tools/glm_gguf.py, tools/tiny_checkpoint.write_tiny_gguf), as llama.cpp's converter lays it out;
both engines serve that one file, TensorFold its blocks as stored:

- gemma4 (e2b): Gemma 4 E2B's text model: hidden 1536, 8 heads, 1 KV head, sliding layers' heads
  of 256 (window 512), global layers' of 512 with proportional rope (a quarter turning), FFN 6144,
  double-wide (12288) on the KV-shared layers, per-layer inputs of 256, soft-cap 30, tied
  embeddings; E2B's 35 layers (4 sliding : 1 global, the last 20 reading the K/V of earlier
  ones) cut to --layers (default 10: layers 0-4 own their K/V, 5-9 share it, as E2B's 0-14 / 15-34).
  E2B's global heads of 512 are the default (the cpu kernels take heads up to 512);
  --gemma-global-head-dim 256 measures the shape the earlier rows of docs/benchmarks.md ran, with
  the global layers' heads at 256 (both engines on that file);
- nemotron_h (8b): Nemotron-H 8B's layer widths: hidden 4096, Mamba2 128 heads of 64 with 8
  groups, state 128, conv 4; attention 32 heads / 8 KV heads of 128 (no rope); relu^2 MLP 21504;
  the 8B's 52-layer pattern (M-M-M-M*-...) cut to --pattern (default "M-M*-": 2 Mamba2, 2 MLP, 1
  attention), llama.cpp's nemotron_h architecture;
- glm_moe_dsa (glm5-small): GLM-5's per-head shapes scaled down in width and depth (GLM-5 itself,
  744B, does not fit): hidden 2048, 16 heads, q_lora 768, kv_lora 512, nope 192 / rope 64 / v 256
  (GLM-5's), the DSA indexer with GLM-5's 32 heads of 128 on every layer (GLM-5 and 5.1 index every
  layer) choosing 256 keys (GLM-5: 2048; 256 so a 512-token prefill selects), 4 layers of which the
  first dense (FFN 6144), then 32 experts of 512, 8 per token, one shared expert, sigmoid routing
  with a correction bias;
- tiny: each family's tests-sized model (the tool's own test).

Columns (best of --repeats, the two engines alternating; other load only slows a run down): one
stream's greedy decode after a 16-token prompt (drafting off), a --prefill-tokens prefill, 4 streams'
aggregate decode; then each layer kind's share of a TensorFold decode round and of the prefill
(timers around each layer's call as the model makes it: a native fused layer is one call; where a
layer runs in Python, its mixer and feed-forward are timed too). The rest of a round is the
embedding, the head, the draw and the engine's own Python. Each (family, mix) runs in a child
process; before it, a second child checks that llama.cpp loads the file and evaluates a token (it
aborts the process on a shape it cannot build), and the peer column says why where it does not.
Targets (issue 35): decode >= 1.2x llama.cpp, prefill >= 1.0x. On a CPU shared with other work,
--threads 1: with two, each parallel region waits for a descheduled thread (docs/benchmarks.md).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools.bench_core import fmt, loadavg, machine_line, print_table  # noqa: E402

VOCAB_NOTE = "SmolLM2's 49,152-token vocabulary"
REAL = dict(initializer_range=0.02, max_position_embeddings=8192)
SLIDING, GLOBAL = "sliding_attention", "full_attention"


def gemma4_sizes(layers: int, global_head_dim: int = 512) -> dict:
    """E2B's text model cut to `layers` (a multiple of 5: 4 sliding then 1 global); the last layers
    share K/V in E2B's proportion (20 of 35), leaving a whole 5-layer group that owns its K/V (so
    the last own layers are sliding then global, as llama.cpp's reuse rule expects)."""
    if layers % 5 or layers < 10:
        raise SystemExit("--layers for gemma4: a multiple of 5, at least 10 (E2B: 35)")
    own = max(5, round(layers * 15 / 35 / 5) * 5)
    return dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=layers, num_attention_heads=8,
                num_key_value_heads=1, head_dim=256, global_head_dim=global_head_dim, num_global_key_value_heads=None,
                attention_k_eq_v=False, sliding_window=512, hidden_size_per_layer_input=256,
                use_double_wide_mlp=True, num_kv_shared_layers=layers - own, final_logit_softcapping=30.0,
                layer_types=([SLIDING] * 4 + [GLOBAL]) * (layers // 5), rms_norm_eps=1e-6, **REAL)


def nemotron_sizes(pattern: str) -> dict:
    return dict(hidden_size=4096, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                conv_kernel=4, chunk_size=128, hybrid_override_pattern=pattern, layer_norm_epsilon=1e-5, **REAL)


GLM_SMALL = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512,
                 qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_topk=256, index_head_dim=128,
                 index_n_heads=32, indexer_types=["full"] * 4, first_k_dense_replace=1, n_routed_experts=32,
                 num_experts_per_tok=8, n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                 norm_topk_prob=True, rms_norm_eps=1e-5, **REAL)
# The tests' sizes, with what llama.cpp needs of each: Gemma's own layers ending sliding, global
# (E2B's order); GLM's indexer keys of 128 (llama.cpp's indexer rotates them with a Hadamard
# matrix of that size) on every layer; Nemotron-H without MoE layers, heads of 64.
TINY = {
    "gemma4": dict(layer_types=([SLIDING] * 4 + [GLOBAL]) * 2, num_hidden_layers=10, num_kv_shared_layers=5,
                   attention_k_eq_v=False, num_global_key_value_heads=None, num_key_value_heads=1),
    "glm_moe_dsa": dict(q_lora_rank=64, qk_nope_head_dim=32, index_head_dim=128, indexer_types=["full"] * 3),
    "nemotron_h": dict(hybrid_override_pattern="M-M*-", mamba_num_heads=4, mamba_head_dim=64, n_groups=2,
                       ssm_state_size=128),
}
SHAPE_NAMES = {"gemma4": "e2b", "glm_moe_dsa": "glm5-small", "nemotron_h": "8b"}


def family_sizes(family: str, args) -> tuple[str, dict]:
    """(the shape's name for the cache folder and the tables, the checkpoint's sizes)."""
    if args.shape == "tiny":
        return "tiny", dict(TINY[family])
    if family == "gemma4":
        wide = "" if args.gemma_global_head_dim == 512 else f"-g{args.gemma_global_head_dim}"
        return f"e2b-{args.layers}{wide}", gemma4_sizes(args.layers, args.gemma_global_head_dim)
    if family == "nemotron_h":
        return f"8b-{args.pattern}", nemotron_sizes(args.pattern)
    return "glm5-small", dict(GLM_SMALL)


def checkpoint(family: str, args) -> tuple[str, str]:
    """(the shape's name, the GGUF in args.mix), each made once in args.cache_dir (the random-weight
    directory can be deleted once its GGUFs exist; it is made again, seed 0, for a new mix)."""
    from tools.tiny_checkpoint import make_tiny_checkpoint, write_tiny_gguf

    name, sizes = family_sizes(family, args)
    folder = os.path.join(args.cache_dir, f"{family}-{name}")
    gguf = os.path.join(folder, f"model-{args.mix}.gguf")
    if os.path.exists(gguf):
        return name, gguf
    if not os.path.exists(os.path.join(folder, "model.safetensors")):  # new, or deleted to save disk
        print(f"making {folder} (random weights, seed 0)", file=sys.stderr, flush=True)
        shutil.rmtree(folder + ".part", ignore_errors=True)
        make_tiny_checkpoint(folder + ".part", family, **sizes)
        for kept in os.listdir(folder) if os.path.isdir(folder) else []:
            if kept.endswith(".gguf"):  # files written before from the same seed's weights
                os.replace(os.path.join(folder, kept), os.path.join(folder + ".part", kept))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(folder + ".part", folder)
    print(f"writing {gguf}", file=sys.stderr, flush=True)
    if family == "gemma4":
        from tools.gemma4_gguf import write_gemma4_gguf
        write_gemma4_gguf(folder, args.mix, gguf + ".part")
    elif family == "glm_moe_dsa":
        from tools.glm_gguf import write_glm_gguf
        write_glm_gguf(folder, args.mix, gguf + ".part")
    else:
        write_tiny_gguf(folder, args.mix, gguf + ".part")
    os.replace(gguf + ".part", gguf)
    return name, gguf


# -- TensorFold: the engine on the file, timers around each layer ------------------------------

def layer_kind(layer) -> str:
    """A layer's kind for the share table: its mixer's class (with the window and KV sharing
    where it has them) and its feed-forward's (with its width)."""
    parts = []
    if getattr(layer, "mixer", None) is not None:
        spec, name = layer.mixer.spec, type(layer.mixer).__name__
        if getattr(spec, "window", None):
            name += " sliding"
        elif hasattr(spec, "kv_source"):  # Gemma 4's: sliding or global
            name += " global"
        if getattr(spec, "kv_source", None) is not None:
            name += ", KV-shared"
        if getattr(spec, "indexer", None) is not None:
            name += " + DSA indexer"
        elif getattr(spec, "selection_source", None) is not None:
            name += " (shared selection)"
        parts.append(name)
    if getattr(layer, "ffn", None) is not None:
        spec, name = layer.ffn.spec, type(layer.ffn).__name__
        width = getattr(spec, "intermediate_size", None)
        if hasattr(spec, "num_experts"):
            name += f" {spec.num_experts}x{width}, top {spec.top_k}"
        elif width:
            name += f" {width}"
        parts.append(name)
    return " + ".join(parts)


class Clocks:
    """Seconds per label, summed over the timed calls since reset()."""

    def __init__(self):
        self.seconds = {}

    def _timed(self, fn, label: str):
        def run(*a, **k):
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(label, time.perf_counter() - started)
        return run

    def add(self, label: str, seconds: float) -> None:
        self.seconds[label] = self.seconds.get(label, 0.0) + seconds

    def reset(self) -> None:
        self.seconds = {}


class LayerClocks(Clocks):
    """Seconds spent in each layer kind (layer_kind's label): the model's per-layer call (the
    decoder's _run entry, or the layer's forward where the family's model calls it directly), and
    within a layer that runs in Python, its mixer's and its feed-forward's."""

    def __init__(self, model):
        super().__init__()
        self.count = {}
        for i, layer in enumerate(model.layers):
            kind = layer_kind(layer)
            self.count[kind] = self.count.get(kind, 0) + 1
            model._run[i] = self._timed(model._run[i], kind)
            layer.forward = self._timed(layer.forward, kind)  # Gemma4Model calls the layer itself
            for part in ("mixer", "ffn"):
                block = getattr(layer, part, None)
                if block is not None:
                    block.forward = self._timed(block.forward, f"{kind} | {part}")

    def shares(self, total_s: float) -> dict:
        return {label: s / total_s for label, s in self.seconds.items()}


def tensorfold_bench(path: str, args):
    import torch

    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams
    from tools.bench_native import prompt_ids, streams_decode_tps

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    engine = Engine(path, EngineConfig(num_threads=args.threads, prompt_cache_gib=0, context=1024,
                                       kv_cache_gib=args.cache_gib, block_size=args.block_size,
                                       max_tokens_per_step=512))
    out = {"exact": engine.exact, "ops": engine.info.ops, "kv": engine.info.kv_dtype,
           "load_s": time.perf_counter() - started}
    greedy = dict(temperature=0, ignore_eos=True, draft=False)
    engine.generate(prompt_ids(8), SamplingParams(max_tokens=2, **greedy))  # warm-up
    clocks = LayerClocks(engine.backend.model)
    out["counts"] = clocks.count

    def once() -> None:
        rid = engine.add_request(prompt_ids(16), SamplingParams(max_tokens=args.tokens, **greedy))
        req = engine.requests[rid]
        while req.num_computed_tokens < 16:
            engine.step()  # the prompt (and the first token)
        clocks.reset()
        started = time.perf_counter()
        while engine.has_work():
            engine.step()
        round_s = (time.perf_counter() - started) / (len(req.output_ids) - 1)
        if 1 / round_s > out.get("decode", 0):
            out["decode"], out["decode_shares"] = 1 / round_s, clocks.shares(round_s * (len(req.output_ids) - 1))
        clocks.reset()
        done = engine.generate(prompt_ids(args.prefill_tokens, offset=7), SamplingParams(max_tokens=1, **greedy))
        prefill_s = done.request.stats.prefill_s
        if args.prefill_tokens / prefill_s > out.get("prefill", 0):
            out["prefill"], out["prefill_shares"] = args.prefill_tokens / prefill_s, clocks.shares(prefill_s)
        out["four"] = max(out.get("four", 0), streams_decode_tps(engine, 4, args.tokens))
    return engine, out, once


def profile_decode(engine, args, rows: int = 12) -> str:
    """torch.profiler's top ops (self CPU time) over one stream's decode of --tokens tokens."""
    from torch.profiler import ProfilerActivity, profile

    from tensorfold.sampling.params import SamplingParams
    from tools.bench_native import prompt_ids

    rid = engine.add_request(prompt_ids(16, offset=3), SamplingParams(max_tokens=args.tokens, temperature=0,
                                                                      ignore_eos=True, draft=False))
    while engine.requests[rid].num_computed_tokens < 16:
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_work():
            engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# -- llama.cpp ---------------------------------------------------------------------------------

def peer_check(gguf: str, threads: int) -> str | None:
    """None where llama.cpp loads the file and evaluates a prompt in a child process, else why not."""
    from tools import peer_llama_cpp

    if not peer_llama_cpp.available():
        return peer_llama_cpp.SKIP_MESSAGE
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from tools import peer_llama_cpp\n"
            "llm = peer_llama_cpp.load(%r, n_ctx=256, threads=%d)\n"
            "llm.eval(peer_llama_cpp.arbitrary_prompt(8)); print('ok')\n") % (ROOT, gguf, threads)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode == 0 and done.stdout.strip().endswith("ok"):
        return None
    said = [line for line in (done.stderr + done.stdout).splitlines()
            if any(w in line for w in ("error", "ASSERT", "Error", "failed"))]
    return f"llama.cpp refused the file (exit {done.returncode}): " + (said[0].strip()[-160:] if said else "?")


def llama_cpp_bench(gguf: str, args):
    from tools import peer_llama_cpp
    from tools.bench_native import peer_round

    llm = peer_llama_cpp.load(gguf, n_ctx=1024, threads=args.threads)
    out = {}
    return out, lambda: peer_round(llm, args, out)


# -- one (family, mix) in a child process ------------------------------------------------------

def worker(family: str, args) -> dict:
    name, gguf = checkpoint(family, args)
    result = {"family": family, "shape": name, "mix": args.mix, "gguf_mib": os.path.getsize(gguf) / 2**20,
              "load_before": loadavg()}
    why = None if args.no_peer else peer_check(gguf, args.threads)
    engine, ours, ours_once = tensorfold_bench(gguf, args)
    peer, peer_once = ({}, lambda: None) if why or args.no_peer else llama_cpp_bench(gguf, args)
    for _ in range(args.repeats):
        ours_once()
        peer_once()
    if args.profile:
        result["profile"] = profile_decode(engine, args)
    result.update(ours=ours, peer=peer, peer_missing=why or ("--no-peer" if args.no_peer else None),
                  load_after=loadavg())
    return result


def run_worker(family: str, mix: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", family, "--mixes", mix]
    for flag in ("shape", "layers", "gemma_global_head_dim", "pattern", "threads", "tokens", "prefill_tokens",
                 "repeats", "block_size", "cache_gib", "cache_dir"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    cmd += ["--profile"] * args.profile + ["--no-peer"] * args.no_peer
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        said = [line for line in done.stderr.splitlines() if "Error" in line.split(":")[0]]
        return {"family": family, "mix": mix,
                "error": f"worker exit {done.returncode}" + (f": {said[-1].strip()[:160]}" if said else "")}
    return json.loads(done.stdout.strip().splitlines()[-1])


def target(ratio: float | None, goal: float) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x ({'met' if ratio >= goal else 'missed'})"


def tables(results: list[dict], args) -> None:
    rows, shares = [], []
    for r in results:
        if "error" in r:
            rows.append([r["family"], "", r["mix"], r["error"]] + [""] * 11)
            continue
        ours, peer = r["ours"], r["peer"]

        def ratio(key):
            return ours[key] / peer[key] if peer.get(key) else None
        rows.append([r["family"], r["shape"], r["mix"], f"{r['gguf_mib']:.0f}",
                     fmt(ours["decode"], 1), fmt(peer.get("decode"), 1), target(ratio("decode"), 1.2),
                     fmt(ours["prefill"], 0), fmt(peer.get("prefill"), 0), target(ratio("prefill"), 1.0),
                     fmt(ours["four"], 1), fmt(peer.get("four"), 1), fmt(ratio("four"), 2),
                     f"{r['load_before']} / {r['load_after']}", r["peer_missing"] or ""])
        labels = sorted({*ours["decode_shares"], *ours["prefill_shares"]})
        for label in labels:
            kind, _, part = label.partition(" | ")
            count = ours["counts"].get(kind, "")
            shares.append([r["family"], r["mix"], f"{kind} (x{count})" if not part else f"  of which {part}",
                           f"{100 * ours['decode_shares'].get(label, 0):.1f}%",
                           f"{100 * ours['prefill_shares'].get(label, 0):.1f}%"])
        layers = [label for label in labels if " | " not in label]
        shares.append([r["family"], r["mix"], "rest (embedding, head, draw, engine)",
                       f"{100 * (1 - sum(ours['decode_shares'].get(k, 0) for k in layers)):.1f}%",
                       f"{100 * (1 - sum(ours['prefill_shares'].get(k, 0) for k in layers)):.1f}%"])
    print_table(["family", "shape", "blocks", "file MiB", "decode tok/s", "llama.cpp", "ratio (>= 1.2x)",
                 f"prefill {args.prefill_tokens} tok/s", "llama.cpp", "ratio (>= 1.0x)", "4 streams tok/s",
                 "llama.cpp", "ratio", "load avg before / after", "peer"], rows,
                f"{args.threads} threads, {args.tokens} new tokens, best of {args.repeats}, engines alternating")
    print_table(["family", "blocks", "layer kind (count)", "share of a decode round",
                 f"share of the {args.prefill_tokens}-token prefill"], shares,
                "TensorFold: each layer kind's share (timers around its calls; the best decode repeat)")
    for r in results:
        if r.get("profile"):
            print(f"\n{r['family']} {r['mix']}: top ops of a decode round (torch.profiler, self CPU)\n{r['profile']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="gemma4,nemotron_h,glm_moe_dsa")
    p.add_argument("--shape", default="real", choices=["real", "tiny"], help="real: the shapes above")
    p.add_argument("--layers", type=int, default=10, help="gemma4's layers (E2B: 35)")
    p.add_argument("--gemma-global-head-dim", type=int, default=512,
                   help="gemma4's global layers' head size (E2B's: 512; 256: the earlier rows' shape)")
    p.add_argument("--pattern", default="M-M*-", help="nemotron_h's layer pattern (the 8B's: 52 layers)")
    p.add_argument("--mixes", default="q8_0", help="GGUF block types, comma-separated (q8_0, q4_0)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--block-size", type=int, default=256, help="cache block (one recurrent state per block)")
    p.add_argument("--cache-gib", type=float, default=2.0)
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/tensorfold-bench/families"))
    p.add_argument("--profile", action="store_true", help="also torch.profiler's top ops of a decode round")
    p.add_argument("--no-peer", action="store_true", help="TensorFold alone")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.mix = args.mixes
        print(json.dumps(worker(args.worker, args)))
        return
    print(machine_line(), flush=True)
    started = time.perf_counter()
    results = []
    for family in args.families.split(","):
        for mix in args.mixes.split(","):
            results.append(run_worker(family, mix, args))
            print(f"  {family} {mix}: done ({time.perf_counter() - started:.0f} s, load average {loadavg()})",
                  flush=True)
    tables(results, args)
    print(f"\nload average at the end: {loadavg()}; total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
