"""tensorfold.http over real loopback sockets: the server runs serve_forever() in a background
thread (in the test only); clients are raw sockets, so framing, pipelining and disconnects are
exactly what the test writes. A fake app drives streams from tick(), as the engine will."""
import contextlib
import hashlib
import json
import logging
import socket
import struct
import threading
import time

import pytest

from serving import running

from tensorfold.api.errors import ApiError
from tensorfold.http.messages import (DeferredResponse, EventStream, HttpRequest, HttpResponse,
                                      encode_event)
from tensorfold.http.router import Router
from tensorfold.http.server import HttpServer, Limits


class FakeApp:
    """An engine stand-in: each tick() writes one event into every running stream and ends a
    stream after `num_events` (a deferred reply is resolved then); a disconnect cancels the
    job, as the real app will."""

    def __init__(self, num_events=3, event_bytes=0, tick_s=0.0):
        self.num_events, self.event_bytes, self.tick_s = num_events, event_bytes, tick_s
        self.jobs: dict[int, list] = {}   # job id -> [stream, events sent]
        self.num_ticks = 0
        self.sent_after_cancel = 0
        self.cancelled: list[int] = []
        self.streams: list[EventStream] = []
        self._next_id = 0

    def start_stream(self, request: HttpRequest) -> EventStream:
        return self._start(EventStream())

    def start_deferred(self, request: HttpRequest) -> DeferredResponse:
        return self._start(DeferredResponse())

    def _start(self, sink):
        job_id, self._next_id = self._next_id, self._next_id + 1
        sink.on_disconnect = lambda: self.cancel(job_id)
        self.jobs[job_id] = [sink, 0]
        self.streams.append(sink)
        return sink

    def cancel(self, job_id):
        self.cancelled.append(job_id)
        del self.jobs[job_id]

    def tick(self) -> bool:
        if self.tick_s:
            time.sleep(self.tick_s)
        for job_id, job in list(self.jobs.items()):
            sink, n = job
            job[1] = n + 1
            done = self.num_events is not None and job[1] == self.num_events
            if isinstance(sink, DeferredResponse):
                if done:
                    sink.resolve(HttpResponse.json_response({"job": job_id, "rounds": job[1]}))
            else:
                sink.send({"job": job_id, "n": n, "pad": "x" * self.event_bytes})
                if done:
                    sink.send("[DONE]")
                    sink.close()
            if done:
                del self.jobs[job_id]
        self.num_ticks += 1
        return bool(self.jobs) or bool(self.tick_s)


def make_router(app: FakeApp | None = None) -> Router:
    router = Router()
    router.add("GET", "/health", lambda req: HttpResponse.json_response({"status": "ok"}))
    router.add("GET", "/echo/{word}", lambda req: HttpResponse.json_response(
        {"word": req.path_params["word"], "query": req.query}))

    def body_digest(req):
        return HttpResponse.json_response({"num_bytes": len(req.body),
                                           "sha": hashlib.sha256(req.body).hexdigest()})

    router.add("POST", "/body", body_digest)
    router.add("POST", "/json", lambda req: HttpResponse.json_response({"got": req.json()}))
    router.add("DELETE", "/echo/{word}", lambda req: HttpResponse.json_response({"deleted": True}))
    router.add("POST", "/echo/{word}", lambda req: HttpResponse.json_response(
        {"word": req.path_params["word"], "num_bytes": len(req.body)}))

    def boom(req):
        raise RuntimeError("handler bug")

    def refuse(req):
        raise ApiError("temperature must be a number", status=400, param="temperature")

    router.add("GET", "/boom", boom)
    router.add("GET", "/str-body", lambda req: HttpResponse(200, "not bytes"))
    router.add("GET", "/bad-header", lambda req: HttpResponse(200, b"{}", headers=[("x-a", "1\r\nx-b: 2")]))
    router.add("GET", "/refuse", refuse)
    if app is not None:
        router.add("GET", "/stream", app.start_stream)
        router.add("GET", "/deferred", app.start_deferred)
    return router


@contextlib.contextmanager
def serving(router, tick=None, **limits):
    with running(HttpServer(router, port=0, tick=tick, limits=Limits(**limits)), max_shutdown_s=1) as server:
        yield server


