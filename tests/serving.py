"""The one way tests run a server: HttpServer.serve_forever on a daemon thread of the test
process (the loop itself is single-threaded; the thread only lets the test be the client),
shut down and joined afterwards. `running` takes any HttpServer (the HTTP layer's own tests
build theirs around a test app); `serving` builds the whole server from ServeSettings and hands
out the official openai client and a raw httpx client on its address, with the checks the
protocol tests share (`post`, `check_error`)."""
import contextlib
import json
import threading
import time
from dataclasses import dataclass

import httpx2 as httpx
import openai

from tensorfold.server import ServeSettings, build_server


@contextlib.contextmanager
def running(server, *, max_shutdown_s: float | None = None):
    """serve_forever() on a daemon thread; on exit shutdown(), join, and fail if the loop crashed
    (or, with max_shutdown_s, took longer than that to stop)."""
    crashed = []

    def run():
        try:
            server.serve_forever()
        except BaseException as e:
            crashed.append(e)
            raise

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        started = time.monotonic()
        server.shutdown()
        thread.join(10)
        assert not thread.is_alive() and not crashed, crashed
        if max_shutdown_s is not None:
            assert time.monotonic() - started < max_shutdown_s


@dataclass
class Served:
    server: object
    client: openai.OpenAI
    http: httpx.Client
    root: str

    @property
    def engine(self):
        return self.server.service.engine

    def health(self) -> dict:
        r = self.http.get("/health")
        assert r.status_code == 200
        return r.json()


@contextlib.contextmanager
def serving(settings: ServeSettings):
    built = build_server(settings)
    try:
        with running(built) as server:
            host, port = server.address
            root = f"http://{host}:{port}"
            client = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0, timeout=60)
            http = httpx.Client(base_url=root, timeout=60)
            try:
                yield Served(server, client, http, root)
            finally:
                http.close()
                client.close()
    finally:
        built.service.engine.close()  # after the loop stopped: a rank group's processes end


def post(s: Served, path: str, body: dict) -> httpx.Response:
    # json.dumps allows NaN and Infinity: the malformed tables send them on purpose.
    return s.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def check_error(r: httpx.Response, status: int, param, *, type_="invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == type_ and err["param"] == param
    return err


@contextlib.contextmanager
def anthropic_serving():
    """The default model served for the Messages route's tests (bf16, two lanes), with the official
    anthropic client on it as `.anthropic`."""
    import anthropic

    from tensorfold.engine.config import EngineConfig
    settings = ServeSettings(port=0, engine=EngineConfig(dtype="bfloat16", max_num_seqs=2, kv_cache_gib=0.25))
    with serving(settings) as s:
        s.anthropic = anthropic.Anthropic(base_url=s.root, api_key="unused", max_retries=0, timeout=60)
        yield s
