"""Image encode time per megapixel (random weights) and the image cache's hit path.

    python tools/bench_vision.py [--shape tiny|real] [--depth N] [--side PIXELS] [--ops native|torch]
                                 [--images N]

tiny: the test checkpoint's tower (1 block, width 32). real: Qwen3.5's tower widths (width 1152,
16 heads, MLP 4304, patch 16, 2x2 merge, out 2048), `--depth` blocks of its 27 (the time per
block is printed, so the whole tower's is depth-scaled). The image is side x side pixels.
--images N (N > 1): also N different images of that size encoded one by one against one
encode_many call (the image cache's misses of a round, encoded together), whose bits must be equal.
"""
import argparse
import io
import time

import numpy as np
import torch
from PIL import Image

from tensorfold.backends.image_cache import ImageCache
from tensorfold.models.vision_tower import VisionSpec, VisionTower
from tensorfold.models.weights import WeightReader
from tensorfold.vision.image import Preprocess, content_hash, patches
from tensorfold.vision.placement import ImageInput

SHAPES = {"tiny": dict(hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, num_position_embeddings=64),
          "real": dict(hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=2048,
                       num_position_embeddings=2304)}


def random_tower(spec: VisionSpec, ops) -> VisionTower:
    g = torch.Generator().manual_seed(0)
    h, i, p = spec.hidden_size, spec.intermediate_size, spec.patch_size
    t = {"patch_embed.proj.weight": (h, 3, 2, p, p), "patch_embed.proj.bias": (h,),
         "pos_embed.weight": (spec.num_position_embeddings, h), "merger.norm.weight": (h,), "merger.norm.bias": (h,),
         "merger.linear_fc1.weight": (4 * h, 4 * h), "merger.linear_fc1.bias": (4 * h,),
         "merger.linear_fc2.weight": (spec.out_hidden_size, 4 * h), "merger.linear_fc2.bias": (spec.out_hidden_size,)}
    for b in range(spec.depth):
        t.update({f"blocks.{b}.{k}": v for k, v in {
            "norm1.weight": (h,), "norm1.bias": (h,), "norm2.weight": (h,), "norm2.bias": (h,),
            "attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,), "attn.proj.weight": (h, h),
            "attn.proj.bias": (h,), "mlp.linear_fc1.weight": (i, h), "mlp.linear_fc1.bias": (i,),
            "mlp.linear_fc2.weight": (h, i), "mlp.linear_fc2.bias": (h,)}.items()})
    tensors = {k: torch.randn(v, generator=g) * 0.02 for k, v in t.items()}
    return VisionTower(spec, WeightReader(tensors, torch.float32, torch.device("cpu"), ops))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=SHAPES)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--side", type=int, default=512)
    ap.add_argument("--ops", default="native", choices=["native", "torch"])
    ap.add_argument("--images", type=int, default=1)
    args = ap.parse_args()
    if args.ops == "native":
        from tensorfold.backends import native_ops as ops
    else:
        from tensorfold.backends import cpu_ops as ops
    spec = VisionSpec.from_hf(dict(SHAPES[args.shape], depth=args.depth))
    tower = random_tower(spec, ops)
    pre = Preprocess(min_pixels=64 * 64, max_pixels=4096 * 4096)
    data = _png(args.side, 0)
    started = time.perf_counter()
    pixels, grid = patches(data, pre)
    prep_s = time.perf_counter() - started
    tower.encode(pixels, grid)  # warm
    started = time.perf_counter()
    tower.encode(pixels, grid)
    encode_s = time.perf_counter() - started
    cache = ImageCache(tower, pre, 2**30)
    image = ImageInput(content_hash(data), grid, pre.merge_size, data)
    cache.embeddings(image)
    started = time.perf_counter()
    for _ in range(100):
        cache.embeddings(image)
    hit_us = (time.perf_counter() - started) / 100 * 1e6
    mp = args.side * args.side / 1e6
    print(f"{args.shape} tower, {args.depth} block(s), {ops.NAME} ops, {torch.get_num_threads()} threads; "
          f"{args.side}x{args.side} image ({mp:.2f} MP) -> {grid[1] * grid[2]} patches, "
          f"{grid[1] * grid[2] // 4} tokens")
    print(f"preprocess {prep_s * 1e3:.1f} ms; encode {encode_s:.3f} s = {encode_s / mp:.3f} s/MP "
          f"({encode_s / args.depth:.3f} s per block incl. embed+merger); cache hit {hit_us:.1f} us")
    if args.images > 1:
        inputs = [patches(_png(args.side, seed), pre) for seed in range(args.images)]
        alone_s = together_s = float("inf")
        for _ in range(5):  # alternating, each form's fastest (a shared machine's noise)
            started = time.perf_counter()
            alone = [tower.encode(px, g) for px, g in inputs]
            alone_s = min(alone_s, time.perf_counter() - started)
            started = time.perf_counter()
            together = tower.encode_many(inputs)
            together_s = min(together_s, time.perf_counter() - started)
        same = all(torch.equal(a, b) for a, b in zip(alone, together))
        print(f"{args.images} images: one by one {alone_s:.3f} s, together {together_s:.3f} s "
              f"({alone_s / together_s:.2f}x; fastest of 5, alternating); bitwise equal: {same}")


def _png(side: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


if __name__ == "__main__":
    main()
