"""http(s) image URLs (--image-urls): fetched on worker threads while their request waits.

The serving loop is one thread (tensorfold/http/server.py), so a request with image URLs is not
prepared at once: its URLs go to a small pool of fetch threads and the handler returns a held
sink (a held EventStream or a DeferredResponse), as a slow grammar compile does. The loop's tick
calls start_fetched(), which prepares and starts every request whose fetches have finished (or
whose time is up) with the bytes by URL; read_images (api/images.py) then treats fetched bytes
exactly as a data: URL's, and refuses a failed fetch with a 400 naming the part. Nothing has been
sent on the sink by then, so every refusal is still a plain 400.

fetch() owns the network rules: only http and https, redirects followed (at most MAX_REDIRECTS)
to http and https only, a 2xx status, the body read in pieces and abandoned past max_bytes
(Content-Length is only an early no), and one deadline for the whole of it (connect, headers,
every read: the socket's timeout is the time left before each). Every failure is a FetchError;
a fetch never raises anything else into the loop.
"""
import http.client
import logging
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urljoin, urlsplit

from tensorfold.api.errors import ApiError
from tensorfold.http.messages import DeferredResponse, EventStream, HttpResponse

log = logging.getLogger("tensorfold.api")

MAX_REDIRECTS = 5
READ_CHUNK = 1 << 16     # bytes asked of the socket per read
FETCH_THREADS = 4        # fetches at once; later ones queue, their deadline already running
SCHEMES = ("http", "https")
REDIRECTS = (301, 302, 303, 307, 308)


class FetchError(Exception):
    """Why an image URL gave no image bytes (the message completes "could not be fetched: ")."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def fetch(url: str, max_bytes: int, deadline: float) -> bytes:
    """The body of GET url, within the module's rules; deadline is a time.monotonic() value."""
    for _ in range(MAX_REDIRECTS + 1):
        parts = _http_url(url)
        conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        try:
            conn = conn_class(parts.hostname, parts.port, timeout=_left(deadline))
            try:
                conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                             headers={"Accept": "image/*", "User-Agent": "tensorfold"})
                sock = conn.sock  # kept: conn drops it once a Connection: close response begins
                sock.settimeout(_left(deadline))
                resp = conn.getresponse()
                location = resp.getheader("Location")
                if resp.status in REDIRECTS and location:
                    url = urljoin(url, location)
                    continue
                if not 200 <= resp.status < 300:
                    raise FetchError(f"the server answered HTTP {resp.status} {resp.reason}".rstrip())
                length = resp.getheader("Content-Length", "")
                if length.isdigit() and int(length) > max_bytes:
                    raise FetchError(f"its Content-Length {length} is over {max_bytes} bytes (--max-image-bytes)")
                return _body(resp, sock, max_bytes, deadline)
            finally:
                conn.close()
        except (TimeoutError, socket.timeout):
            raise FetchError("it did not finish within the time limit (--image-url-timeout)", timed_out=True) from None
        except FetchError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise FetchError(f"{type(e).__name__}: {e}") from None
    raise FetchError(f"more than {MAX_REDIRECTS} redirects")


def _http_url(url: str):
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a malformed port raises here)
    except ValueError as e:
        raise FetchError(f"the URL is malformed ({e})") from None
    if parts.scheme not in SCHEMES:
        raise FetchError(f"it redirected to a {parts.scheme or 'relative'}: URL; only http and https are fetched")
    if not parts.hostname:
        raise FetchError("the URL has no host")
    return parts


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _body(resp: http.client.HTTPResponse, sock: socket.socket, max_bytes: int, deadline: float) -> bytes:
    """The response body, a piece at a time, the socket's timeout the time left before each read."""
    data = bytearray()
    while True:
        sock.settimeout(_left(deadline))
        piece = resp.read1(READ_CHUNK)  # at most one read of the socket
        if not piece:
            return bytes(data)
        data += piece
        if len(data) > max_bytes:
            raise FetchError(f"its body is over {max_bytes} bytes (--max-image-bytes)")


# ---- requests waiting for their fetches ------------------------------------------------------------

@dataclass
class PendingFetch:
    """A request waiting for its image URLs; its sink is held, so a failure is still a 400."""
    greq: object                       # api/request.GenerationRequest
    fmt_class: object                  # the route's reply format (None: the kind's)
    futures: dict[str, Future]         # url -> the fetch (bytes, or FetchError raised)
    deadline: float                    # time.monotonic(): the fetches' common time limit
    sink: EventStream | DeferredResponse

    def ready(self, now: float) -> bool:
        return now >= self.deadline or all(f.done() for f in self.futures.values())

    def results(self) -> dict[str, bytes | FetchError]:
        out = {}
        for url, future in self.futures.items():
            if not future.done():  # the thread stops at its own deadline; no one waits for it
                out[url] = FetchError("it did not finish within the time limit (--image-url-timeout)",
                                      timed_out=True)
                continue
            try:
                out[url] = future.result()
            except FetchError as e:
                out[url] = e
            except Exception as e:  # a fault of the fetch itself: this image only
                log.exception("image fetch failed")
                out[url] = FetchError(f"{type(e).__name__}: {e}")
        return out


# start(greq, fmt_class, fetched, sink) -> sink; error(greq, fmt_class, ApiError | None, message) -> response
Start = Callable[..., object]


class ImageFetches:
    def __init__(self, wake: Callable[[], None], threads: int = FETCH_THREADS):
        self.wake = wake  # makes the server's poll return (called from the fetch threads)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tensorfold-image-fetch")
        self.pending: list[PendingFetch] = []

    def submit(self, greq, fmt_class, urls: list[str], max_bytes: int, timeout_s: float):
        """Fetch `urls` off the serving thread; the request's held sink, to return to the client."""
        deadline = time.monotonic() + timeout_s
        futures = {url: self.pool.submit(fetch, url, max_bytes, deadline) for url in dict.fromkeys(urls)}
        sink = EventStream(held=True) if greq.stream else DeferredResponse()
        self.pending.append(PendingFetch(greq, fmt_class, futures, deadline, sink))
        for future in futures.values():
            future.add_done_callback(lambda _: self.wake())
        return sink

    def start_fetched(self, start: Start, api_error: Callable, server_error: Callable) -> None:
        """Prepare and start the requests whose fetches are over (the loop's tick, every pass):
        start(greq, fmt_class, fetched, sink); an ApiError from it is answered on the held sink
        (api_error(greq, fmt_class, err) -> HttpResponse), anything else as a 500."""
        now = time.monotonic()
        ready = [p for p in self.pending if p.ready(now)]
        self.pending = [p for p in self.pending if not p.ready(now)]
        for p in ready:
            if p.sink.disconnected:
                continue
            try:
                start(p.greq, p.fmt_class, p.results(), p.sink)
                continue
            except ApiError as e:
                response = api_error(p.greq, p.fmt_class, e)
            except Exception as e:  # this request only; the server goes on
                log.exception("starting a request after its image fetches failed")
                response = server_error(p.greq, p.fmt_class, f"{type(e).__name__}: {e}")
            answer(p.sink, response)


def answer(sink: EventStream | DeferredResponse, response: HttpResponse) -> None:
    """A held sink's whole answer (an error): the response instead of a stream, or resolved."""
    if isinstance(sink, EventStream):
        sink.refuse(response)
    else:
        sink.resolve(response)
