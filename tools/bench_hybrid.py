"""The Qwen hybrids at real shapes against llama.cpp on the same weights, in one run (issue 32).

    python tools/bench_hybrid.py                       # Qwen3.5-0.8B's shapes, q4_0, 2 threads
    python tools/bench_hybrid.py --shape moe --layers 4
    python tools/bench_hybrid.py --long 4096           # also a round at 4k tokens of context
    python tools/bench_hybrid.py --mlx                 # also mlx_lm on MLX's CPU device, once

Random weights at the smallest real shapes, SmolLM2's tokenizer (49,152 tokens) in place of the
248k-token one, made once with transformers and kept in --cache-dir:
- dense: Qwen3.5-0.8B: hidden 1024, 24 layers (every fourth full attention, 8 heads / 2 KV heads of
  256, a quarter rotated), Gated DeltaNet with 16 key and 16 value heads of 128, FFN 3584, tied;
- moe: Qwen3.6-35B-A3B's layer shapes (hidden 2048, 256 experts of 512, top 8, a shared expert of
  512, DeltaNet 16 key / 32 value heads of 128, attention 16 heads / 2 KV of 256), cut to --layers
  layers (every fourth full attention) so that it fits this machine.
dense: TensorFold quantizes the matrices at load (--quant), llama.cpp runs a GGUF of the same
weights in the same block type (tools/tiny_checkpoint.write_tiny_gguf); moe: both serve one GGUF
written a layer at a time (tiny_checkpoint.write_hybrid_gguf_by_layer), TensorFold its blocks as
stored. The peer's column is skipped with a message when llama-cpp-python is missing. Best of --repeats, the engines alternating.
Columns: one-stream decode after a 16-token prompt (drafting off), a 512-token prefill, 4 streams'
aggregate decode, the DeltaNet layers' share of a decode round (their time, mixer and MLP, over
the round), and with --long N the decode round at N tokens of context over the round at 100.
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
from tools.bench_native import peer_round, prompt_ids, streams_decode_tps  # noqa: E402

SHAPES = {
    "dense": ("qwen3_5", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                              head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                              linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=3584)),
    "moe": ("qwen3_5_moe", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                linear_value_head_dim=128, intermediate_size=512, num_experts=256,
                                num_experts_per_tok=8, moe_intermediate_size=512,
                                shared_expert_intermediate_size=512)),
    "tiny": ("qwen3_5_moe", {}),  # tools/tiny_checkpoint.py's sizes: the tool's own tests
    "tiny-gguf": ("qwen3_5_moe", dict(linear_key_head_dim=32, linear_value_head_dim=32)),  # written by layer
}
REAL = ("dense", "moe")  # the shapes of real checkpoints (the others: the tool's tests)
BY_LAYER = ("moe", "tiny-gguf")  # written straight to a GGUF a layer at a time
ROPE = dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
            mrope_interleaved=True)
REAL_SIZES = dict(max_position_embeddings=8192, initializer_range=0.02, rope_parameters=ROPE)


def checkpoint(shape: str, layers: int | None, cache_dir: str, quant: str) -> tuple[str, str | None]:
    """(what TensorFold serves, the peer's GGUF or None: made from it on demand), made once.
    dense: an HF directory (quantized at load), moe: a GGUF written a layer at a time (its experts
    would not fit this machine twice), served as stored by both engines."""
    from tools.tiny_checkpoint import make_tiny_checkpoint, smollm2_tokenizer, write_hybrid_gguf_by_layer

    arch, sizes = SHAPES[shape]
    sizes = dict(sizes, **REAL_SIZES) if shape in REAL else dict(sizes)
    if layers:
        sizes["num_hidden_layers"] = layers
    out = os.path.join(cache_dir, f"{shape}-{sizes.get('num_hidden_layers', 4)}")
    if shape in BY_LAYER:
        gguf = os.path.join(out, f"model-{quant}.gguf")
        if not os.path.exists(gguf):
            print(f"making {gguf} (random weights, once, a layer at a time)", file=sys.stderr)
            write_hybrid_gguf_by_layer(out, arch, quant, tokenizer=smollm2_tokenizer(), **sizes)
        return gguf, gguf
    if not os.path.exists(os.path.join(out, "config.json")):
        print(f"making {out} (random weights, once)", file=sys.stderr)
        make_tiny_checkpoint(out, arch, tokenizer=smollm2_tokenizer(), **sizes)
    return out, None


class LayerClock:
    """Time spent in the DeltaNet layers (mixer and MLP: the native path runs each as one call), to
    set against a round's."""

    def __init__(self, engine):
        from tensorfold.models.linear_attention import GatedDeltaNet

        self.seconds = 0.0
        model = engine.backend.model
        for i, layer in enumerate(model.layers):
            if isinstance(layer.mixer, GatedDeltaNet):
                model._run[i] = self._timed(model._run[i])

    def _timed(self, fn):
        def run(*a, **k):
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - started
        return run


def tensorfold_bench(path: str, args):
    import torch

    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    context = max(1024, args.long + args.tokens + 16)
    engine = Engine(path, EngineConfig(quantize=None if path.endswith(".gguf") else args.quant, num_threads=args.threads, prompt_cache_gib=0,
                                       context=context, kv_cache_gib=args.cache_gib, block_size=args.block_size,
                                       max_tokens_per_step=512))
    out = {"exact": engine.exact, "ops": engine.info.ops}
    greedy = dict(temperature=0, ignore_eos=True, draft=False)
    engine.generate(prompt_ids(8), SamplingParams(max_tokens=2, **greedy))  # warm-up
    clock = LayerClock(engine)

    def decode_round_s(prompt_len: int) -> float:
        done = engine.generate(prompt_ids(prompt_len), SamplingParams(max_tokens=args.tokens, **greedy))
        return done.request.stats.decode_s / (args.tokens - 1)

    def once() -> None:
        clock.seconds = 0.0
        round_s = decode_round_s(16)
        out["decode"] = max(out.get("decode", 0), 1 / round_s)
        out["delta_share"] = min(out.get("delta_share", 1), clock.seconds / (round_s * (args.tokens - 1) + 1e-9))
        done = engine.generate(prompt_ids(args.prefill_tokens), SamplingParams(max_tokens=1, **greedy))
        out["prefill"] = max(out.get("prefill", 0), args.prefill_tokens / done.request.stats.prefill_s)
        out["four"] = max(out.get("four", 0), streams_decode_tps(engine, 4, args.tokens))
        if args.long:
            short, deep = decode_round_s(100), decode_round_s(args.long)
            out["long_ratio"] = min(out.get("long_ratio", 99), deep / short)
            out["long_round"] = min(out.get("long_round", 99), deep)
    return out, once


def llama_cpp_bench(path: str, gguf: str | None, args):
    if not peer_llama_cpp.available():
        print(peer_llama_cpp.SKIP_MESSAGE)
        return None
    from tools.tiny_checkpoint import write_tiny_gguf

    gguf = gguf or os.path.join(path, f"peer-{args.quant}.gguf")
    if not os.path.exists(gguf):
        try:
            write_tiny_gguf(path, args.quant, gguf)
        except Exception as e:  # noqa: BLE001 - a peer column, not a result: say why and go on
            print(f"no GGUF for the peer ({e}); skipping llama.cpp")
            return None
    llm = peer_llama_cpp.load(gguf, n_ctx=max(1024, args.long + args.tokens + 16), threads=args.threads)
    out = {}

    def once() -> None:
        peer_round(llm, args, out)
        if args.long:
            short = 1 / peer_llama_cpp.decode_tps(llm, prompt_ids(100), args.tokens)
            deep = 1 / peer_llama_cpp.decode_tps(llm, prompt_ids(args.long), args.tokens)
            out["long_ratio"] = min(out.get("long_ratio", 99), deep / short)
            out["long_round"] = min(out.get("long_round", 99), deep)
    return out, once


def mlx_lm_bench(path: str, gguf: str | None, args) -> dict:
    """mlx_lm on MLX's CPU device (tools/peer_mlx_lm.py), once: it reads Hugging Face directories only
    (no GGUF: the moe shape has none), MLX's 4- or 8-bit blocks of 32 for --quant."""
    from tools import peer_mlx_lm

    if not peer_mlx_lm.available():
        print(peer_mlx_lm.SKIP_MESSAGE)
        return {}
    if gguf and gguf == path:
        print("mlx_lm reads Hugging Face directories; this shape is a GGUF only: skipping mlx_lm")
        return {}
    model = peer_mlx_lm.load(path, bits=8 if args.quant == "q8_0" else 4)
    return {"decode": peer_mlx_lm.decode_tps(model, prompt_ids(16), args.tokens),
            "prefill": args.prefill_tokens / peer_mlx_lm.prefill_seconds(model, prompt_ids(args.prefill_tokens))}


def ratio(ours, peer):
    return f"{ours / peer:.2f}x" if peer else "-"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="dense", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="layers of the stack (default: dense 24, moe 4)")
    p.add_argument("--quant", default="q4_0", choices=["q4_0", "q8_0"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--long", type=int, default=0, help="also a decode round at this context (0: off)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--block-size", type=int, default=256, help="cache block (one recurrent state per block)")
    p.add_argument("--cache-gib", type=float, default=2.0)
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/tensorfold-bench"))
    p.add_argument("--mlx", action="store_true", help="also mlx_lm on MLX's CPU device, once (dense shape)")
    args = p.parse_args(argv)
    layers = args.layers or (4 if args.shape == "moe" else None)
    path, peer_gguf = checkpoint(args.shape, layers, args.cache_dir, args.quant)
    print(machine_line())
    ours, ours_once = tensorfold_bench(path, args)
    peer_bench = llama_cpp_bench(path, peer_gguf, args)
    peer, peer_once = peer_bench if peer_bench else ({}, lambda: None)
    for _ in range(args.repeats):
        ours_once()
        peer_once()
    row = [f"{args.shape} ({os.path.basename(os.path.dirname(path) if peer_gguf else path)})", args.quant, ours["ops"], ours["exact"],
           fmt(ours["decode"], 1), fmt(peer.get("decode"), 1), ratio(ours["decode"], peer.get("decode")),
           fmt(ours["prefill"], 0), fmt(peer.get("prefill"), 0), ratio(ours["prefill"], peer.get("prefill")),
           fmt(ours["four"], 1), fmt(peer.get("four"), 1), ratio(ours["four"], peer.get("four")),
           f"{100 * ours['delta_share']:.0f}%"]
    headers = ["model", "blocks", "ops", "exact", "decode tok/s", "llama.cpp", "ratio",
               f"prefill {args.prefill_tokens} tok/s", "llama.cpp", "ratio", "4 streams tok/s", "llama.cpp", "ratio",
               "DeltaNet layers' share of a round"]
    if args.long:
        row += [f"{ours['long_ratio']:.2f}x", fmt(peer.get("long_ratio"), 2), fmt(1e3 * ours["long_round"], 1),
                fmt(1e3 * peer["long_round"] if "long_round" in peer else None, 1)]
        headers += [f"round @{args.long} / @100", "llama.cpp", f"round @{args.long} ms", "llama.cpp"]
    if args.mlx:
        mlx = mlx_lm_bench(path, peer_gguf, args)
        row += [fmt(mlx.get("decode"), 1), ratio(ours["decode"], mlx.get("decode")), fmt(mlx.get("prefill"), 0),
                ratio(ours["prefill"], mlx.get("prefill"))]
        headers += ["mlx_lm decode (CPU, once)", "ratio", "mlx_lm prefill", "ratio"]
    print_table(headers, [row], f"{args.threads} threads, {args.tokens} new tokens, best of {args.repeats}")


if __name__ == "__main__":
    main()
