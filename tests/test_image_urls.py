"""--image-urls: http(s) image URLs fetched by the server (api/image_fetch.py), over a real server
with the official openai client, from a loopback http.server on a thread: a fetched image is the
same image as its bytes inline (the same token_sha, one image-cache entry); every failed fetch is a
400 naming the part, before any token; a slow fetch holds no one else up; the server serves on."""
import http.server
import threading
import time

import openai
import pytest

from test_exactness import Background, complete, serving, stream, tiny_engine
from test_vision import chat, data_url, png
from tensorfold.__main__ import parse_args, settings_from
from tensorfold.api.image_fetch import FetchError, fetch
from tensorfold.api.images import ImageLimits
from tools.tiny_checkpoint import make_tiny_vision_checkpoint

PICTURE = png(120, 80, 5)
MAX_BYTES = 100_000  # the served limit in these tests; PICTURE is ~29 kB
TIMEOUT_S = 0.6      # --image-url-timeout in these tests


class Pictures(http.server.BaseHTTPRequestHandler):
    """The loopback image server's routes."""
    release = threading.Event()  # /held.png answers once this is set

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = self.path
        if path in ("/a.png", "/held.png"):
            if path == "/held.png":
                self.release.wait(30)
            self._send(200, PICTURE, "image/png")
        elif path == "/moved":
            self._send(302, b"", headers={"Location": "/a.png"})
        elif path == "/to-ftp":
            self._send(302, b"", headers={"Location": "ftp://127.0.0.1/a.png"})
        elif path == "/missing.png":
            self._send(404, b"no such picture", "text/plain")
        elif path == "/big.png":  # no Content-Length: only the reader's count stops it
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self._write(PICTURE + bytes(3 * MAX_BYTES))
        elif path == "/slow.png":  # a byte every 50 ms: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PICTURE)))
            self.end_headers()
            for i in range(200):
                if not self._write(PICTURE[i:i + 1]):
                    return
                time.sleep(0.05)
        elif path == "/text":
            self._send(200, b"not an image", "text/plain")
        else:
            self._send(500, b"?", "text/plain")

    def _send(self, status, body, content_type="application/octet-stream", headers=None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self._write(body)

    def _write(self, data) -> bool:
        try:
            self.wfile.write(data)
            self.wfile.flush()
            return True
        except OSError:  # the fetcher gave up: expected for /big.png and /slow.png
            return False

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def pictures():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pictures)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield "http://127.0.0.1:%d" % server.server_address[1]
    Pictures.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tiny_vl = make_tiny_vision_checkpoint(str(tmp_path_factory.mktemp("tiny_vl")))
    with serving(tiny_engine(tiny_vl, vision=True)) as s:
        yield s


@pytest.fixture
def url_server(served):
    served.service.prompts.image_limits = ImageLimits(max_bytes=MAX_BYTES, fetch_urls=True, url_timeout_s=TIMEOUT_S)
    yield served
    served.service.prompts.image_limits = ImageLimits()


def test_flags_reach_the_settings():
    limits = settings_from(parse_args(["--vision", "--image-urls", "--image-url-timeout", "2.5"])).image_limits
    assert limits.fetch_urls and limits.url_timeout_s == 2.5
    assert not settings_from(parse_args(["--vision"])).image_limits.fetch_urls


def test_fetch_keeps_its_limits(pictures):
    assert fetch(f"{pictures}/a.png", MAX_BYTES, time.monotonic() + 10) == PICTURE
    assert fetch(f"{pictures}/moved", MAX_BYTES, time.monotonic() + 10) == PICTURE
    started = time.monotonic()
    with pytest.raises(FetchError) as e:
        fetch(f"{pictures}/slow.png", MAX_BYTES, started + TIMEOUT_S)
    assert e.value.timed_out and time.monotonic() - started < TIMEOUT_S + 0.5  # the whole fetch, not a read
    for path, words in [("/big.png", "over 100000 bytes"), ("/missing.png", "HTTP 404"),
                        ("/to-ftp", "ftp: URL; only http and https")]:
        with pytest.raises(FetchError, match=words):
            fetch(pictures + path, MAX_BYTES, time.monotonic() + 10)
    with pytest.raises(FetchError, match="ConnectionRefused"):  # nothing listens on the port the test held
        fetch(f"http://127.0.0.1:{_closed_port()}/a.png", MAX_BYTES, time.monotonic() + 10)


