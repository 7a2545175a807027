"""Codex CLI and Claude Code against the server, for real and replayed.

The first request each pinned CLI sends (and Codex's second turn, which resumes with encrypted
reasoning) is kept under tests/fixtures/agent_requests/, trimmed: ids and paths made constant,
long texts cut, every field and tool shape kept. The replay tests POST them without node and
check each streamed event against the official SDKs' models. The `agent_cli` tests run the CLIs
themselves (installed with npm into a cache folder; skipped when node, npm or the install is
missing) against the same server; TENSORFOLD_RECORD_AGENT_REQUESTS=1 makes them rewrite the
fixtures from what the CLIs sent.

The server runs a tiny qwen3 with a 32k window whose replies end: its embedding keeps one
dimension that no layer reads or writes, set on every word token, and only the end token's
output row reads it. So after a word the reply ends, and with a thinking budget of 2 each reply
is one thought token and a one-word answer: the CLIs see a completed turn, not a length stop.
"""
import json
import os
import re
import shutil
import subprocess

import anthropic
import pydantic
import pytest
from anthropic.types.beta import BetaRawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

from serving import post, serving
from tensorfold.engine.engine import EngineConfig
from tensorfold.server import ServeSettings

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "agent_requests")
CLIS = {"codex": ("@openai/codex", "0.171.0"), "claude": ("@anthropic-ai/claude-code", "2.1.197")}
CLI_CACHE = os.environ.get("TENSORFOLD_AGENT_CLIS", os.path.expanduser("~/.cache/tensorfold-agent-clis"))
RECORD = os.environ.get("TENSORFOLD_RECORD_AGENT_REQUESTS") == "1"
CLI_TIMEOUT_S = 240
MODEL = "local"
KEPT_CHARS = 200
ANSWER_DIM = 0  # the embedding dimension that carries "a word came last"


def brief_checkpoint(out_dir: str) -> str:
    """A tiny qwen3 (Qwen3-style template, 32k window) whose replies end one token after a word."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from tools.tiny_checkpoint import make_tiny_checkpoint

    make_tiny_checkpoint(out_dir, "qwen3", family=True, max_position_embeddings=32768)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    special = set(tokenizer.all_special_ids)
    words = torch.tensor([i not in special and any(c.isalnum() for c in tokenizer.decode([i]))
                          for i in range(len(tokenizer))])  # [vocab]
    path = os.path.join(out_dir, "model.safetensors")
    weights = load_file(path)
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[ANSWER_DIM, :] = 0.0  # no layer writes the dimension ...
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            w[:, ANSWER_DIM] = 0.0  # ... or reads it
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]  # [vocab, hidden] each
    embed[:, ANSWER_DIM] = 0.0
    embed[words, ANSWER_DIM] = 20.0  # dominates the final norm: about 8 after it
    head[:, ANSWER_DIM] = 0.0
    head[tokenizer.eos_token_id] = 0.0
    head[tokenizer.eos_token_id, ANSWER_DIM] = 5.0  # a logit near 40 after a word, 0 otherwise
    save_file(weights, path, metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def brief(tmp_path_factory):
    return brief_checkpoint(str(tmp_path_factory.mktemp("brief_qwen3")))


@pytest.fixture(scope="module")
def srv(brief, tmp_path_factory):
    """The server as the README configures it for the CLIs; srv.seen lists each request it got."""
    store = str(tmp_path_factory.mktemp("agents") / "responses.sqlite")
    settings = ServeSettings(model=brief, port=0, served_model_name=MODEL, thinking_budget=2, response_store=store,
                             engine=EngineConfig(max_num_seqs=2, probe=False))
    with serving(settings) as s:
        s.seen = []
        dispatch = s.server.router.dispatch

        def recording(request):
            s.seen.append((request.method, request.path, dict(request.query), request.body))
            return dispatch(request)

        s.server.router.dispatch = recording
        yield s


# ---- fixtures: trimmed bodies


UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
HEX_ID = re.compile(r"\b[0-9a-f]{64}\b")


def trimmed(value, path: str = ""):
    """A body with ids made constant, the working folder a fixed path, long texts cut (tokens kept)."""
    if isinstance(value, dict):
        return {k: trimmed(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [trimmed(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str) or path.endswith("encrypted_content"):
        return value
    text = HEX_ID.sub("0" * 64, UUID.sub("00000000-0000-0000-0000-000000000000", value))
    text = re.sub(r"/tmp/[^\s\"'<>:]*work\b", "/work/project", text)
    if len(text) > KEPT_CHARS:
        text = text[:KEPT_CHARS] + f" [{len(text) - KEPT_CHARS} chars trimmed]"
    return text


def shape(body: dict) -> dict:
    """What a pinned CLI's request must keep: its fields, tool names and types, input item kinds."""
    items = body.get("input") or body.get("messages") or []
    return {"fields": sorted(body), "tools": [(t.get("type"), t.get("name")) for t in body.get("tools", [])],
            "items": [(i.get("type"), i.get("role")) for i in items if isinstance(i, dict)]}


