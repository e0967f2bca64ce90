"""Prometheus metrics in the text exposition format, without a client library: a handful of
counters and histograms are a dict and a few lines of formatting.

Exposed at `/metrics`: requests by endpoint and status, errors by type, prompt/completion
tokens, end-to-end latency and time to first token (histograms), requests in flight, and the
engine's decoding counters (forward passes, jump-forward forced tokens, drafted and accepted
speculative tokens) summed over finished requests, and the engine's running/waiting requests.

Label values come from a fixed set (`endpoint_label` maps every unknown path to "unknown") and
are escaped, so no request can add series or break the exposition format.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

# request path -> the `endpoint` label; every other path is "unknown"
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/models": "models",
    "/health": "health",
    "/metrics": "metrics",
    "/docs": "docs",
    "/openapi.json": "openapi",
}


def endpoint_label(path: str) -> str:
    if path.startswith("/v1/models/"):
        return "models"
    return ENDPOINTS.get(path, "unknown")


def escape_label(value: str) -> str:
    """A label value as the text exposition format requires: backslash, quote, newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# counters summed from each finished request's GenerationStats
STATS_COUNTERS = {
    "prompt_tokens": "Prompt tokens processed.",
    "output_tokens": "Completion tokens generated.",
    "forward_passes": "Model forward passes requests took part in.",
    "forced_tokens": "Tokens appended by grammar jump-forward without sampling.",
    "drafted_tokens": "Speculative tokens proposed by a drafter.",
    "accepted_tokens": "Speculative tokens accepted by the target model.",
    "cached_prompt_tokens": "Prompt tokens whose KV came from the prefix cache instead of a prefill.",
    "preemptions": "Times a request's KV pages were taken back and its tokens recomputed later.",
}


def engine_load(llm: Any) -> dict[str, int]:
    """Requests the engine holds right now (running ones own a KV slot); read without a lock,
    so a snapshot that may be one step old."""
    scheduler = getattr(getattr(llm, "engine", None), "scheduler", None)
    if scheduler is None:
        return {}
    return {"running": len(scheduler.running), "waiting": len(scheduler.waiting)}


class Histogram:
    """Cumulative-bucket histogram, as Prometheus expects."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.total}')
        suffix = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{suffix} {self.sum:.6f}", f"{name}_count{suffix} {self.total}"]
        return out


class Metrics:
    """All server metrics; thread-safe because the engine may report from its own thread."""

    def __init__(self, model: str):
        self.model = model
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.stats: dict[str, int] = defaultdict(int)
        self.latency: dict[str, Histogram] = defaultdict(Histogram)
        self.ttft = Histogram()
        self.first_text = Histogram()
        self.planned = Histogram()
        self.in_flight = 0

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, endpoint: str, status: int, latency_s: float, error_type: str | None = None) -> None:
        with self._lock:
            self.in_flight -= 1
            self.requests[(endpoint, status)] += 1
            self.latency[endpoint].observe(latency_s)
            if error_type:
                self.errors[error_type] += 1

    def rejected(self, endpoint: str, status: int, error_type: str) -> None:
        """A request refused before it started (validation, unknown model)."""
        with self._lock:
            self.requests[(endpoint, status)] += 1
            self.errors[error_type] += 1

    def record_generation(self, prompt_tokens: int, output_tokens: int, stats: Any = None) -> None:
        """Add one finished generation: its token counts, and the engine counters of its
        GenerationStats when it has them (a truncated request may not)."""
        with self._lock:
            self.stats["prompt_tokens"] += prompt_tokens
            self.stats["output_tokens"] += output_tokens
            if stats is None:
                return
            for key in STATS_COUNTERS:
                if key not in ("prompt_tokens", "output_tokens"):
                    self.stats[key] += int(getattr(stats, key, 0) or 0)
            ttft = getattr(stats, "ttft_s", 0.0)
            if ttft:
                self.ttft.observe(ttft)

    def request_planned(self, seconds: float) -> None:
        """A request's jobs planned, `seconds` after its handler started: its output type
        compiled and its prompts tokenized (the compile and tokenizer queues); what is left of
        `first_text_sent` is the engine's (batch slots, prefill, first step)."""
        with self._lock:
            self.planned.observe(seconds)

    def first_text_sent(self, seconds: float) -> None:
        """A streamed request's first text, `seconds` after its handler started: what a client
        waits for, the compile, tokenizing and batch-slot queues included (the engine's
        `ttft` starts after them)."""
        with self._lock:
            self.first_text.observe(seconds)

    def render(self, engine: dict[str, int] | None = None) -> str:
        """The Prometheus text exposition of every metric; `engine` adds gauges of the
        engine's current load (running / waiting requests)."""
        m = f'model="{escape_label(self.model)}"'
        lines: list[str] = []
        with self._lock:
            lines += ["# HELP structgen_requests_total HTTP requests by endpoint and status.",
                      "# TYPE structgen_requests_total counter"]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'structgen_requests_total{{{m},endpoint="{escape_label(endpoint)}",status="{status}"}} {n}')
            lines += ["# HELP structgen_errors_total Failed requests by error type.",
                      "# TYPE structgen_errors_total counter"]
            for etype, n in sorted(self.errors.items()):
                lines.append(f'structgen_errors_total{{{m},type="{escape_label(etype)}"}} {n}')
            for key, help_text in STATS_COUNTERS.items():
                name = f"structgen_{key}_total"
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter",
                          f"{name}{{{m}}} {self.stats.get(key, 0)}"]
            lines += ["# HELP structgen_requests_in_flight Requests being processed.",
                      "# TYPE structgen_requests_in_flight gauge",
                      f"structgen_requests_in_flight{{{m}}} {self.in_flight}"]
            for key, n in (engine or {}).items():
                name = f"structgen_engine_{key}_requests"
                lines += [f"# HELP {name} Requests {key} in the engine.", f"# TYPE {name} gauge",
                          f"{name}{{{m}}} {n}"]
            lines += ["# HELP structgen_request_latency_seconds End-to-end request latency.",
                      "# TYPE structgen_request_latency_seconds histogram"]
            for endpoint, hist in sorted(self.latency.items()):
                lines += hist.lines("structgen_request_latency_seconds", f'{m},endpoint="{escape_label(endpoint)}"')
            lines += ["# HELP structgen_time_to_first_token_seconds Engine arrival (prompt tokenized, grammar compiled) to first output token.",
                      "# TYPE structgen_time_to_first_token_seconds histogram"]
            lines += self.ttft.lines("structgen_time_to_first_token_seconds", m)
            lines += ["# HELP structgen_stream_first_text_seconds Streamed requests: handler start to the first "
                      "text sent (compile, tokenizing and batch-slot queues included).",
                      "# TYPE structgen_stream_first_text_seconds histogram"]
            lines += self.first_text.lines("structgen_stream_first_text_seconds", m)
            lines += ["# HELP structgen_request_plan_seconds Handler start to the request planned: output type "
                      "compiled and prompts tokenized (compile and tokenizer queues included).",
                      "# TYPE structgen_request_plan_seconds histogram"]
            lines += self.planned.lines("structgen_request_plan_seconds", m)
        return "\n".join(lines) + "\n"
