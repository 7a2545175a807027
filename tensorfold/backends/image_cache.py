"""Encoded images by content hash: a repeated image is not decoded or encoded again.

The runner asks for an image's embeddings whenever a round feeds rows of its span (a prefill
chunk, a replay after preemption); the first ask decodes and preprocesses the bytes
(vision/image.patches) and runs the tower (models/vision_tower.py) on the image alone, later
asks get the kept tensor. An image's embeddings are a function of its bytes only (the tower
encodes each image alone), so a hit gives the bits a fresh encode would. Least recently used
images leave first once the kept tensors pass max_bytes (one image is always kept while used).
"""
import time
from collections import OrderedDict

import torch

from tensorfold.vision.image import patches


class ImageCache:
    def __init__(self, tower, preprocess, max_bytes: int):
        self.tower, self.preprocess, self.max_bytes = tower, preprocess, max_bytes
        self._kept: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0
        self.encode_s = 0.0

    def embeddings(self, image) -> torch.Tensor:
        """[image.num_tokens, hidden] for a vision/placement.ImageInput."""
        kept = self._kept.get(image.sha)
        if kept is not None:
            self.hits += 1
            self._kept.move_to_end(image.sha)
            return kept
        self.misses += 1
        started = time.perf_counter()
        pixels, grid = patches(image.data, self.preprocess)
        if grid != image.grid:  # the API measured the same bytes with the same settings
            raise ValueError(f"image {image.sha[:12]}: grid {grid}, the request says {image.grid}")
        out = self.tower.encode(pixels, grid)
        self.encode_s += time.perf_counter() - started
        self._kept[image.sha] = out
        self._bytes += out.numel() * out.element_size()
        while self._bytes > self.max_bytes and len(self._kept) > 1:
            _, old = self._kept.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
        return out
