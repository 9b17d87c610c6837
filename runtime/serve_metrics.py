"""`dejavu-serve`'s /metrics: counters, gauges and histograms in the Prometheus text format
(version 0.0.4), written by hand (no client library). Updated from the scheduler thread and
the server's event loop, so every update holds one lock."""
from __future__ import annotations

import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """Cumulative buckets, sum and count of observed values."""

    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.bounds, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


class ServeMetrics:
    """What /metrics shows; `queue_depth()` and `running()` are read when it is rendered."""

    def __init__(self, max_batch: int):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (endpoint, HTTP status) -> count
        self.finish: dict[str, int] = defaultdict(int)  # finish reason -> sequences
        self.prompt_total = self.cached_total = self.generation_total = self.steps = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(LATENCY_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS + (60.0, 120.0))
        self.batch_size = Histogram(sorted({1, 2, 4, 8, 16, 32, 64, 128, max_batch}))
        self.queue_depth = lambda: 0
        self.running = lambda: 0

    # scheduler thread
    def prompt_tokens(self, n: int) -> None:
        with self.lock:
            self.prompt_total += n

    def cached_tokens(self, n: int) -> None:
        with self.lock:
            self.cached_total += n

    def token(self, ttft: float | None, itl: float | None) -> None:
        with self.lock:
            self.generation_total += 1
            if ttft is not None:
                self.ttft.observe(ttft)
            if itl is not None:
                self.itl.observe(itl)

    def batch(self, n: int) -> None:
        with self.lock:
            self.steps += 1
            self.batch_size.observe(n)

    def finished(self, req, event) -> None:
        import time

        reason = "cancelled" if event is None else event[1] if event[0] == "done" else "error"
        with self.lock:
            self.finish[reason] += 1
            self.e2e.observe(time.perf_counter() - req.arrival)

    # event loop
    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def render(self) -> str:
        with self.lock:
            out = ["# HELP dejavu_requests_total HTTP requests by endpoint and status code.",
                   "# TYPE dejavu_requests_total counter"]
            out += [f'dejavu_requests_total{{endpoint="{e}",code="{c}"}} {n}'
                    for (e, c), n in sorted(self.requests.items())]
            out += ["# HELP dejavu_sequences_finished_total Sequences that left the batch, by finish reason.",
                    "# TYPE dejavu_sequences_finished_total counter"]
            out += [f'dejavu_sequences_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.finish.items())]
            for name, help_, v in (
                    ("dejavu_prompt_tokens_total", "Prompt tokens prefilled.", self.prompt_total),
                    ("dejavu_prefix_cache_hit_tokens_total", "Prompt tokens a row held already (not prefilled).",
                     self.cached_total),
                    ("dejavu_generation_tokens_total", "Tokens generated.", self.generation_total),
                    ("dejavu_decode_steps_total", "Batched decode steps run.", self.steps)):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {v}"]
            for name, help_, v in (
                    ("dejavu_queue_depth", "Requests waiting for a batch row.", self.queue_depth()),
                    ("dejavu_running_sequences", "Sequences holding a batch row.", self.running())):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {v}"]
            for name, help_, h in (
                    ("dejavu_batch_size", "Live sequences per decode step.", self.batch_size),
                    ("dejavu_time_to_first_token_seconds", "Arrival to first token.", self.ttft),
                    ("dejavu_time_per_output_token_seconds", "Time between a sequence's tokens.", self.itl),
                    ("dejavu_request_latency_seconds", "Arrival to last token, per sequence.", self.e2e)):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + h.lines(name)
        return "\n".join(out) + "\n"
