"""TensorFold: an exact, OpenAI-compatible LLM inference server.

Native code built here:
- csrc/cpu -> tensorfold._cpu, the cpu backend's exact kernels (C++, OpenMP), whenever a C++
  compiler and torch are present at install time (`pip install --no-build-isolation -e .`, as
  the Makefile does, so the build sees the installed torch). Flags: -O3 -ffp-contract=off, never
  fast-math; the vector code follows the compiler's target, `-march=native` unless
  TENSORFOLD_CPU_ARCH names another (e.g. `x86-64-v3`, or `none` for the compiler's default).
  The extension is optional: a failed build leaves the torch references in charge, and the
  server says so in its log and in /health.
- tensorfold/kernels/csrc -> tensorfold.kernels._C (CUDA) only when nvcc and a CUDA build of
  torch are both present.
"""
import glob
import os
import runpy
import shutil
import sysconfig

from setuptools import find_packages, setup


def _torch_ext():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return None, None
    return torch, cpp_extension


def cpu_extension(cpp_extension):
    sources = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    compiler = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    if not sources or shutil.which(compiler.split()[0]) is None:
        return None
    build = runpy.run_path(os.path.join("csrc", "cpu", "build_flags.py"))
    flags = build["FLAGS"] + build["arch_flags"](os.environ.get("TENSORFOLD_CPU_ARCH", "native"))
    return cpp_extension.CppExtension("tensorfold._cpu", sources, extra_compile_args=flags,
                                      extra_link_args=["-fopenmp"], optional=True,
                                      depends=sorted(glob.glob(os.path.join("csrc", "cpu", "*.h"))))


def cuda_extension(torch, cpp_extension):
    csrc = os.path.join("tensorfold", "kernels", "csrc")
    sources = sorted(os.path.join(csrc, f) for f in os.listdir(csrc)) if os.path.isdir(csrc) else []
    sources = [s for s in sources if s.endswith((".cu", ".cpp"))]
    if not sources or shutil.which("nvcc") is None or torch.version.cuda is None:
        return None
    return cpp_extension.CUDAExtension("tensorfold.kernels._C", sources, extra_compile_args={"nvcc": ["-O3"]})


def extensions():
    torch, cpp_extension = _torch_ext()
    if torch is None:
        return {}
    ext = [e for e in (cpu_extension(cpp_extension), cuda_extension(torch, cpp_extension)) if e is not None]
    if not ext:
        return {}
    # ninja compiles the sources side by side where it is installed (torch falls back to one at a
    # time, with a warning, where it is not).
    return {"ext_modules": ext, "cmdclass": {"build_ext": cpp_extension.BuildExtension}}


setup(
    name="tensorfold",
    version="0.1.0",
    description="An exact, OpenAI-compatible LLM inference server",
    packages=find_packages(include=["tensorfold", "tensorfold.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "safetensors",
        "tokenizers",
        "jinja2",
        "h11",
        "gguf",
        "numpy",
        "pillow",  # --vision: image decoding
        "xgrammar",  # structured output (pulls transformers for its tokenizer table)
        "cryptography",  # the Responses API's encrypted reasoning (AES-GCM)
        "mlx; platform_system == 'Darwin' and platform_machine == 'arm64'",  # --backend mlx (auto there)
    ],
    extras_require={
        "mlx": ["mlx[cpu]; platform_system == 'Linux'", "mlx; platform_system == 'Darwin'"],  # --backend mlx
        # triton: kernels are tested on the CPU with TRITON_INTERPRET=1 (Linux wheels only).
        "test": ["pytest", "hypothesis", "transformers", "accelerate", "openai", "anthropic", "prometheus_client",
                 "jsonschema",
                 "triton; platform_system == 'Linux'",
                 # the mlx backend's tests: MLX's CPU device on Linux (Metal on a Mac)
                 "mlx[cpu]; platform_system == 'Linux'", "mlx; platform_system == 'Darwin'"],
    },
    entry_points={"console_scripts": ["tensorfold=tensorfold.__main__:main"]},
    # model cards live beside the package in a checkout; an installed wheel finds them here
    data_files=[("share/tensorfold/model_cards", sorted(glob.glob("model_cards/*.json"))),
                ("share/tensorfold/model_cards/templates", sorted(glob.glob("model_cards/templates/*")))],
    **extensions(),
)
