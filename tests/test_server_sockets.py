"""The real server (tiny model, real engine) under raw sockets: the bytes on the wire are exactly
what each test writes, so pipelining, chunked bodies, oversized and half-sent requests and
clients that vanish mid-stream are what they claim to be.

One server for the module, in a daemon thread of the test process, with small Limits so the
timeouts and the body cap are quick to reach. Responses are framed by an h11 client that only
parses (the requests are written by hand).
"""
import contextlib
import json
import socket
import struct
import time

import h11
import pytest

from serving import running
from tensorfold.engine.engine import EngineConfig
from tensorfold.http.server import Limits
from tensorfold.server import ServeSettings, build_server

LIMITS = Limits(max_body_bytes=64 * 1024, header_timeout_s=1.5, body_timeout_s=1.5)
CHAT = {"messages": [{"role": "user", "content": "Say hi."}]}


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running(build_server(ServeSettings(model=tiny_llama, port=0, served_model_name="tiny",
                                            limits=LIMITS, engine=EngineConfig(probe=False)))) as srv:
        yield srv


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def request(method: str, target: str, body: dict | bytes | None = None, *, chunks=None) -> bytes:
    """One HTTP/1.1 request as bytes: a Content-Length body, or `chunks` in chunked encoding."""
    head = f"{method} {target} HTTP/1.1\r\nHost: test\r\n"
    if chunks is not None:
        head += "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        return head.encode() + b"".join(map(chunked, chunks)) + b"0\r\n\r\n"
    if body is None:
        return (head + "\r\n").encode()
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


