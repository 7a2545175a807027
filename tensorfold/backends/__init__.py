"""Which backend serves, and its op set: cpu (the C++ kernels, else torch ops), cuda (Triton) or
mlx (MLX arrays: backends/mlx_backend.py, tensorfold/mlx).

`auto` picks mlx on Apple silicon where mlx imports, else cuda when torch sees a GPU and triton
imports, else cpu; asking for a backend that cannot run here is a startup error that says why. Nothing here touches a GPU at import time:
cuda_ops (which imports triton) is imported only when the cuda backend is chosen.

The cpu backend's op set is native_ops (csrc/cpu, built at install when a C++ compiler is
present) or, without it, cpu_ops (the torch references, with torch's GEMM): the log says once
which, and why; /health names it. TENSORFOLD_CPU_OPS=torch picks the torch ops on purpose
(benchmarks, debugging).
"""
import functools
import importlib.util
import logging
import os
import platform

log = logging.getLogger("tensorfold.backends")

IMPLEMENTED = ("cpu", "cuda", "mlx")


def keeps_v_exponents(ops) -> bool:
    """Whether op set `ops` keeps a record of the V rows' exponents beside the KV cache
    (LayerKV.v_exp; every op set says with V_EXPONENT_RECORD): its write_kv fills the record and
    its attention reads it instead of the V rows."""
    return ops.V_EXPONENT_RECORD


def _cuda_problem() -> str | None:
    """Why the cuda backend cannot run here, or None when it can."""
    import torch
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to torch (torch {torch.__version__})"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import ({e}); pip install triton"
    return None


def _mlx_problem() -> str | None:
    """Why the mlx backend cannot run here, or None when it can."""
    if importlib.util.find_spec("mlx") is None:
        extra = "" if platform.system() == "Darwin" else "[cpu]"
        return f'mlx is not installed (pip install "mlx{extra}")'
    return None


def _apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def select_backend(requested: str) -> str:
    if requested == "auto":
        if _apple_silicon() and _mlx_problem() is None:
            return "mlx"
        return "cuda" if _cuda_problem() is None else "cpu"
    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        problem = _cuda_problem()
        if problem:
            raise RuntimeError(f"--backend cuda: {problem}; use --backend cpu")
        return "cuda"
    if requested == "mlx":
        problem = _mlx_problem()
        if problem:
            raise RuntimeError(f"--backend mlx: {problem}; use --backend cpu")
        return "mlx"
    raise RuntimeError(f"unknown backend {requested!r} (choose auto, cuda, mlx or cpu)")


def native_problem() -> str | None:
    """Why the C++ cpu kernels cannot run here, or None when they can."""
    import torch  # noqa: F401 (the extension links against torch's libraries: load them first)

    try:
        from tensorfold import _cpu  # noqa: F401
    except ImportError as e:
        return f"the C++ extension tensorfold._cpu is not built ({e}); reinstall with a C++ compiler present"
    return None


@functools.cache
def _cpu_op_set():
    if os.environ.get("TENSORFOLD_CPU_OPS", "native") == "torch":
        log.warning("cpu op set: torch (TENSORFOLD_CPU_OPS=torch)")
        from tensorfold.backends import cpu_ops
        return cpu_ops
    problem = native_problem()
    if problem is None:
        from tensorfold.backends import native_ops
        return native_ops
    log.warning("cpu op set: torch references, not the C++ kernels: %s. Exact mode then rests on "
                "torch's GEMM, which the startup probes check.", problem)
    from tensorfold.backends import cpu_ops
    return cpu_ops


def open_backend(config):
    """The Backend that serves `config` (backends/torch_backend.py: load, allocate, runner,
    probes, describe), for the backend select_backend chose (EngineConfig.backend)."""
    import torch

    if config.backend == "mlx":
        from tensorfold.backends.mlx_backend import MLXBackend
        return MLXBackend(config)
    from tensorfold.backends.torch_backend import TorchBackend
    device = torch.device(config.device or config.backend)
    if config.tp > 1:  # rank 0 of a tensor-parallel group (parallel/)
        from tensorfold.parallel.backend import LeaderBackend
        return LeaderBackend(config.backend, backend_ops(config.backend), device, config.num_threads, config)
    return TorchBackend(config.backend, backend_ops(config.backend), device, config.num_threads)


def backend_ops(backend: str):
    """The op set a model of this backend calls (the same names in every op set module); its
    NAME says which it is."""
    if backend == "cpu":
        return _cpu_op_set()
    if backend == "cuda":
        from tensorfold.backends import cuda_ops
        return cuda_ops
    raise ValueError(f"no op set for backend {backend!r} (implemented: {', '.join(IMPLEMENTED)})")
