"""The tensors one forward reads: a flattened batch of rows from several sequences, and the cache.

Rows of one sequence are contiguous and in position order; a sequence may contribute a prefill
chunk, one decode row, or a drafted run to verify: the model does not care which.
"""
from dataclasses import dataclass, field
from functools import cached_property

import torch

from tensorfold.kernels.paged_attention import pad_block_tables


@dataclass
class SequenceRows:
    start: int                 # first row of this sequence in the flattened batch
    end: int                   # one past its last row
    block_table: torch.Tensor  # [num_blocks] int64: cache blocks holding positions 0, 1, ...
    blocks: list[int] | None = None  # the same block ids on the host, where the batch's maker has them


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor     # [num_rows] int64
    positions: torch.Tensor     # [num_rows] int64, absolute positions in their sequences
    slot_mapping: torch.Tensor  # [num_rows] int64, flat cache slot each row's K/V is written to
    sequences: list[SequenceRows]
    logits_rows: torch.Tensor   # [num_logits] int64, rows whose logits are returned
    # The further cache groups' (models/cache.layer_groups: sliding windows) slot mapping and
    # block tables, per group 1, 2, ...: (slots [num_rows], a table per sequence). Empty: every
    # group reads the fields above (a cache whose groups share the block ids).
    groups: list = field(default_factory=list)
    # Images (--vision): each row's multimodal rope positions [3, num_rows] (temporal, height,
    # width; vision/placement.py), None where every row's three are its position; and the rows
    # whose input is an image embedding instead of their token's: (rows [n] int64, [n, hidden]).
    rope_positions: torch.Tensor | None = None
    image_rows: tuple | None = None
    # One past the largest position, as the host knows it (the rope tables grow to it); None: read
    # from the positions (a device sync where they live on a GPU).
    positions_end: int | None = None
    # The positions as host ints, where the batch's maker has them (None: read from `positions`).
    host_positions: list[int] | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    def in_group(self, g: int) -> "ForwardBatch":
        """This batch as the layers of cache group g read it (their slots and block tables), made
        once per forward; the rope rows stay shared."""
        if not g or not self.groups:
            return self
        return self.memo(("group", g), lambda: self._group_view(g))

    def _group_view(self, g: int) -> "ForwardBatch":
        slots, tables = self.groups[g - 1]
        sequences = [SequenceRows(seq.start, seq.end, table) for seq, table in zip(self.sequences, tables)]
        return ForwardBatch(self.input_ids, self.positions, slots, sequences, self.logits_rows,
                            rope_positions=self.rope_positions, image_rows=self.image_rows,
                            positions_end=self.positions_end, host_positions=self.host_positions,
                            _memo=self._memo)

    def memo(self, key, make):
        """make() once per forward and key: what every layer of the forward reads alike (rope rows,
        state slots, their copies on a device)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def rope_rows(self, table) -> tuple[torch.Tensor, torch.Tensor]:
        """A rope table's cos and sin at this batch's positions [num_rows, head_dim] each,
        gathered once per forward and table (models/rope.py). A multimodal table (M-RoPE) with
        rope_positions set takes each column at the position of its axis (RopeTable.axes)."""
        return self.memo(id(table), lambda: self._rope_rows(table))

    def _rope_rows(self, table) -> tuple[torch.Tensor, torch.Tensor]:
        table.cover(self._positions_end())
        if self.rope_positions is None or table.axes is None:
            return table.cos[self.positions], table.sin[self.positions]
        pick = table.axes.view(1, 1, -1).expand(1, self.positions.numel(), -1)  # [1, num_rows, head_dim]
        return (table.cos[self.rope_positions].gather(0, pick).squeeze(0),
                table.sin[self.rope_positions].gather(0, pick).squeeze(0))

    def _positions_end(self) -> int:
        end = self.positions_end if self.positions_end is not None else \
            int(self.positions.max()) + 1 if self.positions.numel() else 0
        if self.rope_positions is not None and self.rope_positions.numel():
            end = max(end, int(self.rope_positions.max()) + 1)
        return end

    def state_slots(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a recurrent layer reads and writes its state (models/cache.RecurrentState), as
        block ids on the batch's device: state_in [num_seqs], the block holding the state after the
        position before each sequence's first row (-1: position 0, a zero state); state_out
        [num_rows], the block a row's state is written to (-1: none): rows that end a block, and
        each sequence's last row. Computed once per forward and block size, without a loop."""
        return self.memo(("state", block_size, id(self.sequences)), lambda: self._state_slots(block_size))

    def _state_slots(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # On the host: a decode round's few integers cost far less as Python ints than as a dozen
        # tensor ops, whose code runs cold after the weights have streamed through the caches.
        positions = self.host_positions if self.host_positions is not None else self.positions.tolist()
        tables = [seq.blocks if seq.blocks is not None else seq.block_table.tolist() for seq in self.sequences]
        state_in, state_out = state_slots(tables, [positions[seq.start:seq.end] for seq in self.sequences],
                                          block_size)
        device = self.positions.device
        return (torch.tensor(state_in, dtype=torch.int64, device=device),
                torch.tensor(state_out, dtype=torch.int64, device=device))

    @cached_property
    def block_tables(self) -> torch.Tensor:
        """[num_seqs, longest table] int64, each row zero-padded (the padding is never read); from
        the host's block ids where every sequence has them (one tensor made, not one per table)."""
        if self.sequences and all(seq.blocks is not None for seq in self.sequences):
            width = max(len(seq.blocks) for seq in self.sequences)
            return torch.tensor([seq.blocks + [0] * (width - len(seq.blocks)) for seq in self.sequences],
                                dtype=torch.int64, device=self.input_ids.device)
        return pad_block_tables([seq.block_table for seq in self.sequences]).to(self.input_ids.device)

    @cached_property
    def row_starts(self) -> list[int]:
        """Sequence i owns rows row_starts[i]:row_starts[i + 1]."""
        return [seq.start for seq in self.sequences] + [self.sequences[-1].end if self.sequences else 0]

    @cached_property
    def row_starts_tensor(self) -> torch.Tensor:
        """row_starts as an int64 CPU tensor (what the C++ attention reads)."""
        return torch.tensor(self.row_starts, dtype=torch.int64)


def state_slots(tables, positions, block_size: int) -> tuple[list[int], list[int]]:
    """(state_in [num_seqs], state_out [rows]) of the sequences with block tables `tables` running
    rows at `positions` (per sequence, in order): a sequence starts from the block holding the
    state after the position before its first row (-1: position 0, a zero state; a sequence of no
    rows: -1 too); a row's state goes to its block where the row ends a block or is its sequence's
    last, else nowhere (-1). Host ints (lists or arrays) in, lists out."""
    state_in, state_out = [], []
    for table, pos in zip(tables, positions):
        if len(pos) == 0:
            state_in.append(-1)
            continue
        first, last = int(pos[0]), len(pos) - 1
        state_in.append(int(table[(first - 1) // block_size]) if first > 0 else -1)
        state_out += [int(table[p // block_size]) if p % block_size == block_size - 1 or i == last else -1
                      for i, p in enumerate(pos)]
    return state_in, state_out
