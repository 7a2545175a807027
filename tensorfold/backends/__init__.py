"""Which backend serves, and its op set: cpu (torch reference ops) or cuda (Triton kernels).

`auto` picks cuda when torch sees a GPU and triton imports, else cpu; asking for a backend that
cannot run here is a startup error that says why. Nothing here touches a GPU at import time:
cuda_ops (which imports triton) is imported only when the cuda backend is chosen.
"""
import importlib.util
import platform

IMPLEMENTED = ("cpu", "cuda")


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


def select_backend(requested: str) -> str:
    if requested == "auto":
        return "cuda" if _cuda_problem() is None else "cpu"
    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        problem = _cuda_problem()
        if problem:
            raise RuntimeError(f"--backend cuda: {problem}; use --backend cpu")
        return "cuda"
    if requested == "mlx":
        if platform.system() != "Darwin" and importlib.util.find_spec("mlx") is None:
            raise RuntimeError("--backend mlx: mlx is not installed (pip install mlx); use --backend cpu")
        raise RuntimeError("--backend mlx: the MLX engine is not in this build yet; use --backend cpu")
    raise RuntimeError(f"unknown backend {requested!r} (choose auto, cuda, mlx or cpu)")


def backend_ops(backend: str):
    """The op set a model of this backend calls (the same names in both modules)."""
    if backend == "cpu":
        from tensorfold.backends import cpu_ops
        return cpu_ops
    if backend == "cuda":
        from tensorfold.backends import cuda_ops
        return cuda_ops
    raise ValueError(f"no op set for backend {backend!r} (implemented: {', '.join(IMPLEMENTED)})")
