"""What every backend is to the engine: four calls, and the plain data two of them answer with.

    load(model_path, config)   the checkpoint onto the device, in the backend's weight types,
                               checked by the batch-invariance probes -> Loaded
    allocate(context_length)   every layer's cache kind within --kv-cache-gib -> Allocation
    runner()                   executes a StepPlan, returns token ids as Python ints
    describe()                 plain strings for /health and the startup log
    status()                   what may change while serving, for /health: {} where nothing
                               does; a rank group's {"ranks": [...], "unavailable": why or None}
    close()                    release what outlives a call (a rank group's processes)
    cache_generation           bumped when the cache's contents were lost (a rank group restarted):
                               the engine then forgets its prefix cache

The torch backends (torch_backend.py: cpu, cuda) and the mlx backend (mlx_backend.py) are
classes with these methods; tensors, MLX arrays and devices stay below this line.
"""
from dataclasses import dataclass
from typing import Protocol

from tensorfold.engine.step_plan import StepPlan
from tensorfold.models.tokenizer import Tokenizer


@dataclass
class Loaded:
    """What load() gives the engine: plain data and the objects it passes on untouched."""
    checkpoint: object            # its metadata (path, architecture, template, configs); tensors dropped
    tokenizer: Tokenizer
    config: object                # the EngineConfig to serve with (narrowed if the probes failed)
    probe_failures: list[str]
    vocab_size: int
    max_position: int
    num_layers: int
    mtp_layers: int = 0           # multi-token-prediction layers loaded (the runner's `mtp` runs them)
    vision: object | None = None  # vision/placement.VisionInfo where a vision tower was loaded (--vision)


@dataclass(frozen=True)
class BlockGroup:
    """Layers behind one block table (models/cache.layer_groups), in plain numbers."""
    window: int | None            # a sliding group's window in tokens; None: every position is kept
    num_blocks: int
    num_layers: int


@dataclass(frozen=True)
class Allocation:
    """The cache's size in plain numbers: blocks of config.block_size tokens."""
    num_blocks: int               # the first group's (all of them where groups is empty)
    max_cached_blocks: int | None  # --prompt-cache-gib's cap on cached free blocks (per group)
    nbytes: int
    kinds: str                    # the cache kinds in words
    resume_at_blocks: bool = False  # a kind keeps state per block (RecurrentState): resume at boundaries
    groups: tuple[BlockGroup, ...] = ()  # one per block table; empty: one table of num_blocks

    @property
    def block_groups(self) -> tuple[BlockGroup, ...]:
        return self.groups or (BlockGroup(None, self.num_blocks, 0),)


class Runner(Protocol):
    def execute(self, plan: StepPlan) -> list[list[int]]: ...


class Backend(Protocol):
    name: str

    def load(self, model_path: str | None, config) -> Loaded: ...

    def allocate(self, context_length: int) -> Allocation: ...

    def runner(self) -> Runner: ...

    def describe(self) -> dict: ...

    def status(self) -> dict: ...

    def close(self) -> None: ...

    cache_generation: int
