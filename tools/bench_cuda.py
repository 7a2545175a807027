"""The cuda backend end to end on one GPU, next to transformers on the same GPU and weights.

    python tools/bench_cuda.py                              # llama-1b shape: bf16 and q8_0
    python tools/bench_cuda.py --shape qwen3-1.7b --streams 1,8,32 --tokens 128
    python tools/bench_cuda.py --smoke                      # tiny sizes, anywhere (times meaningless)

A random checkpoint at a real shape (tools/real_shapes.py's SHAPES) with SmolLM2's tokenizer is
written once per run: a Hugging Face folder in bfloat16 (transformers' own model class, saved by
save_pretrained) and a GGUF of q8_0 blocks (real_shapes.write_random_gguf). Rows:
- bf16: the engine with --dtype bfloat16 (cuBLAS GEMMs under the probes' check, Triton attention,
  norms, rope and sampler) on the folder, and transformers' generate on the same folder;
- q8_0: the engine with --dtype auto on the GGUF (the Triton quantized GEMM on the blocks as
  stored); transformers has no counterpart.
Columns: load seconds (the engine's constructor, startup probes included); decode tokens/s of one
greedy stream after a 16-token prompt (drafting off), then the aggregate of N streams side by
side; prefill tokens/s of a --prefill-tokens prompt. transformers' decode is (tokens - 1) over
generate's time for `tokens` new tokens minus its time for one; its prefill is the one-token time.
Best of --repeats each. Without a GPU (and without --smoke) it says so and exits 0.
"""
import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools.bench_native import prompt_ids, streams_decode_tps  # noqa: E402
from tools.real_shapes import SHAPES, write_random_gguf  # noqa: E402

SMOKE_SHAPE = ("llama", 64, 2, 4, 2, 16, 128, 10000.0)


def hf_checkpoint(out_dir: str, shape: tuple, device: str) -> str:
    """A random bf16 transformers checkpoint of `shape` with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tools.tiny_checkpoint import smollm2_tokenizer

    arch, hidden, layers, heads, kv_heads, head_dim, ffn, theta = shape
    tok = smollm2_tokenizer()
    config = AutoConfig.for_model(arch, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                  num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=ffn,
                                  rope_theta=theta, vocab_size=len(tok), max_position_embeddings=8192,
                                  tie_word_embeddings=True, rms_norm_eps=1e-6, dtype="bfloat16",
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def engine_row(path: str, dtype: str, args, device: str) -> dict:
    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams

    started = time.perf_counter()
    engine = Engine(path, EngineConfig(backend="cuda", device=device, dtype=dtype, context=4096, kv_cache_gib=4.0,
                                       prompt_cache_gib=0, max_num_seqs=max(args.streams), drafting=False,
                                       probe=not args.smoke, max_tokens_per_step=max(512, args.prefill_tokens)))
    out = {"load": time.perf_counter() - started, "ops": engine.info.ops}
    greedy = dict(temperature=0, ignore_eos=True, draft=False)
    for n in (8, args.prefill_tokens):  # warm-up: compiles the kernels at decode and prefill shapes
        engine.generate(prompt_ids(n), SamplingParams(max_tokens=2, **greedy))
    for _ in range(args.repeats):
        for n in args.streams:
            out[n] = max(out.get(n, 0), streams_decode_tps(engine, n, args.tokens))
        done = engine.generate(prompt_ids(args.prefill_tokens), SamplingParams(max_tokens=1, **greedy))
        out["prefill"] = max(out.get("prefill", 0), args.prefill_tokens / done.request.stats.prefill_s)
    return out


def transformers_row(path: str, args, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)

    def generate(prompt: list[int], new: int) -> float:
        ids = torch.tensor([prompt], device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    generate(prompt_ids(8), 2)  # warm-up
    generate(prompt_ids(args.prefill_tokens), 1)
    out = {"ops": "transformers generate, bf16"}
    for _ in range(args.repeats):
        decode = (args.tokens - 1) / (generate(prompt_ids(16), args.tokens) - generate(prompt_ids(16), 1))
        out[1] = max(out.get(1, 0), decode)
        out["prefill"] = max(out.get("prefill", 0), args.prefill_tokens / generate(prompt_ids(args.prefill_tokens), 1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--streams", default="1,8", help="comma-separated stream counts")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes in Triton's interpreter, on the CPU")
    args = ap.parse_args(argv)
    args.streams = [int(n) for n in args.streams.split(",")]
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.tokens, args.prefill_tokens, args.repeats, args.streams = 4, 16, 1, [1, 2]
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("bench_cuda: no CUDA GPU here; nothing to time (try --smoke to check the script).")
        return 0
    device = "cpu" if args.smoke else "cuda"
    shape = SMOKE_SHAPE if args.smoke else SHAPES[args.shape]
    name = "CPU (smoke run: interpreter, times meaningless)" if args.smoke else torch.cuda.get_device_name()
    print(f"{name}; torch {torch.__version__}; shape {'tiny' if args.smoke else args.shape}: {shape}; "
          f"{args.tokens} new tokens, prefill {args.prefill_tokens}, best of {args.repeats}\n")
    with tempfile.TemporaryDirectory(prefix="tensorfold-bench-cuda-") as tmp:
        folder = hf_checkpoint(os.path.join(tmp, "hf"), shape, device)
        gguf_path = os.path.join(tmp, "q8_0.gguf")
        write_random_gguf(gguf_path, *shape, qtype="q8_0")
        rows = [("TensorFold bf16", engine_row(folder, "bfloat16", args, device)),
                ("transformers bf16", transformers_row(folder, args, device)),
                ("TensorFold q8_0 (blocks as stored)", engine_row(gguf_path, "auto", args, device))]
    streams = [f"{n} stream{'s' if n > 1 else ''} tok/s" for n in args.streams]
    print("| engine | ops | load s | " + " | ".join(streams) + " | prefill tok/s |")
    print("|---|---|---|" + "---|" * len(streams) + "---|")
    for label, row in rows:
        cells = [f"{row[n]:.1f}" if n in row else "-" for n in args.streams]
        load = f"{row['load']:.1f}" if "load" in row else "-"
        print(f"| {label} | {row['ops']} | {load} | " + " | ".join(cells) + f" | {row['prefill']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
