"""--tp 2: two processes on this machine over loopback (gloo) give the tokens one process gives,
bitwise, and the group's faults end in errors and 503s, never in a hang.

The oracle is the one-rank engine or server on the same checkpoint: token ids (token_sha over
HTTP) equal for greedy, sampled, drafted, structured and concurrent requests, on a dense
llama, a qwen3, a Gated DeltaNet hybrid and a GGUF whose blocks are served as stored. The
faults are real: rank 1 SIGKILLed or SIGSTOPped mid-request, or raising in a round. Every test
runs under a hard deadline (SIGALRM), so a hang fails instead of stalling the suite.
"""
import contextlib
import json
import os
import signal
import time

import httpx2 as httpx
import pytest

from tensorfold.parallel.backend import RAISE_AFTER
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.sampling.params import SamplingParams
from tensorfold.server import ServeSettings
from tests.serving import post, serving

TIMEOUT_S = 2.0  # the group's --tp-timeout in the fault tests


@pytest.fixture(autouse=True)
def deadline():
    """Fail, never hang: SIGALRM interrupts the test's main thread after 120 s."""
    def expired(signum, frame):
        raise TimeoutError("test exceeded its 120 s deadline")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory, smollm2_tokenizer):
    from tools.tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tp_hybrid")), "qwen3_5", tokenizer=smollm2_tokenizer)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory, smollm2_tokenizer):
    """Qwen3.6's layout: DeltaNet and gated attention, routed experts and a gated shared expert."""
    from tools.tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tp_moe")), "qwen3_5_moe", tokenizer=smollm2_tokenizer)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory):
    """The tiny llama as a Q8_0 GGUF, its blocks read from the file a rank's rows at a time."""
    from tools.tiny_checkpoint import write_tiny_gguf
    return write_tiny_gguf(tiny_llama, "q8_0", str(tmp_path_factory.mktemp("tp_gguf") / "tiny.gguf"))


REPEATING = [17, 18, 19, 20, 21, 22, 23, 24] * 6
PROMPTS = [list(range(300, 340)), list(range(1000, 1013)), [5, 900, 77, 3, 4100, 61] * 3, list(range(2000, 2090))]
SAMPLED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=11)


