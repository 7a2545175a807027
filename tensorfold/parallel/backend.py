"""The tensor-parallel backend: every rank a torch backend on its shard; rank 0 the engine's.

    RankBackend    any rank: the model built from its shard (parallel/shard.py), the probes run in
                   step with the other ranks, a runner that draws with the shard exchange
    LeaderBackend  rank 0, behind the engine's seam (backends/base.py): it starts the other
                   ranks (parallel/launch.py), broadcasts each round's plan before running it, and
                   says when the group cannot serve (`status()["unavailable"]`) or lost its
                   cache (`cache_generation`: the engine then drops its prefix cache)
    serve_rank     ranks 1..N-1: load, allocate, then run each broadcast plan until told to stop

A round on a broken group is refused before anything is sent, and a round that fails mid-way
(a rank died, stopped answering or raised) marks the group failed: the engine ends that
round's requests with an error, and new ones get 503 until the group is restarted.
"""
import logging
import math
import os
import signal

import torch

from tensorfold.backends.runner import ModelRunner, per_request
from tensorfold.backends.torch_backend import TorchBackend
from tensorfold.engine.step_plan import StepPlan
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs
from tensorfold.models.loader import build_model
from tensorfold.parallel.group import RankGroup
from tensorfold.parallel.shard import vocab_range
from tensorfold.sampling.sampler import sample_rank

log = logging.getLogger("tensorfold.parallel")
RAISE_AFTER = "TENSORFOLD_RANK_RAISE_AFTER"  # test aid: ranks 1.. raise in this round (0: never)


class RanksDown(RuntimeError):
    """The group cannot run a round (a rank failed); the message says which and why."""


class RankRunner(ModelRunner):
    def __init__(self, model, cache, group: RankGroup):
        super().__init__(model, cache)
        self.group = group
        self.vocab = model.args.vocab_size
        self.offset = vocab_range(self.vocab, group)[0]

    def run(self, plan: StepPlan) -> list[list[int]]:
        """One forward over this rank's shard, and the draw all ranks agree on."""
        batch = self._batch(plan)
        logits = self.model.forward(batch, self.cache)  # [num_draw_rows, this rank's vocabulary]
        rows = [row for req in plan.requests for row in req.rows]
        drawn = sample_rank(logits, self.offset, self.vocab, self.group.size, rows, self.group,
                            bitmask=plan.bitmask) if rows else []
        return per_request(plan, drawn)


