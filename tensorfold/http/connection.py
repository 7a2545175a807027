"""One HTTP/1.1 connection: its socket, its h11 state machine, its output buffer and its
current response. The server loop (server.py) owns the selector and the deadlines' clock; a
connection only reacts to events, pumps its reply and reports when it is done.
"""
from __future__ import annotations

import logging
import selectors
import socket
import time
from dataclasses import dataclass
from urllib.parse import parse_qsl

import h11

from tensorfold.http.messages import DeferredResponse, EventStream, HttpRequest, HttpResponse
from tensorfold.http.router import server_error

RETRY_AFTER_S = "5"  # a 503's Retry-After (draining, a failed rank group being restarted)
log = logging.getLogger("tensorfold.http")

READ_SIZE = 64 * 1024
_READING = (h11.IDLE, h11.SEND_BODY)   # their states in which we parse what they send


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = 64 * 1024   # request line + headers; also caps unread pipelined bytes
    header_timeout_s: float = 10.0      # a new connection's, or a request's first byte, to its headers' end
    body_timeout_s: float = 30.0        # headers' end to the body's end
    idle_timeout_s: float = 65.0        # a keep-alive connection between requests
    write_timeout_s: float = 60.0       # output waiting and the client takes none of it
    linger_s: float = 2.0               # after our last byte, drain the client's unread ones this long


