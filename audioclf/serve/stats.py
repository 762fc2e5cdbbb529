"""What `GET /metrics` reports, in the Prometheus text format (version 0.0.4, written by
prometheus_client from the server's own registry, not the process-wide one): counters, gauges
and summaries whose quantiles are taken over a window of the most recent observations, so that
memory stays bounded however long the server runs.

    stats = Stats()
    stats.count("audioclf_requests_total", {"path": "/embed", "code": "200"})
    stats.observe("audioclf_request_seconds", 0.012, {"path": "/embed"})
    text = stats.render()
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

QUANTILES = (0.5, 0.95, 0.99)
WINDOW = 4096  # observations a summary's quantiles are taken over (per series)

# name -> (type, help); render() lists them in this order.
METRICS = {
    "audioclf_requests_total": ("counter", "HTTP requests answered, by path and status code"),
    "audioclf_request_seconds": ("summary", "time from a request's arrival to its answer"),
    "audioclf_clips_total": ("counter", "clips embedded"),
    "audioclf_rejected_requests_total": ("counter", "requests refused at once: the queue was full"),
    "audioclf_queue_clips": ("gauge", "clips admitted and not yet embedded"),
    "audioclf_queue_seconds": ("summary", "time a clip waited to join a model batch"),
    "audioclf_batch_size": ("summary", "clips per model batch"),
    "audioclf_batch_seconds": ("summary", "time of one model batch"),
}

Labels = dict[str, str]


class _Summary:
    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.total = 0.0
        self.count = 0

    def add(self, value: float) -> None:
        self.recent.append(value)
        self.total += value
        self.count += 1


class Stats:
    """Thread-safe metrics of one server; every name is one of METRICS."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple], float] = {}
        self._summaries: dict[tuple[str, tuple], _Summary] = {}

    def count(self, name: str, labels: Labels | None = None, by: float = 1) -> None:
        key = self._key(name, labels, "counter")
        with self._lock:
            self._values[key] = self._values.get(key, 0) + by

    def set(self, name: str, value: float, labels: Labels | None = None) -> None:
        key = self._key(name, labels, "gauge")
        with self._lock:
            self._values[key] = value

    def observe(self, name: str, value: float, labels: Labels | None = None) -> None:
        key = self._key(name, labels, "summary")
        with self._lock:
            self._summaries.setdefault(key, _Summary()).add(float(value))

    def value(self, name: str, labels: Labels | None = None) -> float:
        """A counter's or gauge's current value (0 when never set)."""
        return self._values.get((name, tuple(sorted((labels or {}).items()))), 0)

    def total(self, name: str) -> float:
        """A counter's sum over all its labels."""
        with self._lock:
            return sum(v for (n, _), v in self._values.items() if n == name)

    @staticmethod
    def _key(name: str, labels: Labels | None, kind: str) -> tuple[str, tuple]:
        if METRICS.get(name, ("",))[0] != kind:
            raise ValueError(f"{name} is not a {kind} of audioclf.serve.stats.METRICS")
        return name, tuple(sorted((labels or {}).items()))

    def render(self) -> str:
        """Every metric with its HELP and TYPE lines, then its series (prometheus_client's
        text format, from this server's own registry)."""
        from prometheus_client import CollectorRegistry, generate_latest  # noqa: PLC0415

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(self))
        return generate_latest(registry).decode()

    def snapshot(self) -> tuple[dict, dict]:
        """(counter and gauge values, summaries as (recent values, sum, count)), copied."""
        with self._lock:
            values = dict(self._values)
            summaries = {
                key: (np.array(s.recent), s.total, s.count) for key, s in self._summaries.items()
            }
        return values, summaries


class _Snapshot:
    """A prometheus_client collector over one Stats: the METRICS in their order, each series
    as recorded, a summary's quantiles over its recent window."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def collect(self):
        from prometheus_client.metrics_core import Metric  # noqa: PLC0415

        values, summaries = self.stats.snapshot()
        for name, (kind, about) in METRICS.items():
            metric = Metric(name.removesuffix("_total"), about, kind)
            if kind != "summary":
                series = [(dict(k[1]), v) for k, v in values.items() if k[0] == name]
                for labels, value in series or [({}, 0)]:
                    metric.add_sample(name, labels, value)
            else:
                _add_summaries(metric, name, {k: v for k, v in summaries.items() if k[0] == name})
            yield metric


def _add_summaries(metric, name: str, series: dict) -> None:
    if not series:  # no observation yet: count and sum are 0 (no quantiles)
        metric.add_sample(name + "_sum", {}, 0)
        metric.add_sample(name + "_count", {}, 0)
    for key, (recent, total, count) in series.items():
        labels = dict(key[1])
        for q in QUANTILES:
            metric.add_sample(name, {**labels, "quantile": str(q)}, float(np.quantile(recent, q)))
        metric.add_sample(name + "_sum", labels, total)
        metric.add_sample(name + "_count", labels, count)
