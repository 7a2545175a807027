"""A chat request's images: its image_url parts read into ImageInputs, within the server's limits.

Each image_url part (in message order) is a data: URL (base64), or with --image-urls an http(s)
URL the server fetched before preparing the request (api/image_fetch.py: the bytes by URL come in
as `fetched`); without the flag an http(s) URL is a 400 that names the flag. Fetched bytes then go
the data: URL's way (the same checks, the same content hash: a URL and its bytes inline are one
image to the image cache and the prefix cache). The bytes are decoded once here to check
them (a truncated or unknown file is a 400 naming the part) and measured: the patch grid the
family's resize gives (vision/image.py), which fixes how many pad tokens the image takes. The
pixels are made again, below the backend seam, only where the image cache misses.

Limits (ImageLimits; --max-image-bytes, --max-image-pixels, --max-images, --image-url-timeout) are
400s naming the part, and so is a failed fetch.
"""
import base64
import binascii
from dataclasses import dataclass

from tensorfold.api.errors import ApiError
from tensorfold.api.image_fetch import FetchError
from tensorfold.vision.image import ImageError, Preprocess, content_hash, decode_rgb, open_image
from tensorfold.vision.placement import ImageInput


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 2**20        # one image's decoded data: URL payload
    max_pixels: int = 40_000_000       # one image's width x height as sent (before the resize)
    max_images: int = 16               # images in one request
    fetch_urls: bool = False           # --image-urls: http(s) image URLs are fetched by the server
    url_timeout_s: float = 10.0        # a request's fetches, all of it: connect, redirects, the body


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


def urls_to_fetch(messages, limits: ImageLimits) -> list[str]:
    """The http(s) image URLs the server is to fetch for these messages (none without
    --image-urls, or where the request has too many images: read_images refuses it first)."""
    parts = image_parts(messages)
    if not limits.fetch_urls or len(parts) > limits.max_images:
        return []
    return [part["image_url"]["url"] for _, part in parts if _is_http(part["image_url"]["url"])]


def read_images(messages, limits: ImageLimits, pre: Preprocess,
                fetched: dict[str, bytes | FetchError] | None = None) -> list[ImageInput]:
    """The request's images; `fetched`: the bytes (or the failure) of each http(s) URL fetched."""
    parts = image_parts(messages)
    if len(parts) > limits.max_images:
        raise ApiError(f"this request has {len(parts)} images; at most {limits.max_images} per request "
                       "(--max-images)", param=parts[limits.max_images][0])
    return [_read(part["image_url"]["url"], f"{at}.image_url.url", limits, pre, fetched or {})
            for at, part in parts]


def _is_http(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def _read(url: str, param: str, limits: ImageLimits, pre: Preprocess, fetched: dict) -> ImageInput:
    if _is_http(url):
        return _decoded(_fetched(url, param, limits, fetched), param, limits, pre)
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
    return _decoded(data, param, limits, pre)


def _fetched(url: str, param: str, limits: ImageLimits, fetched: dict) -> bytes:
    got = fetched.get(url) if limits.fetch_urls else None
    if got is None:
        raise ApiError("image URLs are fetched only when the server runs with --image-urls: send the image "
                       "inline as a data: URL (data:image/png;base64,...) or start the server with --image-urls",
                       param=param)
    if isinstance(got, FetchError):
        if got.timed_out:
            raise ApiError(f"the image URL could not be fetched within {limits.url_timeout_s:g} s "
                           "(--image-url-timeout)", param=param)
        raise ApiError(f"the image URL could not be fetched: {got}", param=param)
    return got


def _decoded(data: bytes, param: str, limits: ImageLimits, pre: Preprocess) -> ImageInput:
    """The image of `data` (a data: URL's payload or a fetched body), checked and measured."""
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
