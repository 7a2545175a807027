"""Quality of the quantized path: perplexity of the default model's Q4_1 blocks served as stored,
next to the same file dequantized to float32 and to llama.cpp on the same file (issue 33).

    python tools/bench_perplexity.py                     # 8 windows of 512 tokens, 2 threads
    python tools/bench_perplexity.py --windows 2 --threads 1
    python tools/bench_perplexity.py --type q4_k_m       # the default model requantized by llama.cpp

The text is English prose that every Python installation carries: the language reference's
topics in `pydoc_data.topics` (assignment, the execution model, ...), joined in a fixed order
until there are enough tokens (the table names the Python version: the text can differ between
versions). It is cut into windows of --window tokens, each evaluated from position 0 on its own;
the second half of each window is scored (every scored token sees at least window/2 before it), as
llama.cpp's perplexity tool does. Perplexity = exp(mean negative log-likelihood), each log-softmax
in float64 from the engine's float32 logits. Rows:
- TensorFold, --dtype auto: the blocks as stored, int8 activation blocks, exact integer GEMM;
- TensorFold, --dtype float32: every weight dequantized to float32 (the dense path);
- llama.cpp (llama-cpp-python, a peer only) on the same file, logits of every position.
The target: the quantized path within 1% of llama.cpp's and of the dense path's perplexity.
--type TYPE (q4_k_m, q6_k, q4_0, q8_0) evaluates the default model requantized to TYPE by
llama.cpp's own quantizer from its float32 copy (tools/peer_gguf.py; written once under
~/.cache/tensorfold/peer): the K-quants' path (activations per 256) on the tensors whose rows
are whole super-blocks (SmolLM2's hidden size, 576, is not: llama.cpp gives those its fallback
types), the rest on the 32-weight types.
"""
import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools import peer_llama_cpp  # noqa: E402

TOPICS = ("execmodel", "assignment", "compound", "naming", "exceptions", "import", "atom-identifiers",
          "bltin-code-objects", "typesseq", "numbers", "lambda", "class", "function", "for", "while",
          "if", "with", "try", "yield", "return")


def prose() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[t] for t in TOPICS if t in topics)


def windows(ids: list[int], size: int, count: int) -> list[list[int]]:
    out = [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)][:count]
    if len(out) < count:
        raise SystemExit(f"the text has {len(ids)} tokens: {count} windows of {size} need more")
    return out


def nll(logits, window: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of the window's second half, and how many tokens: logits
    [len(window), vocab] (row i predicts token i + 1), in float64."""
    import torch
    first = len(window) // 2
    rows = torch.as_tensor(logits[first - 1:len(window) - 1]).double()
    targets = torch.tensor(window[first:])
    lse = torch.logsumexp(rows, dim=-1)
    return float((lse - rows[torch.arange(len(targets)), targets]).sum()), len(targets)


def requantized(qtype: str, threads: int) -> str:
    """The default model requantized to `qtype` by llama.cpp's quantizer (written once)."""
    from tools.peer_gguf import peer_gguf
    from tools.real_shapes import _quantize

    src = peer_gguf("float32")
    out = src.replace(".F32.gguf", f".{qtype.upper()}.gguf")
    if not os.path.isfile(out):
        _quantize(src, out + ".part", qtype, threads)
        os.replace(out + ".part", out)
    return out


def tensorfold_logits(path: str, dtype: str, threads: int):
    """A function window -> logits of every position, on a fresh engine serving `path` in `dtype`."""
    import torch

    from tensorfold.engine.engine import Engine, EngineConfig
    from tensorfold.models.forward_batch import ForwardBatch, SequenceRows

    torch.set_num_threads(threads)
    engine = Engine(path, EngineConfig(dtype=dtype, num_threads=threads, probe=False, prompt_cache_gib=0,
                                       context=2048, kv_cache_gib=0.1))
    model, cache, block = engine.backend.model, engine.backend.cache, engine.config.block_size

    def run(window: list[int]):
        n = len(window)
        t = (lambda x: torch.tensor(list(x), dtype=torch.int64))  # noqa: E731
        table = t(range(-(-n // block)))  # the idle engine's first blocks: positions = slots
        batch = ForwardBatch(t(window), t(range(n)), t(range(n)), [SequenceRows(0, n, table)], t(range(n)))
        return model.forward(batch, cache).float()
    return engine, run


def llama_cpp_logits(path: str, window_size: int, threads: int):
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=window_size, n_threads=threads, n_threads_batch=threads, n_batch=window_size,
                logits_all=True, verbose=False)

    def run(window: list[int]):
        llm.reset()
        llm.eval(window)
        return np.array(llm.scores[:len(window)], dtype=np.float32)
    return run


def main(argv=None) -> None:
    from tensorfold.models.gguf_file import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--type", choices=("q4_k_m", "q6_k", "q4_0", "q8_0"), default=None,
                    help="the default model requantized by llama.cpp (default: its shipped Q4_1 file)")
    args = ap.parse_args(argv)
    path = requantized(args.type, args.threads) if args.type else default_model_path()

    engine, quantized = tensorfold_logits(path, "auto", args.threads)
    ids = engine.tokenizer.encode(prose(), add_special_tokens=False)
    chunks = windows(ids, args.window, args.windows)
    scored = len(chunks) * (args.window - args.window // 2)
    print(f"text: Python {sys.version.split()[0]}'s pydoc topics ({len(ids)} tokens); {len(chunks)} windows of "
          f"{args.window}, {scored} tokens scored; {args.threads} threads; file {os.path.basename(path)}\n")
    rows = [("TensorFold, --dtype auto (blocks as stored)", quantized)]
    _, dense = tensorfold_logits(path, "float32", args.threads)
    rows.append(("TensorFold, --dtype float32 (dequantized)", dense))
    if peer_llama_cpp.available():
        rows.append(("llama.cpp, the same file", llama_cpp_logits(path, args.window, args.threads)))
    else:
        print(peer_llama_cpp.SKIP_MESSAGE)
    results = {}
    for label, run in rows:
        started = time.perf_counter()
        total, count = 0.0, 0
        for window in chunks:
            s, c = nll(run(window), window)
            total, count = total + s, count + c
        results[label] = math.exp(total / count)
        results[label, "s"] = time.perf_counter() - started
    base = results[rows[0][0]]
    print("| path | perplexity | vs the quantized path | seconds |")
    print("|---|---|---|---|")
    for label, _ in rows:
        ppl = results[label]
        print(f"| {label} | {ppl:.4f} | {(ppl / base - 1) * 100:+.2f}% | {results[label, 's']:.1f} |")


if __name__ == "__main__":
    main()
