"""The server's counters since start, and the two bodies that report them: GET /health (JSON)
and GET /metrics (Prometheus text, api/metrics.py's exposition).

A finished, failed or cancelled request adds its tokens and times once (add_finished); the
reply tokens of requests still running are added when read, from the engine's Load, so the
totals only grow.
"""
from dataclasses import dataclass, field

from tensorfold.api import metrics
from tensorfold.engine.engine import Load
from tensorfold.engine.info import EngineInfo
from tensorfold.engine.request import Request


@dataclass
class Counters:
    requests_total: int = 0
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0   # finished replies; running ones are added on read
    cached_tokens_total: int = 0
    prefill_seconds_total: float = 0.0
    decode_seconds_total: float = 0.0
    rounds_total: int = 0
    drafted_total: int = 0
    accepted_total: int = 0
    drafted_by_position: list[int] = field(default_factory=list)   # [i]: drafts verified at depth i + 1
    accepted_by_position: list[int] = field(default_factory=list)

    def add_finished(self, req: Request) -> None:
        s = req.stats
        self.prompt_tokens_total += req.num_prompt_tokens
        self.completion_tokens_total += len(req.output_ids)
        self.cached_tokens_total += s.cached_tokens
        self.prefill_seconds_total += s.prefill_s
        self.decode_seconds_total += s.decode_s
        self.drafted_total += s.drafted
        self.accepted_total += s.accepted
        for total, counts in ((self.drafted_by_position, s.drafted_by_position),
                              (self.accepted_by_position, s.accepted_by_position)):
            total += [0] * max(0, len(counts) - len(total))
            for i, n in enumerate(counts):
                total[i] += n


def health_body(c: Counters, info: EngineInfo, load: Load, *, card_name: str | None, busy: bool,
                requests_running: int) -> dict:
    return {
        "status": "ok",
        "exact": info.exact,
        "backend": info.backend,
        "ops": info.ops,
        "weights": info.weights,
        "kv_dtype": info.kv_dtype,
        "model_card": card_name,
        "busy": busy,
        "requests_running": requests_running,
        "requests_total": c.requests_total,
        "completion_tokens_total": c.completion_tokens_total + load.running_reply_tokens,
        "prompt_tokens_total": c.prompt_tokens_total,
        "cached_tokens_total": c.cached_tokens_total,
        "prefill_seconds_total": round(c.prefill_seconds_total, 6),
        "decode_seconds_total": round(c.decode_seconds_total, 6),
        "rounds_total": c.rounds_total,
        "drafted_total": c.drafted_total,
        "accepted_total": c.accepted_total,
        "drafted_by_position": list(c.drafted_by_position),
        "accepted_by_position": list(c.accepted_by_position),
        "context_length": info.context_length,
        # each cache group's blocks (one per block table: full, and each sliding window's)
        "kv_cache": {"block_size": info.block_size,
                     "groups": [{"window": window, "blocks": blocks, "used": used}
                                for window, blocks, used in load.kv_groups]},
        "streams": {"decoding": load.decoding, "prefilling": load.prefilling, "maximum": load.max_running},
    }


def metrics_text(c: Counters, load: Load, latencies: metrics.Latencies) -> str:
    counters = [
        ("tensorfold_requests_total", "Generation requests accepted.", c.requests_total),
        ("tensorfold_prompt_tokens_total", "Prompt tokens of finished requests.", c.prompt_tokens_total),
        ("tensorfold_generation_tokens_total", "Reply tokens, running requests' included.",
         c.completion_tokens_total + load.running_reply_tokens),
        ("tensorfold_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache.",
         c.cached_tokens_total),
        ("tensorfold_prefill_seconds_total", "Engine time spent in prefill rounds.", c.prefill_seconds_total),
        ("tensorfold_decode_seconds_total", "Engine time spent in decode rounds.", c.decode_seconds_total),
        ("tensorfold_rounds_total", "Engine rounds run.", c.rounds_total),
        ("tensorfold_draft_tokens_total", "Drafted tokens verified.", c.drafted_total),
        ("tensorfold_draft_accepted_tokens_total", "Drafted tokens accepted.", c.accepted_total),
        ("tensorfold_draft_position_tokens_total", "Drafted tokens verified, by draft position (1: next token).",
         _by_position(c.drafted_by_position)),
        ("tensorfold_draft_position_accepted_tokens_total", "Drafted tokens accepted, by draft position.",
         _by_position(c.accepted_by_position)),
    ]
    gauges = [
        ("tensorfold_requests_running", "Requests in the engine's running set.", load.decoding + load.prefilling),
        ("tensorfold_requests_waiting", "Requests waiting for a lane or memory.", load.waiting),
        ("tensorfold_kv_cache_usage_ratio", "Share of the KV cache's blocks held by requests.", load.kv_used_ratio),
        ("tensorfold_draft_acceptance_ratio", "Accepted over drafted tokens so far.",
         c.accepted_total / c.drafted_total if c.drafted_total else 0.0),
    ]
    return metrics.exposition(counters, gauges, latencies.histograms())


def _by_position(counts: list[int]) -> list:
    return [(f'{{position="{i + 1}"}}', n) for i, n in enumerate(counts)]
