"""GLM-5.x (glm_moe_dsa) on the cpu backend next to transformers, on the same random weights.

    python tools/bench_glm.py                    # the tiny and the small shape, float32, 2 threads
    python tools/bench_glm.py --shape small --quantize q8_0

Shapes (random weights made with transformers, SmolLM2's 49,152-token vocabulary):
- tiny: tools/tiny_checkpoint.GLM_TINY (the tests' model: hidden 64, 3 layers) with q_lora 64 and
  nope 32, so every row is whole blocks of 32 (--quantize);
- small: GLM-5's layer kinds scaled down (hidden 768, 4 layers of which the first dense, 8 heads,
  q_lora 384, kv_lora 256, nope 64 / rope 32 / v 64, an indexer of 16 heads of 64 choosing 256 keys,
  16 experts of 256 in 4 groups, top 4, a shared expert); the real GLM-5 (hidden 6144, 78 layers,
  256 experts) does not fit this machine.
llama.cpp has glm-dsa, but the llama-cpp-python build here predates it: transformers is the peer.
Columns: one-stream greedy decode after a 16-token prompt (drafting off), a 512-token prefill
(longer than index_topk, so the indexer selects), 4 streams' aggregate decode; best of --repeats.
"""
import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools.bench_core import fmt, machine_line, print_table  # noqa: E402
from tools.bench_native import prompt_ids, streams_decode_tps  # noqa: E402

SHAPES = {
    "tiny": dict(q_lora_rank=64, qk_nope_head_dim=32),  # tools/glm_gguf.GLM_GGUF_SIZES: rows in whole blocks
    "small": dict(hidden_size=768, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=256,
                  qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, index_topk=256, index_head_dim=64,
                  index_n_heads=16, indexer_types=["full", "shared", "full", "shared"], first_k_dense_replace=1,
                  n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1),
}


def tensorfold_round(path: str, args, quantize: str | None) -> dict:
    import torch

    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = Engine(path, EngineConfig(num_threads=args.threads, prompt_cache_gib=0, kv_cache_gib=0.25, probe=False,
                                       max_tokens_per_step=512, quantize=quantize))
    greedy = dict(temperature=0, ignore_eos=True, draft=False)
    engine.generate(prompt_ids(8), SamplingParams(max_tokens=2, **greedy))  # warm-up
    out = {}
    for _ in range(args.repeats):
        done = engine.generate(prompt_ids(16), SamplingParams(max_tokens=args.tokens, **greedy))
        out["decode"] = max(out.get("decode", 0), (args.tokens - 1) / done.request.stats.decode_s)
        done = engine.generate(prompt_ids(512, offset=7), SamplingParams(max_tokens=1, **greedy))
        out["prefill"] = max(out.get("prefill", 0), 512 / done.request.stats.prefill_s)
        out["four"] = max(out.get("four", 0), streams_decode_tps(engine, 4, args.tokens))
    engine.close()
    return out


def transformers_round(path: str, args) -> dict:
    import torch
    from transformers import GlmMoeDsaForCausalLM

    torch.set_num_threads(args.threads)
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        model.generate(torch.tensor([prompt_ids(8)]), max_new_tokens=2, do_sample=False)  # warm-up
        for _ in range(args.repeats):
            prompt = torch.tensor([prompt_ids(16)])
            started = time.perf_counter()
            model.generate(prompt, max_new_tokens=1, do_sample=False)
            first = time.perf_counter() - started
            started = time.perf_counter()
            model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
            out["decode"] = max(out.get("decode", 0), (args.tokens - 1) / (time.perf_counter() - started - first))
            started = time.perf_counter()
            model(torch.tensor([prompt_ids(512, offset=7)]))
            out["prefill"] = max(out.get("prefill", 0), 512 / (time.perf_counter() - started))
            prompts = torch.tensor([prompt_ids(16, offset=100 * i) for i in range(4)])
            started = time.perf_counter()
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.tokens,
                           min_new_tokens=args.tokens, do_sample=False)
            out["four"] = max(out.get("four", 0), 4 * args.tokens / (time.perf_counter() - started))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES) + ["all"], default="all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quantize", choices=["q8_0", "q4_0"], default=None, help="also TensorFold in blocks")
    args = parser.parse_args(argv)
    from tools.tiny_checkpoint import make_tiny_checkpoint

    rows = []
    for shape in SHAPES if args.shape == "all" else [args.shape]:
        path = make_tiny_checkpoint(tempfile.mkdtemp(prefix=f"glm-{shape}-"), "glm_moe_dsa", **SHAPES[shape])
        peer = transformers_round(path, args)
        runs = [("float32", tensorfold_round(path, args, None))]
        if args.quantize:
            runs.append((args.quantize, tensorfold_round(path, args, args.quantize)))
        for dtype, ours in runs:
            rows.append([shape, dtype, fmt(ours["decode"], 1), fmt(peer["decode"], 1), fmt(ours["decode"] / peer["decode"]),
                         fmt(ours["prefill"], 0), fmt(peer["prefill"], 0), fmt(ours["prefill"] / peer["prefill"]),
                         fmt(ours["four"], 1), fmt(peer["four"], 1)])
    print(machine_line())
    print_table(["shape", "TensorFold", "decode tok/s", "transformers", "ratio", "prefill 512 tok/s", "transformers",
                 "ratio", "4 streams tok/s", "transformers"], rows)


if __name__ == "__main__":
    main()
