"""What handlers take and give back: HttpRequest, HttpResponse, EventStream, DeferredResponse.

A handler gets an HttpRequest whose body is already read whole, and returns an HttpResponse
(sent at once), an EventStream (server-sent events written over time, from engine rounds) or a
DeferredResponse (one whole response the app resolves in a later engine round). These types
know nothing of sockets: the last two only hold what the app gave them and poke whoever
serves them; the server moves it to the socket when it can.

Invariants of the two pending replies:
- a stream's events reach the client in the order send() was called; close() ends the body;
- on_disconnect is called at most once, and only if the client goes away before the app
  finished (close() or resolve()); the app cancels its request there;
- once the client is gone, send() and resolve() are dropped (the app may learn a round late).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Callable, Sequence

from tensorfold.http.errors import HttpError, error_body

log = logging.getLogger("tensorfold.http")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


@dataclass
class HttpRequest:
    method: str
    path: str                                       # without the query, as sent (percent-encoded)
    query: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)   # lower-case names; repeats joined by ", "
    body: bytes = b""
    path_params: dict[str, str] = field(default_factory=dict)  # decoded, filled in by the Router

    def json(self) -> Any:
        """The body parsed as JSON (NaN and Infinity refused); shape checks are the caller's."""
        try:
            return json.loads(self.body, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            raise HttpError(f"request body is not valid JSON: {e}", status=400) from None


@dataclass
class HttpResponse:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: Sequence[tuple[str, str]] = ()

    @classmethod
    def json_response(cls, obj: Any, status: int = 200) -> HttpResponse:
        return cls(status, json.dumps(obj, ensure_ascii=False).encode())

    @classmethod
    def error(cls, status: int, message: str, *, type: str = "invalid_request_error",
              param: str | None = None, code: str | None = None,
              headers: Sequence[tuple[str, str]] = ()) -> HttpResponse:
        body = error_body(message, type=type, param=param, code=code)
        return cls(status, json.dumps(body).encode(), headers=headers)

    @classmethod
    def from_error(cls, err: HttpError) -> HttpResponse:
        return cls.json_response(err.body(), err.status)

    @property
    def reason(self) -> str:
        try:
            return HTTPStatus(self.status).phrase
        except ValueError:
            return ""


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def encode_event(data: dict | list | str, event: str | None = None) -> bytes:
    """One SSE event. JSON stays ASCII so no client's line splitter can break it apart."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    lines = [f"event: {event}"] if event else []
    lines += [f"data: {line}" for line in _LINE_BREAK.split(text)]
    return ("\n".join(lines) + "\n\n").encode()


class _PendingReply:
    """What EventStream and DeferredResponse share: the disconnect callback and the server's poke."""

    def __init__(self):
        self.on_disconnect: Callable[[], None] | None = None
        self.access_note = ""               # what the access log line adds (the app's: tokens)
        self.disconnected = False           # the client went away before the last byte went out
        self._wake: Callable[[], None] | None = None  # set by the server while it serves us

    @property
    def finished(self) -> bool:
        raise NotImplementedError

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake()

    def _client_gone(self) -> None:
        """Called by the server when the connection is lost before the reply was delivered."""
        if self.disconnected:
            return
        self.disconnected = True
        self._wake = None
        if not self.finished and self.on_disconnect is not None:
            try:
                self.on_disconnect()
            except Exception:
                log.exception("on_disconnect callback failed")


class DeferredResponse(_PendingReply):
    """A whole response that takes engine rounds (a non-streamed reply). The handler returns it;
    the app calls resolve() once, from a later round, on the server's thread."""

    def __init__(self):
        super().__init__()
        self.response: HttpResponse | None = None

    @property
    def finished(self) -> bool:
        return self.response is not None

    def resolve(self, response: HttpResponse) -> None:
        if self.response is not None:
            raise RuntimeError("DeferredResponse.resolve() called twice")
        if self.disconnected:
            return
        self.response = response
        self._poke()


class EventStream(_PendingReply):
    """A server-sent-events response. The handler returns it; the app writes events into it
    from engine rounds (on the server's thread) and calls close() after the last one.

    A stream made with held=True is not opened yet: the server sends nothing until the app calls
    open() (then the 200 and the events) or refuse() (a plain error response instead, e.g. a 400
    for a grammar that failed to compile while the stream waited)."""

    def __init__(self, headers: Sequence[tuple[str, str]] = (), *, held: bool = False):
        super().__init__()
        self.headers = list(headers)        # extra response headers
        self.closed = False                 # close() was called
        self.held = held                    # not to be opened until open() or refuse()
        self.refusal: HttpResponse | None = None
        self.buffered_bytes = 0             # written by the server: bytes not yet taken by the socket
        self._queue: list[bytes] = []       # encoded events the server has not picked up yet

    def open(self) -> None:
        self.held = False
        self._poke()

    def refuse(self, response: HttpResponse) -> None:
        """Answer with `response` instead of the stream (only while held)."""
        if not self.held:
            raise RuntimeError("EventStream.refuse() after the stream opened")
        self.refusal = response
        self.closed = True
        self._poke()

    @property
    def finished(self) -> bool:
        return self.closed

    def send(self, data: dict | list | str, *, event: str | None = None) -> None:
        if self.closed:
            raise RuntimeError("EventStream.send() after close()")
        if self.disconnected:
            return
        chunk = encode_event(data, event)
        self._queue.append(chunk)
        self.buffered_bytes += len(chunk)
        self._poke()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._poke()

    def _take(self) -> list[bytes]:
        queue, self._queue = self._queue, []
        return queue

    def _client_gone(self) -> None:
        self._queue.clear()
        super()._client_gone()
