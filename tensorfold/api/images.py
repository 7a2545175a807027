"""A chat request's images: its image_url parts read into ImageInputs, within the server's limits.

Each image_url part (in message order) must be a data: URL (base64); http(s) URLs are refused
with a 400 that says so (this server fetches nothing). The bytes are decoded once here to check
them (a truncated or unknown file is a 400 naming the part) and measured: the patch grid the
family's resize gives (vision/image.py), which fixes how many pad tokens the image takes. The
pixels are made again, below the backend seam, only where the image cache misses.

Limits (ImageLimits; --max-image-bytes, --max-image-pixels, --max-images) are 400s naming the part.
"""
import base64
import binascii
from dataclasses import dataclass

from tensorfold.api.errors import ApiError
from tensorfold.vision.image import ImageError, Preprocess, content_hash, decode_rgb, open_image
from tensorfold.vision.placement import ImageInput


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 2**20        # one image's decoded data: URL payload
    max_pixels: int = 40_000_000       # one image's width x height as sent (before the resize)
    max_images: int = 16               # images in one request


def image_parts(messages) -> list[tuple[str, dict]]:
    """(param path, part) of every image_url part, in message order."""
    out = []
    for i, message in enumerate(messages or ()):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    out.append((f"messages[{i}].content[{j}]", part))
    return out


def read_images(messages, limits: ImageLimits, pre: Preprocess) -> list[ImageInput]:
    parts = image_parts(messages)
    if len(parts) > limits.max_images:
        raise ApiError(f"this request has {len(parts)} images; at most {limits.max_images} per request "
                       "(--max-images)", param=parts[limits.max_images][0])
    return [_read(part["image_url"]["url"], f"{at}.image_url.url", limits, pre) for at, part in parts]


def _read(url: str, param: str, limits: ImageLimits, pre: Preprocess) -> ImageInput:
    if url.startswith(("http://", "https://")):
        raise ApiError("image URLs are not fetched by this server: send the image inline as a data: URL "
                       "(data:image/png;base64,...)", param=param)
    if not url.startswith("data:") or "," not in url:
        raise ApiError("an image_url must be a data: URL (data:image/png;base64,...)", param=param)
    header, payload = url[5:].split(",", 1)
    if not header.endswith(";base64"):
        raise ApiError("an image data: URL must be base64 (data:image/png;base64,...)", param=param)
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise ApiError(f"the image is over {limits.max_bytes} bytes (--max-image-bytes)", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError("the image data: URL is not valid base64", param=param) from None
    if len(data) > limits.max_bytes:
        raise ApiError(f"the image is {len(data)} bytes; at most {limits.max_bytes} (--max-image-bytes)", param=param)
    try:
        width, height = open_image(data).size
        if width * height > limits.max_pixels:
            raise ApiError(f"the image is {width}x{height} = {width * height} pixels; at most {limits.max_pixels} "
                           "(--max-image-pixels)", param=param)
        decode_rgb(data)
        grid = pre.grid(height, width)
    except ImageError as e:
        raise ApiError(f"the image cannot be read: {e}", param=param) from None
    return ImageInput(content_hash(data), grid, pre.merge_size, data)
