"""TensorFold: an exact, OpenAI-compatible LLM inference server.

The CUDA C++ extension in tensorfold/kernels/csrc is built only when nvcc and a CUDA build of
torch are both present; everywhere else this installs pure Python.
"""
import os
import shutil

from setuptools import find_packages, setup


def cuda_extensions():
    csrc = os.path.join("tensorfold", "kernels", "csrc")
    sources = sorted(os.path.join(csrc, f) for f in os.listdir(csrc)) if os.path.isdir(csrc) else []
    sources = [s for s in sources if s.endswith((".cu", ".cpp"))]
    if not sources or shutil.which("nvcc") is None:
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        return {}
    if torch.version.cuda is None:
        return {}
    ext = CUDAExtension("tensorfold.kernels._C", sources, extra_compile_args={"nvcc": ["-O3"]})
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


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
    ],
    extras_require={
        "grammar": ["xgrammar"],
        # triton: kernels are tested on the CPU with TRITON_INTERPRET=1 (Linux wheels only).
        "test": ["pytest", "hypothesis", "transformers", "accelerate", "openai", "jsonschema",
                 "triton; platform_system == 'Linux'"],
    },
    entry_points={"console_scripts": ["tensorfold=tensorfold.__main__:main"]},
    **cuda_extensions(),
)
