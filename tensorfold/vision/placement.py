"""Images in a prompt: where their rows are, their multimodal rope positions, their cache keys.

The template writes <|vision_start|><|image_pad|><|vision_end|> per image; `expand` turns each
pad into one pad per merged patch and records the span (ImageSpan). In the forward, the rows of
a span take the image's embeddings instead of the pad token's (backends/runner.py).

Rope positions (Qwen's M-RoPE, three rows: temporal, height, width), as transformers' get_rope_index:
text takes p + delta in all three rows, delta starting at 0; an image whose span starts at
sequence index s, on a merged grid of h x w, puts its token j at (b, b + j // w, b + j % w) with
b = s + delta; the text after it continues at b + max(h, w), so delta grows by
max(h, w) - h * w per image. A reply's rows are text: p + the prompt's final delta.

Prefix cache (engine/block_pool.py): the pad tokens of two images are the same ids, so the
first pad of each span is keyed by the image's content hash instead ("image:<sha256>"); the
chain hash then covers the image in every block from there on, and a cached prefix never
matches a prompt with another image.

Plain Python: the engine and the scheduler carry these objects; only the runner reads tensors.
"""
from dataclasses import dataclass, field

from tensorfold.vision.image import Preprocess


@dataclass(frozen=True)
class VisionInfo:
    """What the API needs to place images (EngineInfo.vision, set where --vision loaded a tower)."""
    pad_id: int          # <|image_pad|>
    start_id: int        # <|vision_start|>
    end_id: int          # <|vision_end|>
    preprocess: Preprocess


@dataclass(frozen=True)
class ImageInput:
    """One image as the request carries it: its content hash, its bytes and its patch grid."""
    sha: str
    grid: tuple[int, int, int]   # (t, h, w) in patches
    merge: int
    data: bytes = field(repr=False, compare=False)

    @property
    def merged(self) -> tuple[int, int]:
        """The merged grid (rows, columns): one prompt token each."""
        return self.grid[1] // self.merge, self.grid[2] // self.merge

    @property
    def num_tokens(self) -> int:
        rows, cols = self.merged
        return self.grid[0] * rows * cols


@dataclass(frozen=True)
class ImageSpan:
    offset: int          # index of the span's first pad token in the prompt
    image: ImageInput

    @property
    def end(self) -> int:
        return self.offset + self.image.num_tokens


def expand(token_ids: list[int], pad_id: int, images: list[ImageInput]) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """The prompt with the i-th pad token repeated images[i].num_tokens times, and the spans. A
    count of pads other than len(images) is a ValueError (the template did not place them all)."""
    found = token_ids.count(pad_id)
    if found != len(images):
        raise ValueError(f"the rendered prompt has {found} image placeholders for {len(images)} images")
    out, spans, it = [], [], iter(images)
    for token in token_ids:
        if token == pad_id:
            image = next(it)
            spans.append(ImageSpan(len(out), image))
            out += [pad_id] * image.num_tokens
        else:
            out.append(token)
    return out, tuple(spans)


def rope_delta(spans: tuple[ImageSpan, ...]) -> int:
    """How far text positions after every span lag (negative) or lead their sequence index."""
    return sum(max(s.image.merged) - s.image.num_tokens for s in spans)


def rope_positions(spans: tuple[ImageSpan, ...], start: int, count: int) -> tuple[list[int], list[int], list[int]]:
    """The (temporal, height, width) rope positions of sequence indices start .. start + count - 1."""
    t_pos, h_pos, w_pos = [], [], []
    p, end, delta = start, start + count, 0
    for span in spans:
        if p >= end:
            break
        if span.end <= p:
            delta += max(span.image.merged) - span.image.num_tokens
            continue
        text_end = min(span.offset, end)
        if p < text_end:  # text before the span
            shifted = range(p + delta, text_end + delta)
            t_pos += shifted
            h_pos += shifted
            w_pos += shifted
            p = text_end
        base, cols = span.offset + delta, span.image.merged[1]
        for j in range(p - span.offset, min(span.end, end) - span.offset):
            t_pos.append(base)
            h_pos.append(base + j // cols)
            w_pos.append(base + j % cols)
        p = min(span.end, end)
        delta += max(span.image.merged) - span.image.num_tokens
    if p < end:
        shifted = range(p + delta, end + delta)
        t_pos += shifted
        h_pos += shifted
        w_pos += shifted
    return t_pos, h_pos, w_pos


def cache_keys(token_ids: list, spans: tuple[ImageSpan, ...]) -> list:
    """token_ids with each span's first pad replaced by its image's key (a new list)."""
    keys = list(token_ids)
    for span in spans:
        if span.offset < len(keys):
            keys[span.offset] = f"image:{span.image.sha}"
    return keys