def replies(engine: Engine) -> dict:
    """The same requests on any engine: solo greedy and sampled, drafted, then four at once."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    out = {"greedy": engine.generate(PROMPTS[0], greedy).token_ids,
           "sampled": engine.generate(PROMPTS[1], SAMPLED).token_ids}
    out["repeating"] = engine.generate(REPEATING, SamplingParams(max_tokens=24, temperature=0.0)).token_ids
    ids = [engine.add_request(p, greedy if i % 2 else SAMPLED) for i, p in enumerate(PROMPTS)]
    reqs = [engine.requests[i] for i in ids]
    while engine.has_work():
        engine.step()
    out["concurrent"] = [r.output_ids for r in reqs]
    return out


@contextlib.contextmanager
def opened(model: str, **config):
    engine = Engine(model, EngineConfig(max_num_seqs=4, **config))
    try:
        yield engine
    finally:
        engine.close()


@pytest.mark.parametrize("checkpoint", ["tiny_llama", "tiny_qwen3", "tiny_hybrid", "tiny_moe", "tiny_gguf"])
def test_two_ranks_give_the_one_rank_tokens(checkpoint, request):
    model = request.getfixturevalue(checkpoint)
    with opened(model, drafting=False) as one:
        want, one_rank_blocks = replies(one), one.pool.num_blocks
    with opened(model, tp=2) as two:
        assert two.backend.describe()["tp"] == 2
        assert two.pool.num_blocks > one_rank_blocks  # each rank caches half the KV heads: more blocks fit
        got = replies(two)
    assert got == want


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "nemotron_h", "gemma4", "gemma4_moe"])
def test_the_other_families_on_two_ranks(arch, tmp_path, smollm2_tokenizer):
    """Latent attention with its indexer, Mamba2 and Gemma 4's own blocks (its MoE's experts too)
    take the default split (their GEMMs split and gathered, the rest replicated), GLM's experts the
    expert split."""
    from tools.tiny_checkpoint import make_tiny_checkpoint
    model = make_tiny_checkpoint(str(tmp_path), arch, tokenizer=smollm2_tokenizer)
    requests = [(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0)), (PROMPTS[3], SAMPLED)]
    with opened(model, drafting=False) as one:
        want = [one.generate(p, sp).token_ids for p, sp in requests]
    with opened(model, tp=2, drafting=False) as two:
        assert [two.generate(p, sp).token_ids for p, sp in requests] == want


def test_moe_experts_are_split_whole_among_the_ranks(tiny_moe):
    from tensorfold.models.moe import MoE
    with opened(tiny_moe, tp=2, drafting=False) as two:
        moe = next(layer.ffn for layer in two.backend.model.layers if isinstance(layer.ffn, MoE))
        kept = [e for e, expert in enumerate(moe.experts) if expert is not None]
        assert kept == list(range(len(moe.experts) // 2))  # rank 0: the first half, each whole


def test_a_drafted_masked_mixed_batch_on_two_ranks_equals_serial_solo_runs(small_vocab_llama):
    """engine_cases.mixed_batch (top-p, min-p, top-k, greedy, a grammar-masked row; prompts that
    loop, so drafts run): all at once on two ranks, drafts at full depth, against each request
    alone on one rank without drafts."""
    from tests.engine_cases import mixed_batch, run
    prompts, params, constraints = mixed_batch()
    with opened(small_vocab_llama, drafting=False) as one:
        want = [run(one, [p], [sp], [c])[0].output_ids for p, sp, c in zip(prompts, params, constraints)]
    with opened(small_vocab_llama, tp=2, draft_budget=False) as two:
        reqs = run(two, prompts, params, constraints)
    assert [r.output_ids for r in reqs] == want
    assert sum(r.stats.drafted for r in reqs) > 0 and sum(r.stats.accepted for r in reqs) > 0


def test_each_rank_holds_its_shard_of_the_weights(tiny_llama):
    """Rank 0's attention keeps half the heads, its MLP half the intermediate columns, its head
    half the vocabulary (the other half lives in rank 1)."""
    from tensorfold.models.config import ModelArgs
    with open(os.path.join(tiny_llama, "config.json")) as f:
        args = ModelArgs.from_hf(json.load(f), tiny_llama)
    with opened(tiny_llama, tp=2, drafting=False) as two:
        layer = two.backend.model.layers[0]
        assert layer.mixer.spec.num_heads == args.num_heads // 2
        assert layer.mixer.spec.num_kv_heads == args.num_kv_heads // 2
        assert layer.mixer.cache_spec.num_kv_heads == args.num_kv_heads // 2
        assert layer.ffn.spec.intermediate_size == args.intermediate_size // 2
        assert two.backend.model.lm_head.shape[0] == args.vocab_size // 2


def test_a_hybrids_delta_net_keeps_its_heads_and_their_state(tiny_hybrid):
    """Each rank's Gated DeltaNet layers run half the key and value heads, and its recurrent
    state is theirs alone."""
    from tensorfold.models.linear_attention import GatedDeltaNet
    with opened(tiny_hybrid, drafting=False) as one:
        whole = next(layer.mixer for layer in one.backend.model.layers if isinstance(layer.mixer, GatedDeltaNet))
        specs = (whole.spec, whole.cache_spec)
    with opened(tiny_hybrid, tp=2, drafting=False) as two:
        half = next(layer.mixer for layer in two.backend.model.layers if isinstance(layer.mixer, GatedDeltaNet))
    assert half.spec.num_key_heads == specs[0].num_key_heads // 2 and half.spec.num_heads == specs[0].num_heads // 2
    assert half.cache_spec.num_heads == specs[1].num_heads // 2 and half.cache_spec.conv_dim == specs[1].conv_dim // 2


def test_a_split_that_does_not_divide_the_heads_is_refused_before_loading(tiny_llama):
    from tensorfold.models.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match=r"--tp 3 does not divide the model's \d+ attention heads"):
        Engine(tiny_llama, EngineConfig(tp=3))


def test_parts_that_run_on_one_rank_are_refused_with_tp():
    from tensorfold.__main__ import parse_args, settings_from
    with pytest.raises(SystemExit, match="--vision: the vision tower runs on one rank only"):
        settings_from(parse_args(["--tp", "2", "--vision"]))
    with pytest.raises(SystemExit, match="--drafter mtp: the MTP layer runs on one rank only"):
        settings_from(parse_args(["--tp", "2", "--drafter", "mtp"]))
    assert settings_from(parse_args(["--tp", "2"])).engine.tp == 2


def chat(s, content: str, **extra) -> dict:
    r = post(s, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": content}],
                                         "max_tokens": 12, **extra})
    assert r.status_code == 200, r.text
    return r.json()


STRUCTURED = {"response_format": {"type": "json_schema", "json_schema": {"name": "point", "schema": {
    "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"], "additionalProperties": False}}}, "max_tokens": 40}


def http_replies(s) -> list:
    plain = chat(s, "Name a color.", temperature=0)
    sampled = chat(s, "Tell me a story.", temperature=0.9, seed=4)
    structured = chat(s, "A point, please.", **STRUCTURED)
    stream = s.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count."}],
                                              max_tokens=12, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return [plain["tensorfold"]["token_sha"], sampled["tensorfold"]["token_sha"],
            structured["tensorfold"]["token_sha"], structured["choices"][0]["message"]["content"], streamed]


def test_the_server_on_two_ranks_answers_as_on_one(tiny_llama):
    with serving(ServeSettings(model=tiny_llama, port=0, served_model_name="m", engine=EngineConfig(max_num_seqs=4))) as s:
        want = http_replies(s)
    with serving(ServeSettings(model=tiny_llama, port=0, served_model_name="m", engine=EngineConfig(max_num_seqs=4, tp=2))) as s:
        got = http_replies(s)
        health = s.health()
    assert got == want
    json.loads(got[3])  # the structured reply parses
    assert [r["state"] for r in health["ranks"]] == ["serving", "serving"]


# -- faults -----------------------------------------------------------------------------------

def fault_settings(tiny_llama, **config) -> ServeSettings:
    return ServeSettings(model=tiny_llama, port=0, served_model_name="m",
                         engine=EngineConfig(max_num_seqs=4, tp=2, tp_timeout_s=TIMEOUT_S, **config))


def rank1_pid(s) -> int:
    return s.health()["ranks"][1]["pid"]


def stream_until_error(s, act) -> tuple[list[str], float]:
    """A long streamed completion; `act()` runs after its first token. Returns the data lines
    and the seconds from act() to the stream's end."""
    lines, acted_at = [], None
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with s.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line[6:])
            if acted_at is None and '"text"' in line:
                act()
                acted_at = time.monotonic()
    return lines, time.monotonic() - acted_at


