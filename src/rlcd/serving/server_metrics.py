"""The server's Prometheus metrics (`GET /metrics`), in one registry per app.

Why one registry per app and not prometheus_client's global one: several apps in one process (the tests, the
benchmark's fresh server per load) would otherwise register the same names twice and fail, or mix their counts.
What is measured (every name, its labels and meaning: docs/SERVING.md, "Metrics"):

* traffic: request latency per route and status class (`route` is the route's path, or `other` for a path no route
  has, so a scanner cannot grow the label set), /v1 requests in flight, the batcher's queue depth;
* the model thread: requests, questions and seconds per batched forward;
* the state cache, when the predictor has `state_cache_stats()` (a flat dict of numbers; read at each scrape);
* decision quality: per question type a histogram of the answers' confidence (choice and score `confidence`, noul
  `|noul - 0.5| * 2`, as the gates read it), one-option answers left out (they are fixed, not the model's); with a
  thresholds file, the gate decision each answer would get (`auto`, `escalate`, or `ungated` for a question no
  gate covers), whether or not the request asked for `x_gate`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from rlcd.schema import QUESTION_TYPES
from rlcd.serving.gating import Gates, answer_confidence

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONFIDENCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
OTHER_ROUTE = "other"
# state_cache_stats() keys that only grow (exported as counters); any other numeric key is a gauge
STATE_CACHE_COUNTERS = {"hits": "state-cache lookups that found the state",
                        "misses": "state-cache lookups that did not",
                        "evictions": "states dropped from the state cache"}
STATE_CACHE_GAUGES = {"entries": "states held in the state cache", "bytes": "bytes the state cache holds"}
_NAME = re.compile(r"[^a-zA-Z0-9_]")
log = logging.getLogger("rlcd.server")


def status_class(status: int) -> str:
    """200 -> "2xx": the label the latency histogram uses (one series per class, not per code)."""
    return f"{int(status) // 100}xx"


class StateCacheCollector:
    """Exports `predictor.state_cache_stats()` at each scrape; nothing when the predictor has no such method."""

    def __init__(self, predictor: Any):
        self.predictor = predictor

    def describe(self) -> list[Metric]:
        return []  # the names depend on what the predictor reports; do not call it at registration

    def collect(self) -> Iterator[Metric]:
        read = getattr(self.predictor, "state_cache_stats", None)
        if read is None:
            return
        try:
            stats = read()
        except Exception:  # noqa: BLE001 - a scrape must not fail on it
            log.exception("state_cache_stats() failed")
            return
        for key, value in sorted((stats or {}).items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = "rlcd_state_cache_" + _NAME.sub("_", str(key))
            if key in STATE_CACHE_COUNTERS:
                yield CounterMetricFamily(name, STATE_CACHE_COUNTERS[key], value=value)
            else:
                yield GaugeMetricFamily(name, STATE_CACHE_GAUGES.get(key, f"state_cache_stats()[{key!r}]"), value=value)


class ServerMetrics:
    """The metrics of one app. `watch` connects the live gauges (queue, in flight, readiness) once those exist."""

    def __init__(self, gates: Gates | None = None):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.gates = gates
        self.latency = Histogram("rlcd_http_request_duration_seconds", "time from a request's arrival to its response",
                                 ("route", "status_class"), buckets=LATENCY_BUCKETS, registry=r)
        self.batch_requests = Histogram("rlcd_batch_requests", "requests scored by one batched forward",
                                        buckets=BATCH_BUCKETS, registry=r)
        self.batch_questions = Histogram("rlcd_batch_questions", "questions scored by one batched forward",
                                         buckets=BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram("rlcd_batch_duration_seconds", "time of one batched forward (the model thread)",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.confidence = Histogram("rlcd_answer_confidence", "confidence of the model's answers, per question type",
                                    ("type",), buckets=CONFIDENCE_BUCKETS, registry=r)
        for t in QUESTION_TYPES:
            self.confidence.labels(t)  # every type present from the start, at 0
        self.gate_decisions = None
        if gates is not None:
            self.gate_decisions = Counter("rlcd_gate_decisions", "gate decisions the answers get from thresholds.json",
                                          ("type", "decision"), registry=r)
            for t in QUESTION_TYPES:
                for d in ("auto", "escalate"):
                    self.gate_decisions.labels(t, d)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...

    def watch(self, *, queue_depth: Callable[[], int], in_flight: Callable[[], int], ready: Callable[[], bool],
              predictor: Any) -> None:
        """Gauges read at scrape time, and the state cache of `predictor`."""
        r = self.registry
        Gauge("rlcd_queue_depth", "requests waiting for the model thread", registry=r).set_function(queue_depth)
        Gauge("rlcd_http_requests_in_flight", "/v1 requests admitted and not yet answered",
              registry=r).set_function(in_flight)
        Gauge("rlcd_ready", "1 when /ready answers 200, else 0", registry=r).set_function(lambda: float(ready()))
        r.register(StateCacheCollector(predictor))

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.latency.labels(route, status_class(status)).observe(seconds)

    def observe_batch(self, requests: int, questions: int, tokens: int, seconds: float) -> None:
        """The batcher's observer (called on the model thread after each forward)."""
        self.batch_requests.observe(requests)
        self.batch_questions.observe(questions)
        self.batch_seconds.observe(seconds)

    def observe_answers(self, qids: list[str], questions: list[Any], response: dict[str, Any]) -> None:
        """Confidence and gate decision of each answer the model gave (one-option answers are fixed: left out)."""
        for qid, q in zip(qids, questions):
            if q.k == 1:
                continue
            c = answer_confidence(response["answers"][qid])
            if c is None:
                continue
            self.confidence.labels(q.type).observe(c)
            if self.gate_decisions is not None:
                self.gate_decisions.labels(q.type, self.gates.decide(q, c) or "ungated").inc()

    def render(self) -> tuple[bytes, str]:
        """(the text exposition, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["ServerMetrics", "StateCacheCollector", "status_class", "OTHER_ROUTE"]
