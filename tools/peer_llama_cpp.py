"""Time llama.cpp (through the llama-cpp-python bindings) on a GGUF, as a peer for tensorfold's
benchmarks: greedy decode tokens/s and prompt prefill seconds, single stream, on the CPU.

    python tools/peer_llama_cpp.py [--threads 2] [--tokens 128] [--prompt 512] [--repeats 3]

prints one line per file: the default model's Q4_1 GGUF and its F32 and BF16 copies from
peer_gguf.py, the same weights tensorfold serves with --dtype float32 / bfloat16.

llama-cpp-python is a benchmark peer only, never a dependency of tensorfold. When it is missing,
`available()` is False and callers skip with a message. It is built from source on install; for
this machine's AVX-512 CPU, without AMX:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python

Decode tokens/s counts n_tokens steps of (greedy argmax of the last logits, eval of that one
token), after the prompt has been evaluated and not timed; prefill is one eval of the prompt ids
from an empty cache, in batches of n_batch=512. Several streams (streams_decode_tps) decode in a
context of their own with one KV stream per sequence, all sequences' next tokens in one batch
per step.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SKIP_MESSAGE = "llama-cpp-python is not installed; skipping the llama.cpp peer"


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


# ggml's type numbers for the KV cache (llama-cpp-python takes type_k and type_v as these).
KV_TYPES = {"float32": 0, "float16": 1, "bfloat16": 30}
DEFAULT_KV = "float16"  # llama.cpp's own choice, whatever the weights


def load(path: str, n_ctx: int, threads: int, kv_dtype: str = DEFAULT_KV):
    """A llama_cpp.Llama on `path`, with `threads` threads for both decode and prefill, and its
    KV cache in `kv_dtype` (a key of KV_TYPES)."""
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 verbose=False, logits_all=False, use_mmap=True,
                 type_k=KV_TYPES[kv_dtype], type_v=KV_TYPES[kv_dtype])


def greedy_token(ctx, vocab: int, index: int = -1) -> int:
    """Argmax of the logits of the batch's token `index` (-1: the last) in a llama.cpp context.
    (llm.scores is not filled without logits_all, so the logits are read from the context.)"""
    import llama_cpp
    import numpy as np

    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(vocab,))
    return int(logits.argmax())


def decode_tps(llm, prompt_ids: list[int], n_tokens: int) -> float:
    """Greedy decode tokens/s over n_tokens steps, timed after the prompt is evaluated."""
    llm.reset()
    llm.eval(prompt_ids)
    start = time.perf_counter()
    for _ in range(n_tokens):
        llm.eval([greedy_token(llm.ctx, llm.n_vocab())])
    return n_tokens / (time.perf_counter() - start)


def streams_decode_tps(llm, prompts: list[list[int]], n_tokens: int, kv_dtype: str = DEFAULT_KV) -> float:
    """Aggregate greedy decode tokens/s of len(prompts) sequences decoded together: a context of
    its own on llm's model with one KV stream per sequence, each step one llama_decode of a batch
    holding every sequence's next token (what llama-server does for parallel slots). The prompts
    are evaluated first, not timed; then n_tokens steps are."""
    import llama_cpp
    import numpy as np

    streams = len(prompts)
    params = llama_cpp.llama_context_default_params()
    per_stream = (max(map(len, prompts)) + n_tokens + 255) // 256 * 256  # llama.cpp pads a context to 256s
    params.n_ctx = streams * per_stream
    params.n_batch = params.n_ubatch = max(512, sum(map(len, prompts)))
    params.n_seq_max = streams
    params.n_threads = params.n_threads_batch = llm.context_params.n_threads
    params.type_k = params.type_v = KV_TYPES[kv_dtype]
    ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context for parallel sequences")
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
    vocab = llm.n_vocab()
    try:
        def run(tokens: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, wants logits)
            batch.n_tokens = len(tokens)
            for i, (token, pos, seq, logits) in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

        run([(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)])
        ends = list(np.cumsum([len(ids) for ids in prompts]) - 1)
        nexts, positions = [greedy_token(ctx, vocab, int(e)) for e in ends], [len(ids) for ids in prompts]
        start = time.perf_counter()
        for _ in range(n_tokens):
            run([(nexts[s], positions[s], s, True) for s in range(streams)])
            nexts = [greedy_token(ctx, vocab, s) for s in range(streams)]
            positions = [p + 1 for p in positions]
        return streams * n_tokens / (time.perf_counter() - start)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def prefill_seconds(llm, prompt_ids: list[int]) -> float:
    """Seconds to evaluate prompt_ids from an empty cache."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt_ids)
    return time.perf_counter() - start


def arbitrary_prompt(n: int, vocab: int = 49152) -> list[int]:
    """n fixed in-vocabulary token ids, away from the special tokens at the start of the vocab."""
    return [1000 + (i * 7919) % (vocab - 1000) for i in range(n)]


def main(argv=None) -> None:
    from tools.peer_gguf import peer_gguf
    from tensorfold.models.gguf_file import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="decode steps timed")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt length")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    args = ap.parse_args(argv)
    if not available():
        print(SKIP_MESSAGE)
        return
    prompt = arbitrary_prompt(args.prompt)
    decode_prompt = prompt[:16]
    files = {"q4_1": default_model_path(), "float32": peer_gguf("float32"), "bfloat16": peer_gguf("bfloat16")}
    print(f"llama.cpp, {args.threads} threads; decode {args.tokens} tokens after a "
          f"{len(decode_prompt)}-token prompt; prefill {len(prompt)} tokens; best of {args.repeats}")
    for name, path in files.items():
        llm = load(path, n_ctx=max(len(prompt), len(decode_prompt) + args.tokens) + 8, threads=args.threads)
        tps = max(decode_tps(llm, decode_prompt, args.tokens) for _ in range(args.repeats))
        pre = min(prefill_seconds(llm, prompt) for _ in range(args.repeats))
        print(f"{name:9s} decode {tps:7.1f} tok/s   prefill {pre:6.3f} s ({len(prompt) / pre:6.0f} tok/s)")
        llm.close()


if __name__ == "__main__":
    main()