def check_unavailable(s, rank_words: str) -> None:
    """New requests get 503 with Retry-After; /health is 503 and names rank 1."""
    r = post(s, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    assert r.json()["error"]["type"] == "server_error"
    h = s.http.get("/health")
    assert h.status_code == 503
    body = h.json()
    assert body["status"] == "unavailable" and "rank 1" in body["reason"]
    assert rank_words in body["ranks"][1]["state"] and body["ranks"][0]["state"] == "serving"


def test_a_killed_rank_ends_the_request_with_an_error_and_later_ones_get_503(tiny_llama):
    with serving(fault_settings(tiny_llama)) as s:
        lines, seconds = stream_until_error(s, lambda: os.kill(rank1_pid(s), signal.SIGKILL))
        assert any('"error"' in line for line in lines) and lines[-1] == "[DONE]"
        assert seconds < TIMEOUT_S + 5
        check_unavailable(s, "exited")


def test_a_stopped_rank_is_found_within_the_timeout(tiny_llama):
    with serving(fault_settings(tiny_llama)) as s:
        lines, seconds = stream_until_error(s, lambda: os.kill(rank1_pid(s), signal.SIGSTOP))
        assert any('"error"' in line for line in lines) and lines[-1] == "[DONE]"
        assert seconds < 2 * TIMEOUT_S + 5
        check_unavailable(s, "heartbeat")


def test_a_rank_that_raises_fails_its_request_not_the_server(tiny_llama, monkeypatch):
    monkeypatch.setenv(RAISE_AFTER, "4")
    with serving(fault_settings(tiny_llama)) as s:
        r = post(s, "/v1/completions", {"model": "m", "prompt": "Once", "max_tokens": 30, "temperature": 0})
        assert r.status_code == 500 and "rank" in r.json()["error"]["message"]
        check_unavailable(s, "RuntimeError")


def test_a_restarted_group_serves_the_same_tokens(tiny_llama):
    with serving(fault_settings(tiny_llama, restart_ranks=True)) as s:
        before = chat(s, "Name a color.", temperature=0)["tensorfold"]["token_sha"]
        first = rank1_pid(s)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # down (503), then restarted (200) with a new rank 1
            h = s.http.get("/health")
            if h.status_code == 200 and h.json()["ranks"][1]["pid"] != first:
                break
            assert time.monotonic() < deadline, h.text
            time.sleep(0.2)
        assert chat(s, "Name a color.", temperature=0)["tensorfold"]["token_sha"] == before


def test_torchrun_starts_the_ranks_and_rank_0_serves(tiny_llama, tmp_path):
    """torchrun --nproc-per-node 2 -m tensorfold: every rank runs the server's command line;
    rank 0 serves the one-rank reply, the other ranks exit when it stops."""
    import socket
    import subprocess
    import sys

    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    with serving(ServeSettings(model=tiny_llama, port=0, served_model_name="m")) as s:
        want = post(s, "/v1/completions", body).json()["tensorfold"]["token_sha"]
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(ports[1]), "-m", "tensorfold", "--model", tiny_llama,
                             "--port", str(ports[0]), "--served-model-name", "m", "--backend", "cpu"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        root = f"http://127.0.0.1:{ports[0]}"
        deadline = time.monotonic() + 90
        while True:
            try:
                health = httpx.get(root + "/health", timeout=5)
                if health.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()
            time.sleep(0.5)
        assert [r["state"] for r in health.json()["ranks"]] == ["serving", "serving"]
        got = httpx.post(root + "/v1/completions", json=body, timeout=60).json()["tensorfold"]["token_sha"]
        assert got == want
        os.kill(health.json()["ranks"][0]["pid"], signal.SIGINT)  # the server drains and stops its ranks
    finally:
        try:
            assert proc.wait(30) == 0, (tmp_path / "torchrun.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