class Wire:
    """A raw client socket; an h11 client parses the responses (the requests go out as is)."""

    def __init__(self, server, timeout: float = 30.0):
        self.sock = socket.create_connection(server.address, timeout=timeout)
        self.h11 = h11.Connection(h11.CLIENT)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def events(self, method: str = "GET"):
        """The next response's h11 events, read as they arrive, through EndOfMessage."""
        # Tell the parser a request went out, so it can frame the response to it.
        self.h11.send(h11.Request(method=method, target="/", headers=[("Host", "test"),
                                                                      ("Content-Length", "0")]))
        self.h11.send(h11.EndOfMessage())
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(self.sock.recv(65536))
                continue
            yield event
            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()

    def response(self, method: str = "GET") -> tuple[int, dict, bytes]:
        status, headers, body = None, {}, bytearray()
        for event in self.events(method):
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
        return status, headers, bytes(body)

    def at_eof(self, timeout: float = 5.0) -> bool:
        """True once the server has closed its side (all that was still sent is discarded)."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False

    def close(self, reset: bool = False) -> None:
        if reset:   # RST instead of FIN
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


@contextlib.contextmanager
def wire(server, timeout: float = 30.0):
    w = Wire(server, timeout)
    try:
        yield w
    finally:
        w.close()


def sse_data(body: bytes) -> list[str]:
    return [block[len("data: "):] for block in body.decode().split("\n\n") if block]


def health(server) -> dict:
    with wire(server) as w:
        w.send(request("GET", "/health"))
        status, _, body = w.response()
    assert status == 200
    return json.loads(body)


def wait_for(predicate, timeout: float = 5.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


# -- keep-alive, pipelining, chunked bodies -----------------------------------------------------

def test_pipelined_keep_alive_requests_are_answered_in_order(server):
    completion = {"prompt": "Once upon", "max_tokens": 4, "seed": 1}
    with wire(server) as w:
        w.send(request("GET", "/health")
               + request("POST", "/v1/completions", completion)
               + request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 3, "stream": True})
               + request("GET", "/v1/models")
               + request("POST", "/v1/completions", completion))
        status, headers, body = w.response()
        assert status == 200 and json.loads(body)["status"] == "ok"
        status, _, body = w.response("POST")
        first = json.loads(body)
        assert status == 200 and first["object"] == "text_completion"
        assert first["usage"]["completion_tokens"] == 4
        status, headers, body = w.response("POST")
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        events = sse_data(body)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 3
        status, _, body = w.response()
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["tiny"]
        status, _, body = w.response("POST")
        again = json.loads(body)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["tensorfold"]["token_sha"] == first["tensorfold"]["token_sha"]
        # Still open: one more request on the same connection.
        w.send(request("GET", "/health"))
        assert w.response()[0] == 200


def test_chunked_request_body_equals_the_same_body_sent_whole(server):
    body = json.dumps({"prompt": "The chunked", "max_tokens": 3, "seed": 4}).encode()
    with wire(server) as w:
        w.send(request("POST", "/v1/completions", body))
        _, _, whole = w.response("POST")
        # The same body in three chunks, with pauses: the server must wait for the last one.
        w.send(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
        for part in (body[:7], body[7:20], body[20:]):
            time.sleep(0.1)
            w.send(chunked(part))
        w.send(b"0\r\n\r\n")
        status, _, in_chunks = w.response("POST")
    assert status == 200
    whole, in_chunks = json.loads(whole), json.loads(in_chunks)
    assert in_chunks["choices"][0]["text"] == whole["choices"][0]["text"]
    assert in_chunks["tensorfold"]["token_sha"] == whole["tensorfold"]["token_sha"]


def test_chunked_streamed_chat(server):
    body = json.dumps({**CHAT, "max_tokens": 3, "stream": True}).encode()
    with wire(server) as w:
        w.send(request("POST", "/v1/chat/completions", chunks=[body[:10], body[10:]]))
        status, headers, data = w.response("POST")
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert sse_data(data)[-1] == "[DONE]"


# -- refusals on the wire -----------------------------------------------------------------------

def check_413(status: int, body: bytes) -> None:
    assert status == 413
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and str(LIMITS.max_body_bytes) in err["message"]


def test_oversized_body_is_413_then_closed(server):
    before = health(server)["requests_total"]
    with wire(server) as w:   # refused from Content-Length alone: the body is never sent
        w.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
               % (LIMITS.max_body_bytes + 1))
        check_413(*w.response("POST")[::2])
        assert w.at_eof()
    with wire(server) as w:   # chunked: refused once the chunks pass the limit
        w.send(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(OSError):   # the server may close while we still write
            for _ in range(LIMITS.max_body_bytes // 8192 + 2):
                w.send(chunked(b" " * 8192))
        check_413(*w.response("POST")[::2])
        assert w.at_eof()
    after = health(server)
    assert after["requests_total"] == before and after["requests_running"] == 0


def test_half_sent_request_times_out_while_others_are_served(server):
    with wire(server) as slow_head, wire(server) as slow_body:
        started = time.monotonic()
        slow_head.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-")
        slow_body.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
                       b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messa")
        # Meanwhile the server serves others, generation included.
        with wire(server) as w:
            w.send(request("POST", "/v1/completions", {"prompt": "Quick", "max_tokens": 1}))
            assert w.response("POST")[0] == 200
        assert time.monotonic() - started < LIMITS.header_timeout_s
        for w, kind in ((slow_head, "header"), (slow_body, "body")):
            status, _, body = w.response("POST")
            elapsed = time.monotonic() - started
            assert status == 408 and kind in json.loads(body)["error"]["message"]
            assert LIMITS.header_timeout_s * 0.9 <= elapsed < LIMITS.header_timeout_s + 3
            assert w.at_eof()


# -- a client that goes away mid-stream ---------------------------------------------------------

@pytest.mark.parametrize("how", ["close", "reset"])
def test_client_gone_mid_stream_cancels_its_request(server, how):
    """A streamed reply whose client closes (FIN) or resets (RST) after a few events: the
    request stops, its blocks go back to the pool, /health shows it gone."""
    engine = server.service.engine
    max_tokens = 400
    before = health(server)
    w = Wire(server)
    w.send(request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": max_tokens, "stream": True}))
    events = w.events("POST")
    head = next(events)
    assert isinstance(head, h11.Response) and head.status_code == 200
    received = b""
    while received.count(b'"content"') < 4:   # the role chunk and three tokens
        received += next(events).data

    # While it runs: /health answers, and counts the running reply's tokens.
    running = health(server)
    assert running["busy"] is True and running["requests_running"] == 1
    assert running["requests_total"] == before["requests_total"] + 1
    assert running["completion_tokens_total"] >= before["completion_tokens_total"] + 3
    assert running["streams"]["decoding"] == 1

    w.close(reset=how == "reset")
    gone = wait_for(lambda: (h := health(server))["requests_running"] == 0 and h)
    assert gone, "the request was not cancelled"
    assert gone["busy"] is False
    assert not engine.has_work() and not engine.requests
    assert engine.pool.num_free == engine.pool.num_blocks      # its cache blocks are back
    generated = gone["completion_tokens_total"] - before["completion_tokens_total"]
    assert 3 <= generated < max_tokens // 2
    time.sleep(0.2)   # and it stays stopped
    assert health(server)["rounds_total"] == gone["rounds_total"]

    with wire(server) as again:   # the server goes on
        again.send(request("POST", "/v1/completions", {"prompt": "After", "max_tokens": 2}))
        status, _, body = again.response("POST")
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


def test_client_gone_before_a_whole_reply_cancels_it(server):
    """The same for a non-streamed request: the client leaves while its reply is generated."""
    engine = server.service.engine
    before = health(server)
    w = Wire(server)
    w.send(request("POST", "/v1/completions", {"prompt": "Long", "max_tokens": 400}))
    assert wait_for(lambda: health(server)["completion_tokens_total"]
                    >= before["completion_tokens_total"] + 3)
    w.close()
    gone = wait_for(lambda: (h := health(server))["requests_running"] == 0 and h)
    assert gone and gone["busy"] is False
    assert not engine.has_work() and engine.pool.num_free == engine.pool.num_blocks
    assert gone["completion_tokens_total"] - before["completion_tokens_total"] < 200
