"""One rank's place in a tensor-parallel group: the plan channel and the round's collectives.

Two process groups over one TCPStore (gloo; the round's on NCCL where the tensors are CUDA's):
- the default group, for rank 0's broadcast of each round's StepPlan. The other ranks wait on
  it while the server idles, and the ranks meet through it while they load, so it has no
  practical timeout; a dead rank 0 ends it at once (the socket closes), and the ranks exit.
- `rounds`: the collectives inside a round (column gathers, the draw's exchange), with the
  group's timeout (--tp-timeout, 10 s): a rank that stops answering mid-round fails the round
  within it instead of hanging the server.

Gathers move bits only: a tensor travels as the integer type of its width (bfloat16 as int16),
so no dtype gloo lacks and no conversion on the way.
"""
import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist

PLAN_TIMEOUT = timedelta(days=365)
_AS_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def split_sizes(total: int, count: int) -> list[int]:
    """`total` split into `count` contiguous parts, the first ones a unit larger."""
    base, extra = divmod(total, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


class RankGroup:
    """This process's rank; connect() joins (or, after a restart, rejoins) the process groups.
    The model's sharded weights keep this object, so a rejoined group needs no rebuilt model."""

    def __init__(self, rank: int, size: int, timeout_s: float, store: dist.Store | None = None,
                 device: str = "cpu"):
        """device: where the round's tensors live (cuda: the round's collectives on NCCL)."""
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.backend = "nccl" if device.startswith("cuda") else "gloo"
        self.rounds = None
        self.bytes_moved = 0     # payload this rank's round collectives carried (the benchmark's counters)
        self.collectives = 0
        self.seconds = 0.0       # time spent inside them
        if store is not None:
            self.connect(store)

    def connect(self, store: dist.Store) -> None:
        self.close()
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.size, timeout=PLAN_TIMEOUT)
        self.rounds = dist.new_group(backend=self.backend, timeout=timedelta(seconds=self.timeout_s))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- the plan channel --------------------------------------------------------------------

    def broadcast(self, obj=None):
        """Rank 0's object (a StepPlan, or None to stop) on every rank."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0)
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, 0)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    # -- a round's collectives ---------------------------------------------------------------

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Each rank's x [M, widths[rank]] side by side in rank order: [M, sum(widths)]."""
        started = time.perf_counter()
        width = max(widths)
        local = torch.nn.functional.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x
        bits = local.contiguous().view(_AS_BITS[x.element_size()]) if x.dtype.is_floating_point else local.contiguous()
        parts = [torch.empty_like(bits) for _ in range(self.size)]
        dist.all_gather(parts, bits, group=self.rounds)
        self._count(bits, self.size, started)
        parts = [p[:, :w] for p, w in zip(parts, widths)]
        out = torch.cat(parts, dim=1)
        return out.view(x.dtype) if x.dtype.is_floating_point else out

    # sampling/sampler.Exchange: this rank's one shard

    def all_max(self, parts: list[torch.Tensor]) -> torch.Tensor:
        started = time.perf_counter()
        (t,) = parts
        t = t.clone()
        dist.all_reduce(t, dist.ReduceOp.MAX, group=self.rounds)
        self._count(t, 2, started)
        return t

    def all_sum(self, parts: list[torch.Tensor]) -> torch.Tensor:
        started = time.perf_counter()
        (t,) = parts
        t = t.to(torch.int64).clone()  # integer sums: exact in any order
        dist.all_reduce(t, dist.ReduceOp.SUM, group=self.rounds)
        self._count(t, 2, started)
        return t

    def all_gather(self, parts: list[torch.Tensor]) -> torch.Tensor:
        started = time.perf_counter()
        (t,) = parts
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.rounds)
        self._count(t, self.size, started)
        return torch.cat(out, dim=-1)

    def _count(self, t: torch.Tensor, copies: int, started: float) -> None:
        """One collective of `t` (copies: the tensors it moves, this rank's own included)."""
        self.seconds += time.perf_counter() - started
        self.collectives += 1
        self.bytes_moved += t.numel() * t.element_size() * copies
