"""The Metal shaders of metal/ compiled for the CPU: how Linux checks them bit for bit.

Each kernel body (metal_kernels.KERNELS) is wrapped in a C++ function whose parameters are the
names MLX would give it, and an extern "C" launcher calls that function once per position of the
grid, x fastest, like Metal's dispatchThreads over uint3 thread_position_in_grid. Template
parameters become a typedef or a constexpr per compiled variant (VARIANTS), as MLX's `template=`
makes them. Everything compiles in one translation unit against metal/metal_compat.h with
g++ -O2 -std=c++17 -ffp-contract=off -fno-fast-math (so a * b + c stays two roundings, as the
shaders ask of Metal), into a shared library cached under the user cache directory, keyed by a
hash of the sources and flags; ctypes loads it.

`CpuShaders.run` takes CPU torch tensors (made row-contiguous) and returns new ones; outputs
start filled with 0xFF bytes, so an element a kernel forgot to write shows.
"""
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tensorfold.kernels import quant_gemm as qg
from tensorfold.mlx import metal_kernels as mk

FLAGS = ("-O2", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-Wall",
         "-Wno-unused-variable", "-Wno-unused-function")
TORCH_TYPES = {"float": torch.float32, "int": torch.int32, "long": torch.int64, "ulong": torch.uint64,
               "int8_t": torch.int8}
KV_TYPES = {torch.float32: "float", torch.bfloat16: "bfloat16_t", torch.float16: "half"}

# The template values each kernel is compiled with here (name -> value: a C type or a constant).
VARIANTS = {
    "quantize_activations": [{"ACT": act} for act in sorted({kind.act for kind in qg.KINDS.values()})],
    "quant_gemm": [{"SUB": sub, "HAS_MIN": has_min, "ACT": act}  # one per set the kinds use
                   for sub, has_min, act in sorted({(k.sub, k.has_min, k.act) for k in qg.KINDS.values()})],
    "attention_scores": [{"KV": t} for t in KV_TYPES.values()],
    "attention_output": [{"KV": t} for t in KV_TYPES.values()],
    "sampler_chunk_max": [{"HAS_MASK": False}, {"HAS_MASK": True}],
    "sampler_tokens": [{"HAS_MASK": False}, {"HAS_MASK": True}],
    "sampler_chunk_fold": [{"HAS_MASK": False}, {"HAS_MASK": True}],
}


def compiler() -> str | None:
    """The C++ compiler used (TENSORFOLD_CXX, else g++), or None where there is none."""
    return shutil.which(os.environ.get("TENSORFOLD_CXX", "g++"))


def symbol(kernel: str, templates: dict) -> str:
    """The launcher's name for one variant: tf_<kernel>[__<name>_<value>...]."""
    parts = [f"{k}_{str(v).lower()}" for k, v in sorted(templates.items())]
    return "__".join([f"tf_{kernel}", *parts])


