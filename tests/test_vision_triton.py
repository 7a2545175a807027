"""The vision tower (models/vision_tower.py) on the cuda backend's Triton op set.

Without a GPU the op set runs on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, set
before anything imports triton), patched to compute what the GPU computes
(tests/triton_interpreter.py); with a GPU the same tests run compiled on "cuda". On the tiny
random vision checkpoint (transformers' Qwen3.5 conditional-generation model):
- the tower calls the op set's Triton rope and exact attention (counted), and its embeddings are
  transformers' within float32 tolerance;
- against the native op set, bitwise: with q8_0 GEMMs (the exact quantized GEMM, Triton's
  kernel here) always, with dense ones on CPU tensors (where both op sets run the cpu GEMM);
- batch invariant: an image encoded beside others (encode_many) has the bits it has alone.
"""
import os

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before any `import triton` (cuda_ops imports it)

import pytest  # noqa: E402

from tensorfold.backends import backend_ops  # noqa: E402
from tensorfold.models.quantize import quantize  # noqa: E402
from tensorfold.models.vision_tower import build_vision_tower  # noqa: E402
from tensorfold.vision.image import Preprocess, patches  # noqa: E402
from test_cuda_backend import spy  # noqa: E402
from test_vision import png  # noqa: E402
from tools.tiny_checkpoint import make_tiny_vision_checkpoint  # noqa: E402
from triton_interpreter import interpreter_as_gpu  # noqa: E402,F401 (autouse fixture)

DEVICE = "cuda" if HAS_GPU else "cpu"
SIZES = [(64, 64), (40, 100), (70, 50)]  # 16, 28 and 20 patches at the tiny preprocessor's settings
GEMMS = ("attn.qkv.weight", "attn.proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
         "merger.linear_fc1.weight", "merger.linear_fc2.weight")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import Qwen3_5ForConditionalGeneration
    path = make_tiny_vision_checkpoint(str(tmp_path_factory.mktemp("tiny_vl")))
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    pre = Preprocess.from_checkpoint(path, {})
    images = [patches(png(w, h, seed), pre) for seed, (w, h) in enumerate(SIZES)]
    return path, hf, images


def tower_of(tiny, ops, device, quantized: bool = False):
    path, hf, _ = tiny
    tensors = {n: p.detach() for n, p in hf.named_parameters()}
    if quantized:
        tensors = {n: quantize(t, "q8_0") if n.startswith("model.visual.") and n.endswith(GEMMS) else t
                   for n, t in tensors.items()}
    ckpt = type("Ckpt", (), {"config": hf.config.to_dict(), "tensors": tensors, "path": path})
    return build_vision_tower(ckpt, torch.float32, ops, device)


def test_triton_tower_matches_transformers_and_the_native_op_set(tiny, monkeypatch):
    _, hf, images = tiny
    cuda_ops = backend_ops("cuda")
    calls = spy(monkeypatch, cuda_ops, ("apply_rope", "paged_attention"))
    tower = tower_of(tiny, cuda_ops, DEVICE)
    native = tower_of(tiny, backend_ops("cpu"), "cpu")
    for px, grid in images[:2]:
        ours = tower.encode(px, grid).cpu()
        with torch.no_grad():
            ref = hf.model.visual(torch.from_numpy(px), grid_thw=torch.tensor([grid])).pooler_output
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
        if not HAS_GPU:  # dense GEMMs: the cpu GEMM on both op sets here; on a GPU, Triton's own bits
            assert torch.equal(ours, native.encode(px, grid))
    depth = len(tower.blocks)
    assert calls == {"apply_rope": 2 * 2 * depth, "paged_attention": 2 * depth}  # the Triton kernels ran


def test_triton_tower_with_quantized_gemms_is_the_native_tower_bitwise_alone_or_not(tiny):
    """q8_0 GEMMs (the Triton exact quantized GEMM): the native tower's bits, alone or beside another."""
    _, _, images = tiny
    images = images[1:]  # two: the interpreter's quantized GEMM is the slow part
    tower = tower_of(tiny, backend_ops("cuda"), DEVICE, quantized=True)
    native = tower_of(tiny, backend_ops("cpu"), "cpu", quantized=True)
    dense = tower_of(tiny, backend_ops("cpu"), "cpu")
    alone = [tower.encode(px, grid).cpu() for px, grid in images]
    for emb, (px, grid) in zip(alone, images):
        assert torch.equal(emb, native.encode(px, grid))
    assert not torch.equal(alone[0], dense.encode(*images[0]))  # the q8_0 GEMMs ran: the test can fail
    together = tower.encode_many(images[::-1])
    assert torch.equal(together[0].cpu(), alone[1]) and torch.equal(together[1].cpu(), alone[0])


def test_an_image_beside_others_has_the_bits_it_has_alone(tiny):
    _, _, images = tiny
    tower = tower_of(tiny, backend_ops("cuda"), DEVICE)
    alone = [tower.encode(px, grid) for px, grid in images]
    for order in (images, images[::-1]):
        together = tower.encode_many(order)
        for emb, image in zip(together, order):
            assert torch.equal(emb, alone[next(i for i, x in enumerate(images) if x is image)])
    assert not torch.equal(alone[0], together[1][:len(alone[0])])  # different images differ
