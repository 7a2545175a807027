"""Which backend serves: cpu (torch reference ops) now; cuda and mlx land with their kernels.

`auto` picks the best backend this build can run on this machine; asking for one that cannot
run here is a startup error that says why.
"""
import importlib.util
import platform

IMPLEMENTED = ("cpu",)


def select_backend(requested: str) -> str:
    if requested == "auto":
        return "cpu"
    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("--backend cuda: no CUDA GPU is visible to torch "
                               f"(torch {torch.__version__}); use --backend cpu")
        raise RuntimeError("--backend cuda: the Triton kernels are not in this build yet; use --backend cpu")
    if requested == "mlx":
        if platform.system() != "Darwin" and importlib.util.find_spec("mlx") is None:
            raise RuntimeError("--backend mlx: mlx is not installed (pip install mlx); use --backend cpu")
        raise RuntimeError("--backend mlx: the MLX engine is not in this build yet; use --backend cpu")
    raise RuntimeError(f"unknown backend {requested!r} (choose auto, cuda, mlx or cpu)")