class RankBackend(TorchBackend):
    def __init__(self, name: str, ops, device, num_threads, group: RankGroup | None, size: int):
        # ranks on one host's CPU share its cores: unless told, each takes its share (more threads
        # than cores spin against each other at every collective)
        if num_threads is None and torch.device(device).type == "cpu":
            num_threads = max(1, (os.cpu_count() or 1) // size)
        super().__init__(name, ops, device, num_threads)
        self.group = group

    def build(self, checkpoint, dtype: torch.dtype, **parts):
        """This rank's shard of the model. The optional parts (`parts`: an MTP layer, a vision
        tower) are not sharded yet: ranks serve text and draft by n-grams."""
        return build_model(checkpoint, dtype, self.ops, self.device, group=self.group)

    def probes(self) -> list[str]:
        self.group.broadcast("loaded")  # every rank has its model: the probes' collectives start together
        return super().probes()

    def runner(self) -> RankRunner:
        return RankRunner(self.model, self.cache, self.group)


class LeaderRunner:
    """Rank 0's runner: refuses a round on a failed group, sends the plan, runs its shard."""

    def __init__(self, backend: "LeaderBackend"):
        self.backend = backend
        self.runner = RankBackend.runner(backend)

    def execute(self, plan: StepPlan) -> list[list[int]]:
        ranks = self.backend.ranks
        with ranks.round_lock:
            if ranks.failure:
                raise RanksDown(f"tensor-parallel group unavailable: {ranks.failure}")
            try:
                self.backend.group.broadcast(plan)
                return self.runner.run(plan)
            except Exception as e:
                ranks.round_failed(e)
                raise RanksDown(f"tensor-parallel round failed: {ranks.failure}") from e


class LeaderBackend(RankBackend):
    def __init__(self, name: str, ops, device, num_threads, config):
        from tensorfold.parallel.launch import Ranks
        super().__init__(name, ops, device, num_threads, None, config.tp)
        self.ranks = Ranks(config.tp, config.tp_timeout_s, restart=config.restart_ranks, on_restart=self._rejoin)
        self.context_length = None

    @property
    def cache_generation(self) -> int:
        return self.ranks.generation

    def load(self, model_path, config):
        self._start = (model_path, config)
        return super().load(model_path, config)

    def build(self, checkpoint, dtype: torch.dtype, **parts):
        """Check the split against the checkpoint's config, start the other ranks (each reads its
        own shard), then build rank 0's."""
        check_split(ModelArgs.from_hf(checkpoint.config, checkpoint.path), self._start[1])
        self.group = self.ranks.start(*self._start)
        return super().build(checkpoint, dtype, **parts)

    def allocate(self, context_length: int):
        self.context_length = context_length
        self.group.broadcast(context_length)  # the other ranks size their caches as rank 0 does
        return super().allocate(context_length)

    def _rejoin(self) -> None:
        """A restarted group's first steps, in step with the new ranks' loads: the probes'
        collectives (their result is already known) and the cache size."""
        if self.config.probe:
            RankBackend.probes(self)
        self.group.broadcast(self.context_length)

    def runner(self) -> LeaderRunner:
        return LeaderRunner(self)

    def status(self) -> dict:
        return {"ranks": self.ranks.states(), "unavailable": self.ranks.failure}

    def describe(self) -> dict:
        return {**super().describe(), "tp": self.group.size}

    def close(self) -> None:
        self.ranks.stop()


def check_split(args: ModelArgs, config) -> None:
    """--tp must divide the attention and KV heads (each rank keeps whole heads), and on cuda
    each rank needs its own GPU: said before any weight is read."""
    n = config.tp
    for what, count in (("attention heads", args.num_heads), ("KV heads", args.num_kv_heads)):
        if count % n:
            raise CheckpointError(f"--tp {n} does not divide the model's {count} {what} (each rank keeps whole "
                                  f"heads); use a divisor of {math.gcd(args.num_heads, args.num_kv_heads)}")
    if config.backend == "cuda" and torch.cuda.device_count() < n:
        raise CheckpointError(f"--tp {n} on --backend cuda needs {n} GPUs; {torch.cuda.device_count()} visible")


def serve_rank(rank: int, size: int, host: str, port: int, model_path, config) -> None:
    """Ranks 1..N-1: join the group, load this rank's shard, then run rank 0's plans."""
    from tensorfold.backends import backend_ops
    from tensorfold.parallel.launch import Heartbeat, connect

    # A Ctrl-C (or torchrun's SIGINT) reaches every rank: rank 0 drains, then tells the others to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = connect(host, port)
    Heartbeat(host, port, rank).start()
    device = torch.device(config.device or (f"cuda:{rank}" if config.backend == "cuda" else config.backend))
    group = RankGroup(rank, size, config.tp_timeout_s, store, device=device.type)
    backend = RankBackend(config.backend, backend_ops(config.backend), device, config.num_threads, group, size)
    try:
        backend.load(model_path, config)
        backend.allocate(group.broadcast())
        runner = backend.runner()
        log.info("rank %d of %d: serving", rank, size)
        rounds, raise_after = 0, int(os.environ.get(RAISE_AFTER, 0))
        while (plan := group.broadcast()) is not None:
            rounds += 1
            if rounds == raise_after:  # fault injection, for the tests of a failing rank
                raise RuntimeError(f"{RAISE_AFTER}={raise_after}: rank {rank} raises in round {rounds}")
            runner.run(plan)
    except Exception as e:
        log.exception("rank %d failed", rank)
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        raise
    finally:
        group.close()
