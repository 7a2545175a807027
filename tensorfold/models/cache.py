"""Cache kinds: what each layer keeps between rounds, declared by the layer, allocated together.

A block class declares its layer's cache as a spec (a frozen dataclass): how many bytes one block
costs it and how to allocate its part for `num_blocks` blocks. Layers are grouped behind block
tables (vLLM v1's KV-cache groups, layer_groups): the sliding-window layers of one window form a
group of their own, every other layer (full attention, recurrent and latent kinds, the MTP layer)
group 0. A request holds one block table per group; a sliding group's table lets go of the
blocks that left the window (engine/cache_book.py), so a long prompt costs full K/V only on the
full layers. The engine's bookkeeping is in blocks and counts per group, whatever the kinds; the
backend sizes each group's blocks within --kv-cache-gib (group_blocks). Kinds:

    PagedKV         attention: K and V of each position (optionally within a window)
    SharedKV        attention that reads an earlier layer's K/V and keeps none of its own (Gemma 4's
                    KV-shared layers): no bytes, the earlier layer's part handed to it
    RecurrentState  linear attention: per block, the state after the block's last position
                    (a fixed-size state, not a per-position one: see RecurrentState)
    Mamba2State     Mamba2: the same rule and layout (conv window, SSM state per block), its
                    own name in the counts
    LatentKV        latent attention (MLA, GLM-5): per position the normalized compressed KV and
                    the roped key, and the DSA indexer's key where the layer has an indexer

A layer that keeps nothing (a feed-forward-only layer: Nemotron-H's MLP and MoE layers)
declares None.

ModelCache is the allocated whole: one object per layer (a LayerKV for attention, a LayerState
for linear attention and Mamba2, a LayerLatent for latent attention, None for a layer that keeps
nothing; a KV-shared layer gets its source's LayerKV), handed to that layer's forward.
"""
from dataclasses import dataclass

import torch

from tensorfold.engine.block_pool import lane_blocks


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
    attention masks by it, and the layer's group (layer_groups) frees the blocks behind it."""
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


@dataclass(frozen=True)
class Mamba2State(RecurrentState):
    """A Mamba2 layer's state, kept per block by RecurrentState's rule: the causal conv's last
    conv_kernel - 1 inputs (x, B and C: conv_dim channels) and the SSM state of each head as
    [key_dim = ssm_state_size, value_dim = head_dim] (so the read-out h^T C is the same exact dot
    as DeltaNet's S^T q), float32."""


@dataclass(frozen=True)
class LayerLatent:
    """One latent-attention layer's part of the cache: kv [num_blocks, block_size, latent_dim +
    rope_dim], each position's normalized compressed KV followed by its roped key (the attention's
    key is the whole vector, its value the first latent_dim entries), and index_keys [num_blocks,
    block_size, index_dim], the DSA indexer's key per position (None for a layer without an indexer)."""
    kv: torch.Tensor
    index_keys: torch.Tensor | None
    latent_dim: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.index_keys) if t is not None)


@dataclass(frozen=True)
class LatentKV:
    """The latent cache of multi-head latent attention (MLA): per position the normalized
    compressed KV (latent_dim) and the shared roped key (rope_dim), not per-head K/V (the
    attention runs on the latent with absorbed projections: models/latent_attention.py), and
    the DSA indexer's key (index_dim, 0 without an indexer). Per-position, like PagedKV: the
    engine's counts, rollbacks and prefix hits hold for it unchanged."""
    latent_dim: int
    rope_dim: int
    index_dim: int = 0

    recurrent = False

    def bytes_per_block(self, dtype: torch.dtype, block_size: int, v_exponents: bool = False) -> int:
        return (self.latent_dim + self.rope_dim + self.index_dim) * torch.finfo(dtype).bits // 8 * block_size

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 v_exponents: bool = False) -> LayerLatent:
        kv = torch.zeros((num_blocks, block_size, self.latent_dim + self.rope_dim), dtype=dtype, device=device)
        index = (torch.zeros((num_blocks, block_size, self.index_dim), dtype=dtype, device=device)
                 if self.index_dim else None)
        return LayerLatent(kv, index, self.latent_dim)


def layer_groups(specs: list) -> tuple[list[int | None], list[int | None]]:
    """Which block table each layer's cache lives behind: (group of each layer, None for a layer
    that keeps nothing; window of each group, None for a full group). Group 0 holds every layer
    that keeps all positions (full attention, recurrent and latent kinds); the PagedKV layers of
    each sliding window make one more group, in increasing window order. A SharedKV layer is in
    its source's group. A model with no sliding layer has one group: one table, as before."""
    keys = [getattr(spec, "window", None) if spec is not None else None for spec in specs]
    for i, spec in enumerate(specs):
        if isinstance(spec, SharedKV) and 0 <= spec.source < i:
            keys[i] = keys[spec.source]
    used = {key for spec, key in zip(specs, keys) if spec is not None}
    windows = ([None] if None in used else []) + sorted(w for w in used if w is not None)
    return [None if spec is None else windows.index(key) for spec, key in zip(specs, keys)], windows