def load(name: str) -> dict:
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return json.load(f)


def save(name: str, cli: str, method: str, path: str, query: dict, body: bytes) -> None:
    record = {"cli": f"{CLIS[cli][0]}@{CLIS[cli][1]}", "method": method, "path": path, "query": query,
              "body": trimmed(json.loads(body))}
    with open(os.path.join(FIXTURES, name), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
        f.write("\n")


# ---- replayed without node


def sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) pairs of a text/event-stream reply."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def replay_responses(s, body: dict) -> dict:
    """POST a Responses body streamed; every event must validate as the openai SDK's event union."""
    r = post(s, "/v1/responses", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text[:500]
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    events = sse(r.text)
    for name, data in events:
        event = adapter.validate_python(data)
        assert name == event.type
    types = [data["type"] for _, data in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [d["sequence_number"] for _, d in events] == sorted({d["sequence_number"] for _, d in events})
    final = Response.model_validate(events[-1][1]["response"])
    assert final.status == "completed" and final.output_text
    return events[-1][1]["response"]


def test_codexs_first_request_replays_and_its_resume_restores_the_encrypted_reasoning(srv):
    first = load("codex-first.json")
    assert first["path"] == "/v1/responses" and first["body"]["include"] == ["reasoning.encrypted_content"]
    assert ("namespace", "multi_agent_v1") in shape(first["body"])["tools"]
    reply = replay_responses(srv, first["body"])
    reasoning = [o for o in reply["output"] if o["type"] == "reasoning"]
    message = [o for o in reply["output"] if o["type"] == "message"][-1]
    assert reasoning and reasoning[0]["encrypted_content"]
    # turn two as Codex sends it: the whole history, the reasoning with its token; ours swapped in,
    # since the recorded token was sealed by the recording server's key
    resume = load("codex-resume.json")["body"]
    items = resume["input"]
    at = [i for i, item in enumerate(items) if item.get("type") == "reasoning"]
    assert len(at) == 1 and items[at[0]]["encrypted_content"]
    items[at[0]] = {**items[at[0]], "encrypted_content": reasoning[0]["encrypted_content"],
                    "content": reasoning[0]["content"]}
    items[at[0] + 1]["content"] = message["content"]
    replay_responses(srv, resume)
    items[at[0]]["encrypted_content"] = reasoning[0]["encrypted_content"][:-4] + "AAAA"
    r = post(srv, "/v1/responses", resume)
    assert r.status_code == 400 and r.json()["error"]["param"] == f"input[{at[0]}].encrypted_content"


def test_codexs_first_request_streams_through_the_openai_client(srv):
    body = load("codex-first.json")["body"]
    typed = {"model", "input", "tools", "tool_choice", "parallel_tool_calls", "reasoning", "store", "include",
             "prompt_cache_key"}
    with srv.client.responses.stream(**{k: body[k] for k in typed}, extra_body={
            k: v for k, v in body.items() if k not in typed | {"stream"}}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed" and final.output_text
    assert [o.type for o in final.output] == ["reasoning", "message"]


def test_claude_codes_first_request_replays_on_the_beta_route(srv):
    first = load("claude-code-first.json")
    assert first["path"] == "/v1/messages" and first["query"] == {"beta": "true"}
    body = first["body"]
    assert [m["role"] for m in body["messages"]][:2] == ["user", "system"] and body["thinking"] == {"type": "adaptive"}
    r = post(srv, "/v1/messages?beta=true", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text[:500]
    adapter = pydantic.TypeAdapter(BetaRawMessageStreamEvent)
    events = [(name, adapter.validate_python(data)) for name, data in sse(r.text)]
    assert all(name == e.type for name, e in events)
    kinds = [e.type for _, e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = [e.content_block.type for _, e in events if e.type == "content_block_start"]
    assert blocks == ["thinking", "text"] and kinds.count("content_block_stop") == 2
    assert events[-2][1].delta.stop_reason == "end_turn"
    sdk = anthropic.Anthropic(base_url=srv.root, api_key="unused", max_retries=0)
    typed = {"model", "messages", "system", "tools", "metadata", "max_tokens", "thinking", "context_management",
             "output_config"}
    with sdk.beta.messages.stream(**{k: body[k] for k in typed}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text
    assert final.stop_reason == "end_turn"


# ---- the real CLIs


def npm_cli(cli: str) -> str:
    """The pinned CLI's executable in the cache folder, installed with npm when missing; else skip."""
    package, version = CLIS[cli]
    exe = os.path.join(CLI_CACHE, "node_modules", ".bin", cli)
    manifest = os.path.join(CLI_CACHE, "node_modules", *package.split("/"), "package.json")
    if os.path.exists(manifest) and json.load(open(manifest))["version"] == version and os.access(exe, os.X_OK):
        return exe
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip(f"node and npm are needed to install {package}@{version}")
    try:
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", CLI_CACHE,
                               f"{package}@{version}"], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install {package}@{version} took over 300 s")
    if done.returncode != 0 or not os.access(exe, os.X_OK):
        pytest.skip(f"npm install {package}@{version} failed (no network?): {done.stderr[-500:]}")
    return exe


def run_cli(argv: list[str], env: dict, cwd: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{argv[:2]} ran past {CLI_TIMEOUT_S} s; stderr: {(e.stderr or b'')[-2000:]!r}")


def posted(s, since: int, path: str) -> list[tuple]:
    return [seen for seen in s.seen[since:] if seen[0] == "POST" and seen[1] == path]


@pytest.fixture(scope="module")
def codex():
    return npm_cli("codex")


@pytest.fixture(scope="module")
def claude():
    return npm_cli("claude")


@pytest.mark.agent_cli
def test_codex_exec_and_a_resumed_turn_with_encrypted_reasoning(codex, srv, tmp_path):  # codex first: skip early
    home, work = tmp_path / "codex_home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    (home / "config.toml").write_text(f'''model = "{MODEL}"
model_provider = "tensorfold"
web_search = "disabled"

[model_providers.tensorfold]
name = "TensorFold"
base_url = "{srv.root}/v1"
wire_api = "responses"
''')
    env = {**os.environ, "CODEX_HOME": str(home), "OPENAI_API_KEY": "unused", "NO_COLOR": "1"}
    since = len(srv.seen)
    done = run_cli([codex, "exec", "--skip-git-repo-check", "say hello"], env, str(work))
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]
    (first,) = posted(srv, since, "/v1/responses")
    since = len(srv.seen)
    again = run_cli([codex, "exec", "--skip-git-repo-check", "resume", "--last", "say it again"], env, str(work))
    assert again.returncode == 0 and again.stdout.strip(), again.stderr[-3000:]
    (second,) = posted(srv, since, "/v1/responses")
    items = json.loads(second[3])["input"]
    assert [i["type"] for i in items if i.get("encrypted_content")] == ["reasoning"]
    if RECORD:
        save("codex-first.json", "codex", *first)
        save("codex-resume.json", "codex", *second)
    assert shape(json.loads(first[3])) == shape(load("codex-first.json")["body"])
    assert shape(json.loads(second[3])) == shape(load("codex-resume.json")["body"])


@pytest.mark.agent_cli
def test_claude_print(claude, srv, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": srv.root, "ANTHROPIC_AUTH_TOKEN": "unused",
           "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    env.pop("ANTHROPIC_API_KEY", None)
    since = len(srv.seen)
    done = run_cli([claude, "-p", "say hello"], env, str(work))
    assert done.returncode == 0 and done.stdout.strip(), (done.stdout[-2000:], done.stderr[-3000:])
    first = posted(srv, since, "/v1/messages")[0]
    assert first[2] == {"beta": "true"}
    if RECORD:
        save("claude-code-first.json", "claude", *first)
    assert shape(json.loads(first[3])) == shape(load("claude-code-first.json")["body"])
