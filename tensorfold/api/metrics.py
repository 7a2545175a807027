"""GET /metrics: the server's counters, gauges and latency histograms in the Prometheus text
format (version 0.0.4), under the tensorfold_ namespace.

Counters mirror /health's totals (`_total`, seconds in the name where they are times); gauges
say what runs now (requests running and waiting, the KV cache's used share, the draft acceptance
so far); histograms observe each finished request's time to first token, end-to-end latency
and queue wait (arrival to its first round), and each delivered token's share of the time since
the request's previous delivery (inter-token latency).
"""
import bisect
import time

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Cumulative-bucket histogram: counts of observations <= each upper bound, sum and count."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        out += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {self.count}"]
        return out


class Latencies:
    """The request latency histograms the service feeds."""

    def __init__(self):
        self.ttft = Histogram("tensorfold_time_to_first_token_seconds",
                              "Time from a request's arrival to its first reply token.", LATENCY_BUCKETS)
        self.itl = Histogram("tensorfold_inter_token_latency_seconds",
                             "Time between reply tokens as they are delivered.", TOKEN_BUCKETS)
        self.e2e = Histogram("tensorfold_e2e_request_latency_seconds",
                             "Time from a request's arrival to its last reply token.", LATENCY_BUCKETS)
        self.queue = Histogram("tensorfold_queue_wait_seconds",
                               "Time a request waited before its first engine round.", LATENCY_BUCKETS)
        self._last: dict[str, float] = {}  # request -> when its tokens were last delivered

    def delivered(self, req_id: str, num_tokens: int, first_token_s: float | None) -> None:
        now = time.perf_counter()
        last = self._last.get(req_id, first_token_s)
        if num_tokens and last is not None and req_id in self._last:
            self.itl.observe((now - last) / num_tokens, num_tokens)
        if num_tokens:
            self._last[req_id] = now

    def forget(self, req_id: str) -> None:
        """A request that ends without a finished reply (cancelled, failed)."""
        self._last.pop(req_id, None)

    def finished(self, req) -> None:
        s = req.stats
        now = time.perf_counter()
        self._last.pop(req.req_id, None)
        if s.first_token_s is not None:
            self.ttft.observe(s.first_token_s - s.arrival_s)
        self.e2e.observe(now - s.arrival_s)
        if s.scheduled_s is not None:
            self.queue.observe(s.scheduled_s - s.arrival_s)

    def histograms(self) -> list[Histogram]:
        return [self.ttft, self.itl, self.e2e, self.queue]


def exposition(counters: list[tuple[str, str, float | list]], gauges: list[tuple[str, str, float]],
               histograms: list[Histogram]) -> str:
    """The text format: HELP and TYPE lines, then the samples, one family after another."""
    lines = []
    for kind, families in (("counter", counters), ("gauge", gauges)):
        for name, help_text, value in families:
            # A value, or a list of (labels, value) samples: '{position="1"}', 3
            samples = value if isinstance(value, list) else [("", value)]
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{labels} {float(v)!r}" for labels, v in samples]
    for h in histograms:
        lines += h.lines()
    return "\n".join(lines) + "\n"