def _template_lines(templates: dict) -> str:
    lines = []
    for name, value in templates.items():
        if isinstance(value, bool):
            lines.append(f"constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"constexpr int {name} = {value};")
        else:
            lines.append(f"typedef {value} {name};")
    return "\n".join(lines)


def _variant_source(kernel: mk.Kernel, templates: dict) -> str:
    """One kernel variant: the body as a function of its named arguments, and its grid launcher."""
    name = symbol(kernel.name, templates)
    arrays = [f"const {t}* {n}" for t, n in zip(mk.types(kernel.inputs), kernel.input_names)]
    scalars = list(kernel.scalars)
    outputs = [f"{t}* {n}" for t, n in zip(mk.types(kernel.outputs), kernel.output_names)]
    params = ", ".join(arrays + [f"const {s}" for s in scalars] + outputs)
    args = ", ".join(kernel.input_names + kernel.output_names)
    return f"""
namespace {name}_ns {{
{_template_lines(templates)}
static void body({params}, uint3 thread_position_in_grid) {{
#line 1 "{kernel.source}"
{kernel.body()}
}}
extern "C" void {name}({params}, uint grid_x, uint grid_y, uint grid_z) {{
  for (uint at_z = 0; at_z < grid_z; ++at_z)
    for (uint at_y = 0; at_y < grid_y; ++at_y)
      for (uint at_x = 0; at_x < grid_x; ++at_x) body({args}, uint3{{at_x, at_y, at_z}});
}}
}}  // namespace {name}_ns
"""


def source() -> str:
    """The whole translation unit: compat header, constants, helpers, every kernel variant."""
    compat = (mk.SHADER_DIR / "metal_compat.h").read_text()
    parts = [compat, mk.header_source()]
    for kernel in mk.KERNELS.values():
        for templates in VARIANTS.get(kernel.name, [{}]):
            parts.append(_variant_source(kernel, templates))
    return "\n".join(parts)


@functools.cache
def build() -> "CpuShaders":
    """Compile (or find in the cache) and load the CPU build of every shader."""
    return CpuShaders(compile_library(source()))


def compile_library(text: str, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """g++ `flags` on one C++ translation unit, cached by the hash of text, compiler and flags."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) to build the Metal shaders for the CPU")
    key = hashlib.sha256((text + cxx + " ".join(flags)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tensorfold" / "metal_cpu"
    lib = cache / f"shaders_{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src = Path(tmp) / "shaders.cpp"
            src.write_text(text)
            out = Path(tmp) / lib.name
            done = subprocess.run([cxx, *flags, "-o", str(out), str(src)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"compiling the Metal shaders for the CPU failed:\n{done.stderr[-4000:]}")
            os.replace(out, lib)  # atomic: a concurrent build finds a whole file or none
    return ctypes.CDLL(str(lib))


class CpuShaders:
    """The compiled shaders: run(kernel, inputs, scalars, outputs, grid, templates)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def run(self, name: str, inputs: list[torch.Tensor], scalars: list, outputs: list[tuple[tuple, torch.dtype]],
            grid: tuple[int, int, int], templates: dict | None = None) -> list[torch.Tensor]:
        kernel = mk.KERNELS[name]
        templates = {k: KV_TYPES.get(v, v) if isinstance(v, torch.dtype) else v for k, v in (templates or {}).items()}
        if len(inputs) != len(kernel.inputs) or len(scalars) != len(kernel.scalars) \
                or len(outputs) != len(kernel.outputs):
            raise ValueError(f"{name}: {len(inputs)} inputs, {len(scalars)} scalars, {len(outputs)} outputs")
        arrays = [t.contiguous() for t in inputs]
        for t, declared in zip(arrays, mk.types(kernel.inputs)):
            want = TORCH_TYPES.get(templates.get(declared, declared)) if declared != "KV" else None
            if t.device.type != "cpu" or (want is not None and t.dtype != want):
                raise TypeError(f"{name}: {t.dtype} on {t.device} for a {declared} input")
        outs = [_poisoned(shape, dtype) for shape, dtype in outputs]
        args = [ctypes.c_void_p(t.data_ptr()) for t in arrays]
        for value, declared in zip(scalars, mk.types(kernel.scalars)):
            args.append(ctypes.c_float(value) if declared == "float" else ctypes.c_int(int(value)))
        args += [ctypes.c_void_p(t.data_ptr()) for t in outs]
        args += [ctypes.c_uint(int(g)) for g in grid]
        getattr(self.lib, symbol(name, templates))(*args)
        return outs


def _poisoned(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor of every byte 0xFF (NaN for floats, -1 for integers)."""
    size = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= int(s)
    return torch.full((numel * size,), -1, dtype=torch.int8).view(dtype).reshape(shape)


class TorchArrays:
    """metal.Arrays on CPU torch tensors (the launch sequences' host steps on Linux)."""

    DTYPES = {"float32": torch.float32, "int32": torch.int32, "int64": torch.int64, "uint64": torch.uint64,
              "int8": torch.int8}

    def dtype(self, name: str) -> torch.dtype:
        return self.DTYPES[name]

    def array(self, values: list, name: str) -> torch.Tensor:
        return torch.tensor(values, dtype=self.DTYPES[name])

    def tolist(self, a: torch.Tensor) -> list:
        return a.tolist()

    def head(self, keys: torch.Tensor, scores: torch.Tensor, size: int):
        top, index = keys.topk(size, dim=1)  # unique where drawable (-1 elsewhere: never kept)
        return top, scores.view(torch.int64).gather(1, index).view(torch.uint64)