# Each connection follows h11's state machine (see h11's docs, "flow control" and "keep-alive"):
# - Parse: next_event() until NEED_DATA. Request/Data/EndOfMessage build one HttpRequest; at
#   EndOfMessage the router answers it. A body over the limit is refused with 413 as soon as its
#   Content-Length or its chunks say so; a RemoteProtocolError gets its 4xx while our state still
#   allows a response. Both then close.
# - PAUSED: the client sent its next (pipelined) request while ours is in progress. We parse none
#   of it until our response is fully written, so answers go out in order and a client that
#   pipelines without reading makes us buffer nothing. We keep reading only to notice EOF or a
#   reset while a reply is pending, and stop once max_header_bytes wait unparsed (TCP back-pressure).
# - Write: responses and stream events go into `out`; we send what the socket takes and wait for
#   EVENT_WRITE for the rest, so a slow reader only grows its own buffer and never blocks the loop.
# - Cycle end: once our response is written, MUST_CLOSE (or a client EOF) closes (after a short
#   linger that drains the client's unread bytes, so our last response is not lost to a reset);
#   otherwise start_next_cycle and parse whatever was pipelined.
# - A pending reply (EventStream, DeferredResponse) is filled by the app between polls; it pokes
#   the server, which pumps its connection. The client going away (EOF or reset on read, an error
#   on write, a write stall) before the reply is delivered calls its on_disconnect once.
class Connection:
    def __init__(self, sock: socket.socket, peer, server):
        self.sock, self.peer = sock, peer
        self.router, self.limits, self.selector = server.router, server.limits, server._selector
        self._mark_dirty = server._dirty.add
        self._draining = lambda: server.draining
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        self.out = bytearray()
        self.closed = False
        self.eof = False            # the client sent EOF (or reset)
        self.lingering = False      # our side is shut; draining until EOF or the linger deadline
        self.refused = False        # we answered before the request ended (413/408/400): parse no more
        self.paused_bytes = 0       # bytes read while our response is in progress
        self.head: h11.Request | None = None
        self.body = bytearray()
        self.started = 0.0
        self.reply: EventStream | DeferredResponse | None = None   # pending, filled by the app
        self.deadline_kind, self.deadline = "idle", time.monotonic() + self.limits.header_timeout_s
        self.write_deadline: float | None = None
        self.events = selectors.EVENT_READ
        self.selector.register(sock, self.events, self)

    # -- driven by the server ------------------------------------------------------------------

    def on_events(self, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            self._read()
        if mask & selectors.EVENT_WRITE and not self.closed:
            self.pump()

    def _read(self) -> None:
        try:
            data = self.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self.close()
        if self.lingering:
            if not data:
                self.close()
            return
        if not data:
            self.eof = True
            if self.reply is not None:       # a client waiting on us never half-closes: it has gone
                return self.close()
        elif self.h11.their_state not in _READING:
            self.paused_bytes += len(data)
        self.h11.receive_data(data)
        self.pump()

    def check_deadlines(self, now: float) -> None:
        if self.write_deadline is not None and now >= self.write_deadline:
            log.info("%s: client took no data for %.1fs, closing", self.peer, self.limits.write_timeout_s)
            return self.close()
        if self.deadline is None or now < self.deadline:
            return
        if self.deadline_kind in ("header", "body"):
            self.refuse(408, f"request {self.deadline_kind} not received in time", code="timeout")
            self.pump()
        else:
            self.close()

    def pump(self) -> None:
        """Move everything that can move without waiting on the network."""
        while not self.closed and not self.lingering:
            self._parse()
            self._feed_reply()
            if not self._write():
                break
            if self.h11.our_state not in (h11.DONE, h11.MUST_CLOSE) or not self._end_cycle():
                break
        self._set_deadline()
        self._sync_interest()

    def close(self) -> None:
        """Drop the connection now. An undelivered reply learns that its client is gone."""
        if self.closed:
            return
        self.closed = True
        if self.reply is not None:
            if not self.reply.finished:
                self._log(499 if isinstance(self.reply, DeferredResponse) else 200, "(client gone)")
            self.reply._client_gone()
            self.reply = None
        if self.events:   # unregister before close(), while the fd is still ours
            try:
                self.selector.unregister(self.sock)
            except (KeyError, ValueError):
                pass
        self.sock.close()

    # -- the request/response cycle ------------------------------------------------------------

    def _parse(self) -> None:
        # Their state past SEND_BODY means our response is in progress: pipelined bytes wait.
        while not self.refused and not self.closed and self.h11.their_state in _READING:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as e:
                return self.refuse(e.error_status_hint, f"malformed HTTP request: {e}")
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._on_head(event)
            elif isinstance(event, h11.Data):
                if len(self.body) + len(event.data) > self.limits.max_body_bytes:
                    return self._refuse_too_large()
                self.body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self._dispatch()
            elif isinstance(event, h11.ConnectionClosed):
                return self.close()

    def _on_head(self, head: h11.Request) -> None:
        self.head, self.body, self.started = head, bytearray(), time.monotonic()
        length = dict(head.headers).get(b"content-length")
        if length is not None and int(length) > self.limits.max_body_bytes:
            return self._refuse_too_large()
        if self.h11.they_are_waiting_for_100_continue:
            self.out += self.h11.send(h11.InformationalResponse(status_code=100, headers=[]))

    def _refuse_too_large(self) -> None:
        self.refuse(413, f"request body exceeds {self.limits.max_body_bytes} bytes",
                    code="request_too_large")

    def refuse(self, status: int, message: str, *, code: str | None = None) -> None:
        """Answer the request in progress with an error, then close."""
        self.refused = True
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self._respond(HttpResponse.error(status, message, code=code), close=True)
        else:
            self.close()

    def _dispatch(self) -> None:
        head = self.head
        target = head.target.decode("latin-1")
        path, _, query = target.partition("?")
        headers: dict[str, str] = {}
        for name, value in head.headers:
            key, value = name.decode("latin-1"), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        request = HttpRequest(head.method.decode("ascii"), path,
                              dict(parse_qsl(query, keep_blank_values=True)), headers, bytes(self.body))
        self.body = bytearray()
        if self._draining():
            return self._respond(HttpResponse.error(503, "the server is shutting down", type="server_error",
                                                    code="shutting_down"), close=True)
        try:
            result = self.router.dispatch(request)
        except Exception:
            log.exception("router failed on %s %s", request.method, path)
            result = server_error()
        if isinstance(result, EventStream) and result.held:
            self.reply = result
            result._wake = lambda: self._mark_dirty(self)
        elif isinstance(result, EventStream):
            self._open_stream(result)
        elif isinstance(result, DeferredResponse):
            self.reply = result
            result._wake = lambda: self._mark_dirty(self)
        else:
            self._respond(result)

    def _respond(self, resp: HttpResponse, close: bool = False) -> None:
        if not isinstance(resp.body, (bytes, bytearray)):
            log.error("handler gave a %s body, not bytes", type(resp.body).__name__)
            resp = server_error()
        headers = [("content-type", resp.content_type), ("content-length", str(len(resp.body))),
                   *resp.headers]
        if resp.status == 503 and not any(name.lower() == "retry-after" for name, _ in resp.headers):
            headers.append(("retry-after", RETRY_AFTER_S))  # every 503 says when to come back
        if close:
            headers.append(("connection", "close"))
        try:
            head = h11.Response(status_code=resp.status, headers=headers, reason=resp.reason)
        except h11.LocalProtocolError:
            log.exception("handler gave an invalid response")
            return self._respond(server_error(), close)
        self.out += self.h11.send(head)
        if resp.body and not (self.head is not None and self.head.method == b"HEAD"):
            self.out += self.h11.send(h11.Data(data=resp.body))
        self.out += self.h11.send(h11.EndOfMessage())
        self._log(resp.status)

    def _open_stream(self, stream: EventStream) -> None:
        headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache"), *stream.headers]
        try:
            head = h11.Response(status_code=200, headers=headers, reason="OK")
        except h11.LocalProtocolError:
            log.exception("handler gave an invalid stream header")
            stream._client_gone()
            return self._respond(server_error())
        self.out += self.h11.send(head)
        if self.head.method == b"HEAD":     # headers only: the app's work is not wanted
            self.out += self.h11.send(h11.EndOfMessage())
            self._log(200)
            return stream._client_gone()
        self.reply = stream
        stream._wake = lambda: self._mark_dirty(self)

    def _feed_reply(self) -> None:
        reply, state = self.reply, self.h11.our_state
        if isinstance(reply, DeferredResponse) and reply.finished and state is h11.SEND_RESPONSE:
            self._respond(reply.response)
        elif isinstance(reply, EventStream) and state is h11.SEND_RESPONSE:
            if reply.refusal is not None:
                self._respond(reply.refusal)
            elif not reply.held:
                self._open_stream(reply)
                self._feed_reply()
        elif isinstance(reply, EventStream) and state is h11.SEND_BODY:
            for chunk in reply._take():
                self.out += self.h11.send(h11.Data(data=chunk))
            if reply.closed:
                self.out += self.h11.send(h11.EndOfMessage())
                self._log(200)

    def _write(self) -> bool:
        """Send what the socket takes; True once `out` is empty."""
        sent = 0
        while self.out:
            try:
                n = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close()
                return False
            del self.out[:n]
            sent += n
        if isinstance(self.reply, EventStream):
            self.reply.buffered_bytes = len(self.out)
        if not self.out:
            self.write_deadline = None
            return True
        if sent or self.write_deadline is None:
            self.write_deadline = time.monotonic() + self.limits.write_timeout_s
        return False

    def _end_cycle(self) -> bool:
        """Our response is written: close, or start the next cycle (True)."""
        if self.reply is not None:
            self.reply._wake = None
            self.reply = None
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            self.head, self.paused_bytes, self.deadline_kind = None, 0, None
            return True
        if self.eof:
            self.close()
        else:
            self._linger()
        return False

    def _linger(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return self.close()
        self.lingering = True
        self.deadline_kind, self.deadline = "linger", time.monotonic() + self.limits.linger_s

    def _set_deadline(self) -> None:
        if self.closed or self.lingering:
            return
        if self.refused:    # our error response is on its way; only the write stall deadline applies
            self.deadline_kind, self.deadline = None, None
            return
        state, now = self.h11.their_state, time.monotonic()
        if state is h11.IDLE:
            if self.h11.trailing_data[0]:
                kind, timeout = "header", self.limits.header_timeout_s
            else:   # keeps a fresh connection's header timeout: kind is already "idle"
                kind, timeout = "idle", self.limits.idle_timeout_s
        elif state is h11.SEND_BODY:
            kind, timeout = "body", self.limits.body_timeout_s
        else:       # our turn: only the write stall deadline applies
            self.deadline_kind, self.deadline = None, None
            return
        if self.deadline_kind != kind:
            self.deadline_kind, self.deadline = kind, now + timeout

    def _sync_interest(self) -> None:
        if self.closed:
            return
        events = selectors.EVENT_WRITE if self.out else 0
        if self.lingering or (not self.eof and not self.refused
                              and self.paused_bytes < self.limits.max_header_bytes):
            events |= selectors.EVENT_READ
        if events != self.events:
            if not self.events:
                self.selector.register(self.sock, events, self)
            elif not events:
                self.selector.unregister(self.sock)
            else:
                self.selector.modify(self.sock, events, self)
            self.events = events

    def _log(self, status: int, note: str = "") -> None:
        """The access log: one line per response (method, target, status, ms, and what the app
        noted: tokens); the fields also ride along as `access` for a JSON formatter."""
        app_note = self.reply.access_note if self.reply is not None else ""
        note = " ".join(n for n in (app_note, note) if n)
        if self.head is None:
            log.info("- - %d%s", status, note and " " + note,
                     extra={"access": {"status": status, "note": note}})
            return
        method, target = self.head.method.decode("ascii", "replace"), self.head.target.decode("latin-1")
        ms = 1000 * (time.monotonic() - self.started)
        log.info("%s %s %d %.1fms%s", method, target, status, ms, note and " " + note,
                 extra={"access": {"method": method, "path": target, "status": status, "ms": round(ms, 1),
                                   "note": note}})
