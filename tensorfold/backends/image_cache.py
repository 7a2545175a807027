"""Encoded images by content hash: a repeated image is not decoded or encoded again.

The runner asks for the embeddings of the images whose rows a round feeds (a prefill chunk, a
replay after preemption), all at once; the images not kept are decoded and preprocessed
(vision/image.patches) and run through the tower (models/vision_tower.py) together, at most
MAX_ENCODE_PATCHES patches a call; later asks get the kept tensor. An image's embeddings are a
function of its bytes only (the tower is batch invariant: what is encoded beside an image
changes none of its bits), so a hit gives the bits a fresh encode would. Least recently used
images leave first once the kept tensors pass max_bytes (the images just asked for are returned
whatever leaves).
"""
import time
from collections import OrderedDict

import torch

from tensorfold.models.vision_tower import MAX_ENCODE_PATCHES
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
        return self.embeddings_of([image])[0]

    def embeddings_of(self, images: list) -> list[torch.Tensor]:
        """Each ImageInput's embeddings, in order; the ones not kept encoded together (an image
        twice in the list is encoded once)."""
        missing = {}
        for image in images:
            if image.sha in self._kept:
                self.hits += 1
                self._kept.move_to_end(image.sha)
            elif image.sha in missing:
                self.hits += 1
            else:
                self.misses += 1
                missing[image.sha] = image
        got = {sha: self._kept[sha] for sha in {i.sha for i in images} if sha in self._kept}
        if missing:
            got.update(self._encode(list(missing.values())))
        return [got[image.sha] for image in images]

    def _encode(self, images: list) -> dict[str, torch.Tensor]:
        started = time.perf_counter()
        inputs = []
        for image in images:
            pixels, grid = patches(image.data, self.preprocess)
            if grid != image.grid:  # the API measured the same bytes with the same settings
                raise ValueError(f"image {image.sha[:12]}: grid {grid}, the request says {image.grid}")
            inputs.append((pixels, grid))
        out, batch, num_patches = [], [], 0
        for item in inputs:  # calls of at most MAX_ENCODE_PATCHES patches (a lone larger image alone)
            if batch and num_patches + len(item[0]) > MAX_ENCODE_PATCHES:
                out += self.tower.encode_many(batch)
                batch, num_patches = [], 0
            batch.append(item)
            num_patches += len(item[0])
        out += self.tower.encode_many(batch)
        self.encode_s += time.perf_counter() - started
        encoded = {image.sha: emb for image, emb in zip(images, out)}
        for sha, emb in encoded.items():
            self._kept[sha] = emb
            self._bytes += emb.numel() * emb.element_size()
        while self._bytes > self.max_bytes and len(self._kept) > 1:
            _, old = self._kept.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
        return encoded
