"""The tensors one forward reads: a flattened batch of rows from several sequences, and the cache.

Rows of one sequence are contiguous and in position order; a sequence may contribute a prefill
chunk, one decode row, or a drafted run to verify: the model does not care which.
"""
from dataclasses import dataclass
from functools import cached_property

import torch

from tensorfold.kernels.paged_attention import pad_block_tables


@dataclass
class SequenceRows:
    start: int                 # first row of this sequence in the flattened batch
    end: int                   # one past its last row
    block_table: torch.Tensor  # [num_blocks] int64: cache blocks holding positions 0, 1, ...


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor     # [num_rows] int64
    positions: torch.Tensor     # [num_rows] int64, absolute positions in their sequences
    slot_mapping: torch.Tensor  # [num_rows] int64, flat cache slot each row's K/V is written to
    sequences: list[SequenceRows]
    logits_rows: torch.Tensor   # [num_logits] int64, rows whose logits are returned

    @cached_property
    def block_tables(self) -> torch.Tensor:
        """[num_seqs, longest table] int64, each row zero-padded (the padding is never read)."""
        return pad_block_tables([seq.block_table for seq in self.sequences]).to(self.input_ids.device)

    @cached_property
    def row_starts(self) -> list[int]:
        """Sequence i owns rows row_starts[i]:row_starts[i + 1]."""
        return [seq.start for seq in self.sequences] + [self.sequences[-1].end if self.sequences else 0]

    @cached_property
    def row_starts_tensor(self) -> torch.Tensor:
        """row_starts as an int64 CPU tensor (what the C++ attention reads)."""
        return torch.tensor(self.row_starts, dtype=torch.int64)


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's part of the cache, what its attention writes and reads: K and V
    blocks [num_blocks, block_size, num_kv_heads, head_dim] and, where the op set keeps it, the
    record of V's exponents [num_blocks, block_size, num_kv_heads] int16 (else None). The model
    hands each layer its own (KVCache.layer), so a layer of another kind, a hybrid model's
    state-space layer, can be handed a cache of another kind."""
    k: torch.Tensor
    v: torch.Tensor
    v_exp: torch.Tensor | None = None


@dataclass
class KVCache:
    """Per-layer K and V blocks: [num_blocks, block_size, num_kv_heads, head_dim] each, in the
    cache's dtype (EngineConfig.kv_dtype), which may differ from the activations'. v_exp, for op
    sets that ask for it (backends.keeps_v_exponents), holds per layer each slot's V exponents, int16
    [num_blocks, block_size, num_kv_heads]: write_kv records them, the attention reads them."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    v_exp: list[torch.Tensor] | None = None

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 v_exponents: bool = False) -> "KVCache":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   [torch.zeros(shape[:3], dtype=torch.int16, device=device) for _ in range(num_layers)]
                   if v_exponents else None)

    def __post_init__(self):
        self._layers = [LayerKV(k, v, None if self.v_exp is None else self.v_exp[i])
                        for i, (k, v) in enumerate(zip(self.k, self.v))]

    def layer(self, i: int) -> LayerKV:
        """Layer i's part of the cache (views built once: a decode round asks for every layer's)."""
        return self._layers[i]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def nbytes(self) -> int:
        """The bytes the cache holds: K, V and the V exponents' records."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *(self.v_exp or ())))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        v_exponents: bool = False) -> int:
        record = 2 if v_exponents else 0  # an int16 per KV head
        return num_layers * num_kv_heads * (2 * head_dim * torch.finfo(dtype).bits // 8 + record)
