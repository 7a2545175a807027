"""An image as the vision tower reads it: decoded, resized to patch multiples, normalised, patchified.

The steps are those of the family's image processor (transformers' Qwen2-VL processor, Pillow
path, which Qwen3-VL and Qwen3.5 use with their own patch size and mean/std), so the same file
gives the same pixels as the reference:

1. decode with Pillow; RGB, an alpha channel composited onto white;
2. smart_resize: each side rounded to a multiple of patch * merge, then scaled down (floor) into
   max_pixels or up (ceil) to min_pixels, keeping the aspect ratio; bicubic resampling in Pillow
   on the uint8 image;
3. rescale (float64 multiply by 1/255, then float32) and normalise ((x - mean) / std in float32);
4. patchify: [grid_h * grid_w, channels * temporal_patch * patch * patch] float32, patches in
   merge-block order (the 2x2 patches of one merged token adjacent), the one frame repeated
   temporal_patch times.

Pure function of the image's bytes and the checkpoint's preprocessor settings; no torch here.
"""
import hashlib
import io
import json
import math
import os
from dataclasses import dataclass

import numpy as np

MAX_ASPECT = 200  # the processor refuses a longer side over 200 times the shorter


class ImageError(ValueError):
    """The bytes are not an image this server can read, or its shape is refused."""


@dataclass(frozen=True)
class Preprocess:
    """The checkpoint's image-processor settings (preprocessor_config.json, Qwen3.5's defaults)."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_checkpoint(cls, path: str, vision_config: dict) -> "Preprocess":
        """preprocessor_config.json beside the checkpoint where present; patch, frame and merge
        sizes from the vision config otherwise."""
        base = dict(patch_size=int(vision_config.get("patch_size", 16)),
                    temporal_patch_size=int(vision_config.get("temporal_patch_size", 2)),
                    merge_size=int(vision_config.get("spatial_merge_size", 2)))
        file = os.path.join(path, "preprocessor_config.json") if os.path.isdir(path) else ""
        if not file or not os.path.exists(file):
            return cls(**base)
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
        size = raw.get("size") or {}
        fields = dict(
            patch_size=raw.get("patch_size"), temporal_patch_size=raw.get("temporal_patch_size"),
            merge_size=raw.get("merge_size"),
            min_pixels=size.get("shortest_edge", raw.get("min_pixels")),
            max_pixels=size.get("longest_edge", raw.get("max_pixels")),
            image_mean=tuple(raw["image_mean"]) if raw.get("image_mean") else None,
            image_std=tuple(raw["image_std"]) if raw.get("image_std") else None,
            rescale_factor=raw.get("rescale_factor"))
        return cls(**{**base, **{k: v for k, v in fields.items() if v is not None}})

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) of an image of this size after resizing."""
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        """Pad tokens the image takes in the prompt: one per merged patch."""
        _, h, w = self.grid(height, width)
        return h * w // (self.merge_size ** 2)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Sides that are multiples of factor, the area within [min_pixels, max_pixels], the aspect kept."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"the image's aspect ratio is over {MAX_ASPECT}:1 ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def content_hash(data: bytes) -> str:
    """The image's key in the image cache and the prefix cache: SHA-256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


def open_image(data: bytes):
    """The image's header read (size, format) without decoding the pixels: a PIL image."""
    from PIL import Image

    try:
        return Image.open(io.BytesIO(data))
    except Exception as e:  # Pillow raises several kinds (UnidentifiedImageError, OSError, ...)
        raise ImageError(f"not a readable image ({type(e).__name__})") from None


def decode_rgb(data: bytes):
    """Step 1: the decoded image in RGB, an alpha channel composited onto white."""
    from PIL import Image

    image = open_image(data)
    try:
        image.load()
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        return image.convert("RGB")
    except Exception as e:
        raise ImageError(f"the image could not be decoded ({type(e).__name__}: {e})") from None


def patches(data: bytes, pre: Preprocess) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Steps 1-4: the flattened patches [grid_h * grid_w, 3 * T * P * P] float32 and the grid (t, h, w)."""
    from PIL import Image

    image = decode_rgb(data)
    height, width = image.height, image.width
    new_h, new_w = pre.resized(height, width)
    pixels = np.asarray(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))  # [H, W, 3] uint8
    x = (pixels.astype(np.float64) * pre.rescale_factor).astype(np.float32)
    x = (x - np.array(pre.image_mean, dtype=np.float32)) / np.array(pre.image_std, dtype=np.float32)
    x = np.moveaxis(x, -1, 0)  # [3, H, W]
    p, m, t = pre.patch_size, pre.merge_size, pre.temporal_patch_size
    grid_h, grid_w = new_h // p, new_w // p
    x = x.reshape(3, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x.reshape(grid_h * grid_w, 3 * t * p * p)), (1, grid_h, grid_w)
