"""Rank 0's side of the group: start the other ranks on this host, watch them, restart them.

Ranks 1..N-1 are child processes (`python -m tensorfold.parallel.launch`, their settings in the
environment) that meet rank 0 at a TCPStore it hosts. Under torchrun (several hosts, or one:
`torchrun --nproc-per-node 2 -m tensorfold ...`) torchrun starts every rank with the server's
own command line; they meet at its store (MASTER_ADDR, MASTER_PORT), rank 0 serves, the others
run their shards, and a failed group is torchrun's to restart (--max-restarts). Each sends a heartbeat through the store
every HEARTBEAT_S; rank 0's watcher thread checks every rank's process and heartbeat. A rank that
exits, or whose heartbeat stops for the group's timeout (a stopped or hung process), fails the
group: the watcher records why, kills the remaining ranks so that a collective waiting on them
ends at once, and /health names the rank. Then either `restart` (--restart-ranks) starts a new
group at once, or the group stays failed (requests get 503) until the server is restarted.
A rank exits by itself when rank 0 goes away (its heartbeat finds the store closed).
"""
import base64
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from tensorfold.parallel.group import RankGroup

log = logging.getLogger("tensorfold.parallel")

HEARTBEAT_S = 0.5
HOST = "127.0.0.1"
ENV = "TENSORFOLD_RANK"


def connect(host: str, port: int, master: bool = False) -> dist.Store:
    """The group's store (its keys under tensorfold/, apart from a torchrun agent's own)."""
    raw = dist.TCPStore(host, port, is_master=master, wait_for_workers=False, timeout=timedelta(seconds=300))
    return dist.PrefixStore("tensorfold", raw)


