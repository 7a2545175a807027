"""What operators rely on: /metrics (read by prometheus_client's own parser), --api-key on every
/v1 route, /tokenize and /detokenize, and, on a real `python -m tensorfold` process, the JSON
log format, the load progress, the access log, and SIGTERM draining a running stream before a
clean exit."""
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import check_error, post, serving
from tensorfold.engine.engine import EngineConfig
from tensorfold.server import ServeSettings, build_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sk-test-0123456789"
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6}


@pytest.fixture(scope="module")
def srv(tiny_llama):
    with serving(ServeSettings(model=tiny_llama, port=0, engine=EngineConfig(max_num_seqs=2, probe=False))) as s:
        yield s


def scrape(s) -> dict:
    r = s.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        assert family.name.startswith("tensorfold_"), family.name
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_parse_and_move_with_traffic(srv):
    before = scrape(srv)
    for stream in (False, True):
        assert post(srv, "/v1/chat/completions", {**CHAT, "stream": stream}).status_code == 200
    after = scrape(srv)
    assert value(after, "tensorfold_requests_total") == value(before, "tensorfold_requests_total") + 2
    assert value(after, "tensorfold_generation_tokens_total") >= value(before, "tensorfold_generation_tokens_total") + 2
    assert value(after, "tensorfold_prompt_tokens_total") > value(before, "tensorfold_prompt_tokens_total")
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "queue_wait_seconds"):
        name = f"tensorfold_{h}"
        assert value(after, f"{name}_count") == value(before, f"{name}_count") + 2, h
        assert value(after, f"{name}_bucket", le="+Inf") == value(after, f"{name}_count")
        assert value(after, f"{name}_sum") > value(before, f"{name}_sum")
    itl = "tensorfold_inter_token_latency_seconds_count"
    assert value(after, itl) > value(before, itl)
    for gauge in ("requests_running", "requests_waiting", "kv_cache_usage_ratio", "draft_acceptance_ratio"):
        assert 0 <= value(after, f"tensorfold_{gauge}") <= max(1, value(after, "tensorfold_requests_total"))


def test_tokenize_and_detokenize_round_trip(srv):
    r = post(srv, "/tokenize", {"prompt": "Hello there, world"})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == srv.engine.context_length
    text = post(srv, "/detokenize", {"tokens": body["tokens"]}).json()
    assert text["prompt"].endswith("Hello there, world") and text["content"] == text["prompt"]
    plain = post(srv, "/tokenize", {"content": "Hello", "add_special_tokens": False}).json()
    assert post(srv, "/detokenize", {"tokens": plain["tokens"]}).json()["content"] == "Hello"
    # messages go through the chat template: the same ids a chat request's prompt has
    chat = post(srv, "/tokenize", {"messages": CHAT["messages"]}).json()
    reply = post(srv, "/v1/chat/completions", CHAT).json()
    assert chat["count"] == reply["usage"]["prompt_tokens"]
    check_error(post(srv, "/detokenize", {"tokens": [1, -2]}), 400, "tokens[1]")
    check_error(post(srv, "/detokenize", {"tokens": [10 ** 9]}), 400, "prompt[0]")
    check_error(post(srv, "/tokenize", {"prompt": 5}), 400, "prompt")


def test_api_key_guards_every_v1_route_and_only_those(tiny_llama, caplog):
    settings = ServeSettings(model=tiny_llama, port=0, api_key=KEY, engine=EngineConfig(max_num_seqs=2, probe=False))
    with serving(settings) as s:
        routes = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
                  ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})]
        for method, path, body in routes:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"},
                            {"authorization": "Bearer " + KEY[:-1]}):
                r = s.http.request(method, path, json=body, headers=headers)
                err = check_error(r, 401, None)
                assert err["code"] == "invalid_api_key"
            ok = s.http.request(method, path, json=body, headers={"authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200, ok.text
        assert s.http.get("/health").status_code == 200 and s.http.get("/metrics").status_code == 200
        client = s.client.with_options(api_key=KEY)
        assert client.chat.completions.create(model="", messages=CHAT["messages"], max_tokens=2).choices
    with caplog.at_level(logging.WARNING, logger="tensorfold"):
        server = build_server(ServeSettings(model=tiny_llama, host="0.0.0.0", port=0,
                                            engine=EngineConfig(max_num_seqs=1, probe=False)))
        server.shutdown()
    assert any("without --api-key" in r.getMessage() for r in caplog.records)


def start_process(model, *args):
    """`python -m tensorfold` on a free port; returns (process, root url, stderr lines so far)."""
    proc = subprocess.Popen([sys.executable, "-m", "tensorfold", "--model", model, "--port", "0",
                             "--log-format", "json", "--parallel", "2", *args],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"serving on (http://[\d.]+:\d+)", line)
        if m:
            return proc, m.group(1), lines
    proc.kill()
    raise AssertionError("the server did not start:\n" + "".join(lines))


def test_sigterm_lets_a_running_stream_finish_then_exits_0(tiny_llama):
    proc, root, lines = start_process(tiny_llama, "--drain-seconds", "60")
    try:
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events, opened = [], threading.Event()

        def stream():
            with httpx.stream("POST", root + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        opened.set()

        client = threading.Thread(target=stream)
        client.start()
        assert opened.wait(60)
        proc.send_signal(signal.SIGTERM)
        client.join(120)
        assert events[-1] == "[DONE]"
        finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]]
        assert finishes[-1] == "length"
        assert proc.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(root + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    records = [json.loads(line) for line in lines if line.strip()]  # every line is one JSON object
    messages = [r["message"] for r in records]
    assert any("loading weights: 100%" in m for m in messages)
    access = [r for r in records if r.get("path") == "/v1/completions"]
    assert access and access[0]["status"] == 200 and access[0]["method"] == "POST" and access[0]["ms"] > 0
    assert re.match(r"\d+\+400 tokens length", access[0]["note"])
    assert any("SIGTERM" in m for m in messages)


def test_a_second_signal_exits_at_once(tiny_llama):
    proc, root, lines = start_process(tiny_llama, "--drain-seconds", "120")
    try:
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
        opened = threading.Event()

        def stream():
            try:
                with httpx.stream("POST", root + "/v1/completions", json={
                        "prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "stream": True}, timeout=120) as r:
                    for _ in r.iter_lines():
                        opened.set()
            except httpx.HTTPError:
                pass  # cut off: that is the point

        threading.Thread(target=stream, daemon=True).start()
        assert opened.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) != 0 and time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
