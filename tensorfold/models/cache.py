"""Cache kinds: what each layer keeps between rounds, declared by the layer, allocated together.

A block class declares its layer's cache as a spec (a frozen dataclass): how many bytes one token
costs it and how to allocate its part for `num_blocks` blocks. Every kind is indexed by the same
block ids (one block table per request), so the engine's bookkeeping (engine/cache_book.py) is
in blocks and counts, whatever the kinds; the backend sizes the blocks from the sum of the
layers' bytes per token within --kv-cache-gib. Kinds: paged K/V (attention, with an optional
window) here; a recurrent state (linear attention, Mamba) and a latent cache (MLA) go beside it.

ModelCache is the allocated whole: one object per layer (a LayerKV for attention), handed to
that layer's forward.
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's part of the cache, what its attention writes and reads: K and V
    blocks [num_blocks, block_size, num_kv_heads, head_dim] and, where the op set keeps it, the
    record of V's exponents [num_blocks, block_size, num_kv_heads] int16 (else None)."""
    k: torch.Tensor
    v: torch.Tensor
    v_exp: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.v_exp) if t is not None)


@dataclass(frozen=True)
class PagedKV:
    """Paged K/V for one attention layer. `window`: a sliding window in tokens (None: full); the
    attention masks by it, and the blocks stay allocated (block freeing by window comes with the
    families that need it)."""
    num_kv_heads: int
    head_dim: int
    window: int | None = None

    def bytes_per_token(self, dtype: torch.dtype, v_exponents: bool = False) -> int:
        record = 2 if v_exponents else 0  # an int16 per KV head
        return self.num_kv_heads * (2 * self.head_dim * torch.finfo(dtype).bits // 8 + record)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 v_exponents: bool = False) -> LayerKV:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        record = torch.zeros(shape[:3], dtype=torch.int16, device=device) if v_exponents else None
        return LayerKV(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                       record)


class ModelCache:
    """Every layer's cache for `num_blocks` blocks of `block_size` tokens. dtype: the K/V dtype
    (EngineConfig.kv_dtype), which may differ from the activations'; v_exponents: whether the op
    set keeps the record of V's exponents beside its K/V (backends.keeps_v_exponents)."""

    def __init__(self, specs: list, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", v_exponents: bool = False):
        self.specs = list(specs)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.layers = [spec.allocate(num_blocks, block_size, dtype, device, v_exponents) for spec in specs]

    def layer(self, i: int):
        """Layer i's part of the cache (built once: a decode round asks for every layer's)."""
        return self.layers[i]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @staticmethod
    def bytes_per_token(specs: list, dtype: torch.dtype, v_exponents: bool = False) -> int:
        return sum(spec.bytes_per_token(dtype, v_exponents) for spec in specs)

    def describe(self) -> str:
        """The kinds and their layer counts, in words (the startup log, /health)."""
        kinds: dict[str, int] = {}
        for spec in self.specs:
            name = type(spec).__name__
            kinds[name] = kinds.get(name, 0) + 1
        return ", ".join(f"{n} x {name}" for name, n in kinds.items())