def group_blocks(specs: list, budget_bytes: int, block_bytes, block_size: int, context_length: int,
                 max_num_seqs: int, max_chunk: int) -> list[int]:
    """Blocks per group (layer_groups) within budget_bytes, a block of layer spec s costing
    block_bytes(s) (the backend's own layout: its dtype, its exponent records). A sliding group needs at most
    lane_blocks per running request; it gets that for every lane plus one window per lane, so the
    windows of as many finished requests stay in the prefix cache (a hit needs its window's
    blocks, engine/cache_book.py), and never more than the full groups. The full groups take the
    rest. Every group holds at least one request of context_length tokens (over the budget if
    need be, as a single group always did)."""
    group_of, windows = layer_groups(specs)
    cost = [0] * len(windows)
    for spec, g in zip(specs, group_of):
        if g is not None:
            cost[g] += block_bytes(spec)
    whole = -(-context_length // block_size)
    if not windows:
        return []
    want = [None if w is None else max_num_seqs * (lane_blocks(w, block_size, max_chunk) + -(-w // block_size))
            for w in windows]
    least = [whole if w is None else min(whole, lane_blocks(w, block_size, max_chunk)) for w in windows]
    total = sum(cost) or 1
    if windows[0] is not None:  # only sliding groups: one count for all, as one table had
        return [max(budget_bytes // total, floor) for floor in least]

    def counts(n: int) -> list[int]:
        return [n if need is None else min(n, need) for need in want]

    lo, hi = 0, budget_bytes // max(cost[0], 1)  # the largest n whose counts fit the budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(c * k for c, k in zip(cost, counts(mid))) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return [max(n, floor) for n, floor in zip(counts(lo), least)]


class ModelCache:
    """Every layer's cache for `num_blocks` blocks of `block_size` tokens. dtype: the K/V dtype
    (EngineConfig.kv_dtype), which may differ from the activations'; v_exponents: whether the op
    set keeps the record of V's exponents beside its K/V (backends.keeps_v_exponents); blocks:
    each group's count (layer_groups; None: num_blocks for every group)."""

    def __init__(self, specs: list, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", v_exponents: bool = False, blocks: list[int] | None = None):
        self.specs = list(specs)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.group_of, self.windows = layer_groups(self.specs)
        self.group_blocks = list(blocks) if blocks else [num_blocks] * len(self.windows)
        self.layers = []
        for i, spec in enumerate(self.specs):
            if spec is None:  # a layer that keeps nothing
                self.layers.append(None)
            elif isinstance(spec, SharedKV):
                if not 0 <= spec.source < i or isinstance(self.specs[spec.source], SharedKV):
                    raise ValueError(f"layer {i} shares the K/V of layer {spec.source}, which keeps none before it")
                self.layers.append(self.layers[spec.source])
            else:
                count = self.group_blocks[self.group_of[i]]
                self.layers.append(spec.allocate(count, block_size, dtype, device, v_exponents))

    def layer(self, i: int):
        """Layer i's part of the cache (built once: a decode round asks for every layer's)."""
        return self.layers[i]

    def batch(self, i: int, batch):
        """The forward batch as layer i reads it: its group's slots and block tables."""
        g = self.group_of[i]
        return batch if not g else batch.in_group(g)

    @property
    def nbytes(self) -> int:
        unique = {id(layer): layer for layer in self.layers if layer is not None}  # shared once
        return sum(layer.nbytes for layer in unique.values())

    @staticmethod
    def bytes_per_block(specs: list, dtype: torch.dtype, block_size: int, v_exponents: bool = False) -> int:
        return sum(spec.bytes_per_block(dtype, block_size, v_exponents) for spec in specs if spec is not None)

    @staticmethod
    def recurrent(specs: list) -> bool:
        """Whether any layer keeps a recurrent state (resuming then snaps to block boundaries)."""
        return any(getattr(spec, "recurrent", False) for spec in specs)

    def describe(self) -> str:
        """The kinds and their layer counts, and each group's blocks where there are several, in
        words (the startup log, /health)."""
        kinds: dict[str, int] = {}
        for spec in self.specs:
            if spec is None:
                continue
            name = type(spec).__name__
            kinds[name] = kinds.get(name, 0) + 1
        text = ", ".join(f"{n} x {name}" for name, n in kinds.items())
        if len(self.windows) > 1:
            text += "; " + ", ".join(f"{'full' if w is None else f'window {w}'}: {self.group_of.count(g)} layers, "
                                     f"{n} blocks" for g, (w, n) in enumerate(zip(self.windows, self.group_blocks)))
        return text