def _closed_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_fetched_image_is_the_inline_image(url_server, pictures):
    s = url_server
    images = s.engine.runner.images
    misses = images.misses
    inline = complete(s.client, chat([data_url(PICTURE)]))
    by_url = complete(s.client, chat([f"{pictures}/a.png"]))
    redirected = stream(s.client, chat([f"{pictures}/moved"]))
    assert by_url.sha == inline.sha and by_url.text == inline.text
    assert redirected.sha == inline.sha
    assert by_url.cached > 0  # the prefix cache keys the image by its bytes, wherever they came from
    assert images.misses == misses + 1  # one image, encoded once
    other = complete(s.client, chat([data_url(png(80, 120, 6))]))
    assert other.sha != inline.sha or other.text != inline.text  # the image matters: the test can fail
    r = s.client.responses.create(model="tiny", max_output_tokens=12, temperature=0.8, store=False,
                                  extra_body={"seed": 3},
                                  input=[{"role": "user", "content": [
                                      {"type": "input_image", "image_url": f"{pictures}/a.png"},
                                      {"type": "input_text", "text": "What is in the picture?"}]}])
    assert r.model_extra["tensorfold"]["token_sha"] == inline.sha and r.output_text == inline.text


def test_each_failed_fetch_is_a_400_naming_the_part(url_server, pictures):
    s = url_server
    part = "messages[0].content[1].image_url.url"
    cases = [("/missing.png", "HTTP 404"), ("/slow.png", f"within {TIMEOUT_S:g} s (--image-url-timeout)"),
             ("/big.png", "--max-image-bytes"), ("/text", "cannot be read"), ("/to-ftp", "only http and https"),
             (f"http://127.0.0.1:{_closed_port()}/a.png", "could not be fetched")]
    for path, words in cases:
        url = path if path.startswith("http") else pictures + path
        body = chat([data_url(PICTURE), url])  # the second part fails
        for streamed in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                if streamed:
                    list(s.client.chat.completions.create(model="tiny", stream=True, **body))
                else:
                    s.client.chat.completions.create(model="tiny", **body)
            err = e.value.body
            assert err["param"] == part and words in err["message"], (path, err)
    with pytest.raises(openai.BadRequestError) as e:  # the Responses API names its input
        s.client.responses.create(model="tiny", max_output_tokens=4, store=False, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": f"{pictures}/missing.png"}, {"type": "input_text", "text": "Hi"}]}])
    assert e.value.body["param"] == "input" and "HTTP 404" in e.value.body["message"]
    assert not s.service.fetches.pending and not s.service.replies
    assert complete(s.client, chat([f"{pictures}/a.png"])).sha  # and the server serves on


def test_a_waiting_fetch_holds_no_one_up(url_server, pictures):
    s = url_server
    s.service.prompts.image_limits = ImageLimits(max_bytes=MAX_BYTES, fetch_urls=True, url_timeout_s=30)
    Pictures.release.clear()
    waiting = Background(lambda: complete(s.client, chat([f"{pictures}/held.png"])))
    deadline = time.monotonic() + 30
    while not s.service.fetches.pending:
        assert time.monotonic() < deadline, "the request never reached the fetcher"
        time.sleep(0.01)
    text = Background(lambda: complete(s.client, chat([], "Just text.")))
    assert text.result(timeout=20).sha  # served while the other request's fetch waits
    assert s.service.fetches.pending  # still waiting: the text reply did not wait for it
    Pictures.release.set()
    assert waiting.result(timeout=60).sha == complete(s.client, chat([data_url(PICTURE)])).sha


def test_without_the_flag_a_url_is_a_400_naming_it(served, pictures):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model="tiny", **chat([f"{pictures}/a.png"]))
    err = e.value.body
    assert err["param"] == "messages[0].content[0].image_url.url" and "--image-urls" in err["message"]


def test_a_fetched_request_whose_grammar_compiles_off_thread(url_server, pictures, monkeypatch):
    """The held sink waits twice, for the image and then for the grammar (api/grammar_pipeline.py)."""
    from tensorfold.api import grammar_pipeline
    pytest.importorskip("xgrammar")
    monkeypatch.setattr(grammar_pipeline, "QUICK_COMPILE_S", 0.0)
    s = url_server
    for key, streamed in [("colour", False), ("shape", True)]:  # a new grammar each: compiled off-thread
        fmt = {"type": "json_schema", "json_schema": {"name": "picture", "schema": {
            "type": "object", "properties": {key: {"type": "string"}}, "required": [key]}}}
        by_url = (stream if streamed else complete)(s.client, chat([f"{pictures}/a.png"], response_format=fmt))
        inline = complete(s.client, chat([data_url(PICTURE)], response_format=fmt))
        assert by_url.sha == inline.sha and by_url.text == inline.text
