"""Prometheus metrics of the gateway. Index, event-stream and worker gauges are read at scrape
time by a collector, so the request path pays only for its own counters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.gateway.fleet import Fleet
from router.index import UnifiedIndex

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)
# a rough per-block cost of the index (bench/index_bench.py measures it)
INDEX_BYTES_PER_BLOCK = 100


class GatewayMetrics:
    def __init__(self, fleet: Fleet, index: UnifiedIndex, policy_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "urc_requests",
            "Requests by model, worker and status",
            ["model", "worker", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "urc_ttft_seconds",
            "Time to first byte from the worker, per model",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "urc_request_latency_seconds",
            "End-to-end latency, per model",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decision = Histogram(
            "urc_decision_seconds",
            "Tokenize + keys + match + policy",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "urc_prompt_tokens", "Prompt tokens routed", ["worker", "model"], registry=r
        )
        self.predicted_cached = Counter(
            "urc_predicted_cached_tokens",
            "Cached tokens the index predicted on the chosen worker",
            ["worker", "model"],
            registry=r,
        )
        self.actual_cached = Counter(
            "urc_actual_cached_tokens",
            "Cached tokens the worker reported (usage)",
            ["worker", "model"],
            registry=r,
        )
        self.prediction_error = Counter(
            "urc_prediction_abs_error_tokens",
            "|predicted - actual| cached tokens",
            ["worker", "model"],
            registry=r,
        )
        self.failovers = Counter(
            "urc_failovers",
            "Requests retried on another worker before the first byte",
            ["worker"],
            registry=r,
        )
        self.reasons = Counter(
            "urc_route_reasons", "Routing decisions by reason", ["policy", "reason"], registry=r
        )
        Gauge("urc_policy_info", "The live routing policy", ["policy"], registry=r).labels(
            policy_name
        ).set(1)
        r.register(_FleetCollector(fleet, index))
        self.policy_name = policy_name
        self._series: dict[tuple[str, str], Series] = {}
        self._reasons: dict[str, Any] = {}

    def series(self, model: str, worker: str) -> Series:
        """The labelled children of one (model, worker), bound once: `labels()` is not free."""
        series = self._series.get((model, worker))
        if series is None:
            series = self._series[(model, worker)] = Series(
                self.ttft.labels(model),
                self.latency.labels(model),
                self.requests.labels(model, worker, "200"),
                self.prompt_tokens.labels(worker, model),
                self.predicted_cached.labels(worker, model),
                self.actual_cached.labels(worker, model),
                self.prediction_error.labels(worker, model),
            )
        return series

    def reason(self, reason: str) -> Any:
        child = self._reasons.get(reason)
        if child is None:
            child = self._reasons[reason] = self.reasons.labels(self.policy_name, reason)
        return child


class Series(NamedTuple):
    ttft: Any
    latency: Any
    ok: Any
    prompt_tokens: Any
    predicted: Any
    actual: Any
    error: Any


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet, index: UnifiedIndex) -> None:
        self.fleet = fleet
        self.index = index

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.index.stats()
        yield GaugeMetricFamily("urc_index_blocks", "Blocks in the unified index", stats.blocks)
        yield GaugeMetricFamily("urc_index_runs", "Radix nodes (runs of blocks)", stats.runs)
        yield GaugeMetricFamily(
            "urc_index_residencies", "(block, worker) residencies", stats.residencies
        )
        yield GaugeMetricFamily(
            "urc_index_memory_bytes",
            "Estimated memory of the index",
            stats.blocks * INDEX_BYTES_PER_BLOCK,
        )
        yield CounterMetricFamily(
            "urc_index_evicted_blocks", "Blocks dropped by the memory budget", stats.evicted
        )
        healthy = GaugeMetricFamily(
            "urc_worker_healthy", "1 if the worker is up", labels=["worker"]
        )
        exact = GaugeMetricFamily(
            "urc_worker_exact", "1 if residency comes from KV events", labels=["worker"]
        )
        in_flight = GaugeMetricFamily(
            "urc_worker_in_flight", "Requests in flight", labels=["worker"]
        )
        queued = GaugeMetricFamily(
            "urc_worker_queued_prefill_tokens",
            "Uncached prompt tokens routed, not yet prefilled",
            labels=["worker"],
        )
        held = GaugeMetricFamily("urc_worker_cached_blocks", "Blocks held", labels=["worker"])
        lag = GaugeMetricFamily(
            "urc_kv_event_lag_seconds", "Now minus the newest event's timestamp", labels=["worker"]
        )
        gaps = CounterMetricFamily("urc_kv_event_gaps", "Sequence gaps seen", labels=["worker"])
        resets = CounterMetricFamily(
            "urc_kv_event_resyncs", "Resyncs (gaps not replayable, restarts)", labels=["worker"]
        )
        now = time.time()
        for w in self.fleet.workers.values():
            healthy.add_metric([w.name], float(w.up))
            exact.add_metric([w.name], float(w.exact))
            in_flight.add_metric([w.name], w.in_flight)
            queued.add_metric([w.name], w.queued_prefill_tokens)
            held.add_metric(
                [w.name], sum(self.index.blocks_held(w.name, g) for g in set(w.models.values()))
            )
            if w.mirror is not None:
                m = w.mirror.stats()
                if m.last_event_ts is not None:
                    lag.add_metric([w.name], max(0.0, now - m.last_event_ts))
                gaps.add_metric([w.name], m.gaps)
                resets.add_metric([w.name], m.resets + m.restarts)
        yield from (healthy, exact, in_flight, queued, held, lag, gaps, resets)