def torchrun_rank() -> tuple[int, int, str, int, bool] | None:
    """(rank, world size, store host, store port, whether rank 0 hosts the store) when torchrun
    started this process in a group of more than one, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return (int(os.environ["RANK"]), world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
            not agent_store)


class Heartbeat(threading.Thread):
    """A rank's heartbeat: a counter in the store, bumped every HEARTBEAT_S. When the store is
    gone (rank 0 exited), the rank exits."""

    def __init__(self, host: str, port: int, rank: int):
        super().__init__(daemon=True, name=f"heartbeat-{rank}")
        self.store, self.key = connect(host, port), f"heartbeat/{rank}"

    def run(self) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
            except Exception:
                os._exit(3)
            time.sleep(HEARTBEAT_S)


class Ranks:
    def __init__(self, size: int, timeout_s: float, restart: bool = False, on_restart=None):
        self.size, self.timeout_s, self.restart_on_failure = size, timeout_s, restart
        self.on_restart = on_restart or (lambda: None)
        self.group: RankGroup | None = None
        self.procs: list[subprocess.Popen] = []
        self.failure: str | None = None
        self.failed_rank: int | None = None
        self.generation = 0                    # +1 on every restart: the other ranks' caches are new
        self.restarts = 0
        self.round_lock = threading.Lock()     # held by rank 0's round; a restart waits for it
        self._state_lock = threading.Lock()
        self._stopping = False
        self._args = None

    # -- start, stop -------------------------------------------------------------------------

    def start(self, model_path, config) -> RankGroup:
        """Spawn ranks 1..N-1 (or, under torchrun, meet the ones it started) and join the group
        with them (they load while rank 0 does)."""
        self._args = (model_path, config)
        device = config.device or ("cuda:0" if config.backend == "cuda" else "cpu")
        self.group = RankGroup(0, self.size, self.timeout_s, device=device)
        torchrun = torchrun_rank()
        if torchrun is None:
            self._launch()
        else:  # the ranks are torchrun's: nothing to spawn, kill or restart here
            _, _, host, port, hosted = torchrun
            self.restart_on_failure, self.address = False, (host, port)
            self.store = connect(host, port, master=hosted)
            self._seen = {rank: (0, time.monotonic()) for rank in range(1, self.size)}
            self.group.connect(self.store)
            log.info("tensor parallel: %d ranks under torchrun (store %s:%d)", self.size, host, port)
        threading.Thread(target=self._watch, daemon=True, name="rank-watcher").start()
        return self.group

    def _launch(self) -> None:
        hosted = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
        self.store, self.address = dist.PrefixStore("tensorfold", hosted), (HOST, hosted.port)
        port = hosted.port
        model_path, config = self._args
        env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        payload = base64.b64encode(pickle.dumps((self.size, HOST, port, model_path, config))).decode()
        self.procs = [subprocess.Popen([sys.executable, "-m", "tensorfold.parallel.launch"],
                                       env={**env, ENV: f"{rank}:{payload}"}) for rank in range(1, self.size)]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self._seen = {rank: (0, time.monotonic()) for rank in range(1, self.size)}
        self.group.connect(self.store)
        log.info("tensor parallel: %d ranks on this host (gloo, port %d, timeout %.0fs)", self.size, port,
                 self.timeout_s)

    def stop(self) -> None:
        """Tell the ranks to exit (they finish nothing: the server is going away)."""
        self._stopping = True
        if self.failure is None:
            try:
                with self.round_lock:
                    self.group.broadcast(None)
            except Exception:
                pass
        self._kill()

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()

    # -- health ------------------------------------------------------------------------------

    def fail(self, reason: str, rank: int | None = None) -> None:
        """Record the group's failure (the first reason stays) and end the other ranks, so no
        collective keeps waiting on them."""
        with self._state_lock:
            if self.failure is not None:
                return
            self.failure, self.failed_rank = reason, rank
        log.error("tensor parallel: %s", reason)
        self._kill()
        if self.restart_on_failure and not self._stopping:
            threading.Thread(target=self.restart, daemon=True, name="rank-restart").start()

    def round_failed(self, error: Exception) -> None:
        """Rank 0's round raised (a collective broke, or rank 0 itself failed): name the rank
        behind it where one exited or went silent, else the error."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # a killed rank's exit may lag its socket's reset
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    return self.fail(_exited(rank, proc.returncode, self.store), rank)
            time.sleep(0.05)
        now = time.monotonic()
        silent = [(now - at, rank) for rank, (_, at) in self._seen.items() if now - at > 4 * HEARTBEAT_S]
        if silent:
            age, rank = max(silent)
            return self.fail(f"rank {rank} sent no heartbeat for {age:.1f}s (stopped or hung)", rank)
        first_line = str(error).splitlines()[0] if str(error) else ""
        self.fail(f"a round failed on rank 0: {type(error).__name__}: {first_line[:200]}")

    def restart(self) -> None:
        """A new group: the ranks spawned again, rank 0 rejoining with its model as it is."""
        with self.round_lock:
            self._kill()
            log.info("tensor parallel: restarting the group")
            self._launch()
            self.on_restart()
            with self._state_lock:
                self.generation += 1
                self.restarts += 1
                self.failure = self.failed_rank = None
        log.info("tensor parallel: group restarted (%d restart(s))", self.restarts)

    def states(self) -> list[dict]:
        """Each rank's state for /health."""
        out = [{"rank": 0, "state": "serving", "pid": os.getpid()}]
        for rank in range(1, self.size):
            proc = self.procs[rank - 1] if self.procs else None  # None: torchrun's
            if self.failure is None:
                state = "serving"
            elif rank == self.failed_rank:
                state = f"failed: {self.failure}"
            elif proc is None:
                state = "unknown (group failed)"
            else:
                state = "stopped (group failed)" if proc.poll() is not None else "stopping"
            out.append({"rank": rank, "state": state, **({"pid": proc.pid} if proc else {})})
        return out

    def _watch(self) -> None:
        watcher = None
        while not self._stopping:
            time.sleep(HEARTBEAT_S / 2)
            if self.failure is not None:
                watcher = None
                continue
            try:
                if watcher is None:
                    watcher = connect(*self.address)
                self._check(watcher)
            except Exception as e:  # the store itself is being replaced by a restart
                log.debug("rank watcher: %s", e)
                watcher = None

    def _check(self, store) -> None:
        now = time.monotonic()
        for rank in range(1, self.size):
            proc = self.procs[rank - 1] if self.procs else None  # torchrun's ranks are not ours
            code = proc.poll() if proc is not None else None
            if code is not None:
                self.fail(_exited(rank, code, store), rank)
                return
            if proc is None and store.check([f"error/{rank}"]):
                self.fail(f"rank {rank} failed: {store.get(f'error/{rank}').decode()}", rank)
                return
            beats = store.add(f"heartbeat/{rank}", 0)
            last, at = self._seen[rank]
            if beats != last:
                self._seen[rank] = (beats, now)
            elif beats and now - at > self.timeout_s:
                self.fail(f"rank {rank} sent no heartbeat for {now - at:.1f}s (stopped or hung)", rank)
                return
            elif not beats and now - at > max(self.timeout_s, 120):
                self.fail(f"rank {rank} did not start within {now - at:.0f}s", rank)
                return


def _exited(rank: int, code: int, store) -> str:
    """Why rank `rank` exited: its code, and the error it left in the store where it raised."""
    key = f"error/{rank}"
    why = store.get(key).decode() if store.check([key]) else None
    return f"rank {rank} exited (code {code})" + (f": {why}" if why else "")


def _rank_main() -> None:
    from tensorfold.__main__ import setup_logging
    from tensorfold.parallel.backend import serve_rank

    rank, payload = os.environ.pop(ENV).split(":", 1)
    size, host, port, model_path, config = pickle.loads(base64.b64decode(payload))
    setup_logging("info", "text")
    serve_rank(int(rank), size, host, port, model_path, config)


if __name__ == "__main__":
    _rank_main()
