"""Cache kinds: what each layer keeps between rounds, declared by the layer, allocated together.

A block class declares its layer's cache as a spec (a frozen dataclass): how many bytes one block
costs it and how to allocate its part for `num_blocks` blocks. Every kind is indexed by the same
block ids (one block table per request), so the engine's bookkeeping (engine/cache_book.py) is
in blocks and counts, whatever the kinds; the backend sizes the blocks from the sum of the
layers' bytes per block within --kv-cache-gib. Kinds:

    PagedKV         attention: K and V of each position (optionally within a window)
    SharedKV        attention that reads an earlier layer's K/V and keeps none of its own (Gemma 4's
                    KV-shared layers): no bytes, the earlier layer's part handed to it
    RecurrentState  linear attention: per block, the state after the block's last position
                    (a fixed-size state, not a per-position one: see RecurrentState)

A latent cache (MLA) and Mamba's state go beside them.

ModelCache is the allocated whole: one object per layer (a LayerKV for attention, a LayerState
for linear attention; a KV-shared layer gets its source's LayerKV), handed to that layer's forward.
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

    recurrent = False

    def bytes_per_token(self, dtype: torch.dtype, v_exponents: bool = False) -> int:
        record = 2 if v_exponents else 0  # an int16 per KV head
        return self.num_kv_heads * (2 * self.head_dim * torch.finfo(dtype).bits // 8 + record)

    def bytes_per_block(self, dtype: torch.dtype, block_size: int, v_exponents: bool = False) -> int:
        return self.bytes_per_token(dtype, v_exponents) * block_size

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 v_exponents: bool = False) -> LayerKV:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        record = torch.zeros(shape[:3], dtype=torch.int16, device=device) if v_exponents else None
        return LayerKV(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                       record)


@dataclass(frozen=True)
class SharedKV:
    """An attention layer that reads the K/V layer `source` (an earlier one, with the same window)
    wrote in the same forward, and writes none: it costs no bytes, and ModelCache hands it the
    source's LayerKV. Every count, rollback and snapshot is the source's, so the engine's rules
    for paged K/V hold for it unchanged."""
    source: int

    recurrent = False

    def bytes_per_block(self, dtype: torch.dtype, block_size: int, v_exponents: bool = False) -> int:
        return 0


@dataclass(frozen=True)
class LayerState:
    """One linear-attention layer's part of the cache, one state per block id (float32):
    conv [num_blocks, kernel - 1, conv_dim], the last inputs of the causal conv, and
    ssm [num_blocks, num_heads, key_dim, value_dim], the delta rule's state matrices."""
    conv: torch.Tensor
    ssm: torch.Tensor
    block_size: int

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()


@dataclass(frozen=True)
class RecurrentState:
    """A recurrent layer's state (Gated DeltaNet: the causal conv's window and the delta rule's
    matrices), kept per block: block b of a sequence holds the state after the last position
    the sequence has computed in it. So a full block holds the state at its end (a snapshot the
    prefix cache shares with its K/V blocks, evicted with them), and the running block the live
    state, updated in place. The rules that follow (engine/cache_book.py): a sequence resumes
    only at a block boundary, so a rejected draft or a cached prefix rewinds to the boundary at
    or before it and recomputes from there. Cost: one state per block of block_size tokens,
    always float32 (the state's precision is the model's, whatever the K/V dtype)."""
    conv_dim: int
    conv_kernel: int
    num_heads: int
    key_dim: int
    value_dim: int

    recurrent = True

    def bytes_per_block(self, dtype: torch.dtype, block_size: int, v_exponents: bool = False) -> int:
        return 4 * ((self.conv_kernel - 1) * self.conv_dim + self.num_heads * self.key_dim * self.value_dim)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 v_exponents: bool = False) -> LayerState:
        conv = torch.zeros((num_blocks, self.conv_kernel - 1, self.conv_dim), dtype=torch.float32, device=device)
        ssm = torch.zeros((num_blocks, self.num_heads, self.key_dim, self.value_dim), dtype=torch.float32,
                          device=device)
        return LayerState(conv, ssm, block_size)


class ModelCache:
    """Every layer's cache for `num_blocks` blocks of `block_size` tokens. dtype: the K/V dtype
    (EngineConfig.kv_dtype), which may differ from the activations'; v_exponents: whether the op
    set keeps the record of V's exponents beside its K/V (backends.keeps_v_exponents)."""

    def __init__(self, specs: list, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", v_exponents: bool = False):
        self.specs = list(specs)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.layers = []
        for i, spec in enumerate(self.specs):
            if isinstance(spec, SharedKV):
                if not 0 <= spec.source < i or isinstance(self.specs[spec.source], SharedKV):
                    raise ValueError(f"layer {i} shares the K/V of layer {spec.source}, which keeps none before it")
                self.layers.append(self.layers[spec.source])
            else:
                self.layers.append(spec.allocate(num_blocks, block_size, dtype, device, v_exponents))

    def layer(self, i: int):
        """Layer i's part of the cache (built once: a decode round asks for every layer's)."""
        return self.layers[i]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in {id(layer): layer for layer in self.layers}.values())  # shared once

    @staticmethod
    def bytes_per_block(specs: list, dtype: torch.dtype, block_size: int, v_exponents: bool = False) -> int:
        return sum(spec.bytes_per_block(dtype, block_size, v_exponents) for spec in specs)

    @staticmethod
    def recurrent(specs: list) -> bool:
        """Whether any layer keeps a recurrent state (resuming then snaps to block boundaries)."""
        return any(getattr(spec, "recurrent", False) for spec in specs)

    def describe(self) -> str:
        """The kinds and their layer counts, in words (the startup log, /health)."""
        kinds: dict[str, int] = {}
        for spec in self.specs:
            name = type(spec).__name__
            kinds[name] = kinds.get(name, 0) + 1
        return ", ".join(f"{n} x {name}" for name, n in kinds.items())
