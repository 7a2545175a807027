"""The HTTP/1.1 server: one thread, one selector, h11 on every connection, engine rounds between polls.

HttpServer owns the listening socket, the selector, the engine's tick() and the deadlines;
Connection (connection.py) owns one socket, its h11 state machine, its output buffer and its
current response.
Nothing blocks: sockets are non-blocking, bytes that do not fit in a socket wait in the
connection's buffer, and a handler or a tick() is the only code that may take time.
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Callable

from tensorfold.http.connection import Connection, Limits  # noqa: F401 (Limits: part of this API)
from tensorfold.http.router import Router

log = logging.getLogger("tensorfold.http")

IDLE_POLL_S = 0.05      # how long a poll waits when the engine has no work
_LISTENER, _WAKER = "listener", "waker"


class HttpServer:
    """Serves a Router on one thread and runs the engine's tick() between polls.

    serve_forever() is the whole loop: one tick() (one engine round, which may write into
    streams), then one poll of the sockets (timeout 0 while tick() says work remains, else up
    to IDLE_POLL_S), then the deadlines. A slow handler or round delays everyone; a slow
    client delays no one. shutdown() and wake() may be called from any thread; everything
    else, EventStream included, belongs to the loop's thread.
    """

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 8080, *,
                 tick: Callable[[], bool] | None = None, limits: Limits = Limits()):
        self.router, self.limits, self._tick = router, limits, tick
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=1024)
        self._listener.setblocking(False)
        self._waker, self._wakee = socket.socketpair()
        self._wakee.setblocking(False)
        self._waker.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._selector.register(self._wakee, selectors.EVENT_READ, _WAKER)
        self._conns: set[Connection] = set()
        self._dirty: set[Connection] = set()   # connections whose pending reply has news
        self._stopping = False
        self._closed = False
        self.draining = False                  # no new connections or requests; in-flight ones finish
        self._drain_deadline: float | None = None
        self._state_lock = threading.Lock()   # serve_forever starting vs shutdown from another thread
        self._loop_thread: int | None = None
        self._loop_done = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def serve_forever(self) -> None:
        with self._state_lock:
            if self._stopping:
                return
            self._loop_thread = threading.get_ident()
            self._loop_done.clear()
        log.info("serving on http://%s:%d", *self.address)
        try:
            while not self._stopping:
                busy = self._run_tick()
                if self._drain_deadline is not None and self._drained(busy):
                    break
                self.poll_once(0.0 if busy else IDLE_POLL_S)
        finally:
            self._close_all()
            self._loop_thread = None
            self._loop_done.set()

    def poll_once(self, timeout: float) -> None:
        """Wait up to `timeout` for socket events (less if a deadline comes first) and serve them."""
        if self._closed:
            return
        self._flush_replies()
        now = time.monotonic()
        deadlines = [d for c in self._conns for d in (c.deadline, c.write_deadline) if d is not None]
        if deadlines:
            timeout = max(0.0, min(timeout, min(deadlines) - now))
        # A connection accepted now usually has its request already waiting: read it in this
        # poll (a second, non-blocking pass) rather than after the next engine round.
        for pass_timeout in (timeout, 0.0):
            accepted = False
            for key, mask in self._selector.select(pass_timeout):
                if key.data is _LISTENER:
                    self._accept()
                    accepted = True
                elif key.data is _WAKER:
                    self._drain_waker()
                elif not key.data.closed:
                    self._guarded(key.data, key.data.on_events, mask)
            if not accepted:
                break
        self._flush_replies()
        now = time.monotonic()
        for conn in list(self._conns):
            if not conn.closed:
                self._guarded(conn, conn.check_deadlines, now)
            if conn.closed:
                self._conns.discard(conn)

    def drain(self, seconds: float) -> None:
        """Stop taking connections and requests (any thread): what is in flight may finish for up
        to `seconds`, then serve_forever() returns. New requests on open connections get 503."""
        with self._state_lock:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + seconds
        self.wake()

    def _drained(self, busy: bool) -> bool:
        """Called by the loop while draining: close the listener once, then say when to stop."""
        if not self.draining:
            self.draining = True
            self._selector.unregister(self._listener)
            self._listener.close()
            log.info("draining: no new connections; waiting up to %.0fs for %d running request(s)",
                     max(0.0, self._drain_deadline - time.monotonic()),
                     sum(1 for c in self._conns if c.reply is not None and not c.reply.finished))
        in_flight = busy or bool(self._dirty) or any(
            not c.closed and ((c.reply is not None and not c.reply.finished) or c.out) for c in self._conns)
        if in_flight and time.monotonic() < self._drain_deadline:
            return False
        if in_flight:
            log.warning("drain time is up; closing the requests still running")
        for conn in list(self._conns):  # let the last bytes of finished replies go out
            if not conn.closed:
                conn._write()
        return True

    def wake(self) -> None:
        """Make a waiting poll return now (any thread)."""
        try:
            self._waker.send(b"\0")
        except OSError:   # full (a wake is already pending) or closed
            pass

    def shutdown(self) -> None:
        """Stop serving: close the listening socket and every connection. Pending replies see a
        disconnect. Waits for serve_forever() to return when called from another thread."""
        with self._state_lock:
            self._stopping = True
            loop_thread = self._loop_thread
        if loop_thread is None:
            self._close_all()
        elif loop_thread != threading.get_ident():
            self.wake()
            self._loop_done.wait(timeout=10)

    def _run_tick(self) -> bool:
        if self._tick is None:
            return False
        try:
            return bool(self._tick())
        except Exception:
            log.exception("engine tick failed")
            return False

    def _flush_replies(self) -> None:
        dirty = list(self._dirty)    # the set itself stays: connections hold its add()
        self._dirty.clear()
        for conn in dirty:
            if not conn.closed:
                self._guarded(conn, conn.pump)

    @staticmethod
    def _guarded(conn: Connection, action: Callable, *args) -> None:
        """A bug met while serving one connection drops that connection, not the server."""
        try:
            action(*args)
        except Exception:
            log.exception("serving %s failed; dropping the connection", conn.peer)
            conn.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:   # e.g. out of file descriptors: try again on the next poll
                log.warning("accept failed: %s", e)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # events go out at once
            self._conns.add(Connection(sock, peer, self))

    def _drain_waker(self) -> None:
        try:
            while self._wakee.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _close_all(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.draining:
            self._selector.unregister(self._listener)
            self._listener.close()
        for conn in list(self._conns):
            if not conn.closed:
                conn._write()        # last chance for what is already buffered
                conn.close()
        self._conns.clear()
        self._selector.close()
        self._waker.close()
        self._wakee.close()
        log.info("server stopped")
