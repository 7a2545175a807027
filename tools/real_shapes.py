"""Random-weight GGUFs at the shapes of real models, for speed and memory measurements only.

    python tools/real_shapes.py llama-1b --types q4_0,q8_0,q4_k_m,q6_k     # prints the paths
    python tools/real_shapes.py qwen3-1.7b --types q4_k_m --out-dir DIR

The shapes are the published configs' (hidden size, layers, heads, KV heads, head size, FFN), with
SmolLM2's tokenizer (49,152 tokens, copied from the default model's GGUF) in place of the real
128k / 152k vocabularies, so the embedding and the LM head are smaller than the real ones: every
layer is at full size. The weights are random normal (std 0.02, norms 1), written as an F16 file
first; each quantized type is then made from it by llama.cpp's own quantizer
(llama-cpp-python's llama_model_quantize: the file a user downloads is made the same way), or,
without llama-cpp-python, by the `gguf` package for q4_0 and q8_0. Files are kept in --out-dir
(default ~/.cache/tensorfold-bench/real) and written only when missing. Benchmark tooling only:
nothing ships them, nothing downloads them.
"""
import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

OUT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tensorfold-bench", "real")

# arch, hidden, layers, heads, KV heads, head size, FFN, RoPE theta
SHAPES = {
    "llama-1b": ("llama", 2048, 16, 32, 8, 64, 8192, 500000.0),      # Llama-3.2-1B
    "llama-3b": ("llama", 3072, 28, 24, 8, 128, 8192, 500000.0),     # Llama-3.2-3B
    "qwen3-1.7b": ("qwen3", 2048, 28, 16, 8, 128, 6144, 1000000.0),  # Qwen3-1.7B
    "qwen3-4b": ("qwen3", 2560, 36, 32, 8, 128, 9728, 1000000.0),    # Qwen3-4B
}
# Our type names -> llama.cpp's file types (llama_ftype) and the gguf package's block types.
LLAMA_FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
                "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}
GGUF_TYPES = {"q4_0": "Q4_0", "q8_0": "Q8_0"}


def path_of(shape: str, qtype: str, out_dir: str | None = None) -> str:
    return os.path.join(out_dir or OUT_DIR, f"{shape}-{qtype}.gguf")


def real_shape_gguf(shape: str, qtype: str, out_dir: str | None = None, threads: int = 2) -> str:
    """The path of `shape`'s random-weight GGUF in `qtype` (f16 or a key of LLAMA_FTYPES), written
    first if missing."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    if qtype != "f16" and qtype not in LLAMA_FTYPES:
        raise ValueError(f"unknown type {qtype!r}: f16 or one of {', '.join(LLAMA_FTYPES)}")
    out = path_of(shape, qtype, out_dir)
    if os.path.isfile(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".part"
    if qtype == "f16":
        _write_f16(shape, tmp)
    else:
        source = real_shape_gguf(shape, "f16", out_dir, threads)
        _quantize(source, tmp, qtype, threads)
    os.replace(tmp, out)  # a killed run leaves no half-written file under the final name
    return out


def _write_f16(shape: str, dst: str) -> None:
    write_random_gguf(dst, *SHAPES[shape], name=f"random {shape}")


def write_random_gguf(dst: str, arch: str, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                      ffn: int, theta: float = 500000.0, qtype: str = "f16", name: str = "random") -> None:
    """A llama or qwen3 GGUF of these sizes with SmolLM2's tokenizer and random weights: f16
    (normal, std 0.02), or q8_0 blocks written as such (random codes, float16 scales near 0.02 / 127;
    no quantizer run, so any size is quick to make). Norms are 1."""
    import gguf

    from tensorfold.models.gguf_file import default_model_path

    source = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in source.fields.items():  # the tokenizer and its chat template, as they are
        if key.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(key, field.contents(), kind, field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if qtype == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR

    def matrix(tensor: str, rows: int, cols: int) -> None:
        if qtype == "f16":
            w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
            writer.add_tensor(tensor, w.astype(np.float16))
            return
        blocks = rows * cols // 32  # q8_0: [d: f16][q: int8 x 32]
        d = (rng.uniform(0.5, 1.5, blocks) * (0.02 / 127)).astype(np.float16).view(np.uint8).reshape(blocks, 2)
        q = rng.integers(-127, 128, (blocks, 32), dtype=np.int8).view(np.uint8)
        writer.add_tensor(tensor, np.concatenate([d, q], axis=1).reshape(rows, cols // 32 * 34),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def norm(tensor: str, size: int) -> None:
        writer.add_tensor(tensor, np.ones(size, dtype=np.float32))

    matrix(names[T.TOKEN_EMBD] + ".weight", vocab, hidden)  # tied: the LM head is the embedding
    norm(names[T.OUTPUT_NORM] + ".weight", hidden)
    for i in range(layers):
        blk = (lambda t: names[t].format(bid=i) + ".weight")
        norm(blk(T.ATTN_NORM), hidden)
        matrix(blk(T.ATTN_Q), heads * head_dim, hidden)
        matrix(blk(T.ATTN_K), kv_heads * head_dim, hidden)
        matrix(blk(T.ATTN_V), kv_heads * head_dim, hidden)
        matrix(blk(T.ATTN_OUT), hidden, heads * head_dim)
        if arch == "qwen3":
            norm(blk(T.ATTN_Q_NORM), head_dim)
            norm(blk(T.ATTN_K_NORM), head_dim)
        norm(blk(T.FFN_NORM), hidden)
        matrix(blk(T.FFN_GATE), ffn, hidden)
        matrix(blk(T.FFN_UP), ffn, hidden)
        matrix(blk(T.FFN_DOWN), hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=qtype == "f16")
    writer.close()


def _quantize(src: str, dst: str, qtype: str, threads: int) -> None:
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    if llama_cpp is not None:
        params = llama_cpp.llama_model_quantize_default_params()
        params.nthread = threads
        params.ftype = getattr(llama_cpp, LLAMA_FTYPES[qtype])
        if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {src} to {qtype}")
        return
    if qtype not in GGUF_TYPES:
        raise RuntimeError(f"{qtype} needs llama.cpp's quantizer (pip install llama-cpp-python)")
    _requantize_with_gguf(src, dst, qtype)


def _requantize_with_gguf(src: str, dst: str, qtype: str) -> None:
    """The F16 file's 2-D tensors quantized by the `gguf` package (q4_0 / q8_0), the rest as they are."""
    import gguf

    reader = gguf.GGUFReader(src)
    target = gguf.GGMLQuantizationType[GGUF_TYPES[qtype]]
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        writer.add_key_value(key, field.contents(), kind, field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if qtype == "q4_0" else gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in reader.tensors:
        data = np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])
        if len(data.shape) == 1:
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data.astype(np.float32), target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="+", choices=list(SHAPES))
    p.add_argument("--types", default="q4_k_m", help=f"comma-separated, of f16, {', '.join(LLAMA_FTYPES)}")
    p.add_argument("--out-dir", default=None, help=f"default {OUT_DIR}")
    p.add_argument("--threads", type=int, default=2, help="the quantizer's threads")
    args = p.parse_args(argv)
    for shape in args.shapes:
        for qtype in args.types.split(","):
            print(real_shape_gguf(shape, qtype, args.out_dir, args.threads))


if __name__ == "__main__":
    main()