def connect(server, rcvbuf=None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(5)
    sock.connect(server.address)
    return sock


class Reader:
    """Just enough of an HTTP/1.1 response parser to check what went over the wire."""

    def __init__(self, sock):
        self.file = sock.makefile("rb")

    def head(self):
        status_line = self.file.readline()
        if not status_line:
            return None
        status = int(status_line.split()[1])
        headers = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    def chunk(self) -> bytes:
        size = int(self.file.readline(), 16)
        data = self.file.read(size)
        assert self.file.read(2) == b"\r\n"
        return data

    def response(self):
        status, headers = self.head()
        if headers.get("transfer-encoding") == "chunked":
            body = b"".join(iter(self.chunk, b""))   # the last chunk's read takes the final CRLF
        else:
            body = self.file.read(int(headers["content-length"]))
        return status, headers, body

    def events(self):
        """SSE `data:` payloads from a chunked stream, until its last chunk."""
        buf = b""
        while chunk := self.chunk():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                yield event.decode().removeprefix("data: ")

    def at_eof(self) -> bool:
        return self.file.read(1) == b""


def get(path, extra=""):
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


def post(path, body: bytes, extra=""):
    return f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def assert_error_shape(body, status_type="invalid_request_error"):
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == status_type and err["message"]
    return err


# -- request/response cycles ---------------------------------------------------------------------

def test_keep_alive_pipelining_in_order():
    with serving(make_router()) as server:
        sock = connect(server)
        sock.sendall(get("/echo/a?x=1") + post("/body", b"hello") + get("/echo/b%20c") + get("/health"))
        reader = Reader(sock)
        got = [reader.response() for _ in range(4)]
        assert [s for s, _, _ in got] == [200] * 4
        assert json.loads(got[0][2]) == {"word": "a", "query": {"x": "1"}}
        assert json.loads(got[1][2])["num_bytes"] == 5
        assert json.loads(got[2][2])["word"] == "b c"
        assert json.loads(got[3][2]) == {"status": "ok"}
        # still open: a later request on the same connection, then Connection: close ends it
        sock.sendall(get("/health", "Connection: close\r\n"))
        status, headers, _ = reader.response()
        assert status == 200 and headers["connection"] == "close"
        assert reader.at_eof()


def test_pipelined_requests_wait_for_stream_to_finish():
    app = FakeApp(num_events=10, tick_s=0.01)
    with serving(make_router(app), tick=app.tick, max_header_bytes=1024) as server:
        sock = connect(server)
        sock.sendall(get("/stream") + get("/echo/after0"))
        reader = Reader(sock)
        status, headers = reader.head()
        assert status == 200
        # while the stream runs, far more pipelined bytes than the server reads ahead
        sock.sendall(b"".join(post(f"/echo/after{i}", b"x" * 2048) for i in range(1, 200)))
        events = list(reader.events())
        assert events[-1] == "[DONE]" and [json.loads(e)["n"] for e in events[:-1]] == list(range(10))
        for i in range(200):
            status, _, body = reader.response()
            assert status == 200 and json.loads(body)["word"] == f"after{i}"


def test_expect_100_continue():
    with serving(make_router(), max_body_bytes=1000) as server:
        sock = connect(server)
        reader = Reader(sock)
        sock.sendall(b"POST /body HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert reader.head()[0] == 100
        sock.sendall(b"hello")
        status, _, body = reader.response()
        assert status == 200 and json.loads(body)["num_bytes"] == 5
        # too large: refused instead of invited
        sock.sendall(b"POST /body HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
        assert reader.response()[0] == 413 and reader.at_eof()


def test_request_bodies_content_length_and_chunked():
    payload = bytes(range(256)) * 1000
    with serving(make_router()) as server:
        sock = connect(server)
        reader = Reader(sock)
        sock.sendall(post("/body", payload))
        status, _, body = reader.response()
        assert status == 200 and json.loads(body) == {
            "num_bytes": len(payload), "sha": hashlib.sha256(payload).hexdigest()}
        pieces = [payload[:1000], payload[1000:70000], payload[70000:]]
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        sock.sendall(b"POST /body HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(chunked), 7000):   # arrives over several reads
            sock.sendall(chunked[i:i + 7000])
        status, _, body = reader.response()
        assert status == 200 and json.loads(body)["sha"] == hashlib.sha256(payload).hexdigest()
        # request.json(): a body that is not JSON is a 400 in the OpenAI error shape
        sock.sendall(post("/json", b"{nope") + post("/json", b'{"a": NaN}') + post("/json", b'[1, "x"]'))
        for _ in range(2):
            status, _, body = reader.response()
            assert status == 400
            assert "not valid JSON" in assert_error_shape(body)["message"]
        status, _, body = reader.response()
        assert status == 200 and json.loads(body) == {"got": [1, "x"]}


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_limit_is_413_then_close(chunked):
    with serving(make_router(), max_body_bytes=1000) as server:
        sock = connect(server)
        reader = Reader(sock)
        sock.sendall(post("/body", b"x" * 1000))   # exactly the limit is fine
        assert reader.response()[0] == 200
        if chunked:
            sock.sendall(b"POST /body HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
            sock.sendall(b"258\r\n" + b"y" * 600 + b"\r\n" + b"258\r\n" + b"y" * 600 + b"\r\n")
        else:   # refused from the header alone: the body is never sent
            sock.sendall(b"POST /body HTTP/1.1\r\nHost: t\r\nContent-Length: 5000000\r\n\r\n")
        status, headers, body = reader.response()
        assert status == 413 and headers["connection"] == "close"
        assert assert_error_shape(body)["code"] == "request_too_large"
        assert reader.at_eof()


def test_404_405_and_malformed_requests():
    with serving(make_router()) as server:
        sock = connect(server)
        reader = Reader(sock)
        sock.sendall(get("/v1/nothing") + post("/health", b"{}") + f"PUT /echo/a HTTP/1.1\r\nHost: t\r\n"
                     "Content-Length: 0\r\n\r\n".encode())
        status, _, body = reader.response()
        assert status == 404 and "/v1/nothing" in assert_error_shape(body)["message"]
        status, headers, body = reader.response()
        assert status == 405 and headers["allow"] == "GET, HEAD"
        assert_error_shape(body)
        status, headers, body = reader.response()
        assert status == 405 and headers["allow"] == "DELETE, GET, HEAD, POST"
        # HEAD runs the GET handler and sends no body
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: t\r\n\r\n" + get("/health"))
        status, headers = reader.head()
        assert status == 200 and int(headers["content-length"]) > 0
        assert reader.response()[0] == 200
        sock.sendall(b"GARBAGE\r\n\r\n")
        status, headers, body = reader.response()
        assert status == 400 and headers["connection"] == "close"
        assert "malformed" in assert_error_shape(body)["message"]
        assert reader.at_eof()
    # a bad header line after a good request line is malformed too
    with serving(make_router()) as server:
        sock = connect(server)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nno colon here\r\n\r\n")
        reader = Reader(sock)
        assert reader.response()[0] == 400 and reader.at_eof()


def test_handler_errors_then_server_keeps_serving(caplog):
    with serving(make_router()) as server:
        sock = connect(server)
        reader = Reader(sock)
        with caplog.at_level(logging.ERROR, logger="tensorfold.http"):
            sock.sendall(get("/boom") + get("/str-body") + get("/bad-header") + get("/refuse") + get("/health"))
            got = [reader.response() for _ in range(3)]
        assert [status for status, _, _ in got] == [500] * 3
        assert all(assert_error_shape(body, "server_error") for _, _, body in got)
        assert "x-b" not in got[2][1]
        assert any(r.exc_info and "handler bug" in str(r.exc_info[1]) for r in caplog.records)
        status, _, body = reader.response()
        assert status == 400 and assert_error_shape(body)["param"] == "temperature"
        assert reader.response()[0] == 200
        other = connect(server)   # and on a new connection too
        other.sendall(get("/health"))
        assert Reader(other).response()[0] == 200


# -- timeouts: a slow client holds only its own connection ---------------------------------------

def test_half_sent_headers_time_out_while_others_are_served():
    with serving(make_router(), header_timeout_s=0.4) as server:
        slow = connect(server)
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")   # headers never finish
        t0 = time.monotonic()
        for _ in range(3):
            fast = connect(server)
            fast.sendall(get("/health"))
            assert Reader(fast).response()[0] == 200
        assert time.monotonic() - t0 < 0.3
        reader = Reader(slow)
        status, _, body = reader.response()
        assert status == 408 and reader.at_eof()
        assert 0.3 < time.monotonic() - t0 < 3


def test_slow_body_times_out():
    with serving(make_router(), body_timeout_s=0.3) as server:
        sock = connect(server)
        sock.sendall(b"POST /body HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n0123456789")
        t0 = time.monotonic()
        reader = Reader(sock)
        assert reader.response()[0] == 408 and reader.at_eof()
        assert 0.2 < time.monotonic() - t0 < 3


def test_idle_keep_alive_connection_closes():
    with serving(make_router(), idle_timeout_s=0.2, header_timeout_s=0.8) as server:
        sock = connect(server)
        reader = Reader(sock)
        sock.sendall(get("/health"))
        assert reader.response()[0] == 200
        t0 = time.monotonic()
        assert reader.at_eof()      # closed without another byte
        assert 0.1 < time.monotonic() - t0 < 0.6
        # a connection that never sends a byte gets the header timeout, not the idle one
        silent = connect(server)
        t0 = time.monotonic()
        assert silent.recv(1) == b""
        assert 0.6 < time.monotonic() - t0 < 3


# -- streaming: SSE from engine rounds ----------------------------------------------------------

def test_sse_stream_headers_events_then_keep_alive():
    app = FakeApp(num_events=5)
    with serving(make_router(app), tick=app.tick) as server:
        sock = connect(server)
        reader = Reader(sock)
        for _ in range(2):    # two streams, one after the other, on one connection
            sock.sendall(get("/stream"))
            status, headers = reader.head()
            assert status == 200
            assert headers["content-type"] == "text/event-stream"
            assert headers["cache-control"] == "no-cache"
            assert headers["transfer-encoding"] == "chunked"
            events = list(reader.events())
            assert events[-1] == "[DONE]"
            assert [json.loads(e)["n"] for e in events[:-1]] == [0, 1, 2, 3, 4]
        # HEAD: the stream's headers and no body; the app is told to drop the work
        sock.sendall(b"HEAD /stream HTTP/1.1\r\nHost: t\r\n\r\n" + get("/health"))
        status, headers = reader.head()
        assert status == 200 and headers["content-type"] == "text/event-stream"
        assert reader.response()[0] == 200
        assert app.cancelled == [2] and app.streams[2].disconnected


def test_deferred_response_resolved_in_a_later_round():
    app = FakeApp(num_events=10, tick_s=0.02)
    with serving(make_router(app), tick=app.tick) as server:
        sock = connect(server)
        reader = Reader(sock)
        sock.sendall(get("/deferred") + get("/echo/after"))
        time.sleep(0.05)
        other = connect(server)              # served while the deferred reply waits
        other.sendall(get("/health"))
        assert Reader(other).response()[0] == 200
        assert app.jobs
        status, _, body = reader.response()
        assert status == 200 and json.loads(body) == {"job": 0, "rounds": 10}
        status, _, body = reader.response()
        assert status == 200 and json.loads(body)["word"] == "after"
        # the client leaves before its reply: the job is cancelled, nothing breaks
        app.num_events = None
        sock.sendall(get("/deferred"))
        time.sleep(0.05)
        reader.file.close()
        sock.close()
        deadline = time.monotonic() + 3
        while not app.cancelled and time.monotonic() < deadline:
            time.sleep(0.005)
        assert app.cancelled == [1] and app.streams[1].disconnected and not app.jobs
        app.streams[1].resolve(HttpResponse.json_response({}))    # late: dropped


@pytest.mark.parametrize("how", ["close", "reset"])
def test_client_disconnect_mid_stream_cancels_within_a_tick(how):
    app = FakeApp(num_events=None, tick_s=0.02)   # a stream that never ends by itself
    with serving(make_router(app), tick=app.tick) as server:
        sock = connect(server)
        sock.sendall(get("/stream"))
        reader = Reader(sock)
        assert reader.head()[0] == 200
        events = reader.events()
        assert [json.loads(next(events))["n"] for _ in range(3)] == [0, 1, 2]
        if how == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reader.file.close()
        sock.close()
        ticks_at_close = app.num_ticks
        deadline = time.monotonic() + 3
        while not app.cancelled and time.monotonic() < deadline:
            time.sleep(0.005)
        assert app.cancelled == [0] and not app.jobs
        assert app.num_ticks - ticks_at_close <= 2      # noticed on the poll after the next round
        stream = app.streams[0]
        assert stream.disconnected and not stream.closed
        time.sleep(0.1)                                 # later rounds: no more work, no second call
        assert app.cancelled == [0]
        stream.send({"late": True})                     # an app a round late is ignored, not an error
        # the server goes on serving
        fresh = connect(server)
        fresh.sendall(get("/health"))
        assert Reader(fresh).response()[0] == 200


def test_health_answered_while_engine_rounds_run():
    app = FakeApp(tick_s=0.05)     # every round takes 50 ms and there is always more work
    with serving(make_router(app), tick=app.tick) as server:
        sock = connect(server)
        reader = Reader(sock)
        ticks0 = app.num_ticks
        worst = 0.0
        for _ in range(10):
            t0 = time.monotonic()
            sock.sendall(get("/health"))
            assert reader.response()[0] == 200
            worst = max(worst, time.monotonic() - t0)
        assert worst < 0.5          # about one round, never the whole run of rounds
        assert app.num_ticks - ticks0 >= 5


def test_slow_reader_is_buffered_not_blocking():
    app = FakeApp(num_events=100, event_bytes=64 * 1024)   # 6.5 MB: beyond what the kernel buffers
    with serving(make_router(app), tick=app.tick) as server:
        slow = connect(server, rcvbuf=4096)
        slow.sendall(get("/stream"))
        deadline = time.monotonic() + 5
        while not (app.streams and app.streams[0].closed) and time.monotonic() < deadline:
            time.sleep(0.01)
        stream = app.streams[0]
        assert stream.closed                    # every round ran although nobody read
        assert stream.buffered_bytes > 1_000_000  # the rest waits in the server, per connection
        fast = connect(server)
        t0 = time.monotonic()
        fast.sendall(get("/health"))
        assert Reader(fast).response()[0] == 200 and time.monotonic() - t0 < 0.5
        reader = Reader(slow)
        assert reader.head()[0] == 200
        events = list(reader.events())
        assert len(events) == 101 and events[-1] == "[DONE]"
        payloads = [json.loads(e) for e in events[:-1]]
        assert [p["n"] for p in payloads] == list(range(100))
        assert all(len(p["pad"]) == 64 * 1024 for p in payloads)
        assert stream.buffered_bytes == 0 and not stream.disconnected


def test_reader_that_stops_reading_is_dropped():
    app = FakeApp(num_events=None, event_bytes=64 * 1024, tick_s=0.01)
    with serving(make_router(app), tick=app.tick, write_timeout_s=0.3) as server:
        stalled = connect(server, rcvbuf=4096)
        stalled.sendall(get("/stream"))
        deadline = time.monotonic() + 5
        while not app.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.cancelled == [0] and app.streams[0].disconnected


def test_openai_client_reads_our_stream_and_errors():
    openai = pytest.importorskip("openai")

    chunks = ["Hel", "lo", " world"]

    class ChatApp(FakeApp):
        def tick(self):
            for job_id, job in list(self.jobs.items()):
                stream, n = job
                delta = {"content": chunks[n]} if n < len(chunks) else {}
                stream.send({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                             "model": "m", "choices": [{"index": 0, "delta": delta,
                                                        "finish_reason": None if delta else "stop"}]})
                job[1] = n + 1
                if not delta:
                    stream.send("[DONE]")
                    stream.close()
                    del self.jobs[job_id]
            return bool(self.jobs)

    app = ChatApp()
    router = make_router()
    router.add("POST", "/v1/chat/completions", app.start_stream)
    with serving(router, tick=app.tick) as server:
        host, port = server.address
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(model="m", stream=True,
                                                messages=[{"role": "user", "content": "hi"}])
        text = "".join(c.choices[0].delta.content or "" for c in stream)
        assert text == "Hello world"
        with pytest.raises(openai.NotFoundError) as err:
            client.models.list()
        assert "Invalid URL" in str(err.value)


def test_shutdown_closes_listener_connections_and_streams():
    app = FakeApp(num_events=None, tick_s=0.01)
    server = HttpServer(make_router(app), port=0, tick=app.tick, limits=Limits())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    idle = connect(server)
    streaming = connect(server)
    streaming.sendall(get("/stream"))
    reader = Reader(streaming)
    assert reader.head()[0] == 200
    server.shutdown()
    thread.join(5)
    assert not thread.is_alive()
    assert app.cancelled == [0]           # the open stream was told its client is gone
    assert idle.recv(1) == b""
    with pytest.raises(OSError):
        socket.create_connection(server.address, timeout=1)


# -- pure parts -----------------------------------------------------------------------------------

def test_router_patterns_and_event_encoding():
    router = make_router()
    request = HttpRequest("GET", "/echo/a%2Fb", {}, {}, b"")
    response = router.dispatch(request)
    assert request.path_params == {"word": "a/b"} and json.loads(response.body)["word"] == "a/b"
    assert router.dispatch(HttpRequest("GET", "/echo/", {}, {}, b"")).status == 404
    assert router.dispatch(HttpRequest("GET", "/echo/a/b", {}, {}, b"")).status == 404
    router.add("GET", "/nothing", lambda req: "not a response")
    assert router.dispatch(HttpRequest("GET", "/nothing", {}, {}, b"")).status == 500
    assert encode_event({"a": "é"}) == b'data: {"a":"\\u00e9"}\n\n'
    assert encode_event("one\ntwo", event="response.done") == b"event: response.done\ndata: one\ndata: two\n\n"
    stream = EventStream()
    stream.close()
    with pytest.raises(RuntimeError):
        stream.send("x")
